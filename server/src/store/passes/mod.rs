//! The passes over one node's kept engine state: the periodic balancer
//! with the node's balancing state (`nr_balance_failed`, intervals,
//! `sgc->imbalance`) and its cache-aware preferences (here), and the
//! cache-aware accounting of each report's runtime (`cache`). Each node
//! keeps that state beside its snapshot, under mutexes of its own; this
//! owner runs the engine over it and claims what a pass proposes.
//!
//! A pass reads the current snapshot (no writer lock) and runs on the
//! balancer's own working copy; only the node's balancer mutex is held, so
//! agents and placements never wait for it.

use std::sync::{Arc, PoisonError};
use std::time::Instant;

use crate::engine::balance::{BalanceOpts, Balancer, PassStats, Proposal};
use crate::engine::cache::CacheParams;
use crate::engine::cpumask::CpuMask;

use super::nodes::Nodes;
use super::{Node, StoreConfig, Table};
use crate::engine::features::System;

mod cache;

pub use cache::{CacheSummary, ProcSummary};

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

/// What runs over a node's balancer and cache-aware state.
pub struct Passes {
    table: Arc<Table>,
    nodes: Arc<Nodes>,
    system: System,
    cache: CacheParams,
}

impl Passes {
    pub(super) fn new(config: &StoreConfig, table: Arc<Table>, nodes: Arc<Nodes>) -> Self {
        Self {
            table,
            nodes,
            system: config.system,
            cache: config.cache,
        }
    }

    /// One periodic balance of `node` (see [`Balancer::run`]).
    pub fn balance(&self, node: &Node, req: &BalanceRequest, now: Instant) -> BalanceOutcome {
        self.balance_with(node, req, now, true)
            .expect("a waiting balance always runs")
    }

    /// As [`Passes::balance`], or `None` at once if another pass of this node
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
        let now_ms = self.table.now_ms(now);
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
        let view = snap.view(&self.system);
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
            self.nodes.claim_cpus(node, &cpus, now)
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
