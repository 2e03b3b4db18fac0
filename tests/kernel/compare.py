#!/usr/bin/env python3
"""Compares the placements a live Linux kernel made (recorded by the guest
program of tests/kernel/guest as scenario lines on the serial console) with
`fairplace-server decide` on the same scenarios, and checks the topology the
guest kernel built against what the scenario's topology (read from sysfs in
the guest) and fairplace-agent say.

Usage: compare.py DECIDE_BIN MIN_PERCENT LOG...   (one serial log per topology)
Prints per topology and path how many agree, every disagreement, and as the
last line `kernel agreement A/N (P%) over T topologies, kernel K`. Exits 1
when agreement is below MIN_PERCENT, fewer placements than
FP_KERNEL_MIN_COMPARED (environment, default 0) were compared, a topology
check fails, or a guest gave no record."""

import json
import os
import re
import subprocess
import sys
from collections import defaultdict


def cpulist(s):
    out = []
    for part in s.split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def parse_log(path):
    log = {"topo": None, "uname": "?", "scn": [], "kdom": defaultdict(list), "agent": [], "agent_err": []}
    cur = None
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line.startswith("TOPO "):
                log["topo"] = json.loads(line[5:])
            elif line.startswith("UNAME "):
                log["uname"] = line[6:].strip()
            elif line.startswith("SCN "):
                try:
                    log["scn"].append(json.loads(line[4:]))
                except json.JSONDecodeError:
                    pass  # a line broken by a kernel message; not counted
            elif line.startswith("KDOM "):
                m = re.search(r"CPU(\d+) attaching", line)
                if m:
                    cur = int(m.group(1))
                m = re.search(r"domain-\d+: span=(\S+) level=(\S+)", line)
                if m and cur is not None:
                    log["kdom"][cur].append((m.group(2), cpulist(m.group(1))))
            elif line.startswith("AGENT "):
                log["agent"].append(line[6:])
            elif line.startswith("AGENTERR "):
                log["agent_err"].append(line[9:])
    return log


def expected_domains(topo):
    """The non-degenerate domain spans the scenario topology implies per CPU
    (SMT core, LLC, node, then all), without repeats."""
    cpus = topo["cpus"]
    out = {}
    for c in cpus:
        spans = []
        for key in ("core", "llc", "node"):
            s = [d["id"] for d in cpus if d[key] == c[key]]
            if len(s) > 1 and (not spans or s != spans[-1]):
                spans.append(s)
        alls = [d["id"] for d in cpus]
        if not spans or spans[-1] != alls:
            spans.append(alls)
        out[c["id"]] = spans
    return out


def check_topology(name, log):
    """The kernel's domains (sched_verbose) against the scenario topology."""
    problems = []
    want = expected_domains(log["topo"])
    for cpu, spans in want.items():
        got = [s for _, s in log["kdom"].get(cpu, [])]
        if got != spans:
            problems.append(f"cpu {cpu}: kernel domains {got}, topology gives {spans}")
    return problems


def check_agent(log):
    """fairplace-agent's Register against the scenario topology from sysfs."""
    if not log["agent"]:
        return None, ["agent printed nothing: " + " | ".join(log["agent_err"][:3])]
    problems = []
    try:
        reg = json.loads(log["agent"][0])
    except json.JSONDecodeError as e:
        return None, [f"agent Register is not JSON: {e}"]
    t = reg.get("topology", {})
    acpus = t.get("cpus", [])
    scpus = log["topo"]["cpus"]
    if len(acpus) != len(scpus):
        problems.append(f"agent has {len(acpus)} CPUs, kernel {len(scpus)}")
    groups = lambda cs, key: sorted(
        sorted(c.get("id", 0) for c in cs if c.get(key, 0) == v) for v in {c.get(key, 0) for c in cs}
    )
    for key in ("core", "llc", "node"):
        if groups(acpus, key) != groups(scpus, key):
            problems.append(f"agent {key} groups {groups(acpus, key)} != kernel {groups(scpus, key)}")
    caps = [c.get("capacity", 1024) or 1024 for c in acpus]
    if caps != [c["capacity"] for c in scpus]:
        problems.append(f"agent capacities {caps}")
    dist = [r.get("distances", r) if isinstance(r, dict) else r for r in t.get("numa_distance", [])]
    if dist and dist != log["topo"]["numa_distance"]:
        problems.append(f"agent distances {dist} != kernel {log['topo']['numa_distance']}")
    return reg, problems


def differing_inputs(s, a, b):
    """The per-CPU inputs of the two CPUs the answers name."""
    cpus = {c["id"]: c for c in s.get("cpus", [])}
    keys = ("nr_running", "h_nr_idle", "curr_is_idle", "ttwu_pending", "load_avg", "runnable_avg", "util_avg", "util_est", "idle_stamp")
    rows = []
    for k in keys:
        va = cpus.get(a, {}).get(k)
        vb = cpus.get(b, {}).get(k)
        if va != vb:
            rows.append(f"{k} {va}|{vb}")
    return f"cpu{a}|cpu{b}: " + ", ".join(rows)


def excluded(s):
    """Why a record is not compared, or None. Only recorded evidence that
    the record's inputs were not the kernel's counts:
    - `stale`: without the decision probes, a CPU entered or left idle
      between the state read and the decision (seen in the trace);
    - `sgc_imbalance`: a fork or exec whose allowed CPUs include one whose
      group has `sgc->imbalance` set (read at the decision); the slow path
      classifies such a group `group_imbalanced`, and the scenario format
      fixes the field at 0;
    - `changed_during_decision`: between the probe reading and the end of
      the decision (the return probe), the trace shows a CPU entering or
      leaving idle, or being the target of another task's wakeup or an end
      of its migration: the kernel reads the runqueues a little after the
      probe, and a vCPU can stall in between under TCG."""
    gen = s.get("generator", {})
    if gen.get("source") != "kprobe":
        return "stale" if gen.get("stale_cpus") else None
    if gen.get("changed_during"):
        return "changed_during_decision"
    if s["request"]["kind"] in ("fork", "exec") and gen.get("sgc_imbalance"):
        allowed = s["task"].get("cpus_allowed")
        allowed = set(cpulist(allowed)) if allowed else None
        if any(allowed is None or c in allowed for c, _ in gen["sgc_imbalance"]):
            return "sgc_imbalance"
    return None


def main():
    decide, min_pct, logs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    total_ok = total_n = total_stale = 0
    unames = set()
    failed = False
    for path in logs:
        name = os.path.splitext(os.path.basename(path))[0]
        log = parse_log(path)
        unames.add(log["uname"])
        if log["topo"] is None or not log["scn"]:
            print(f"{name}: the guest gave no records")
            failed = True
            continue
        jsonl = os.path.splitext(path)[0] + ".jsonl"
        with open(jsonl, "w") as f:
            for s in log["scn"]:
                f.write(json.dumps(s) + "\n")
        out = subprocess.run([decide, "decide", jsonl], capture_output=True, text=True).stdout.splitlines()
        per_path = defaultdict(lambda: [0, 0])
        ok = n = 0
        skipped = defaultdict(lambda: [0, 0])
        probed = sum(s.get("generator", {}).get("source") == "kprobe" for s in log["scn"])
        for i, (s, line) in enumerate(zip(log["scn"], out), 1):
            d = json.loads(line)
            kind = s["request"]["kind"]
            want = s["expected"]["cpu"]
            why = excluded(s)
            if why:
                # Counted and printed, not compared (see `excluded`).
                skipped[why][0] += 1
                skipped[why][1] += d.get("cpu") == want
                continue
            n += 1
            key = f"{kind}/{d.get('path', 'error')}"
            per_path[key][1] += 1
            if d.get("cpu") == want:
                per_path[key][0] += 1
                ok += 1
            else:
                req = s["request"]
                print(
                    f"DISAGREE {os.path.basename(jsonl)}:{i} {s['name']} {kind} this={req['this_cpu']}"
                    f" prev={s['task'].get('prev_cpu')} sync={req.get('sync', False)}"
                    f" allowed={s['task'].get('cpus_allowed')}: kernel {want}, fairplace {d.get('cpu')}"
                    f" ({d.get('path')}{' ' + d['error'] if 'error' in d else ''});"
                    f" {differing_inputs(s, want, d.get('cpu'))}"
                )
        total_ok += ok
        total_n += n
        stale = sum(c for c, _ in skipped.values())
        print(
            f"{name}: {ok}/{n} agree; {len(log['scn'])} records, {probed} with the kernel's inputs read at the decision;"
            f" {stale} not compared: "
            + (", ".join(f"{k} {c} ({a} of them agree anyway)" for k, (c, a) in sorted(skipped.items())) or "none")
        )
        total_stale += stale
        for key in sorted(per_path):
            a, b = per_path[key]
            print(f"  {key}: {a}/{b}")
        problems = check_topology(name, log)
        print(f"  kernel domains vs topology: {'equal' if not problems else 'DIFFER'}")
        for p in problems:
            print(f"    {p}")
        failed |= bool(problems)
        if log["agent"] or log["agent_err"]:
            _, ap = check_agent(log)
            print(f"  fairplace-agent topology vs kernel: {'equal' if not ap else 'DIFFER'}")
            for p in ap:
                print(f"    {p}")
            failed |= bool(ap)
    print(f"records not compared (their inputs were not the kernel's): {total_stale}")
    pct = 100.0 * total_ok / total_n if total_n else 0.0
    if pct < min_pct:
        failed = True
    min_n = int(os.environ.get("FP_KERNEL_MIN_COMPARED", "0"))
    if total_n < min_n:
        print(f"only {total_n} placements compared, fewer than the {min_n} asked for")
        failed = True
    print(
        f"kernel agreement {total_ok}/{total_n} ({pct:.1f}%) over {len(logs)} topologies, kernel {','.join(sorted(unames))}"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
