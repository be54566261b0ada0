"""The CUDA backend's kernels as torch ops on CUDA tensors, with plain-torch backwards.

ctypes binding of librollout_trainer_cuda_ops.so (trainer/trainer_cuda_ops.cc): every forward is
the very launcher the server's CUDA runner calls, on the tensors' data_ptr() and torch's current
stream (raw driver objects: the library has its own CUDA runtime). Dtypes are the runner's: bf16
weights, GEMM inputs and K/V; fp32 residual stream, q, qkv and logits. Backwards are analytic, in
plain torch (bf16 matmuls as plain-torch training would run them; attention by torch's SDPA
recomputed under autograd): gradients are correct, not bitwise.

The library is found at $ROLLOUT_TRAINER_CUDA_OPS, else beside this package, else in
<repo>/build/lib. Importing this module loads nothing; the first op does.
"""

from __future__ import annotations

import ctypes
from typing import Dict, List, Optional, Tuple

import torch

from ._libpath import find_library

_NAME = "librollout_trainer_cuda_ops.so"
_lib: Optional[ctypes.CDLL] = None

_f = ctypes.c_float
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_p = ctypes.c_void_p


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use). OSError naming where it looked otherwise."""
    global _lib
    if _lib is not None:
        return _lib
    l = ctypes.CDLL(find_library(_NAME, "ROLLOUT_TRAINER_CUDA_OPS",
                                 "build the target rollout_trainer_cuda_ops (a CUDA build)"))
    sigs = {
        "rt_cuda_last_error": (ctypes.c_char_p, []),
        "rt_cuda_kernels_version": (ctypes.c_char_p, []),
        "rt_cuda_attention_tile": (_i32, []),
        "rt_cuda_attention_item_tokens": (_i32, [_i32]),
        "rt_cuda_device_facts": (ctypes.c_int, [ctypes.c_char_p, _i64]),
        "rt_cuda_model_create": (ctypes.c_int, [_i64, _i64, _i64, _i64, _i64, _i64, _i64, _i32,
                                                _i32, ctypes.POINTER(_p)]),
        "rt_cuda_model_create_tp": (ctypes.c_int, [_i64, _i64, _i64, _i64, _i64, _i64, _i64,
                                                   _i32, _i32, _i64, _i64, _i64,
                                                   ctypes.POINTER(_p)]),
        "rt_cuda_model_free": (None, [_p]),
        "rt_cuda_model_algorithms": (ctypes.c_char_p, [_p]),
        "rt_cuda_gemm": (ctypes.c_int, [_p, _i32, _p, _i64, _p, _p, _p]),
        "rt_cuda_row_parallel": (ctypes.c_int, [_p, _i32, _p, _i64, _p, _p, _p, _p, _p]),
        "rt_cuda_row_parallel_node": (ctypes.c_int, [_p, _i32, _p, _i64, _i64, _p, _p, _p, _p]),
        "rt_cuda_sum_tree_onto": (ctypes.c_int, [_p, _i32, _i64, _i64, _p, _p, _p]),
        "rt_cuda_embedding": (ctypes.c_int, [_p, _i64, _p, _i64, _p, _p]),
        "rt_cuda_embedding_shard": (ctypes.c_int, [_p, _i64, _p, _i64, _i64, _i64, _p, _p]),
        "rt_cuda_select_owner_rows": (ctypes.c_int, [_p, _i64, _p, _i64, _i64, _i64, _p, _p]),
        "rt_cuda_rms_norm": (ctypes.c_int, [_p, _p, _i64, _i64, _p, _f, _p, _p]),
        "rt_cuda_qkv_norm_rope": (ctypes.c_int, [_p, _i64, _p, _p, _p, _p, _f, _p, _p, _i32,
                                                 _i32, _i32, _p, _p, _p, _p]),
        "rt_cuda_attention": (ctypes.c_int, [_p, _p, _p, _p, _p, _i32, _i32, _i32, _i32, _i32, _f,
                                             _p, _p, _i32, _p, _p]),
        "rt_cuda_silu_mul": (ctypes.c_int, [_p, _i64, _i64, _p, _p]),
        "rt_cuda_logprob_workspace": (_i64, [_i64]),
        "rt_cuda_token_logprobs": (ctypes.c_int, [_p, _i64, _i32, _p, _f, _p, _p, _p, _p, _p]),
        "rt_cuda_rope_tables": (None, [_f, _i64, _i64, _p, _p]),
        "rt_cuda_model_add_router": (ctypes.c_int, [_p, _i64]),
        "rt_cuda_moe_route": (ctypes.c_int, [_p, _i64, _i32, _i32, _i32, _p, _p, _p, _p, _p]),
        "rt_cuda_moe_grouping_ints": (_i64, [_i64, _i64]),
        "rt_cuda_moe_experts": (ctypes.c_int, [_p, _i64, _i64, _i64, _i32, _i32, _p, _p, _p, _p,
                                               _p, _p, _p, _p]),
        "rt_cuda_moe_combine": (ctypes.c_int, [_p, _p, _p, _i64, _i32, _i64, _p, _p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(l, name)
        fn.restype, fn.argtypes = res, args
    _lib = l
    return l


def _call(name: str, *args) -> None:
    if getattr(lib(), name)(*args) != 0:
        raise RuntimeError(f"{name}: {lib().rt_cuda_last_error().decode()}")


def kernels_version() -> str:
    """ServerInfo.numerics.kernels of a cuda server built from the same sources."""
    return lib().rt_cuda_kernels_version().decode()


def device_facts() -> Dict[str, str]:
    """The current device's facts, as the server reports its own (kernels/cuda/numerics.h)."""
    buf = ctypes.create_string_buffer(1024)
    _call("rt_cuda_device_facts", buf, len(buf))
    gpu, cc, rt, lt = buf.value.decode().split("\n")
    return {"gpu_model": gpu, "compute_capability": cc, "cuda_runtime": rt,
            "cublaslt_version": lt, "attention_tile": int(lib().rt_cuda_attention_tile()),
            "kernels": kernels_version()}


def _stream() -> int:
    return torch.cuda.current_stream().cuda_stream


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def _need(t: torch.Tensor, name: str, dtype: torch.dtype, align: int = 16) -> torch.Tensor:
    if t.device.type != "cuda" or t.dtype != dtype:
        raise TypeError(f"{name}: {dtype} CUDA tensor expected, got {t.dtype} on {t.device}")
    t = t.detach().contiguous()
    if t.data_ptr() % align != 0:
        t = t.clone()
    if t.data_ptr() % align != 0:
        raise ValueError(f"{name}: not {align}-byte aligned")
    return t


class PinnedGemms:
    """The model's pinned GEMMs on the current device, created as the server's CUDA runner pins
    them at TP 1 (pin_m, outputs, the canonical tree's leaves or the fused residual GEMMs,
    optional ladder). slices: a tensor-parallel rank's (qkv rows, gate_up rows, vocab rows),
    which run the algorithms pinned for the full shapes (the runner's PinCanonicalGemms; needs
    canonical); None: the whole model. Owns the library's handle."""

    def __init__(self, hidden, heads, kv_heads, head_dim, intermediate, vocab, pin_m: int,
                 ladder: bool, canonical: bool, slices: Optional[Tuple[int, int, int]] = None):
        h = _p()
        if slices is None:
            slices = ((heads + 2 * kv_heads) * head_dim, 2 * intermediate, vocab)
        _call("rt_cuda_model_create_tp", hidden, heads, kv_heads, head_dim, intermediate, vocab,
              int(pin_m), int(bool(ladder)), int(bool(canonical)), *map(int, slices),
              ctypes.byref(h))
        self._h = h
        self.canonical = canonical
        self.algorithms: List[str] = lib().rt_cuda_model_algorithms(h).decode().split("\n")

    def add_router(self, num_experts: int) -> None:
        """Pins the MoE router GEMM [num_experts, hidden] (fp32 logits; gemm(3, ...)) as the
        runner's PinMoeGemms does; its line joins `algorithms` after the dense ones."""
        _call("rt_cuda_model_add_router", self._h, int(num_experts))
        self.algorithms = lib().rt_cuda_model_algorithms(self._h).decode().split("\n")

    def __del__(self):
        if getattr(self, "_h", None) and _lib is not None:
            _lib.rt_cuda_model_free(self._h)
            self._h = None

    def gemm(self, which: int, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype):
        """y = x . w^T by the pin `which`: 0 qkv, 1 gate_up, 2 lm_head, 3 router."""
        x = _need(x, "x", torch.bfloat16, 256)
        w = _need(w, "w", torch.bfloat16, 256)
        y = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
        if x.shape[0]:
            _call("rt_cuda_gemm", self._h, which, _ptr(x), x.shape[0], _ptr(w), _ptr(y), _stream())
        return y

    def row_parallel(self, which: int, x: torch.Tensor, a: torch.Tensor, w_kernel: torch.Tensor):
        """x + a . w^T as the runner (w_kernel: segment-major [8, hidden, K / 8] when canonical,
        else [hidden, K]); a new fp32 tensor, written by the kernel from x (no copy of x first)."""
        a = _need(a, "in", torch.bfloat16, 256)
        x = _need(x, "x", torch.float32, 256)
        out = torch.empty_like(x)
        m = a.shape[0]
        leaves = None
        if self.canonical and m:
            leaves = torch.empty(8, m, out.shape[1], dtype=torch.float32, device=x.device)
        if m:
            _call("rt_cuda_row_parallel", self._h, which, _ptr(a), m, _ptr(w_kernel),
                  _ptr(leaves), _ptr(x), _ptr(out), _stream())
        return out


    def row_parallel_node(self, which: int, a: torch.Tensor, w_kernel: torch.Tensor):
        """A tensor-parallel rank's node of the K tree: the sum (by the tree) of a . w_s^T over
        its segments s. a bf16 [m, K / tp], w_kernel segment-major [8 / tp, hidden, K / 8] ->
        a new fp32 [m, hidden]."""
        a = _need(a, "in", torch.bfloat16, 256)
        local, hidden = w_kernel.shape[0], w_kernel.shape[1]
        m = a.shape[0]
        node = torch.empty(m, hidden, dtype=torch.float32, device=a.device)
        leaves = None
        if local > 1 and m:
            leaves = torch.empty(local, m, hidden, dtype=torch.float32, device=a.device)
        if m:
            _call("rt_cuda_row_parallel_node", self._h, which, _ptr(a), m, a.shape[1],
                  _ptr(w_kernel), _ptr(leaves), _ptr(node), _stream())
        return node


def sum_tree_onto(x: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """x + the canonical tree over parts [n, ...] (n in 1, 2, 4, 8; the ranks' nodes in rank
    order): a new fp32 tensor of x's shape (cuda::SumTreeOnto)."""
    xc = _need(x, "x", torch.float32)
    pc = _need(parts, "parts", torch.float32)
    out = torch.empty_like(xc)
    count = xc.numel()
    if count:
        _call("rt_cuda_sum_tree_onto", _ptr(pc), pc.shape[0], count, count, _ptr(xc), _ptr(out),
              _stream())
    return out


def segment_major(w: torch.Tensor, segments: int = 8) -> torch.Tensor:
    """[hidden, K] -> the canonical tree's weight layout [segments, hidden, K / segments]
    (contiguous): 8 for the whole weight, 8 / tp for a rank's K columns."""
    h, k = w.shape
    return w.detach().reshape(h, segments, k // segments).permute(1, 0, 2).contiguous()


# --- metadata of packed sequences ---

class Packing:
    """Device metadata of packed variable-length sequences (cu_seqlens [b + 1] from 0): each
    token's position, its sequence's first row (its "block table" of one-token pages is the
    rows from there), attention work items, and the sequences grouped by length for the SDPA
    backward."""

    def __init__(self, cu_seqlens: torch.Tensor, device, item_tokens: int):
        cu = [int(v) for v in cu_seqlens.reshape(-1).tolist()]
        t = cu[-1]
        lens = [e - s for s, e in zip(cu[:-1], cu[1:])]
        starts = torch.repeat_interleave(torch.tensor(cu[:-1], dtype=torch.int64),
                                         torch.tensor(lens, dtype=torch.int64))
        positions = torch.arange(t, dtype=torch.int64) - starts
        items = []
        for s, n in zip(cu[:-1], lens):
            for i in range(0, n, item_tokens):
                items.append((s + i, min(item_tokens, n - i)))
        self.t = t
        self.max_len = max(lens)
        self.cu = cu
        self.positions = positions.to(torch.int32).to(device)
        self.starts = starts.to(torch.int32).to(device)
        self.rows = torch.arange(t, dtype=torch.int32, device=device)
        self.items = torch.tensor(items, dtype=torch.int32).reshape(-1, 2).to(device)
        by_len: Dict[int, List[int]] = {}
        for s, n in zip(cu[:-1], lens):
            by_len.setdefault(n, []).append(s)
        # Per distinct length L: row indices [nb, L] of its sequences.
        self.groups = [(n, (torch.tensor(ss, dtype=torch.int64)[:, None] +
                            torch.arange(n, dtype=torch.int64)[None, :]).to(device))
                       for n, ss in sorted(by_len.items())]
        first = torch.zeros(t, dtype=torch.bool)
        first[torch.tensor(cu[:-1], dtype=torch.int64)] = True
        self.first = first.to(device)


# --- the backwards' arithmetic (plain torch, any device: tests/test_cuda_backward.py checks each
# against autograd of the forward's formula on the CPU) ---

def silu_mul_backward(gate_up, g):
    """d/d gate_up of silu(gate) * up, fp32: gate_up [rows, 2 dim], g [rows, dim]."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    gf = g.float()
    return torch.cat([gf * up * s * (1 + gate * (1 - s)), gf * gate * s], dim=-1)


def token_logprob_backward(logits, targets, row_max, row_log_sum, t: float, g):
    """d/d logits of lp[r] = log_softmax(logits[r] / t)[targets[r]], given the forward's max and
    log-sum of logits / t per row: g[r] (onehot - softmax) / t."""
    grad = -torch.exp(logits / t - row_max[:, None] - row_log_sum[:, None])
    grad.scatter_add_(1, targets.long()[:, None], torch.ones_like(row_max)[:, None])
    grad.mul_(g[:, None] / t)
    return grad


def qkv_norm_rope_backward(qkv, q_norm, k_norm, eps, cos, sin, heads, kv_heads, hd, gq, gk, gv):
    """d/d (qkv, q_norm, k_norm) of q = rope(rmsnorm_head(q_raw) q_norm), k likewise, v = v_raw;
    cos, sin [t, hd / 2] of each token's position."""
    t = qkv.shape[0]
    q_raw = qkv[:, :heads * hd].reshape(t, heads, hd)
    k_raw = qkv[:, heads * hd:(heads + kv_heads) * hd].reshape(t, kv_heads, hd)
    gqn, gwq = _rms_norm_backward(q_raw, q_norm, eps, _rope_backward(gq.float(), cos, sin))
    gkn, gwk = _rms_norm_backward(k_raw, k_norm, eps, _rope_backward(gk.float(), cos, sin))
    gqkv = torch.cat([gqn.reshape(t, -1), gkn.reshape(t, -1), gv.float().reshape(t, -1)], dim=1)
    return gqkv, gwq, gwk


# --- autograd ops ---

class Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, embed):
        ids32 = _need(ids.to(torch.int32), "ids", torch.int32)
        e = _need(embed, "embed", torch.bfloat16)
        x = torch.empty(ids.numel(), e.shape[1], dtype=torch.float32, device=e.device)
        _call("rt_cuda_embedding", _ptr(ids32), ids.numel(), _ptr(e), e.shape[1], _ptr(x),
              _stream())
        ctx.save_for_backward(ids)
        ctx.vocab = e.shape[0]
        return x

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ge = torch.zeros(ctx.vocab, g.shape[1], dtype=torch.float32, device=g.device)
        ge.index_add_(0, ids.long(), g.float())
        return None, ge.to(torch.bfloat16)


def _rms_norm_backward(x, w, eps, g):
    """Gradients of y = x * rsqrt(mean(x^2) + eps) * w over the last dim, in fp32."""
    x, g, wf = x.float(), g.float(), w.float()
    r = torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)
    gw = (g * x * r).reshape(-1, x.shape[-1]).sum(0)
    gwx = g * wf
    gx = r * (gwx - x * (r * r) * (gwx * x).mean(-1, keepdim=True))
    return gx, gw


class RmsNorm(torch.autograd.Function):
    """x fp32 [rows, dim], weight fp32 [dim] -> bf16 (cuda::RmsNorm)."""

    @staticmethod
    def forward(ctx, x, w, eps):
        xc = _need(x, "x", torch.float32)
        wc = _need(w.float(), "weight", torch.float32)
        y = torch.empty(xc.shape, dtype=torch.bfloat16, device=x.device)
        if xc.shape[0]:
            _call("rt_cuda_rms_norm", _ptr(xc), None, xc.shape[0], xc.shape[1], _ptr(wc), eps,
                  _ptr(y), _stream())
        ctx.save_for_backward(x, w)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx, gw = _rms_norm_backward(x, w, ctx.eps, g)
        return gx, gw.to(w.dtype), None


class Gemm(torch.autograd.Function):
    """y = x . w^T by a pinned GEMM (x, w bf16; y fp32 or bf16 per the runner's output)."""

    @staticmethod
    def forward(ctx, x, w, gemms: PinnedGemms, which: int, out_dtype):
        ctx.save_for_backward(x, w)
        return gemms.gemm(which, x, w, out_dtype)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gb = g.to(torch.bfloat16)
        gx = gb @ w if ctx.needs_input_grad[0] else None
        gw = gb.t() @ x if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None


class RowParallel(torch.autograd.Function):
    """x + a . w^T, the residual projection as the runner's (o_proj, down_proj)."""

    @staticmethod
    def forward(ctx, x, a, w, w_kernel, gemms: PinnedGemms, which: int):
        ctx.save_for_backward(a, w)
        return gemms.row_parallel(which, x, a, w_kernel)

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        gb = g.to(torch.bfloat16)
        return g, gb @ w, gb.t() @ a, None, None, None


class RowParallelNode(torch.autograd.Function):
    """A tensor-parallel rank's node of the K tree, a . w^T over its K columns (a bf16 [m, K /
    tp], w [hidden, K / tp]) -> fp32 [m, hidden] (PinnedGemms.row_parallel_node)."""

    @staticmethod
    def forward(ctx, a, w, w_kernel, gemms: PinnedGemms, which: int):
        ctx.save_for_backward(a, w)
        return gemms.row_parallel_node(which, a, w_kernel)

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        gb = g.to(torch.bfloat16)
        return gb @ w, gb.t() @ a, None, None, None


class TreeTop(torch.autograd.Function):
    """x + the canonical tree over the ranks' gathered nodes [tp, m, hidden] (sum_tree_onto).
    Backward: the gradient to x and to every node."""

    @staticmethod
    def forward(ctx, x, nodes):
        ctx.tp = nodes.shape[0]
        return sum_tree_onto(x, nodes)

    @staticmethod
    def backward(ctx, g):
        return g, g.unsqueeze(0).expand(ctx.tp, *g.shape)


class EmbeddingShard(torch.autograd.Function):
    """A vocab-parallel rank's part of the embedding (cuda::EmbeddingGatherShard): x[t] = the
    row of shard [vocab_end - vocab_begin, hidden] bf16 for a token it owns, else zeros (fp32)."""

    @staticmethod
    def forward(ctx, ids, shard, vocab_begin: int, vocab_end: int):
        ids32 = _need(ids.to(torch.int32), "ids", torch.int32)
        e = _need(shard, "embedding shard", torch.bfloat16)
        x = torch.empty(ids.numel(), e.shape[1], dtype=torch.float32, device=e.device)
        if ids.numel():
            _call("rt_cuda_embedding_shard", _ptr(ids32), ids.numel(), _ptr(e), vocab_begin,
                  vocab_end, e.shape[1], _ptr(x), _stream())
        ctx.save_for_backward(ids)
        ctx.rows, ctx.begin, ctx.end = e.shape[0], vocab_begin, vocab_end
        return x

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        ids = ids.long()
        own = (ids >= ctx.begin) & (ids < ctx.end)
        ge = torch.zeros(ctx.rows, g.shape[1], dtype=torch.float32, device=g.device)
        ge.index_add_(0, ids[own] - ctx.begin, g.float()[own])
        return None, ge.to(torch.bfloat16), None, None


class SelectOwnerRows(torch.autograd.Function):
    """The ranks' EmbeddingShard rows all-gathered [tp, t, hidden] -> x[t] = the row of the rank
    that owns token t (ids // rows_per_rank): selected, never summed (cuda::SelectOwnerRows)."""

    @staticmethod
    def forward(ctx, ids, gathered, rows_per_rank: int):
        ids32 = _need(ids.to(torch.int32), "ids", torch.int32)
        gc = _need(gathered, "gathered rows", torch.float32)
        tp, t, hidden = gc.shape
        x = torch.empty(t, hidden, dtype=torch.float32, device=gc.device)
        if t:
            _call("rt_cuda_select_owner_rows", _ptr(ids32), t, _ptr(gc), t * hidden,
                  rows_per_rank, hidden, _ptr(x), _stream())
        ctx.save_for_backward(ids)
        ctx.tp, ctx.rows = tp, rows_per_rank
        return x

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        t = g.shape[0]
        grad = torch.zeros(ctx.tp, *g.shape, dtype=g.dtype, device=g.device)
        grad[ids.long() // ctx.rows, torch.arange(t, device=g.device)] = g
        return None, grad, None


def _rope_backward(g, cos, sin):
    half = g.shape[-1] // 2
    g1, g2 = g[..., :half], g[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([g1 * c + g2 * s, g2 * c - g1 * s], dim=-1)


class QkvNormRope(torch.autograd.Function):
    """qkv fp32 [t, (h + 2 kv) d] -> q fp32 [t, h, d] (normed, rotated), k, v bf16 [t, kv, d]
    (cuda::QkvNormRopeWriteKv into one-token pages that are the packed rows)."""

    @staticmethod
    def forward(ctx, qkv, q_norm, k_norm, eps, cos_table, sin_table, pack: Packing, heads,
                kv_heads, head_dim):
        qkvc = _need(qkv, "qkv", torch.float32)
        qn = _need(q_norm.float(), "q_norm", torch.float32)
        kn = _need(k_norm.float(), "k_norm", torch.float32)
        t = qkvc.shape[0]
        dev = qkv.device
        q = torch.empty(t, heads, head_dim, dtype=torch.float32, device=dev)
        k = torch.empty(t, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
        v = torch.empty_like(k)
        if t:
            _call("rt_cuda_qkv_norm_rope", _ptr(qkvc), t, _ptr(pack.positions), _ptr(pack.rows),
                  _ptr(qn), _ptr(kn), eps, _ptr(cos_table), _ptr(sin_table), heads, kv_heads,
                  head_dim, _ptr(q), _ptr(k), _ptr(v), _stream())
        ctx.save_for_backward(qkv, q_norm, k_norm, cos_table, sin_table, pack.positions)
        ctx.shape = (heads, kv_heads, head_dim, eps)
        return q, k, v

    @staticmethod
    def backward(ctx, gq, gk, gv):
        qkv, q_norm, k_norm, cos_table, sin_table, positions = ctx.saved_tensors
        heads, kv_heads, hd, eps = ctx.shape
        pos = positions.long()
        gqkv, gwq, gwk = qkv_norm_rope_backward(qkv, q_norm, k_norm, eps, cos_table[pos],
                                                sin_table[pos], heads, kv_heads, hd, gq, gk, gv)
        return (gqkv, gwq.to(q_norm.dtype), gwk.to(k_norm.dtype), None, None, None, None, None,
                None, None)


def sdpa_packed(q, k, v, pack: Packing, scale: float):
    """Causal attention of packed sequences in plain torch (SDPA per group of equal-length
    sequences): q [t, h, d], k/v [t, kv, d] of one dtype -> [t, h, d]."""
    t, heads, hd = q.shape
    group = heads // k.shape[1]
    out = q.new_empty(t, heads, hd)
    for n, idx in pack.groups:
        qs = q[idx].transpose(1, 2)                       # [nb, h, L, d]
        ks = k[idx].repeat_interleave(group, dim=2).transpose(1, 2)
        vs = v[idx].repeat_interleave(group, dim=2).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                             scale=scale)
        out[idx.reshape(-1)] = o.transpose(1, 2).reshape(-1, heads, hd)
    return out


class Attention(torch.autograd.Function):
    """The server's per-row attention (PagedAttentionMma, or the SIMT kernel) of packed
    sequences: q fp32 [t, h, d] (rounded to bf16 inside, as the kernel does), k/v bf16
    [t, kv, d] -> bf16 [t, h, d]. Backward: SDPA on bf16 recomputed under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, pack: Packing, split_size: int, scale: float, tensor_core: bool):
        qc = _need(q, "q", torch.float32)
        kc, vc = _need(k, "k", torch.bfloat16), _need(v, "v", torch.bfloat16)
        t, heads, hd = qc.shape
        out = torch.empty(t, heads, hd, dtype=torch.bfloat16, device=q.device)
        if t:
            _call("rt_cuda_attention", _ptr(qc), _ptr(pack.positions), _ptr(pack.starts),
                  _ptr(pack.rows), _ptr(pack.items), pack.items.shape[0], heads, kc.shape[1], hd,
                  split_size, scale, _ptr(kc), _ptr(vc), int(tensor_core), _ptr(out), _stream())
        ctx.save_for_backward(q, k, v)
        ctx.pack, ctx.scale = pack, scale
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            qb = q.detach().to(torch.bfloat16).requires_grad_(True)
            kb = k.detach().requires_grad_(True)
            vb = v.detach().requires_grad_(True)
            out = sdpa_packed(qb, kb, vb, ctx.pack, ctx.scale)
            gq, gk, gv = torch.autograd.grad(out, (qb, kb, vb), g.to(torch.bfloat16))
        return gq.float(), gk, gv, None, None, None, None


class SiluMul(torch.autograd.Function):
    """gate_up bf16 [rows, 2 dim] -> bf16(silu(gate) * up) (cuda::SiluMul)."""

    @staticmethod
    def forward(ctx, gate_up):
        gu = _need(gate_up, "gate_up", torch.bfloat16)
        rows, two = gu.shape
        out = torch.empty(rows, two // 2, dtype=torch.bfloat16, device=gu.device)
        if rows:
            _call("rt_cuda_silu_mul", _ptr(gu), rows, two // 2, _ptr(out), _stream())
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    def backward(ctx, g):
        (gu,) = ctx.saved_tensors
        return silu_mul_backward(gu, g).to(torch.bfloat16)


class TokenLogprob(torch.autograd.Function):
    """lp[r] = log_softmax(logits[r] / T)[targets[r]] as the server's sampling kernel computes
    it (cuda::ProcessLogitsRows, kRowScore). logits fp32 [rows, vocab] -> fp32 [rows]."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float):
        lg = _need(logits, "logits", torch.float32)
        tg = _need(targets.to(torch.int32), "targets", torch.int32)
        rows, vocab = lg.shape
        dev = lg.device
        lp = torch.empty(rows, dtype=torch.float32, device=dev)
        mx, ls = torch.empty_like(lp), torch.empty_like(lp)
        if rows:
            ws = torch.empty(int(lib().rt_cuda_logprob_workspace(rows)), dtype=torch.uint8,
                             device=dev)
            _call("rt_cuda_token_logprobs", _ptr(lg), rows, vocab, _ptr(tg), temperature,
                  _ptr(ws), _ptr(lp), _ptr(mx), _ptr(ls), _stream())
        ctx.save_for_backward(logits, targets, mx, ls)
        ctx.t = temperature if temperature > 0 else 1.0
        return lp

    @staticmethod
    def backward(ctx, g):
        logits, targets, mx, ls = ctx.saved_tensors
        return token_logprob_backward(logits, targets, mx, ls, ctx.t, g), None, None


# --- MoE ---
# Qwen3-MoE's MLP as the runner's EnqueueMoe (trainer_cuda_ops.cc "--- MoE ---"): the router
# logits by the pinned router GEMM (Gemm, which 3), MoeRoute, MoeExperts (grouping, gate/up,
# SiLU * up, down: the expert GEMMs of kernels/cuda/moe_gemm.cu) and MoeCombine into the
# residual. Backwards in plain torch: the selection is a constant; the router's gradient flows
# through the (renormalised) top-k weights, as the CPU ops' (ops.reference_moe_weights).

def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or kept in float64 (the CPU checks of these formulas)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def moe_route_backward(logits, ids, norm_topk_prob: bool, g):
    """d/d logits of w[t, j] = p[t, ids[t, j]] (divided by sum_j p[t, ids[t, j]] with
    norm_topk_prob), p = softmax(logits[t]): the ids are constants. logits [t, e], ids [t, k],
    g [t, k] -> [t, e]."""
    p = torch.softmax(_wide(logits), dim=-1)
    idx = ids.long()
    ps = p.gather(1, idx)                                  # [t, k]
    gw = g.to(p.dtype)
    if norm_topk_prob:
        s = ps.sum(-1, keepdim=True)
        gw = (gw - (gw * (ps / s)).sum(-1, keepdim=True)) / s  # d/d ps
    hp = gw * ps
    grad = -p * hp.sum(-1, keepdim=True)
    grad.scatter_add_(1, idx, hp)
    return grad


def moe_combine_backward(y, weights, g):
    """d/d (y, weights) of out[t] = sum_j weights[t, j] y[t, j]: y [t, k, h] (each token's
    expert outputs in rank order), weights [t, k], g [t, h] -> ([t, k, h], [t, k])."""
    y, weights, g = _wide(y), _wide(weights), _wide(g)
    return weights[..., None] * g[:, None, :], (y * g[:, None, :]).sum(-1)


def group_assignments(ids, num_experts: int):
    """MoeGroup's grouping in plain torch: the assignments a = t * k + j of ids [t, k] ordered by
    (expert, a). Returns rows [a] (grouped row -> token), slots [a] (assignment -> grouped row),
    expert_offsets [num_experts + 1] (expert e's grouped rows are [offsets[e], offsets[e + 1])),
    int64 on ids' device."""
    flat = ids.reshape(-1).long()
    a, k = flat.numel(), ids.shape[1]
    order = torch.argsort(flat * a + torch.arange(a, device=flat.device))
    slots = torch.empty_like(order)
    slots[order] = torch.arange(a, device=flat.device)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return order // k, slots, offsets


def grouping_views(buffer: torch.Tensor, num_experts: int, assignments: int) -> dict:
    """The arrays of a grouping workspace (rt_cuda_moe_grouping_ints(e, a) int32), at their places
    in cuda::MoeGroupingIn's layout: counts, expert_offsets, tile_offsets, rows, slots."""
    e, a = num_experts, assignments
    return {"counts": buffer[:e], "expert_offsets": buffer[e:2 * e + 1],
            "tile_offsets": buffer[2 * e + 1:3 * e + 2], "rows": buffer[3 * e + 2:3 * e + 2 + a],
            "slots": buffer[3 * e + 2 + a:3 * e + 2 + 2 * a]}


def expert_mlp_backward(xn, rows, offsets, gate_up, act, w_gate_up, w_down, gy):
    """d/d (xn, w_gate_up, w_down) of the experts' outputs in grouped order: for expert e's
    grouped rows r in [offsets[e], offsets[e + 1]), y[r] = silu_mul(xn[rows[r]] . w_gate_up[e]^T)
    . w_down[e]^T, gate_up [a, 2 i] and act [a, i] the forward's (gate/up output, SiLU * up).
    Matmuls per expert in the weights' dtype (bf16 on the GPU), as plain-torch training runs
    them; the xn gradient summed over a token's ranks in fp32. xn [t, h], w_gate_up [e, 2 i, h],
    w_down [e, h, i], gy [a, h]; offsets a list of e + 1 ints."""
    dt = w_down.dtype
    gxn = torch.zeros(xn.shape, dtype=torch.promote_types(dt, torch.float32), device=xn.device)
    g_gate_up = torch.zeros_like(w_gate_up)
    g_down = torch.zeros_like(w_down)
    for e in range(len(offsets) - 1):
        b, end = int(offsets[e]), int(offsets[e + 1])
        if b == end:
            continue
        r = rows[b:end].long()
        ge = gy[b:end].to(dt)                                          # [n, h]
        g_down[e] = ge.t() @ act[b:end].to(dt)                         # [h, i]
        g_gu = silu_mul_backward(gate_up[b:end], ge @ w_down[e]).to(dt)  # [n, 2 i]
        g_gate_up[e] = g_gu.t() @ xn[r].to(dt)                         # [2 i, h]
        gxn.index_add_(0, r, (g_gu @ w_gate_up[e]).to(gxn.dtype))
    return gxn, g_gate_up, g_down


class MoeRoute(torch.autograd.Function):
    """Router logits fp32 [t, e] -> (ids int32 [t, k], weights fp32 [t, k]) by cuda::MoeRoute:
    the top k by router probability (ties to the lower id) or, on rows where forced_rows
    (bool/int [t]) is set, forced [t, k]; weights the probabilities at them, renormalised with
    norm_topk_prob. Backward: moe_route_backward (the selection is a constant)."""

    @staticmethod
    def forward(ctx, logits, forced, forced_rows, k: int, norm_topk_prob: bool):
        lg = _need(logits, "router logits", torch.float32)
        t, e = lg.shape
        ids = torch.empty(t, k, dtype=torch.int32, device=lg.device)
        weights = torch.empty(t, k, dtype=torch.float32, device=lg.device)
        fi = fr = None
        if forced is not None:
            fi = _need(forced.to(torch.int32), "forced ids", torch.int32)
            fr = _need(forced_rows.to(torch.int32), "forced rows", torch.int32)
            if fi.shape != (t, k) or fr.shape != (t,):
                raise ValueError(f"MoeRoute: forced {tuple(fi.shape)}, forced_rows "
                                 f"{tuple(fr.shape)} for {t} rows of {k} experts")
        if t:
            _call("rt_cuda_moe_route", _ptr(lg), t, e, k, int(bool(norm_topk_prob)), _ptr(fi),
                  _ptr(fr), _ptr(ids), _ptr(weights), _stream())
        ctx.save_for_backward(logits, ids)
        ctx.norm_topk_prob = bool(norm_topk_prob)
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, grad_ids, grad_weights):
        logits, ids = ctx.saved_tensors
        g = None
        if grad_weights is not None:
            g = moe_route_backward(logits, ids, ctx.norm_topk_prob, grad_weights).to(logits.dtype)
        return g, None, None, None, None


class MoeExperts(torch.autograd.Function):
    """The experts of one MoE layer before the combine (rt_cuda_moe_experts: EnqueueMoe's
    grouping, gate/up, SiLU * up and down): xn bf16 [t, h], ids int32 [t, k], w_gate_up bf16
    [e, 2 i, h] (each expert's gate rows, then its up rows), w_down bf16 [e, h, i] -> (y fp32
    [t k, h] in grouped order, slots int32 [t k]: assignment t * k + j -> its row of y).
    Backward: expert_mlp_backward."""

    @staticmethod
    def forward(ctx, xn, ids, w_gate_up, w_down):
        xc = _need(xn, "xn", torch.bfloat16)
        idc = _need(ids, "ids", torch.int32)
        wgu = _need(w_gate_up, "experts' gate_up", torch.bfloat16)
        wd = _need(w_down, "experts' down", torch.bfloat16)
        (t, h), k = xc.shape, idc.shape[1]
        e, inter = wgu.shape[0], wgu.shape[1] // 2
        a, dev = t * k, xc.device
        buf = torch.zeros(int(lib().rt_cuda_moe_grouping_ints(e, a)), dtype=torch.int32,
                          device=dev)
        gate_up = torch.empty(a, 2 * inter, dtype=torch.bfloat16, device=dev)
        act = torch.empty(a, inter, dtype=torch.bfloat16, device=dev)
        y = torch.empty(a, h, dtype=torch.float32, device=dev)
        if a:
            _call("rt_cuda_moe_experts", _ptr(xc), t, h, inter, e, k, _ptr(idc), _ptr(wgu),
                  _ptr(wd), _ptr(buf), _ptr(gate_up), _ptr(act), _ptr(y), _stream())
        g = grouping_views(buf, e, a)
        slots = g["slots"].clone()
        ctx.save_for_backward(xn, w_gate_up, w_down, gate_up, act, g["rows"],
                              g["expert_offsets"])
        ctx.mark_non_differentiable(slots)
        return y, slots

    @staticmethod
    def backward(ctx, grad_y, grad_slots):
        xn, w_gate_up, w_down, gate_up, act, rows, offsets = ctx.saved_tensors
        gxn, g_gate_up, g_down = expert_mlp_backward(xn, rows, offsets.tolist(), gate_up, act,
                                                     w_gate_up, w_down, grad_y)
        return gxn.to(xn.dtype), None, g_gate_up, g_down


class MoeCombine(torch.autograd.Function):
    """x + the combine (cuda::MoeCombine): x fp32 [t, h], y fp32 [t k, h] in grouped order,
    slots int32 [t k], weights fp32 [t, k] -> a new fp32 [t, h], out[t] = x[t] + (sum over
    ranks j in order of weights[t, j] y[slots[t k + j]], one fma each from 0).
    Backward: moe_combine_backward."""

    @staticmethod
    def forward(ctx, x, y, slots, weights):
        out = _need(x, "x", torch.float32).clone()
        yc = _need(y, "y", torch.float32)
        sc = _need(slots, "slots", torch.int32)
        wc = _need(weights, "weights", torch.float32)
        (t, h), k = out.shape, wc.shape[1]
        if t:
            _call("rt_cuda_moe_combine", _ptr(yc), _ptr(sc), _ptr(wc), t, k, h, _ptr(out),
                  _stream())
        ctx.save_for_backward(y, slots, weights)
        return out

    @staticmethod
    def backward(ctx, g):
        y, slots, weights = ctx.saved_tensors
        (t, k), h = weights.shape, y.shape[1]
        s = slots.long()
        gy_a, gw = moe_combine_backward(y[s].reshape(t, k, h), weights, g)
        gy = torch.empty(y.shape, dtype=gy_a.dtype, device=y.device)
        gy[s] = gy_a.reshape(t * k, h)
        return g, gy.to(y.dtype), None, gw.to(weights.dtype)
