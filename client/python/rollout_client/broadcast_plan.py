"""The layout of an NCCL weight broadcast (UpdateWeightsFromBroadcast), the trainer's side of one
pure function that the server computes too (engine/broadcast_plan.h); both are tested against
tests/testdata/broadcast_plan_golden.json.

The tensors are laid end to end, in broadcast order, into one byte stream, each starting at a
multiple of ALIGNMENT (gap bytes are padding: sent, never read), and the stream is cut into
buckets of bucket_bytes, the last one shorter: bucket j is stream bytes
[j * bucket_bytes, min((j + 1) * bucket_bytes, total_bytes)). A bucket's slices say which bytes
of which tensor go where in it.

Also the plan's digest (SHA-256 of its canonical text) and the 64-byte handshake record every
rank of the group all-gathers before the buckets, with the verdict all of them draw from it.
Standard library only: importable without grpcio, torch or NCCL.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

ALIGNMENT = 256
LEAF_BYTES = 1 << 16  # the weight digest's leaf (docs/api.md, "Weight digests")
HANDSHAKE_BYTES = 64
UNIQUE_ID_BYTES = 128  # an ncclUniqueId
ROLE_SOURCE = 1
ROLE_RECEIVER = 2
_MAGIC = b"RLBCAST1"
_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a broadcast, as the request declares it (proto rollout.v1.BroadcastTensor)."""
    name: str
    dtype: str                  # "BF16", "F16" or "F32"
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        if self.dtype not in _DTYPE_BYTES:
            raise ValueError(f"tensor '{self.name}': dtype '{self.dtype}' is not BF16, F16 or F32")
        n = _DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= int(d)
        return n


@dataclass(frozen=True)
class Slice:
    """Bytes [tensor_offset, tensor_offset + size) of tensors[tensor] at bucket_offset."""
    tensor: int
    tensor_offset: int
    bucket_offset: int
    size: int


@dataclass(frozen=True)
class Bucket:
    stream_offset: int
    size: int
    slices: Tuple[Slice, ...]


@dataclass(frozen=True)
class BroadcastPlan:
    tensors: Tuple[TensorSpec, ...]
    bucket_bytes: int
    offsets: Tuple[int, ...]     # where each tensor starts in the stream
    total_bytes: int             # up to the last tensor's last byte
    payload_bytes: int           # the tensors' bytes, without padding
    buckets: Tuple[Bucket, ...]
    digest: bytes = field(repr=False)  # SHA-256 of plan_text(tensors, bucket_bytes)


def plan_text(tensors: Sequence[TensorSpec], bucket_bytes: int) -> str:
    lines = ["rollout.broadcast.v1", f"bucket_bytes {bucket_bytes}", f"alignment {ALIGNMENT}"]
    for t in tensors:
        lines.append(f"tensor {t.name} {t.dtype} {','.join(str(int(d)) for d in t.shape)}")
    return "\n".join(lines) + "\n"


def plan_broadcast(tensors: Sequence[TensorSpec], bucket_bytes: int) -> BroadcastPlan:
    """The plan of `tensors` (in broadcast order) in buckets of `bucket_bytes` (> 0)."""
    tensors = tuple(tensors)
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes = {bucket_bytes!r}; it must be a positive int")
    offsets: List[int] = []
    end = 0
    for t in tensors:
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        offsets.append(offset)
        end = offset + t.nbytes
    total = end
    buckets: List[Bucket] = []
    first = 0
    for begin in range(0, total, bucket_bytes):
        size = min(bucket_bytes, total - begin)
        stop = begin + size
        slices: List[Slice] = []
        i = first
        while i < len(tensors) and offsets[i] < stop:
            t_begin, t_end = offsets[i], offsets[i] + tensors[i].nbytes
            if t_end <= begin:
                if i == first:
                    first += 1
            else:
                lo, hi = max(begin, t_begin), min(stop, t_end)
                slices.append(Slice(i, lo - t_begin, lo - begin, hi - lo))
            i += 1
        buckets.append(Bucket(begin, size, tuple(slices)))
    digest = hashlib.sha256(plan_text(tensors, bucket_bytes).encode()).digest()
    return BroadcastPlan(tensors, bucket_bytes, tuple(offsets), total,
                         sum(t.nbytes for t in tensors), tuple(buckets), digest)


def leaves_completed_by(plan: BroadcastPlan, bucket: int) -> Tuple[List[Tuple[int, int, int]],
                                                                    Tuple[int, int]]:
    """The digest leaves whose last byte is in `bucket`, as (tensor, first_leaf, num_leaves)
    runs, and the range [first, end) of tensors it completes (engine/broadcast_plan.h)."""
    runs = []
    for s in plan.buckets[bucket].slices:
        n = plan.tensors[s.tensor].nbytes
        num_leaves = -(-n // LEAF_BYTES)
        a, z = s.tensor_offset, s.tensor_offset + s.size - 1
        first_leaf = a // LEAF_BYTES
        end_leaf = num_leaves if z + 1 == n else (z + 1) // LEAF_BYTES
        if end_leaf > first_leaf:
            runs.append((s.tensor, first_leaf, end_leaf - first_leaf))

    def completed_by(b: int) -> int:
        if b + 1 == len(plan.buckets):
            return len(plan.tensors)
        reach = plan.buckets[b].stream_offset + plan.buckets[b].size
        count = 0
        while count < len(plan.tensors) and \
                plan.offsets[count] + plan.tensors[count].nbytes <= reach:
            count += 1
        return count

    first = 0 if bucket == 0 else completed_by(bucket - 1)
    return runs, (first, completed_by(bucket))


def encode_handshake(role: int, ready: bool, source_rank: int, total_bytes: int,
                     plan_digest: Optional[bytes]) -> bytes:
    """The 64-byte record a rank contributes to the handshake (engine/broadcast_plan.h)."""
    digest = (plan_digest or b"")[:32].ljust(32, b"\0")
    return (_MAGIC + bytes([role, 1 if ready else 0, 0, 0]) +
            struct.pack("<iQ", source_rank, total_bytes) + b"\0" * 8 + digest)


@dataclass(frozen=True)
class HandshakeRecord:
    role: int
    ready: bool
    source_rank: int
    total_bytes: int
    plan_digest: bytes


def decode_handshake(gathered: bytes, world_size: int) -> List[HandshakeRecord]:
    if len(gathered) != HANDSHAKE_BYTES * world_size:
        raise ValueError(f"the handshake gathered {len(gathered)} bytes; {world_size} ranks of "
                         f"{HANDSHAKE_BYTES} were expected")
    records = []
    for r in range(world_size):
        p = gathered[HANDSHAKE_BYTES * r: HANDSHAKE_BYTES * (r + 1)]
        if p[:8] != _MAGIC or p[8] not in (ROLE_SOURCE, ROLE_RECEIVER):
            raise ValueError(f"rank {r}'s handshake record is not one (it starts {p[:8].hex()})")
        source_rank, total = struct.unpack("<iQ", p[12:24])
        records.append(HandshakeRecord(p[8], p[9] != 0, source_rank, total, bytes(p[32:64])))
    return records


def handshake_verdict(gathered: bytes, world_size: int) -> Optional[str]:
    """None when the update goes ahead (exactly one source, every other rank a ready receiver
    expecting it with the source's plan digest), else why not. Every rank draws the same
    verdict from the same bytes (engine/broadcast_plan.h's HandshakeVerdict)."""
    try:
        records = decode_handshake(gathered, world_size)
    except ValueError as e:
        return str(e)
    sources = [r for r, rec in enumerate(records) if rec.role == ROLE_SOURCE]
    if len(sources) != 1:
        return f"{len(sources)} ranks broadcast ({sources}); exactly one, the trainer's, must"
    refused = [r for r, rec in enumerate(records) if rec.role == ROLE_RECEIVER and not rec.ready]
    if refused:
        return f"rank(s) {refused} refused this update (their answers say why)"
    src = records[sources[0]]
    for r, rec in enumerate(records):
        if r == sources[0]:
            continue
        if rec.source_rank != sources[0]:
            return f"rank {r} expects rank {rec.source_rank} to broadcast, but rank " \
                   f"{sources[0]} does"
        if rec.plan_digest != src.plan_digest:
            return f"rank {r}'s broadcast plan ({rec.plan_digest.hex()[:16]}..., " \
                   f"{rec.total_bytes} bytes) differs from the source's " \
                   f"({src.plan_digest.hex()[:16]}..., {src.total_bytes} bytes)"
    return None
