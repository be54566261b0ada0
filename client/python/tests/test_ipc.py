"""update_weights_from_ipc without torch or a GPU: fake tensors exposing the torch interface the
client uses (device, dtype, shape, is_contiguous, untyped_storage()._share_cuda_(),
storage_offset, element_size) and a fake ``torch`` module (cuda.synchronize,
cuda.get_device_properties(i).uuid), checked against what goes over the wire and against a
real server's answers (the cpu backend refuses; malformed tensors are INVALID_ARGUMENT)."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import sys
import types
import unittest
from unittest import mock

import grpc

import rollout_client
import rollout_client.aio
from rollout_client import IpcTensor, RolloutClient, RolloutError, read_safetensors
from rollout_client import ipc
from rollout_client.client import pb2, pb2_grpc

from _support import shared_server, stop_shared_server

NORM = "model.norm.weight"
UUID = "0a1b2c3d-0000-4000-8000-00000000abcd"
HANDLE = bytes(range(64))


def tearDownModule():
    stop_shared_server()


class FakeStorage:
    """An untyped storage in a caching-allocator block: `offset` bytes into the allocation
    `handle` exports (torch >= 2.3 layout: version byte, 'c', the 64 bytes)."""
    released = []  # (ref counter handle, offset) given back, over every storage

    def __init__(self, ptr, offset, handle=b"\x02c" + HANDLE, nbytes=1 << 20):
        self.ptr, self.offset, self.handle, self.nbytes = ptr, offset, handle, nbytes
        self.shares = 0

    def data_ptr(self):
        return self.ptr

    def _share_cuda_(self):
        self.shares += 1
        return (0, self.handle, self.nbytes, self.offset, b"/torch_42_ref", 7 + self.ptr % 5,
                b"\0" * 64, False)

    @staticmethod
    def _release_ipc_counter_cuda(handle, offset):
        FakeStorage.released.append((handle, offset))


class FakeDType:
    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"torch.{self.name}"


class FakeTensor:
    def __init__(self, shape, storage, storage_offset=0, dtype="bfloat16", device="cuda",
                 contiguous=True):
        self.shape = tuple(shape)
        self.dtype = FakeDType(dtype)
        self.device = types.SimpleNamespace(type=device, index=0 if device == "cuda" else None)
        self._storage, self._offset, self._contiguous = storage, storage_offset, contiguous

    def is_contiguous(self):
        return self._contiguous

    def untyped_storage(self):
        return self._storage

    def storage_offset(self):
        return self._offset

    def element_size(self):
        return 4 if str(self.dtype) == "torch.float32" else 2


def fake_torch():
    """A ``torch`` module with what ipc.export_tensors calls; records synchronize calls."""
    torch = types.ModuleType("torch")
    torch.synchronized = []

    class Uuid:
        def __str__(self):
            return UUID

    torch.cuda = types.SimpleNamespace(
        current_device=lambda: 0,
        synchronize=lambda device=None: torch.synchronized.append(device),
        get_device_properties=lambda i: types.SimpleNamespace(uuid=Uuid()))
    return torch


class ExportTest(unittest.TestCase):
    def setUp(self):
        FakeStorage.released.clear()
        self.torch = fake_torch()
        patcher = mock.patch.dict(sys.modules, {"torch": self.torch})
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_handles_offsets_and_one_share_per_storage(self):
        fused = FakeStorage(ptr=1000, offset=4096)
        other = FakeStorage(ptr=2000, offset=0, handle=HANDLE[::-1])  # torch < 2.3: bare handle
        q = FakeTensor((8, 4), fused)
        k = FakeTensor((2, 4), fused, storage_offset=32)  # a view into the same storage
        norm = FakeTensor((4,), other, dtype="float32")
        with ipc.export_tensors([("q", q), ("k", k), ("norm", norm)]) as exported:
            self.assertEqual(self.torch.synchronized, [0], "the device is synchronized first")
            self.assertEqual((fused.shares, other.shares), (1, 1))
            self.assertEqual(exported.tensors, [
                IpcTensor("q", "BF16", (8, 4), HANDLE, 4096, UUID),
                IpcTensor("k", "BF16", (2, 4), HANDLE, 4096 + 32 * 2, UUID),
                IpcTensor("norm", "F32", (4,), HANDLE[::-1], 0, UUID)])
            self.assertEqual(FakeStorage.released, [])
        self.assertEqual(sorted(FakeStorage.released),
                         sorted([(b"/torch_42_ref", 7 + 1000 % 5), (b"/torch_42_ref", 7 + 2000 % 5)]),
                         "each share's reference count is given back once")

    def test_tensors_it_cannot_export_are_refused_by_name(self):
        s = FakeStorage(ptr=1, offset=0)
        cases = [
            (FakeTensor((4,), s, contiguous=False), "tensor 'w' is not contiguous"),
            (FakeTensor((4,), s, device="cpu"), "tensor 'w' is on"),
            (FakeTensor((4,), s, dtype="float64"), "tensor 'w': dtype torch.float64"),
            (FakeTensor((4,), FakeStorage(1, 0, handle=b"\x02e" + b"\0" * 40)),
             "expandable_segments:False"),
            (FakeTensor((4,), FakeStorage(1, 0, handle=b"\0" * 10)), "unknown layout"),
        ]
        for t, expected in cases:
            with self.assertRaises(ValueError) as cm:
                ipc.export_tensors([("w", t)])
            self.assertIn(expected, str(cm.exception))
        # The first three are refused before anything is shared; the last two after their
        # share, which is given back.
        self.assertEqual(len(FakeStorage.released), 2)

    def test_json_is_what_rollout_cli_reads(self):
        t = FakeTensor((3, 5), FakeStorage(ptr=9, offset=256))
        with ipc.export_tensors({"model.norm.weight": t}) as exported:
            doc = json.loads(exported.to_json())
        self.assertEqual(doc, {"tensors": [{
            "name": "model.norm.weight", "dtype": "BF16", "shape": [3, 5],
            "ipc_handle": base64.b64encode(HANDLE).decode(), "offset_bytes": 256,
            "device_uuid": UUID}]})

    def test_ipc_tensors_pass_through_without_torch(self):
        pre = IpcTensor("x", "BF16", (2,), HANDLE, 0, UUID)
        with mock.patch.dict(sys.modules, {"torch": None}):
            exported = ipc.export_tensors([("renamed", pre)])
        self.assertEqual(exported.tensors, [IpcTensor("renamed", "BF16", (2,), HANDLE, 0, UUID)])

    def test_without_torch_the_error_says_torch_is_needed(self):
        with mock.patch.dict(sys.modules, {"torch": None}):
            with self.assertRaises(ImportError) as cm:
                ipc.export_tensors([("w", FakeTensor((4,), FakeStorage(1, 0)))])
        self.assertIn("update_weights_from_ipc needs torch", str(cm.exception))


class _IpcRecorder(pb2_grpc.RolloutServiceServicer):
    def __init__(self):
        self.requests = []

    def GetServerInfo(self, request, context):
        return pb2.ServerInfo(weight_version="fake", backend="none",
                              model=pb2.ModelInfo(tie_word_embeddings=True))

    def UpdateWeightsFromIpc(self, request, context):
        self.requests.append(request)
        if request.version == "refuse":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        return pb2.UpdateWeightsResponse(version=request.version, previous_version="fake",
                                         tensors_updated=len(request.tensors))


class WireTest(unittest.TestCase):
    def setUp(self):
        FakeStorage.released.clear()
        patcher = mock.patch.dict(sys.modules, {"torch": fake_torch()})
        patcher.start()
        self.addCleanup(patcher.stop)
        self.recorder = _IpcRecorder()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        pb2_grpc.add_RolloutServiceServicer_to_server(self.recorder, self.server)
        self.target = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()
        self.addCleanup(self.server.stop, None)

    def test_the_request_names_every_tensor_and_the_tied_lm_head_is_left_out(self):
        s = FakeStorage(ptr=5, offset=512)
        state = {"model.embed_tokens.weight": FakeTensor((16, 4), s),
                 "lm_head.weight": FakeTensor((16, 4), s),  # tied: the same storage
                 "model.norm.weight": FakeTensor((4,), s, storage_offset=64)}
        with RolloutClient(self.target) as c:
            r = c.update_weights_from_ipc(state, version="v3", policy="continue")
        self.assertEqual((r.version, r.previous_version, r.tensors_updated), ("v3", "fake", 2))
        self.assertGreater(r.seconds, 0)
        request = self.recorder.requests[0]
        self.assertEqual(request.version, "v3")
        self.assertEqual(request.policy, pb2.IN_FLIGHT_POLICY_CONTINUE)
        self.assertEqual([(t.name, t.dtype, list(t.shape), t.ipc_handle, t.offset_bytes,
                           t.device_uuid) for t in request.tensors],
                         [("model.embed_tokens.weight", "BF16", [16, 4], HANDLE, 512, UUID),
                          ("model.norm.weight", "BF16", [4], HANDLE, 512 + 128, UUID)])
        self.assertEqual(len(FakeStorage.released), 1, "released after the answer")

    def test_shares_are_given_back_when_the_server_refuses(self):
        with RolloutClient(self.target) as c:
            with self.assertRaises(RolloutError) as cm:
                c.update_weights_from_ipc([("w", FakeTensor((4,), FakeStorage(1, 0)))],
                                          version="refuse")
        self.assertEqual(cm.exception.code, "INVALID_ARGUMENT")
        self.assertEqual(len(FakeStorage.released), 1)

    def test_the_aio_client_sends_the_same_request(self):
        async def main():
            async with rollout_client.aio.RolloutClient(self.target) as c:
                return await c.update_weights_from_ipc(
                    [("w", FakeTensor((4,), FakeStorage(1, 64)))], version="a1")
        r = asyncio.run(main())
        self.assertEqual(r.tensors_updated, 1)
        self.assertEqual(self.recorder.requests[0].tensors[0].offset_bytes, 64)
        self.assertEqual(len(FakeStorage.released), 1)


class ServerAnswersTest(unittest.TestCase):
    """A real rollout-server (the cpu backend): validation first, then the backend's refusal."""

    @classmethod
    def setUpClass(cls):
        cls.server = shared_server()
        cls.client = RolloutClient(cls.server.target, timeout=120)
        info = cls.client.wait_ready(60)
        cls.norm = read_safetensors(info.model.source, [NORM])[NORM]

    @classmethod
    def tearDownClass(cls):
        cls.client.close()

    def setUp(self):
        patcher = mock.patch.dict(sys.modules, {"torch": fake_torch()})
        patcher.start()
        self.addCleanup(patcher.stop)

    def norm_tensor(self, shape=None):
        return FakeTensor(shape or self.norm.shape, FakeStorage(ptr=3, offset=0),
                          dtype={"BF16": "bfloat16", "F32": "float32"}[self.norm.dtype])

    def answer(self, named, version="ipc-1"):
        with self.assertRaises(RolloutError) as cm:
            self.client.update_weights_from_ipc(named, version=version)
        return cm.exception

    def test_the_cpu_backend_refuses_with_failed_precondition(self):
        e = self.answer([(NORM, self.norm_tensor())])
        self.assertEqual(e.code, "FAILED_PRECONDITION")
        self.assertIn("the cpu backend cannot read CUDA IPC handles", e.message)

        async def main():
            async with rollout_client.aio.RolloutClient(self.server.target) as c:
                with self.assertRaises(RolloutError) as cm:
                    await c.update_weights_from_ipc([(NORM, self.norm_tensor())], version="a")
                return cm.exception
        self.assertEqual(asyncio.run(main()).code, "FAILED_PRECONDITION")
        self.assertEqual(self.client.server_info().weight_version, "0")

    def test_malformed_tensors_are_invalid_argument_naming_them(self):
        e = self.answer([("model.nope.weight", self.norm_tensor())])
        self.assertEqual(e.code, "INVALID_ARGUMENT")
        self.assertIn("'model.nope.weight' is not a weight of the served model", e.message)
        e = self.answer([(NORM, self.norm_tensor(shape=(3,)))])
        self.assertEqual(e.code, "INVALID_ARGUMENT")
        self.assertIn("shape [3] given", e.message)
        short = IpcTensor(NORM, self.norm.dtype, tuple(self.norm.shape), HANDLE[:63], 0, UUID)
        e = self.answer([(NORM, short)])
        self.assertEqual(e.code, "INVALID_ARGUMENT")
        self.assertIn("ipc_handle has 63 bytes", e.message)
        self.assertEqual(self.client.server_info().weight_version, "0")


if __name__ == "__main__":
    unittest.main()
