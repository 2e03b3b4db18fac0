//! Scheduling groups: the one definition of what fair.c says about a group
//! of CPUs, shared by the fork/exec slow path, the periodic balancer and the
//! cluster levels (where a node plays an LLC's part).
//!
//! The kernel has one `enum group_type`, one `struct sg_lb_stats`, one
//! `group_classify()` and one `update_pick_idlest()`; the wakeup statistics
//! (`update_sg_wakeup_stats()`) and the balancer's (`update_sg_lb_stats()`)
//! fill the same structure and differ only in which fields they set. The
//! same holds here: [`SgLbStats`] is filled by either, [`group_classify`]
//! reads it, and [`wakeup_stats`] turns a [`GroupSum`] (the running sums a
//! group's statistics are made from, whether its members are CPUs or whole
//! nodes) into it.

use super::state::{CpuState, GroupSum, NodeState};
use super::topology::Topology;

/// `enum group_type`, in the kernel's numeric order (lower = idler).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GroupType {
    #[default]
    HasSpare = 0,
    FullyBusy = 1,
    MisfitTask = 2,
    SmtBalance = 3,
    AsymPacking = 4,
    Imbalanced = 5,
    LlcBalance = 6,
    Overloaded = 7,
}

impl GroupType {
    pub fn as_str(self) -> &'static str {
        match self {
            GroupType::HasSpare => "has_spare",
            GroupType::FullyBusy => "fully_busy",
            GroupType::MisfitTask => "misfit_task",
            GroupType::SmtBalance => "smt_balance",
            GroupType::AsymPacking => "asym_packing",
            GroupType::Imbalanced => "imbalanced",
            GroupType::LlcBalance => "llc_balance",
            GroupType::Overloaded => "overloaded",
        }
    }
}

/// `struct sg_lb_stats` plus the group attributes the decisions read
/// (`sg->flags`, `sg->cores`, `sgc->min/max_capacity`, `sgc->imbalance`).
/// The wakeup statistics leave the balancer-only fields at their defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SgLbStats {
    pub avg_load: u64,
    pub group_load: u64,
    pub group_capacity: u64,
    pub group_util: u64,
    pub group_runnable: u64,
    pub sum_nr_running: u32,
    pub sum_h_nr_running: u32,
    pub idle_cpus: u32,
    pub group_weight: u32,
    pub group_type: GroupType,
    pub group_misfit_task_load: u64,
    pub group_smt_balance: bool,
    pub group_asym_packing: bool,
    pub group_llc_balance: bool,
    /// Tasks queued in the group that prefer the destination's LLC.
    pub nr_pref_dst_llc: u32,
    /// `sgc->imbalance`: affinity kept the level below from balancing.
    pub sgc_imbalance: bool,
    pub cores: u32,
    /// `sg->flags & SD_SHARE_CPUCAPACITY`: an SMT core.
    pub smt: bool,
    /// `sg->flags & SD_PREFER_SIBLING`.
    pub prefer_sibling: bool,
    pub min_capacity: u64,
    pub max_capacity: u64,
}

impl SgLbStats {
    /// What `update_sd_pick_busiest()` starts from: no group, and an idle
    /// count nothing can beat.
    pub const NO_BUSIEST: SgLbStats = SgLbStats {
        avg_load: 0,
        group_load: 0,
        group_capacity: 0,
        group_util: 0,
        group_runnable: 0,
        sum_nr_running: 0,
        sum_h_nr_running: 0,
        idle_cpus: u32::MAX,
        group_weight: 0,
        group_type: GroupType::HasSpare,
        group_misfit_task_load: 0,
        group_smt_balance: false,
        group_asym_packing: false,
        group_llc_balance: false,
        nr_pref_dst_llc: 0,
        sgc_imbalance: false,
        cores: 0,
        smt: false,
        prefer_sibling: false,
        min_capacity: 0,
        max_capacity: 0,
    };

    /// What `sched_balance_find_dst_group()` starts the idlest search from:
    /// the worst possible group.
    pub const WORST_IDLEST: SgLbStats = SgLbStats {
        group_type: GroupType::Overloaded,
        avg_load: u32::MAX as u64,
        idle_cpus: 0,
        ..SgLbStats::NO_BUSIEST
    };
}

fn group_is_overloaded(pct: u64, s: &SgLbStats) -> bool {
    if s.sum_nr_running <= s.group_weight {
        return false;
    }
    s.group_capacity * 100 < s.group_util * pct || s.group_capacity * pct < s.group_runnable * 100
}

fn group_has_capacity(pct: u64, s: &SgLbStats) -> bool {
    if s.sum_nr_running < s.group_weight {
        return true;
    }
    if s.group_capacity * pct < s.group_runnable * 100 {
        return false;
    }
    s.group_capacity * 100 > s.group_util * pct
}

/// `group_classify()`: the tests run in this order, not in numeric order.
/// The wakeup statistics set only `sgc_imbalance` of the balancer's flags,
/// so for them overloaded, imbalanced, misfit, fully busy and has-spare can
/// come out.
pub fn group_classify(pct: u32, s: &SgLbStats) -> GroupType {
    let pct = pct as u64;
    if group_is_overloaded(pct, s) {
        GroupType::Overloaded
    } else if s.group_llc_balance {
        GroupType::LlcBalance
    } else if s.sgc_imbalance {
        GroupType::Imbalanced
    } else if s.group_asym_packing {
        GroupType::AsymPacking
    } else if s.group_smt_balance {
        GroupType::SmtBalance
    } else if s.group_misfit_task_load != 0 {
        GroupType::MisfitTask
    } else if !group_has_capacity(pct, s) {
        GroupType::FullyBusy
    } else {
        GroupType::HasSpare
    }
}

/// The end of `update_sg_lb_stats()`: classify; only an overloaded group's
/// average load is computed there.
pub fn finish_lb_stats(pct: u32, s: &mut SgLbStats) {
    s.group_type = group_classify(pct, s);
    if s.group_type == GroupType::Overloaded {
        s.avg_load = s.group_load * 1024 / s.group_capacity.max(1);
    }
}

/// The end of `update_sg_wakeup_stats()`: classify, then the average load
/// of a fully busy or overloaded group.
pub fn finish_wakeup_stats(pct: u32, s: &mut SgLbStats) {
    s.group_type = group_classify(pct, s);
    if matches!(s.group_type, GroupType::FullyBusy | GroupType::Overloaded) {
        s.avg_load = s.group_load * 1024 / s.group_capacity.max(1);
    }
}

/// `update_pick_idlest()`: is `cand` a better target than the idlest so far?
pub fn update_pick_idlest(idlest: &SgLbStats, cand: &SgLbStats) -> bool {
    if cand.group_type != idlest.group_type {
        return cand.group_type < idlest.group_type;
    }
    match cand.group_type {
        GroupType::Overloaded | GroupType::FullyBusy => cand.avg_load < idlest.avg_load,
        GroupType::MisfitTask => cand.max_capacity > idlest.max_capacity,
        GroupType::HasSpare => {
            cand.idle_cpus > idlest.idle_cpus
                || (cand.idle_cpus == idlest.idle_cpus && cand.group_util < idlest.group_util)
        }
        // Imbalanced, asym packing, SMT balance: "not used in the slow
        // wakeup path", so an equal group never replaces the idlest.
        _ => false,
    }
}

/// `adjust_numa_imbalance()`: a small imbalance is allowed while the
/// destination runs few tasks.
pub fn adjust_numa_imbalance(imbalance: i64, dst_running: i64, imb_numa_nr: i64) -> i64 {
    if dst_running > imb_numa_nr {
        return imbalance;
    }
    if imbalance <= 2 {
        return 0;
    }
    imbalance
}

/// What the task's NUMA preference says about the two groups
/// (`p->numa_preferred_nid` against the local CPU's and the idlest group's
/// node). Cluster levels have none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NumaPref {
    None,
    /// The local CPU is on the preferred node.
    Local,
    /// The idlest group starts on the preferred node.
    Idlest,
}

/// A domain's facts the local-versus-idlest rule reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DstDomain {
    pub imbalance_pct: u32,
    /// `sd->flags & SD_NUMA`.
    pub numa: bool,
    /// `min(|local ∩ p->cpus_ptr|, sd->imb_numa_nr)`: the tasks the local
    /// group may run before a small idle difference counts.
    pub allowed: i64,
    pub pref: NumaPref,
}

/// The end of `sched_balance_find_dst_group()`: is the idlest remote group
/// enough better than the local one to leave it? On NUMA domains (and at
/// every cluster level) a small idle-CPU difference is allowed while the
/// local group runs few tasks, and a fully busy or overloaded local group
/// is left only for a clearly lighter one.
pub fn leave_local_group(d: &DstDomain, local: &SgLbStats, idlest: &SgLbStats) -> bool {
    if local.group_type != idlest.group_type {
        return local.group_type > idlest.group_type;
    }
    let pct = d.imbalance_pct as u64;
    match local.group_type {
        GroupType::Overloaded | GroupType::FullyBusy => {
            let imb = 1024 * (pct - 100) / 100;
            if d.numa && idlest.avg_load + imb >= local.avg_load {
                return false;
            }
            if idlest.avg_load >= local.avg_load + imb {
                return false;
            }
            100 * local.avg_load > pct * idlest.avg_load
        }
        GroupType::MisfitTask => local.max_capacity < idlest.max_capacity,
        GroupType::HasSpare => {
            if d.numa {
                match d.pref {
                    NumaPref::Local => return false,
                    NumaPref::Idlest => return true,
                    NumaPref::None => {}
                }
                let imb = (local.idle_cpus as i64 - idlest.idle_cpus as i64).abs();
                if adjust_numa_imbalance(imb, local.sum_nr_running as i64 + 1, d.allowed) == 0 {
                    return false;
                }
            }
            local.idle_cpus < idlest.idle_cpus
        }
        // Imbalanced (and the balancer-only types): stay in the local group.
        _ => false,
    }
}

/// A group's sums as `update_sg_wakeup_stats()` statistics of a group of
/// `weight` CPUs (not yet classified).
pub fn wakeup_stats(sum: &GroupSum, weight: u32) -> SgLbStats {
    let u = |v: i64| v.max(0) as u64;
    let n = |v: i64| v.clamp(0, u32::MAX as i64) as u32;
    SgLbStats {
        group_load: u(sum.load),
        group_capacity: u(sum.capacity),
        group_util: u(sum.util),
        group_runnable: u(sum.runnable),
        sum_nr_running: n(sum.nr_running),
        sum_h_nr_running: n(sum.nr_running),
        idle_cpus: n(sum.idle_cpus),
        group_weight: weight,
        max_capacity: u(sum.max_capacity),
        min_capacity: u(sum.max_capacity),
        ..SgLbStats::default()
    }
}

/// What one node contributes to its groups: its [`GroupSum`] over its
/// online CPUs, and its topology's CPU count (a task whose lowest allowed
/// CPU is beyond it cannot run on this node).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeAgg {
    pub sum: GroupSum,
    pub nr_cpus: i64,
}

impl NodeAgg {
    /// The node's sums from its per-CPU state.
    pub fn of(topo: &Topology, st: &NodeState, util_est: bool) -> NodeAgg {
        let mut a = NodeAgg {
            nr_cpus: topo.nr_cpus as i64,
            ..NodeAgg::default()
        };
        for (i, c) in st.cpus.iter().enumerate() {
            if !c.online {
                continue;
            }
            a.sum.cpus += 1;
            a.add_cpu(topo, i, c, util_est, 1);
            a.sum.max_capacity = a.sum.max_capacity.max(c.capacity as i64);
        }
        a
    }

    /// Adds (`sign` 1) or removes (-1) one online CPU's share of the sums
    /// (not its count or the maximum capacity).
    #[inline]
    pub fn add_cpu(&mut self, topo: &Topology, i: usize, c: &CpuState, util_est: bool, sign: i64) {
        self.sum.add_cpu(c, topo.capacity_orig(i), util_est, sign);
    }

    /// The node (or group) as classified wakeup statistics at a level of
    /// `imbalance_pct`: a group of nodes is a group of their CPUs.
    pub fn stats(&self, imbalance_pct: u32) -> SgLbStats {
        let weight = self.sum.cpus.clamp(0, u32::MAX as i64) as u32;
        let mut s = wakeup_stats(&self.sum, weight);
        finish_wakeup_stats(imbalance_pct, &mut s);
        s
    }
}
