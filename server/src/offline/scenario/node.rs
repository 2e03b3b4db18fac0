//! What a scenario says about the node, whatever it asks: the version,
//! kernel profile, features and system switches, then the topology, the
//! CPUs' states and the hints (parsed in `topology` and `hints`), built
//! into the engine's topology and node state.

use serde_json::Value;

use crate::engine::cpumask::CpuMask;
use crate::engine::features::{Features, Kernel, SERVICE_ONLY, System};
use crate::engine::state::{MAX_CLOCK, NodeState};
use crate::engine::topology::{FieldError, Topology};
use crate::quote::{field_key, quote};

use super::hints::{parse_hints, parse_sgc_imbalance};
use super::obj::Obj;
use super::topology::{parse_cpus, parse_topology};

/// The top-level fields every request kind shares.
pub(in crate::offline) const NODE_KEYS: [&str; 14] = [
    "version",
    "name",
    "kernel",
    "generator",
    "features",
    "system",
    "topology",
    "cpus",
    "llc",
    "asym",
    "sgc_imbalance",
    "task",
    "request",
    "expected",
];

/// What a scenario says about the node, whatever it asks.
pub(in crate::offline) struct Node {
    pub name: Option<String>,
    pub topology: Topology,
    pub state: NodeState,
    pub features: Features,
    pub system: System,
}

/// The version, kernel, features, system, topology, per-CPU state and hints.
pub(in crate::offline) fn parse_node(top: &Obj<'_>) -> Result<Node, FieldError> {
    let version = top.int_or("version", i64::MIN, i64::MAX, 1)?;
    if version != 1 {
        return Err(FieldError::new(
            "version",
            format!("{version} is not supported (must be 1)"),
        ));
    }
    let name = top.str("name")?.map(str::to_string);
    if let Some(g) = top.map.get("generator")
        && !g.is_object()
    {
        return Err(FieldError::new("generator", "must be an object"));
    }

    let kernel = parse_kernel(top.map.get("kernel"))?;
    let features = parse_features(top.map.get("features"), kernel)?;
    let system = parse_system(top.map.get("system"))?;
    let spec = parse_topology(
        top.map
            .get("topology")
            .ok_or_else(|| FieldError::new("topology", "is required"))?,
    )?;
    spec.validate("topology")?;
    let (cpus, cookies) = parse_cpus(top.map.get("cpus"), &spec)?;
    let mut online = CpuMask::new();
    for (i, c) in cpus.iter().enumerate() {
        if c.online {
            online.set(i);
        }
    }
    let topology = Topology::build(&spec, &online, system.node_reclaim_distance)?;
    if kernel == Kernel::V6_12 && top.map.contains_key("asym") {
        return Err(FieldError::new(
            "asym",
            "Linux 6.12 has no asymmetric-capacity shared object (kernel \"6.12\")",
        ));
    }
    let hints = parse_hints(top.map.get("llc"), top.map.get("asym"), &topology)?;
    let mut state = NodeState::new(&topology, cpus, &hints, &features);
    state.set_core_cookies(&topology, cookies);
    state.sgc_imbalance = parse_sgc_imbalance(top.map.get("sgc_imbalance"), &topology)?;
    Ok(Node {
        name,
        topology,
        state,
        features,
        system,
    })
}

/// The kernel profile (section 13): `"mainline"` (default) or `"6.12"`.
fn parse_kernel(v: Option<&Value>) -> Result<Kernel, FieldError> {
    match v {
        None => Ok(Kernel::Mainline),
        Some(Value::String(s)) if !s.is_empty() => Kernel::from_name(s).ok_or_else(|| {
            FieldError::new(
                "kernel",
                format!("{} is not one of \"mainline\", \"6.12\"", quote(s)),
            )
        }),
        Some(_) => Err(FieldError::new(
            "kernel",
            "must be \"mainline\" or \"6.12\"",
        )),
    }
}

/// The features of the kernel profile, with the scenario's switches set.
fn parse_features(v: Option<&Value>, kernel: Kernel) -> Result<Features, FieldError> {
    let mut f = Features::for_kernel(kernel);
    let Some(v) = v else { return Ok(f) };
    let map = v
        .as_object()
        .ok_or_else(|| FieldError::new("features", "must be an object"))?;
    for (k, val) in map {
        let field = format!("features.{}", field_key(k));
        let on = val
            .as_bool()
            .ok_or_else(|| FieldError::new(&field, "must be true or false"))?;
        if SERVICE_ONLY.contains(&k.as_str()) {
            return Err(FieldError::new(
                field,
                "a service switch, not part of the scenario format (cache-aware scheduling is not modelled there)",
            ));
        }
        if !f.set(k, on) {
            return Err(FieldError::new(field, "unknown feature"));
        }
    }
    Ok(f)
}

/// The system-wide switches (`system`), defaults where absent.
fn parse_system(v: Option<&Value>) -> Result<System, FieldError> {
    let mut s = System::default();
    let Some(v) = v else { return Ok(s) };
    let o = Obj::new(
        v,
        "system",
        &[
            "uclamp_used",
            "core_sched",
            "migration_cost_ns",
            "node_reclaim_distance",
        ],
    )?;
    s.uclamp_used = o.nullable_bool("uclamp_used")?;
    s.core_sched = o.bool_or("core_sched", false)?;
    s.migration_cost_ns = o.int_or("migration_cost_ns", -1, MAX_CLOCK, s.migration_cost_ns)?;
    s.node_reclaim_distance = o.int_or(
        "node_reclaim_distance",
        0,
        1 << 20,
        s.node_reclaim_distance as i64,
    )? as u32;
    Ok(s)
}
