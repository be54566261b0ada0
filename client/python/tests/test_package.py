"""The installed package: outside the repository, with its generated modules inside, importable
without protoc and without writing anything, a clear error when a part is missing, and
dataclasses that cover every field of the messages they mirror. No server needed."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import rollout_client
from rollout_client import (EngineCounters, EngineLimits, IpcTensor, ModelInfo, NumericsContract,
                            ServerInfo, UpdateWeightsResult, WeightSyncGroup, WeightSyncGroupInfo)
from rollout_client.broadcast_plan import TensorSpec
from rollout_client.client import pb2

from _support import REPO

PKG_DIR = os.path.dirname(os.path.abspath(rollout_client.__file__))


def tree(root):
    """Every file under root with its size and mtime."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(d, f))
            out[os.path.relpath(os.path.join(d, f), root)] = (st.st_size, st.st_mtime_ns)
    return out


def python(code, **env):
    """Runs `code` in a fresh interpreter, from an empty folder, with no PATH (so no protoc)."""
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                              text=True, timeout=60,
                              env=dict(os.environ, PATH="", PYTHONDONTWRITEBYTECODE="1", **env))


class InstalledPackageTest(unittest.TestCase):
    def test_the_package_under_test_is_installed_outside_the_repository(self):
        # Installed into this interpreter's prefix (run_tests.sh: a fresh venv), run from a
        # folder outside the repository.
        self.assertTrue(os.path.realpath(PKG_DIR).startswith(os.path.realpath(sys.prefix)),
                        f"{PKG_DIR} is not installed in {sys.prefix}")
        self.assertFalse(os.path.realpath(os.getcwd()).startswith(os.path.realpath(REPO)),
                         os.getcwd())
        for name in ("py.typed", "aio.py", os.path.join("_gen", "rollout_pb2.py"),
                     os.path.join("_gen", "rollout_pb2_grpc.py")):
            self.assertTrue(os.path.exists(os.path.join(PKG_DIR, name)), name)

    def test_imports_without_protoc_and_writes_nothing(self):
        before = tree(PKG_DIR)
        r = python("import rollout_client, rollout_client.aio; print(rollout_client.__file__)")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(os.path.dirname(r.stdout.strip()), PKG_DIR)
        self.assertEqual(tree(PKG_DIR), before)

    def test_missing_generated_modules_say_how_to_install(self):
        with tempfile.TemporaryDirectory() as site:
            shutil.copytree(PKG_DIR, os.path.join(site, "rollout_client"),
                            ignore=shutil.ignore_patterns("_gen", "__pycache__"))
            r = python("import rollout_client", PYTHONPATH=site, PYTHONNOUSERSITE="1")
        self.assertNotEqual(r.returncode, 0)
        last = r.stderr.strip().splitlines()[-1]
        self.assertTrue(last.startswith("ImportError: rollout_client: its generated gRPC "
                                        "modules (rollout_client._gen) are missing"), r.stderr)
        self.assertIn("pip install", last)

    def test_dataclasses_cover_every_field_of_their_messages(self):
        for cls, message in ((ServerInfo, pb2.ServerInfo), (ModelInfo, pb2.ModelInfo),
                             (EngineLimits, pb2.EngineLimits),
                             (EngineCounters, pb2.EngineCounters),
                             (UpdateWeightsResult, pb2.UpdateWeightsResponse),
                             (IpcTensor, pb2.IpcTensor),
                             (WeightSyncGroup, pb2.JoinWeightSyncGroupResponse),
                             (WeightSyncGroupInfo, pb2.WeightSyncGroupInfo),
                             (NumericsContract, pb2.NumericsContract),
                             (TensorSpec, pb2.BroadcastTensor)):
            client_side = CLIENT_MEASURED.get(cls, set())
            self.assertEqual({f.name for f in dataclasses.fields(cls)} - client_side,
                             {f.name for f in message.DESCRIPTOR.fields}, cls.__name__)


# Fields the client measures itself, not read from the message.
CLIENT_MEASURED = {UpdateWeightsResult: {"seconds", "bytes_per_second"}}


if __name__ == "__main__":
    unittest.main()
