//! Cache-aware scheduling: per-process LLC preference (kernel 2026,
//! `CONFIG_SCHED_CACHE`).
//!
//! Accounting ([`CacheState::account_mm_sched`]) keeps, per CPU and per
//! (process, CPU), runtime that halves every epoch; once per epoch per
//! process [`CacheState::task_cache_work`] sums each LLC's share and moves
//! the preference to an LLC with more than twice the current one's. The
//! scan reads every CPU of every LLC touched (the kernel's), or only the
//! CPUs the process visited recently (`SC_VISIT`, Luo Gengkun's series, not
//! merged), optionally limited to the NUMA nodes in play (`SC_NODE`).
//!
//! The load balancer reads the preferences through an [`LlcView`]:
//! `can_migrate_llc`, `migrate_degrades_llc`, `llc_balance` and
//! `alb_break_llc`. Wakeup, fork and exec never read them, as in the kernel.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::Arc;

use crate::engine::cpumask::CpuMask;
use crate::engine::group::SgLbStats;
use crate::engine::rq::RqTask;
use crate::engine::state::{NodeState, cpu_util};
use crate::engine::topology::{Domain, Topology, sd};

/// `NICE_0_LOAD` unscaled (64-bit): only ratios matter.
const NICE_0_LOAD: u128 = 1 << 20;

/// The debugfs knobs of `sched/llc_balancing/`, kernel defaults.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheParams {
    /// `aggr_tolerance`: 0 disables aggregation, >= 100 always aggregates.
    pub aggr_tolerance: u32,
    /// `epoch_period`, ms (HZ/100 jiffies).
    pub epoch_period_ms: u64,
    /// `epoch_affinity_timeout`, epochs.
    pub epoch_affinity_timeout: u64,
    /// `overaggr_pct`: an LLC above this share of its capacity is busy.
    pub overaggr_pct: u32,
    /// `imb_pct`: hysteresis between two LLCs' utilisation.
    pub imb_pct: u32,
    /// Processes tracked per node; the least recently accounted is dropped.
    pub max_processes: usize,
}

impl Default for CacheParams {
    fn default() -> Self {
        Self {
            aggr_tolerance: 1,
            epoch_period_ms: 10,
            epoch_affinity_timeout: 5,
            overaggr_pct: 50,
            imb_pct: 20,
            max_processes: 512,
        }
    }
}

impl CacheParams {
    /// `get_sched_cache_scale()`: `None` = unlimited (tolerance >= 100).
    fn scale(&self, mul: u64) -> Option<u64> {
        match self.aggr_tolerance {
            0 => Some(0),
            t if t >= 100 => None,
            t => Some(1 + (t as u64 - 1) * mul),
        }
    }
}

/// Which CPUs `task_cache_work` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScanStrategy {
    /// Every CPU of every LLC touched (the kernel).
    Full,
    /// Only the CPUs the process visited within the epoch timeout.
    Visit,
}

impl ScanStrategy {
    pub fn as_str(self) -> &'static str {
        match self {
            ScanStrategy::Full => "full",
            ScanStrategy::Visit => "visit",
        }
    }
}

/// Per-CPU epoch clock (`rq->cpu_epoch*`, `rq->cpu_runtime`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct CpuEpoch {
    epoch: u64,
    /// ms when the next epoch starts.
    next: u64,
    /// ns of fair runtime, decayed per epoch.
    runtime: u64,
}

/// Per (process, CPU) record (`struct sched_cache_time`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Pcpu {
    runtime: u64,
    epoch: u64,
    /// `epoch_last_visit` of the visited-CPUs series.
    last_visit: u64,
}

/// One process's cache-aware state (`struct sched_cache_group`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    /// Preferred CPU; its LLC is the preferred LLC.
    pub cpu: Option<usize>,
    /// Epoch at which a scan was last queued.
    pub epoch: u64,
    /// ms; one scan per epoch period.
    pub next_scan: u64,
    /// EWMA of the threads running at scan time.
    pub nr_running_avg: u64,
    pub nr_threads: u32,
    pcpu: Vec<Pcpu>,
    visited: CpuMask,
    /// Accounting sequence number of the last runtime, for eviction.
    last_seen: u64,
}

/// What one `task_cache_work` pass did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScanReport {
    pub group: u64,
    pub strategy: ScanStrategy,
    /// Per-CPU records read (`fraction_mm_sched` calls).
    pub scanned: u32,
    pub changed: bool,
    pub preferred_cpu: Option<usize>,
}

/// Running totals, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub passes: u64,
    pub scanned: u64,
    pub changes: u64,
}

/// A node's cache-aware accounting.
#[derive(Debug, Clone)]
pub struct CacheState {
    pub params: CacheParams,
    cpus: Vec<CpuEpoch>,
    procs: HashMap<u64, Proc>,
    seq: u64,
    pub stats: CacheStats,
}

/// `llc_id()` as a dense index per CPU, and the LLC spans.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LlcMap {
    pub of_cpu: Vec<u16>,
    pub spans: Vec<CpuMask>,
    /// `cpu_smt_num_threads`.
    pub smt_threads: u32,
}

impl LlcMap {
    pub fn new(topo: &Topology) -> Self {
        let mut ids: Vec<u32> = topo.spec.cpus.iter().map(|c| c.llc).collect();
        ids.sort_unstable();
        ids.dedup();
        let of_cpu: Vec<u16> = topo
            .spec
            .cpus
            .iter()
            .map(|c| ids.binary_search(&c.llc).expect("known llc") as u16)
            .collect();
        let mut spans = vec![CpuMask::new(); ids.len()];
        for (c, &l) in of_cpu.iter().enumerate() {
            if topo.online.test(c) {
                spans[l as usize].set(c);
            }
        }
        let smt_threads = (0..topo.nr_cpus)
            .filter(|&c| topo.online.test(c))
            .map(|c| topo.smt_siblings(c).len() as u32)
            .max()
            .unwrap_or(1)
            .max(1);
        Self {
            of_cpu,
            spans,
            smt_threads,
        }
    }

    pub fn nr_llc(&self) -> usize {
        self.spans.len()
    }

    #[inline]
    pub fn llc(&self, cpu: usize) -> usize {
        self.of_cpu[cpu] as usize
    }

    /// `sched_cache_present`: the partition spans more than one LLC.
    pub fn present(&self) -> bool {
        self.spans.iter().filter(|s| !s.is_empty()).count() > 1
    }
}

impl CacheState {
    pub fn new(nr_cpus: usize, params: CacheParams, now_ms: u64) -> Self {
        Self {
            params,
            cpus: vec![
                CpuEpoch {
                    epoch: 0,
                    next: now_ms,
                    runtime: 0,
                };
                nr_cpus
            ],
            procs: HashMap::new(),
            seq: 0,
            stats: CacheStats::default(),
        }
    }

    pub fn nr_cpus(&self) -> usize {
        self.cpus.len()
    }

    pub fn procs(&self) -> impl Iterator<Item = (u64, &Proc)> {
        self.procs.iter().map(|(g, p)| (*g, p))
    }

    pub fn proc(&self, group: u64) -> Option<&Proc> {
        self.procs.get(&group)
    }

    fn period(&self) -> u64 {
        self.params.epoch_period_ms.max(1)
    }

    /// `__update_mm_sched()` for the CPU clock alone.
    fn advance_cpu(&mut self, cpu: usize, now: u64) {
        let period = self.period();
        advance_epoch(&mut self.cpus[cpu], period, now);
    }

    /// `__update_mm_sched()`: bring the CPU's epoch to `now`, then the
    /// process's record to the CPU's epoch; both halve once per epoch.
    fn update_mm_sched(cpus: &mut [CpuEpoch], period: u64, cpu: usize, pc: &mut Pcpu, now: u64) {
        let rq = &mut cpus[cpu];
        advance_epoch(rq, period, now);
        let n = rq.epoch.saturating_sub(pc.epoch);
        if n > 0 {
            pc.epoch += n;
            pc.runtime = shr(pc.runtime, n);
        }
    }

    /// `fraction_mm_sched()`: the process's recent share of the CPU, in
    /// NICE_0_LOAD units.
    fn fraction_mm_sched(
        cpus: &mut [CpuEpoch],
        period: u64,
        cpu: usize,
        pc: &mut Pcpu,
        now: u64,
    ) -> u64 {
        Self::update_mm_sched(cpus, period, cpu, pc, now);
        (NICE_0_LOAD * pc.runtime as u128 / (cpus[cpu].runtime as u128 + 1)) as u64
    }

    /// `invalid_llc_nr()` of a tracked process.
    pub fn invalid_llc_nr(params: &CacheParams, llc: &LlcMap, p: &Proc, cpu: usize) -> bool {
        invalid_llc_nr(params, llc, p.nr_threads, p.nr_running_avg, cpu)
    }

    fn new_proc(&self, now: u64) -> Proc {
        Proc {
            cpu: None,
            epoch: self.cpus.last().map_or(0, |c| c.epoch),
            next_scan: now,
            nr_running_avg: 0,
            nr_threads: 0,
            pcpu: self
                .cpus
                .iter()
                .map(|c| Pcpu {
                    runtime: 0,
                    epoch: c.epoch,
                    last_visit: 0,
                })
                .collect(),
            visited: CpuMask::new(),
            last_seen: 0,
        }
    }

    /// Drops the least recently accounted process when the table is full.
    fn make_room(&mut self) {
        if self.procs.len() < self.params.max_processes.max(1) {
            return;
        }
        if let Some((&g, _)) = self.procs.iter().min_by_key(|(g, p)| (p.last_seen, **g)) {
            self.procs.remove(&g);
        }
    }

    /// `account_mm_sched()`: `delta_ns` of runtime of process `group` on
    /// `cpu` at `now_ms`. Kernel threads (group 0) are never accounted.
    /// Returns whether the process may now queue its scan
    /// (`task_tick_cache`: once per epoch).
    pub fn account_mm_sched(
        &mut self,
        llc: &LlcMap,
        cpu: usize,
        group: u64,
        nr_threads: u32,
        delta_ns: u64,
        now_ms: u64,
    ) -> bool {
        if group == 0 || cpu >= self.cpus.len() || !llc.present() {
            return false;
        }
        if !self.procs.contains_key(&group) {
            self.make_room();
            let p = self.new_proc(now_ms);
            self.procs.insert(group, p);
        }
        self.seq += 1;
        let seq = self.seq;
        let period = self.period();
        let params = self.params;
        let timeout = params.epoch_affinity_timeout;
        let p = self.procs.get_mut(&group).expect("inserted");
        p.last_seen = seq;
        if nr_threads > 0 {
            p.nr_threads = nr_threads;
        }
        let pc = &mut p.pcpu[cpu];
        Self::update_mm_sched(&mut self.cpus, period, cpu, pc, now_ms);
        pc.runtime = pc.runtime.saturating_add(delta_ns);
        let rq = &mut self.cpus[cpu];
        rq.runtime = rq.runtime.saturating_add(delta_ns);
        let epoch = rq.epoch;
        // The visited-CPUs series marks the CPU on every accounting.
        pc.last_visit = epoch;
        p.visited.set(cpu);
        if epoch as i64 - p.epoch as i64 > timeout as i64
            || Self::invalid_llc_nr(&params, llc, p, cpu)
        {
            p.cpu = None;
        }
        // task_tick_cache(): queue the scan once per epoch.
        if p.epoch >= epoch {
            return false;
        }
        p.epoch = epoch;
        true
    }

    /// The CPUs the outer loop of the scan starts from.
    fn scan_mask(
        &mut self,
        topo: &Topology,
        group: u64,
        curr_cpu: usize,
        strategy: ScanStrategy,
        node_limit: bool,
        now: u64,
    ) -> CpuMask {
        let timeout = self.params.epoch_affinity_timeout;
        let mut cpus = match strategy {
            ScanStrategy::Full => topo.online,
            ScanStrategy::Visit => {
                // Evict CPUs not visited within the timeout; only the
                // scanner (one per process per period) clears bits.
                let visited = self.procs[&group].visited;
                let mut keep = CpuMask::new();
                for c in visited.iter() {
                    self.advance_cpu(c, now);
                    let epoch = self.cpus[c].epoch;
                    let last = self.procs[&group].pcpu[c].last_visit;
                    if epoch.saturating_sub(last) <= timeout {
                        keep.set(c);
                    }
                }
                self.procs.get_mut(&group).expect("known").visited = keep;
                keep.and(&topo.online)
            }
        };
        if node_limit {
            // SC_NODE: the node the process runs on and its preferred CPU's.
            let mut nodes = CpuMask::new();
            let node_of = |c: usize| topo.node_of(c) as usize;
            nodes.or_assign(&topo.node_cpus[node_of(curr_cpu)]);
            if let Some(pc) = self.procs[&group].cpu {
                nodes.or_assign(&topo.node_cpus[node_of(pc)]);
            }
            cpus = cpus.and(&nodes);
        }
        cpus
    }

    /// `task_cache_work()`: find the LLC where the process ran most and
    /// move its preference there if it has more than twice the current
    /// LLC's occupancy. `running_here(cpu)` says whether a thread of the
    /// process is on that CPU now. `None` when the scan did not run.
    #[allow(clippy::too_many_arguments)]
    pub fn task_cache_work(
        &mut self,
        topo: &Topology,
        llc: &LlcMap,
        group: u64,
        curr_cpu: usize,
        strategy: ScanStrategy,
        node_limit: bool,
        now: u64,
        running_here: impl Fn(usize) -> bool,
    ) -> Option<ScanReport> {
        let period = self.period();
        let params = self.params;
        {
            let p = self.procs.get_mut(&group)?;
            if now < p.next_scan {
                return None;
            }
            p.next_scan = now + period;
            if Self::invalid_llc_nr(&params, llc, p, curr_cpu) {
                p.cpu = None;
                return None;
            }
        }
        let mut cpus = self.scan_mask(topo, group, curr_cpu, strategy, node_limit, now);
        let visited = self.procs[&group].visited;
        let cur_llc = self.procs[&group].cpu.map(|c| llc.llc(c));
        let (mut best_occ, mut best_cpu, mut cur_occ) = (0u64, None, 0u64);
        let mut running = 0u64;
        let mut scanned = 0u32;
        let n = topo.nr_cpus;
        let mut next = cpus.next_lt(0, n);
        while let Some(cpu) = next {
            let l = llc.llc(cpu);
            let span = llc.spans[l];
            // A CPU whose LLC domain degenerated has no sd_llc: skipped.
            if topo.sd_llc(cpu).is_none() {
                cpus.clear(cpu);
                next = cpus.next_lt(cpu + 1, n);
                continue;
            }
            let inner = match strategy {
                ScanStrategy::Full => span,
                ScanStrategy::Visit => span.and(&visited),
            };
            let (mut occ_sum, mut max_occ, mut max_cpu) = (0u64, 0u64, None);
            let p = self.procs.get_mut(&group).expect("known");
            for i in inner.iter() {
                let occ = Self::fraction_mm_sched(&mut self.cpus, period, i, &mut p.pcpu[i], now);
                scanned += 1;
                occ_sum += occ;
                if occ > max_occ {
                    (max_occ, max_cpu) = (occ, Some(i));
                }
                if running_here(i) {
                    running += 1;
                }
            }
            // Strict: the first LLC wins ties.
            if occ_sum > best_occ {
                (best_occ, best_cpu) = (occ_sum, max_cpu);
            }
            if Some(l) == cur_llc {
                cur_occ = occ_sum;
            }
            cpus.andnot_assign(&span);
            next = cpus.next_lt(cpu + 1, n);
        }
        let p = self.procs.get_mut(&group).expect("known");
        let before = p.cpu;
        if best_occ > 2 * cur_occ {
            p.cpu = best_cpu;
        }
        // update_avg_scale(): signed EWMA with a divisor from the LLC size.
        let divisor = (llc.spans[llc.llc(curr_cpu)].weight() as i64 >> 2).clamp(2, 8);
        let diff = running as i64 - p.nr_running_avg as i64;
        p.nr_running_avg = (p.nr_running_avg as i64 + diff / divisor).max(0) as u64;
        let changed = p.cpu != before;
        let preferred_cpu = p.cpu;
        self.stats.passes += 1;
        self.stats.scanned += scanned as u64;
        self.stats.changes += changed as u64;
        Some(ScanReport {
            group,
            strategy,
            scanned,
            changed,
            preferred_cpu,
        })
    }

    /// Occupancy per LLC of one process now (what the scan would sum),
    /// for the admin view; reads without decaying the stored records.
    pub fn occupancy(&self, llc: &LlcMap, group: u64, now: u64) -> Vec<u64> {
        let mut out = vec![0u64; llc.nr_llc()];
        let Some(p) = self.procs.get(&group) else {
            return out;
        };
        let period = self.period();
        let mut cpus = self.cpus.clone();
        for (c, pc) in p.pcpu.iter().enumerate() {
            let mut pc = *pc;
            out[llc.llc(c)] += Self::fraction_mm_sched(&mut cpus, period, c, &mut pc, now);
        }
        out
    }

    /// Processes with a preferred LLC.
    pub fn nr_preferring(&self) -> usize {
        self.procs.values().filter(|p| p.cpu.is_some()).count()
    }

    /// `get_pref_llc()` of a process (NUMA balancing is not modelled).
    pub fn pref_llc(&self, llc: &LlcMap, group: u64) -> Option<usize> {
        self.procs.get(&group)?.cpu.map(|c| llc.llc(c))
    }

    /// Clears the preferences the balancer dropped (`grp->cpu = -1`).
    pub fn clear(&mut self, groups: &[u64]) {
        for g in groups {
            if let Some(p) = self.procs.get_mut(g) {
                p.cpu = None;
            }
        }
    }

    /// The view the balancer reads.
    pub fn view<'a>(&self, llc: &'a LlcMap, params: &'a CacheParams) -> LlcView<'a> {
        let prefs = self
            .procs
            .iter()
            .filter_map(|(g, p)| {
                p.cpu.map(|c| {
                    (
                        *g,
                        GroupPref {
                            llc: llc.llc(c) as u16,
                            nr_running_avg: p.nr_running_avg,
                            nr_threads: p.nr_threads,
                        },
                    )
                })
            })
            .collect();
        LlcView {
            llc,
            params,
            prefs,
            cleared: RefCell::new(Vec::new()),
            util_est: true,
            recorded: RefCell::new(Vec::new()),
        }
    }
}

/// Moves a CPU's epoch clock to `now`; its runtime halves once per epoch.
fn advance_epoch(rq: &mut CpuEpoch, period: u64, now: u64) {
    if now > rq.next {
        let n = (now - rq.next).div_ceil(period);
        rq.epoch += n;
        rq.next += n * period;
        rq.runtime = shr(rq.runtime, n);
    }
}

/// `invalid_llc_nr()`: single-threaded, or more concurrently running
/// threads (times the SMT width) than ~80 % of the LLC's CPUs.
fn invalid_llc_nr(
    params: &CacheParams,
    llc: &LlcMap,
    nr_threads: u32,
    nr_running_avg: u64,
    cpu: usize,
) -> bool {
    if nr_threads <= 1 {
        return true;
    }
    let Some(scale) = params.scale(1) else {
        return false;
    };
    let llc_size = llc.spans[llc.llc(cpu)].weight() as u64;
    // fits_capacity(): util * 1280 < capacity * 1024.
    nr_running_avg * llc.smt_threads as u64 * 1280 >= scale * llc_size * 1024
}

fn shr(v: u64, n: u64) -> u64 {
    if n >= 64 { 0 } else { v >> n }
}

/// What the balancer knows of one process's preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPref {
    pub llc: u16,
    pub nr_running_avg: u64,
    pub nr_threads: u32,
}

/// `enum llc_mig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlcMig {
    Forbid,
    Llc,
    Unrestricted,
}

/// The preferences a balance pass reads, frozen at its start.
#[derive(Debug)]
pub struct LlcView<'a> {
    pub llc: &'a LlcMap,
    pub params: &'a CacheParams,
    pub prefs: HashMap<u64, GroupPref>,
    /// Processes whose preference the pass dropped.
    pub cleared: RefCell<Vec<u64>>,
    /// UTIL_EST: an LLC's utilisation counts util_est.
    pub util_est: bool,
    /// Each LLC's utilisation and capacity as `record_sg_llc_stats` last
    /// stored them (by dense LLC index); an LLC not recorded yet reads its
    /// present sums instead.
    pub recorded: RefCell<Vec<Option<(u64, u64)>>>,
}

/// Per-CPU cache-aware counts of a working copy: `nr_llc_running`,
/// `nr_pref_llc_running` and the base domain's `llc_counts[]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RqCounts {
    nr_llc: usize,
    of_cpu: Vec<u16>,
    pub nr_llc_running: Vec<u32>,
    pub nr_pref_llc_running: Vec<u32>,
    counts: Vec<u32>,
}

impl RqCounts {
    /// Tasks on `cpu` preferring `dst_cpu`'s LLC (0 without a view).
    pub fn pref_on(&self, cpu: usize, dst_cpu: usize) -> u32 {
        if self.nr_llc == 0 {
            return 0;
        }
        let l = self.of_cpu[dst_cpu] as usize;
        self.counts[cpu * self.nr_llc + l]
    }

    /// `account_llc_enqueue()`.
    pub fn enqueue(&mut self, cpu: usize, pref: Option<usize>, runnable: bool) {
        let Some(l) = pref else { return };
        if self.nr_llc == 0 {
            return;
        }
        self.nr_llc_running[cpu] += 1;
        if l == self.of_cpu[cpu] as usize && runnable {
            self.nr_pref_llc_running[cpu] += 1;
        }
        self.counts[cpu * self.nr_llc + l] += 1;
    }

    /// `account_llc_dequeue()`: never underflows.
    pub fn dequeue(&mut self, cpu: usize, pref: Option<usize>, runnable: bool) {
        let Some(l) = pref else { return };
        if self.nr_llc == 0 {
            return;
        }
        let dec = |v: &mut u32| *v = v.saturating_sub(1);
        dec(&mut self.nr_llc_running[cpu]);
        if l == self.of_cpu[cpu] as usize && runnable {
            dec(&mut self.nr_pref_llc_running[cpu]);
        }
        dec(&mut self.counts[cpu * self.nr_llc + l]);
    }
}

impl LlcView<'_> {
    /// `get_pref_llc()` now: the process's preferred LLC, unless the pass
    /// dropped it (`grp->cpu = -1`).
    pub fn pref_of(&self, group: u64) -> Option<usize> {
        if self.cleared.borrow().contains(&group) {
            return None;
        }
        self.task_pref(group)
    }

    /// `p->preferred_llc` of a task of `group`: set when the task was last
    /// accounted, so a preference the pass dropped still counts here.
    pub fn task_pref(&self, group: u64) -> Option<usize> {
        if group == 0 {
            return None;
        }
        self.prefs.get(&group).map(|p| p.llc as usize)
    }

    /// `record_sg_llc_stats()`: stores an LLC's group sums.
    pub fn record(&self, cpu: usize, util: u64, capacity: u64) {
        let l = self.llc.llc(cpu);
        let mut r = self.recorded.borrow_mut();
        if r.len() < self.llc.nr_llc() {
            r.resize(self.llc.nr_llc(), None);
        }
        r[l] = Some((util, capacity));
    }

    /// Fills the per-CPU counts from the task lists.
    pub fn counts(&self, topo: &Topology, tasks: &[Arc<[RqTask]>], out: &mut RqCounts) {
        let n = topo.nr_cpus;
        out.nr_llc = self.llc.nr_llc();
        out.of_cpu.clone_from(&self.llc.of_cpu);
        out.nr_llc_running.clear();
        out.nr_llc_running.resize(n, 0);
        out.nr_pref_llc_running.clear();
        out.nr_pref_llc_running.resize(n, 0);
        out.counts.clear();
        out.counts.resize(n * out.nr_llc, 0);
        for (cpu, list) in tasks.iter().enumerate().take(n) {
            for t in list.iter() {
                out.enqueue(cpu, self.task_pref(t.group), !t.sched_delayed);
            }
        }
    }

    /// `get_llc_stats()`: the LLC's utilisation and capacity as recorded,
    /// or its present sums before the first record; `None` without an LLC
    /// domain (no shared object).
    fn llc_stats(&self, topo: &Topology, st: &NodeState, cpu: usize) -> Option<(u64, u64)> {
        topo.sd_llc(cpu)?;
        let l = self.llc.llc(cpu);
        if let Some(Some(r)) = self.recorded.borrow().get(l) {
            return Some(*r);
        }
        let span = &self.llc.spans[l];
        let mut util = 0u64;
        let mut cap = 0u64;
        for i in span.iter() {
            let rq = &st.cpus[i];
            util += cpu_util(rq, topo.capacity_orig(i), self.util_est, false, None) as u64;
            cap += rq.capacity as u64;
        }
        Some((util, cap))
    }

    /// `fits_llc_capacity()`: below overaggr_pct (x 3/2 without SMT).
    fn fits(&self, util: u64, cap: u64) -> bool {
        let mut pct = self.params.overaggr_pct as u64;
        if self.llc.smt_threads <= 1 {
            pct = pct * 3 / 2;
        }
        util * 100 < cap * pct
    }

    /// `util_greater()`: more than imb_pct above.
    fn greater(&self, a: u64, b: u64) -> bool {
        a * 100 > b * (100 + self.params.imb_pct as u64)
    }

    /// `can_migrate_llc()`: does moving `task_util` from src's LLC to dst's
    /// respect (`Llc`), break (`Forbid`) or not concern (`Unrestricted`)
    /// the preference?
    pub fn can_migrate_llc(
        &self,
        topo: &Topology,
        st: &NodeState,
        src: usize,
        dst: usize,
        task_util: u64,
        to_pref: bool,
    ) -> LlcMig {
        let (Some((su, sc)), Some((du, dc))) =
            (self.llc_stats(topo, st, src), self.llc_stats(topo, st, dst))
        else {
            return LlcMig::Unrestricted;
        };
        let su = su.saturating_sub(task_util);
        let du = du + task_util;
        // Both LLCs busy: ordinary load balancing decides.
        if !self.fits(du, dc) && !self.fits(su, sc) {
            return LlcMig::Unrestricted;
        }
        let forbid = if to_pref {
            !self.fits(du, dc) && self.greater(du, su)
        } else {
            self.fits(su, sc) || !self.greater(su, du)
        };
        if forbid { LlcMig::Forbid } else { LlcMig::Llc }
    }

    /// `can_migrate_llc_task()`. `misfits` is `task_misfits_asym_cpu()`:
    /// on an asymmetric domain the task fits the source but not the
    /// destination (kernel 7.2; the algorithm notes lack it).
    #[allow(clippy::too_many_arguments)]
    pub fn can_migrate_llc_task(
        &self,
        topo: &Topology,
        st: &NodeState,
        src: usize,
        dst: usize,
        group: u64,
        task_util: u64,
        misfits: bool,
    ) -> LlcMig {
        if misfits {
            return LlcMig::Forbid;
        }
        let Some(pref) = self.pref_of(group) else {
            return LlcMig::Unrestricted;
        };
        if self.llc.llc(src) == self.llc.llc(dst) {
            return LlcMig::Unrestricted;
        }
        let g = self.prefs[&group];
        if invalid_llc_nr(self.params, self.llc, g.nr_threads, g.nr_running_avg, dst) {
            self.cleared.borrow_mut().push(group);
            return LlcMig::Unrestricted;
        }
        let to_pref = if self.llc.llc(dst) == pref {
            true
        } else if self.llc.llc(src) == pref {
            false
        } else {
            return LlcMig::Unrestricted;
        };
        self.can_migrate_llc(topo, st, src, dst, task_util, to_pref)
    }

    /// `migrate_degrades_llc()`: `Some(true)` refuses, `Some(false)` allows
    /// because the preference asked for it, `None` does not concern it.
    #[allow(clippy::too_many_arguments)]
    pub fn migrate_degrades_llc(
        &self,
        topo: &Topology,
        st: &NodeState,
        (src, dst): (usize, usize),
        group: u64,
        task_util: u64,
        misfits: bool,
        llc_task: bool,
        nr_balance_failed: u32,
        cache_nice_tries: u32,
    ) -> Option<bool> {
        // The kernel writes it as ">= cache_nice_tries + 1".
        if nr_balance_failed > cache_nice_tries {
            return None;
        }
        // migrate_llc_task_wrong_dst() reads the task's own preference.
        if llc_task && self.task_pref(group) != Some(self.llc.llc(dst)) {
            return Some(true);
        }
        match self.can_migrate_llc_task(topo, st, src, dst, group, task_util, misfits) {
            LlcMig::Forbid => Some(true),
            LlcMig::Llc => Some(false),
            LlcMig::Unrestricted => None,
        }
    }

    /// `llc_balance()`: a remote group above the LLC with tasks preferring
    /// the destination's LLC, which can take them.
    #[allow(clippy::too_many_arguments)]
    pub fn llc_balance(
        &self,
        topo: &Topology,
        st: &NodeState,
        d: &Domain,
        sgs: &SgLbStats,
        span: &CpuMask,
        dst: usize,
        nr_balance_failed: u32,
    ) -> bool {
        if d.has(sd::SHARE_LLC) {
            return false;
        }
        if d.has(sd::ASYM_CPUCAPACITY) && sgs.group_misfit_task_load != 0 {
            return false;
        }
        if nr_balance_failed > d.cache_nice_tries {
            return false;
        }
        let Some(first) = span.first() else {
            return false;
        };
        sgs.nr_pref_dst_llc > 0
            && self.can_migrate_llc(topo, st, first, dst, 0, true) == LlcMig::Llc
    }

    /// `alb_break_llc()`: active balancing would pull a task off the LLC
    /// every runnable task of the source prefers.
    #[allow(clippy::too_many_arguments)]
    pub fn alb_break_llc(
        &self,
        topo: &Topology,
        st: &NodeState,
        counts: &RqCounts,
        (src, dst): (usize, usize),
        misfit: bool,
        curr: Option<(&RqTask, bool)>,
    ) -> bool {
        if self.llc.llc(src) == self.llc.llc(dst) {
            return false;
        }
        let rq = &st.cpus[src];
        let pref = counts.nr_pref_llc_running.get(src).copied().unwrap_or(0);
        if pref == 0 || pref != rq.cfs_h_nr_queued.saturating_sub(rq.nr_delayed) {
            return false;
        }
        if misfit {
            return false;
        }
        if rq.nr_running <= 1 {
            return true;
        }
        // The running task's utilisation would leave; `curr.1` is
        // task_misfits_asym_cpu() for it.
        let util = curr.map_or(0, |(t, _)| t.util_avg.max(0) as u64);
        curr.is_some_and(|(_, m)| m)
            || self.can_migrate_llc(topo, st, src, dst, util, false) == LlcMig::Forbid
    }
}
