//! The placement scenario format, version 1: one JSON object that fully
//! determines one decision. This module turns a scenario into engine types,
//! rejecting anything the format does not allow with an error that names the
//! field, and turns the engine's answer into the format's output shape.
//!
//! The parts, by what they read: `obj` (fields at their types and
//! ranges), `node` (version, kernel, features, system), `topology` (the
//! shape and the CPUs' states), `hints` (shared-object hints and
//! `sgc_imbalance`), `task`, and `request` (placement and migration).
//! This module holds the types, the top level and the answer.

mod hints;
mod node;
mod obj;
mod request;
mod task;
mod topology;

use serde_json::{Value, json};

use crate::engine::balance::migrate::{MigrateDecision, MigrateEnv, lbf};
use crate::engine::decision::{Kind, PlaceRequest, Placement};
use crate::engine::features::{Features, System};
use crate::engine::state::{NodeState, Task};
use crate::engine::topology::{FieldError, Topology};
use crate::engine::{View, can_migrate_task, select_task_rq};
use crate::quote::quote;

pub(super) use node::{NODE_KEYS, Node, parse_node};
pub(super) use obj::Obj;
pub(super) use task::POLICIES;

use request::{migrate_cpus, parse_migrate_request, parse_place_request};
use task::parse_task;

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
