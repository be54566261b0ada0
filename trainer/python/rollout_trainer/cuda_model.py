"""A dense Qwen3 forward on the GPU built from the server's CUDA kernels: logprobs bit for bit
equal to what a cuda server's Generate streamed and Score returns (at TP 1's bits: every degree
of the canonical tree has them), differentiable in plain torch (docs/trainer.md, "CUDA")."""

from __future__ import annotations

import json
import os
from typing import Dict, Optional

import numpy as np
import torch

from . import cuda_ops as ops
from .contract import ARCHITECTURES, ContractError, _get, check_contract
from .model import _read_safetensors


class CudaQwen3Model(torch.nn.Module):
    """Dense Qwen3 on CUDA: bf16 weights as the runner holds them (q/k/v fused as `qkv`,
    gate/up as `gate_up`, in the runner's row order; norms in bf16, widened to fp32 for the
    kernels), the runner's GEMM pins, attention kernel and split size.

    named_weights() yields the Hugging Face names (views into the fused tensors) for
    update_weights; load_weights() takes them back. One thread at a time (the pinned GEMMs'
    handle).

    shard (a tp.RankShard): the model holds that tensor-parallel rank's part (`tensors` are its
    shards) and computes its part of each layer; the collectives between the parts are
    CudaTpQwen3Model's (rollout_trainer.cuda_tp). None: the whole model."""

    architectures = ARCHITECTURES  # config.json's architectures[0] this class computes

    def __init__(self, config: dict, tensors: Dict[str, torch.Tensor], *, pin_m: int = 256,
                 ladder: bool = True, canonical: bool = True, split_size: int = 256,
                 tensor_core: bool = True, device="cuda", shard=None):
        super().__init__()
        arch = (config.get("architectures") or [""])[0]
        if arch not in self.architectures:
            raise ContractError("architecture", arch, self.architectures)
        rope_scaling = config.get("rope_scaling") or config.get("rope_parameters") or {}
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type != "default":
            raise ContractError("rope_type", rope_type, "default")
        if config.get("attention_bias", False):
            raise ContractError("architecture", "attention_bias", "Qwen3 without qkv biases")
        self.config = config
        self.device = torch.device(device)
        self.hidden = int(config["hidden_size"])
        self.num_layers = int(config["num_hidden_layers"])
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config.get("num_key_value_heads", self.heads))
        self.head_dim = int(config.get("head_dim") or self.hidden // self.heads)
        self.inter = int(config["intermediate_size"])
        self.vocab = int(config["vocab_size"])
        self.max_position = int(config.get("max_position_embeddings", 32768))
        self.eps = float(np.float32(config.get("rms_norm_eps", 1e-6)))
        self.theta = float(np.float32(config.get("rope_theta", 10000.0)))
        self.tied = bool(config.get("tie_word_embeddings", False))
        self.split_size = int(split_size)
        self.tensor_core = bool(tensor_core)
        self.scale = float(np.float32(1.0) / np.sqrt(np.float32(self.head_dim)))
        self.shard = shard
        # What this model computes of each layer: all of it, or the rank's heads and features.
        self.local_heads = shard.heads if shard else self.heads
        self.local_kv_heads = shard.kv_heads if shard else self.kv_heads
        self.local_inter = shard.inter if shard else self.inter
        slices = None
        if shard is not None:
            slices = ((self.local_heads + 2 * self.local_kv_heads) * self.head_dim,
                      2 * self.local_inter, shard.vocab_rows)
        with torch.cuda.device(self.device):
            self.gemms = ops.PinnedGemms(self.hidden, self.heads, self.kv_heads, self.head_dim,
                                         self.inter, self.vocab, pin_m, ladder, canonical,
                                         slices)
        self.item_tokens = int(ops.lib().rt_cuda_attention_item_tokens(
            self.local_heads // self.local_kv_heads))

        bf = lambda t: t.to(torch.bfloat16).to(self.device)
        self.params = torch.nn.ParameterDict()
        # HF name -> (param key, row slice or None)
        self._names: Dict[str, tuple] = {}
        hd, nh, nkv, inter = self.head_dim, self.local_heads, self.local_kv_heads, self.local_inter
        q_rows, kv_rows = nh * hd, nkv * hd
        for name, t in tensors.items():
            if self.tied and name == "lm_head.weight":
                continue
            if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or \
                    ".mlp.up_proj." in name:
                continue  # fused below with q_proj / gate_proj
            key = name.replace(".", "__")
            if ".self_attn.q_proj." in name:
                p = name.replace("q_proj", "{}")
                key = p.replace("{}", "qkv").replace(".", "__")
                fused = torch.cat([tensors[p.format(s)] for s in ("q_proj", "k_proj", "v_proj")])
                self.params[key] = torch.nn.Parameter(bf(fused))
                self._names[p.format("q_proj")] = (key, slice(0, q_rows))
                self._names[p.format("k_proj")] = (key, slice(q_rows, q_rows + kv_rows))
                self._names[p.format("v_proj")] = (key, slice(q_rows + kv_rows, q_rows + 2 * kv_rows))
            elif ".mlp.gate_proj." in name:
                p = name.replace("gate_proj", "{}")
                key = p.replace("{}", "gate_up").replace(".", "__")
                fused = torch.cat([tensors[p.format(s)] for s in ("gate_proj", "up_proj")])
                self.params[key] = torch.nn.Parameter(bf(fused))
                self._names[p.format("gate_proj")] = (key, slice(0, inter))
                self._names[p.format("up_proj")] = (key, slice(inter, 2 * inter))
            else:
                self.params[key] = torch.nn.Parameter(bf(t))
                self._names[name] = (key, None)
        self._kernel_weights: Dict[str, tuple] = {}  # the segment-major copies, by version
        self._rope: Optional[tuple] = None

    @classmethod
    def from_pretrained(cls, path: str, contract=None, device="cuda", **options):
        """Loads config.json and the safetensors of `path`. With `contract` (ServerInfo.numerics:
        a rollout_client NumericsContract or the dict of `rollout-cli --json info`), takes the
        server's pin_m, ladder, reduction, attention kernel and split size from it and refuses,
        naming the field, one this library cannot honour on this GPU (the pins included)."""
        config, options = cls._config_and_options(path, contract, device, options)
        model = cls(config, _read_safetensors(path), device=device, **options)
        model._check_pins(contract, config)
        return model

    @staticmethod
    def _config_and_options(path: str, contract, device, options):
        """config.json of `path`, and the constructor's options with the contract's (checked on
        this device) merged in."""
        if contract is not None:
            with torch.cuda.device(torch.device(device)):
                check_contract(contract, device="cuda")
            options = dict(
                pin_m=int(_get(contract, "gemm_pin_m")),
                ladder=bool(_get(contract, "gemm_ladder")),
                canonical=_get(contract, "row_parallel_reduction") == "canonical_k_tree_8",
                split_size=int(_get(contract, "attention_split_size")),
                tensor_core=_get(contract, "attention_kernel") == "tensor_core", **options)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        served = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        if served != "bfloat16":
            raise ContractError("served_dtype", served, "bfloat16")
        return config, options

    def _check_pins(self, contract, config) -> None:
        """Refuses (ContractError) a contract of another architecture or other GEMM pins."""
        if contract is None:
            return
        arch = (config.get("architectures") or [""])[0]
        if _get(contract, "architecture") != arch:
            raise ContractError("architecture", _get(contract, "architecture"), arch)
        theirs = list(_get(contract, "gemm_algorithms") or [])
        if theirs != self.gemms.algorithms:
            raise ContractError("gemm_algorithms", theirs, self.gemms.algorithms)

    # --- weights ---

    def named_weights(self):
        """(Hugging Face name, tensor) pairs: what RolloutClient.update_weights takes."""
        for name, (key, rows) in self._names.items():
            p = self.params[key]
            yield name, (p if rows is None else p[rows])

    def weight(self, name: str) -> torch.Tensor:
        key, rows = self._names[name]
        p = self.params[key]
        return p if rows is None else p[rows]

    def load_weights(self, named_tensors) -> None:
        """Replaces weights in place (rounded to bf16), e.g. after an update."""
        with torch.no_grad():
            for name, t in named_tensors:
                if self.tied and name == "lm_head.weight":
                    continue
                self.weight(name).copy_(t.detach().to(self.device, torch.bfloat16))

    def _p(self, i: int, s: str) -> torch.Tensor:
        return self.params[f"model__layers__{i}__{s}".replace(".", "__")]

    def _kernel_weight(self, key: str, w: torch.Tensor) -> torch.Tensor:
        """What the row-parallel kernel reads: the canonical tree's segment-major copy of w,
        remade when w changed (its version counter), or w itself when fused."""
        if not self.gemms.canonical:
            return w.detach()
        cached = self._kernel_weights.get(key)
        if cached is None or cached[0] != w._version or cached[1] != w.data_ptr():
            tp = self.shard.tp if self.shard else 1
            cached = (w._version, w.data_ptr(), ops.segment_major(w, 8 // tp))
            self._kernel_weights[key] = cached
        return cached[2]

    def _rope_tables(self, n: int):
        if self._rope is None or self._rope[0] < n:
            n = max(n, 4096)
            half = self.head_dim // 2
            cos = torch.empty(n, half, dtype=torch.float32)
            sin = torch.empty_like(cos)
            ops.lib().rt_cuda_rope_tables(self.theta, self.head_dim, n, cos.data_ptr(),
                                          sin.data_ptr())
            self._rope = (n, cos.to(self.device), sin.to(self.device))
        return self._rope[1], self._rope[2]

    # --- forward ---

    def packing(self, cu_seqlens) -> ops.Packing:
        return ops.Packing(torch.as_tensor(cu_seqlens).cpu(), self.device, self.item_tokens)

    def hidden_states(self, tokens: torch.Tensor, pack: ops.Packing,
                      mlp_context=None) -> torch.Tensor:
        """The final-normed hidden states [t, hidden] bf16 of packed sequences. mlp_context:
        passed to _mlp (CudaQwen3MoeModel's routing)."""
        t = tokens.numel()
        hd, nh, nkv = self.head_dim, self.local_heads, self.local_kv_heads
        cos, sin = self._rope_tables(pack.max_len)
        x = self._embed(tokens)
        for i in range(self.num_layers):
            p = lambda s: self._p(i, s)
            xn = self._to_tp(ops.RmsNorm.apply(x, p("input_layernorm.weight"), self.eps))
            qkv = ops.Gemm.apply(xn, self._qkv_weight(i), self.gemms, 0, torch.float32)
            q, k, v = ops.QkvNormRope.apply(qkv, *self._qk_norms(i), self.eps, cos, sin,
                                            pack, nh, nkv, hd)
            a = ops.Attention.apply(q, k, v, pack, self.split_size, self.scale, self.tensor_core)
            x = self._row_parallel(x, a.reshape(t, nh * hd), i, "o", 0)
            x = self._mlp(i, x, mlp_context)
        return ops.RmsNorm.apply(x, self.params["model__norm__weight"], self.eps)

    def _mlp(self, i: int, x: torch.Tensor, mlp_context=None) -> torch.Tensor:
        """x + layer i's MLP of x (post-attention norm, gate/up, SiLU * up, the down projection
        into the residual), as the runner's EnqueueMlp at TP 1. mlp_context: a subclass's
        per-call state."""
        p = lambda s: self._p(i, s)
        xn = self._to_tp(ops.RmsNorm.apply(x, p("post_attention_layernorm.weight"), self.eps))
        gu = ops.Gemm.apply(xn, p("mlp.gate_up.weight"), self.gemms, 1, torch.bfloat16)
        act = ops.SiluMul.apply(gu)
        return self._row_parallel(x, act, i, "down", 1)

    # --- the pieces tensor parallelism replaces (rollout_trainer.cuda_tp) ---

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return ops.Embedding.apply(tokens, self.params["model__embed_tokens__weight"])

    def _to_tp(self, xn: torch.Tensor) -> torch.Tensor:
        """The input of column-parallel GEMMs (identity here)."""
        return xn

    def _qkv_weight(self, i: int) -> torch.Tensor:
        return self._p(i, "self_attn.qkv.weight")

    def _qk_norms(self, i: int):
        return self._p(i, "self_attn.q_norm.weight"), self._p(i, "self_attn.k_norm.weight")

    def _row_parallel(self, x, a, i: int, name: str, which: int) -> torch.Tensor:
        """x + a . w^T for layer i's o_proj (which 0) or down_proj (1), as the runner's."""
        w = self._p(i, "self_attn.o_proj.weight" if which == 0 else "mlp.down_proj.weight")
        return ops.RowParallel.apply(x, a, w, self._kernel_weight(f"{i}.{name}", w), self.gemms,
                                     which)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The logits [t, vocab] fp32 of the final hidden states."""
        return ops.Gemm.apply(h, self.head(), self.gemms, 2, torch.float32)

    def head(self) -> torch.Tensor:
        return self.params["model__embed_tokens__weight" if self.tied else "lm_head__weight"]

    def logprobs(self, tokens: torch.Tensor, cu_seqlens, temperature: float = 1.0,
                 pack: Optional[ops.Packing] = None, mlp_context=None) -> torch.Tensor:
        """log_softmax(logits / T) of each token given the tokens before it in its sequence:
        [t] float32 on the GPU, packed order, 0 at each sequence's first token. Bitwise the cuda
        server's Score logprob of token i (and Generate's for a token it sampled at T; T = 0
        scores as T = 1). tokens [t] int (any device), cu_seqlens [b + 1] from 0."""
        tokens = torch.as_tensor(tokens).reshape(-1).to(self.device, torch.int64)
        cu = torch.as_tensor(cu_seqlens).reshape(-1).cpu().long()
        t = tokens.numel()
        if cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != t or \
                bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError("cu_seqlens must rise strictly from 0 to len(tokens)")
        if bool(((tokens < 0) | (tokens >= self.vocab)).any()):
            raise ValueError(f"token ids must be in [0, {self.vocab})")
        if int((cu[1:] - cu[:-1]).max()) > self.max_position:
            raise ValueError(f"a sequence is longer than max_position_embeddings "
                             f"({self.max_position})")
        pack = pack or self.packing(cu)
        temperature = float(np.float32(temperature))
        logits = self._logits(self.hidden_states(tokens, pack, mlp_context))
        # Row r predicts token r + 1 (the last row of a sequence predicts nothing: token 0).
        targets = torch.cat([tokens[1:], tokens.new_zeros(1)])
        lp_rows = ops.TokenLogprob.apply(logits, targets, temperature)
        prev = torch.cat([lp_rows.new_zeros(1), lp_rows[:-1]])
        return torch.where(pack.first, torch.zeros((), dtype=lp_rows.dtype,
                                                    device=self.device), prev)
