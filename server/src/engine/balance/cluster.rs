//! The periodic balancer run at a cluster level: the groups are a rack's
//! nodes (or a zone's racks), and a node plays the part a CPU's LLC plays
//! inside a machine.
//!
//! Each node of the level takes the part of a destination in turn and runs
//! `sched_balance_rq()`'s steps with the node balancer's own definitions:
//! `should_we_balance()` (the local group's first node with an idle CPU,
//! else its first node), the group statistics and their classification
//! ([`crate::engine::group`]), `update_sd_pick_busiest()`, the balanced-or-not
//! decision and `calculate_imbalance()` ([`super::lb`]), the busiest
//! runqueue by the same comparisons ([`super::src_rq`]) applied to the
//! busiest group's nodes and then to that node's CPUs, `detach_tasks()`'s
//! per-type amount, and the runqueue arithmetic of a move
//! ([`crate::engine::rq`]). What differs is only what a machine boundary
//! changes: a task bound to CPUs (or with migration disabled) is bound to
//! its node, every level behaves like a NUMA level (no prefer-sibling, the
//! NUMA imbalance allowance, `cache_nice_tries` 2), and a pulled task lands
//! on the destination node's idlest CPU.
//!
//! A pass works on private copies of the members' states, so later
//! destinations see earlier moves; the caller decides what to store.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::engine::group::NodeAgg;
use crate::engine::group::{GroupType, SgLbStats, finish_lb_stats, wakeup_stats};
use crate::engine::rq::{RqTask, TaskTable, h_nr_runnable, rq_add, rq_sub};
use crate::engine::state::{CpuState, GroupSum, Policy, cpu_util};
use crate::engine::topology::Topology;

use super::lb::{self, DomainParams, Imbalance, SdTotals};
use super::migrate::{MigrationType, Reason};
use super::src_rq::{BusiestRq, check_cpu_capacity, detach_amount};
use super::{PassStats, SCHED_NR_MIGRATE};

/// `cache_nice_tries` of the cluster levels (as a NUMA level's).
pub const CLUSTER_CACHE_NICE_TRIES: u32 = 2;

/// Failed passes per (destination node, level), kept between passes like a
/// domain's `nr_balance_failed`.
pub type ClusterFailures = HashMap<(String, String), u32>;

/// One node taking part in a pass: its reported state as last published.
#[derive(Debug, Clone)]
pub struct ClusterMember {
    pub id: String,
    pub topo: Arc<Topology>,
    pub cpus: Vec<CpuState>,
    pub tasks: Arc<TaskTable>,
    pub util_est: bool,
    pub agg: NodeAgg,
}

/// The level a pass runs at.
#[derive(Debug, Clone)]
pub struct ClusterLevel {
    /// The hierarchy label (`zone`, `rack`).
    pub label: String,
    pub imbalance_pct: u32,
    /// `sysctl_sched_migration_cost` for the hotness test, ns.
    pub migration_cost_ns: i64,
    /// Stop after this many proposals (0 = no limit).
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

/// A member's private copy for the pass; its task lists are copied when it
/// first becomes a source.
struct WorkNode {
    m: ClusterMember,
    lists: Option<Vec<VecDeque<RqTask>>>,
}

impl WorkNode {
    fn lists(&mut self) -> &mut Vec<VecDeque<RqTask>> {
        let table = &self.m.tasks;
        self.lists.get_or_insert_with(|| {
            table
                .cpus
                .iter()
                .map(|l| l.iter().cloned().collect())
                .collect()
        })
    }
}

/// One pass at a level: the groups (`children`, indices into `members`),
/// each member balancing for its group in turn.
pub fn cluster_balance(
    level: &ClusterLevel,
    members: Vec<ClusterMember>,
    children: &[Vec<usize>],
    failed: &mut ClusterFailures,
) -> ClusterBalanceOutcome {
    let mut pass = ClusterPass {
        level,
        children,
        work: members
            .into_iter()
            .map(|m| WorkNode { m, lists: None })
            .collect(),
        failed,
        out: ClusterBalanceOutcome::default(),
    };
    for (lc, nodes) in children.iter().enumerate() {
        for &dst in nodes {
            if pass.full() {
                return pass.out;
            }
            pass.sched_balance_rq(lc, dst);
        }
    }
    pass.out
}

/// What the source search settled on.
struct Source {
    busiest: GroupType,
    local: GroupType,
    imb: Imbalance,
    node: usize,
    cpu: usize,
}

struct ClusterPass<'a> {
    level: &'a ClusterLevel,
    children: &'a [Vec<usize>],
    work: Vec<WorkNode>,
    failed: &'a mut ClusterFailures,
    out: ClusterBalanceOutcome,
}

impl ClusterPass<'_> {
    fn full(&self) -> bool {
        self.level.max_proposals != 0 && self.out.proposals.len() >= self.level.max_proposals
    }

    fn key(&self, dst: usize) -> (String, String) {
        (self.work[dst].m.id.clone(), self.level.label.clone())
    }

    /// `sched_balance_rq()` for destination node `dst` of local group `lc`.
    fn sched_balance_rq(&mut self, lc: usize, dst: usize) {
        let key = self.key(dst);
        if !self.should_we_balance(lc, dst) {
            // out_balanced: a declined pass resets the failure count too.
            self.out.stats.domains_declined += 1;
            self.failed.insert(key, 0);
            return;
        }
        self.out.stats.domains_balanced += 1;
        let nr_failed = self.failed.get(&key).copied().unwrap_or(0);
        let Some(src) = self.find_source(lc, dst) else {
            self.failed.insert(key, 0);
            return;
        };
        // Only a runqueue with more than one task gives one away.
        if self.work[src.node].m.cpus[src.cpu].nr_running <= 1 {
            self.failed.insert(key, nr_failed + 1);
            return;
        }
        let moved = self.detach_tasks(&src, dst, nr_failed);
        self.failed
            .insert(key, if moved > 0 { 0 } else { nr_failed + 1 });
    }

    /// `should_we_balance()`: the local group's first node with an idle CPU
    /// balances for it, else its first node.
    fn should_we_balance(&self, lc: usize, dst: usize) -> bool {
        let local = &self.children[lc];
        let first_idle = local
            .iter()
            .find(|&&i| self.work[i].m.agg.sum.idle_cpus > 0);
        first_idle.or(local.first()) == Some(&dst)
    }

    /// The level's facts for destination `dst`: a NUMA level whose
    /// `imb_numa_nr` is the local group's node count (an eighth of its CPUs
    /// for a one-node group), as in cluster placement.
    fn domain_params(&self, lc: usize, dst: usize) -> DomainParams {
        let local = &self.children[lc];
        let local_cpus: i64 = local.iter().map(|&i| self.work[i].m.agg.sum.cpus).sum();
        let dst_idle = self.work[dst].m.agg.sum.idle_cpus > 0;
        DomainParams {
            imbalance_pct: self.level.imbalance_pct,
            numa: true,
            share_llc: false,
            asym_cpucapacity: false,
            imb_numa_nr: if local.len() == 1 {
                (local_cpus >> 3).max(1) as u32
            } else {
                local.len() as u32
            },
            dst_idle,
            dst_core_idle: dst_idle,
            dst_capacity: 1024,
        }
    }

    /// `update_sg_lb_stats()` over a group of nodes: their sums, one "core"
    /// per CPU (nodes carry no SMT flag at this level).
    fn update_sg_lb_stats(&self, nodes: &[usize]) -> SgLbStats {
        let mut sum = GroupSum::default();
        for &i in nodes {
            sum.add(&self.work[i].m.agg.sum, 1);
        }
        let weight = sum.cpus.clamp(0, u32::MAX as i64) as u32;
        let mut s = wakeup_stats(&sum, weight);
        s.cores = weight;
        finish_lb_stats(self.level.imbalance_pct, &mut s);
        s
    }

    /// `sched_balance_find_src_group()` and `sched_balance_find_src_rq()`:
    /// the busiest group, whether to balance and by how much, then its
    /// busiest node and that node's busiest CPU.
    fn find_source(&self, lc: usize, dst: usize) -> Option<Source> {
        let p = self.domain_params(lc, dst);
        let mut local = self.update_sg_lb_stats(&self.children[lc]);
        let mut sds = SdTotals::default();
        let mut busiest: Option<usize> = None;
        let mut busiest_sgs = SgLbStats::NO_BUSIEST;
        for (c, nodes) in self.children.iter().enumerate() {
            let sgs = if c == lc {
                local
            } else {
                self.update_sg_lb_stats(nodes)
            };
            sds.total_load += sgs.group_load;
            sds.total_capacity += sgs.group_capacity;
            if c != lc && lb::update_sd_pick_busiest(&p, local.group_type, &busiest_sgs, &sgs) {
                busiest = Some(c);
                busiest_sgs = sgs;
            }
        }
        let b = busiest?;
        let imb = lb::find_busiest_decision(&p, &mut sds, &mut local, &busiest_sgs)?;
        let node = self.find_src_node(&self.children[b], imb.migration_type, imb.imbalance)?;
        let cpu = self.find_src_cpu(node, imb.migration_type, imb.imbalance)?;
        Some(Source {
            busiest: busiest_sgs.group_type,
            local: local.group_type,
            imb,
            node,
            cpu,
        })
    }

    /// The busiest node of the busiest group: the runqueue comparisons with
    /// each node's sums standing for one runqueue.
    fn find_src_node(&self, nodes: &[usize], ty: MigrationType, imbalance: i64) -> Option<usize> {
        let mut best = BusiestRq::default();
        for &i in nodes {
            let a = &self.work[i].m.agg.sum;
            if a.nr_running <= 0 {
                continue;
            }
            let nr = a.nr_running as u64;
            match ty {
                MigrationType::Load => best.consider_load(
                    i,
                    nr,
                    a.load as u64,
                    a.capacity.max(1) as u64,
                    false,
                    imbalance,
                ),
                MigrationType::Util => best.consider_util(i, nr, a.util as u64),
                _ => best.consider_count(i, nr),
            }
        }
        best.busiest
    }

    /// `sched_balance_find_src_rq()` over all of a node's online CPUs.
    fn find_src_cpu(&self, node: usize, ty: MigrationType, imbalance: i64) -> Option<usize> {
        let m = &self.work[node].m;
        let mut best = BusiestRq::default();
        for (i, rq) in m.cpus.iter().enumerate() {
            if !m.topo.online.test(i) {
                continue;
            }
            let nr = h_nr_runnable(rq) as u64;
            if nr == 0 {
                continue;
            }
            let orig = m.topo.capacity_orig(i);
            match ty {
                MigrationType::Load => {
                    let reduced = check_cpu_capacity(rq, orig, self.level.imbalance_pct);
                    best.consider_load(
                        i,
                        nr,
                        rq.load_avg as u64,
                        rq.capacity as u64,
                        reduced,
                        imbalance,
                    )
                }
                MigrationType::Util => {
                    best.consider_util(i, nr, cpu_util(rq, orig, m.util_est, true, None) as u64)
                }
                _ => best.consider_count(i, nr),
            }
        }
        best.busiest
    }

    /// `detach_tasks()` from the source CPU to the destination node's
    /// idlest CPU, coldest first, until the imbalance is covered. Returns
    /// the tasks moved.
    fn detach_tasks(&mut self, src: &Source, dst: usize, nr_failed: u32) -> u32 {
        let dst_cpu = idlest_cpu(&self.work[dst].m);
        let dst_idle = self.work[dst].m.agg.sum.idle_cpus > 0;
        let ty = src.imb.migration_type;
        let mut imbalance = src.imb.imbalance;
        let clock = self.work[src.node]
            .m
            .tasks
            .clock
            .get(src.cpu)
            .copied()
            .unwrap_or(0);
        let loop_max = SCHED_NR_MIGRATE.min(self.work[src.node].m.cpus[src.cpu].nr_running);
        let (mut moved, mut loops) = (0, 0);
        while !self.work[src.node].lists()[src.cpu].is_empty() && imbalance > 0 {
            if dst_idle && self.work[src.node].m.cpus[src.cpu].nr_running <= 1 {
                break;
            }
            loops += 1;
            if loops > loop_max {
                break;
            }
            let t = self.work[src.node].lists()[src.cpu]
                .pop_back()
                .expect("non-empty");
            let cost = self.level.migration_cost_ns;
            let forced_hot = match cross_node_can_migrate(&t, ty, clock, cost, nr_failed) {
                Ok(h) => h,
                Err(r) => {
                    let k = Reason::ALL.iter().position(|x| *x == r).unwrap_or(0);
                    self.out.stats.rejections[k] += 1;
                    self.work[src.node].lists()[src.cpu].push_front(t);
                    continue;
                }
            };
            let Some(amount) = detach_amount(ty, &t, nr_failed, imbalance) else {
                self.work[src.node].lists()[src.cpu].push_front(t);
                continue;
            };
            imbalance -= amount;
            moved += 1;
            self.move_task(src, dst, dst_cpu, t, forced_hot, nr_failed);
            if self.full() {
                break;
            }
        }
        moved
    }

    /// Dequeues `t` from the source, enqueues it on the destination, keeps
    /// both nodes' sums current and records the proposal.
    fn move_task(
        &mut self,
        src: &Source,
        dst: usize,
        dst_cpu: usize,
        mut t: RqTask,
        forced_hot: bool,
        nr_failed: u32,
    ) {
        for (w, cpu, add) in [(src.node, src.cpu, false), (dst, dst_cpu, true)] {
            let wn = &mut self.work[w];
            let old = wn.m.cpus[cpu];
            if add {
                rq_add(&mut wn.m.cpus[cpu], &t);
            } else {
                rq_sub(&mut wn.m.cpus[cpu], &t);
            }
            let (topo, ue) = (&wn.m.topo, wn.m.util_est);
            wn.m.agg.add_cpu(topo, cpu, &old, ue, -1);
            wn.m.agg.add_cpu(topo, cpu, &wn.m.cpus[cpu], ue, 1);
        }
        self.out.proposals.push(ClusterProposal {
            task: t.id,
            group: t.group,
            src_node: self.work[src.node].m.id.clone(),
            src_cpu: src.cpu,
            dst_node: self.work[dst].m.id.clone(),
            dst_cpu,
            migration_type: src.imb.migration_type,
            level: self.level.label.clone(),
            busiest: src.busiest,
            local: src.local,
            imbalance: src.imb.imbalance,
            forced_hot,
            nr_balance_failed: nr_failed,
        });
        // On its new node the task is not running and may use every CPU.
        t.running = false;
        t.allowed = 0;
        if let Some(l) = self.work[dst].lists.as_mut() {
            l[dst_cpu].push_front(t);
        }
    }
}

/// Where a task pulled to a node lands: its first idle CPU, else the CPU
/// with the least load for its capacity.
fn idlest_cpu(m: &ClusterMember) -> usize {
    let online = |i: &usize| m.topo.online.test(*i);
    if let Some(i) = (0..m.cpus.len())
        .filter(online)
        .find(|&i| m.cpus[i].available_idle())
    {
        return i;
    }
    (0..m.cpus.len())
        .filter(online)
        .min_by_key(|&i| (m.cpus[i].load_avg as u64 * 1024) / m.cpus[i].capacity.max(1) as u64)
        .unwrap_or(0)
}

/// `can_migrate_task()` between machines: a task bound to CPUs (or with
/// migration disabled) is bound to its node; hotness is the kernel's time
/// test (no clock: cold), forgiven after `CLUSTER_CACHE_NICE_TRIES` failed
/// passes. `Ok(forced_hot)`.
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
    let hot = if t.policy == Policy::Idle {
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
