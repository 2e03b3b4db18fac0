#!/usr/bin/env python3
"""Compares the can_migrate_task() verdicts a live Linux kernel gave
(recorded by tests/kernel/guest's migrate module as `MIG` scenario lines on
the serial console) with `fairplace-server decide` on the same scenarios.

Usage: compare_migrate.py DECIDE_BIN MIN_PERCENT LOG...   (one log per topology)

Compared fields (format section 9.2): `allowed`, `new_dst_cpu`, `flags`,
`reason`. The kernel's reason is the check whose schedstats counter the call
raised (or, for a refusal that raises none, the per-CPU kthread or
throttling test), so all four are the kernel's own. No record is set aside:
the probes read the inputs inside the call, under the source runqueue's
lock.

Prints per topology the verdicts, the guest's drops (with reasons), counts
per kernel reason and per workload, every disagreement, and last
`kernel can_migrate agreement A/N (P%) over T topologies`. Exits 1 when
agreement is below MIN_PERCENT, fewer than FP_KERNEL_MIN_MIGRATE verdicts
were compared (default 0), a line does not parse, a guest did not finish
(`MIGDONE`) or lost records, or `decide` fails or rejects a record."""

import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from compare import run_decide  # noqa: E402  (one way to run decide and check its answers)

FIELDS = ("allowed", "new_dst_cpu", "flags", "reason")


def parse_records(path, tag, drop_tag, done_tag):
    """A guest log's scenario lines after `tag` (JSON), its drops after
    `drop_tag` (counted by reason), the count after `done_tag`, its FAIL
    lines and the kernel's release."""
    log = {"records": [], "unparsable": [], "drops": defaultdict(int), "done": None, "fail": [], "uname": "?"}
    with open(path, errors="replace") as f:
        for line in f:
            line = line.rstrip("\r\n")
            if line.startswith(tag):
                try:
                    log["records"].append(json.loads(line[len(tag):]))
                except json.JSONDecodeError:
                    log["unparsable"].append(line[:120])
            elif line.startswith(drop_tag):
                log["drops"][line[len(drop_tag):].strip()] += 1
            elif line.startswith(done_tag):
                log["done"] = int(line[len(done_tag):].strip() or -1)
            elif line.startswith("FAIL "):
                log["fail"].append(line[5:])
            elif line.startswith("UNAME "):
                log["uname"] = line[6:].strip()
    return log


def parse_log(path):
    return parse_records(path, "MIG ", "DROP can_migrate ", "MIGDONE ")


def differing(want, got):
    return [f"{k} kernel {want.get(k)!r} fairplace {got.get(k)!r}" for k in FIELDS if want.get(k) != got.get(k)]


def compare(decide, path, totals):
    """One topology; returns (agree, compared, failed)."""
    name = os.path.splitext(os.path.basename(path))[0]
    log = parse_log(path)
    totals["unames"].add(log["uname"])
    problems = list(log["fail"])
    if log["unparsable"]:
        problems.append(f"{len(log['unparsable'])} MIG lines do not parse: {log['unparsable'][0]}")
    if log["done"] is None:
        problems.append("the guest did not finish the verdicts (no MIGDONE line)")
    elif log["done"] != len(log["records"]):
        problems.append(f"the guest made {log['done']} verdict records, {len(log['records'])} arrived")
    ok = n = 0
    by_reason, by_workload = defaultdict(lambda: [0, 0]), defaultdict(lambda: [0, 0])
    if log["records"]:
        jsonl = os.path.join(os.path.dirname(path), f"{name}.mig.jsonl")
        with open(jsonl, "w") as f:
            for s in log["records"]:
                f.write(json.dumps(s) + "\n")
        answers, why = run_decide(decide, jsonl, len(log["records"]))
        if answers is None:
            problems.append(why)
        else:
            for i, (s, d) in enumerate(zip(log["records"], answers), 1):
                want = s["expected"]
                diff = differing(want, d)
                agree = not diff
                ok += agree
                n += 1
                for tally, key in (
                    (by_reason, want["reason"]),
                    (by_workload, s["generator"].get("workload")),
                    (totals["reason"], want["reason"]),
                    (totals["workload"], s["generator"].get("workload")),
                ):
                    tally[key][0] += agree
                    tally[key][1] += 1
                if diff:
                    r = s["request"]
                    print(
                        f"DISAGREE {os.path.basename(jsonl)}:{i} {s['name']} {r['idle']} {r['sd_level']}"
                        f" src={r['src_cpu']} dst={r['dst_cpu']} flags={r['flags']}"
                        f" nbf={r['nr_balance_failed']}/{r['cache_nice_tries']}: " + "; ".join(diff)
                    )
    drops = sum(log["drops"].values())
    print(
        f"{name}: {ok}/{n} can_migrate_task verdicts agree; guest drops {drops}"
        + "".join(f"; {k} {c}" for k, c in sorted(log["drops"].items()))
    )
    print("  by the kernel's reason: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(by_reason.items())))
    print("  by workload: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(by_workload.items())))
    for p in problems:
        print(f"  FAILED: {p}")
    return ok, n, bool(problems)


def main():
    decide, min_pct, logs = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    totals = {"unames": set(), "reason": defaultdict(lambda: [0, 0]), "workload": defaultdict(lambda: [0, 0])}
    ok = n = 0
    failed = False
    for path in logs:
        a, b, f = compare(decide, path, totals)
        ok, n, failed = ok + a, n + b, failed or f
    print("all topologies, by the kernel's reason: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(totals["reason"].items())))
    print("all topologies, by workload: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in sorted(totals["workload"].items())))
    pct = 100.0 * ok / n if n else 0.0
    if pct < min_pct:
        print(f"can_migrate agreement {pct:.2f}% is below {min_pct}%")
        failed = True
    min_n = int(os.environ.get("FP_KERNEL_MIN_MIGRATE", "0"))
    if n < min_n:
        print(f"only {n} can_migrate_task verdicts compared, fewer than the {min_n} asked for")
        failed = True
    print(f"kernel {','.join(sorted(totals['unames']))}")
    print(f"kernel can_migrate agreement {ok}/{n} ({pct:.1f}%) over {len(logs)} topologies")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
