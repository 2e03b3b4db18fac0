//! Moving tasks: `detach_tasks` through `can_migrate_task` on the pass's
//! working copy, and active balancing when nothing could be detached.

use super::*;
use crate::engine::v6_12::lb_h_nr_running;

impl Balancer {
    /// `can_migrate_task()` for the working copy, counting refusals.
    pub(super) fn can_migrate(
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
    pub(super) fn detach_tasks(
        &mut self,
        pass: &mut Pass<'_, '_>,
        env: &mut Env,
        this_cpu: usize,
    ) -> u32 {
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
                    let slot = CpusPtrSlot::new();
                    if Ctx::new(self.view(pass), &p, src, &slot).task_fits_cpu(src) {
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
            // A preemptible kernel (CONFIG_PREEMPTION, as distributions
            // build it) keeps a newly idle pull to one task: it runs with
            // interrupts off on the way into the idle loop.
            if env.idle == IdleType::NewlyIdle || env.imbalance <= 0 || self.full(pass) {
                break;
            }
        }
        detached
    }

    /// `attach_tasks()`: the detached tasks join `dst`, at the head.
    pub(super) fn attach_tasks(&mut self, pass: &Pass<'_, '_>, dst: usize) {
        while let Some(mut t) = self.detached.pop() {
            t.running = false;
            self.enqueue(pass, dst, t);
        }
    }

    pub(super) fn dequeue(&mut self, pass: &Pass<'_, '_>, cpu: usize, t: &RqTask) {
        rq_sub(&mut self.work.cpus[cpu], t);
        if let Some(l) = pass.llc {
            self.llc
                .dequeue(cpu, l.task_pref(t.group), !t.sched_delayed);
        }
    }

    pub(super) fn enqueue(&mut self, pass: &Pass<'_, '_>, cpu: usize, t: RqTask) {
        rq_add(&mut self.work.cpus[cpu], &t);
        if let Some(l) = pass.llc {
            self.llc
                .enqueue(cpu, l.task_pref(t.group), !t.sched_delayed);
        }
        self.list_mut(pass.table, cpu).push_front(t);
    }

    /// `need_active_balance()`.
    pub(super) fn need_active_balance(&self, pass: &Pass<'_, '_>, env: &Env) -> bool {
        let topo = pass.topo;
        let d = &topo.domains(env.sd_cpu)[env.sd];
        if let Some(l) = pass.llc {
            let curr = self.curr(pass.table, env.src_cpu).map(|t| {
                let p = pass.table.task(t, env.src_cpu);
                let slot = CpusPtrSlot::new();
                let ctx = Ctx::new(self.view(pass), &p, env.src_cpu, &slot);
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
            && lb_h_nr_running(pass.view.features.kernel, src) == 1
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
    pub(super) fn curr_allowed_on(&self, pass: &Pass<'_, '_>, src: usize, cpu: usize) -> bool {
        match self.curr(pass.table, src) {
            Some(t) => {
                let p = pass.table.task(t, src);
                let slot = CpusPtrSlot::new();
                Ctx::new(self.view(pass), &p, src, &slot).cpus_ptr.test(cpu)
            }
            None => true,
        }
    }

    /// `active_load_balance_cpu_stop()`: the source's stopper pushes the
    /// coldest task that may move (hotness no longer matters).
    pub(super) fn active_load_balance(
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
