//! The task a placement or migration is about (`task`): its policy,
//! affinity, signals and flags, resolved against the node as the RPC path
//! resolves a task (`engine::resolve`).

use serde_json::{Map, Value};

use crate::engine::cpumask::CpuMask;
use crate::engine::resolve;
use crate::engine::state::{Policy, Task};
use crate::engine::topology::FieldError;

use super::obj::Obj;
use super::obj::cpu_value;

/// A task's `policy` names (section 7).
pub(in crate::offline) const POLICIES: [(&str, Policy); 3] = [
    ("normal", Policy::Normal),
    ("batch", Policy::Batch),
    ("idle", Policy::Idle),
];

/// The task on a node of `n` CPUs, on `task_cpu`; a wakeup's needs its
/// `prev_cpu`.
pub(super) fn parse_task(
    v: Option<&Value>,
    n: usize,
    wakeup: bool,
    task_cpu: usize,
) -> Result<Task, FieldError> {
    let empty = Value::Object(Map::new());
    let v = match v {
        Some(v) => v,
        None if wakeup => return Err(FieldError::new("task.prev_cpu", "is required for a wakeup")),
        None => &empty,
    };
    let o = Obj::new(
        v,
        "task",
        &[
            "policy",
            "cpus_allowed",
            "prev_cpu",
            "recent_used_cpu",
            "util_avg",
            "util_est",
            "runnable_avg",
            "load_avg",
            "uclamp_min",
            "uclamp_max",
            "wakee_flips",
            "migration_disabled",
            "core_cookie",
            "numa_preferred_nid",
            "per_cpu_kthread",
            "running",
            "sched_delayed",
            "eligible",
            "next_buddy",
            "blocked",
            "exec_start",
            "hot",
        ],
    )?;
    let cpus = resolve::TaskCpus {
        prev_cpu: o.cpu("prev_cpu", n)?,
        recent_used_cpu: match o.map.get("recent_used_cpu") {
            None => resolve::Recent::Unset,
            Some(Value::Null) => resolve::Recent::NoCpu,
            Some(v) => resolve::Recent::Cpu(cpu_value(v, "task.recent_used_cpu", n)?),
        },
    };
    let mut t = Task::new(n, task_cpu);
    t.policy = o.choice("policy", &POLICIES, Policy::Normal)?;
    t.cpus_allowed = o.cpulist("cpus_allowed", n)?.unwrap_or(CpuMask::first_n(n));
    // Parsed at the types' widths; the value rules are the resolver's
    // (Task::check), the same the RPC path applies.
    t.util_avg = o.int_or("util_avg", i64::MIN, i64::MAX, 0)?;
    t.util_est = o.int_or("util_est", i64::MIN, i64::MAX, 0)?;
    t.runnable_avg = o.int_or("runnable_avg", i64::MIN, i64::MAX, 0)?;
    t.load_avg = o.int_or("load_avg", i64::MIN, i64::MAX, 0)?;
    t.uclamp_min = o.int_or("uclamp_min", 0, u32::MAX as i64, 0)? as u32;
    t.uclamp_max = o.int_or("uclamp_max", 0, u32::MAX as i64, 1024)? as u32;
    t.wakee_flips = o.int_or("wakee_flips", i64::MIN, i64::MAX, 0)?;
    t.migration_disabled = o.bool_or("migration_disabled", false)?;
    t.core_cookie = o.int_or("core_cookie", 0, i64::MAX, 0)? as u64;
    let nid = o.int_or("numa_preferred_nid", i32::MIN as i64, i32::MAX as i64, -1)?;
    t.numa_preferred_nid = nid as i32;
    t.per_cpu_kthread = o.bool_or("per_cpu_kthread", false)?;
    t.running = o.bool_or("running", false)?;
    t.sched_delayed = o.bool_or("sched_delayed", false)?;
    t.eligible = o.bool_or("eligible", true)?;
    t.next_buddy = o.bool_or("next_buddy", false)?;
    t.blocked = o.bool_or("blocked", false)?;
    t.exec_start = o.int_or("exec_start", i64::MIN, i64::MAX, 0)?;
    t.hot = o.nullable_bool("hot")?;
    resolve::task(&mut t, cpus, wakeup, task_cpu)?;
    Ok(t)
}
