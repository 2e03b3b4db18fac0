import json
CASES = []

def mk_topo(n, core=lambda i: i, llc=lambda i: 0, node=lambda i: 0, cap=lambda i: 1024,
            cluster=None, dist=None):
    cpus = []
    for i in range(n):
        d = {"id": i, "core": core(i), "llc": llc(i), "node": node(i)}
        if cap(i) != 1024:
            d["capacity"] = cap(i)
        if cluster is not None:
            d["cluster"] = cluster(i)
        cpus.append(d)
    t = {"cpus": cpus}
    if dist is not None:
        t["numa_distance"] = dist
    return t

def busy(i, nr=1, **kw):
    d = {"id": i, "nr_running": nr}
    d.update(kw)
    return d

def idle(i, **kw):
    d = {"id": i}
    d.update(kw)
    return d

def case(name, why, topology, request, expected, cpus=None, task=None, features=None,
         system=None, llc=None, asym=None):
    s = {"version": 1, "name": name, "generator": {"by": "hand", "why": why}}
    if features: s["features"] = features
    if system: s["system"] = system
    s["topology"] = topology
    if cpus: s["cpus"] = sorted(cpus, key=lambda c: c["id"])
    if llc: s["llc"] = llc
    if asym: s["asym"] = asym
    if task is not None: s["task"] = task
    s["request"] = request
    s["expected"] = expected
    CASES.append(s)

def place(cpu, path, scanned, **detail):
    e = {"cpu": cpu, "path": path, "scanned": scanned}
    if detail:
        e["detail"] = detail
    return e

def mig(allowed, reason, flags, new_dst=None, hot=None):
    return {"allowed": allowed, "new_dst_cpu": new_dst, "flags": flags, "reason": reason, "task_hot": hot}

def wake(this, **kw):
    d = {"kind": "wakeup", "this_cpu": this}
    d.update(kw)
    return d

# common topologies
SMT1_8 = mk_topo(8)
SMT1_16 = mk_topo(16)
SMT1_32 = mk_topo(32)
SMT2_8 = mk_topo(8, core=lambda i: i // 2)            # {0,1},{2,3},{4,5},{6,7}
SMT2X_8 = mk_topo(8, core=lambda i: i % 4)            # {0,4},{1,5},{2,6},{3,7}
SMT4_16 = mk_topo(16, core=lambda i: i // 4)
SMT8_16 = mk_topo(16, core=lambda i: i // 8)
CLS16 = mk_topo(16, cluster=lambda i: i // 4)
CLS_SMT16 = mk_topo(16, core=lambda i: i // 2, cluster=lambda i: i // 4)
LLC2_8 = mk_topo(8, llc=lambda i: i // 4)
NUMA8_D20 = mk_topo(8, llc=lambda i: i // 4, node=lambda i: i // 4, dist=[[10, 20], [20, 10]])
NUMA8_D40 = mk_topo(8, llc=lambda i: i // 4, node=lambda i: i // 4, dist=[[10, 40], [40, 10]])
NOLLC4 = mk_topo(4, llc=lambda i: i)
ONECPU_NODE4 = mk_topo(4, llc=lambda i: 0 if i == 0 else 1, node=lambda i: 0 if i == 0 else 1,
                       dist=[[10, 40], [40, 10]])
LLC_PER_CORE8 = mk_topo(8, core=lambda i: i // 2, llc=lambda i: i // 2)
ASYM1 = mk_topo(8, cap=lambda i: 512 if i < 4 else 1024)
ASYM2 = mk_topo(8, llc=lambda i: i // 4, cap=lambda i: 512 if i < 4 else 1024)
ASYM_SMT = mk_topo(8, core=lambda i: i // 2, cap=lambda i: 512 if i < 4 else 1024)

def dump(path):
    names = set()
    with open(path, "w") as f:
        for s in CASES:
            assert s["name"] not in names, s["name"]
            names.add(s["name"])
            f.write(json.dumps(s, separators=(",", ":")) + "\n")
    print(len(CASES), "cases written")
