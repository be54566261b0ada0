"""The numerics contract (ServerInfo.numerics): what this library can honour, and the check."""

from __future__ import annotations

from typing import Any

from . import _lib

ARCHITECTURES = ("Qwen3ForCausalLM",)  # dense: Qwen3Model, and CudaQwen3Model on cuda
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)  # Qwen3MoeModel, and CudaQwen3MoeModel on cuda
SERVED_DTYPES = ("bfloat16", "float16", "float32")
TENSOR_PARALLEL = (1, 2, 4, 8)  # the server's bits are the same at every degree (D10)
# The trainer's own degree (rollout_trainer.tp), independent of the server's: each rank owns
# a node of the canonical 8-leaf K tree, so it must divide the 8 leaves (and the model).
TRAINER_TENSOR_PARALLEL = (1, 2, 4, 8)


class ContractError(RuntimeError):
    """The server's numerics contract asks for something this library cannot compute.
    `field` names the contract's field, `got` its value, `supported` what would be honoured."""

    def __init__(self, field: str, got: Any, supported: Any):
        self.field, self.got, self.supported = field, got, supported
        super().__init__(f"numerics contract field '{field}' is {got!r}; this library reproduces "
                         f"the server's bits only for {supported!r}")


def _get(contract, field):
    if isinstance(contract, dict):
        return contract.get(field)
    return getattr(contract, field, None)


def check_contract(contract, device: str = "cpu") -> None:
    """Raises ContractError naming the first field of `contract` (a rollout_client
    NumericsContract, its protobuf message, or a dict of its fields, e.g. `rollout-cli --json
    info`'s "numerics") that this library cannot honour on `device` ("cpu": the CPU kernels;
    "cuda": the CUDA kernels on the current GPU); returns None when every bit of the server's
    logprobs can be reproduced here. On cuda the pinned GEMMs are compared when they are made
    (CudaQwen3Model: gemm_algorithms)."""
    if contract is None:
        raise ContractError("numerics", None, "a server that reports ServerInfo.numerics")
    if device == "cuda":
        _check_cuda(contract)
        return
    want = {
        "backend": ("cpu",),
        "compute_dtype": ("float32",),
        "row_parallel_reduction": ("canonical_k_tree_8",),
        "kernels": (_lib.kernels_version(),),
        "architecture": ARCHITECTURES + MOE_ARCHITECTURES,
        "rope_type": ("default",),
        "served_dtype": SERVED_DTYPES,
        "tensor_parallel": TENSOR_PARALLEL,
    }
    for field, supported in want.items():
        got = _get(contract, field)
        if got not in supported:
            raise ContractError(field, got, supported[0] if len(supported) == 1 else supported)


CUDA_COMPUTE_DTYPE = "bfloat16+float32"  # bf16 storage and GEMM inputs, fp32 accumulation


def _check_cuda(contract) -> None:
    from . import cuda_ops  # loads the CUDA library (and needs a GPU) only here
    facts = cuda_ops.device_facts()
    reduction = _get(contract, "row_parallel_reduction")
    # A cuda server refuses Qwen3-MoE at TP > 1 (runner/cuda/setup.cc, CheckMoeSupported): a
    # MoE contract at another degree is not one a cuda server made.
    moe = _get(contract, "architecture") in MOE_ARCHITECTURES
    want = {
        "backend": ("cuda",),
        "compute_dtype": (CUDA_COMPUTE_DTYPE,),
        "row_parallel_reduction": ("canonical_k_tree_8", "fused"),
        "kernels": (facts["kernels"],),
        "architecture": ARCHITECTURES + MOE_ARCHITECTURES,
        "rope_type": ("default",),
        # The runner holds every weight in bf16 whatever the checkpoint: bf16 checkpoints only.
        "served_dtype": ("bfloat16",),
        # The canonical tree gives TP 1's bits at every degree (D10); fused is TP 1 only.
        "tensor_parallel":
            TENSOR_PARALLEL if reduction == "canonical_k_tree_8" and not moe else (1,),
        "gpu_model": (facts["gpu_model"],),
        "compute_capability": (facts["compute_capability"],),
        "cuda_runtime": (facts["cuda_runtime"],),
        "cublaslt_version": (facts["cublaslt_version"],),
        "attention_tile": (facts["attention_tile"],),
        "attention_kernel": ("tensor_core", "simt"),
    }
    for field, supported in want.items():
        got = _get(contract, field)
        if field in ("tensor_parallel", "attention_tile") and got is not None:
            got = int(got)
        if got not in supported:
            if field == "tensor_parallel" and moe:
                raise ContractError(field, got, "1 (a cuda server serves Qwen3MoeForCausalLM at "
                                    "TP 1 only: it refuses mixture-of-experts models at --tp > 1)")
            raise ContractError(field, got, supported[0] if len(supported) == 1 else supported)
    split = int(_get(contract, "attention_split_size") or 0)
    if split <= 0 or split % 32 != 0:
        raise ContractError("attention_split_size", split, "a positive multiple of 32")
    # int64 fields come as strings in protobuf's JSON.
    if int(_get(contract, "gemm_pin_m") or 0) <= 0:
        raise ContractError("gemm_pin_m", _get(contract, "gemm_pin_m"),
                            "a pinned algorithm per weight shape (gemm_pin_m > 0)")


def check_trainer_tensor_parallel(config: dict, tp: int) -> None:
    """Raises ValueError naming the degree (and the dimension) when a trainer cannot shard the
    model of `config` (config.json) `tp` ways with TP 1's bits; the server's check
    (model/tensor_parallel.cc CheckTensorParallel) in Python."""
    if tp not in TRAINER_TENSOR_PARALLEL:
        raise ValueError(f"trainer tensor-parallel degree {tp}: must be 1, 2, 4 or 8 (each rank "
                         "owns a node of the canonical 8-leaf K tree of the row-parallel layers)")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    inter = int(config["intermediate_size"])
    if heads % tp != 0:
        raise ValueError(f"trainer tensor-parallel degree {tp}: the model's {heads} attention "
                         f"heads do not split evenly over {tp} ranks")
    if kv_heads % tp != 0 and tp % kv_heads != 0:
        raise ValueError(f"trainer tensor-parallel degree {tp}: the model's {kv_heads} KV heads "
                         f"neither split evenly over {tp} ranks nor replicate evenly across them")
    if inter % tp != 0:
        raise ValueError(f"trainer tensor-parallel degree {tp}: the model's intermediate size "
                         f"{inter} does not split evenly over {tp} ranks")
