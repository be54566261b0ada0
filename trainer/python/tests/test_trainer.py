"""rollout_trainer against a real CPU rollout-server on the embedded default model (the small
preset, seed 0): trainer logprobs == Score == Generate bit for bit over several hundred sampled
tokens in batches of mixed lengths; gradients against autograd of a plain-torch float64
forward; a mismatched numerics contract refused, naming the field.

Run by trainer/python/run_tests.sh (ctest python_trainer_test) with Debian's /usr/bin/python3
and python3-torch; torch missing is a failure there, never a skip.
"""

from __future__ import annotations

import dataclasses
import os
import random
import sys
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "client", "python", "tests"))
import _support  # noqa: E402  (the client tests' server subprocess)

from rollout_client import RolloutClient  # noqa: E402
import rollout_trainer  # noqa: E402
from rollout_trainer import ContractError, Qwen3Model, check_contract  # noqa: E402
from rollout_trainer import ops  # noqa: E402

_server = None
_client = None
_model = None


def setUpModule():
    global _server, _client, _model
    _server = _support.Server(_support.cache_dir())
    _client = RolloutClient(_server.target)
    info = _client.server_info(timeout=60)
    _model = Qwen3Model.from_pretrained(info.model.source, contract=info.numerics)


def tearDownModule():
    if _client is not None:
        _client.close()
    if _server is not None:
        _server.stop()


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def pack(sequences):
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    cu = torch.tensor(np.cumsum([0] + [len(s) for s in sequences]), dtype=torch.long)
    return tokens, cu


class ParityTest(unittest.TestCase):
    def rollouts(self, temperature, top_p, seed, max_new_tokens):
        rng = random.Random(seed)
        vocab = _model.vocab
        lengths = [1, 3, 7, 16, 17, 31, 64, 100]  # across KV pages and prefill chunks
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
        kwargs = {} if temperature == 0 else {"temperature": temperature, "top_p": top_p}
        per_prompt = _client.generate(prompts, num_samples=2, seed=seed,
                                      max_new_tokens=max_new_tokens, ignore_eos=True, **kwargs)
        return prompts, [c for samples in per_prompt for c in samples]

    def check(self, temperature, top_p, seed, max_new_tokens):
        prompts, completions = self.rollouts(temperature, top_p, seed, max_new_tokens)
        sequences = [prompts[c.prompt_index] + list(c.token_ids) for c in completions]
        starts = [len(prompts[c.prompt_index]) for c in completions]
        score_t = temperature if temperature > 0 else None
        scored = _client.score(sequences, starts, temperature=score_t)
        tokens, cu = pack(sequences)
        with torch.no_grad():
            lp = _model.logprobs(tokens, cu, temperature).numpy()
            plain = _model.logprobs(tokens, cu, temperature,
                                    reference_dtype=torch.float32).numpy()
        mine, generated, score, control = [], [], [], []
        for i, (c, s) in enumerate(zip(completions, scored)):
            begin = int(cu[i]) + starts[i]
            mine.extend(lp[begin:int(cu[i + 1])])
            control.extend(plain[begin:int(cu[i + 1])])
            generated.extend(c.logprobs)
            score.extend(s)
        total = len(generated)
        self.assertGreaterEqual(total, 500)
        self.assertEqual(len(mine), total)
        apart = int((bits(mine) != bits(generated)).sum())
        worst = float(np.max(np.abs(np.float64(mine) - np.float64(generated))))
        self.assertEqual(apart, 0, f"{apart} of {total} logprobs differ from Generate's "
                                   f"(max |diff| {worst})")
        self.assertEqual(int((bits(score) != bits(generated)).sum()), 0, "Score != Generate")
        # The control: plain torch in float32 (other reduction orders) does not give these bits,
        # so the comparison above can fail.
        self.assertGreater(int((bits(control) != bits(generated)).sum()), total // 10)
        return total

    def test_sampled_rollouts_are_bitwise_equal_to_generate_and_score(self):
        self.check(temperature=0.7, top_p=0.9, seed=11, max_new_tokens=40)

    def test_greedy_and_hot_rollouts_are_bitwise_equal_too(self):
        self.check(temperature=0.0, top_p=1.0, seed=5, max_new_tokens=32)
        self.check(temperature=1.3, top_p=1.0, seed=6, max_new_tokens=32)

    def test_a_sequence_alone_has_the_bits_it_has_in_a_packed_batch(self):
        rng = random.Random(3)
        seqs = [[rng.randrange(0, _model.vocab) for _ in range(n)] for n in (9, 40, 2)]
        tokens, cu = pack(seqs)
        with torch.no_grad():
            together = _model.logprobs(tokens, cu, 1.0).numpy()
            alone = np.concatenate([_model.logprobs(*pack([s]), 1.0).numpy() for s in seqs])
        self.assertTrue(np.array_equal(bits(together), bits(alone)))


class TensorParallelTest(unittest.TestCase):
    def test_a_tp2_and_a_tp4_server_score_the_trainers_bits(self):
        # The canonical K tree gives every degree TP 1's bits (D10); the trainer computes TP 1.
        rng = random.Random(21)
        seqs = [[rng.randrange(0, _model.vocab) for _ in range(n)] for n in (2, 33, 70)]
        tokens, cu = pack(seqs)
        with torch.no_grad():
            lp = _model.logprobs(tokens, cu, 0.9).numpy()
        mine = np.concatenate([lp[int(cu[i]) + 1:int(cu[i + 1])] for i in range(len(seqs))])
        for tp in (2, 4):
            server = _support.Server(_support.cache_dir(), "--tp", str(tp))
            try:
                with RolloutClient(server.target) as client:
                    n = client.server_info(timeout=60).numerics
                    self.assertEqual(n.tensor_parallel, tp)
                    check_contract(n)
                    scored = client.score(seqs, 1, temperature=0.9)
            finally:
                server.stop()
            theirs = np.concatenate([np.float32(s) for s in scored])
            self.assertTrue(np.array_equal(bits(mine), bits(theirs)), f"tp {tp}")


class TrainingLoopTest(unittest.TestCase):
    def test_rollout_step_push_rollout_keeps_the_bits(self):
        # A GRPO-shaped loop: rollouts, the trainer's logprobs (with autograd) equal to them,
        # a step, the new weights pushed to the server, rollouts of the new weights equal to the
        # trainer's logprobs again. Its own server and model: the update changes both.
        server = _support.Server(_support.cache_dir())
        try:
            with RolloutClient(server.target) as client:
                info = client.server_info(timeout=60)
                model = Qwen3Model.from_pretrained(info.model.source, contract=info.numerics)
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                rng = random.Random(4)
                prompts = [[rng.randrange(3, model.vocab) for _ in range(n)] for n in (4, 9, 23)]
                for step in range(2):
                    per_prompt = client.generate(prompts, num_samples=2, seed=step,
                                                 temperature=1.0, max_new_tokens=24,
                                                 ignore_eos=True)
                    comps = [c for samples in per_prompt for c in samples]
                    seqs = [prompts[c.prompt_index] + list(c.token_ids) for c in comps]
                    tokens, cu = pack(seqs)
                    lp = model.logprobs(tokens, cu, 1.0)
                    mine = np.concatenate([
                        lp.detach().numpy()[int(cu[i]) + len(prompts[c.prompt_index]):
                                            int(cu[i + 1])] for i, c in enumerate(comps)])
                    theirs = np.concatenate([np.float32(c.logprobs) for c in comps])
                    self.assertTrue(np.array_equal(bits(mine), bits(theirs)), f"step {step}")
                    adv = torch.tensor(rng.choices([-1.0, 1.0], k=tokens.numel()))
                    opt.zero_grad()
                    (-(lp * adv).mean()).backward()
                    opt.step()
                    # The served weights are the step's cast to bfloat16: the trainer's too.
                    model.load_weights([(n, p.detach()) for n, p in model.named_weights()])
                    before = client.server_info().weight_digest
                    client.update_weights(list(model.named_weights()), f"step-{step + 1}")
                    after = client.server_info()
                    self.assertEqual(after.weight_version, f"step-{step + 1}")
                    self.assertNotEqual(after.weight_digest, before, "the step changed no bit")
        finally:
            server.stop()


class GradientTest(unittest.TestCase):
    def test_gradients_match_autograd_of_a_float64_forward(self):
        rng = random.Random(7)
        seqs = [[rng.randrange(0, _model.vocab) for _ in range(n)] for n in (5, 12, 1, 20)]
        tokens, cu = pack(seqs)
        advantages = torch.randn(tokens.numel(), generator=torch.Generator().manual_seed(0))
        temperature = 0.8

        def grads(reference_dtype):
            _model.zero_grad()
            lp = _model.logprobs(tokens, cu, temperature, reference_dtype=reference_dtype)
            loss = -(lp.double() * advantages.double()).sum() / tokens.numel()
            loss.backward()
            out = {n: p.grad.double().clone() for n, p in _model.named_parameters()}
            _model.zero_grad()
            return lp.detach().double(), out

        lp32, g32 = grads(None)
        lp64, g64 = grads(torch.float64)
        self.assertLess(float((lp32 - lp64).abs().max()), 1e-3)
        self.assertEqual(set(g32), set(g64))
        worst = 0.0
        for name in g64:
            scale = float(g64[name].abs().max())
            self.assertGreater(scale, 0.0, f"{name}: no gradient")
            err = float((g32[name] - g64[name]).abs().max()) / scale
            worst = max(worst, err)
            self.assertLess(err, 2e-3, f"{name}: relative gradient error {err}")

    def test_each_op_backward_is_the_gradient_of_its_forward(self):
        # An op's backward differentiates its plain-torch reference; that is the gradient of the
        # kernel's forward when the two forwards agree (checked against the float64 reference
        # here: a reference that computed another function would fail) and autograd of the
        # reference is right (checked in float64, the gradients of the float32 op against it).
        g = torch.Generator().manual_seed(1)
        x = torch.randn(6, 48, generator=g)
        w = torch.randn(40, 48, generator=g)
        q = torch.randn(7, 4, 16, generator=g)
        kv = torch.randn(7, 2, 16, generator=g)
        vv = torch.randn(7, 2, 16, generator=g)
        cu = torch.tensor([0, 3, 4, 7])
        positions, _ = ops.packed_positions(cu)
        cos, sin = ops.rope_cos_sin(positions, 16, 1e6)
        cases = {
            "attention": (lambda a, b, c: ops.attention(a, b, c, cu, 0.25),
                          lambda a, b, c: ops.reference_attention(a, b, c, cu, 0.25),
                          (q, kv, vv)),
            "rope": (lambda a: ops.rope(a, cos, sin),
                     lambda a: ops.reference_rope(a, cos, sin), (q,)),
            "add": (ops.add, ops.reference_add, (x, x.flip(0))),
            "matmul": (lambda a, b: ops.matmul(a, b), ops.reference_matmul, (x, w)),
            "row_parallel_matmul": (lambda a, b: ops.row_parallel_matmul(a, b),
                                    ops.reference_matmul, (x, w)),
            "rms_norm": (lambda a, b: ops.rms_norm(a, b, 1e-6),
                         lambda a, b: ops.reference_rms_norm(a, b, 1e-6), (x, w[0])),
            "silu_mul": (ops.silu_mul, ops.reference_silu_mul, (x,)),
            "log_softmax": (lambda a: ops.log_softmax(a, 0.7),
                            lambda a: ops.reference_log_softmax(a, 0.7), (x,)),
        }
        for name, (op, ref, args) in cases.items():
            ins = [a.clone().requires_grad_(True) for a in args]
            out = op(*ins)
            with torch.no_grad():
                ref_out = ref(*[a.double() for a in args])
            fwd = float((out.double() - ref_out).abs().max() / ref_out.abs().max())
            self.assertLess(fwd, 1e-5, f"{name}: forward differs from its reference by {fwd}")
            cot = torch.randn(out.shape, generator=g)
            got = torch.autograd.grad(out, ins, cot)
            ins64 = [a.double().requires_grad_(True) for a in args]
            want = torch.autograd.grad(ref(*ins64), ins64, cot.double())
            # The reference's autograd against its own finite differences (float64).
            self.assertTrue(torch.autograd.gradcheck(
                ref, [a.double().requires_grad_(True) for a in args]), name)
            for a, b in zip(got, want):
                err = float((a.double() - b).abs().max() / b.abs().max())
                self.assertLess(err, 1e-4, f"{name}: relative gradient error {err}")


class ContractTest(unittest.TestCase):
    def test_the_server_reports_a_contract_this_library_honours(self):
        n = _client.server_info().numerics
        self.assertIsNotNone(n)
        self.assertEqual((n.backend, n.compute_dtype, n.row_parallel_reduction, n.rope_type),
                         ("cpu", "float32", "canonical_k_tree_8", "default"))
        self.assertEqual(n.kernels, rollout_trainer.kernels_version())
        self.assertEqual(n.architecture, "Qwen3ForCausalLM")
        self.assertEqual(n.served_dtype, "bfloat16")
        self.assertEqual(n.tensor_parallel, 1)
        self.assertEqual(n.gpu_model, "")
        check_contract(n)

    def test_a_mismatched_contract_is_refused_naming_the_field(self):
        n = _client.server_info().numerics
        source = _client.server_info().model.source
        for field, value in (("kernels", "rollout-cpu-ref/0"), ("backend", "cuda"),
                             ("architecture", "Qwen2MoeForCausalLM"),
                             ("row_parallel_reduction", "fused"), ("tensor_parallel", 3),
                             ("compute_dtype", "bfloat16"), ("rope_type", "yarn")):
            bad = dataclasses.replace(n, **{field: value})
            with self.assertRaises(ContractError) as ctx:
                check_contract(bad)
            self.assertEqual(ctx.exception.field, field)
            self.assertIn(f"'{field}'", str(ctx.exception))
            with self.assertRaises(ContractError):
                Qwen3Model.from_pretrained(source, contract=bad)
        # A contract that names another served dtype than the checkpoint's config.
        with self.assertRaises(ContractError) as ctx:
            Qwen3Model.from_pretrained(source, contract=dataclasses.replace(
                n, served_dtype="float32"))
        self.assertEqual(ctx.exception.field, "served_dtype")
        with self.assertRaises(ContractError) as ctx:
            check_contract(None)
        self.assertEqual(ctx.exception.field, "numerics")


if __name__ == "__main__":
    unittest.main()
