"""Qwen3-MoE (Qwen3MoeForCausalLM) built from the CPU server's kernels: Qwen3Model's attention,
norms and head, with the MoE layers of runner/cpu/cpu_moe_layer.cc -- logprobs bit for bit the
CPU server's, routing replay (R3) included, differentiable in plain torch (docs/trainer.md,
"Qwen3-MoE")."""

from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from . import ops
from .contract import MOE_ARCHITECTURES, ContractError
from .model import Qwen3Model

_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"


def _split_fused_experts(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """transformers 5's fused experts -- P.mlp.experts.gate_up_proj [E, 2 * I, H] (each expert's
    gate rows, then its up rows) and P.mlp.experts.down_proj [E, H, I] -- as the Hub's per-expert
    tensors P.mlp.experts.e.{gate,up,down}_proj.weight, the names the server serves (model/
    safetensors.h, Checkpoint::Open)."""
    out = {}
    for name, t in tensors.items():
        gate_up = name.endswith(_FUSED_GATE_UP)
        if not gate_up and not name.endswith(_FUSED_DOWN):
            out[name] = t
            continue
        if t.dim() != 3 or (gate_up and t.shape[1] % 2 != 0):
            raise ValueError(f"fused expert tensor '{name}' has shape {tuple(t.shape)}")
        prefix = name[:-len(_FUSED_GATE_UP if gate_up else _FUSED_DOWN)] + "mlp.experts."
        inter = t.shape[1] // 2
        for e in range(t.shape[0]):
            parts = ({"gate_proj": t[e, :inter], "up_proj": t[e, inter:]} if gate_up
                     else {"down_proj": t[e]})
            for proj, part in parts.items():
                key = f"{prefix}{e}.{proj}.weight"
                if key in tensors:
                    raise ValueError(f"tensor '{key}' is given twice: on its own and in the "
                                     f"fused expert tensor '{name}'")
                out[key] = part.contiguous()
    return out


def moe_layer_indices(config: dict) -> list:
    """The MoE layers of a Qwen3-MoE config.json, ascending: transformers' rule, as the server's
    ModelConfig::IsMoeLayer (not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0);
    the others are dense MLPs of intermediate_size."""
    step = int(config.get("decoder_sparse_step", 1))
    if step <= 0:
        raise ValueError(f"decoder_sparse_step ({step}) must be positive")
    only = set(int(i) for i in (config.get("mlp_only_layers") or []))
    return [i for i in range(int(config["num_hidden_layers"]))
            if i not in only and (i + 1) % step == 0]


class _Routing:
    """One forward's routing state (logprobs -> _mlp): the rows that replay a given routing and
    their ids, the rows that produce a logprob, and the ids every MoE layer used."""

    def __init__(self, forced: Optional[torch.Tensor], forced_rows: torch.Tensor,
                 produces: torch.Tensor):
        self.forced = forced            # int32 [t, moe_layers, k] of the rows (or None)
        self.forced_rows = forced_rows  # bool [t]: row r replays forced[r]
        self.produces = produces        # bool [t]: row r produces entry r + 1's logprob
        self.used = {}                  # MoE layer index -> int32 [t, k]


class MoeRouting:
    """What the CPU and CUDA Qwen3-MoE models share (a mixin before their dense base): the MoE
    config as the server reads it, and routing replay in the server's layout -- entry i of a
    routing belongs to the row that produced logprob i (the row of token i - 1 of its sequence).
    Subclasses call _read_moe_config before their base's __init__ and pass _replay_context's
    result to their forward's _mlp."""

    architectures = MOE_ARCHITECTURES

    def _read_moe_config(self, config: dict) -> None:
        # transformers' Qwen3MoeConfig defaults, as the server reads them (ReadMoe).
        local = int(config.get("num_local_experts") or 0)
        self.num_experts = int(config.get("num_experts") or local or 128)
        if local and local != self.num_experts:
            raise ValueError(f"num_local_experts ({local}) differs from num_experts "
                             f"({self.num_experts})")
        self.top_k = int(config.get("num_experts_per_tok", 8))
        self.moe_inter = int(config.get("moe_intermediate_size", 768))
        self.norm_topk_prob = bool(config.get("norm_topk_prob", False))
        if int(config.get("shared_expert_intermediate_size") or 0) > 0:
            raise ContractError("shared_expert_intermediate_size",
                                config["shared_expert_intermediate_size"], 0)
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts "
                             f"({self.num_experts})]")
        self.moe_layers = moe_layer_indices(config)
        self._moe_index = {layer: j for j, layer in enumerate(self.moe_layers)}

    @property
    def routing_size(self) -> int:
        """Expert ids per token of a routing: MoE layers x num_experts_per_tok."""
        return len(self.moe_layers) * self.top_k

    def pack_routing(self, routings: Sequence[Optional[Sequence[int]]], starts: Sequence[int],
                     cu_seqlens) -> tuple:
        """(routing, replay) for logprobs from the server's per-sequence routings: routings[b]
        None, or the expert ids of sequence b's tokens [starts[b], len) -- a Completion.routing
        (starts[b] = len(prompt)) or a ScoredSequence.routing -- flattened [token][MoE layer][k].
        routing int32 [t, moe_layers, k] aligned with the packed tokens, replay bool [t]."""
        cu = torch.as_tensor(cu_seqlens).reshape(-1).long()
        t, r = int(cu[-1]), self.routing_size
        routing = torch.zeros(t, len(self.moe_layers), self.top_k, dtype=torch.int32)
        replay = torch.zeros(t, dtype=torch.bool)
        for b, (ids, start) in enumerate(zip(routings, starts)):
            if ids is None:
                continue
            begin, end = int(cu[b]) + int(start), int(cu[b + 1])
            if not int(cu[b]) < begin <= end or len(ids) != (end - begin) * r:
                raise ValueError(f"sequence {b}: routing has {len(ids)} expert ids; expected "
                                 f"{max(end - begin, 0) * r} ({end - begin} tokens from start "
                                 f"{start} x {r})")
            routing[begin:end] = torch.as_tensor(list(ids), dtype=torch.int32).reshape(
                end - begin, len(self.moe_layers), self.top_k)
            replay[begin:end] = True
        return routing, replay

    def _check_routing(self, routing: torch.Tensor, replay: torch.Tensor) -> None:
        """ValueError naming the token and MoE layer of a replayed entry whose ids are outside
        [0, num_experts) or hold an expert twice (the server refuses them so too)."""
        r = routing[replay].long()  # [n, layers, k]
        bad = ((r < 0) | (r >= self.num_experts)).any(-1)
        s = r.sort(-1).values
        twice = (s[..., 1:] == s[..., :-1]).any(-1)
        for what, mask in (("outside [0, %d)" % self.num_experts, bad), ("an expert twice", twice)):
            if bool(mask.any()):
                n, j = (int(v) for v in mask.nonzero()[0])
                i = int(replay.nonzero()[n, 0])
                raise ValueError(f"routing of token {i} at MoE layer {self.moe_layers[j]} is "
                                 f"{routing[i, j].tolist()}: {what}")

    def _replay_context(self, t: int, cu: torch.Tensor, routing=None, replay=None) -> _Routing:
        """The forward's routing state (on the CPU) for t packed tokens of cu_seqlens `cu`:
        routing (int [t, moe_layers, k] or [t, routing_size], entry-aligned) shifted onto the
        rows that produce each entry, where replay (bool [t]; default every token but each
        sequence's first) is set and a row produces one."""
        layers, k = len(self.moe_layers), self.top_k
        first = torch.zeros(t, dtype=torch.bool)
        if cu.numel() >= 2 and int(cu[0]) == 0 and int(cu[-1]) == t:
            first[cu[:-1].clamp(max=max(t - 1, 0))] = True
        # Row r produces entry r + 1 unless r + 1 starts a sequence (r ends one: it routes
        # itself and produces no logprob).
        produces = torch.cat([~first[1:], torch.zeros(1, dtype=torch.bool)]) if t else first
        forced, forced_rows = None, torch.zeros(t, dtype=torch.bool)
        if routing is not None:
            routing = torch.as_tensor(routing).cpu()
            if routing.numel() != t * layers * k:
                raise ValueError(f"routing has {routing.numel()} expert ids; expected "
                                 f"{t * layers * k} ({t} tokens x {layers} MoE layers x {k})")
            routing = routing.reshape(t, layers, k).to(torch.int32)
            replay = ~first if replay is None else torch.as_tensor(replay).cpu().reshape(t).bool()
            self._check_routing(routing, replay & ~first)
            forced = torch.zeros_like(routing)
            forced[:-1] = routing[1:]
            forced_rows[:-1] = replay[1:]
            forced_rows &= produces
        return _Routing(forced, forced_rows, produces)

    def _routing_used(self, ctx: _Routing, t: int) -> torch.Tensor:
        """The routing the forward used, entry-aligned: int32 [t, moe_layers, k] on the CPU, 0
        at each sequence's first token."""
        layers, k = len(self.moe_layers), self.top_k
        used = torch.zeros(t, layers, k, dtype=torch.int32)
        if layers:
            rows = torch.stack([ctx.used[j].cpu() for j in range(layers)], dim=1)
            used[1:] = torch.where(ctx.produces[:-1, None, None], rows[:-1], used[1:])
        return used


class Qwen3MoeModel(MoeRouting, Qwen3Model):
    """Qwen3-MoE with the parameters' Hugging Face names, the Hub's per-expert layout (a fused
    transformers 5 checkpoint is split into it, as the server does). Same interface as
    Qwen3Model; logprobs also replays (routing=...) or returns (return_routing=True) the
    experts each row used, in the server's routing layout."""

    def __init__(self, config: dict, tensors: Dict[str, torch.Tensor]):
        self._read_moe_config(config)
        super().__init__(config, _split_fused_experts(tensors))
        for i in self.moe_layers:
            for _, name in self._mlp_weight_names(i):
                if f"model.layers.{i}.{name}" not in self._names:
                    raise ValueError(f"checkpoint lacks model.layers.{i}.{name}")

    def _mlp_weight_names(self, i: int):
        if i not in self._moe_index:
            return super()._mlp_weight_names(i)
        names = [("router", "mlp.gate.weight")]
        for e in range(self.num_experts):
            names += [(f"gate.{e}", f"mlp.experts.{e}.gate_proj.weight"),
                      (f"up.{e}", f"mlp.experts.{e}.up_proj.weight"),
                      (f"down.{e}", f"mlp.experts.{e}.down_proj.weight")]
        return names

    def _mlp(self, i: int, xn, w, ref: bool, mlp_context: Optional[_Routing] = None):
        if i not in self._moe_index:
            return super()._mlp(i, xn, w, ref, mlp_context)
        j, k = self._moe_index[i], self.top_k
        t, hidden = xn.shape
        logits = (ops.reference_matmul if ref else ops.matmul)(xn, w["router"])  # [t, experts]
        ctx = mlp_context
        forced = None if ctx is None or ctx.forced is None else ctx.forced[:, j].contiguous()
        if ref:
            ids = ops.reference_moe_choose(logits, k).to(torch.int32)
            if forced is not None:
                ids = torch.where(ctx.forced_rows[:, None], forced, ids)
            weights = ops.reference_moe_weights(logits, ids, self.norm_topk_prob)
        else:
            ids, weights = ops.moe_route(logits, k, self.norm_topk_prob, forced,
                                         None if forced is None else ctx.forced_rows)
        if ctx is not None:
            ctx.used[j] = ids
        expert = ops.reference_expert_mlp if ref else ops.expert_mlp
        # y[p] for p = r * k + rank: expert ids[r, rank] on row r.
        flat = ids.reshape(-1).long()
        order, outs = [], []
        for e in range(self.num_experts):
            p = (flat == e).nonzero().reshape(-1)
            if p.numel() == 0:
                continue
            gate_up = torch.cat([w[f"gate.{e}"], w[f"up.{e}"]], dim=0)
            outs.append(expert(xn[p // k], gate_up, w[f"down.{e}"]))
            order.append(p)
        y = torch.cat(outs)[torch.argsort(torch.cat(order))].reshape(t, k, hidden)
        return (ops.reference_moe_combine if ref else ops.moe_combine)(y, weights)

    def logprobs(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0,
                 reference_dtype: Optional[torch.dtype] = None, routing=None, replay=None,
                 return_routing: bool = False):
        """Qwen3Model.logprobs, with the MoE layers' routing. Routings are aligned with the
        logprobs, in the server's layout: entry i (int [t, moe_layers, k], or [t, routing_size])
        holds the experts, at every MoE layer ascending, in rank order, of the row that produced
        token i's logprob (the row of token i - 1 of its sequence).
        routing: replay it (R3): for each i with replay[i] (bool [t]; default every token but
        each sequence's first, which no row produced) row i - 1 uses these experts instead of
        choosing, their weights the router's probabilities at them (renormalised with
        norm_topk_prob) -- bitwise Score with that routing. The other rows choose, as the server.
        return_routing: returns (logprobs, routing used) in that layout (0 at each sequence's
        first token) -- for a completion, routing[its tokens] flattened is Generate's
        Completion.routing."""
        tokens = torch.as_tensor(tokens).reshape(-1).long()
        cu = torch.as_tensor(cu_seqlens).reshape(-1).long()
        ctx = self._replay_context(tokens.numel(), cu, routing, replay)
        lp = super().logprobs(tokens, cu, temperature, reference_dtype, mlp_context=ctx)
        if not return_routing:
            return lp
        return lp, self._routing_used(ctx, tokens.numel())
