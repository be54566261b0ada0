"""The weight stream's encoding and buckets, and Fleet against real servers.

Run as the other test modules (client/python/run_tests.sh); Debian's /usr/bin/python3 (grpcio,
numpy) in a venv with the package installed.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import subprocess
import tempfile
import threading
import unittest

import grpc
import numpy as np

from rollout_client import (Fleet, FleetError, RawTensor, RolloutClient, RolloutError,
                            bf16_bits_to_f32, read_safetensors)
from rollout_client._stream import SharedStream, encode_data_chunk
from rollout_client.client import pb2, pb2_grpc
from rollout_client.weights import prepare

from _support import BIN_DIR, Server, cache_dir

NORM = "model.norm.weight"
PROMPTS = [[1, 2, 3, 4], [10, 20, 30]]
ARGS = dict(num_samples=2, seed=[5, 6], temperature=1.0, max_new_tokens=10)


def keys(groups):
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in g] for g in groups]


class EncodingTest(unittest.TestCase):
    def test_encoded_chunks_are_the_protobuf_encoding(self):
        rng = np.random.default_rng(0)
        for name in ("a", "model.layers.0.self_attn.q_proj.weight", "x" * 200):
            for offset in (0, 1, 127, 128, 300, 1 << 40):
                for size in (1, 127, 128, 16383, 16384, 70000):
                    data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                    got = encode_data_chunk(name.encode(), offset, memoryview(data))
                    want = pb2.WeightsChunk(data=pb2.TensorData(
                        name=name, offset=offset, data=data)).SerializeToString()
                    self.assertEqual(got, want, (name, offset, size))
                    parsed = pb2.WeightsChunk.FromString(got)
                    self.assertEqual((parsed.data.name, parsed.data.offset, parsed.data.data),
                                     (name, offset, data))


def _tensors(n: int, size: int):
    rng = np.random.default_rng(1)
    return [(f"t{i}", rng.standard_normal(size).astype(np.float32)) for i in range(n)]


def _collect(messages):
    """tensor name -> its bytes, checking order and chunk limits on the way."""
    it = iter(messages)
    header = pb2.WeightsChunk.FromString(next(it))
    got = {}
    for m in it:
        d = pb2.WeightsChunk.FromString(m).data
        buf = got.setdefault(d.name, bytearray())
        assert d.offset == len(buf), (d.name, d.offset, len(buf))
        buf += d.data
    return header, got


class SharedStreamTest(unittest.TestCase):
    def make(self, named, consumers, bucket_bytes, chunk_bytes=1000, ahead=2):
        tensors = prepare(named, "BF16")
        header = pb2.WeightsChunk(header=pb2.WeightsHeader(version="v")).SerializeToString()
        return SharedStream(header, tensors, consumers=consumers, bucket_bytes=bucket_bytes,
                            chunk_bytes=chunk_bytes, buckets_ahead=ahead)

    def test_buckets_and_chunks_carry_every_byte_once(self):
        named = _tensors(9, 1500) + [("big", np.ones(10000, np.float32))]
        for bucket_bytes in (1, 700, 3000, 1 << 30):
            stream = self.make(named, 1, bucket_bytes)
            _, got = _collect(stream.messages(0))
            for name, value in named:
                bits = prepare([(name, value)], "BF16")[0].payload().tobytes()
                self.assertEqual(bytes(got[name]), bits, (bucket_bytes, name))

    def test_a_consumer_stopped_while_its_iterator_runs_ends_it_quietly(self):
        # A refused call ends (stop) while gRPC's request thread still pulls from messages(i):
        # once every consumer has stopped the buckets are dropped, and the iterator must end,
        # not read a dropped bucket (a KeyError that Fleet raised in place of the FleetError).
        stream = self.make(_tensors(4, 500), 2, bucket_bytes=1000)
        it = stream.messages(0)
        next(it)  # the header; conversion starts
        with stream._cond:
            while stream._produced == 0 and not stream._finished:
                stream._cond.wait()
        stream.stop(0)
        stream.stop(1)
        self.assertEqual(list(it), [])

    def test_consumers_get_the_same_bytes_and_conversion_stays_bounded(self):
        named = _tensors(40, 500)   # 1000 bytes each in BF16: 40 buckets of 1000 bytes
        stream = self.make(named, 3, bucket_bytes=1000, ahead=2)
        outs = [None] * 3
        seen_alive = []
        slow = threading.Event()

        def consume(i):
            msgs = []
            for m in stream.messages(i):
                msgs.append(m)
                with stream._cond:
                    seen_alive.append(len(stream._buckets))
                if i == 2:
                    slow.wait(0.001)  # one slow replica holds the others back
            outs[i] = msgs

        threads = [threading.Thread(target=consume, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        self.assertEqual(outs[0], outs[1])
        self.assertEqual(outs[0], outs[2])
        self.assertEqual(len(outs[0]), 1 + 40)
        # Never more than `ahead` buckets beyond the slowest consumer's (+ the one it reads).
        self.assertLessEqual(max(seen_alive), 3)

    def test_a_stopped_consumer_does_not_hold_the_others(self):
        named = _tensors(20, 500)
        stream = self.make(named, 2, bucket_bytes=1000, ahead=1)
        first = stream.messages(1)
        next(first)
        first.close()  # replica 1 failed after the header
        _, got = _collect(stream.messages(0))
        self.assertEqual(len(got), 20)

    def test_a_conversion_error_reaches_every_consumer(self):
        named = [("ok", np.ones(4, np.float32)), ("bad", np.zeros(4, np.uint16))]
        # dtype None: a uint16 array cannot be converted; prepare() lets it through with
        # target BF16, so make the conversion itself fail instead.
        tensors = prepare(named, "BF16")
        tensors[1]._value = np.zeros(4, np.complex64)
        header = pb2.WeightsChunk(header=pb2.WeightsHeader(version="v")).SerializeToString()
        stream = SharedStream(header, tensors, consumers=2, bucket_bytes=1, chunk_bytes=4)
        for i in range(2):
            with self.assertRaises(TypeError):
                list(stream.messages(i))


try:
    import torch
    HAVE_CUDA = torch.cuda.is_available()
except ImportError:
    torch = None
    HAVE_CUDA = False


@unittest.skipUnless(HAVE_CUDA, "needs torch with a GPU (run by tests/gpu/python_weights.sh)")
class TorchGpuBucketsTest(unittest.TestCase):
    """GPU tensors go to the host through the pinned bucket; the bytes must be those of the
    same tensors converted on the CPU, whatever the bucket size and the tensors' dtypes."""

    def test_gpu_tensors_give_the_cpu_bytes(self):
        g = torch.Generator().manual_seed(0)
        cpu = [("a", torch.randn(37, 129, generator=g)),                     # f32 -> BF16
               ("b", torch.randn(1000, generator=g).to(torch.bfloat16)),     # as it is
               ("c", torch.randn(3, 5, generator=g).to(torch.float16)),      # f16 -> BF16
               ("d", torch.randn(64, 64, generator=g).t()),                  # a strided view
               ("e", torch.randn(5000, generator=g, dtype=torch.float64))]   # f64 -> BF16
        gpu = [(n, t.cuda()) for n, t in cpu]
        want = {n: bytes(prepare([(n, t)], "BF16")[0].payload()) for n, t in cpu}
        for bucket_bytes in (1, 100, 3000, 1 << 20):
            for named in (gpu, cpu[:2] + gpu[2:]):  # GPU only, and mixed with CPU tensors
                tensors = prepare(named, "BF16")
                header = pb2.WeightsChunk(header=pb2.WeightsHeader(version="v")).SerializeToString()
                stream = SharedStream(header, tensors, consumers=1, bucket_bytes=bucket_bytes,
                                      chunk_bytes=777)
                _, got = _collect(stream.messages(0))
                self.assertEqual({n: bytes(b) for n, b in got.items()}, want, bucket_bytes)


class _Rejecting(pb2_grpc.RolloutServiceServicer):
    """A replica that refuses every update (and reads its whole stream first)."""

    def GetServerInfo(self, request, context):
        info = pb2.ServerInfo(weight_version="fake")
        return info

    def UpdateWeights(self, request_iterator, context):
        for _ in request_iterator:
            pass
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this replica refuses updates")


class _RecordingPeers(pb2_grpc.RolloutServiceServicer):
    """Accepts every update, recording each call's client address and header."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = []  # (peer, header)

    def UpdateWeights(self, request_iterator, context):
        header = next(request_iterator).header
        for _ in request_iterator:
            pass
        with self.lock:
            self.calls.append((context.peer(), header))
        return pb2.UpdateWeightsResponse(version=header.version, part_count=header.part_count)


class FleetTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.servers = [Server(cache_dir()), Server(cache_dir())]
        cls.fleet = Fleet([s.target for s in cls.servers], timeout=120)
        infos = cls.fleet.wait_ready(60)
        cls.model_dir = infos[0].model.source
        cls.original = read_safetensors(cls.model_dir, [NORM])[NORM]
        cls.baseline = [RolloutClient(s.target, timeout=120).generate(PROMPTS, **ARGS)
                        for s in cls.servers]

    @classmethod
    def tearDownClass(cls):
        cls.fleet.close()
        for s in cls.servers:
            s.stop()

    def nudged(self, step):
        f = bf16_bits_to_f32(np.frombuffer(self.original.data, np.uint16))
        f = f.reshape(self.original.shape)
        return f * np.float32(1 + 0.01 * step)

    def test_every_replica_serves_the_same_new_bits(self):
        self.assertEqual(keys(self.baseline[0]), keys(self.baseline[1]))
        results = self.fleet.update_weights({NORM: self.nudged(3)}, version="fleet-1",
                                            bucket_bytes=256, chunk_bytes=100)
        self.assertEqual([r.version for r in results], ["fleet-1", "fleet-1"])
        self.assertEqual(results[0].weight_digest, results[1].weight_digest)
        for r in results:
            self.assertEqual(r.bytes_received, len(self.original.data))
            self.assertGreater(r.seconds, 0)
            self.assertGreater(r.bytes_per_second, 0)
        outs = [RolloutClient(s.target, timeout=120).generate(PROMPTS, **ARGS)
                for s in self.servers]
        self.assertEqual(keys(outs[0]), keys(outs[1]))
        self.assertNotEqual(keys(outs[0]), keys(self.baseline[0]))
        # Back to the original bytes: the original bits, on both.
        results = self.fleet.update_weights({NORM: self.original}, version="fleet-orig")
        for s in self.servers:
            out = RolloutClient(s.target, timeout=120).generate(PROMPTS, **ARGS)
            self.assertEqual(keys(out), keys(self.baseline[0]))
        self.assertEqual({i.weight_version for i in self.fleet.server_info()}, {"fleet-orig"})

    def test_a_failing_replica_is_named_and_the_others_updated(self):
        fake = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        pb2_grpc.add_RolloutServiceServicer_to_server(_Rejecting(), fake)
        port = fake.add_insecure_port("127.0.0.1:0")
        fake.start()
        fake_target = f"127.0.0.1:{port}"
        try:
            with Fleet([self.servers[0].target, fake_target], timeout=60) as mixed:
                with self.assertRaises(FleetError) as cm:
                    mixed.update_weights({NORM: self.original}, version="mixed-1",
                                         skip_tied=False, bucket_bytes=64, chunk_bytes=32)
                e = cm.exception
                self.assertEqual(e.code, "FAILED_PRECONDITION")
                self.assertIn(fake_target, e.message)
                self.assertIn("this replica refuses updates", e.message)
                self.assertIn(f"succeeded: {self.servers[0].target}", e.message)
                self.assertIsNone(e.errors[0])
                self.assertEqual(e.results[0].version, "mixed-1")
                self.assertIsNone(e.results[1])
                retry = mixed.subset([fake_target])
                self.assertEqual(retry.targets, [fake_target])
        finally:
            fake.stop(None)
        self.fleet.update_weights({NORM: self.original}, version="0-again")

    def test_bad_input_is_refused_before_anything_is_sent(self):
        with self.assertRaises(ValueError):
            Fleet([])
        with self.assertRaises(ValueError):
            Fleet(["a:1", "a:1"])
        with self.assertRaises(TypeError):
            self.fleet.update_weights({NORM: np.zeros(3, np.complex64)}, version="x")
        with self.assertRaises(FleetError) as cm:
            self.fleet.update_weights({NORM: np.ones(7, np.float32)}, version="x")
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        self.assertEqual(len([e for e in cm.exception.errors if e is not None]), 2)
        self.assertNotIn("x", {i.weight_version for i in self.fleet.server_info()})


if __name__ == "__main__":
    unittest.main()


class MultiStreamTest(unittest.TestCase):
    """update_weights(streams=3): one update over three concurrent calls, each on its own
    connection, gives the digest and bits of one stream; a failing part fails the whole."""

    TENSORS = ["model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight",
               "model.layers.1.mlp.up_proj.weight", NORM]

    @classmethod
    def setUpClass(cls):
        cls.server = Server(cache_dir())
        cls.client = RolloutClient(cls.server.target, timeout=120)
        info = cls.client.wait_ready(60)
        cls.original = read_safetensors(info.model.source, cls.TENSORS)
        cls.baseline = cls.client.generate(PROMPTS, **ARGS)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.stop()

    def changed(self):
        out = {}
        for name, t in self.original.items():
            f = bf16_bits_to_f32(np.frombuffer(t.data, np.uint16)).reshape(t.shape)
            out[name] = f * np.float32(1.03)
        return out

    def test_split_by_bytes_is_balanced_and_deterministic(self):
        from rollout_client._wire import split_by_bytes
        self.assertEqual(split_by_bytes([5, 1, 4, 4, 2], 3), [[0], [2, 4], [1, 3]])
        self.assertEqual(split_by_bytes([7, 7], 5), [[0], [1]])
        self.assertEqual(split_by_bytes([3], 1), [[0]])

    def test_each_stream_has_a_connection_of_its_own(self):
        recorder = _RecordingPeers()
        fake = grpc.server(concurrent.futures.ThreadPoolExecutor(8))
        pb2_grpc.add_RolloutServiceServicer_to_server(recorder, fake)
        port = fake.add_insecure_port("127.0.0.1:0")
        fake.start()
        try:
            with RolloutClient(f"127.0.0.1:{port}", timeout=60) as client:
                r = client.update_weights(self.original, version="peers", streams=3,
                                          skip_tied=False)
        finally:
            fake.stop(None)
        self.assertEqual(r.part_count, 3)
        peers = {peer for peer, _ in recorder.calls}
        self.assertEqual(len(recorder.calls), 3)
        self.assertEqual(len(peers), 3, f"the streams shared a connection: {peers}")
        headers = [h for _, h in recorder.calls]
        self.assertEqual(sorted(h.part_index for h in headers), [0, 1, 2])
        self.assertEqual(len({h.update_id for h in headers}), 1)
        self.assertTrue(headers[0].update_id)
        declared = [t.name for h in headers for t in h.tensors]
        self.assertEqual(sorted(declared), sorted(self.TENSORS))

    def test_three_streams_give_the_digest_and_bits_of_one(self):
        one = self.client.update_weights(self.changed(), version="py-one", chunk_bytes=4096)
        bits_one = keys(self.client.generate(PROMPTS, **ARGS))
        self.assertNotEqual(bits_one, keys(self.baseline))
        self.assertEqual(one.part_count, 1)
        self.client.update_weights(self.original, version="py-back")
        self.assertEqual(keys(self.client.generate(PROMPTS, **ARGS)), keys(self.baseline))
        three = self.client.update_weights(self.changed(), version="py-three", chunk_bytes=4096,
                                           streams=3)
        self.assertEqual(three.part_count, 3)
        self.assertEqual(three.version, "py-three")
        self.assertEqual(three.tensors_updated, len(self.TENSORS))
        self.assertEqual(three.bytes_received, one.bytes_received)
        self.assertEqual(three.weight_digest, one.weight_digest)
        self.assertEqual(keys(self.client.generate(PROMPTS, **ARGS)), bits_one)
        self.client.update_weights(self.original, version="py-back-2", streams=2)
        self.assertEqual(keys(self.client.generate(PROMPTS, **ARGS)), keys(self.baseline))

    def test_a_bad_tensor_in_one_part_fails_the_update(self):
        before = self.client.server_info()
        bad = self.changed()
        bad[NORM] = np.ones(7, np.float32)  # the wrong shape: its part is refused
        with self.assertRaises(RolloutError) as cm:
            self.client.update_weights(bad, version="py-bad", streams=3)
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        after = self.client.server_info()
        self.assertEqual(after.weight_version, before.weight_version)
        self.assertEqual(after.weight_digest, before.weight_digest)
        with self.assertRaises(ValueError):
            self.client.update_weights(self.original, version="x", streams=0)
