"""Shared fixtures: stubs generated from the .proto files, and the binaries."""
import importlib
import os
import socket
import subprocess
import sys
import tempfile

import pytest
from grpc_tools import protoc

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("FAIRPLACE_BIN_DIR", os.path.join(ROOT, "target", "debug"))
PROTOS = ["types", "agent", "placement", "admin"]


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


def start_server(*extra):
    """Starts fairplace-server on free ports; returns (process, grpc, metrics url)."""
    srv = subprocess.Popen(
        [os.path.join(BIN, "fairplace-server"), "serve", "--grpc-addr", "127.0.0.1:0",
         "--metrics-addr", "127.0.0.1:0", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = srv.stdout.readline()
    words = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return srv, words["grpc"], words["metrics"]
