//! The wakeup fast path: `select_idle_sibling()` and the scans it runs
//! (`select_idle_smt`, `select_idle_cpu` with `select_idle_core`, and
//! `select_idle_capacity` on asymmetric systems).
//!
//! `scanned` counts the idle-state tests made inside the four scans only,
//! exactly where the kernel would test one CPU's idleness in a loop.

use std::ops::ControlFlow;

use crate::engine::cpumask::{CpuMask, WrapWalk};
use crate::engine::ctx::Ctx;
use crate::engine::decision::{Path, PlaceRequest};
use crate::engine::topology::{Domain, sd};
use crate::engine::v6_12::{balance_shared, select_idle_capacity_v6_12};

/// `select_idle_sibling()`: the cheapest idle CPU that shares a cache with
/// the target, trying the obvious candidates before scanning.
pub(crate) fn select_idle_sibling(
    ctx: &mut Ctx<'_>,
    req: &PlaceRequest,
    prev: usize,
    target: usize,
) -> (usize, Path) {
    let topo = ctx.topo;
    ctx.detail.sis_target = Some(target);

    if ctx.choose_idle_cpu(target) && ctx.asym_fits_cpu(target) {
        return (target, Path::Target);
    }

    // prev, if cache-affine with target; across clusters it waits until
    // the target's own cluster has been scanned.
    let mut prev_aff = None;
    if prev != target
        && topo.cpus_share_cache(prev, target)
        && ctx.choose_idle_cpu(prev)
        && ctx.asym_fits_cpu(prev)
    {
        if !topo.cluster_active || topo.cpus_share_resources(prev, target) {
            return (prev, Path::Prev);
        }
        prev_aff = Some(prev);
    }

    // A per-CPU kthread waker (an IO completion, say) is about to sleep:
    // stack the wakee on its CPU.
    if req.waker_is_per_cpu_kthread
        && req.in_task
        && prev == req.this_cpu
        && ctx.rq(req.this_cpu).nr_running <= 1
        && ctx.asym_fits_cpu(prev)
    {
        return (prev, Path::PerCpuKthread);
    }

    let mut recent = ctx.p.recent_used_cpu;
    match recent {
        Some(r)
            if r != prev
                && r != target
                && topo.cpus_share_cache(r, target)
                && ctx.choose_idle_cpu(r)
                && ctx.cpus_ptr.test(r)
                && ctx.asym_fits_cpu(r) =>
        {
            if !topo.cluster_active || topo.cpus_share_resources(r, target) {
                return (r, Path::Recent);
            }
        }
        _ => recent = None,
    }

    // Asymmetric capacity: the capacity-aware scan replaces the LLC scan.
    if topo.asym_active
        && let Some(sda) = topo.sd_asym(target)
    {
        let found = if ctx.is_v6_12() {
            select_idle_capacity_v6_12(ctx, sda, target)
        } else {
            select_idle_capacity(ctx, sda, target)
        };
        return match found {
            Some(i) => (i, Path::Capacity),
            None => (target, Path::CapacityNone),
        };
    }

    let Some(llc) = topo.sd_llc(target) else {
        return (target, Path::NoLlc);
    };

    let mut has_idle_core = false;
    if topo.smt_active {
        has_idle_core = test_idle_cores(ctx, target);
        ctx.detail.has_idle_core = Some(has_idle_core);
        if !has_idle_core
            && topo.cpus_share_cache(prev, target)
            && let Some(i) = select_idle_smt(ctx, llc, prev)
        {
            return (i, Path::IdleSmt);
        }
    }

    if let Some((i, path)) = select_idle_cpu(ctx, llc, has_idle_core, target) {
        return (i, path);
    }

    if let Some(p) = prev_aff {
        return (p, Path::PrevAff);
    }
    if let Some(r) = recent {
        return (r, Path::RecentAff);
    }
    (target, Path::FallbackTarget)
}

/// `test_idle_cores()`: the hint in the target's balance shared object.
fn test_idle_cores(ctx: &Ctx<'_>, cpu: usize) -> bool {
    balance_shared(ctx, cpu).is_some_and(|s| ctx.st.shared[s as usize].has_idle_cores)
}

/// The SIS_UTIL scan budget of a domain, `nr_idle_scan + 1` because the
/// loops pre-decrement; `None` when unlimited.
fn sis_budget(ctx: &mut Ctx<'_>, sd: &Domain) -> Option<i64> {
    if !ctx.f.sis_util {
        return None;
    }
    let s = sd.shared?;
    let nr = ctx.st.shared[s as usize].nr_idle_scan;
    ctx.detail.nr_idle_scan = Some(nr);
    Some(nr as i64 + 1)
}

/// `select_idle_smt()`: an idle sibling of prev, when no core is idle.
fn select_idle_smt(ctx: &mut Ctx<'_>, sd: &Domain, prev: usize) -> Option<usize> {
    let span = ctx.topo.span(sd.span);
    for &s in ctx.topo.smt_siblings(prev) {
        let c = s as usize;
        if !ctx.cpus_ptr.test(c) || c == prev || !span.test(c) {
            continue;
        }
        ctx.scanned += 1;
        if ctx.choose_idle_cpu(c) {
            return Some(c);
        }
    }
    None
}

/// One CPU of `select_idle_cpu()`'s scans (the cluster's and the
/// LLC's run the same step): in idle-core mode the CPU's whole core, else
/// the CPU itself for one unit of the budget. `Break` ends the scan with
/// its answer (`None`: the budget ran out).
#[inline]
fn select_idle_step(
    ctx: &mut Ctx<'_>,
    c: usize,
    has_idle_core: bool,
    nr: &mut i64,
    cpus: &mut CpuMask,
    idle_cpu: &mut Option<usize>,
) -> ControlFlow<Option<(usize, Path)>> {
    if has_idle_core {
        if let Some(i) = select_idle_core(ctx, c, cpus, idle_cpu) {
            return ControlFlow::Break(Some((i, Path::IdleCore)));
        }
    } else {
        *nr -= 1;
        if *nr <= 0 {
            return ControlFlow::Break(None);
        }
        if let Some(i) = __select_idle_cpu(ctx, c) {
            return ControlFlow::Break(Some((i, Path::IdleCpu)));
        }
    }
    ControlFlow::Continue(())
}

/// `select_idle_cpu()`: the LLC scan, the target's cluster first. In
/// idle-core mode whole cores are tested and the budget is not spent; in
/// per-CPU mode each probe costs one unit of the SIS_UTIL budget.
fn select_idle_cpu(
    ctx: &mut Ctx<'_>,
    sd: &Domain,
    has_idle_core: bool,
    target: usize,
) -> Option<(usize, Path)> {
    let topo = ctx.topo;
    let n = topo.nr_cpus;
    let mut nr = i64::MAX;
    if let Some(b) = sis_budget(ctx, sd) {
        if b == 1 {
            return None;
        }
        nr = b;
    }
    // The node's masks hold none of its CPUs beyond `n`: every mask op
    // of the scan runs over the node's words only, as the kernel's run
    // over `nr_cpumask_bits`.
    let mut cpus = topo.span(sd.span).and_lt(ctx.cpus_ptr, n);
    if cpus.is_empty() {
        return None;
    }
    let mut idle_cpu: Option<usize> = None;

    if topo.cluster_active && sd.first_group_flags & sd::CLUSTER != 0 {
        let group = topo.span(sd.groups[0]);
        let mut walk = WrapWalk::new(target + 1, n);
        while let Some(c) = walk.next(group) {
            if !cpus.test(c) {
                continue;
            }
            let step = select_idle_step(ctx, c, has_idle_core, &mut nr, &mut cpus, &mut idle_cpu);
            if let ControlFlow::Break(found) = step {
                return found;
            }
        }
        cpus.andnot_assign_lt(group, n);
    }

    let mut walk = WrapWalk::new(target + 1, n);
    while let Some(c) = walk.next(&cpus) {
        let step = select_idle_step(ctx, c, has_idle_core, &mut nr, &mut cpus, &mut idle_cpu);
        if let ControlFlow::Break(found) = step {
            return found;
        }
    }
    let path = if has_idle_core {
        Path::CoreScanCpu
    } else {
        Path::IdleCpu
    };
    idle_cpu.map(|i| (i, path))
}

/// `__select_idle_cpu()`.
#[allow(non_snake_case)]
fn __select_idle_cpu(ctx: &mut Ctx<'_>, cpu: usize) -> Option<usize> {
    ctx.scanned += 1;
    (ctx.choose_idle_cpu(cpu) && ctx.sched_cpu_cookie_match(cpu)).then_some(cpu)
}

/// `select_idle_core()`: is the core of `core` wholly idle? On the way,
/// remember a fallback thread (the first allowed idle one met in the whole
/// scan, or with PREFER_LAST_IDLE_CPU the last); a core found busy is
/// removed from `cpus` so the outer walk never returns to it.
fn select_idle_core(
    ctx: &mut Ctx<'_>,
    core: usize,
    cpus: &mut CpuMask,
    idle_cpu: &mut Option<usize>,
) -> Option<usize> {
    let topo = ctx.topo;
    let mut idle = true;
    for &s in topo.smt_siblings(core) {
        let c = s as usize;
        ctx.scanned += 1;
        if !ctx.available_idle_cpu(c) {
            idle = false;
            if idle_cpu.is_none() {
                if ctx.choose_sched_idle_rq(c) && cpus.test(c) {
                    *idle_cpu = Some(c);
                    break;
                }
                continue;
            }
            break;
        }
        if cpus.test(c) && (ctx.f.prefer_last_idle_cpu || idle_cpu.is_none()) {
            *idle_cpu = Some(c);
        }
    }
    if idle {
        return Some(core);
    }
    cpus.andnot_assign_lt(topo.smt_mask(core), topo.nr_cpus);
    None
}

/// `select_idle_capacity()`: on asymmetric systems the idle CPU that best
/// fits the task, preferring wholly idle cores when some exist.
fn select_idle_capacity(ctx: &mut Ctx<'_>, sd: &Domain, target: usize) -> Option<usize> {
    let topo = ctx.topo;
    let has_idle_core = topo.smt_active && test_idle_cores(ctx, target);
    let util = ctx.p.util_est_max();
    let (umin, umax) = (ctx.p.uclamp_min, ctx.p.uclamp_max);
    let mut best_cap = 0i64;
    let mut best_fits = 0i32;
    let mut best: Option<usize> = None;
    let mut nr = i64::MAX;
    let cpus = topo.span(sd.span).and_lt(ctx.cpus_ptr, topo.nr_cpus);
    if let Some(b) = sis_budget(ctx, sd) {
        if b == 1 {
            return None;
        }
        nr = b;
    }
    let mut walk = WrapWalk::new(target, topo.nr_cpus);
    while let Some(c) = walk.next(&cpus) {
        let preferred = !has_idle_core || ctx.is_core_idle(c);
        let mut cap = ctx.rq(c).capacity as i64;
        if !has_idle_core {
            nr -= 1;
            if nr <= 0 {
                return best;
            }
        }
        ctx.scanned += 1;
        if !ctx.choose_idle_cpu(c) {
            continue;
        }
        let mut fits = ctx.util_fits_cpu(util, umin, umax, c);
        if fits > 0 && preferred {
            return Some(c);
        } else if fits < 0 {
            cap = ctx.rq(c).actual_capacity as i64;
        } else if fits > 0 {
            fits = -2;
        }
        if preferred {
            fits += -3;
        }
        if fits < best_fits || (fits == best_fits && cap > best_cap) {
            best_cap = cap;
            best = Some(c);
            best_fits = fits;
        }
    }
    best
}
