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
use crate::engine::ctx::{Ctx, View};
use crate::engine::group::{self, GroupType, SgLbStats};
use crate::engine::rq::{RqTask, TaskTable, h_nr_runnable, rq_add, rq_sub};
use crate::engine::state::{NodeState, cpu_util};

use super::src_rq::{BusiestRq, check_cpu_capacity, detach_amount};
use crate::engine::topology::{Domain, Level, SpanId, Topology, sd};

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
        if !self.lb.fits(topo) {
            self.lb = LbState::new(topo);
            self.llc_recorded.clear();
        }
        self.work.cpus.clone_from(&view.state.cpus);
        self.work.shared.clone_from(&view.state.shared);
        // No group sums: the working copy changes as tasks move.
        self.work.groups.clear();
        self.tasks.resize_with(topo.nr_cpus, VecDeque::new);
        self.copied.clear();
        self.copied.resize(topo.nr_cpus, false);
        if let Some(l) = llc {
            l.counts(topo, &table.cpus, &mut self.llc);
            l.recorded.borrow_mut().clone_from(&self.llc_recorded);
        }
        let mut pass = Pass {
            topo,
            view,
            table,
            llc,
            opts,
            out,
            stats: PassStats::default(),
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
            let Some(busiest) = self.sched_balance_find_src_rq(pass, &env, group) else {
                break 'redo Exit::Balanced;
            };
            env.src_cpu = busiest;
            env.flags |= lbf::ALL_PINNED;
            env.start_imbalance = env.imbalance;
            let nr = self.work.cpus[busiest].nr_running;
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
                if env.migration_type != MigrationType::Misfit && !llc_pinned {
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

    /// `sched_balance_find_src_group()`: statistics of every group
    /// (`update_sd_lb_stats`), the busiest remote group, and whether and how
    /// much to move. Sets the env's migration type and imbalance.
    fn sched_balance_find_src_group(
        &self,
        pass: &Pass<'_, '_>,
        env: &mut Env,
        this_cpu: usize,
    ) -> Option<SpanId> {
        let topo = pass.topo;
        let d = &topo.domains(this_cpu)[env.sd];
        let p = self.domain_params(pass, d, env);
        let mut sds = SdTotals::default();
        let mut local = SgLbStats::default();
        let mut busiest: Option<SpanId> = None;
        let mut busiest_sgs = SgLbStats::NO_BUSIEST;
        for (i, &g) in d.groups.iter().enumerate() {
            let is_local = i == 0;
            let sgs = self.update_sg_lb_stats(pass, env, d, g, is_local);
            sds.total_load += sgs.group_load;
            sds.total_capacity += sgs.group_capacity;
            if is_local {
                local = sgs;
                continue;
            }
            if lb::update_sd_pick_busiest(&p, local.group_type, &busiest_sgs, &sgs) {
                busiest = Some(g);
                busiest_sgs = sgs;
            }
        }
        let busiest = busiest?;
        sds.prefer_sibling = busiest_sgs.prefer_sibling;
        env.busiest_type = busiest_sgs.group_type;
        env.local_type = local.group_type;
        let imb = lb::find_busiest_decision(&p, &mut sds, &mut local, &busiest_sgs)?;
        env.migration_type = imb.migration_type;
        env.imbalance = imb.imbalance;
        (imb.imbalance != 0).then_some(busiest)
    }

    /// `update_sg_lb_stats()` over `group ∩ env.cpus`.
    fn update_sg_lb_stats(
        &self,
        pass: &Pass<'_, '_>,
        env: &Env,
        d: &Domain,
        g: SpanId,
        is_local: bool,
    ) -> SgLbStats {
        let topo = pass.topo;
        let span = topo.span(g);
        let util_est = pass.view.features.util_est;
        let mut s = SgLbStats {
            min_capacity: u64::MAX,
            ..SgLbStats::default()
        };
        let n = topo.nr_cpus;
        let mut c = span.next_lt(0, n);
        while let Some(i) = c {
            c = span.next_lt(i + 1, n);
            if !topo.online.test(i) {
                continue;
            }
            let rq = &self.work.cpus[i];
            let cap = rq.capacity as u64;
            s.group_capacity += cap;
            s.min_capacity = s.min_capacity.min(cap);
            s.max_capacity = s.max_capacity.max(cap);
            s.group_weight += 1;
            if !env.cpus.test(i) {
                continue;
            }
            s.group_load += rq.load_avg as u64;
            s.group_util += cpu_util(rq, topo.capacity_orig(i), util_est, false, None) as u64;
            s.group_runnable += rq.runnable_avg as u64;
            let h_nr = h_nr_runnable(rq);
            s.sum_h_nr_running = s.sum_h_nr_running.saturating_add(h_nr);
            s.sum_nr_running = s.sum_nr_running.saturating_add(rq.nr_running);
            if let Some(l) = pass.llc
                && l.llc.llc(i) != l.llc.llc(env.dst_cpu)
            {
                s.nr_pref_dst_llc += self.llc.pref_on(i, env.dst_cpu);
            }
            if rq.nr_running == 0 && rq.idle_cpu() {
                s.idle_cpus += 1;
                continue;
            }
            if is_local {
                continue;
            }
            if d.has(sd::ASYM_CPUCAPACITY) {
                s.group_misfit_task_load = s.group_misfit_task_load.max(self.misfit_load(pass, i));
            } else if env.idle != IdleType::NotIdle
                && h_nr == 1
                && check_cpu_capacity(rq, topo.capacity_orig(i), d.imbalance_pct)
            {
                s.group_misfit_task_load = s.group_misfit_task_load.max(rq.load_avg as u64);
            }
        }
        if s.min_capacity == u64::MAX {
            s.min_capacity = 0;
        }
        s.cores = group_cores(topo, span);
        let flags = if d.has(sd::NUMA) && !is_local {
            numa_remote_group_flags(topo, d)
        } else {
            group_flags(topo, g)
        };
        s.smt = flags & sd::SHARE_CPUCAPACITY != 0;
        s.prefer_sibling = flags & sd::PREFER_SIBLING != 0;
        s.sgc_imbalance = self.lb.group_imbalance[sgc_index(topo, d.level, g)];
        let k = env.sd;
        if !is_local {
            s.group_smt_balance = env.idle != IdleType::NotIdle && s.smt && s.sum_h_nr_running > 1;
            if let Some(l) = pass.llc {
                s.group_llc_balance = l.llc_balance(
                    topo,
                    &self.work,
                    d,
                    &s,
                    span,
                    env.dst_cpu,
                    self.lb.dom[env.sd_cpu][env.sd].nr_balance_failed,
                );
            }
        }
        group::finish_lb_stats(d.imbalance_pct, &mut s);
        // record_sg_llc_stats(): at the level just above the destination's
        // LLC, each group is an LLC; its sums are what can_migrate_llc reads.
        if let Some(l) = pass.llc
            && env.idle != IdleType::NewlyIdle
            && k >= 1
            && topo.cpu[env.sd_cpu].sd_llc == Some((k - 1) as u8)
            && let Some(first) = span.first()
        {
            l.record(first, s.group_util, s.group_capacity);
        }
        s
    }

    /// `rq->misfit_task_load` (`update_misfit_status`): the running task's
    /// load when it does not fit its CPU and could go somewhere bigger;
    /// asymmetric capacity only.
    fn misfit_load(&self, pass: &Pass<'_, '_>, cpu: usize) -> u64 {
        let topo = pass.topo;
        if !topo.asym_active {
            return 0;
        }
        let Some(t) = self.curr(pass.table, cpu) else {
            return 0;
        };
        let p = pass.table.task(t, cpu);
        let ctx = Ctx::new(self.view(pass), &p, cpu);
        let allowed = ctx.cpus_ptr.and(&topo.online);
        // Pinned to one CPU, or already on its biggest allowed CPU: nowhere
        // better to go.
        let max_allowed = allowed
            .iter()
            .map(|c| topo.capacity_orig(c))
            .max()
            .unwrap_or(0);
        if allowed.weight() <= 1 || topo.capacity_orig(cpu) >= max_allowed {
            return 0;
        }
        if ctx.task_fits_cpu(cpu) {
            0
        } else {
            t.load_avg.max(1) as u64
        }
    }

    /// `sched_balance_find_src_rq()`: the busiest runqueue of the group in the
    /// units of the migration type; the first maximum wins.
    fn sched_balance_find_src_rq(
        &self,
        pass: &Pass<'_, '_>,
        env: &Env,
        group: SpanId,
    ) -> Option<usize> {
        let topo = pass.topo;
        let d = &topo.domains(env.sd_cpu)[env.sd];
        let util_est = pass.view.features.util_est;
        let dst_cap = self.work.cpus[env.dst_cpu].capacity as u64;
        let mut busiest = BusiestRq::default();
        let span = topo.span(group);
        let n = topo.nr_cpus;
        let mut c = span.next_lt(0, n);
        while let Some(i) = c {
            c = span.next_lt(i + 1, n);
            if !env.cpus.test(i) {
                continue;
            }
            let rq = &self.work.cpus[i];
            let nr = h_nr_runnable(rq);
            if nr == 0 {
                continue;
            }
            let cap = rq.capacity as u64;
            // A lone task gains nothing on a CPU that is not noticeably bigger.
            if d.has(sd::ASYM_CPUCAPACITY) && !lb::capacity_greater(dst_cap, cap) && nr == 1 {
                continue;
            }
            match env.migration_type {
                MigrationType::Load => {
                    let reduced = check_cpu_capacity(rq, topo.capacity_orig(i), d.imbalance_pct);
                    let load = rq.load_avg as u64;
                    busiest.consider_load(i, nr as u64, load, cap, reduced, env.imbalance);
                }
                MigrationType::Util => {
                    let util = cpu_util(rq, topo.capacity_orig(i), util_est, true, None);
                    busiest.consider_util(i, nr as u64, util as u64);
                }
                MigrationType::Task => busiest.consider_count(i, nr as u64),
                MigrationType::Misfit => busiest.consider_misfit(i, self.misfit_load(pass, i)),
                MigrationType::LlcTask => {
                    busiest.consider_count(i, self.llc.pref_on(i, env.dst_cpu) as u64)
                }
            }
        }
        busiest.busiest
    }

    /// `can_migrate_task()` for the working copy, counting refusals.
    fn can_migrate(
        &self,
        pass: &mut Pass<'_, '_>,
        env: &mut Env,
        t: &RqTask,
        running_ok: bool,
    ) -> Option<(bool, bool)> {
        let mut p = pass.table.task(t, env.src_cpu);
        if running_ok {
            p.running = false;
        }
        let menv = MigrateEnv {
            src_cpu: env.src_cpu,
            dst_cpu: env.dst_cpu,
            sd_cpu: env.sd_cpu,
            sd: env.sd,
            dst_group: env.dst_grpmask,
            env_cpus: env.cpus,
            idle: env.idle,
            migration_type: env.migration_type,
            flags: env.flags,
            nr_balance_failed: self.lb.dom[env.sd_cpu][env.sd].nr_balance_failed,
            cache_nice_tries: None,
            throttled: false,
            dst_cfs_nr_queued: self.work.cpus[env.dst_cpu].cfs_h_nr_queued,
            now: pass.table.clock.get(env.src_cpu).copied().unwrap_or(0),
        };
        let llc = pass.llc.map(|l| (l, t.group));
        let r = migrate::can_migrate_task_llc(self.view(pass), &p, &menv, llc);
        env.flags = r.flags;
        if let Some(nd) = r.new_dst_cpu {
            env.new_dst_cpu = Some(nd);
        }
        if r.allowed {
            Some((r.task_hot == Some(true), r.llc_decided))
        } else {
            let idx = Reason::ALL.iter().position(|x| *x == r.reason).unwrap_or(0);
            pass.stats.rejections[idx] += 1;
            None
        }
    }

    /// `detach_tasks()`: take tasks from the source's coldest end until the
    /// imbalance is covered. Detached tasks wait in `self.detached`.
    fn detach_tasks(&mut self, pass: &mut Pass<'_, '_>, env: &mut Env, this_cpu: usize) -> u32 {
        let src = env.src_cpu;
        if self.work.cpus[src].nr_running <= 1 {
            env.flags &= !lbf::ALL_PINNED;
            return 0;
        }
        if env.imbalance <= 0 {
            return 0;
        }
        let failed = self.lb.dom[this_cpu][env.sd].nr_balance_failed;
        let shift = failed.min(63);
        let mut detached = 0;
        while !self.list_mut(pass.table, src).is_empty() {
            if env.idle != IdleType::NotIdle && self.work.cpus[src].nr_running <= 1 {
                break;
            }
            env.loop_ += 1;
            if env.loop_ > env.loop_max {
                break;
            }
            if env.loop_ > env.loop_break {
                env.loop_break += NR_MIGRATE_BREAK;
                env.flags |= lbf::NEED_BREAK;
                break;
            }
            let t = self.tasks[src].pop_back().expect("non-empty");
            let Some((hot, llc_decided)) = self.can_migrate(pass, env, &t, false) else {
                self.tasks[src].push_front(t);
                continue;
            };
            let take = match env.migration_type {
                MigrationType::Misfit => {
                    let p = pass.table.task(&t, src);
                    if Ctx::new(self.view(pass), &p, src).task_fits_cpu(src) {
                        None
                    } else {
                        Some(env.imbalance)
                    }
                }
                ty => detach_amount(ty, &t, shift, env.imbalance),
            };
            let Some(amount) = take else {
                self.tasks[src].push_front(t);
                continue;
            };
            env.imbalance -= amount;
            self.dequeue(pass, src, &t);
            pass.out.push(Proposal {
                task: t.id,
                group: t.group,
                src_cpu: src,
                dst_cpu: env.dst_cpu,
                migration_type: env.migration_type,
                active: false,
                level: pass.topo.domains(this_cpu)[env.sd].level,
                busiest: env.busiest_type,
                local: env.local_type,
                imbalance: env.start_imbalance,
                forced_hot: hot,
                nr_balance_failed: failed,
                llc_preference: llc_decided,
            });
            self.detached.push(t);
            detached += 1;
            if env.imbalance <= 0 || self.full(pass) {
                break;
            }
        }
        detached
    }

    /// `attach_tasks()`: the detached tasks join `dst`, at the head.
    fn attach_tasks(&mut self, pass: &Pass<'_, '_>, dst: usize) {
        while let Some(mut t) = self.detached.pop() {
            t.running = false;
            self.enqueue(pass, dst, t);
        }
    }

    fn dequeue(&mut self, pass: &Pass<'_, '_>, cpu: usize, t: &RqTask) {
        rq_sub(&mut self.work.cpus[cpu], t);
        if let Some(l) = pass.llc {
            self.llc
                .dequeue(cpu, l.task_pref(t.group), !t.sched_delayed);
        }
    }

    fn enqueue(&mut self, pass: &Pass<'_, '_>, cpu: usize, t: RqTask) {
        rq_add(&mut self.work.cpus[cpu], &t);
        if let Some(l) = pass.llc {
            self.llc
                .enqueue(cpu, l.task_pref(t.group), !t.sched_delayed);
        }
        self.list_mut(pass.table, cpu).push_front(t);
    }

    /// `need_active_balance()`.
    fn need_active_balance(&self, pass: &Pass<'_, '_>, env: &Env) -> bool {
        let topo = pass.topo;
        let d = &topo.domains(env.sd_cpu)[env.sd];
        if let Some(l) = pass.llc {
            let curr = self.curr(pass.table, env.src_cpu).map(|t| {
                let p = pass.table.task(t, env.src_cpu);
                let ctx = Ctx::new(self.view(pass), &p, env.src_cpu);
                let misfits = d.has(sd::ASYM_CPUCAPACITY)
                    && !ctx.task_fits_cpu(env.dst_cpu)
                    && ctx.task_fits_cpu(env.src_cpu);
                (t, misfits)
            });
            if l.alb_break_llc(
                topo,
                &self.work,
                &self.llc,
                (env.src_cpu, env.dst_cpu),
                env.migration_type == MigrationType::Misfit,
                curr,
            ) {
                return false;
            }
        }
        let failed = self.lb.dom[env.sd_cpu][env.sd].nr_balance_failed;
        if env.migration_type == MigrationType::Task && failed > d.cache_nice_tries + 2 {
            return true;
        }
        let src = &self.work.cpus[env.src_cpu];
        if env.idle != IdleType::NotIdle
            && h_nr_runnable(src) == 1
            && check_cpu_capacity(src, topo.capacity_orig(env.src_cpu), d.imbalance_pct)
            && (src.capacity as u64) * (d.imbalance_pct as u64)
                < self.work.cpus[env.dst_cpu].capacity as u64 * 100
        {
            return true;
        }
        matches!(
            env.migration_type,
            MigrationType::Misfit | MigrationType::LlcTask
        )
    }

    /// Whether the source's current task may run on `cpu` (the stopper is
    /// not kicked otherwise). Unknown when no task is reported running.
    fn curr_allowed_on(&self, pass: &Pass<'_, '_>, src: usize, cpu: usize) -> bool {
        match self.curr(pass.table, src) {
            Some(t) => {
                let p = pass.table.task(t, src);
                Ctx::new(self.view(pass), &p, src).cpus_ptr.test(cpu)
            }
            None => true,
        }
    }

    /// `active_load_balance_cpu_stop()`: the source's stopper pushes the
    /// coldest task that may move (hotness no longer matters).
    fn active_load_balance(
        &mut self,
        pass: &mut Pass<'_, '_>,
        lb_env: &Env,
        src: usize,
        target: usize,
    ) -> bool {
        let topo = pass.topo;
        if !topo.online.test(src) || !topo.online.test(target) {
            return false;
        }
        // The kernel tests nr_running <= 1 with the stopper itself counted:
        // one queued fair task is enough.
        if self.work.cpus[src].nr_running == 0 {
            return false;
        }
        let Some(k) = topo
            .domains(target)
            .iter()
            .position(|d| topo.span(d.span).test(src))
        else {
            return false;
        };
        pass.stats.active_balances += 1;
        let mut env = Env {
            sd_cpu: target,
            sd: k,
            dst_cpu: target,
            dst_grpmask: group_balance_mask(topo, target, k),
            cpus: topo.span(topo.domains(target)[k].span).and(&topo.online),
            idle: IdleType::Idle,
            src_cpu: src,
            // alb_stop_fn(): the cache-aware stopper for migrate_llc_task.
            flags: if lb_env.migration_type == MigrationType::LlcTask {
                lbf::ACTIVE_LB | lbf::ACTIVE_LB_LLC
            } else {
                lbf::ACTIVE_LB
            },
            migration_type: MigrationType::Load,
            ..lb_env.clone()
        };
        // The stopper runs on the source, so its former current task is
        // queued like the others.
        self.list_mut(pass.table, src);
        let pos = (0..self.tasks[src].len()).rev().find(|&j| {
            let t = self.tasks[src][j].clone();
            self.can_migrate(pass, &mut env, &t, true).is_some()
        });
        let Some(j) = pos else {
            return false;
        };
        let t = self.tasks[src].remove(j).expect("index in range");
        self.dequeue(pass, src, &t);
        pass.out.push(Proposal {
            task: t.id,
            group: t.group,
            src_cpu: src,
            dst_cpu: target,
            migration_type: lb_env.migration_type,
            active: true,
            level: topo.domains(target)[k].level,
            busiest: lb_env.busiest_type,
            local: lb_env.local_type,
            imbalance: lb_env.start_imbalance,
            forced_hot: false,
            nr_balance_failed: self.lb.dom[target][k].nr_balance_failed,
            llc_preference: lb_env.migration_type == MigrationType::LlcTask,
        });
        let mut t = t;
        t.running = false;
        self.enqueue(pass, target, t);
        self.lb.dom[target][k].nr_balance_failed = 0;
        true
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

/// `group_balance_mask()` of `cpu`'s local group at domain `k`: for an
/// overlapping NUMA group, only the CPUs whose own child domain is the
/// group; otherwise the whole group.
pub fn group_balance_mask(topo: &Topology, cpu: usize, k: usize) -> CpuMask {
    let d = &topo.domains(cpu)[k];
    let g = d.groups[0];
    let span = *topo.span(g);
    if !d.has(sd::NUMA) {
        return span;
    }
    let mut m = CpuMask::new();
    for i in span.iter() {
        let chain = topo.domains(i);
        let Some(j) = chain.iter().position(|x| x.level_idx == d.level_idx) else {
            continue;
        };
        let child_span = if j == 0 {
            CpuMask::from_cpus([i])
        } else {
            *topo.span(chain[j - 1].span)
        };
        if child_span == span {
            m.set(i);
        }
    }
    if m.is_empty() { span } else { m }
}

/// `sg->flags`: the flags of the child domain the group was built from.
fn group_flags(topo: &Topology, g: SpanId) -> u32 {
    let span = topo.span(g);
    let Some(first) = span.first() else {
        return 0;
    };
    topo.domains(first)
        .iter()
        .find(|d| d.span == g || topo.span(d.span) == span)
        .map_or(0, |d| d.flags)
}

/// `sg->flags` of a group at a NUMA level that is not the balancing CPU's
/// own. NUMA groups are built per CPU (`build_overlap_sched_groups()`), each
/// taking the flags of the child domain it was built from as it stood
/// before degeneration: the NODE level's (which keeps SD_PREFER_SIBLING) or
/// the NUMA level below's (SD_NUMA, no SD_PREFER_SIBLING). When that child
/// degenerates away, `cpu_attach_domain()` rewrites only the CPU's local
/// group, so a remote group never takes the surviving domain's flags (an
/// SMT domain's SD_SHARE_CPUCAPACITY, say, where a NUMA node is one core).
fn numa_remote_group_flags(topo: &Topology, d: &Domain) -> u32 {
    let at = topo.levels.iter().position(|&l| l == d.level).unwrap_or(0);
    let child = match at.checked_sub(1).map(|i| topo.levels[i]) {
        Some(Level::Numa(_)) => sd::NUMA,
        Some(_) => sd::PREFER_SIBLING,
        None => 0,
    };
    // sd_init(): no spreading across CPUs of different capacities.
    if d.has(sd::ASYM_CPUCAPACITY) {
        child & !sd::PREFER_SIBLING
    } else {
        child
    }
}

/// `sg->cores` (`init_sched_groups_capacity()`): the cores with an online
/// CPU in the group's own span. The kernel walks the span, counting a CPU
/// and removing its SMT siblings, so a one-CPU group at the SMT level is
/// one core whichever sibling it holds.
fn group_cores(topo: &Topology, span: &CpuMask) -> u32 {
    // A CPU starts a new core unless a lower sibling of it is in the span.
    span.iter()
        .filter(|&c| topo.online.test(c))
        .filter(|&c| {
            !topo
                .smt_siblings(c)
                .iter()
                .take_while(|&&s| (s as usize) < c)
                .any(|&s| span.test(s as usize))
        })
        .count() as u32
}

/// Where `sgc->imbalance` of the group `g` of a domain at `level` is
/// kept in [`LbState::group_imbalance`].
fn sgc_index(topo: &Topology, level: Level, g: SpanId) -> usize {
    let at = topo.levels.iter().position(|&l| l == level).unwrap_or(0);
    at * topo.spans.len() + g as usize
}
