"""Tensor -> bytes conversion for UpdateWeights.

Accepted tensor values (the `v` of each `(name, v)` pair):
  * torch.Tensor (torch is used only if the caller passes one; it is never imported otherwise):
    any of bfloat16 / float16 / float32 / float64, any device, any layout;
  * numpy.ndarray: float32 / float16 / float64, ml_dtypes.bfloat16, or uint16 holding the raw
    16-bit payload of the target dtype (BF16 bits from `bf16_tensor.view(torch.int16)` etc.);
  * RawTensor(data, dtype, shape): bytes already in the served layout (row-major,
    little-endian), sent unchanged with its own dtype;
  * anything numpy.asarray turns into numbers (lists, scalars), read as float32.
Weights are floating point: an array, tensor or numpy scalar of an integer or bool dtype
(but the 16-bit raw bits above) is refused with a TypeError naming the tensor, never converted
(it is usually token ids, a mask or a wrong view; cast it yourself if it holds weights).

The target dtype ("BF16", "F16" or "F32", the served tensor's dtype) decides the conversion:
float32 -> BF16 is round-to-nearest-even (NaN stays a quiet NaN with its sign; overflow gives
inf), exactly what torch's `.to(torch.bfloat16)` and the server's own loader do; float32 -> F16
is numpy's/torch's IEEE round-to-nearest-even; widening is exact; float64 goes through float32
first (as torch does for bfloat16). With dtype=None a tensor is sent in its own dtype.
"""

from __future__ import annotations

import ctypes
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple, Union

DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class RawTensor:
    """Bytes already in the served layout: row-major, little-endian, `dtype` in DTYPE_SIZES."""
    data: Union[bytes, bytearray, memoryview]
    dtype: str
    shape: Tuple[int, ...]

    def __post_init__(self):
        dtype = _norm_dtype(self.dtype)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        n = DTYPE_SIZES[dtype]
        for d in self.shape:
            n *= d
        if memoryview(self.data).nbytes != n:
            raise ValueError(f"RawTensor: {memoryview(self.data).nbytes} bytes for dtype {dtype} "
                             f"and shape {list(self.shape)} (expected {n})")


DTypeSpec = Union[None, str, Mapping[str, str], Callable[[str], Optional[str]]]


def _norm_dtype(dtype: str) -> str:
    d = str(dtype).upper()
    aliases = {"BFLOAT16": "BF16", "FLOAT16": "F16", "HALF": "F16", "FP16": "F16",
               "FLOAT32": "F32", "FLOAT": "F32", "FP32": "F32"}
    d = aliases.get(d, d)
    if d not in DTYPE_SIZES:
        raise ValueError(f"unsupported dtype {dtype!r} (use 'BF16', 'F16' or 'F32')")
    return d


def target_dtype(spec: DTypeSpec, name: str) -> Optional[str]:
    if spec is None:
        return None
    if isinstance(spec, str):
        return _norm_dtype(spec)
    if isinstance(spec, Mapping):
        d = spec.get(name)
    else:
        d = spec(name)
    return None if d is None else _norm_dtype(d)


# ---------------------------------------------------------------------------------------------
# numpy conversions


def _np():
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - Debian: apt-get install python3-numpy
        raise ImportError("rollout_client: converting arrays needs numpy "
                          "(apt-get install python3-numpy), or pass RawTensor bytes") from e
    return numpy


def f32_to_bf16_bits(a):
    """float32 ndarray -> uint16 ndarray of BF16 bits, round to nearest even."""
    np = _np()
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32)
    nan = np.isnan(a)
    lsb = (u >> np.uint32(16)) & np.uint32(1)
    # NaN inputs could wrap here; they are replaced below.
    with np.errstate(over="ignore"):
        out = ((u + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_bits_to_f32(bits):
    """uint16 ndarray of BF16 bits -> float32 ndarray (exact)."""
    np = _np()
    bits = np.ascontiguousarray(bits, dtype=np.uint16)
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


_NP_SOURCE_KINDS = {"float32": "F32", "float16": "F16", "float64": "F64", "bfloat16": "BF16",
                    "uint16": "U16", "int16": "U16"}


# The bits of +-infinity in a 16-bit float, sign masked off by 0x7FFF.
_INF_BITS = {"F16": 0x7C00, "BF16": 0x7F80}


def _check_cast_range(name: str, before, bits, dtype: str) -> None:
    """Refuses a cast to a 16-bit `dtype` (its result as uint16 `bits`) that made a finite value
    of `before` infinite, as the server refuses one it casts itself (docs/api.md, "Models":
    never served as infinity). Reads `before` only where the result is infinite."""
    np = _np()
    infinite = np.flatnonzero((bits.reshape(-1) & 0x7FFF) == _INF_BITS[dtype])
    flat = before.reshape(-1) if infinite.size else None
    for i in infinite:
        value = float(flat[int(i)])
        if math.isfinite(value):
            raise ValueError(f"tensor '{name}': element {int(i)} ({value:g}) is beyond the "
                             f"range of {dtype}; nothing was sent")


def _check_f64_cast(name: str, before, after) -> None:
    """Refuses a float64 -> float32 cast (the first step of every float64 tensor) that made a
    finite value of `before` infinite: checked against the float64 values themselves, since
    the later range checks see only the float32 result (1e300 came through as inf)."""
    np = _np()
    bad = np.flatnonzero(np.isinf(np.asarray(after).reshape(-1)) &
                         np.isfinite(np.asarray(before).reshape(-1)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"tensor '{name}': element {i} ({float(before.reshape(-1)[i]):g}) is "
                         f"beyond the range of F32; nothing was sent")


def _integer_weights(name: str, what: str) -> TypeError:
    """The error of a tensor whose values are integers (or bools): `what`, e.g. "an array of
    int64"."""
    return TypeError(f"tensor '{name}': {what} is refused, not converted: weights are floating "
                     "point (float32, float16, float64, bfloat16; uint16/int16 numpy arrays for "
                     "raw BF16/F16 bits)")


def _check_numpy_dtype(name: str, dtype) -> str:
    """The source kind of a numpy dtype ("F32", "F16", "F64", "BF16", "U16": raw 16-bit bits);
    TypeError naming the tensor for an integer or bool dtype (weights are floating point) or
    one that holds no numbers."""
    kind = _NP_SOURCE_KINDS.get(dtype.name, "")
    if kind:
        return kind
    if dtype.kind in "iub":
        raise _integer_weights(name, f"an array of {dtype}")
    raise TypeError(f"tensor '{name}': unsupported numpy dtype {dtype}")


def _numpy_bytes(name: str, a, target: Optional[str]):
    """Returns (dtype, shape, ndarray whose little-endian bytes are the payload)."""
    np = _np()
    kind = _check_numpy_dtype(name, a.dtype)
    if a.dtype.byteorder == ">" or (a.dtype.byteorder == "=" and sys.byteorder == "big"):
        a = a.astype(a.dtype.newbyteorder("<"))
    shape = tuple(int(d) for d in a.shape)
    if kind == "U16":
        if target not in ("BF16", "F16"):
            raise TypeError(f"tensor '{name}': a uint16/int16 array is read as raw BF16/F16 bits; "
                            f"pass dtype='BF16' or 'F16' (got {target!r})")
        return target, shape, np.ascontiguousarray(a).view(np.uint16)
    if kind == "BF16":  # ml_dtypes.bfloat16
        bits = np.ascontiguousarray(a).view(np.uint16)
        if target in (None, "BF16"):
            return "BF16", shape, bits
        a, kind = bf16_bits_to_f32(bits).reshape(shape), "F32"
    if kind == "F64":
        with np.errstate(over="ignore"):
            f32 = a.astype(np.float32)
        _check_f64_cast(name, a, f32)
        a, kind = f32, "F32"
    if target is None:
        target = kind
    if target == kind:
        return target, shape, np.ascontiguousarray(a)
    if target == "F32":
        return target, shape, np.ascontiguousarray(a, dtype=np.float32)
    if target == "F16":
        with np.errstate(over="ignore"):
            half = np.ascontiguousarray(a.astype(np.float16))
        _check_cast_range(name, a, half.view(np.uint16), "F16")
        return target, shape, half
    # target BF16 from F32 or F16
    bits = f32_to_bf16_bits(a.astype(np.float32)).reshape(shape)
    _check_cast_range(name, a, bits, "BF16")
    return target, shape, bits


# ---------------------------------------------------------------------------------------------
# torch (only touched when given a torch tensor)


def _torch_dtype_error(name: str, dtype) -> TypeError:
    if not dtype.is_floating_point and not dtype.is_complex:  # integers, bool
        return _integer_weights(name, f"a tensor of {dtype}")
    return TypeError(f"tensor '{name}': unsupported torch dtype {dtype}")


def _is_torch_tensor(v: Any) -> bool:
    return type(v).__module__.startswith("torch") and hasattr(v, "detach") and hasattr(v, "dtype")


def _torch_bytes(name: str, t, target: Optional[str]):
    import torch

    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    t = t.detach()
    if t.dtype == torch.float64:
        f32 = t.to(torch.float32)
        # Tested where it is (the device), copied to the host only to name an element.
        if bool((torch.isinf(f32) & torch.isfinite(t)).any()):
            _check_f64_cast(name, t.cpu().numpy(), f32.cpu().numpy())
        t = f32
    src = names.get(t.dtype)
    if src is None:
        raise _torch_dtype_error(name, t.dtype)
    dst = target or src
    to_torch = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    src_t = t
    t = t.to(device="cpu", dtype=to_torch[dst]).contiguous()
    if dst != src and dst in _INF_BITS:
        _check_cast_range(name, src_t, t.view(torch.int16).numpy().view(_np().uint16), dst)
    shape = tuple(int(d) for d in t.shape)
    if sys.byteorder != "little":  # pragma: no cover
        raise RuntimeError("rollout_client: big-endian hosts are not supported for torch tensors")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return dst, shape, b""
    try:  # the tensor's own bytes, no copy (numpy shares torch's CPU memory)
        return dst, shape, t.reshape(-1).view(torch.uint8).numpy()
    except (ImportError, RuntimeError, TypeError):  # no numpy: a copy of the storage
        return dst, shape, ctypes.string_at(t.data_ptr(), nbytes)


# ---------------------------------------------------------------------------------------------


@dataclass
class PreparedTensor:
    name: str
    dtype: str
    shape: Tuple[int, ...]
    nbytes: int
    _value: Any
    _target: Optional[str]

    def payload(self) -> memoryview:
        """The bytes to send (converted now, so that only one tensor's copy is alive at once)."""
        dtype, shape, data = to_bytes(self.name, self._value, self._target)
        if hasattr(data, "dtype") and hasattr(data, "reshape"):  # numpy array
            data = data.reshape(-1).view("uint8")
        mv = memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        if mv.nbytes != self.nbytes or dtype != self.dtype or shape != self.shape:
            raise RuntimeError(f"tensor '{self.name}' changed while being sent")
        return mv


def to_bytes(name: str, value: Any, target: Optional[str]):
    """(dtype, shape, bytes-like) of one tensor value converted to `target` (None: own dtype)."""
    if isinstance(value, RawTensor):
        return value.dtype, value.shape, value.data
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise TypeError(f"tensor '{name}': wrap raw bytes as RawTensor(data, dtype, shape)")
    if _is_torch_tensor(value):
        return _torch_bytes(name, value, target)
    np = _np()
    if not isinstance(value, np.ndarray):
        dtype = getattr(value, "dtype", None)  # a numpy scalar, another library's array
        if getattr(dtype, "kind", None) in ("i", "u", "b"):
            raise _integer_weights(name, f"an array of {dtype}")
        value = np.asarray(value, dtype=np.float32)
    return _numpy_bytes(name, value, target)


def _expected_dtype_shape(name: str, value: Any, target: Optional[str]):
    """dtype and shape of what to_bytes would produce, without converting anything."""
    if isinstance(value, RawTensor):
        return value.dtype, value.shape
    if _is_torch_tensor(value):
        import torch
        names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                 torch.float64: "F32"}
        if value.dtype not in names:
            raise _torch_dtype_error(name, value.dtype)
        return target or names[value.dtype], tuple(int(d) for d in value.shape)
    np = _np()
    if isinstance(value, np.ndarray):
        kind = _check_numpy_dtype(name, value.dtype)
        if kind == "U16" and target not in ("BF16", "F16"):
            raise TypeError(f"tensor '{name}': a uint16/int16 array is read as raw BF16/F16 bits; "
                            f"pass dtype='BF16' or 'F16' (got {target!r})")
        own = {"F32": "F32", "F16": "F16", "F64": "F32", "BF16": "BF16", "U16": target}[kind]
        return target or own, tuple(int(d) for d in value.shape)
    dtype, shape, _ = to_bytes(name, value, target)
    return dtype, shape


_FUSED_GATE_UP = "mlp.experts.gate_up_proj"
_FUSED_DOWN = "mlp.experts.down_proj"


def split_fused_experts(named_tensors):
    """(name, tensor) pairs with MoE experts fused as transformers 5 holds them in a state_dict
    ("P.mlp.experts.gate_up_proj" [E, 2I, H]: each expert's gate rows, then its up rows;
    "P.mlp.experts.down_proj" [E, H, I]) replaced by the per-expert tensors the server serves,
    "P.mlp.experts.e.{gate,up,down}_proj.weight" (views, no copy). Others pass unchanged."""
    for item in named_tensors:
        try:
            name, value = item
        except (TypeError, ValueError):
            raise TypeError("update_weights expects (name, tensor) pairs, e.g. "
                            "model.state_dict().items()") from None
        name = str(name)
        gate_up = name.endswith(_FUSED_GATE_UP)
        if not (gate_up or name.endswith(_FUSED_DOWN)):
            yield name, value
            continue
        shape = tuple(int(d) for d in getattr(value, "shape", ()))
        if len(shape) != 3 or (gate_up and shape[1] % 2 != 0):
            raise ValueError(f"fused expert tensor '{name}' has shape {list(shape)}, expected "
                             + ("[experts, 2 * moe_intermediate_size, hidden]" if gate_up else
                                "[experts, hidden, moe_intermediate_size]"))
        prefix = name[:-len(_FUSED_GATE_UP if gate_up else _FUSED_DOWN)] + "mlp.experts."
        for e in range(shape[0]):
            if gate_up:
                i = shape[1] // 2
                yield f"{prefix}{e}.gate_proj.weight", value[e, :i]
                yield f"{prefix}{e}.up_proj.weight", value[e, i:]
            else:
                yield f"{prefix}{e}.down_proj.weight", value[e]


def prepare(named_tensors, dtype: DTypeSpec) -> Sequence[PreparedTensor]:
    """Checks every (name, value) and works out its declared dtype, shape and size. Fused MoE
    experts (transformers 5's state_dict) are sent as the per-expert tensors they hold."""
    if isinstance(named_tensors, Mapping):
        named_tensors = named_tensors.items()
    out = []
    seen = set()
    for name, value in split_fused_experts(named_tensors):
        if name in seen:
            raise ValueError(f"tensor '{name}' given twice")
        seen.add(name)
        target = target_dtype(dtype, name)
        d, shape = _expected_dtype_shape(name, value, target)
        n = DTYPE_SIZES[d]
        for s in shape:
            n *= s
        out.append(PreparedTensor(name, d, shape, n, value, target))
    if not out:
        raise ValueError("update_weights: no tensors given")
    return out
