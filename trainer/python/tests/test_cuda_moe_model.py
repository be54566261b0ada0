"""CudaQwen3MoeModel's wiring on the CPU, over a plain-torch stand-in for the CUDA library
(tests/fake_cuda_lib.py: the kernels' formulas, not their bits): weights fused as the runner
holds them and named as the server serves them; the forward and the analytic backwards, with
bf16 standing for float64 (fake_cuda_lib.installed(wide=True)), equal to the float64 reference
function of the CPU Qwen3MoeModel and its autograd on the routing it chose; routing replay onto
the producing rows; the cuda contract for MoE. The bits are the GPU's to prove
(tests/gpu/trainer_parity.py, PRESETS=moe-small)."""

import os
import sys
import unittest

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fake_cuda_lib  # noqa: E402
from rollout_trainer import ContractError, CudaQwen3MoeModel, Qwen3MoeModel  # noqa: E402
from rollout_trainer import check_contract  # noqa: E402

E, K, H, MI = 4, 2, 32, 16
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
    "vocab_size": 40, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": MI,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [1],
}


def checkpoint(seed=0):
    """Random weights of CONFIG under the Hub's per-expert names, bf16 values in float32."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.3).to(torch.bfloat16).float()
    one = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to(torch.bfloat16).float()
    t = {"model.embed_tokens.weight": r(40, H), "model.norm.weight": one(H),
         "lm_head.weight": r(40, H)}
    for i in range(3):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": one(H), p + "post_attention_layernorm.weight": one(H),
                  p + "self_attn.q_proj.weight": r(32, H), p + "self_attn.k_proj.weight": r(16, H),
                  p + "self_attn.v_proj.weight": r(16, H), p + "self_attn.o_proj.weight": r(H, 32),
                  p + "self_attn.q_norm.weight": one(8), p + "self_attn.k_norm.weight": one(8)})
        if i == 1:
            t.update({p + "mlp.gate_proj.weight": r(48, H), p + "mlp.up_proj.weight": r(48, H),
                      p + "mlp.down_proj.weight": r(H, 48)})
            continue
        t[p + "mlp.gate.weight"] = r(E, H) * 4
        for e in range(E):
            t.update({f"{p}mlp.experts.{e}.gate_proj.weight": r(MI, H),
                      f"{p}mlp.experts.{e}.up_proj.weight": r(MI, H),
                      f"{p}mlp.experts.{e}.down_proj.weight": r(H, MI)})
    return t


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, 5, 6, 13, 22])
    return torch.randint(0, 40, (22,), generator=g), cu


def first_mask(cu, t):
    first = torch.zeros(t, dtype=torch.bool)
    first[cu[:-1]] = True
    return first


# Widened (wide=True), the model computes its function with fp32 rounding only.
TOL = 1e-4


class CudaMoeModelTest(unittest.TestCase):
    wide = True

    def setUp(self):
        self.tensors = checkpoint()
        self.ref = Qwen3MoeModel(CONFIG, self.tensors)  # before bf16 stands for float64
        self._fake = fake_cuda_lib.installed(wide=self.wide)
        self.fake = self._fake.__enter__()
        self.model = CudaQwen3MoeModel(CONFIG, self.tensors, device="cpu")

    def tearDown(self):
        self._fake.__exit__(None, None, None)

    def test_experts_are_fused_as_the_runner_holds_them_and_named_as_served(self):
        m = self.model
        gu = m.params["model__layers__2__mlp__experts__gate_up_proj"]
        down = m.params["model__layers__2__mlp__experts__down_proj"]
        self.assertEqual((tuple(gu.shape), tuple(down.shape)), ((E, 2 * MI, H), (E, H, MI)))
        self.assertEqual(gu.dtype, torch.bfloat16)  # float64 here (wide)
        # Expert e's gate rows, then its up rows.
        p = "model.layers.2.mlp.experts.3."
        self.assertTrue(torch.equal(gu[3, :MI].float(), self.tensors[p + "gate_proj.weight"]))
        self.assertTrue(torch.equal(gu[3, MI:].float(), self.tensors[p + "up_proj.weight"]))
        self.assertTrue(torch.equal(down[3].float(), self.tensors[p + "down_proj.weight"]))
        named = dict(m.named_weights())
        self.assertEqual(sorted(named), sorted(self.tensors))
        for name, t in self.tensors.items():
            self.assertTrue(torch.equal(named[name].float(), t), name)
        self.assertFalse(any("mlp__experts__0" in k for k in m.params))
        # load_weights writes through the per-expert names into the fused tensors.
        m.load_weights([(p + "up_proj.weight", torch.zeros(MI, H))])
        self.assertEqual(int((gu[3, MI:] != 0).sum()), 0)
        self.assertTrue(torch.equal(gu[3, :MI].float(), self.tensors[p + "gate_proj.weight"]))
        # The router is pinned after the dense GEMMs: the server's gemm_algorithms order.
        self.assertEqual(m.gemms.algorithms[-1], "router pin")
        self.assertEqual(len(m.gemms.algorithms), 6)

    def test_transformers5_fused_layout_loads_the_same_parameters(self):
        fused = {n: t for n, t in self.tensors.items() if ".mlp.experts." not in n}
        for i in (0, 2):
            p = f"model.layers.{i}.mlp.experts."
            fused[p + "gate_up_proj"] = torch.stack([torch.cat(
                [self.tensors[f"{p}{e}.gate_proj.weight"], self.tensors[f"{p}{e}.up_proj.weight"]])
                for e in range(E)])
            fused[p + "down_proj"] = torch.stack(
                [self.tensors[f"{p}{e}.down_proj.weight"] for e in range(E)])
        other = CudaQwen3MoeModel(CONFIG, fused, device="cpu")
        for k, v in self.model.params.items():
            self.assertTrue(torch.equal(v, other.params[k]), k)

    def test_a_dense_checkpoint_or_missing_expert_is_refused(self):
        dense = dict(CONFIG, architectures=["Qwen3ForCausalLM"])
        with self.assertRaises(ContractError) as e:
            CudaQwen3MoeModel(dense, self.tensors, device="cpu")
        self.assertEqual(e.exception.field, "architecture")
        missing = dict(self.tensors)
        del missing["model.layers.2.mlp.experts.1.down_proj.weight"]
        with self.assertRaisesRegex(ValueError, "experts.1.down_proj"):
            CudaQwen3MoeModel(CONFIG, missing, device="cpu")

    def test_forward_is_the_reference_function_on_the_routing_it_chose(self):
        tokens, cu = batch()
        lp, used = self.model.logprobs(tokens, cu, 0.7, return_routing=True)
        first = first_mask(cu, tokens.numel())
        self.assertEqual(tuple(used.shape), (tokens.numel(), 2, K))
        self.assertTrue(bool((lp[first] == 0).all()) and bool((used[first] == 0).all()))
        # The fake kernels choose as the CPU kernels do on these weights.
        ref_lp, ref_used = self.ref.logprobs(tokens, cu, 0.7, return_routing=True)
        self.assertTrue(torch.equal(used, ref_used))
        want = self.ref.logprobs(tokens, cu, 0.7, reference_dtype=torch.float64, routing=used)
        self.assertLess((lp.double() - want).abs().max().item(), TOL)
        # Control: the reference on another routing is far away.
        other = torch.where(first[:, None, None], used, (used + 1) % E)
        far = self.ref.logprobs(tokens, cu, 0.7, reference_dtype=torch.float64, routing=other)
        self.assertGreater((lp.double() - far).abs().max().item(), 1e-2)
        self.assertIn("rt_cuda_gemm 3", self.fake.calls)
        self.assertIn("rt_cuda_moe_combine", self.fake.calls)

    def test_a_replayed_routing_lands_on_the_producing_rows(self):
        tokens, cu = batch()
        t = tokens.numel()
        first = first_mask(cu, t)
        lp, used = self.model.logprobs(tokens, cu, 1.0, return_routing=True)
        # Replaying its own routing changes nothing.
        lp_same, used_same = self.model.logprobs(tokens, cu, 1.0, routing=used,
                                                 return_routing=True)
        self.assertTrue(torch.equal(lp_same, lp) and torch.equal(used_same, used))
        self.assertIn("rt_cuda_moe_route forced", self.fake.calls)
        # Another routing, replayed on the third sequence only: used there, chosen elsewhere.
        other = (used + 1) % E
        replay = torch.zeros(t, dtype=torch.bool)
        replay[6:13] = True
        lp2, used2 = self.model.logprobs(tokens, cu, 1.0, routing=other, replay=replay,
                                         return_routing=True)
        self.assertTrue(torch.equal(used2[7:13], other[7:13]))
        self.assertTrue(torch.equal(used2[:6], used[:6]))
        self.assertTrue(torch.equal(used2[13:], used[13:]))
        self.assertTrue(torch.equal(lp2[:6], lp[:6]) and torch.equal(lp2[13:], lp[13:]))
        self.assertTrue(bool((lp2[7:13] != lp[7:13]).all()))
        # It is the reference function of that routing.
        want = self.ref.logprobs(tokens, cu, 1.0, reference_dtype=torch.float64, routing=used2)
        self.assertLess((lp2.double() - want).abs().max().item(), TOL)
        # The CPU model's routing aligned the same way gives the same routing used.
        _, ref_used2 = self.ref.logprobs(tokens, cu, 1.0, routing=other, replay=replay,
                                         return_routing=True)
        self.assertTrue(torch.equal(ref_used2, used2))
        bad = used.clone()
        bad[9, 1] = torch.tensor([3, 3], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, "token 9 at MoE layer 2"):
            self.model.logprobs(tokens, cu, 1.0, routing=bad)
        self.assertFalse(bool(first[9]))

    def test_gradients_match_autograd_of_the_float64_reference(self):
        tokens, cu = batch()
        t = tokens.numel()
        g = torch.Generator().manual_seed(3)
        adv = torch.randn(t, generator=g)
        lp, used = self.model.logprobs(tokens, cu, 1.0, return_routing=True)
        (-(lp * adv).sum()).backward()
        ref = Qwen3MoeModel(CONFIG, self.tensors)
        want = ref.logprobs(tokens, cu, 1.0, reference_dtype=torch.float64, routing=used)
        (-(want * adv.double()).sum()).backward()
        mine = {}
        for name, (key, rows) in self.model._names.items():
            grad = self.model.params[key].grad
            mine[name] = (grad if rows is None else grad[rows]).double()
        worst = (0.0, "")
        for name, p in ref.named_weights():
            self.assertIsNotNone(p.grad, name)
            gref = p.grad.double()
            err = ((mine[name] - gref).norm() / gref.norm().clamp_min(1e-30)).item()
            worst = max(worst, (err, name))
        self.assertLess(worst[0], TOL, worst[1])
        # Every expert of every MoE layer got a gradient here, and the routers.
        for i in (0, 2):
            self.assertGreater(mine[f"model.layers.{i}.mlp.gate.weight"].abs().sum().item(), 0)


class CudaMoeModelBf16Test(unittest.TestCase):
    """The same model in bf16 as on the GPU: its rounding moves logprobs and gradients by bf16
    noise only (widened, the tests above pin the function)."""

    def test_bf16_forward_and_backward_are_the_reference_up_to_bf16_noise(self):
        tensors = checkpoint()
        ref = Qwen3MoeModel(CONFIG, tensors)
        tokens, cu = batch()
        adv = torch.randn(tokens.numel(), generator=torch.Generator().manual_seed(3))
        with fake_cuda_lib.installed():
            model = CudaQwen3MoeModel(CONFIG, tensors, device="cpu")
            self.assertEqual(model.params["model__layers__0__mlp__experts__down_proj"].dtype,
                             torch.bfloat16)
            lp, used = model.logprobs(tokens, cu, 1.0, return_routing=True)
            (-(lp * adv).sum()).backward()
        want = ref.logprobs(tokens, cu, 1.0, reference_dtype=torch.float64, routing=used)
        (-(want * adv.double()).sum()).backward()
        self.assertLess((lp.double() - want).abs().max().item(), 0.02 * want.abs().max().item())
        for name, p in ref.named_weights():
            key, rows = model._names[name]
            g = model.params[key].grad
            g = (g if rows is None else g[rows]).double()
            err = ((g - p.grad.double()).norm() / p.grad.double().norm()).item()
            self.assertLess(err, 0.1, name)


class CudaMoeContractTest(unittest.TestCase):
    def contract(self, **fields):
        c = {"backend": "cuda", "compute_dtype": "bfloat16+float32",
             "row_parallel_reduction": "canonical_k_tree_8", "kernels": "rollout-cuda/1",
             "architecture": "Qwen3MoeForCausalLM", "rope_type": "default",
             "served_dtype": "bfloat16", "tensor_parallel": 1, "gpu_model": "Fake GPU",
             "compute_capability": "9.0", "cuda_runtime": "13.0", "cublaslt_version": "130000",
             "attention_tile": 32, "attention_kernel": "tensor_core",
             "attention_split_size": 256, "gemm_pin_m": "256"}
        c.update(fields)
        return c

    def test_moe_is_honoured_at_tp1_and_refused_at_other_degrees(self):
        with fake_cuda_lib.installed():
            check_contract(self.contract(), device="cuda")
            check_contract(self.contract(row_parallel_reduction="fused"), device="cuda")
            # Dense models keep every degree of the canonical tree.
            check_contract(self.contract(architecture="Qwen3ForCausalLM", tensor_parallel=4),
                           device="cuda")
            for tp in (2, 8):
                with self.assertRaises(ContractError) as e:
                    check_contract(self.contract(tensor_parallel=tp), device="cuda")
                self.assertEqual(e.exception.field, "tensor_parallel")
                self.assertIn("TP 1 only", str(e.exception))
            for arch in ("Qwen2MoeForCausalLM", "MixtralForCausalLM"):
                with self.assertRaises(ContractError) as e:
                    check_contract(self.contract(architecture=arch), device="cuda")
                self.assertEqual(e.exception.field, "architecture")


if __name__ == "__main__":
    unittest.main()
