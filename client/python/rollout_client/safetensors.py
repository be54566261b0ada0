"""A tiny pure-Python safetensors reader/writer (no dependencies), enough to read served weights
back as RawTensor bytes and to write checkpoints for update_weights_from_path.

Format: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Dict, Iterable, List, Mapping, Optional

from .weights import DTYPE_SIZES, RawTensor

_INDEX = "model.safetensors.index.json"


def _files_of(path: str, names: Optional[Iterable[str]]) -> Dict[str, Optional[List[str]]]:
    """{file: names wanted from it (None = all)} for a .safetensors file or a model folder."""
    if os.path.isfile(path):
        return {path: None if names is None else list(names)}
    index = os.path.join(path, _INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        wanted = list(weight_map) if names is None else list(names)
        files: Dict[str, Optional[List[str]]] = {}
        for n in wanted:
            if n not in weight_map:
                raise KeyError(f"tensor '{n}' is not in {index}")
            files.setdefault(os.path.join(path, weight_map[n]), []).append(n)
        return files
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return {single: None if names is None else list(names)}
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    if names is None:
        return {os.path.join(path, f): None for f in found}
    wanted = set(names)
    files = {}
    for f in found:
        full = os.path.join(path, f)
        here = [n for n in read_header(full) if n in wanted]
        if here:
            files[full] = here
    return files


def read_header(file: str) -> Dict[str, dict]:
    """The tensor entries of one .safetensors file (without __metadata__)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def read_safetensors(path: str, names: Optional[Iterable[str]] = None) -> Dict[str, RawTensor]:
    """Tensors of a .safetensors file or a Hugging Face model folder (single or sharded), as
    RawTensor bytes, in file order. `names` limits which are read (KeyError if one is missing)."""
    out: Dict[str, RawTensor] = {}
    for file, wanted in _files_of(path, names).items():
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            header.pop("__metadata__", None)
            base = 8 + n
            for name in (wanted if wanted is not None else list(header)):
                if name not in header:
                    raise KeyError(f"tensor '{name}' is not in {file}")
                e = header[name]
                if e["dtype"] not in DTYPE_SIZES:
                    raise ValueError(f"{file}: tensor '{name}' has dtype {e['dtype']} "
                                     "(supported: BF16, F16, F32)")
                begin, end = e["data_offsets"]
                f.seek(base + begin)
                data = f.read(end - begin)
                out[name] = RawTensor(data, e["dtype"], tuple(e["shape"]))
    if names is not None:
        for n in names:
            if n not in out:
                raise KeyError(f"tensor '{n}' not found under {path}")
    return out


def write_safetensors(file: str, tensors: Mapping[str, RawTensor],
                      metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes RawTensors to one .safetensors file (atomically: written beside, then renamed)."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, t in tensors.items():
        size = memoryview(t.data).nbytes
        header[name] = {"dtype": t.dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = f"{file}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for t in tensors.values():
            f.write(t.data)
    os.replace(tmp, file)
