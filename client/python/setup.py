"""Build step of the rollout_client package: generates its gRPC modules into the build.

The metadata is in pyproject.toml; this file adds one thing to setuptools' build_py: protoc runs
on rollout/v1/rollout.proto and writes rollout_pb2.py and rollout_pb2_grpc.py into
<build>/rollout_client/_gen/, so the installed package carries them and never runs protoc.

Where the .proto is read from: $ROLLOUT_PROTO_ROOT, else ./proto beside this file (a copy of
the repository's proto/ folder), else ../../proto (this file in the repository's
client/python). Which compiler: grpc_tools.protoc when grpcio-tools is importable, else protoc
with grpc_python_plugin ($PROTOC / $GRPC_PYTHON_PLUGIN, else found on PATH or in /usr/bin;
Debian: protobuf-compiler protobuf-compiler-grpc).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO = os.path.join("rollout", "v1", "rollout.proto")


class BuildError(Exception):
    pass


def proto_root():
    candidates = [os.environ.get("ROLLOUT_PROTO_ROOT"), os.path.join(HERE, "proto"),
                  os.path.join(HERE, "..", "..", "proto")]
    for root in candidates:
        if root and os.path.exists(os.path.join(root, PROTO)):
            return os.path.abspath(root)
    raise BuildError(f"cannot find {PROTO}; set ROLLOUT_PROTO_ROOT to the repository's proto/ "
                     "folder, or build from the repository's client/python")


def tool(env_name, name):
    found = os.environ.get(env_name) or shutil.which(name)
    if found is None and os.path.exists(f"/usr/bin/{name}"):
        found = f"/usr/bin/{name}"
    return found


def protoc_command(root, out):
    args = [f"-I{root}", f"--python_out={out}", f"--grpc_python_out={out}", PROTO]
    try:
        import grpc_tools  # noqa: F401
        return [sys.executable, "-m", "grpc_tools.protoc"] + args
    except ImportError:
        pass
    protoc, plugin = tool("PROTOC", "protoc"), tool("GRPC_PYTHON_PLUGIN", "grpc_python_plugin")
    if protoc is None or plugin is None:
        raise BuildError("generating the gRPC modules needs grpcio-tools, or protoc and "
                         "grpc_python_plugin (Debian: apt-get install protobuf-compiler "
                         "protobuf-compiler-grpc; or set PROTOC and GRPC_PYTHON_PLUGIN)")
    return [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"] + args


def generate(gen_dir):
    """Writes rollout_client/_gen (an __init__, rollout_pb2, rollout_pb2_grpc) into gen_dir."""
    root = proto_root()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = protoc_command(root, tmp)
        r = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise BuildError(f"{' '.join(cmd)} failed:\n{r.stderr}")
        src = os.path.join(tmp, "rollout", "v1")
        with open(os.path.join(src, "rollout_pb2_grpc.py")) as f:
            code = f.read()
        code, n = re.subn(r"^from rollout\.v1 import rollout_pb2 as",
                          "from . import rollout_pb2 as", code, flags=re.M)
        if n != 1:
            raise BuildError("unexpected grpc_python_plugin output (no import of rollout_pb2)")
        os.makedirs(gen_dir, exist_ok=True)
        shutil.copyfile(os.path.join(src, "rollout_pb2.py"),
                        os.path.join(gen_dir, "rollout_pb2.py"))
        with open(os.path.join(gen_dir, "rollout_pb2_grpc.py"), "w") as f:
            f.write(code)
        with open(os.path.join(gen_dir, "__init__.py"), "w") as f:
            f.write(f"# Generated at build time from {PROTO} by {os.path.basename(cmd[0])}; "
                    "do not edit.\n")


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        try:
            generate(os.path.join(self.build_lib, "rollout_client", "_gen"))
        except BuildError as e:
            sys.exit(f"rollout_client: {e}")


setup(cmdclass={"build_py": BuildPyWithStubs})
