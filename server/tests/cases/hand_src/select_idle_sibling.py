"""select_idle_sibling and select_idle_cpu: clusters, nr_idle_scan (SIS_UTIL) on large LLCs,
probe order, idle-core wrap on interleaved SMT2, idle-core mode, UTIL_EST, an LLC of one
core, select_idle_smt on SMT4, and the idle predicates.

Each case() carries its reasoning in generator.why; build.py writes them all to
../hand.jsonl."""
from lib import *

# ---------------- clusters ----------------
WHY_CLS = ("SMT1 16 CPUs, one LLC, clusters of 4: SMT degenerates, tree CLS(4) -> MC(16); MC's first group is the CLS span carrying CLUSTER, so select_idle_cpu "
           "scans target's cluster first; cluster_active, share_id = first CPU of the cluster. ")
case("cluster-prev-aff",
     WHY_CLS + "sync wakeup, this 1 (only the waker) -> this_sync, target 1. prev 5 idle, same LLC but other cluster -> prev_aff=5. Hint nr_idle_scan 4: cluster phase "
     "wrap({0-3},2) tests 2,3,0,1 (all busy), main phase at 4 has nr 0 -> none; return prev_aff 5, scanned 4.",
     CLS16, wake(1, sync=True), place(5, "prev_aff", 4, affine="this_sync", nr_idle_scan=4),
     cpus=[busy(0), busy(1), busy(2), busy(3), busy(4)], task={"prev_cpu": 5}, llc={"0": {"nr_idle_scan": 4}})
case("cluster-recent-aff",
     WHY_CLS + "this=prev=1 busy; recent 9 idle, same LLC, other cluster -> kept as r. Hint budget 4: cluster phase 2,3,0,1 busy (4 tests), main phase stops at 4 -> "
     "no prev_aff, return r: recent_aff 9, scanned 4.",
     CLS16, wake(1), place(9, "recent_aff", 4, nr_idle_scan=4),
     cpus=[busy(0), busy(1), busy(2), busy(3), busy(4)], task={"prev_cpu": 1, "recent_used_cpu": 9}, llc={"0": {"nr_idle_scan": 4}})
case("cluster-recent-same-cluster",
     WHY_CLS + "this=prev=1 busy; recent 3 idle in the same cluster as target 1 -> cpus_share_resources -> recent, no scan.",
     CLS16, wake(1), place(3, "recent", 0), cpus=[busy(0), busy(1), busy(2)], task={"prev_cpu": 1, "recent_used_cpu": 3})
case("cluster-phase-finds-own-cluster-first",
     WHY_CLS + "this=prev=1 busy, CPU 0 idle, 2,3 busy, 4 idle. Budget derived 3*600/16=112 -> 15. Cluster phase wrap({0-3},2): 2, 3 busy, 0 idle -> 0 at test 3 "
     "(a plain LLC walk from 2 would have taken 4).",
     CLS16, wake(1), place(0, "idle_cpu", 3, nr_idle_scan=15),
     cpus=[busy(1, util_avg=600), busy(2, util_avg=600), busy(3, util_avg=600)], task={"prev_cpu": 1})
case("cluster-phase-then-main-phase",
     WHY_CLS + "this=prev=1, whole cluster 0-3 busy, 4 busy, 5 idle; derived budget 5*600/16=187 -> 15. Cluster phase 2,3,0,1 (4 tests), main phase over 4-15 from 2: 4 busy, 5 idle -> 5, scanned 6.",
     CLS16, wake(1), place(5, "idle_cpu", 6),
     cpus=[busy(i, util_avg=600) for i in range(5)], task={"prev_cpu": 1})
case("cluster-prev-same-cluster",
     WHY_CLS + "sync wakeup, this 1 -> this_sync, target 1; prev 2 idle in the same cluster -> cpus_share_resources -> prev.",
     CLS16, wake(1, sync=True), place(2, "prev", 0, affine="this_sync"), cpus=[busy(1)], task={"prev_cpu": 2})
cs = [busy(1, util_avg=500), busy(2, util_avg=500), busy(4, util_avg=500), busy(6, util_avg=500), busy(8, util_avg=500),
      busy(10, util_avg=500), busy(15, util_avg=500)]
case("cluster-smt-idle-core-mode",
     "SMT2 16 CPUs with clusters of 2 cores: tree SMT -> CLS -> MC, MC's first group = target's cluster. this=prev=1; core {12,13} fully idle so has_idle_cores derived true. "
     "Cluster phase wrap({0-3},2): core{2,3}: 2 busy, 3 idle (recorded) = 2 tests; 3 skipped (removed); core{0,1}: 0 idle, 1 busy break = 2; "
     "main phase from 2 over 4-15: cores 4,6,8,10 stop at their busy first thread (4 tests), core{12,13}: 12, 13 idle -> idle core 12. scanned 10.",
     CLS_SMT16, wake(1), place(12, "idle_core", 10, has_idle_core=True, nr_idle_scan=15), cpus=cs, task={"prev_cpu": 1})

# ---------------- B.1 nr_idle_scan on a 32-CPU LLC ----------------
def b1_state(utils, idle_ids=()):
    out = []
    for i, u in enumerate(utils):
        if i in idle_ids:
            out.append(idle(i, util_avg=u))
        else:
            out.append(busy(i, util_avg=u))
    return out
WHY_B1 = "Appendix B.1: SMT1 32 CPUs one LLC (tree MC only, pct 117), this=prev=0 busy target, per-CPU scan from 1. "
case("b1-sum-util-0-budget-32",
     WHY_B1 + "All 32 busy with util 0: sum_util 0 -> nr_idle_scan 32; the walk 1..31 then target 0 = 32 tests, none idle -> fallback_target, scanned 32.",
     SMT1_32, wake(0), place(0, "fallback_target", 32, nr_idle_scan=32), cpus=b1_state([0] * 32), task={"prev_cpu": 0})
case("b1-sum-util-8000-budget-29",
     WHY_B1 + "util 250 everywhere: sum 8000, x=250, t=83, y=941 -> 29; CPUs 1..29 tested busy, then nr hits 0 -> fallback_target, scanned 29.",
     SMT1_32, wake(0), place(0, "fallback_target", 29, nr_idle_scan=29), cpus=b1_state([250] * 32), task={"prev_cpu": 0})
case("b1-sum-util-16000-found-at-21",
     WHY_B1 + "util 500 everywhere (sum 16000 -> x=500, t=334, y=690 -> 21); CPU 21 idle (blocked util 500): it is the 21st and last allowed probe -> idle_cpu 21, scanned 21.",
     SMT1_32, wake(0), place(21, "idle_cpu", 21, nr_idle_scan=21), cpus=b1_state([500] * 32, idle_ids=(21,)), task={"prev_cpu": 0})
case("b1-sum-util-16000-idle-22-not-reached",
     WHY_B1 + "sum 16000 -> 21; only CPU 22 idle: 21 probes (1..21) fail, the budget ends before 22 -> fallback_target, scanned 21.",
     SMT1_32, wake(0), place(0, "fallback_target", 21, nr_idle_scan=21), cpus=b1_state([500] * 32, idle_ids=(22,)), task={"prev_cpu": 0})
case("b1-sum-util-24000-budget-8",
     WHY_B1 + "util 750 (sum 24000, x=750, t=751, y=273 -> 8); CPU 9 idle is just past the budget: probes 1..8 -> fallback_target, scanned 8.",
     SMT1_32, wake(0), place(0, "fallback_target", 8, nr_idle_scan=8), cpus=b1_state([750] * 32, idle_ids=(9,)), task={"prev_cpu": 0})
case("b1-sum-util-27500-budget-1",
     WHY_B1 + "utils 12x860 + 20x859 = 27500 (x=859, t=986, y=38 -> 1); one probe (CPU 1 busy); CPU 2 idle not reached -> fallback_target, scanned 1.",
     SMT1_32, wake(0), place(0, "fallback_target", 1, nr_idle_scan=1),
     cpus=b1_state([860] * 12 + [859] * 20, idle_ids=(2,)), task={"prev_cpu": 0})
case("b1-sum-util-28000-budget-0",
     WHY_B1 + "util 875 (sum 28000, x=875, t=1023, y=1 -> 0): select_idle_cpu returns at once (nr==1) although CPU 1 is idle -> fallback_target, scanned 0.",
     SMT1_32, wake(0), place(0, "fallback_target", 0, nr_idle_scan=0), cpus=b1_state([875] * 32, idle_ids=(1,)), task={"prev_cpu": 0})

# ---------------- B.4 probe order ----------------
case("b4-probe-order-6-7-0-none",
     "Appendix B.4: SMT1 LLC 0-7, this=prev=5 busy target, hint nr_idle_scan 3: probes 6, 7, 0 (all busy); CPU 1 idle is not probed -> fallback_target 5, scanned 3.",
     SMT1_8, wake(5), place(5, "fallback_target", 3, nr_idle_scan=3),
     cpus=[busy(i) for i in (0, 2, 3, 4, 5, 6, 7)], task={"prev_cpu": 5}, llc={"0": {"nr_idle_scan": 3}})
case("b4-probe-order-0-found",
     "Appendix B.4 with CPU 0 idle: probes 6, 7 busy, 0 idle -> idle_cpu 0, scanned 3 (CPU 1 also idle, not reached).",
     SMT1_8, wake(5), place(0, "idle_cpu", 3, nr_idle_scan=3),
     cpus=[busy(i) for i in (2, 3, 4, 5, 6, 7)], task={"prev_cpu": 5}, llc={"0": {"nr_idle_scan": 3}})

# ---------------- B.5 idle-core wrap on interleaved SMT2 ----------------
WHY_B5 = ("Appendix B.5: SMT2 cores {0,4} {1,5} {2,6} {3,7}, LLC 0-7, this=prev=1 busy target; idle-core mode walks wrap from 2 over the live mask. ")
b5a = [busy(1, util_avg=500), busy(5, util_avg=500), busy(2, util_avg=500), busy(7, util_avg=500)]
case("b5-idle-core-returns-iteration-cpu",
     WHY_B5 + "Core {0,4} fully idle (derived has_idle_cores true). CPU 2: core{2,6}: 2 busy, 6 idle recorded (2 tests); CPU 3: core{3,7}: 3 idle, 7 busy break (2); "
     "CPU 4: core{0,4}: 0, 4 idle -> idle core, returns the iteration CPU 4 (not 0). scanned 6.",
     SMT2X_8, wake(1), place(4, "idle_core", 6, has_idle_core=True), cpus=b5a, task={"prev_cpu": 1})
b5b = b5a + [busy(0, util_avg=500)]
case("b5-core-scan-first-idle",
     WHY_B5 + "CPU 0 also busy, hint has_idle_cores true. 2 busy, 6 idle (record 6); 3 idle, 7 busy break; CPU 4: 0 busy break; CPU 5: 1 busy break; "
     "rest removed -> core_scan_cpu 6, scanned 6.",
     SMT2X_8, wake(1), place(6, "core_scan_cpu", 6, has_idle_core=True, nr_idle_scan=6), cpus=b5b, task={"prev_cpu": 1},
     llc={"0": {"has_idle_cores": True}})
case("b5-core-scan-prefer-last",
     WHY_B5 + "Same as the core_scan case with PREFER_LAST on: 6 recorded, then 3 (idle, before busy 7) overwrites; cores {0,4},{1,5} exit at their first busy thread -> 3, scanned 6.",
     SMT2X_8, wake(1), place(3, "core_scan_cpu", 6, has_idle_core=True), cpus=b5b, task={"prev_cpu": 1},
     llc={"0": {"has_idle_cores": True}}, features={"PREFER_LAST_IDLE_CPU": True})
case("b5-derived-no-idle-core-smt",
     WHY_B5 + "Same busy set, no hint: has_idle_cores derived false -> select_idle_smt(prev 1) tests sibling 5 (busy, 1 test); per-CPU select_idle_cpu from 2 "
     "(budget 2500/8=312 -> 6): 2 busy, 3 idle -> 3. scanned 3.",
     SMT2X_8, wake(1), place(3, "idle_cpu", 3, has_idle_core=False, nr_idle_scan=6), cpus=b5b, task={"prev_cpu": 1})

# ---------------- idle-core mode: all busy, budget ignored ----------------
case("idle-core-mode-all-busy-scans-everything",
     "SMT2 8 CPUs all busy, hints has_idle_cores true and nr_idle_scan 2. Idle-core mode never decrements nr, and with no idle CPU recorded select_idle_core visits "
     "every sibling: cores {0,1},{2,3},{4,5},{6,7} from wrap(1) = 8 tests -> none -> fallback_target 0.",
     SMT2_8, wake(0), place(0, "fallback_target", 8, has_idle_core=True, nr_idle_scan=2),
     cpus=[busy(i) for i in range(8)], task={"prev_cpu": 0}, llc={"0": {"has_idle_cores": True, "nr_idle_scan": 2}})
case("idle-core-mode-budget-zero-returns",
     "SMT2 8 CPUs, core {2,3} idle (derived has_idle_cores true) but hint nr_idle_scan 0: select_idle_cpu returns before scanning even in idle-core mode; "
     "select_idle_smt is skipped because has_idle_core is true -> fallback_target 0, scanned 0.",
     SMT2_8, wake(0), place(0, "fallback_target", 0, has_idle_core=True, nr_idle_scan=0),
     cpus=[busy(0), busy(1), busy(4), busy(5), busy(6), busy(7)], task={"prev_cpu": 0}, llc={"0": {"nr_idle_scan": 0}})
case("idle-core-offline-sibling",
     "SMT2 8 CPUs, CPU 5 offline so core {4,5} has one online thread. this=prev=0; has_idle_cores derived true via CPU 4 alone. Walk from 1: core{0,1}: 0, 1 busy (nothing recorded, "
     "both visited) = 2; core{2,3}: 2 busy, 3 idle recorded = 2; CPU 4: smt_mask {4} idle -> idle core 4. scanned 5.",
     SMT2_8, wake(0), place(4, "idle_core", 5, has_idle_core=True),
     cpus=[busy(0), busy(1), busy(2), idle(5, online=False), busy(6)], task={"prev_cpu": 0})
case("idle-core-sched-idle-sibling-recorded",
     "SMT2 8 CPUs, hint has_idle_cores true, this=prev=0. Walk from 1: core{0,1}: 0 busy (normal), 1 SCHED_IDLE-only -> recorded and break (2 tests); core{2,3}: "
     "2 busy -> break (1); core{4,5}: 4 busy break (1); core{6,7}: 6 busy break (1) -> core_scan_cpu 1, scanned 5.",
     SMT2_8, wake(0), place(1, "core_scan_cpu", 5, has_idle_core=True),
     cpus=[busy(0), busy(1, h_nr_idle=1), busy(2), busy(4), busy(6)], task={"prev_cpu": 0}, llc={"0": {"has_idle_cores": True}})

# ---------------- SIS_UTIL derived exhaustion / UTIL_EST ----------------
ex = [busy(i, util_avg=1024) for i in range(8) if i != 4] + [idle(4, util_avg=900)]
case("sis-util-derived-budget-zero",
     "SMT1 8 CPUs, 7 busy at util 1024 and idle CPU 4 with blocked util 900: sum 8068, x=1008, t capped 1024 -> nr_idle_scan 0; select_idle_cpu returns at once -> "
     "fallback_target 0 although CPU 4 is idle; scanned 0.",
     SMT1_8, wake(0), place(0, "fallback_target", 0, nr_idle_scan=0), cpus=ex, task={"prev_cpu": 0})
case("sis-util-off-unbounded-scan",
     "Same state with SIS_UTIL off: no budget; scan from 1: 1, 2, 3 busy, 4 idle -> idle_cpu 4, scanned 4 (nr_idle_scan not consulted).",
     SMT1_8, wake(0), place(4, "idle_cpu", 4, nr_idle_scan=None), cpus=ex, task={"prev_cpu": 0}, features={"SIS_UTIL": False})
ue = [busy(i, util_avg=100, util_est=1024) for i in range(8) if i != 4]
case("sis-util-util-est-raises-util",
     "SMT1 8 CPUs, 7 busy with util_avg 100 but util_est 1024; UTIL_EST on: cpu_util_cfs = 1024 each, sum 7168, x=896 -> t capped -> nr_idle_scan 0 -> fallback_target 0, scanned 0.",
     SMT1_8, wake(0), place(0, "fallback_target", 0, nr_idle_scan=0), cpus=ue, task={"prev_cpu": 0})
case("sis-util-util-est-off",
     "Same with UTIL_EST off: sum 700, x=87, t=10, y=1014 -> 7; scan 1, 2, 3 busy, 4 idle -> idle_cpu 4, scanned 4.",
     SMT1_8, wake(0), place(4, "idle_cpu", 4, nr_idle_scan=7), cpus=ue, task={"prev_cpu": 0}, features={"UTIL_EST": False})

# ---------------- LLC = one SMT2 core: domain and pct 110 budget ----------------
case("llc-per-core-budget-uses-smt-pct",
     "8 CPUs, SMT2 cores, each core its own LLC: MC{0,1} equals SMT{0,1} with one group -> MC removed, SMT keeps SHARE_LLC and takes the llc object; tree SMT -> PKG. "
     "this 0 / prev 2 meet at PKG: weight 200*100 < 1900*108 -> this. prev is in another LLC so no select_idle_smt; has_idle_cores false (0 busy). "
     "Budget over SMT{0,1} with its pct 110: sum 1000+280, x=640, t=484, y=540 -> 1 (pct 117 would give 0): probe 1 idle -> idle_cpu 1, scanned 1.",
     LLC_PER_CORE8, wake(0), place(1, "idle_cpu", 1, affine="this_weight", has_idle_core=False, nr_idle_scan=1),
     cpus=[busy(0, util_avg=1000, load_avg=100), idle(1, util_avg=280), busy(2, load_avg=2000), busy(3)],
     task={"prev_cpu": 2, "load_avg": 100})

# ---------------- SMT4 select_idle_smt ----------------
s4 = [busy(0, util_avg=600), busy(4, util_avg=600), busy(8, util_avg=600), busy(9, util_avg=600), busy(10, util_avg=600), busy(12, util_avg=600)]
case("smt4-select-idle-smt",
     "SMT4 16 CPUs (cores 0-3,4-7,8-11,12-15), every core has a busy thread so has_idle_cores derived false. this=prev=9 busy: select_idle_smt(9) tests 8 (busy), "
     "skips 9, tests 10 (busy), 11 (idle) -> idle_smt 11, scanned 3.",
     SMT4_16, wake(9), place(11, "idle_smt", 3, has_idle_core=False), cpus=s4, task={"prev_cpu": 9})
case("smt4-smt-miss-then-llc-scan",
     "Same, but 11 is not allowed (0-10,12-15): select_idle_smt tests 8, 10 (2). Per-CPU scan (budget 3600/16=225 -> 14) over allowed CPUs from 10: 10 busy, (11 not in mask), "
     "12 busy, 13 idle -> idle_cpu 13. scanned 2+3=5.",
     SMT4_16, wake(9), place(13, "idle_cpu", 5, has_idle_core=False, nr_idle_scan=14), cpus=s4, task={"prev_cpu": 9, "cpus_allowed": "0-10,12-15"})
case("smt-select-idle-smt-on-prev-core-not-target",
     "SMT4 16 CPUs, this 1 (core 0-3), prev 9 (core 8-11), both busy; loads make wake_affine pick this (100*200 < 108*900). No idle core; select_idle_smt looks at prev's "
     "siblings: 8 busy, 10 idle -> idle_smt 10 (2 tests), not a CPU of target's core (2 and 3 are idle).",
     SMT4_16, wake(1), place(10, "idle_smt", 2, affine="this_weight"),
     cpus=[busy(0), busy(1, load_avg=100), busy(4), busy(8), busy(9, load_avg=1000), busy(12)], task={"prev_cpu": 9, "load_avg": 100})

# ---------------- idle predicates ----------------
case("idle-predicates-pending-preempted-curr",
     "SMT1 8 CPUs, this=prev=0 busy. CPU 1 idle but ttwu_pending, CPU 2 idle but vcpu_preempted, CPU 3 nr_running 0 with curr_is_idle false: none is available idle. "
     "Budget 500/8 -> 7. Probes 1, 2, 3 fail, 4 idle -> idle_cpu 4, scanned 4.",
     SMT1_8, wake(0), place(4, "idle_cpu", 4, nr_idle_scan=7),
     cpus=[busy(0, util_avg=500), idle(1, ttwu_pending=True), idle(2, vcpu_preempted=True), idle(3, curr_is_idle=False)],
     task={"prev_cpu": 0})
case("idle-core-vcpu-preempted-sibling",
     "SMT2 8 CPUs, this=prev=0 busy; core {2,3}: 3 vcpu_preempted (idle_cpu but not available); core {4,5} idle. has_idle_cores derived true ({4,5}). Walk from 1: "
     "core{0,1}: 0 busy, 1 idle recorded (2 tests); core{2,3}: 2 idle, 3 not available -> break (2); core{4,5}: 4, 5 idle -> idle core 4. scanned 6.",
     SMT2_8, wake(0), place(4, "idle_core", 6, has_idle_core=True),
     cpus=[busy(0), idle(3, vcpu_preempted=True), busy(6), busy(7)], task={"prev_cpu": 0})
