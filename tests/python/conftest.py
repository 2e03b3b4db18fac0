"""Shared fixtures: stubs generated from the .proto files, the binaries, and
a real etcd for the servers to run as replicas on.

With an etcd binary installed (Debian's etcd-server; FAIRPLACE_ETCD names
another), every server started here is a replica (--etcd-endpoints) on one
single-member etcd, each in a replica set of its own; without it they are
single servers and the replica-only checks skip, saying so, unless
FAIRPLACE_REQUIRE_ETCD=1 (CI), which makes them fail instead.
"""
import importlib
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("FAIRPLACE_BIN_DIR", os.path.join(ROOT, "target", "debug"))
PROTOS = ["types", "agent", "placement", "record", "admin", "replica"]
REQUIRE_ETCD = os.environ.get("FAIRPLACE_REQUIRE_ETCD") == "1"
NO_ETCD = "no etcd binary (apt-get install etcd-server, or set FAIRPLACE_ETCD)"


@pytest.fixture(scope="session")
def stubs():
    out = tempfile.mkdtemp(prefix="fairplace-py-")
    args = ["protoc", f"-I{os.path.join(ROOT, 'proto')}", f"--python_out={out}", f"--grpc_python_out={out}"]
    args += [f"fairplace/v1/{p}.proto" for p in PROTOS]
    assert protoc.main(args) == 0, "stub generation failed"
    sys.path.insert(0, out)
    mods = {p: importlib.import_module(f"fairplace.v1.{p}_pb2") for p in PROTOS}
    for p in ("placement", "admin", "agent"):
        mods[f"{p}_grpc"] = importlib.import_module(f"fairplace.v1.{p}_pb2_grpc")
    return mods


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A real single-member etcd on free loopback ports, its data in a
    temporary directory, healthy (a write commits) when constructed."""

    def __init__(self, binary):
        self.dir = tempfile.mkdtemp(prefix="fairplace-py-etcd-")
        self.url = f"http://127.0.0.1:{free_port()}"
        peer = f"http://127.0.0.1:{free_port()}"
        health = f"http://127.0.0.1:{free_port()}/health"
        self.log = open(os.path.join(self.dir, "etcd.log"), "w")
        self.proc = subprocess.Popen(
            [binary, "--name", "py", "--data-dir", os.path.join(self.dir, "data"),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"py={peer}", "--initial-cluster-state", "new",
             "--listen-metrics-urls", health.rsplit("/", 1)[0]],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(health, timeout=1) as r:
                    if json.loads(r.read()).get("health") == "true":
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                log = self.tail()
                self.stop()
                raise AssertionError(f"etcd did not become healthy; its log:\n{log}")
            time.sleep(0.1)

    def tail(self):
        with open(os.path.join(self.dir, "etcd.log")) as f:
            return "".join(f.readlines()[-20:])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def etcd():
    """One etcd for the session when the binary is installed, else None."""
    binary = os.environ.get("FAIRPLACE_ETCD") or shutil.which("etcd")
    if not binary:
        yield None
        return
    e = Etcd(binary)
    yield e
    e.stop()


def require_etcd(etcd, what):
    """Skips the calling test without etcd, saying why; fails instead under
    FAIRPLACE_REQUIRE_ETCD=1."""
    if etcd is None:
        if REQUIRE_ETCD:
            pytest.fail(f"{what}: {NO_ETCD}, and FAIRPLACE_REQUIRE_ETCD=1 requires it", pytrace=False)
        pytest.skip(f"{what}: {NO_ETCD}")


def start_server(*extra, words_out=None, etcd=None, replica_id="py-1", replica_args=()):
    """Starts fairplace-server on free ports; returns (process, grpc, metrics url).
    words_out, a dict, receives every key=value of the server's first line.
    With etcd (an Etcd) the server is a replica: replica_id, alone in a
    replica set of its own (a key prefix of its own on that etcd), so it owns
    every node; its gRPC port is picked here, since it must advertise it
    (--advertise-addr). replica_args are passed then only (under mutual TLS:
    --replica-tls-cert/--replica-tls-key)."""
    # Each server keeps its leases in a directory of its own (in etcd, when
    # a replica, but the directory does no harm).
    state = tempfile.mkdtemp(prefix="fairplace-py-state-")
    grpc_addr, replica = "127.0.0.1:0", []
    if etcd is not None:
        grpc_addr = f"127.0.0.1:{free_port()}"
        replica = ["--etcd-endpoints", etcd.url, "--etcd-prefix", f"/fairplace-py-{secrets.token_hex(6)}/",
                   "--replica-id", replica_id, "--advertise-addr", grpc_addr, *replica_args]
    srv = subprocess.Popen(
        [os.path.join(BIN, "fairplace-server"), "serve", "--grpc-addr", grpc_addr,
         "--metrics-addr", "127.0.0.1:0", "--state-dir", state, *replica, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = srv.stdout.readline()
    words = dict(w.split("=", 1) for w in line.split() if "=" in w)
    if words_out is not None:
        words_out.update(words)
    return srv, words["grpc"], words["metrics"]


class Pki:
    """A PKI made with the openssl command line, independently of the
    server's own code: a CA, a server certificate for 127.0.0.1/localhost
    with the server's SPIFFE ID (agents require it), and client certificates
    whose URI SAN is spiffe://fairplace/ROLE/NAME."""

    def __init__(self, trust_domain="fairplace"):
        assert shutil.which("openssl"), "the openssl command is needed"
        self.dir = tempfile.mkdtemp(prefix="fairplace-py-pki-")
        self.td = trust_domain
        self._run("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                  "-keyout", self.path("ca.key"), "-out", self.path("ca.crt"), "-days", "2",
                  "-subj", "/CN=fairplace python test CA")
        self.leaf("server", f"subjectAltName=DNS:localhost,IP:127.0.0.1,URI:spiffe://{self.td}/server/localhost"
                            "\nextendedKeyUsage=serverAuth")

    def path(self, name):
        return os.path.join(self.dir, name)

    def _run(self, *args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    def leaf(self, name, extensions):
        ext = self.path(name + ".ext")
        with open(ext, "w") as f:
            f.write("basicConstraints=CA:FALSE\n" + extensions + "\n")
        self._run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                  "-keyout", self.path(name + ".key"), "-out", self.path(name + ".csr"), "-subj", "/CN=" + name)
        self._run("x509", "-req", "-in", self.path(name + ".csr"), "-CA", self.path("ca.crt"),
                  "-CAkey", self.path("ca.key"), "-set_serial", "0x" + secrets.token_hex(12), "-days", "2",
                  "-out", self.path(name + ".crt"), "-extfile", ext)
        return self.path(name + ".crt"), self.path(name + ".key")

    def client(self, role, name):
        """Makes ROLE-NAME.crt/.key; returns (cert, key) paths."""
        return self.leaf(f"{role}-{name}",
                         f"subjectAltName=URI:spiffe://{self.td}/{role}/{name}\nextendedKeyUsage=clientAuth")

    def server_args(self):
        return ["--tls-cert", self.path("server.crt"), "--tls-key", self.path("server.key"),
                "--client-ca", self.path("ca.crt")]

    def replica_args(self, name):
        """A replica's peer certificate (spiffe://TD/replica/NAME) as the
        server's --replica-tls-cert/--replica-tls-key."""
        cert, key = self.client("replica", name)
        return ["--replica-tls-cert", cert, "--replica-tls-key", key]

    def tls_args(self, role, name):
        cert, key = self.client(role, name)
        return ["--tls-ca", self.path("ca.crt"), "--tls-cert", cert, "--tls-key", key]

    def credentials(self, role=None, name=None):
        """grpc channel credentials trusting the CA, with a client
        certificate when a role is given."""
        import grpc
        ca = open(self.path("ca.crt"), "rb").read()
        if role is None:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        cert, key = self.client(role, name)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=open(key, "rb").read(),
                                            certificate_chain=open(cert, "rb").read())

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def pki():
    p = Pki()
    yield p
    p.cleanup()
