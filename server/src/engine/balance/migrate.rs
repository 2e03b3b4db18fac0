//! Migration: `can_migrate_task()` and `task_hot()`, in the kernel's order.

use crate::engine::cache::LlcView;
use crate::engine::cpumask::CpuMask;
use crate::engine::ctx::{CpusPtrSlot, Ctx, View};
use crate::engine::features::Kernel;
use crate::engine::state::{Policy, Task};
use crate::engine::topology::sd;

/// `env->flags` bits.
pub mod lbf {
    pub const ALL_PINNED: u32 = 0x01;
    pub const NEED_BREAK: u32 = 0x02;
    pub const DST_PINNED: u32 = 0x04;
    pub const SOME_PINNED: u32 = 0x08;
    pub const ACTIVE_LB: u32 = 0x10;
    /// A task was refused only for cache-aware reasons.
    pub const LLC_PINNED: u32 = 0x20;
    /// Active balancing for `migrate_llc_task`: only a task preferring the
    /// destination's LLC may go.
    pub const ACTIVE_LB_LLC: u32 = 0x40;

    /// Names in output order.
    /// The flags of the scenario format and CanMigrate (the cache-aware
    /// ones are set only inside balance passes).
    pub const NAMES: [(u32, &str); 5] = [
        (ALL_PINNED, "ALL_PINNED"),
        (NEED_BREAK, "NEED_BREAK"),
        (DST_PINNED, "DST_PINNED"),
        (SOME_PINNED, "SOME_PINNED"),
        (ACTIVE_LB, "ACTIVE_LB"),
    ];
}

/// `env->idle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleType {
    Idle,
    NotIdle,
    NewlyIdle,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigrationType {
    Load,
    Util,
    Task,
    Misfit,
    /// Cache-aware: one task toward its preferred LLC.
    LlcTask,
}

impl MigrationType {
    pub fn as_str(self) -> &'static str {
        match self {
            MigrationType::Load => "load",
            MigrationType::Util => "util",
            MigrationType::Task => "task",
            MigrationType::Misfit => "misfit",
            MigrationType::LlcTask => "llc_task",
        }
    }
}

/// The parts of `struct lb_env` that `can_migrate_task()` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrateEnv {
    pub src_cpu: usize,
    pub dst_cpu: usize,
    /// The CPU whose domain chain `sd` indexes: the balancing CPU (it stays
    /// when the destination is retargeted to `new_dst_cpu`).
    pub sd_cpu: usize,
    /// Index of the balancing domain in `sd_cpu`'s chain.
    pub sd: usize,
    /// `env->dst_grpmask`.
    pub dst_group: CpuMask,
    /// `env->cpus`.
    pub env_cpus: CpuMask,
    pub idle: IdleType,
    pub migration_type: MigrationType,
    pub flags: u32,
    pub nr_balance_failed: u32,
    /// Override of the domain's `cache_nice_tries`.
    pub cache_nice_tries: Option<u32>,
    pub throttled: bool,
    pub dst_cfs_nr_queued: u32,
    /// `rq_clock_task(src_rq)`.
    pub now: i64,
}

/// The check that decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    Delayed,
    Throttled,
    Ineligible,
    PerCpuKthread,
    Blocked,
    Affinity,
    Running,
    ActiveLb,
    Cold,
    BalanceFailed,
    Hot,
    /// Cache-aware: the move would break the process's LLC preference.
    LlcPinned,
}

impl Reason {
    pub const ALL: [Reason; 12] = [
        Reason::Delayed,
        Reason::Throttled,
        Reason::Ineligible,
        Reason::PerCpuKthread,
        Reason::Blocked,
        Reason::Affinity,
        Reason::Running,
        Reason::ActiveLb,
        Reason::Cold,
        Reason::BalanceFailed,
        Reason::Hot,
        Reason::LlcPinned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Delayed => "delayed",
            Reason::Throttled => "throttled",
            Reason::Ineligible => "ineligible",
            Reason::PerCpuKthread => "per_cpu_kthread",
            Reason::Blocked => "blocked",
            Reason::Affinity => "affinity",
            Reason::Running => "running",
            Reason::ActiveLb => "active_lb",
            Reason::Cold => "cold",
            Reason::BalanceFailed => "balance_failed",
            Reason::Hot => "hot",
            Reason::LlcPinned => "llc_pinned",
        }
    }
}

/// The answer of `can_migrate_task()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrateDecision {
    pub allowed: bool,
    /// What this call stored in `env->new_dst_cpu`.
    pub new_dst_cpu: Option<usize>,
    /// `env->flags` after the call.
    pub flags: u32,
    pub reason: Reason,
    /// `task_hot()`, when it was evaluated.
    pub task_hot: Option<bool>,
    pub cache_nice_tries: u32,
    /// A cache-aware preference allowed the move (`can_migrate_llc` said
    /// `mig_llc`, or a `migrate_llc_task` pass).
    pub llc_decided: bool,
}

/// `can_migrate_task()`: may the balancer pull `p` from `src_cpu` to `dst_cpu`?
/// Cache-aware scheduling is not part of this form (the scenario format
/// does not model it).
pub fn can_migrate_task(view: View<'_>, p: &Task, env: &MigrateEnv) -> MigrateDecision {
    can_migrate_task_llc(view, p, env, None)
}

/// `can_migrate_task()` with cache-aware scheduling: `llc` holds the
/// balancer's view of the preferences and the task's process.
pub fn can_migrate_task_llc(
    view: View<'_>,
    p: &Task,
    env: &MigrateEnv,
    llc: Option<(&LlcView<'_>, u64)>,
) -> MigrateDecision {
    let slot = CpusPtrSlot::new();
    let ctx = Ctx::new(view, p, env.src_cpu, &slot);
    let d = &view.topo.domains(env.sd_cpu)[env.sd];
    let cnt = env.cache_nice_tries.unwrap_or(d.cache_nice_tries);
    let mut flags = env.flags;
    let done = |allowed, flags, reason, new_dst_cpu, task_hot| MigrateDecision {
        allowed,
        new_dst_cpu,
        flags,
        reason,
        task_hot,
        cache_nice_tries: cnt,
        llc_decided: false,
    };

    // 6.12 has none of the delayed, ineligible and blocked checks.
    let mainline = view.features.kernel == Kernel::Mainline;
    if mainline && p.sched_delayed && env.migration_type != MigrationType::Load {
        return done(false, flags, Reason::Delayed, None, None);
    }
    if env.throttled {
        return done(false, flags, Reason::Throttled, None, None);
    }
    // task_is_ineligible_on_dst_cpu(): a soft rule for the first pass only.
    if mainline
        && env.nr_balance_failed == 0
        && view.features.place_lag
        && env.dst_cfs_nr_queued > 0
        && !p.eligible
    {
        return done(false, flags, Reason::Ineligible, None, None);
    }
    if p.per_cpu_kthread {
        return done(false, flags, Reason::PerCpuKthread, None, None);
    }
    if mainline && p.blocked {
        return done(false, flags, Reason::Blocked, None, None);
    }

    if !ctx.cpus_ptr.test(env.dst_cpu) {
        flags |= lbf::SOME_PINNED;
        if env.idle == IdleType::NewlyIdle || flags & (lbf::DST_PINNED | lbf::ACTIVE_LB) != 0 {
            return done(false, flags, Reason::Affinity, None, None);
        }
        // Remember another CPU of the destination group the task may run on.
        let new_dst = env.dst_group.first_and_and(&env.env_cpus, ctx.cpus_ptr);
        if new_dst.is_some() {
            flags |= lbf::DST_PINNED;
        }
        return done(false, flags, Reason::Affinity, new_dst, None);
    }

    flags &= !lbf::ALL_PINNED;

    if p.running {
        return done(false, flags, Reason::Running, None, None);
    }
    if flags & lbf::ACTIVE_LB != 0 {
        // migrate_llc_task_wrong_dst(): the cache-aware stopper takes only
        // a task that prefers the destination's LLC.
        if let Some((l, group)) = llc
            && flags & lbf::ACTIVE_LB_LLC != 0
            && l.task_pref(group) != Some(l.llc.llc(env.dst_cpu))
        {
            return done(false, flags, Reason::LlcPinned, None, None);
        }
        return done(true, flags, Reason::ActiveLb, None, None);
    }

    // Without NUMA balancing migrate_degrades_locality() is neutral, so
    // the cache-aware test and then task_hot() decide.
    let mut llc_decided = env.migration_type == MigrationType::LlcTask;
    if let Some((l, group)) = llc {
        // task_misfits_asym_cpu(): never trade capacity for cache locality.
        let misfits = d.has(sd::ASYM_CPUCAPACITY)
            && !ctx.task_fits_cpu(env.dst_cpu)
            && ctx.task_fits_cpu(env.src_cpu);
        let degrades = l.migrate_degrades_llc(
            view.topo,
            view.state,
            (env.src_cpu, env.dst_cpu),
            group,
            p.util_avg.max(0) as u64,
            misfits,
            env.migration_type == MigrationType::LlcTask,
            env.nr_balance_failed,
            cnt,
        );
        match degrades {
            Some(true) => {
                if env.migration_type != MigrationType::LlcTask {
                    flags |= lbf::LLC_PINNED;
                }
                return done(false, flags, Reason::LlcPinned, None, None);
            }
            Some(false) => llc_decided = true,
            None => {}
        }
    }
    let hot = task_hot(&ctx, env, d.has(sd::SHARE_CPUCAPACITY));
    let mut r = if !hot {
        done(true, flags, Reason::Cold, None, Some(false))
    } else if env.nr_balance_failed > cnt {
        done(true, flags, Reason::BalanceFailed, None, Some(true))
    } else {
        done(false, flags, Reason::Hot, None, Some(true))
    };
    r.llc_decided = r.allowed && llc_decided;
    r
}

/// The per-CPU loop that `first_and_and` replaced in `can_migrate_task()`
/// (kernel 6.12): walk `dst_group ∩ env_cpus` and test each CPU against the
/// task's mask. Kept to measure the change and to check that both agree.
pub fn new_dst_cpu_loop(
    dst_group: &CpuMask,
    env_cpus: &CpuMask,
    cpus_ptr: &CpuMask,
) -> Option<usize> {
    let both = dst_group.and(env_cpus);
    both.iter().find(|&c| cpus_ptr.test(c))
}

/// `task_hot()`: did the task run so recently that its cache is warm?
fn task_hot(ctx: &Ctx<'_>, env: &MigrateEnv, smt_domain: bool) -> bool {
    if ctx.p.policy == Policy::Idle {
        return false;
    }
    // SMT siblings share their caches.
    if smt_domain {
        return false;
    }
    if ctx.f.cache_hot_buddy && ctx.rq(env.dst_cpu).nr_running > 0 && ctx.p.next_buddy {
        return true;
    }
    let cost = ctx.sys.migration_cost_ns;
    if cost == -1 {
        return true;
    }
    if !ctx.sched_core_cookie_match(env.dst_cpu) {
        return true;
    }
    if cost == 0 {
        return false;
    }
    if let Some(h) = ctx.p.hot {
        return h;
    }
    env.now - ctx.p.exec_start < cost
}
