"""The dashboards and rules work as shipped: a real Prometheus (the Debian
package, started here on loopback with deploy/prometheus/prometheus.test.yml.tmpl)
scrapes a real server and agent; after some PickCpu, CanMigrate, claim and
bad-input traffic, every panel query of every dashboard in deploy/grafana
and every recording rule must return data, and every alert expression must
evaluate. A panel whose query returns nothing fails with its title.

With etcd installed the server is a replica (dash-1) on a real single-member
etcd (conftest.py), so the replica panels (the fairplace_replica_* series,
which only a replica exports) return data too, and the replica alerts must
be quiet on that healthy replica. Without etcd those checks skip, saying so
(they fail under FAIRPLACE_REQUIRE_ETCD=1); everything else is checked alike.

Run by .ci/run (which installs prometheus and etcd) after `cargo test --workspace`.
"""
import glob
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import grpc
import pytest
import yaml

from conftest import BIN, ROOT, free_port, require_etcd, start_server

SIM_NODES = 3
DEPLOY = os.path.join(ROOT, "deploy")


def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def query(prom, expr):
    q = urllib.parse.urlencode({"query": expr})
    return get(f"http://{prom}/api/v1/query?{q}")


def replica_only(expr):
    """A query of the series only a replica (--etcd-endpoints) exports."""
    return "fairplace_replica_" in expr


@pytest.fixture(scope="module")
def stack(stubs, etcd):
    assert shutil.which("prometheus"), "prometheus is not installed (apt-get install prometheus)"
    srv, grpc_addr, metrics_url = start_server("--claim-ttl-ms", "200", etcd=etcd, replica_id="dash-1")
    agent_metrics = f"127.0.0.1:{free_port()}"
    agent = subprocess.Popen(
        [os.path.join(BIN, "fairplace-agent"), "--server", grpc_addr, "--node-id", "dash",
         "--simulate", str(SIM_NODES), "--simulate-cpus", "16", "--interval-ms", "200",
         "--simulate-tasks", "--simulate-llc-cpus", "8", "--label", "zone=z1", "--label", "rack=r1",
         "--metrics-addr", agent_metrics, "--state-dir", tempfile.mkdtemp(prefix="fairplace-py-agent-")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    tmp = tempfile.mkdtemp(prefix="fairplace-prom-")
    with open(os.path.join(DEPLOY, "prometheus", "prometheus.test.yml.tmpl")) as f:
        cfg = f.read()
    server_target = metrics_url.split("//", 1)[1].split("/", 1)[0]
    cfg = (cfg.replace("__SERVER__", server_target).replace("__AGENT__", agent_metrics)
           .replace("__RULES_DIR__", os.path.join(DEPLOY, "prometheus", "rules")))
    cfg_path = os.path.join(tmp, "prometheus.yml")
    with open(cfg_path, "w") as f:
        f.write(cfg)
    prom_addr = f"127.0.0.1:{free_port()}"
    prom = subprocess.Popen(
        ["prometheus", f"--config.file={cfg_path}", f"--storage.tsdb.path={tmp}/data",
         f"--web.listen-address={prom_addr}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://{prom_addr}/-/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.2)
        else:
            raise AssertionError("prometheus did not become ready")
        traffic(stubs, grpc_addr, seconds=8)
        yield prom_addr
    finally:
        for p in (prom, agent, srv):
            p.terminate()
        for p in (prom, agent, srv):
            p.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)


def traffic(stubs, addr, seconds):
    """Decisions of every kind, claims, migration checks, node and rack
    balance passes, leases granted and released, and some bad input, spread
    over several scrapes."""
    pl, ty, ad = stubs["placement"], stubs["types"], stubs["admin"]
    with grpc.insecure_channel(addr) as ch:
        p = stubs["placement_grpc"].PlacementServiceStub(ch)
        a = stubs["admin_grpc"].AdminServiceStub(ch)
        for _ in range(100):
            if len([n for n in a.ListNodes(ad.ListNodesRequest()).nodes if n.fresh]) >= SIM_NODES:
                break
            time.sleep(0.1)
        nodes = [n.id for n in a.ListNodes(ad.ListNodesRequest()).nodes]
        assert len(nodes) >= SIM_NODES
        end = time.time() + seconds
        i = 0
        while time.time() < end:
            node = nodes[i % len(nodes)]
            for kind in (pl.REQUEST_KIND_WAKEUP, pl.REQUEST_KIND_FORK, pl.REQUEST_KIND_EXEC):
                try:
                    p.PickCpu(pl.PickCpuRequest(node_id=node, task=ty.Task(prev_cpu=i % 16), kind=kind,
                                                this_cpu=(i * 7) % 16, claim=(i % 3 == 0)), timeout=2)
                except grpc.RpcError:
                    pass  # exec on an idle CPU is refused: that is traffic too
            p.CanMigrate(pl.CanMigrateRequest(node_id=node, src_cpu=0, dst_cpu=1 + i % 15), timeout=2)
            if i % 5 == 0:
                b = p.Balance(pl.BalanceRequest(node_id=node), timeout=5)
                assert b.domains_balanced + b.domains_declined > 0
                p.Balance(pl.BalanceRequest(cluster_level="rack", cluster_group="z1/r1"), timeout=5)
                # A lease's life: the lease panels and the store's commits.
                lease = p.AllocateCpus(pl.AllocateCpusRequest(node_id=node, count=1, holder="dashboards"), timeout=5)
                p.ReleaseCpus(pl.ReleaseCpusRequest(lease_id=lease.lease_id), timeout=5)
            for bad in (pl.PickCpuRequest(node_id="nope"), pl.PickCpuRequest(node_id=node, this_cpu=99)):
                try:
                    p.PickCpu(bad, timeout=2)
                except grpc.RpcError:
                    pass
            i += 1
            time.sleep(0.02)
        # An agent update out of sequence, for the rejected-reports series.
        ag = stubs["agent_grpc"].AgentServiceStub(ch)
        topo = ty.Topology(cpus=[ty.CpuTopology(id=k, core=k, llc=0) for k in range(2)])
        agm = stubs["agent"]
        msgs = [agm.AgentMessage(register=agm.Register(node_id="rejecting", topology=topo)),
                agm.AgentMessage(update=agm.Update(seq=5, full=False))]
        acks = list(ag.Report(iter(msgs), timeout=5))
        assert acks[-1].rejection.reason == "out_of_sequence"
    time.sleep(3)  # a few more scrapes and rule evaluations


def substitute(expr, node):
    for k, v in (("${node}", node), ("$node", node), ("${datasource}", "prometheus"),
                 ("$__rate_interval", "30s"), ("${__rate_interval}", "30s"),
                 ("$__interval", "5s"), ("${__interval}", "5s"), ("$__range", "5m")):
        expr = expr.replace(k, v)
    return expr


def panels(dash):
    for p in dash.get("panels", []):
        yield p
        yield from p.get("panels", [])  # panels inside collapsed rows


def dashboards():
    files = sorted(glob.glob(os.path.join(DEPLOY, "grafana", "dashboards", "*.json")))
    assert files, "no dashboards shipped"
    return files


def check_panels(prom, replica):
    """Queries every panel target (those of the replica panels, or all the
    others); returns (failures, queries checked)."""
    node = "dash-sim-0"
    failures, checked = [], 0
    for path in dashboards():
        with open(path) as f:
            dash = json.load(f)
        assert any(v.get("name") == "datasource" for v in dash["templating"]["list"]), path
        for p in panels(dash):
            for t in p.get("targets", []):
                if not t.get("expr") or replica_only(t["expr"]) != replica:
                    continue
                expr = substitute(t["expr"], node)
                r = query(prom, expr)
                checked += 1
                if r["status"] != "success":
                    failures.append(f"{os.path.basename(path)}: panel {p['title']!r}: error {r.get('error')}")
                elif not r["data"]["result"]:
                    failures.append(f"{os.path.basename(path)}: panel {p['title']!r}: no data for {expr}")
    return failures, checked


def test_every_dashboard_panel_returns_data(stack):
    failures, checked = check_panels(stack, replica=False)
    assert checked >= 10, f"only {checked} panel queries found"
    assert not failures, "\n".join(failures)


def test_every_replica_panel_returns_data(stack, etcd):
    require_etcd(etcd, "the replica panels (fairplace_replica_*, exported by a server on etcd)")
    failures, checked = check_panels(stack, replica=True)
    assert checked >= 8, f"only {checked} replica panel queries found"
    assert not failures, "\n".join(failures)


def rules():
    out = []
    for path in sorted(glob.glob(os.path.join(DEPLOY, "prometheus", "rules", "*.yml"))):
        with open(path) as f:
            for g in yaml.safe_load(f)["groups"]:
                out.extend(g["rules"])
    return out


def test_every_recording_rule_has_data_and_every_alert_evaluates(stack, etcd):
    loaded = get(f"http://{stack}/api/v1/rules")["data"]["groups"]
    assert loaded, "prometheus loaded no rule groups"
    for g in loaded:
        for r in g["rules"]:
            assert r["health"] == "ok", f"{r['name']}: {r.get('lastError')}"
    failures = []
    for r in rules():
        # A replica's recording rule can have data only from a replica.
        needs_data = "record" in r and (etcd is not None or not replica_only(r["expr"]))
        res = query(stack, r["expr"])
        if res["status"] != "success":
            failures.append(f"{r.get('record') or r.get('alert')}: {res.get('error')}")
        elif needs_data and not res["data"]["result"]:
            failures.append(f"recording rule {r['record']}: no data")
        elif needs_data:
            # The recorded series exists too, once evaluated.
            if not query(stack, r["record"])["data"]["result"]:
                failures.append(f"recording rule {r['record']}: not recorded")
    assert not failures, "\n".join(failures)


def test_replica_alerts_are_quiet_on_a_healthy_replica(stack, etcd):
    """The replica alerts evaluate on real series and stay quiet: every
    metric they name is exported by the replica, and none of their
    conditions holds (one member, itself the leader, owning no more nodes
    than are registered, etcd up); none is pending or firing."""
    require_etcd(etcd, "the replica alerts on a real replica")
    failures = []
    for r in rules():
        if "alert" not in r or not replica_only(r["expr"]):
            continue
        for name in sorted(set(re.findall(r"fairplace_[a-z0-9_]+", r["expr"]))):
            if not query(stack, f"count({name})")["data"]["result"]:
                failures.append(f"{r['alert']}: no series {name} from the replica")
        res = query(stack, r["expr"])
        if res["status"] != "success" or res["data"]["result"]:
            failures.append(f"{r['alert']}: {res.get('error') or res['data']['result']} on a healthy replica")
        active = query(stack, f'ALERTS{{alertname="{r["alert"]}"}}')["data"]["result"]
        if active:
            failures.append(f"{r['alert']}: {active[0]['metric'].get('alertstate')} on a healthy replica")
    assert not failures, "\n".join(failures)


def test_every_metric_named_is_documented():
    """Every fairplace_* metric a panel or a rule names is one that
    docs/metrics.md lists, so a misspelt name (which a fallback such as
    `or vector(0)` would hide) fails here."""
    with open(os.path.join(ROOT, "docs", "metrics.md")) as f:
        documented = set(re.findall(r"fairplace_[a-z0-9_]+", f.read()))
    exprs = []
    for path in dashboards():
        with open(path) as f:
            exprs += [(os.path.basename(path), t["expr"]) for p in panels(json.load(f))
                      for t in p.get("targets", []) if t.get("expr")]
    exprs += [(r.get("record") or r.get("alert"), r["expr"]) for r in rules()]
    missing = {f"{where}: {name}" for where, e in exprs for name in re.findall(r"fairplace_[a-z0-9_]+", e)
               if re.sub(r"_(bucket|sum|count)$", "", name) not in documented}
    assert not missing, "\n".join(sorted(missing))
