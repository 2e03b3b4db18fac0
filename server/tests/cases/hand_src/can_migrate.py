"""can_migrate_task: affinity and new_dst_cpu with the LBF flags, running tasks and active
balancing, task_hot (migration cost, buddies, SMT, NUMA, core cookies, overrides), delayed,
throttled and ineligible tasks, per-CPU kthreads, migration-disabled tasks.

Each case() carries its reasoning in generator.why; build.py writes them all to
../hand.jsonl."""
from lib import *

def cm(src, dst, **kw):
    d = {"kind": "can_migrate", "src_cpu": src, "dst_cpu": dst}
    d.update(kw)
    return d
BASE = "SMT2 8 CPUs (cores {0,1}..{6,7}); src 6, dst 0: lowest domain of 0 containing 6 is MC (cache_nice_tries 1), dst_group = local group {0,1}, env_cpus 0-7. "
HOT = {"exec_start": 800000}        # with now 1000000: 200000 < 500000 -> hot
COLD = {"exec_start": 400000}       # with now 1000000: 600000 >= 500000 -> cold
src_dst = [busy(6, nr=2), busy(0)]

def t(**kw):
    d = {}
    d.update(kw)
    return d

case("mig-dst-pinned-new-dst",
     BASE + "Task allowed 1,6-7: dst 0 not allowed -> SOME_PINNED; not newly idle, no DST_PINNED/ACTIVE_LB yet -> lowest of {0,1} ∩ env ∩ allowed = 1 -> DST_PINNED, new_dst_cpu 1; refused (affinity).",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "affinity", ["ALL_PINNED", "DST_PINNED", "SOME_PINNED"], new_dst=1),
     cpus=src_dst, task=t(cpus_allowed="1,6-7", **COLD))
case("mig-dst-pinned-already-set",
     BASE + "Same task but env flags already carry DST_PINNED: SOME_PINNED added, then refused at once without a new destination.",
     SMT2_8, cm(6, 0, now=1000000, flags=["ALL_PINNED", "DST_PINNED"]), mig(False, "affinity", ["ALL_PINNED", "DST_PINNED", "SOME_PINNED"]),
     cpus=src_dst, task=t(cpus_allowed="1,6-7", **COLD))
case("mig-affinity-newly-idle",
     BASE + "Newly idle balance: dst not allowed -> SOME_PINNED and refused before looking for another destination.",
     SMT2_8, cm(6, 0, now=1000000, idle="newly_idle"), mig(False, "affinity", ["ALL_PINNED", "SOME_PINNED"]),
     cpus=src_dst, task=t(cpus_allowed="1,6-7", **COLD))
case("mig-affinity-active-lb",
     BASE + "ACTIVE_LB set and dst not allowed: SOME_PINNED, refused, no new destination.",
     SMT2_8, cm(6, 0, now=1000000, flags=["ALL_PINNED", "ACTIVE_LB"]), mig(False, "affinity", ["ALL_PINNED", "SOME_PINNED", "ACTIVE_LB"]),
     cpus=src_dst, task=t(cpus_allowed="1,6-7", **COLD))
case("mig-affinity-no-candidate-in-env",
     BASE.replace("env_cpus 0-7", "env_cpus given as 2-7") + "dst_group {0,1} ∩ env {2-7} is empty -> no DST_PINNED: flags ALL_PINNED|SOME_PINNED, new_dst null.",
     SMT2_8, cm(6, 0, now=1000000, env_cpus="2-7"), mig(False, "affinity", ["ALL_PINNED", "SOME_PINNED"]),
     cpus=src_dst, task=t(cpus_allowed="1,6-7", **COLD))
case("mig-dst-group-override",
     BASE.replace("dst_group = local group {0,1}", "dst_group given as 0-3") + "Task allowed 3,6-7: lowest of {0-3} ∩ env ∩ allowed = 3 -> DST_PINNED, new_dst_cpu 3.",
     SMT2_8, cm(6, 0, now=1000000, dst_group="0-3"), mig(False, "affinity", ["ALL_PINNED", "DST_PINNED", "SOME_PINNED"], new_dst=3),
     cpus=src_dst, task=t(cpus_allowed="3,6-7", **COLD))
case("mig-active-lb-allowed",
     BASE + "dst allowed -> ALL_PINNED cleared; not running; ACTIVE_LB -> allowed without the hotness test (task is hot).",
     SMT2_8, cm(6, 0, now=1000000, flags=["ALL_PINNED", "ACTIVE_LB"]), mig(True, "active_lb", ["ACTIVE_LB"]),
     cpus=src_dst, task=t(**HOT))
case("mig-running-with-active-lb",
     BASE + "Task is running on src: after ALL_PINNED is cleared the running check refuses it before the ACTIVE_LB shortcut.",
     SMT2_8, cm(6, 0, now=1000000, flags=["ALL_PINNED", "ACTIVE_LB"]), mig(False, "running", ["ACTIVE_LB"]),
     cpus=src_dst, task=t(running=True, **COLD))
case("mig-running",
     BASE + "Allowed on dst (ALL_PINNED cleared) but currently running -> refused: running, flags [].",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "running", []), cpus=src_dst, task=t(running=True, **COLD))
case("mig-hot",
     BASE + "now 1000000 - exec_start 800000 = 200000 < 500000 -> hot; nr_balance_failed 0 <= 1 -> refused: hot.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "hot", [], hot=True), cpus=src_dst, task=t(**HOT))
case("mig-hot-failures-equal-tries",
     BASE + "Hot task, nr_balance_failed 1 is not > cache_nice_tries 1 -> still refused: hot.",
     SMT2_8, cm(6, 0, now=1000000, nr_balance_failed=1), mig(False, "hot", [], hot=True), cpus=src_dst, task=t(**HOT))
case("mig-balance-failed",
     BASE + "Hot task, nr_balance_failed 2 > 1 -> allowed: balance_failed.",
     SMT2_8, cm(6, 0, now=1000000, nr_balance_failed=2), mig(True, "balance_failed", [], hot=True), cpus=src_dst, task=t(**HOT))
case("mig-cold",
     BASE + "now - exec_start = 600000 >= 500000 -> cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(**COLD))
case("mig-cold-boundary",
     BASE + "now - exec_start = 500000 exactly: the test is strict (< 500000) -> cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(exec_start=500000))
case("mig-default-clock-hot",
     BASE + "now and exec_start both default 0: 0 < 500000 -> hot -> refused.",
     SMT2_8, cm(6, 0), mig(False, "hot", [], hot=True), cpus=src_dst, task=t())
case("mig-negative-delta-hot",
     BASE + "now 100 < exec_start 1000000: signed difference -999900 < 500000 -> hot.",
     SMT2_8, cm(6, 0, now=100), mig(False, "hot", [], hot=True), cpus=src_dst, task=t(exec_start=1000000))
case("mig-cost-minus-one",
     BASE + "migration_cost_ns -1: task_hot returns hot before any clock comparison (task ran long ago) -> refused.",
     SMT2_8, cm(6, 0, now=1000000000), mig(False, "hot", [], hot=True), cpus=src_dst, task=t(exec_start=0),
     system={"migration_cost_ns": -1})
case("mig-cost-zero",
     BASE + "migration_cost_ns 0: never hot (task ran 1 ns ago) -> cold, allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(exec_start=999999),
     system={"migration_cost_ns": 0})
case("mig-cache-hot-buddy",
     BASE + "Task is next buddy and dst 0 has a running task: CACHE_HOT_BUDDY makes it hot before the migration_cost 0 rule -> refused.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "hot", [], hot=True), cpus=src_dst, task=t(next_buddy=True, exec_start=0),
     system={"migration_cost_ns": 0})
case("mig-cache-hot-buddy-dst-empty",
     BASE + "Next buddy but dst 0 is empty (nr_running 0): buddy rule needs dst tasks; old exec_start -> cold.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=[busy(6, nr=2)], task=t(next_buddy=True, exec_start=0))
case("mig-cache-hot-buddy-off",
     BASE + "CACHE_HOT_BUDDY off: next buddy ignored; migration_cost 0 -> cold.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(next_buddy=True, exec_start=0),
     features={"CACHE_HOT_BUDDY": False}, system={"migration_cost_ns": 0})
case("mig-smt-level-never-hot",
     "SMT2 8 CPUs, src 1, dst 0 are siblings: balancing domain SMT (SHARE_CPUCAPACITY, cache_nice_tries 0) -> task_hot false although the task ran 200 us ago -> cold.",
     SMT2_8, cm(1, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=[busy(1, nr=2), busy(0)], task=t(**HOT))
case("mig-sd-level-mc-override",
     "Same siblings but sd_level MC: not SHARE_CPUCAPACITY, cache_nice_tries 1; hot (200 us), nr_balance_failed 1 not > 1 -> refused: hot.",
     SMT2_8, cm(1, 0, now=1000000, sd_level="MC", nr_balance_failed=1), mig(False, "hot", [], hot=True), cpus=[busy(1, nr=2), busy(0)], task=t(**HOT))
case("mig-idle-policy-never-hot",
     BASE + "SCHED_IDLE task: task_hot returns cold first, even though it ran 200 us ago.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(policy="idle", **HOT))
case("mig-delayed-util",
     BASE + "sched_delayed task with migration_type util -> refused first (delayed); flags untouched.",
     SMT2_8, cm(6, 0, now=1000000, migration_type="util"), mig(False, "delayed", ["ALL_PINNED"]), cpus=src_dst, task=t(sched_delayed=True, **COLD))
case("mig-delayed-load-passes",
     BASE + "sched_delayed but migration_type load: the delayed rule does not apply; cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000, migration_type="load"), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(sched_delayed=True, **COLD))
case("mig-throttled",
     BASE + "Hierarchy throttled on dst -> refused (throttled), flags untouched.",
     SMT2_8, cm(6, 0, now=1000000, throttled=True), mig(False, "throttled", ["ALL_PINNED"]), cpus=src_dst, task=t(**COLD))
case("mig-ineligible",
     BASE + "Not eligible, nr_balance_failed 0, PLACE_LAG on and dst has 2 queued (default cfs_h_nr_queued = nr_running) -> refused: ineligible.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "ineligible", ["ALL_PINNED"]), cpus=[busy(6, nr=2), busy(0, nr=2)], task=t(eligible=False, **COLD))
case("mig-ineligible-before-affinity",
     BASE + "Not eligible and dst not allowed: the ineligible test comes first, so no SOME_PINNED is recorded.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "ineligible", ["ALL_PINNED"]), cpus=[busy(6, nr=2), busy(0, nr=2)],
     task=t(eligible=False, cpus_allowed="6-7", **COLD))
case("mig-ineligible-soft-after-failure",
     BASE + "Not eligible but nr_balance_failed 1: the soft rule is off; cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000, nr_balance_failed=1), mig(True, "cold", [], hot=False), cpus=[busy(6, nr=2), busy(0, nr=2)], task=t(eligible=False, **COLD))
case("mig-ineligible-dst-no-cfs",
     BASE + "Not eligible but dst_cfs_nr_queued 0 (dst runs only a non-CFS task): rule needs queued CFS entities -> passes; cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000, dst_cfs_nr_queued=0), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(eligible=False, **COLD))
case("mig-ineligible-place-lag-off",
     BASE + "Not eligible, PLACE_LAG off -> no ineligible rejection; cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=[busy(6, nr=2), busy(0, nr=2)], task=t(eligible=False, **COLD),
     features={"PLACE_LAG": False})
case("mig-per-cpu-kthread",
     BASE + "Per-CPU kthread -> refused (per_cpu_kthread) before the affinity test.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "per_cpu_kthread", ["ALL_PINNED"]), cpus=src_dst, task=t(per_cpu_kthread=True, **COLD))
case("mig-blocked",
     BASE + "Proxy-blocked task -> refused (blocked).",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "blocked", ["ALL_PINNED"]), cpus=src_dst, task=t(blocked=True, **COLD))
case("mig-hot-override-false",
     BASE + "task.hot false replaces the clock comparison (which would say hot) -> cold, allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(hot=False, **HOT))
case("mig-hot-override-true",
     BASE + "task.hot true replaces the clock comparison (which would say cold) -> hot, refused.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "hot", [], hot=True), cpus=src_dst, task=t(hot=True, **COLD))
case("mig-cost-zero-before-hot-override",
     BASE + "migration_cost_ns 0 is tested before task.hot: never hot even with hot=true -> cold, allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False), cpus=src_dst, task=t(hot=True, **COLD), system={"migration_cost_ns": 0})
case("mig-core-cookie-mismatch-hot",
     BASE + "core_sched on, task cookie 7, dst core cookie 3 and dst 0 busy (core not all idle) -> cookie mismatch -> hot (task ran long ago) -> refused.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "hot", [], hot=True),
     cpus=[busy(6, nr=2), busy(0, core_cookie=3), idle(1, core_cookie=3)], task=t(core_cookie=7, **COLD), system={"core_sched": True})
case("mig-core-cookie-idle-core-matches",
     BASE + "core_sched on, cookies differ but dst core {0,1} is wholly available idle -> sched_core_cookie_match true -> cold -> allowed.",
     SMT2_8, cm(6, 0, now=1000000), mig(True, "cold", [], hot=False),
     cpus=[busy(6, nr=2), idle(0, core_cookie=3), idle(1, core_cookie=3)], task=t(core_cookie=7, **COLD), system={"core_sched": True})
case("mig-need-break-preserved",
     BASE + "Input flags ALL_PINNED|NEED_BREAK, cold task: ALL_PINNED cleared, NEED_BREAK kept -> allowed.",
     SMT2_8, cm(6, 0, now=1000000, flags=["ALL_PINNED", "NEED_BREAK"]), mig(True, "cold", ["NEED_BREAK"], hot=False), cpus=src_dst, task=t(**COLD))
case("mig-cache-nice-tries-override",
     BASE + "cache_nice_tries overridden to 0: hot task with nr_balance_failed 1 > 0 -> allowed: balance_failed.",
     SMT2_8, cm(6, 0, now=1000000, nr_balance_failed=1, cache_nice_tries=0), mig(True, "balance_failed", [], hot=True), cpus=src_dst, task=t(**HOT))
case("mig-migration-disabled",
     BASE + "migration_disabled: cpus_ptr = {src 6}; dst 0 not in it -> SOME_PINNED; {0,1} ∩ env ∩ {6} empty -> no new dst.",
     SMT2_8, cm(6, 0, now=1000000), mig(False, "affinity", ["ALL_PINNED", "SOME_PINNED"]), cpus=src_dst, task=t(migration_disabled=True, **COLD))
NUMA_BASE = "2 nodes x 4 (distance 20): src 5, dst 1 -> lowest domain of 1 containing 5 is NUMA1, cache_nice_tries 2. Task hot (200 us). "
case("mig-numa-hot-two-failures",
     NUMA_BASE + "nr_balance_failed 2 is not > 2 -> refused: hot.",
     NUMA8_D20, cm(5, 1, now=1000000, nr_balance_failed=2), mig(False, "hot", [], hot=True), cpus=[busy(5, nr=2), busy(1)], task=t(**HOT))
case("mig-numa-balance-failed-three",
     NUMA_BASE + "nr_balance_failed 3 > 2 -> allowed: balance_failed.",
     NUMA8_D20, cm(5, 1, now=1000000, nr_balance_failed=3), mig(True, "balance_failed", [], hot=True), cpus=[busy(5, nr=2), busy(1)], task=t(**HOT))
case("mig-pkg-level-dst-group-is-llc",
     "8 CPUs, two LLCs 0-3 / 4-7 in one node: src 5, dst 1 -> domain PKG, whose local group for 1 is the LLC {0-3}. Task allowed 2,5: dst not allowed -> lowest of "
     "{0-3} ∩ env ∩ allowed = 2 -> DST_PINNED, new_dst_cpu 2.",
     LLC2_8, cm(5, 1, now=1000000), mig(False, "affinity", ["ALL_PINNED", "DST_PINNED", "SOME_PINNED"], new_dst=2),
     cpus=[busy(5, nr=2), busy(1)], task=t(cpus_allowed="2,5", **COLD))
