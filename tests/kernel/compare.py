#!/usr/bin/env python3
"""Compares the placements a live Linux kernel made (recorded by the guest
program of tests/kernel/guest as scenario lines on the serial console) with
`fairplace-server decide` on the same scenarios, and checks the topology the
guest kernel built against what the scenario's topology (read from sysfs in
the guest) and fairplace-agent say.

Usage: compare.py DECIDE_BIN MIN_PERCENT LOG...   (one serial log per topology)
Prints per topology its records, the records set aside (only evidence of a
race that could change fairplace's answer: `changed_during_decision`,
`stale`) with their counts, the raced records still compared because
fairplace answers the same under every state the race allows, the guest's own
dropped attempts, and compared/agreeing counts per load profile and per path;
every disagreement; the same counts over all topologies; and as the last line
`kernel agreement A/N (P%) over T topologies, kernel K; R records, S set aside`.
Exits 1 when agreement is below MIN_PERCENT, fewer than FP_KERNEL_MIN_COMPARED
were compared, fewer than FP_KERNEL_MIN_SGC records carrying the
`sgc_imbalance` hint were compared, a profile of FP_KERNEL_PROFILES has no
compared record, more than FP_KERNEL_MAX_SET_ASIDE percent of the records were
set aside (environment; defaults 0, 0, all, 100), a record line does not parse, a
guest did not finish or lost records, `decide` fails or answers short or
rejects a record, a wakeup's or fork's traced CPU is not the one
select_task_rq_fair() returned, a topology check fails, or a guest gave no
record."""

import itertools
import json
import math
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
    log = {
        "topo": None,
        "uname": "?",
        "scn": [],
        "kdom": defaultdict(list),
        "agent": [],
        "agent_err": [],
        "unparsable": [],
        "drops": defaultdict(int),
        "done": None,
        "fail": [],
    }
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
                    # Counted, and it fails the run: a record lost.
                    log["unparsable"].append(line[:120])
            elif line.startswith("DROP "):
                log["drops"][line[5:].strip()] += 1
            elif line.startswith("DONE "):
                log["done"] = int(line[5:].strip() or -1)
            elif line.startswith("FAIL "):
                log["fail"].append(line[5:])
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
    (SMT core, LLC, node, the nodes within each larger distance, then all),
    without repeats."""
    cpus = topo["cpus"]
    dist = topo.get("numa_distance") or []
    levels = sorted({d for row in dist for d in row})[1:]
    out = {}
    for c in cpus:
        spans = []
        for key in ("core", "llc", "node"):
            s = [d["id"] for d in cpus if d[key] == c[key]]
            if len(s) > 1 and (not spans or s != spans[-1]):
                spans.append(s)
        for dj in levels:
            row = dist[c["node"]]
            s = [d["id"] for d in cpus if row[d["node"]] <= dj]
            if not spans or s != spans[-1]:
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
    """Why a record is not compared, or None. Only recorded evidence of a
    race (the record's inputs may not be the ones the kernel read) counts:
    - `stale`: without the decision probes, a CPU entered or left idle
      between the state read and the decision (seen in the trace);
    - `changed_during_decision`: a CPU the decision reads
      (`read_by_decision`) changed between the probe reading and the end of
      the decision (`raced_cpus`): the kernel reads the runqueues a little
      after the probe, and a vCPU can stall in between under TCG. Such a
      record is still compared when fairplace gives the same answer under
      every state the race allows (`race_variants`)."""
    gen = s.get("generator", {})
    if gen.get("source") != "kprobe":
        # A task with one allowed CPU gets it without a runqueue being read
        # (select_task_rq() skips the class), so no change can matter.
        return "stale" if set(gen.get("stale_cpus", [])) & read_by_decision(s) else None
    return "changed_during_decision" if raced_cpus(s) or h_load_raced(s) else None


# What changed a CPU during the decision (the guest's `changed_by` bits).
SWITCHED, WOKEN, RETURNED, MIGRATED = 1, 2, 4, 8


def raced_cpus(s):
    """The CPUs the decision reads whose state may have changed while it
    ran, each with what changed it (`changed_by` bits; 0 for a CPU entering
    idle at the probe): between the probe and the return probe the trace
    shows it entering or leaving idle, the target of another task's wakeup
    or placement, or an end of a migration; or it had no task queued while
    its current task was not the idle task, so it was inside __schedule()
    and idle_cpu() turns true at the switch, which may come before or after
    the kernel's read (the switch's trace event is written after rq->curr)."""
    read = read_by_decision(s)
    by = {c: k for c, k in s.get("generator", {}).get("changed_by", [])}
    out = {c: by.get(c, 0) for c in set(s.get("generator", {}).get("changed_during", [])) & read}
    for c in s.get("cpus", []):
        if c["id"] in read and c.get("nr_running", 0) == 0 and not c.get("curr_is_idle", True):
            out.setdefault(c["id"], 0)
    return out


def idle_state(c):
    """How a wakeup's scan sees a record's CPU: `idle` (idle_cpu()),
    `sched_idle` (sched_idle_rq(): only SCHED_IDLE work queued), `busy`
    (a task of another policy queued: no enqueue can make it available), or
    `pending` (nothing queued yet not idle: a wakeup pending or the CPU
    entering idle)."""
    nr, nr_idle = c.get("nr_running", 0), c.get("h_nr_idle", 0)
    if idle(c):
        return "idle"
    if nr > 0 and nr == nr_idle:
        return "sched_idle"
    return "busy" if nr > nr_idle else "pending"


def with_idle_state(c, state):
    """A copy of CPU record `c` in another `idle_state` (the fields a
    wakeup's scan reads; loads are kept, as the scan reads none)."""
    c = dict(c)
    nr, nr_idle = c.get("nr_running", 0), c.get("h_nr_idle", 0)
    if state == "idle":
        c.update(nr_running=0, h_nr_idle=0, cfs_h_nr_queued=0, nr_delayed=0, curr_is_idle=True, ttwu_pending=False)
    elif state == "sched_idle":
        n = max(nr_idle, 1)
        c.update(nr_running=n, h_nr_idle=n, cfs_h_nr_queued=n, curr_is_idle=False, ttwu_pending=False)
    else:
        n = nr_idle + 1
        c.update(nr_running=max(nr, n), cfs_h_nr_queued=max(c.get("cfs_h_nr_queued", 0), n), curr_is_idle=False)
    return c


def wake_affine_runs(s):
    """Whether a wakeup calls wake_affine() (which reads this_cpu's and
    prev's loads and task_h_load()): want_affine with this_cpu != prev,
    conservatively ignoring wake_wide()."""
    if s["request"]["kind"] != "wakeup":
        return False
    this, prev = s["request"]["this_cpu"], s["task"].get("prev_cpu")
    allowed = s["task"].get("cpus_allowed")
    allowed = set(cpulist(allowed)) if allowed else {c["id"] for c in s["topology"]["cpus"]}
    return this != prev and this in allowed


def h_load_raced(s):
    """The task_h_load() values (`task.load_avg`, `request.waker_load`) a
    race may have changed, each with its value recomputed, or None when
    unknown (a record without `h_load_fresh`). An h_load stored in the
    probe's jiffy is used as stored unless a tick comes during the decision
    or another placement in flight recomputes it first."""
    gen = s.get("generator", {})
    fresh = gen.get("h_load_fresh")
    if fresh is None:
        return None
    jiffies = fresh.get("jiffies", [0, -1])
    others = any(k & (WOKEN | RETURNED) for _, k in gen.get("changed_by", []))
    if not wake_affine_runs(s) or not (others or jiffies[0] != jiffies[1]):
        return []
    out = []
    if fresh["load_avg"] != s["task"].get("load_avg", 0):
        out.append((("task", "load_avg"), fresh["load_avg"]))
    if s["request"].get("sync") and fresh["waker_load"] != s["request"].get("waker_load", 0):
        out.append((("request", "waker_load"), fresh["waker_load"]))
    return out


def race_states(s):
    """For a wakeup, each raced CPU with the states it may have had when
    the kernel read it, and the task_h_load() values with the values the
    race allows (`h_load_raced`); None when the race may have changed
    something else the decision reads (a fork's or exec's slow path reads
    every allowed CPU's loads; wake_affine() reads this_cpu's and prev's).
    An enqueue (a wakeup, a placement's return, a migration's destination)
    cannot make a `busy` CPU available; a switch or a migration may leave a
    CPU in any state."""
    if s["request"]["kind"] != "wakeup":
        return None
    raced = raced_cpus(s)
    this, prev = s["request"]["this_cpu"], s["task"].get("prev_cpu")
    loads = h_load_raced(s)
    if wake_affine_runs(s) and (this in raced or prev in raced or loads is None):
        return None
    cpus = {c["id"]: c for c in s.get("cpus", [])}
    out = []
    for cpu, kinds in sorted(raced.items()):
        now = idle_state(cpus[cpu])
        if kinds & (SWITCHED | MIGRATED) or kinds == 0:
            may = {"idle", "sched_idle", "busy"}
        elif now == "busy":
            may = set()
        elif now == "sched_idle":
            may = {"busy"}
        else:
            may = {"busy", "sched_idle"}
        out.append((cpu, sorted(may - {now})))
    return out, loads or []


# Records whose race allows more states than this are set aside untried.
MAX_RACE_VARIANTS = 256


def race_variants(s):
    """The record under every combination of the states `race_states`
    allows, with `has_idle_cores` also set in an LLC where a CPU may have
    entered idle (the switch to idle sets it); None when the race is not
    one of idle states and h_load alone or allows too many combinations."""
    states = race_states(s)
    if states is None:
        return None
    cpu_states, loads = states
    llc_of = {c["id"]: c["llc"] for c in s["topology"]["cpus"]}
    choices = [[None] + alts for _, alts in cpu_states] + [[None, v] for _, v in loads]
    count = 1
    for ch in choices:
        count *= len(ch)
    if count * 2 > MAX_RACE_VARIANTS:
        return None
    out = []
    for combo in itertools.product(*choices):
        v = json.loads(json.dumps(s))
        at = {c["id"]: i for i, c in enumerate(v["cpus"])}
        woke = set()
        for (cpu, _), state in zip(cpu_states, combo):
            if state is not None:
                v["cpus"][at[cpu]] = with_idle_state(v["cpus"][at[cpu]], state)
                if state == "idle":
                    woke.add(llc_of[cpu])
        for ((obj, key), _), value in zip(loads, combo[len(cpu_states) :]):
            if value is not None:
                v[obj][key] = value
        out.append(v)
        if woke:
            v = json.loads(json.dumps(v))
            for llc in woke:
                v.setdefault("llc", {}).setdefault(str(llc), {})["has_idle_cores"] = True
            out.append(v)
    return out


def read_by_decision(s):
    """The CPUs whose runqueues the kernel's decision reads. A wakeup or
    fork of a task with one allowed CPU reads none (select_task_rq() returns
    that CPU without calling the class); a wakeup (6.12 sets no
    SD_BALANCE_WAKE, so never the slow path) reads this_cpu and prev
    (wake_affine()), the LLCs of both (the target is one of them:
    select_idle_sibling() scans the target's LLC) and recent_used_cpu; a
    fork or exec's slow path reads the allowed CPUs."""
    topo = s["topology"]["cpus"]
    allowed = s["task"].get("cpus_allowed")
    allowed = set(cpulist(allowed)) if allowed else {c["id"] for c in topo}
    if len(allowed) == 1 and s["request"]["kind"] != "exec":
        return set()
    if s["request"]["kind"] != "wakeup":
        # The slow path sums and searches the allowed CPUs of each group
        # (capacities, the only other input, do not change).
        return allowed
    llc = {c["id"]: c["llc"] for c in topo}
    ends = {s["request"]["this_cpu"], s["task"].get("prev_cpu")}
    near = {llc.get(c) for c in ends}
    out = {c for c, l in llc.items() if l in near} | ends
    if s["task"].get("recent_used_cpu") is not None:
        out.add(s["task"]["recent_used_cpu"])
    return out


class Tally:
    """Compared and agreeing counts under a key."""

    def __init__(self):
        self.n = defaultdict(lambda: [0, 0])

    def add(self, key, agree):
        self.n[key][0] += agree
        self.n[key][1] += 1

    def lines(self, indent):
        return [f"{indent}{k}: {a}/{b}" for k, (a, b) in sorted(self.n.items())]


def run_decide(decide, jsonl, count):
    """`decide` on the records: one JSON answer per record, exit status 0,
    or the reason the run must fail."""
    p = subprocess.run([decide, "decide", jsonl], capture_output=True, text=True)
    out = p.stdout.splitlines()
    if p.returncode != 0:
        return None, f"decide exited {p.returncode}: {p.stderr.strip()[:300]}"
    if len(out) != count:
        return None, f"decide gave {len(out)} answers for {count} records"
    answers = [json.loads(line) for line in out]
    bad = [i for i, a in enumerate(answers, 1) if "error" in a]
    if bad:
        return None, f"decide rejected records {bad[:5]}: {answers[bad[0] - 1]['error']}"
    return answers, None


def race_insensitive(decide, jsonl, records, answers):
    """The indexes of the records set aside for a race whose answer from
    fairplace is the same under every state the race allows
    (`race_variants`): the race cannot explain a disagreement there, so
    they are compared. Returns (set, None) or (None, why the run fails)."""
    batch, owner = [], []
    for i, s in enumerate(records):
        if excluded(s) != "changed_during_decision":
            continue
        for v in race_variants(s) or []:
            batch.append(v)
            owner.append(i)
    if not batch:
        return set(), None
    path = os.path.splitext(jsonl)[0] + ".race.jsonl"
    with open(path, "w") as f:
        for v in batch:
            f.write(json.dumps(v) + "\n")
    got, why = run_decide(decide, path, len(batch))
    if got is None:
        return None, f"race variants: {why}"
    same = defaultdict(lambda: True)
    for i, a in zip(owner, got):
        same[i] &= a.get("cpu") == answers[i].get("cpu")
    return {i for i, ok in same.items() if ok}, None


def disagreement(jsonl, i, s, d):
    req, want = s["request"], s["expected"]["cpu"]
    return (
        f"DISAGREE {os.path.basename(jsonl)}:{i} {s['name']} {req['kind']}"
        f" profile={s['generator'].get('profile')} seed={s['generator'].get('seed')}"
        f" this={req['this_cpu']} prev={s['task'].get('prev_cpu')} sync={req.get('sync', False)}"
        f" allowed={s['task'].get('cpus_allowed')} sgc={s.get('sgc_imbalance', {})}:"
        f" kernel {want}, fairplace {d.get('cpu')} ({d.get('path')});"
        f" {differing_inputs(s, want, d.get('cpu'))}"
    )


def idle(c):
    """`available_idle_cpu()` of a record's CPU."""
    return c.get("nr_running", 0) == 0 and c.get("curr_is_idle", True) and not c.get("ttwu_pending", False)


def hardness(s, d, h):
    """Counts how hard a record's load is: prev idle at a wakeup (which ends
    select_idle_sibling() at once), no idle allowed CPU at all, an LLC scan
    budget (SIS_UTIL's nr_idle_scan) below the LLC's size, wake_wide() set
    (want_affine false with this_cpu allowed), the sgc_imbalance hint."""
    cpus = {c["id"]: c for c in s.get("cpus", [])}
    n = len(s["topology"]["cpus"])
    allowed = s["task"].get("cpus_allowed")
    allowed = set(cpulist(allowed)) if allowed else set(range(n))
    h["records"] += 1
    if not any(idle(cpus.get(i, {})) for i in allowed):
        h["no idle allowed CPU"] += 1
    if "sgc_imbalance" in s:
        h["sgc_imbalance hint"] += 1
    if s["request"]["kind"] != "wakeup":
        return
    h["wakeups"] += 1
    if idle(cpus.get(s["task"].get("prev_cpu"), {})):
        h["wakeups with prev idle"] += 1
    topo = {c["id"]: c for c in s["topology"]["cpus"]}
    llc = topo[s["task"].get("prev_cpu", 0)]["llc"]
    size = sum(c["llc"] == llc for c in topo.values())
    if s.get("llc", {}).get(str(llc), {}).get("nr_idle_scan", size) < size:
        h["wakeups with prev's LLC scan budget below its size"] += 1
    if s["request"]["this_cpu"] in allowed and not d.get("detail", {}).get("want_affine", True):
        h["wakeups with wake_wide()"] += 1


def check_log(name, log):
    """The ways a guest can lose records; each fails the run."""
    problems = list(log["fail"])
    if log["unparsable"]:
        problems.append(f"{len(log['unparsable'])} record lines do not parse: {log['unparsable'][0]}")
    if log["done"] is None:
        problems.append("the guest did not finish (no DONE line)")
    elif log["done"] != len(log["scn"]) + len(log["unparsable"]):
        problems.append(f"the guest made {log['done']} records, {len(log['scn'])} arrived")
    return problems


def compare_topology(decide, path, totals):
    """Compares one guest's records; returns (ok, n, records, set aside, failed)."""
    name = os.path.splitext(os.path.basename(path))[0]
    log = parse_log(path)
    totals["unames"].add(log["uname"])
    if log["topo"] is None or not log["scn"]:
        print(f"{name}: the guest gave no records {' '.join(log['fail'])}")
        return 0, 0, 0, 0, True
    failed = False
    jsonl = os.path.splitext(path)[0] + ".jsonl"
    with open(jsonl, "w") as f:
        for s in log["scn"]:
            f.write(json.dumps(s) + "\n")
    answers, why = run_decide(decide, jsonl, len(log["scn"]))
    if answers is None:
        print(f"{name}: {why}")
        return 0, 0, len(log["scn"]), 0, True
    steady, why = race_insensitive(decide, jsonl, log["scn"], answers)
    if steady is None:
        print(f"{name}: {why}")
        return 0, 0, len(log["scn"]), 0, True
    per_path, per_profile = Tally(), Tally()
    skipped = defaultdict(lambda: [0, 0])
    moved = mismatched = steady_here = 0
    probed = sum(s.get("generator", {}).get("source") == "kprobe" for s in log["scn"])
    for i, (s, d) in enumerate(zip(log["scn"], answers), 1):
        gen = s.get("generator", {})
        kind, want = s["request"]["kind"], s["expected"]["cpu"]
        ret, seen = gen.get("returned"), gen.get("observed")
        if ret is not None and seen is not None and ret != seen:
            # The task was seen elsewhere than the decision put it: after
            # sched_exec() the balancer may move it before it runs; a wakeup
            # or fork lands where select_task_rq_fair() said, always.
            if kind == "exec":
                moved += 1
            else:
                mismatched += 1
                print(f"ANSWERS DIFFER {name} {s['name']}: returned {ret}, traced {seen}")
        hardness(s, d, totals["hard"])
        why = excluded(s)
        if why and i - 1 in steady:
            totals["steady"] += 1
            steady_here += 1
        elif why:
            skipped[why][0] += 1
            skipped[why][1] += d.get("cpu") == want
            continue
        agree = d.get("cpu") == want
        if "sgc_imbalance" in s:
            totals["sgc"].add(kind, agree)
        per_path.add(f"{kind}/{d.get('path', 'error')}", agree)
        per_profile.add(gen.get("profile", "light"), agree)
        totals["path"].add(f"{kind}/{d.get('path', 'error')}", agree)
        totals["profile"].add(gen.get("profile", "light"), agree)
        if not agree:
            print(disagreement(jsonl, i, s, d))
    ok = sum(a for a, _ in per_path.n.values())
    n = sum(b for _, b in per_path.n.values())
    aside = sum(c for c, _ in skipped.values())
    seeds = sorted({s.get("generator", {}).get("seed") for s in log["scn"]}, key=str)
    print(
        f"{name}: {ok}/{n} agree; {len(log['scn'])} records (seeds {','.join(map(str, seeds))}),"
        f" {probed} with the kernel's inputs read at the decision; {aside} set aside: "
        + (", ".join(f"{k} {c} ({a} of them agree anyway)" for k, (c, a) in sorted(skipped.items())) or "none")
        + f"; {steady_here} raced but compared (the same answer under every state the race allows)"
    )
    for k, (c, _) in skipped.items():
        totals["aside"][k] += c
    drops = sum(log["drops"].values())
    print(
        f"  attempts that gave no record (the guest's own drops, refilled): {drops}"
        + "".join(f"; {k} {c}" for k, c in sorted(log["drops"].items()))
    )
    print(f"  exec tasks moved after sched_exec() decided (expected = the decision): {moved}")
    print("  by profile:")
    print("\n".join(per_profile.lines("    ")))
    print("  by path:")
    print("\n".join(per_path.lines("    ")))
    problems = check_log(name, log)
    if mismatched:
        problems.append(f"{mismatched} wakeup/fork records whose traced CPU is not the returned one")
    kd = check_topology(name, log)
    print(f"  kernel domains vs topology: {'equal' if not kd else 'DIFFER'}")
    problems += [f"kernel domains: {p}" for p in kd]
    if log["agent"] or log["agent_err"]:
        _, ap = check_agent(log)
        print(f"  fairplace-agent topology vs kernel: {'equal' if not ap else 'DIFFER'}")
        problems += [f"agent: {p}" for p in ap]
    for p in problems:
        print(f"  FAILED: {p}")
    failed |= bool(problems)
    return ok, n, len(log["scn"]), aside, failed


def main():
    decide, min_pct, logs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    totals = {
        "unames": set(),
        "path": Tally(),
        "profile": Tally(),
        "sgc": Tally(),
        "aside": defaultdict(int),
        "hard": defaultdict(int),
        "steady": 0,
    }
    total_ok = total_n = total_r = total_s = 0
    failed = False
    for path in logs:
        ok, n, r, aside, f = compare_topology(decide, path, totals)
        total_ok += ok
        total_n += n
        total_r += r
        total_s += aside
        failed |= f
    print("all topologies, by profile:")
    print("\n".join(totals["profile"].lines("  ")))
    print("all topologies, by path:")
    print("\n".join(totals["path"].lines("  ")))
    h = totals["hard"]
    print(
        "the load: "
        + ", ".join(
            f"{k} {h[k]}/{h['wakeups' if k.startswith('wakeups ') else 'records']}"
            for k in sorted(h)
            if k not in ("records", "wakeups")
        )
    )
    print("records with the sgc_imbalance hint, by kind:")
    print("\n".join(totals["sgc"].lines("  ")))
    sgc_n = sum(b for _, b in totals["sgc"].n.values())
    min_sgc = int(os.environ.get("FP_KERNEL_MIN_SGC", "0"))
    if sgc_n < min_sgc:
        print(f"only {sgc_n} records with the sgc_imbalance hint compared, fewer than {min_sgc}")
        failed = True
    # Every profile asked for must have been exercised.
    for want in os.environ.get("FP_KERNEL_PROFILES", "").split():
        if want not in totals["profile"].n:
            print(f"no compared record under the load profile {want}")
            failed = True
    print(
        "set aside (evidence of a race): "
        + (", ".join(f"{k} {c}" for k, c in sorted(totals["aside"].items())) or "none")
        + f"; raced but compared (the same answer under every state the race allows): {totals['steady']}"
    )
    pct = 100.0 * total_ok / total_n if total_n else 0.0
    if pct < min_pct:
        print(f"agreement {pct:.2f}% is below {min_pct}%")
        failed = True
    min_n = int(os.environ.get("FP_KERNEL_MIN_COMPARED", "0"))
    if total_n < min_n:
        print(f"only {total_n} placements compared, fewer than the {min_n} asked for")
        failed = True
    # At most that share of the records, rounded up to a whole record: one
    # race in a short run of 24 is not 4 % of anything.
    max_aside = float(os.environ.get("FP_KERNEL_MAX_SET_ASIDE", "100"))
    if total_r and total_s > math.ceil(max_aside * total_r / 100.0 - 1e-9):
        print(f"{total_s} of {total_r} records set aside, more than {max_aside}%")
        failed = True
    print(
        f"kernel agreement {total_ok}/{total_n} ({pct:.1f}%) over {len(logs)} topologies,"
        f" kernel {','.join(sorted(totals['unames']))}; {total_r} records, {total_s} set aside"
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
