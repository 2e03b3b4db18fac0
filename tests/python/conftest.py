"""Shared fixtures: stubs generated from the .proto files, and the binaries."""
import importlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile

import pytest
from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("FAIRPLACE_BIN_DIR", os.path.join(ROOT, "target", "debug"))
PROTOS = ["types", "agent", "placement", "admin", "replica"]


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


def start_server(*extra, words_out=None):
    """Starts fairplace-server on free ports; returns (process, grpc, metrics url).
    words_out, a dict, receives every key=value of the server's first line."""
    # Each server keeps its leases in a directory of its own.
    state = tempfile.mkdtemp(prefix="fairplace-py-state-")
    srv = subprocess.Popen(
        [os.path.join(BIN, "fairplace-server"), "serve", "--grpc-addr", "127.0.0.1:0",
         "--metrics-addr", "127.0.0.1:0", "--state-dir", state, *extra],
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
