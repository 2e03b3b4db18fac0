"""Asymmetric capacity (select_idle_capacity, uclamp fitting), the slow path for fork and exec
(sched_balance_find_dst_group/cpu), the NUMA slow path, and NUMA imbalance with 64 CPUs
(preferred node, LLCs per node).

Each case() carries its reasoning in generator.why; build.py writes them all to
../hand.jsonl."""
from lib import *

# ---------------- asymmetric capacity ----------------
WHY_A1 = ("8 CPUs SMT1 one LLC, CPUs 0-3 capacity 512, 4-7 capacity 1024: MC gets ASYM_CPUCAPACITY(_FULL), sd_asym=MC, its shared object is the llc one. ")
a1 = [busy(0, util_avg=400), idle(1, util_avg=600, load_avg=600), busy(3, util_avg=400), busy(4, util_avg=400, load_avg=500), busy(5, util_avg=400)]
case("asym-capacity-big-idle",
     WHY_A1 + "this 4, prev 1 idle -> wake_affine_idle prev. Task util 600 does not fit 512 (768000 >= 524288): target 1 fails asym_fits. select_idle_capacity from target 1 "
     "(budget 2200/8=275 -> 7): 1 idle no-fit rank -3 (best), 2 idle -3 (not better), 3, 4, 5 busy, 6 idle fits -> capacity 6, scanned 6.",
     ASYM1, wake(4), place(6, "capacity", 6, affine="prev_idle", nr_idle_scan=7), cpus=a1, task={"prev_cpu": 1, "util_avg": 600})
case("asym-capacity-budget-best-little",
     WHY_A1 + "Same with hint nr_idle_scan 3: 1 (best, -3), 2, 3 tested, then nr reaches 0 at CPU 4 -> return best 1: capacity 1, scanned 3.",
     ASYM1, wake(4), place(1, "capacity", 3, nr_idle_scan=3), cpus=a1, task={"prev_cpu": 1, "util_avg": 600}, llc={"0": {"nr_idle_scan": 3}})
case("asym-capacity-none",
     WHY_A1 + "All 8 busy, this=prev=0, hint nr_idle_scan 8: the walk wrap(0-7, 0) tests 0..7 (target first), no idle CPU, best none -> target: capacity_none, scanned 8.",
     ASYM1, wake(0), place(0, "capacity_none", 8, nr_idle_scan=8), cpus=[busy(i) for i in range(8)], task={"prev_cpu": 0, "util_avg": 300},
     llc={"0": {"nr_idle_scan": 8}})
a4 = [busy(0), busy(3), busy(4), busy(5), idle(6, actual_capacity=700), busy(7)]
case("asym-uclamp-min-minus-one",
     WHY_A1 + "Task util 100, uclamp_min 800 (uclamp_used derived true). this=prev=0 busy; hint budget 8. util_fits_cpu is -1 on littles (800 > actual 512) -> rank -4 cap 512, "
     "and -1 on CPU 6 (800 > actual_capacity 700) -> rank -4 cap 700 > 512 -> best 6. All 8 CPUs tested, no full fit -> capacity 6, scanned 8.",
     ASYM1, wake(0), place(6, "capacity", 8, nr_idle_scan=8), cpus=a4, task={"prev_cpu": 0, "util_avg": 100, "uclamp_min": 800},
     llc={"0": {"nr_idle_scan": 8}})
case("asym-uclamp-unused-little-fits",
     WHY_A1 + "Same state with system.uclamp_used false: util_fits_cpu is just fits_capacity, util 100 fits 512, so CPU 1 (second CPU of the walk from 0) is returned: capacity 1, scanned 2.",
     ASYM1, wake(0), place(1, "capacity", 2), cpus=a4, task={"prev_cpu": 0, "util_avg": 100, "uclamp_min": 800},
     llc={"0": {"nr_idle_scan": 8}}, system={"uclamp_used": False})
case("asym-uclamp-max-fits-little-target",
     WHY_A1 + "Task util 800 capped by uclamp_max 400: on a little CPU m=false and 400 <= 512 so it fits; this 4 busy, prev 1 idle -> prev_idle; target 1 idle and fits -> target.",
     ASYM1, wake(4), place(1, "target", 0, affine="prev_idle"), cpus=[busy(4, load_avg=500)], task={"prev_cpu": 1, "util_avg": 800, "uclamp_max": 400})
case("asym-capacity-wrap-starts-at-target",
     WHY_A1 + "this=prev=6 busy big, task util 600; 5 and 7 idle bigs, littles idle. select_idle_capacity walks from target 6 itself: 6 busy (test 1), 7 idle fits -> capacity 7, scanned 2.",
     ASYM1, wake(6), place(7, "capacity", 2), cpus=[busy(6), busy(4)], task={"prev_cpu": 6, "util_avg": 600})
a2 = [busy(0, load_avg=100), busy(2), busy(3), busy(4), busy(5, load_avg=1000), busy(7)]
case("asym-pkg-domain-own-budget",
     "8 CPUs, LLC0 = 0-3 (cap 512), LLC1 = 4-7 (cap 1024): tree MC -> PKG, PKG is ASYM_FULL with its own asym shared object (key 0-7). this 0, prev 5: wake_affine(PKG) "
     "weight 200*100 < 900*108 -> this. Asym path: select_idle_capacity(PKG, 0) uses the asym hint 8 (the llc hints 0 are not used): 0 busy, 1 idle no-fit (-3), 2-5 busy, "
     "6 idle fits -> capacity 6, scanned 7.",
     ASYM2, wake(0), place(6, "capacity", 7, affine="this_weight", nr_idle_scan=8), cpus=a2, task={"prev_cpu": 5, "util_avg": 600, "load_avg": 100},
     llc={"0": {"nr_idle_scan": 0}, "1": {"nr_idle_scan": 0}}, asym={"0-7": {"nr_idle_scan": 8}})
case("asym-smt-prefers-idle-core",
     "SMT2 asym: cores {0,1},{2,3} cap 512, {4,5},{6,7} cap 1024; tree SMT -> MC(ASYM_FULL). this 5 busy, prev 4 idle: wake_affine at SMT -> prev_idle, target 4. "
     "asym_fits_cpu(4) needs is_core_idle(4): sibling 5 busy -> fails. has_idle_cores derived true ({2,3},{6,7}) so no budget decrement. Walk from 4: 4 idle fits but "
     "not on an idle core -> rank -2 (best); 5 busy; 6 on an idle core fits -> capacity 6, scanned 3.",
     ASYM_SMT, wake(5), place(6, "capacity", 3, affine="prev_idle"), cpus=[busy(0, util_avg=500), busy(5, util_avg=500)],
     task={"prev_cpu": 4, "util_avg": 300})

# ---------------- slow path: fork / exec ----------------
case("fork-lowest-util-idle-cpu",
     "SMT1 8 CPUs, fork from busy 0 (util 500 -> has_spare, 0 idle). MC groups are single CPUs, all idle has_spare with 1 idle CPU; pick_idlest keeps the strictly lowest util in "
     "ring order: {1} 300, {2} 200, {3} 50, {4} 50 (tie kept), {6} 20, {7} 60 -> {6}; local 0 idle < 1 -> 6.",
     SMT1_8, {"kind": "fork", "this_cpu": 0}, place(6, "slow_path", 0),
     cpus=[busy(0, util_avg=500), idle(1, util_avg=300), idle(2, util_avg=200), idle(3, util_avg=50), idle(4, util_avg=50),
           idle(5, util_avg=100), idle(6, util_avg=20), idle(7, util_avg=60)])
fu = [busy(0, util_avg=500), idle(1, util_avg=300), idle(2, util_avg=200), idle(3, util_avg=50), idle(4, util_avg=50),
      idle(5, util_avg=100), idle(6, util_avg=20, util_est=300), idle(7, util_avg=60)]
case("fork-util-est-counts",
     "Same but CPU 6 has util_est 300: with UTIL_EST cpu_util(6)=300, so the lowest util is {3} (50; {4} ties and loses, {7} has 60) -> 3.",
     SMT1_8, {"kind": "fork", "this_cpu": 0}, place(3, "slow_path", 0), cpus=fu)
case("fork-util-est-off",
     "Same with UTIL_EST off: CPU 6 util 20 is the lowest again -> 6.",
     SMT1_8, {"kind": "fork", "this_cpu": 0}, place(6, "slow_path", 0), cpus=fu, features={"UTIL_EST": False})
ex_local = [busy(0, util_avg=800, load_avg=800, runnable_avg=800)] + [busy(i, util_avg=500, load_avg=500) for i in (1, 2, 3, 4, 6, 7)]
case("exec-subtracts-itself-stays",
     "SMT1 8 CPUs, exec on 0 where the exec'ing task (load/util/runnable 800) is the only task; CPU 5 idle, others busy util 500. Local {0}: nr 1-1=0 and exec on this_cpu "
     "-> 1 idle CPU, util 0; idlest remote {5} has 1 idle CPU; has_spare tie: local.idle >= idlest.idle -> stay: 0.",
     SMT1_8, {"kind": "exec", "this_cpu": 0}, place(0, "slow_path", 0), cpus=ex_local,
     task={"util_avg": 800, "load_avg": 800, "runnable_avg": 800})
case("fork-same-state-moves",
     "Same state as the exec case but fork: the parent stays counted on 0 (nr 1, 0 idle; util 800 -> has_spare), idlest {5} has 1 idle -> 5.",
     SMT1_8, {"kind": "fork", "this_cpu": 0}, place(5, "slow_path", 0), cpus=ex_local)
sm = [busy(0, util_avg=500), busy(2, util_avg=500), idle(4, idle_stamp=100), idle(5, idle_stamp=200)]
case("fork-smt2-descends-core-then-thread",
     "SMT2 8 CPUs, fork from 0. MC groups (cores): {0,1} and {2,3} have 1 idle, {4,5} and {6,7} 2 idle with util 0 -> idlest {4,5} (first with 2). "
     "find_dst_group_cpu({4,5}): no exit latency, stamps 100 then 200 > 100 -> 5. Restart below MC: SMT(5) groups {5},{4} both 1 idle -> stay. Answer 5.",
     SMT2_8, {"kind": "fork", "this_cpu": 0}, place(5, "slow_path", 0), cpus=sm)

# ---------------- NUMA slow path ----------------
nf = [busy(0, util_avg=500), busy(1, util_avg=500), busy(2, util_avg=400), busy(3, util_avg=450)]
WHY_NF = ("2 nodes x 4 CPUs, distance 20: tree MC(node) -> NUMA1; fork from 0, sd=NUMA1. Node 0 all busy (sum_nr 4 = weight, util 1850 -> has_spare, 0 idle), "
          "node 1 idle (4 idle). imb_numa_nr: MC and PKG both 4 CPUs, nr_llcs 1, 4>>3=0 -> 1. dst_running 5 > 1 -> no allowance; 0 < 4 idle -> idlest node 1. ")
case("numa-fork-no-idle-info-stays",
     WHY_NF + "find_dst_group_cpu(node 1): all idle with no exit latency and idle_stamp 0 -> none taken, least stays this_cpu 0 -> descend to MC(0): single busy CPUs, "
     "all has_spare with 0 idle -> local.idle >= idlest.idle -> stay. Answer 0.",
     NUMA8_D20, {"kind": "fork", "this_cpu": 0}, place(0, "slow_path", 0), cpus=nf)
case("numa-fork-idle-state-choice",
     WHY_NF + "Node 1 idle states: 4 lat 10; 5 lat 2 stamp 100; 6 lat 2 stamp 500; 7 no state stamp 1000. Ascending: 4 taken (10), 5 (2 < 10), 6 (lat equal, 500 > 100), "
     "7 (no state, 1000 > 500) -> 7. Restart in 7's MC: all idle, stay -> 7.",
     NUMA8_D20, {"kind": "fork", "this_cpu": 0}, place(7, "slow_path", 0),
     cpus=nf + [idle(4, idle_exit_latency=10), idle(5, idle_exit_latency=2, idle_stamp=100), idle(6, idle_exit_latency=2, idle_stamp=500),
                idle(7, idle_stamp=1000)])
fb = ([busy(0, util_avg=1000, load_avg=1000)] + [busy(i, util_avg=1000, load_avg=560) for i in (1, 2, 3)] +
      [busy(i, util_avg=1000, load_avg=500) for i in (4, 5, 6, 7)])
case("numa-fork-fully-busy-imbalance-174",
     "2 nodes x 4, distance 20, all CPUs busy util 1000 -> both nodes fully_busy. avg_load node0 = 2680*1024/4096 = 670, node1 = 500. NUMA rule with imb = 1024*17/100 = 174: "
     "500+174 >= 670 -> stay local. MC(0): singles fully_busy, idlest {1} (560): 560 >= 1174 no, 100000 <= 117*560 no -> 1.",
     NUMA8_D20, {"kind": "fork", "this_cpu": 0}, place(1, "slow_path", 0), cpus=fb)
case("numa-fork-far-node-d40-stays-in-node",
     "Same busy node 0 but distance 40 and node 1 idle: NUMA1 lacks BALANCE_FORK so sd=MC(0-3); within node 0 fully_busy singles: idlest {1} (560) -> 1.",
     NUMA8_D40, {"kind": "fork", "this_cpu": 0}, place(1, "slow_path", 0), cpus=fb[:4])
case("numa-exec-far-affinity-slow-path-prev",
     "Distance 40, exec on 0 with EXEC_BOUND_FAST_PATH off; task allowed only on node 1 (4-7): sd=MC(0-3) (NUMA1 lacks BALANCE_EXEC), span ∩ cpus_ptr empty -> prev 0: slow_path_prev.",
     NUMA8_D40, {"kind": "exec", "this_cpu": 0}, place(0, "slow_path_prev", 0), cpus=[busy(0)], task={"cpus_allowed": "4-7"},
     features={"EXEC_BOUND_FAST_PATH": False})
case("numa-exec-far-affinity-fallback-rq",
     "Same exec with EXEC_BOUND_FAST_PATH on: the wrapper checks is_cpu_allowed(0) -> false; fallback(0): node 0 has no allowed CPU, lowest allowed of cpus_ptr = 4: fallback_rq.",
     NUMA8_D40, {"kind": "exec", "this_cpu": 0}, place(4, "fallback_rq", 0), cpus=[busy(0)], task={"cpus_allowed": "4-7"})

# ---------------- B.6 with 64 CPUs ----------------
def stamps(lo, hi, best):
    return [idle(i, idle_stamp=(900 if i == best else 100)) for i in range(lo, hi)]
b6 = [busy(0, util_avg=500), busy(1, util_avg=500), busy(2, util_avg=500)] + stamps(32, 64, 45)
T2LLC = mk_topo(64, llc=lambda i: i // 16, node=lambda i: i // 32, dist=[[10, 20], [20, 10]])
T1LLC = mk_topo(64, llc=lambda i: i // 32, node=lambda i: i // 32, dist=[[10, 20], [20, 10]])
case("b6-two-llcs-per-node-goes-remote",
     "Appendix B.6: 2 nodes x 32, two 16-CPU LLCs per node: tree MC(16) -> PKG(32) -> NUMA1(64); imb_numa_nr = nr_llcs = 2. Fork from 0 with 3 tasks on node 0 (29 idle), "
     "node 1 all idle: dst_running 4 > 2 -> no allowance; 29 < 32 -> idlest node 1. Node-1 CPUs have idle_stamp 100 except 45 (900) -> 45. "
     "Below: PKG(45) both LLCs 16 idle -> stay; MC(45) singles all idle -> stay. Answer 45.",
     T2LLC, {"kind": "fork", "this_cpu": 0}, place(45, "slow_path", 0), cpus=b6)
case("b6-one-llc-per-node-still-remote",
     "Appendix B.6 with one 32-CPU LLC per node (tree MC -> NUMA1): imb_numa_nr = 32>>3 = 4; dst_running 4 <= 4 but the idle difference 3 > 2 is kept -> 29 < 32 -> node 1 -> 45.",
     T1LLC, {"kind": "fork", "this_cpu": 0}, place(45, "slow_path", 0), cpus=b6)
b6c = [busy(0, util_avg=500), busy(1, nr=2, util_avg=500)] + stamps(32, 64, 45)
case("b6-one-llc-per-node-diff-2-stays",
     "Appendix B.6, one LLC per node, node 0 runs 3 tasks on 2 CPUs (30 idle): dst_running 4 <= 4 and |30-32| = 2 <= 2 -> stay local. MC(0-31): {0} 0 idle, {1} 0 idle, "
     "{2} first group with 1 idle -> idlest; local 0 < 1 -> 2.",
     T1LLC, {"kind": "fork", "this_cpu": 0}, place(2, "slow_path", 0), cpus=b6c)
case("b6-preferred-nid-remote",
     "Same state as the diff-2 case but task numa_preferred_nid 1: node(this)=0 is not preferred, node of idlest's first CPU (32) is -> idlest node 1 -> 45.",
     T1LLC, {"kind": "fork", "this_cpu": 0}, place(45, "slow_path", 0), cpus=b6c, task={"numa_preferred_nid": 1})
case("b6-preferred-nid-local",
     "Two LLCs per node state (would go remote) but numa_preferred_nid 0 = node(this) -> stay. PKG(0): LLC {0-15} 13 idle vs {16-31} 16 idle -> idlest {16-31}; its CPUs "
     "have no idle info (stamp 0) so find_dst_group_cpu returns this_cpu 0 -> descend to MC(0-15): {0} local 0 idle, {1},{2} busy, {3} first with 1 idle -> 3.",
     T2LLC, {"kind": "fork", "this_cpu": 0}, place(3, "slow_path", 0), cpus=b6, task={"numa_preferred_nid": 0})
