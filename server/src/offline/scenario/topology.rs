//! The node's shape and state: `topology` (its CPUs' cores, clusters,
//! LLCs, NUMA nodes and capacities, and the NUMA distances) and `cpus`
//! (each CPU's runqueue and signals, held to the rules an agent's report
//! is held to).

use serde_json::Value;

use crate::engine::cpumask::CpuMask;
use crate::engine::state::CpuState;
use crate::engine::topology::{CpuTopo, FieldError, TopologySpec};

use super::Obj;
use super::obj::{cpu_value, int_value};

/// The `topology` object: its CPUs in id order, and the NUMA distances.
pub(super) fn parse_topology(v: &Value) -> Result<TopologySpec, FieldError> {
    let o = Obj::new(v, "topology", &["cpus", "numa_distance"])?;
    let list = o
        .map
        .get("cpus")
        .ok_or_else(|| FieldError::new("topology.cpus", "is required"))?
        .as_array()
        .ok_or_else(|| FieldError::new("topology.cpus", "must be a list"))?;
    if list.len() > crate::engine::cpumask::MAX_CPUS {
        return Err(FieldError::new(
            "topology.cpus",
            format!(
                "{} CPUs exceed the limit of {}",
                list.len(),
                crate::engine::cpumask::MAX_CPUS
            ),
        ));
    }
    let mut cpus = Vec::with_capacity(list.len());
    for (i, c) in list.iter().enumerate() {
        let path = format!("topology.cpus[{i}]");
        let c = Obj::new(
            c,
            &path,
            &["id", "core", "cluster", "llc", "node", "capacity"],
        )?;
        let id = c.req_int("id", 0, i64::MAX)?;
        if id != i as i64 {
            return Err(FieldError::new(
                c.field("id"),
                format!("{id} must equal the list position {i}"),
            ));
        }
        cpus.push(CpuTopo {
            core: c.req_int("core", 0, u32::MAX as i64)? as u32,
            cluster: c.int("cluster", 0, u32::MAX as i64)?.map(|x| x as u32),
            llc: c.req_int("llc", 0, u32::MAX as i64)? as u32,
            node: c.int_or("node", 0, 255, 0)? as u32,
            capacity: c.int_or("capacity", 1, 1024, 1024)? as u32,
        });
    }
    let numa_distance = match o.get("numa_distance") {
        None => None,
        Some(d) => {
            let rows = d.as_array().ok_or_else(|| {
                FieldError::new("topology.numa_distance", "must be a list of lists")
            })?;
            let mut m = Vec::with_capacity(rows.len());
            for (a, row) in rows.iter().enumerate() {
                let f = format!("topology.numa_distance[{a}]");
                let row = row
                    .as_array()
                    .ok_or_else(|| FieldError::new(&f, "must be a list"))?;
                let mut r = Vec::with_capacity(row.len());
                for (b, x) in row.iter().enumerate() {
                    r.push(int_value(x, &format!("{f}[{b}]"), 0, 1 << 20)? as u32);
                }
                m.push(r);
            }
            Some(m)
        }
    };
    Ok(TopologySpec {
        cpus,
        numa_distance,
    })
}

/// The CPUs' states, and their core cookies (by CPU).
pub(super) type ParsedCpus = (Vec<CpuState>, Vec<u64>);

/// The `cpus` list: each listed CPU's state (the others idle).
pub(super) fn parse_cpus(v: Option<&Value>, spec: &TopologySpec) -> Result<ParsedCpus, FieldError> {
    let n = spec.cpus.len();
    let mut cpus: Vec<CpuState> = spec
        .cpus
        .iter()
        .map(|t| CpuState::idle(t.capacity))
        .collect();
    let mut cookies = vec![0; n];
    let Some(v) = v else {
        return Ok((cpus, cookies));
    };
    let list = v
        .as_array()
        .ok_or_else(|| FieldError::new("cpus", "must be a list"))?;
    let mut seen = CpuMask::new();
    for (k, e) in list.iter().enumerate() {
        let path = format!("cpus[{k}]");
        let o = Obj::new(
            e,
            &path,
            &[
                "id",
                "online",
                "nr_running",
                "h_nr_idle",
                "nr_delayed",
                "cfs_h_nr_queued",
                "curr_is_idle",
                "ttwu_pending",
                "vcpu_preempted",
                "load_avg",
                "runnable_avg",
                "util_avg",
                "util_est",
                "capacity",
                "actual_capacity",
                "idle_exit_latency",
                "idle_stamp",
                "curr_is_per_cpu_kthread",
                "core_cookie",
            ],
        )?;
        let id = match e.get("id") {
            None => return Err(FieldError::new(o.field("id"), "is required")),
            Some(v) => cpu_value(v, &o.field("id"), n)?,
        };
        if seen.test(id) {
            return Err(FieldError::new(
                o.field("id"),
                format!("CPU {id} is listed twice"),
            ));
        }
        seen.set(id);
        // Parsed at the types' widths; the value rules are CpuState::check's,
        // the same an agent's report is held to.
        let cap = spec.cpus[id].capacity;
        let count = |k| o.int_or(k, 0, u32::MAX as i64, 0).map(|v| v as u32);
        let signal = |k| o.int_or(k, i64::MIN, i64::MAX, 0);
        let field = |(f, msg)| FieldError::new(o.field(f), msg);
        let pelt = |k| CpuState::signal_field(k, signal(k)?).map_err(field);
        let capacity = |k, lo| {
            let v = o.int_or(k, 0, u32::MAX as i64, cap as i64)? as u32;
            CpuState::capacity_field(k, lo, Some(v), cap).map_err(field)
        };
        let nr = count("nr_running")?;
        cpus[id] = CpuState {
            online: o.bool_or("online", true)?,
            nr_running: nr,
            h_nr_idle: count("h_nr_idle")?,
            nr_delayed: count("nr_delayed")?,
            cfs_h_nr_queued: o.int_or("cfs_h_nr_queued", 0, u32::MAX as i64, nr as i64)? as u32,
            curr_is_idle: o.bool_or("curr_is_idle", nr == 0)?,
            ttwu_pending: o.bool_or("ttwu_pending", false)?,
            vcpu_preempted: o.bool_or("vcpu_preempted", false)?,
            load_avg: pelt("load_avg")?,
            runnable_avg: pelt("runnable_avg")?,
            util_avg: pelt("util_avg")?,
            util_est: pelt("util_est")?,
            capacity: capacity("capacity", 1)?,
            actual_capacity: capacity("actual_capacity", 0)?,
            idle_exit_latency: CpuState::exit_latency_field(
                o.nullable_int("idle_exit_latency", 0, u32::MAX as i64)?
                    .flatten()
                    .map(|x| x as u32),
            )
            .map_err(field)?,
            idle_stamp: signal("idle_stamp")?,
            curr_is_per_cpu_kthread: o.bool_or("curr_is_per_cpu_kthread", false)?,
        };
        cookies[id] = o.int_or("core_cookie", 0, i64::MAX, 0)? as u64;
        cpus[id]
            .check(cap)
            .map_err(|(f, msg)| FieldError::new(o.field(f), msg))?;
    }
    Ok((cpus, cookies))
}
