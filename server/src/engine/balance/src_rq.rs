//! The runqueue-level rules of a balance pass that do not depend on what a
//! group is made of: which runqueue is the busiest in the migration type's
//! units (`sched_balance_find_src_rq()`'s comparisons) and how much of the
//! imbalance a detached task covers (`detach_tasks()`'s per-type test).
//!
//! The node balancer applies them to CPUs; the cluster balancer applies the
//! same comparisons first to the busiest group's nodes, then to the chosen
//! node's CPUs, so both pick a source by one definition.

use crate::engine::rq::RqTask;
use crate::engine::state::CpuState;

use super::migrate::MigrationType;

/// The running maximum of `sched_balance_find_src_rq()`: the first maximum
/// wins, loads compare relative to capacity.
#[derive(Debug, Clone, Copy)]
pub struct BusiestRq {
    pub busiest: Option<usize>,
    load: u64,
    capacity: u64,
    util: u64,
    nr: u64,
}

impl Default for BusiestRq {
    fn default() -> Self {
        Self {
            busiest: None,
            load: 0,
            capacity: 1,
            util: 0,
            nr: 0,
        }
    }
}

impl BusiestRq {
    /// `migrate_load`: the highest load per capacity. A runqueue whose only
    /// task would overshoot the imbalance is passed over unless its capacity
    /// is reduced (`check_cpu_capacity()`): moving it would gain nothing.
    #[inline]
    pub fn consider_load(
        &mut self,
        i: usize,
        nr: u64,
        load: u64,
        capacity: u64,
        reduced: bool,
        imbalance: i64,
    ) {
        if nr == 1 && load as i128 > imbalance as i128 && !reduced {
            return;
        }
        // u128: a node's load times a capacity can pass 2^64.
        if (load as u128) * (self.capacity as u128) > (self.load as u128) * (capacity as u128) {
            (self.load, self.capacity, self.busiest) = (load, capacity, Some(i));
        }
    }

    /// `migrate_util`: the highest (boosted) utilisation among runqueues
    /// with more than one task.
    #[inline]
    pub fn consider_util(&mut self, i: usize, nr: u64, util: u64) {
        if nr <= 1 {
            return;
        }
        if self.util < util {
            (self.util, self.busiest) = (util, Some(i));
        }
    }

    /// `migrate_task` and `migrate_llc_task`: the most tasks (of the kind
    /// the type counts).
    #[inline]
    pub fn consider_count(&mut self, i: usize, n: u64) {
        if self.nr < n {
            (self.nr, self.busiest) = (n, Some(i));
        }
    }

    /// `migrate_misfit`: the largest misfit load.
    #[inline]
    pub fn consider_misfit(&mut self, i: usize, misfit_load: u64) {
        if misfit_load > self.load {
            (self.load, self.busiest) = (misfit_load, Some(i));
        }
    }
}

/// `detach_tasks()`'s test of one task against what is left of the
/// imbalance: the amount it covers, or `None` to leave it. Load and
/// utilisation relax by `>> nr_balance_failed`; a count type takes any
/// task. Misfit needs the task's fit, which only the caller can tell.
#[inline]
pub fn detach_amount(ty: MigrationType, t: &RqTask, shift: u32, imbalance: i64) -> Option<i64> {
    let v = match ty {
        MigrationType::Load => t.load_avg.max(1),
        MigrationType::Util => t.util_avg.max(t.util_est),
        MigrationType::Task | MigrationType::LlcTask => return Some(1),
        MigrationType::Misfit => return None,
    };
    if (v >> shift.min(63)) > imbalance {
        None
    } else {
        Some(v)
    }
}

/// `check_cpu_capacity()`: RT, IRQ or pressure took a noticeable share of
/// the CPU (more than the domain's imbalance_pct allows).
#[inline]
pub fn check_cpu_capacity(rq: &CpuState, capacity_orig: u32, imbalance_pct: u32) -> bool {
    (rq.capacity as u64) * (imbalance_pct as u64) < capacity_orig as u64 * 100
}
