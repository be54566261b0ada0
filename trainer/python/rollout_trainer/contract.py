"""The numerics contract (ServerInfo.numerics): what this library can honour, and the check."""

from __future__ import annotations

from typing import Any

from . import _lib

ARCHITECTURES = ("Qwen3ForCausalLM",)
SERVED_DTYPES = ("bfloat16", "float16", "float32")
TENSOR_PARALLEL = (1, 2, 4, 8)  # the server's bits are the same at every degree (D10)


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


def check_contract(contract) -> None:
    """Raises ContractError naming the first field of `contract` (a rollout_client
    NumericsContract, its protobuf message, or a dict of its fields) that this library cannot
    honour; returns None when every bit of the server's logprobs can be reproduced here."""
    if contract is None:
        raise ContractError("numerics", None, "a server that reports ServerInfo.numerics")
    want = {
        "backend": ("cpu",),
        "compute_dtype": ("float32",),
        "row_parallel_reduction": ("canonical_k_tree_8",),
        "kernels": (_lib.kernels_version(),),
        "architecture": ARCHITECTURES,
        "rope_type": ("default",),
        "served_dtype": SERVED_DTYPES,
        "tensor_parallel": TENSOR_PARALLEL,
    }
    for field, supported in want.items():
        got = _get(contract, field)
        if got not in supported:
            raise ContractError(field, got, supported[0] if len(supported) == 1 else supported)
