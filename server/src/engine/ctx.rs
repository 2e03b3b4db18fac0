//! The context of one decision and the predicates every step shares
//! (`choose_idle_cpu`, `util_fits_cpu`, `asym_fits_cpu`, the cookie matches).
//!
//! A `Ctx` borrows the node's read-only view and the task, and the task's
//! mask as its effective affinity (`p->cpus_ptr` points at `p->cpus_mask`,
//! as in the kernel; a task with migration disabled points at a one-CPU
//! mask in a slot its caller keeps, [`CpusPtrSlot`]). What it owns is the
//! decision's scratch: the scan counter and the informative detail.
//! Nothing here allocates.

use std::cell::OnceCell;

use super::cpumask::CpuMask;
use super::decision::Detail;
use super::features::{Features, Kernel, System};
use super::state::{CpuState, NodeState, Policy, Task, cpu_util};
use super::topology::Topology;

/// The read-only view a decision runs against.
#[derive(Clone, Copy)]
pub struct View<'a> {
    pub topo: &'a Topology,
    pub state: &'a NodeState,
    pub features: &'a Features,
    pub system: &'a System,
}

/// Where `p->cpus_ptr` points when it is not the task's own mask
/// (`cpumask_of(task_cpu)` for a task with migration disabled). The caller
/// holds it for as long as the `Ctx`; it is written only in that case, so
/// the common one costs no 512-byte mask.
pub(crate) type CpusPtrSlot = OnceCell<CpuMask>;

pub(crate) struct Ctx<'a> {
    pub topo: &'a Topology,
    pub st: &'a NodeState,
    pub f: &'a Features,
    pub sys: &'a System,
    pub p: &'a Task,
    /// `p->cpus_ptr`: the allowed mask, or `{task_cpu}` when migration is
    /// disabled. Borrowed, not copied: a copy is 512 bytes more for every
    /// decision to write and bring into the cache.
    pub cpus_ptr: &'a CpuMask,
    pub nr_cpus_allowed: usize,
    pub task_cpu: usize,
    /// The exec'ing task's CPU: its own load is queued there.
    pub exec_cpu: Option<usize>,
    pub uclamp_used: bool,
    pub scanned: u32,
    pub detail: Detail,
}

impl<'a> Ctx<'a> {
    /// True under the 6.12 profile (`v6_12.rs` holds its variant steps).
    #[inline]
    pub(crate) fn is_v6_12(&self) -> bool {
        self.f.kernel == Kernel::V6_12
    }

    pub fn new(view: View<'a>, p: &'a Task, task_cpu: usize, slot: &'a CpusPtrSlot) -> Self {
        let cpus_ptr = if p.migration_disabled {
            slot.get_or_init(|| CpuMask::from_cpus([task_cpu]))
        } else {
            &p.cpus_allowed
        };
        let uclamp_used = view
            .system
            .uclamp_used
            .unwrap_or(p.uclamp_min != 0 || p.uclamp_max != 1024);
        Self {
            topo: view.topo,
            st: view.state,
            f: view.features,
            sys: view.system,
            p,
            cpus_ptr,
            nr_cpus_allowed: p.cpus_allowed.weight_lt(view.topo.nr_cpus),
            task_cpu,
            exec_cpu: None,
            uclamp_used,
            scanned: 0,
            detail: Detail::default(),
        }
    }

    #[inline]
    pub fn rq(&self, cpu: usize) -> &CpuState {
        &self.st.cpus[cpu]
    }

    #[inline]
    pub fn available_idle_cpu(&self, cpu: usize) -> bool {
        self.rq(cpu).available_idle()
    }

    /// `choose_sched_idle_rq()`: a SCHED_IDLE-only runqueue is as good as idle,
    /// unless the task itself is SCHED_IDLE (with the switch on).
    #[inline]
    pub fn choose_sched_idle_rq(&self, cpu: usize) -> bool {
        self.rq(cpu).sched_idle_rq()
            && !(self.f.skip_sched_idle_for_idle_task && self.p.policy == Policy::Idle)
    }

    /// `choose_idle_cpu()`.
    #[inline]
    pub fn choose_idle_cpu(&self, cpu: usize) -> bool {
        self.available_idle_cpu(cpu) || self.choose_sched_idle_rq(cpu)
    }

    /// `is_core_idle()`: every other online sibling is `idle_cpu`.
    pub fn is_core_idle(&self, cpu: usize) -> bool {
        self.topo
            .smt_siblings(cpu)
            .iter()
            .all(|&s| s as usize == cpu || self.rq(s as usize).idle_cpu())
    }

    /// `util_fits_cpu()`: 1 fits, 0 does not, -1 fits but uclamp_min cannot be met.
    pub fn util_fits_cpu(&self, util: i64, umin: u32, umax: u32, cpu: usize) -> i32 {
        let rq = self.rq(cpu);
        let mut fits = fits_capacity(util, rq.capacity as i64);
        if !self.uclamp_used {
            return fits as i32;
        }
        let cap_orig = self.topo.capacity_orig(cpu);
        let max_special = cap_orig == 1024 && umax == 1024;
        fits = fits || (!max_special && umax <= cap_orig);
        let umin = umin.min(umax);
        if fits && util < umin as i64 && umin > rq.actual_capacity as u32 {
            return -1;
        }
        fits as i32
    }

    /// `task_fits_cpu()`.
    #[inline]
    pub fn task_fits_cpu(&self, cpu: usize) -> bool {
        self.util_fits_cpu(
            self.p.util_est_max(),
            self.p.uclamp_min,
            self.p.uclamp_max,
            cpu,
        ) > 0
    }

    /// `asym_fits_cpu()`: on asymmetric systems a candidate must fit the task,
    /// and with SMT sit on an otherwise idle core.
    #[inline]
    pub fn asym_fits_cpu(&self, cpu: usize) -> bool {
        if !self.topo.asym_active {
            return true;
        }
        if self.is_v6_12() {
            return self.task_fits_cpu(cpu);
        }
        (!self.topo.smt_active || self.is_core_idle(cpu)) && self.task_fits_cpu(cpu)
    }

    /// `sched_cpu_cookie_match()`.
    #[inline]
    pub fn sched_cpu_cookie_match(&self, cpu: usize) -> bool {
        !self.sys.core_sched || self.st.core_cookie(cpu) == self.p.core_cookie
    }

    /// `sched_core_cookie_match()`: a wholly idle core takes any cookie.
    pub fn sched_core_cookie_match(&self, cpu: usize) -> bool {
        if !self.sys.core_sched {
            return true;
        }
        let core_idle = self
            .topo
            .smt_siblings(cpu)
            .iter()
            .all(|&s| self.available_idle_cpu(s as usize));
        core_idle || self.st.core_cookie(cpu) == self.p.core_cookie
    }

    /// `sched_group_cookie_match()`.
    pub fn sched_group_cookie_match(&self, group: &CpuMask) -> bool {
        if !self.sys.core_sched {
            return true;
        }
        let n = self.topo.nr_cpus;
        let mut c = group.next_lt(0, n);
        while let Some(i) = c {
            if self.cpus_ptr.test(i) && self.sched_core_cookie_match(i) {
                return true;
            }
            c = group.next_lt(i + 1, n);
        }
        false
    }

    /// `is_cpu_allowed()`.
    #[inline]
    pub fn is_cpu_allowed(&self, cpu: usize) -> bool {
        self.cpus_ptr.test(cpu) && self.topo.online.test(cpu)
    }

    /// `cpu_util()` for the slow path: the exec'ing task's own contribution is
    /// removed from its CPU (`with_task`).
    pub fn cpu_util(&self, cpu: usize, with_task: bool) -> i64 {
        let without = with_task.then_some((self.p.util_avg, self.p.util_est));
        cpu_util(
            self.rq(cpu),
            self.topo.capacity_orig(cpu),
            self.f.util_est,
            false,
            without,
        )
    }
}

/// `fits_capacity()`: ~20 % headroom.
#[inline]
pub fn fits_capacity(util: i64, cap: i64) -> bool {
    util * 1280 < cap * 1024
}
