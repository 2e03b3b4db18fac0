//! What the load balancer reads of the preferences ([`LlcView`]):
//! `can_migrate_llc`, `migrate_degrades_llc`, `llc_balance` and
//! `alb_break_llc`, over per-runqueue counts of tasks by preference.

use super::*;

/// What the balancer knows of one process's preference.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupPref {
    pub llc: u16,
    pub nr_running_avg: u64,
    pub nr_threads: u32,
}

/// `enum llc_mig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LlcMig {
    Forbid,
    Llc,
    Unrestricted,
}

/// The preferences a balance pass reads, frozen at its start.
#[derive(Debug)]
pub struct LlcView<'a> {
    pub llc: &'a LlcMap,
    pub params: &'a CacheParams,
    pub prefs: HashMap<u64, GroupPref>,
    /// Processes whose preference the pass dropped.
    pub cleared: RefCell<Vec<u64>>,
    /// UTIL_EST: an LLC's utilisation counts util_est.
    pub util_est: bool,
    /// Each LLC's utilisation and capacity as `record_sg_llc_stats` last
    /// stored them (by dense LLC index); an LLC not recorded yet reads its
    /// present sums instead.
    pub recorded: RefCell<Vec<Option<(u64, u64)>>>,
}

/// Per-CPU cache-aware counts of a working copy: `nr_llc_running`,
/// `nr_pref_llc_running` and the base domain's `llc_counts[]`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RqCounts {
    pub(super) nr_llc: usize,
    pub(super) of_cpu: Vec<u16>,
    pub nr_llc_running: Vec<u32>,
    pub nr_pref_llc_running: Vec<u32>,
    pub(super) counts: Vec<u32>,
}

impl RqCounts {
    /// Tasks on `cpu` preferring `dst_cpu`'s LLC (0 without a view).
    pub fn pref_on(&self, cpu: usize, dst_cpu: usize) -> u32 {
        if self.nr_llc == 0 {
            return 0;
        }
        let l = self.of_cpu[dst_cpu] as usize;
        self.counts[cpu * self.nr_llc + l]
    }

    /// `account_llc_enqueue()`.
    pub fn enqueue(&mut self, cpu: usize, pref: Option<usize>, runnable: bool) {
        let Some(l) = pref else { return };
        if self.nr_llc == 0 {
            return;
        }
        self.nr_llc_running[cpu] += 1;
        if l == self.of_cpu[cpu] as usize && runnable {
            self.nr_pref_llc_running[cpu] += 1;
        }
        self.counts[cpu * self.nr_llc + l] += 1;
    }

    /// `account_llc_dequeue()`: never underflows.
    pub fn dequeue(&mut self, cpu: usize, pref: Option<usize>, runnable: bool) {
        let Some(l) = pref else { return };
        if self.nr_llc == 0 {
            return;
        }
        let dec = |v: &mut u32| *v = v.saturating_sub(1);
        dec(&mut self.nr_llc_running[cpu]);
        if l == self.of_cpu[cpu] as usize && runnable {
            dec(&mut self.nr_pref_llc_running[cpu]);
        }
        dec(&mut self.counts[cpu * self.nr_llc + l]);
    }
}

impl LlcView<'_> {
    /// `get_pref_llc()` now: the process's preferred LLC, unless the pass
    /// dropped it (`grp->cpu = -1`).
    pub fn pref_of(&self, group: u64) -> Option<usize> {
        if self.cleared.borrow().contains(&group) {
            return None;
        }
        self.task_pref(group)
    }

    /// `p->preferred_llc` of a task of `group`: set when the task was last
    /// accounted, so a preference the pass dropped still counts here.
    pub fn task_pref(&self, group: u64) -> Option<usize> {
        if group == 0 {
            return None;
        }
        self.prefs.get(&group).map(|p| p.llc as usize)
    }

    /// `record_sg_llc_stats()`: stores an LLC's group sums.
    pub fn record(&self, cpu: usize, util: u64, capacity: u64) {
        let l = self.llc.llc(cpu);
        let mut r = self.recorded.borrow_mut();
        if r.len() < self.llc.nr_llc() {
            r.resize(self.llc.nr_llc(), None);
        }
        r[l] = Some((util, capacity));
    }

    /// Fills the per-CPU counts from the task lists.
    pub fn counts(&self, topo: &Topology, tasks: &[Arc<[RqTask]>], out: &mut RqCounts) {
        let n = topo.nr_cpus;
        out.nr_llc = self.llc.nr_llc();
        out.of_cpu.clone_from(&self.llc.of_cpu);
        out.nr_llc_running.clear();
        out.nr_llc_running.resize(n, 0);
        out.nr_pref_llc_running.clear();
        out.nr_pref_llc_running.resize(n, 0);
        out.counts.clear();
        out.counts.resize(n * out.nr_llc, 0);
        for (cpu, list) in tasks.iter().enumerate().take(n) {
            for t in list.iter() {
                out.enqueue(cpu, self.task_pref(t.group), !t.sched_delayed);
            }
        }
    }

    /// `get_llc_stats()`: the LLC's utilisation and capacity as recorded,
    /// or its present sums before the first record; `None` without an LLC
    /// domain (no shared object).
    pub(super) fn llc_stats(
        &self,
        topo: &Topology,
        st: &NodeState,
        cpu: usize,
    ) -> Option<(u64, u64)> {
        topo.sd_llc(cpu)?;
        let l = self.llc.llc(cpu);
        if let Some(Some(r)) = self.recorded.borrow().get(l) {
            return Some(*r);
        }
        let span = &self.llc.spans[l];
        let mut util = 0u64;
        let mut cap = 0u64;
        for i in span.iter() {
            let rq = &st.cpus[i];
            util += cpu_util(rq, topo.capacity_orig(i), self.util_est, false, None) as u64;
            cap += rq.capacity as u64;
        }
        Some((util, cap))
    }

    /// `fits_llc_capacity()`: below overaggr_pct (x 3/2 without SMT).
    pub(super) fn fits(&self, util: u64, cap: u64) -> bool {
        let mut pct = self.params.overaggr_pct as u64;
        if self.llc.smt_threads <= 1 {
            pct = pct * 3 / 2;
        }
        util * 100 < cap * pct
    }

    /// `util_greater()`: more than imb_pct above.
    pub(super) fn greater(&self, a: u64, b: u64) -> bool {
        a * 100 > b * (100 + self.params.imb_pct as u64)
    }

    /// `can_migrate_llc()`: does moving `task_util` from src's LLC to dst's
    /// respect (`Llc`), break (`Forbid`) or not concern (`Unrestricted`)
    /// the preference?
    pub fn can_migrate_llc(
        &self,
        topo: &Topology,
        st: &NodeState,
        src: usize,
        dst: usize,
        task_util: u64,
        to_pref: bool,
    ) -> LlcMig {
        let (Some((su, sc)), Some((du, dc))) =
            (self.llc_stats(topo, st, src), self.llc_stats(topo, st, dst))
        else {
            return LlcMig::Unrestricted;
        };
        let su = su.saturating_sub(task_util);
        let du = du + task_util;
        // Both LLCs busy: ordinary load balancing decides.
        if !self.fits(du, dc) && !self.fits(su, sc) {
            return LlcMig::Unrestricted;
        }
        let forbid = if to_pref {
            !self.fits(du, dc) && self.greater(du, su)
        } else {
            self.fits(su, sc) || !self.greater(su, du)
        };
        if forbid { LlcMig::Forbid } else { LlcMig::Llc }
    }

    /// `can_migrate_llc_task()`. `misfits` is `task_misfits_asym_cpu()`:
    /// on an asymmetric domain the task fits the source but not the
    /// destination (kernel 7.2; the algorithm notes lack it).
    #[allow(clippy::too_many_arguments)]
    pub fn can_migrate_llc_task(
        &self,
        topo: &Topology,
        st: &NodeState,
        src: usize,
        dst: usize,
        group: u64,
        task_util: u64,
        misfits: bool,
    ) -> LlcMig {
        if misfits {
            return LlcMig::Forbid;
        }
        let Some(pref) = self.pref_of(group) else {
            return LlcMig::Unrestricted;
        };
        if self.llc.llc(src) == self.llc.llc(dst) {
            return LlcMig::Unrestricted;
        }
        let g = self.prefs[&group];
        if invalid_llc_nr(self.params, self.llc, g.nr_threads, g.nr_running_avg, dst) {
            self.cleared.borrow_mut().push(group);
            return LlcMig::Unrestricted;
        }
        let to_pref = if self.llc.llc(dst) == pref {
            true
        } else if self.llc.llc(src) == pref {
            false
        } else {
            return LlcMig::Unrestricted;
        };
        self.can_migrate_llc(topo, st, src, dst, task_util, to_pref)
    }

    /// `migrate_degrades_llc()`: `Some(true)` refuses, `Some(false)` allows
    /// because the preference asked for it, `None` does not concern it.
    #[allow(clippy::too_many_arguments)]
    pub fn migrate_degrades_llc(
        &self,
        topo: &Topology,
        st: &NodeState,
        (src, dst): (usize, usize),
        group: u64,
        task_util: u64,
        misfits: bool,
        llc_task: bool,
        nr_balance_failed: u32,
        cache_nice_tries: u32,
    ) -> Option<bool> {
        // The kernel writes it as ">= cache_nice_tries + 1".
        if nr_balance_failed > cache_nice_tries {
            return None;
        }
        // migrate_llc_task_wrong_dst() reads the task's own preference.
        if llc_task && self.task_pref(group) != Some(self.llc.llc(dst)) {
            return Some(true);
        }
        match self.can_migrate_llc_task(topo, st, src, dst, group, task_util, misfits) {
            LlcMig::Forbid => Some(true),
            LlcMig::Llc => Some(false),
            LlcMig::Unrestricted => None,
        }
    }

    /// `llc_balance()`: a remote group above the LLC with tasks preferring
    /// the destination's LLC, which can take them.
    #[allow(clippy::too_many_arguments)]
    pub fn llc_balance(
        &self,
        topo: &Topology,
        st: &NodeState,
        d: &Domain,
        sgs: &SgLbStats,
        span: &CpuMask,
        dst: usize,
        nr_balance_failed: u32,
    ) -> bool {
        if d.has(sd::SHARE_LLC) {
            return false;
        }
        if d.has(sd::ASYM_CPUCAPACITY) && sgs.group_misfit_task_load != 0 {
            return false;
        }
        if nr_balance_failed > d.cache_nice_tries {
            return false;
        }
        let Some(first) = span.first() else {
            return false;
        };
        sgs.nr_pref_dst_llc > 0
            && self.can_migrate_llc(topo, st, first, dst, 0, true) == LlcMig::Llc
    }

    /// `alb_break_llc()`: active balancing would pull a task off the LLC
    /// every runnable task of the source prefers.
    #[allow(clippy::too_many_arguments)]
    pub fn alb_break_llc(
        &self,
        topo: &Topology,
        st: &NodeState,
        counts: &RqCounts,
        (src, dst): (usize, usize),
        misfit: bool,
        curr: Option<(&RqTask, bool)>,
    ) -> bool {
        if self.llc.llc(src) == self.llc.llc(dst) {
            return false;
        }
        let rq = &st.cpus[src];
        let pref = counts.nr_pref_llc_running.get(src).copied().unwrap_or(0);
        if pref == 0 || pref != rq.cfs_h_nr_queued.saturating_sub(rq.nr_delayed) {
            return false;
        }
        if misfit {
            return false;
        }
        if rq.nr_running <= 1 {
            return true;
        }
        // The running task's utilisation would leave; `curr.1` is
        // task_misfits_asym_cpu() for it.
        let util = curr.map_or(0, |(t, _)| t.util_avg.max(0) as u64);
        curr.is_some_and(|(_, m)| m)
            || self.can_migrate_llc(topo, st, src, dst, util, false) == LlcMig::Forbid
    }
}
