//! The fork/exec slow path: `sched_balance_find_dst_cpu()` walks down the
//! domains; at each level `sched_balance_find_dst_group()` picks the idlest
//! group (or stays local) and `sched_balance_find_dst_group_cpu()` the CPU.

use crate::engine::cpumask::CpuMask;
use crate::engine::ctx::Ctx;
use crate::engine::decision::Path;
use crate::engine::group::{
    DstDomain, GroupType, NumaPref, SgLbStats, finish_wakeup_stats, leave_local_group,
    update_pick_idlest, wakeup_stats,
};
use crate::engine::state::GroupSum;
use crate::engine::topology::{Domain, SpanId, sd};

/// `sched_balance_find_dst_cpu()`: from the highest flagged domain down,
/// move to the idlest group's idlest CPU and refine below it.
pub(crate) fn sched_balance_find_dst_cpu(
    ctx: &mut Ctx<'_>,
    this_cpu: usize,
    sd_idx: usize,
    prev_cpu: usize,
    sd_flag: u32,
) -> (usize, Path) {
    let topo = ctx.topo;
    let top = &topo.domains(this_cpu)[sd_idx];
    if !topo.span(top.span).intersects(ctx.cpus_ptr) {
        return (prev_cpu, Path::SlowPathPrev);
    }
    let mut cpu = this_cpu;
    let mut new_cpu = cpu;
    let mut sd: Option<usize> = Some(sd_idx);
    while let Some(k) = sd {
        let d = &topo.domains(cpu)[k];
        let child = k.checked_sub(1);
        if !d.has(sd_flag) {
            sd = child;
            continue;
        }
        let Some(group) = sched_balance_find_dst_group(ctx, d, cpu) else {
            sd = child;
            continue;
        };
        ctx.detail.slow_levels += 1;
        new_cpu = sched_balance_find_dst_group_cpu(ctx, group, cpu);
        if new_cpu == cpu {
            sd = child;
            continue;
        }
        // Moved: continue in the new CPU's domains below this level.
        cpu = new_cpu;
        let weight = d.weight;
        sd = None;
        for (j, t) in topo.domains(cpu).iter().enumerate() {
            if weight <= t.weight {
                break;
            }
            if t.has(sd_flag) {
                sd = Some(j);
            }
        }
    }
    (new_cpu, Path::SlowPath)
}

/// `sched_balance_find_dst_group()`: the idlest allowed group of `sd`, or
/// `None` to stay in the local group.
fn sched_balance_find_dst_group(ctx: &mut Ctx<'_>, d: &Domain, this_cpu: usize) -> Option<SpanId> {
    let topo = ctx.topo;
    let mut idlest: Option<SpanId> = None;
    let mut idlest_sgs = SgLbStats::WORST_IDLEST;
    let mut local: Option<SgLbStats> = None;
    let mut local_group: Option<SpanId> = None;
    for &g in &d.groups {
        let span = topo.span(g);
        if !span.intersects(ctx.cpus_ptr) || !ctx.sched_group_cookie_match(span) {
            continue;
        }
        let sgs = update_sg_wakeup_stats(ctx, d, g);
        if span.test(this_cpu) {
            local = Some(sgs);
            local_group = Some(g);
        } else if update_pick_idlest(&idlest_sgs, &sgs) {
            idlest = Some(g);
            idlest_sgs = sgs;
        }
    }
    let idlest = idlest?;
    let Some(local) = local else {
        return Some(idlest);
    };
    let local_span = topo.span(local_group.expect("local group"));
    local_vs_idlest(ctx, d, this_cpu, &local, local_span, idlest, &idlest_sgs)
}

/// The end of `sched_balance_find_dst_group()`: the shared rule
/// ([`leave_local_group`]) with this domain's NUMA facts and the task's
/// preferred node.
fn local_vs_idlest(
    ctx: &Ctx<'_>,
    d: &Domain,
    this_cpu: usize,
    local: &SgLbStats,
    local_span: &CpuMask,
    idlest: SpanId,
    idlest_sgs: &SgLbStats,
) -> Option<SpanId> {
    let numa = d.has(sd::NUMA);
    let (mut allowed, mut pref) = (0, NumaPref::None);
    // Only the has-spare comparison on a NUMA domain reads these.
    let spare =
        local.group_type == GroupType::HasSpare && idlest_sgs.group_type == GroupType::HasSpare;
    if numa && spare {
        let nid = ctx.p.numa_preferred_nid;
        if nid >= 0 {
            let first = ctx.topo.span(idlest).first().expect("non-empty group");
            if ctx.topo.node_of(this_cpu) as i32 == nid {
                pref = NumaPref::Local;
            } else if ctx.topo.node_of(first) as i32 == nid {
                pref = NumaPref::Idlest;
            }
        }
        allowed = (local_span.and(ctx.cpus_ptr).weight() as i64).min(d.imb_numa_nr as i64);
    }
    let dd = DstDomain {
        imbalance_pct: d.imbalance_pct,
        numa,
        allowed,
        pref,
    };
    leave_local_group(&dd, local, idlest_sgs).then_some(idlest)
}

/// `update_sg_wakeup_stats()`: the group's statistics as if the task were
/// not there (an exec'ing task is removed from its own CPU).
fn update_sg_wakeup_stats(ctx: &mut Ctx<'_>, d: &Domain, g: SpanId) -> SgLbStats {
    let topo = ctx.topo;
    let span = topo.span(g);
    let asym = d.has(sd::ASYM_CPUCAPACITY);
    let exec_cpu = ctx.exec_cpu;
    let weight = topo.span_weight[g as usize];
    // The snapshot's sums stand for the CPU walk when the task is on
    // none of the group's CPUs and may use all of them.
    let k = topo.sum_index[g as usize];
    if !asym
        && k != u32::MAX
        && ctx.st.groups.len() == topo.sum_groups.len()
        && ctx.st.groups_util_est == ctx.f.util_est
        && exec_cpu.is_none_or(|c| !span.test(c))
        && span.is_subset(ctx.cpus_ptr)
    {
        ctx.detail.slow_cpus_read += weight;
        let mut s = wakeup_stats(&ctx.st.groups[k as usize], weight);
        s.sgc_imbalance = ctx.st.sg_imbalanced(d.level, g);
        finish_wakeup_stats(d.imbalance_pct, &mut s);
        return s;
    }
    let mut sum = GroupSum::default();
    let mut misfit = asym;
    let n = topo.nr_cpus;
    let mut next = span.next_lt(0, n);
    while let Some(i) = next {
        next = span.next_lt(i + 1, n);
        let rq = &ctx.st.cpus[i];
        // Capacity counts every CPU of the group, allowed or not.
        sum.capacity += rq.capacity as i64;
        sum.max_capacity = sum.max_capacity.max(rq.capacity as i64);
        if !ctx.cpus_ptr.test(i) {
            continue;
        }
        ctx.detail.slow_cpus_read += 1;
        let here = exec_cpu == Some(i);
        if here {
            sum.load += (rq.load_avg as i64 - ctx.p.load_avg).max(0);
            sum.runnable += (rq.runnable_avg as i64 - ctx.p.runnable_avg).max(0);
        } else {
            sum.load += rq.load_avg as i64;
            sum.runnable += rq.runnable_avg as i64;
        }
        sum.util += ctx.cpu_util(i, here);
        let nr = rq.nr_running as i64 - here as i64;
        sum.nr_running += nr;
        if nr == 0 && (rq.curr_is_idle || here) && !rq.ttwu_pending {
            sum.idle_cpus += 1;
        }
        if asym && misfit && ctx.task_fits_cpu(i) {
            misfit = false;
        }
    }
    let mut s = wakeup_stats(&sum, weight);
    s.group_misfit_task_load = misfit as u64;
    // group_classify() reads sg_imbalanced() here too: a group the
    // balancer could not even out for affinity is `group_imbalanced`,
    // which the slow path neither picks over an equal group nor leaves
    // the local group for.
    s.sgc_imbalance = ctx.st.sg_imbalanced(d.level, g);
    finish_wakeup_stats(d.imbalance_pct, &mut s);
    s
}

/// `sched_balance_find_dst_group_cpu()`: a SCHED_IDLE-only CPU at once,
/// else the idle CPU in the shallowest state (most recently idle on ties),
/// else the least loaded.
fn sched_balance_find_dst_group_cpu(ctx: &Ctx<'_>, g: SpanId, this_cpu: usize) -> usize {
    let topo = ctx.topo;
    let span = topo.span(g);
    if topo.span_weight[g as usize] == 1 {
        return span.first().expect("non-empty group");
    }
    let mut min_exit_latency = u32::MAX as u64;
    let mut latest_idle_stamp = 0i64;
    let mut shallowest: Option<usize> = None;
    let mut min_load = u64::MAX;
    let mut least_loaded = this_cpu;
    let n = topo.nr_cpus;
    let mut next = span.next_lt(0, n);
    while let Some(i) = next {
        next = span.next_lt(i + 1, n);
        if !ctx.cpus_ptr.test(i) || !ctx.sched_core_cookie_match(i) {
            continue;
        }
        if ctx.choose_sched_idle_rq(i) {
            return i;
        }
        let rq = ctx.rq(i);
        if rq.available_idle() {
            match rq.exit_latency() {
                Some(lat) if (lat as u64) < min_exit_latency => {
                    min_exit_latency = lat as u64;
                    latest_idle_stamp = rq.idle_stamp;
                    shallowest = Some(i);
                }
                lat if (lat.is_none() || lat.map(u64::from) == Some(min_exit_latency))
                    && rq.idle_stamp > latest_idle_stamp =>
                {
                    latest_idle_stamp = rq.idle_stamp;
                    shallowest = Some(i);
                }
                _ => {}
            }
        } else if shallowest.is_none() {
            let load = rq.load_avg as u64;
            if load < min_load {
                min_load = load;
                least_loaded = i;
            }
        }
    }
    shallowest.unwrap_or(least_loaded)
}
