//! The cache-aware state kept per node: runtime accounted after each agent
//! report (`account_mm_sched`, `task_cache_work`), under the node's cache
//! mutex, and the summary the admin API shows.

use std::sync::PoisonError;
use std::time::Instant;

use crate::engine::cache::{CacheState, LlcMap, ScanReport, ScanStrategy};
use crate::engine::cpumask::CpuMask;

use super::Passes;
use crate::store::{Node, NodeCache, RuntimeEntry, Snapshot};

/// One process's cache-aware state, for the admin view.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcSummary {
    pub group: u64,
    pub preferred_cpu: Option<usize>,
    /// Dense LLC index (see [`LlcMap`]).
    pub preferred_llc: Option<usize>,
    pub nr_threads: u32,
    pub nr_running_avg: u64,
    /// Occupancy per LLC, NICE_0_LOAD (2^20) units per CPU.
    pub occupancy: Vec<u64>,
}

/// A node's cache-aware view for the admin API.
#[derive(Debug, Clone)]
pub struct CacheSummary {
    pub enabled: bool,
    pub strategy: ScanStrategy,
    pub node_limited: bool,
    /// The topology's LLC id of each dense LLC index, and its CPUs.
    pub llcs: Vec<(u32, CpuMask)>,
    pub procs: Vec<ProcSummary>,
    /// Tasks with a preference, and those queued on their preferred LLC.
    pub tasks_with_preference: u32,
    pub tasks_on_preferred_llc: u32,
    pub passes: u64,
    pub scanned: u64,
    pub changes: u64,
}

impl Passes {
    /// Runs `f` on the node's cache-aware state, kept in step with its
    /// online CPUs; with `create`, made if the node has none yet.
    pub(super) fn with_cache<T>(
        &self,
        node: &Node,
        create: bool,
        f: impl FnOnce(&mut NodeCache) -> T,
    ) -> Option<T> {
        let snap = node.snapshot();
        let mut guard = node.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            if !create {
                return None;
            }
            *guard = Some(Box::new(NodeCache {
                // The epoch clocks count from the store's start, as the
                // kernel's from boot.
                state: CacheState::new(node.spec.cpus.len(), self.cache, 0),
                llc: LlcMap::new(&snap.topo),
            }));
        }
        let c = guard.as_mut().expect("made above");
        if c.llc.spans.iter().fold(CpuMask::new(), |a, s| a.or(s)) != snap.topo.online {
            c.llc = LlcMap::new(&snap.topo);
        }
        Some(f(c))
    }

    /// Cache-aware accounting of a published report's runtime entries:
    /// `account_mm_sched`, and `task_cache_work` for each process whose
    /// scan came due. Returns the scans that ran.
    pub fn account(&self, node: &Node, runtime: &[RuntimeEntry], now: Instant) -> Vec<ScanReport> {
        let snap = node.snapshot();
        if !snap.features.sched_cache || runtime.is_empty() {
            return Vec::new();
        }
        let strategy = if snap.features.sc_visit {
            ScanStrategy::Visit
        } else {
            ScanStrategy::Full
        };
        let now_ms = self.table.now_ms(now);
        self.with_cache(node, true, |c| {
            let mut scans = Vec::new();
            for e in runtime {
                let cpu = e.cpu as usize;
                if !snap.topo.online.test(cpu) {
                    continue;
                }
                let due = c.state.account_mm_sched(
                    &c.llc,
                    cpu,
                    e.group,
                    e.nr_threads,
                    e.runtime_ns,
                    now_ms,
                );
                if !due {
                    continue;
                }
                let tasks = &snap.tasks;
                let running_here = |i: usize| {
                    tasks
                        .cpus
                        .get(i)
                        .is_some_and(|l| l.iter().any(|t| t.running && t.group == e.group))
                };
                if let Some(r) = c.state.task_cache_work(
                    &snap.topo,
                    &c.llc,
                    e.group,
                    cpu,
                    strategy,
                    snap.features.sc_node,
                    now_ms,
                    running_here,
                ) {
                    scans.push(r);
                }
            }
            scans
        })
        .unwrap_or_default()
    }

    /// Processes with a preference, reported tasks with one, and those of
    /// them queued on their preferred LLC: the node's cache-aware gauges.
    /// `None` for a node that never reported runtime (no series for it).
    pub fn cache_gauges(&self, node: &Node) -> Option<(u32, u32, u32)> {
        let snap = node.snapshot();
        self.with_cache(node, false, |c| {
            let (with, on) = pref_counts(&snap, c);
            (c.state.nr_preferring() as u32, with, on)
        })
    }

    /// The node's cache-aware state, for the admin view.
    pub fn cache_summary(&self, node: &Node, now: Instant) -> CacheSummary {
        let snap = node.snapshot();
        let now_ms = self.table.now_ms(now);
        let f = &snap.features;
        let summary = |llc: &LlcMap| {
            let mut ids = vec![0u32; llc.nr_llc()];
            for (cpu, l) in llc.of_cpu.iter().enumerate() {
                ids[*l as usize] = snap.topo.spec.cpus[cpu].llc;
            }
            CacheSummary {
                enabled: f.sched_cache && llc.present(),
                strategy: if f.sc_visit {
                    ScanStrategy::Visit
                } else {
                    ScanStrategy::Full
                },
                node_limited: f.sc_node,
                llcs: ids.into_iter().zip(llc.spans.iter().copied()).collect(),
                procs: Vec::new(),
                tasks_with_preference: 0,
                tasks_on_preferred_llc: 0,
                passes: 0,
                scanned: 0,
                changes: 0,
            }
        };
        self.with_cache(node, false, |c| {
            let mut out = summary(&c.llc);
            out.procs = c
                .state
                .procs()
                .map(|(g, p)| ProcSummary {
                    group: g,
                    preferred_cpu: p.cpu,
                    preferred_llc: p.cpu.map(|x| c.llc.llc(x)),
                    nr_threads: p.nr_threads,
                    nr_running_avg: p.nr_running_avg,
                    occupancy: c.state.occupancy(&c.llc, g, now_ms),
                })
                .collect();
            out.procs.sort_by_key(|p| p.group);
            (out.tasks_with_preference, out.tasks_on_preferred_llc) = pref_counts(&snap, c);
            out.passes = c.state.stats.passes;
            out.scanned = c.state.stats.scanned;
            out.changes = c.state.stats.changes;
            out
        })
        .unwrap_or_else(|| summary(&LlcMap::new(&snap.topo)))
    }
}

/// Reported tasks whose process has a preferred LLC, and those on it.
fn pref_counts(snap: &Snapshot, c: &NodeCache) -> (u32, u32) {
    let (mut with, mut on) = (0, 0);
    for (cpu, list) in snap.tasks.cpus.iter().enumerate() {
        for t in list.iter() {
            if let Some(l) = c.state.pref_llc(&c.llc, t.group) {
                with += 1;
                on += (l == c.llc.llc(cpu)) as u32;
            }
        }
    }
    (with, on)
}
