//! The fork/exec slow path: `sched_balance_find_dst_cpu()` walks down the
//! domains; at each level `sched_balance_find_dst_group()` picks the idlest
//! group (or stays local) and `sched_balance_find_dst_group_cpu()` the CPU.

use crate::engine::cpumask::CpuMask;
use crate::engine::ctx::Ctx;
use crate::engine::decision::Path;
use crate::engine::balance::lb::adjust_numa_imbalance;
use crate::engine::topology::{Domain, SpanId, sd};

/// `enum group_type`, in the kernel's numeric order (lower = idler).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum GroupType {
    HasSpare = 0,
    FullyBusy = 1,
    MisfitTask = 2,
    Overloaded = 7,
}

/// `struct sg_lb_stats` as `update_sg_wakeup_stats()` fills it.
#[derive(Debug, Clone, Copy)]
pub struct SgStats {
    pub group_type: GroupType,
    pub avg_load: u64,
    pub group_load: i64,
    pub group_util: i64,
    pub group_runnable: i64,
    pub sum_nr_running: i64,
    pub idle_cpus: i64,
    pub group_capacity: i64,
    pub group_max_capacity: i64,
    pub group_weight: i64,
    pub misfit: bool,
}

impl SgStats {
    /// The starting point of the idlest search: the worst possible group.
    const WORST: SgStats = SgStats {
        group_type: GroupType::Overloaded,
        avg_load: u32::MAX as u64,
        group_load: 0,
        group_util: 0,
        group_runnable: 0,
        sum_nr_running: 0,
        idle_cpus: 0,
        group_capacity: 0,
        group_max_capacity: 0,
        group_weight: 0,
        misfit: false,
    };
}

impl Ctx<'_> {
    /// `sched_balance_find_dst_cpu()`: from the highest flagged domain down,
    /// move to the idlest group's idlest CPU and refine below it.
    pub(crate) fn sched_balance_find_dst_cpu(
        &mut self,
        this_cpu: usize,
        sd_idx: usize,
        prev_cpu: usize,
        sd_flag: u32,
    ) -> (usize, Path) {
        let topo = self.topo;
        let top = &topo.domains(this_cpu)[sd_idx];
        if !topo.span(top.span).intersects(&self.cpus_ptr) {
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
            let Some(group) = self.sched_balance_find_dst_group(d, cpu) else {
                sd = child;
                continue;
            };
            self.detail.slow_levels += 1;
            new_cpu = self.sched_balance_find_dst_group_cpu(group, cpu);
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
    fn sched_balance_find_dst_group(&mut self, d: &Domain, this_cpu: usize) -> Option<SpanId> {
        let topo = self.topo;
        let mut idlest: Option<SpanId> = None;
        let mut idlest_sgs = SgStats::WORST;
        let mut local: Option<SgStats> = None;
        let mut local_group: Option<SpanId> = None;
        for &g in &d.groups {
            let span = topo.span(g);
            if !span.intersects(&self.cpus_ptr) || !self.sched_group_cookie_match(span) {
                continue;
            }
            let sgs = self.update_sg_wakeup_stats(d, g);
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
        self.local_vs_idlest(d, this_cpu, &local, local_span, idlest, &idlest_sgs)
    }

    /// The end of `sched_balance_find_dst_group()`: is the idlest remote group
    /// enough better than the local one to leave it?
    fn local_vs_idlest(
        &self,
        d: &Domain,
        this_cpu: usize,
        local: &SgStats,
        local_span: &CpuMask,
        idlest: SpanId,
        idlest_sgs: &SgStats,
    ) -> Option<SpanId> {
        if local.group_type < idlest_sgs.group_type {
            return None;
        }
        if local.group_type > idlest_sgs.group_type {
            return Some(idlest);
        }
        let pct = d.imbalance_pct as u64;
        match local.group_type {
            GroupType::Overloaded | GroupType::FullyBusy => {
                let imb = 1024 * (pct - 100) / 100;
                if d.has(sd::NUMA) && idlest_sgs.avg_load + imb >= local.avg_load {
                    return None;
                }
                if idlest_sgs.avg_load >= local.avg_load + imb {
                    return None;
                }
                if 100 * local.avg_load <= pct * idlest_sgs.avg_load {
                    return None;
                }
            }
            GroupType::MisfitTask => {
                if local.group_max_capacity >= idlest_sgs.group_max_capacity {
                    return None;
                }
            }
            GroupType::HasSpare => {
                if d.has(sd::NUMA) {
                    let nid = self.p.numa_preferred_nid;
                    if nid >= 0 {
                        if self.topo.node_of(this_cpu) as i32 == nid {
                            return None;
                        }
                        let first = self.topo.span(idlest).first().expect("non-empty group");
                        if self.topo.node_of(first) as i32 == nid {
                            return Some(idlest);
                        }
                    }
                    let allowed =
                        (local_span.and(&self.cpus_ptr).weight() as i64).min(d.imb_numa_nr as i64);
                    let imb = (local.idle_cpus - idlest_sgs.idle_cpus).abs();
                    if adjust_numa_imbalance(imb, local.sum_nr_running + 1, allowed) == 0 {
                        return None;
                    }
                }
                if local.idle_cpus >= idlest_sgs.idle_cpus {
                    return None;
                }
            }
        }
        Some(idlest)
    }

    /// `update_sg_wakeup_stats()`: the group's statistics as if the task were
    /// not there (an exec'ing task is removed from its own CPU).
    fn update_sg_wakeup_stats(&mut self, d: &Domain, g: SpanId) -> SgStats {
        let topo = self.topo;
        let span = topo.span(g);
        let asym = d.has(sd::ASYM_CPUCAPACITY);
        let exec_cpu = self.exec_cpu;
        let mut s = SgStats {
            group_type: GroupType::HasSpare,
            avg_load: 0,
            group_load: 0,
            group_util: 0,
            group_runnable: 0,
            sum_nr_running: 0,
            idle_cpus: 0,
            group_capacity: 0,
            group_max_capacity: 0,
            group_weight: topo.span_weight[g as usize] as i64,
            misfit: asym,
        };
        // The snapshot's sums stand for the CPU walk when the task is on
        // none of the group's CPUs and may use all of them.
        let k = topo.sum_index[g as usize];
        if !asym
            && k != u32::MAX
            && self.st.groups.len() == topo.sum_groups.len()
            && self.st.groups_util_est == self.f.util_est
            && exec_cpu.is_none_or(|c| !span.test(c))
            && span.is_subset(&self.cpus_ptr)
        {
            let sum = &self.st.groups[k as usize];
            self.detail.slow_cpus_read += s.group_weight as u32;
            s.group_capacity = sum.capacity;
            s.group_max_capacity = sum.max_capacity;
            s.group_load = sum.load;
            s.group_runnable = sum.runnable;
            s.group_util = sum.util;
            s.sum_nr_running = sum.nr_running;
            s.idle_cpus = sum.idle_cpus;
            return self.finish_wakeup_stats(d, s);
        }
        let n = topo.nr_cpus;
        let mut next = span.next_lt(0, n);
        while let Some(i) = next {
            next = span.next_lt(i + 1, n);
            let rq = &self.st.cpus[i];
            s.group_capacity += rq.capacity as i64;
            s.group_max_capacity = s.group_max_capacity.max(rq.capacity as i64);
            if !self.cpus_ptr.test(i) {
                continue;
            }
            self.detail.slow_cpus_read += 1;
            let here = exec_cpu == Some(i);
            if here {
                s.group_load += (rq.load_avg - self.p.load_avg).max(0);
                s.group_runnable += (rq.runnable_avg - self.p.runnable_avg).max(0);
            } else {
                s.group_load += rq.load_avg;
                s.group_runnable += rq.runnable_avg;
            }
            s.group_util += self.cpu_util(i, here);
            let nr = rq.nr_running as i64 - here as i64;
            s.sum_nr_running += nr;
            if nr == 0 && (rq.curr_is_idle || here) && !rq.ttwu_pending {
                s.idle_cpus += 1;
            }
            if asym && s.misfit && self.task_fits_cpu(i) {
                s.misfit = false;
            }
        }
        self.finish_wakeup_stats(d, s)
    }

    /// The end of `update_sg_wakeup_stats()`: classify, then the average
    /// load of a busy group.
    fn finish_wakeup_stats(&self, d: &Domain, mut s: SgStats) -> SgStats {
        s.group_type = group_classify(d.imbalance_pct as i64, &s);
        if matches!(s.group_type, GroupType::FullyBusy | GroupType::Overloaded) {
            s.avg_load = (s.group_load.max(0) as u64) * 1024 / (s.group_capacity.max(1) as u64);
        }
        s
    }

    /// `sched_balance_find_dst_group_cpu()`: a SCHED_IDLE-only CPU at once,
    /// else the idle CPU in the shallowest state (most recently idle on ties),
    /// else the least loaded.
    fn sched_balance_find_dst_group_cpu(&self, g: SpanId, this_cpu: usize) -> usize {
        let topo = self.topo;
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
            if !self.cpus_ptr.test(i) || !self.sched_core_cookie_match(i) {
                continue;
            }
            if self.choose_sched_idle_rq(i) {
                return i;
            }
            let rq = self.rq(i);
            if rq.available_idle() {
                match rq.idle_exit_latency {
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
                let load = rq.load_avg.max(0) as u64;
                if load < min_load {
                    min_load = load;
                    least_loaded = i;
                }
            }
        }
        shallowest.unwrap_or(least_loaded)
    }
}

/// `group_classify()` for the wakeup statistics.
fn group_classify(pct: i64, s: &SgStats) -> GroupType {
    if group_is_overloaded(pct, s) {
        return GroupType::Overloaded;
    }
    if s.misfit {
        return GroupType::MisfitTask;
    }
    if !group_has_capacity(pct, s) {
        return GroupType::FullyBusy;
    }
    GroupType::HasSpare
}

fn group_is_overloaded(pct: i64, s: &SgStats) -> bool {
    if s.sum_nr_running <= s.group_weight {
        return false;
    }
    s.group_capacity * 100 < s.group_util * pct || s.group_capacity * pct < s.group_runnable * 100
}

fn group_has_capacity(pct: i64, s: &SgStats) -> bool {
    if s.sum_nr_running < s.group_weight {
        return true;
    }
    if s.group_capacity * pct < s.group_runnable * 100 {
        return false;
    }
    s.group_capacity * 100 > s.group_util * pct
}

/// `update_pick_idlest()`: is `cand` a better target than the idlest so far?
fn update_pick_idlest(idlest: &SgStats, cand: &SgStats) -> bool {
    if cand.group_type != idlest.group_type {
        return cand.group_type < idlest.group_type;
    }
    match cand.group_type {
        GroupType::Overloaded | GroupType::FullyBusy => cand.avg_load < idlest.avg_load,
        GroupType::MisfitTask => cand.group_max_capacity > idlest.group_max_capacity,
        GroupType::HasSpare => {
            cand.idle_cpus > idlest.idle_cpus
                || (cand.idle_cpus == idlest.idle_cpus && cand.group_util < idlest.group_util)
        }
    }
}
