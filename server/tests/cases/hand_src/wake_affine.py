"""wake_affine (idle, sync, prev; wake_affine_weight, at SMT level), wake_wide, nodes without
an LLC domain, and wakeups across NUMA nodes.

Each case() carries its reasoning in generator.why; build.py writes them all to
../hand.jsonl."""
from lib import *

# ---------------- wake_affine_idle / sync / prev path ----------------
case("prev-after-sync-this",
     "this 1 runs only the waker (nr_running 1), prev 5 idle, sync: wake_affine(MC): this not idle, sync rule nr_running-nr_delayed==1 -> this (this_sync). "
     "select_idle_sibling(prev 5, target 1): target busy, prev shares the LLC and is idle, no clusters -> prev.",
     SMT1_8, wake(1, sync=True), place(5, "prev", 0, want_affine=True, affine="this_sync"),
     cpus=[busy(1, load_avg=300)], task={"prev_cpu": 5})
case("prev-sched-idle-only-after-weight",
     "prev 5 is SCHED_IDLE-only: wake_affine_idle uses available_idle only, so step 3 fails and wake_affine_weight decides: te=(200+100)*100*1024 < pe=(900-100)*108*1024 -> this. "
     "Then in select_idle_sibling target 1 is busy and prev 5 passes choose_idle_cpu (normal wakee) -> prev.",
     SMT1_8, wake(1), place(5, "prev", 0, affine="this_weight"),
     cpus=[busy(1, nr=2, load_avg=200), busy(5, h_nr_idle=1, load_avg=900)], task={"prev_cpu": 5, "load_avg": 100})
case("this-idle-interrupt-wakeup",
     "this 2 is idle (interrupt wakeup), prev 6 busy, same LLC: wake_affine_idle step 1 returns this (prev not idle) -> this_idle; target 2 idle -> target.",
     SMT1_8, wake(2), place(2, "target", 0, affine="this_idle"), cpus=[busy(6)], task={"prev_cpu": 6})
case("this-idle-prev-idle",
     "this 2 idle and prev 6 idle, same LLC: step 1 returns prev (prev_idle); target 6 idle -> target.",
     SMT1_8, wake(2), place(6, "target", 0, affine="prev_idle"), cpus=[], task={"prev_cpu": 6})
case("sync-rule-counts-delayed",
     "sync wakeup, this 1 has nr_running 2 of which 1 is a delayed-dequeue entity: 2-1==1 -> this_sync. target 1 busy, prev 5 busy, recent=prev skipped; "
     "select_idle_cpu from 2: 2 busy, 3 idle -> idle_cpu 3, scanned 2.",
     SMT1_8, wake(1, sync=True), place(3, "idle_cpu", 2, affine="this_sync"),
     cpus=[busy(0), busy(1, nr=2, nr_delayed=1, load_avg=2000), busy(2), busy(4), busy(5, load_avg=100), busy(6), busy(7)],
     task={"prev_cpu": 5})
case("wa-idle-and-weight-off-prev",
     "WA_IDLE and WA_WEIGHT off: wake_affine decides nothing -> prev (affine 'prev'), even though this 2 is idle. target 6 busy; scan from 7: 7 busy, 0 idle -> 0, scanned 2.",
     SMT1_8, wake(2), place(0, "idle_cpu", 2, affine="prev"),
     cpus=[busy(1), busy(3), busy(4), busy(5), busy(6), busy(7)], task={"prev_cpu": 6},
     features={"WA_IDLE": False, "WA_WEIGHT": False})
case("wa-idle-off-weight-this",
     "WA_IDLE off: weight test with this 2 idle (load 0), prev 6 load 500, task load 100: 100*100*1024 < 400*108*1024 -> this_weight; target 2 idle -> target.",
     SMT1_8, wake(2), place(2, "target", 0, affine="this_weight"),
     cpus=[busy(6, load_avg=500)], task={"prev_cpu": 6, "load_avg": 100}, features={"WA_IDLE": False})

# ---------------- B.2 wake_affine_weight ----------------
b2_base = [busy(0, util_avg=300), busy(2, util_avg=300), busy(4, util_avg=300), busy(6, util_avg=300)]
def b2(load_this):
    return b2_base + [busy(1, util_avg=300, load_avg=load_this), busy(5, util_avg=300, load_avg=600)]
WHY_B2 = ("Appendix B.2 on SMT1 8 CPUs (wake_affine at MC, imbalance_pct 117 -> 108): this 1, prev 5 busy, idle CPUs 3 and 7, tl=100, load_prev=600 (includes the task; tl is subtracted). "
          "nr_idle_scan derived 1800/8=225 -> 7. ")
case("b2-weight-this-300",
     WHY_B2 + "load_this 300: 100*(300+100)=40000 < 108*(600-100)=54000 -> this; target 1: scan from 2: 2 busy, 3 idle -> 3, scanned 2.",
     SMT1_8, wake(1), place(3, "idle_cpu", 2, affine="this_weight", nr_idle_scan=7), cpus=b2(300), task={"prev_cpu": 5, "load_avg": 100})
case("b2-weight-this-400",
     WHY_B2 + "load_this 400: 50000 < 54000 -> this; target 1, scan 2, 3 -> 3.",
     SMT1_8, wake(1), place(3, "idle_cpu", 2, affine="this_weight"), cpus=b2(400), task={"prev_cpu": 5, "load_avg": 100})
case("b2-weight-prev-450",
     WHY_B2 + "load_this 450: 55000 < 54000 false -> prev; target 5, recent=prev skipped, scan from 6: 6 busy, 7 idle -> 7, scanned 2.",
     SMT1_8, wake(1), place(7, "idle_cpu", 2, affine="prev"), cpus=b2(450), task={"prev_cpu": 5, "load_avg": 100})
case("b2-weight-400-no-bias",
     WHY_B2 + "WA_BIAS off, load_this 400: (400+100)*1024 < (600-100)*1024 is false (equal) -> prev; target 5 -> 7.",
     SMT1_8, wake(1), place(7, "idle_cpu", 2, affine="prev"), cpus=b2(400), task={"prev_cpu": 5, "load_avg": 100},
     features={"WA_BIAS": False})
case("b2-weight-prev-capacity-halved",
     WHY_B2 + "load_this 450 but capacity_of(prev 5)=512: te=550*100*512=28160000 < pe=500*108*1024=55296000 -> this; target 1 -> 3.",
     SMT1_8, wake(1), place(3, "idle_cpu", 2, affine="this_weight"),
     cpus=b2_base + [busy(1, util_avg=300, load_avg=450), busy(5, util_avg=300, load_avg=600, capacity=512)],
     task={"prev_cpu": 5, "load_avg": 100})
case("weight-prev-load-below-task-load",
     WHY_B2.replace("load_prev=600", "load_prev=50") + "load_prev 50 < tl 100 so pe=-50*108*1024 is negative; te=(0+100)*100*1024 >= pe -> prev. target 5 -> scan 6, 7 -> 7.",
     SMT1_8, wake(1), place(7, "idle_cpu", 2, affine="prev"),
     cpus=b2_base + [busy(1, util_avg=300, load_avg=0), busy(5, util_avg=300, load_avg=50)],
     task={"prev_cpu": 5, "load_avg": 100})

# sync + waker_load
sw = b2_base + [busy(1, nr=2, util_avg=300, load_avg=1000), busy(5, util_avg=300, load_avg=400)]
case("weight-sync-subtracts-waker-load",
     WHY_B2.replace("load_prev=600", "load_prev=400") + "sync, this has nr_running 2 (sync rule fails), load 1000, waker_load 800: te=(1000-800+100)*100*1024=30720000, "
     "pe=(400-100)*108*1024+1=33177601 -> this_weight; target 1 -> 3.",
     SMT1_8, wake(1, sync=True, waker_load=800), place(3, "idle_cpu", 2, affine="this_weight"), cpus=sw, task={"prev_cpu": 5, "load_avg": 100})
case("weight-no-sync-same-loads-prev",
     WHY_B2.replace("load_prev=600", "load_prev=400") + "Same loads without sync: te=1100*100*1024 > pe=300*108*1024 -> prev; target 5 -> 7.",
     SMT1_8, wake(1, waker_load=800), place(7, "idle_cpu", 2, affine="prev"), cpus=sw, task={"prev_cpu": 5, "load_avg": 100})
sw2 = b2_base + [busy(1, nr=2, util_avg=300, load_avg=500), busy(5, util_avg=300, load_avg=400)]
case("weight-sync-waker-load-exceeds-this",
     WHY_B2.replace("load_prev=600", "load_prev=400") + "sync, waker_load 600 > load(this)=500 -> this_weight immediately; target 1 -> 3.",
     SMT1_8, wake(1, sync=True, waker_load=600), place(3, "idle_cpu", 2, affine="this_weight"), cpus=sw2, task={"prev_cpu": 5, "load_avg": 100})
case("weight-waker-exiting-cancels-sync",
     WHY_B2.replace("load_prev=600", "load_prev=400") + "Same but waker_exiting: sync=false, te=(500+100)*100*1024 > pe=(400-100)*108*1024 -> prev; target 5 -> 7.",
     SMT1_8, wake(1, sync=True, waker_exiting=True, waker_load=600), place(7, "idle_cpu", 2, affine="prev"), cpus=sw2, task={"prev_cpu": 5, "load_avg": 100})

# ---------------- wake_affine at SMT level (pct 110 -> 105) ----------------
smt_aff = [busy(0, util_avg=300, load_avg=430), busy(1, util_avg=300, load_avg=600), busy(2, util_avg=300, load_avg=600),
           busy(4, util_avg=300), busy(5, util_avg=300), busy(6, util_avg=300)]
case("wake-affine-smt-level-bias-105",
     "SMT2 8 CPUs, this 0 and prev 1 are siblings: the walk matches SMT{0,1} (imbalance_pct 110 -> factor 105). te=(430+100)*100=53000 vs pe=(600-100)*105=52500 -> prev. "
     "No idle core (derived false), select_idle_smt(prev 1): sibling 0 busy (1 test); select_idle_cpu from 2: 2 busy, 3 idle -> 3, scanned 3.",
     SMT2_8, wake(0), place(3, "idle_cpu", 3, affine="prev", has_idle_core=False), cpus=smt_aff, task={"prev_cpu": 1, "load_avg": 100})
case("wake-affine-mc-level-bias-108",
     "Same loads with prev 2 in another core: the walk matches MC (117 -> 108): 53000 < 108*500=54000 -> this; target 0 busy, prev 2 busy; no idle core; "
     "select_idle_smt(prev 2): sibling 3 idle -> idle_smt 3 with 1 test.",
     SMT2_8, wake(0), place(3, "idle_smt", 1, affine="this_weight", has_idle_core=False), cpus=smt_aff, task={"prev_cpu": 2, "load_avg": 100})

# ---------------- B.3 wake_wide ----------------
ww_state = [busy(i) for i in range(16) if i not in (3, 9)] + [busy(3, load_avg=200), busy(9, load_avg=800)]
WHY_WW = ("Appendix B.3: SMT1 16 CPUs one LLC (llc_size 16), all busy, nr_idle_scan hint 2; this 3 (load 200), prev 9 (load 800), task load 100, wakee_flips 20. ")
case("b3-wake-wide-not-wide",
     WHY_WW + "Waker flips 300: slave 20>=16 but master 300 >= 320 fails -> not wide, want_affine; wake_affine(MC) weight 300*100 < 700*108 -> this. "
     "Scan from 4: 4, 5 busy, budget gone -> fallback_target 3, scanned 2.",
     SMT1_16, wake(3, waker_wakee_flips=300), place(3, "fallback_target", 2, want_affine=True, affine="this_weight", nr_idle_scan=2),
     cpus=ww_state, task={"prev_cpu": 9, "load_avg": 100, "wakee_flips": 20}, llc={"0": {"nr_idle_scan": 2}})
case("b3-wake-wide-wide",
     WHY_WW + "Waker flips 400 >= 20*16=320 -> wide: want_affine false, no wake_affine, target=prev 9; scan 10, 11 -> fallback_target 9, scanned 2.",
     SMT1_16, wake(3, waker_wakee_flips=400), place(9, "fallback_target", 2, want_affine=False, affine=None, nr_idle_scan=2),
     cpus=ww_state, task={"prev_cpu": 9, "load_avg": 100, "wakee_flips": 20}, llc={"0": {"nr_idle_scan": 2}})
case("wake-wide-record-wakee-increment",
     WHY_WW + "Waker flips 319 and last_wakee is another task: record_wakee adds 1 -> 320 >= 320 -> wide; target prev 9 -> fallback_target 9, scanned 2.",
     SMT1_16, wake(3, waker_wakee_flips=319, waker_last_wakee_is_task=False), place(9, "fallback_target", 2, want_affine=False),
     cpus=ww_state, task={"prev_cpu": 9, "load_avg": 100, "wakee_flips": 20}, llc={"0": {"nr_idle_scan": 2}})
case("wake-wide-decay-halves",
     WHY_WW + "Waker flips 639 with decay expired: 639>>1=319 < 320 -> not wide; weight -> this; fallback_target 3, scanned 2.",
     SMT1_16, wake(3, waker_wakee_flips=639, waker_flip_decay_expired=True), place(3, "fallback_target", 2, want_affine=True, affine="this_weight"),
     cpus=ww_state, task={"prev_cpu": 9, "load_avg": 100, "wakee_flips": 20}, llc={"0": {"nr_idle_scan": 2}})

# ---------------- no_llc ----------------
case("no-llc-each-cpu-own-llc",
     "4 CPUs each in its own LLC: SMT and MC spans have 1 CPU and degenerate, only PKG(0-3) survives and it lacks SHARE_LLC -> no sd_llc (llc_size 1). "
     "wake_wide: slave 0 < 1 -> affine; wake_affine(PKG): no idle, weight (500+100)*100 vs (500-100)*108 -> prev. target 2 busy, no sd_llc -> no_llc.",
     NOLLC4, wake(0), place(2, "no_llc", 0, affine="prev"),
     cpus=[busy(0, load_avg=500), busy(1), busy(2, load_avg=500), busy(3)], task={"prev_cpu": 2, "load_avg": 100})
case("no-llc-one-cpu-node",
     "Node 0 = {0} alone, node 1 = {1,2,3}, distance 40 > 30. CPU 0's only domain is NUMA1 (no WAKE_AFFINE, no SHARE_LLC). Waker 1: its MC{1-3} lacks prev 0 and NUMA1 lacks WAKE_AFFINE, "
     "so no wake_affine, target=prev 0 (busy); 0 has no LLC domain -> no_llc.",
     ONECPU_NODE4, wake(1), place(0, "no_llc", 0, want_affine=True, affine=None), cpus=[busy(0), busy(1)], task={"prev_cpu": 0})
case("no-domain-fork-one-cpu-node",
     "fork on CPU 0, alone in node 0 (distance 40): its only domain NUMA1 lacks BALANCE_FORK (distance > node_reclaim_distance) -> sd none -> no_domain, stays 0 although 2,3 are idle.",
     ONECPU_NODE4, {"kind": "fork", "this_cpu": 0}, place(0, "no_domain", 0), cpus=[busy(0), busy(1)])
case("no-domain-single-online-cpu",
     "Only CPU 0 online of 4: every level spans {0}, all degenerate -> no domains; fork -> no_domain, CPU 0.",
     SMT1_8 if False else mk_topo(4), {"kind": "fork", "this_cpu": 0}, place(0, "no_domain", 0),
     cpus=[busy(0), idle(1, online=False), idle(2, online=False), idle(3, online=False)])
case("fork-far-node-not-balanced",
     "Node 1 = {1,2,3} (distance 40 to node 0): fork on 1, sd=MC{1-3} since NUMA1 lacks BALANCE_FORK; idle CPU 0 in node 0 is never considered. "
     "All three CPUs fully_busy (util 1000): avg_load 1000/400/600, idlest {2}: 400 >= 1174 no, 100*1000 <= 117*400 no -> 2.",
     ONECPU_NODE4, {"kind": "fork", "this_cpu": 1}, place(2, "slow_path", 0),
     cpus=[busy(1, util_avg=1000, load_avg=1000), busy(2, util_avg=1000, load_avg=400), busy(3, util_avg=1000, load_avg=600)])

# ---------------- NUMA wakeups ----------------
numa_w = [busy(0, util_avg=500), busy(1, util_avg=500, load_avg=200), busy(2, util_avg=500),
          busy(4, util_avg=500), busy(5, util_avg=500, load_avg=900), busy(7, util_avg=500)]
case("numa-wakeup-affine-across-nodes-d20",
     "2 nodes x 4 CPUs (LLC=node), distance 20: tree MC(node) -> NUMA1 (keeps WAKE_AFFINE). this 1, prev 5: wake_affine(NUMA1, 108): weight 300*100 < 800*108 -> this. "
     "prev does not share the LLC; scan this LLC {0-3} from 2 (budget 1500/4=375 -> 3): 2 busy, 3 idle -> 3, scanned 2.",
     NUMA8_D20, wake(1), place(3, "idle_cpu", 2, affine="this_weight", nr_idle_scan=3), cpus=numa_w, task={"prev_cpu": 5, "load_avg": 100})
case("numa-wakeup-far-node-no-affine-d40",
     "Same state, distance 40: NUMA1 lacks WAKE_AFFINE, the walk finds no affine domain containing prev, target=prev 5; scan LLC {4-7} from 6: 6 idle -> 6, scanned 1.",
     NUMA8_D40, wake(1), place(6, "idle_cpu", 1, want_affine=True, affine=None, nr_idle_scan=3), cpus=numa_w, task={"prev_cpu": 5, "load_avg": 100})
case("numa-far-reclaim-distance-raised",
     "Distance 40 but system.node_reclaim_distance 40: 40 > 40 is false so NUMA1 keeps WAKE_AFFINE; weight -> this 1; scan LLC {0-3}: 2 busy, 3 idle -> 3.",
     NUMA8_D40, wake(1), place(3, "idle_cpu", 2, affine="this_weight"), cpus=numa_w, task={"prev_cpu": 5, "load_avg": 100},
     system={"node_reclaim_distance": 40})
