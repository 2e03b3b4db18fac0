//! The Linux 6.12 kernel profile: the steps of the fair class that 6.12
//! (read from the 6.12.118 stable tree) does differently from the mainline
//! the rest of the engine follows. The other modules call in here through
//! small hooks that test `Features::kernel`; everything not listed here is
//! the same in both profiles (scenario format, section 13).
//!
//! | step | 6.12 | mainline | algorithm notes |
//! |---|---|---|---|
//! | `sched_idle_cpu()` tests | any wakee takes a SCHED_IDLE-only CPU | `choose_sched_idle_rq()`: not a SCHED_IDLE wakee | D1 (feature default) |
//! | `sched_exec()` | calls `select_task_rq_fair()` directly | through `select_task_rq()` | section 2 exec (feature default) |
//! | `asym_fits_cpu()` | fit only | fit and, with SMT, an idle core | D9 |
//! | `select_idle_capacity()` | no SIS_UTIL budget, no idle-core preference | SMT-aware ranking with budget | D8 |
//! | shared objects | read through `sd_llc_shared` only | `sd_balance_shared`: an asym-capacity object | D10, D12 |
//! | `can_migrate_task()` | throttled pair, per-CPU kthread | + delayed, ineligible, blocked | D4 |
//! | the balancer's task counts (`sum_h_nr_running`, the busiest runqueue's, active balance's) | `cfs.h_nr_queued`: delayed-dequeue tasks count | `cfs.h_nr_runnable` | seen in the live kernel's passes |
//!
//! The notes date mainline as the 2026 development cycle; they do not give
//! the release of each change, so neither does this table. The 6.12 column
//! was checked against Debian's linux-source-6.12 (6.12.118) `fair.c`.

use super::cpumask::WrapWalk;
use super::ctx::Ctx;
use super::features::Kernel;
use super::rq::h_nr_runnable;
use super::state::{CpuState, NodeState};
use super::topology::{Domain, Topology};

/// The object `test_idle_cores()` reads for `cpu`: 6.12 has no asym
/// shared object, so it is always the LLC's.
#[inline]
pub(crate) fn balance_shared(ctx: &Ctx<'_>, cpu: usize) -> Option<u32> {
    let cd = &ctx.topo.cpu[cpu];
    if ctx.is_v6_12() {
        cd.llc_shared
    } else {
        cd.balance_shared
    }
}

/// 6.12's `select_idle_capacity()`: the first idle CPU of the asym
/// domain that fits the task, else the idle one that fits best (a CPU
/// where only uclamp_min misses beats one that does not fit; then the
/// larger capacity). Every CPU of the walk is tested; no budget.
pub(crate) fn select_idle_capacity_v6_12(
    ctx: &mut Ctx<'_>,
    sd: &Domain,
    target: usize,
) -> Option<usize> {
    let topo = ctx.topo;
    let util = ctx.p.util_est_max();
    let (umin, umax) = (ctx.p.uclamp_min, ctx.p.uclamp_max);
    let (mut best_cap, mut best_fits, mut best) = (0i64, 0i32, None);
    let cpus = topo.span(sd.span).and(ctx.cpus_ptr);
    let mut walk = WrapWalk::new(target, topo.nr_cpus);
    while let Some(c) = walk.next(&cpus) {
        let mut cap = ctx.rq(c).capacity as i64;
        ctx.scanned += 1;
        if !ctx.choose_idle_cpu(c) {
            continue;
        }
        let fits = ctx.util_fits_cpu(util, umin, umax, c);
        if fits > 0 {
            return Some(c);
        } else if fits < 0 {
            cap = ctx.rq(c).actual_capacity as i64;
        }
        if fits < best_fits || (fits == best_fits && cap > best_cap) {
            best_cap = cap;
            best = Some(c);
            best_fits = fits;
        }
    }
    best
}

impl NodeState {
    /// The idle-core truth of a shared object under 6.12: every CPU of the
    /// LLC reads the LLC's object; an asym object is read by no one.
    pub(crate) fn derive_has_idle_cores_v6_12(&self, topo: &Topology, obj: usize) -> bool {
        let o = &topo.shared[obj];
        topo.span(o.span).iter().any(|c| {
            topo.online.test(c)
                && topo.cpu[c].llc_shared == Some(obj as u32)
                && topo
                    .smt_siblings(c)
                    .iter()
                    .all(|&s| self.cpus[s as usize].available_idle())
        })
    }
}

/// The CFS task count the load balancer reads of a runqueue: 6.12 counts
/// the tasks whose dequeue is delayed (`cfs.h_nr_queued`), mainline only
/// the runnable ones (`cfs.h_nr_runnable`).
#[inline]
pub(crate) fn lb_h_nr_running(kernel: Kernel, rq: &CpuState) -> u32 {
    if kernel == Kernel::V6_12 {
        rq.cfs_h_nr_queued
    } else {
        h_nr_runnable(rq)
    }
}
