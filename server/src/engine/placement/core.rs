//! The core wrapper (core.c): `select_task_rq()`, its callers for wakeup, fork
//! and exec, and `select_fallback_rq()`.

use crate::engine::ctx::{CpusPtrSlot, Ctx, View};
use crate::engine::decision::{Kind, Path, PlaceRequest, Placement};
use crate::engine::state::Task;

/// Places a waking, forked or exec'ing task as the kernel would.
pub fn select_task_rq(view: View<'_>, p: &Task, req: &PlaceRequest) -> Placement {
    let task_cpu = match req.kind {
        Kind::Wakeup => p.prev_cpu,
        Kind::Fork | Kind::Exec => req.this_cpu,
    };
    let slot = CpusPtrSlot::new();
    let mut ctx = Ctx::new(view, p, task_cpu, &slot);
    if req.kind == Kind::Exec {
        ctx.exec_cpu = Some(req.this_cpu);
    }
    let (cpu, path) = match req.kind {
        Kind::Wakeup => ctx.core_select(req, p.prev_cpu),
        Kind::Fork => ctx.core_select(req, req.this_cpu),
        Kind::Exec => ctx.sched_exec(req),
    };
    Placement {
        cpu,
        path,
        scanned: ctx.scanned,
        detail: ctx.detail,
    }
}

impl Ctx<'_> {
    /// `select_task_rq()`: one allowed CPU, or migration disabled, skips the
    /// class; whatever is chosen must pass `is_cpu_allowed()`.
    pub(crate) fn core_select(&mut self, req: &PlaceRequest, cpu: usize) -> (usize, Path) {
        let (mut cpu, mut path) = if self.nr_cpus_allowed > 1 && !self.p.migration_disabled {
            self.select_task_rq_fair(req, cpu)
        } else {
            (self.cpus_ptr.first().unwrap_or(cpu), Path::Bound)
        };
        if !self.is_cpu_allowed(cpu) {
            cpu = self.select_fallback_rq(self.task_cpu);
            path = Path::FallbackRq;
        }
        (cpu, path)
    }

    /// `sched_exec()`: with EXEC_BOUND_FAST_PATH it goes through the wrapper
    /// (so a bound task skips the slow path); without, it calls the class
    /// directly. An inactive choice leaves the task where it is.
    fn sched_exec(&mut self, req: &PlaceRequest) -> (usize, Path) {
        let (dest, path) = if self.f.exec_bound_fast_path {
            self.core_select(req, req.this_cpu)
        } else {
            self.select_task_rq_fair(req, req.this_cpu)
        };
        if !self.topo.online.test(dest) {
            return (req.this_cpu, Path::ExecStayInactive);
        }
        (dest, path)
    }

    /// `select_fallback_rq()`: the task's node first, then its mask, then any
    /// online CPU (the kernel would widen the mask; that is a configuration
    /// problem, not a placement).
    pub(crate) fn select_fallback_rq(&self, cpu: usize) -> usize {
        let node = self.topo.node_of(cpu) as usize;
        let n = self.topo.nr_cpus;
        let node_cpus = &self.topo.node_cpus[node];
        if let Some(c) = node_cpus.first_and_and(self.cpus_ptr, &self.topo.online) {
            return c;
        }
        if let Some(c) = self.cpus_ptr.first_and(&self.topo.online) {
            return c;
        }
        self.topo.online.next_lt(0, n).unwrap_or(cpu)
    }
}
