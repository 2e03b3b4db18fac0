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

mod account;
mod llc_view;

pub use account::*;
pub use llc_view::*;
