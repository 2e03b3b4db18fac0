//! Accounting and the preference: `account_mm_sched` (per CPU and per
//! process, runtime halving every epoch) and `task_cache_work` (each LLC's
//! share, the scan over every CPU or only the visited ones, and the move of
//! the preference).

use super::*;

/// Per-CPU epoch clock (`rq->cpu_epoch*`, `rq->cpu_runtime`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct CpuEpoch {
    pub(super) epoch: u64,
    /// ms when the next epoch starts.
    pub(super) next: u64,
    /// ns of fair runtime, decayed per epoch.
    pub(super) runtime: u64,
}

/// Per (process, CPU) record (`struct sched_cache_time`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Pcpu {
    pub(super) runtime: u64,
    pub(super) epoch: u64,
    /// `epoch_last_visit` of the visited-CPUs series.
    pub(super) last_visit: u64,
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
    pub(super) pcpu: Vec<Pcpu>,
    pub(super) visited: CpuMask,
    /// Accounting sequence number of the last runtime, for eviction.
    pub(super) last_seen: u64,
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
    pub(super) cpus: Vec<CpuEpoch>,
    pub(super) procs: HashMap<u64, Proc>,
    pub(super) seq: u64,
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

    pub(super) fn period(&self) -> u64 {
        self.params.epoch_period_ms.max(1)
    }

    /// `__update_mm_sched()` for the CPU clock alone.
    pub(super) fn advance_cpu(&mut self, cpu: usize, now: u64) {
        let period = self.period();
        advance_epoch(&mut self.cpus[cpu], period, now);
    }

    /// `__update_mm_sched()`: bring the CPU's epoch to `now`, then the
    /// process's record to the CPU's epoch; both halve once per epoch.
    pub(super) fn update_mm_sched(
        cpus: &mut [CpuEpoch],
        period: u64,
        cpu: usize,
        pc: &mut Pcpu,
        now: u64,
    ) {
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
    pub(super) fn fraction_mm_sched(
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

    pub(super) fn new_proc(&self, now: u64) -> Proc {
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
    pub(super) fn make_room(&mut self) {
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
    pub(super) fn scan_mask(
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
pub(super) fn advance_epoch(rq: &mut CpuEpoch, period: u64, now: u64) {
    if now > rq.next {
        let n = (now - rq.next).div_ceil(period);
        rq.epoch += n;
        rq.next += n * period;
        rq.runtime = shr(rq.runtime, n);
    }
}

/// `invalid_llc_nr()`: single-threaded, or more concurrently running
/// threads (times the SMT width) than ~80 % of the LLC's CPUs.
pub(super) fn invalid_llc_nr(
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

pub(super) fn shr(v: u64, n: u64) -> u64 {
    if n >= 64 { 0 } else { v >> n }
}
