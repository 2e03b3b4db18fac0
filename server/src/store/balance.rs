//! Load balancing and cache-aware accounting against the stored state.
//!
//! A balance pass reads the current snapshot (no writer lock) and runs on
//! the balancer's own working copy; only the node's balancer mutex is held,
//! so agents and placements never wait for it. Cache-aware accounting runs
//! after an agent report is published, under the node's cache mutex.

use std::sync::PoisonError;
use std::time::Instant;

use crate::engine::View;
use crate::engine::balance::{BalanceOpts, Balancer, PassStats, Proposal};
use crate::engine::cache::{CacheParams, CacheState, LlcMap, ScanReport, ScanStrategy};
use crate::engine::cpumask::CpuMask;

use super::{Node, RuntimeEntry, Store};

/// What a caller asks of a node balance.
#[derive(Debug, Clone, Default)]
pub struct BalanceRequest {
    /// Destination CPUs; `None` = every online CPU.
    pub dst_cpus: Option<CpuMask>,
    pub honor_intervals: bool,
    /// Commit each proposal as a claim on its destination CPU.
    pub apply: bool,
    /// 0 = no limit.
    pub max_proposals: usize,
}

#[derive(Debug, Clone)]
pub struct BalanceOutcome {
    pub proposals: Vec<Proposal>,
    pub stats: PassStats,
    /// The snapshot version the pass read.
    pub version: u64,
    pub claimed: u32,
    /// Whether cache-aware preferences took part.
    pub cache_aware: bool,
}

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

impl Store {
    /// Runs `f` on the node's cache-aware state, kept in step with its
    /// online CPUs; with `create`, made if the node has none yet.
    fn with_cache<T>(
        &self,
        node: &Node,
        create: bool,
        f: impl FnOnce(&mut super::NodeCache) -> T,
    ) -> Option<T> {
        let snap = node.snapshot();
        let mut guard = node.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if guard.is_none() {
            if !create {
                return None;
            }
            *guard = Some(Box::new(super::NodeCache {
                // The epoch clocks count from the store's start, as the
                // kernel's from boot.
                state: CacheState::new(node.spec.cpus.len(), self.config.cache, 0),
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
        let now_ms = self.now_ms(now);
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

    /// One periodic balance of `node` (see [`Balancer::run`]).
    pub fn balance(&self, node: &Node, req: &BalanceRequest, now: Instant) -> BalanceOutcome {
        self.balance_with(node, req, now, true)
            .expect("a waiting balance always runs")
    }

    /// As [`Store::balance`], or `None` at once if another pass of this node
    /// is running (the service answers ABORTED rather than queue passes).
    pub fn try_balance(
        &self,
        node: &Node,
        req: &BalanceRequest,
        now: Instant,
    ) -> Option<BalanceOutcome> {
        self.balance_with(node, req, now, false)
    }

    fn balance_with(
        &self,
        node: &Node,
        req: &BalanceRequest,
        now: Instant,
        wait: bool,
    ) -> Option<BalanceOutcome> {
        let snap = node.snapshot();
        let topo = &snap.topo;
        let now_ms = self.now_ms(now);
        // Freeze the preferences for the pass; the cache lock is not held.
        let frozen = self
            .with_cache(node, false, |c| {
                let llc = c.llc.clone();
                let params: CacheParams = c.state.params;
                let on = snap.features.sched_cache && llc.present();
                let prefs = on.then(|| c.state.view(&llc, &params).prefs);
                prefs.map(|p| (llc, params, p))
            })
            .flatten();
        let view_llc = frozen
            .as_ref()
            .map(|(llc, params, prefs)| crate::engine::cache::LlcView {
                llc,
                params,
                prefs: prefs.clone(),
                cleared: Default::default(),
                util_est: snap.features.util_est,
                recorded: Default::default(),
            });
        let opts = BalanceOpts {
            dst_cpus: req.dst_cpus.unwrap_or(topo.online),
            now_ms,
            honor_intervals: req.honor_intervals,
            max_proposals: req.max_proposals,
        };
        let view = View {
            topo,
            state: &snap.state,
            features: &snap.features,
            system: &self.config.system,
        };
        let mut proposals = Vec::new();
        let stats = {
            let mut b = if wait {
                node.balancer.lock().unwrap_or_else(PoisonError::into_inner)
            } else {
                match node.balancer.try_lock() {
                    Ok(g) => g,
                    Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                    Err(std::sync::TryLockError::WouldBlock) => return None,
                }
            };
            let bal = b.get_or_insert_with(|| Box::new(Balancer::new(topo)));
            bal.run(view, &snap.tasks, view_llc.as_ref(), &opts, &mut proposals)
        };
        let proposals = collapse(proposals);
        let cache_aware = view_llc.is_some();
        if let Some(v) = view_llc {
            let cleared = v.cleared.into_inner();
            if !cleared.is_empty() {
                self.with_cache(node, false, |c| c.state.clear(&cleared));
            }
        }
        let claimed = if req.apply && !proposals.is_empty() {
            let cpus: Vec<usize> = proposals.iter().map(|p| p.dst_cpu).collect();
            self.claim_cpus(node, &cpus, now)
        } else {
            0
        };
        Some(BalanceOutcome {
            proposals,
            stats,
            version: snap.version,
            claimed,
            cache_aware,
        })
    }

    /// Claims one task on each CPU listed (repeats count), publishing once.
    pub fn claim_cpus(&self, node: &Node, cpus: &[usize], now: Instant) -> u32 {
        if cpus.is_empty() {
            return 0;
        }
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        let mut n = 0;
        for &cpu in cpus {
            if cpu >= cur.state.cpus.len() || !cur.topo.online.test(cpu) {
                continue;
            }
            let base = w
                .claims
                .get(&(cpu as u32))
                .map_or(cur.state.cpus[cpu], |s| s.base);
            w.claims
                .entry(cpu as u32)
                .or_insert_with(|| super::ClaimSlot {
                    base,
                    expires: Vec::new(),
                })
                .expires
                .push(now + self.config.claim_ttl);
            n += 1;
        }
        if n == 0 {
            return 0;
        }
        let cpus = super::claims::base_cpus(&cur, &w);
        let topo = std::sync::Arc::clone(&cur.topo);
        self.publish(node, &mut w, cpus, topo, cur.features, None, &cur);
        n
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
        let now_ms = self.now_ms(now);
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

/// One proposal per task: a task a pass moved twice goes from its first
/// source to its last destination, and one that came back is dropped.
fn collapse(proposals: Vec<Proposal>) -> Vec<Proposal> {
    let mut at: std::collections::HashMap<u64, usize> = std::collections::HashMap::new();
    let mut out: Vec<Proposal> = Vec::with_capacity(proposals.len());
    for p in proposals {
        match at.get(&p.task) {
            Some(&i) => out[i].dst_cpu = p.dst_cpu,
            None => {
                at.insert(p.task, out.len());
                out.push(p);
            }
        }
    }
    out.retain(|p| p.src_cpu != p.dst_cpu);
    out
}

/// Reported tasks whose process has a preferred LLC, and those on it.
fn pref_counts(snap: &super::Snapshot, c: &super::NodeCache) -> (u32, u32) {
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
