"""Qwen3MoeModel against real CPU rollout-servers on the moe-small preset (seed 0; 3 MoE layers
of 8 experts, 2 per token, norm_topk_prob, layer 1 dense): trainer logprobs == Generate ==
Score bit for bit over several hundred sampled tokens of packed batches of mixed lengths; the
routing the trainer chooses is the server's routing replay output; logprobs with a replayed
routing are Score's with that routing; gradients against autograd of a float64 plain-torch
forward; the MoE ops against their references (ties to the lower expert id); the fused
transformers 5 layout; the contract.

Run by trainer/python/run_tests.sh (ctest python_trainer_test) with Debian's /usr/bin/python3
and python3-torch; the model is written by rollout-make-model beside rollout-server.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "client", "python", "tests"))
import _support  # noqa: E402  (the client tests' server subprocess)

from rollout_client import RolloutClient  # noqa: E402
from rollout_trainer import ContractError, Qwen3Model, Qwen3MoeModel, check_contract  # noqa: E402
from rollout_trainer import ops  # noqa: E402
from rollout_trainer.moe_model import moe_layer_indices  # noqa: E402

_dir = None
_server = None
_client = None
_model = None


def setUpModule():
    global _dir, _server, _client, _model
    _dir = tempfile.mkdtemp(prefix="rollout-trainer-moe-")
    subprocess.run([os.path.join(_support.BIN_DIR, "rollout-make-model"), "--preset", "moe-small",
                    "--out", os.path.join(_dir, "hub")], check=True, stdout=subprocess.DEVNULL)
    _server = _support.Server(_support.cache_dir(), "--model", os.path.join(_dir, "hub"))
    _client = RolloutClient(_server.target)
    info = _client.server_info(timeout=60)
    _model = Qwen3MoeModel.from_pretrained(info.model.source, contract=info.numerics)


def tearDownModule():
    if _client is not None:
        _client.close()
    if _server is not None:
        _server.stop()
    if _dir is not None:
        shutil.rmtree(_dir, True)


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def pack(sequences):
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    cu = torch.tensor(np.cumsum([0] + [len(s) for s in sequences]), dtype=torch.long)
    return tokens, cu


def rollouts(temperature, seed, max_new_tokens, lengths=(1, 3, 7, 16, 17, 31, 64, 100)):
    """prompts, completions (2 samples each, with their routing), the packed sequences."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, _model.vocab) for _ in range(n)] for n in lengths]
    kwargs = {} if temperature == 0 else {"temperature": temperature, "top_p": 0.9}
    per_prompt = _client.generate(prompts, num_samples=2, seed=seed, max_new_tokens=max_new_tokens,
                                  ignore_eos=True, return_routing=True, **kwargs)
    completions = [c for samples in per_prompt for c in samples]
    sequences = [prompts[c.prompt_index] + list(c.token_ids) for c in completions]
    return prompts, completions, sequences


def completion_slices(prompts, completions, cu):
    return [slice(int(cu[i]) + len(prompts[c.prompt_index]), int(cu[i + 1]))
            for i, c in enumerate(completions)]


class MoeParityTest(unittest.TestCase):
    def check(self, temperature, seed, max_new_tokens):
        prompts, completions, sequences = rollouts(temperature, seed, max_new_tokens)
        starts = [len(prompts[c.prompt_index]) for c in completions]
        scored = _client.score(sequences, starts, temperature=temperature or None)
        tokens, cu = pack(sequences)
        with torch.no_grad():
            lp, routing = _model.logprobs(tokens, cu, temperature, return_routing=True)
            plain = _model.logprobs(tokens, cu, temperature, reference_dtype=torch.float32)
        slices = completion_slices(prompts, completions, cu)
        mine = np.concatenate([lp[s].numpy() for s in slices])
        control = np.concatenate([plain[s].numpy() for s in slices])
        generated = np.concatenate([np.float32(c.logprobs) for c in completions])
        score = np.concatenate([np.float32(s) for s in scored])
        total = generated.size
        self.assertGreaterEqual(total, 500)
        apart = int((bits(mine) != bits(generated)).sum())
        worst = float(np.max(np.abs(np.float64(mine) - np.float64(generated))))
        self.assertEqual(apart, 0, f"{apart} of {total} logprobs differ from Generate's "
                                   f"(max |diff| {worst})")
        self.assertEqual(int((bits(score) != bits(generated)).sum()), 0, "Score != Generate")
        # The control: plain torch float32 (its own reduction orders, torch.topk's choice) does
        # not give these bits, so the comparison above can fail.
        self.assertGreater(int((bits(control) != bits(generated)).sum()), total // 10)
        # The routing the trainer chose is the one Generate returned.
        mine_r = np.concatenate([routing[s].reshape(-1).numpy() for s in slices])
        theirs_r = np.concatenate([np.int32(c.routing) for c in completions])
        self.assertEqual(mine_r.size, total * _model.routing_size)
        self.assertTrue(np.array_equal(mine_r, theirs_r), "routing differs from Generate's")
        return prompts, completions, sequences

    def test_sampled_rollouts_are_bitwise_equal_to_generate_and_score(self):
        self.check(temperature=0.7, seed=11, max_new_tokens=40)

    def test_greedy_rollouts_are_bitwise_equal_too(self):
        self.check(temperature=0.0, seed=5, max_new_tokens=32)

    def test_every_rows_routing_is_the_servers(self):
        # Score(start = 1, return_routing) gives every row's routing, the prompt's too.
        rng = random.Random(8)
        seqs = [[rng.randrange(0, _model.vocab) for _ in range(n)] for n in (2, 19, 57)]
        results = _client.score(seqs, 1, details=True, return_routing=True)
        tokens, cu = pack(seqs)
        with torch.no_grad():
            lp, routing = _model.logprobs(tokens, cu, 1.0, return_routing=True)
        for i, r in enumerate(results):
            s = slice(int(cu[i]) + 1, int(cu[i + 1]))
            self.assertTrue(np.array_equal(routing[s].reshape(-1).numpy(), np.int32(r.routing)))
            self.assertTrue(np.array_equal(bits(lp[s].numpy()), bits(r.logprobs)))
        # A sequence alone routes and scores as it does in the packed batch.
        with torch.no_grad():
            alone = [_model.logprobs(*pack([q]), 1.0, return_routing=True) for q in seqs]
        self.assertTrue(np.array_equal(bits(lp.numpy()),
                                       bits(np.concatenate([a[0].numpy() for a in alone]))))
        self.assertTrue(torch.equal(routing, torch.cat([a[1] for a in alone])))

    def test_a_replayed_routing_gives_scores_logprobs_with_it(self):
        prompts, completions, sequences = rollouts(1.0, 9, 24, lengths=(5, 12, 40))
        starts = [len(prompts[c.prompt_index]) for c in completions]
        tokens, cu = pack(sequences)
        # Generate's own routing replayed: Generate's bits (R3 as a trainer uses it).
        routing, replay = _model.pack_routing([c.routing for c in completions], starts, cu)
        slices = completion_slices(prompts, completions, cu)
        generated = np.concatenate([np.float32(c.logprobs) for c in completions])
        with torch.no_grad():
            lp = _model.logprobs(tokens, cu, 1.0, routing=routing, replay=replay)
        self.assertTrue(np.array_equal(bits(np.concatenate([lp[s].numpy() for s in slices])),
                                       bits(generated)))
        # Another routing (each expert id + 1 mod 8: still two distinct experts per layer):
        # Score with it and the trainer with it agree bitwise, and differ from Generate's.
        other = [[(e + 1) % _model.num_experts for e in c.routing] for c in completions]
        scored = _client.score(sequences, starts, routings=other)
        routing, replay = _model.pack_routing(other, starts, cu)
        with torch.no_grad():
            lp = _model.logprobs(tokens, cu, 1.0, routing=routing, replay=replay)
        mine = np.concatenate([lp[s].numpy() for s in slices])
        theirs = np.concatenate([np.float32(s) for s in scored])
        self.assertEqual(int((bits(mine) != bits(theirs)).sum()), 0)
        # The control: the perturbed routing changes (almost) every logprob.
        self.assertGreater(int((bits(mine) != bits(generated)).sum()), generated.size // 2)

    def test_a_bad_routing_is_refused_naming_the_row(self):
        tokens, cu = pack([[5, 6, 7]])
        r = torch.zeros(3, len(_model.moe_layers), _model.top_k, dtype=torch.int32)
        r[..., 1] = 1
        bad = r.clone()
        bad[2, 1, 0] = 8  # token 2's routing at the second MoE layer (layer 2)
        with self.assertRaisesRegex(ValueError, r"token 2 at MoE layer 2 is \[8, 1\]: outside"):
            _model.logprobs(tokens, cu, 1.0, routing=bad)
        bad = r.clone()
        bad[1, 0, 1] = 0  # expert 0 twice
        with self.assertRaisesRegex(ValueError, "token 1 at MoE layer 0 .*twice"):
            _model.logprobs(tokens, cu, 1.0, routing=bad)
        # The op checks what it is given too (a replayed row's ids).
        with self.assertRaisesRegex(ValueError, "row 0 .*outside"):
            ops.moe_route(torch.zeros(1, 8), 2, True, torch.tensor([[0, 9]]))
        # An entry at a sequence's first token is not replayed (no row produced it).
        bad = r.clone()
        bad[0] = 99
        with torch.no_grad():
            self.assertTrue(torch.equal(_model.logprobs(tokens, cu, 1.0, routing=bad),
                                        _model.logprobs(tokens, cu, 1.0, routing=r)))
        with self.assertRaisesRegex(ValueError, "expected 18"):
            _model.logprobs(tokens, cu, 1.0, routing=r[:2])


class MoeTrainingLoopTest(unittest.TestCase):
    def test_rollout_step_push_rollout_keeps_the_bits(self):
        # A GRPO-shaped step on the MoE model: rollouts replayed (R3) into the trainer's
        # logprobs with autograd, an SGD step (routers and experts move), the weights rounded to
        # the served dtype and pushed under their Hub names, rollouts of the new weights equal to
        # the trainer's logprobs and routing again. Its own server and model: the update changes
        # both.
        server = _support.Server(_support.cache_dir(), "--model", os.path.join(_dir, "hub"))
        try:
            with RolloutClient(server.target) as client:
                info = client.server_info(timeout=60)
                model = Qwen3MoeModel.from_pretrained(info.model.source, contract=info.numerics)
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
                rng = random.Random(4)
                prompts = [[rng.randrange(3, model.vocab) for _ in range(n)] for n in (4, 9, 23)]
                for step in range(2):
                    per_prompt = client.generate(prompts, num_samples=2, seed=step,
                                                 temperature=1.0, max_new_tokens=24,
                                                 ignore_eos=True, return_routing=True)
                    comps = [c for samples in per_prompt for c in samples]
                    seqs = [prompts[c.prompt_index] + list(c.token_ids) for c in comps]
                    starts = [len(prompts[c.prompt_index]) for c in comps]
                    tokens, cu = pack(seqs)
                    routing, replay = model.pack_routing([c.routing for c in comps], starts, cu)
                    lp = model.logprobs(tokens, cu, 1.0, routing=routing, replay=replay)
                    slices = completion_slices(prompts, comps, cu)
                    mine = np.concatenate([lp.detach()[s].numpy() for s in slices])
                    theirs = np.concatenate([np.float32(c.logprobs) for c in comps])
                    self.assertTrue(np.array_equal(bits(mine), bits(theirs)), f"step {step}")
                    # Unreplayed, the trainer chooses the rollout's routing itself.
                    with torch.no_grad():
                        _, chosen = model.logprobs(tokens, cu, 1.0, return_routing=True)
                    self.assertTrue(torch.equal(chosen[replay], routing[replay]), f"step {step}")
                    adv = torch.tensor(rng.choices([-1.0, 1.0], k=tokens.numel()))
                    opt.zero_grad()
                    (-(lp * adv).mean()).backward()
                    opt.step()
                    model.load_weights([(n, p.detach()) for n, p in model.named_weights()])
                    before = client.server_info().weight_digest
                    client.update_weights(list(model.named_weights()), f"step-{step + 1}")
                    after = client.server_info()
                    self.assertEqual(after.weight_version, f"step-{step + 1}")
                    self.assertNotEqual(after.weight_digest, before, "the step changed no bit")
        finally:
            server.stop()


class MoeTensorParallelAndFusedLayoutTest(unittest.TestCase):
    def test_a_tp2_server_on_the_fused_layout_scores_the_trainers_bits(self):
        # transformers 5's fused experts, written from the Hub layout's tensors: the trainer
        # loads the same weights from it, and a --tp 2 server on it (TP 1's bits at every
        # degree, D10) scores the trainer's bits.
        fused = os.path.join(_dir, "fused")
        write_fused(os.path.join(_dir, "hub"), fused)
        model = Qwen3MoeModel.from_pretrained(fused)
        theirs, mine = model.state_dict(), _model.state_dict()
        self.assertEqual(set(theirs), set(mine))
        for k in mine:
            self.assertTrue(torch.equal(theirs[k], mine[k]), k)
        rng = random.Random(21)
        seqs = [[rng.randrange(0, _model.vocab) for _ in range(n)] for n in (2, 33, 70)]
        tokens, cu = pack(seqs)
        with torch.no_grad():
            lp = _model.logprobs(tokens, cu, 0.9).numpy()
        mine = np.concatenate([lp[int(cu[i]) + 1:int(cu[i + 1])] for i in range(len(seqs))])
        server = _support.Server(_support.cache_dir(), "--model", fused, "--tp", "2")
        try:
            with RolloutClient(server.target) as client:
                n = client.server_info(timeout=60).numerics
                self.assertEqual((n.tensor_parallel, n.architecture), (2, "Qwen3MoeForCausalLM"))
                check_contract(n)
                scored = client.score(seqs, 1, temperature=0.9)
        finally:
            server.stop()
        self.assertTrue(np.array_equal(bits(mine), bits(np.concatenate(
            [np.float32(s) for s in scored]))))


def write_fused(src: str, dst: str) -> None:
    """src's checkpoint with every MoE layer's experts fused as transformers 5 saves them
    (save_original_format=False): mlp.experts.gate_up_proj [E, 2 * I, H], down_proj [E, H, I]."""
    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), dst)
    with open(os.path.join(src, "model.safetensors"), "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    raw = {k: data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]]
           for k, v in header.items() if k != "__metadata__"}
    out = {}  # name -> (shape, bytes), bf16 throughout
    experts = {}
    for name, v in header.items():
        if name == "__metadata__":
            continue
        if ".mlp.experts." not in name:
            out[name] = (v["shape"], raw[name])
            continue
        prefix, rest = name.split(".mlp.experts.")
        e, proj = rest.split(".")[:2]
        experts.setdefault(prefix, {})[(int(e), proj)] = (v["shape"], raw[name])
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        gate_up = b"".join(parts[(e, "gate_proj")][1] + parts[(e, "up_proj")][1]
                           for e in range(count))
        inter, hidden = parts[(0, "gate_proj")][0]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = ([count, 2 * inter, hidden], gate_up)
        down = b"".join(parts[(e, "down_proj")][1] for e in range(count))
        out[f"{prefix}.mlp.experts.down_proj"] = ([count, hidden, inter], down)
    head, offset, blobs = {}, 0, []
    for name, (shape, blob) in out.items():
        head[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    text = json.dumps(head).encode()
    with open(os.path.join(dst, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


class MoeGradientTest(unittest.TestCase):
    def test_gradients_match_autograd_of_a_float64_forward(self):
        rng = random.Random(7)
        seqs = [[rng.randrange(0, _model.vocab) for _ in range(n)] for n in (5, 12, 1, 30)]
        tokens, cu = pack(seqs)
        advantages = torch.randn(tokens.numel(), generator=torch.Generator().manual_seed(0))
        # Both forwards route alike (the kernels' choice, replayed by the reference): the
        # gradient of one piece of the piecewise-smooth function, the selection constant.
        with torch.no_grad():
            _, routing = _model.logprobs(tokens, cu, 0.8, return_routing=True)

        def grads(reference_dtype):
            _model.zero_grad()
            lp = _model.logprobs(tokens, cu, 0.8, reference_dtype=reference_dtype,
                                 routing=routing)
            (-(lp.double() * advantages.double()).sum() / tokens.numel()).backward()
            out = {n: p.grad.double().clone() for n, p in _model.named_parameters()}
            _model.zero_grad()
            return lp.detach().double(), out

        lp32, g32 = grads(None)
        lp64, g64 = grads(torch.float64)
        self.assertLess(float((lp32 - lp64).abs().max()), 1e-3)
        self.assertEqual(set(g32), set(g64))
        routers = 0
        for name in g64:
            scale = float(g64[name].abs().max())
            if scale == 0.0:  # an expert no row chose: no gradient on either side
                self.assertIn("__mlp__experts__", name, f"{name}: no gradient")
                self.assertEqual(float(g32[name].abs().max()), 0.0, name)
                continue
            routers += name.endswith("mlp__gate__weight")
            err = float((g32[name] - g64[name]).abs().max()) / scale
            self.assertLess(err, 2e-3, f"{name}: relative gradient error {err}")
        self.assertEqual(routers, len(_model.moe_layers), "every router gets a gradient")

    def test_each_moe_op_is_the_servers_function_and_its_gradient(self):
        g = torch.Generator().manual_seed(2)
        logits = torch.randn(9, 8, generator=g)
        # Ties: equal logits choose the lower expert id first.
        logits[0] = 0.5
        logits[1, [2, 5, 6]] = 3.0
        ids, w = ops.moe_route(logits, 2, True)
        self.assertEqual(ids[0].tolist(), [0, 1])
        self.assertEqual(ids[1].tolist(), [2, 5])
        want = torch.sort(-logits, dim=-1, stable=True).indices[:, :2]
        self.assertTrue(torch.equal(ids.long(), want))
        self.assertTrue(torch.equal(w.sum(-1) > 0.999, torch.ones(9, dtype=torch.bool)))
        # Without renormalisation the weights are the probabilities themselves.
        _, raw = ops.moe_route(logits, 2, False)
        self.assertLess(float((raw.double() - torch.softmax(logits.double(), -1).gather(
            -1, ids.long())).abs().max()), 1e-6)
        # Forced rows take the given ids, in the given order; the others choose.
        forced = torch.tensor([[7, 3]] * 9, dtype=torch.int32)
        rows = torch.zeros(9, dtype=torch.bool)
        rows[4] = True
        fids, _ = ops.moe_route(logits, 2, True, forced, rows)
        self.assertEqual(fids[4].tolist(), [7, 3])
        self.assertTrue(torch.equal(fids[rows.logical_not()], ids[rows.logical_not()]))

        x = torch.randn(6, 48, generator=g)
        gate_up = torch.randn(2 * 24, 48, generator=g)  # inter 24: the tree's 8 segments of 3
        down = torch.randn(48, 24, generator=g)
        y = torch.randn(6, 2, 48, generator=g)
        cw = torch.rand(6, 2, generator=g)
        cases = {
            "moe_route": (lambda a: ops.moe_route(a, 2, True)[1],
                          lambda a: ops.reference_moe_weights(a, ids, True), (logits,)),
            "moe_combine": (ops.moe_combine, ops.reference_moe_combine, (y, cw)),
            "expert_mlp": (ops.expert_mlp, ops.reference_expert_mlp, (x, gate_up, down)),
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
            self.assertTrue(torch.autograd.gradcheck(
                ref, [a.double().requires_grad_(True) for a in args]), name)
            for a, b in zip(got, want):
                err = float((a.double() - b).abs().max() / b.abs().max())
                self.assertLess(err, 1e-4, f"{name}: relative gradient error {err}")
        # The combine is the server's fixed order with one fma per step, not torch's sum: the
        # float64 product rounded once per step, accumulated from +0 in rank order.
        acc = torch.zeros(6, 48, dtype=torch.float64)
        for j in range(2):
            acc = (acc + cw[:, j:j + 1].double() * y[:, j].double()).float().double()
        self.assertTrue(torch.equal(ops.moe_combine(y, cw), acc.float()))


class MoeContractTest(unittest.TestCase):
    def test_a_moe_contract_is_honoured_and_other_moe_architectures_refused(self):
        info = _client.server_info()
        n = info.numerics
        self.assertEqual(n.architecture, "Qwen3MoeForCausalLM")
        self.assertEqual(list(info.model.moe_layers), _model.moe_layers)
        self.assertEqual((info.model.num_experts, info.model.num_experts_per_tok),
                         (_model.num_experts, _model.top_k))
        # The layer rule: decoder_sparse_step, then mlp_only_layers.
        self.assertEqual(moe_layer_indices({"num_hidden_layers": 6, "decoder_sparse_step": 2,
                                            "mlp_only_layers": [3]}), [1, 5])
        check_contract(n)
        for arch in ("Qwen2MoeForCausalLM", "MixtralForCausalLM"):
            with self.assertRaises(ContractError) as ctx:
                check_contract(dataclasses.replace(n, architecture=arch))
            self.assertEqual(ctx.exception.field, "architecture")
        # A MoE checkpoint is not a dense model's, nor the other way round.
        source = _client.server_info().model.source
        with self.assertRaises(ContractError) as ctx:
            Qwen3Model.from_pretrained(source)
        self.assertEqual(ctx.exception.field, "architecture")
        dense = os.path.join(_dir, "dense")
        subprocess.run([os.path.join(_support.BIN_DIR, "rollout-make-model"), "--preset", "tiny",
                        "--out", dense], check=True, stdout=subprocess.DEVNULL)
        with self.assertRaises(ContractError) as ctx:
            Qwen3MoeModel.from_pretrained(dense, contract=n)
        self.assertEqual(ctx.exception.field, "architecture")


if __name__ == "__main__":
    unittest.main()
