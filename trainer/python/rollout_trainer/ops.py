"""The CPU backend's kernels as torch ops, with plain-torch backwards.

Each op's forward runs the server's kernel (librollout_trainer_ops.so) on float32 CPU tensors, so
its bits are the server's by construction. Its backward is the gradient of the same function
written in plain torch (`reference_*`, any float dtype): the reference is recomputed from the
saved inputs under autograd and differentiated (activation recompute of the op's forward), so
gradients are correct, not bitwise. The reference functions are also the float64 model the
tests check gradients against.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import _lib


def _f32(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{name}: float32 CPU tensor expected, got {t.dtype} on {t.device}")
    return t.detach().contiguous()


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


# --- plain-torch references (the backwards differentiate these) ---

def reference_matmul(x, w, bias=None):
    y = x @ w.t()
    return y if bias is None else y + bias


def reference_rms_norm(x, w, eps: float):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def reference_rope(x, cos, sin):
    """x [t, heads, head_dim], cos/sin [t, head_dim / 2], rotate_half layout."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def reference_silu_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_add(x, y):
    return x + y


def reference_attention(q, k, v, cu_seqlens, scale: float):
    """Causal attention per packed sequence; q [t, h, d], k/v [t, kv, d]."""
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    outs = []
    for b in range(len(cu_seqlens) - 1):
        s, e = int(cu_seqlens[b]), int(cu_seqlens[b + 1])
        qs = q[s:e]
        ks = k[s:e].repeat_interleave(group, dim=1)
        vs = v[s:e].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        n = e - s
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
    return torch.cat(outs, dim=0)


def reference_log_softmax(logits, temperature: float):
    t = temperature if temperature > 0 else 1.0
    return torch.log_softmax(logits / t, dim=-1)


# --- kernels (forward only, no autograd) ---

def _k_matmul(x, w, bias=None, *, segmented=False):
    x, w = _f32(x, "x"), _f32(w, "w")
    bias = None if bias is None else _f32(bias, "bias")
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"matmul shapes x {tuple(x.shape)} w {tuple(w.shape)}")
    y = torch.empty(m, n, dtype=torch.float32)
    fn = _lib.lib().rt_segmented_matmul if segmented else _lib.lib().rt_matmul
    fn(_ptr(x), m, k, _ptr(w), n, _ptr(bias), _ptr(y))
    return y


def _k_rms_norm(x, w, *, eps):
    x, w = _f32(x, "x"), _f32(w, "weight")
    dim = x.shape[-1]
    if w.shape != (dim,):
        raise ValueError(f"rms_norm weight {tuple(w.shape)} for rows of {dim}")
    y = torch.empty_like(x)
    _lib.lib().rt_rms_norm(_ptr(x), _ptr(w), x.numel() // dim, dim, eps, _ptr(y))
    return y


def _k_rope(x, cos, sin):
    y = _f32(x, "x").clone()
    cos, sin = _f32(cos, "cos"), _f32(sin, "sin")
    t, heads, hd = y.shape
    _lib.lib().rt_apply_rope(_ptr(y), _ptr(cos), _ptr(sin), t, heads, hd)
    return y


def _k_silu_mul(gate_up):
    gate_up = _f32(gate_up, "gate_up")
    rows, two_dim = gate_up.shape
    out = torch.empty(rows, two_dim // 2, dtype=torch.float32)
    _lib.lib().rt_silu_mul(_ptr(gate_up), rows, two_dim // 2, _ptr(out))
    return out


def _k_add(x, y):
    out = _f32(x, "x").clone()
    y = _f32(y, "y")
    if y.shape != out.shape:
        raise ValueError(f"add shapes {tuple(out.shape)} and {tuple(y.shape)}")
    _lib.lib().rt_add(_ptr(out), _ptr(y), out.numel())
    return out


def _k_attention(q, k, v, positions, starts, *, scale):
    q, k, v = _f32(q, "q"), _f32(k, "k"), _f32(v, "v")
    positions = positions.to(torch.int32).contiguous()
    starts = starts.to(torch.int32).contiguous()
    t, heads, hd = q.shape
    kv_heads = k.shape[1]
    if heads % kv_heads != 0 or k.shape != (t, kv_heads, hd) or v.shape != k.shape:
        raise ValueError(f"attention shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                         f"v {tuple(v.shape)}")
    out = torch.empty_like(q)
    _lib.lib().rt_attention(_ptr(q), _ptr(k), _ptr(v), _ptr(positions), _ptr(starts), t, heads,
                            kv_heads, hd, scale, _ptr(out))
    return out


def _k_log_softmax(logits, *, temperature):
    logits = _f32(logits, "logits")
    rows, vocab = logits.shape
    out = torch.empty_like(logits)
    _lib.lib().rt_log_softmax(_ptr(logits), rows, vocab, temperature, _ptr(out))
    return out


class _KernelOp(torch.autograd.Function):
    """forward: kernel(*tensors, **kw); backward: autograd of reference(*tensors, **ref_kw)."""

    @staticmethod
    def forward(ctx, kernel: Callable, reference: Callable, kw: dict, ref_kw: dict, *tensors):
        ctx.reference, ctx.ref_kw = reference, ref_kw
        ctx.save_for_backward(*tensors)
        return kernel(*tensors, **kw)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[4:]
        with torch.enable_grad():
            inputs = [t.detach().requires_grad_(True) if need else t
                      for t, need in zip(saved, needs)]
            out = ctx.reference(*inputs, **ctx.ref_kw)
            wanted = [i for i, need in enumerate(needs) if need]
            grads = torch.autograd.grad(out, [inputs[i] for i in wanted], grad)
        result = [None] * len(saved)
        for i, g in zip(wanted, grads):
            result[i] = g
        return (None, None, None, None, *result)


def _apply(kernel, reference, kw, ref_kw, *tensors):
    return _KernelOp.apply(kernel, reference, kw, ref_kw, *tensors)


# --- the ops ---

def matmul(x, w, bias=None):
    """y = x @ w.T (+ bias): the CPU's Dot order (q/k/v, gate/up, lm_head)."""
    return _apply(_k_matmul, reference_matmul, {}, {}, x, w, bias)


def row_parallel_matmul(x, w, bias=None):
    """y = x @ w.T (+ bias) through the canonical K tree of eight segments (o_proj, down_proj),
    the server's reduction at every tensor-parallel degree."""
    return _apply(lambda a, b, c: _k_matmul(a, b, c, segmented=True), reference_matmul, {}, {},
                  x, w, bias)


def rms_norm(x, w, eps: float):
    """Per row of the last dimension: x / sqrt(mean(x^2) + eps) * w."""
    return _apply(_k_rms_norm, reference_rms_norm, {"eps": eps}, {"eps": eps}, x, w)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [t, head_dim / 2] of default RoPE at `positions` (model/rope.h's RopeCosSin)."""
    positions = positions.to(torch.int32).contiguous()
    n = positions.numel()
    cos = torch.empty(n, head_dim // 2, dtype=torch.float32)
    sin = torch.empty_like(cos)
    _lib.lib().rt_rope_cos_sin(theta, head_dim, _ptr(positions), n, _ptr(cos), _ptr(sin))
    return cos, sin


def rope(x, cos, sin):
    """Rotary embedding of x [t, heads, head_dim] (rotate_half layout)."""
    return _apply(_k_rope, reference_rope, {}, {}, x, cos, sin)


def silu_mul(gate_up):
    """silu(gate) * up for gate_up [rows, 2 * dim] holding gate then up."""
    return _apply(_k_silu_mul, reference_silu_mul, {}, {}, gate_up)


def add(x, y):
    """The residual add, in float32 as the server's."""
    return _apply(_k_add, reference_add, {}, {}, x, y)


def packed_positions(cu_seqlens: torch.Tensor):
    """(positions, starts) [t] of packed sequences bounded by cu_seqlens [b + 1]."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    starts = torch.repeat_interleave(cu_seqlens[:-1].to(torch.int64), lens)
    positions = torch.arange(int(cu_seqlens[-1]), dtype=torch.int64) - starts
    return positions, starts


def attention(q, k, v, cu_seqlens, scale: float):
    """Causal attention over packed variable-length sequences (cu_seqlens [b + 1], from 0):
    q [t, heads, head_dim], k/v [t, kv_heads, head_dim]; the server's per-row arithmetic."""
    positions, starts = packed_positions(cu_seqlens)
    return _apply(lambda a, b, c: _k_attention(a, b, c, positions, starts, scale=scale),
                  reference_attention, {}, {"cu_seqlens": cu_seqlens, "scale": scale}, q, k, v)


def log_softmax(logits, temperature: float):
    """log_softmax(logits / T) per row, the sampler's definition (T <= 0 means 1)."""
    return _apply(_k_log_softmax, reference_log_softmax, {"temperature": temperature},
                  {"temperature": temperature}, logits)


# --- MoE ---
# The CPU runner's mixture-of-experts layer (runner/cpu/cpu_moe_layer.cc): router logits by
# `matmul`, each token's routing (`moe_route`), each expert's MLP on the rows routed to it
# (`expert_mlp`), the top-k outputs combined in rank order (`moe_combine`).

def reference_moe_weights(logits, ids, norm_topk_prob: bool):
    """The expert weights of a routing: softmax(logits) at ids [t, k] (rank order), divided by
    their sum with norm_topk_prob. The selection `ids` is a constant: a gradient flows to the
    logits through these weights only."""
    w = torch.softmax(logits, dim=-1).gather(-1, ids.long())
    return w / w.sum(-1, keepdim=True) if norm_topk_prob else w


def reference_moe_choose(logits, k: int):
    """Plain torch's choice of k experts per row (torch.topk of the softmax; its ties are
    unspecified): the reference forward's routing where none is given. int64 [t, k]."""
    return torch.topk(torch.softmax(logits.detach(), dim=-1), k, dim=-1).indices


def reference_moe_combine(y, weights):
    """out[r] = sum_j weights[r, j] * y[r, j]: y [t, k, dim], weights [t, k]."""
    return (weights.unsqueeze(-1) * y).sum(1)


def reference_expert_mlp(x, gate_up, down):
    """One SwiGLU expert: down(silu(gate x) * up x); gate_up [2 * inter, hidden] holds its gate
    rows then its up rows, down [hidden, inter]."""
    return reference_matmul(reference_silu_mul(reference_matmul(x, gate_up)), down)


def _check_routing(forced, forced_rows, t: int, k: int, num_experts: int):
    if forced.shape != (t, k) or forced_rows.shape != (t,):
        raise ValueError(f"moe_route: forced {tuple(forced.shape)} and forced_rows "
                         f"{tuple(forced_rows.shape)} for {t} rows of {k} experts")
    rows = forced[forced_rows]
    bad = (rows < 0) | (rows >= num_experts)
    if bool(bad.any()):
        r = int(forced_rows.nonzero()[bad.any(1).nonzero()[0, 0], 0])
        raise ValueError(f"moe_route: row {r} replays expert ids {forced[r].tolist()}, "
                         f"outside [0, {num_experts})")
    if k > 1:
        s = rows.sort(-1).values
        twice = (s[:, 1:] == s[:, :-1]).any(1)
        if bool(twice.any()):
            r = int(forced_rows.nonzero()[twice.nonzero()[0, 0], 0])
            raise ValueError(f"moe_route: row {r} replays expert ids {forced[r].tolist()}: "
                             "an expert twice")


def _k_moe_route(logits, forced, forced_rows, *, k, norm_topk_prob):
    logits = _f32(logits, "router logits")
    t, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"moe_route: k = {k} of {num_experts} experts")
    ids = torch.empty(t, k, dtype=torch.int32)
    weights = torch.empty(t, k, dtype=torch.float32)
    rows_u8 = None
    if forced is not None:
        forced = forced.to(torch.int32).contiguous()
        forced_rows = forced_rows.to(torch.bool).contiguous()
        _check_routing(forced, forced_rows, t, k, num_experts)
        rows_u8 = forced_rows.to(torch.uint8)
    _lib.lib().rt_moe_route(_ptr(logits), t, num_experts, k, int(norm_topk_prob), _ptr(forced),
                            _ptr(rows_u8), _ptr(ids), _ptr(weights))
    return ids, weights


class _MoeRoute(torch.autograd.Function):
    """forward: cpu::RouteToken per row; backward: autograd of reference_moe_weights at the
    chosen ids (the selection is constant)."""

    @staticmethod
    def forward(ctx, logits, forced, forced_rows, k, norm_topk_prob):
        ids, weights = _k_moe_route(logits, forced, forced_rows, k=k,
                                    norm_topk_prob=norm_topk_prob)
        ctx.norm_topk_prob = norm_topk_prob
        ctx.save_for_backward(logits, ids)
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, grad_ids, grad_weights):
        logits, ids = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(reference_moe_weights(x, ids, ctx.norm_topk_prob), [x],
                                       grad_weights)
        return g, None, None, None, None


def moe_route(logits, k: int, norm_topk_prob: bool, forced=None, forced_rows=None):
    """Each row's routing from its router logits [t, num_experts]: (ids int32 [t, k] in rank
    order -- router probability descending, ties to the lower expert id --, weights [t, k] fp32,
    the probabilities at those ids, renormalised over them with norm_topk_prob), the server's
    RouteToken bit for bit. forced [t, k] with forced_rows bool [t]: those rows replay the given
    ids instead of choosing (weights are then the probabilities at them). ValueError for a
    replayed id outside [0, num_experts) or given twice in a row."""
    if forced is not None and forced_rows is None:
        forced_rows = torch.ones(logits.shape[0], dtype=torch.bool)
    return _MoeRoute.apply(logits, forced, forced_rows, int(k), bool(norm_topk_prob))


def _k_moe_combine(y, weights):
    y, weights = _f32(y, "y"), _f32(weights, "weights")
    t, k, dim = y.shape
    if weights.shape != (t, k):
        raise ValueError(f"moe_combine: y {tuple(y.shape)} weights {tuple(weights.shape)}")
    out = torch.empty(t, dim, dtype=torch.float32)
    _lib.lib().rt_moe_combine(_ptr(y), _ptr(weights), t, k, dim, _ptr(out))
    return out


def moe_combine(y, weights):
    """out [t, dim] = each row's top-k expert outputs y [t, k, dim] weighted by weights [t, k],
    summed in rank order j = 0..k-1 from +0 with one fma each (cpu::CombineExperts)."""
    return _apply(_k_moe_combine, reference_moe_combine, {}, {}, y, weights)


def _k_expert_mlp(x, gate_up, down):
    return _k_matmul(_k_silu_mul(_k_matmul(x, gate_up)), down, segmented=True)


def expert_mlp(x, gate_up, down):
    """One expert on its rows x [n, hidden]: gate/up by cpu::MatMul, SiluMul, down by the
    canonical K tree (cpu::SegmentedMatMul), as MoeBlock at TP 1. Each row is its own Dots: how
    many rows an expert gets changes no bit of any of them."""
    return _apply(_k_expert_mlp, reference_expert_mlp, {}, {}, x, gate_up, down)


# --- TP ---
# The canonical K tree of the row-parallel layers split over trainer ranks, as a server rank
# splits it: a rank's node of the tree from its K slice (segmented_partial_matmul), the ranks'
# nodes folded by the tree's top levels (combine_partials). rollout_trainer.tp gathers the nodes.

_NUM_K_SEGMENTS = 8  # cpu::kNumKSegments
_tp_bound = False


def _tp_lib():
    """The library with the TP entry points' signatures declared (trainer_ops.cc, `--- TP ---`)."""
    global _tp_bound
    l = _lib.lib()
    if not _tp_bound:
        i64, i32, p = _lib._i64, _lib._i32, _lib._p
        l.rt_segmented_partial_matmul.argtypes = [p, i64, p, i64, i64, i32, i32, p]
        l.rt_segmented_partial_matmul.restype = None
        l.rt_combine_partials.argtypes = [p, i32, i64, p]
        l.rt_combine_partials.restype = None
        l.rt_is_canonical_segment_block.argtypes = [i32, i32]
        l.rt_is_canonical_segment_block.restype = i32
        _tp_bound = True
    return l


def k_segment_begin(k: int, s: int) -> int:
    """First K index of canonical segment s of a reduction of length k (cpu::KSegmentBegin)."""
    return k * s // _NUM_K_SEGMENTS


def reference_combine_partials(parts):
    """The tree's root from parts [num_parts, ...]: mathematically their sum."""
    return parts.sum(0)


def _k_segmented_partial_matmul(x, w, *, k_full, seg_begin, seg_end):
    x, w = _f32(x, "x"), _f32(w, "w")
    if not _tp_lib().rt_is_canonical_segment_block(seg_begin, seg_end):
        raise ValueError(f"segments [{seg_begin}, {seg_end}) are not a node of the 8-leaf tree")
    k_slice = k_segment_begin(k_full, seg_end) - k_segment_begin(k_full, seg_begin)
    m, n = x.shape[0], w.shape[0]
    if x.shape != (m, k_slice) or w.shape != (n, k_slice):
        raise ValueError(f"partial matmul of segments [{seg_begin}, {seg_end}) of K {k_full}: "
                         f"x {tuple(x.shape)} w {tuple(w.shape)}, K slice {k_slice} expected")
    y = torch.empty(m, n, dtype=torch.float32)
    _tp_lib().rt_segmented_partial_matmul(_ptr(x), m, _ptr(w), n, k_full, seg_begin, seg_end,
                                          _ptr(y))
    return y


def _k_combine_partials(parts):
    parts = _f32(parts, "parts")
    num_parts = parts.shape[0]
    if num_parts not in (1, 2, 4, 8):
        raise ValueError(f"combine_partials of {num_parts} parts (1, 2, 4 or 8)")
    y = torch.empty(parts.shape[1:], dtype=torch.float32)
    _tp_lib().rt_combine_partials(_ptr(parts), num_parts, y.numel(), _ptr(y))
    return y


def segmented_partial_matmul(x, w, k_full: int, seg_begin: int, seg_end: int):
    """The node over canonical segments [seg_begin, seg_end) of x @ w.T for a reduction of full
    length k_full, from the node's K columns alone: x [m, k_slice], w [n, k_slice] (a rank's
    shard of a row-parallel layer's input and weight)."""
    kw = {"k_full": k_full, "seg_begin": seg_begin, "seg_end": seg_end}
    return _apply(_k_segmented_partial_matmul, reference_matmul, kw, {}, x, w)


def combine_partials(parts):
    """parts [num_parts, ...], the tree's nodes of ranks 0 .. num_parts - 1 (num_parts = 1, 2,
    4, 8) -> their root [...]: adjacent pairs level by level, the server's fold."""
    return _apply(_k_combine_partials, reference_combine_partials, {}, {}, parts)
