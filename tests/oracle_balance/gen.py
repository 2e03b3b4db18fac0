#!/usr/bin/env python3
"""Random nodes for the load-balancer differential test.

    python3 gen.py --seed S --count N          N nodes as JSON Lines
    python3 gen.py --seed S --count N --stats  also run model.py in-process and print,
                                               on stderr, what the proposals cover

Each node: a topology in the scenario format (SMT1/2/4/8, 1-4 LLCs, 1, 2 or 4 NUMA nodes
(four in a chain at unequal distances),
4-64 CPUs, packed or x86-interleaved numbering, now and then LLCs of unequal size),
every CPU online with capacity 1024, per-CPU state consistent with the CPU's task list
(nr_running, load/util/util_est/runnable sums), the task lists (head = most recently
run, the head task running; several tasks per CPU, idle CPUs; nice-weighted and
fractional loads; no, one-CPU, core, LLC, node, random and cross-LLC affinities;
per-CPU kthreads, tasks preempted with migration disabled), and the destination CPUs of the pass ("" = every CPU).
Task clocks are unknown (clock_task 0), so every task is cache-cold.

Node JSON:
  {"name", "topology": {"cpus": [{"id","core","llc","node","capacity"}], "numa_distance"?},
   "cpus": [{"id","nr_running","load_avg","runnable_avg","util_avg","util_est"}],
   "tasks": [{"cpu", "tasks": [{"id","group","nice","load_avg","util_avg","util_est",
              "runnable_avg","cpus_allowed","running","exec_start","per_cpu_kthread",
              "migration_disabled"}]}],
   "dst_cpus": cpulist}
The same seed always gives the same nodes.
"""

import argparse
import json
import os
import random
import sys

sys.dont_write_bytecode = True

# sched_prio_to_weight[], nice -20..19
NICE_WEIGHT = [
    88761, 71755, 56483, 46273, 36291, 29154, 23254, 18705, 14949, 11916,
    9548, 7620, 6100, 4904, 3906, 3121, 2501, 1991, 1586, 1277,
    1024, 820, 655, 526, 423, 335, 272, 215, 172, 137,
    110, 87, 70, 56, 45, 36, 29, 23, 18, 15,
]

CLOCK = 1_000_000_000_000


def cpulist(cpus):
    cpus = sorted(set(cpus))
    out = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


def gen_topology(rng):
    smt = rng.choice([1, 1, 2, 2, 2, 4, 8])
    r = rng.random()
    # Four nodes in a chain at unequal distances (three NUMA levels,
    # overlapping groups, groups built from a descended sibling: the live
    # kernel showed the balancer had their flags wrong).
    n_nodes = 1 if r < 0.55 else 2 if r < 0.9 else 4
    llc_per_node = rng.choice([1, 2, 3, 4]) if n_nodes == 1 else rng.choice([1, 2]) if n_nodes == 2 else 1
    n_llc = n_nodes * llc_per_node
    lo = max(1, -(-4 // (smt * n_llc)))
    hi = max(lo, 64 // (smt * n_llc))
    if rng.random() < 0.6:
        hi = max(lo, min(hi, 24 // (smt * n_llc)))     # small nodes are quicker to read
    base = rng.randint(lo, hi)
    cores = [base] * n_llc
    if rng.random() < 0.2 and n_llc > 1:
        # LLCs of unequal size (still symmetric capacity)
        for k in range(n_llc):
            cores[k] = max(1, base + rng.randint(-1, 2))
        while sum(cores) * smt > 64:
            k = cores.index(max(cores))
            cores[k] -= 1
    # (llc, node, global core) of every core, in core order
    core_list = []
    for llc in range(n_llc):
        for _ in range(cores[llc]):
            core_list.append((llc, llc // llc_per_node))
    n_cores = len(core_list)
    ncpu = n_cores * smt
    interleaved = smt > 1 and rng.random() < 0.35
    cpus = [None] * ncpu
    for g, (llc, node) in enumerate(core_list):
        for t in range(smt):
            cid = t * n_cores + g if interleaved else g * smt + t
            cpus[cid] = {"id": cid, "core": g, "llc": llc, "node": node, "capacity": 1024}
    topo = {"cpus": cpus}
    if n_nodes == 2 and rng.random() < 0.3:
        d = rng.choice([12, 16, 21, 32])
        topo["numa_distance"] = [[10, d], [d, 10]]
    elif n_nodes == 4:
        step = rng.choice([6, 8])
        topo["numa_distance"] = [[10 if a == b else 10 + step * abs(a - b) for b in range(4)] for a in range(4)]
    shape = {"smt": smt, "nodes": n_nodes, "llcs": n_llc, "cpus": ncpu,
             "interleaved": interleaved, "uneven": len(set(cores)) > 1}
    return topo, shape


def gen_tasks_per_cpu(rng, topo, mode):
    cpus = topo["cpus"]
    n = len(cpus)
    counts = [0] * n
    if mode == "random":
        p_idle = rng.choice([0.1, 0.3, 0.5, 0.7])
        maxk = rng.choice([2, 3, 4, 6])
        for c in range(n):
            if rng.random() >= p_idle:
                counts[c] = rng.randint(1, maxk)
    elif mode == "hotspot":
        for c in range(n):
            counts[c] = 1 if rng.random() < 0.3 else 0
        for _ in range(rng.randint(1, 3)):
            counts[rng.randrange(n)] = rng.randint(2, 12)
    elif mode == "busy":
        for c in range(n):
            counts[c] = rng.choice([1, 1, 1, 2, 2, 3, 4])
    elif mode == "skew":
        # one LLC (or node) loaded, the rest mostly idle
        key = rng.choice(["llc", "node"])
        target = cpus[rng.randrange(n)][key]
        for c in range(n):
            if cpus[c][key] == target:
                counts[c] = rng.randint(1, 4)
            elif rng.random() < 0.15:
                counts[c] = 1
    elif mode == "smt":
        # SMT siblings loaded, whole cores idle
        for c in range(n):
            counts[c] = rng.choice([0, 0, 1, 2]) if c % 2 == 0 else rng.choice([0, 1])
    return counts


def gen_affinity(rng, topo, c, pin_rate):
    cpus = topo["cpus"]
    n = len(cpus)
    if rng.random() >= pin_rate:
        return ""
    me = cpus[c]
    kind = rng.choice(["one", "one", "core", "llc", "node", "random", "cross", "pair"])
    if kind == "one":
        s = [c]
    elif kind == "core":
        s = [i for i in range(n) if cpus[i]["core"] == me["core"]]
    elif kind == "llc":
        s = [i for i in range(n) if cpus[i]["llc"] == me["llc"]]
    elif kind == "node":
        s = [i for i in range(n) if cpus[i]["node"] == me["node"]]
    elif kind == "random":
        s = [c] + rng.sample(range(n), rng.randint(1, max(1, n // 2)))
    elif kind == "cross":
        others = [i for i in range(n) if cpus[i]["llc"] != me["llc"]]
        s = [c] + (rng.sample(others, min(len(others), rng.randint(1, 4))) if others else [])
    else:
        s = [c, rng.randrange(n)]
    s = sorted(set(s))
    if len(s) == n:
        return ""
    return cpulist(s)


def gen_node(rng, name):
    topo, shape = gen_topology(rng)
    n = len(topo["cpus"])
    mode = rng.choice(["random", "random", "hotspot", "busy", "skew", "smt"])
    counts = gen_tasks_per_cpu(rng, topo, mode)
    pin_rate = rng.choice([0.0, 0.0, 0.1, 0.3, 0.6])
    nice_rate = rng.choice([0.0, 0.2, 0.5])
    full_load = rng.random() < 0.4
    next_id = 1
    states = []
    lists = []
    groups = [rng.randint(100, 999) for _ in range(rng.randint(1, 5))]
    for c in range(n):
        k = counts[c]
        tasks = []
        if k and rng.random() < 0.05:
            k += 1              # one more: a per-CPU kthread
        cpu_util = rng.randint(200, 1024)
        over = rng.random() < 0.1        # CPU util sum above capacity
        # the running task is normally the head (it ran last); now and then a task
        # queued after it sorts first
        run_at = 1 if k > 1 and rng.random() < 0.1 else 0
        for j in range(k):
            kthread = j == k - 1 and k > counts[c]
            nice = 0
            if rng.random() < nice_rate:
                nice = rng.choice([-20, -10, -5, -1, 1, 5, 10, 19])
            w = NICE_WEIGHT[nice + 20]
            if full_load:
                load = w
            else:
                r = rng.random()
                if r < 0.4:
                    load = w
                elif r < 0.9:
                    load = max(0, int(w * rng.uniform(0.05, 1.0)))
                else:
                    load = rng.randint(0, 20)
            share = cpu_util // k if not over else rng.randint(200, 1024)
            util = max(0, int(share * rng.uniform(0.3, 1.0)))
            r = rng.random()
            if r < 0.5:
                util_est = util
            elif r < 0.8:
                util_est = 0
            else:
                util_est = rng.randint(0, 1024)
            runnable = rng.randint(util, 1024) if util <= 1024 else util
            mig_disabled = False
            if kthread:
                allowed = str(c)
                grp = 0
                load = min(load, 200)
            else:
                allowed = gen_affinity(rng, topo, c, pin_rate)
                grp = rng.choice(groups)
                # preempted inside migrate_disable(): bound to this CPU
                mig_disabled = j != run_at and rng.random() < 0.02
            tasks.append({
                "id": next_id, "group": grp, "nice": nice, "load_avg": load,
                "util_avg": util, "util_est": util_est, "runnable_avg": runnable,
                "cpus_allowed": allowed, "running": j == run_at,
                "exec_start": CLOCK - j * 1_000_000 - rng.randint(0, 999),
                "per_cpu_kthread": kthread, "migration_disabled": mig_disabled,
            })
            next_id += 1
        states.append({
            "id": c, "nr_running": len(tasks),
            "load_avg": sum(t["load_avg"] for t in tasks),
            "runnable_avg": sum(t["runnable_avg"] for t in tasks),
            "util_avg": sum(t["util_avg"] for t in tasks),
            "util_est": sum(t["util_est"] for t in tasks),
        })
        if tasks:
            lists.append({"cpu": c, "tasks": tasks})
    r = rng.random()
    if r < 0.5:
        dst = ""
    elif r < 0.75:
        idle = [c for c in range(n) if counts[c] == 0]
        dst = str(rng.choice(idle) if idle and rng.random() < 0.8 else rng.randrange(n))
    else:
        dst = cpulist(rng.sample(range(n), rng.randint(1, n)))
    shape.update({"mode": mode, "pin_rate": pin_rate})
    return {"name": name, "shape": shape, "topology": topo, "cpus": states, "tasks": lists,
            "dst_cpus": dst}


def generate(seed, count):
    rng = random.Random(seed)
    return [gen_node(rng, f"bal-{seed}-{i}") for i in range(count)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--stats", action="store_true")
    a = ap.parse_args()
    nodes = generate(a.seed, a.count)
    for nd in nodes:
        sys.stdout.write(json.dumps(nd, separators=(",", ":")) + "\n")
    if a.stats:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import model
        from collections import Counter
        cnt = Counter()
        for nd in nodes:
            node = model.Node(nd)
            props = node.run()
            cnt.update(node.stats)
            cnt["nodes"] += 1
            cnt["nodes with proposals"] += bool(props)
            for p in props:
                cnt[f"{p['kind']} {p['level']} {p['migration_type']}"] += 1
        for k, v in sorted(cnt.items()):
            sys.stderr.write(f"{v:7d}  {k}\n")


if __name__ == "__main__":
    main()
