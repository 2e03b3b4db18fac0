#!/usr/bin/env python3
"""Print criterion's median estimates for the engine benchmarks as the
markdown tables of BENCHMARKS.md, with each figure's ratio to the baseline
measured in the same run.

Usage: python3 benches/report.py [target/criterion]
"""
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "target/criterion"


def median_ns(group, bench, param=None):
    parts = [root, group, bench] + ([str(param)] if param is not None else [])
    path = os.path.join(*parts, "new", "estimates.json")
    with open(path) as f:
        return json.load(f)["median"]["point_estimate"]


def fmt(ns):
    return f"{ns / 1000:.3f} µs" if ns >= 1000 else f"{ns:.1f} ns"


def table(title, header, rows):
    print(f"### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    print()


for smt in (2, 8):
    rows = []
    for busy in (0, 50, 95, 100):
        t = median_ns(f"wakeup_smt{smt}", "select_task_rq", busy)
        base = median_ns(f"wakeup_smt{smt}", "naive_full_scan", busy)
        rows.append([f"{busy} %", fmt(t), fmt(base), f"{t / base:.2f}"])
    table(
        f"Wakeup on the 256-CPU node, SMT{smt} (median)",
        ["busy", "select_task_rq", "naive full scan (256 CPUs)", "ratio"],
        rows,
    )

base = median_ns("slow_path_smt2", "naive_full_scan")
rows = [[k, fmt(median_ns("slow_path_smt2", k)), fmt(base),
         f"{median_ns('slow_path_smt2', k) / base:.2f}"] for k in ("fork", "exec")]
table("Fork/exec slow path, 256 CPUs SMT2, 50 % busy (median)",
      ["kind", "select_task_rq", "naive full scan", "ratio"], rows)

on = median_ns("exec_bound_one_cpu", "fast_path_on")
off = median_ns("exec_bound_one_cpu", "fast_path_off")
table("Exec of a task bound to one CPU (median)",
      ["EXEC_BOUND_FAST_PATH on", "off (slow path)", "off / on"],
      [[fmt(on), fmt(off), f"{off / on:.1f}x"]])

a = median_ns("can_migrate_new_dst_cpu", "first_and_and")
b = median_ns("can_migrate_new_dst_cpu", "per_cpu_loop")
table("can_migrate_task new_dst_cpu (median)",
      ["first_and_and", "per-CPU loop", "loop / first_and_and"],
      [[fmt(a), fmt(b), f"{b / a:.1f}x"]])

f = median_ns("select_idle_core_smt8", "first_idle")
l = median_ns("select_idle_core_smt8", "last_idle")
table("select_idle_core on 8-thread cores, first vs last idle (median)",
      ["first idle (kernel)", "last idle", "last / first"],
      [[fmt(f), fmt(l), f"{l / f:.2f}"]])
