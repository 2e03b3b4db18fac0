#!/usr/bin/env python3
"""Random scenario generator for fairplace differential testing.

  python3 gen.py --seed S --count N            # N valid scenarios as JSON Lines (no "expected")
  python3 gen.py --seed S --count 3000 --histogram
                                               # run oracle.py in-process, print path/reason counts

Covers SMT1/2/4/8, 1-4 LLCs (more on 3-4 node boxes), clusters, 1-4 NUMA nodes with
non-uniform distances (some beyond node_reclaim_distance), 4-256 CPUs, packed and
x86-interleaved numbering, asymmetric capacities with pressure and uclamp, offline CPUs,
idle..busy states (SCHED_IDLE-only CPUs, ttwu_pending, vcpu_preempted, exit latencies,
stamps), all request kinds, all feature/system switches, llc/asym hints, narrow/wide
affinity, migration_disabled, core scheduling, and every can_migrate option.
The same seed always gives the same output.
"""

import argparse
import json
import os
import random
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import oracle  # noqa: E402  (used to learn domain names / object spans for hints)

FEATURES = list(oracle.FEATURES)


def cpulist(cpus):
    m = 0
    for c in cpus:
        m |= 1 << c
    return oracle.cpulist(m)


# ---------------------------------------------------------------------------
# Topology
# ---------------------------------------------------------------------------


def gen_topology(rng, force_clusters=False, force_smt=False):
    smt = rng.choice([2, 2, 4, 8] if force_smt else [1, 1, 2, 2, 2, 2, 4, 8])
    r = rng.random()
    if r < 0.5:
        n_nodes = 1
    elif r < 0.85:
        n_nodes = 2
    else:
        n_nodes = rng.choice([3, 4])
    if n_nodes == 1:
        llc_per_node = rng.choice([1, 1, 2, 2, 3, 4])
    elif n_nodes == 2:
        llc_per_node = rng.choice([1, 1, 2])
    else:
        llc_per_node = rng.choice([1, 1, 2]) if n_nodes == 3 else 1
    n_llc = n_nodes * llc_per_node
    size = rng.random()
    max_cores = 256 // smt
    lo = max(1, -(-4 // (smt * n_llc)))
    if size < 0.45:
        hi = max(lo, 16 // (smt * n_llc))
    elif size < 0.8:
        hi = max(lo, 64 // (smt * n_llc))
    else:
        hi = max(lo, max_cores // n_llc)
    hi = max(lo, min(hi, max_cores // n_llc))
    if rng.random() < 0.07:
        base_cores = 1                  # LLC = one core (no_llc targets with SMT1)
    elif size > 0.94:
        base_cores = max_cores // n_llc  # the full 256 CPUs
    else:
        base_cores = rng.randint(lo, hi)
    cores_per_llc = []
    for _ in range(n_llc):
        c = base_cores
        if rng.random() < 0.15:
            c = max(1, c + rng.randint(-2, 2))
        cores_per_llc.append(c)
    while sum(cores_per_llc) * smt > 256:
        i = max(range(n_llc), key=lambda k: cores_per_llc[k])
        cores_per_llc[i] -= 1
    while sum(cores_per_llc) * smt < 4:
        cores_per_llc[0] += 1
    clusters = force_clusters or rng.random() < 0.3
    cores_per_cluster = None
    if clusters:
        cores_per_cluster = rng.choice([1, 2, 2, 4, 4, 1000])  # 1 = core, 1000 = whole LLC
    if force_clusters:
        cores_per_cluster = rng.choice([1, 2, 4])
        smt = rng.choice([1, 1, 2])
        cores_per_llc = [max(c, 2 * cores_per_cluster) for c in cores_per_llc]
        while sum(cores_per_llc) * smt > 256:
            cores_per_llc = [max(2 * cores_per_cluster, c // 2) for c in cores_per_llc]
    # the logical structure: list of (node, llc, cluster, core) per core
    cores = []
    core_id = 0
    cluster_id = 0
    for L in range(n_llc):
        node = L // llc_per_node
        for k in range(cores_per_llc[L]):
            if clusters and k % cores_per_cluster == 0 and k > 0:
                cluster_id += 1
            cores.append({"node": node, "llc": L, "cluster": cluster_id, "core": core_id})
            core_id += 1
        cluster_id += 1
    n = len(cores) * smt
    interleaved = smt > 1 and rng.random() < 0.4
    cpu_of = {}
    cid = 0
    if interleaved:
        for t in range(smt):
            for k in range(len(cores)):
                cpu_of[(k, t)] = cid
                cid += 1
    else:
        for k in range(len(cores)):
            for t in range(smt):
                cpu_of[(k, t)] = cid
                cid += 1
    # id relabelling: ids need not be contiguous
    relabel = rng.random() < 0.2
    core_map = {k: (k * 3 + 7 if relabel else k) for k in range(len(cores))}
    llc_map = {L: (L * 2 + 1 if relabel else L) for L in range(n_llc)}
    node_ids = list(range(n_nodes))
    if n_nodes >= 2 and rng.random() < 0.1:
        node_ids[-1] = n_nodes          # non-contiguous node ids (matrix has an empty node)
    # capacities
    caps = [1024] * len(cores)
    asym_kind = None
    if rng.random() < 0.28:
        asym_kind = rng.choice(["dynamiq", "dynamiq", "per_llc", "per_cluster", "offline_only"])
        classes = sorted(rng.sample([160, 256, 383, 446, 512, 640, 768, 870, 1024], 2), reverse=True)
        if rng.random() < 0.4:
            classes = sorted(set(classes + [rng.choice([200, 600, 900])]), reverse=True)
        classes[0] = 1024 if rng.random() < 0.85 else classes[0]
        if asym_kind in ("dynamiq", "offline_only"):
            for L in range(n_llc):
                ks = [k for k in range(len(cores)) if cores[k]["llc"] == L]
                for j, k in enumerate(ks):
                    caps[k] = classes[min(len(classes) - 1, j * len(classes) // max(1, len(ks)))]
                    caps[k] = classes[len(classes) - 1 - classes.index(caps[k])] \
                        if rng.random() < 0.5 else caps[k]
        elif asym_kind == "per_llc":
            for k in range(len(cores)):
                caps[k] = classes[cores[k]["llc"] % len(classes)]
        else:
            for k in range(len(cores)):
                caps[k] = classes[cores[k]["cluster"] % len(classes)]
    tcpus = [None] * n
    for k, co in enumerate(cores):
        for t in range(smt):
            c = cpu_of[(k, t)]
            e = {"id": c, "core": core_map[k], "llc": llc_map[co["llc"]]}
            if clusters:
                e["cluster"] = co["cluster"] * (5 if relabel else 1)
            if n_nodes > 1 or rng.random() < 0.3:
                e["node"] = node_ids[co["node"]]
            if caps[k] != 1024 or rng.random() < 0.2:
                e["capacity"] = caps[k]
            tcpus[c] = e
    topo = {"cpus": tcpus}
    nn = max(node_ids) + 1
    if nn > 1 or rng.random() < 0.1:
        if rng.random() < 0.15 and nn > 1:
            pass                        # default matrix (20 off-diagonal)
        else:
            topo["numa_distance"] = gen_distance(rng, nn)
    return topo, {"smt": smt, "n_nodes": n_nodes, "n_llc": n_llc, "clusters": clusters,
                  "interleaved": interleaved, "asym": asym_kind, "n": n}


def gen_distance(rng, nn):
    d = [[10] * nn for _ in range(nn)]
    style = rng.random()
    if nn == 2:
        v = rng.choice([11, 12, 16, 20, 21, 21, 25, 30, 31, 32, 40])
        d[0][1] = d[1][0] = v
        return d
    if style < 0.5:
        # two "sockets" of nodes: near/far
        near = rng.choice([11, 12, 16, 20])
        far = rng.choice([21, 25, 30, 31, 32, 40])
        for a in range(nn):
            for b in range(nn):
                if a != b:
                    d[a][b] = near if a // 2 == b // 2 else far
    else:
        vals = [12, 16, 20, 21, 22, 25, 28, 30, 31, 32, 40]
        for a in range(nn):
            for b in range(a + 1, nn):
                v = rng.choice(vals)
                d[a][b] = d[b][a] = v
    return d


# ---------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------


def gen_state(rng, topo, info, core_sched):
    n = info["n"]
    tc = topo["cpus"]
    online = [True] * n
    r = rng.random()
    if r < 0.13:
        k = rng.randint(1, max(1, n // 4))
        for c in rng.sample(range(n), k):
            online[c] = False
    elif r < 0.17:
        # keep only a few CPUs online (lone CPUs in an LLC / node, single-CPU machine)
        keep = rng.sample(range(n), rng.choice([1, 1, 2, 3]))
        for c in range(n):
            online[c] = c in keep
    elif r < 0.21:
        # all but one CPU of one LLC offline
        llc = rng.choice([e["llc"] for e in tc])
        members = [e["id"] for e in tc if e["llc"] == llc]
        keep = rng.choice(members)
        for c in members:
            online[c] = c == keep
    if info["asym"] == "offline_only":
        for e in tc:
            if e.get("capacity", 1024) != 1024:
                online[e["id"]] = False
    if not any(online):
        online[rng.randrange(n)] = True
    p_busy = rng.choice([0.0, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0])
    p_schedidle = rng.choice([0.0, 0.0, 0.1, 0.3, 0.7])
    p_pending = rng.choice([0.0, 0.0, 0.05, 0.2])
    p_vcpu = rng.choice([0.0, 0.0, 0.0, 0.1, 0.3])
    p_pressure = rng.choice([0.0, 0.0, 0.1, 0.3])
    util_level = rng.choice([0.2, 0.5, 0.8, 1.0])
    cookies = {}
    cpus = []
    for c in range(n):
        e = {"id": c}
        cap_orig = tc[c].get("capacity", 1024)
        if not online[c]:
            e["online"] = False
            if rng.random() < 0.3:
                e["nr_running"] = rng.randint(0, 3)      # ignored for offline CPUs
            cpus.append(e)
            continue
        busy = rng.random() < p_busy
        if busy:
            nr = 1 if rng.random() < 0.6 else rng.randint(2, 6)
            e["nr_running"] = nr
            if rng.random() < p_schedidle:
                e["h_nr_idle"] = nr
            elif rng.random() < 0.15:
                e["h_nr_idle"] = rng.randint(0, nr - 1)
            if rng.random() < 0.15:
                e["nr_delayed"] = rng.randint(0, nr)
            if rng.random() < 0.05:
                e["curr_is_idle"] = True                # idle task still current
            u = int(rng.randint(50, 1024) * util_level)
            e["util_avg"] = min(u, cap_orig)
            e["util_est"] = rng.randint(0, e["util_avg"] + 100)
            e["load_avg"] = rng.randint(100, 1200) * nr
            e["runnable_avg"] = min(INT31, e["util_avg"] + rng.randint(0, 600) * (nr - 1))
        else:
            if rng.random() < 0.02:
                e["curr_is_idle"] = False
            if rng.random() < p_pending:
                e["ttwu_pending"] = True
            if rng.random() < 0.3:
                e["util_avg"] = rng.randint(0, 80)
                e["load_avg"] = rng.randint(0, 100)
                e["runnable_avg"] = e["util_avg"]
                e["util_est"] = rng.randint(0, 40)
            lat = rng.choice([None, None, 0, 1, 2, 10, 20, 100, 150])
            if lat is not None:
                e["idle_exit_latency"] = lat
            if rng.random() < 0.7:
                e["idle_stamp"] = rng.choice([0, rng.randint(1, 10 ** 6)])
        if rng.random() < p_vcpu:
            e["vcpu_preempted"] = True
        if rng.random() < p_pressure:
            e["capacity"] = rng.randint(max(1, cap_orig // 3), cap_orig)
        if rng.random() < p_pressure:
            e["actual_capacity"] = rng.randint(0, cap_orig)
        if rng.random() < 0.03:
            e["curr_is_per_cpu_kthread"] = True
        if rng.random() < 0.05:
            e["cfs_h_nr_queued"] = rng.randint(0, e.get("nr_running", 0) + 2)
        if core_sched:
            core = tc[c]["core"]
            if core not in cookies:
                cookies[core] = rng.choice([0, 0, 1, 2])
            if cookies[core]:
                e["core_cookie"] = cookies[core]
        cpus.append(e)
    # drop CPUs with all defaults (and some others entirely: defaults = idle)
    return [e for e in cpus if len(e) > 1], online


INT31 = (1 << 31) - 1


def cpu_entry(cpus, c):
    for e in cpus:
        if e["id"] == c:
            return e
    e = {"id": c}
    cpus.append(e)
    cpus.sort(key=lambda x: x["id"])
    return e


def make_busy(cpus, c, nr=1):
    e = cpu_entry(cpus, c)
    e["nr_running"] = max(nr, e.get("nr_running", 0))
    e["curr_is_idle"] = False
    e.pop("h_nr_idle", None)
    e.pop("nr_delayed", None)
    e.setdefault("load_avg", 700)
    e.setdefault("util_avg", 400)


def make_idle(cpus, c):
    e = cpu_entry(cpus, c)
    for k in ("nr_running", "h_nr_idle", "nr_delayed", "ttwu_pending", "vcpu_preempted",
              "curr_is_idle"):
        e.pop(k, None)


# ---------------------------------------------------------------------------
# Task / request
# ---------------------------------------------------------------------------


def gen_affinity(rng, topo, online):
    n = len(online)
    tc = topo["cpus"]
    r = rng.random()
    on = [c for c in range(n) if online[c]]
    if r < 0.45:
        return None
    if r < 0.53:
        node = rng.choice([e.get("node", 0) for e in tc])
        s = [e["id"] for e in tc if e.get("node", 0) == node]
    elif r < 0.62:
        llc = rng.choice([e["llc"] for e in tc])
        s = [e["id"] for e in tc if e["llc"] == llc]
    elif r < 0.70:
        a = rng.randrange(n)
        b = rng.randrange(a, n)
        s = list(range(a, b + 1))
    elif r < 0.82:
        dens = rng.choice([0.2, 0.5, 0.8])
        s = [c for c in range(n) if rng.random() < dens]
    elif r < 0.90:
        s = [rng.choice(on) if rng.random() < 0.9 else rng.randrange(n)]
    elif r < 0.95:
        s = rng.sample(range(n), min(2, n))
    else:
        off = [c for c in range(n) if not online[c]]
        s = off[:rng.randint(1, len(off))] if off else [rng.randrange(n)]
        if rng.random() < 0.5:
            s.append(rng.randrange(n))
    if not s:
        s = [rng.randrange(n)]
    return sorted(set(s))


def gen_task(rng, topo, online, kind, core_sched, n_nodes):
    n = len(online)
    t = {}
    t["policy"] = rng.choices(["normal", "batch", "idle"], [70, 15, 15])[0]
    if rng.random() < 0.15:
        t.pop("policy")
    aff = gen_affinity(rng, topo, online)
    if aff is not None:
        t["cpus_allowed"] = cpulist(aff)
    t["util_avg"] = rng.choice([0, rng.randint(0, 200), rng.randint(0, 1024)])
    t["util_est"] = rng.choice([0, rng.randint(0, 1024)])
    t["runnable_avg"] = rng.randint(0, 1100)
    t["load_avg"] = rng.randint(0, 2048)
    if rng.random() < 0.3:
        t["uclamp_min"] = rng.choice([0, 128, 256, 512, 768, 1024])
        t["uclamp_max"] = rng.choice([128, 256, 512, 768, 1024, 1024])
    t["wakee_flips"] = rng.randint(0, 5) if rng.random() < 0.7 else rng.randint(0, 300)
    if rng.random() < 0.04:
        t["migration_disabled"] = True
    if core_sched or rng.random() < 0.05:
        t["core_cookie"] = rng.choice([0, 0, 1, 2])
    if rng.random() < 0.15:
        t["numa_preferred_nid"] = rng.choice([-1] + list(range(n_nodes)))
    return t


def pick_online(rng, online):
    on = [c for c in range(len(online)) if online[c]]
    return rng.choice(on)


def gen_request(rng, kind, topo, online, cpus, task, meta):
    n = len(online)
    tc = topo["cpus"]
    req = {"kind": kind}
    if kind != "can_migrate":
        this = pick_online(rng, online)
        req["this_cpu"] = this
        if kind == "exec":
            make_busy(cpus, this, 1)
            if rng.random() < 0.3:
                # the exec'ing task's own load/util is inside this CPU's averages
                e = cpu_entry(cpus, this)
                e["load_avg"] = e.get("load_avg", 0) + task.get("load_avg", 0)
        if kind == "wakeup":
            r = rng.random()
            allowed = [c for c in oracle.bits(oracle.parse_cpulist(task["cpus_allowed"], n, "x"))
                       if online[c]] if "cpus_allowed" in task else None
            if r < 0.12:
                prev = this
            elif allowed and r < 0.45:
                prev = rng.choice(allowed)
            elif r < 0.6:
                # same LLC as this
                llc = tc[this]["llc"]
                prev = rng.choice([e["id"] for e in tc if e["llc"] == llc])
            elif r < 0.94:
                prev = rng.randrange(n)
            else:
                off = [c for c in range(n) if not online[c]]
                prev = rng.choice(off) if off else rng.randrange(n)
            task["prev_cpu"] = prev
            rr = rng.random()
            if rr < 0.3:
                pass                                  # default: prev_cpu
            elif rr < 0.45:
                task["recent_used_cpu"] = None
            elif rr < 0.8:
                llc = tc[this]["llc"] if rng.random() < 0.5 else tc[prev]["llc"]
                task["recent_used_cpu"] = rng.choice([e["id"] for e in tc if e["llc"] == llc])
            else:
                task["recent_used_cpu"] = rng.randrange(n)
            if rng.random() < 0.3:
                req["sync"] = True
            if rng.random() < 0.05:
                req["wf_current_cpu"] = True
            if rng.random() < 0.1:
                req["in_task"] = False
            if rng.random() < 0.05:
                req["waker_exiting"] = True
            req["waker_wakee_flips"] = rng.randint(0, 4) if rng.random() < 0.7 else \
                rng.randint(0, 2000)
            if rng.random() < 0.3:
                req["waker_last_wakee_is_task"] = False
            if rng.random() < 0.2:
                req["waker_flip_decay_expired"] = True
            req["waker_load"] = rng.randint(0, 3000)
            if rng.random() < 0.05:
                req["waker_is_per_cpu_kthread"] = rng.random() < 0.8
            # recipes that bias towards rare paths
            r = rng.random()
            if r < 0.06:
                # per-CPU kthread waker stacking the wakee on its own CPU
                task["prev_cpu"] = this
                make_busy(cpus, this, 1)
                if rng.random() < 0.5:
                    cpu_entry(cpus, this)["curr_is_per_cpu_kthread"] = True
                else:
                    req["waker_is_per_cpu_kthread"] = True
                req.pop("in_task", None)
            elif r < 0.14:
                # wake_wide: both flip counts large compared with the LLC size
                req["waker_wakee_flips"] = rng.randint(64, 4000)
                task["wakee_flips"] = rng.randint(8, 300)
            elif r < 0.24 and task.get("recent_used_cpu") is not None:
                # target and prev busy, recent idle
                make_busy(cpus, this, rng.randint(1, 3))
                if online[task["prev_cpu"]]:
                    make_busy(cpus, task["prev_cpu"], rng.randint(1, 3))
                if online[task["recent_used_cpu"]]:
                    make_idle(cpus, task["recent_used_cpu"])
            elif r < 0.32:
                # this busy, prev idle or SCHED_IDLE-only in the same LLC
                make_busy(cpus, this, rng.randint(1, 2))
                llc = tc[this]["llc"]
                mem = [e["id"] for e in tc if e["llc"] == llc and online[e["id"]]
                       and e["id"] != this]
                if mem:
                    p = rng.choice(mem)
                    task["prev_cpu"] = p
                    if rng.random() < 0.5:
                        make_idle(cpus, p)
                    else:
                        make_busy(cpus, p, 1)
                        cpu_entry(cpus, p)["h_nr_idle"] = cpu_entry(cpus, p)["nr_running"]
                    if rng.random() < 0.5:
                        req["sync"] = True
    else:
        on = [c for c in range(n) if online[c]]
        src, dst = rng.sample(on, 2)
        req["src_cpu"], req["dst_cpu"] = src, dst
        if rng.random() < 0.25 and "cpus_allowed" not in task:
            task["cpus_allowed"] = cpulist([c for c in range(n) if c != dst
                                            and rng.random() < 0.6] or [src])
        req["idle"] = rng.choice(["idle", "not_idle", "newly_idle"])
        req["migration_type"] = rng.choice(["load", "load", "util", "task", "misfit"])
        if rng.random() < 0.5:
            req["flags"] = [f for f in oracle.LBF if rng.random() < 0.3]
        req["nr_balance_failed"] = 0 if rng.random() < 0.5 else rng.randint(1, 5)
        if rng.random() < 0.15:
            req["cache_nice_tries"] = rng.randint(0, 3)
        if rng.random() < 0.05:
            req["throttled"] = True
        if rng.random() < 0.2:
            req["dst_cfs_nr_queued"] = rng.randint(0, 3)
        now = rng.randint(10 ** 7, 10 ** 9)
        req["now"] = now
        task["exec_start"] = max(0, now - rng.randint(0, 1500000))
        for k, p in (("running", 0.12), ("sched_delayed", 0.08), ("next_buddy", 0.15),
                     ("blocked", 0.04), ("per_cpu_kthread", 0.04)):
            if rng.random() < p:
                task[k] = True
        if rng.random() < 0.25:
            task["eligible"] = False
        if rng.random() < 0.12:
            task["hot"] = rng.random() < 0.5
        meta["needs_domain_fields"] = True
    return req


def add_domain_fields(rng, sc_obj, req, n):
    """can_migrate: sd_level / dst_group / env_cpus drawn from dst's real domains."""
    try:
        tmp = oracle.Scenario(sc_obj)
    except oracle.ScenarioError:
        return
    tt = tmp.topo_tree
    chain = tt.sd[req["dst_cpu"]]
    if chain and rng.random() < 0.35:
        d = rng.choice(chain)
        req["sd_level"] = d.level
    elif rng.random() < 0.05:
        req["sd_level"] = None
    if rng.random() < 0.15:
        req["dst_group"] = cpulist([c for c in range(n) if rng.random() < 0.3])
    if rng.random() < 0.15:
        req["env_cpus"] = cpulist([c for c in range(n) if rng.random() < 0.6])


def add_hints(rng, sc_obj):
    try:
        tmp = oracle.Scenario(sc_obj)
    except oracle.ScenarioError:
        return
    tt = tmp.topo_tree
    tc = sc_obj["topology"]["cpus"]
    if rng.random() < 0.3:
        llc = {}
        for lid in sorted({e["llc"] for e in tc}):
            if rng.random() < 0.6:
                h = {}
                if rng.random() < 0.7:
                    size = sum(1 for e in tc if e["llc"] == lid)
                    h["nr_idle_scan"] = rng.choice([0, 1, 2, rng.randint(0, size)])
                if rng.random() < 0.5:
                    h["has_idle_cores"] = rng.random() < 0.5
                llc[str(lid)] = h
        if llc:
            sc_obj["llc"] = llc
    asym_objs = [k for k in tt.objects if k[0] == "asym"]
    if asym_objs and rng.random() < 0.35:
        asym = {}
        for k in asym_objs:
            if rng.random() < 0.7:
                h = {}
                if rng.random() < 0.7:
                    h["nr_idle_scan"] = rng.randint(0, oracle.weight(k[1]))
                if rng.random() < 0.4:
                    h["has_idle_cores"] = rng.random() < 0.5
                asym[oracle.cpulist(k[1])] = h
        if asym:
            sc_obj["asym"] = asym


def gen_features(rng):
    f = {}
    for name in FEATURES:
        r = rng.random()
        if r < 0.2:
            f[name] = not oracle.FEATURES[name]
        elif r < 0.3:
            f[name] = oracle.FEATURES[name]
    return f


def gen_system(rng):
    s = {}
    r = rng.random()
    if r < 0.2:
        s["uclamp_used"] = True
    elif r < 0.4:
        s["uclamp_used"] = False
    elif r < 0.45:
        s["uclamp_used"] = None
    core_sched = rng.random() < 0.15
    if core_sched or rng.random() < 0.05:
        s["core_sched"] = core_sched
    if rng.random() < 0.4:
        s["migration_cost_ns"] = rng.choice([-1, 0, 250000, 500000, 1000000])
    if rng.random() < 0.2:
        s["node_reclaim_distance"] = rng.choice([15, 20, 25, 30, 40])
    return s, core_sched


def cluster_aff_recipe(rng, sc, online):
    """Cluster machine: target's cluster busy, prev/recent idle in a sibling cluster of the
    same LLC, small scan budget -> prev_aff / recent_aff."""
    tc = sc["topology"]["cpus"]
    n = len(tc)
    cpus = sc.setdefault("cpus", [])
    task, req = sc["task"], sc["request"]
    by_llc = {}
    for e in tc:
        if online[e["id"]]:
            by_llc.setdefault(e["llc"], {}).setdefault(e["cluster"], []).append(e["id"])
    cands = [L for L, cl in by_llc.items() if len(cl) >= 2]
    if not cands:
        return
    L = rng.choice(cands)
    ca, cb = rng.sample(sorted(by_llc[L]), 2)
    this = rng.choice(by_llc[L][ca])
    other = rng.choice(by_llc[L][cb])
    for c in by_llc[L][ca]:
        make_busy(cpus, c, rng.randint(1, 2))
    make_busy(cpus, this, 1)
    cpu_entry(cpus, this)["nr_running"] = 1
    cpu_entry(cpus, this).pop("curr_is_per_cpu_kthread", None)
    core_of = {e["id"]: e["core"] for e in tc}
    for c in by_llc[L][cb]:
        if core_of[c] == core_of[other] and c != other:
            make_busy(cpus, c, 1)
    make_idle(cpus, other)
    req["this_cpu"] = this
    req["sync"] = True
    req["waker_wakee_flips"] = 0
    req.pop("waker_exiting", None)
    req.pop("wf_current_cpu", None)
    req.pop("waker_is_per_cpu_kthread", None)
    task["wakee_flips"] = 0
    task.pop("migration_disabled", None)
    if rng.random() < 0.5:
        task["prev_cpu"] = other                       # -> prev_aff
        task["recent_used_cpu"] = None
        task.pop("cpus_allowed", None)
    else:
        task["prev_cpu"] = this                        # -> recent_aff
        task["recent_used_cpu"] = other
        task.pop("cpus_allowed", None)
    sc["llc"] = {str(L): {"nr_idle_scan": rng.choice([0, 1, 2, len(by_llc[L][ca])]),
                          "has_idle_cores": False}}
    sc.pop("asym", None)
    feats = sc.setdefault("features", {})
    feats["SIS_UTIL"] = rng.random() < 0.9
    feats["WA_IDLE"] = True


def smt_scan_recipe(rng, sc, online):
    """SMT machine, every core of the target's LLC has a busy sibling (a stale has_idle_cores
    hint -> core_scan_cpu), or one core left wholly idle (-> idle_core)."""
    tc = sc["topology"]["cpus"]
    cpus = sc.setdefault("cpus", [])
    task, req = sc["task"], sc["request"]
    this = req["this_cpu"]
    L = tc[this]["llc"]
    cores = {}
    for e in tc:
        if e["llc"] == L and online[e["id"]]:
            cores.setdefault(e["core"], []).append(e["id"])
    keep_idle = rng.choice(sorted(cores)) if rng.random() < 0.4 else None
    for core, sib in cores.items():
        if core == keep_idle:
            for c in sib:
                make_idle(cpus, c)
            continue
        for c in sib:
            if rng.random() < 0.5:
                make_idle(cpus, c)
        busy = rng.sample(sib, rng.randint(1, len(sib)))
        for c in busy:
            make_busy(cpus, c, 1)
            if rng.random() < 0.15:
                cpu_entry(cpus, c)["h_nr_idle"] = 1
    make_busy(cpus, this, 1)
    if online[task["prev_cpu"]]:
        make_busy(cpus, task["prev_cpu"], 1)
    req.pop("wf_current_cpu", None)
    task.pop("migration_disabled", None)
    if keep_idle is None or rng.random() < 0.5:
        h = {"has_idle_cores": True}
        if rng.random() < 0.3:
            h["nr_idle_scan"] = rng.randint(0, 8)
        sc["llc"] = {str(L): h}


def gen_one(rng, seed, index):
    r = rng.random()
    recipe = "cluster_aff" if r < 0.04 else "smt_scan" if r < 0.10 else None
    topo, info = gen_topology(rng, force_clusters=recipe == "cluster_aff",
                              force_smt=recipe == "smt_scan")
    system, core_sched = gen_system(rng)
    cpus, online = gen_state(rng, topo, info, core_sched)
    n_online = sum(online)
    kind = rng.choices(["wakeup", "fork", "exec", "can_migrate"], [55, 15, 15, 15])[0]
    if recipe:
        kind = "wakeup"
    if kind == "can_migrate" and n_online < 2:
        kind = "wakeup"
    task = gen_task(rng, topo, online, kind, core_sched, info["n_nodes"])
    meta = {}
    req = gen_request(rng, kind, topo, online, cpus, task, meta)
    sc = {"version": 1, "name": f"gen{seed}-{index:05d}",
          "generator": {"tool": "gen.py", "seed": seed, "index": index,
                        "shape": {k: v for k, v in info.items()}}}
    feats = gen_features(rng)
    if kind == "exec" and rng.random() < 0.3:
        feats["EXEC_BOUND_FAST_PATH"] = False
        if rng.random() < 0.3:
            # nothing allowed in the balancing span: offline CPUs or another node only
            this = req["this_cpu"]
            tc = topo["cpus"]
            off = [c for c in range(info["n"]) if not online[c]]
            other = [e["id"] for e in tc if e.get("node", 0) != tc[this].get("node", 0)]
            pick = off if (off and rng.random() < 0.6) or not other else other
            if pick:
                task["cpus_allowed"] = cpulist(rng.sample(pick, rng.randint(1, len(pick))))
                task.pop("migration_disabled", None)
    if feats:
        sc["features"] = feats
    if system:
        sc["system"] = system
    sc["topology"] = topo
    if cpus:
        sc["cpus"] = cpus
    sc["task"] = task
    sc["request"] = req
    if meta.get("needs_domain_fields"):
        add_domain_fields(rng, sc, req, info["n"])
    if kind in ("wakeup", "fork", "exec"):
        add_hints(rng, sc)
    if recipe == "cluster_aff":
        cluster_aff_recipe(rng, sc, online)
    elif recipe == "smt_scan":
        smt_scan_recipe(rng, sc, online)
    if recipe:
        sc["generator"]["recipe"] = recipe
    # fork/exec: sometimes a stale prev_cpu / recent (ignored by the format)
    if kind in ("fork", "exec") and rng.random() < 0.1:
        task["prev_cpu"] = rng.randrange(info["n"])
    return sc


def generate(seed, count):
    rng = random.Random(seed)
    for i in range(count):
        yield gen_one(rng, seed, i)


# ---------------------------------------------------------------------------
# Self-check histogram
# ---------------------------------------------------------------------------

ALL_PATHS = ["bound", "current_cpu", "target", "prev", "per_cpu_kthread", "recent", "capacity",
             "capacity_none", "no_llc", "idle_smt", "idle_core", "core_scan_cpu", "idle_cpu",
             "prev_aff", "recent_aff", "fallback_target", "slow_path", "slow_path_prev",
             "no_domain", "fallback_rq", "exec_stay_inactive"]
ALL_REASONS = ["delayed", "throttled", "ineligible", "per_cpu_kthread", "blocked", "affinity",
               "running", "active_lb", "cold", "balance_failed", "hot"]


def histogram(seed, count):
    import time
    t0 = time.time()
    paths = {p: 0 for p in ALL_PATHS}
    reasons = {r: 0 for r in ALL_REASONS}
    kinds = {}
    errors = []
    scanned_total = 0
    for sc in generate(seed, count):
        res = oracle.decide(sc)
        kind = sc["request"]["kind"]
        if "error" in res:
            errors.append((sc["name"], res["error"]))
            continue
        key = res["path"] if "path" in res else res["reason"]
        kinds[(kind, key)] = kinds.get((kind, key), 0) + 1
        if "path" in res:
            paths[res["path"]] = paths.get(res["path"], 0) + 1
            scanned_total += res["scanned"]
        else:
            reasons[res["reason"]] = reasons.get(res["reason"], 0) + 1
    dt = time.time() - t0
    print(f"{count} scenarios (seed {seed}) in {dt:.1f}s, {len(errors)} invalid")
    for name, err in errors[:10]:
        print(f"  INVALID {name}: {err}")
    print("paths:")
    for p, v in paths.items():
        print(f"  {p:20} {v:6}" + ("   <-- never" if v == 0 else ""))
    print("reasons:")
    for r, v in reasons.items():
        print(f"  {r:20} {v:6}" + ("   <-- never" if v == 0 else ""))
    print("by kind:")
    for (k, p), v in sorted(kinds.items()):
        print(f"  {k:12} {p:20} {v:6}")
    print(f"total scanned: {scanned_total}")
    return 1 if errors else 0


def main(argv):
    ap = argparse.ArgumentParser(description="random valid fairplace scenarios (JSON Lines)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--histogram", action="store_true",
                    help="run the oracle on the generated scenarios and print path/reason counts")
    args = ap.parse_args(argv)
    if args.histogram:
        return histogram(args.seed, args.count)
    out = sys.stdout
    for sc in generate(args.seed, args.count):
        out.write(json.dumps(sc, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
