"""Trainer-side tensor parallelism (rollout_trainer.tp) on the embedded default model (the small
preset, seed 0): ranks of a gloo group on 127.0.0.1 at TP 2, 4 and 8 (spawned processes) give,
on every rank, TP 1's logprobs bit for bit, which are Score's from CPU servers at --tp 1, 2 and
4 and Generate's from the --tp 2 server (trainer TP k == rollout TP m); each rank's parameter
gradients of a policy-gradient loss are the slices of TP 1's. Controls: folding the ranks' K-tree
nodes in another order changes the bits; dropping the all-reduce of Megatron's f from the
backward changes the gradients beyond the bound.

Run by trainer/python/run_tests.sh (ctest python_trainer_test).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue as queue_module
import random
import socket
import sys
import time
import traceback
import unittest

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "client", "python", "tests"))
import _support  # noqa: E402  (the client tests' server subprocess)

from rollout_client import RolloutClient  # noqa: E402
from rollout_trainer import Qwen3Model, TpQwen3Model, ops, tp as tp_mod  # noqa: E402
from rollout_trainer.contract import check_trainer_tensor_parallel  # noqa: E402

TEMPERATURE = 0.9
GRAD_BOUND = 1e-4  # relative to the tensor's largest TP 1 gradient (measured: ~3e-6)

_path = None      # the model's folder
_numerics = {}    # server TP degree -> its ServerInfo.numerics
_scored = {}      # server TP degree -> Score's logprobs of _seqs (from token 1 of each)
_seqs = None      # random sequences, then rollouts of the --tp 2 server
_generated = None  # [(sequence index, prompt length, Generate's logprobs)]
_tp1 = None       # TP 1: (logprobs [t], {name: gradient}, config)
_ranks = {}       # trainer TP degree -> [per rank result]
_tied = None      # the model with tie_word_embeddings: (TP 1's logprobs and gradients, TP 2's)


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def pack(sequences):
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    cu = torch.tensor(np.cumsum([0] + [len(s) for s in sequences]), dtype=torch.long)
    return tokens, cu


def advantages(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0))


def logprobs_and_grads(model, tokens, cu):
    """The logprobs [t] and the gradients of a policy-gradient loss, {HF name: gradient}."""
    model.zero_grad()
    lp = model.logprobs(tokens, cu, TEMPERATURE)
    (-(lp.double() * advantages(tokens.numel()).double()).sum() / tokens.numel()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_weights()}
    model.zero_grad()
    return lp.detach(), grads


def sequential_fold(gathered):
    """A wrong fold: ((p0 + p1) + p2) + p3 instead of the tree's (p0 + p1) + (p2 + p3)."""
    y = gathered[0]
    for part in gathered[1:]:
        y = y + part
    return y


def _rank_main(rank, tp, port, path, contract, tokens, cu, controls, queue):
    """One trainer rank: its logprobs and shard gradients (and the controls') into `queue`."""
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=tp)
        model = TpQwen3Model.from_pretrained(path, contract=contract, tp_group=dist.group.WORLD)
        lp, grads = logprobs_and_grads(model, tokens, cu)
        out = {"lp": lp.numpy(), "grads": {n: g.numpy() for n, g in grads.items()}}
        # The whole model gathered back is the checkpoint's (as served), and loading it back
        # leaves every shard as it was.
        full = Qwen3Model.from_pretrained(path)
        gathered = list(model.full_named_weights())
        out["full_apart"] = [n for n, w in gathered
                             if not torch.equal(w.view(torch.int32),
                                                full.weight(n).detach().view(torch.int32))]
        before = {n: p.detach().clone() for n, p in model.named_weights()}
        model.load_weights(gathered)
        out["reload_apart"] = [n for n, p in model.named_weights()
                               if not torch.equal(p.detach(), before[n])]
        if controls:
            fold = tp_mod.combine
            tp_mod.combine = sequential_fold
            try:
                with torch.no_grad():
                    out["lp_wrong_fold"] = model.logprobs(tokens, cu, TEMPERATURE).numpy()
            finally:
                tp_mod.combine = fold
            backward = tp_mod._CopyToTp.backward
            tp_mod._CopyToTp.backward = staticmethod(lambda ctx, grad: (grad, None))
            try:
                _, wrong = logprobs_and_grads(model, tokens, cu)
            finally:
                tp_mod._CopyToTp.backward = backward
            out["grads_without_f"] = {n: g.numpy() for n, g in wrong.items()}
        queue.put((rank, out))
    except BaseException:  # noqa: B902 -- reported to the parent, which fails the test
        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(tp: int, path: str, contract, tokens, cu, controls: bool):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, tp, port, path, contract, tokens, cu, controls, queue))
             for r in range(tp)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + 240
    try:
        while len(results) < tp:
            try:
                rank, out = queue.get(timeout=1)
                results[rank] = out
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and
                        r not in results]
                if dead or time.monotonic() > deadline:
                    raise AssertionError(f"TP {tp}: ranks {dead or 'all'} gave no result "
                                         f"(exit codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for r in range(tp):
        if isinstance(results[r], str):
            raise AssertionError(f"TP {tp} rank {r} failed:\n{results[r]}")
    return [results[r] for r in range(tp)]


def tied_copy(path: str, out: str) -> str:
    """`path`'s model with tie_word_embeddings (embed_tokens is also the lm_head)."""
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(path, f), os.path.join(out, f))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(dict(config, tie_word_embeddings=True), f)
    return out


def setUpModule():
    global _path, _seqs, _generated, _tp1, _tied
    rng = random.Random(21)
    servers = {}
    try:
        for tp in (1, 2, 4):
            servers[tp] = _support.Server(_support.cache_dir(), "--tp", str(tp))
            with RolloutClient(servers[tp].target) as client:
                info = client.server_info(timeout=60)
                _numerics[tp] = info.numerics
                _path = info.model.source
        vocab = 4096
        _seqs = [[rng.randrange(0, vocab) for _ in range(n)] for n in (2, 33, 70)]
        prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17)]
        with RolloutClient(servers[2].target) as client:
            per_prompt = client.generate(prompts, num_samples=2, seed=3, temperature=TEMPERATURE,
                                         max_new_tokens=24, ignore_eos=True)
        _generated = []
        for c in (c for samples in per_prompt for c in samples):
            _generated.append((len(_seqs), len(prompts[c.prompt_index]), list(c.logprobs)))
            _seqs.append(prompts[c.prompt_index] + list(c.token_ids))
        for tp, server in servers.items():
            with RolloutClient(server.target) as client:
                _scored[tp] = client.score(_seqs, 1, temperature=TEMPERATURE)
    finally:
        for server in servers.values():
            server.stop()
    tokens, cu = pack(_seqs)
    model = Qwen3Model.from_pretrained(_path, contract=_numerics[1])
    lp, grads = logprobs_and_grads(model, tokens, cu)
    _tp1 = (lp.numpy(), grads, model.config)
    # The trainer's degree is its own: the ranks check a server contract of another degree.
    for tp, contract_tp, controls in ((2, 4, False), (4, 2, True), (8, 1, False)):
        _ranks[tp] = run_ranks(tp, _path, dataclasses.asdict(_numerics[contract_tp]), tokens,
                               cu, controls)
    tied = tied_copy(_path, os.path.join(_support.cache_dir(), "tied"))
    lp, grads = logprobs_and_grads(Qwen3Model.from_pretrained(tied), tokens, cu)
    _tied = ((lp.numpy(), grads, model.config), run_ranks(2, tied, None, tokens, cu, False))


class TensorParallelParityTest(unittest.TestCase):
    def test_every_rank_at_tp_2_4_8_has_tp1s_bits(self):
        want = bits(_tp1[0])
        for tp, ranks in _ranks.items():
            for r, out in enumerate(ranks):
                apart = int((bits(out["lp"]) != want).sum())
                self.assertEqual(apart, 0, f"TP {tp} rank {r}: {apart} of {want.size} differ")

    def test_trainer_tp_k_equals_score_of_a_server_at_tp_m(self):
        _, cu = pack(_seqs)
        for k, ranks in [(1, [{"lp": _tp1[0]}])] + list(_ranks.items()):
            for r, out in enumerate(ranks):
                mine = np.concatenate([out["lp"][int(cu[i]) + 1:int(cu[i + 1])]
                                       for i in range(len(_seqs))])
                for m, scored in _scored.items():
                    theirs = np.concatenate([np.float32(s) for s in scored])
                    self.assertEqual(mine.size, theirs.size)
                    apart = int((bits(mine) != bits(theirs)).sum())
                    self.assertEqual(apart, 0, f"trainer TP {k} rank {r} vs server --tp {m}: "
                                               f"{apart} of {mine.size} differ")

    def test_trainer_tp_k_equals_generate_of_a_tp2_server(self):
        _, cu = pack(_seqs)
        total = 0
        for k, ranks in _ranks.items():
            for r, out in enumerate(ranks):
                for i, prompt_len, generated in _generated:
                    mine = out["lp"][int(cu[i]) + prompt_len:int(cu[i + 1])]
                    self.assertTrue(np.array_equal(bits(mine), bits(generated)),
                                    f"TP {k} rank {r}, rollout {i}")
                    total += len(generated)
        self.assertGreater(total, 0)

    def test_tied_embeddings_at_tp2_have_tp1s_bits_and_gradients(self):
        (lp, grads, config), ranks = _tied
        self.assertNotIn("lm_head.weight", grads)
        for r, out in enumerate(ranks):
            self.assertTrue(np.array_equal(bits(out["lp"]), bits(lp)), f"rank {r}")
            shard = tp_mod.shard_of(config, 2, r)
            name = "model.embed_tokens.weight"  # the lookup's and the head's gradient
            want = grads[name][tp_mod.shard_index(name, shard, config)].double()
            err = float((torch.from_numpy(out["grads"][name]).double() - want).abs().max() /
                        want.abs().max())
            self.assertLess(err, GRAD_BOUND, f"rank {r}")

    def test_folding_the_nodes_in_another_order_changes_the_bits(self):
        # The control: the comparisons above can fail. A rank-order sequential sum of the TP 4
        # ranks' nodes is not the tree's fold.
        want = bits(_tp1[0])
        for r, out in enumerate(_ranks[4]):
            apart = int((bits(out["lp_wrong_fold"]) != want).sum())
            self.assertGreater(apart, want.size // 4, f"rank {r}: only {apart} differ")


class TreeOpsTest(unittest.TestCase):
    def test_the_ranks_nodes_fold_to_the_row_parallel_matmul_at_every_degree(self):
        # Odd shapes: K = 99 and 61 cut into segments of 12 or 13 (7 or 8); m = 1 and 5.
        g = torch.Generator().manual_seed(2)
        for m, n, k in ((1, 7, 99), (5, 33, 61), (3, 16, 256)):
            x = torch.randn(m, k, generator=g)
            w = torch.randn(n, k, generator=g)
            want = ops.row_parallel_matmul(x, w)
            for tp in (1, 2, 4, 8):
                nodes = []
                for r in range(tp):
                    s0, s1 = r * 8 // tp, (r + 1) * 8 // tp
                    cols = slice(ops.k_segment_begin(k, s0), ops.k_segment_begin(k, s1))
                    nodes.append(ops.segmented_partial_matmul(x[:, cols], w[:, cols], k, s0, s1))
                got = ops.combine_partials(torch.stack(nodes))
                self.assertTrue(torch.equal(got, want), f"m {m} n {n} k {k} tp {tp}")
                if tp >= 4:  # the control: another fold of the same nodes
                    self.assertFalse(torch.equal(sequential_fold(torch.stack(nodes)), want))
        with self.assertRaises(ValueError):  # not a node of the tree
            ops.segmented_partial_matmul(x[:, :96], w[:, :96], 256, 0, 3)

    def test_the_tree_ops_backwards_are_the_gradients_of_their_forwards(self):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(6, 40, generator=g, requires_grad=True)
        w = torch.randn(9, 40, generator=g, requires_grad=True)
        parts = torch.randn(4, 6, 9, generator=g, requires_grad=True)
        for op, ref, args in (
                (lambda a, b: ops.segmented_partial_matmul(a, b, 160, 4, 6),
                 ops.reference_matmul, (x, w)),
                (ops.combine_partials, ops.reference_combine_partials, (parts,))):
            out = op(*args)
            ins64 = [a.detach().double().requires_grad_(True) for a in args]
            ref_out = ref(*ins64)
            self.assertLess(float((out.double() - ref_out).abs().max()), 1e-5)
            cot = torch.randn(out.shape, generator=g)
            got = torch.autograd.grad(out, args, cot)
            want = torch.autograd.grad(ref_out, ins64, cot.double())
            for a, b in zip(got, want):
                self.assertLess(float((a.double() - b).abs().max() / b.abs().max()), 1e-5)


class TensorParallelGradientTest(unittest.TestCase):
    def worst_error(self, tp, rank, grads):
        shard = tp_mod.shard_of(_tp1[2], tp, rank)
        worst, where = 0.0, None
        self.assertEqual(set(grads), set(_tp1[1]))
        for name, g in grads.items():
            want = _tp1[1][name][tp_mod.shard_index(name, shard, _tp1[2]) or ()].double()
            self.assertEqual(tuple(g.shape), tuple(want.shape), name)
            scale = float(want.abs().max())
            self.assertGreater(scale, 0.0, f"{name}: no gradient")
            err = float((torch.from_numpy(g).double() - want).abs().max()) / scale
            if err > worst:
                worst, where = err, name
        return worst, where

    def test_each_ranks_gradients_are_the_slices_of_tp1s(self):
        for tp, ranks in _ranks.items():
            for r, out in enumerate(ranks):
                worst, where = self.worst_error(tp, r, out["grads"])
                self.assertLess(worst, GRAD_BOUND, f"TP {tp} rank {r}: {where} off by {worst}")

    def test_a_backward_without_fs_all_reduce_is_caught(self):
        for r, out in enumerate(_ranks[4]):
            worst, where = self.worst_error(4, r, out["grads_without_f"])
            self.assertGreater(worst, 100 * GRAD_BOUND, f"rank {r}: worst {where} {worst}")


class TensorParallelWeightsTest(unittest.TestCase):
    def test_the_gathered_weights_are_the_checkpoints_and_reload_unchanged(self):
        for tp, ranks in _ranks.items():
            for r, out in enumerate(ranks):
                self.assertEqual(out["full_apart"], [], f"TP {tp} rank {r}")
                self.assertEqual(out["reload_apart"], [], f"TP {tp} rank {r}")

    def test_a_degree_that_does_not_divide_the_tree_or_the_model_is_refused(self):
        config = dict(_tp1[2])
        for tp in (1, 2, 4, 8):
            check_trainer_tensor_parallel(config, tp)
        for tp, config_change, words in (
                (3, {}, "must be 1, 2, 4 or 8"), (16, {}, "must be 1, 2, 4 or 8"),
                (4, {"num_attention_heads": 6}, "6 attention heads"),
                (4, {"num_key_value_heads": 3}, "3 KV heads"),
                (8, {"intermediate_size": 772}, "intermediate size 772")):
            with self.assertRaises(ValueError) as ctx:
                check_trainer_tensor_parallel(dict(config, **config_change), tp)
            self.assertIn(f"degree {tp}", str(ctx.exception))
            self.assertIn(words, str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
