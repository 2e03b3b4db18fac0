//! The periodic load balancer over one node's reported tasks:
//! `sched_balance_domains` → `sched_balance_rq` → `should_we_balance`,
//! `sched_balance_find_src_group`, `sched_balance_find_src_rq`,
//! `detach_tasks` through `can_migrate_task`, and active balancing.
//!
//! A pass runs on a private working copy of the node's runqueues and task
//! lists, so each migration it proposes is seen by the steps after it, as
//! the kernel's next balance would see the moved task, while the stored
//! state stays as the agent reported it. The per-domain bookkeeping the
//! kernel keeps between passes (`nr_balance_failed`, `balance_interval`,
//! `last_balance`, `sgc->imbalance`) lives in [`LbState`] and persists.

use std::collections::VecDeque;

use crate::engine::balance::lb::{self, DomainParams, SdTotals};
use crate::engine::balance::migrate::{self, IdleType, MigrateEnv, MigrationType, Reason, lbf};
use crate::engine::cache::{self, LlcView};
use crate::engine::cpumask::CpuMask;
use crate::engine::ctx::{CpusPtrSlot, Ctx, View};
use crate::engine::group::{self, GroupType, SgLbStats};
use crate::engine::rq::{RqTask, TaskTable, rq_add, rq_sub};
use crate::engine::state::{NodeState, cpu_util};

use super::src_rq::{BusiestRq, check_cpu_capacity, detach_amount};
use crate::engine::topology::{Domain, Level, SpanId, Topology, sd};

mod detach;
mod find;

pub use find::group_balance_mask;
use find::*;

/// `sysctl_sched_nr_migrate` and `SCHED_NR_MIGRATE_BREAK`.
pub const SCHED_NR_MIGRATE: u32 = 32;
const NR_MIGRATE_BREAK: u32 = 32;
/// `MAX_PINNED_INTERVAL`, ms.
const MAX_PINNED_INTERVAL: u32 = 512;
const BUSY_FACTOR: u32 = 16;

/// The balancer's per-domain state (`struct sched_domain` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DomainLb {
    pub nr_balance_failed: u32,
    /// ms.
    pub balance_interval: u32,
    /// ms on the caller's clock; `None` = never balanced.
    pub last_balance: Option<u64>,
}

/// What the balancer remembers between passes for one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LbState {
    /// Per CPU, per domain of its chain.
    pub dom: Vec<Vec<DomainLb>>,
    /// `sgc->imbalance`, per level and group span: the kernel keeps one
    /// `sched_group_capacity` per topology level, so a span that is a group
    /// at two levels has two flags. Indexed by [`sgc_index`].
    pub group_imbalance: Vec<bool>,
}

impl LbState {
    pub fn new(topo: &Topology) -> Self {
        Self {
            dom: (0..topo.nr_cpus)
                .map(|c| {
                    topo.domains(c)
                        .iter()
                        .map(|d| DomainLb {
                            nr_balance_failed: 0,
                            balance_interval: d.weight,
                            last_balance: None,
                        })
                        .collect()
                })
                .collect(),
            group_imbalance: vec![false; topo.spans.len() * topo.levels.len()],
        }
    }

    /// `sgc->imbalance` of the group spanning `g` among the groups of a
    /// domain at `level`.
    pub fn sgc_imbalance(&self, topo: &Topology, level: Level, g: SpanId) -> bool {
        self.group_imbalance[sgc_index(topo, level, g)]
    }

    /// Marks or clears the `sgc->imbalance` of group `g` as the domains at
    /// `level` see it: the capacity object a group of that span shares
    /// there (a lower level's, for a group built from a descended sibling).
    pub fn set_sgc_imbalance(&mut self, topo: &Topology, level: Level, g: SpanId, on: bool) {
        let at = topo.levels.iter().position(|&l| l == level).unwrap_or(0);
        let sgc_level = (0..topo.nr_cpus)
            .flat_map(|c| topo.domains(c).iter())
            .filter(|d| d.level == level)
            .find_map(|d| {
                let i = d.groups.iter().position(|&x| x == g)?;
                d.groups.sgc_level(i)
            })
            .unwrap_or(at);
        self.group_imbalance[sgc_index_at(topo, sgc_level, g)] = on;
    }

    /// Whether this state was built for `topo`'s domain tree.
    pub fn fits(&self, topo: &Topology) -> bool {
        self.dom.len() == topo.nr_cpus
            && self.group_imbalance.len() == topo.spans.len() * topo.levels.len()
            && self
                .dom
                .iter()
                .enumerate()
                .all(|(c, v)| v.len() == topo.domains(c).len())
    }
}

/// How a pass is run.
#[derive(Debug, Clone)]
pub struct BalanceOpts {
    /// Destination CPUs whose point of view is balanced, ascending.
    pub dst_cpus: CpuMask,
    pub now_ms: u64,
    /// Only domains whose interval has expired; otherwise every domain.
    pub honor_intervals: bool,
    /// 0 = no limit.
    pub max_proposals: usize,
}

/// "Move task from src to dst", and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proposal {
    pub task: u64,
    pub group: u64,
    pub src_cpu: usize,
    pub dst_cpu: usize,
    pub migration_type: MigrationType,
    /// Found by active balancing (the source's stopper), not detach_tasks.
    pub active: bool,
    pub level: Level,
    pub busiest: GroupType,
    pub local: GroupType,
    pub imbalance: i64,
    /// A cache-hot task allowed because the domain failed often enough.
    pub forced_hot: bool,
    pub nr_balance_failed: u32,
    /// A cache-aware preference decided this move.
    pub llc_preference: bool,
}

/// Counters of one pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassStats {
    /// `sched_balance_rq()` calls past `should_we_balance()`.
    pub domains_balanced: u32,
    /// Calls `should_we_balance()` declined.
    pub domains_declined: u32,
    /// Domains skipped because their interval had not expired.
    pub domains_not_due: u32,
    /// `can_migrate_task()` refusals by [`Reason`] index.
    pub rejections: [u64; REJECTION_KINDS],
    pub active_balances: u32,
}

pub const REJECTION_KINDS: usize = Reason::ALL.len();

/// What one `sched_balance_rq()` call found, for a replay of one pass of a
/// real kernel ([`Balancer::balance_rq`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RqOutcome {
    /// Every runqueue `detach_tasks()` was tried on, in order: a redo after
    /// an all-pinned source picks another. Only sources with more than one
    /// task (the kernel looks at none otherwise).
    pub busiest: Vec<usize>,
    /// The first busiest group and runqueue found, whatever its task count.
    pub first_group: Option<SpanId>,
    pub first_rq: Option<usize>,
    /// The migration type and imbalance the first find set.
    pub migration_type: Option<MigrationType>,
    pub imbalance: i64,
    /// Tasks detached (the proposals without `active`).
    pub moved: u32,
}

impl PassStats {
    /// `(reason, count)` for every refusal kind counted at least once.
    pub fn rejection_counts(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        self.rejections
            .iter()
            .enumerate()
            .filter(|(_, n)| **n > 0)
            .map(|(i, n)| (rejection_name(i), *n))
    }
}

pub fn rejection_name(i: usize) -> &'static str {
    Reason::ALL[i].as_str()
}

/// `struct lb_env`.
#[derive(Clone)]
struct Env {
    /// `env->sd`: domain `sd` of `sd_cpu`'s chain; it stays the balancing
    /// CPU's when the destination is retargeted.
    sd_cpu: usize,
    sd: usize,
    dst_cpu: usize,
    dst_grpmask: CpuMask,
    cpus: CpuMask,
    idle: IdleType,
    src_cpu: usize,
    flags: u32,
    imbalance: i64,
    migration_type: MigrationType,
    loop_: u32,
    loop_break: u32,
    loop_max: u32,
    new_dst_cpu: Option<usize>,
    busiest_type: GroupType,
    local_type: GroupType,
    start_imbalance: i64,
}

/// A node's balancer: its persistent state and the scratch of its passes,
/// reused so a pass allocates only when the node grows.
#[derive(Debug, Clone)]
pub struct Balancer {
    pub lb: LbState,
    work: NodeState,
    /// The pass's own copy of a CPU's list, made when the pass first changes
    /// it; `copied[c]` false = the table's list still stands.
    tasks: Vec<VecDeque<RqTask>>,
    copied: Vec<bool>,
    detached: Vec<RqTask>,
    /// Per-CPU cache-aware counts of the working copy.
    llc: cache::RqCounts,
    /// The LLC statistics recorded by earlier passes (`sd_llc_shared`).
    llc_recorded: Vec<Option<(u64, u64)>>,
}

struct Pass<'a, 'o> {
    topo: &'a Topology,
    view: View<'a>,
    table: &'a TaskTable,
    llc: Option<&'a LlcView<'a>>,
    opts: &'o BalanceOpts,
    out: &'o mut Vec<Proposal>,
    stats: PassStats,
    /// Set by a one-call replay only.
    outcome: Option<&'o mut RqOutcome>,
}

impl Balancer {
    pub fn new(topo: &Topology) -> Self {
        Self {
            lb: LbState::new(topo),
            work: NodeState {
                cpus: Vec::new(),
                shared: Vec::new(),
                groups: Vec::new(),
                groups_util_est: false,
                sgc_imbalance: Vec::new(),
                core_cookies: Vec::new(),
            },
            tasks: Vec::new(),
            copied: Vec::new(),
            detached: Vec::new(),
            llc: cache::RqCounts::default(),
            llc_recorded: Vec::new(),
        }
    }

    /// One periodic balance of the node: `sched_balance_domains()` for every
    /// destination CPU in `opts.dst_cpus`, ascending, on a working copy of
    /// `view.state` and `table`. Proposals are appended to `out`.
    pub fn run(
        &mut self,
        view: View<'_>,
        table: &TaskTable,
        llc: Option<&LlcView<'_>>,
        opts: &BalanceOpts,
        out: &mut Vec<Proposal>,
    ) -> PassStats {
        let topo = view.topo;
        self.prepare(view, table, llc);
        let mut pass = Pass {
            topo,
            view,
            table,
            llc,
            opts,
            out,
            stats: PassStats::default(),
            outcome: None,
        };
        let mut c = opts.dst_cpus.next_lt(0, topo.nr_cpus);
        while let Some(cpu) = c {
            if topo.online.test(cpu) && !self.full(&pass) {
                self.sched_balance_domains(&mut pass, cpu);
            }
            c = opts.dst_cpus.next_lt(cpu + 1, topo.nr_cpus);
        }
        if let Some(l) = llc {
            self.llc_recorded.clone_from(&l.recorded.borrow());
        }
        pass.stats
    }

    /// One `sched_balance_rq()` call: `cpu` balances its domain `k` as
    /// `idle`, with the per-domain state already in `self.lb` (the kernel's
    /// `nr_balance_failed` and `sgc->imbalance` at the call). The detached
    /// tasks (and an active balance's push) are appended to `out`.
    #[allow(clippy::too_many_arguments)]
    pub fn balance_rq(
        &mut self,
        view: View<'_>,
        table: &TaskTable,
        llc: Option<&LlcView<'_>>,
        cpu: usize,
        k: usize,
        idle: IdleType,
        out: &mut Vec<Proposal>,
    ) -> RqOutcome {
        let topo = view.topo;
        let mut outcome = RqOutcome::default();
        if cpu >= topo.nr_cpus || !topo.online.test(cpu) || k >= topo.domains(cpu).len() {
            return outcome;
        }
        self.prepare(view, table, llc);
        let opts = BalanceOpts {
            dst_cpus: CpuMask::new(),
            now_ms: 0,
            honor_intervals: false,
            max_proposals: 0,
        };
        let mut pass = Pass {
            topo,
            view,
            table,
            llc,
            opts: &opts,
            out,
            stats: PassStats::default(),
            outcome: Some(&mut outcome),
        };
        let mut continue_balancing = true;
        let moved = self.sched_balance_rq(&mut pass, cpu, k, idle, &mut continue_balancing);
        if let Some(o) = pass.outcome.as_deref_mut() {
            o.moved = moved;
        }
        outcome
    }

    /// The pass's working copy of the node: runqueues, lists, LLC counts.
    fn prepare(&mut self, view: View<'_>, table: &TaskTable, llc: Option<&LlcView<'_>>) {
        let topo = view.topo;
        if !self.lb.fits(topo) {
            self.lb = LbState::new(topo);
            self.llc_recorded.clear();
        }
        self.work.cpus.clone_from(&view.state.cpus);
        self.work.shared.clone_from(&view.state.shared);
        self.work.core_cookies.clone_from(&view.state.core_cookies);
        // No group sums: the working copy changes as tasks move.
        self.work.groups.clear();
        self.tasks.resize_with(topo.nr_cpus, VecDeque::new);
        self.copied.clear();
        self.copied.resize(topo.nr_cpus, false);
        if let Some(l) = llc {
            l.counts(topo, &table.cpus, &mut self.llc);
            l.recorded.borrow_mut().clone_from(&self.llc_recorded);
        }
    }

    /// The running task of a CPU's list, if reported.
    fn curr<'t>(&'t self, table: &'t TaskTable, cpu: usize) -> Option<&'t RqTask> {
        if self.copied[cpu] {
            self.tasks[cpu].iter().find(|t| t.running)
        } else {
            table.cpus.get(cpu)?.iter().find(|t| t.running)
        }
    }

    /// The pass's own copy of a CPU's list, made on first change.
    fn list_mut(&mut self, table: &TaskTable, cpu: usize) -> &mut VecDeque<RqTask> {
        if !self.copied[cpu] {
            let q = &mut self.tasks[cpu];
            q.clear();
            if let Some(l) = table.cpus.get(cpu) {
                q.extend(l.iter().cloned());
            }
            self.copied[cpu] = true;
        }
        &mut self.tasks[cpu]
    }

    fn full(&self, pass: &Pass<'_, '_>) -> bool {
        pass.opts.max_proposals != 0 && pass.out.len() >= pass.opts.max_proposals
    }

    fn view<'a>(&'a self, pass: &Pass<'a, '_>) -> View<'a> {
        View {
            topo: pass.topo,
            state: &self.work,
            features: pass.view.features,
            system: pass.view.system,
        }
    }

    /// `sched_balance_domains()`: walk the CPU's domains bottom-up, balancing
    /// each whose interval expired (or all, on demand).
    fn sched_balance_domains(&mut self, pass: &mut Pass<'_, '_>, cpu: usize) {
        let topo = pass.topo;
        let mut idle = self.idle_type(cpu);
        let mut busy = idle != IdleType::Idle && !self.work.cpus[cpu].sched_idle_rq();
        let max_interval = 100 * topo.online.weight() as u32;
        let mut continue_balancing = true;
        for k in 0..topo.domains(cpu).len() {
            if !continue_balancing || self.full(pass) {
                break;
            }
            let st = self.lb.dom[cpu][k];
            let interval = balance_interval(st.balance_interval, busy, max_interval);
            let due = st
                .last_balance
                .is_none_or(|t| pass.opts.now_ms >= t + interval as u64);
            if pass.opts.honor_intervals && !due {
                pass.stats.domains_not_due += 1;
                continue;
            }
            if self.sched_balance_rq(pass, cpu, k, idle, &mut continue_balancing) > 0 {
                idle = self.idle_type(cpu);
                busy = idle != IdleType::Idle && !self.work.cpus[cpu].sched_idle_rq();
            }
            self.lb.dom[cpu][k].last_balance = Some(pass.opts.now_ms);
        }
    }

    fn idle_type(&self, cpu: usize) -> IdleType {
        if self.work.cpus[cpu].idle_cpu() {
            IdleType::Idle
        } else {
            IdleType::NotIdle
        }
    }

    /// `sched_balance_rq()`: balance `cpu`'s domain `k`. Returns the tasks moved.
    fn sched_balance_rq(
        &mut self,
        pass: &mut Pass<'_, '_>,
        this_cpu: usize,
        k: usize,
        idle: IdleType,
        continue_balancing: &mut bool,
    ) -> u32 {
        let topo = pass.topo;
        let d = &topo.domains(this_cpu)[k];
        let has_parent = k + 1 < topo.domains(this_cpu).len();
        let mut env = Env {
            sd_cpu: this_cpu,
            sd: k,
            dst_cpu: this_cpu,
            dst_grpmask: group_balance_mask(topo, this_cpu, k),
            cpus: topo.span(d.span).and(&topo.online),
            idle,
            src_cpu: this_cpu,
            flags: 0,
            imbalance: 0,
            migration_type: MigrationType::Load,
            loop_: 0,
            loop_break: NR_MIGRATE_BREAK,
            loop_max: 0,
            new_dst_cpu: None,
            busiest_type: GroupType::HasSpare,
            local_type: GroupType::HasSpare,
            start_imbalance: 0,
        };
        let mut moved = 0u32;
        let mut active_started = false;

        enum Exit {
            Balanced,
            AllPinned,
            OnePinned,
        }
        let exit = 'redo: loop {
            if !self.should_we_balance(pass, &env, this_cpu) {
                *continue_balancing = false;
                pass.stats.domains_declined += 1;
                break 'redo Exit::Balanced;
            }
            pass.stats.domains_balanced += 1;
            let Some(group) = self.sched_balance_find_src_group(pass, &mut env, this_cpu) else {
                break 'redo Exit::Balanced;
            };
            let found = self.sched_balance_find_src_rq(pass, &env, group);
            let nr = found.map_or(0, |b| self.work.cpus[b].nr_running);
            record_found(pass, &env, group, found, nr);
            let Some(busiest) = found else {
                break 'redo Exit::Balanced;
            };
            env.src_cpu = busiest;
            env.flags |= lbf::ALL_PINNED;
            env.start_imbalance = env.imbalance;
            if nr > 1 {
                env.loop_max = SCHED_NR_MIGRATE.min(nr);
                loop {
                    let now = self.detach_tasks(pass, &mut env, this_cpu);
                    self.attach_tasks(pass, env.dst_cpu);
                    moved += now;
                    if env.flags & lbf::NEED_BREAK != 0 {
                        env.flags &= !lbf::NEED_BREAK;
                        continue;
                    }
                    // Retry the same source toward the CPU the task could use
                    // (unless the caller's proposal limit is reached).
                    if env.flags & lbf::DST_PINNED != 0
                        && env.imbalance > 0
                        && !self.full(pass)
                        && let Some(nd) = env.new_dst_cpu
                    {
                        env.cpus.clear(env.dst_cpu);
                        env.dst_cpu = nd;
                        env.flags &= !lbf::DST_PINNED;
                        env.loop_ = 0;
                        env.loop_break = NR_MIGRATE_BREAK;
                        continue;
                    }
                    break;
                }
                if has_parent && env.flags & lbf::SOME_PINNED != 0 && env.imbalance > 0 {
                    // Tell the level above that affinity blocked this one:
                    // the parent's local group (`sd_parent->groups->sgc`)
                    // spans this domain.
                    let parent = &topo.domains(this_cpu)[k + 1];
                    self.lb.group_imbalance[sgc_index(topo, parent.level, d.span)] = true;
                }
                if env.flags & lbf::ALL_PINNED != 0 {
                    env.cpus.clear(busiest);
                    if !env.cpus.is_subset(&env.dst_grpmask) {
                        env.loop_ = 0;
                        env.loop_break = NR_MIGRATE_BREAK;
                        continue 'redo;
                    }
                    break 'redo Exit::AllPinned;
                }
            }
            let st = &mut self.lb.dom[this_cpu][k];
            let mut need_active = false;
            if moved == 0 {
                let llc_pinned = env.flags & lbf::LLC_PINNED != 0;
                // Newly idle passes are too frequent to count as failures.
                if env.idle != IdleType::NewlyIdle
                    && env.migration_type != MigrationType::Misfit
                    && !llc_pinned
                {
                    st.nr_balance_failed += 1;
                }
                // Decided once: the kernel's stopper runs later, so its
                // second look sees the state from before the push.
                need_active = self.need_active_balance(pass, &env);
                if need_active {
                    if !self.curr_allowed_on(pass, busiest, this_cpu) {
                        break 'redo Exit::OnePinned;
                    }
                    env.flags &= !lbf::ALL_PINNED;
                    active_started = true;
                    // Not counted as moved by this pass: the stopper does it.
                    self.active_load_balance(pass, &env, busiest, this_cpu);
                }
            } else {
                st.nr_balance_failed = 0;
            }
            if !active_started || need_active {
                let st = &mut self.lb.dom[this_cpu][k];
                st.balance_interval = d.weight;
            }
            return moved;
        };

        if let Exit::Balanced = exit
            && has_parent
            && env.flags & lbf::ALL_PINNED == 0
        {
            let parent = &topo.domains(this_cpu)[k + 1];
            self.lb.group_imbalance[sgc_index(topo, parent.level, d.span)] = false;
        }
        if !matches!(exit, Exit::OnePinned) {
            self.lb.dom[this_cpu][k].nr_balance_failed = 0;
        }
        if env.migration_type != MigrationType::Misfit {
            let st = &mut self.lb.dom[this_cpu][k];
            let max = 2 * d.weight;
            if (env.flags & lbf::ALL_PINNED != 0 && st.balance_interval < MAX_PINNED_INTERVAL)
                || st.balance_interval < max
            {
                st.balance_interval *= 2;
            }
        }
        moved
    }

    /// `should_we_balance()`: only one CPU of the local group balances a
    /// domain: the first idle CPU on an idle core, else the first idle SMT
    /// thread, else the group's first CPU.
    fn should_we_balance(&self, pass: &Pass<'_, '_>, env: &Env, this_cpu: usize) -> bool {
        let topo = pass.topo;
        if !env.cpus.test(env.dst_cpu) {
            return false;
        }
        // Every CPU going idle may pull for itself, unless work arrived.
        if env.idle == IdleType::NewlyIdle {
            let dst = &self.work.cpus[env.dst_cpu];
            return dst.nr_running == 0 && !dst.ttwu_pending;
        }
        let d = &topo.domains(this_cpu)[env.sd];
        let mut swb = env.dst_grpmask.and(&env.cpus);
        let mut idle_smt = None;
        let n = topo.nr_cpus;
        let mut c = swb.next_lt(0, n);
        while let Some(cpu) = c {
            c = swb.next_lt(cpu + 1, n);
            if !self.work.cpus[cpu].idle_cpu() {
                continue;
            }
            if topo.smt_active && !d.has(sd::SHARE_CPUCAPACITY) && !self.is_core_idle(topo, cpu) {
                if idle_smt.is_none() {
                    idle_smt = Some(cpu);
                }
                // One idle thread of a busy core is enough to remember.
                swb.andnot_assign(topo.smt_mask(cpu));
                c = swb.next_lt(cpu + 1, n);
                continue;
            }
            return cpu == env.dst_cpu;
        }
        if let Some(s) = idle_smt {
            return s == env.dst_cpu;
        }
        env.dst_grpmask.first() == Some(env.dst_cpu)
    }

    fn is_core_idle(&self, topo: &Topology, cpu: usize) -> bool {
        topo.smt_siblings(cpu)
            .iter()
            .all(|&s| s as usize == cpu || self.work.cpus[s as usize].idle_cpu())
    }

    fn domain_params(&self, pass: &Pass<'_, '_>, d: &Domain, env: &Env) -> DomainParams {
        let dst = env.dst_cpu;
        DomainParams {
            imbalance_pct: d.imbalance_pct,
            numa: d.has(sd::NUMA),
            share_llc: d.has(sd::SHARE_LLC),
            asym_cpucapacity: d.has(sd::ASYM_CPUCAPACITY),
            imb_numa_nr: d.imb_numa_nr,
            dst_idle: env.idle != IdleType::NotIdle,
            dst_core_idle: !pass.topo.smt_active || self.is_core_idle(pass.topo, dst),
            dst_capacity: self.work.cpus[dst].capacity as u64,
        }
    }
}

/// A one-call replay's record of what a search found (the first busiest
/// group and runqueue, the type and imbalance the first search set) and of
/// each runqueue the walk is about to take tasks from.
fn record_found(pass: &mut Pass<'_, '_>, env: &Env, group: SpanId, found: Option<usize>, nr: u32) {
    let Some(o) = pass.outcome.as_deref_mut() else {
        return;
    };
    if o.first_group.is_none() {
        o.first_group = Some(group);
        o.first_rq = found;
        o.migration_type = Some(env.migration_type);
        o.imbalance = env.imbalance;
    }
    if let Some(b) = found
        && nr > 1
    {
        o.busiest.push(b);
    }
}

/// `get_sd_balance_interval()` in ms (HZ = 1000): longer when the CPU is
/// busy, and offset by one so levels do not fire together.
fn balance_interval(base: u32, busy: bool, max: u32) -> u32 {
    let mut i = base;
    if busy {
        i = i * BUSY_FACTOR - 1;
    }
    i.clamp(1, max.max(1))
}
