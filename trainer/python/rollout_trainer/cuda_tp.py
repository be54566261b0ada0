"""Trainer-side tensor parallelism on the CUDA kernels: CudaQwen3Model sharded over a
torch.distributed process group as rollout_trainer.tp shards the CPU model (the server's split,
ShardOf), every rank's logprobs bit for bit TP 1's -- so bit for bit what a cuda server at any
--tp streams and scores (D10: trainer TP k == rollout TP m).

A rank computes what a cuda server's rank computes (runner/cuda/forward_layers.cc at tp > 1):
- column-parallel qkv, gate_up and lm_head on its rows, with the algorithm pinned for the full
  weight's shape (PinnedGemms slices: the runner's PinCanonicalGemms), so every output column has
  the unsliced GEMM's bits;
- o_proj and down_proj: its 8 / tp K-segment leaves summed by the canonical tree into its node
  (RowParallelNode), the nodes all-gathered in rank order, the tree's top levels onto the
  residual (TreeTop: SumTreeOnto) -- TP 1's additions in TP 1's order;
- the vocab-parallel embedding (EmbeddingShard, gathered, SelectOwnerRows: the exact rows) and
  the lm_head columns gathered into full rows, log_softmax on every rank over the whole row.

Gradients as rollout_trainer.tp's (copy_to_tp before the column-parallel GEMMs, an all-gather's
backward the rank's slice, weights held as copies summed over their holders): a rank's
parameter gradients are the slices of TP 1's. Collectives run on the group's backend: nccl on
CUDA tensors, or gloo (several ranks on one GPU, or no NCCL) through host memory.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import cuda_ops as ops
from . import tp as tpm
from .contract import check_trainer_tensor_parallel
from .cuda_model import CudaQwen3Model
from .model import _read_safetensors


class CudaTpQwen3Model(CudaQwen3Model):
    """CudaQwen3Model sharded over `tp_group`: parameters hold the rank's shards (shards: name
    -> the rank's part, tp.shard_index says which) under the fused names of CudaQwen3Model.
    Every rank of the group runs the same calls with the same inputs (collectives inside); one
    thread per rank. Dense Qwen3 with the canonical K tree only (the server's TP needs it)."""

    def __init__(self, config: dict, shards, tp_group, **options):
        tp = dist.get_world_size(tp_group)
        check_trainer_tensor_parallel(config, tp)
        if tp > 1 and not options.get("canonical", True):
            raise ValueError("trainer tensor parallelism on CUDA needs the canonical K tree "
                             "(row_parallel_reduction canonical_k_tree_8, the server's "
                             "--tp_invariant)")
        shard = tpm.shard_of(config, tp, dist.get_rank(tp_group))
        tpm.check_shards(config, shard, shards)
        super().__init__(config, shards, shard=shard, **options)
        self.tp_group, self.tp = tp_group, tp

    @classmethod
    def from_pretrained(cls, path: str, contract=None, tp_group=None, device="cuda",
                        **options) -> "CudaTpQwen3Model":
        """Rank dist.get_rank(tp_group)'s shards of the checkpoint at `path` (only those are
        read) on `device`; tp_group None is the default (world) group. contract: as
        CudaQwen3Model's (the server's TP degree is its own)."""
        if tp_group is None:
            tp_group = dist.group.WORLD
        config, options = cls._config_and_options(path, contract, device, options)
        tp = dist.get_world_size(tp_group)
        check_trainer_tensor_parallel(config, tp)
        shard = tpm.shard_of(config, tp, dist.get_rank(tp_group))
        tensors = _read_safetensors(path, lambda name, _: tpm.shard_index(name, shard, config))
        model = cls(config, tensors, tp_group, device=device, **options)
        model._check_pins(contract, config)
        return model

    def full_named_weights(self):
        """(Hugging Face name, full tensor) pairs on this rank's device, gathered from every rank
        (a collective: every rank must call it; each gets the whole model): what
        RolloutClient.update_weights takes."""
        return tpm.gather_full_weights(self.named_weights(), self.config, self.shard,
                                       self.tp_group)

    def load_weights(self, named_tensors) -> None:
        """Replaces weights in place from full (unsharded) tensors: the rank takes its shard."""
        self.load_shards((name, t[tpm.shard_index(name, self.shard, self.config) or ()])
                         for name, t in named_tensors)

    def load_shards(self, named_tensors) -> None:
        """Replaces weights in place from tensors already cut to this rank's shard."""
        super().load_weights(named_tensors)

    # --- the tensor-parallel pieces of CudaQwen3Model's forward ---

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        s = self.shard
        table = self.params["model__embed_tokens__weight"]
        if s.vocab_end > s.vocab_begin:
            local = ops.EmbeddingShard.apply(tokens, table, s.vocab_begin, s.vocab_end)
        else:  # a tiny vocabulary leaves the last ranks none
            local = torch.zeros(tokens.numel(), self.hidden, dtype=torch.float32,
                                device=self.device)
        return ops.SelectOwnerRows.apply(tokens, tpm.all_gather(local, self.tp_group),
                                         s.vocab_rows)

    def _to_tp(self, xn: torch.Tensor) -> torch.Tensor:
        return tpm.copy_to_tp(xn, self.tp_group)

    def _qkv_weight(self, i: int) -> torch.Tensor:
        w = super()._qkv_weight(i)
        s = self.shard
        if not s.kv_replicated:
            return w
        q_rows, kv_rows = s.heads * self.head_dim, s.kv_heads * self.head_dim
        return tpm.sum_over_holders(w, s.kv_head_begin, self.kv_heads, self.tp_group,
                                    (q_rows, q_rows + 2 * kv_rows))

    def _qk_norms(self, i: int):
        g = self.tp_group
        return tuple(tpm.sum_over_holders(w, 0, 1, g) for w in super()._qk_norms(i))

    def _row_parallel(self, x, a, i: int, name: str, which: int) -> torch.Tensor:
        w = self._p(i, "self_attn.o_proj.weight" if which == 0 else "mlp.down_proj.weight")
        node = ops.RowParallelNode.apply(a, w, self._kernel_weight(f"{i}.{name}", w),
                                         self.gemms, which)
        return ops.TreeTop.apply(x, tpm.all_gather(node, self.tp_group))

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """The full logits [t, vocab] on every rank: each rank's vocab columns (its rows of the
        head, zero-padded to vocab_rows: one GEMM shape on every rank, as the runner's),
        gathered."""
        s = self.shard
        h = tpm.copy_to_tp(h, self.tp_group)
        head = self.head()
        if head.shape[0] < s.vocab_rows:
            head = torch.nn.functional.pad(head, (0, 0, 0, s.vocab_rows - head.shape[0]))
        local = ops.Gemm.apply(h, head, self.gemms, 2, torch.float32)  # [t, vocab_rows]
        return tpm.gather_vocab_columns(local, self.vocab, self.tp_group)
