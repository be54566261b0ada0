"""WeightBroadcaster: a trainer's weights to many rollout servers at once, by NCCL broadcast from
its GPU (no copy to the host; docs/api.md, "Weights by NCCL broadcast").

    from rollout_client import WeightBroadcaster

    with WeightBroadcaster(["10.0.0.1:50051", "10.0.0.2:50051"], device="cuda:0",
                           token=TOKEN) as fleet:           # the servers join an NCCL group
        for step in range(steps):
            train(model)
            results = fleet.broadcast(model.state_dict().items(), version=f"step-{step}")
            print([round(r.bytes_per_second / 1e9, 1) for r in results], "GB/s")

The trainer is rank 0 of a group of 1 + len(servers) ranks; server i is rank i + 1. Each
broadcast calls UpdateWeightsFromBroadcast on every server (concurrently), takes part in the
group's handshake (every rank all-gathers a 64-byte record, so a server that refuses stops the
whole broadcast before a bucket is sent, and the group survives), then broadcasts the tensors
bucket by bucket as rollout_client.broadcast_plan lays them out: a bucket inside one tensor goes
from the tensor's own memory, one that holds several is packed into one of two device buffers on
a second stream while the previous bucket is sent. Each server swaps its weights in atomically
once every byte arrived and its digest is known, under the policy.

torch (and the libnccl it ships) is imported only when a broadcaster is made; the layout, the
handshake and the requests are pure (and tested without either).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

from . import _wire, broadcast_plan
from .broadcast_plan import BroadcastPlan, TensorSpec
from .datatypes import RolloutError, UpdateWeightsResult, WeightSyncGroup

__all__ = ["WeightBroadcaster", "BroadcastError", "TorchNcclTransport"]

_TORCH_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"WeightBroadcaster needs torch and a CUDA device ({e}); pip install "
                          "torch, or send host tensors with RolloutClient.update_weights / "
                          "Fleet.update_weights") from None
    return torch


class BroadcastError(RolloutError):
    """A broadcast (or the group's join) failed on some ranks. `results[i]` / `errors[i]` are
    server i's (None where it failed / succeeded), `trainer_error` the source's own failure
    (an NCCL error or timeout: the group is then aborted on this side), `targets[i]` server i's
    address."""

    def __init__(self, what: str, targets: Sequence[str], results: List[Any],
                 errors: List[Optional[BaseException]], trainer_error: Optional[BaseException]):
        failed = [(t, e) for t, e in zip(targets, errors) if e is not None]
        parts = [f"{t}: {e}" for t, e in failed]
        if trainer_error is not None:
            parts.insert(0, f"trainer: {trainer_error}")
        first = failed[0][1] if failed else trainer_error
        code = first.code if isinstance(first, RolloutError) else type(first).__name__
        ok = [t for t, e in zip(targets, errors) if e is None]
        message = f"{what}: " + "; ".join(parts)
        if ok:
            message += f" (succeeded: {', '.join(ok)})"
        super().__init__(code, message)
        self.targets = list(targets)
        self.results = results
        self.errors = errors
        self.trainer_error = trainer_error


class TorchNcclTransport:
    """The source rank's device side: torch CUDA tensors, the libnccl torch ships (rollout_client
    .nccl), two streams. Built by WeightBroadcaster; a test may pass another object with the
    same methods (unique_id, join, describe, handshake, send, close)."""

    def __init__(self, device: Any = None, nccl_library: Optional[str] = None):
        torch = _torch()
        from . import nccl
        self._torch = torch
        self._nccl_module = nccl
        if not torch.cuda.is_available():
            raise RuntimeError("WeightBroadcaster: torch sees no CUDA device")
        self.device = torch.device(device if device is not None else
                                   f"cuda:{torch.cuda.current_device()}")
        if self.device.type != "cuda":
            raise ValueError(f"WeightBroadcaster: device {self.device} is not a CUDA device")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.nccl = nccl.Nccl(nccl_library)
        self.comm = None
        self._stream = self._copy_stream = None

    @property
    def nccl_version(self) -> int:
        return self.nccl.version()

    @property
    def broken(self) -> bool:
        return self.comm is None or self.comm.broken

    def unique_id(self) -> bytes:
        return self.nccl.unique_id()

    def join(self, unique_id: bytes, world_size: int, rank: int, timeout: float,
             give_up: Optional[Callable[[], bool]] = None) -> None:
        torch = self._torch
        with torch.cuda.device(self.device):
            self.comm = self._nccl_module.Communicator(self.nccl, world_size, unique_id, rank,
                                                       timeout, give_up)
            self._stream = torch.cuda.Stream(self.device)
            self._copy_stream = torch.cuda.Stream(self.device)

    def describe(self, name: str, tensor: Any) -> TensorSpec:
        """The tensor's spec; ValueError unless it is a CUDA tensor of this device in a served
        dtype (nothing is converted or moved: the bytes go as they are)."""
        dtype = _TORCH_DTYPES.get(str(getattr(tensor, "dtype", None)))
        if dtype is None:
            raise ValueError(f"tensor '{name}': dtype {getattr(tensor, 'dtype', type(tensor))} "
                             "is not bfloat16, float16 or float32 (convert it to the served "
                             "dtype first)")
        if not getattr(tensor, "is_cuda", False) or tensor.device != self.device:
            raise ValueError(f"tensor '{name}' is on {getattr(tensor, 'device', 'the host')}; "
                             f"the broadcaster's device is {self.device} (NCCL sends device "
                             "memory; nothing is copied through the host)")
        return TensorSpec(name, dtype, tuple(int(d) for d in tensor.shape))

    def _wait(self, event: Any, what: str, timeout: float) -> None:
        self.comm.wait(what, timeout, done=event.query)

    def handshake(self, record: bytes, timeout: float) -> bytes:
        torch = self._torch
        world = self.comm.world_size
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            send = torch.tensor(list(record), dtype=torch.uint8, device=self.device)
            recv = torch.empty(len(record) * world, dtype=torch.uint8, device=self.device)
            self.comm.all_gather(send.data_ptr(), recv.data_ptr(), len(record),
                                 self._stream.cuda_stream, timeout)
            done = torch.cuda.Event()
            done.record(self._stream)
            self._wait(done, "the handshake (ncclAllGather)", timeout)
            return bytes(recv.cpu().tolist())

    def send(self, plan: BroadcastPlan, tensors: Sequence[Any], timeout: float) -> None:
        """Broadcasts every bucket of `plan` (tensors[i] is plan.tensors[i]) from this rank; at
        most two buckets in flight, each waited for with `timeout`."""
        torch = self._torch
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream(self.device)
            # The tensors were written on the current stream: both streams start after it.
            self._stream.wait_stream(current)
            self._copy_stream.wait_stream(current)
            flat = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
            packing = [None, None]  # two device buffers, made when a bucket needs one
            sent: List[Any] = []    # each bucket's broadcast-done event
            for j, bucket in enumerate(plan.buckets):
                slices = bucket.slices
                if len(slices) == 1 and slices[0].size == bucket.size:
                    s = slices[0]
                    ptr = flat[s.tensor][s.tensor_offset:s.tensor_offset + s.size].data_ptr()
                else:
                    k = j % 2
                    if packing[k] is None:  # empty: no kernel the streams would race with
                        packing[k] = torch.empty(plan.bucket_bytes, dtype=torch.uint8,
                                                 device=self.device)
                    buf = packing[k]
                    with torch.cuda.stream(self._copy_stream):
                        if j >= 2:  # the buffer's last bucket must have left
                            self._copy_stream.wait_event(sent[j - 2])
                        for s in slices:
                            buf[s.bucket_offset:s.bucket_offset + s.size].copy_(
                                flat[s.tensor][s.tensor_offset:s.tensor_offset + s.size])
                        packed = torch.cuda.Event()
                        packed.record(self._copy_stream)
                    self._stream.wait_event(packed)
                    ptr = buf.data_ptr()
                self.comm.broadcast(ptr, bucket.size, self.comm.rank, self._stream.cuda_stream,
                                    timeout)
                done = torch.cuda.Event()
                done.record(self._stream)
                sent.append(done)
                if j >= 1:
                    self._wait(sent[j - 1], f"bucket {j - 1} of {len(plan.buckets)}", timeout)
            if sent:
                self._wait(sent[-1], f"bucket {len(sent) - 1} of {len(plan.buckets)}", timeout)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.abort()


class WeightBroadcaster:
    """The source rank of an NCCL weight-sync group of rollout servers (see the module doc).

    targets: server addresses (RolloutClients are made with token, tls_root_cert, options,
    tls_client_cert, tls_client_key) or RolloutClient objects. device: the CUDA device whose
    tensors are broadcast (default: the current one). timeout: seconds any wait may take (the
    join; each bucket). The constructor joins: it makes the unique id, calls
    JoinWeightSyncGroup on every server at once (they wait for each other) while it initializes
    its own communicator; BroadcastError says who failed, and the servers that joined are left
    again. close() (or the with block) leaves the group. One thread at a time.
    """

    def __init__(self, targets: Sequence[Any], device: Any = None, *, token: Optional[str] = None,
                 timeout: float = 60.0, nccl_library: Optional[str] = None,
                 tls_root_cert: _wire.PemSource = None,
                 options: Sequence[Tuple[str, Any]] = (), transport: Any = None,
                 tls_client_cert: _wire.PemSource = None, tls_client_key: _wire.PemSource = None):
        from .client import RolloutClient
        targets = list(targets)
        if not targets:
            raise ValueError("WeightBroadcaster: no servers given")
        self.clients = [t if hasattr(t, "join_weight_sync_group") else
                        RolloutClient(t, token, None, tls_root_cert, options,
                                      tls_client_cert=tls_client_cert,
                                      tls_client_key=tls_client_key) for t in targets]
        self.targets = [getattr(c, "target", str(c)) for c in self.clients]
        if len(set(self.targets)) != len(self.targets):
            raise ValueError("WeightBroadcaster: a server is listed twice")
        self.timeout = float(timeout)
        self.rank = 0
        self.world_size = 1 + len(self.clients)
        self.transport = transport if transport is not None else \
            TorchNcclTransport(device, nccl_library)
        self.groups: List[Optional[WeightSyncGroup]] = [None] * len(self.clients)
        unique_id = self.transport.unique_id()
        joined, errors = self._each(lambda i, c: c.join_weight_sync_group(
            unique_id, i + 1, self.world_size, group_timeout=self.timeout))
        trainer_error = None
        try:
            # While the servers' joins wait for this rank: the group forms when all arrived.
            self.transport.join(unique_id, self.world_size, self.rank, self.timeout,
                                give_up=lambda: self._failed_early(errors))
        except Exception as e:  # reported with the servers' errors below
            trainer_error = e
        results, errors = self._finish(joined, errors)
        self.groups = results
        if trainer_error is not None or any(e is not None for e in errors):
            self._leave([i for i, g in enumerate(results) if g is not None])
            self.transport.close()
            raise BroadcastError("joining the weight-sync group", self.targets, results, errors,
                                 trainer_error)

    # -- calls on every server at once --------------------------------------------------------

    def _each(self, call: Callable[[int, Any], Any]):
        """Starts call(i, client) on every server, each on its own thread; _finish waits."""
        results: List[Any] = [None] * len(self.clients)
        errors: List[Optional[BaseException]] = [None] * len(self.clients)

        def run(i: int) -> None:
            try:
                results[i] = call(i, self.clients[i])
            except BaseException as e:  # collected
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i,), daemon=True,
                                    name=f"rollout-broadcast-{i}") for i in range(len(self.clients))]
        for t in threads:
            t.start()
        return (threads, results), errors

    @staticmethod
    def _finish(started, errors):
        threads, results = started
        for t in threads:
            t.join()
        return results, errors

    @staticmethod
    def _failed_early(errors: List[Optional[BaseException]]) -> bool:
        """A server answered an error before the group formed: it will not join, stop waiting."""
        return any(e is not None for e in errors)

    def _leave(self, indices: Iterable[int]) -> None:
        for i in indices:
            try:
                self.clients[i].leave_weight_sync_group()
            except Exception:  # best effort: the server leaves on its own after a timeout
                pass

    # -- broadcasts ---------------------------------------------------------------------------

    def broadcast(self, named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
                  version: str, policy: Optional[str] = "drain", *,
                  bucket_bytes: int = _wire.DEFAULT_BUCKET_BYTES,
                  expected_weight_digest: Optional[str] = None, skip_tied: bool = True,
                  timeout: Optional[float] = None) -> List[UpdateWeightsResult]:
        """Broadcasts (name, tensor) pairs -- CUDA tensors of the broadcaster's device in the
        served dtype, e.g. model.state_dict().items() -- to every server, which swaps them in
        under `policy` ("drain", "abort", "continue"). Returns each server's result (its
        seconds and bytes_per_second as this trainer saw the call). bucket_bytes: a multiple of
        256 (default 256 MiB); expected_weight_digest: every server refuses (DATA_LOSS) unless
        its weights' digest after the update would be this; skip_tied: lm_head.weight is left
        out when the servers tie it to the embedding; timeout: per wait (default: the
        broadcaster's). BroadcastError when any rank failed: a server that refused at the
        handshake stops every one (nothing sent, the group intact); a timeout or an NCCL error
        aborts the group (each server leaves it: make a new WeightBroadcaster)."""
        if self.broken:
            raise RuntimeError("WeightBroadcaster: the group was aborted by an earlier failure; "
                               "make a new WeightBroadcaster (the servers left it)")
        wait = self.timeout if timeout is None else float(timeout)
        if skip_tied and self.clients[0].server_info().model.tie_word_embeddings:
            named_tensors = _wire.without_tied_lm_head(named_tensors)
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not pairs:
            raise ValueError("WeightBroadcaster.broadcast: no tensors")
        specs = [self.transport.describe(name, t) for name, t in pairs]
        plan = broadcast_plan.plan_broadcast(specs, bucket_bytes)
        # Checks the arguments before any server is asked.
        _wire.broadcast_request(specs, version, policy, bucket_bytes, self.rank, wait,
                                expected_weight_digest)
        started, errors = self._each(lambda i, c: c.update_weights_from_broadcast(
            specs, version, policy, bucket_bytes=bucket_bytes, source_rank=self.rank,
            broadcast_timeout=wait, expected_weight_digest=expected_weight_digest))
        trainer_error = None
        record = broadcast_plan.encode_handshake(broadcast_plan.ROLE_SOURCE, True, self.rank,
                                                 plan.total_bytes, plan.digest)
        try:
            gathered = self.transport.handshake(record, wait)
            # Every rank draws the same verdict; a refusal stops them all, each server says why.
            if broadcast_plan.handshake_verdict(gathered, self.world_size) is None:
                self.transport.send(plan, [t for _, t in pairs], wait)
        except Exception as e:
            trainer_error = e
        results, errors = self._finish(started, errors)
        if trainer_error is not None or any(e is not None for e in errors):
            raise BroadcastError(f"broadcasting '{version}'", self.targets, results, errors,
                                 trainer_error)
        return results

    @property
    def broken(self) -> bool:
        return getattr(self.transport, "broken", False)

    def close(self) -> None:
        """Leaves the group on every server and aborts this rank's communicator."""
        self._leave(range(len(self.clients)))
        self.transport.close()

    def __enter__(self) -> "WeightBroadcaster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
