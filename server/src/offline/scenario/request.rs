//! The `request` of a placement (`wakeup`, `fork`, `exec`) or a migration
//! (`can_migrate`): its fields read and resolved against the node as the
//! RPC path resolves them (`engine::resolve`).

use serde_json::Value;

use crate::engine::balance::migrate::{IdleType, MigrateEnv, MigrationType};
use crate::engine::decision::{Kind, PlaceRequest};
use crate::engine::resolve;
use crate::engine::state::{MAX_SIGNAL, NodeState};
use crate::engine::topology::{FieldError, Topology};

use super::obj::Obj;

/// A placement request of `kind`.
pub(super) fn parse_place_request(
    v: &Value,
    kind: Kind,
    topo: &Topology,
    st: &NodeState,
) -> Result<PlaceRequest, FieldError> {
    let o = Obj::new(
        v,
        "request",
        &[
            "kind",
            "this_cpu",
            "sync",
            "wf_current_cpu",
            "in_task",
            "waker_exiting",
            "waker_wakee_flips",
            "waker_last_wakee_is_task",
            "waker_flip_decay_expired",
            "waker_load",
            "waker_is_per_cpu_kthread",
        ],
    )?;
    let this_cpu = o
        .cpu("this_cpu", topo.nr_cpus)?
        .ok_or_else(|| FieldError::new("request.this_cpu", "is required"))?;
    let this_cpu = resolve::this_cpu(kind, this_cpu, "request.this_cpu", topo, st)?;
    let mut r = PlaceRequest::new(kind, this_cpu);
    r.sync = o.bool_or("sync", false)?;
    r.wf_current_cpu = o.bool_or("wf_current_cpu", false)?;
    r.in_task = o.bool_or("in_task", true)?;
    r.waker_exiting = o.bool_or("waker_exiting", false)?;
    r.waker_wakee_flips = o.int_or("waker_wakee_flips", 0, MAX_SIGNAL, 0)?;
    r.waker_last_wakee_is_task = o.bool_or("waker_last_wakee_is_task", true)?;
    r.waker_flip_decay_expired = o.bool_or("waker_flip_decay_expired", false)?;
    r.waker_load = o.int_or("waker_load", 0, MAX_SIGNAL, 0)?;
    r.waker_is_per_cpu_kthread = o.bool_or(
        "waker_is_per_cpu_kthread",
        st.cpus[this_cpu].curr_is_per_cpu_kthread,
    )?;
    Ok(r)
}

/// The fields of a `can_migrate` request.
const MIGRATE_KEYS: [&str; 14] = [
    "kind",
    "src_cpu",
    "dst_cpu",
    "sd_level",
    "dst_group",
    "env_cpus",
    "idle",
    "migration_type",
    "flags",
    "nr_balance_failed",
    "cache_nice_tries",
    "throttled",
    "dst_cfs_nr_queued",
    "now",
];

/// A migration's source and destination CPUs, checked.
pub(super) fn migrate_cpus(v: &Value, topo: &Topology) -> Result<(usize, usize), FieldError> {
    let o = Obj::new(v, "request", &MIGRATE_KEYS)?;
    let n = topo.nr_cpus;
    let src = o
        .cpu("src_cpu", n)?
        .ok_or_else(|| FieldError::new("request.src_cpu", "is required"))?;
    let dst = o
        .cpu("dst_cpu", n)?
        .ok_or_else(|| FieldError::new("request.dst_cpu", "is required"))?;
    resolve::migrate_cpus(src, dst, |f| o.field(f), topo)?;
    Ok((src, dst))
}

/// A migration request from `src` to `dst`.
pub(super) fn parse_migrate_request(
    v: &Value,
    src: usize,
    dst: usize,
    topo: &Topology,
    st: &NodeState,
) -> Result<MigrateEnv, FieldError> {
    let o = Obj::new(v, "request", &MIGRATE_KEYS)?;
    let n = topo.nr_cpus;
    let sd_level = match o.map.get("sd_level") {
        Some(Value::Null) => None,
        _ => o.str("sd_level")?,
    };
    let flags = match o.get("flags") {
        None => None,
        Some(Value::Array(list)) => Some(
            list.iter()
                .enumerate()
                .map(|(i, x)| {
                    x.as_str().ok_or_else(|| {
                        FieldError::new(format!("request.flags[{i}]"), "must be a flag name")
                    })
                })
                .collect::<Result<Vec<&str>, _>>()?,
        ),
        Some(_) => {
            return Err(FieldError::new(
                "request.flags",
                "must be a list of flag names",
            ));
        }
    };
    let fields = resolve::MigrateFields {
        src_cpu: src,
        dst_cpu: dst,
        sd_level,
        flags,
        dst_group: o.cpulist("dst_group", n)?,
        env_cpus: o.cpulist("env_cpus", n)?,
        idle: o.choice(
            "idle",
            &[
                ("idle", IdleType::Idle),
                ("not_idle", IdleType::NotIdle),
                ("newly_idle", IdleType::NewlyIdle),
            ],
            IdleType::Idle,
        )?,
        migration_type: o.choice(
            "migration_type",
            &[
                ("load", MigrationType::Load),
                ("util", MigrationType::Util),
                ("task", MigrationType::Task),
                ("misfit", MigrationType::Misfit),
            ],
            MigrationType::Load,
        )?,
        nr_balance_failed: o.int_or("nr_balance_failed", 0, u32::MAX as i64, 0)? as u32,
        cache_nice_tries: o
            .int("cache_nice_tries", 0, u32::MAX as i64)?
            .map(|x| x as u32),
        throttled: o.bool_or("throttled", false)?,
        dst_cfs_nr_queued: o.int("dst_cfs_nr_queued", i64::MIN, i64::MAX)?,
        now: o.int_or("now", i64::MIN, i64::MAX, 0)?,
    };
    resolve::migrate_env(fields, |f| o.field(f), topo, st)
}
