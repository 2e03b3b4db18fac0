//! Cache-aware scheduling (kernel-algorithms section 6.4), worked out by
//! hand: epochs and decay, the 2x switch rule, ties, the visited-CPUs scan
//! and its eviction, the limits, and `can_migrate_llc`.
//!
//! Notation in the comments: `f(r, R) = floor(2^20 * r / (R + 1))` is
//! `fraction_mm_sched` for a process with `r` ns on a CPU whose total is
//! `R` ns (both after decay). With the clocks started at `b`, a CPU's epoch
//! at time `t` is `ceil((t - b) / 10)` (0 at `t = b`), whatever the path:
//! an advance at `t > next` moves by `n = ceil((t - next) / 10)` epochs and
//! lands `next` on the first epoch boundary `>= t`.

use std::collections::HashMap;

use fairplace::engine::cache::{
    CacheParams, CacheState, GroupPref, LlcMap, LlcMig, LlcView, ScanReport, ScanStrategy,
};
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::features::Features;
use fairplace::engine::state::{CpuState, NodeState};
use fairplace::engine::topology::{CpuTopo, Topology, TopologySpec};

/// 1 ms in ns.
const MS: u64 = 1_000_000;

/// One node, `llcs` LLCs of `cores` cores of `smt` threads, packed numbering
/// (LLC, then core, then thread), capacity 1024.
fn machine(llcs: u32, cores: u32, smt: u32) -> (Topology, LlcMap) {
    let mut cpus = vec![];
    for llc in 0..llcs {
        for c in 0..cores {
            for _ in 0..smt {
                cpus.push(CpuTopo {
                    core: llc * cores + c,
                    cluster: None,
                    llc,
                    node: 0,
                    capacity: 1024,
                });
            }
        }
    }
    build(TopologySpec {
        cpus,
        numa_distance: None,
    })
}

fn build(spec: TopologySpec) -> (Topology, LlcMap) {
    let n = spec.cpus.len();
    let topo = Topology::build(&spec, &CpuMask::first_n(n), 30).unwrap();
    let llc = LlcMap::new(&topo);
    (topo, llc)
}

fn state(topo: &Topology, start_ms: u64) -> CacheState {
    CacheState::new(topo.nr_cpus, CacheParams::default(), start_ms)
}

/// `task_cache_work` without the NUMA-node limit.
#[allow(clippy::too_many_arguments)]
fn scan(
    st: &mut CacheState,
    topo: &Topology,
    llc: &LlcMap,
    group: u64,
    curr: usize,
    strategy: ScanStrategy,
    now: u64,
    running: impl Fn(usize) -> bool,
) -> Option<ScanReport> {
    st.task_cache_work(topo, llc, group, curr, strategy, false, now, running)
}

fn none(_: usize) -> bool {
    false
}

// ---------------------------------------------------------------------------
// 1. Epochs and decay
// ---------------------------------------------------------------------------

#[test]
fn runtime_halves_once_per_epoch_counted_with_ceil_and_occupancy_reads_do_not_decay() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    // t=0: CPU 0 has next = 0; 0 > 0 is false, so no epoch passes.
    // pc(7, 0) = 8 ms, rq(0) = 8 ms, epoch 0.
    assert!(!st.account_mm_sched(&llc, 0, 7, 2, 8 * MS, 0));
    // Read at t=0: f(8e6, 8e6) = floor(2^20 * 8e6 / 8000001) = 1048575.
    assert_eq!(st.occupancy(&llc, 7, 0), [1_048_575, 0]);
    // Read at t=25: n = ceil((25 - 0) / 10) = 3 epochs; both halve 3 times:
    // 8e6 >> 3 = 1e6. f(1e6, 1e6) = floor(2^20 * 1e6 / 1000001) = 1048574.
    assert_eq!(st.occupancy(&llc, 7, 25), [1_048_574, 0]);
    // t=30: n = ceil(30 / 10) = 3 still (the boundary belongs to epoch 3).
    assert_eq!(st.occupancy(&llc, 7, 30), [1_048_574, 0]);
    // t=31: n = ceil(31 / 10) = 4: 8e6 >> 4 = 5e5;
    // f(5e5, 5e5) = floor(2^20 * 5e5 / 500001) = 1048573.
    assert_eq!(st.occupancy(&llc, 7, 31), [1_048_573, 0]);
    // The reads decayed nothing: t=0 again still gives the undecayed share.
    assert_eq!(st.occupancy(&llc, 7, 0), [1_048_575, 0]);
    assert_eq!(st.proc(7).unwrap().epoch, 0);
    // An unknown process has no occupancy anywhere.
    assert_eq!(st.occupancy(&llc, 8, 25), [0, 0]);
}

#[test]
fn a_later_process_on_the_same_cpu_decays_from_its_own_epoch() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    // t=0, epoch 0: pc(7) = 8e6, rq = 8e6.
    st.account_mm_sched(&llc, 0, 7, 2, 8 * MS, 0);
    // t=15: n = ceil((15 - 0) / 10) = 2 -> epoch 2, next 20, rq = 8e6 >> 2
    // = 2e6, then + 4e6 = 6e6. pc(9) is new (runtime 0), then 4e6.
    st.account_mm_sched(&llc, 0, 9, 2, 4 * MS, 15);
    // Read at t=25: n = ceil((25 - 20) / 10) = 1 -> epoch 3, rq = 3e6.
    // pc(7): epoch 0 -> 3, 8e6 >> 3 = 1e6; pc(9): epoch 2 -> 3, 2e6.
    // occ(7) = floor(2^20 * 1e6 / 3000001) = 349525,
    // occ(9) = floor(2^20 * 2e6 / 3000001) = 699050.
    assert_eq!(st.occupancy(&llc, 7, 25), [349_525, 0]);
    assert_eq!(st.occupancy(&llc, 9, 25), [699_050, 0]);
    // Read at t=15 (epoch 2): pc(7) = 8e6 >> 2 = 2e6 of 6e6:
    // floor(2^20 * 2e6 / 6000001) = 349525; pc(9) = 4e6: 699050.
    assert_eq!(st.occupancy(&llc, 7, 15), [349_525, 0]);
    assert_eq!(st.occupancy(&llc, 9, 15), [699_050, 0]);
}

#[test]
fn two_processes_sharing_a_cpu_3_to_1_split_its_occupancy_3_to_1() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    // t=2 on CPU 5 (LLC 1): n = ceil(2 / 10) = 1 -> epoch 1, next 10.
    // pc(7) = 6e6, pc(9) = 2e6, rq = 8e6.
    st.account_mm_sched(&llc, 5, 7, 4, 6 * MS, 2);
    st.account_mm_sched(&llc, 5, 9, 4, 2 * MS, 2);
    // t=12: n = ceil((12 - 10) / 10) = 1: pc(7) = 3e6, pc(9) = 1e6, rq = 4e6.
    // occ(7) = floor(2^20 * 3e6 / 4000001) = 786431,
    // occ(9) = floor(2^20 * 1e6 / 4000001) = 262143.
    assert_eq!(st.occupancy(&llc, 7, 12), [0, 786_431]);
    assert_eq!(st.occupancy(&llc, 9, 12), [0, 262_143]);
}

#[test]
fn scan_is_due_once_per_epoch_and_not_in_the_creation_epoch() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    // Created at epoch 0 with its epoch = 0: 0 >= 0, not due.
    assert!(!st.account_mm_sched(&llc, 0, 7, 2, MS, 0));
    // t=5: CPU 0 -> epoch ceil(5/10) = 1 > 0: due, process epoch = 1.
    assert!(st.account_mm_sched(&llc, 0, 7, 2, MS, 5));
    assert_eq!(st.proc(7).unwrap().epoch, 1);
    // t=9 on CPU 1: epoch ceil(9/10) = 1, already queued this epoch.
    assert!(!st.account_mm_sched(&llc, 1, 7, 2, MS, 9));
    // t=10 on CPU 0: 10 > next 10 is false, still epoch 1.
    assert!(!st.account_mm_sched(&llc, 0, 7, 2, MS, 10));
    // t=11: epoch 2: due again.
    assert!(st.account_mm_sched(&llc, 0, 7, 2, MS, 11));
    assert_eq!(st.proc(7).unwrap().epoch, 2);
}

#[test]
fn preference_expires_after_more_than_5_epochs_without_a_scan() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    // t=1: epoch 1, due (process epoch 0 -> 1); the scan prefers CPU 0.
    assert!(st.account_mm_sched(&llc, 0, 7, 4, 10 * MS, 1));
    let r = scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, 1, none).unwrap();
    assert_eq!(r.preferred_cpu, Some(0));
    // t=51: CPU 0 epoch ceil(51/10) = 6; 6 - 1 = 5, not > 5: kept.
    let mut kept = st.clone();
    kept.account_mm_sched(&llc, 0, 7, 4, MS, 51);
    assert_eq!(kept.pref_llc(&llc, 7), Some(0));
    // t=61: epoch 7; 7 - 1 = 6 > 5: dropped by the accounting.
    st.account_mm_sched(&llc, 0, 7, 4, MS, 61);
    assert_eq!(st.pref_llc(&llc, 7), None);
    assert_eq!(st.proc(7).unwrap().cpu, None);
}

// ---------------------------------------------------------------------------
// 2. The 2x switch rule
// ---------------------------------------------------------------------------

/// 2 LLCs x 4 CPUs (no SMT): process 7 (4 threads) ran 10 ms alone on CPU 0
/// at t=1 and the scan at t=1 made CPU 0 (LLC 0) its preference. Then, at
/// t=11 (epoch 2), `b` lists (cpu, ns of process 7, ns of process 8) in
/// LLC 1, and the scan runs at t=11.
fn switch_case(b: &[(usize, u64, u64)]) -> (CacheState, ScanReport, LlcMap) {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    assert!(st.account_mm_sched(&llc, 0, 7, 4, 10 * MS, 1));
    // Scan at t=1: LLC 0 = f(1e7, 1e7) = 1048575, LLC 1 = 0; current 0:
    // 1048575 > 0, preference CPU 0. 8 CPUs read.
    let r = scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, 1, none).unwrap();
    assert_eq!((r.preferred_cpu, r.changed, r.scanned), (Some(0), true, 8));
    let mut first = true;
    for &(cpu, p7, p8) in b {
        if p7 > 0 {
            // Only the first accounting of epoch 2 is due.
            assert_eq!(st.account_mm_sched(&llc, cpu, 7, 4, p7, 11), first);
            first = false;
        }
        if p8 > 0 {
            st.account_mm_sched(&llc, cpu, 8, 4, p8, 11);
        }
    }
    // t=11: CPU 0 goes to epoch 2, 1e7 >> 1 = 5e6 of 5e6:
    // LLC 0 = f(5e6, 5e6) = floor(2^20 * 5e6 / 5000001) = 1048575;
    // twice that is 2097150.
    let r = scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, 11, none).unwrap();
    (st, r, llc)
}

#[test]
fn preference_stays_when_the_other_llc_has_1_9_times_the_occupancy() {
    // LLC 1: CPU 4 = 9 ms of 10 ms: f(9e6, 1e7) = floor(2^20 * 9e6 /
    // 10000001) = 943718; CPU 5 = 10 ms alone: f(1e7, 1e7) = 1048575.
    // Sum 1992293 = 1.9 x 1048575, not > 2097150: stays on CPU 0.
    let (st, r, llc) = switch_case(&[(4, 9 * MS, MS), (5, 10 * MS, 0)]);
    assert_eq!(st.occupancy(&llc, 7, 11), [1_048_575, 1_992_293]);
    assert_eq!((r.preferred_cpu, r.changed), (Some(0), false));
    assert_eq!(st.pref_llc(&llc, 7), Some(0));
}

#[test]
fn preference_stays_when_the_other_llc_has_exactly_twice_the_occupancy() {
    // LLC 1: CPUs 4 and 5 alone, 1048575 each = 2097150 = 2 x 1048575;
    // the rule is strict (best > 2 * current): stays.
    let (st, r, llc) = switch_case(&[(4, 10 * MS, 0), (5, 10 * MS, 0)]);
    assert_eq!(st.occupancy(&llc, 7, 11), [1_048_575, 2_097_150]);
    assert_eq!((r.preferred_cpu, r.changed), (Some(0), false));
}

#[test]
fn preference_moves_above_twice_the_occupancy_to_the_biggest_share_cpu() {
    // LLC 1: CPU 4 = 943718 (9 of 10 ms), CPU 5 = 1048575 (alone),
    // CPU 6 = 2 of 10 ms: floor(2^20 * 2e6 / 10000001) = 209715.
    // Sum 2202008 = 2.1 x 1048575 > 2097150: switch; the biggest share in
    // LLC 1 is CPU 5's.
    let (st, r, llc) = switch_case(&[(4, 9 * MS, MS), (5, 10 * MS, 0), (6, 2 * MS, 8 * MS)]);
    assert_eq!(st.occupancy(&llc, 7, 11), [1_048_575, 2_202_008]);
    assert_eq!((r.preferred_cpu, r.changed), (Some(5), true));
    assert_eq!(st.pref_llc(&llc, 7), Some(1));
    assert_eq!(st.nr_preferring(), 1);
}

// ---------------------------------------------------------------------------
// 3. Ties
// ---------------------------------------------------------------------------

#[test]
fn equal_llc_occupancy_goes_to_the_llc_reached_first_by_cpu_order() {
    // LLC ids run against CPU order: CPUs 0-3 are LLC id 1 (dense index 1),
    // CPUs 4-7 are LLC id 0 (dense index 0). The scan starts at CPU 0.
    let cpus = (0..8u32)
        .map(|c| CpuTopo {
            core: c,
            cluster: None,
            llc: if c < 4 { 1 } else { 0 },
            node: 0,
            capacity: 1024,
        })
        .collect();
    let (topo, llc) = build(TopologySpec {
        cpus,
        numa_distance: None,
    });
    assert_eq!((llc.llc(0), llc.llc(4)), (1, 0));
    let mut st = state(&topo, 0);
    // t=1: 10 ms alone on CPUs 2, 1 (LLC index 1) and 4, 7 (LLC index 0):
    // every share f(1e7, 1e7) = 1048575, both LLCs 2097150.
    for cpu in [2, 1, 4, 7] {
        st.account_mm_sched(&llc, cpu, 7, 4, 10 * MS, 1);
    }
    assert_eq!(st.occupancy(&llc, 7, 1), [2_097_150, 2_097_150]);
    // No preference: CPU 0's LLC (index 1) is summed first and the later
    // equal sum is not strictly bigger; inside it, CPU 1 comes before CPU 2
    // with an equal share.
    let r = scan(&mut st, &topo, &llc, 7, 4, ScanStrategy::Full, 1, none).unwrap();
    assert_eq!(r.preferred_cpu, Some(1));
    assert_eq!(st.pref_llc(&llc, 7), Some(1));
}

// ---------------------------------------------------------------------------
// 4. The visited-CPUs scan and its eviction
// ---------------------------------------------------------------------------

/// 2 LLCs x 4 CPUs. Process 7 visits CPUs 0 and 1 at t=1 (epoch 1), CPU 3
/// at t=11 (epoch 2), CPU 2 at t=21 (epoch 3), then CPUs 4 and 5 at t=71
/// (epoch 8); at t=71 process 99 runs 10 ms on each of CPUs 0-3 when
/// `others` is set.
fn eviction_history(others: bool) -> (Topology, LlcMap, CacheState) {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    for (t, cpus) in [(1, &[0usize, 1][..]), (11, &[3]), (21, &[2]), (71, &[4, 5])] {
        for &c in cpus {
            st.account_mm_sched(&llc, c, 7, 4, 10 * MS, t);
        }
    }
    if others {
        for c in 0..4 {
            st.account_mm_sched(&llc, c, 99, 4, 10 * MS, 71);
        }
    }
    (topo, llc, st)
}

#[test]
fn visit_scan_evicts_cpus_last_visited_more_than_5_epochs_ago() {
    let (topo, llc, mut full) = eviction_history(true);
    let mut visit = full.clone();
    // At t=71 every CPU is at epoch ceil(71/10) = 8. Shares (Full):
    //   CPU 0, 1: pc = 1e7 >> 7 = 78125, rq = 78125 + 1e7 (p99) = 10078125:
    //             floor(2^20 * 78125 / 10078126) = 8128
    //   CPU 3:    1e7 >> 6 = 156250 of 10156250: 16131
    //   CPU 2:    1e7 >> 5 = 312500 of 10312500: 31775
    //   CPU 4, 5: 1e7 alone: 1048575
    // LLC 0 = 2*8128 + 16131 + 31775 = 64162, LLC 1 = 2097150.
    assert_eq!(full.occupancy(&llc, 7, 71), [64_162, 2_097_150]);
    let f = scan(&mut full, &topo, &llc, 7, 4, ScanStrategy::Full, 71, none).unwrap();
    // Full reads all 8 CPUs (both LLCs touched).
    assert_eq!((f.scanned, f.preferred_cpu), (8, Some(4)));
    // Visit: visited {0,1,2,3,4,5}, age = 8 - last visit:
    //   CPU 0, 1: 7 > 5 evicted; CPU 3: 6 > 5 evicted; CPU 2: 5 kept;
    //   CPU 4, 5: 0 kept. Read: {2} in LLC 0, {4, 5} in LLC 1 = 3.
    // LLC 0 = 31775, LLC 1 = 2097150: the same choice, CPU 4.
    let v = scan(&mut visit, &topo, &llc, 7, 4, ScanStrategy::Visit, 71, none).unwrap();
    assert_eq!((v.scanned, v.preferred_cpu), (3, Some(4)));
    // t=81 (next scan allowed at 71 + 10): epoch 9. CPU 2 is now 9 - 3 = 6
    // epochs old: evicted; CPUs 4, 5 (last visit 8) kept: 2 read. Full: 8.
    let v = scan(&mut visit, &topo, &llc, 7, 4, ScanStrategy::Visit, 81, none).unwrap();
    assert_eq!((v.scanned, v.preferred_cpu, v.changed), (2, Some(4), false));
    let f = scan(&mut full, &topo, &llc, 7, 4, ScanStrategy::Full, 81, none).unwrap();
    assert_eq!((f.scanned, f.preferred_cpu, f.changed), (8, Some(4), false));
    // An evicted CPU is scanned again once the process runs there again:
    // t=91 (epoch 10) on CPU 0, then the scan: {0, 4, 5} = 3.
    visit.account_mm_sched(&llc, 0, 7, 4, MS, 91);
    let v = scan(&mut visit, &topo, &llc, 7, 4, ScanStrategy::Visit, 91, none).unwrap();
    assert_eq!(v.scanned, 3);
}

#[test]
fn full_scan_still_counts_idle_cpus_that_the_visit_scan_evicted() {
    // Without process 99 nothing else ran on CPUs 0-3, so process 7 keeps a
    // share near 1 there however old its runtime is (6.4.9's "decayed
    // shares, about 0 after the timeout" needs other work on the CPU):
    //   CPU 0, 1: 78125 of 78125: floor(2^20 * 78125 / 78126) = 1048562
    //   CPU 3: 156250 of 156250: floor(2^20 * 156250 / 156251) = 1048569
    //   CPU 2: 312500 of 312500: floor(2^20 * 312500 / 312501) = 1048572
    // LLC 0 = 4194265 > LLC 1 = 2097150: Full prefers CPU 2 (biggest share
    // in LLC 0), Visit (CPU 2 only in LLC 0) prefers CPU 4.
    let (topo, llc, mut full) = eviction_history(false);
    let mut visit = full.clone();
    assert_eq!(full.occupancy(&llc, 7, 71), [4_194_265, 2_097_150]);
    let f = scan(&mut full, &topo, &llc, 7, 4, ScanStrategy::Full, 71, none).unwrap();
    let v = scan(&mut visit, &topo, &llc, 7, 4, ScanStrategy::Visit, 71, none).unwrap();
    assert_eq!((f.scanned, f.preferred_cpu), (8, Some(2)));
    assert_eq!((v.scanned, v.preferred_cpu), (3, Some(4)));
}

// ---------------------------------------------------------------------------
// 5. and 6. Limits
// ---------------------------------------------------------------------------

#[test]
fn single_threaded_process_never_gets_a_preference() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    // The tick still queues the scan (task_tick_cache does not look at the
    // thread count) ...
    assert!(st.account_mm_sched(&llc, 0, 7, 1, 10 * MS, 1));
    // ... but task_cache_work stops at invalid_llc_nr (nr_threads <= 1)
    // after taking the period: next_scan = 1 + 10.
    assert_eq!(
        scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, 1, |_| true),
        None
    );
    assert_eq!(st.pref_llc(&llc, 7), None);
    let p = st.proc(7).unwrap();
    assert_eq!((p.cpu, p.next_scan, p.nr_running_avg), (None, 11, 0));
    assert_eq!(st.stats.passes, 0);
    // Same with the visited-CPUs scan a period later.
    assert!(st.account_mm_sched(&llc, 0, 7, 1, 10 * MS, 11));
    assert_eq!(
        scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Visit, 11, |_| {
            true
        }),
        None
    );
    assert_eq!(st.nr_preferring(), 0);
}

#[test]
fn process_turning_single_threaded_loses_its_preference_at_the_next_accounting() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    st.account_mm_sched(&llc, 0, 7, 2, 10 * MS, 1);
    scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, 1, none).unwrap();
    assert_eq!(st.pref_llc(&llc, 7), Some(0));
    // Same epoch, now one thread: invalid_llc_nr -> preference dropped.
    st.account_mm_sched(&llc, 0, 7, 1, MS, 2);
    assert_eq!(st.pref_llc(&llc, 7), None);
}

#[test]
fn process_with_more_running_threads_than_its_llc_fits_loses_its_preference() {
    // 2 LLCs x 8 cores x SMT2 = 32 CPUs; LLC 0 = CPUs 0-15, llc_size 16,
    // smt 2. invalid_llc_nr: avg * 2 * 1280 >= 1 * 16 * 1024 = 16384, i.e.
    // avg * 2560 >= 16384: avg 6 -> 15360 (fits), avg 7 -> 17920 (invalid).
    // EWMA divisor: clamp(16 >> 2, 2, 8) = 4.
    let (topo, llc) = machine(2, 8, 2);
    assert_eq!(llc.smt_threads, 2);
    let mut st = state(&topo, 0);
    let running = |i: usize| i < 12; // 12 threads running, on CPUs 0-11
    // EWMA (truncating): 0 + 12/4 = 3; 3 + 9/4 = 5; 5 + 7/4 = 6; 6 + 6/4 = 7.
    let expect = [3, 5, 6, 7];
    for (k, avg) in expect.into_iter().enumerate() {
        let t = 1 + 10 * k as u64; // epochs 1, 2, 3, 4
        for c in 0..12 {
            st.account_mm_sched(&llc, c, 7, 32, 10 * MS, t);
        }
        // Each pass starts valid (avg 0, 3, 5, 6 all fit): LLC 0 holds all
        // the occupancy, equal shares, so CPU 0 is preferred.
        let r = scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, t, running).unwrap();
        assert_eq!(r.preferred_cpu, Some(0), "pass {k}");
        assert_eq!(st.proc(7).unwrap().nr_running_avg, avg, "pass {k}");
    }
    // avg 7 is only tested at the next accounting (t=41): preference gone.
    st.account_mm_sched(&llc, 0, 7, 32, 10 * MS, 41);
    assert_eq!(st.pref_llc(&llc, 7), None);
    // The pass stops at invalid_llc_nr before update_avg_scale, so the
    // average never moves again, even with nothing running (as in the
    // kernel: task_cache_work returns before updating nr_running_avg).
    assert_eq!(
        scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, 41, none),
        None
    );
    for t in [51, 61] {
        st.account_mm_sched(&llc, 0, 7, 32, 10 * MS, t);
        assert_eq!(
            scan(&mut st, &topo, &llc, 7, 0, ScanStrategy::Full, t, none),
            None
        );
    }
    let p = st.proc(7).unwrap();
    assert_eq!((p.cpu, p.nr_running_avg), (None, 7));
}

// ---------------------------------------------------------------------------
// 7. The two scan strategies agree
// ---------------------------------------------------------------------------

#[test]
fn full_and_visit_agree_on_a_process_confined_to_one_llc_of_512_cpus() {
    // 8 LLCs x 32 cores x SMT2 = 512 CPUs, 64 per LLC. Process 7 (16
    // threads) runs on CPUs 320-335 (LLC 5): 5 of 10 ms on each (process 8
    // the rest), except 10 ms alone on CPU 329.
    let (topo, llc) = machine(8, 32, 2);
    assert_eq!((topo.nr_cpus, llc.nr_llc(), llc.smt_threads), (512, 8, 2));
    let mut full = state(&topo, 0);
    for c in 320..336 {
        if c == 329 {
            full.account_mm_sched(&llc, c, 7, 16, 10 * MS, 1);
        } else {
            full.account_mm_sched(&llc, c, 7, 16, 5 * MS, 1);
            full.account_mm_sched(&llc, c, 8, 2, 5 * MS, 1);
        }
    }
    let mut visit = full.clone();
    // Shares: f(5e6, 1e7) = floor(2^20 * 5e6 / 10000001) = 524287 on 15
    // CPUs, 1048575 on CPU 329: LLC 5 = 15 * 524287 + 1048575 = 8912880.
    let mut occ = vec![0; 8];
    occ[5] = 8_912_880;
    assert_eq!(full.occupancy(&llc, 7, 1), occ);
    let running = |i: usize| (320..336).contains(&i);
    let f = scan(
        &mut full,
        &topo,
        &llc,
        7,
        320,
        ScanStrategy::Full,
        1,
        running,
    )
    .unwrap();
    let v = scan(
        &mut visit,
        &topo,
        &llc,
        7,
        320,
        ScanStrategy::Visit,
        1,
        running,
    )
    .unwrap();
    // Same choice: CPU 329 in LLC 5.
    assert_eq!((f.preferred_cpu, v.preferred_cpu), (Some(329), Some(329)));
    assert_eq!(full.pref_llc(&llc, 7), Some(5));
    assert_eq!(visit.pref_llc(&llc, 7), Some(5));
    // Full reads all 512 CPUs, Visit the 16 visited: 32 times fewer.
    assert_eq!((f.scanned, v.scanned), (512, 16));
    assert!(f.scanned >= 8 * v.scanned);
    // Both counted 16 running threads: avg = 0 + 16 / clamp(64 >> 2, 2, 8)
    // = 16 / 8 = 2.
    assert_eq!(full.proc(7).unwrap().nr_running_avg, 2);
    assert_eq!(visit.proc(7).unwrap().nr_running_avg, 2);
    assert_eq!((full.stats.scanned, visit.stats.scanned), (512, 16));
}

/// A 64-bit LCG (Knuth's MMIX constants).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        self.0 >> 33
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn full_and_visit_agree_on_random_histories_without_eviction() {
    // 4 LLCs x 4 cores x SMT2 = 32 CPUs (llc_size 8). All activity lies
    // within 40 ms of the last scan, so no visited CPU is ever more than 4
    // epochs old: nothing is evicted, and the CPUs Visit skips have no
    // runtime of the process (share 0), so every LLC sum, every choice and
    // the running count are the same. At most 3 running threads keep the
    // average below the limit (avg 4 * 2 * 1280 >= 8 * 1024).
    let (topo, llc) = machine(4, 4, 2);
    let mut rng = Lcg(0x5eed);
    let mut with_pref = 0;
    for h in 0..200 {
        let base = rng.below(1000);
        let end = base + 40 + rng.below(40);
        let from = end - 40;
        let home = rng.below(4) as usize * 8;
        let mut events: Vec<(u64, u64, usize, u64)> = (0..5 + rng.below(40))
            .map(|_| {
                let group = if rng.below(3) != 0 {
                    7
                } else {
                    8 + rng.below(2)
                };
                let cpu = if rng.below(2) == 0 {
                    home + rng.below(8) as usize
                } else {
                    rng.below(32) as usize
                };
                let ns = 1 + rng.below(10 * MS);
                let t = from + rng.below(end - from + 1);
                (t, group, cpu, ns)
            })
            .collect();
        events.sort_by_key(|e| e.0);
        let mut full = state(&topo, base);
        let mut visit = full.clone();
        let mut visited = CpuMask::new();
        let mut check =
            |full: &mut CacheState, visit: &mut CacheState, cpu, t, visited: &CpuMask| {
                let mut run = CpuMask::new();
                for c in visited.iter() {
                    if run.weight() < 3 && rng.below(4) == 0 {
                        run.set(c);
                    }
                }
                let running = |i: usize| run.test(i);
                let f = scan(full, &topo, &llc, 7, cpu, ScanStrategy::Full, t, running);
                let v = scan(visit, &topo, &llc, 7, cpu, ScanStrategy::Visit, t, running);
                assert_eq!(f.is_some(), v.is_some(), "history {h} t={t}");
                if let (Some(f), Some(v)) = (f, v) {
                    assert_eq!(f.preferred_cpu, v.preferred_cpu, "history {h} t={t}");
                    assert_eq!(f.changed, v.changed, "history {h} t={t}");
                    assert_eq!(f.scanned, 32, "history {h} t={t}");
                    assert_eq!(v.scanned as usize, visited.weight(), "history {h} t={t}");
                }
            };
        for &(t, group, cpu, ns) in &events {
            let df = full.account_mm_sched(&llc, cpu, group, 8, ns, t);
            let dv = visit.account_mm_sched(&llc, cpu, group, 8, ns, t);
            if group != 7 {
                continue;
            }
            visited.set(cpu);
            assert_eq!(df, dv, "history {h} t={t}");
            if df {
                check(&mut full, &mut visit, cpu, t, &visited);
            }
        }
        if visited.is_empty() {
            continue;
        }
        let last = visited.first().unwrap();
        check(&mut full, &mut visit, last, end, &visited);
        assert_eq!(
            full.pref_llc(&llc, 7),
            visit.pref_llc(&llc, 7),
            "history {h}"
        );
        let (pf, pv) = (full.proc(7).unwrap(), visit.proc(7).unwrap());
        assert_eq!((pf.cpu, pf.nr_running_avg), (pv.cpu, pv.nr_running_avg));
        assert_eq!(full.occupancy(&llc, 7, end), visit.occupancy(&llc, 7, end));
        with_pref += pf.cpu.is_some() as u32;
    }
    // The comparison is not vacuous: most histories end with a preference.
    assert!(with_pref >= 150, "{with_pref} of 200 with a preference");
}

// ---------------------------------------------------------------------------
// 8. can_migrate_llc
// ---------------------------------------------------------------------------

/// A node whose LLC `l` has total utilisation `utils[l]`, spread over its
/// CPUs (at most 1024 each); every CPU has capacity 1024.
fn node(topo: &Topology, llc: &LlcMap, utils: &[u64]) -> NodeState {
    let mut cpus = vec![CpuState::idle(1024); topo.nr_cpus];
    for (l, &u) in utils.iter().enumerate() {
        let mut left = u;
        for c in llc.spans[l].iter() {
            let take = left.min(1024);
            cpus[c].util_avg = take as u32;
            left -= take;
        }
        assert_eq!(left, 0);
    }
    NodeState::new(topo, cpus, &[], &Features::default())
}

/// Process 7 (4 threads) prefers CPU 0's LLC.
fn preferring_llc0(topo: &Topology, llc: &LlcMap) -> CacheState {
    let mut st = state(topo, 0);
    st.account_mm_sched(llc, 0, 7, 4, 10 * MS, 1);
    let r = scan(&mut st, topo, llc, 7, 0, ScanStrategy::Full, 1, none).unwrap();
    assert_eq!(r.preferred_cpu, Some(0));
    st
}

#[test]
fn can_migrate_llc_thresholds_with_smt_are_50_percent_and_20_percent_imbalance() {
    // 3 LLCs x 2 cores x SMT2: LLC capacity 4 * 1024 = 4096.
    // fits(u) = u * 100 < 4096 * 50 = 204800 -> u <= 2047.
    // greater(a, b) = a * 100 > b * 120.
    let (topo, llc) = machine(3, 2, 2);
    let st = preferring_llc0(&topo, &llc);
    let params = st.params;
    let view = st.view(&llc, &params);
    assert_eq!(view.pref_of(7), Some(0));
    // src = CPU 4 (LLC 1), dst = CPU 0 (LLC 0).
    let m = |u0: u64, u1: u64, tu: u64, to_pref: bool| {
        let ns = node(&topo, &llc, &[u0, u1, 0]);
        if to_pref {
            view.can_migrate_llc(&topo, &ns, 4, 0, tu, true)
        } else {
            view.can_migrate_llc(&topo, &ns, 0, 4, tu, false)
        }
    };
    use LlcMig::*;
    // Towards the preferred LLC (dst = LLC 0 with u0, src = LLC 1 with u1):
    // dst 2047 fits: allowed.
    assert_eq!(m(2047, 100, 0, true), Llc);
    // dst 2048 does not fit and 204800 > 100 * 120: forbidden.
    assert_eq!(m(2048, 100, 0, true), Forbid);
    // src 1706: 204800 > 204720: much busier, forbidden; src 1707:
    // 204800 > 204840 fails: allowed.
    assert_eq!(m(2048, 1706, 0, true), Forbid);
    assert_eq!(m(2048, 1707, 0, true), Llc);
    // task_util moves 100 from src to dst: dst 1947 + 100 = 2047 fits;
    // dst 1948 + 100 = 2048 with src 1806 - 100 = 1706 is forbidden, with
    // src 1807 - 100 = 1707 allowed.
    assert_eq!(m(1947, 1806, 100, true), Llc);
    assert_eq!(m(1948, 1806, 100, true), Forbid);
    assert_eq!(m(1948, 1807, 100, true), Llc);
    // Leaving the preferred LLC (src = LLC 0 with u0, dst = LLC 1 with u1):
    // src 2047 still fits: forbidden, even towards an idle LLC.
    assert_eq!(m(2047, 0, 0, false), Forbid);
    // src 2048 busy, dst 1706: 204800 > 204720, allowed; dst 1707: forbidden.
    assert_eq!(m(2048, 1706, 0, false), Llc);
    assert_eq!(m(2048, 1707, 0, false), Forbid);
    // With task_util 100: src 2148 - 100 = 2048, dst 1606 + 100 = 1706.
    assert_eq!(m(2148, 1606, 100, false), Llc);
    // src 2147 - 100 = 2047 fits again: forbidden.
    assert_eq!(m(2147, 1606, 100, false), Forbid);
    // Both busy (neither fits): unrestricted either way.
    assert_eq!(m(2048, 2048, 0, true), Unrestricted);
    assert_eq!(m(2048, 2048, 0, false), Unrestricted);
    // task_util makes both busy: src 2148 - 100 = 2048, dst 1948 + 100.
    assert_eq!(m(2148, 1948, 100, false), Unrestricted);
    // src utilisation saturates at 0: src 50 - 100 -> 0, dst 2047 + 100 =
    // 2147 does not fit and 214700 > 0: forbidden towards dst.
    assert_eq!(m(2047, 50, 100, true), Forbid);
}

#[test]
fn can_migrate_llc_without_smt_uses_75_percent() {
    // 2 LLCs x 4 cores, no SMT: pct = 50 * 3 / 2 = 75.
    // fits(u) = u * 100 < 4096 * 75 = 307200 -> u <= 3071.
    let (topo, llc) = machine(2, 4, 1);
    assert_eq!(llc.smt_threads, 1);
    let st = preferring_llc0(&topo, &llc);
    let params = st.params;
    let view = st.view(&llc, &params);
    let m = |u0: u64, u1: u64, to_pref: bool| {
        let ns = node(&topo, &llc, &[u0, u1]);
        if to_pref {
            view.can_migrate_llc(&topo, &ns, 4, 0, 0, true)
        } else {
            view.can_migrate_llc(&topo, &ns, 0, 4, 0, false)
        }
    };
    use LlcMig::*;
    // Towards LLC 0: 3071 fits; 3072 does not, and with src 2559:
    // 307200 > 307080 forbidden; src 2560: 307200 > 307200 fails, allowed.
    assert_eq!(m(3071, 0, true), Llc);
    assert_eq!(m(3072, 2559, true), Forbid);
    assert_eq!(m(3072, 2560, true), Llc);
    // 2048 (the SMT threshold) fits here.
    assert_eq!(m(2048, 0, false), Forbid);
    // Leaving LLC 0: src 3071 fits, forbidden; src 3072 with dst 2559
    // allowed, with dst 2560 forbidden.
    assert_eq!(m(3071, 0, false), Forbid);
    assert_eq!(m(3072, 2559, false), Llc);
    assert_eq!(m(3072, 2560, false), Forbid);
    assert_eq!(m(3072, 3072, false), Unrestricted);
    assert_eq!(m(3072, 3072, true), Unrestricted);
}

#[test]
fn can_migrate_llc_task_takes_the_direction_from_the_preference() {
    let (topo, llc) = machine(3, 2, 2);
    let st = preferring_llc0(&topo, &llc);
    let params = st.params;
    let view = st.view(&llc, &params);
    use LlcMig::*;
    // LLC 0 at 2048 (busy), LLC 1 at 1706, LLC 2 at 100.
    let ns = node(&topo, &llc, &[2048, 1706, 100]);
    // Into LLC 0 (to_pref): dst 2048 busy and 204800 > 1706 * 120: forbid.
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 4, 0, 7, 0, false),
        Forbid
    );
    // Out of LLC 0 to LLC 1 (to_pref false): src busy, 204800 > 204720: llc.
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 0, 4, 7, 0, false),
        Llc
    );
    // Same LLC, neither LLC preferred, no preference, kernel thread:
    // unrestricted.
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 0, 1, 7, 0, false),
        Unrestricted
    );
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 4, 8, 7, 0, false),
        Unrestricted
    );
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 4, 0, 8, 0, false),
        Unrestricted
    );
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 4, 0, 0, 0, false),
        Unrestricted
    );
    // LLC 0 at 2047 fits: into it allowed, out of it forbidden.
    let ns = node(&topo, &llc, &[2047, 1706, 100]);
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 4, 0, 7, 0, false),
        Llc
    );
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 0, 8, 7, 0, false),
        Forbid
    );
    assert!(view.cleared.borrow().is_empty());
}

#[test]
fn can_migrate_llc_task_drops_a_preference_too_big_for_the_destination_llc() {
    // LLC size 4, SMT2: invalid_llc_nr iff avg * 2 * 1280 >= 4 * 1024 =
    // 4096: avg 1 -> 2560 fits, avg 2 -> 5120 does not.
    let (topo, llc) = machine(3, 2, 2);
    let params = CacheParams::default();
    let view = |avg: u64| LlcView {
        llc: &llc,
        params: &params,
        prefs: HashMap::from([(
            7,
            GroupPref {
                llc: 0,
                nr_running_avg: avg,
                nr_threads: 4,
            },
        )]),
        cleared: Default::default(),
        util_est: true,
        recorded: Default::default(),
    };
    let ns = node(&topo, &llc, &[2048, 100, 0]);
    let ok = view(1);
    assert_eq!(
        ok.can_migrate_llc_task(&topo, &ns, 4, 0, 7, 0, false),
        LlcMig::Forbid
    );
    assert!(ok.cleared.borrow().is_empty());
    let big = view(2);
    assert_eq!(
        big.can_migrate_llc_task(&topo, &ns, 4, 0, 7, 0, false),
        LlcMig::Unrestricted
    );
    assert_eq!(*big.cleared.borrow(), [7]);
    assert_eq!(big.pref_of(7), None);
}

// ---------------------------------------------------------------------------
// 9. Kernel threads
// ---------------------------------------------------------------------------

#[test]
fn kernel_threads_are_never_accounted() {
    let (topo, llc) = machine(2, 4, 1);
    let mut st = state(&topo, 0);
    for t in [0, 1, 11, 21] {
        assert!(!st.account_mm_sched(&llc, 0, 0, 4, 10 * MS, t));
    }
    assert!(st.proc(0).is_none());
    assert_eq!(st.procs().count(), 0);
    // Their runtime does not count in the CPU's total either: process 7's
    // 10 ms at t=21 is f(1e7, 1e7) = 1048575, not f(1e7, 2e7) = 524287.
    st.account_mm_sched(&llc, 0, 7, 4, 10 * MS, 21);
    assert_eq!(st.occupancy(&llc, 7, 21), [1_048_575, 0]);
    assert_eq!(st.procs().count(), 1);
}

#[test]
fn a_machine_with_a_single_llc_accounts_nothing() {
    // sched_cache_present is false with one LLC.
    let (topo, llc) = machine(1, 4, 1);
    assert!(!llc.present());
    let mut st = state(&topo, 0);
    assert!(!st.account_mm_sched(&llc, 0, 7, 4, 10 * MS, 1));
    assert!(st.proc(7).is_none());
}

#[test]
fn a_move_that_would_misfit_on_an_asymmetric_domain_is_forbidden_even_toward_the_preference() {
    // task_misfits_asym_cpu() (kernel 7.2, fair.c can_migrate_llc_task):
    // the caller computes it; here the same move as above, out of the
    // preferred LLC 0 into an idle LLC 1 (Llc without the veto), is
    // forbidden once the task fits the source CPU but not the destination.
    let (topo, llc) = machine(3, 2, 2);
    let st = preferring_llc0(&topo, &llc);
    let params = st.params;
    let view = st.view(&llc, &params);
    let ns = node(&topo, &llc, &[2048, 1706, 100]);
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 0, 4, 7, 0, false),
        LlcMig::Llc
    );
    assert_eq!(
        view.can_migrate_llc_task(&topo, &ns, 0, 4, 7, 0, true),
        LlcMig::Forbid
    );
}

#[test]
fn llc_utilisation_counts_util_est_only_with_util_est_on() {
    // LLC 0's CPUs show util_avg 0 but util_est 1024 each (4096 in all):
    // with UTIL_EST the destination LLC 0 is busy (4096 * 100 >= 4096 * 50)
    // and much busier than LLC 1 (0): pulling into it is forbidden; without
    // UTIL_EST it reads 0 and fits: allowed as a preference move.
    let (topo, llc) = machine(3, 2, 2);
    let st = preferring_llc0(&topo, &llc);
    let params = st.params;
    let mut cpus = vec![CpuState::idle(1024); topo.nr_cpus];
    for c in llc.spans[0].iter() {
        cpus[c].util_est = 1024;
    }
    let ns = NodeState::new(&topo, cpus, &[], &Features::default());
    let mut view = st.view(&llc, &params);
    assert_eq!(
        view.can_migrate_llc(&topo, &ns, 4, 0, 0, true),
        LlcMig::Forbid
    );
    view.util_est = false;
    assert_eq!(view.can_migrate_llc(&topo, &ns, 4, 0, 0, true), LlcMig::Llc);
}
