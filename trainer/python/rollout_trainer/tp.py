"""Trainer-side tensor parallelism on the CPU kernels (torch.distributed, gloo): Qwen3Model
sharded Megatron-style over a process group, every rank's logprobs bit for bit TP 1's -- so bit
for bit what a CPU server at any --tp streams and scores (D10: trainer TP k == rollout TP m).

Rank r of tp holds (ShardOf in model/tensor_parallel.cc, the server's split):
- column-parallel: q_proj rows of its query heads [r * H / tp, (r + 1) * H / tp); k_proj, v_proj
  rows of its KV heads (split, or -- fewer KV heads than ranks -- the one its query heads read,
  replicated); gate_proj, up_proj rows [r * I / tp, (r + 1) * I / tp);
- row-parallel: o_proj and down_proj columns of the same K ranges. K = H * head_dim (or I) cut
  into the canonical 8 segments: the rank's range is exactly the aligned block of 8 / tp
  segments under one node of the K tree, whose value it computes (ops.segmented_partial_matmul,
  cpu::SegmentedPartialMatMul); the nodes are all-gathered in rank order and every rank folds
  them by the tree's top levels (ops.combine_partials, cpu::CombinePartials) -- the
  floating-point operations of TP 1's cpu::SegmentedMatMul in its order, as a server rank does;
- vocab-parallel: embed_tokens and lm_head rows [r * V', (r + 1) * V'), V' = ceil(V / tp). The
  embedding rows are gathered and selected (never summed: the exact rows); the logits columns
  are gathered into full rows and log_softmax runs on every rank over the whole row as at TP 1;
- replicated: the RMSNorm weights (q_norm and k_norm too).

Gradients (each piece a torch.autograd.Function or plain torch, correct not bitwise):
- copy_to_tp before every column-parallel GEMM (lm_head included): identity forward, backward
  all-reduce(sum) of the input's gradient (each rank's shard contributes its part: Megatron's f);
- an all-gather's backward is the rank's slice of the gradient, not a sum: all that follows a
  gather runs identically on every rank (one loss, replicated), so each rank already holds the
  whole gradient of that one loss, and a sum would count it tp times;
- weights a rank applies to its part only -- q_norm and k_norm (to its heads), replicated KV
  heads (to its query heads) -- get their gradient summed over the ranks holding them.
So a rank's parameter gradients are the slices of TP 1's (all-reduce order aside).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Dict, Optional

import numpy as np
import torch
import torch.distributed as dist

from . import ops
from .contract import check_contract, check_trainer_tensor_parallel
from .model import Qwen3Model, _read_safetensors

_NUM_K_SEGMENTS = 8


@dataclasses.dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `tp` holds: query heads from head_begin, KV heads from kv_head_begin,
    intermediate features from inter_begin, vocab rows [vocab_begin, vocab_end) of shards of
    vocab_rows."""
    tp: int
    rank: int
    heads: int
    head_begin: int
    kv_heads: int
    kv_head_begin: int
    inter: int
    inter_begin: int
    vocab_rows: int
    vocab_begin: int
    vocab_end: int
    kv_heads_total: int  # the model's

    @property
    def kv_replicated(self) -> bool:
        """Fewer KV heads than ranks: ranks share (hold copies of) a KV head."""
        return self.kv_heads * self.tp != self.kv_heads_total

    @property
    def segments(self):
        """The node of the canonical K tree this rank computes: segments [begin, end)."""
        n = _NUM_K_SEGMENTS // self.tp
        return self.rank * n, (self.rank + 1) * n


def shard_of(config: dict, tp: int, rank: int) -> RankShard:
    """Rank `rank`'s shard of the model of `config` (config.json) at degree tp.
    REQUIRES check_trainer_tensor_parallel(config, tp) passes."""
    heads = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads", heads))
    inter = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    if nkv >= tp:
        kv_heads, kv_begin = nkv // tp, rank * (nkv // tp)
    else:  # fewer KV heads than ranks: the one its query heads read
        kv_heads, kv_begin = 1, rank // (tp // nkv)
    rows = -(-vocab // tp)
    return RankShard(tp=tp, rank=rank, heads=heads // tp, head_begin=rank * (heads // tp),
                     kv_heads=kv_heads, kv_head_begin=kv_begin, inter=inter // tp,
                     inter_begin=rank * (inter // tp), vocab_rows=rows,
                     vocab_begin=min(vocab, rank * rows), vocab_end=min(vocab, (rank + 1) * rows),
                     kv_heads_total=nkv)


def shard_index(name: str, shard: RankShard, config: dict) -> Optional[tuple]:
    """The part of the Hugging Face tensor `name` that `shard` holds (a tuple of slices), None
    for a replicated tensor."""
    hd = int(config.get("head_dim") or int(config["hidden_size"]) // int(
        config["num_attention_heads"]))
    all_ = slice(None)
    q = slice(shard.head_begin * hd, (shard.head_begin + shard.heads) * hd)
    kv = slice(shard.kv_head_begin * hd, (shard.kv_head_begin + shard.kv_heads) * hd)
    inter = slice(shard.inter_begin, shard.inter_begin + shard.inter)
    vocab = slice(shard.vocab_begin, shard.vocab_end)
    for suffix, index in (("self_attn.q_proj.weight", (q,)), ("self_attn.k_proj.weight", (kv,)),
                          ("self_attn.v_proj.weight", (kv,)),
                          ("self_attn.o_proj.weight", (all_, q)),
                          ("mlp.gate_proj.weight", (inter,)), ("mlp.up_proj.weight", (inter,)),
                          ("mlp.down_proj.weight", (all_, inter)),
                          ("model.embed_tokens.weight", (vocab,)), ("lm_head.weight", (vocab,))):
        if name.endswith(suffix):
            return index
    return None


def full_shape(config: dict, name: str) -> Optional[tuple]:
    """The unsharded shape of the Hugging Face tensor `name` that tensor parallelism cuts
    (shard_index not None), from config.json; None for the others."""
    h = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv = int(config.get("num_key_value_heads", heads))
    hd = int(config.get("head_dim") or h // heads)
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    for suffix, shape in (("q_proj.weight", (heads * hd, h)), ("k_proj.weight", (kv * hd, h)),
                          ("v_proj.weight", (kv * hd, h)), ("o_proj.weight", (h, heads * hd)),
                          ("gate_proj.weight", (inter, h)), ("up_proj.weight", (inter, h)),
                          ("down_proj.weight", (h, inter)), ("embed_tokens.weight", (vocab, h)),
                          ("lm_head.weight", (vocab, h))):
        if name.endswith(suffix):
            return shape
    return None


def check_shards(config: dict, shard: RankShard, tensors) -> None:
    """Raises ValueError naming the first of `tensors` (name -> tensor) that is not `shard`'s
    part of its weight."""
    for name, t in tensors.items():
        index = shard_index(name, shard, config)
        if index is None:
            continue
        want = _sliced_shape(full_shape(config, name), index)
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: shard {tuple(t.shape)}, rank {shard.rank} of {shard.tp} "
                             f"holds {want}")


def _sliced_shape(shape, index) -> tuple:
    """The shape of a tensor of `shape` indexed by `index` (slices), without making one."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(len(range(*i.indices(n))) for i, n in zip(index, shape))


# --- collectives with their backwards ---
# On CPU tensors (gloo) or CUDA tensors (nccl, or gloo through host memory: gloo all-gathers
# CPU tensors only). Values are moved, never recomputed: the bits are the same either way.

def _through_host(x: torch.Tensor, group) -> bool:
    return x.is_cuda and dist.get_backend(group) == "gloo"


def _gather_list(x: torch.Tensor, group) -> list:
    """Every rank's x (same shape), in rank order, on x's device."""
    x = x.contiguous()
    src = x.cpu() if _through_host(x, group) else x
    parts = [torch.empty_like(src) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, src, group=group)
    return [p.to(x.device) for p in parts] if src is not x else parts


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of every rank's x (a new tensor on x's device; gradients only: the order of the
    sum is the backend's)."""
    if _through_host(x, group):
        buf = x.detach().cpu().clone()
        dist.all_reduce(buf, group=group)
        return buf.to(x.device)
    buf = x.contiguous().clone()
    dist.all_reduce(buf, group=group)
    return buf


class _CopyToTp(torch.autograd.Function):
    """Identity; backward: the gradient all-reduced (summed) over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _AllGather(torch.autograd.Function):
    """x [...] of each rank -> [tp, ...] in rank order; backward: the rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank = dist.get_rank(group)
        return torch.stack(_gather_list(x, group))

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.rank].contiguous(), None


class _SumOverHolders(torch.autograd.Function):
    """Identity on a weight that ranks hold as copies and apply to their own part of the work
    (`slot` of `slots` names which copy: ranks of one slot hold the same tensor); backward: the
    gradient summed over the ranks of the slot. rows (begin, end): only those rows of w are the
    copies (a fused weight's replicated KV rows); the other rows' gradient is the rank's own."""

    @staticmethod
    def forward(ctx, w, slot: int, slots: int, group, rows=None):
        ctx.slot, ctx.slots, ctx.group, ctx.rows = slot, slots, group, rows
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        b, e = ctx.rows if ctx.rows is not None else (0, grad.shape[0])
        part = grad[b:e]
        buf = torch.zeros((ctx.slots,) + tuple(part.shape), dtype=grad.dtype, device=grad.device)
        buf[ctx.slot] = part
        summed = _all_reduce(buf, ctx.group)[ctx.slot]
        if ctx.rows is None:
            return summed, None, None, None, None
        out = grad.clone()
        out[b:e] = summed
        return out, None, None, None, None


def copy_to_tp(x, group):
    return _CopyToTp.apply(x, group)


def sum_over_holders(w, slot: int, slots: int, group, rows=None):
    """w, whose gradient is summed over the ranks holding copy `slot` of `slots` (rows: of
    those rows only); _SumOverHolders."""
    return _SumOverHolders.apply(w, slot, slots, group, rows)


def all_gather(x, group):
    return _AllGather.apply(x, group)


def gather_vocab_columns(local, vocab: int, group):
    """The full logits rows [t, vocab] on every rank from each rank's vocab-parallel columns
    local [t, vocab_rows] (its rows of the head, the last rank's padded), gathered in rank
    order."""
    gathered = all_gather(local, group)  # [tp, t, vocab_rows]
    tp, t, rows = gathered.shape
    return gathered.permute(1, 0, 2).reshape(t, tp * rows)[:, :vocab]


def combine(gathered):
    """The ranks' nodes [tp, ...] -> the tree's root. (The fold; a module-level name so that
    tests can swap in a wrong order and see the bits change.)"""
    return ops.combine_partials(gathered)


def row_parallel_matmul(x, w, k_full: int, shard: RankShard, group):
    """y = x_full @ w_full.T through the canonical K tree: x [m, k_slice], w [n, k_slice] the
    rank's K columns; y [m, n] on every rank, TP 1's bits."""
    seg_begin, seg_end = shard.segments
    node = ops.segmented_partial_matmul(x, w, k_full, seg_begin, seg_end)
    return combine(all_gather(node, group))


def gather_full_weights(named_weights, config: dict, shard: RankShard, group):
    """(Hugging Face name, full tensor) pairs from a rank's (name, shard) pairs, every sharded
    tensor all-gathered from the ranks of `group` (a collective: every rank calls it, each gets
    the whole model), on the shards' device."""
    shards = [shard_of(config, shard.tp, r) for r in range(shard.tp)]
    for name, p in named_weights:
        mine = shard_index(name, shard, config)
        if mine is None:
            yield name, p.detach()
            continue
        full = torch.empty(full_shape(config, name), dtype=p.dtype, device=p.device)
        biggest = max(_sliced_shape(full.shape, shard_index(name, s, config)) for s in shards)
        padded = torch.zeros(biggest, dtype=p.dtype, device=p.device)
        padded[tuple(slice(0, n) for n in p.shape)] = p.detach()
        for s, part in zip(shards, _gather_list(padded, group)):
            view = full[shard_index(name, s, config)]
            view.copy_(part[tuple(slice(0, n) for n in view.shape)])
        yield name, full


class TpQwen3Model(Qwen3Model):
    """Qwen3Model sharded over `tp_group` (a torch.distributed group, gloo: CPU tensors); every
    rank of the group runs the same calls with the same inputs (collectives inside). Parameters
    hold the rank's shards under their Hugging Face names (shard_index says which part). One
    thread of each rank's process drives it, as torch.distributed requires of a group's calls."""

    def __init__(self, config: dict, shards: Dict[str, torch.Tensor], tp_group):
        check_trainer_tensor_parallel(config, dist.get_world_size(tp_group))
        super().__init__(config, shards)
        self.tp_group = tp_group
        self.tp = dist.get_world_size(tp_group)
        self.shard = shard_of(config, self.tp, dist.get_rank(tp_group))
        self.intermediate = int(config["intermediate_size"])
        for name, key in self._names.items():
            index = shard_index(name, self.shard, config)
            want = _sliced_shape(self._full_shape(name), index) if index else None
            if want is not None and tuple(self.params[key].shape) != want:
                raise ValueError(f"{name}: shard {tuple(self.params[key].shape)}, rank "
                                 f"{self.shard.rank} of {self.tp} holds {tuple(want)}")

    def _full_shape(self, name: str):
        return full_shape(self.config, name) or tuple(self.weight(name).shape)

    @classmethod
    def from_pretrained(cls, path: str, contract=None, tp_group=None) -> "TpQwen3Model":
        """Rank dist.get_rank(tp_group)'s shards of the checkpoint at `path` (only those are
        read); tp_group None is the default (world) group. contract: as Qwen3Model's (the
        server's TP degree is its own; this model's is the group's size)."""
        if tp_group is None:
            tp_group = dist.group.WORLD
        if contract is not None:
            check_contract(contract)
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        tp = dist.get_world_size(tp_group)
        check_trainer_tensor_parallel(config, tp)
        shard = shard_of(config, tp, dist.get_rank(tp_group))
        tensors = _read_safetensors(path, lambda name, _: shard_index(name, shard, config))
        model = cls(config, tensors, tp_group)
        model._check_against(contract, config)
        return model

    def load_weights(self, named_tensors) -> None:
        """Replaces weights in place from full (unsharded) tensors: the rank takes its shard."""
        self.load_shards((name, t[shard_index(name, self.shard, self.config) or ()])
                         for name, t in named_tensors)

    def load_shards(self, named_tensors) -> None:
        """Replaces weights in place from tensors already cut to this rank's shard."""
        super().load_weights(named_tensors)

    def full_named_weights(self):
        """(Hugging Face name, full tensor) pairs, gathered from every rank (a collective: every
        rank must call it; each gets the whole model): what RolloutClient.update_weights takes."""
        return gather_full_weights(self.named_weights(), self.config, self.shard, self.tp_group)

    # --- forward ---

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        # Each rank fills the rows of the tokens it owns; the gathered rows are selected, so x
        # is exactly the embedding row (as the server's vocab-parallel embedding).
        s, t = self.shard, tokens.numel()
        ids = tokens.long()
        table = self.weight("model.embed_tokens.weight")  # [vocab_end - vocab_begin, hidden]
        own = (ids >= s.vocab_begin) & (ids < s.vocab_end)
        if s.vocab_end > s.vocab_begin:
            rows = table[(ids - s.vocab_begin).clamp(0, s.vocab_end - s.vocab_begin - 1)]
            local = torch.where(own[:, None], rows, torch.zeros((), dtype=rows.dtype))
        else:  # a tiny vocabulary leaves the last ranks none
            local = torch.zeros(t, self.hidden, dtype=torch.float32)
        gathered = all_gather(local, self.tp_group)  # [tp, t, hidden]
        return gathered[ids // s.vocab_rows, torch.arange(t)]

    def hidden_states(self, tokens, cu_seqlens, reference_dtype=None, mlp_context=None):
        if mlp_context is not None:
            raise ValueError("mlp_context: trainer TP serves the dense Qwen3 MLP only")
        if reference_dtype is not None:
            raise ValueError("reference_dtype: the plain-torch reference runs unsharded "
                             "(Qwen3Model)")
        s, g = self.shard, self.tp_group
        t, hd = tokens.numel(), self.head_dim
        positions, _ = ops.packed_positions(cu_seqlens)
        cos, sin = ops.rope_cos_sin(positions, hd, self.theta)
        scale = float(np.float32(1.0) / np.sqrt(np.float32(hd)))  # as Qwen3Model's
        kv_slots = self.kv_heads if s.kv_replicated else 1
        kv_slot = s.kv_head_begin if s.kv_replicated else 0
        x = self._embed(tokens)
        for i in range(self.num_layers):
            w = self._layer_weights(i)
            wk, wv = w["k"], w["v"]
            if s.kv_replicated:
                wk = sum_over_holders(wk, kv_slot, kv_slots, g)
                wv = sum_over_holders(wv, kv_slot, kv_slots, g)
            qn = sum_over_holders(w["qn"], 0, 1, g)
            kn = sum_over_holders(w["kn"], 0, 1, g)
            xn = copy_to_tp(ops.rms_norm(x, w["in"], self.eps), g)
            q = ops.matmul(xn, w["q"]).reshape(t, s.heads, hd)
            k = ops.matmul(xn, wk).reshape(t, s.kv_heads, hd)
            v = ops.matmul(xn, wv).reshape(t, s.kv_heads, hd)
            q = ops.rope(ops.rms_norm(q, qn, self.eps), cos, sin)
            k = ops.rope(ops.rms_norm(k, kn, self.eps), cos, sin)
            a = ops.attention(q, k, v, cu_seqlens, scale).reshape(t, s.heads * hd)
            x = ops.add(x, row_parallel_matmul(a, w["o"], self.heads * hd, s, g))
            xn = copy_to_tp(ops.rms_norm(x, w["post"], self.eps), g)
            gate_up = ops.matmul(xn, torch.cat([w["gate"], w["up"]], dim=0))
            act = ops.silu_mul(gate_up)
            x = ops.add(x, row_parallel_matmul(act, w["down"], self.intermediate, s, g))
        return ops.rms_norm(x, self.weight("model.norm.weight"), self.eps)

    def logits(self, tokens, cu_seqlens, reference_dtype=None, mlp_context=None):
        """The full logits [t, vocab] on every rank: each rank's vocab columns (every column is
        its own Dot, as at TP 1), gathered."""
        s = self.shard
        h = copy_to_tp(self.hidden_states(tokens, cu_seqlens, reference_dtype, mlp_context),
                       self.tp_group)
        head = self.weight("model.embed_tokens.weight" if self.tied else "lm_head.weight")
        local = ops.matmul(h, head)  # [t, vocab_end - vocab_begin]
        local = torch.nn.functional.pad(local, (0, s.vocab_rows - local.shape[1]))
        return gather_vocab_columns(local, self.vocab, self.tp_group)
