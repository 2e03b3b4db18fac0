//! The balancer's look at a domain: the groups' statistics
//! (`update_sg_lb_stats`), the busiest group and runqueue
//! (`sched_balance_find_src_group`, `sched_balance_find_src_rq`), and the
//! group facts they read (`sg->flags`, `sg->cores`, `sgc->imbalance`).

use super::*;
use crate::engine::v6_12::lb_h_nr_running;

impl Balancer {
    /// `sched_balance_find_src_group()`: statistics of every group
    /// (`update_sd_lb_stats`), the busiest remote group, and whether and how
    /// much to move. Sets the env's migration type and imbalance.
    pub(super) fn sched_balance_find_src_group(
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
            let sgs = self.update_sg_lb_stats(pass, env, d, i, g);
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
    pub(super) fn update_sg_lb_stats(
        &self,
        pass: &Pass<'_, '_>,
        env: &Env,
        d: &Domain,
        i: usize,
        g: SpanId,
    ) -> SgLbStats {
        let is_local = i == 0;
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
            let h_nr = lb_h_nr_running(pass.view.features.kernel, rq);
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
            numa_remote_group_flags(d, i)
        } else {
            group_flags(topo, g)
        };
        s.smt = flags & sd::SHARE_CPUCAPACITY != 0;
        s.prefer_sibling = flags & sd::PREFER_SIBLING != 0;
        let sgc_level = d.groups.sgc_level(i).unwrap_or(d.level_idx as usize);
        s.sgc_imbalance = self.lb.group_imbalance[sgc_index_at(topo, sgc_level, g)];
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
    pub(super) fn misfit_load(&self, pass: &Pass<'_, '_>, cpu: usize) -> u64 {
        let topo = pass.topo;
        if !topo.asym_active {
            return 0;
        }
        let Some(t) = self.curr(pass.table, cpu) else {
            return 0;
        };
        let p = pass.table.task(t, cpu);
        let slot = CpusPtrSlot::new();
        let ctx = Ctx::new(self.view(pass), &p, cpu, &slot);
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
    pub(super) fn sched_balance_find_src_rq(
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
            let nr = lb_h_nr_running(pass.view.features.kernel, rq);
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
pub(super) fn group_flags(topo: &Topology, g: SpanId) -> u32 {
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
/// own (the `i`th of the domain). NUMA groups are built per CPU
/// (`build_overlap_sched_groups()`), each taking the flags of the child of
/// the domain it was built from as it stood before degeneration
/// (`find_descended_sibling()` may have gone down first): the NODE level's
/// (which keeps SD_PREFER_SIBLING) or a NUMA level's (SD_NUMA, no
/// SD_PREFER_SIBLING). The live kernel showed the descended case: in
/// `numa4`, CPU 1's NUMA2 group {4,5} was built from CPU 4's NUMA1 domain,
/// so it carries NODE's SD_PREFER_SIBLING. When that child degenerates
/// away, `cpu_attach_domain()` rewrites only the CPU's local group, so a
/// remote group never takes the surviving domain's flags.
pub(super) fn numa_remote_group_flags(d: &Domain, i: usize) -> u32 {
    let child = d.groups.build_flags(i);
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
pub(super) fn group_cores(topo: &Topology, span: &CpuMask) -> u32 {
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
pub(super) fn sgc_index(topo: &Topology, level: Level, g: SpanId) -> usize {
    let at = topo.levels.iter().position(|&l| l == level).unwrap_or(0);
    sgc_index_at(topo, at, g)
}

/// [`sgc_index`] by level index.
pub(super) fn sgc_index_at(topo: &Topology, level_idx: usize, g: SpanId) -> usize {
    level_idx * topo.spans.len() + g as usize
}
