//! What is asked of the engine and what it answers.

use std::fmt;

/// Which placement is asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Wakeup,
    Fork,
    Exec,
}

impl Kind {
    /// Every kind, in the order of its index (`kind as usize`).
    pub const ALL: [Kind; 3] = [Kind::Wakeup, Kind::Fork, Kind::Exec];

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Wakeup => "wakeup",
            Kind::Fork => "fork",
            Kind::Exec => "exec",
        }
    }
}

// Tables indexed by kind or path (`kind as usize`) rely on ALL's order.
const _: () = {
    let mut i = 0;
    while i < Kind::ALL.len() {
        assert!(Kind::ALL[i] as usize == i);
        i += 1;
    }
    let mut i = 0;
    while i < Path::ALL.len() {
        assert!(Path::ALL[i] as usize == i);
        i += 1;
    }
};

/// A wakeup, fork or exec, with what the kernel knows of the waker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlaceRequest {
    pub kind: Kind,
    /// The waker's, parent's or exec'ing task's CPU.
    pub this_cpu: usize,
    pub sync: bool,
    pub wf_current_cpu: bool,
    pub in_task: bool,
    pub waker_exiting: bool,
    /// `current->wakee_flips` before `record_wakee()`.
    pub waker_wakee_flips: i64,
    pub waker_last_wakee_is_task: bool,
    pub waker_flip_decay_expired: bool,
    /// `task_h_load(current)`.
    pub waker_load: i64,
    pub waker_is_per_cpu_kthread: bool,
}

impl PlaceRequest {
    pub fn new(kind: Kind, this_cpu: usize) -> Self {
        Self {
            kind,
            this_cpu,
            sync: false,
            wf_current_cpu: false,
            in_task: true,
            waker_exiting: false,
            waker_wakee_flips: 0,
            waker_last_wakee_is_task: true,
            waker_flip_decay_expired: false,
            waker_load: 0,
            waker_is_per_cpu_kthread: false,
        }
    }
}

/// The step that produced a placement (the last one that changed the answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    Bound,
    CurrentCpu,
    Target,
    Prev,
    PerCpuKthread,
    Recent,
    Capacity,
    CapacityNone,
    NoLlc,
    IdleSmt,
    IdleCore,
    CoreScanCpu,
    IdleCpu,
    PrevAff,
    RecentAff,
    FallbackTarget,
    SlowPath,
    SlowPathPrev,
    NoDomain,
    FallbackRq,
    ExecStayInactive,
}

impl Path {
    pub const ALL: [Path; 21] = [
        Path::Bound,
        Path::CurrentCpu,
        Path::Target,
        Path::Prev,
        Path::PerCpuKthread,
        Path::Recent,
        Path::Capacity,
        Path::CapacityNone,
        Path::NoLlc,
        Path::IdleSmt,
        Path::IdleCore,
        Path::CoreScanCpu,
        Path::IdleCpu,
        Path::PrevAff,
        Path::RecentAff,
        Path::FallbackTarget,
        Path::SlowPath,
        Path::SlowPathPrev,
        Path::NoDomain,
        Path::FallbackRq,
        Path::ExecStayInactive,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Path::Bound => "bound",
            Path::CurrentCpu => "current_cpu",
            Path::Target => "target",
            Path::Prev => "prev",
            Path::PerCpuKthread => "per_cpu_kthread",
            Path::Recent => "recent",
            Path::Capacity => "capacity",
            Path::CapacityNone => "capacity_none",
            Path::NoLlc => "no_llc",
            Path::IdleSmt => "idle_smt",
            Path::IdleCore => "idle_core",
            Path::CoreScanCpu => "core_scan_cpu",
            Path::IdleCpu => "idle_cpu",
            Path::PrevAff => "prev_aff",
            Path::RecentAff => "recent_aff",
            Path::FallbackTarget => "fallback_target",
            Path::SlowPath => "slow_path",
            Path::SlowPathPrev => "slow_path_prev",
            Path::NoDomain => "no_domain",
            Path::FallbackRq => "fallback_rq",
            Path::ExecStayInactive => "exec_stay_inactive",
        }
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which step of `wake_affine()` decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Affine {
    /// `wake_affine_idle()`: this CPU is idle and shares the cache.
    ThisIdle,
    /// `wake_affine_idle()`: prev is idle.
    PrevIdle,
    /// `wake_affine_idle()`: a sync wakeup from the only runnable task.
    ThisSync,
    /// `wake_affine_weight()` preferred this CPU.
    ThisWeight,
    /// Nothing preferred this CPU.
    Prev,
}

impl Affine {
    pub const ALL: [Affine; 5] = [
        Affine::ThisIdle,
        Affine::PrevIdle,
        Affine::ThisSync,
        Affine::ThisWeight,
        Affine::Prev,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Affine::ThisIdle => "this_idle",
            Affine::PrevIdle => "prev_idle",
            Affine::ThisSync => "this_sync",
            Affine::ThisWeight => "this_weight",
            Affine::Prev => "prev",
        }
    }
}

/// Informative facts about a placement (not compared).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Detail {
    pub want_affine: bool,
    pub affine: Option<Affine>,
    /// The target `select_idle_sibling()` started from.
    pub sis_target: Option<usize>,
    pub has_idle_core: Option<bool>,
    /// The SIS_UTIL budget a scan read, when it read one.
    pub nr_idle_scan: Option<u32>,
    /// Slow path: levels at which a group was chosen.
    pub slow_levels: u32,
    /// Slow path: CPUs whose statistics were read.
    pub slow_cpus_read: u32,
}

/// The answer to a wakeup, fork or exec.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub cpu: usize,
    pub path: Path,
    /// CPU idle-state tests made inside the scan functions.
    pub scanned: u32,
    pub detail: Detail,
}
