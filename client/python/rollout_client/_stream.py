"""The UpdateWeights request stream, converted once and sent to one or many servers.

Tensors are converted in buckets of about `bucket_bytes` on a background thread while the
previous bucket is on the wire, and each TensorData chunk is encoded to its wire bytes once
(the protobuf encoding written directly: one copy of the tensor bytes per chunk, instead of a
message copy, a serialization copy and a slice copy). A torch tensor on a GPU reaches the host
through one pinned buffer, in one device-to-host copy per bucket rather than one synchronous
copy per tensor. Every consumer (one per server) reads the same
encoded chunks; a bucket is dropped once every consumer has passed it, and the converter stays
at most `buckets_ahead` buckets ahead of the slowest one, so memory stays bounded.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from .weights import PreparedTensor

# -- the wire encoding of one WeightsChunk{data: TensorData{name, offset, data}} ---------------
# rollout.proto: WeightsChunk.data = 2; TensorData.name = 1, offset = 2, data = 3.


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(number: int, length: int) -> bytes:
    return _varint((number << 3) | 2) + _varint(length)


def encode_data_chunk(name: bytes, offset: int, data: memoryview) -> bytes:
    """The serialized WeightsChunk carrying `data` at `offset` of tensor `name`: what
    pb2.WeightsChunk(data=pb2.TensorData(name=..., offset=..., data=...)).SerializeToString()
    gives (fields in number order, a zero offset left out as proto3 does)."""
    inner_head = _len_field(1, len(name)) + name
    if offset:
        inner_head += _varint((2 << 3) | 0) + _varint(offset)
    inner_head += _len_field(3, data.nbytes)
    outer = _len_field(2, len(inner_head) + data.nbytes)
    return b"".join((outer, inner_head, data))


# -- buckets ------------------------------------------------------------------------------------


def _cuda_tensor(value: Any) -> bool:
    return (type(value).__module__.startswith("torch") and hasattr(value, "is_cuda")
            and bool(value.is_cuda))


def _torch_device_bytes(t, target: Optional[str]):
    """The tensor converted to `target` on its own device, as a flat uint8 view."""
    import torch
    names = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    t = t.detach()
    if t.dtype == torch.float64:
        t = t.to(torch.float32)
    if target is not None:
        t = t.to(names[target])
    return t.contiguous().reshape(-1).view(torch.uint8)


class _Bucket:
    __slots__ = ("chunks", "nbytes")

    def __init__(self):
        self.chunks: List[bytes] = []
        self.nbytes = 0


def _buckets(tensors: Sequence[PreparedTensor], bucket_bytes: int, chunk_bytes: int
             ) -> Iterator[_Bucket]:
    """Encoded chunks, grouped in buckets of about bucket_bytes of tensor data. A tensor larger
    than a bucket spans several; a chunk never crosses two tensors."""
    # One pinned host buffer for GPU tensors' bytes: encoding a chunk copies its bytes out, so
    # the buffer is free again once a bucket is encoded.
    pinned = None
    bucket = _Bucket()
    # GPU pieces of the current bucket: (name, offset, device view) copied in one go.
    pending: List[Tuple[bytes, int, Any]] = []
    pending_bytes = 0

    def flush_pending():
        nonlocal pending, pending_bytes, pinned
        if not pending:
            return
        import torch
        if pinned is None:
            pinned = torch.empty(bucket_bytes, dtype=torch.uint8, pin_memory=True)
        host = pinned
        at = 0
        for _, _, view in pending:
            host[at:at + view.numel()].copy_(view, non_blocking=True)
            at += view.numel()
        torch.cuda.current_stream(pending[0][2].device).synchronize()
        mv = memoryview(host.numpy())
        at = 0
        for name, offset, view in pending:
            n = view.numel()
            for o in range(0, n, chunk_bytes):
                m = min(chunk_bytes, n - o)
                bucket.chunks.append(encode_data_chunk(name, offset + o, mv[at + o:at + o + m]))
            at += n
        pending, pending_bytes = [], 0

    def close_bucket():
        nonlocal bucket
        flush_pending()
        done, bucket = bucket, _Bucket()
        return done

    for t in tensors:
        name = t.name.encode()
        if _cuda_tensor(t._value):
            view = _torch_device_bytes(t._value, t._target)
            if view.numel() != t.nbytes:
                raise RuntimeError(f"tensor '{t.name}' changed while being sent")
            done_bytes = 0
            while done_bytes < t.nbytes:
                room = bucket_bytes - bucket.nbytes
                n = min(room, t.nbytes - done_bytes)
                pending.append((name, done_bytes, view[done_bytes:done_bytes + n]))
                pending_bytes += n
                bucket.nbytes += n
                done_bytes += n
                if bucket.nbytes >= bucket_bytes:
                    yield close_bucket()
            continue
        data = t.payload()
        for o in range(0, data.nbytes, chunk_bytes):
            bucket.chunks.append(encode_data_chunk(name, o, data[o:o + chunk_bytes]))
        bucket.nbytes += data.nbytes
        del data
        if bucket.nbytes >= bucket_bytes:
            yield close_bucket()
    last = close_bucket()
    if last.chunks:
        yield last


class SharedStream:
    """The encoded UpdateWeights stream for `consumers` servers: `messages(i)` is consumer i's
    iterator (the header, then every chunk). Conversion runs on one background thread, started
    by the first consumer; a conversion error is raised in every consumer."""

    def __init__(self, header: bytes, tensors: Sequence[PreparedTensor], *, consumers: int,
                 bucket_bytes: int, chunk_bytes: int, buckets_ahead: int = 2):
        if bucket_bytes <= 0:
            raise ValueError("update_weights: bucket_bytes must be > 0")
        self._header = header
        self._tensors = tensors
        self._bucket_bytes = bucket_bytes
        self._chunk_bytes = chunk_bytes
        self._ahead = max(1, buckets_ahead)
        self._cond = threading.Condition()
        self._buckets: dict = {}        # index -> _Bucket, those some consumer still needs
        self._produced = 0              # buckets converted so far
        self._finished = False
        self._error: Optional[BaseException] = None
        self._position = [0] * consumers  # next bucket index of each consumer
        self._active = [True] * consumers
        self._thread: Optional[threading.Thread] = None
        self.bytes_total = sum(t.nbytes for t in tensors)

    def _start(self):
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._produce, daemon=True,
                                                name="rollout-weights-convert")
                self._thread.start()

    def _slowest(self) -> int:
        live = [p for p, a in zip(self._position, self._active) if a]
        return min(live) if live else self._produced

    def _produce(self):
        try:
            for bucket in _buckets(self._tensors, self._bucket_bytes, self._chunk_bytes):
                with self._cond:
                    while (self._produced - self._slowest() >= self._ahead
                           and any(self._active)):
                        self._cond.wait()
                    if not any(self._active):
                        return
                    self._buckets[self._produced] = bucket
                    self._produced += 1
                    self._cond.notify_all()
        except BaseException as e:  # surfaced in the consumers
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _release(self):
        """Drops the buckets every active consumer has passed (caller holds the lock)."""
        slowest = self._slowest()
        for k in [k for k in self._buckets if k < slowest]:
            del self._buckets[k]
        self._cond.notify_all()

    def stop(self, i: int) -> None:
        """Consumer i is done (finished or failed): it no longer holds buckets back."""
        with self._cond:
            self._active[i] = False
            self._release()

    def messages(self, i: int) -> Iterator[bytes]:
        self._start()
        try:
            yield self._header
            while True:
                with self._cond:
                    k = self._position[i]
                    while (k >= self._produced and not self._finished and self._error is None
                           and self._active[i]):
                        self._cond.wait()
                    # Stopped: its call has ended (gRPC may still ask its request thread for
                    # one more message) and the buckets it had not reached may be dropped.
                    if not self._active[i]:
                        return
                    if self._error is not None:
                        raise self._error
                    if k >= self._produced:
                        return
                    bucket = self._buckets[k]
                for chunk in bucket.chunks:
                    yield chunk
                with self._cond:
                    self._position[i] = k + 1
                    self._release()
        finally:
            self.stop(i)
