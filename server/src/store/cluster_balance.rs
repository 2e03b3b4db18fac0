//! Load balancing across nodes: the kernel's periodic balance applied at a
//! cluster level (a rack's nodes, or a zone's racks).
//!
//! Each node of the group takes the part of a destination CPU in turn:
//! `should_we_balance` (the group's first node with an idle CPU, else its
//! first node), the busiest sibling group by `update_sd_pick_busiest`, the
//! decision and `calculate_imbalance` on the groups' sums, the busiest node
//! and CPU inside it, then that CPU's coldest tasks through the cross-node
//! form of `can_migrate_task`. Cluster levels behave like NUMA levels (as
//! in cluster placement): no prefer-sibling, the NUMA imbalance allowance,
//! and `cache_nice_tries` 2. A pass works on private copies of the nodes'
//! states, so later destinations see earlier moves; stored state changes
//! only with `apply` (claims on the destinations).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use crate::cluster::NodeAgg;
use crate::engine::balance::{
    PassStats, RqTask, SCHED_NR_MIGRATE, cpu_util_cfs_boost, h_nr_runnable,
};
use crate::engine::balance::lb::{self, DomainParams, GroupType, SdTotals, SgLbStats};
use crate::engine::balance::migrate::{MigrationType, Reason};
use crate::engine::state::CpuState;
use crate::engine::topology::FieldError;
use crate::quote::quote;

use super::{Snapshot, Store};

/// `cache_nice_tries` of the cluster levels (as a NUMA level's).
pub const CLUSTER_CACHE_NICE_TRIES: u32 = 2;

#[derive(Debug, Clone, Default)]
pub struct ClusterBalanceRequest {
    /// A hierarchy label (`zone`, `rack`).
    pub level: String,
    /// The group's label values from the top, joined by `/` (`z1/r3`).
    pub group: String,
    pub apply: bool,
    pub max_proposals: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterProposal {
    pub task: u64,
    pub group: u64,
    pub src_node: String,
    pub src_cpu: usize,
    pub dst_node: String,
    pub dst_cpu: usize,
    pub migration_type: MigrationType,
    pub level: String,
    pub busiest: GroupType,
    pub local: GroupType,
    pub imbalance: i64,
    pub forced_hot: bool,
    pub nr_balance_failed: u32,
}

#[derive(Debug, Clone, Default)]
pub struct ClusterBalanceOutcome {
    pub proposals: Vec<ClusterProposal>,
    pub stats: PassStats,
    pub claimed: u32,
}

/// A node's private copy for the pass.
struct WorkNode {
    id: String,
    snap: Arc<Snapshot>,
    cpus: Vec<CpuState>,
    /// Copied when the node first becomes a source.
    tasks: Option<Vec<VecDeque<RqTask>>>,
    agg: NodeAgg,
}

impl WorkNode {
    fn tasks(&mut self) -> &mut Vec<VecDeque<RqTask>> {
        let snap = &self.snap;
        self.tasks.get_or_insert_with(|| {
            snap.tasks
                .cpus
                .iter()
                .map(|l| l.iter().cloned().collect())
                .collect()
        })
    }
}

/// The group sums of a set of work nodes as load-balance statistics.
fn sg_stats(pct: u32, nodes: &[usize], work: &[WorkNode], imbalanced: bool) -> SgLbStats {
    let mut a = NodeAgg::default();
    for &i in nodes {
        let w = &work[i].agg;
        a.cpus += w.cpus;
        a.idle_cpus += w.idle_cpus;
        a.nr_running += w.nr_running;
        a.load += w.load;
        a.util += w.util;
        a.runnable += w.runnable;
        a.capacity += w.capacity;
        a.max_capacity = a.max_capacity.max(w.max_capacity);
    }
    let mut s = SgLbStats {
        group_load: a.load.max(0) as u64,
        group_capacity: a.capacity.max(0) as u64,
        group_util: a.util.max(0) as u64,
        group_runnable: a.runnable.max(0) as u64,
        sum_nr_running: a.nr_running.clamp(0, u32::MAX as i64) as u32,
        sum_h_nr_running: a.nr_running.clamp(0, u32::MAX as i64) as u32,
        idle_cpus: a.idle_cpus.clamp(0, u32::MAX as i64) as u32,
        group_weight: a.cpus.clamp(0, u32::MAX as i64) as u32,
        cores: a.cpus.clamp(0, u32::MAX as i64) as u32,
        sgc_imbalance: imbalanced,
        min_capacity: a.max_capacity.max(0) as u64,
        max_capacity: a.max_capacity.max(0) as u64,
        ..SgLbStats::default()
    };
    lb::classify(pct, &mut s);
    s
}

fn move_task(rq: &mut CpuState, t: &RqTask, sign: i64) {
    let d = |v: &mut i64, x: i64| *v = (*v + sign * x).max(0);
    if sign > 0 {
        rq.nr_running += 1;
        rq.cfs_h_nr_queued += 1;
        rq.curr_is_idle = false;
    } else {
        rq.nr_running = rq.nr_running.saturating_sub(1);
        rq.cfs_h_nr_queued = rq.cfs_h_nr_queued.saturating_sub(1);
        rq.h_nr_idle = rq.h_nr_idle.min(rq.nr_running);
        rq.nr_delayed = rq.nr_delayed.min(rq.nr_running);
        if rq.nr_running == 0 {
            rq.curr_is_idle = true;
        }
    }
    d(&mut rq.load_avg, t.load_avg);
    d(&mut rq.runnable_avg, t.runnable_avg);
    d(&mut rq.util_avg, t.util_avg);
    d(&mut rq.util_est, t.util_est);
}

impl Store {
    /// One periodic balance across the members of a cluster group.
    pub fn cluster_balance(
        &self,
        req: &ClusterBalanceRequest,
        now: Instant,
    ) -> Result<ClusterBalanceOutcome, FieldError> {
        let levels = &self.cluster.config.levels;
        let Some(li) = levels.iter().position(|l| l.label == req.level) else {
            let names: Vec<&str> = levels.iter().map(|l| l.label.as_str()).collect();
            return Err(FieldError::new(
                "cluster_level",
                format!(
                    "{} is not a level (levels: {})",
                    quote(&req.level),
                    names.join(", ")
                ),
            ));
        };
        let path: Vec<String> = req.group.split('/').map(str::to_string).collect();
        if path.len() != li + 1 {
            return Err(FieldError::new(
                "cluster_group",
                format!(
                    "{} must name {} label value(s) from the top, joined by '/'",
                    quote(&req.group),
                    li + 1
                ),
            ));
        }
        let Some(group) = self.cluster.group(&path) else {
            return Err(FieldError::new(
                "cluster_group",
                format!("no {} {} has nodes", req.level, quote(&req.group)),
            ));
        };
        let pct = levels[li].imbalance_pct;
        // The children: nodes at the last level, groups above it.
        let mut work: Vec<WorkNode> = Vec::new();
        let mut children: Vec<Vec<usize>> = Vec::new();
        let add_nodes = |ids: Vec<String>, work: &mut Vec<WorkNode>| -> Vec<usize> {
            let mut idx = Vec::new();
            for id in ids {
                let Some(n) = self.get(&id) else { continue };
                let snap = n.snapshot();
                if !self.is_fresh(&snap, now) {
                    continue;
                }
                idx.push(work.len());
                work.push(WorkNode {
                    id,
                    cpus: snap.state.cpus.clone(),
                    agg: snap.agg,
                    snap,
                    tasks: None,
                });
            }
            idx
        };
        if li + 1 == levels.len() {
            for id in group.all_nodes() {
                let v = add_nodes(vec![id], &mut work);
                if !v.is_empty() {
                    children.push(v);
                }
            }
        } else {
            for (_, c) in group.child_groups() {
                let v = add_nodes(c.all_nodes(), &mut work);
                if !v.is_empty() {
                    children.push(v);
                }
            }
        }
        let mut out = ClusterBalanceOutcome::default();
        let order: Vec<(usize, usize)> = children
            .iter()
            .enumerate()
            .flat_map(|(c, v)| v.iter().map(move |&i| (c, i)))
            .collect();
        let mut failed = self
            .cluster_lb
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        for (lc, dst) in order {
            if req.max_proposals != 0 && out.proposals.len() >= req.max_proposals {
                break;
            }
            self.cluster_balance_one(
                &req.level,
                pct,
                lc,
                dst,
                &children,
                &mut work,
                &mut failed,
                &mut out,
                req.max_proposals,
            );
        }
        drop(failed);
        if req.apply {
            let mut by_node: HashMap<&str, Vec<usize>> = HashMap::new();
            for p in &out.proposals {
                by_node.entry(&p.dst_node).or_default().push(p.dst_cpu);
            }
            let mut claimed = 0;
            for (id, cpus) in by_node {
                if let Some(n) = self.get(id) {
                    claimed += self.claim_cpus(&n, &cpus, now);
                }
            }
            out.claimed = claimed;
        }
        Ok(out)
    }

    /// `sched_balance_rq()` at a cluster level for destination node `dst`.
    #[allow(clippy::too_many_arguments)]
    fn cluster_balance_one(
        &self,
        level: &str,
        pct: u32,
        lc: usize,
        dst: usize,
        children: &[Vec<usize>],
        work: &mut [WorkNode],
        failed: &mut HashMap<(String, String), u32>,
        out: &mut ClusterBalanceOutcome,
        max: usize,
    ) {
        // should_we_balance(): the local group's first node with an idle
        // CPU balances for it, else its first node.
        let local_nodes = &children[lc];
        let key = (work[dst].id.clone(), level.to_string());
        let first_idle = local_nodes.iter().find(|&&i| work[i].agg.idle_cpus > 0);
        if first_idle.or(local_nodes.first()) != Some(&dst) {
            // out_balanced: a declined pass resets the failure count too.
            out.stats.domains_declined += 1;
            failed.insert(key, 0);
            return;
        }
        out.stats.domains_balanced += 1;
        let nr_failed = failed.get(&key).copied().unwrap_or(0);
        let dst_idle = work[dst].agg.idle_cpus > 0;
        let local_cpus: i64 = local_nodes.iter().map(|&i| work[i].agg.cpus).sum();
        let p = DomainParams {
            imbalance_pct: pct,
            numa: true,
            share_llc: false,
            asym_cpucapacity: false,
            imb_numa_nr: if local_nodes.len() == 1 {
                (local_cpus >> 3).max(1) as u32
            } else {
                local_nodes.len() as u32
            },
            dst_idle,
            dst_core_idle: dst_idle,
            dst_capacity: 1024,
        };
        let mut local = sg_stats(pct, local_nodes, work, false);
        let mut sds = SdTotals::default();
        let mut busiest: Option<usize> = None;
        let mut busiest_sgs = SgLbStats::NO_BUSIEST;
        for (c, nodes) in children.iter().enumerate() {
            let sgs = if c == lc {
                local
            } else {
                sg_stats(pct, nodes, work, false)
            };
            sds.total_load += sgs.group_load;
            sds.total_capacity += sgs.group_capacity;
            if c != lc && lb::update_sd_pick_busiest(&p, local.group_type, &busiest_sgs, &sgs) {
                busiest = Some(c);
                busiest_sgs = sgs;
            }
        }
        let decision =
            busiest.and_then(|_| lb::find_busiest_decision(&p, &mut sds, &mut local, &busiest_sgs));
        let (Some(b), Some(imb)) = (busiest, decision) else {
            failed.insert(key, 0);
            return;
        };
        let Some(src) = find_src_node(&children[b], work, imb.migration_type, imb.imbalance) else {
            failed.insert(key, 0);
            return;
        };
        let Some(src_cpu) = find_src_cpu(&work[src], imb.migration_type, imb.imbalance, pct) else {
            failed.insert(key, 0);
            return;
        };
        let dst_cpu = idlest_cpu(&work[dst]);
        // Only a runqueue with more than one task gives one away.
        if work[src].cpus[src_cpu].nr_running <= 1 {
            failed.insert(key, nr_failed + 1);
            return;
        }
        let mut imbalance = imb.imbalance;
        let shift = nr_failed.min(63);
        let cost = self.config.system.migration_cost_ns;
        let clock = work[src]
            .snap
            .tasks
            .clock
            .get(src_cpu)
            .copied()
            .unwrap_or(0);
        let loop_max = SCHED_NR_MIGRATE.min(work[src].cpus[src_cpu].nr_running);
        let mut moved = 0;
        let mut loops = 0;
        loop {
            if work[src].tasks()[src_cpu].is_empty() || imbalance <= 0 {
                break;
            }
            if dst_idle && work[src].cpus[src_cpu].nr_running <= 1 {
                break;
            }
            loops += 1;
            if loops > loop_max {
                break;
            }
            let t = work[src].tasks()[src_cpu].pop_back().expect("non-empty");
            let verdict = cross_node_can_migrate(&t, imb.migration_type, clock, cost, nr_failed);
            let forced_hot = match verdict {
                Ok(h) => h,
                Err(r) => {
                    out.stats.rejections[Reason::ALL.iter().position(|x| *x == r).unwrap_or(0)] +=
                        1;
                    work[src].tasks()[src_cpu].push_front(t);
                    continue;
                }
            };
            let amount = match imb.migration_type {
                MigrationType::Load => t.load_avg.max(1),
                MigrationType::Util => t.util_avg.max(t.util_est),
                _ => 1,
            };
            if matches!(
                imb.migration_type,
                MigrationType::Load | MigrationType::Util
            ) && (amount >> shift) > imbalance
            {
                work[src].tasks()[src_cpu].push_front(t);
                continue;
            }
            imbalance -= amount;
            moved += 1;
            // Dequeue on the source, enqueue on the destination.
            let before = (work[src].cpus[src_cpu], work[dst].cpus[dst_cpu]);
            move_task(&mut work[src].cpus[src_cpu], &t, -1);
            move_task(&mut work[dst].cpus[dst_cpu], &t, 1);
            for (w, cpu, old) in [(src, src_cpu, before.0), (dst, dst_cpu, before.1)] {
                let wn = &mut work[w];
                let (topo, ue) = (&wn.snap.topo, wn.snap.features.util_est);
                wn.agg.add_cpu(topo, cpu, &old, ue, -1);
                wn.agg.add_cpu(topo, cpu, &wn.cpus[cpu], ue, 1);
            }
            out.proposals.push(ClusterProposal {
                task: t.id,
                group: t.group,
                src_node: work[src].id.clone(),
                src_cpu,
                dst_node: work[dst].id.clone(),
                dst_cpu,
                migration_type: imb.migration_type,
                level: level.to_string(),
                busiest: busiest_sgs.group_type,
                local: local.group_type,
                imbalance: imb.imbalance,
                forced_hot,
                nr_balance_failed: nr_failed,
            });
            let mut t = t;
            t.running = false;
            t.allowed = 0;
            if let Some(l) = work[dst].tasks.as_mut() {
                l[dst_cpu].push_front(t);
            }
            if max != 0 && out.proposals.len() >= max {
                break;
            }
        }
        failed.insert(key, if moved > 0 { 0 } else { nr_failed + 1 });
    }
}

/// The busiest node of the busiest group, in migration-type units.
fn find_src_node(
    nodes: &[usize],
    work: &[WorkNode],
    ty: MigrationType,
    imbalance: i64,
) -> Option<usize> {
    let mut best = None;
    let (mut b_load, mut b_cap, mut b_val) = (0i64, 1i64, 0i64);
    for &i in nodes {
        let a = &work[i].agg;
        if a.nr_running == 0 {
            continue;
        }
        match ty {
            MigrationType::Load => {
                if a.nr_running == 1 && a.load > imbalance {
                    continue;
                }
                // i128: a node's load times a capacity can pass 2^63.
                if (a.load as i128) * (b_cap as i128)
                    > (b_load as i128) * (a.capacity.max(1) as i128)
                {
                    (b_load, b_cap, best) = (a.load, a.capacity.max(1), Some(i));
                }
            }
            MigrationType::Util => {
                if a.nr_running <= 1 {
                    continue;
                }
                if a.util > b_val {
                    (b_val, best) = (a.util, Some(i));
                }
            }
            _ => {
                if a.nr_running > b_val {
                    (b_val, best) = (a.nr_running, Some(i));
                }
            }
        }
    }
    best
}

/// `sched_balance_find_src_rq()` over all of a node's CPUs.
fn find_src_cpu(w: &WorkNode, ty: MigrationType, imbalance: i64, pct: u32) -> Option<usize> {
    let topo = &w.snap.topo;
    let mut best = None;
    let (mut b_load, mut b_cap, mut b_val) = (0u64, 1u64, 0u64);
    for (i, rq) in w.cpus.iter().enumerate() {
        if !topo.online.test(i) {
            continue;
        }
        let nr = h_nr_runnable(rq);
        if nr == 0 {
            continue;
        }
        let cap = rq.capacity as u64;
        match ty {
            MigrationType::Load => {
                let load = rq.load_avg as u64;
                let reduced = cap * (pct as u64) < (topo.capacity_orig(i) as u64) * 100;
                if nr == 1 && load as i64 > imbalance && !reduced {
                    continue;
                }
                if load * b_cap > b_load * cap {
                    (b_load, b_cap, best) = (load, cap, Some(i));
                }
            }
            MigrationType::Util => {
                if nr <= 1 {
                    continue;
                }
                let u = cpu_util_cfs_boost(topo, rq, i, w.snap.features.util_est);
                if u > b_val {
                    (b_val, best) = (u, Some(i));
                }
            }
            _ => {
                if nr as u64 > b_val {
                    (b_val, best) = (nr as u64, Some(i));
                }
            }
        }
    }
    best
}

/// Where a task pulled to this node lands: its first idle CPU, else the CPU
/// with the least load for its capacity.
fn idlest_cpu(w: &WorkNode) -> usize {
    let topo = &w.snap.topo;
    let online = |i: &usize| topo.online.test(*i);
    if let Some(i) = (0..w.cpus.len())
        .filter(online)
        .find(|&i| w.cpus[i].available_idle())
    {
        return i;
    }
    (0..w.cpus.len())
        .filter(online)
        .min_by_key(|&i| {
            (w.cpus[i].load_avg.max(0) as u64 * 1024) / w.cpus[i].capacity.max(1) as u64
        })
        .unwrap_or(0)
}

/// `can_migrate_task()` between machines: a task bound to CPUs (or with
/// migration disabled) is bound to its node; hotness is the kernel's test,
/// forgiven after `CLUSTER_CACHE_NICE_TRIES` failed passes. `Ok(forced_hot)`.
fn cross_node_can_migrate(
    t: &RqTask,
    ty: MigrationType,
    clock: i64,
    cost: i64,
    nr_failed: u32,
) -> Result<bool, Reason> {
    if t.sched_delayed && ty != MigrationType::Load {
        return Err(Reason::Delayed);
    }
    if t.per_cpu_kthread {
        return Err(Reason::PerCpuKthread);
    }
    if t.allowed != 0 || t.migration_disabled {
        return Err(Reason::Affinity);
    }
    if t.running {
        return Err(Reason::Running);
    }
    let hot = if t.policy == crate::engine::state::Policy::Idle {
        false
    } else if cost == -1 {
        true
    } else if cost == 0 || clock == 0 {
        false
    } else {
        clock - t.exec_start < cost
    };
    if !hot {
        return Ok(false);
    }
    if nr_failed > CLUSTER_CACHE_NICE_TRIES {
        return Ok(true);
    }
    Err(Reason::Hot)
}
