"""Qwen3-MoE (Qwen3MoeForCausalLM) on the GPU built from the CUDA server's kernels:
CudaQwen3Model's attention, norms, dense layers and head, with the MoE layers of the runner's
EnqueueMoe (runner/cuda/forward_layers.cc) -- logprobs bit for bit a cuda server's, routing
replay (R3) included, differentiable in plain torch (docs/trainer.md, "CUDA")."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from . import cuda_ops as ops
from .cuda_model import CudaQwen3Model
from .moe_model import MoeRouting, _Routing, _split_fused_experts


class CudaQwen3MoeModel(MoeRouting, CudaQwen3Model):
    """Qwen3-MoE on CUDA. Each MoE layer holds its experts as the runner does, fused: parameter
    `model__layers__L__mlp__experts__gate_up_proj` bf16 [experts, 2 moe_inter, hidden] (each
    expert's gate rows, then its up rows) and `..__down_proj` [experts, hidden, moe_inter] --
    transformers 5's fused layout, read from either it or the Hub's per-expert tensors;
    `named_weights()` yields the per-expert Hugging Face names (the served ones, what
    update_weights takes) as views into them. The router `mlp.gate.weight` runs on the router
    pin (rt_cuda_model_add_router). Same interface as CudaQwen3Model; logprobs also replays
    (routing=...) or returns (return_routing=True) the experts each row used, in the server's
    layout (Qwen3MoeModel.logprobs says how). TP 1 only, as a cuda server serves MoE."""

    def __init__(self, config: dict, tensors: Dict[str, torch.Tensor], *, device="cuda",
                 **options):
        self._read_moe_config(config)
        tensors = _split_fused_experts(tensors)
        experts = {n: tensors.pop(n) for n in list(tensors) if ".mlp.experts." in n}
        super().__init__(config, tensors, device=device, **options)
        bf = lambda t: t.to(torch.bfloat16).to(self.device)
        mi = self.moe_inter
        for i in self.moe_layers:
            pre = f"model.layers.{i}.mlp."
            if pre + "gate.weight" not in self._names:
                raise ValueError(f"checkpoint lacks {pre}gate.weight")
            names = [[f"{pre}experts.{e}.{proj}.weight" for proj in
                      ("gate_proj", "up_proj", "down_proj")] for e in range(self.num_experts)]
            for name in (n for per in names for n in per):
                if name not in experts:
                    raise ValueError(f"checkpoint lacks {name}")
            key_gu = f"model__layers__{i}__mlp__experts__gate_up_proj"
            key_down = f"model__layers__{i}__mlp__experts__down_proj"
            self.params[key_gu] = torch.nn.Parameter(bf(torch.stack(
                [torch.cat([experts.pop(g), experts.pop(u)]) for g, u, _ in names])))
            self.params[key_down] = torch.nn.Parameter(bf(torch.stack(
                [experts.pop(d) for _, _, d in names])))
            for e, (g, u, d) in enumerate(names):
                self._names[g] = (key_gu, (e, slice(0, mi)))
                self._names[u] = (key_gu, (e, slice(mi, 2 * mi)))
                self._names[d] = (key_down, e)
        if experts:
            raise ValueError(f"expert tensors outside the MoE layers {self.moe_layers}: "
                             f"{sorted(experts)[:3]}")
        with torch.cuda.device(self.device):
            self.gemms.add_router(self.num_experts)

    def _mlp(self, i: int, x: torch.Tensor, mlp_context: Optional[_Routing] = None):
        """x + MoE layer i of x as EnqueueMoe: post-attention norm, router GEMM, routing (the
        context's forced rows replay their ids), experts, combine into the residual."""
        if i not in self._moe_index:
            return super()._mlp(i, x, mlp_context)
        j = self._moe_index[i]
        p = lambda s: self._p(i, s)
        xn = ops.RmsNorm.apply(x, p("post_attention_layernorm.weight"), self.eps)
        logits = ops.Gemm.apply(xn, p("mlp.gate.weight"), self.gemms, 3, torch.float32)
        ctx = mlp_context
        forced = forced_rows = None
        if ctx is not None and ctx.forced is not None:
            forced, forced_rows = ctx.forced[:, j].contiguous(), ctx.forced_rows
        ids, weights = ops.MoeRoute.apply(logits, forced, forced_rows, self.top_k,
                                          self.norm_topk_prob)
        if ctx is not None:
            ctx.used[j] = ids
        y, slots = ops.MoeExperts.apply(xn, ids, p("mlp.experts.gate_up_proj"),
                                        p("mlp.experts.down_proj"))
        return ops.MoeCombine.apply(x, y, slots, weights)

    def logprobs(self, tokens: torch.Tensor, cu_seqlens, temperature: float = 1.0,
                 pack: Optional[ops.Packing] = None, routing=None, replay=None,
                 return_routing: bool = False):
        """CudaQwen3Model.logprobs with the MoE layers' routing, bitwise a cuda server's Score
        (with that routing, when replayed) and Generate. routing, replay and return_routing as
        Qwen3MoeModel.logprobs: entry i of a routing ([t, moe_layers, k] int, or [t,
        routing_size]) holds the experts of the row that produced logprob i. Returns lp [t] on
        the GPU, or (lp, routing used int32 [t, moe_layers, k] on the CPU)."""
        cu = torch.as_tensor(cu_seqlens).reshape(-1).cpu().long()
        t = torch.as_tensor(tokens).numel()
        ctx = self._replay_context(t, cu, routing, replay)
        if ctx.forced is not None:
            ctx.forced = ctx.forced.to(self.device)
            ctx.forced_rows = ctx.forced_rows.to(self.device)
        lp = super().logprobs(tokens, cu, temperature, pack=pack, mlp_context=ctx)
        if not return_routing:
            return lp
        return lp, self._routing_used(ctx, t)
