//! `select_task_rq_fair()` (fair.c): the wake-affine decision and the walk up
//! the domains that chooses between the fast path and the slow path.

use crate::engine::ctx::Ctx;
use crate::engine::decision::{Affine, Kind, Path, PlaceRequest};
use crate::engine::placement::sis::select_idle_sibling;
use crate::engine::placement::slowpath::sched_balance_find_dst_cpu;
use crate::engine::topology::{Domain, sd};

/// `select_task_rq_fair()`.
pub(crate) fn select_task_rq_fair(
    ctx: &mut Ctx<'_>,
    req: &PlaceRequest,
    prev_cpu: usize,
) -> (usize, Path) {
    let cpu = req.this_cpu;
    let mut new_cpu = prev_cpu;
    let mut want_affine = false;
    let sd_flag = match req.kind {
        Kind::Wakeup => sd::BALANCE_WAKE,
        Kind::Fork => sd::BALANCE_FORK,
        Kind::Exec => sd::BALANCE_EXEC,
    };
    let sync = req.kind == Kind::Wakeup && req.sync && !req.waker_exiting;

    if req.kind == Kind::Wakeup {
        let flips = record_wakee(req);
        if req.wf_current_cpu && ctx.cpus_ptr.test(cpu) {
            return (cpu, Path::CurrentCpu);
        }
        // No energy model is modelled: the EAS gate is always closed.
        want_affine = !wake_wide(ctx, cpu, flips) && ctx.cpus_ptr.test(cpu);
    }
    ctx.detail.want_affine = want_affine;

    let topo = ctx.topo;
    let mut sd_idx: Option<usize> = None;
    for (k, tmp) in topo.domains(cpu).iter().enumerate() {
        if want_affine && tmp.has(sd::WAKE_AFFINE) && topo.span(tmp.span).test(prev_cpu) {
            if cpu != prev_cpu {
                new_cpu = wake_affine(ctx, tmp, cpu, prev_cpu, sync, req.waker_load);
            }
            sd_idx = None;
            break;
        }
        if tmp.has(sd_flag) {
            sd_idx = Some(k);
        } else if !want_affine {
            break;
        }
    }

    if let Some(k) = sd_idx {
        return sched_balance_find_dst_cpu(ctx, cpu, k, prev_cpu, sd_flag);
    }
    if req.kind == Kind::Wakeup {
        return select_idle_sibling(ctx, req, prev_cpu, new_cpu);
    }
    (new_cpu, Path::NoDomain)
}

/// `wake_wide()`: a 1:N waker/wakee relation wider than the LLC spreads.
/// The kernel keeps flips in `unsigned int`, so `slave * factor` wraps
/// at 2^32; the scenario format's plain arithmetic would not, and the
/// kernel wins.
fn wake_wide(ctx: &Ctx<'_>, this_cpu: usize, waker_flips: i64) -> bool {
    let factor = ctx.topo.llc_size(this_cpu);
    let mut master = waker_flips as u32;
    let mut slave = ctx.p.wakee_flips as u32;
    if master < slave {
        std::mem::swap(&mut master, &mut slave);
    }
    slave >= factor && master >= slave.wrapping_mul(factor)
}

/// `wake_affine()`: pull the wakee to the waker's CPU, or leave it on prev.
fn wake_affine(
    ctx: &mut Ctx<'_>,
    sd: &Domain,
    this_cpu: usize,
    prev_cpu: usize,
    sync: bool,
    waker_load: i64,
) -> usize {
    let mut target = None;
    if ctx.f.wa_idle {
        target = wake_affine_idle(ctx, this_cpu, prev_cpu, sync);
    }
    if ctx.f.wa_weight && target.is_none() {
        target = wake_affine_weight(ctx, sd, this_cpu, prev_cpu, sync, waker_load);
    }
    let (cpu, why) = match target {
        Some((c, why)) if c == this_cpu => (this_cpu, why),
        Some((_, why)) => (prev_cpu, why),
        None => (prev_cpu, Affine::Prev),
    };
    ctx.detail.affine = Some(why);
    cpu
}

/// `wake_affine_idle()`: only truly idle CPUs count here, never
/// SCHED_IDLE-only ones.
fn wake_affine_idle(
    ctx: &Ctx<'_>,
    this: usize,
    prev: usize,
    sync: bool,
) -> Option<(usize, Affine)> {
    if ctx.available_idle_cpu(this) && ctx.topo.cpus_share_cache(this, prev) {
        return Some(if ctx.available_idle_cpu(prev) {
            (prev, Affine::PrevIdle)
        } else {
            (this, Affine::ThisIdle)
        });
    }
    let rq = ctx.rq(this);
    if sync && rq.nr_running as i64 - rq.nr_delayed as i64 == 1 {
        return Some((this, Affine::ThisSync));
    }
    if ctx.available_idle_cpu(prev) {
        return Some((prev, Affine::PrevIdle));
    }
    None
}

/// `wake_affine_weight()`: compare the loads as if the wakee had moved,
/// biased towards prev by half the domain's imbalance_pct.
fn wake_affine_weight(
    ctx: &Ctx<'_>,
    sd: &Domain,
    this: usize,
    prev: usize,
    sync: bool,
    waker_load: i64,
) -> Option<(usize, Affine)> {
    let mut this_eff = ctx.rq(this).load_avg as i64;
    if sync {
        if waker_load > this_eff {
            return Some((this, Affine::ThisWeight));
        }
        this_eff -= waker_load;
    }
    let tl = ctx.p.load_avg;
    this_eff += tl;
    if ctx.f.wa_bias {
        this_eff *= 100;
    }
    this_eff *= ctx.rq(prev).capacity as i64;

    let mut prev_eff = ctx.rq(prev).load_avg as i64 - tl;
    if ctx.f.wa_bias {
        prev_eff *= 100 + (sd.imbalance_pct as i64 - 100) / 2;
    }
    prev_eff *= ctx.rq(this).capacity as i64;
    if sync {
        prev_eff += 1;
    }
    (this_eff < prev_eff).then_some((this, Affine::ThisWeight))
}

/// `record_wakee()`: the waker's flip count as this wakeup leaves it.
fn record_wakee(req: &PlaceRequest) -> i64 {
    let mut flips = req.waker_wakee_flips;
    if req.waker_flip_decay_expired {
        flips >>= 1;
    }
    if !req.waker_last_wakee_is_task {
        flips += 1;
    }
    flips
}
