"""The CUDA MoE ops' backward arithmetic (rollout_trainer.cuda_ops, "--- MoE ---"), on the CPU:
each analytic backward against torch autograd of the forward's formula in float64 (the CPU ops'
references: ops.reference_moe_weights, reference_moe_combine, reference_expert_mlp), and the
plain-torch grouping against MoeGroup's definition. The forwards are the server's CUDA kernels
and need a GPU (tests/gpu/trainer_parity.py checks them there, and the whole model's gradients
against float32 plain torch). Nothing here loads the CUDA library."""

import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rollout_trainer import cuda_ops  # noqa: E402
from rollout_trainer import ops as cpu_ops  # noqa: E402

D = torch.float64


def _rel(got, want):
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def _routing(t, e, k, gen):
    """Distinct expert ids per row, in a random rank order."""
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]).to(torch.int32)


class CudaMoeBackwardTest(unittest.TestCase):
    def setUp(self):
        self.gen = torch.Generator().manual_seed(0)

    def _router_case(self, t, e, k, norm):
        """Router logits (requiring grad), a routing, an upstream gradient of the top-k weights,
        and autograd's gradient of the reference weights in float64."""
        logits = (torch.randn(t, e, dtype=D, generator=self.gen) * 2).requires_grad_(True)
        ids = _routing(t, e, k, self.gen)
        g = torch.randn(t, k, dtype=D, generator=self.gen)
        (want,) = torch.autograd.grad(cpu_ops.reference_moe_weights(logits, ids, norm),
                                      (logits,), g)
        return logits, ids, g, want

    def test_router_backward_is_autograd_through_the_top_k_weights(self):
        t, e, k = 9, 8, 3
        for norm in (True, False):
            logits, ids, g, want = self._router_case(t, e, k, norm)
            got = cuda_ops.moe_route_backward(logits.detach(), ids, norm, g)
            self.assertEqual(got.dtype, D)
            self.assertLess(_rel(got, want), 1e-12, f"norm_topk_prob={norm}")
            # Every row's gradient sums to 0 (softmax), renormalised or not.
            self.assertLess(got.sum(-1).abs().max().item(), 1e-12)

    def test_combine_backward_is_autograds(self):
        t, k, h = 7, 2, 12
        y = torch.randn(t, k, h, dtype=D, generator=self.gen, requires_grad=True)
        w = torch.rand(t, k, dtype=D, generator=self.gen, requires_grad=True)
        g = torch.randn(t, h, dtype=D, generator=self.gen)
        want = torch.autograd.grad(cpu_ops.reference_moe_combine(y, w), (y, w), g)
        got = cuda_ops.moe_combine_backward(y.detach(), w.detach(), g)
        for a, b in zip(got, want):
            self.assertLess(_rel(a, b), 1e-12)

    def test_grouping_is_moegroups_order(self):
        # Expert e's rows are its assignments a = t * k + j in increasing a; slots invert it.
        t, e, k = 11, 5, 2
        ids = _routing(t, e, k, self.gen)
        rows, slots, offsets = cuda_ops.group_assignments(ids, e)
        flat = ids.reshape(-1).tolist()
        order = [a for ex in range(e) for a in range(t * k) if flat[a] == ex]
        self.assertEqual(rows.tolist(), [a // k for a in order])
        self.assertEqual([order[int(s)] for s in slots], list(range(t * k)))
        self.assertEqual(offsets.tolist(),
                         [sum(1 for f in flat if f < ex) for ex in range(e + 1)])
        # An expert no token chose has no rows.
        ids = torch.tensor([[0, 3], [3, 0]], dtype=torch.int32)
        self.assertEqual(cuda_ops.group_assignments(ids, 5)[2].tolist(), [0, 2, 2, 2, 4, 4])

    def test_grouping_views_are_moegroupingins_layout(self):
        e, a = 3, 4
        buf = torch.arange(3 * e + 2 + 2 * a)
        v = cuda_ops.grouping_views(buf, e, a)
        self.assertEqual([v[n].tolist() for n in ("counts", "expert_offsets", "tile_offsets",
                                                  "rows", "slots")],
                         [[0, 1, 2], [3, 4, 5, 6], [7, 8, 9, 10], [11, 12, 13, 14],
                          [15, 16, 17, 18]])

    def test_expert_backward_is_autograd_of_each_expert(self):
        t, e, k, h, i = 10, 4, 2, 8, 6
        ids = _routing(t, e, k, self.gen)
        ids[:, 0] = 2  # one expert with many rows; some experts may get none
        xn = torch.randn(t, h, dtype=D, generator=self.gen, requires_grad=True)
        w_gu = (torch.randn(e, 2 * i, h, dtype=D, generator=self.gen) * 0.5).requires_grad_(True)
        w_down = (torch.randn(e, h, i, dtype=D, generator=self.gen) * 0.5).requires_grad_(True)
        rows, _, offsets = cuda_ops.group_assignments(ids, e)
        gate_up = torch.cat([xn[rows[b:end]] @ w_gu[ex].t() for ex, (b, end) in
                             enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
        act = cpu_ops.reference_silu_mul(gate_up)
        y = torch.cat([act[b:end] @ w_down[ex].t() for ex, (b, end) in
                       enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist()))])
        # The reference forward is each expert's SwiGLU on its rows.
        for ex in range(e):
            b, end = int(offsets[ex]), int(offsets[ex + 1])
            if end > b:
                ref = cpu_ops.reference_expert_mlp(xn[rows[b:end]], w_gu[ex], w_down[ex])
                self.assertLess(_rel(y[b:end], ref), 1e-12)
        gy = torch.randn(t * k, h, dtype=D, generator=self.gen)
        want = torch.autograd.grad(y, (xn, w_gu, w_down), gy)
        got = cuda_ops.expert_mlp_backward(xn.detach(), rows, offsets.tolist(), gate_up.detach(),
                                           act.detach(), w_gu.detach(), w_down.detach(), gy)
        for name, a, b in zip(("xn", "w_gate_up", "w_down"), got, want):
            # silu_mul_backward computes in fp32.
            self.assertLess(_rel(a.double(), b), 1e-5, name)

    def test_the_moe_backwards_can_fail(self):
        # Controls: the router backward without renormalisation, and the combine's weight
        # gradient read from another rank, are caught by the comparisons above.
        t, e, k = 9, 8, 3
        logits, ids, g, want = self._router_case(t, e, k, True)
        wrong = cuda_ops.moe_route_backward(logits.detach(), ids, False, g)
        self.assertGreater(_rel(wrong, want), 1e-3)
        y = torch.randn(t, k, 4, dtype=D, generator=self.gen, requires_grad=True)
        w = torch.rand(t, k, dtype=D, generator=self.gen, requires_grad=True)
        gc = torch.randn(t, 4, dtype=D, generator=self.gen)
        _, want_w = torch.autograd.grad(cpu_ops.reference_moe_combine(y, w), (y, w), gc)
        _, got_w = cuda_ops.moe_combine_backward(y.detach().flip(1), w.detach(), gc)
        self.assertGreater(_rel(got_w, want_w), 1e-3)


if __name__ == "__main__":
    unittest.main()
