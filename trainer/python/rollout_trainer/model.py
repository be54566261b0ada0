"""A dense Qwen3 forward built from the server's CPU kernels: logprobs bit for bit equal to
what the CPU server's Generate streamed and Score returns, differentiable in plain torch."""

from __future__ import annotations

import glob
import json
import math
import os
import struct
from typing import Dict, Optional, Sequence

import numpy as np
import torch

from . import ops
from .contract import ARCHITECTURES, ContractError, check_contract

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _read_safetensors(path: str, select=None) -> Dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in `path`, as float32 (exact widening).
    select(name, shape): the index (a tuple of slices) of the part of that tensor to read, None
    for all of it (a tensor-parallel rank reads its shards only: the files are memory-mapped)."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file")
    out = {}
    for file in files:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        data = np.memmap(file, dtype=np.uint8, mode="r")
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            raw = data[base + b:base + e]
            dt = info["dtype"]
            if dt not in ("F32", "BF16", "F16"):
                raise ValueError(f"{file}: tensor {name} has dtype {dt} (F32, BF16, F16 read)")
            stored = raw.view({"F32": np.float32, "BF16": np.uint16, "F16": np.float16}[dt])
            stored = stored.reshape(info["shape"])
            index = select(name, tuple(info["shape"])) if select is not None else None
            if index is not None:
                stored = stored[index]
            if dt == "BF16":
                arr = (stored.astype(np.uint32) << 16).view(np.float32)
            else:
                arr = stored.astype(np.float32)
            out[name] = torch.from_numpy(np.ascontiguousarray(arr))
        del data
    return out


class Qwen3Model(torch.nn.Module):
    """Dense Qwen3 (Qwen3ForCausalLM) with the parameters' Hugging Face names (dots as '__'
    in nn.Module attribute names aside: state_dict() keys are the checkpoint's)."""

    architectures = ARCHITECTURES  # config.json's architectures[0] this class computes

    def __init__(self, config: dict, tensors: Dict[str, torch.Tensor]):
        super().__init__()
        arch = (config.get("architectures") or [""])[0]
        if arch not in self.architectures:
            raise ContractError("architecture", arch, self.architectures)
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type != "default":
            raise ContractError("rope_type", rope_type, "default")
        self.config = config
        self.hidden = int(config["hidden_size"])
        self.num_layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads", self.heads))
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.vocab = int(config["vocab_size"])
        # The server holds both as float32 (ModelConfig): round them as it does.
        self.eps = float(np.float32(config.get("rms_norm_eps", 1e-6)))
        self.theta = float(np.float32(config.get("rope_theta", 10000.0)))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.served_dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if self.served_dtype not in _TORCH_DTYPES:
            raise ContractError("served_dtype", self.served_dtype, tuple(_TORCH_DTYPES))
        self.params = torch.nn.ParameterDict()
        self._names = {}
        for name, t in tensors.items():
            if self.tied and name == "lm_head.weight":
                continue
            key = name.replace(".", "__")
            self._names[name] = key
            self.params[key] = torch.nn.Parameter(self._as_served(t))

    def _as_served(self, t: torch.Tensor) -> torch.Tensor:
        # Weights serve as their cast to the served dtype (round to nearest even), like the
        # server's load; values in float32 for the kernels.
        return t.to(_TORCH_DTYPES[self.served_dtype]).to(torch.float32)

    @classmethod
    def from_pretrained(cls, path: str, contract=None) -> "Qwen3Model":
        """Loads config.json and the safetensors of `path`; with `contract` (ServerInfo.numerics)
        refuses, naming the field, one this library cannot honour. Sharded over a
        torch.distributed group: TpQwen3Model.from_pretrained(path, contract, tp_group)."""
        if contract is not None:
            check_contract(contract)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        model = cls(config, _read_safetensors(path))
        model._check_against(contract, config)
        return model

    def _check_against(self, contract, config: dict) -> None:
        """ContractError when `contract` names another architecture or served dtype."""
        if contract is not None:
            arch = (config.get("architectures") or [""])[0]
            for field, mine in (("architecture", arch), ("served_dtype", self.served_dtype)):
                theirs = getattr(contract, field, None) if not isinstance(contract, dict) \
                    else contract.get(field)
                if theirs != mine:
                    raise ContractError(field, theirs, mine)

    def named_weights(self):
        """(Hugging Face name, parameter) pairs: what RolloutClient.update_weights takes."""
        for name, key in self._names.items():
            yield name, self.params[key]

    def weight(self, name: str) -> torch.Tensor:
        return self.params[self._names[name]]

    def load_weights(self, named_tensors) -> None:
        """Replaces weights in place (cast to the served dtype), e.g. after an update."""
        with torch.no_grad():
            for name, t in named_tensors:
                if self.tied and name == "lm_head.weight":
                    continue
                self.weight(name).copy_(self._as_served(t.detach().cpu().float()))

    # --- forward ---

    def _layer_weights(self, i: int, dtype=None):
        w = lambda s: self.weight(f"model.layers.{i}.{s}")
        return {k: w(s) for k, s in (
            ("in", "input_layernorm.weight"), ("q", "self_attn.q_proj.weight"),
            ("k", "self_attn.k_proj.weight"), ("v", "self_attn.v_proj.weight"),
            ("o", "self_attn.o_proj.weight"), ("qn", "self_attn.q_norm.weight"),
            ("kn", "self_attn.k_norm.weight"), ("post", "post_attention_layernorm.weight"),
            *self._mlp_weight_names(i))}

    def _mlp_weight_names(self, i: int):
        """(key, name under model.layers.i) of layer i's MLP weights (Qwen3MoeModel's differ)."""
        return (("gate", "mlp.gate_proj.weight"), ("up", "mlp.up_proj.weight"),
                ("down", "mlp.down_proj.weight"))

    def _mlp(self, i: int, xn, w, ref: bool, mlp_context=None):
        """Layer i's MLP of its normed input xn [t, hidden]; w: _layer_weights(i), cast; ref: the
        plain-torch reference instead of the kernels. mlp_context: a subclass's per-call state."""
        gate_up = torch.cat([w["gate"], w["up"]], dim=0)
        if ref:
            return ops.reference_matmul(ops.reference_silu_mul(ops.reference_matmul(xn, gate_up)),
                                        w["down"])
        return ops.row_parallel_matmul(ops.silu_mul(ops.matmul(xn, gate_up)), w["down"])

    def hidden_states(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor,
                      reference_dtype: Optional[torch.dtype] = None,
                      mlp_context=None) -> torch.Tensor:
        """The final-normed hidden states [t, hidden] of packed sequences. reference_dtype: run
        the plain-torch reference in that dtype instead of the kernels (the gradient check's
        float64 forward). mlp_context: passed to _mlp (Qwen3MoeModel's routing)."""
        ref = reference_dtype is not None
        cast = (lambda p: p.to(reference_dtype)) if ref else (lambda p: p)
        matmul = ops.reference_matmul if ref else ops.matmul
        row_matmul = ops.reference_matmul if ref else ops.row_parallel_matmul
        norm = ops.reference_rms_norm if ref else ops.rms_norm
        rope = ops.reference_rope if ref else ops.rope
        add = ops.reference_add if ref else ops.add
        attention = ops.reference_attention if ref else ops.attention

        t = tokens.numel()
        positions, _ = ops.packed_positions(cu_seqlens)
        cos, sin = ops.rope_cos_sin(positions, self.head_dim, self.theta)
        if ref:
            cos, sin = cos.to(reference_dtype), sin.to(reference_dtype)
        embed = cast(self.weight("model.embed_tokens.weight"))
        x = embed[tokens.long()]
        hd, nh, nkv = self.head_dim, self.heads, self.kv_heads
        scale = float(np.float32(1.0) / np.sqrt(np.float32(hd)))
        for i in range(self.num_layers):
            w = {k: cast(v) for k, v in self._layer_weights(i).items()}
            xn = norm(x, w["in"], self.eps)
            q = matmul(xn, w["q"]).reshape(t, nh, hd)
            k = matmul(xn, w["k"]).reshape(t, nkv, hd)
            v = matmul(xn, w["v"]).reshape(t, nkv, hd)
            q = rope(norm(q, w["qn"], self.eps), cos, sin)
            k = rope(norm(k, w["kn"], self.eps), cos, sin)
            a = attention(q, k, v, cu_seqlens, scale).reshape(t, nh * hd)
            x = add(x, row_matmul(a, w["o"]))
            xn = norm(x, w["post"], self.eps)
            x = add(x, self._mlp(i, xn, w, ref, mlp_context))
        return norm(x, cast(self.weight("model.norm.weight")), self.eps)

    def logits(self, tokens, cu_seqlens, reference_dtype=None, mlp_context=None):
        h = self.hidden_states(tokens, cu_seqlens, reference_dtype, mlp_context)
        head = self.weight("model.embed_tokens.weight" if self.tied else "lm_head.weight")
        if reference_dtype is not None:
            return ops.reference_matmul(h, head.to(reference_dtype))
        return ops.matmul(h, head)

    def logprobs(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0,
                 reference_dtype: Optional[torch.dtype] = None, mlp_context=None) -> torch.Tensor:
        """log_softmax(logits / T) of each token given the tokens before it in its sequence:
        [t] float32, in packed order, 0 at each sequence's first token (nothing precedes it).
        Entry i equals, bitwise, Score's logprob of token i (and Generate's, for a token it
        sampled) at temperature T (T = 0 scores as T = 1, as the server does).
        tokens [t] int, cu_seqlens [b + 1] int from 0 (packed variable-length sequences)."""
        tokens = torch.as_tensor(tokens).reshape(-1).long()
        cu_seqlens = torch.as_tensor(cu_seqlens).reshape(-1).long()
        t = tokens.numel()
        if cu_seqlens.numel() < 2 or int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != t or \
                bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
            raise ValueError("cu_seqlens must rise strictly from 0 to len(tokens)")
        if bool(((tokens < 0) | (tokens >= self.vocab)).any()):
            raise ValueError(f"token ids must be in [0, {self.vocab})")
        temperature = float(np.float32(temperature))  # the proto's float
        logits = self.logits(tokens, cu_seqlens, reference_dtype, mlp_context)
        if reference_dtype is not None:
            lp = ops.reference_log_softmax(logits, temperature)
        else:
            lp = ops.log_softmax(logits, temperature)
        # Row i - 1 predicts token i; the first token of each sequence has no row.
        first = torch.zeros(t, dtype=torch.bool)
        first[cu_seqlens[:-1]] = True
        prev = torch.clamp(torch.arange(t) - 1, min=0)
        picked = lp[prev, tokens]
        return torch.where(first, torch.zeros((), dtype=lp.dtype), picked)
