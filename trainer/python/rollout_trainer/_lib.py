"""ctypes binding of librollout_trainer_ops.so: the CPU backend's kernels (trainer/trainer_ops.cc).

Found at $ROLLOUT_TRAINER_OPS, else beside this package, else in <repo>/build/lib.
"""

from __future__ import annotations

import ctypes
from typing import Optional

from ._libpath import find_library

_NAME = "librollout_trainer_ops.so"
_lib: Optional[ctypes.CDLL] = None

_f = ctypes.c_float
_i64 = ctypes.c_int64
_i32 = ctypes.c_int32
_p = ctypes.c_void_p


def lib() -> ctypes.CDLL:
    """The loaded library (loaded on first use). OSError naming where it looked otherwise."""
    global _lib
    if _lib is not None:
        return _lib
    l = ctypes.CDLL(find_library(
        _NAME, "ROLLOUT_TRAINER_OPS",
        "build the target rollout_trainer_ops (cmake --build build --target rollout_trainer_ops)"))
    l.rt_kernels_version.restype = ctypes.c_char_p
    l.rt_kernels_version.argtypes = []
    l.rt_matmul.argtypes = [_p, _i64, _i64, _p, _i64, _p, _p]
    l.rt_segmented_matmul.argtypes = [_p, _i64, _i64, _p, _i64, _p, _p]
    l.rt_rms_norm.argtypes = [_p, _p, _i64, _i64, _f, _p]
    l.rt_rope_cos_sin.argtypes = [_f, _i64, _p, _i64, _p, _p]
    l.rt_apply_rope.argtypes = [_p, _p, _p, _i64, _i64, _i64]
    l.rt_silu_mul.argtypes = [_p, _i64, _i64, _p]
    l.rt_add.argtypes = [_p, _p, _i64]
    l.rt_attention.argtypes = [_p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _f, _p]
    l.rt_log_softmax.argtypes = [_p, _i64, _i32, _f, _p]
    for name in ("rt_matmul", "rt_segmented_matmul", "rt_rms_norm", "rt_rope_cos_sin",
                 "rt_apply_rope", "rt_silu_mul", "rt_add", "rt_attention", "rt_log_softmax"):
        getattr(l, name).restype = None
    # --- MoE ---
    l.rt_moe_route.argtypes = [_p, _i64, _i32, _i32, _i32, _p, _p, _p, _p]
    l.rt_moe_combine.argtypes = [_p, _p, _i64, _i32, _i64, _p]
    l.rt_moe_route.restype = l.rt_moe_combine.restype = None
    _lib = l
    return l


def kernels_version() -> str:
    """The kernels' build id and version, as ServerInfo.numerics.kernels reports it."""
    return lib().rt_kernels_version().decode()
