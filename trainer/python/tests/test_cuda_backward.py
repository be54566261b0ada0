"""The CUDA ops' backward arithmetic (rollout_trainer.cuda_ops), on the CPU: each analytic
backward against torch autograd of the forward's formula in float64. The forwards are the
server's CUDA kernels and need a GPU (tests/gpu/trainer_parity.py checks them there, and the
whole model's gradients against a float32 torch model). Runs with Debian's /usr/bin/python3 and
python3-torch (trainer/python/run_tests.sh); nothing here loads the CUDA library."""

import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rollout_trainer import cuda_ops  # noqa: E402
from rollout_trainer import ops as cpu_ops  # noqa: E402

torch.manual_seed(0)
D = torch.float64


def _close(test, got, want, tol=1e-10):
    err = (got - want).abs().max().item() / max(want.abs().max().item(), 1e-30)
    test.assertLess(err, tol, f"relative error {err}")


class CudaBackwardTest(unittest.TestCase):
    def test_rms_norm_backward_is_autograds(self):
        x = torch.randn(7, 12, dtype=D, requires_grad=True)
        w = torch.randn(12, dtype=D, requires_grad=True)
        g = torch.randn(7, 12, dtype=D)
        gx, gw = torch.autograd.grad(cpu_ops.reference_rms_norm(x, w, 1e-6), (x, w), g)
        mx, mw = cuda_ops._rms_norm_backward(x.detach(), w.detach(), 1e-6, g)
        # fp32 inside: the backward casts to float.
        _close(self, mx.double(), gx, 1e-5)
        _close(self, mw.double(), gw, 1e-5)

    def test_qkv_norm_rope_backward_is_autograds(self):
        t, h, kv, d = 5, 4, 2, 8
        qkv = torch.randn(t, (h + 2 * kv) * d, dtype=D, requires_grad=True)
        qn = torch.randn(d, dtype=D, requires_grad=True)
        kn = torch.randn(d, dtype=D, requires_grad=True)
        ang = torch.rand(t, d // 2, dtype=D) * 6
        cos, sin = ang.cos(), ang.sin()

        def forward(qkv, qn, kn):
            q = qkv[:, :h * d].reshape(t, h, d)
            k = qkv[:, h * d:(h + kv) * d].reshape(t, kv, d)
            v = qkv[:, (h + kv) * d:].reshape(t, kv, d)
            q = cpu_ops.reference_rope(cpu_ops.reference_rms_norm(q, qn, 1e-6), cos, sin)
            k = cpu_ops.reference_rope(cpu_ops.reference_rms_norm(k, kn, 1e-6), cos, sin)
            return q, k, v

        q, k, v = forward(qkv, qn, kn)
        gq, gk, gv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
        want = torch.autograd.grad((q, k, v), (qkv, qn, kn), (gq, gk, gv))
        got = cuda_ops.qkv_norm_rope_backward(qkv.detach(), qn.detach(), kn.detach(), 1e-6, cos,
                                              sin, h, kv, d, gq, gk, gv)
        for a, b in zip(got, want):
            _close(self, a.double(), b, 1e-5)

    def test_silu_mul_backward_is_autograds(self):
        gu = torch.randn(6, 10, dtype=D, requires_grad=True)
        g = torch.randn(6, 5, dtype=D)
        (want,) = torch.autograd.grad(cpu_ops.reference_silu_mul(gu), (gu,), g)
        _close(self, cuda_ops.silu_mul_backward(gu.detach(), g).double(), want, 1e-5)

    def test_token_logprob_backward_is_autograds(self):
        for temperature in (1.0, 0.7, 1.3):
            logits = torch.randn(9, 31, dtype=D, requires_grad=True) * 4
            targets = torch.randint(0, 31, (9,))
            lsm = torch.log_softmax(logits / temperature, dim=-1)
            g = torch.randn(9, dtype=D)
            (want,) = torch.autograd.grad(lsm.gather(1, targets[:, None])[:, 0], (logits,), g)
            x = logits.detach() / temperature
            mx = x.max(-1).values
            ls = torch.log(torch.exp(x - mx[:, None]).sum(-1))
            got = cuda_ops.token_logprob_backward(logits.detach(), targets, mx, ls, temperature, g)
            _close(self, got, want)

    def test_the_backwards_can_fail(self):
        # The control: a wrong formula (silu's derivative without its second term) is caught.
        gu = torch.randn(6, 10, dtype=D, requires_grad=True)
        g = torch.randn(6, 5, dtype=D)
        (want,) = torch.autograd.grad(cpu_ops.reference_silu_mul(gu), (gu,), g)
        gate, up = gu.detach().chunk(2, dim=-1)
        s = torch.sigmoid(gate)
        wrong = torch.cat([g * up * s, g * gate * s], dim=-1)
        err = (wrong - want).abs().max().item() / want.abs().max().item()
        self.assertGreater(err, 1e-3)

    @unittest.skipUnless(hasattr(torch.nn.functional, "scaled_dot_product_attention"),
                         "torch < 2.0 has no SDPA (the GPU host's torch checks this)")
    def test_packed_sdpa_is_the_reference_attention(self):
        t, h, kv, d = 17, 4, 2, 8
        cu = torch.tensor([0, 5, 6, 11, 17])
        q = torch.randn(t, h, d, dtype=D)
        k = torch.randn(t, kv, d, dtype=D)
        v = torch.randn(t, kv, d, dtype=D)
        pack = cuda_ops.Packing(cu, "cpu", item_tokens=4)
        got = cuda_ops.sdpa_packed(q, k, v, pack, 0.35)
        _close(self, got, cpu_ops.reference_attention(q, k, v, cu, 0.35))

    def test_packing_cuts_items_within_sequences(self):
        pack = cuda_ops.Packing(torch.tensor([0, 5, 6, 15]), "cpu", item_tokens=4)
        self.assertEqual(pack.items.tolist(),
                         [[0, 4], [4, 1], [5, 1], [6, 4], [10, 4], [14, 1]])
        self.assertEqual(pack.positions.tolist(), [0, 1, 2, 3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8])
        self.assertEqual(pack.starts.tolist(), [0] * 5 + [5] + [6] * 9)
        self.assertEqual(pack.first.tolist(), [True] + [False] * 4 + [True, True] + [False] * 8)

    def test_segment_major_is_the_runners_leaf_layout(self):
        w = torch.arange(4 * 16, dtype=torch.float32).reshape(4, 16)
        s = cuda_ops.segment_major(w)
        self.assertEqual(tuple(s.shape), (8, 4, 2))
        for seg in range(8):
            self.assertTrue(torch.equal(s[seg], w[:, seg * 2:(seg + 1) * 2]))


if __name__ == "__main__":
    unittest.main()
