#!/usr/bin/env python3
"""Compares whole load-balance passes of a live Linux kernel (recorded by
tests/kernel/guest's pass module as `LB` balance scenarios on the serial
console) with `fairplace-server decide` replaying the same
`sched_balance_rq()` call.

Usage: compare_balance.py DECIDE_BIN MIN_PERCENT LOG...   (one log per topology)

Compared: `busiest` (every runqueue the kernel's detach_tasks() walked, in
order; it names the busiest group too, the group of the domain holding it),
`migration_type` (when the kernel walked a runqueue) and `detached` (the
set of tasks moved, each with its source and destination). The imbalance
the search set is reported beside, not compared: it is the kernel's
arithmetic on the same inputs, and a difference there shows up in what is
detached.

A pass is set aside only for a counted reason the guest recorded as
evidence of a race (`generator.raced`): a CPU of the domain the pass did not
touch changed during it, the balancing CPU or a source gained or lost a
task the pass did not move, the busiest runqueue's task count changed
before it was locked, or a task migrated during the call other than by the
walk (an interrupt's wakeup on the balancing CPU).

Prints per topology the passes, set-aside reasons, agreement by kind of
pass, every disagreement, and last
`kernel balance agreement A/N (P%) over T topologies; R passes, S set aside`.
Exits 1 when agreement is below MIN_PERCENT, fewer than
FP_KERNEL_MIN_PASSES compared passes detached a task (default 0), a line
does not parse, a guest did not finish (`LBDONE`) or lost records, a guest
dropped a pass it could not record, or `decide` fails or rejects a record."""

import json
import os
import re
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import run_decide  # noqa: E402  (one way to run decide and check its answers)
from compare_migrate import parse_records  # noqa: E402  (one reader of the guests' record lines)


def parse_log(path):
    return parse_records(path, "LB ", "DROP balance ", "LBDONE ")


def detached_set(lst):
    return sorted((d["id"], d["src_cpu"], d["dst_cpu"]) for d in lst)


def differing(want, got):
    out = []
    if want["busiest"] != got.get("busiest"):
        out.append(f"busiest kernel {want['busiest']} fairplace {got.get('busiest')}")
    if want["busiest"] and want["migration_type"] != got.get("migration_type"):
        out.append(f"migration_type kernel {want['migration_type']} fairplace {got.get('migration_type')}")
    if detached_set(want["detached"]) != detached_set(got.get("detached", [])):
        out.append(f"detached kernel {detached_set(want['detached'])} fairplace {detached_set(got.get('detached', []))}")
    return out


def kind_of(s):
    w = s["expected"]
    r = s["request"]
    if w["detached"]:
        return f"detached {w['migration_type']} {r['idle']}"
    return ("refused " if w["busiest"] else "balanced ") + r["idle"]


def race_kind(reason):
    """A race reason without its CPU number, for the counts."""
    return re.sub(r"\b\d+\b", "N", reason)


def compare(decide, path, totals):
    """One topology; returns (agree, compared, recorded, set_aside, failed)."""
    name = os.path.splitext(os.path.basename(path))[0]
    log = parse_log(path)
    totals["unames"].add(log["uname"])
    problems = list(log["fail"])
    if log["unparsable"]:
        problems.append(f"{len(log['unparsable'])} LB lines do not parse: {log['unparsable'][0]}")
    if log["done"] is None:
        problems.append("the guest did not finish the passes (no LBDONE line)")
    elif log["done"] != len(log["records"]):
        problems.append(f"the guest made {log['done']} pass records, {len(log['records'])} arrived")
    drops = sum(log["drops"].values())
    if drops:
        problems.append(f"the guest could not record {drops} passes: " + "; ".join(f"{k} ({c})" for k, c in sorted(log["drops"].items())))
    aside = defaultdict(int)
    kept = []
    for s in log["records"]:
        raced = s["generator"].get("raced", [])
        if raced:
            for r in {race_kind(x) for x in raced}:
                aside[r] += 1
                totals["aside"][r] += 1
        else:
            kept.append(s)
    ok = n = imb_ok = 0
    by_kind = defaultdict(lambda: [0, 0])
    if kept:
        jsonl = os.path.join(os.path.dirname(path), f"{name}.lb.jsonl")
        with open(jsonl, "w") as f:
            for s in kept:
                f.write(json.dumps(s) + "\n")
        answers, why = run_decide(decide, jsonl, len(kept))
        if answers is None:
            problems.append(why)
        else:
            for i, (s, d) in enumerate(zip(kept, answers), 1):
                want = s["expected"]
                diff = differing(want, d)
                agree = not diff
                ok += agree
                n += 1
                imb_ok += want["imbalance"] is None or want["imbalance"] == d.get("imbalance")
                k = kind_of(s)
                for tally in (by_kind, totals["kind"]):
                    tally[k][0] += agree
                    tally[k][1] += 1
                if want["detached"]:
                    totals["detached"][0] += agree
                    totals["detached"][1] += 1
                    totals["detached_topos"].add(name)
                if diff:
                    r = s["request"]
                    print(
                        f"DISAGREE {os.path.basename(jsonl)}:{i} {s['name']} cpu={r['cpu']} {r['sd_level']} {r['idle']}"
                        f" nbf={r['nr_balance_failed']} workload={s['generator'].get('workload')}: " + "; ".join(diff)
                    )
    totals["imbalance"][0] += imb_ok
    totals["imbalance"][1] += n
    set_aside = len(log["records"]) - len(kept)
    print(f"{name}: {ok}/{n} passes agree; {len(log['records'])} recorded, {set_aside} set aside"
          + "".join(f"; {k} {c}" for k, c in sorted(aside.items())))
    print("  by kind: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(by_kind.items())))
    for p in problems:
        print(f"  FAILED: {p}")
    return ok, n, len(log["records"]), set_aside, bool(problems)


def main():
    decide, min_pct, logs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    totals = {
        "unames": set(),
        "kind": defaultdict(lambda: [0, 0]),
        "aside": defaultdict(int),
        "detached": [0, 0],
        "detached_topos": set(),
        "imbalance": [0, 0],
    }
    ok = n = rec = aside = 0
    failed = False
    for path in logs:
        a, b, r, s, f = compare(decide, path, totals)
        ok, n, rec, aside, failed = ok + a, n + b, rec + r, aside + s, failed or f
    print("all topologies, by kind: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(totals["kind"].items())))
    print("all topologies, set aside: " + (", ".join(f"{k} {c}" for k, c in sorted(totals["aside"].items())) or "none"))
    d_ok, d_n = totals["detached"]
    print(f"passes that detached a task: {d_ok}/{d_n} agree over {len(totals['detached_topos'])} topologies")
    i_ok, i_n = totals["imbalance"]
    print(f"imbalance as the kernel computed it: {i_ok}/{i_n}")
    pct = 100.0 * ok / n if n else 0.0
    if pct < min_pct:
        print(f"balance agreement {pct:.2f}% is below {min_pct}%")
        failed = True
    min_n = int(os.environ.get("FP_KERNEL_MIN_PASSES", "0"))
    if d_n < min_n:
        print(f"only {d_n} compared passes detached a task, fewer than the {min_n} asked for")
        failed = True
    print(f"kernel {','.join(sorted(totals['unames']))}")
    print(f"kernel balance agreement {ok}/{n} ({pct:.1f}%) over {len(logs)} topologies; {rec} passes, {aside} set aside")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
