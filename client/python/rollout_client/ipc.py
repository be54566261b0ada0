"""CUDA IPC exports of torch tensors, for UpdateWeightsFromIpc (a trainer on the server's GPU).

The server opens each tensor's allocation by its CUDA IPC handle and copies the bytes device
to device, so nothing crosses the host. What a tensor must be: on a CUDA device (the server's),
contiguous, bfloat16 / float16 / float32 as the served tensor is (no conversion happens here),
allocated by torch's caching allocator without expandable segments. It must stay alive and
unchanged until the call returns.

This module imports only the standard library (torch lazily, when tensors are exported), so a
script without grpcio can load it by path to write rollout-cli's JSON file of handles
(tests/gpu/ipc_trainer.py does).

torch's ``untyped_storage()._share_cuda_()`` returns (device, handle, storage size, storage
offset in its allocation, ref-counter file, ref-counter offset, event handle, event sync
required). Since torch 2.3 the handle is a version byte, a type byte ('c': a cudaMalloc block,
'e': an expandable segment) and then, for 'c', the 64-byte cudaIpcMemHandle_t; before, the bare
64 bytes. A tensor's byte offset in the allocation is the storage's plus storage_offset() *
element_size(). Sharing also takes one count on torch's producer-side reference counter of the
storage (which keeps a freed storage's memory until every consumer let go); ``release()`` gives
it back once the server answered, as a torch consumer would when it drops the tensor.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Tuple, Union

CUDA_IPC_HANDLE_BYTES = 64
_HANDLE_TYPE_CUDA_MALLOC = ord("c")
_HANDLE_TYPE_EXPANDABLE = ord("e")
_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


@dataclass(frozen=True)
class IpcTensor:
    """One tensor as UpdateWeightsFromIpc names it (proto rollout.v1.IpcTensor)."""
    name: str
    dtype: str                  # "BF16", "F16" or "F32"
    shape: Tuple[int, ...]
    ipc_handle: bytes           # the 64-byte cudaIpcMemHandle_t of its allocation
    offset_bytes: int           # of its first byte in that allocation
    device_uuid: str            # the GPU's, e.g. "58b3d0b5-1c4e-..." (torch's str of the uuid)

    @property
    def nbytes(self) -> int:
        n = 4 if self.dtype == "F32" else 2
        for d in self.shape:
            n *= d
        return n


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"update_weights_from_ipc needs torch, to export CUDA tensors ({e}); "
                          "pip install torch, or send host tensors with update_weights") from None
    return torch


def cuda_ipc_handle(name: str, handle: bytes) -> bytes:
    """The 64-byte cudaIpcMemHandle_t in what _share_cuda_() returned as the handle."""
    handle = bytes(handle)
    if len(handle) == CUDA_IPC_HANDLE_BYTES:
        return handle  # torch before 2.3: the bare handle
    if len(handle) == CUDA_IPC_HANDLE_BYTES + 2 and handle[1] == _HANDLE_TYPE_CUDA_MALLOC:
        return handle[2:]
    if len(handle) >= 2 and handle[1] == _HANDLE_TYPE_EXPANDABLE:
        raise ValueError(f"tensor '{name}' lives in an expandable segment, which has no CUDA IPC "
                         "handle; allocate the tensors with "
                         "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False")
    raise ValueError(f"tensor '{name}': torch's IPC handle of {len(handle)} bytes has an unknown "
                     f"layout (starts {handle[:2].hex()}); expected 64 bytes, or a version byte, "
                     "'c' and 64 bytes")


class IpcExport:
    """The exports of one update: `tensors` (IpcTensor, in the order given) and the torch
    shares behind them, one per distinct storage. Use as a context manager, or call release()
    once the server answered; the caller keeps the tensors alive until then."""

    def __init__(self, tensors: List[IpcTensor], shares: List[Tuple[Any, tuple]]):
        self.tensors = tensors
        self._shares = shares

    def release(self) -> None:
        """Gives back the count each share took on torch's producer-side reference counter
        (otherwise torch keeps a shared storage's memory after it is freed)."""
        shares, self._shares = self._shares, []
        for storage, share in shares:
            release = getattr(type(storage), "_release_ipc_counter_cuda", None)
            if release is not None and share[4]:
                release(share[4], share[5])

    def __enter__(self) -> "IpcExport":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def to_json(self) -> str:
        """rollout-cli update-weights-from-ipc's --ipc_tensors file (proto3 JSON)."""
        return tensors_json(self.tensors)


def export_tensors(named_tensors: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]]
                   ) -> IpcExport:
    """CUDA IPC exports of (name, tensor) pairs: torch tensors, or IpcTensor values exported by
    other means (sent as they are, under the pair's name). Waits for the torch tensors' devices
    first (torch.cuda.synchronize), so that the bytes the server reads are the ones written. A
    tensor that is not a contiguous CUDA tensor of a served dtype raises ValueError naming it;
    torch is imported only when a torch tensor is given."""
    pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    if not pairs:
        raise ValueError("update_weights_from_ipc: no tensors")
    if all(isinstance(t, IpcTensor) for _, t in pairs):
        return IpcExport([_renamed(t, name) for name, t in pairs], [])
    torch = _torch()
    uuids: Dict[int, str] = {}
    for name, t in pairs:
        if isinstance(t, IpcTensor):
            continue
        device = getattr(t, "device", None)
        if getattr(device, "type", None) != "cuda":
            raise ValueError(f"tensor '{name}' is on {device}, not a CUDA device: IPC exports "
                             "device memory (use update_weights for host tensors)")
        if not t.is_contiguous():
            raise ValueError(f"tensor '{name}' is not contiguous; pass t.contiguous() (and keep "
                             "that copy alive until the call returns)")
        if str(t.dtype) not in _DTYPES:
            raise ValueError(f"tensor '{name}': dtype {t.dtype} cannot be served; convert it to "
                             "the served dtype (bfloat16, float16 or float32) first")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in uuids:
            uuids[index] = str(torch.cuda.get_device_properties(index).uuid)
    for index in uuids:
        torch.cuda.synchronize(index)
    tensors: List[IpcTensor] = []
    shares: List[Tuple[Any, tuple]] = []
    by_storage: Dict[Tuple[int, int], tuple] = {}
    try:
        for name, t in pairs:
            if isinstance(t, IpcTensor):
                tensors.append(_renamed(t, name))
                continue
            storage = t.untyped_storage()
            index = t.device.index if t.device.index is not None else torch.cuda.current_device()
            key = (index, storage.data_ptr())
            share = by_storage.get(key)
            if share is None:
                share = tuple(storage._share_cuda_())
                by_storage[key] = share
                shares.append((storage, share))
            tensors.append(IpcTensor(
                name=str(name), dtype=_DTYPES[str(t.dtype)],
                shape=tuple(int(d) for d in t.shape),
                ipc_handle=cuda_ipc_handle(str(name), share[1]),
                offset_bytes=int(share[3]) + int(t.storage_offset()) * int(t.element_size()),
                device_uuid=uuids[index]))
    except BaseException:
        IpcExport([], shares).release()
        raise
    return IpcExport(tensors, shares)


def _renamed(t: IpcTensor, name: Any) -> IpcTensor:
    return t if t.name == str(name) else IpcTensor(str(name), t.dtype, t.shape, t.ipc_handle,
                                                   t.offset_bytes, t.device_uuid)


def tensors_json(tensors: Iterable[IpcTensor]) -> str:
    """The tensors as an UpdateWeightsFromIpcRequest's `tensors` in proto3 JSON (the handle in
    base64), as rollout-cli update-weights-from-ipc reads them."""
    return json.dumps({"tensors": [{
        "name": t.name, "dtype": t.dtype, "shape": list(t.shape),
        "ipc_handle": base64.b64encode(t.ipc_handle).decode("ascii"),
        "offset_bytes": t.offset_bytes, "device_uuid": t.device_uuid} for t in tensors]})


def request_fields(t: IpcTensor) -> Dict[str, Any]:
    """Keyword arguments of the proto IpcTensor."""
    return {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "ipc_handle": t.ipc_handle,
            "offset_bytes": t.offset_bytes, "device_uuid": t.device_uuid}


__all__ = ["IpcTensor", "IpcExport", "export_tensors", "tensors_json", "cuda_ipc_handle",
           "CUDA_IPC_HANDLE_BYTES"]
