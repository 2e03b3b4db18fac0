//! The periodic load balancer (`Balancer::run`), worked out by hand from
//! kernel-algorithms sections 4.4, 5.1-5.11 and T.2, and checked against the
//! kernel's fair.c (6.12 and 7.3).
//!
//! Conventions of every case below:
//! - every CPU has capacity 1024 (`capacity_of` = `arch_scale_cpu_capacity`);
//! - each CPU's state is derived from its task list (`node()`), so
//!   `nr_running`, `cfs_h_nr_queued`, the PELT sums and `curr_is_idle` agree
//!   with the tasks reported;
//! - task lists run from the head (ran most recently; the running task) to
//!   the tail (coldest); `detach_tasks` takes from the tail;
//! - `table.clock[cpu] == 0` means every task is cold.
//!
//! Rejection counts are in `Reason::ALL` order: delayed, throttled,
//! ineligible, per_cpu_kthread, blocked, affinity, running, active_lb, cold,
//! balance_failed, hot, llc_pinned.

use fairplace::engine::View;
use fairplace::engine::balance::migrate::MigrationType;
use fairplace::engine::balance::{BalanceOpts, Balancer, PassStats, Proposal};
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::features::{Features, System};
use fairplace::engine::group::GroupType;
use fairplace::engine::rq::{RqTask, TaskTable};
use fairplace::engine::state::{CpuState, NodeState, Policy};
use fairplace::engine::topology::{CpuTopo, Level, Topology, TopologySpec};

// ---------------------------------------------------------------------------
// Set-up helpers
// ---------------------------------------------------------------------------

/// One node; each CPU given as (core, llc). Equal cores = SMT siblings.
fn spec(cpus: &[(u32, u32)]) -> TopologySpec {
    TopologySpec {
        cpus: cpus
            .iter()
            .map(|&(core, llc)| CpuTopo {
                core,
                cluster: None,
                llc,
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    }
}

fn build(s: &TopologySpec, online: CpuMask) -> Topology {
    Topology::build(s, &online, 30).unwrap()
}

fn build_all(s: &TopologySpec) -> Topology {
    build(s, CpuMask::first_n(s.cpus.len()))
}

/// 2 CPUs, no SMT, one LLC: only MC survives degeneration.
fn two_cpus() -> Topology {
    build_all(&spec(&[(0, 0), (1, 0)]))
}

/// 2 cores x SMT2 in one LLC: CPUs 0,1 = core 0; CPUs 2,3 = core 1.
/// Domains SMT {core} and MC {0-3} whose groups are the cores.
fn smt2x2() -> Topology {
    build_all(&spec(&[(0, 0), (0, 0), (1, 0), (1, 0)]))
}

/// 2 LLCs x 2 single-thread CPUs in one node: MC {0,1} / {2,3}, then PKG
/// {0-3} whose groups are the LLCs.
fn two_llcs() -> Topology {
    build_all(&spec(&[(0, 0), (1, 0), (2, 1), (3, 1)]))
}

fn levels(t: &Topology, cpu: usize) -> Vec<Level> {
    t.domains(cpu).iter().map(|d| d.level).collect()
}

/// A fair nice-0 style task allowed everywhere, cold, not running.
fn task(id: u64, load: i64, util: i64, runnable: i64) -> RqTask {
    let mut t = RqTask::new(id, 1000 + id, load);
    t.util_avg = util;
    t.runnable_avg = runnable;
    t
}

fn running(mut t: RqTask) -> RqTask {
    t.running = true;
    t
}

/// A runqueue consistent with its task list.
fn rq_of(tasks: &[RqTask]) -> CpuState {
    let mut c = CpuState::idle(1024);
    for t in tasks {
        c.nr_running += 1;
        c.cfs_h_nr_queued += 1;
        if t.policy == Policy::Idle {
            c.h_nr_idle += 1;
        }
        if t.sched_delayed {
            c.nr_delayed += 1;
        }
        c.load_avg += t.load_avg as u32;
        c.util_avg += t.util_avg as u32;
        c.runnable_avg += t.runnable_avg as u32;
        c.util_est += t.util_est as u32;
    }
    c.curr_is_idle = c.nr_running == 0;
    c
}

fn set(table: &mut TaskTable, cpu: usize, tasks: Vec<RqTask>) {
    table.cpus[cpu] = tasks.into();
}

/// The node state derived from the task lists.
fn node(topo: &Topology, table: &TaskTable) -> NodeState {
    let cpus = (0..topo.nr_cpus).map(|c| rq_of(&table.cpus[c])).collect();
    NodeState::new(topo, cpus, &[], &Features::default())
}

fn opts(dst: &[usize]) -> BalanceOpts {
    BalanceOpts {
        dst_cpus: CpuMask::from_cpus(dst.iter().copied()),
        now_ms: 0,
        honor_intervals: false,
        max_proposals: 0,
    }
}

/// One periodic pass.
fn run(
    b: &mut Balancer,
    topo: &Topology,
    st: &NodeState,
    table: &TaskTable,
    o: &BalanceOpts,
) -> (Vec<Proposal>, PassStats) {
    let features = Features::default();
    let system = System::default();
    let view = View {
        topo,
        state: st,
        features: &features,
        system: &system,
    };
    let mut out = vec![];
    let stats = b.run(view, table, None, o, &mut out);
    (out, stats)
}

/// The expected proposal of a passive (detach_tasks) move, cold, on a
/// domain that had not failed.
#[allow(clippy::too_many_arguments)]
fn prop(
    task: u64,
    src_cpu: usize,
    dst_cpu: usize,
    migration_type: MigrationType,
    level: Level,
    busiest: GroupType,
    local: GroupType,
    imbalance: i64,
) -> Proposal {
    Proposal {
        task,
        group: 1000 + task,
        src_cpu,
        dst_cpu,
        migration_type,
        active: false,
        level,
        busiest,
        local,
        imbalance,
        forced_hot: false,
        nr_balance_failed: 0,
        llc_preference: false,
    }
}

fn rejections(s: &PassStats) -> Vec<(&'static str, u64)> {
    s.rejection_counts().collect()
}

/// `(nr_balance_failed, balance_interval)` of `cpu`'s domain `k`.
fn dom(b: &Balancer, cpu: usize, k: usize) -> (u32, u32) {
    let d = b.lb.dom[cpu][k];
    (d.nr_balance_failed, d.balance_interval)
}

const CLOCK: i64 = 10_000_000;

/// Ran 0.1 ms before the source's clock: hot (< 0.5 ms migration cost).
fn hot(mut t: RqTask) -> RqTask {
    t.exec_start = CLOCK - 100_000;
    t
}

// ---------------------------------------------------------------------------
// 1. An overloaded CPU next to an idle one
// ---------------------------------------------------------------------------

/// CPU 0 runs three nice-0 tasks (load 1024, util 341, runnable 1024 each),
/// CPU 1 is idle. The head task 1 is running, task 3 is the coldest.
fn overloaded_pair() -> (Topology, TaskTable) {
    let topo = two_cpus();
    let mut table = TaskTable::empty(2);
    set(
        &mut table,
        0,
        vec![
            running(task(1, 1024, 341, 1024)),
            task(2, 1024, 341, 1024),
            task(3, 1024, 341, 1024),
        ],
    );
    (topo, table)
}

#[test]
fn idle_cpu_pulls_the_coldest_task_from_an_overloaded_neighbour() {
    let (topo, table) = overloaded_pair();
    // SMT has one CPU and PKG the same span and a subset of MC's flags: only
    // MC remains (pct 117, cache_nice_tries 1, min/max interval 2/4 ms).
    assert_eq!(levels(&topo, 0), [Level::Mc]);
    assert_eq!(levels(&topo, 1), [Level::Mc]);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    // should_we_balance: CPU 1 is the only CPU of its local group {1}.
    // Local {1}: nr 0 < weight 1 -> has_spare, idle_cpus 1.
    // Remote {0}: nr 3 > weight 1 and 1024*100 < util 1023*117 = 119691
    //   -> overloaded, avg_load 3072*1024/1024 = 3072.
    // Decision: busiest overloaded, local has_spare. The groups are single
    //   CPUs whose child (SMT) was degenerated, so sg->flags = 0 and
    //   prefer_sibling is false; the busiest is overloaded so the
    //   "not overloaded" exits do not apply -> calculate_imbalance.
    // calculate_imbalance: local has_spare, busiest > fully_busy but MC has
    //   SD_SHARE_LLC (no util case); busiest.group_weight == 1 ->
    //   sibling_imbalance: equal cores (1, 1): 3 - 0 = 3; >> 1 = 1 task.
    // find_src_rq (task): CPU 0 (3 runnable).
    // detach_tasks: tail = task 3, cold -> imbalance 1 - 1 = 0, stop.
    assert_eq!(
        out,
        [prop(
            3,
            0,
            1,
            MigrationType::Task,
            Level::Mc,
            GroupType::Overloaded,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!(rejections(&stats), []);
    assert_eq!((stats.domains_balanced, stats.domains_declined), (1, 0));
    assert_eq!(stats.active_balances, 0);
    // Moved: nr_balance_failed = 0, balance_interval = min_interval = 2.
    assert_eq!(dom(&b, 1, 0), (0, 2));
}

#[test]
fn busy_cpu_finds_no_busier_group_and_backs_off() {
    let (topo, table) = overloaded_pair();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    // should_we_balance: no idle CPU in {0}, CPU 0 is the group's first CPU.
    // Remote {1} runs nothing (sum_h_nr_running 0): never the busiest ->
    // out_balanced: nr_balance_failed 0; interval 2 < max_interval 4 -> 4.
    assert!(out.is_empty());
    assert_eq!((stats.domains_balanced, stats.domains_declined), (1, 0));
    assert_eq!(dom(&b, 0, 0), (0, 4));
    // Next pass: 4 is not below max_interval 4 and not all pinned: stays 4.
    let (out, _) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    assert!(out.is_empty());
    assert_eq!(dom(&b, 0, 0), (0, 4));
}

// ---------------------------------------------------------------------------
// 2. LBF_DST_PINNED: retarget to another CPU of the local group
// ---------------------------------------------------------------------------

/// SMT2 x 2 cores. CPU 0: [1 running, 2, 3 pinned to {0,3}], CPU 1: [4
/// running]; core 1 (CPUs 2, 3) idle. Loads 1024; util 341 on CPU 0 and
/// 1024 on CPU 1; runnable 1024.
fn pinned_to_sibling(hot3: bool) -> (Topology, TaskTable) {
    let topo = smt2x2();
    let mut table = TaskTable::empty(4);
    let k = table.intern_mask(CpuMask::from_cpus([0, 3]));
    let mut t3 = task(3, 1024, 341, 1024);
    t3.allowed = k;
    if hot3 {
        t3 = hot(t3);
        table.clock[0] = CLOCK;
    }
    set(
        &mut table,
        0,
        vec![
            running(task(1, 1024, 341, 1024)),
            task(2, 1024, 341, 1024),
            t3,
        ],
    );
    set(&mut table, 1, vec![running(task(4, 1024, 1024, 1024))]);
    (topo, table)
}

#[test]
fn dst_pinned_task_is_retargeted_to_the_other_thread_of_the_idle_core() {
    let (topo, table) = pinned_to_sibling(false);
    assert_eq!(levels(&topo, 2), [Level::Smt, Level::Mc]);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[2]));
    // SMT {2,3}: group {3} is empty -> balanced.
    // MC: should_we_balance: CPU 2 idle on an idle core -> CPU 2 balances.
    //   Local {2,3}: has_spare, idle 2, cores 1.
    //   Remote {0,1}: nr 4 > 2, util 1023 + 1024 = 2047, 2048*100 < 2047*117
    //   -> overloaded. Its flags are the SMT child's: PREFER_SIBLING, so
    //   sibling_imbalance = 4 - 0 = 4 > 1 forces; calculate_imbalance:
    //   SD_SHARE_LLC, prefer_sibling -> 4 >> 1 = 2 tasks.
    //   find_src_rq: CPU 0 (3) over CPU 1 (1).
    // detach_tasks toward CPU 2 (loop_max 3):
    //   1: task 3 not allowed on 2 -> SOME_PINNED; first({2,3} & cpus &
    //      {0,3}) = 3 -> DST_PINNED, new_dst_cpu 3; rotated to the head.
    //   2: task 2 cold -> moves to CPU 2, imbalance 1.
    //   3: task 1 running -> refused. 4 > loop_max: stop.
    // DST_PINNED and imbalance 1 > 0: CPU 2 leaves env.cpus, dst = 3,
    //   loop = 0: task 3 (tail again) may run on 3, cold -> moves, imbalance 0.
    let busiest = GroupType::Overloaded;
    let local = GroupType::HasSpare;
    assert_eq!(
        out,
        [
            prop(2, 0, 2, MigrationType::Task, Level::Mc, busiest, local, 2),
            prop(3, 0, 3, MigrationType::Task, Level::Mc, busiest, local, 2),
        ]
    );
    assert_eq!(rejections(&stats), [("affinity", 1), ("running", 1)]);
    assert_eq!(stats.domains_balanced, 2);
    // SMT: balanced, interval 2 -> 4. MC: moved, interval = min_interval 4.
    assert_eq!(dom(&b, 2, 0), (0, 4));
    assert_eq!(dom(&b, 2, 1), (0, 4));
}

/// Same layout, but CPU 0 runs only [1 running, 3 hot and pinned to {0,3}].
#[test]
fn dst_pinned_retarget_keeps_the_balancing_cpus_failure_count() {
    let (topo, mut table) = pinned_to_sibling(true);
    let t0: Vec<RqTask> = table.cpus[0]
        .iter()
        .filter(|t| t.id != 2)
        .cloned()
        .collect();
    set(&mut table, 0, t0);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // MC from CPU 2: remote {0,1} nr 3 > 2, util 682 + 1024 = 1706:
    //   204800 < 1706*117 = 199602? no; runnable 3072*100 > 2048*117 ->
    //   overloaded. sibling_imbalance 3 - 0 = 3 -> 3 >> 1 = 1 task; CPU 0.
    // Each pass toward CPU 2: task 3 pinned -> DST_PINNED new_dst 3; task 1
    //   running. Retarget to CPU 3 (env->sd is still CPU 2's MC domain):
    //   task 3 allowed, hot (0.1 ms), MC cache_nice_tries 1.
    // Pass 1: nr_balance_failed 0 > 1? no -> refused; failed -> 1.
    // Pass 2: 1 > 1? no -> refused; failed -> 2.
    // Neither pass starts active balancing (needs failed > 1 + 2).
    for want in 1..=2 {
        let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[2]));
        assert!(out.is_empty(), "pass {want}: {out:?}");
        assert_eq!(
            rejections(&stats),
            [("affinity", 1), ("running", 2), ("hot", 1)],
            "pass {want}"
        );
        assert_eq!(stats.active_balances, 0);
        assert_eq!(dom(&b, 2, 1), (want, 4), "pass {want}");
    }
    // Pass 3: env->sd->nr_balance_failed = 2 > 1: the hot task is allowed
    // (forced) toward the retargeted CPU 3; the domain's counter resets.
    // (The count read is the balancing CPU's, not the retargeted CPU 3's,
    // which never balanced: a regression would keep the task hot forever.)
    let (out, _) = run(&mut b, &topo, &st, &table, &opts(&[2]));
    let mut want = prop(
        3,
        0,
        3,
        MigrationType::Task,
        Level::Mc,
        GroupType::Overloaded,
        GroupType::HasSpare,
        1,
    );
    want.forced_hot = true;
    want.nr_balance_failed = 2;
    assert_eq!(out, [want]);
    assert_eq!(dom(&b, 2, 1), (0, 4));
}

#[test]
fn dst_pinned_retarget_to_a_cpu_with_a_shorter_domain_chain() {
    // LLC 0: core 0 = CPUs 0,1 (SMT), core 1 = CPU 2 (one thread);
    // LLC 1: CPUs 3, 4 (one thread each). CPU 0's chain is SMT, MC, PKG;
    // CPU 2's SMT level has one CPU and degenerates: MC, PKG.
    let topo = build_all(&spec(&[(0, 0), (0, 0), (1, 0), (2, 1), (3, 1)]));
    assert_eq!(levels(&topo, 0), [Level::Smt, Level::Mc, Level::Pkg]);
    assert_eq!(levels(&topo, 2), [Level::Mc, Level::Pkg]);
    let mut table = TaskTable::empty(5);
    let k = table.intern_mask(CpuMask::from_cpus([2, 3, 4]));
    let mut on3 = vec![
        running(task(30, 1024, 341, 1024)),
        task(31, 1024, 341, 1024),
        task(32, 1024, 341, 1024),
    ];
    for t in &mut on3 {
        t.allowed = k;
    }
    set(&mut table, 3, on3);
    let mut t40 = running(task(40, 1024, 1024, 1024));
    t40.allowed = k;
    set(&mut table, 4, vec![t40]);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    // CPU 0, SMT and MC: nothing runs in LLC 0 -> balanced.
    // CPU 0, PKG: first idle CPU of {0,1,2} on an idle core is 0.
    //   Local {0,1,2}: has_spare, capacity 3072, cores 2, util 0.
    //   Remote {3,4}: nr 4 > 2, util 1023 + 1024 = 2047, 2047*117 > 204800
    //   -> overloaded; prefer_sibling (MC flags); equal cores (2, 2):
    //   4 - 0 = 4 > 1 -> force. PKG is not SD_SHARE_LLC -> migrate_util,
    //   max(3072, 0) - 0 = 3072. find_src_rq: CPU 4 has 1 task -> CPU 3.
    // detach toward CPU 0: task 32 not allowed on 0 -> DST_PINNED,
    //   new_dst = first({0,1,2} & cpus & {2,3,4}) = 2; 31 and 30 refused
    //   by affinity too. Retarget: dst = CPU 2, env->sd still CPU 0's PKG.
    //   Task 32: util 341 <= 3072 -> moves (2731 left); task 31 -> moves
    //   (2390 left); CPU 3 keeps one task and the balancer is idle -> stop.
    // (CPU 2's chain has 2 domains: indexing it with CPU 0's PKG index 2
    // would be out of range; env->sd stays CPU 0's domain.)
    let busiest = GroupType::Overloaded;
    let local = GroupType::HasSpare;
    assert_eq!(
        out,
        [
            prop(
                32,
                3,
                2,
                MigrationType::Util,
                Level::Pkg,
                busiest,
                local,
                3072
            ),
            prop(
                31,
                3,
                2,
                MigrationType::Util,
                Level::Pkg,
                busiest,
                local,
                3072
            ),
        ]
    );
    assert_eq!(rejections(&stats), [("affinity", 3)]);
}

// ---------------------------------------------------------------------------
// 3. All pinned
// ---------------------------------------------------------------------------

#[test]
fn all_pinned_busiest_gives_nothing_and_doubles_the_interval_past_max() {
    let topo = two_cpus();
    let mut table = TaskTable::empty(2);
    let k = table.intern_mask(CpuMask::from_cpus([0]));
    let mut tasks = vec![
        running(task(1, 1024, 341, 1024)),
        task(2, 1024, 341, 1024),
        task(3, 1024, 341, 1024),
    ];
    for t in &mut tasks {
        t.allowed = k;
    }
    set(&mut table, 0, tasks);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // As in case 1: migrate_task, imbalance 1, busiest CPU 0 (loop_max 3).
    // detach_tasks: tasks 3, 2, 1 are each refused by affinity (the affinity
    //   test comes before the running test), no CPU of {1} is in their mask
    //   -> no DST_PINNED; LBF_ALL_PINNED stays set.
    // All pinned: CPU 0 leaves env.cpus = {1}, a subset of dst_grpmask {1}
    //   -> out_all_pinned: nr_balance_failed 0; then, ALL_PINNED and
    //   balance_interval < MAX_PINNED_INTERVAL 512 -> doubles, ignoring
    //   max_interval 4: 2 -> 4 -> 8 -> 16.
    for want in [4, 8, 16] {
        let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
        assert!(out.is_empty());
        assert_eq!(rejections(&stats), [("affinity", 3)]);
        assert_eq!(dom(&b, 1, 0), (0, want));
    }
}

#[test]
fn all_pinned_busiest_is_dropped_and_the_next_busiest_is_used() {
    // 4 single-thread CPUs in one LLC (MC only, single-CPU groups).
    let topo = build_all(&spec(&[(0, 0), (1, 0), (2, 0), (3, 0)]));
    assert_eq!(levels(&topo, 3), [Level::Mc]);
    let mut table = TaskTable::empty(4);
    let k = table.intern_mask(CpuMask::from_cpus([0]));
    let mut on0 = vec![
        running(task(1, 1024, 341, 1024)),
        task(2, 1024, 341, 1024),
        task(3, 1024, 341, 1024),
    ];
    for t in &mut on0 {
        t.allowed = k;
    }
    set(&mut table, 0, on0);
    set(
        &mut table,
        1,
        vec![running(task(4, 1024, 512, 1024)), task(5, 1024, 512, 1024)],
    );
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[3]));
    // Ring of CPU 3: {3} {0} {1} {2}. {0}: overloaded, avg 3072. {1}: nr 2,
    //   util 1024*117 > 102400 -> overloaded, avg 2048; 2048 > 3072 is false
    //   -> busiest {0}. sibling_imbalance 3 -> 1 task. All three tasks of
    //   CPU 0 are pinned: CPU 0 leaves env.cpus = {1,2,3}, not a subset of
    //   {3} -> redo without it.
    // Redo: {1} is the busiest: sibling_imbalance 2 - 0 = 2 -> 1 task.
    //   detach from CPU 1: tail task 5 cold -> moves to CPU 3.
    assert_eq!(
        out,
        [prop(
            5,
            1,
            3,
            MigrationType::Task,
            Level::Mc,
            GroupType::Overloaded,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!(rejections(&stats), [("affinity", 3)]);
    // Moved: failed 0, interval = min_interval 4.
    assert_eq!(dom(&b, 3, 0), (0, 4));
}

#[test]
fn affinity_blocked_child_level_marks_its_group_imbalanced_for_the_parent() {
    // 2 LLCs x 2 CPUs. CPU 2: [20 running, 21], both allowed on {0,1,2}
    // only; loads 1024, util 512, runnable 1024. CPUs 0, 1, 3 idle.
    let topo = two_llcs();
    let mut table = TaskTable::empty(4);
    let k = table.intern_mask(CpuMask::from_cpus([0, 1, 2]));
    let mut on2 = vec![
        running(task(20, 1024, 512, 1024)),
        task(21, 1024, 512, 1024),
    ];
    for t in &mut on2 {
        t.allowed = k;
    }
    set(&mut table, 2, on2);
    let st = node(&topo, &table);
    let llc1 = topo.domains(2)[0].span; // {2,3}
    let mut b = Balancer::new(&topo);
    // CPU 3, MC {2,3}: {2} nr 2 > 1, 1024*117 > 102400 -> overloaded;
    //   sibling_imbalance 2 -> 1 task; CPU 2. Both tasks refused by affinity
    //   (no CPU of {3} in their mask: no DST_PINNED). SOME_PINNED with
    //   imbalance 1 > 0 and a parent -> PKG's local group {2,3} gets
    //   sgc->imbalance = 1 (before the all-pinned exit, which keeps it).
    //   All pinned: interval 2 -> 4, failed 0.
    // CPU 3, PKG: first idle of {2,3} is CPU 3 -> balances; {0,1} is empty.
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[3]));
    assert!(out.is_empty());
    assert_eq!(rejections(&stats), [("affinity", 2)]);
    assert!(b.lb.sgc_imbalance(&topo, Level::Pkg, llc1));
    assert_eq!(dom(&b, 3, 0), (0, 4));
    // CPU 0, PKG: remote {2,3}: nr 2 <= 2 (not overloaded) but
    //   sgc->imbalance -> group_imbalanced (5): force; calculate_imbalance:
    //   imbalanced -> migrate_task, 1. find_src_rq: CPU 2. detach toward
    //   CPU 0: task 21 is allowed there and cold -> moves.
    let (out, _) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    assert_eq!(
        out,
        [prop(
            21,
            2,
            0,
            MigrationType::Task,
            Level::Pkg,
            GroupType::Imbalanced,
            GroupType::HasSpare,
            1
        )]
    );
    // Only a balanced pass of the child level without ALL_PINNED clears it.
    assert!(b.lb.sgc_imbalance(&topo, Level::Pkg, llc1));
}

// ---------------------------------------------------------------------------
// 4. Cache-hot tasks and cache_nice_tries; active balancing
// ---------------------------------------------------------------------------

#[test]
fn cache_hot_tasks_stay_until_the_domain_failed_more_than_cache_nice_tries() {
    let (topo, mut table) = overloaded_pair();
    let hot_list: Vec<RqTask> = table.cpus[0].iter().cloned().map(hot).collect();
    set(&mut table, 0, hot_list);
    table.clock[0] = CLOCK;
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // Every pass: migrate_task, imbalance 1, busiest CPU 0 (as in case 1).
    // MC cache_nice_tries = 1. Tasks ran 100000 ns ago < 500000: hot.
    // Pass 1 (failed 0): task 3 hot, task 2 hot, task 1 running -> nothing;
    //   failed -> 1. need_active_balance: migrate_task but 1 > 1 + 2 is
    //   false; src has 3 runnable (not the reduced-capacity case) -> no.
    // Pass 2 (failed 1): 1 > 1 false: same; failed -> 2.
    for want in 1..=2 {
        let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
        assert!(out.is_empty(), "pass {want}");
        assert_eq!(rejections(&stats), [("running", 1), ("hot", 2)]);
        assert_eq!(stats.active_balances, 0);
        // Unbalanced: interval reset to min_interval 2.
        assert_eq!(dom(&b, 1, 0), (want, 2));
    }
    // Pass 3 (failed 2 > 1): task 3 is allowed as a forced hot migration;
    // imbalance 1 -> 0. Moved: failed -> 0. Active balancing never started
    // (it would have needed failed > 3 with nothing moved).
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    let mut want = prop(
        3,
        0,
        1,
        MigrationType::Task,
        Level::Mc,
        GroupType::Overloaded,
        GroupType::HasSpare,
        1,
    );
    want.forced_hot = true;
    want.nr_balance_failed = 2;
    assert_eq!(out, [want]);
    assert_eq!(rejections(&stats), []);
    assert_eq!(stats.active_balances, 0);
    assert_eq!(dom(&b, 1, 0), (0, 2));
}

#[test]
fn cache_hot_task_moves_at_once_between_smt_siblings() {
    // One core, two threads: SMT {0,1} only (MC has the same span and a
    // subset of its flags). SMT: pct 110, cache_nice_tries 0, and task_hot()
    // is false at an SD_SHARE_CPUCAPACITY level.
    let topo = build_all(&spec(&[(0, 0), (0, 0)]));
    assert_eq!(levels(&topo, 1), [Level::Smt]);
    let mut table = TaskTable::empty(2);
    set(
        &mut table,
        0,
        vec![
            hot(running(task(1, 1024, 341, 1024))),
            hot(task(2, 1024, 341, 1024)),
            hot(task(3, 1024, 341, 1024)),
        ],
    );
    table.clock[0] = CLOCK;
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    // {0}: nr 3 > 1 and 1024*100 < 1023*110 = 112530 -> overloaded; single
    // CPU group -> sibling_imbalance 3 -> 1 task. Task 3 is "hot" by the
    // clock but not at the SMT level: moves on the first pass.
    assert_eq!(
        out,
        [prop(
            3,
            0,
            1,
            MigrationType::Task,
            Level::Smt,
            GroupType::Overloaded,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!(rejections(&stats), []);
}

/// CPU 0: [1 running, 2 = per-CPU kthread]; CPU 1 idle. Loads 1024, util
/// 512, runnable 1024.
fn running_and_kthread() -> (Topology, TaskTable) {
    let topo = two_cpus();
    let mut table = TaskTable::empty(2);
    let mut k = task(2, 1024, 512, 1024);
    k.per_cpu_kthread = true;
    k.group = 0;
    set(&mut table, 0, vec![running(task(1, 1024, 512, 1024)), k]);
    (topo, table)
}

#[test]
fn running_task_only_moves_by_active_balance_after_four_failures() {
    let (topo, table) = running_and_kthread();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // {0}: nr 2 > 1, 102400 < 1024*117 -> overloaded; sibling_imbalance
    //   2 - 0 = 2 -> 1 task; busiest CPU 0, loop_max 2.
    // detach_tasks: task 2 per-CPU kthread -> refused (before affinity, so
    //   ALL_PINNED stays); task 1 may run on CPU 1 (ALL_PINNED cleared) but
    //   is running -> refused. Nothing moved: failed++.
    // need_active_balance (migrate_task): failed > cache_nice_tries 1 + 2.
    // Passes 1..3: failed 1, 2, 3 -> no.
    for want in 1..=3 {
        let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
        assert!(out.is_empty(), "pass {want}");
        assert_eq!(rejections(&stats), [("per_cpu_kthread", 1), ("running", 1)]);
        assert_eq!(stats.active_balances, 0);
        assert_eq!(dom(&b, 1, 0), (want, 2));
    }
    // Pass 4: failed 4 > 3 -> active. busiest->curr (task 1) may run on
    // CPU 1, so the stopper runs on CPU 0: from the tail, task 2 is a
    // per-CPU kthread (refused even under LBF_ACTIVE_LB), task 1 is now
    // merely queued -> pushed to CPU 1. The stopper resets failed to 0.
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    let mut want = prop(
        1,
        0,
        1,
        MigrationType::Task,
        Level::Mc,
        GroupType::Overloaded,
        GroupType::HasSpare,
        1,
    );
    want.active = true;
    want.nr_balance_failed = 4;
    assert_eq!(out, [want]);
    assert_eq!(stats.active_balances, 1);
    assert_eq!(rejections(&stats), [("per_cpu_kthread", 2), ("running", 1)]);
    assert_eq!(dom(&b, 1, 0).0, 0);
}

#[test]
fn active_balance_resets_the_balance_interval_to_min_interval() {
    let (topo, table) = running_and_kthread();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // The domain state just before the active pass, with an interval that an
    // earlier back-off had left at 4 (max_interval).
    b.lb.dom[1][0].nr_balance_failed = 3;
    b.lb.dom[1][0].balance_interval = 4;
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    assert_eq!(stats.active_balances, 1);
    assert_eq!(out.len(), 1);
    assert!(out[0].active);
    // Kernel 7.3: after kicking the stopper, sched_balance_rq falls through
    // to out_unbalanced, which always sets balance_interval = min_interval.
    // Kernel 6.12: "if (!active_balance || need_active_balance(&env))"
    // resets it too: the stopper runs later, so failed is still 4 > 3.
    // (need_active_balance is decided once, before the push the model
    // makes at once, so the reset happens.)
    assert_eq!(dom(&b, 1, 0), (0, 2));
}

// ---------------------------------------------------------------------------
// 5. should_we_balance
// ---------------------------------------------------------------------------

/// LLC 0 = CPUs 0,1 idle; LLC 1: CPU 2 [20 running, 21], CPU 3 [30 running,
/// 31]; loads 1024, util 512, runnable 1024.
fn idle_llc_next_to_busy_llc() -> (Topology, TaskTable) {
    let topo = two_llcs();
    let mut table = TaskTable::empty(4);
    set(
        &mut table,
        2,
        vec![
            running(task(20, 1024, 512, 1024)),
            task(21, 1024, 512, 1024),
        ],
    );
    set(
        &mut table,
        3,
        vec![
            running(task(30, 1024, 512, 1024)),
            task(31, 1024, 512, 1024),
        ],
    );
    (topo, table)
}

#[test]
fn second_idle_cpu_of_the_local_group_declines_to_balance() {
    let (topo, table) = idle_llc_next_to_busy_llc();
    assert_eq!(levels(&topo, 1), [Level::Mc, Level::Pkg]);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    // MC {0,1} of CPU 1: its local group is {1} alone, so it balances; the
    //   other group {0} is empty -> balanced, interval 2 -> 4.
    // PKG: local group {0,1}; the first idle CPU is 0 (no SMT), not 1 ->
    //   declined; continue_balancing = 0; out_balanced: interval 4 -> 8.
    assert!(out.is_empty());
    assert_eq!((stats.domains_balanced, stats.domains_declined), (1, 1));
    assert_eq!(dom(&b, 1, 0), (0, 4));
    assert_eq!(dom(&b, 1, 1), (0, 8));
}

#[test]
fn once_the_first_idle_cpu_pulled_the_second_one_balances() {
    let (topo, table) = idle_llc_next_to_busy_llc();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0, 1]));
    // CPU 0, MC: {1} empty -> balanced.
    // CPU 0, PKG: first idle CPU of {0,1} is 0 -> balances.
    //   Local {0,1}: has_spare, idle 2, cores 2, util 0.
    //   Remote {2,3}: nr 4 > 2, util 2048, 204800 < 2048*117 -> overloaded;
    //   flags = MC's -> prefer_sibling; sibling_imbalance (2 cores each)
    //   4 - 0 = 4 > 1 -> force.
    //   calculate_imbalance: local has_spare, busiest overloaded and PKG is
    //   not SD_SHARE_LLC -> migrate_util, max(2048, 0) - 0 = 2048.
    //   find_src_rq (util): CPU 2 and CPU 3 both min(max(1024, 2048), 1024)
    //   = 1024 -> the first, CPU 2.
    //   detach: task 21 util 512 <= 2048 -> moves (imbalance 1536); CPU 2
    //   is left with one task and dst is idle -> stop.
    // CPU 1, MC: {0} now runs task 21: nr 1, has_spare, sum_h 1 -> balanced.
    // CPU 1, PKG: CPU 0 is busy now, CPU 1 is the first idle -> balances.
    //   Local: nr 1, util 512, has_spare. Remote: CPU 2 (1 task) + CPU 3
    //   (2 tasks): nr 3 > 2; 2048*117 < runnable 3072*100 -> overloaded.
    //   sibling_imbalance 3 - 1 = 2 > 1 -> force; util: 2048 - 512 = 1536.
    //   find_src_rq: CPU 2 has one task (util needs > 1) -> CPU 3.
    //   detach: task 31 util 512 <= 1536 -> moves; CPU 3 keeps one -> stop.
    let busiest = GroupType::Overloaded;
    let local = GroupType::HasSpare;
    assert_eq!(
        out,
        [
            prop(
                21,
                2,
                0,
                MigrationType::Util,
                Level::Pkg,
                busiest,
                local,
                2048
            ),
            prop(
                31,
                3,
                1,
                MigrationType::Util,
                Level::Pkg,
                busiest,
                local,
                1536
            ),
        ]
    );
    assert_eq!((stats.domains_balanced, stats.domains_declined), (4, 0));
    assert_eq!(rejections(&stats), []);
}

#[test]
fn on_smt_only_the_first_idle_cpu_of_an_idle_core_balances_the_cores() {
    // SMT2 x 2: CPU 0 [1 running, 2], CPUs 1, 2, 3 idle.
    let topo = smt2x2();
    let mut table = TaskTable::empty(4);
    set(
        &mut table,
        0,
        vec![running(task(1, 1024, 512, 1024)), task(2, 1024, 512, 1024)],
    );
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // CPU 3, SMT {2,3}: local group {3} -> balances (nothing there).
    // CPU 3, MC: local group {2,3}: CPU 2 is idle on an idle core -> it is
    //   CPU 2's job: declined.
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[3]));
    assert!(out.is_empty());
    assert_eq!((stats.domains_balanced, stats.domains_declined), (1, 1));
    // CPU 2 balances MC. Remote {0,1}: nr 2 <= 2 -> not overloaded;
    //   SMT group with 2 runnable and an idle dst -> smt_balance.
    //   prefer_sibling (SMT flags): sibling_imbalance 2 - 0 = 2 > 1 ->
    //   force; smt_balance -> migrate_task, 1. find_src_rq: CPU 0.
    //   detach: task 2 (tail, cold) -> CPU 2.
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[2]));
    assert_eq!(
        out,
        [prop(
            2,
            0,
            2,
            MigrationType::Task,
            Level::Mc,
            GroupType::SmtBalance,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!((stats.domains_balanced, stats.domains_declined), (2, 0));
}

// ---------------------------------------------------------------------------
// 6. SMT: one task per thread of a core, the other core idle
// ---------------------------------------------------------------------------

#[test]
fn busy_smt_core_next_to_an_idle_core_is_relieved_by_active_balance() {
    let topo = smt2x2();
    let mut table = TaskTable::empty(4);
    set(&mut table, 0, vec![running(task(1, 1024, 1024, 1024))]);
    set(&mut table, 1, vec![running(task(2, 1024, 1024, 1024))]);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // CPU 2, SMT {2,3}: nothing. MC: CPU 2 is the first idle CPU of the idle
    //   core -> balances.
    //   Local {2,3}: has_spare, idle 2. Remote {0,1}: nr 2 <= weight 2 ->
    //   not overloaded; dst idle, SMT group, sum_h_nr_running 2 > 1 ->
    //   group_smt_balance (3) > has_spare -> busiest.
    //   prefer_sibling: sibling_imbalance 2 - 0 = 2 > 1 -> force;
    //   calculate_imbalance: smt_balance -> migrate_task, imbalance 1.
    //   find_src_rq (task): CPU 0 and CPU 1 each 1 -> the first, CPU 0.
    //   busiest->nr_running = 1: no detach_tasks; nothing moved -> failed++.
    //   need_active_balance: migrate_task and failed > 1 + 2; the reduced
    //   capacity case does not apply (full capacity).
    // Passes 1..3: failed 1, 2, 3: no active balance.
    for want in 1..=3 {
        let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[2]));
        assert!(out.is_empty(), "pass {want}");
        assert_eq!(stats.active_balances, 0);
        assert_eq!(rejections(&stats), []);
        assert_eq!(dom(&b, 2, 1), (want, 4));
    }
    // Pass 4: failed 4 > 3. Task 1 (CPU 0's curr) may run on CPU 2, so the
    // stopper is queued on CPU 0. When it runs, CPU 0's nr_running counts
    // the stopper and task 1 (2 > 1), task 1 is no longer on the CPU, and
    // under LBF_ACTIVE_LB it is pushed to CPU 2; failed -> 0.
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[2]));
    let mut want = prop(
        1,
        0,
        2,
        MigrationType::Task,
        Level::Mc,
        GroupType::SmtBalance,
        GroupType::HasSpare,
        1,
    );
    want.active = true;
    want.nr_balance_failed = 4;
    // Regression guard: active_load_balance() in balance.rs at commit
    // cbb851f refused a source with nr_running <= 1, forgetting that the
    // kernel's count includes the stopper, and never moved the task (fixed in
    // 0cc90c2).
    assert_eq!(out, [want]);
    assert_eq!(stats.active_balances, 1);
    assert_eq!(dom(&b, 2, 1), (0, 4));
}

// ---------------------------------------------------------------------------
// 7. migrate_load between two overloaded groups
// ---------------------------------------------------------------------------

#[test]
fn load_moves_between_overloaded_llcs_once_the_shift_lets_a_heavy_task_fit() {
    let topo = two_llcs();
    let mut table = TaskTable::empty(4);
    // Local LLC {0,1}: two tasks per CPU, load 700, util 500, runnable 700.
    for c in 0..2 {
        let id = 10 * c as u64;
        set(
            &mut table,
            c,
            vec![
                running(task(id + 1, 700, 500, 700)),
                task(id + 2, 700, 500, 700),
            ],
        );
    }
    // Remote LLC {2,3}: CPU 2 two tasks of load 1500 (nice -2), CPU 3 two
    // of load 1300; util 512, runnable 1024.
    set(
        &mut table,
        2,
        vec![
            running(task(21, 1500, 512, 1024)),
            task(22, 1500, 512, 1024),
        ],
    );
    set(
        &mut table,
        3,
        vec![
            running(task(31, 1300, 512, 1024)),
            task(32, 1300, 512, 1024),
        ],
    );
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    // Balancing from busy CPU 0 (CPU_NOT_IDLE).
    // MC {0,1}: {0} and {1} both overloaded (nr 2 > 1, 1000*117 > 102400)
    //   with avg_load 1400 each: local.avg >= busiest.avg -> balanced.
    // PKG: no idle CPU in {0,1} -> the first CPU, 0, balances.
    //   Local {0,1}: load 2800, util 2000, nr 4 > 2, 2000*117 = 234000 >
    //   204800 -> overloaded, avg_load 2800*1024/2048 = 1400.
    //   Remote {2,3}: load 5600, util 2048 -> overloaded, avg 2800.
    //   sds.avg_load = 8400*1024/4096 = 2100. 1400 < 2800, 1400 < 2100,
    //   100*2800 = 280000 > 117*1400 = 163800 -> imbalanced.
    //   calculate_imbalance (both overloaded): migrate_load,
    //   min((2800-2100)*2048, (2100-1400)*2048)/1024 = 1400.
    //   find_src_rq (load): CPU 2 3000/1024 > CPU 3 2600/1024 -> CPU 2.
    // Pass 1 (failed 0): task 22: 1500 >> 0 = 1500 > 1400 -> skipped (not a
    //   can_migrate refusal); task 21 running. Nothing: failed -> 1. No
    //   active balance (migrate_load; dst not idle).
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    assert!(out.is_empty());
    assert_eq!(rejections(&stats), [("running", 1)]);
    assert_eq!(stats.active_balances, 0);
    assert_eq!(dom(&b, 0, 0), (0, 4)); // MC balanced: 2 -> 4
    assert_eq!(dom(&b, 0, 1), (1, 4)); // PKG unbalanced: min_interval 4
    // Pass 2 (failed 1): task 22: 1500 >> 1 = 750 <= 1400 -> moves;
    // imbalance 1400 - 1500 < 0 -> stop. Moved: failed -> 0.
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    let mut want = prop(
        22,
        2,
        0,
        MigrationType::Load,
        Level::Pkg,
        GroupType::Overloaded,
        GroupType::Overloaded,
        1400,
    );
    want.nr_balance_failed = 1;
    assert_eq!(out, [want]);
    assert_eq!(rejections(&stats), []);
    assert_eq!(dom(&b, 0, 1), (0, 4));
}

#[test]
fn load_detach_takes_light_tasks_and_skips_heavier_ones() {
    // The same machine; CPU 2 now runs [21 running 1500, 23 load 1200,
    // 24 load 300 (tail)]: util 341 each, runnable 1024.
    let topo = two_llcs();
    let mut table = TaskTable::empty(4);
    for c in 0..2 {
        let id = 10 * c as u64;
        set(
            &mut table,
            c,
            vec![
                running(task(id + 1, 700, 500, 700)),
                task(id + 2, 700, 500, 700),
            ],
        );
    }
    set(
        &mut table,
        2,
        vec![
            running(task(21, 1500, 341, 1024)),
            task(23, 1200, 341, 1024),
            task(24, 300, 341, 1024),
        ],
    );
    set(
        &mut table,
        3,
        vec![
            running(task(31, 1300, 512, 1024)),
            task(32, 1300, 512, 1024),
        ],
    );
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    // Remote {2,3}: load 3000 + 2600 = 5600 as before, util 1023 + 1024,
    //   nr 5 -> overloaded, avg 2800; imbalance 1400 again; CPU 2 (3000).
    // detach (loop_max 3): task 24: 300 <= 1400 -> moves, imbalance 1100;
    //   task 23: 1200 > 1100 -> skipped; task 21 running; loop 4 > 3.
    assert_eq!(
        out,
        [prop(
            24,
            2,
            0,
            MigrationType::Load,
            Level::Pkg,
            GroupType::Overloaded,
            GroupType::Overloaded,
            1400
        )]
    );
    assert_eq!(rejections(&stats), [("running", 1)]);
    assert_eq!(dom(&b, 0, 1), (0, 4));
}

// ---------------------------------------------------------------------------
// 8. Edge cases
// ---------------------------------------------------------------------------

#[test]
fn one_cpu_node_has_no_domains_and_proposes_nothing() {
    let topo = build_all(&spec(&[(0, 0)]));
    assert!(topo.domains(0).is_empty());
    let mut table = TaskTable::empty(1);
    set(
        &mut table,
        0,
        vec![running(task(1, 1024, 512, 1024)), task(2, 1024, 512, 1024)],
    );
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0]));
    assert!(out.is_empty());
    assert_eq!(stats, PassStats::default());
}

#[test]
fn offline_cpu_is_neither_source_nor_destination() {
    // 3 CPUs in one LLC, CPU 2 offline: MC spans {0,1}; CPU 2 has no
    // domains. A stale report still lists tasks on CPU 2.
    let s = spec(&[(0, 0), (1, 0), (2, 0)]);
    let topo = build(&s, CpuMask::from_cpus([0, 1]));
    assert!(topo.domains(2).is_empty());
    let mut table = TaskTable::empty(3);
    set(
        &mut table,
        0,
        vec![
            running(task(1, 1024, 341, 1024)),
            task(2, 1024, 341, 1024),
            task(3, 1024, 341, 1024),
        ],
    );
    set(
        &mut table,
        2,
        vec![
            running(task(7, 1024, 341, 1024)),
            task(8, 1024, 341, 1024),
            task(9, 1024, 341, 1024),
        ],
    );
    let st = node(&topo, &table);
    // NodeState::new normalises the offline CPU to an empty runqueue.
    assert_eq!(st.cpus[2].nr_running, 0);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[0, 1, 2]));
    // CPU 0: {1} empty -> balanced. CPU 1: case 1 exactly -> task 3 from
    // CPU 0. CPU 2: offline, skipped. Nothing leaves or enters CPU 2.
    assert_eq!(
        out,
        [prop(
            3,
            0,
            1,
            MigrationType::Task,
            Level::Mc,
            GroupType::Overloaded,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!(stats.domains_balanced, 2);
}

#[test]
fn busy_cpu_without_reported_tasks_is_picked_but_nothing_detaches() {
    let topo = two_cpus();
    let table = TaskTable::empty(2);
    // CPU 0 reports 3 fair tasks in its counters but no task list.
    let mut cpu0 = CpuState::idle(1024);
    cpu0.nr_running = 3;
    cpu0.cfs_h_nr_queued = 3;
    cpu0.load_avg = 3072;
    cpu0.util_avg = 1023;
    cpu0.runnable_avg = 3072;
    cpu0.curr_is_idle = false;
    let st = NodeState::new(
        &topo,
        vec![cpu0, CpuState::idle(1024)],
        &[],
        &Features::default(),
    );
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    // Case 1's numbers: imbalance 1, busiest CPU 0 (nr_running 3 > 1), but
    // the list is empty: detach_tasks sees no task, LBF_ALL_PINNED stays ->
    // CPU 0 leaves env.cpus ({1} is within dst_grpmask) -> out_all_pinned:
    // failed 0, interval 2 -> 4 (all-pinned doubling).
    assert!(out.is_empty());
    assert_eq!(rejections(&stats), []);
    assert_eq!(stats.active_balances, 0);
    assert_eq!(dom(&b, 1, 0), (0, 4));
}

#[test]
fn sched_idle_task_is_never_cache_hot() {
    let (topo, mut table) = overloaded_pair();
    // CPU 0: [1 running, 2 SCHED_IDLE (load 3), 3 (tail)], all ran 0.1 ms ago.
    let mut idle_task = hot(task(2, 3, 341, 1024));
    idle_task.policy = Policy::Idle;
    set(
        &mut table,
        0,
        vec![
            hot(running(task(1, 1024, 341, 1024))),
            idle_task,
            hot(task(3, 1024, 341, 1024)),
        ],
    );
    table.clock[0] = CLOCK;
    let st = node(&topo, &table);
    assert_eq!(st.cpus[0].h_nr_idle, 1);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    // {0}: nr 3, util 1023 -> overloaded; 1 task to move (as case 1).
    // Task 3 is hot (MC, failed 0) -> refused; task 2 is SCHED_IDLE:
    // task_hot() is false for it -> moves, not as a forced hot migration.
    assert_eq!(
        out,
        [prop(
            2,
            0,
            1,
            MigrationType::Task,
            Level::Mc,
            GroupType::Overloaded,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!(rejections(&stats), [("hot", 1)]);
}

#[test]
fn per_cpu_kthread_is_skipped_and_the_next_task_moves() {
    let (topo, mut table) = overloaded_pair();
    // CPU 0: [1 running, 2, 3 = per-CPU kthread (tail)].
    let mut list: Vec<RqTask> = table.cpus[0].to_vec();
    list[2].per_cpu_kthread = true;
    list[2].group = 0;
    set(&mut table, 0, list);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, stats) = run(&mut b, &topo, &st, &table, &opts(&[1]));
    // 1 task to move; task 3 refused (per-CPU kthread); task 2 moves.
    assert_eq!(
        out,
        [prop(
            2,
            0,
            1,
            MigrationType::Task,
            Level::Mc,
            GroupType::Overloaded,
            GroupType::HasSpare,
            1
        )]
    );
    assert_eq!(rejections(&stats), [("per_cpu_kthread", 1)]);
}

// ---------------------------------------------------------------------------
// 9. max_proposals and honor_intervals
// ---------------------------------------------------------------------------

#[test]
fn max_proposals_stops_before_the_next_destination_cpu() {
    let (topo, table) = idle_llc_next_to_busy_llc();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let mut o = opts(&[0, 1]);
    o.max_proposals = 1;
    let (out, stats) = run(&mut b, &topo, &st, &table, &o);
    // CPU 0's PKG pass proposes task 21 (see case 5); then the limit is
    // reached and CPU 1 is not balanced at all.
    assert_eq!(
        out,
        [prop(
            21,
            2,
            0,
            MigrationType::Util,
            Level::Pkg,
            GroupType::Overloaded,
            GroupType::HasSpare,
            2048
        )]
    );
    assert_eq!(stats.domains_balanced, 2);
    assert_eq!(b.lb.dom[1][0].last_balance, None);
}

#[test]
fn max_proposals_also_stops_the_dst_pinned_retry() {
    let (topo, table) = pinned_to_sibling(false);
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let mut o = opts(&[2]);
    o.max_proposals = 1;
    let (out, _) = run(&mut b, &topo, &st, &table, &o);
    // Case 2 proposes task 2 (to CPU 2), then retries toward CPU 3 for task
    // 3. With a limit of one proposal ("stop after this many proposals"),
    // only the first may be returned.
    // (The LBF_DST_PINNED retry toward CPU 3 is not taken once the limit
    // is reached.)
    assert_eq!(
        out,
        [prop(
            2,
            0,
            2,
            MigrationType::Task,
            Level::Mc,
            GroupType::Overloaded,
            GroupType::HasSpare,
            2
        )]
    );
}

#[test]
fn honor_intervals_skips_an_idle_cpus_domain_until_its_interval_expires() {
    let (topo, table) = overloaded_pair();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let at = |now_ms| BalanceOpts {
        now_ms,
        honor_intervals: true,
        ..opts(&[1])
    };
    // t = 0: never balanced -> due; case 1 moves task 3; interval = 2,
    // last_balance = 0.
    let (out, stats) = run(&mut b, &topo, &st, &table, &at(0));
    assert_eq!(out.len(), 1);
    assert_eq!((stats.domains_balanced, stats.domains_not_due), (1, 0));
    assert_eq!(b.lb.dom[1][0].last_balance, Some(0));
    // CPU 1 is idle (the stored state is unchanged): interval = 2 ms, not
    // scaled. t = 1 < 0 + 2: not due.
    let (out, stats) = run(&mut b, &topo, &st, &table, &at(1));
    assert!(out.is_empty());
    assert_eq!((stats.domains_balanced, stats.domains_not_due), (0, 1));
    assert_eq!(b.lb.dom[1][0].last_balance, Some(0));
    // t = 2: due again.
    let (out, stats) = run(&mut b, &topo, &st, &table, &at(2));
    assert_eq!(out.len(), 1);
    assert_eq!((stats.domains_balanced, stats.domains_not_due), (1, 0));
    assert_eq!(b.lb.dom[1][0].last_balance, Some(2));
}

#[test]
fn busy_cpu_interval_is_scaled_by_busy_factor_minus_one() {
    let (topo, table) = overloaded_pair();
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let at = |now_ms| BalanceOpts {
        now_ms,
        honor_intervals: true,
        ..opts(&[0])
    };
    // t = 0: CPU 0 balances, finds nothing, interval 2 -> 4.
    let (_, stats) = run(&mut b, &topo, &st, &table, &at(0));
    assert_eq!(stats.domains_balanced, 1);
    assert_eq!(dom(&b, 0, 0), (0, 4));
    // Busy: 4 * busy_factor 16 = 64 ms, minus 1 = 63, clamped to
    // [1, HZ * 2 CPUs / 10 = 200]: due at t >= 63.
    let (_, stats) = run(&mut b, &topo, &st, &table, &at(62));
    assert_eq!((stats.domains_balanced, stats.domains_not_due), (0, 1));
    let (_, stats) = run(&mut b, &topo, &st, &table, &at(63));
    assert_eq!((stats.domains_balanced, stats.domains_not_due), (1, 0));
}

// ---------------------------------------------------------------------------
// sg->cores at the SMT level: each group is one CPU, hence one core
// ---------------------------------------------------------------------------
//
// init_sched_groups_capacity() counts a group's cores over the group's own
// span: walk its CPUs, count one, remove that CPU's SMT siblings. At the SMT
// level every group is a single CPU, so every group has cores == 1 whichever
// sibling it holds; sibling_imbalance() then takes the difference of the task
// counts and calculate_imbalance() halves it.

/// `n` CPUs, one LLC, CPU `i` on core `core_of(i)`.
fn one_llc(n: usize, core_of: impl Fn(usize) -> u32) -> Topology {
    let cpus: Vec<(u32, u32)> = (0..n).map(|i| (core_of(i), 0)).collect();
    build_all(&spec(&cpus))
}

/// Four nice-0 tasks (load 1024, util 256, runnable 1024) on `busy`, task 1
/// at the head and running, task 4 the coldest.
fn four_on(topo: &Topology, busy: usize) -> TaskTable {
    let mut table = TaskTable::empty(topo.nr_cpus);
    set(
        &mut table,
        busy,
        vec![
            running(task(1, 1024, 256, 1024)),
            task(2, 1024, 256, 1024),
            task(3, 1024, 256, 1024),
            task(4, 1024, 256, 1024),
        ],
    );
    table
}

/// One pass from `dst` alone with four tasks on `busy`, a sibling of it.
/// Derivation, the same for every SMT width and numbering below:
/// - SMT level, dst idle: should_we_balance holds (the local group {dst} is
///   its own balance CPU and idle).
/// - local {dst}: nr 0 < weight 1 -> has_spare, cores 1.
/// - {busy}: nr 4 > weight 1 and runnable 4096*100 > 1024*110 -> overloaded,
///   cores 1. Other siblings are idle (has_spare): busy is the busiest.
/// - SMT has no child: prefer_sibling false; the busiest is overloaded so no
///   early exit -> calculate_imbalance.
/// - local has_spare, SMT shares the LLC (no util case), busiest.group_weight
///   == 1 -> sibling_imbalance: equal cores (1 == 1): 4 - 0 = 4; >> 1 = 2.
/// - find_src_rq: busy; detach_tasks from the tail: tasks 4 and 3 (cold),
///   imbalance 2 -> 0.
/// - The level above sees the core (or the node) with all the work in the
///   local group and no busier group: nothing more.
fn two_move_to_the_idle_sibling(topo: &Topology, busy: usize, dst: usize) {
    assert_eq!(topo.domains(dst)[0].level, Level::Smt);
    let table = four_on(topo, busy);
    let st = node(topo, &table);
    let mut b = Balancer::new(topo);
    let (out, _) = run(&mut b, topo, &st, &table, &opts(&[dst]));
    let expect: Vec<Proposal> = [4, 3]
        .iter()
        .map(|&t| {
            prop(
                t,
                busy,
                dst,
                MigrationType::Task,
                Level::Smt,
                GroupType::Overloaded,
                GroupType::HasSpare,
                2,
            )
        })
        .collect();
    assert_eq!(out, expect, "busy {busy} -> dst {dst}");
}

#[test]
fn smt2_idle_first_sibling_pulls_half_of_four_tasks() {
    // 8 CPUs, SMT2 packed: cores {0,1} {2,3} {4,5} {6,7}.
    let topo = one_llc(8, |i| (i / 2) as u32);
    two_move_to_the_idle_sibling(&topo, 1, 0);
}

#[test]
fn smt2_idle_second_sibling_pulls_half_of_four_tasks() {
    let topo = one_llc(8, |i| (i / 2) as u32);
    two_move_to_the_idle_sibling(&topo, 0, 1);
}

#[test]
fn smt4_first_and_other_siblings_pull_half_of_four_tasks() {
    // 8 CPUs, SMT4: cores {0-3} {4-7}.
    let topo = one_llc(8, |i| (i / 4) as u32);
    two_move_to_the_idle_sibling(&topo, 1, 0);
    two_move_to_the_idle_sibling(&topo, 0, 2);
    two_move_to_the_idle_sibling(&topo, 6, 5);
}

#[test]
fn smt8_first_and_other_siblings_pull_half_of_four_tasks() {
    // 8 CPUs, one SMT8 core: only the SMT domain survives.
    let topo = one_llc(8, |_| 0);
    two_move_to_the_idle_sibling(&topo, 5, 0);
    two_move_to_the_idle_sibling(&topo, 0, 2);
    two_move_to_the_idle_sibling(&topo, 7, 3);
}

#[test]
fn interleaved_smt2_cores_count_one_core_per_sibling_group() {
    // x86 numbering: core c = {c, c+4}. Core 0's second thread is CPU 4;
    // core 1's lowest id is CPU 1 and its other thread CPU 5.
    let topo = one_llc(8, |i| (i % 4) as u32);
    two_move_to_the_idle_sibling(&topo, 4, 0);
    two_move_to_the_idle_sibling(&topo, 1, 5);
}

#[test]
fn remote_numa_group_built_from_a_degenerated_node_level_is_not_an_smt_group() {
    // 2 NUMA nodes, each one SMT2 core with its own LLC: CPUs {0,1} and
    // {2,3}. Per CPU only SMT {core} and NUMA {0-3} survive (MC, PKG and
    // NODE span the core). CPU 0 runs two nice-0 tasks (load 1024, util
    // 500, runnable 1024); Balance from CPU 2 alone.
    let s = TopologySpec {
        cpus: (0..4u32)
            .map(|i| CpuTopo {
                core: i / 2,
                cluster: None,
                llc: i / 2,
                node: i / 2,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    };
    let topo = build_all(&s);
    assert_eq!(levels(&topo, 2), [Level::Smt, Level::Numa(1)]);
    let mut table = TaskTable::empty(4);
    set(
        &mut table,
        0,
        vec![running(task(1, 1024, 500, 1024)), task(2, 1024, 500, 1024)],
    );
    let st = node(&topo, &table);
    let mut b = Balancer::new(&topo);
    let (out, _) = run(&mut b, &topo, &st, &table, &opts(&[2]));
    // SMT {2,3}: both idle, nothing to pull.
    // NUMA1: the remote group {0,1} was built from CPU 0's NODE domain,
    //   whose flags (SD_PREFER_SIBLING, no SD_SHARE_CPUCAPACITY) it keeps:
    //   cpu_attach_domain() rewrites only CPU 2's own group when NODE
    //   degenerates. So {0,1} is not an SMT group. nr 2 <= weight 2: not
    //   overloaded; group_has_capacity: runnable 2048*100 <= 2048*117 and
    //   2048*100 > util 1000*117 -> has_spare, idle_cpus 1 (CPU 1). It is
    //   the busiest (the only group with tasks), but not smt_balance.
    // sched_balance_find_src_group: local {2,3} has_spare (idle_cpus 2); no
    //   prefer_sibling at NUMA; busiest not overloaded, dst idle, no SMT
    //   pull; weight 2 > 1 and local idle 2 <= busiest idle 1 + 1 ->
    //   balanced.
    // Nothing moves (the engine once called {0,1} an SMT group and moved
    // task 2 as smt_balance).
    assert_eq!(out, []);
}
