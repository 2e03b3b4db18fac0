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

impl Ctx<'_> {
    /// `select_idle_sibling()`: the cheapest idle CPU that shares a cache with
    /// the target, trying the obvious candidates before scanning.
    pub(crate) fn select_idle_sibling(
        &mut self,
        req: &PlaceRequest,
        prev: usize,
        target: usize,
    ) -> (usize, Path) {
        let topo = self.topo;
        self.detail.sis_target = Some(target);

        if self.choose_idle_cpu(target) && self.asym_fits_cpu(target) {
            return (target, Path::Target);
        }

        // prev, if cache-affine with target; across clusters it waits until
        // the target's own cluster has been scanned.
        let mut prev_aff = None;
        if prev != target
            && topo.cpus_share_cache(prev, target)
            && self.choose_idle_cpu(prev)
            && self.asym_fits_cpu(prev)
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
            && self.rq(req.this_cpu).nr_running <= 1
            && self.asym_fits_cpu(prev)
        {
            return (prev, Path::PerCpuKthread);
        }

        let mut recent = self.p.recent_used_cpu;
        match recent {
            Some(r)
                if r != prev
                    && r != target
                    && topo.cpus_share_cache(r, target)
                    && self.choose_idle_cpu(r)
                    && self.cpus_ptr.test(r)
                    && self.asym_fits_cpu(r) =>
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
            let found = if self.is_v6_12() {
                self.select_idle_capacity_v6_12(sda, target)
            } else {
                self.select_idle_capacity(sda, target)
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
            has_idle_core = self.test_idle_cores(target);
            self.detail.has_idle_core = Some(has_idle_core);
            if !has_idle_core
                && topo.cpus_share_cache(prev, target)
                && let Some(i) = self.select_idle_smt(llc, prev)
            {
                return (i, Path::IdleSmt);
            }
        }

        if let Some((i, path)) = self.select_idle_cpu(llc, has_idle_core, target) {
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
    fn test_idle_cores(&self, cpu: usize) -> bool {
        self.balance_shared(cpu)
            .is_some_and(|s| self.st.shared[s as usize].has_idle_cores)
    }

    /// The SIS_UTIL scan budget of a domain, `nr_idle_scan + 1` because the
    /// loops pre-decrement; `None` when unlimited.
    fn sis_budget(&mut self, sd: &Domain) -> Option<i64> {
        if !self.f.sis_util {
            return None;
        }
        let s = sd.shared?;
        let nr = self.st.shared[s as usize].nr_idle_scan;
        self.detail.nr_idle_scan = Some(nr);
        Some(nr as i64 + 1)
    }

    /// `select_idle_smt()`: an idle sibling of prev, when no core is idle.
    fn select_idle_smt(&mut self, sd: &Domain, prev: usize) -> Option<usize> {
        let span = self.topo.span(sd.span);
        for &s in self.topo.smt_siblings(prev) {
            let c = s as usize;
            if !self.cpus_ptr.test(c) || c == prev || !span.test(c) {
                continue;
            }
            self.scanned += 1;
            if self.choose_idle_cpu(c) {
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
        &mut self,
        c: usize,
        has_idle_core: bool,
        nr: &mut i64,
        cpus: &mut CpuMask,
        idle_cpu: &mut Option<usize>,
    ) -> ControlFlow<Option<(usize, Path)>> {
        if has_idle_core {
            if let Some(i) = self.select_idle_core(c, cpus, idle_cpu) {
                return ControlFlow::Break(Some((i, Path::IdleCore)));
            }
        } else {
            *nr -= 1;
            if *nr <= 0 {
                return ControlFlow::Break(None);
            }
            if let Some(i) = self.__select_idle_cpu(c) {
                return ControlFlow::Break(Some((i, Path::IdleCpu)));
            }
        }
        ControlFlow::Continue(())
    }

    /// `select_idle_cpu()`: the LLC scan, the target's cluster first. In
    /// idle-core mode whole cores are tested and the budget is not spent; in
    /// per-CPU mode each probe costs one unit of the SIS_UTIL budget.
    fn select_idle_cpu(
        &mut self,
        sd: &Domain,
        has_idle_core: bool,
        target: usize,
    ) -> Option<(usize, Path)> {
        let topo = self.topo;
        let n = topo.nr_cpus;
        let mut nr = i64::MAX;
        if let Some(b) = self.sis_budget(sd) {
            if b == 1 {
                return None;
            }
            nr = b;
        }
        // The node's masks hold none of its CPUs beyond `n`: every mask op
        // of the scan runs over the node's words only, as the kernel's run
        // over `nr_cpumask_bits`.
        let mut cpus = topo.span(sd.span).and_lt(self.cpus_ptr, n);
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
                let step =
                    self.select_idle_step(c, has_idle_core, &mut nr, &mut cpus, &mut idle_cpu);
                if let ControlFlow::Break(found) = step {
                    return found;
                }
            }
            cpus.andnot_assign_lt(group, n);
        }

        let mut walk = WrapWalk::new(target + 1, n);
        while let Some(c) = walk.next(&cpus) {
            let step = self.select_idle_step(c, has_idle_core, &mut nr, &mut cpus, &mut idle_cpu);
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
    fn __select_idle_cpu(&mut self, cpu: usize) -> Option<usize> {
        self.scanned += 1;
        (self.choose_idle_cpu(cpu) && self.sched_cpu_cookie_match(cpu)).then_some(cpu)
    }

    /// `select_idle_core()`: is the core of `core` wholly idle? On the way,
    /// remember a fallback thread (the first allowed idle one met in the whole
    /// scan, or with PREFER_LAST_IDLE_CPU the last); a core found busy is
    /// removed from `cpus` so the outer walk never returns to it.
    fn select_idle_core(
        &mut self,
        core: usize,
        cpus: &mut CpuMask,
        idle_cpu: &mut Option<usize>,
    ) -> Option<usize> {
        let topo = self.topo;
        let mut idle = true;
        for &s in topo.smt_siblings(core) {
            let c = s as usize;
            self.scanned += 1;
            if !self.available_idle_cpu(c) {
                idle = false;
                if idle_cpu.is_none() {
                    if self.choose_sched_idle_rq(c) && cpus.test(c) {
                        *idle_cpu = Some(c);
                        break;
                    }
                    continue;
                }
                break;
            }
            if cpus.test(c) && (self.f.prefer_last_idle_cpu || idle_cpu.is_none()) {
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
    fn select_idle_capacity(&mut self, sd: &Domain, target: usize) -> Option<usize> {
        let topo = self.topo;
        let has_idle_core = topo.smt_active && self.test_idle_cores(target);
        let util = self.p.util_est_max();
        let (umin, umax) = (self.p.uclamp_min, self.p.uclamp_max);
        let mut best_cap = 0i64;
        let mut best_fits = 0i32;
        let mut best: Option<usize> = None;
        let mut nr = i64::MAX;
        let cpus = topo.span(sd.span).and_lt(self.cpus_ptr, topo.nr_cpus);
        if let Some(b) = self.sis_budget(sd) {
            if b == 1 {
                return None;
            }
            nr = b;
        }
        let mut walk = WrapWalk::new(target, topo.nr_cpus);
        while let Some(c) = walk.next(&cpus) {
            let preferred = !has_idle_core || self.is_core_idle(c);
            let mut cap = self.rq(c).capacity as i64;
            if !has_idle_core {
                nr -= 1;
                if nr <= 0 {
                    return best;
                }
            }
            self.scanned += 1;
            if !self.choose_idle_cpu(c) {
                continue;
            }
            let mut fits = self.util_fits_cpu(util, umin, umax, c);
            if fits > 0 && preferred {
                return Some(c);
            } else if fits < 0 {
                cap = self.rq(c).actual_capacity as i64;
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
}
