//! The `balance` request of the scenario format: one `sched_balance_rq()`
//! call, replayed. A kernel trace of a load-balance pass gives the node's
//! runqueues, the task lists the pass read (`rq_tasks`), the balancing CPU,
//! its domain and idle type and the domain's `nr_balance_failed`; the
//! answer is what the engine's balancer does in that one call: the
//! runqueues it tried to detach from, the busiest group, the migration type
//! and imbalance, and the tasks it detached. Separate from `scenario`
//! because it is the only request over many tasks, and the only one that
//! runs the balancer rather than one decision.

use std::sync::Arc;

use serde_json::{Value, json};

use crate::engine::View;
use crate::engine::balance::migrate::IdleType;
use crate::engine::balance::{Balancer, Proposal, RqOutcome};
use crate::engine::cpumask::CpuMask;
use crate::engine::rq::{RqTask, TaskTable};
use crate::engine::state::{MAX_CLOCK, MAX_SIGNAL, Policy};
use crate::engine::topology::{FieldError, Topology};
use crate::quote::quote;

use super::scenario::{NODE_KEYS, Node, Obj, POLICIES, parse_node};

/// At most this many tasks in all lists together: a request's work and
/// memory stay bounded (a kernel runqueue this long is not balanced in one
/// call anyway: `sysctl_sched_nr_migrate` is 32).
pub const MAX_RQ_TASKS: usize = 65_536;

/// Whether a scenario asks for a balance (`request.kind == "balance"`).
pub fn is_balance(v: &Value) -> bool {
    v.get("request")
        .and_then(|r| r.get("kind"))
        .and_then(Value::as_str)
        == Some("balance")
}

/// Parses, runs and answers one balance scenario.
pub fn decide_balance(v: &Value) -> Result<Value, FieldError> {
    let mut keys = NODE_KEYS.to_vec();
    keys.push("rq_tasks");
    let top = Obj::new(v, "", &keys)?;
    if top.map.contains_key("task") {
        return Err(FieldError::new(
            "task",
            "a balance has no single task: give the runqueues' tasks in rq_tasks",
        ));
    }
    let node = parse_node(&top)?;
    let topo = &node.topology;
    let req = parse_request(top.map.get("request").expect("is_balance saw it"), topo)?;
    let table = parse_rq_tasks(top.map.get("rq_tasks"), topo)?;

    let mut b = Balancer::new(topo);
    b.lb.dom[req.cpu][req.sd].nr_balance_failed = req.nr_balance_failed;
    for &(level, g) in &node.state.sgc_imbalance {
        b.lb.set_sgc_imbalance(topo, level, g, true);
    }
    let view = View {
        topo,
        state: &node.state,
        features: &node.features,
        system: &node.system,
    };
    let mut out = Vec::new();
    let o = b.balance_rq(view, &table, None, req.cpu, req.sd, req.idle, &mut out);
    Ok(answer_json(&node, &req, &o, &out, &b))
}

/// The request's fields, resolved against the topology.
struct BalanceRequest {
    cpu: usize,
    /// Index into `cpu`'s domain chain.
    sd: usize,
    idle: IdleType,
    nr_balance_failed: u32,
}

const REQUEST_KEYS: [&str; 5] = ["kind", "cpu", "sd_level", "idle", "nr_balance_failed"];

fn parse_request(v: &Value, topo: &Topology) -> Result<BalanceRequest, FieldError> {
    let o = Obj::new(v, "request", &REQUEST_KEYS)?;
    let n = topo.nr_cpus;
    let cpu = o
        .cpu("cpu", n)?
        .ok_or_else(|| FieldError::new("request.cpu", "is required"))?;
    if !topo.online.test(cpu) {
        return Err(FieldError::new(
            "request.cpu",
            format!("CPU {cpu} is offline"),
        ));
    }
    let chain = topo.domains(cpu);
    if chain.is_empty() {
        return Err(FieldError::new(
            "request.cpu",
            format!("CPU {cpu} has no sched domain to balance"),
        ));
    }
    let sd = match o.str("sd_level")? {
        None => 0,
        Some(name) => topo.domain_by_name(cpu, name).ok_or_else(|| {
            let names: Vec<String> = chain.iter().map(|d| d.level.to_string()).collect();
            FieldError::new(
                "request.sd_level",
                format!(
                    "{} is not a domain of CPU {cpu} (it has {})",
                    quote(name),
                    names.join(", ")
                ),
            )
        })?,
    };
    let idle = o.choice(
        "idle",
        &[
            ("idle", IdleType::Idle),
            ("not_idle", IdleType::NotIdle),
            ("newly_idle", IdleType::NewlyIdle),
        ],
        IdleType::Idle,
    )?;
    let nr_balance_failed = o.int_or("nr_balance_failed", 0, u32::MAX as i64, 0)? as u32;
    Ok(BalanceRequest {
        cpu,
        sd,
        idle,
        nr_balance_failed,
    })
}

const TASK_KEYS: [&str; 12] = [
    "id",
    "policy",
    "cpus_allowed",
    "load_avg",
    "util_avg",
    "util_est",
    "runnable_avg",
    "running",
    "exec_start",
    "migration_disabled",
    "per_cpu_kthread",
    "next_buddy",
];

/// `rq_tasks`: per CPU id (a string key), `{"clock_task": N, "tasks": [...]}`
/// with the tasks in `cfs_tasks` order, most recently run first.
fn parse_rq_tasks(v: Option<&Value>, topo: &Topology) -> Result<TaskTable, FieldError> {
    let n = topo.nr_cpus;
    let mut table = TaskTable::empty(n);
    let Some(v) = v else {
        return Ok(table);
    };
    let map = v
        .as_object()
        .ok_or_else(|| FieldError::new("rq_tasks", "must be an object keyed by CPU id"))?;
    let mut total = 0usize;
    let mut ids = std::collections::HashSet::new();
    for (k, cv) in map {
        let path = format!("rq_tasks.{k}");
        let cpu = k
            .parse::<usize>()
            .ok()
            .filter(|&c| c < n)
            .ok_or_else(|| FieldError::new(&path, "key must be a CPU id of the topology"))?;
        let o = Obj::new(cv, &path, &["clock_task", "tasks"])?;
        table.clock[cpu] = o.int_or("clock_task", 0, MAX_CLOCK, 0)?;
        let list = match o.get("tasks") {
            None => continue,
            Some(Value::Array(a)) => a,
            Some(_) => return Err(FieldError::new(format!("{path}.tasks"), "must be a list")),
        };
        total += list.len();
        if total > MAX_RQ_TASKS {
            return Err(FieldError::new(
                format!("{path}.tasks"),
                format!("more than {MAX_RQ_TASKS} tasks in all lists"),
            ));
        }
        let mut tasks = Vec::with_capacity(list.len());
        for (i, tv) in list.iter().enumerate() {
            let tp = format!("{path}.tasks[{i}]");
            let (t, mask) = parse_rq_task(tv, &tp, n)?;
            if !ids.insert(t.id) {
                return Err(FieldError::new(
                    format!("{tp}.id"),
                    format!("task {} is listed twice", t.id),
                ));
            }
            let allowed = table.intern_mask(mask);
            tasks.push(RqTask { allowed, ..t });
        }
        table.cpus[cpu] = Arc::from(tasks);
    }
    Ok(table)
}

fn parse_rq_task(v: &Value, path: &str, n: usize) -> Result<(RqTask, CpuMask), FieldError> {
    let o = Obj::new(v, path, &TASK_KEYS)?;
    let id = o
        .int("id", 0, i64::MAX)?
        .ok_or_else(|| FieldError::new(format!("{path}.id"), "is required"))?;
    let mask = o.cpulist("cpus_allowed", n)?.unwrap_or(CpuMask::first_n(n));
    if mask.is_empty() {
        return Err(FieldError::new(
            format!("{path}.cpus_allowed"),
            "must not be empty",
        ));
    }
    let signal = |k: &str| o.int_or(k, 0, MAX_SIGNAL, 0);
    let mut t = RqTask::new(id as u64, id as u64, 0);
    t.policy = o.choice("policy", &POLICIES, Policy::Normal)?;
    t.load_avg = signal("load_avg")?;
    t.util_avg = signal("util_avg")?;
    t.util_est = signal("util_est")?;
    t.runnable_avg = signal("runnable_avg")?;
    t.running = o.bool_or("running", false)?;
    t.exec_start = o.int_or("exec_start", 0, MAX_CLOCK, 0)?;
    t.migration_disabled = o.bool_or("migration_disabled", false)?;
    t.per_cpu_kthread = o.bool_or("per_cpu_kthread", false)?;
    t.next_buddy = o.bool_or("next_buddy", false)?;
    Ok((t, mask))
}

/// The answer: the format's balance output (docs/scenario-format.md).
fn answer_json(
    node: &Node,
    req: &BalanceRequest,
    o: &RqOutcome,
    out: &[Proposal],
    b: &Balancer,
) -> Value {
    let topo = &node.topology;
    let d = &topo.domains(req.cpu)[req.sd];
    let detached: Vec<Value> = out
        .iter()
        .filter(|p| !p.active)
        .map(|p| json!({"id": p.task, "src_cpu": p.src_cpu, "dst_cpu": p.dst_cpu}))
        .collect();
    let active = out
        .iter()
        .find(|p| p.active)
        .map(|p| json!({"id": p.task, "src_cpu": p.src_cpu, "dst_cpu": p.dst_cpu}));
    json!({
        "busiest": o.busiest,
        "busiest_group": o.first_group.map(|g| topo.span(g).to_string()),
        "busiest_rq": o.first_rq,
        "migration_type": o.migration_type.map(|m| m.as_str()),
        "imbalance": o.imbalance,
        "detached": detached,
        "active": active,
        "detail": {
            "sd_level": d.level.to_string(),
            "sd_span": topo.span(d.span).to_string(),
            "moved": o.moved,
            "nr_balance_failed_after": b.lb.dom[req.cpu][req.sd].nr_balance_failed,
        }
    })
}
