//! Sched features and system switches: what `sched/features` and a few
//! sysctls and static keys would say on the machine being modelled.

/// The sched features these algorithms read, with the kernel's defaults, and
/// the project's switches for recent kernel changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Features {
    pub sis_util: bool,
    pub wa_idle: bool,
    pub wa_weight: bool,
    pub wa_bias: bool,
    pub util_est: bool,
    pub cache_hot_buddy: bool,
    pub place_lag: bool,
    /// `select_idle_core()` records the last instead of the first idle sibling.
    pub prefer_last_idle_cpu: bool,
    /// A SCHED_IDLE wakee does not treat a SCHED_IDLE-only runqueue as idle.
    pub skip_sched_idle_for_idle_task: bool,
    /// `sched_exec()` goes through the core `select_task_rq()` wrapper.
    pub exec_bound_fast_path: bool,
    /// Cache-aware scheduling (`sched/llc_balancing/enabled`): processes
    /// get a preferred LLC and load balancing honours it.
    pub sched_cache: bool,
    /// `task_cache_work` scans only the CPUs a process visited.
    pub sc_visit: bool,
    /// `task_cache_work` scans only the NUMA nodes in play.
    pub sc_node: bool,
    /// Which kernel's fair class to follow (see `engine::v6_12`).
    pub kernel: Kernel,
}

impl Default for Features {
    fn default() -> Self {
        Self {
            sis_util: true,
            wa_idle: true,
            wa_weight: true,
            wa_bias: true,
            util_est: true,
            cache_hot_buddy: true,
            place_lag: true,
            prefer_last_idle_cpu: false,
            skip_sched_idle_for_idle_task: true,
            exec_bound_fast_path: true,
            sched_cache: true,
            sc_visit: false,
            sc_node: false,
            kernel: Kernel::Mainline,
        }
    }
}

/// The kernel profile: the mainline the engine follows, or Linux 6.12
/// where it differs (scenario format section 13).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Kernel {
    #[default]
    Mainline,
    V6_12,
}

impl Kernel {
    /// The profile named as in scenarios and in `Register.kernel_profile`
    /// (empty = mainline).
    pub fn from_name(name: &str) -> Option<Kernel> {
        match name {
            "" | "mainline" => Some(Kernel::Mainline),
            "6.12" => Some(Kernel::V6_12),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kernel::Mainline => "mainline",
            Kernel::V6_12 => "6.12",
        }
    }
}

/// Feature names as written in scenarios and in `sched/features`.
pub const FEATURE_NAMES: [&str; 13] = [
    "SIS_UTIL",
    "WA_IDLE",
    "WA_WEIGHT",
    "WA_BIAS",
    "UTIL_EST",
    "CACHE_HOT_BUDDY",
    "PLACE_LAG",
    "PREFER_LAST_IDLE_CPU",
    "SKIP_SCHED_IDLE_FOR_IDLE_TASK",
    "EXEC_BOUND_FAST_PATH",
    "SCHED_CACHE",
    "SC_VISIT",
    "SC_NODE",
];

/// The service's switches that decide no scenario of the format (cache-aware
/// scheduling is outside it): a scenario naming them is refused.
pub const SERVICE_ONLY: [&str; 3] = ["SCHED_CACHE", "SC_VISIT", "SC_NODE"];

impl Features {
    /// The defaults of a kernel profile: 6.12 tests `sched_idle_cpu()` for
    /// every wakee and its `sched_exec()` calls the class directly.
    pub fn for_kernel(kernel: Kernel) -> Features {
        let mut f = Features {
            kernel,
            ..Features::default()
        };
        if kernel == Kernel::V6_12 {
            f.skip_sched_idle_for_idle_task = false;
            f.exec_bound_fast_path = false;
        }
        f
    }

    fn slot(&mut self, name: &str) -> Option<&mut bool> {
        Some(match name {
            "SIS_UTIL" => &mut self.sis_util,
            "WA_IDLE" => &mut self.wa_idle,
            "WA_WEIGHT" => &mut self.wa_weight,
            "WA_BIAS" => &mut self.wa_bias,
            "UTIL_EST" => &mut self.util_est,
            "CACHE_HOT_BUDDY" => &mut self.cache_hot_buddy,
            "PLACE_LAG" => &mut self.place_lag,
            "PREFER_LAST_IDLE_CPU" => &mut self.prefer_last_idle_cpu,
            "SKIP_SCHED_IDLE_FOR_IDLE_TASK" => &mut self.skip_sched_idle_for_idle_task,
            "EXEC_BOUND_FAST_PATH" => &mut self.exec_bound_fast_path,
            "SCHED_CACHE" => &mut self.sched_cache,
            "SC_VISIT" => &mut self.sc_visit,
            "SC_NODE" => &mut self.sc_node,
            _ => return None,
        })
    }

    /// Sets a feature by name; false if the name is unknown.
    pub fn set(&mut self, name: &str, on: bool) -> bool {
        match self.slot(name) {
            Some(s) => {
                *s = on;
                true
            }
            None => false,
        }
    }

    pub fn get(&self, name: &str) -> Option<bool> {
        let mut copy = *self;
        copy.slot(name).map(|s| *s)
    }
}

/// Global switches (section 4 of the scenario format).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct System {
    /// The `sched_uclamp_used` static key; `None` = on iff the task is clamped.
    pub uclamp_used: Option<bool>,
    /// Core scheduling: cookies are compared.
    pub core_sched: bool,
    /// `sysctl_sched_migration_cost` in ns; -1 = always hot, 0 = never hot.
    pub migration_cost_ns: i64,
    /// NUMA levels farther than this lose fork/exec balancing and wake-affine.
    pub node_reclaim_distance: u32,
}

impl Default for System {
    fn default() -> Self {
        Self {
            uclamp_used: None,
            core_sched: false,
            migration_cost_ns: 500_000,
            node_reclaim_distance: 30,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_kernels_and_the_projects() {
        let f = Features::default();
        for name in FEATURE_NAMES {
            // Off: the project's opt-in switches for changes the kernel
            // does not have (or not by default).
            let want = !matches!(name, "PREFER_LAST_IDLE_CPU" | "SC_VISIT" | "SC_NODE");
            assert_eq!(f.get(name), Some(want), "{name}");
        }
        assert_eq!(f.get("NO_SUCH"), None);
    }

    #[test]
    fn set_by_name_changes_only_that_feature() {
        let mut f = Features::default();
        assert!(f.set("WA_BIAS", false));
        assert!(!f.wa_bias);
        assert!(f.wa_idle && f.sis_util);
        assert!(!f.set("SIS_PROP", true));
    }
}
