"""The fast path's edges and the kernel switches: select_idle_core on SMT8 (first vs last idle CPU),
a SCHED_IDLE wakee and SCHED_IDLE-only CPUs, exec of a one-CPU-bound task, offline prev and
bound wakeups or forks, the current CPU, per-CPU kthreads and recent_used_cpu.

Each case() carries its reasoning in generator.why; build.py writes them all to
../hand.jsonl."""
from lib import *

# ---------------- SMT8 select_idle_core (PREFER_LAST_IDLE_CPU) ----------------
smt8_state = [busy(1, util_avg=800)] + [busy(i, util_avg=800) for i in range(10, 16)]
smt8_hint = {"0": {"has_idle_cores": True}}
WHY_SMT8 = ("SMT8 16 CPUs: tree SMT(0-7|8-15) -> MC(0-15); only CPU1 and CPUs10-15 busy, so no idle core, "
            "but the hint has_idle_cores=true forces idle-core mode (nr_idle_scan derived 5600/16=350 -> 13, only checked for 0). ")
case("smt8-core-scan-first-core-target15",
     WHY_SMT8 + "this=prev=15 (no wake_affine), target 15 busy; select_idle_cpu walks wrap(0-15,16)=ascending: core 0 visits 0 (idle, recorded) and 1 (busy, break) = 2 tests, "
     "core 8 visits 8,9 (idle, not recorded: PREFER_LAST off) and 10 (busy, break) = 3 tests; no idle core so the recorded CPU 0 is returned: core_scan_cpu, scanned 5.",
     SMT8_16, wake(15), place(0, "core_scan_cpu", 5, want_affine=True, affine=None, has_idle_core=True, nr_idle_scan=13),
     cpus=smt8_state, task={"prev_cpu": 15}, llc=smt8_hint)
case("smt8-core-scan-prefer-last-target15",
     WHY_SMT8 + "Same walk as the PREFER_LAST off case (core 0: 0,1; core 8: 8,9,10 = 5 tests) but every allowed available-idle sibling overwrites the record: 0, then 8, then 9; "
     "exit at busy 10, so the answer is 9 on the busier second core (Prateek's 1/8 vs 6/8 example).",
     SMT8_16, wake(15), place(9, "core_scan_cpu", 5, has_idle_core=True, nr_idle_scan=13),
     cpus=smt8_state, task={"prev_cpu": 15}, llc=smt8_hint, features={"PREFER_LAST_IDLE_CPU": True})
case("smt8-core-scan-first-core-target1",
     WHY_SMT8 + "this=prev=1 (busy target); wrap from 2 reaches core 0 first at CPU 2, but select_idle_core walks the whole SMT mask ascending: 0 idle (record 0), 1 busy break; "
     "then CPU 8: 8, 9, 10 busy break. Record stays 0 (PREFER_LAST off): core_scan_cpu 0, scanned 5.",
     SMT8_16, wake(1), place(0, "core_scan_cpu", 5, has_idle_core=True),
     cpus=smt8_state, task={"prev_cpu": 1}, llc=smt8_hint)
case("smt8-core-scan-prefer-last-target1",
     WHY_SMT8 + "this=prev=1; wrap from 2: core 0 (0 idle recorded, 1 busy break), core 8 (8 and 9 overwrite, 10 busy break); PREFER_LAST on -> 9, scanned 5.",
     SMT8_16, wake(1), place(9, "core_scan_cpu", 5, has_idle_core=True),
     cpus=smt8_state, task={"prev_cpu": 1}, llc=smt8_hint, features={"PREFER_LAST_IDLE_CPU": True})
case("smt8-core-scan-target10-visits-second-core-first",
     WHY_SMT8 + "this=prev=10; wrap from 11 starts in core 8: 8 idle (recorded), 9 idle, 10 busy break (3 tests); 12-15 were removed with the core; next CPU 0: 0 idle, 1 busy break (2 tests). "
     "PREFER_LAST off keeps the first record 8.",
     SMT8_16, wake(10), place(8, "core_scan_cpu", 5, has_idle_core=True),
     cpus=smt8_state, task={"prev_cpu": 10}, llc=smt8_hint)
case("smt8-core-scan-target10-prefer-last",
     WHY_SMT8 + "this=prev=10, PREFER_LAST on: core 8 records 8 then 9, core 0 visited last overwrites with 0 (before busy CPU 1); answer 0, scanned 5.",
     SMT8_16, wake(10), place(0, "core_scan_cpu", 5, has_idle_core=True),
     cpus=smt8_state, task={"prev_cpu": 10}, llc=smt8_hint, features={"PREFER_LAST_IDLE_CPU": True})
case("smt8-derived-no-idle-core-select-idle-smt",
     "Same SMT8 state without the hint: has_idle_cores derived false (each core has a busy CPU), target=prev=15 shares the LLC, so select_idle_smt(prev 15) "
     "tests siblings of 15 ascending: 8 passes the skips and is idle -> idle_smt 8 with 1 test.",
     SMT8_16, wake(15), place(8, "idle_smt", 1, has_idle_core=False),
     cpus=smt8_state, task={"prev_cpu": 15})

# ---------------- SCHED_IDLE wakee ----------------
si_state = ([busy(0, util_avg=900)] + [busy(i, h_nr_idle=1, util_avg=300) for i in (1, 2, 3)] +
            [busy(i, util_avg=900) for i in (5, 6, 7)])
WHY_SI = ("SMT1 8 CPUs (tree MC only, smt inactive); CPUs 1-3 run only SCHED_IDLE tasks (nr_running==h_nr_idle==1), CPU 4 truly idle, 0 and 5-7 busy. "
          "nr_idle_scan derived: sum_util 4*900+3*300=4500, x=562, t=422, y=602 -> 4. this=prev=0 busy target, recent defaults to prev. ")
case("sched-idle-wakee-skips-sched-idle-rq",
     WHY_SI + "Wakee policy idle with SKIP_SCHED_IDLE_FOR_IDLE_TASK on: choose_sched_idle_rq is false, so select_idle_cpu probes 1,2,3 (rejected) and 4 (idle), "
     "using the whole budget of 4: idle_cpu 4, scanned 4.",
     SMT1_8, wake(0), place(4, "idle_cpu", 4, want_affine=True, affine=None, has_idle_core=None, nr_idle_scan=4),
     cpus=si_state, task={"prev_cpu": 0, "policy": "idle"})
case("sched-idle-wakee-skip-off-takes-sched-idle-rq",
     WHY_SI + "SKIP_SCHED_IDLE_FOR_IDLE_TASK off: the first probe, CPU 1 (SCHED_IDLE-only), is accepted: idle_cpu 1, scanned 1.",
     SMT1_8, wake(0), place(1, "idle_cpu", 1, nr_idle_scan=4),
     cpus=si_state, task={"prev_cpu": 0, "policy": "idle"}, features={"SKIP_SCHED_IDLE_FOR_IDLE_TASK": False})
case("sched-idle-normal-wakee-takes-sched-idle-rq",
     WHY_SI + "Normal wakee: a SCHED_IDLE-only runqueue counts as idle whatever the toggle, so probe 1 (CPU 1) succeeds: idle_cpu 1, scanned 1.",
     SMT1_8, wake(0), place(1, "idle_cpu", 1, nr_idle_scan=4),
     cpus=si_state, task={"prev_cpu": 0, "policy": "normal"})
case("sched-idle-wakee-budget-3-exhausted",
     WHY_SI.replace("-> 4.", "-> 4, overridden by the hint nr_idle_scan=3.") + "Idle wakee, SKIP on: nr=4, probes 1,2,3 rejected, at CPU 4 nr reaches 0 before the test -> none; fallback_target 0, scanned 3.",
     SMT1_8, wake(0), place(0, "fallback_target", 3, nr_idle_scan=3),
     cpus=si_state, task={"prev_cpu": 0, "policy": "idle"}, llc={"0": {"nr_idle_scan": 3}})
case("sched-idle-target-normal-wakee",
     WHY_SI.replace("this=prev=0 busy target", "here this=prev=2 (a SCHED_IDLE-only CPU)") + "Normal wakee: choose_idle_cpu(target 2) is true via choose_sched_idle_rq -> path target, scanned 0.",
     SMT1_8, wake(2), place(2, "target", 0),
     cpus=si_state, task={"prev_cpu": 2})
case("sched-idle-target-idle-wakee-scans",
     WHY_SI.replace("this=prev=0 busy target", "here this=prev=2 (a SCHED_IDLE-only CPU)") + "Idle wakee, SKIP on: target 2 is not acceptable, recent=prev skipped; scan from 3: 3 rejected, 4 idle -> idle_cpu 4, scanned 2.",
     SMT1_8, wake(2), place(4, "idle_cpu", 2, nr_idle_scan=4),
     cpus=si_state, task={"prev_cpu": 2, "policy": "idle"})

# ---------------- slow path and SCHED_IDLE-only CPUs ----------------
sp_si = [busy(0, util_avg=1000, load_avg=1000), busy(1, util_avg=1000, load_avg=1000),
         busy(2, h_nr_idle=1, util_avg=100, load_avg=300), busy(3, h_nr_idle=1, util_avg=100, load_avg=100),
         busy(4, util_avg=1000, load_avg=1000), busy(5, util_avg=1000, load_avg=1000),
         busy(6, util_avg=1000, load_avg=1000), busy(7, util_avg=1000, load_avg=1000)]
WHY_SPSI = ("SMT2 8 CPUs, fork from 0: sd=MC; MC groups are cores. Cores {0,1},{4,5},{6,7}: util 2000 on cap 2048 -> 204800 > 234000 false -> fully_busy; "
            "core {2,3} (both SCHED_IDLE-only, util 200) has_spare; local fully_busy > has_spare -> idlest {2,3}. ")
case("fork-slow-path-first-sched-idle-cpu",
     WHY_SPSI + "find_dst_group_cpu({2,3}) returns CPU 2 at once (first SCHED_IDLE-only CPU, normal task). At SMT(2): groups {2},{3} both has_spare with 0 idle CPUs -> "
     "local.idle 0 >= 0 -> stay. Answer 2.",
     SMT2_8, {"kind": "fork", "this_cpu": 0}, place(2, "slow_path", 0), cpus=sp_si)
case("fork-slow-path-idle-policy-least-loaded",
     WHY_SPSI + "Policy idle with SKIP on: neither 2 nor 3 counts as SCHED_IDLE-choosable nor idle, so the least cpu_load wins: 2 (300) then 3 (100 < 300) -> 3. "
     "At SMT(3) both groups have 0 idle -> stay. Answer 3.",
     SMT2_8, {"kind": "fork", "this_cpu": 0}, place(3, "slow_path", 0), cpus=sp_si, task={"policy": "idle"})

# ---------------- exec with one allowed CPU ----------------
ex_state = [busy(3, util_avg=600, load_avg=600), busy(1, util_avg=500)]
case("exec-bound-fast-path",
     "exec of a task allowed only on CPU 3, running on 3. EXEC_BOUND_FAST_PATH on: core_select sees nr_cpus_allowed==1 and returns min(cpus_ptr)=3 without the fair class: bound, scanned 0.",
     SMT1_8, {"kind": "exec", "this_cpu": 3}, place(3, "bound", 0), cpus=ex_state, task={"cpus_allowed": "3", "util_avg": 600, "load_avg": 600})
case("exec-bound-slow-path",
     "Same exec with EXEC_BOUND_FAST_PATH off: select_task_rq_fair runs; sd=MC (BALANCE_EXEC); every group except {3} has no allowed CPU, so only the local group exists, "
     "no idlest -> descend to no child; result stays 3 via the slow path.",
     SMT1_8, {"kind": "exec", "this_cpu": 3}, place(3, "slow_path", 0), cpus=ex_state,
     task={"cpus_allowed": "3", "util_avg": 600, "load_avg": 600}, features={"EXEC_BOUND_FAST_PATH": False})
case("exec-bound-elsewhere-fast-path",
     "exec on CPU 3 of a task now allowed only on CPU 5: fast path returns min(cpus_ptr)=5 (bound); 5 is online and allowed, so exec moves to 5.",
     SMT1_8, {"kind": "exec", "this_cpu": 3}, place(5, "bound", 0), cpus=ex_state, task={"cpus_allowed": "5"})
case("exec-bound-elsewhere-slow-path",
     "Same with EXEC_BOUND_FAST_PATH off: MC groups: local {3} has no allowed CPU (no local), {5} is the only allowed group -> idlest returned, single-CPU group -> 5; "
     "restart below MC weight 8 finds nothing. slow_path 5.",
     SMT1_8, {"kind": "exec", "this_cpu": 3}, place(5, "slow_path", 0), cpus=ex_state, task={"cpus_allowed": "5"},
     features={"EXEC_BOUND_FAST_PATH": False})
case("exec-migration-disabled-bound",
     "exec with migration disabled: cpus_ptr={task_cpu}={2}; core_select skips the fair class because migration is disabled -> min(cpus_ptr)=2, bound.",
     SMT1_8, {"kind": "exec", "this_cpu": 2}, place(2, "bound", 0), cpus=[busy(2)], task={"migration_disabled": True})

off67 = [idle(6, online=False), idle(7, online=False)]
case("exec-offline-affinity-slow-path-prev",
     "CPUs 6,7 offline; exec on CPU 2 (busy) of a task allowed on 6-7 only. EXEC_BOUND_FAST_PATH off: sd=MC spans online 0-5, span ∩ cpus_ptr empty -> return prev (=this_cpu 2): slow_path_prev. "
     "No wrapper check on this path, so the task stays on 2.",
     SMT1_8, {"kind": "exec", "this_cpu": 2}, place(2, "slow_path_prev", 0), cpus=off67 + [busy(2)],
     task={"cpus_allowed": "6-7"}, features={"EXEC_BOUND_FAST_PATH": False})
case("exec-offline-affinity-fallback-rq",
     "Same with EXEC_BOUND_FAST_PATH on: nr_cpus_allowed=2 so the fair class runs and returns 2 (slow_path_prev); 2 is not in cpus_ptr -> fallback(task_cpu 2): "
     "no allowed online CPU of node 0, none in cpus_ptr, so the lowest online CPU 0: fallback_rq.",
     SMT1_8, {"kind": "exec", "this_cpu": 2}, place(0, "fallback_rq", 0), cpus=off67 + [busy(2)],
     task={"cpus_allowed": "6-7"})
case("exec-slow-path-ignores-offline-allowed",
     "CPUs 6,7 offline; exec on 2 (busy) of a task allowed on 5-7: the slow path only sees online CPUs; MC groups with allowed CPUs: {5} only (local {2} not allowed) -> 5. "
     "The offline allowed CPUs cannot be picked.",
     SMT1_8, {"kind": "exec", "this_cpu": 2}, place(5, "slow_path", 0), cpus=off67 + [busy(2)],
     task={"cpus_allowed": "5-7"})

# ---------------- offline prev, bound wakeups, fork bound ----------------
case("wakeup-offline-prev-fallback-rq",
     "CPU 5 offline; the wakee's prev is 5, allowed 3-7; waker on 0 is not allowed so want_affine=false, target=prev=5. An offline CPU reads as an idle empty rq, "
     "so select_idle_sibling returns target 5; the wrapper's is_cpu_allowed fails (offline) -> fallback(5): lowest allowed online CPU of node 0 = 3.",
     SMT1_8, wake(0), place(3, "fallback_rq", 0, want_affine=False, affine=None),
     cpus=[idle(5, online=False), busy(0)], task={"prev_cpu": 5, "cpus_allowed": "3-7"})
case("wakeup-single-cpu-affinity-bound",
     "Task allowed only on CPU 4: core_select does not call the fair class (nr_cpus_allowed==1) -> min(cpus_ptr)=4, bound, even though prev 1 and this 0 differ.",
     SMT1_8, wake(0), place(4, "bound", 0), cpus=[busy(0), busy(4)], task={"prev_cpu": 1, "cpus_allowed": "4"})
case("wakeup-migration-disabled-bound",
     "migration_disabled: cpus_ptr={task_cpu}={prev 3}; the wrapper returns min(cpus_ptr)=3 without the fair class (CPU 2 idle is not considered): bound.",
     SMT1_8, wake(0), place(3, "bound", 0), cpus=[busy(0), busy(3)], task={"prev_cpu": 3, "migration_disabled": True})
case("fork-bound-offline-lowest-online",
     "fork of a child allowed only on CPU 6 which is offline: bound -> 6, is_cpu_allowed fails -> fallback(task_cpu=this 3): node 0 has no allowed online CPU, "
     "cpus_ptr has none either, so the lowest online CPU 0: fallback_rq.",
     SMT1_8, {"kind": "fork", "this_cpu": 3}, place(0, "fallback_rq", 0), cpus=[idle(6, online=False), busy(3)],
     task={"cpus_allowed": "6"})

# ---------------- current cpu, per-cpu kthread, recent ----------------
case("wf-current-cpu",
     "WF_CURRENT_CPU and this_cpu 2 is allowed: select_task_rq_fair returns 2 right after record_wakee, although 2 is busy and prev 6 is idle.",
     SMT1_8, wake(2, wf_current_cpu=True), place(2, "current_cpu", 0), cpus=[busy(2)], task={"prev_cpu": 6})
case("wf-current-cpu-not-allowed",
     "WF_CURRENT_CPU but this_cpu 2 not in cpus_allowed 4-7: flag ignored, want_affine false (this not allowed), target=prev 6 which is idle -> target.",
     SMT1_8, wake(2, wf_current_cpu=True), place(6, "target", 0, want_affine=False, affine=None),
     cpus=[busy(2)], task={"prev_cpu": 6, "cpus_allowed": "4-7"})
case("per-cpu-kthread-waker-stacks",
     "this=prev=3; CPU 3 runs a per-CPU kthread (curr_is_per_cpu_kthread, so waker_is_per_cpu_kthread defaults true), nr_running 1 <= 1, in_task: "
     "target 3 busy, prev==target, then the kthread rule returns prev 3 (CPU 4 idle is not scanned).",
     SMT1_8, wake(3), place(3, "per_cpu_kthread", 0), cpus=[busy(3, curr_is_per_cpu_kthread=True)], task={"prev_cpu": 3})
case("per-cpu-kthread-irq-context-scans",
     "Same but in_task false (interrupt context): the kthread rule does not apply; recent=prev skipped; select_idle_cpu from 4 finds CPU 4 idle at the first probe.",
     SMT1_8, wake(3, in_task=False), place(4, "idle_cpu", 1), cpus=[busy(3, curr_is_per_cpu_kthread=True)], task={"prev_cpu": 3})
case("per-cpu-kthread-two-running-scans",
     "Per-CPU kthread waker but nr_running(3)=2 > 1: rule fails; scan from 4: 4 busy, 5 idle -> idle_cpu 5, scanned 2.",
     SMT1_8, wake(3), place(5, "idle_cpu", 2), cpus=[busy(3, nr=2, curr_is_per_cpu_kthread=True), busy(4)], task={"prev_cpu": 3})
case("recent-used-cpu",
     "this=prev=2 busy; recent_used_cpu 6 is idle, differs from prev/target, same LLC, allowed -> returned before any scan (CPU 3 idle would be the scan's first hit).",
     SMT1_8, wake(2), place(6, "recent", 0), cpus=[busy(2)], task={"prev_cpu": 2, "recent_used_cpu": 6})
case("recent-used-cpu-not-allowed",
     "recent_used_cpu 6 idle but not in cpus_allowed 0-5 -> r dropped; select_idle_cpu from 3 finds 3 idle at the first probe.",
     SMT1_8, wake(2), place(3, "idle_cpu", 1), cpus=[busy(2)], task={"prev_cpu": 2, "recent_used_cpu": 6, "cpus_allowed": "0-5"})
case("recent-used-cpu-null",
     "recent_used_cpu null: no candidate; scan from 3 finds 3.",
     SMT1_8, wake(2), place(3, "idle_cpu", 1), cpus=[busy(2)], task={"prev_cpu": 2, "recent_used_cpu": None})
