"""Tests of rollout_client against a real rollout-server (and a few fake in-process servers).

Run:  client/python/run_tests.sh [BIN_DIR]   (installs the package into a fresh venv first)
or, with the package installed:  ROLLOUT_BIN_DIR=build/bin VENV/bin/python -m unittest discover
-s client/python/tests   (from outside the repository)

Servers are started with `--port 0` (the port is read from the "listening on port N" log line)
and ROLLOUT_CACHE_DIR pointing at a temporary folder. Calls the server answers UNIMPLEMENTED
fail, unless ROLLOUT_PY_TESTS_ALLOW_UNIMPLEMENTED=1 (an older server): then they are skipped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import math
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc
import numpy as np

import rollout_client
import rollout_client.aio
from rollout_client import (BroadcastError, Fleet, FleetError, RawTensor, RolloutClient,
                            RolloutError, UpdateWeightsResult, bf16_bits_to_f32,
                            f32_to_bf16_bits, read_safetensors, sample_seed,
                            write_safetensors)
from rollout_client.client import pb2, pb2_grpc

from _support import PKG_ROOT, REPO, Server, cache_dir, shared_server, stop_shared_server

STRICT = os.environ.get("ROLLOUT_PY_TESTS_ALLOW_UNIMPLEMENTED") != "1"
NORM = "model.norm.weight"
PROMPTS = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7, 7]]


def tearDownModule():
    stop_shared_server()


def needs_server_support(test):
    """Skips a test the server answers UNIMPLEMENTED when ROLLOUT_PY_TESTS_ALLOW_UNIMPLEMENTED=1."""
    @functools.wraps(test)
    def wrapper(self, *args, **kwargs):
        try:
            return test(self, *args, **kwargs)
        except RolloutError as e:
            if e.code == "UNIMPLEMENTED" and not STRICT:
                self.skipTest(f"server answers UNIMPLEMENTED: {e}")
            raise
    return wrapper


def key(c):
    """What determinism covers (cached_prompt_tokens depends on the prefix cache)."""
    return (c.token_ids, c.logprobs, c.finish_reason, c.sample_seed, c.top_logprobs)


def keys(groups):
    return [[key(c) for c in g] for g in groups]


def f32_to_bf16_reference(x: float) -> int:
    """Pure-Python round-to-nearest-even float32 -> bf16 bits (the server's F32ToBF16)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    if (bits & 0x7FFFFFFF) > 0x7F800000:
        return (bits >> 16) | 0x0040
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF


def bits_to_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# ---------------------------------------------------------------------------------------------


class GenerateTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.client = RolloutClient(shared_server().target, timeout=120)
        cls.info = cls.client.wait_ready(60)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def test_server_info(self):
        info = self.client.server_info()
        self.assertEqual(info.model.vocab_size, 4096)
        self.assertEqual(info.model.eos_token_ids, [2])
        self.assertEqual(info.weight_version, "0")
        self.assertEqual(info.backend, "cpu")
        self.assertGreater(info.limits.max_running_samples, 0)
        self.assertEqual(info.limits.tensor_parallel, 1)
        self.assertEqual(info.limits.admission, "estimate")
        self.assertEqual(info.counters.weight_updates, 0)
        self.assertTrue(os.path.isdir(info.model.source))
        self.assertEqual(info.to_dict()["model"]["vocab_size"], 4096)

    def test_shapes_and_fields(self):
        groups = self.client.generate(PROMPTS, num_samples=[2, 1, 3], seed=[5, 6, 7],
                                      temperature=0.8, max_new_tokens=6, top_logprobs=3,
                                      request_ids=["a", "b", "c"])
        self.assertEqual([len(g) for g in groups], [2, 1, 3])
        for i, g in enumerate(groups):
            for j, c in enumerate(g):
                self.assertEqual((c.prompt_index, c.sample_index), (i, j))
                self.assertEqual(c.request_id, "abc"[i])
                self.assertTrue(1 <= len(c.token_ids) <= 6)
                self.assertEqual(len(c.logprobs), len(c.token_ids))
                self.assertEqual(len(c.top_logprobs), len(c.token_ids))
                self.assertTrue(all(len(t) == 3 for t in c.top_logprobs))
                self.assertIn(c.finish_reason, ("stop", "length"))
                if c.finish_reason == "length":
                    self.assertEqual(len(c.token_ids), 6)
                else:
                    self.assertEqual(c.token_ids[-1], 2)
                self.assertEqual(c.weight_version, "0")
                self.assertEqual(c.sample_seed, sample_seed([5, 6, 7][i], j))
                self.assertTrue(all(isinstance(t, int) for t in c.token_ids))
                self.assertTrue(all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs))
                for k, top in enumerate(c.top_logprobs):  # most likely first
                    self.assertEqual([lp for _, lp in top], sorted((lp for _, lp in top),
                                                                   reverse=True))
                    self.assertGreaterEqual(top[0][1], c.logprobs[k])
                if c.version_spans:
                    self.assertEqual(c.version_spans[0].first_token, 0)
                    self.assertEqual(c.version_spans[-1].last_token, len(c.token_ids) - 1)

    def test_determinism(self):
        args = dict(num_samples=4, seed=[11, 12, 13], temperature=1.0, max_new_tokens=12)
        a = self.client.generate(PROMPTS, **args)
        b = self.client.generate(PROMPTS, **args)
        self.assertEqual(keys(a), keys(b))
        for g in a:  # samples of one rollout get different seeds, so different tokens
            self.assertEqual(len({tuple(c.token_ids) for c in g}), len(g))
        self.assertNotEqual(keys(a), keys(self.client.generate(PROMPTS, **dict(args, seed=99))))

    def test_num_samples_equal_single_rollouts_with_derived_seeds(self):
        n = self.client.generate([PROMPTS[0]], num_samples=3, seed=42, max_new_tokens=8)[0]
        singles = self.client.generate([PROMPTS[0]] * 3, seed=[sample_seed(42, j)
                                                               for j in range(3)],
                                       max_new_tokens=8)
        self.assertEqual([key(c)[:3] for c in n], [key(g[0])[:3] for g in singles])

    def test_array_inputs(self):
        a = self.client.generate(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64),
                                 seed=np.int64(3), num_samples=np.array([1, 2]),
                                 max_new_tokens=4)
        b = self.client.generate([[1, 2, 3], [4, 5, 6]], seed=3, num_samples=[1, 2],
                                 max_new_tokens=4)
        self.assertEqual(keys(a), keys(b))

    def test_greedy(self):
        a = self.client.generate([PROMPTS[1]], num_samples=2, seed=1, temperature=0,
                                 max_new_tokens=8)[0]
        self.assertEqual(a[0].token_ids, a[1].token_ids)

    def test_stream_chunks_concatenate_to_completions(self):
        args = dict(num_samples=2, seed=3, temperature=0.9, max_new_tokens=10, top_logprobs=2)
        items = list(self.client.generate(PROMPTS, stream=True, **args))
        chunks = [x for x in items if isinstance(x, rollout_client.TokenChunk)]
        completions = [x for x in items if isinstance(x, rollout_client.Completion)]
        self.assertEqual(len(completions), 6)
        self.assertGreater(len(chunks), 0)
        for c in completions:
            mine = [x for x in chunks if (x.prompt_index, x.sample_index) ==
                    (c.prompt_index, c.sample_index)]
            self.assertEqual(sum((x.token_ids for x in mine), []), c.token_ids)
            self.assertEqual(sum((x.logprobs for x in mine), []), c.logprobs)
            self.assertEqual(sum((x.top_logprobs for x in mine), []), c.top_logprobs)
        batch = self.client.generate(PROMPTS, **args)
        self.assertEqual(sorted(key(c) for c in completions),
                         sorted(key(c) for g in batch for c in g))

    def test_stream_options_carry_the_per_token_streams_bits(self):
        args = dict(num_samples=[2, 1, 3], seed=[4, 5, 6], temperature=0.8, max_new_tokens=30,
                    top_logprobs=2, stop_token_ids=[9])

        def run(**options):
            items = list(self.client.generate(PROMPTS, stream=True, **args, **options))
            streamed = {}
            for x in items:
                if isinstance(x, rollout_client.TokenChunk):
                    s = streamed.setdefault((x.prompt_index, x.sample_index), [[], [], []])
                    s[0] += x.token_ids
                    s[1] += x.logprobs
                    s[2] += x.top_logprobs
            done = sorted(key(x) for x in items if isinstance(x, rollout_client.Completion))
            return done, streamed, len(items)

        per_token, streamed, messages = run()
        for options in (dict(chunk_tokens=4), dict(chunk_interval_ms=50),
                        dict(chunk_tokens=6, chunk_interval_ms=20)):
            done, coalesced, fewer = run(**options)
            self.assertEqual(done, per_token, options)
            self.assertEqual(coalesced, streamed, options)
            self.assertLess(fewer, messages, options)
        done, none, count = run(completions_only=True)
        self.assertEqual(done, per_token)
        self.assertEqual((none, count), ({}, 6))
        # Not streaming, generate() asks for completions only: the same completions.
        batch = self.client.generate(PROMPTS, **args)
        self.assertEqual(sorted(key(c) for g in batch for c in g), per_token)
        with self.assertRaises(ValueError):
            self.client.generate(PROMPTS, stream=True, completions_only=True, chunk_tokens=2,
                                 **args)

    def test_numpy_arrays_hold_the_servers_bits(self):
        c = self.client.generate([PROMPTS[0]], seed=2, max_new_tokens=12, top_logprobs=1)[0][0]
        tokens, logprobs = c.tokens_array(), c.logprobs_array()
        self.assertEqual((tokens.dtype, logprobs.dtype), (np.int32, np.float32))
        self.assertEqual(tokens.tolist(), c.token_ids)
        self.assertEqual(logprobs.tolist(), c.logprobs)  # float32 -> float exactly, both ways
        self.assertEqual(c.tokens_array(np.int64).dtype, np.int64)
        bits = logprobs.view(np.uint32).tolist()
        self.assertEqual(bits, [struct.unpack("<I", struct.pack("<f", x))[0]
                                for x in c.logprobs])
        score = self.client.score([PROMPTS[0] + c.token_ids], len(PROMPTS[0]), details=True)[0]
        np.testing.assert_array_equal(score.logprobs_array().view(np.uint32),
                                      logprobs.view(np.uint32))
        chunk = next(x for x in self.client.generate([PROMPTS[0]], max_new_tokens=3,
                                                     stream=True)
                     if isinstance(x, rollout_client.TokenChunk))
        self.assertEqual(chunk.tokens_array().tolist(), chunk.token_ids)

    def test_stream_stopped_early_cancels(self):
        stream = self.client.generate([PROMPTS[0]], max_new_tokens=2000, ignore_eos=True,
                                      stream=True)
        first = next(stream)
        self.assertIsInstance(first, rollout_client.TokenChunk)
        stream.close()  # cancels the call; the server aborts the sample
        deadline = time.monotonic() + 30
        while self.client.server_info().counters.running_samples and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(self.client.server_info().counters.running_samples, 0)

    def test_score_equals_generate_exactly(self):
        for temperature in (0.7, 1.0, 0.0, None):
            groups = self.client.generate(PROMPTS, num_samples=2, seed=21,
                                          temperature=temperature, max_new_tokens=10,
                                          top_logprobs=4)
            seqs, starts, expected, expected_top = [], [], [], []
            for p, g in zip(PROMPTS, groups):
                for c in g:
                    seqs.append(p + c.token_ids)
                    starts.append(len(p))
                    expected.append(c.logprobs)
                    expected_top.append(c.top_logprobs)
            # Generate's logprobs at temperature 0 are those at T = 1.
            t = None if temperature in (None, 0.0) else temperature
            self.assertEqual(self.client.score(seqs, starts, temperature=t), expected,
                             f"temperature {temperature}")
            detailed = self.client.score(seqs, starts, temperature=t, top_logprobs=4,
                                         details=True)
            self.assertEqual([d.logprobs for d in detailed], expected)
            self.assertEqual([d.top_logprobs for d in detailed], expected_top)
            self.assertEqual({d.weight_version for d in detailed}, {"0"})

    def test_score_per_sequence_temperatures(self):
        seq = PROMPTS[0] + [100, 200, 300]
        both = self.client.score([seq, seq], 4, temperature=[0.5, 2.0])
        self.assertEqual(both[0], self.client.score([seq], 4, temperature=0.5)[0])
        self.assertEqual(both[1], self.client.score([seq], 4, temperature=2.0)[0])
        self.assertNotEqual(both[0], both[1])

    def test_invalid_arguments_raise_rollout_error(self):
        bad = [
            lambda: self.client.generate(PROMPTS, max_new_tokens=0),
            lambda: self.client.generate(PROMPTS, max_new_tokens=4, temperature=-1.0),
            lambda: self.client.generate(PROMPTS, max_new_tokens=4, top_p=0.0),
            lambda: self.client.generate(PROMPTS, max_new_tokens=4, top_logprobs=1000),
            lambda: self.client.generate([[1, 4096]], max_new_tokens=4),
            lambda: self.client.generate([[]], max_new_tokens=4),
            lambda: self.client.generate([], max_new_tokens=4),
            lambda: self.client.generate(PROMPTS, max_new_tokens=4, request_ids=["x", "x", "y"]),
            lambda: self.client.generate([[1]], max_new_tokens=100000),
            lambda: self.client.score([[1, 2, 3]], starts=0),
            lambda: self.client.score([[1, 2, 3]], starts=1, temperature=-2.0),
            lambda: self.client.abort(["x"], all=True),
            lambda: self.client.abort(),
        ]
        for i, call in enumerate(bad):
            with self.subTest(i=i):
                with self.assertRaises(RolloutError) as cm:
                    call()
                self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
                self.assertEqual(cm.exception.grpc_code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertTrue(cm.exception.message)
                self.assertTrue(str(cm.exception).startswith("INVALID_ARGUMENT: "))
        with self.assertRaises(RolloutError) as cm:
            self.client.generate(PROMPTS, max_new_tokens=0)
        self.assertIn("max_new_tokens", cm.exception.message)

    def test_python_argument_errors(self):
        with self.assertRaises(TypeError):
            self.client.generate([1, 2, 3], max_new_tokens=4)  # not wrapped in a list
        with self.assertRaises(TypeError):
            self.client.generate(PROMPTS)  # max_new_tokens missing
        with self.assertRaises(ValueError):
            self.client.generate(PROMPTS, seed=[1, 2], max_new_tokens=4)
        with self.assertRaises(ValueError):
            self.client.generate([[1, -2]], max_new_tokens=4)
        with self.assertRaises(ValueError):
            self.client.update_weights([], version="v")
        with self.assertRaises(ValueError):
            self.client.update_weights([("a", np.zeros(2, np.float32))], version="")
        with self.assertRaises(ValueError):
            self.client.update_weights([("a", np.zeros(2, np.float32))], version="v",
                                       policy="later")

    def test_abort_by_request_id(self):
        stream = self.client.generate([PROMPTS[2]], max_new_tokens=3000, ignore_eos=True,
                                      request_ids=["py-abort-me"], stream=True)
        result = None
        for item in stream:
            if result is None:
                result = self.client.abort(["py-abort-me", "py-unknown"])
            if isinstance(item, rollout_client.Completion):
                completion = item
        self.assertEqual(result.aborted_rollouts, 1)
        self.assertEqual(result.unknown_request_ids, ["py-unknown"])
        self.assertEqual(completion.finish_reason, "abort")
        self.assertEqual(completion.request_id, "py-abort-me")
        self.assertLess(len(completion.token_ids), 3000)

    def test_abort_all_counts_the_score_call_it_ends(self):
        rng = np.random.default_rng(28)
        seqs = [rng.integers(3, 4000, size=3000).tolist() for _ in range(4)]
        before = self.client.server_info().counters.prefilled_tokens
        outcome = {}

        def score():
            try:
                outcome["result"] = self.client.score(seqs, starts=1)
            except RolloutError as e:
                outcome["error"] = e

        thread = threading.Thread(target=score)
        thread.start()
        deadline = time.monotonic() + 30
        while (self.client.server_info().counters.prefilled_tokens == before
               and time.monotonic() < deadline):
            time.sleep(0.005)
        result = self.client.abort(all=True)
        thread.join(60)
        self.assertIn("error", outcome, "the Score call ended before the abort")
        self.assertEqual(outcome["error"].code, "ABORTED")
        self.assertEqual(result.aborted_rollouts, 0)
        self.assertEqual(result.aborted_score_calls, 1)

    def test_flush_cache(self):
        self.client.generate(PROMPTS, max_new_tokens=2)
        r = self.client.flush_cache()
        self.assertGreater(r.freed_blocks + r.detached_blocks, 0)
        # The counters are published after the flush's reply, so poll briefly.
        deadline = time.monotonic() + 5
        while self.client.server_info().counters.kv_blocks_cached and \
                time.monotonic() < deadline:
            time.sleep(0.01)
        self.assertEqual(self.client.server_info().counters.kv_blocks_cached, 0)

    def test_unavailable_and_wait_ready_timeout(self):
        with socket_port() as port:
            with RolloutClient(f"127.0.0.1:{port}", timeout=5) as c:
                with self.assertRaises(RolloutError) as cm:
                    c.server_info()
                self.assertEqual(cm.exception.code, "UNAVAILABLE")
                t = time.monotonic()
                with self.assertRaises(RolloutError) as cm:
                    c.wait_ready(0.5)
                self.assertEqual(cm.exception.code, "DEADLINE_EXCEEDED")
                self.assertLess(time.monotonic() - t, 5)


class socket_port:
    """A port nothing listens on (bound, not listening, while in use)."""

    def __enter__(self):
        import socket
        self.s = socket.socket()
        self.s.bind(("127.0.0.1", 0))
        return self.s.getsockname()[1]

    def __exit__(self, *exc):
        self.s.close()


# ---------------------------------------------------------------------------------------------
# Fake in-process servers: what exactly goes over the wire.


class _Recorder(pb2_grpc.RolloutServiceServicer):
    def __init__(self, token=None):
        self.token = token
        self.metadata = []
        self.weights = []
        self.deadlines = []  # each call's time_remaining(): ~9.2e18 s for a call without one

    def _check(self, context):
        md = dict(context.invocation_metadata())
        self.metadata.append(md)
        self.deadlines.append(context.time_remaining())
        if self.token and md.get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    def GetServerInfo(self, request, context):
        self._check(context)
        return pb2.ServerInfo(weight_version="fake", backend="none")

    def Pause(self, request, context):
        self._check(context)
        return pb2.PauseResponse(was_paused=request.abort_in_flight)

    def UpdateWeights(self, request_iterator, context):
        self._check(context)
        messages = list(request_iterator)
        self.weights.append(messages)
        header = messages[0].header
        total = sum(len(m.data.data) for m in messages[1:])
        return pb2.UpdateWeightsResponse(version=header.version, previous_version="fake",
                                         tensors_updated=len(header.tensors),
                                         bytes_received=total)


class FakeServerTest(unittest.TestCase):
    def setUp(self):
        self.recorder = _Recorder(token="s3cret")
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        pb2_grpc.add_RolloutServiceServicer_to_server(self.recorder, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.target = f"127.0.0.1:{port}"

    def tearDown(self):
        self.server.stop(None)

    def test_bearer_token_on_every_call(self):
        with RolloutClient(self.target, token="s3cret") as c:
            self.assertEqual(c.server_info().weight_version, "fake")
            self.assertTrue(c.pause(abort_in_flight=True))
            c.update_weights([("w", np.ones(3, np.float32))], version="v")
        # update_weights asks GetServerInfo first (whether lm_head is tied): four calls.
        self.assertEqual(len(self.recorder.metadata), 4)
        for md in self.recorder.metadata:
            self.assertEqual(md["authorization"], "Bearer s3cret")
        with RolloutClient(self.target) as c:
            with self.assertRaises(RolloutError) as cm:
                c.server_info()
            self.assertEqual(cm.exception.code, "UNAUTHENTICATED")
            self.assertEqual(cm.exception.message, "missing or wrong bearer token")

    def test_update_weights_stream_layout(self):
        rng = np.random.default_rng(1)
        a = rng.standard_normal((7, 33)).astype(np.float32)
        b = rng.standard_normal(50).astype(np.float16)
        raw = RawTensor(bytes(range(256)) * 2, "BF16", (16, 16))
        with RolloutClient(self.target, token="s3cret") as c:
            r = c.update_weights({"a": a, "b": b, "raw": raw}, version="v7", policy="continue",
                                 dtype={"a": "BF16", "b": "F32"}.get, chunk_bytes=100)
        self.assertEqual((r.version, r.previous_version, r.tensors_updated), ("v7", "fake", 3))
        messages = self.recorder.weights[0]
        header = messages[0].header
        self.assertEqual(header.version, "v7")
        self.assertEqual(header.policy, pb2.IN_FLIGHT_POLICY_CONTINUE)
        self.assertEqual([(t.name, t.dtype, list(t.shape)) for t in header.tensors],
                         [("a", "BF16", [7, 33]), ("b", "F32", [50]), ("raw", "BF16", [16, 16])])
        got = {}
        for m in messages[1:]:
            self.assertEqual(m.WhichOneof("item"), "data")
            self.assertLessEqual(len(m.data.data), 100)
            buf = got.setdefault(m.data.name, bytearray())
            self.assertEqual(m.data.offset, len(buf))  # in order, no gaps
            buf += m.data.data
        self.assertEqual(bytes(got["a"]), f32_to_bf16_bits(a).tobytes())
        self.assertEqual(bytes(got["b"]), b.astype(np.float32).tobytes())
        self.assertEqual(bytes(got["raw"]), raw.data)
        self.assertEqual(r.bytes_received, 7 * 33 * 2 + 50 * 4 + 512)

    def test_conversion_error_surfaces_as_itself(self):
        with RolloutClient(self.target, token="s3cret") as c:
            with self.assertRaises(TypeError):
                c.update_weights([("u", np.zeros(4, np.uint16))], version="v", dtype=None)
            with self.assertRaises(TypeError):
                c.update_weights([("c", np.zeros(4, np.complex64))], version="v")
            with self.assertRaises(TypeError):
                c.update_weights([("r", b"\0\0")], version="v")

    def test_integer_weight_arrays_are_refused_naming_the_tensor(self):
        # Weights are floating point: an integer array is a bug upstream (ids, masks, a wrong
        # view), refused before anything is sent rather than converted to float.
        with RolloutClient(self.target, token="s3cret") as c:
            for dtype in (np.int8, np.int32, np.int64, np.uint8, np.uint32, np.uint64, np.bool_):
                name = np.dtype(dtype).name
                with self.subTest(dtype=name):
                    with self.assertRaisesRegex(TypeError, rf"^tensor 'w': an array of {name} is "
                                                           r"refused, not converted: weights are "
                                                           r"floating point"):
                        c.update_weights([("ok", np.ones(2, np.float32)),
                                          ("w", np.ones(3, dtype))], version="v")
            with self.assertRaisesRegex(TypeError, r"^tensor 's': an array of int64 is refused"):
                c.update_weights({"s": np.int64(3)}, version="v", dtype=None)  # a numpy scalar
            with self.assertRaisesRegex(TypeError, r"^tensor 'f': an array of int32 is refused"):
                Fleet([self.target], token="s3cret").update_weights(
                    {"f": np.zeros(2, np.int32)}, version="v")
        self.assertEqual(self.recorder.weights, [])  # no UpdateWeights call was made
        # 16-bit integers are raw BF16/F16 bits (a bf16 tensor's .view(torch.int16)): they go.
        from rollout_client.weights import prepare
        for dtype in (np.uint16, np.int16):
            t = prepare([("b", np.zeros(2, dtype))], "BF16")[0]
            self.assertEqual((t.dtype, t.nbytes), ("BF16", 4))

    def test_timeout_none_is_no_deadline_and_a_timeout_not_given_the_clients(self):
        none = 1e9  # gRPC's infinite deadline (~9.2e18 s) as the server sees it: far beyond
        near = 1    # gRPC rounds a deadline up a little (a timeout of 30 s arrives as 30.1)
        with RolloutClient(self.target, token="s3cret", timeout=5) as c:
            c.server_info()                                       # the client's default
            c.server_info(timeout=None)                           # no deadline
            c.server_info(timeout=30)                             # its own
            c.pause(timeout=rollout_client.DEFAULT_TIMEOUT)       # the default, said so
            c.update_weights([("w", np.ones(3, np.float32))], version="v", timeout=None)
        d = self.recorder.deadlines
        self.assertEqual(len(d), 6)  # update_weights: GetServerInfo, then UpdateWeights
        self.assertLess(d[0], 5 + near)
        self.assertGreater(d[1], none)
        self.assertTrue(5 + near < d[2] < 30 + near, d[2])
        self.assertLess(d[3], 5 + near)
        self.assertGreater(d[4], none)
        self.assertGreater(d[5], none)
        # A client without a default deadline: none unless a call gives one.
        del d[:]
        with RolloutClient(self.target, token="s3cret") as c:
            c.server_info()
            c.server_info(timeout=7)
        self.assertGreater(d[0], none)
        self.assertLess(d[1], 7 + near)

        async def aio():
            async with rollout_client.aio.RolloutClient(self.target, token="s3cret",
                                                        timeout=5) as c:
                await c.server_info()
                await c.server_info(timeout=None)
                await c.update_weights([("w", np.ones(3, np.float32))], version="v",
                                       timeout=None)
        del d[:]
        asyncio.run(aio())
        self.assertEqual(len(d), 4)
        self.assertLess(d[0], 5 + near)
        self.assertGreater(min(d[1:]), none)
        del d[:]
        with Fleet([self.target], token="s3cret", timeout=5) as fleet:
            fleet.server_info()
            fleet.server_info(timeout=None)
            fleet.update_weights([("w", np.ones(3, np.float32))], version="v", timeout=None)
        self.assertEqual(len(d), 4)
        self.assertLess(d[0], 5 + near)
        self.assertGreater(min(d[1:]), none)

    def test_a_timeout_that_is_not_a_positive_number_is_refused_naming_it(self):
        with RolloutClient(self.target, token="s3cret") as c:
            with self.assertRaisesRegex(TypeError, r"^timeout must be a number \(got str '5'\)$"):
                c.server_info(timeout="5")
            with self.assertRaisesRegex(TypeError, r"^timeout must be a number \(got bool True\)$"):
                c.pause(timeout=True)
            for bad in (0, -1.0, math.inf, math.nan, 1e10):  # each DEADLINE_EXCEEDED in gRPC
                with self.subTest(timeout=bad):
                    with self.assertRaisesRegex(ValueError, rf"^timeout = {bad!r}: a deadline is "
                                                            r"a positive number of seconds up to "
                                                            r"1e\+09 \(None: no deadline\)$"):
                        c.server_info(timeout=bad)
            # At the call, before a stream is iterated.
            with self.assertRaisesRegex(TypeError, r"^timeout must be a number"):
                c.generate([[1, 2]], max_new_tokens=2, stream=True, timeout="5")
            with self.assertRaisesRegex(TypeError, r"^timeout must be a number"):
                c.update_weights([("w", np.ones(3, np.float32))], version="v", timeout="5")
        with Fleet([self.target], token="s3cret") as fleet:  # raised as itself, not FleetError
            with self.assertRaisesRegex(TypeError, r"^timeout must be a number"):
                fleet.server_info(timeout="5")
            with self.assertRaisesRegex(ValueError, r"^timeout = -1: "):
                fleet.update_weights([("w", np.ones(3, np.float32))], version="v", timeout=-1)
        self.assertEqual(self.recorder.deadlines, [])  # nothing was sent
        with RolloutClient(self.target, token="s3cret") as c:
            c.server_info(timeout=1e9)  # the longest deadline goes (gRPC caps it lower)
        self.assertEqual(len(self.recorder.deadlines), 1)
        for make in (RolloutClient, rollout_client.aio.RolloutClient):
            with self.subTest(client=make.__module__):
                with self.assertRaisesRegex(TypeError, r"^timeout must be a number \(got bool "
                                                       r"True\)$"):
                    make(self.target, timeout=True)
                with self.assertRaisesRegex(ValueError, r"^timeout = -5: "):
                    make(self.target, timeout=-5)


class RolloutErrorPickleTest(unittest.TestCase):
    """Errors cross process boundaries (multiprocessing, concurrent.futures' process pools,
    Ray): each comes back as itself, with its fields."""

    def round_trips(self, e):
        copies = [pickle.loads(pickle.dumps(e, protocol))
                  for protocol in range(pickle.HIGHEST_PROTOCOL + 1)]
        copies += [copy.copy(e), copy.deepcopy(e)]
        for got in copies:
            self.assertIs(type(got), type(e))
            self.assertEqual((got.code, got.message, got.grpc_code, got.args, str(got)),
                             (e.code, e.message, e.grpc_code, e.args, str(e)))
        return copies[-1]

    def test_a_rollout_error_keeps_its_code_message_and_grpc_code(self):
        self.round_trips(RolloutError("INVALID_ARGUMENT", "rollouts[1].sampling.top_p = 2",
                                      grpc.StatusCode.INVALID_ARGUMENT))
        self.round_trips(RolloutError("INTERNAL", "no grpc code"))
        with socket_port() as port:
            with RolloutClient(f"127.0.0.1:{port}", timeout=5) as c:
                with self.assertRaises(RolloutError) as cm:
                    c.server_info()
        got = self.round_trips(cm.exception)  # as the client raises it
        self.assertEqual(got.grpc_code, grpc.StatusCode.UNAVAILABLE)

    def test_fleet_and_broadcast_errors_keep_every_replica(self):
        ok = UpdateWeightsResult("v", "u", 1, 2, 0, 0.5, 0.25, "sha256:00")
        down = RolloutError("UNAVAILABLE", "down", grpc.StatusCode.UNAVAILABLE)
        got = self.round_trips(FleetError(["a:1", "b:2"], [None, ok], [down, None]))
        self.assertEqual((got.targets, got.results), (["a:1", "b:2"], [None, ok]))
        self.assertEqual((got.errors[0].code, got.errors[0].message, got.errors[1]),
                         ("UNAVAILABLE", "down", None))
        got = self.round_trips(BroadcastError("broadcasting 'v'", ["a:1"], [None], [down],
                                              RuntimeError("nccl")))
        self.assertEqual((got.targets, got.results, got.errors[0].code),
                         (["a:1"], [None], "UNAVAILABLE"))
        self.assertEqual(str(got.trainer_error), "nccl")


# ---------------------------------------------------------------------------------------------
# Token ids and integer arguments are checked before anything is sent: no server needed (the
# client's target answers nothing, so an unchecked argument fails as UNAVAILABLE instead).


class ArgumentCheckTest(unittest.TestCase):
    def setUp(self):
        self.client = RolloutClient("127.0.0.1:1", timeout=5)

    def tearDown(self):
        self.client.close()

    def generate(self, prompts, **kwargs):
        kwargs.setdefault("max_new_tokens", 3)
        return self.client.generate(prompts, **kwargs)

    def test_float_token_ids_in_lists_are_refused_not_truncated(self):
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = 1\.5: token ids must "
                                               r"be integers, not float"):
            self.generate([[1.5, 2.9]], temperature=0)
        with self.assertRaisesRegex(TypeError, r"^prompts\[1\]\[2\] = 3\.0: .* not float"):
            self.generate([[1, 2], [1, 2, 3.0]])  # a whole float too
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[1\] = 2\.5: .* not float64"):
            self.generate([[np.int64(1), np.float64(2.5)]])
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = True: .* not bool"):
            self.generate([[True, 2]])
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[1\] = '2': .* not str"):
            self.generate([[1, "2"]])
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[1\] = 2\.0"):
            self.generate([[1, 2.0]], stream=True)

    def test_a_float_numpy_array_of_token_ids_is_refused(self):
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = 1\.7: token ids must "
                                               r"be integers, not an array of float32"):
            self.generate([np.array([1.7, 2.2], np.float32)])
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = 1\.0: .*float64"):
            self.generate([np.array([1.0, 2.0])])  # whole values: still refused
        # A 2-D batch: the row and the column of the first value that is not whole.
        with self.assertRaisesRegex(TypeError, r"^prompts\[1\]\[1\] = 4\.5: .*float64"):
            self.generate(np.array([[1, 2], [3, 4.5]]))
        with self.assertRaisesRegex(TypeError, r"^prompts\[0\]\[0\] = True: .*bool"):
            self.generate([np.array([True, False])])
        # Integer arrays of any width go as they are, 1-D or a 2-D batch.
        from rollout_client._wire import sequences
        for dtype in (np.int8, np.uint16, np.int32, np.uint32, np.int64, np.uint64):
            self.assertEqual(sequences([np.array([5, 6], dtype)], "p"), [[5, 6]])
            self.assertEqual(sequences(np.array([[5], [6]], dtype), "p"), [[5], [6]])

    def test_score_refuses_float_token_ids(self):
        with self.assertRaisesRegex(TypeError, r"^sequences\[0\]\[0\] = 1\.9: token ids must "
                                               r"be integers, not float"):
            self.client.score([[1.9, 2.5, 3.99]], starts=1)
        with self.assertRaisesRegex(TypeError, r"^sequences\[1\]\[0\] = 1\.0: .*float32"):
            self.client.score([[1, 2], np.array([1, 2], np.float32)], starts=1)
        with self.assertRaisesRegex(TypeError, r"^routings\[0\]\[1\] = 2\.0: expert ids"):
            self.client.score([[1, 2, 3]], starts=1, routings=[[1, 2.0]])
        with self.assertRaisesRegex(ValueError, r"^sequences\[0\]\[2\] = 4294967296: token "
                                                r"ids must be < 2\*\*32"):
            self.client.score([[1, 2, 2**32]], starts=1)
        with self.assertRaisesRegex(ValueError, r"^score: starts = -1 .* \[0, 2\*\*32\)"):
            self.client.score([[1, 2, 3]], starts=-1)
        with self.assertRaisesRegex(TypeError, r"^score: starts\[0\] must be an integer "
                                               r"\(got float 1\.0\)"):
            self.client.score([[1, 2, 3]], starts=[1.0])
        with self.assertRaisesRegex(ValueError, r"^score: top_logprobs = -1 .* \[0, 2\*\*32\)"):
            self.client.score([[1, 2, 3]], starts=1, top_logprobs=-1)

    def test_token_ids_beyond_uint32_name_the_prompt_and_element(self):
        with self.assertRaisesRegex(ValueError, r"^prompts\[0\]\[0\] = 1099511627776: token "
                                                r"ids must be < 2\*\*32 \(4294967296\)$"):
            self.generate([np.array([2**40])])
        with self.assertRaisesRegex(ValueError, r"^prompts\[1\]\[1\] = 4294967296: "):
            self.generate(np.array([[1, 2], [3, 2**32]], np.uint64))
        with self.assertRaisesRegex(ValueError, r"^prompts\[1\]\[0\] = -3: token ids must "
                                                r"be >= 0$"):
            self.generate(np.array([[1, 2], [-3, 4]]))
        with self.assertRaisesRegex(ValueError, r"^prompts\[0\]\[1\] = 4294967296: "):
            self.generate([[1, 2**32]])
        from rollout_client._wire import sequences
        self.assertEqual(sequences([[0, 2**32 - 1]], "p"), [[0, 2**32 - 1]])
        self.assertEqual(sequences([np.array([0, 2**32 - 1], np.uint64)], "p"),
                         [[0, 2**32 - 1]])

    def test_seed_out_of_uint64_range_names_seed_and_bound(self):
        with self.assertRaisesRegex(ValueError, r"^generate: seed = -1 is out of range: it must "
                                                r"be in \[0, 2\*\*64\)$"):
            self.generate([[1, 2]], seed=-1)
        with self.assertRaisesRegex(ValueError, r"^generate: seed = 18446744073709551616 .*"
                                                r"\[0, 2\*\*64\)"):
            self.generate([[1, 2]], seed=2**64)
        with self.assertRaisesRegex(ValueError, r"^generate: seed\[1\] = -2 "):
            self.generate([[1, 2], [3]], seed=[1, -2])
        with self.assertRaisesRegex(TypeError, r"^generate: seed must be an integer "
                                               r"\(got float 1\.5\)"):
            self.generate([[1, 2]], seed=1.5)
        from rollout_client._wire import generate_request
        request, _ = generate_request([[1]], 1, 2**64 - 1, None, None, None, None, 3, (), False,
                                      0, None)
        self.assertEqual(request.rollouts[0].seed, 2**64 - 1)

    def test_negative_num_samples_and_other_counts_name_the_parameter(self):
        with self.assertRaisesRegex(ValueError, r"^generate: num_samples = -1 is out of range: "
                                                r"it must be in \[0, 2\*\*32\)$"):
            self.generate([[1, 2]], num_samples=-1)
        with self.assertRaisesRegex(ValueError, r"^generate: num_samples\[0\] = 4294967296 "):
            self.generate([[1, 2]], num_samples=np.array([2**32]))
        bad = [
            (dict(max_new_tokens=2**32), ValueError, r"^generate: max_new_tokens = 4294967296 "),
            (dict(max_new_tokens=-1), ValueError, r"^generate: max_new_tokens = -1 "),
            (dict(max_new_tokens=4.0), TypeError, r"^generate: max_new_tokens must be an integer"),
            (dict(top_logprobs=-1), ValueError, r"^generate: top_logprobs = -1 "),
            (dict(top_k=2**31), ValueError, r"^generate: top_k = 2147483648 .*\[-2\*\*31, "),
            (dict(chunk_tokens=-1, stream=True), ValueError, r"^generate: chunk_tokens = -1 "),
            (dict(chunk_interval_ms=2**32, stream=True), ValueError,
             r"^generate: chunk_interval_ms = 4294967296 "),
        ]
        for kwargs, error, pattern in bad:
            with self.subTest(**{k: v for k, v in kwargs.items() if k != "stream"}):
                with self.assertRaisesRegex(error, pattern):
                    self.generate([[1, 2]], **kwargs)

    def test_negative_stop_token_id_names_its_index(self):
        with self.assertRaisesRegex(ValueError, r"^stop_token_ids\[0\] = -5: token ids must "
                                                r"be >= 0$"):
            self.generate([[1, 2]], stop_token_ids=[-5])
        with self.assertRaisesRegex(ValueError, r"^stop_token_ids\[1\] = 4294967296: "):
            self.generate([[1, 2]], stop_token_ids=np.array([3, 2**32]))
        with self.assertRaisesRegex(TypeError, r"^stop_token_ids\[0\] = 2\.0: .* not float"):
            self.generate([[1, 2]], stop_token_ids=[2.0])

    def test_float_options_must_be_numbers_naming_the_parameter(self):
        bad = [
            (dict(temperature="hot"), r"temperature must be a number \(got str 'hot'\)$"),
            (dict(temperature=True), r"temperature must be a number \(got bool True\)$"),
            (dict(top_p=np.bool_(False)), r"top_p must be a number \(got bool False\)$"),
            (dict(min_p=[0.1]), r"min_p must be a number \(got list \[0\.1\]\)$"),
            (dict(min_p=b"0"), r"min_p must be a number \(got bytes b'0'\)$"),
            (dict(top_p=0.5 + 0j), r"top_p must be a number \(got complex \(0\.5\+0j\)\)$"),
            (dict(top_p=np.complex64(0.5)), r"top_p must be a number \(got complex64 "),
            (dict(temperature=np.array([0.5, 0.7])),
             r"temperature must be a number \(got an array of shape \[2\]\)$"),
        ]
        for kwargs, pattern in bad:
            with self.subTest(**{k: repr(v) for k, v in kwargs.items()}):
                for stream in (False, True):  # refused at the call, before any iteration
                    with self.assertRaisesRegex(TypeError, "^generate: " + pattern):
                        self.generate([[1, 2]], stream=stream, **kwargs)
        # score: one temperature for every sequence, or one (or None) per sequence.
        with self.assertRaisesRegex(TypeError, r"^score: temperature must be a number \(got "
                                               r"str 'hot'\)$"):
            self.client.score([[1, 2, 3]], starts=1, temperature="hot")
        with self.assertRaisesRegex(TypeError, r"^score: temperature\[1\] must be a number "
                                               r"\(got bool True\)$"):
            self.client.score([[1, 2, 3], [4, 5]], starts=1, temperature=[0.5, True])
        # The weight-sync group's float options too.
        from rollout_client._wire import (broadcast_request, generate_request, join_request,
                                          score_request)
        with self.assertRaisesRegex(TypeError, r"^join_weight_sync_group: group_timeout must be "
                                               r"a number \(got str '30'\)$"):
            join_request(b"u" * 128, 1, 2, "30")
        with self.assertRaisesRegex(TypeError, r"^update_weights_from_broadcast: "
                                               r"broadcast_timeout must be a number \(got bool "
                                               r"True\)$"):
            broadcast_request([("a", "BF16", (2,))], "v", "drain", 256, 0, True, None)
        # Any real number goes, as a float: ints, numpy scalars, 0-d arrays.
        request, _ = generate_request([[1]], 1, 0, 1, None, np.float32(0.5), np.array(0.25), 3,
                                      (), False, 0, None)
        s = request.rollouts[0].sampling
        self.assertEqual((s.temperature, s.top_p, s.min_p), (1.0, 0.5, 0.25))
        request = score_request([[1, 2]], 1, [np.float64(0.5)], 0)
        self.assertEqual(request.sequences[0].temperature, 0.5)

    def test_bools_are_refused_for_integer_options(self):
        for name in ("seed", "num_samples", "max_new_tokens", "top_k", "top_logprobs",
                     "chunk_tokens"):
            with self.subTest(name=name):
                with self.assertRaisesRegex(TypeError, rf"^generate: {name} must be an integer "
                                                       r"\(got bool True\)$"):
                    self.generate([[1, 2]], stream=name == "chunk_tokens", **{name: True})
        with self.assertRaisesRegex(TypeError, r"^generate: seed\[1\] must be an integer \(got "
                                               r"bool False\)$"):
            self.generate([[1, 2], [3]], seed=[1, np.bool_(False)])
        with self.assertRaisesRegex(TypeError, r"^score: starts must be an integer \(got bool"):
            self.client.score([[1, 2, 3]], starts=True)

    def test_weight_update_sizes_must_be_integers_naming_the_parameter(self):
        w = [("w", np.ones(4, np.float32))]
        bad = [
            (dict(chunk_bytes=1.5), TypeError,
             r"^update_weights: chunk_bytes must be an integer \(got float 1\.5\)$"),
            (dict(chunk_bytes=True), TypeError,
             r"^update_weights: chunk_bytes must be an integer \(got bool True\)$"),
            (dict(chunk_bytes="4096"), TypeError,
             r"^update_weights: chunk_bytes must be an integer \(got str '4096'\)$"),
            (dict(chunk_bytes=0), ValueError, r"^update_weights: chunk_bytes must be > 0$"),
            (dict(chunk_bytes=64 << 20), ValueError, r"^update_weights: chunk_bytes must be at "
                                                     r"most 66060288 "),
            (dict(bucket_bytes=2.0), TypeError,
             r"^update_weights: bucket_bytes must be an integer \(got float 2\.0\)$"),
            (dict(streams=True), TypeError,
             r"^update_weights: streams must be an integer \(got bool True\)$"),
            (dict(streams=2.0), TypeError,
             r"^update_weights: streams must be an integer \(got float 2\.0\)$"),
            (dict(streams=65), ValueError, r"^update_weights: streams = 65; give 1 to 64$"),
        ]
        for kwargs, error, pattern in bad:
            with self.subTest(**kwargs):
                # skip_tied=False: no GetServerInfo first; the checks come before any call.
                with self.assertRaisesRegex(error, pattern):
                    self.client.update_weights(w, version="v", skip_tied=False, **kwargs)
        from rollout_client._wire import weights_part_streams
        streams = weights_part_streams(w + [("x", np.ones(2, np.float32))], "v", "drain", "BF16",
                                       np.int64(1024), np.uint32(4096), np.int8(2))
        self.assertEqual(len(streams), 2)  # numpy integers go
        for stream in streams:
            stream.stop(0)


class ConversionTest(unittest.TestCase):
    def test_bf16_round_to_nearest_even(self):
        cases = {
            0x3F800000: 0x3F80,  # 1.0
            0x3F808000: 0x3F80,  # tie, even stays
            0x3F818000: 0x3F82,  # tie, odd rounds up
            0x3F808001: 0x3F81,  # above the tie
            0x3F807FFF: 0x3F80,  # below the tie
            0xBF808001: 0xBF81,  # negative
            0x7F7FFFFF: 0x7F80,  # max float overflows to inf
            0x7F800000: 0x7F80,  # inf
            0xFF800000: 0xFF80,  # -inf
            0x00000001: 0x0000,  # denormal rounds to 0
            0x80000000: 0x8000,  # -0
        }
        a = np.array(list(cases), dtype=np.uint32).view(np.float32)
        self.assertEqual(f32_to_bf16_bits(a).tolist(), list(cases.values()))
        nans = np.array([0x7FC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF],
                        dtype=np.uint32).view(np.float32)
        out = f32_to_bf16_bits(nans)
        self.assertTrue(np.isnan(bf16_bits_to_f32(out)).all())
        self.assertEqual(out.tolist(), [0x7FC0, 0x7FC0, 0xFFC0, 0x7FFF])

    def test_bf16_matches_reference_on_random_bits(self):
        bits = np.random.default_rng(0).integers(0, 2**32, 20000, dtype=np.uint64)
        bits = bits.astype(np.uint32)
        a = bits.view(np.float32)
        out = f32_to_bf16_bits(a).tolist()
        self.assertEqual(out, [f32_to_bf16_reference(float(x)) for x in a])

    def test_bf16_round_trip_is_exact(self):
        bits = np.arange(0, 65536, dtype=np.uint16)
        finite = ~np.isnan(bf16_bits_to_f32(bits))
        self.assertEqual(f32_to_bf16_bits(bf16_bits_to_f32(bits))[finite].tolist(),
                         bits[finite].tolist())

    def test_a_cast_that_makes_a_finite_value_infinite_is_refused(self):
        # As the server refuses one it casts itself: 70000 is beyond F16, max float beyond BF16.
        from rollout_client.weights import to_bytes
        big = np.array([1.0, 70000.0, 2.0], dtype=np.float32)
        with self.assertRaisesRegex(ValueError, r"tensor 'w': element 1 \(70000\) is beyond "
                                                r"the range of F16; nothing was sent"):
            to_bytes("w", big, "F16")
        top = np.array([np.finfo(np.float32).max], dtype=np.float32)
        with self.assertRaisesRegex(ValueError, "element 0 .* beyond the range of BF16"):
            to_bytes("w", top, "BF16")
        # In range, and an infinity that was given, go through.
        dtype, _, half = to_bytes("w", np.array([65504.0, np.inf], dtype=np.float32), "F16")
        self.assertEqual((dtype, half.tolist()), ("F16", [65504.0, np.inf]))
        # float64 beyond float32 to any target (it went through as inf: review25py finding 1).
        huge = np.array([1.0, 1e300], dtype=np.float64)
        for target in ("BF16", "F16", "F32", None):
            with self.assertRaisesRegex(ValueError, r"tensor 'w': element 1 \(1e\+300\) is "
                                                    r"beyond the range of F32; nothing was sent"):
                to_bytes("w", huge, target)
        dtype, _, ok = to_bytes("w", np.array([1.5, -np.inf], dtype=np.float64), "F32")
        self.assertEqual((dtype, ok.tolist()), ("F32", [1.5, -np.inf]))

    def test_raw_tensor_checks_size(self):
        with self.assertRaises(ValueError):
            RawTensor(b"\0" * 6, "BF16", (2, 2))
        with self.assertRaises(ValueError):
            RawTensor(b"\0" * 8, "I8", (8,))
        self.assertEqual(RawTensor(b"\0" * 16, "float32", [2, 2]).dtype, "F32")

    def test_safetensors_round_trip(self):
        d = tempfile.mkdtemp()
        try:
            t = {"x": RawTensor(b"\1\2" * 6, "BF16", (2, 3)),
                 "y": RawTensor(struct.pack("<2f", 1.5, -2.0), "F32", (2,))}
            write_safetensors(os.path.join(d, "model.safetensors"), t, {"format": "pt"})
            self.assertEqual(read_safetensors(d), t)
            self.assertEqual(read_safetensors(d, ["y"]), {"y": t["y"]})
            with self.assertRaises(KeyError):
                read_safetensors(d, ["z"])
        finally:
            shutil.rmtree(d)


try:
    import torch  # noqa: F401
    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TorchConversionTest(unittest.TestCase):
    def test_torch_matches_numpy(self):
        import torch
        from rollout_client.weights import to_bytes
        x = torch.randn(5, 7)
        for target in ("BF16", "F16", "F32"):
            _, _, tb = to_bytes("x", x, target)
            _, _, nb = to_bytes("x", x.numpy(), target)
            self.assertEqual(bytes(tb), np.ascontiguousarray(nb).tobytes())
        _, _, tb = to_bytes("x", x.to(torch.bfloat16), None)
        self.assertEqual(bytes(tb), f32_to_bf16_bits(x.numpy()).tobytes())
        # Non-contiguous views go row-major.
        _, shape, tb = to_bytes("xt", x.t(), "F32")
        self.assertEqual((shape, bytes(tb)), ((7, 5), x.t().contiguous().numpy().tobytes()))

    def test_state_dict_items_as_is(self):
        import torch
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4, bias=False))
        model = model.to(torch.bfloat16)
        fake = FakeServerTest("test_bearer_token_on_every_call")
        fake.setUp()
        try:
            with RolloutClient(fake.target, token="s3cret") as c:
                r = c.update_weights(model.state_dict().items(), version="t1", chunk_bytes=64)
            self.assertEqual(r.tensors_updated, 3)
            messages = fake.recorder.weights[0]
            header = messages[0].header
            sd = model.state_dict()
            self.assertEqual([(t.name, t.dtype, tuple(t.shape)) for t in header.tensors],
                             [(k, "BF16", tuple(v.shape)) for k, v in sd.items()])
            got = {}
            for m in messages[1:]:
                got.setdefault(m.data.name, bytearray()).extend(m.data.data)
            for k, v in sd.items():
                self.assertEqual(bytes(got[k]), v.view(torch.int16).numpy().tobytes(), k)
        finally:
            fake.tearDown()

    def test_integer_tensors_are_refused_naming_the_tensor(self):
        import torch
        from rollout_client.weights import prepare
        for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool):
            with self.subTest(dtype=str(dtype)):
                with self.assertRaisesRegex(TypeError, rf"^tensor 't': a tensor of {dtype} is "
                                                       r"refused, not converted: weights are "
                                                       r"floating point"):
                    prepare([("t", torch.ones(3, dtype=dtype))], "BF16")
        with self.assertRaisesRegex(TypeError, r"^tensor 'c': unsupported torch dtype "
                                               r"torch.complex64$"):
            prepare([("c", torch.ones(3, dtype=torch.complex64))], "BF16")

    def test_torch_prompts(self):
        import torch
        from rollout_client._wire import sequences
        self.assertEqual(sequences(torch.tensor([[1, 2], [3, 4]]), "p"), [[1, 2], [3, 4]])
        self.assertEqual(sequences([torch.tensor([5, 6, 7])], "p"), [[5, 6, 7]])

    def test_float_torch_prompts_are_refused(self):
        import torch
        from rollout_client._wire import generate_request, sequences
        client = RolloutClient("127.0.0.1:1", timeout=5)  # nothing is sent
        try:
            with self.assertRaisesRegex(TypeError, r"prompts\[0\]\[0\] = 1\.5.*float32"):
                client.generate([torch.tensor([1.5, 2.0])], max_new_tokens=3)
            with self.assertRaisesRegex(TypeError, r"prompts\[1\]\[0\] = 3\.5"):
                client.generate(torch.tensor([[1.0, 2.0], [3.5, 4.0]]), max_new_tokens=3)
            with self.assertRaisesRegex(TypeError, r"prompts\[0\]\[0\] = True: .*torch.bool"):
                client.generate([torch.tensor([True, True])], max_new_tokens=3)
            with self.assertRaisesRegex(ValueError, r"prompts\[0\]\[1\] = 1099511627776"):
                client.generate([torch.tensor([1, 2**40])], max_new_tokens=3)
        finally:
            client.close()
        for dtype in (torch.int32, torch.int64, torch.uint8):
            self.assertEqual(sequences([torch.tensor([5, 6], dtype=dtype)], "p"), [[5, 6]])
        request, _ = generate_request([[1]], 1, torch.tensor(7), None, None, None, None, 3,
                                      torch.tensor([4, 5]), False, 0, None)
        self.assertEqual((request.rollouts[0].seed,
                          list(request.rollouts[0].sampling.stop_token_ids)), (7, [4, 5]))


# ---------------------------------------------------------------------------------------------
# Weight updates and pause/resume against a real server (its own, since they change state).


def nudge(original: RawTensor, step: int) -> np.ndarray:
    f = bf16_bits_to_f32(np.frombuffer(original.data, np.uint16)).reshape(original.shape)
    i = np.arange(f.size, dtype=np.float32).reshape(f.shape)
    return f * (1 + 0.5 * np.sin(0.37 * i + step)).astype(np.float32)


class WeightsTest(unittest.TestCase):
    ARGS = dict(num_samples=3, seed=[1, 2, 3], temperature=1.0, max_new_tokens=12)

    @classmethod
    def setUpClass(cls):
        cls.server = Server(cache_dir())
        cls.client = RolloutClient(cls.server.target, timeout=120)
        cls.info = cls.client.wait_ready(60)
        cls.model_dir = cls.info.model.source
        cls.original = read_safetensors(cls.model_dir, [NORM])[NORM]
        cls.baseline = cls.client.generate(PROMPTS, **cls.ARGS)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def _retry_busy(self, call, *args, **kwargs):
        """Retries ABORTED ("another weight update is in progress"): the server may release its
        update slot a moment after the previous update's status reached us (a server race that
        test_update_right_after_a_rejected_one covers on its own)."""
        deadline = time.monotonic() + 10
        while True:
            try:
                return call(*args, **kwargs)
            except RolloutError as e:
                if e.code != "ABORTED" or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def update(self, *args, **kwargs):
        return self._retry_busy(self.client.update_weights, *args, **kwargs)

    def update_from_path(self, *args, **kwargs):
        return self._retry_busy(self.client.update_weights_from_path, *args, **kwargs)

    def tearDown(self):
        # Every test leaves the original weights and an unpaused server behind.
        try:
            self.client.resume_memory()
            self.client.resume()
            self.update([(NORM, self.original)], version="0")
        except RolloutError as e:
            if e.code != "UNIMPLEMENTED":
                raise

    def assert_baseline(self, groups, version):
        self.assertEqual(keys(groups), keys(self.baseline))
        self.assertEqual({c.weight_version for g in groups for c in g}, {version})

    @needs_server_support
    def test_update_round_trip(self):
        self.assertEqual(self.original.dtype, "BF16")
        r = self.update([(NORM, nudge(self.original, 1))], version="v-mod")
        self.assertEqual(r.version, "v-mod")
        self.assertEqual(r.previous_version, "0")
        self.assertEqual(r.tensors_updated, 1)
        self.assertEqual(r.bytes_received, len(self.original.data))
        self.assertEqual(self.client.server_info().weight_version, "v-mod")
        changed = self.client.generate(PROMPTS, **self.ARGS)
        self.assertEqual({c.weight_version for g in changed for c in g}, {"v-mod"})
        self.assertNotEqual(keys(changed), keys(self.baseline))
        for g in changed:
            for c in g:
                if c.version_spans:
                    self.assertEqual(c.version_spans, [rollout_client.VersionSpan(
                        "v-mod", 0, len(c.token_ids) - 1)])
        # Same bytes again -> same outputs as before, bitwise.
        r = self.update([(NORM, self.original)], version="v-orig")
        self.assertEqual(r.previous_version, "v-mod")
        self.assert_baseline(self.client.generate(PROMPTS, **self.ARGS), "v-orig")

    @needs_server_support
    def test_float32_converted_to_bf16_gives_the_same_weights(self):
        self.update([(NORM, nudge(self.original, 2))], version="tmp")
        f32 = bf16_bits_to_f32(np.frombuffer(self.original.data, np.uint16))
        self.update({NORM: f32.reshape(self.original.shape)}, version="f32",
                                   chunk_bytes=100)
        self.assert_baseline(self.client.generate(PROMPTS, **self.ARGS), "f32")
        # ...sent as float32, cast by the server (round to nearest even), in chunks that cut
        # elements: the same weights and digest.
        digest = self.client.server_info().weight_digest
        self.update([(NORM, nudge(self.original, 2))], version="tmp2")
        r = self.update({NORM: f32.reshape(self.original.shape)}, version="f32-wire",
                        dtype="F32", chunk_bytes=99)
        self.assertEqual(r.bytes_received, 2 * len(self.original.data))
        self.assertEqual(r.weight_digest, digest)
        self.assert_baseline(self.client.generate(PROMPTS, **self.ARGS), "f32-wire")
        # ...and as raw uint16 bits.
        self.update([(NORM, nudge(self.original, 2))], version="tmp")
        self.update([(NORM, np.frombuffer(self.original.data, np.uint16)
                                     .reshape(self.original.shape))], version="u16")
        self.assert_baseline(self.client.generate(PROMPTS, **self.ARGS), "u16")

    def rejected_update(self, *args, **kwargs) -> RolloutError:
        """The error of an update the server must reject (ABORTED retried, see _retry_busy)."""
        with self.assertRaises(RolloutError) as cm:
            self.update(*args, **kwargs)
        return cm.exception

    @needs_server_support
    def test_invalid_updates(self):
        self.update([(NORM, self.original)], version="0")  # supported at all?
        e = self.rejected_update([(NORM, np.ones(7, np.float32))], version="x")
        self.assertEqual(e.code, "INVALID_ARGUMENT")  # wrong shape
        e = self.rejected_update([("model.nope.weight", np.ones(7, np.float32))], version="x")
        self.assertIn(e.code, ("INVALID_ARGUMENT", "NOT_FOUND"))  # unknown tensor
        # Nothing changed.
        self.assertEqual(self.client.server_info().weight_version, "0")
        self.assert_baseline(self.client.generate(PROMPTS, **self.ARGS), "0")

    @needs_server_support
    def test_update_right_after_a_rejected_one(self):
        # A client that fixes its request and retries at once must not be told ABORTED
        # ("another weight update is in progress") by its own finished, rejected update.
        for i in range(20):
            with self.assertRaises(RolloutError) as cm:
                self.client.update_weights([(NORM, np.ones(7, np.float32))], version="x")
            self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")  # wrong shape
            self.client.update_weights([(NORM, self.original)], version=f"retry-{i}")

    @needs_server_support
    def test_update_from_path(self):
        streamed_version = "streamed"
        self.update([(NORM, nudge(self.original, 3))], version=streamed_version)
        streamed = self.client.generate(PROMPTS, **self.ARGS)
        # The original checkpoint folder -> the original outputs.
        r = self.update_from_path(self.model_dir, version="from-path")
        self.assertEqual(r.version, "from-path")
        self.assertEqual(r.previous_version, streamed_version)
        # The client's wall time, as every other update method reports (they were 0).
        self.assertGreater(r.seconds, 0.0)
        self.assertGreater(r.bytes_per_second, 0.0)
        self.assert_baseline(self.client.generate(PROMPTS, **self.ARGS), "from-path")
        # A checkpoint holding the nudged tensor -> what streaming it gave.
        d = tempfile.mkdtemp(prefix="rollout-py-ckpt-")
        try:
            shutil.copy(os.path.join(self.model_dir, "config.json"), d)
            tensors = read_safetensors(self.model_dir)
            bits = f32_to_bf16_bits(nudge(self.original, 3)).tobytes()
            tensors[NORM] = RawTensor(bits, "BF16", self.original.shape)
            write_safetensors(os.path.join(d, "model.safetensors"), tensors)
            self.update_from_path(d, version="from-path-2", policy="abort")
            got = self.client.generate(PROMPTS, **self.ARGS)
            self.assertEqual(keys(got), keys(streamed))
        finally:
            shutil.rmtree(d)
        with self.assertRaises(RolloutError) as cm:
            self.update_from_path("/nonexistent/ckpt", version="x")
        self.assertIn(cm.exception.code, ("INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"))

    @needs_server_support
    def test_pause_holds_requests_until_resume(self):
        self.assertFalse(self.client.pause())
        self.assertTrue(self.client.pause())
        self.assertTrue(self.client.server_info().paused)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "groups", self.client.generate(PROMPTS, **self.ARGS)))
        t.start()
        t.join(1.0)
        self.assertTrue(t.is_alive(), "generate finished while paused")
        self.assertTrue(self.client.resume())
        t.join(60)
        self.assertFalse(t.is_alive())
        self.assert_baseline(out["groups"], "0")
        self.assertFalse(self.client.resume())

    @needs_server_support
    def test_release_memory_holds_requests_and_resume_memory_keeps_the_bits(self):
        self.assertIsNone(self.client.server_info().memory_released)
        released = self.client.release_memory()
        self.assertFalse(released.was_released)
        self.assertGreater(released.kv_cache_bytes, 0)
        self.assertEqual(released.weight_bytes, 0)
        info = self.client.server_info()
        self.assertEqual(info.memory_released,
                         rollout_client.ReleasedMemory(released.kv_cache_bytes, 0, False))
        self.assertFalse(info.paused)
        self.assertEqual(info.to_dict()["memory_released"]["kv_cache_bytes"],
                         released.kv_cache_bytes)
        again = self.client.release_memory()
        self.assertTrue(again.was_released)
        self.assertEqual(again.kv_cache_bytes, 0)
        out = {}
        t = threading.Thread(target=lambda: out.setdefault(
            "groups", self.client.generate(PROMPTS, **self.ARGS)))
        t.start()
        t.join(1.0)
        self.assertTrue(t.is_alive(), "generate finished while the memory was released")
        resumed = self.client.resume_memory()
        self.assertTrue(resumed.was_released)
        self.assertEqual(resumed.kv_cache_bytes, released.kv_cache_bytes)
        t.join(60)
        self.assertFalse(t.is_alive())
        self.assert_baseline(out["groups"], "0")
        self.assertIsNone(self.client.server_info().memory_released)
        self.assertFalse(self.client.resume_memory().was_released)

    @needs_server_support
    def test_release_memory_needs_the_token_and_aborts_when_asked(self):
        server = Server(cache_dir(), "--auth_token_file", self._token_file())
        try:
            with RolloutClient(server.target, timeout=60) as anonymous:
                anonymous.wait_ready(60)
                with self.assertRaises(RolloutError) as cm:
                    anonymous.release_memory()
                self.assertEqual(cm.exception.code, "UNAUTHENTICATED")
            with RolloutClient(server.target, token="s3cret", timeout=60) as c:
                stream = c.generate([PROMPTS[0]], max_new_tokens=3000, ignore_eos=True,
                                    stream=True)
                next(stream)  # the sample is running
                r = c.release_memory(abort_in_flight=True)
                self.assertEqual(r.aborted_samples, 1)
                last = list(stream)[-1]
                self.assertEqual(last.finish_reason, "abort")
                self.assertTrue(c.resume_memory().was_released)
        finally:
            server.stop()

    def _token_file(self):
        path = tempfile.mktemp(prefix="rollout-token-")
        with open(path, "w") as f:
            f.write("s3cret\n")
        return path

    def _long_stream(self, rid, max_new_tokens):
        return self.client.generate([PROMPTS[0]], max_new_tokens=max_new_tokens,
                                    ignore_eos=True, request_ids=[rid], stream=True)

    @needs_server_support
    def test_policy_continue_gives_two_version_spans(self):
        completion, pushed = None, None
        for item in self._long_stream("py-continue", 400):
            if pushed is None:  # after the first chunk: the sample is running
                pushed = self.update([(NORM, nudge(self.original, 4))],
                                                    version="v-cont", policy="continue")
            if isinstance(item, rollout_client.Completion):
                completion = item
        spans = completion.version_spans
        self.assertEqual([s.version for s in spans], ["0", "v-cont"])
        self.assertEqual(spans[0].first_token, 0)
        self.assertEqual(spans[1].first_token, spans[0].last_token + 1)
        self.assertEqual(spans[1].last_token, len(completion.token_ids) - 1)

    @needs_server_support
    def test_policy_abort_ends_samples_in_flight(self):
        completion, pushed = None, None
        for item in self._long_stream("py-abort-policy", 1500):
            if pushed is None:
                pushed = self.update([(NORM, nudge(self.original, 5))],
                                                    version="v-abort", policy="abort")
            if isinstance(item, rollout_client.Completion):
                completion = item
        self.assertGreaterEqual(pushed.aborted_samples, 1)
        self.assertEqual(completion.finish_reason, "abort")
        self.assertLess(len(completion.token_ids), 1500)


class ExampleTest(unittest.TestCase):
    def test_grpo_loop(self):
        server = Server(cache_dir())
        try:
            cmd = [sys.executable, os.path.join(PKG_ROOT, "examples", "grpo_loop.py"),
                   "--target", server.target, "--rounds", "3", "--prompts", "3",
                   "--group-size", "4", "--max-new-tokens", "16"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0 and "UNIMPLEMENTED" in r.stderr and not STRICT:
                self.skipTest("server answers UNIMPLEMENTED to UpdateWeights")
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn("weights ['step-2']", r.stdout)
            self.assertIn("restored the served model.norm.weight as '0'", r.stdout)
            self.assertIn("OK:", r.stdout)
            with RolloutClient(server.target) as c:
                info = c.server_info()
            self.assertEqual(info.weight_version, "0")  # restored
            # Now updated since it started: the start checkpoint is not taken for what is
            # served unless named; named, it is proved by the probe.
            again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            self.assertEqual(again.returncode, 2, again.stdout + again.stderr)
            self.assertIn("pass --model-dir", again.stdout)
            named = subprocess.run(cmd + ["--model-dir", info.model.source], capture_output=True,
                                   text=True, timeout=300)
            self.assertEqual(named.returncode, 0, named.stdout + named.stderr)
            self.assertIn("OK:", named.stdout)
            # A checkpoint that does not hold the served weights fails the probe.
            wrong = tempfile.mkdtemp(prefix="rollout-py-wrong-")
            try:
                tensors = read_safetensors(info.model.source)
                bits = np.frombuffer(tensors[NORM].data, dtype=np.uint16).copy()
                bits ^= 0x0040  # another mantissa in every element
                tensors[NORM] = RawTensor(bits.tobytes(), "BF16", tensors[NORM].shape)
                write_safetensors(os.path.join(wrong, "model.safetensors"), tensors)
                shutil.copy(os.path.join(info.model.source, "config.json"), wrong)
                bad = subprocess.run(cmd + ["--model-dir", wrong, "--rounds", "2"],
                                     capture_output=True, text=True, timeout=300)
                self.assertEqual(bad.returncode, 1, bad.stdout + bad.stderr)
                self.assertIn("does not hold the weights that were served", bad.stdout)
            finally:
                shutil.rmtree(wrong, ignore_errors=True)
        finally:
            server.stop()


class TiedWeightsTest(unittest.TestCase):
    """A model whose lm_head is its embedding (the tiny preset): a full state_dict lists the
    shared tensor as lm_head.weight too, which update_weights leaves out."""

    def test_a_tied_lm_head_in_a_state_dict_is_skipped_not_refused(self):
        from _support import BIN_DIR
        model = tempfile.mkdtemp(prefix="rollout-py-tied-")
        try:
            subprocess.run([os.path.join(BIN_DIR, "rollout-make-model"), "--preset", "tiny",
                            "--out", model, "--seed", "3"], check=True, capture_output=True,
                           timeout=120)
            server = Server(cache_dir(), "--model", model)
            try:
                client = RolloutClient(server.target, timeout=120)
                info = client.wait_ready(60)
                self.assertTrue(info.model.tie_word_embeddings)
                state = read_safetensors(model)
                self.assertNotIn("lm_head.weight", state)
                state["lm_head.weight"] = state["model.embed_tokens.weight"]
                with self.assertRaises(RolloutError) as refused:
                    client.update_weights(state, version="tied-raw", skip_tied=False)
                self.assertEqual(refused.exception.code, "INVALID_ARGUMENT")
                self.assertIn("lm_head.weight", str(refused.exception))
                r = client.update_weights(state, version="tied-1")
                self.assertEqual(r.tensors_updated, len(state) - 1)
                self.assertEqual(r.weight_digest, info.weight_digest, "the same bytes")
                client.close()
            finally:
                server.stop()
        finally:
            shutil.rmtree(model, ignore_errors=True)


class RoutingReplayTest(unittest.TestCase):
    """A Qwen3-MoE model (the moe-small preset): generate(return_routing=True) returns each
    token's experts, and score(routings=...) with them gives generate's logprobs bitwise."""

    def test_generate_routing_replays_through_score(self):
        from _support import BIN_DIR
        model = tempfile.mkdtemp(prefix="rollout-py-moe-")
        try:
            subprocess.run([os.path.join(BIN_DIR, "rollout-make-model"), "--preset", "moe-small",
                            "--out", model, "--seed", "5"], check=True, capture_output=True,
                           timeout=120)
            server = Server(cache_dir(), "--model", model)
            try:
                client = RolloutClient(server.target, timeout=120)
                info = client.wait_ready(60)
                self.assertEqual(info.model.architecture, "Qwen3MoeForCausalLM")
                self.assertEqual(info.model.moe_layers, [0, 2, 3])
                self.assertTrue(info.model.routing_replay)
                per_token = len(info.model.moe_layers) * info.model.num_experts_per_tok
                prompt = [5, 17, 301, 4000, 12, 9]
                c = client.generate([prompt], max_new_tokens=8, temperature=0.7, seed=3,
                                    ignore_eos=True, return_routing=True)[0][0]
                self.assertEqual(len(c.routing), len(c.token_ids) * per_token)
                self.assertTrue(all(0 <= e < info.model.num_experts for e in c.routing))
                plain = client.generate([prompt], max_new_tokens=8, temperature=0.7, seed=3,
                                        ignore_eos=True)[0][0]
                self.assertEqual(plain.routing, [])
                self.assertEqual(plain.token_ids, c.token_ids)
                r = client.score([prompt + c.token_ids], len(prompt), temperature=0.7,
                                 routings=[c.routing], return_routing=True, details=True)[0]
                self.assertEqual(r.logprobs_array().tobytes(), c.logprobs_array().tobytes())
                self.assertEqual(r.routing, c.routing)
                bad = list(c.routing)
                bad[0] = info.model.num_experts
                with self.assertRaises(RolloutError) as refused:
                    client.score([prompt + c.token_ids], len(prompt), routings=[bad])
                self.assertEqual(refused.exception.code, "INVALID_ARGUMENT")
                self.assertIn("is outside the experts", str(refused.exception))
                # A transformers 5 state_dict holds experts fused: update_weights sends them as
                # the per-expert tensors the server serves -- the same bytes, the same digest.
                state = read_safetensors(model)

                def f32(name):
                    t = state[name]
                    bits = np.frombuffer(bytes(t.data), dtype=np.uint16).reshape(t.shape)
                    return bf16_bits_to_f32(bits)
                fused = {}
                for layer in info.model.moe_layers:
                    p = f"model.layers.{layer}.mlp.experts."
                    experts = range(info.model.num_experts)
                    fused[p + "gate_up_proj"] = np.stack([np.concatenate(
                        [f32(f"{p}{e}.gate_proj.weight"), f32(f"{p}{e}.up_proj.weight")])
                        for e in experts])
                    fused[p + "down_proj"] = np.stack([f32(f"{p}{e}.down_proj.weight")
                                                       for e in experts])
                r = client.update_weights(fused, version="fused-1")
                self.assertEqual(r.tensors_updated, len(info.model.moe_layers) *
                                 info.model.num_experts * 3)
                self.assertEqual(r.weight_digest, info.weight_digest, "the same bytes")
                client.close()
            finally:
                server.stop()
        finally:
            shutil.rmtree(model, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
