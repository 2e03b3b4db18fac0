//! Per-CPU runqueue state, per-LLC hints and the task being placed, with the
//! derived facts every algorithm reads (`idle_cpu`, `sched_idle_rq`, the
//! SIS_UTIL budget, the idle-core hint).

use super::cpumask::CpuMask;
use super::features::{Features, Kernel};
use super::topology::{Level, SpanId, Topology};

/// One runqueue as the agent last reported it.
///
/// Laid out in 56 bytes: a node's CPU states are most of what the store
/// holds per node (10,000 nodes of 128 CPUs: 70 MiB here, 110 MiB at the
/// natural widths). The PELT signals are bounded by `MAX_SIGNAL` (31 bits)
/// and capacities by `SCHED_CAPACITY_SCALE`, so they are held at 32 and 16
/// bits; every algorithm reads them widened (`as i64`), so no arithmetic
/// changes width. The core-scheduling cookie, which agents of machines
/// without core scheduling never set, is the node's (`NodeState::core_cookie`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuState {
    pub online: bool,
    /// `rq->nr_running`, all classes.
    pub nr_running: u32,
    /// `rq->cfs.h_nr_idle`: SCHED_IDLE tasks queued.
    pub h_nr_idle: u32,
    /// `cfs_h_nr_delayed()`: delayed-dequeue entities.
    pub nr_delayed: u32,
    /// `rq->cfs.h_nr_queued`.
    pub cfs_h_nr_queued: u32,
    /// `rq->curr == rq->idle`.
    pub curr_is_idle: bool,
    pub ttwu_pending: bool,
    pub vcpu_preempted: bool,
    /// PELT averages, 0..=MAX_SIGNAL.
    pub load_avg: u32,
    pub runnable_avg: u32,
    pub util_avg: u32,
    pub util_est: u32,
    /// `capacity_of()`, 1..=capacity_orig.
    pub capacity: u16,
    /// `get_actual_cpu_capacity()`, 0..=capacity_orig.
    pub actual_capacity: u16,
    /// Exit latency of the idle state the CPU is in; [`NO_IDLE_STATE`] when
    /// it is in none (see [`CpuState::exit_latency`]).
    pub idle_exit_latency: u32,
    pub idle_stamp: i64,
    pub curr_is_per_cpu_kthread: bool,
}

/// A PELT sum held back in a runqueue's 32 bits: a working copy that gains
/// or loses a task's share (`rq_add`, `rq_sub`) floors at 0 as the kernel's
/// `sub_positive()` does, and saturates (only sums past 2^32, which no
/// reported runqueue and task come near).
#[inline]
pub fn pelt(v: i64) -> u32 {
    v.clamp(0, u32::MAX as i64) as u32
}

/// `idle_exit_latency` of a CPU in no idle state (a value no state has:
/// reports of it are refused).
pub const NO_IDLE_STATE: u32 = u32::MAX;

const _: () = assert!(std::mem::size_of::<CpuState>() == 56);

impl CpuState {
    /// An online, idle, empty runqueue of the given capacity.
    pub fn idle(capacity: u32) -> Self {
        // A topology's capacities are 1..=1024 (`TopologySpec`).
        let capacity = capacity.min(u16::MAX as u32) as u16;
        Self {
            online: true,
            nr_running: 0,
            h_nr_idle: 0,
            nr_delayed: 0,
            cfs_h_nr_queued: 0,
            curr_is_idle: true,
            ttwu_pending: false,
            vcpu_preempted: false,
            load_avg: 0,
            runnable_avg: 0,
            util_avg: 0,
            util_est: 0,
            capacity,
            actual_capacity: capacity,
            idle_exit_latency: NO_IDLE_STATE,
            idle_stamp: 0,
            curr_is_per_cpu_kthread: false,
        }
    }

    /// What an offline CPU looks like to the algorithms: an idle, empty
    /// runqueue that keeps only its capacities.
    pub fn offline(self) -> Self {
        Self {
            online: false,
            capacity: self.capacity,
            actual_capacity: self.actual_capacity,
            ..Self::idle(self.capacity as u32)
        }
    }

    /// Checks the rules a runqueue's state must keep, given the CPU's
    /// topology capacity. Returns the offending field and what is wrong.
    pub fn check(&self, capacity_orig: u32) -> Result<(), (&'static str, String)> {
        const MAX: i64 = MAX_SIGNAL;
        for (name, v) in [
            ("nr_running", self.nr_running),
            ("cfs_h_nr_queued", self.cfs_h_nr_queued),
        ] {
            if v as i64 > MAX {
                return Err((name, format!("{v} is out of range 0..{MAX}")));
            }
        }
        if self.h_nr_idle > self.nr_running {
            return Err((
                "h_nr_idle",
                format!("{} exceeds nr_running {}", self.h_nr_idle, self.nr_running),
            ));
        }
        if self.nr_delayed > self.nr_running {
            return Err((
                "nr_delayed",
                format!("{} exceeds nr_running {}", self.nr_delayed, self.nr_running),
            ));
        }
        for (name, v) in [
            ("load_avg", self.load_avg),
            ("runnable_avg", self.runnable_avg),
            ("util_avg", self.util_avg),
            ("util_est", self.util_est),
        ] {
            if v as i64 > MAX {
                return Err((name, format!("{v} is out of range 0..{MAX}")));
            }
        }
        let (capacity, actual) = (self.capacity as u32, self.actual_capacity as u32);
        if capacity == 0 || capacity > capacity_orig {
            return Err((
                "capacity",
                format!("{} is out of range 1..{capacity_orig}", self.capacity),
            ));
        }
        if actual > capacity_orig {
            return Err((
                "actual_capacity",
                format!(
                    "{} is out of range 0..{capacity_orig}",
                    self.actual_capacity
                ),
            ));
        }
        if !(0..=MAX_CLOCK).contains(&self.idle_stamp) {
            return Err((
                "idle_stamp",
                format!("{} is out of range 0..2^62", self.idle_stamp),
            ));
        }
        Ok(())
    }

    /// A reported PELT average, narrowed to the layout's 32 bits; out of
    /// 0..=MAX_SIGNAL is refused as `check` words it.
    pub fn signal_field(name: &'static str, v: i64) -> Result<u32, (&'static str, String)> {
        match u32::try_from(v) {
            Ok(x) if v <= MAX_SIGNAL => Ok(x),
            _ => Err((name, format!("{v} is out of range 0..{MAX_SIGNAL}"))),
        }
    }

    /// A reported capacity, narrowed to 16 bits (a topology's are at most
    /// 1024); `None` is the CPU's own. A value that does not fit is refused
    /// as `check` words it, with the field's lower bound `lo`.
    pub fn capacity_field(
        name: &'static str,
        lo: u32,
        v: Option<u32>,
        capacity_orig: u32,
    ) -> Result<u16, (&'static str, String)> {
        let v = v.unwrap_or(capacity_orig);
        u16::try_from(v).map_err(|_| (name, format!("{v} is out of range {lo}..{capacity_orig}")))
    }

    /// A reported idle state's exit latency; `None` is no state.
    pub fn exit_latency_field(v: Option<u32>) -> Result<u32, (&'static str, String)> {
        match v {
            None => Ok(NO_IDLE_STATE),
            Some(NO_IDLE_STATE) => Err((
                "idle_exit_latency",
                format!("{NO_IDLE_STATE} is out of range 0..{}", NO_IDLE_STATE - 1),
            )),
            Some(l) => Ok(l),
        }
    }

    /// A reported core-scheduling cookie (`rq->core->core_cookie`): the
    /// kernel's are pointers, which fit 63 bits.
    pub fn core_cookie_field(v: u64) -> Result<u64, (&'static str, String)> {
        if v > i64::MAX as u64 {
            return Err((
                "core_cookie",
                format!("{v} is out of range 0..{}", i64::MAX),
            ));
        }
        Ok(v)
    }

    /// The exit latency of the CPU's idle state, if it is in one.
    #[inline]
    pub fn exit_latency(&self) -> Option<u32> {
        (self.idle_exit_latency != NO_IDLE_STATE).then_some(self.idle_exit_latency)
    }

    /// `idle_cpu()`.
    #[inline]
    pub fn idle_cpu(&self) -> bool {
        self.curr_is_idle && self.nr_running == 0 && !self.ttwu_pending
    }

    /// `available_idle_cpu()`.
    #[inline]
    pub fn available_idle(&self) -> bool {
        self.idle_cpu() && !self.vcpu_preempted
    }

    /// `sched_idle_rq()`: everything runnable here is SCHED_IDLE work.
    #[inline]
    pub fn sched_idle_rq(&self) -> bool {
        self.nr_running > 0 && self.nr_running == self.h_nr_idle
    }
}

/// A hint stored in a shared object; absent values are derived.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedHint {
    pub nr_idle_scan: Option<u32>,
    pub has_idle_cores: Option<bool>,
}

/// The values of one shared object as a decision reads them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SharedState {
    pub nr_idle_scan: u32,
    pub has_idle_cores: bool,
}

pub use fairplace_types::limits::{MAX_CLOCK, MAX_SIGNAL};

/// `cpu_util(cpu, p, -1, boost)`: the CPU's CFS utilisation with util_est as
/// the features say, raised to the runnable average when `boost`
/// (`cpu_util_cfs_boost()`), without task `p`'s own share when `without`
/// gives its (util_avg, util_est), capped at the CPU's original capacity.
#[inline]
pub fn cpu_util(
    rq: &CpuState,
    capacity_orig: u32,
    util_est: bool,
    boost: bool,
    without: Option<(i64, i64)>,
) -> i64 {
    let mut util = rq.util_avg as i64;
    if boost {
        util = util.max(rq.runnable_avg as i64);
    }
    if let Some((u, _)) = without {
        util = (util - u).max(0);
    }
    if util_est {
        let mut e = rq.util_est as i64;
        if let Some((_, ue)) = without {
            e = (e - ue).max(0);
        }
        util = util.max(e);
    }
    util.min(capacity_orig as i64)
}

/// The sums a group's statistics are made from: its CPUs' runqueues (or,
/// at the cluster levels, its nodes' sums). Kept incrementally by the node
/// snapshots (for groups wider than a core) and by the cluster hierarchy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupSum {
    /// Online CPUs counted.
    pub cpus: i64,
    pub idle_cpus: i64,
    pub nr_running: i64,
    pub load: i64,
    pub runnable: i64,
    /// `cpu_util()` summed (util_est as the features say).
    pub util: i64,
    pub capacity: i64,
    pub max_capacity: i64,
}

impl GroupSum {
    /// Adds (`sign` 1) or removes (-1) one CPU's share of the sums (not its
    /// count or the maximum capacity, which the caller keeps).
    #[inline]
    pub fn add_cpu(&mut self, rq: &CpuState, capacity_orig: u32, util_est: bool, sign: i64) {
        self.nr_running += sign * rq.nr_running as i64;
        if rq.nr_running == 0 && rq.curr_is_idle && !rq.ttwu_pending {
            self.idle_cpus += sign;
        }
        self.load += sign * rq.load_avg as i64;
        self.runnable += sign * rq.runnable_avg as i64;
        self.util += sign * cpu_util(rq, capacity_orig, util_est, false, None);
        self.capacity += sign * rq.capacity as i64;
    }

    /// Adds (`sign` 1) or removes (-1) another group's sums (the maximum
    /// capacity only grows: removal keeps it, the caller recomputes it).
    #[inline]
    pub fn add(&mut self, o: &GroupSum, sign: i64) {
        self.cpus += sign * o.cpus;
        self.idle_cpus += sign * o.idle_cpus;
        self.nr_running += sign * o.nr_running;
        self.load += sign * o.load;
        self.runnable += sign * o.runnable;
        self.util += sign * o.util;
        self.capacity += sign * o.capacity;
        if sign > 0 {
            self.max_capacity = self.max_capacity.max(o.max_capacity);
        }
    }
}

/// One node's runqueues plus the hints of its shared objects: the read-only
/// view every decision runs against.
#[derive(Debug, Clone)]
pub struct NodeState {
    pub cpus: Vec<CpuState>,
    pub shared: Vec<SharedState>,
    /// Sums of the groups wider than a core (`Topology::sum_groups`), kept
    /// per report in O(depth) per changed CPU; empty = not kept (the slow
    /// path then reads every CPU).
    pub groups: Vec<GroupSum>,
    /// The UTIL_EST setting the sums were made with.
    pub groups_util_est: bool,
    /// The groups whose `sgc->imbalance` the balancer left set, as (level,
    /// group span): a scenario's hint (format section 6.1); agents report
    /// none, so it is empty and costs nothing on their nodes.
    pub sgc_imbalance: Vec<(Level, SpanId)>,
    /// Each CPU's core-scheduling cookie (`rq->core->core_cookie`), by CPU;
    /// empty while every one is 0, as on every machine without core
    /// scheduling, so those nodes pay nothing for it. Set with
    /// [`NodeState::set_core_cookies`], read with [`NodeState::core_cookie`].
    pub core_cookies: Vec<u64>,
}

impl NodeState {
    /// Builds the view: offline CPUs are normalised, and every shared-object
    /// value not given as a hint is derived from the present state.
    /// `hints` is indexed like `topo.shared` (missing entries mean no hint).
    pub fn new(
        topo: &Topology,
        cpus: Vec<CpuState>,
        hints: &[SharedHint],
        features: &Features,
    ) -> NodeState {
        let mut st = NodeState::new_without_sums(topo, cpus, hints, features);
        st.sum_groups(topo, features.util_est);
        st
    }

    /// The state with its shared objects but without group sums.
    fn new_without_sums(
        topo: &Topology,
        mut cpus: Vec<CpuState>,
        hints: &[SharedHint],
        features: &Features,
    ) -> NodeState {
        for (i, c) in cpus.iter_mut().enumerate() {
            if !topo.online.test(i) {
                *c = c.offline();
            } else {
                c.online = true;
            }
        }
        let mut st = NodeState {
            cpus,
            shared: vec![SharedState::default(); topo.shared.len()],
            groups: Vec::new(),
            groups_util_est: features.util_est,
            sgc_imbalance: Vec::new(),
            core_cookies: Vec::new(),
        };
        for k in 0..topo.shared.len() {
            let h = hints.get(k).copied().unwrap_or_default();
            st.shared[k] = SharedState {
                nr_idle_scan: h
                    .nr_idle_scan
                    .unwrap_or_else(|| st.derive_nr_idle_scan(topo, k, features)),
                has_idle_cores: h.has_idle_cores.unwrap_or_else(|| match features.kernel {
                    Kernel::V6_12 => st.derive_has_idle_cores_v6_12(topo, k),
                    Kernel::Mainline => st.derive_has_idle_cores(topo, k),
                }),
            };
        }
        st
    }

    /// The next state of a node after a report: `prev`'s group sums are
    /// carried over and only the CPUs that changed are taken out and put
    /// back in (`same_topology`: `prev` was made for this domain tree).
    pub fn next(
        topo: &Topology,
        prev: &NodeState,
        same_topology: bool,
        cpus: Vec<CpuState>,
        hints: &[SharedHint],
        features: &Features,
    ) -> NodeState {
        let incremental = same_topology
            && prev.groups.len() == topo.sum_groups.len()
            && prev.groups_util_est == features.util_est
            && prev.cpus.len() == cpus.len();
        if !incremental {
            let mut st = NodeState::new(topo, cpus, hints, features);
            st.set_core_cookies(topo, prev.core_cookies.clone());
            return st;
        }
        let mut st = NodeState::new_without_sums(topo, cpus, hints, features);
        st.set_core_cookies(topo, prev.core_cookies.clone());
        st.groups.clone_from(&prev.groups);
        let ue = features.util_est;
        for i in 0..st.cpus.len() {
            let (old, new) = (&prev.cpus[i], &st.cpus[i]);
            if old == new {
                continue;
            }
            for &k in &topo.cpu_sum_groups[i] {
                let g = &mut st.groups[k as usize];
                let cap = topo.capacity_orig(i);
                g.add_cpu(old, cap, ue, -1);
                g.add_cpu(new, cap, ue, 1);
                let (oc, nc) = (old.capacity as i64, new.capacity as i64);
                if nc > g.max_capacity {
                    g.max_capacity = nc;
                } else if oc == g.max_capacity && nc < oc {
                    // The maximum may have left: find it again.
                    let span = topo.span(topo.sum_groups[k as usize]);
                    g.max_capacity = span
                        .iter()
                        .map(|c| st.cpus[c].capacity as i64)
                        .max()
                        .unwrap_or(0);
                }
            }
        }
        st
    }

    /// Sets every CPU's core cookie (`cookies` by CPU; missing ones are 0).
    /// An offline CPU has none, as `CpuState::offline` keeps no state.
    pub fn set_core_cookies(&mut self, topo: &Topology, mut cookies: Vec<u64>) {
        cookies.truncate(self.cpus.len());
        for (i, c) in cookies.iter_mut().enumerate() {
            if !topo.online.test(i) {
                *c = 0;
            }
        }
        if cookies.iter().all(|&c| c == 0) {
            cookies = Vec::new();
        }
        self.core_cookies = cookies;
    }

    /// CPU `cpu`'s core-scheduling cookie.
    #[inline]
    pub fn core_cookie(&self, cpu: usize) -> u64 {
        self.core_cookies.get(cpu).copied().unwrap_or(0)
    }

    /// `sg_imbalanced()`: is the group `g` of a `level` domain marked?
    #[inline]
    pub fn sg_imbalanced(&self, level: Level, g: SpanId) -> bool {
        self.sgc_imbalance
            .iter()
            .any(|&(l, s)| l == level && s == g)
    }

    /// Every kept group's sums from scratch.
    fn sum_groups(&mut self, topo: &Topology, util_est: bool) {
        self.groups.clear();
        self.groups_util_est = util_est;
        for &g in &topo.sum_groups {
            let mut s = GroupSum::default();
            for i in topo.span(g).iter() {
                let c = &self.cpus[i];
                s.cpus += 1;
                s.add_cpu(c, topo.capacity_orig(i), util_est, 1);
                s.max_capacity = s.max_capacity.max(c.capacity as i64);
            }
            self.groups.push(s);
        }
    }

    /// `update_idle_cpu_scan()` applied to the present state: the share of the
    /// domain to scan falls quadratically with its average utilisation.
    pub fn derive_nr_idle_scan(&self, topo: &Topology, obj: usize, features: &Features) -> u32 {
        let o = &topo.shared[obj];
        if !o.live || o.weight == 0 {
            return 0;
        }
        let w = o.weight as i64;
        let pct = o.imbalance_pct as i64;
        let sum_util: i64 = topo
            .span(o.span)
            .iter()
            .filter(|&i| topo.online.test(i))
            .map(|i| {
                cpu_util(
                    &self.cpus[i],
                    topo.capacity_orig(i),
                    features.util_est,
                    false,
                    None,
                )
            })
            .sum();
        let x = sum_util / w;
        let tmp = (x * x * pct * pct / (10000 * 1024)).min(1024);
        let y = 1024 - tmp;
        (y * w / 1024) as u32
    }

    /// The truth the `has_idle_cores` hint approximates: some CPU that reads
    /// this object sits on a core whose online threads are all idle.
    pub fn derive_has_idle_cores(&self, topo: &Topology, obj: usize) -> bool {
        let o = &topo.shared[obj];
        o.balance_members.iter().any(|c| {
            topo.smt_siblings(c)
                .iter()
                .all(|&s| self.cpus[s as usize].available_idle())
        })
    }

    /// The online CPUs whose runqueue is wholly idle (`available_idle_cpu`).
    pub fn available_idle_mask(&self) -> CpuMask {
        CpuMask::from_cpus(
            self.cpus
                .iter()
                .enumerate()
                .filter(|(_, c)| c.online && c.available_idle())
                .map(|(i, _)| i),
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Normal,
    Batch,
    /// SCHED_IDLE.
    Idle,
}

/// The task being placed or migrated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub policy: Policy,
    /// `p->cpus_mask`; may contain offline CPUs.
    pub cpus_allowed: CpuMask,
    /// `task_cpu(p)` / `p->wake_cpu`.
    pub prev_cpu: usize,
    /// `p->recent_used_cpu`; `None` = no candidate.
    pub recent_used_cpu: Option<usize>,
    pub util_avg: i64,
    pub util_est: i64,
    pub runnable_avg: i64,
    /// `task_h_load(p)`.
    pub load_avg: i64,
    pub uclamp_min: u32,
    pub uclamp_max: u32,
    pub wakee_flips: i64,
    pub migration_disabled: bool,
    pub core_cookie: u64,
    pub numa_preferred_nid: i32,
    pub per_cpu_kthread: bool,
    pub running: bool,
    pub sched_delayed: bool,
    pub eligible: bool,
    pub next_buddy: bool,
    pub blocked: bool,
    pub exec_start: i64,
    /// Replaces the final clock comparison of `task_hot()` when given.
    pub hot: Option<bool>,
}

impl Task {
    /// Checks the rules a task must keep, whatever path it came in by (a
    /// scenario or an RPC). Returns the offending field and what is wrong.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if self.cpus_allowed.is_empty() {
            return Err(("cpus_allowed", "must not be empty".into()));
        }
        for (name, v) in [
            ("util_avg", self.util_avg),
            ("util_est", self.util_est),
            ("runnable_avg", self.runnable_avg),
            ("load_avg", self.load_avg),
            ("wakee_flips", self.wakee_flips),
        ] {
            range(name, v, 0, MAX_SIGNAL)?;
        }
        range("uclamp_min", self.uclamp_min as i64, 0, 1024)?;
        range("uclamp_max", self.uclamp_max as i64, 0, 1024)?;
        let nid = self.numa_preferred_nid as i64;
        range("numa_preferred_nid", nid, -1, 255)?;
        range("exec_start", self.exec_start, 0, MAX_CLOCK)?;
        if self.core_cookie > i64::MAX as u64 {
            let msg = format!("{} is out of range 0..{}", self.core_cookie, i64::MAX);
            return Err(("core_cookie", msg));
        }
        Ok(())
    }

    /// A normal task allowed everywhere, last run on `prev_cpu`. The mask
    /// is filled where the task is built (a mask built apart would be 512
    /// bytes more to write and copy on every request).
    #[inline]
    pub fn new(nr_cpus: usize, prev_cpu: usize) -> Self {
        let mut t = Self {
            policy: Policy::Normal,
            cpus_allowed: CpuMask::new(),
            prev_cpu,
            recent_used_cpu: Some(prev_cpu),
            util_avg: 0,
            util_est: 0,
            runnable_avg: 0,
            load_avg: 0,
            uclamp_min: 0,
            uclamp_max: 1024,
            wakee_flips: 0,
            migration_disabled: false,
            core_cookie: 0,
            numa_preferred_nid: -1,
            per_cpu_kthread: false,
            running: false,
            sched_delayed: false,
            eligible: true,
            next_buddy: false,
            blocked: false,
            exec_start: 0,
            hot: None,
        };
        t.cpus_allowed.assign_first_n(nr_cpus);
        t
    }

    /// `task_util_est()`.
    #[inline]
    pub fn util_est_max(&self) -> i64 {
        self.util_avg.max(self.util_est)
    }
}

/// A field's value within `lo..=hi`. This runs for every field of every
/// placement request, so the check is inline and the message is made only
/// for a value out of range.
#[inline]
fn range(name: &'static str, v: i64, lo: i64, hi: i64) -> Result<(), (&'static str, String)> {
    if (lo..=hi).contains(&v) {
        Ok(())
    } else {
        Err(out_of_range(name, v, lo, hi))
    }
}

#[cold]
#[inline(never)]
fn out_of_range(name: &'static str, v: i64, lo: i64, hi: i64) -> (&'static str, String) {
    let shown = if hi == MAX_CLOCK {
        "2^62".to_string()
    } else {
        hi.to_string()
    };
    (name, format!("{v} is out of range {lo}..{shown}"))
}
