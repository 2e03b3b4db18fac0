#!/usr/bin/env python3
"""Where a PickCpu's server time goes beyond a Ping's: a differential profile.

`fairplace-load rpc` runs Ping and PickCpu in alternating one-second slices
against one server. Sampled with perf over a whole run, each slice is told
apart by whether its samples show PickCpu's own functions; per call, a
symbol's cost in a phase is its share of that phase's samples times the
server's CPU per call the generator printed for it. The difference between
the phases, symbol by symbol, is what a PickCpu adds.

    taskset -c 1 target/release/fairplace-load --server-cpus 0 --server-threads 1 \\
        rpc --seconds 20 --concurrency 32 --connections 4 --transport plain > run.txt &
    sleep 2.5; perf record -e cpu-clock -F 5000 -m 2048 -p $(pgrep -f fairplace-server) \\
        -o perf.data -- sleep 38
    perf script -i perf.data -F time,ip,sym,dso > samples.txt
    benches/scripts/phase-profile.py samples.txt PING_US PICK_US

PING_US and PICK_US are the run's "server ... µs CPU ... per call" figures.
Slices are cut in 100 ms windows; a window is PickCpu's with at least 5
samples in PickCpu's functions, Ping's with none, and left out otherwise
(the windows a slice boundary cuts).
"""

import collections
import re
import sys

WINDOW_S = 0.1
PICK_ONLY = ("pick_on", "select_task_rq", "select_idle", "PickAnswer",
             "decisions::record", "registered_node", "pick_cpu_here")


def samples(path):
    pat = re.compile(r"\s*([\d.]+):\s+[0-9a-f]+\s+(.*?)\s+\((.*)\)\s*$")
    for line in open(path):
        m = pat.match(line)
        if not m:
            continue
        sym = re.sub(r"\+0x[0-9a-f]+$", "", m.group(2))
        dso = m.group(3)
        if "[kernel" in dso:
            sym = "[k] " + sym
        elif "libc" in dso:
            sym = "[libc] " + sym
        elif sym == "[unknown]":
            sym = dso
        yield float(m.group(1)), sym


def main():
    path, ping_us, pick_us = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    rows = list(samples(path))
    t0 = rows[0][0]
    windows = collections.defaultdict(list)
    for t, sym in rows:
        windows[int((t - t0) / WINDOW_S)].append(sym)
    phases = {"ping": collections.Counter(), "pick": collections.Counter()}
    for syms in windows.values():
        hits = sum(1 for s in syms if any(p in s for p in PICK_ONLY))
        phase = "pick" if hits >= 5 else "ping" if hits == 0 else None
        if phase and len(syms) > 3 * WINDOW_S * 1000:
            phases[phase].update(syms)
    n = {k: sum(v.values()) for k, v in phases.items()}
    if not n["ping"] or not n["pick"]:
        sys.exit("no whole window of one phase: sample a longer run")
    per_call = {"ping": ping_us * 1000, "pick": pick_us * 1000}
    diff = {}
    for sym in set(phases["ping"]) | set(phases["pick"]):
        a = phases["pick"][sym] / n["pick"] * per_call["pick"]
        b = phases["ping"][sym] / n["ping"] * per_call["ping"]
        diff[sym] = (a - b, a, b)
    groups = collections.Counter()
    for sym, (d, _, _) in diff.items():
        groups["kernel" if sym.startswith("[k]") else
               "libc" if sym.startswith("[libc]") else "server"] += d
    print(f"samples: ping {n['ping']}, pick {n['pick']}")
    print("PickCpu minus Ping, ns per call: " +
          ", ".join(f"{g} {v:+.0f}" for g, v in groups.items()))
    print(f"{'diff':>8} {'pick':>8} {'ping':>8}  symbol (ns per call)")
    for sym, (d, a, b) in sorted(diff.items(), key=lambda x: -x[1][0])[:40]:
        print(f"{d:8.1f} {a:8.1f} {b:8.1f}  {sym[:110]}")


if __name__ == "__main__":
    main()
