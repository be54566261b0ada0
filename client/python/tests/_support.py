"""What the test modules share: a rollout-server subprocess on a free port, and its cache.

The tests import rollout_client as installed (tests/run.sh installs it into a fresh venv and
runs them from outside the repository); nothing here puts the source tree on sys.path.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)       # client/python
REPO = os.path.dirname(os.path.dirname(PKG_ROOT))
BIN_DIR = os.environ.get("ROLLOUT_BIN_DIR", os.path.join(REPO, "build", "bin"))
THREADS = os.environ.get("ROLLOUT_TEST_THREADS", "2")


class Server:
    """A rollout-server subprocess on a free port."""

    def __init__(self, cache_dir: str, *args: str):
        exe = os.path.join(BIN_DIR, "rollout-server")
        if not os.path.exists(exe):
            raise unittest.SkipTest(f"{exe} not built (set ROLLOUT_BIN_DIR)")
        self.log_path = tempfile.mktemp(prefix="rollout-server-", suffix=".log")
        env = dict(os.environ, ROLLOUT_CACHE_DIR=cache_dir)
        self._log = open(self.log_path, "wb")
        # --metrics_port 0: several test servers run at once; the default port would clash.
        self.proc = subprocess.Popen([exe, "--port", "0", "--metrics_port", "0",
                                      "--threads", THREADS, *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        self.port = None
        while time.monotonic() < deadline:
            with open(self.log_path, "rb") as f:
                m = re.search(rb"listening on port (\d+)", f.read())
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if self.port is None:
            log = self.log()
            self.stop()
            raise RuntimeError(f"rollout-server did not start:\n{log}")
        self.target = f"127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


_cache_dir = None
_server = None


def cache_dir() -> str:
    """One model cache for every server of the test run."""
    global _cache_dir
    if _cache_dir is None:
        _cache_dir = tempfile.mkdtemp(prefix="rollout-py-cache-")
        atexit.register(shutil.rmtree, _cache_dir, True)
    return _cache_dir


def shared_server() -> Server:
    """The server of the tests that leave its state unchanged, started on first use."""
    global _server
    if _server is None:
        _server = Server(cache_dir())
    return _server


def stop_shared_server() -> None:
    """A module's tearDownModule: the next module starts its own."""
    global _server
    if _server is not None:
        _server.stop()
        _server = None
