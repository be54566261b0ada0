"""NCCL weight broadcasts without torch, NCCL or a GPU: the bucket layout against the golden
vectors the server is tested against (tests/testdata/broadcast_plan_golden.json), the handshake,
the requests, a real server's answers (the cpu backend refuses; bad arguments are ValueError before
any call), and WeightBroadcaster's orchestration over a fake transport and fake servers (joins at
once, a refusal at the handshake stops every rank, results with bytes/s, the group left on
failure). The torch + NCCL transport runs on a GPU host: tests/gpu/nccl_broadcast.sh."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import unittest

import rollout_client
import rollout_client.aio
from rollout_client import (BroadcastError, RolloutClient, RolloutError, WeightBroadcaster,
                            read_safetensors)
from rollout_client import _wire, broadcast_plan as bp
from rollout_client.datatypes import UpdateWeightsResult, WeightSyncGroup

from _support import REPO, shared_server, stop_shared_server

GOLDEN = os.path.join(REPO, "tests", "testdata", "broadcast_plan_golden.json")
NORM = "model.norm.weight"


def tearDownModule():
    stop_shared_server()


def specs_of(case):
    return [bp.TensorSpec(t["name"], t["dtype"], tuple(t["shape"])) for t in case["tensors"]]


class GoldenVectorTest(unittest.TestCase):
    def test_the_plan_is_what_the_server_computes(self):
        with open(GOLDEN) as f:
            golden = json.load(f)
        self.assertEqual(golden["alignment"], bp.ALIGNMENT)
        self.assertGreaterEqual(len(golden["cases"]), 3)
        for case in golden["cases"]:
            with self.subTest(case["description"]):
                plan = bp.plan_broadcast(specs_of(case), case["bucket_bytes"])
                self.assertEqual(bp.plan_text(plan.tensors, plan.bucket_bytes), case["plan_text"])
                self.assertEqual(plan.digest.hex(), case["plan_digest"])
                self.assertEqual(list(plan.offsets), case["offsets"])
                self.assertEqual(plan.total_bytes, case["total_bytes"])
                self.assertEqual(plan.payload_bytes, case["payload_bytes"])
                got = [{"stream_offset": b.stream_offset, "size": b.size,
                        "slices": [[s.tensor, s.tensor_offset, s.bucket_offset, s.size]
                                   for s in b.slices]} for b in plan.buckets]
                self.assertEqual(got, case["buckets"])
                for j, want in enumerate(case["leaves"]):
                    runs, completed = bp.leaves_completed_by(plan, j)
                    self.assertEqual([list(r) for r in runs], want["runs"], j)
                    self.assertEqual(list(completed), want["completed"], j)
                self.assertEqual(bp.encode_handshake(bp.ROLE_SOURCE, True, 0, plan.total_bytes,
                                                     plan.digest).hex(),
                                 case["source_handshake_rank0"])
                self.assertEqual(bp.encode_handshake(bp.ROLE_RECEIVER, False, 2, plan.total_bytes,
                                                     plan.digest).hex(),
                                 case["receiver_handshake_refused_source2"])

    def test_the_buckets_rebuild_the_stream_of_any_tensors(self):
        sizes = [1, 255, 256, 257, 65537, 3, 200000]
        specs = [bp.TensorSpec(f"t{i}", "BF16" if i % 2 else "F32", (n,))
                 for i, n in enumerate(sizes)]
        data = [bytes((i * 7 + k) % 251 for k in range(s.nbytes)) for i, s in enumerate(specs)]
        for bucket_bytes in (256, 1000, 65536, 1 << 30):
            plan = bp.plan_broadcast(specs, bucket_bytes)
            stream = bytearray(plan.total_bytes)
            for b in plan.buckets:
                for s in b.slices:
                    at = b.stream_offset + s.bucket_offset
                    stream[at:at + s.size] = data[s.tensor][s.tensor_offset:s.tensor_offset + s.size]
            for i, offset in enumerate(plan.offsets):
                self.assertEqual(offset % bp.ALIGNMENT, 0)
                self.assertEqual(bytes(stream[offset:offset + specs[i].nbytes]), data[i])


class HandshakeTest(unittest.TestCase):
    def setUp(self):
        self.plan = bp.plan_broadcast([bp.TensorSpec("a", "BF16", (8,))], 256)

    def record(self, role=bp.ROLE_RECEIVER, ready=True, source=0, digest=None):
        return bp.encode_handshake(role, ready, source, self.plan.total_bytes,
                                   self.plan.digest if digest is None else digest)

    def test_goes_ahead_only_when_every_rank_agrees(self):
        source = self.record(bp.ROLE_SOURCE)
        self.assertIsNone(bp.handshake_verdict(source + self.record() + self.record(), 3))
        self.assertIn("rank(s) [2] refused",
                      bp.handshake_verdict(source + self.record() + self.record(ready=False), 3))
        self.assertIn("differs from the source's",
                      bp.handshake_verdict(source + self.record(digest=b"x" * 32), 2))
        self.assertIn("expects rank 1",
                      bp.handshake_verdict(source + self.record(source=1), 2))
        self.assertIn("exactly one", bp.handshake_verdict(self.record() + self.record(), 2))
        self.assertIn("not one", bp.handshake_verdict(source + b"\0" * 64, 2))
        self.assertIn("were expected", bp.handshake_verdict(source, 2))


class RequestTest(unittest.TestCase):
    def test_requests_carry_every_field(self):
        r = _wire.broadcast_request([("a", "BF16", (2, 3)), bp.TensorSpec("b", "F32", (4,))],
                                    "v7", "abort", 1 << 20, 0, 12.5, "sha256:" + "0" * 64)
        self.assertEqual(r.version, "v7")
        self.assertEqual([(t.name, t.dtype, list(t.shape)) for t in r.tensors],
                         [("a", "BF16", [2, 3]), ("b", "F32", [4])])
        self.assertEqual(r.bucket_bytes, 1 << 20)
        self.assertEqual(r.source_rank, 0)
        self.assertEqual(r.timeout_seconds, 12.5)
        self.assertEqual(r.policy, _wire.pb2.IN_FLIGHT_POLICY_ABORT)
        j = _wire.join_request(b"u" * 128, 2, 3, 30)
        self.assertEqual((j.unique_id, j.rank, j.world_size, j.timeout_seconds),
                         (b"u" * 128, 2, 3, 30.0))

    def test_bad_arguments_are_value_errors_before_any_call(self):
        with self.assertRaisesRegex(ValueError, "unique_id has 127 bytes"):
            _wire.join_request(b"u" * 127, 1, 2, 0)
        with self.assertRaisesRegex(ValueError, "rank 2 is not in"):
            _wire.join_request(b"u" * 128, 2, 2, 0)
        with self.assertRaisesRegex(ValueError, "bucket_bytes = 1000"):
            _wire.broadcast_request([("a", "BF16", (2,))], "v", "drain", 1000, 0, 0, None)
        with self.assertRaisesRegex(ValueError, "dtype 'I64'"):
            _wire.broadcast_request([("a", "I64", (2,))], "v", "drain", 256, 0, 0, None)
        with self.assertRaisesRegex(ValueError, "version"):
            _wire.broadcast_request([("a", "BF16", (2,))], "", "drain", 256, 0, 0, None)


class ServerAnswersTest(unittest.TestCase):
    """A real cpu server: it cannot receive broadcasts, and says which backend can."""

    @classmethod
    def setUpClass(cls):
        cls.server = shared_server()
        cls.client = RolloutClient(cls.server.target, timeout=120)
        info = cls.client.wait_ready(60)
        norm = read_safetensors(info.model.source, [NORM])[NORM]
        cls.specs = [(NORM, "BF16", tuple(norm.shape))]

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def test_the_cpu_backend_refuses_naming_the_cuda_backend(self):
        with self.assertRaises(RolloutError) as e:
            self.client.join_weight_sync_group(b"u" * 128, 1, 2, group_timeout=5)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("--backend cuda --device_weight_staging", e.exception.message)
        with self.assertRaises(RolloutError) as e:
            self.client.update_weights_from_broadcast(self.specs, "bc", bucket_bytes=4096)
        self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
        self.assertIn("cannot receive NCCL weight broadcasts", e.exception.message)
        self.assertIsNone(self.client.leave_weight_sync_group())
        self.assertIsNone(self.client.server_info().weight_sync_group)

    def test_a_wrong_shape_is_invalid_argument_naming_the_tensor(self):
        with self.assertRaises(RolloutError) as e:
            self.client.update_weights_from_broadcast([(NORM, "BF16", (3,))], "bc",
                                                      bucket_bytes=4096)
        self.assertEqual(e.exception.code, "INVALID_ARGUMENT")
        self.assertIn(f"tensor '{NORM}': shape [3]", e.exception.message)

    def test_the_asyncio_client_answers_the_same(self):
        async def run():
            async with rollout_client.aio.RolloutClient(self.server.target) as client:
                with self.assertRaises(RolloutError) as e:
                    await client.join_weight_sync_group(b"u" * 128, 1, 2)
                self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                with self.assertRaises(RolloutError) as e:
                    await client.update_weights_from_broadcast(self.specs, "bc", bucket_bytes=4096)
                self.assertEqual(e.exception.code, "FAILED_PRECONDITION")
                self.assertIsNone(await client.leave_weight_sync_group())
        asyncio.run(run())

    def test_a_broadcaster_without_torch_says_what_it_needs(self):
        try:
            import torch  # noqa: F401
            self.skipTest("torch is installed here")
        except ImportError:
            pass
        with self.assertRaisesRegex(ImportError, "WeightBroadcaster needs torch"):
            WeightBroadcaster([self.server.target])


# --- WeightBroadcaster over a fake transport and fake servers --------------------------------

class FakeTensor:
    def __init__(self, dtype, shape, data):
        self.dtype, self.shape, self.data = dtype, shape, data


class FakeGroup:
    """The ranks' meeting point: each server posts its handshake record, the trainer's
    transport gathers them; the trainer's buckets reach every server."""

    def __init__(self, world):
        self.world = world
        self.cv = threading.Condition()
        self.records = {}
        self.gathered = None
        self.stream = None
        self.joined = threading.Barrier(world)  # every rank blocks in its join until all came

    def post(self, rank, record):
        with self.cv:
            self.records[rank] = record
            self.cv.notify_all()
            assert self.cv.wait_for(lambda: self.gathered is not None, 10)
            return self.gathered

    def gather(self, record):
        with self.cv:
            self.records[0] = record
            assert self.cv.wait_for(lambda: len(self.records) == self.world, 10), self.records
            self.gathered = b"".join(self.records[r] for r in range(self.world))
            self.cv.notify_all()
            return self.gathered

    def deliver(self, stream):
        with self.cv:
            self.stream = stream
            self.cv.notify_all()

    def wait_stream(self):
        with self.cv:
            assert self.cv.wait_for(lambda: self.stream is not None, 10)
            return self.stream


class FakeTransport:
    def __init__(self, group):
        self.group = group
        self.sent_buckets = 0
        self.closed = False

    def unique_id(self):
        return b"\x42" * 128

    def join(self, unique_id, world_size, rank, timeout, give_up=None):
        self.group.joined.wait(10)

    def describe(self, name, t):
        return bp.TensorSpec(name, t.dtype, t.shape)

    def handshake(self, record, timeout):
        return self.group.gather(record)

    def send(self, plan, tensors, timeout):
        stream = bytearray(plan.total_bytes)
        for b in plan.buckets:
            for s in b.slices:
                at = b.stream_offset + s.bucket_offset
                stream[at:at + s.size] = tensors[s.tensor].data[s.tensor_offset:
                                                                s.tensor_offset + s.size]
            self.sent_buckets += 1
        self.group.deliver(bytes(stream))

    def close(self):
        self.closed = True


class FakeServer:
    """What RolloutClient's weight-sync calls do against a server in the group."""

    def __init__(self, group, target, refuse=None):
        self.group, self.target, self.refuse = group, target, refuse
        self.rank = None
        self.received = None
        self.left = 0

    def join_weight_sync_group(self, unique_id, rank, world_size, group_timeout=0.0):
        assert unique_id == b"\x42" * 128 and world_size == self.group.world
        self.rank = rank
        self.group.joined.wait(10)  # a real join blocks until every rank came
        return WeightSyncGroup(rank, world_size, 0.01, 22703)

    def leave_weight_sync_group(self):
        self.left += 1
        return WeightSyncGroup(self.rank, self.group.world)

    def server_info(self):
        class Model:
            tie_word_embeddings = False

        class Info:
            model = Model()
        return Info()

    def update_weights_from_broadcast(self, specs, version, policy, *, bucket_bytes, source_rank,
                                      broadcast_timeout, expected_weight_digest):
        plan = bp.plan_broadcast(specs, bucket_bytes)
        record = bp.encode_handshake(bp.ROLE_RECEIVER, self.refuse is None, source_rank,
                                     plan.total_bytes, plan.digest)
        gathered = self.group.post(self.rank, record)
        if self.refuse is not None:
            raise RolloutError("INVALID_ARGUMENT", self.refuse)
        verdict = bp.handshake_verdict(gathered, self.group.world)
        if verdict is not None:
            raise RolloutError("ABORTED", verdict)
        self.received = self.group.wait_stream()
        return UpdateWeightsResult(version, "0", len(specs), plan.payload_bytes, 0, 0.01, 0.0,
                                   "sha256:x", seconds=0.02,
                                   bytes_per_second=plan.payload_bytes / 0.02)


class WeightBroadcasterTest(unittest.TestCase):
    TENSORS = [("w", FakeTensor("BF16", (3, 1000), bytes(range(256)) * 23 + bytes(112))),
               ("n", FakeTensor("F32", (5,), bytes(range(20))))]

    def make(self, refuse=None, servers=2):
        group = FakeGroup(1 + servers)
        fakes = [FakeServer(group, f"s{i}", refuse if i == servers - 1 else None)
                 for i in range(servers)]
        transport = FakeTransport(group)
        return WeightBroadcaster(fakes, transport=transport, timeout=10), fakes, transport, group

    def test_joins_every_server_at_once_and_broadcasts_the_plan_to_all(self):
        fleet, fakes, transport, group = self.make()
        self.assertEqual([f.rank for f in fakes], [1, 2])  # the trainer is rank 0
        self.assertEqual([g.rank for g in fleet.groups], [1, 2])
        results = fleet.broadcast(self.TENSORS, "v1", bucket_bytes=1024)
        plan = bp.plan_broadcast([bp.TensorSpec("w", "BF16", (3, 1000)),
                                  bp.TensorSpec("n", "F32", (5,))], 1024)
        self.assertEqual(transport.sent_buckets, len(plan.buckets))
        for f in fakes:
            self.assertEqual(f.received[:6000], self.TENSORS[0][1].data)
            self.assertEqual(f.received[plan.offsets[1]:], self.TENSORS[1][1].data)
        self.assertEqual([r.bytes_received for r in results], [6020, 6020])
        self.assertTrue(all(r.bytes_per_second > 0 for r in results))
        fleet.close()
        self.assertEqual([f.left for f in fakes], [1, 1])
        self.assertTrue(transport.closed)

    def test_a_server_that_refuses_stops_the_broadcast_for_every_rank(self):
        fleet, fakes, transport, _ = self.make(refuse="tensors[0]: bad")
        with self.assertRaises(BroadcastError) as e:
            fleet.broadcast(self.TENSORS, "v1", bucket_bytes=1024)
        self.assertEqual(transport.sent_buckets, 0, "nothing is sent after a refusal")
        self.assertIsInstance(e.exception.errors[1], RolloutError)
        self.assertEqual(e.exception.errors[1].code, "INVALID_ARGUMENT")
        self.assertEqual(e.exception.errors[0].code, "ABORTED")
        self.assertIn("s1: INVALID_ARGUMENT: tensors[0]: bad", str(e.exception))
        self.assertIsNone(e.exception.trainer_error)

    def test_bad_arguments_are_refused_before_any_server_is_asked(self):
        fleet, fakes, transport, group = self.make()
        with self.assertRaisesRegex(ValueError, "bucket_bytes = 1000"):
            fleet.broadcast(self.TENSORS, "v1", bucket_bytes=1000)
        with self.assertRaisesRegex(ValueError, "no tensors"):
            fleet.broadcast([], "v1")
        self.assertEqual(group.records, {})

    def test_a_failed_join_leaves_the_servers_that_joined(self):
        class Refusing(FakeServer):
            def join_weight_sync_group(self, *args, **kwargs):
                self.group.joined.abort()  # the others stop waiting
                raise RolloutError("FAILED_PRECONDITION", "no --device_weight_staging")

        group = FakeGroup(3)
        fakes = [FakeServer(group, "s0"), Refusing(group, "s1")]
        transport = FakeTransport(group)
        transport.join = lambda *a, **k: None
        with self.assertRaises(BroadcastError) as e:
            WeightBroadcaster(fakes, transport=transport, timeout=10)
        self.assertIn("s1: FAILED_PRECONDITION", str(e.exception))
        self.assertTrue(transport.closed)


if __name__ == "__main__":
    unittest.main()
