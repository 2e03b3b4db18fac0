//! The placement scenario format, version 1: one JSON object that fully
//! determines one decision. This module turns a scenario into engine types,
//! rejecting anything the format does not allow with an error that names the
//! field, and turns the engine's answer into the format's output shape.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value, json};

use crate::engine::balance::migrate::{IdleType, MigrateDecision, MigrateEnv, MigrationType, lbf};
use crate::engine::cpumask::CpuMask;
use crate::engine::decision::{Kind, PlaceRequest, Placement};
use crate::engine::features::{Features, Kernel, SERVICE_ONLY, System};
use crate::engine::resolve;
use crate::engine::state::{CpuState, MAX_CLOCK, MAX_SIGNAL, NodeState, Policy, SharedHint, Task};
use crate::engine::topology::{
    CpuTopo, FieldError, Level, SharedKind, SpanId, Topology, TopologySpec,
};
use crate::engine::{View, can_migrate_task, select_task_rq};
use crate::quote::{field_key, quote};

/// What a scenario asks.
#[derive(Debug, Clone)]
pub enum Request {
    Place(PlaceRequest),
    Migrate(Box<MigrateEnv>),
}

/// A parsed, validated scenario: everything one decision needs.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub name: Option<String>,
    pub topology: Topology,
    pub state: NodeState,
    pub features: Features,
    pub system: System,
    pub task: Task,
    pub request: Request,
}

/// The answer to a scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    Place(Placement),
    Migrate(MigrateDecision),
}

impl Scenario {
    pub fn view(&self) -> View<'_> {
        View {
            topo: &self.topology,
            state: &self.state,
            features: &self.features,
            system: &self.system,
        }
    }

    pub fn decide(&self) -> Answer {
        match &self.request {
            Request::Place(r) => Answer::Place(select_task_rq(self.view(), &self.task, r)),
            Request::Migrate(env) => {
                Answer::Migrate(can_migrate_task(self.view(), &self.task, env))
            }
        }
    }

    /// The answer in the format's output shape (section 9).
    pub fn answer_json(&self, a: &Answer) -> Value {
        match a {
            Answer::Place(p) => {
                let d = &p.detail;
                json!({
                    "cpu": p.cpu,
                    "path": p.path.as_str(),
                    "scanned": p.scanned,
                    "detail": {
                        "want_affine": d.want_affine,
                        "affine": d.affine.map(|a| a.as_str()),
                        "sis_target": d.sis_target,
                        "has_idle_core": d.has_idle_core,
                        "nr_idle_scan": d.nr_idle_scan,
                        "slow_levels": d.slow_levels,
                        "slow_cpus_read": d.slow_cpus_read,
                    }
                })
            }
            Answer::Migrate(m) => {
                let Request::Migrate(env) = &self.request else {
                    unreachable!("a migrate answer comes from a migrate request")
                };
                let dom = &self.topology.domains(env.dst_cpu)[env.sd];
                json!({
                    "allowed": m.allowed,
                    "new_dst_cpu": m.new_dst_cpu,
                    "flags": flag_names(m.flags),
                    "reason": m.reason.as_str(),
                    "task_hot": m.task_hot,
                    "detail": {
                        "sd_level": dom.level.to_string(),
                        "sd_span": self.topology.span(dom.span).to_string(),
                        "cache_nice_tries": m.cache_nice_tries,
                        "dst_group": env.dst_group.to_string(),
                        "env_cpus": env.env_cpus.to_string(),
                    }
                })
            }
        }
    }
}

fn flag_names(flags: u32) -> Vec<&'static str> {
    lbf::NAMES
        .iter()
        .filter(|(f, _)| flags & f != 0)
        .map(|(_, n)| *n)
        .collect()
}

/// Parses and decides one placement or migration scenario, returning the
/// output line's object (`offline::request` also takes balance requests).
pub fn decide_value(v: &Value) -> Result<Value, FieldError> {
    let s = parse(v)?;
    let a = s.decide();
    Ok(s.answer_json(&a))
}

/// A JSON object being read, with its path for error messages. Unknown keys
/// are rejected up front.
pub(super) struct Obj<'a> {
    pub(super) path: String,
    pub(super) map: &'a Map<String, Value>,
}

impl<'a> Obj<'a> {
    pub(super) fn new(v: &'a Value, path: &str, known: &[&str]) -> Result<Self, FieldError> {
        let map = v
            .as_object()
            .ok_or_else(|| FieldError::new(path, "must be an object"))?;
        for k in map.keys() {
            if !known.contains(&k.as_str()) {
                return Err(FieldError::new(join(path, k), "unknown field"));
            }
        }
        Ok(Obj {
            path: path.to_string(),
            map,
        })
    }

    pub(super) fn field(&self, k: &str) -> String {
        join(&self.path, k)
    }

    /// The value, treating JSON null as absent.
    pub(super) fn get(&self, k: &str) -> Option<&'a Value> {
        self.map.get(k).filter(|v| !v.is_null())
    }

    pub(super) fn int(&self, k: &str, min: i64, max: i64) -> Result<Option<i64>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(v) => int_value(v, &self.field(k), min, max).map(Some),
        }
    }

    pub(super) fn int_or(&self, k: &str, min: i64, max: i64, def: i64) -> Result<i64, FieldError> {
        Ok(self.int(k, min, max)?.unwrap_or(def))
    }

    pub(super) fn req_int(&self, k: &str, min: i64, max: i64) -> Result<i64, FieldError> {
        self.int(k, min, max)?
            .ok_or_else(|| FieldError::new(self.field(k), "is required"))
    }

    /// An integer that may be JSON null (`Some(None)`).
    pub(super) fn nullable_int(
        &self,
        k: &str,
        min: i64,
        max: i64,
    ) -> Result<Option<Option<i64>>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(Value::Null) => Ok(Some(None)),
            Some(v) => int_value(v, &self.field(k), min, max).map(|x| Some(Some(x))),
        }
    }

    pub(super) fn bool(&self, k: &str) -> Result<Option<bool>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(FieldError::new(self.field(k), "must be true or false")),
        }
    }

    pub(super) fn bool_or(&self, k: &str, def: bool) -> Result<bool, FieldError> {
        Ok(self.bool(k)?.unwrap_or(def))
    }

    pub(super) fn nullable_bool(&self, k: &str) -> Result<Option<bool>, FieldError> {
        match self.map.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(FieldError::new(
                self.field(k),
                "must be true, false or null",
            )),
        }
    }

    pub(super) fn str(&self, k: &str) -> Result<Option<&'a str>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(_) => Err(FieldError::new(self.field(k), "must be a string")),
        }
    }

    pub(super) fn choice<T: Copy>(
        &self,
        k: &str,
        opts: &[(&str, T)],
        def: T,
    ) -> Result<T, FieldError> {
        match self.str(k)? {
            None => Ok(def),
            Some(s) => opts
                .iter()
                .find(|(n, _)| *n == s)
                .map(|(_, t)| *t)
                .ok_or_else(|| {
                    let names: Vec<&str> = opts.iter().map(|(n, _)| *n).collect();
                    FieldError::new(
                        self.field(k),
                        format!("{} is not one of {}", quote(s), names.join(", ")),
                    )
                }),
        }
    }

    pub(super) fn cpulist(&self, k: &str, n: usize) -> Result<Option<CpuMask>, FieldError> {
        match self.str(k)? {
            None => Ok(None),
            Some(s) => CpuMask::parse_cpulist(s, n)
                .map(Some)
                .map_err(|e| FieldError::new(self.field(k), e)),
        }
    }

    pub(super) fn cpu(&self, k: &str, n: usize) -> Result<Option<usize>, FieldError> {
        match self.map.get(k) {
            None => Ok(None),
            Some(v) => cpu_value(v, &self.field(k), n).map(Some),
        }
    }
}

fn join(path: &str, k: &str) -> String {
    if path.is_empty() {
        field_key(k).into_owned()
    } else {
        format!("{path}.{}", field_key(k))
    }
}

fn int_value(v: &Value, field: &str, min: i64, max: i64) -> Result<i64, FieldError> {
    let x = match v {
        Value::Number(n) => n.as_i64().ok_or_else(|| {
            if n.is_u64() {
                FieldError::new(field, format!("{n} is out of range {min}..{max}"))
            } else {
                FieldError::new(field, format!("{n} is not an integer"))
            }
        })?,
        _ => return Err(FieldError::new(field, "must be an integer")),
    };
    if x < min || x > max {
        return Err(FieldError::new(
            field,
            format!("{x} is out of range {min}..{max}"),
        ));
    }
    Ok(x)
}

fn cpu_value(v: &Value, field: &str, n: usize) -> Result<usize, FieldError> {
    let x = match v {
        Value::Number(num) => num
            .as_i64()
            .ok_or_else(|| FieldError::new(field, format!("{num} is not a CPU id")))?,
        _ => return Err(FieldError::new(field, "must be a CPU id (integer)")),
    };
    if x < 0 || x as usize >= n {
        return Err(FieldError::new(
            field,
            format!("CPU {x} is not in the topology"),
        ));
    }
    Ok(x as usize)
}

/// The top-level fields every request kind shares.
pub(super) const NODE_KEYS: [&str; 14] = [
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
pub(super) struct Node {
    pub name: Option<String>,
    pub topology: Topology,
    pub state: NodeState,
    pub features: Features,
    pub system: System,
}

/// Parses and validates one scenario.
pub fn parse(v: &Value) -> Result<Scenario, FieldError> {
    let top = Obj::new(v, "", &NODE_KEYS)?;
    let Node {
        name,
        topology,
        state,
        features,
        system,
    } = parse_node(&top)?;
    let n = topology.nr_cpus;
    let req_v = top
        .map
        .get("request")
        .ok_or_else(|| FieldError::new("request", "is required"))?;
    let kind = {
        let o = req_v
            .as_object()
            .ok_or_else(|| FieldError::new("request", "must be an object"))?;
        match o.get("kind") {
            None => return Err(FieldError::new("request.kind", "is required")),
            Some(Value::String(s)) => s.clone(),
            Some(_) => return Err(FieldError::new("request.kind", "must be a string")),
        }
    };
    let task_v = top.map.get("task");
    let (task, request) = match kind.as_str() {
        "wakeup" | "fork" | "exec" => {
            let k = match kind.as_str() {
                "wakeup" => Kind::Wakeup,
                "fork" => Kind::Fork,
                _ => Kind::Exec,
            };
            let req = parse_place_request(req_v, k, &topology, &state)?;
            let task = parse_task(task_v, n, k == Kind::Wakeup, req.this_cpu)?;
            (task, Request::Place(req))
        }
        "can_migrate" => {
            let (src, dst) = migrate_cpus(req_v, &topology)?;
            let task = parse_task(task_v, n, false, src)?;
            let env = parse_migrate_request(req_v, src, dst, &topology, &state)?;
            (task, Request::Migrate(Box::new(env)))
        }
        other => {
            return Err(FieldError::new(
                "request.kind",
                format!(
                    "{} is not one of wakeup, fork, exec, can_migrate, balance",
                    quote(other)
                ),
            ));
        }
    };
    Ok(Scenario {
        name,
        topology,
        state,
        features,
        system,
        task,
        request,
    })
}

/// The version, kernel, features, system, topology, per-CPU state and hints.
pub(super) fn parse_node(top: &Obj<'_>) -> Result<Node, FieldError> {
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

fn parse_topology(v: &Value) -> Result<TopologySpec, FieldError> {
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
type ParsedCpus = (Vec<CpuState>, Vec<u64>);

fn parse_cpus(v: Option<&Value>, spec: &TopologySpec) -> Result<ParsedCpus, FieldError> {
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

fn parse_hint(v: &Value, path: &str) -> Result<SharedHint, FieldError> {
    let o = Obj::new(v, path, &["nr_idle_scan", "has_idle_cores"])?;
    Ok(SharedHint {
        nr_idle_scan: o.int("nr_idle_scan", 0, MAX_SIGNAL)?.map(|x| x as u32),
        has_idle_cores: o.bool("has_idle_cores")?,
    })
}

fn parse_hints(
    llc: Option<&Value>,
    asym: Option<&Value>,
    topo: &Topology,
) -> Result<Vec<SharedHint>, FieldError> {
    let mut hints = vec![SharedHint::default(); topo.shared.len()];
    if let Some(v) = llc {
        let map = v
            .as_object()
            .ok_or_else(|| FieldError::new("llc", "must be an object"))?;
        for (k, val) in map {
            let path = format!("llc.{}", field_key(k));
            let id: u32 = k
                .parse()
                .ok()
                .filter(|id: &u32| id.to_string() == *k)
                .filter(|id| topo.spec.cpus.iter().any(|c| c.llc == *id))
                .ok_or_else(|| {
                    FieldError::new(
                        &path,
                        format!("{} is not an LLC id of the topology", quote(k)),
                    )
                })?;
            let h = parse_hint(val, &path)?;
            // An LLC without a domain has no object: the entry is accepted and ignored.
            for (i, o) in topo.shared.iter().enumerate() {
                if o.kind == SharedKind::Llc && o.live && o.llc == id {
                    hints[i] = h;
                }
            }
        }
    }
    if let Some(v) = asym {
        let map = v
            .as_object()
            .ok_or_else(|| FieldError::new("asym", "must be an object"))?;
        for (k, val) in map {
            let path = format!("asym.{}", field_key(k));
            let span =
                CpuMask::parse_cpulist(k, topo.nr_cpus).map_err(|e| FieldError::new(&path, e))?;
            let idx = topo
                .shared
                .iter()
                .position(|o| o.kind == SharedKind::Asym && o.live && *topo.span(o.span) == span)
                .ok_or_else(|| {
                    FieldError::new(
                        &path,
                        "is not the span of an asymmetric-capacity shared object",
                    )
                })?;
            hints[idx] = parse_hint(val, &path)?;
        }
    }
    Ok(hints)
}

/// A domain name of section 2 as a level: `NUMA` is the first NUMA level
/// (the kernel names every NUMA level so), `NUMAj` the j-th.
fn parse_level_name(name: &str) -> Option<Level> {
    Some(match name {
        "SMT" => Level::Smt,
        "CLS" => Level::Cls,
        "MC" => Level::Mc,
        "PKG" => Level::Pkg,
        "NODE" => Level::Node,
        "NUMA" => Level::Numa(1),
        _ => {
            let j: u8 = name.strip_prefix("NUMA")?.parse().ok()?;
            if j == 0 || name != format!("NUMA{j}") {
                return None;
            }
            Level::Numa(j)
        }
    })
}

/// Section 6.1: the groups whose `sgc->imbalance` is set, each exactly the
/// span of a group of some online CPU's domain of the named level.
fn parse_sgc_imbalance(
    v: Option<&Value>,
    topo: &Topology,
) -> Result<Vec<(Level, SpanId)>, FieldError> {
    let Some(v) = v else {
        return Ok(Vec::new());
    };
    let map = v
        .as_object()
        .ok_or_else(|| FieldError::new("sgc_imbalance", "must be an object"))?;
    // The groups of every level's domains by span: one probe per entry,
    // however long the lists are.
    let mut groups: HashMap<(Level, CpuMask), SpanId> = HashMap::new();
    for c in topo.online.iter() {
        for d in topo.domains(c) {
            for &g in d.groups.iter() {
                groups.insert((d.level, *topo.span(g)), g);
            }
        }
    }
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for (k, val) in map {
        let path = format!("sgc_imbalance.{}", field_key(k));
        let level = parse_level_name(k).ok_or_else(|| {
            FieldError::new(
                &path,
                format!(
                    "{} is not a domain name (SMT, CLS, MC, PKG, NODE, NUMA, NUMAj)",
                    quote(k)
                ),
            )
        })?;
        let list = val
            .as_array()
            .ok_or_else(|| FieldError::new(&path, "must be a list of cpulists"))?;
        for (i, item) in list.iter().enumerate() {
            let ipath = format!("{path}[{i}]");
            let s = item
                .as_str()
                .ok_or_else(|| FieldError::new(&ipath, "must be a cpulist string"))?;
            let mask =
                CpuMask::parse_cpulist(s, topo.nr_cpus).map_err(|e| FieldError::new(&ipath, e))?;
            let g = groups.get(&(level, mask)).copied().ok_or_else(|| {
                FieldError::new(
                    &ipath,
                    format!("{} is not the span of a group of a {k} domain", quote(s)),
                )
            })?;
            if seen.insert((level, g)) {
                out.push((level, g));
            }
        }
    }
    Ok(out)
}

/// A task's `policy` names (section 7).
pub(super) const POLICIES: [(&str, Policy); 3] = [
    ("normal", Policy::Normal),
    ("batch", Policy::Batch),
    ("idle", Policy::Idle),
];

fn parse_task(
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

fn parse_place_request(
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

fn migrate_cpus(v: &Value, topo: &Topology) -> Result<(usize, usize), FieldError> {
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

fn parse_migrate_request(
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
