//! The core wrapper (core.c): `select_task_rq()`, its callers for wakeup, fork
//! and exec, and `select_fallback_rq()`.

use crate::engine::ctx::{CpusPtrSlot, Ctx, View};
use crate::engine::decision::{Kind, Path, PlaceRequest, Placement};
use crate::engine::placement::fair::select_task_rq_fair;
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
        Kind::Wakeup => core_select(&mut ctx, req, p.prev_cpu),
        Kind::Fork => core_select(&mut ctx, req, req.this_cpu),
        Kind::Exec => sched_exec(&mut ctx, req),
    };
    Placement {
        cpu,
        path,
        scanned: ctx.scanned,
        detail: ctx.detail,
    }
}

/// `select_task_rq()`: one allowed CPU, or migration disabled, skips the
/// class; whatever is chosen must pass `is_cpu_allowed()`.
pub(crate) fn core_select(ctx: &mut Ctx<'_>, req: &PlaceRequest, cpu: usize) -> (usize, Path) {
    let (mut cpu, mut path) = if ctx.nr_cpus_allowed > 1 && !ctx.p.migration_disabled {
        select_task_rq_fair(ctx, req, cpu)
    } else {
        (ctx.cpus_ptr.first().unwrap_or(cpu), Path::Bound)
    };
    if !ctx.is_cpu_allowed(cpu) {
        cpu = select_fallback_rq(ctx, ctx.task_cpu);
        path = Path::FallbackRq;
    }
    (cpu, path)
}

/// `sched_exec()`: with EXEC_BOUND_FAST_PATH it goes through the wrapper
/// (so a bound task skips the slow path); without, it calls the class
/// directly. An inactive choice leaves the task where it is.
fn sched_exec(ctx: &mut Ctx<'_>, req: &PlaceRequest) -> (usize, Path) {
    let (dest, path) = if ctx.f.exec_bound_fast_path {
        core_select(ctx, req, req.this_cpu)
    } else {
        select_task_rq_fair(ctx, req, req.this_cpu)
    };
    if !ctx.topo.online.test(dest) {
        return (req.this_cpu, Path::ExecStayInactive);
    }
    (dest, path)
}

/// `select_fallback_rq()`: the task's node first, then its mask, then any
/// online CPU (the kernel would widen the mask; that is a configuration
/// problem, not a placement).
pub(crate) fn select_fallback_rq(ctx: &Ctx<'_>, cpu: usize) -> usize {
    let node = ctx.topo.node_of(cpu) as usize;
    let n = ctx.topo.nr_cpus;
    let node_cpus = &ctx.topo.node_cpus[node];
    if let Some(c) = node_cpus.first_and_and(ctx.cpus_ptr, &ctx.topo.online) {
        return c;
    }
    if let Some(c) = ctx.cpus_ptr.first_and(&ctx.topo.online) {
        return c;
    }
    ctx.topo.online.next_lt(0, n).unwrap_or(cpu)
}
