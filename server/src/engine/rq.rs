//! The runnable tasks of each CPU, as the agent reports them, and the
//! arithmetic of moving one between two working copies of runqueues.
//!
//! The balancer (node and cluster) detaches and attaches these; the
//! cache-aware accounting reads them. Both sit above this module, so it
//! knows neither.

use std::collections::HashMap;
use std::sync::Arc;

use super::cpumask::CpuMask;
use super::state::{CpuState, Policy, Task, pelt};

/// One queued or running fair task, as the agent reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RqTask {
    pub id: u64,
    /// The process (thread group); 0 = a kernel thread.
    pub group: u64,
    pub policy: Policy,
    pub nice: i8,
    /// Index into [`TaskTable::masks`]; 0 = every CPU.
    pub allowed: u32,
    /// `task_h_load()`.
    pub load_avg: i64,
    pub util_avg: i64,
    pub util_est: i64,
    pub runnable_avg: i64,
    pub running: bool,
    pub exec_start: i64,
    pub migration_disabled: bool,
    pub per_cpu_kthread: bool,
    pub sched_delayed: bool,
    /// Its cfs_rq's next buddy (`task_hot()` keeps it): only a kernel
    /// trace knows; agents report false.
    pub next_buddy: bool,
    pub nr_threads: u32,
}

impl RqTask {
    /// A nice-0 task allowed everywhere.
    pub fn new(id: u64, group: u64, load: i64) -> Self {
        Self {
            id,
            group,
            policy: Policy::Normal,
            nice: 0,
            allowed: 0,
            load_avg: load,
            util_avg: load.min(1024),
            util_est: 0,
            runnable_avg: load,
            running: false,
            exec_start: 0,
            migration_disabled: false,
            per_cpu_kthread: false,
            sched_delayed: false,
            next_buddy: false,
            nr_threads: 1,
        }
    }
}

/// A node's runnable tasks per CPU. Each list runs from the head (ran most
/// recently) to the tail (coldest), as the kernel's `cfs_tasks`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskTable {
    /// Shared between snapshots: a report replaces only its CPUs' lists.
    pub cpus: Vec<Arc<[RqTask]>>,
    /// `rq_clock_task()` per CPU when its list was read; 0 = unknown (every
    /// task counts as cold).
    pub clock: Vec<i64>,
    /// Distinct affinity masks; entry 0 is every CPU of the node.
    pub masks: Vec<CpuMask>,
    /// Where each mask is in `masks`.
    pub mask_index: HashMap<CpuMask, u32>,
    /// Compact the masks once there are this many (see the store).
    pub compact_at: usize,
}

impl TaskTable {
    pub fn empty(nr_cpus: usize) -> Self {
        Self {
            cpus: vec![Arc::from(Vec::new()); nr_cpus],
            clock: vec![0; nr_cpus],
            masks: vec![CpuMask::first_n(nr_cpus)],
            mask_index: HashMap::from([(CpuMask::first_n(nr_cpus), 0)]),
            compact_at: 256,
        }
    }

    /// The index of `mask` in the table, added if new.
    pub fn intern_mask(&mut self, mask: CpuMask) -> u32 {
        if self.mask_index.len() != self.masks.len() {
            self.reindex_masks();
        }
        if let Some(&i) = self.mask_index.get(&mask) {
            return i;
        }
        self.masks.push(mask);
        let i = (self.masks.len() - 1) as u32;
        self.mask_index.insert(mask, i);
        i
    }

    /// Rebuilds the mask lookup after the masks were replaced.
    pub fn reindex_masks(&mut self) {
        self.mask_index = self
            .masks
            .iter()
            .enumerate()
            .map(|(i, m)| (*m, i as u32))
            .collect();
    }

    pub fn len(&self) -> usize {
        self.cpus.iter().map(|l| l.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.cpus.iter().all(|l| l.is_empty())
    }

    /// The engine's task record for `t`, queued on `cpu`.
    pub fn task(&self, t: &RqTask, cpu: usize) -> Task {
        let n = self.masks[0].weight();
        let mut p = Task::new(n, cpu);
        p.policy = t.policy;
        p.cpus_allowed = self.masks[t.allowed as usize];
        p.load_avg = t.load_avg;
        p.util_avg = t.util_avg;
        p.util_est = t.util_est;
        p.runnable_avg = t.runnable_avg;
        p.running = t.running;
        p.exec_start = t.exec_start;
        p.migration_disabled = t.migration_disabled;
        p.per_cpu_kthread = t.per_cpu_kthread;
        p.sched_delayed = t.sched_delayed;
        p.next_buddy = t.next_buddy;
        if self.clock.get(cpu).copied().unwrap_or(0) == 0 {
            p.hot = Some(false);
        }
        p
    }
}

/// `rq->cfs.h_nr_runnable`.
#[inline]
pub fn h_nr_runnable(rq: &CpuState) -> u32 {
    rq.cfs_h_nr_queued.saturating_sub(rq.nr_delayed)
}

/// Dequeues `t`'s share from a working copy of a runqueue.
pub fn rq_sub(rq: &mut CpuState, t: &RqTask) {
    rq.nr_running = rq.nr_running.saturating_sub(1);
    rq.cfs_h_nr_queued = rq.cfs_h_nr_queued.saturating_sub(1);
    if t.policy == Policy::Idle {
        rq.h_nr_idle = rq.h_nr_idle.saturating_sub(1);
    }
    if t.sched_delayed {
        rq.nr_delayed = rq.nr_delayed.saturating_sub(1);
    }
    rq.h_nr_idle = rq.h_nr_idle.min(rq.nr_running);
    rq.nr_delayed = rq.nr_delayed.min(rq.nr_running);
    rq.load_avg = pelt(rq.load_avg as i64 - t.load_avg);
    rq.runnable_avg = pelt(rq.runnable_avg as i64 - t.runnable_avg);
    rq.util_avg = pelt(rq.util_avg as i64 - t.util_avg);
    rq.util_est = pelt(rq.util_est as i64 - t.util_est);
    if rq.nr_running == 0 {
        rq.curr_is_idle = true;
    }
}

/// Enqueues `t`'s share on a working copy of a runqueue.
pub fn rq_add(rq: &mut CpuState, t: &RqTask) {
    rq.nr_running += 1;
    rq.cfs_h_nr_queued += 1;
    if t.policy == Policy::Idle {
        rq.h_nr_idle += 1;
    }
    if t.sched_delayed {
        rq.nr_delayed += 1;
    }
    rq.load_avg = pelt(rq.load_avg as i64 + t.load_avg);
    rq.runnable_avg = pelt(rq.runnable_avg as i64 + t.runnable_avg);
    rq.util_avg = pelt(rq.util_avg as i64 + t.util_avg);
    rq.util_est = pelt(rq.util_est as i64 + t.util_est);
    rq.curr_is_idle = false;
}
