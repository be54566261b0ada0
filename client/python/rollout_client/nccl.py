"""A small ctypes binding of the NCCL that the trainer's environment ships (PyTorch's wheels bring
nvidia-nccl: site-packages/nvidia/nccl/lib/libnccl.so.2), for the source rank of a weight-sync
group (rollout_client.broadcast.WeightBroadcaster).

torch.distributed cannot take part: its NCCL groups are made through its own rendezvous, while
the servers join with a raw ncclUniqueId. So this binds the few calls the source needs, with the
same discipline as the server (runner/cuda/weight_sync_member.cc): the communicator is
non-blocking (ncclCommInitRankConfig, blocking = 0), every call is polled with
ncclCommGetAsyncError until done, a deadline passes (then ncclCommAbort) or the caller gives up.
Nothing here waits forever. Device work is ordered and waited for by the caller (CUDA events of
its streams); this module only talks to NCCL, and imports nothing beyond the standard library.
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Callable, Optional

UNIQUE_ID_BYTES = 128
SUCCESS = 0
IN_PROGRESS = 7
UINT8 = 1
_CONFIG_UNDEF_INT = -2 ** 31


class NcclError(RuntimeError):
    """An NCCL call failed, or a wait for one timed out (`timed_out`) or was given up."""

    def __init__(self, message: str, timed_out: bool = False, cancelled: bool = False):
        super().__init__(message)
        self.timed_out = timed_out
        self.cancelled = cancelled


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


class _Config(ctypes.Structure):
    """ncclConfig_t as NCCL 2.17 laid it out; later NCCLs read `size` bytes and default the
    rest (NCCL_CONFIG_INITIALIZER: magic 0xcafebeef, every field NCCL_CONFIG_UNDEF_INT)."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cga_cluster_size", ctypes.c_int),
                ("min_ctas", ctypes.c_int), ("max_ctas", ctypes.c_int),
                ("net_name", ctypes.c_char_p), ("split_share", ctypes.c_int)]


def library_path(path: Optional[str] = None) -> str:
    """Which libnccl to load: `path`, else $ROLLOUT_NCCL_LIBRARY, else the nvidia-nccl wheel's
    (what torch loads), else libnccl.so.2 on the loader's search path."""
    if path:
        return path
    if os.environ.get("ROLLOUT_NCCL_LIBRARY"):
        return os.environ["ROLLOUT_NCCL_LIBRARY"]
    try:
        import nvidia.nccl  # the wheel torch depends on
        for root in nvidia.nccl.__path__:
            candidate = os.path.join(root, "lib", "libnccl.so.2")
            if os.path.exists(candidate):
                return candidate
    except ImportError:
        pass
    return "libnccl.so.2"


class Nccl:
    """The loaded library. Loading by the soname torch loaded returns torch's copy."""

    def __init__(self, path: Optional[str] = None):
        self.path = library_path(path)
        try:
            lib = ctypes.CDLL(self.path)
        except OSError as e:
            raise NcclError(f"cannot load NCCL ({self.path}): {e}; pip install nvidia-nccl-cu12 "
                            "(torch brings it), or name the library with nccl_library= or "
                            "$ROLLOUT_NCCL_LIBRARY") from None
        for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig",
                     "ncclCommGetAsyncError", "ncclCommAbort", "ncclBroadcast", "ncclAllGather",
                     "ncclGetErrorString"):
            if not hasattr(lib, name):
                raise NcclError(f"{self.path} lacks {name}: weight-sync groups need NCCL >= 2.14")
        p = ctypes.c_void_p
        lib.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.ncclGetUniqueId.argtypes = [ctypes.POINTER(_UniqueId)]
        lib.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(p), ctypes.c_int, _UniqueId,
                                               ctypes.c_int, ctypes.POINTER(_Config)]
        lib.ncclCommGetAsyncError.argtypes = [p, ctypes.POINTER(ctypes.c_int)]
        lib.ncclCommAbort.argtypes = [p]
        lib.ncclBroadcast.argtypes = [p, p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, p, p]
        lib.ncclAllGather.argtypes = [p, p, ctypes.c_size_t, ctypes.c_int, p, p]
        lib.ncclGetErrorString.argtypes = [ctypes.c_int]
        lib.ncclGetErrorString.restype = ctypes.c_char_p
        for name in ("ncclGetVersion", "ncclGetUniqueId", "ncclCommInitRankConfig",
                     "ncclCommGetAsyncError", "ncclCommAbort", "ncclBroadcast", "ncclAllGather"):
            getattr(lib, name).restype = ctypes.c_int
        self.lib = lib

    def describe(self, result: int) -> str:
        text = self.lib.ncclGetErrorString(result)
        return f"NCCL error {result} ({text.decode() if text else '?'})"

    def check(self, result: int, what: str) -> None:
        if result != SUCCESS:
            raise NcclError(f"{what}: {self.describe(result)}")

    def version(self) -> int:
        v = ctypes.c_int()
        self.check(self.lib.ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
        return v.value

    def unique_id(self) -> bytes:
        """A new ncclUniqueId (128 bytes): its bootstrap root listens in this process, so the
        group can form only while it runs."""
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES))


GiveUp = Optional[Callable[[], bool]]


class Communicator:
    """One rank of a non-blocking communicator on the current CUDA device (the caller sets it,
    e.g. torch.cuda.set_device, before creating it). Not thread-safe: one thread drives it."""

    def __init__(self, nccl: Nccl, world_size: int, unique_id: bytes, rank: int,
                 timeout: float, give_up: GiveUp = None):
        if len(unique_id) != UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id has {len(unique_id)} bytes; an ncclUniqueId has 128")
        self.nccl = nccl
        self.world_size = world_size
        self.rank = rank
        self._comm = ctypes.c_void_p()
        uid = _UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, UNIQUE_ID_BYTES)
        config = _Config(ctypes.sizeof(_Config), 0xcafebeef, 21700, 0, _CONFIG_UNDEF_INT,
                         _CONFIG_UNDEF_INT, _CONFIG_UNDEF_INT, None, _CONFIG_UNDEF_INT)
        r = nccl.lib.ncclCommInitRankConfig(ctypes.byref(self._comm), world_size, uid, rank,
                                            ctypes.byref(config))
        if r not in (SUCCESS, IN_PROGRESS):
            self.abort()
            raise NcclError(f"ncclCommInitRankConfig (rank {rank} of {world_size}): "
                            f"{nccl.describe(r)}")
        self.wait(f"joining the weight-sync group as rank {rank} of {world_size}", timeout,
                  give_up=give_up)

    @property
    def broken(self) -> bool:
        return not self._comm.value

    def abort(self) -> None:
        """Aborts the communicator (local; kernels waiting for a peer stop). Idempotent."""
        if self._comm.value:
            self.nccl.lib.ncclCommAbort(self._comm)
            self._comm = ctypes.c_void_p()

    def wait(self, what: str, timeout: float, done: Optional[Callable[[], bool]] = None,
             give_up: GiveUp = None) -> None:
        """Polls until NCCL's last call is done and, with `done` (e.g. a CUDA event's query),
        until it answers True. NcclError (the communicator aborted) on an NCCL error, after
        `timeout` seconds, or once `give_up` answers True."""
        if self.broken:
            raise NcclError(f"{what}: the communicator was aborted")
        deadline = time.monotonic() + timeout
        state = ctypes.c_int()
        polls = 0
        while True:
            r = self.nccl.lib.ncclCommGetAsyncError(self._comm, ctypes.byref(state))
            if r != SUCCESS:
                self.abort()
                raise NcclError(f"{what}: ncclCommGetAsyncError: {self.nccl.describe(r)}")
            if state.value not in (SUCCESS, IN_PROGRESS):
                self.abort()
                raise NcclError(f"{what}: the group failed ({self.nccl.describe(state.value)}): "
                                "a rank left, failed or disagrees")
            if state.value == SUCCESS and (done is None or done()):
                return
            if give_up is not None and give_up():
                self.abort()
                raise NcclError(f"{what}: given up", cancelled=True)
            if time.monotonic() >= deadline:
                self.abort()
                raise NcclError(f"{what}: not done within {timeout:g} s", timed_out=True)
            polls += 1
            time.sleep(0 if polls < 2000 else 0.0002)

    def _enqueued(self, result: int, what: str, timeout: float) -> None:
        if result not in (SUCCESS, IN_PROGRESS):
            self.abort()
            raise NcclError(f"{what}: {self.nccl.describe(result)}")
        self.wait(what, timeout)  # a non-blocking call is enqueued once its state is success

    def broadcast(self, buffer_ptr: int, nbytes: int, root: int, stream_handle: int,
                  timeout: float) -> None:
        """Enqueues ncclBroadcast of `nbytes` at `buffer_ptr` (in place) from `root` on the CUDA
        stream `stream_handle`; returns once NCCL enqueued it (wait for the stream after)."""
        r = self.nccl.lib.ncclBroadcast(ctypes.c_void_p(buffer_ptr), ctypes.c_void_p(buffer_ptr),
                                        nbytes, UINT8, root, self._comm,
                                        ctypes.c_void_p(stream_handle))
        self._enqueued(r, "ncclBroadcast", timeout)

    def all_gather(self, send_ptr: int, recv_ptr: int, nbytes: int, stream_handle: int,
                   timeout: float) -> None:
        """Enqueues ncclAllGather of `nbytes` per rank (device memory) on `stream_handle`."""
        r = self.nccl.lib.ncclAllGather(ctypes.c_void_p(send_ptr), ctypes.c_void_p(recv_ptr),
                                        nbytes, UINT8, self._comm, ctypes.c_void_p(stream_handle))
        self._enqueued(r, "ncclAllGather", timeout)
