"""Generated protobuf/gRPC modules of rollout.v1, (re)generated from the .proto when missing or stale.

The generated code is never committed. On first import this module runs

    protoc -I <proto root> --python_out=<tmp> --grpc_python_out=<tmp>
           --plugin=protoc-gen-grpc_python=<grpc_python_plugin> rollout/v1/rollout.proto

(Debian: packages protobuf-compiler and protobuf-compiler-grpc), then moves rollout_pb2.py and
rollout_pb2_grpc.py into a flat package folder (default: rollout_client/_gen/, gitignored) next to
a stamp holding the hash of the .proto and the protoc version. The one absolute import protoc
writes into the gRPC module (``from rollout.v1 import rollout_pb2``) is rewritten as a relative
import, so nothing named ``rollout`` is put on sys.path and the modules load as
``rollout_client._gen.rollout_pb2`` / ``rollout_client._gen.rollout_pb2_grpc``.

Environment overrides:
  ROLLOUT_PROTO_ROOT      folder holding rollout/v1/rollout.proto (default: <repo>/proto)
  ROLLOUT_CLIENT_GEN_DIR  where to write the generated package (default: rollout_client/_gen)
  PROTOC, GRPC_PYTHON_PLUGIN   the tools (default: found on PATH, then /usr/bin)

Regenerate by hand with:  /usr/bin/python3 -m rollout_client._proto [--force]
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_PROTO_REL = os.path.join("rollout", "v1", "rollout.proto")
_GEN_PACKAGE = "rollout_client._gen"
_STAMP = "STAMP"


def proto_root() -> str:
    env = os.environ.get("ROLLOUT_PROTO_ROOT")
    if env:
        return env
    # client/python/rollout_client -> repository root
    return os.path.normpath(os.path.join(_PKG_DIR, "..", "..", "..", "proto"))


def gen_dir() -> str:
    return os.environ.get("ROLLOUT_CLIENT_GEN_DIR") or os.path.join(_PKG_DIR, "_gen")


def _tool(env_name: str, name: str) -> str | None:
    env = os.environ.get(env_name)
    if env:
        return env
    return shutil.which(name) or (f"/usr/bin/{name}" if os.path.exists(f"/usr/bin/{name}") else None)


def _stamp_text(proto_path: str, protoc: str) -> str:
    with open(proto_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    version = subprocess.run([protoc, "--version"], capture_output=True, text=True,
                             check=False).stdout.strip()
    return f"{digest} {version}\n"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _is_complete(out: str) -> bool:
    return all(os.path.exists(os.path.join(out, n))
               for n in ("__init__.py", "rollout_pb2.py", "rollout_pb2_grpc.py", _STAMP))


def generate(force: bool = False) -> str:
    """Makes sure the generated package is present and matches the .proto; returns its folder.

    When the .proto cannot be found (the package was copied without the repository), an already
    generated folder is used as is.
    """
    out = gen_dir()
    proto_path = os.path.join(proto_root(), _PROTO_REL)
    if not os.path.exists(proto_path):
        if _is_complete(out) and not force:
            return out
        raise RuntimeError(
            f"rollout_client: cannot find {proto_path} to generate the gRPC modules; set "
            "ROLLOUT_PROTO_ROOT to the folder holding rollout/v1/rollout.proto")
    protoc = _tool("PROTOC", "protoc")
    plugin = _tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin")
    if protoc is None or plugin is None:
        if _is_complete(out) and not force:
            return out
        raise RuntimeError(
            "rollout_client: protoc and grpc_python_plugin are needed to generate the gRPC "
            "modules (Debian: apt-get install protobuf-compiler protobuf-compiler-grpc)")
    stamp = _stamp_text(proto_path, protoc)
    if not force and _is_complete(out) and _read(os.path.join(out, _STAMP)) == stamp:
        return out

    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    # One generator at a time (parallel test processes import together).
    with open(os.path.join(parent, ".rollout_gen.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and _is_complete(out) and _read(os.path.join(out, _STAMP)) == stamp:
            return out
        tmp = tempfile.mkdtemp(prefix=".gen-", dir=parent)
        try:
            cmd = [protoc, f"-I{proto_root()}", f"--python_out={tmp}",
                   f"--grpc_python_out={tmp}", f"--plugin=protoc-gen-grpc_python={plugin}",
                   _PROTO_REL]
            r = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                raise RuntimeError(f"rollout_client: {' '.join(cmd)} failed:\n{r.stderr}")
            src = os.path.join(tmp, "rollout", "v1")
            flat = os.path.join(tmp, "pkg")
            os.makedirs(flat)
            shutil.move(os.path.join(src, "rollout_pb2.py"), os.path.join(flat, "rollout_pb2.py"))
            with open(os.path.join(src, "rollout_pb2_grpc.py")) as f:
                code = f.read()
            code, n = re.subn(r"^from rollout\.v1 import rollout_pb2 as",
                              "from . import rollout_pb2 as", code, flags=re.M)
            if n != 1:
                raise RuntimeError("rollout_client: unexpected grpc_python_plugin output "
                                   "(import of rollout_pb2 not found)")
            with open(os.path.join(flat, "rollout_pb2_grpc.py"), "w") as f:
                f.write(code)
            with open(os.path.join(flat, "__init__.py"), "w") as f:
                f.write("# Generated by rollout_client._proto from rollout/v1/rollout.proto. "
                        "Do not edit or commit.\n")
            with open(os.path.join(flat, _STAMP), "w") as f:
                f.write(stamp)
            old = None
            if os.path.exists(out):
                old = tempfile.mkdtemp(prefix=".old-", dir=parent)
                os.rename(out, os.path.join(old, "gen"))
            os.rename(flat, out)
            if old:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def load():
    """Returns (rollout_pb2, rollout_pb2_grpc), generating them first if needed."""
    out = generate()
    if _GEN_PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            _GEN_PACKAGE, os.path.join(out, "__init__.py"), submodule_search_locations=[out])
        module = importlib.util.module_from_spec(spec)
        sys.modules[_GEN_PACKAGE] = module
        spec.loader.exec_module(module)
    pb2 = importlib.import_module(_GEN_PACKAGE + ".rollout_pb2")
    pb2_grpc = importlib.import_module(_GEN_PACKAGE + ".rollout_pb2_grpc")
    return pb2, pb2_grpc


if __name__ == "__main__":
    print(generate(force="--force" in sys.argv[1:]))
