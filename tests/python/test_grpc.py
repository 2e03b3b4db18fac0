"""An independent gRPC peer: Python stubs generated from the .proto files call
PickCpu, PickCpus, Decide and the health check against the real server and agent, over
mutual TLS with certificates made by the openssl command line.

Run by .ci/run after `cargo test --workspace` (which builds the binaries):
    python3 -m pytest tests/python
FAIRPLACE_BIN_DIR overrides where the binaries are (default target/debug).
With etcd installed the server is a replica on it (conftest.py): one replica
alone owns every node, so everything here holds as for a single server, and
it is checked with the replica certificate the server must then have.
"""
import json
import os
import subprocess
import tempfile
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import BIN, ROOT, Pki, require_etcd, start_server


SERVER = {}


@pytest.fixture(scope="module")
def server(pki, etcd):
    srv, grpc_addr, _ = start_server(*pki.server_args(), "--health-addr", "127.0.0.1:0", words_out=SERVER,
                                     etcd=etcd, replica_id="py-1", replica_args=pki.replica_args("py-1"))
    agent = subprocess.Popen(
        [os.path.join(BIN, "fairplace-agent"), "--server", grpc_addr, "--node-id", "py", "--interval-ms", "200",
         "--state-dir", tempfile.mkdtemp(prefix="fairplace-py-agent-"), *pki.tls_args("node", "py")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield grpc_addr
    agent.terminate()
    srv.terminate()
    agent.wait(10)
    srv.wait(10)


def channel(pki, server, role="orchestrator", name="py-orch"):
    """A mutual-TLS channel with a certificate for ROLE/NAME."""
    return grpc.secure_channel(server, pki.credentials(role, name))


def wait_node(stubs, channel):
    admin = stubs["admin_grpc"].AdminServiceStub(channel)
    for _ in range(200):
        nodes = admin.ListNodes(stubs["admin"].ListNodesRequest(), timeout=2).nodes
        if any(n.id == "py" and n.fresh for n in nodes):
            return next(n for n in nodes if n.id == "py")
        time.sleep(0.05)
    raise AssertionError("the agent's node never became fresh")


def test_the_server_is_a_replica_on_etcd(stubs, pki, server, etcd):
    """With etcd installed, everything in this file runs against a replica
    (alone in its set, so it owns the agent's node) under mutual TLS."""
    require_etcd(etcd, "the gRPC peer against a replica")
    with channel(pki, server) as ch:
        wait_node(stubs, ch)
    with urllib.request.urlopen(SERVER["metrics"], timeout=5) as r:
        series = dict(line.rsplit(" ", 1) for line in r.read().decode().splitlines()
                      if line.startswith("fairplace_replica_") and "{" not in line)
    assert series.get("fairplace_replica_members") == "1", series
    assert series.get("fairplace_replica_etcd_up") == "1", series
    assert series.get("fairplace_replica_leader") == "1", series
    assert int(series.get("fairplace_replica_owned_nodes", "0")) >= 1, series


def test_health_check_serves(pki, server):
    with channel(pki, server) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "fairplace.v1.PlacementService"):
            r = h.Check(health_pb2.HealthCheckRequest(service=svc), timeout=2)
            assert r.status == health_pb2.HealthCheckResponse.SERVING
    # The plaintext health-only listener, for probes without a certificate.
    with grpc.insecure_channel(SERVER["health"]) as ch:
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        assert r.status == health_pb2.HealthCheckResponse.SERVING


def test_nothing_works_without_a_trusted_certificate(stubs, pki, server):
    admin = stubs["admin"]
    for ch in (grpc.insecure_channel(server), grpc.secure_channel(server, pki.credentials())):
        with ch:
            with pytest.raises(grpc.RpcError) as e:
                stubs["admin_grpc"].AdminServiceStub(ch).ListNodes(admin.ListNodesRequest(), timeout=2)
            assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAUTHENTICATED)
    # Another CA's certificate with a valid SPIFFE ID.
    other = Pki()
    try:
        cert, key = other.client("admin", "mallory")
        creds = grpc.ssl_channel_credentials(root_certificates=open(pki.path("ca.crt"), "rb").read(),
                                             private_key=open(key, "rb").read(),
                                             certificate_chain=open(cert, "rb").read())
        with grpc.secure_channel(server, creds) as ch:
            with pytest.raises(grpc.RpcError) as e:
                stubs["admin_grpc"].AdminServiceStub(ch).ListNodes(admin.ListNodesRequest(), timeout=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        other.cleanup()


def test_roles(stubs, pki, server):
    pl, adm = stubs["placement"], stubs["admin"]
    with channel(pki, server, "node", "py") as ch:
        with pytest.raises(grpc.RpcError) as e:
            stubs["placement_grpc"].PlacementServiceStub(ch).PickCpu(pl.PickCpuRequest(node_id="py"), timeout=2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with channel(pki, server) as ch:
        with pytest.raises(grpc.RpcError) as e:
            stubs["admin_grpc"].AdminServiceStub(ch).SetFeatures(
                adm.SetFeaturesRequest(set={"PREFER_LAST_IDLE_CPU": True}), timeout=2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "admin" in e.value.details()


def test_pick_cpu_on_the_agents_node(stubs, pki, server):
    with channel(pki, server) as ch:
        node = wait_node(stubs, ch)
        p = stubs["placement_grpc"].PlacementServiceStub(ch)
        t = stubs["types"].Task(prev_cpu=0)
        pl = stubs["placement"]
        r = p.PickCpu(pl.PickCpuRequest(node_id="py", task=t, kind=pl.REQUEST_KIND_WAKEUP, this_cpu=0), timeout=2)
        assert r.cpu < node.cpus
        assert r.path in {"target", "prev", "recent", "idle_smt", "idle_core", "core_scan_cpu", "idle_cpu",
                          "fallback_target", "no_llc", "per_cpu_kthread"}
        assert r.state_version >= 2
        r = p.PickCpu(pl.PickCpuRequest(node_id="py", kind=pl.REQUEST_KIND_FORK, this_cpu=0), timeout=2)
        assert r.path in {"slow_path", "no_domain"}
        with pytest.raises(grpc.RpcError) as e:
            p.PickCpu(pl.PickCpuRequest(node_id="py", task=t, this_cpu=100000), timeout=2)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("this_cpu:")


def hrw_weight(member, node):
    """The replicas' rendezvous weight (types/src/hrw.rs), written again here
    from its description: FNV-1a over MEMBER, a zero byte and NODE, then
    murmur3's fmix64."""
    mask = (1 << 64) - 1
    h = 0xcbf29ce484222325
    for b in member.encode() + b"\0" + node.encode():
        h = ((h ^ b) * 0x100000001b3) & mask
    h ^= h >> 33
    h = (h * 0xff51afd7ed558ccd) & mask
    h ^= h >> 33
    h = (h * 0xc4ceb9fe1a85ec53) & mask
    return h ^ (h >> 33)


def hrw_owner(members, node):
    """The member with the highest weight; ties to the smaller id."""
    return max(members, key=lambda m: (hrw_weight(m, node), [-c for c in m.encode()]))


def test_a_routing_client_in_python_finds_the_owner_and_calls_it(stubs, pki, server):
    """The routing protocol from another language: WatchMembers gives the
    set and the hash, the owner computed here answers a routed call itself.
    A single server says it is not replicated and ends the stream."""
    with channel(pki, server) as ch:
        wait_node(stubs, ch)
        admin = stubs["admin_grpc"].AdminServiceStub(ch)
        sets = admin.WatchMembers(stubs["admin"].WatchMembersRequest(), timeout=5)
        first = next(iter(sets))
        sets.cancel()
        assert first.owner_hash == "rendezvous-fnv1a-fmix64"
        if not first.replicated:
            assert not first.members
            return
        ids = [m.id for m in first.members]
        assert ids == sorted(ids) and first.replica_id in ids
        owner = next(m for m in first.members if m.id == hrw_owner(ids, "py"))
    with channel(pki, owner.addr) as ch:
        p = stubs["placement_grpc"].PlacementServiceStub(ch)
        pl = stubs["placement"]
        r = p.PickCpu(pl.PickCpuRequest(node_id="py", kind=pl.REQUEST_KIND_FORK, this_cpu=0), timeout=2,
                      metadata=(("fairplace-routed", "1"),))
        assert r.node_id == "py"


def test_the_rendezvous_weight_is_the_servers():
    """The same values the Rust implementation is tested for (types/src/hrw.rs)."""
    assert hrw_weight("r0", "node-0") == 0xfcb4ada229a6710e
    assert hrw_weight("r1", "node-0") == 0xad7b92532f1d145e
    assert hrw_weight("r2", "scale-17") == 0xf35f0ab657372a13
    assert hrw_weight("replica-a", "vm") == 0xde4b5bd90f818a72


def test_the_rendezvous_weight_spreads_nodes_over_members_as_the_servers_do():
    """The Python weight gives each of three members about a third of 30,000
    nodes, and a member leaving moves only its own nodes (the properties the
    Rust unit tests check of the servers' own)."""
    members = ["r0", "r1", "r2"]
    owners = {f"node-{i}": hrw_owner(members, f"node-{i}") for i in range(30000)}
    for m in members:
        assert 9500 < sum(1 for o in owners.values() if o == m) < 10500
    for n, o in owners.items():
        if o != "r1":
            assert hrw_owner(["r0", "r2"], n) == o


def test_pick_cpus_answers_each_request_in_order_as_pick_cpu_would(stubs, pki, server):
    """PickCpus from a peer of another language: every request answered in
    order, a bad one with its own error and the stream going on, and the
    answers the unary call gives for the same requests."""
    with channel(pki, server) as ch:
        node = wait_node(stubs, ch)
        p = stubs["placement_grpc"].PlacementServiceStub(ch)
        pl, ty = stubs["placement"], stubs["types"]
        good = pl.PickCpuRequest(node_id="py", task=ty.Task(prev_cpu=0), kind=pl.REQUEST_KIND_WAKEUP, this_cpu=0)
        bad = pl.PickCpuRequest(node_id="py", task=ty.Task(prev_cpu=0), this_cpu=100000)
        missing = pl.PickCpuRequest(node_id="no-such-node", kind=pl.REQUEST_KIND_FORK)
        reqs = [good, bad, good, missing] + [good] * 96
        answers = list(p.PickCpus(iter(reqs), timeout=10))
        assert [a.seq for a in answers] == list(range(len(reqs)))
        assert answers[1].WhichOneof("result") == "error"
        assert answers[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert answers[1].error.message.startswith("this_cpu:")
        assert answers[3].error.code == grpc.StatusCode.NOT_FOUND.value[0]
        unary = p.PickCpu(good, timeout=2)
        oks = answers[:1] + answers[2:3] + answers[4:]
        for a in oks:
            assert a.WhichOneof("result") == "ok"
            assert a.ok.cpu < node.cpus
        # On the same state (the agent reports every 200 ms), the same answer.
        for a in oks:
            if a.ok.state_version == unary.state_version:
                assert (a.ok.cpu, a.ok.path) == (unary.cpu, unary.path)
        # A node certificate may not use it, as it may not use PickCpu.
    with channel(pki, server, role="node", name="py") as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(stubs["placement_grpc"].PlacementServiceStub(ch).PickCpus(iter([good]), timeout=2))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_decide_matches_the_expected_answers(stubs, pki, server):
    with open(os.path.join(ROOT, "server", "tests", "cases", "examples.jsonl")) as f:
        scenarios = [json.loads(l) for l in f if l.strip()]
    with channel(pki, server) as ch:
        p = stubs["placement_grpc"].PlacementServiceStub(ch)
        for s in scenarios:
            a = json.loads(p.Decide(stubs["placement"].DecideRequest(scenario_json=json.dumps(s)), timeout=5).answer_json)
            e = s["expected"]
            keys = ["cpu", "path", "scanned"] if "cpu" in e else ["allowed", "new_dst_cpu", "flags", "reason"]
            assert {k: a[k] for k in keys} == {k: e[k] for k in keys}, s.get("name")


def test_balance_proposes_moving_a_task_to_the_idle_cpu(stubs, pki, server):
    """A Python agent stream reports two CPUs, one running three cold tasks
    and one idle; Balance from the idle CPU proposes one migration (the MC
    domain: sibling imbalance 3 - 0 = 3, halved = 1 task), the coldest
    (tail) task first, and refuses the running one."""
    ty, agm, pl = stubs["types"], stubs["agent"], stubs["placement"]
    topo = ty.Topology(cpus=[ty.CpuTopology(id=k, core=k, llc=0) for k in range(2)])
    clock = 10_000_000_000
    cpus = [agm.CpuState(id=0, online=True, nr_running=3, load_avg=3072, runnable_avg=3072,
                         util_avg=1000, util_est=1000),
            agm.CpuState(id=1, online=True)] if hasattr(agm, "CpuState") else [
            ty.CpuState(id=0, online=True, nr_running=3, load_avg=3072, runnable_avg=3072,
                        util_avg=1000, util_est=1000),
            ty.CpuState(id=1, online=True)]
    tasks = [agm.CpuTasks(cpu=0, clock_task=clock, tasks=[
        agm.RunnableTask(id=10 + j, group=5, load_avg=1024, util_avg=333, runnable_avg=1024,
                         running=(j == 0), exec_start=clock - 10_000_000 * (j + 1), nr_threads=3)
        for j in range(3)])]
    msgs = [agm.AgentMessage(register=agm.Register(node_id="pybal", topology=topo)),
            agm.AgentMessage(update=agm.Update(seq=1, full=True, cpus=cpus, tasks=tasks))]
    # The stream with a node certificate for pybal, the calls as an orchestrator.
    with channel(pki, server, "node", "pybal") as ch:
        acks = list(stubs["agent_grpc"].AgentServiceStub(ch).Report(iter(msgs), timeout=5))
        assert not acks[-1].HasField("rejection"), acks[-1]
    with channel(pki, server) as ch:
        p = stubs["placement_grpc"].PlacementServiceStub(ch)
        # The stream ended, but the node stays registered and fresh.
        r = p.Balance(pl.BalanceRequest(node_id="pybal", cpus="1"), timeout=5)
        assert len(r.proposals) == 1, r
        prop = r.proposals[0]
        # Tasks are ordered by exec_start, most recent first: 10 (running),
        # 11, 12; the tail is task 12.
        assert (prop.task, prop.src_cpu, prop.dst_cpu) == (12, 0, 1)
        assert prop.migration_type == pl.MIGRATION_TYPE_TASK
        with pytest.raises(grpc.RpcError) as e:
            p.Balance(pl.BalanceRequest(node_id="pybal", cpus="7"), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cpus" in e.value.details()
