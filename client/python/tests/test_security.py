"""Mutual TLS and the bearer token, against real rollout-servers: the clients present a client
certificate (tls_client_cert / tls_client_key, as rollout-cli's --tls_client_cert /
--tls_client_key) to a server started with --tls_client_ca, and send a token read from a file
(its line end left out, as the server reads --auth_token_file). The test PKI is made with the
openssl CLI in a temporary folder, once per class."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import unittest

import rollout_client.aio
from rollout_client import Fleet, RolloutClient, RolloutError, WeightBroadcaster

from _support import Server, cache_dir

TOKEN = "s3cret"


def openssl(*args: str, cwd: str) -> None:
    r = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed:\n{r.stderr}")


def make_pki(d: str) -> None:
    """In folder d: ca.pem (a CA), server.pem/server.key (signed by it, for localhost and
    127.0.0.1), client.pem/client.key (signed by it, for client auth) and other.pem/other.key (a
    self-signed client certificate the CA did not sign). EC P-256, valid for a day."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
            "-subj", "/CN=rollout-py-test-ca", cwd=d)
    exts = {"server": "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                      "extendedKeyUsage=serverAuth\n",
            "client": "extendedKeyUsage=clientAuth\n"}
    for serial, (name, ext) in enumerate(exts.items(), start=1):
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext)
        openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN=rollout-py-test-{name}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-set_serial", str(serial), "-days", "1", "-out", f"{name}.pem",
                "-extfile", f"{name}.ext", cwd=d)
    openssl("req", "-x509", *ec, "-keyout", "other.key", "-out", "other.pem", "-days", "1",
            "-subj", "/CN=rollout-py-test-other", "-addext", "extendedKeyUsage=clientAuth",
            cwd=d)


class MutualTlsTest(unittest.TestCase):
    """One server with --tls_cert --tls_key --tls_client_ca for the class."""

    @classmethod
    def setUpClass(cls):
        if shutil.which("openssl") is None:
            raise unittest.SkipTest("the openssl CLI is not installed")
        cls.dir = tempfile.mkdtemp(prefix="rollout-py-pki-")
        try:
            make_pki(cls.dir)
            cls.server = Server(cache_dir(), "--tls_cert", cls.path("server.pem"),
                                "--tls_key", cls.path("server.key"),
                                "--tls_client_ca", cls.path("ca.pem"))
        except BaseException:
            shutil.rmtree(cls.dir, True)
            raise
        cls.target = cls.server.target
        cls.tls = dict(tls_root_cert=cls.path("ca.pem"), tls_client_cert=cls.path("client.pem"),
                       tls_client_key=cls.path("client.key"))

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        shutil.rmtree(cls.dir, True)

    @classmethod
    def path(cls, name: str) -> str:
        return os.path.join(cls.dir, name)

    def test_the_blocking_client_with_its_certificate_gets_server_info(self):
        with RolloutClient(self.target, timeout=60, **self.tls) as c:
            info = c.wait_ready(60)
            self.assertEqual(c.server_info().weight_version, info.weight_version)

    def test_pem_bytes_work_as_paths_do(self):
        pem = {}
        for name, path in self.tls.items():
            with open(path, "rb") as f:
                pem[name] = f.read()
        with RolloutClient(self.target, timeout=60, **pem) as c:
            c.wait_ready(60)

    def test_the_asyncio_client_with_its_certificate_gets_server_info(self):
        async def main():
            async with rollout_client.aio.RolloutClient(self.target, timeout=60,
                                                        **self.tls) as c:
                return await c.server_info()
        self.assertTrue(asyncio.run(main()).weight_version)

    def test_a_fleet_passes_the_certificate_to_every_client(self):
        with Fleet([self.target], timeout=60, **self.tls) as fleet:
            self.assertEqual(len(fleet.server_info()), 1)

    def test_without_a_client_certificate_the_server_refuses(self):
        with RolloutClient(self.target, timeout=10,
                           tls_root_cert=self.tls["tls_root_cert"]) as c:
            with self.assertRaises(RolloutError) as cm:
                c.server_info()
            self.assertEqual(cm.exception.code, "UNAVAILABLE")

        async def main():
            async with rollout_client.aio.RolloutClient(
                    self.target, timeout=10, tls_root_cert=self.tls["tls_root_cert"]) as c:
                await c.server_info()
        with self.assertRaises(RolloutError) as cm:
            asyncio.run(main())
        self.assertEqual(cm.exception.code, "UNAVAILABLE")

    def test_a_client_certificate_alone_is_tls_with_the_default_roots(self):
        # As rollout-cli: TLS on, the server checked against gRPC's default roots, which do not
        # hold this test CA, so the handshake fails (no ValueError, no plaintext attempt).
        with RolloutClient(self.target, timeout=10, tls_client_cert=self.tls["tls_client_cert"],
                           tls_client_key=self.tls["tls_client_key"]) as c:
            with self.assertRaises(RolloutError) as cm:
                c.server_info()
            self.assertEqual(cm.exception.code, "UNAVAILABLE")
            self.assertIn("ssl", str(cm.exception).lower())  # a handshake, not plaintext

    def test_a_client_certificate_the_ca_did_not_sign_is_refused(self):
        with RolloutClient(self.target, timeout=10, tls_root_cert=self.tls["tls_root_cert"],
                           tls_client_cert=self.path("other.pem"),
                           tls_client_key=self.path("other.key")) as c:
            with self.assertRaises(RolloutError) as cm:
                c.server_info()
            self.assertEqual(cm.exception.code, "UNAVAILABLE")

    def test_an_unreadable_file_is_named(self):
        missing = self.path("missing.pem")
        for name in ("tls_root_cert", "tls_client_cert", "tls_client_key"):
            with self.assertRaises(FileNotFoundError) as cm:
                RolloutClient(self.target, **dict(self.tls, **{name: missing}))
            self.assertIn(name, str(cm.exception))
            self.assertIn(missing, str(cm.exception))
        empty = self.path("empty.pem")
        open(empty, "wb").close()
        with self.assertRaises(ValueError) as cm:
            RolloutClient(self.target, **dict(self.tls, tls_client_key=empty))
        self.assertIn(f"tls_client_key file {empty} is empty", str(cm.exception))


class HalfGivenClientCertificateTest(unittest.TestCase):
    """Refused with ValueError naming the parameters, before any channel is made."""

    CASES = (
        (dict(tls_root_cert=b"ca", tls_client_cert=b"cert"), "tls_client_key"),
        (dict(tls_root_cert=b"ca", tls_client_key=b"key"), "tls_client_cert"),
        (dict(tls_client_cert=b"cert"), "tls_client_key"),
    )

    def check(self, make):
        for kwargs, missing in self.CASES:
            with self.subTest(given=sorted(kwargs)):
                with self.assertRaises(ValueError) as cm:
                    make(**kwargs)
                message = str(cm.exception)
                self.assertIn(missing, message)  # what to add
                for given in kwargs.keys() - {"tls_root_cert"}:
                    self.assertIn(given, message)  # what needs it

    def test_the_blocking_client(self):
        self.check(lambda **kw: RolloutClient("127.0.0.1:1", **kw))

    def test_the_asyncio_client(self):
        async def make(**kw):
            rollout_client.aio.RolloutClient("127.0.0.1:1", **kw)
        self.check(lambda **kw: asyncio.run(make(**kw)))

    def test_fleet_and_weight_broadcaster(self):
        self.check(lambda **kw: Fleet(["127.0.0.1:1", "127.0.0.1:2"], **kw))
        # The clients are made before any NCCL transport: no torch needed for this.
        self.check(lambda **kw: WeightBroadcaster(["127.0.0.1:1"], **kw))


class TokenTest(unittest.TestCase):
    """A server with --auth_token_file and --auth_all_rpcs (GetServerInfo needs the token)."""

    @classmethod
    def setUpClass(cls):
        fd, cls.token_file = tempfile.mkstemp(prefix="rollout-token-")
        with os.fdopen(fd, "w") as f:
            f.write(TOKEN + "\r\n")
        try:
            cls.server = Server(cache_dir(), "--auth_token_file", cls.token_file,
                                "--auth_all_rpcs")
        except BaseException:
            os.unlink(cls.token_file)
            raise
        cls.target = cls.server.target

    @classmethod
    def tearDownClass(cls):
        cls.server.stop()
        os.unlink(cls.token_file)

    def test_a_token_with_its_line_end_works(self):
        with open(self.token_file, newline="") as f:
            from_file = f.read()
        self.assertEqual(from_file, TOKEN + "\r\n")
        for token in (TOKEN, TOKEN + "\n", TOKEN + "\r\n", TOKEN + "\r", from_file):
            with self.subTest(token=repr(token)):
                with RolloutClient(self.target, token=token, timeout=60) as c:
                    c.wait_ready(60)
                    self.assertTrue(c.server_info().weight_version)

    def test_the_asyncio_client_strips_it_too(self):
        async def main():
            async with rollout_client.aio.RolloutClient(self.target, token=TOKEN + "\r\n",
                                                        timeout=60) as c:
                return await c.server_info()
        self.assertTrue(asyncio.run(main()).weight_version)

    def test_the_server_still_checks_it(self):
        for token in (None, "wrong\n"):
            with RolloutClient(self.target, token=token, timeout=60) as c:
                with self.assertRaises(RolloutError) as cm:
                    c.server_info()
                self.assertEqual(cm.exception.code, "UNAUTHENTICATED")

    def test_a_token_metadata_cannot_carry_raises_value_error_naming_token(self):
        for token in (TOKEN + "\nsecond line\n", "s3\rcret", "s3\x00cret", "s3crét", "\r\n"):
            for make in (RolloutClient, rollout_client.aio.RolloutClient):
                with self.subTest(token=repr(token), client=make.__module__):
                    with self.assertRaises(ValueError) as cm:
                        make(self.target, token=token)
                    self.assertIn("token", str(cm.exception))
                    self.assertNotIn(TOKEN, str(cm.exception))  # never shown


if __name__ == "__main__":
    unittest.main()
