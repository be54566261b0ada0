"""A stand-in for librollout_trainer_cuda_ops.so on the CPU, for tests without a GPU: each
rt_cuda_* entry point in plain torch (the kernels' formulas, not their bits) on the CPU tensors
the ops pass, found by their data_ptr(). With it installed (`installed()`), CudaQwen3Model and
CudaQwen3MoeModel run on device="cpu": their wiring -- weights and names, packing, routing
replay, the autograd ops' forward/backward plumbing -- is checked here; the bits are checked
on the GPU (tests/gpu/trainer_parity.py).

installed(wide=True) also lets torch.bfloat16 stand for float64 inside the block: the models'
bf16 weights and activations are then float64, so the stand-in computes the model's function
with no rounding but the fp32 residual's, and its logprobs and (analytic) gradients must equal
autograd of the float64 reference to ~1e-5 -- a check of every op's wiring that bf16 noise would
hide."""

from __future__ import annotations

import contextlib
import ctypes
import itertools

import torch

from rollout_trainer import cuda_ops
from rollout_trainer import ops as cpu_ops



def _bf():
    return torch.bfloat16  # looked up per call: float64 under installed(wide=True)


class FakeCudaLib:
    """The entry points cuda_ops binds, in plain torch. Pointers are resolved through the
    registry that the patched cuda_ops._ptr fills."""

    def __init__(self):
        self.tensors = {}
        self.models = {}
        self._ids = itertools.count(1)
        self.calls = []  # entry point names, in call order

    def t(self, ptr) -> torch.Tensor:
        return self.tensors[ptr]

    # --- facts ---
    def rt_cuda_last_error(self):
        return b"fake"

    def rt_cuda_kernels_version(self):
        return b"rollout-cuda/1"

    def rt_cuda_attention_tile(self):
        return 32

    def rt_cuda_attention_item_tokens(self, group):
        return 64

    def rt_cuda_device_facts(self, buf, n):
        buf.value = b"Fake GPU\n9.0\n13.0\n130000"
        return 0

    # --- GEMMs ---
    def rt_cuda_model_create_tp(self, hidden, heads, kv_heads, head_dim, inter, vocab, pin_m,
                                ladder, canonical, qkv_rows, gate_up_rows, vocab_rows, out):
        h = next(self._ids)
        self.models[h] = {"canonical": bool(canonical),
                          "lines": ["qkv pin", "o pin", "gate_up pin", "down pin", "lm_head pin"]}
        out._obj.value = h
        return 0

    def rt_cuda_model_free(self, h):
        pass

    def rt_cuda_model_algorithms(self, h):
        return "\n".join(self.models[h.value]["lines"]).encode()

    def rt_cuda_model_add_router(self, h, num_experts):
        self.calls.append("rt_cuda_model_add_router")
        self.models[h.value]["lines"].append("router pin")
        self.models[h.value]["router"] = int(num_experts)
        return 0

    def rt_cuda_gemm(self, h, which, x, m, w, y, stream):
        if which == 3 and "router" not in self.models[h.value]:
            return 1
        self.calls.append(f"rt_cuda_gemm {which}")
        out = self.t(y)
        out.copy_((self.t(x).float() @ self.t(w).float().t()).to(out.dtype))
        return 0

    def rt_cuda_row_parallel(self, h, which, a, m, w_kernel, leaves, x, out, stream):
        w = self.t(w_kernel)
        if self.models[h.value]["canonical"]:  # [8, hidden, K / 8] -> [hidden, K]
            w = w.permute(1, 0, 2).reshape(w.shape[1], -1)
        self.t(out).copy_(self.t(x) + self.t(a).float() @ w.float().t())
        return 0

    def rt_cuda_row_parallel_node(self, h, which, a, m, k_local, w_kernel, leaves, node, stream):
        w = self.t(w_kernel)  # [8 / tp, hidden, K / 8] -> [hidden, K / tp]
        w = w.permute(1, 0, 2).reshape(w.shape[1], -1)
        self.t(node).copy_(self.t(a).float() @ w.float().t())
        return 0

    def rt_cuda_sum_tree_onto(self, parts, n, stride, count, residual, out, stream):
        level = list(self.t(parts).reshape(n, -1)[:, :count].unbind(0))
        while len(level) > 1:  # the canonical pairwise tree
            level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
        o = self.t(out)
        o.copy_((self.t(residual).reshape(-1) + level[0]).reshape(o.shape))
        return 0

    def rt_cuda_embedding_shard(self, ids, t, shard, begin, end, hidden, x, stream):
        i = self.t(ids).long()
        own = (i >= begin) & (i < end)
        rows = self.t(shard)[(i - begin).clamp(0, end - begin - 1)].float()
        self.t(x).copy_(torch.where(own[:, None], rows, torch.zeros((), dtype=rows.dtype)))
        return 0

    def rt_cuda_select_owner_rows(self, ids, t, gathered, rank_stride, rows, hidden, x, stream):
        g = self.t(gathered).reshape(-1, t, hidden)
        self.t(x).copy_(g[self.t(ids).long() // rows, torch.arange(t)])
        return 0

    # --- the rest of the dense forward ---
    def rt_cuda_embedding(self, ids, t, embed, hidden, x, stream):
        self.t(x).copy_(self.t(embed)[self.t(ids).long()].float())
        return 0

    def rt_cuda_rms_norm(self, x, rows, n, dim, w, eps, y, stream):
        self.t(y).copy_(cpu_ops.reference_rms_norm(self.t(x), self.t(w), eps).to(_bf()))
        return 0

    def rt_cuda_qkv_norm_rope(self, qkv, t, positions, slots, q_norm, k_norm, eps, cos, sin,
                              heads, kv_heads, hd, q_out, k_out, v_out, stream):
        x, pos = self.t(qkv), self.t(positions).long()
        c, s = self.t(cos)[pos], self.t(sin)[pos]
        q = x[:, :heads * hd].reshape(t, heads, hd)
        k = x[:, heads * hd:(heads + kv_heads) * hd].reshape(t, kv_heads, hd)
        v = x[:, (heads + kv_heads) * hd:].reshape(t, kv_heads, hd)
        norm = cpu_ops.reference_rms_norm
        self.t(q_out).copy_(cpu_ops.reference_rope(norm(q, self.t(q_norm), eps), c, s))
        self.t(k_out).copy_(cpu_ops.reference_rope(norm(k, self.t(k_norm), eps), c, s).to(_bf()))
        self.t(v_out).copy_(v.to(_bf()))
        return 0

    def rt_cuda_attention(self, q, positions, starts, rows, items, n_items, heads, kv_heads, hd,
                          split, scale, k, v, tensor_core, out, stream):
        st = self.t(starts).long()
        t = st.numel()
        cu = torch.cat([torch.unique_consecutive(st), torch.tensor([t])])
        o = cpu_ops.reference_attention(self.t(q).to(_bf()).float(), self.t(k).float(),
                                        self.t(v).float(), cu, scale)
        self.t(out).copy_(o.to(_bf()))
        return 0

    def rt_cuda_silu_mul(self, gate_up, rows, dim, out, stream):
        self.t(out).copy_(cpu_ops.reference_silu_mul(self.t(gate_up).float()).to(_bf()))
        return 0

    def rt_cuda_logprob_workspace(self, rows):
        return 16

    def rt_cuda_token_logprobs(self, logits, rows, vocab, tokens, temperature, ws, lp, row_max,
                               row_log_sum, stream):
        t = temperature if temperature > 0 else 1.0
        x = self.t(logits) / t
        mx = x.max(-1).values
        ls = torch.log(torch.exp(x - mx[:, None]).sum(-1))
        self.t(lp).copy_(x.gather(1, self.t(tokens).long()[:, None])[:, 0] - mx - ls)
        self.t(row_max).copy_(mx)
        self.t(row_log_sum).copy_(ls)
        return 0

    def rt_cuda_rope_tables(self, theta, head_dim, n, cos_ptr, sin_ptr):
        cos, sin = cpu_ops.rope_cos_sin(torch.arange(n), head_dim, theta)
        ctypes.memmove(cos_ptr, cos.data_ptr(), cos.numel() * 4)
        ctypes.memmove(sin_ptr, sin.data_ptr(), sin.numel() * 4)

    # --- MoE ---
    def rt_cuda_moe_route(self, logits, n, e, k, norm, forced_ids, forced_rows, ids, weights,
                          stream):
        self.calls.append("rt_cuda_moe_route" + (" forced" if forced_rows else ""))
        p = torch.softmax(self.t(logits), dim=-1)
        # Descending probability, ties to the lower id (a stable sort of -p).
        chosen = torch.sort(-p, dim=-1, stable=True).indices[:, :k].to(torch.int32)
        if forced_rows:
            rows = self.t(forced_rows).bool()
            chosen = torch.where(rows[:, None], self.t(forced_ids), chosen)
        w = p.gather(1, chosen.long())
        if norm:
            w = w / w.sum(-1, keepdim=True)
        self.t(ids).copy_(chosen)
        self.t(weights).copy_(w)
        return 0

    def rt_cuda_moe_grouping_ints(self, e, a):
        return 3 * e + 2 + 2 * a

    def rt_cuda_moe_experts(self, xn, n, h, inter, e, k, ids, w_gate_up, w_down, grouping,
                            gate_up, act, y, stream):
        self.calls.append("rt_cuda_moe_experts")
        rows, slots, offsets = cuda_ops.group_assignments(self.t(ids), e)
        g = cuda_ops.grouping_views(self.t(grouping), e, n * k)
        g["counts"].copy_(offsets[1:] - offsets[:-1])
        g["expert_offsets"].copy_(offsets)
        g["rows"].copy_(rows)
        g["slots"].copy_(slots)
        x, wgu, wd = self.t(xn).float(), self.t(w_gate_up).float(), self.t(w_down).float()
        gu_out, act_out, y_out = self.t(gate_up), self.t(act), self.t(y)
        for ex in range(e):
            b, end = int(offsets[ex]), int(offsets[ex + 1])
            if b == end:
                continue
            gu = (x[rows[b:end]] @ wgu[ex].t()).to(_bf())
            a = cpu_ops.reference_silu_mul(gu.float()).to(_bf())
            gu_out[b:end] = gu
            act_out[b:end] = a
            y_out[b:end] = a.float() @ wd[ex].t()
        return 0

    def rt_cuda_moe_combine(self, y, slots, weights, n, k, h, x, stream):
        self.calls.append("rt_cuda_moe_combine")
        ya = self.t(y)[self.t(slots).long()].reshape(n, k, h)
        self.t(x).add_(cpu_ops.reference_moe_combine(ya, self.t(weights)))
        return 0


def _sdpa_packed(q, k, v, pack, scale):
    """sdpa_packed without SDPA (torch < 2.0): the reference attention, same function."""
    cu = torch.tensor(pack.cu)
    return cpu_ops.reference_attention(q, k, v, cu, scale)


@contextlib.contextmanager
def installed(wide: bool = False):
    """cuda_ops bound to a FakeCudaLib on CPU tensors, for the block; yields the fake. wide:
    torch.bfloat16 is float64 in the block (the module docstring says why)."""
    fake = FakeCudaLib()
    saved = (cuda_ops._lib, cuda_ops._ptr, cuda_ops._need, cuda_ops._stream,
             cuda_ops.sdpa_packed, torch.cuda.device, torch.bfloat16)

    def ptr(t):
        if t is None:
            return None
        fake.tensors[t.data_ptr()] = t
        return t.data_ptr()

    def need(t, name, dtype, align=16):
        if t.dtype != dtype:
            raise TypeError(f"{name}: {dtype} tensor expected, got {t.dtype}")
        return t.detach().contiguous()

    cuda_ops._lib, cuda_ops._ptr, cuda_ops._need = fake, ptr, need
    cuda_ops._stream = lambda: 0
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        cuda_ops.sdpa_packed = _sdpa_packed
    torch.cuda.device = lambda d: contextlib.nullcontext()
    if wide:
        torch.bfloat16 = torch.float64
    try:
        yield fake
    finally:
        (cuda_ops._lib, cuda_ops._ptr, cuda_ops._need, cuda_ops._stream, cuda_ops.sdpa_packed,
         torch.cuda.device, torch.bfloat16) = saved
