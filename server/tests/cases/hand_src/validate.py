import json, sys
TOP = {"version","name","generator","features","system","topology","cpus","llc","asym","task","request","expected"}
FEAT = {"SIS_UTIL","WA_IDLE","WA_WEIGHT","WA_BIAS","UTIL_EST","CACHE_HOT_BUDDY","PLACE_LAG","PREFER_LAST_IDLE_CPU","SKIP_SCHED_IDLE_FOR_IDLE_TASK","EXEC_BOUND_FAST_PATH"}
SYS = {"uclamp_used","core_sched","migration_cost_ns","node_reclaim_distance"}
TCPU = {"id","core","cluster","llc","node","capacity"}
CPU = {"id","online","nr_running","h_nr_idle","nr_delayed","cfs_h_nr_queued","curr_is_idle","ttwu_pending","vcpu_preempted","load_avg","runnable_avg","util_avg","util_est","capacity","actual_capacity","idle_exit_latency","idle_stamp","curr_is_per_cpu_kthread","core_cookie"}
TASK = {"policy","cpus_allowed","prev_cpu","recent_used_cpu","util_avg","util_est","runnable_avg","load_avg","uclamp_min","uclamp_max","wakee_flips","migration_disabled","core_cookie","numa_preferred_nid","per_cpu_kthread","running","sched_delayed","eligible","next_buddy","blocked","exec_start","hot"}
REQ_P = {"kind","this_cpu","sync","wf_current_cpu","in_task","waker_exiting","waker_wakee_flips","waker_last_wakee_is_task","waker_flip_decay_expired","waker_load","waker_is_per_cpu_kthread"}
REQ_M = {"kind","src_cpu","dst_cpu","sd_level","dst_group","env_cpus","idle","migration_type","flags","nr_balance_failed","cache_nice_tries","throttled","dst_cfs_nr_queued","now"}
PATHS = {"bound","current_cpu","target","prev","per_cpu_kthread","recent","capacity","capacity_none","no_llc","idle_smt","idle_core","core_scan_cpu","idle_cpu","prev_aff","recent_aff","fallback_target","slow_path","slow_path_prev","no_domain","fallback_rq","exec_stay_inactive"}
REASONS = {"delayed","throttled","ineligible","per_cpu_kthread","blocked","affinity","running","active_lb","cold","balance_failed","hot"}
FLAGS = ["ALL_PINNED","NEED_BREAK","DST_PINNED","SOME_PINNED","ACTIVE_LB"]
DETAIL = {"want_affine","affine","has_idle_core","nr_idle_scan"}
def cpulist(s, n):
    out = set()
    for part in s.split(","):
        if "-" in part:
            a, b = part.split("-"); a, b = int(a), int(b); assert a <= b
            out |= set(range(a, b + 1))
        else:
            out.add(int(part))
    assert all(0 <= c < n for c in out), s
    return out
def check(s):
    assert set(s) <= TOP, set(s) - TOP
    assert set(s.get("features", {})) <= FEAT
    assert set(s.get("system", {})) <= SYS
    tc = s["topology"]["cpus"]; n = len(tc)
    for i, c in enumerate(tc):
        assert c["id"] == i and set(c) <= TCPU
    assert len({("cluster" in c) for c in tc}) == 1
    nodes = max(c.get("node", 0) for c in tc) + 1
    if "numa_distance" in s["topology"]:
        d = s["topology"]["numa_distance"]; assert len(d) == nodes and all(len(r) == nodes for r in d)
    # core in one llc etc
    for key, parent in (("core", "llc"), ("llc", "node")):
        m = {}
        for c in tc:
            v = (c[key]); p = c.get(parent, 0)
            assert m.setdefault(v, p) == p, (key, v)
    cores = {}
    for c in tc:
        cores.setdefault(c["core"], set()).add(c.get("capacity", 1024))
    assert all(len(v) == 1 for v in cores.values())
    st = {}
    for c in s.get("cpus", []):
        assert set(c) <= CPU, set(c) - CPU
        assert c["id"] not in st; st[c["id"]] = c
        nr = c.get("nr_running", 0)
        assert c.get("h_nr_idle", 0) <= nr and c.get("nr_delayed", 0) <= nr
    online = lambda i: st.get(i, {}).get("online", True)
    t = s.get("task", {})
    assert set(t) <= TASK, set(t) - TASK
    if "cpus_allowed" in t: cpulist(t["cpus_allowed"], n)
    r = s["request"]; k = r["kind"]
    e = s["expected"]
    if k == "can_migrate":
        assert set(r) <= REQ_M, set(r) - REQ_M
        assert online(r["src_cpu"]) and online(r["dst_cpu"]) and r["src_cpu"] != r["dst_cpu"]
        for f in r.get("flags", []): assert f in FLAGS
        assert set(e) == {"allowed","new_dst_cpu","flags","reason","task_hot"}
        assert e["reason"] in REASONS
        assert e["flags"] == [f for f in FLAGS if f in e["flags"]]
    else:
        assert set(r) <= REQ_P, set(r) - REQ_P
        assert online(r["this_cpu"])
        if k == "wakeup": assert "prev_cpu" in t
        if k == "exec":
            c = st.get(r["this_cpu"], {}); assert c.get("nr_running", 0) >= 1 and not c.get("curr_is_idle", False)
        assert k in ("wakeup", "fork", "exec")
        assert e["path"] in PATHS and isinstance(e["cpu"], int) and isinstance(e["scanned"], int)
        assert set(e.get("detail", {})) <= DETAIL
    for key in s.get("llc", {}):
        assert int(key) in {c["llc"] for c in tc}
    assert s["generator"]["by"] == "hand" and 0 < len(s["generator"]["why"])
names = set(); paths = {}; reasons = {}
for ln, line in enumerate(open(sys.argv[1]), 1):
    s = json.loads(line)
    try:
        check(s)
    except AssertionError as ex:
        print("line", ln, s["name"], "FAIL", ex); continue
    assert s["name"] not in names; names.add(s["name"])
    e = s["expected"]
    if "path" in e: paths[e["path"]] = paths.get(e["path"], 0) + 1
    else: reasons[e["reason"]] = reasons.get(e["reason"], 0) + 1
print(len(names), "valid")
print("paths", sorted(paths.items()))
print("missing paths", PATHS - set(paths))
print("reasons", sorted(reasons.items()))
print("missing reasons", REASONS - set(reasons))
