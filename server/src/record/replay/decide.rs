//! A recorded request decided again on its rebuilt snapshot, with the same
//! conversions and engine calls the handlers make, and the recorded answer
//! in the same terms.

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::record_decision::Request;

use super::nodes::Version;
use crate::convert;
use crate::engine::alloc::{self, Policy};
use crate::engine::cpumask::{CpuMask, MAX_CPUS};
use crate::engine::features::{Features, System};
use crate::engine::state::Task;
use crate::engine::{can_migrate_task, select_task_rq};

/// A request's answer, as compared.
#[derive(Debug, Clone, PartialEq)]
pub enum Answer {
    Pick {
        cpu: u32,
        path: String,
        scanned: u32,
        affine: String,
        nr_idle_scan: Option<u32>,
    },
    Migrate {
        allowed: bool,
        new_dst_cpu: Option<u32>,
        flags: Vec<String>,
        reason: String,
        task_hot: Option<bool>,
    },
    Allocate {
        /// As a cpulist.
        cpus: String,
        scanned: u32,
    },
    /// The request was refused (its conversion or the policy).
    Refused(String),
}

impl Answer {
    /// Whether `other` sends the task somewhere else (or decides the other
    /// way): what a switch's "changed" counts.
    pub fn moved_from(&self, other: &Answer) -> bool {
        match (self, other) {
            (Answer::Pick { cpu: a, .. }, Answer::Pick { cpu: b, .. }) => a != b,
            (
                Answer::Migrate {
                    allowed: a,
                    new_dst_cpu: x,
                    ..
                },
                Answer::Migrate {
                    allowed: b,
                    new_dst_cpu: y,
                    ..
                },
            ) => a != b || x != y,
            (Answer::Allocate { cpus: a, .. }, Answer::Allocate { cpus: b, .. }) => a != b,
            (Answer::Refused(_), Answer::Refused(_)) => false,
            _ => true,
        }
    }

    /// The CPUs it scanned (placements and allocations).
    pub fn scanned(&self) -> Option<u32> {
        match self {
            Answer::Pick { scanned, .. } | Answer::Allocate { scanned, .. } => Some(*scanned),
            _ => None,
        }
    }

    /// The path that chose (a placement's), or the request's kind.
    pub fn path(&self) -> &str {
        match self {
            Answer::Pick { path, .. } => path,
            Answer::Migrate { reason, .. } => reason,
            Answer::Allocate { .. } => "allocate",
            Answer::Refused(_) => "refused",
        }
    }

    /// The one CPU a placement chose.
    pub fn cpu(&self) -> Option<usize> {
        match self {
            Answer::Pick { cpu, .. } => Some(*cpu as usize),
            _ => None,
        }
    }
}

/// The request's kind as the report names it.
pub fn kind(d: &pb::RecordDecision) -> &'static str {
    match &d.request {
        Some(Request::Pick(r)) => match pb::RequestKind::try_from(r.kind) {
            Ok(pb::RequestKind::Fork) => "fork",
            Ok(pb::RequestKind::Exec) => "exec",
            _ => "wakeup",
        },
        Some(Request::Migrate(_)) => "can_migrate",
        Some(Request::Allocate(_)) => "allocate",
        Some(Request::Balance(_)) => "balance",
        None => "none",
    }
}

/// The answer the server gave, in the replay's terms.
pub fn recorded(d: &pb::RecordDecision) -> Option<Answer> {
    match &d.request {
        Some(Request::Pick(_)) => d.picked.as_ref().map(|p| Answer::Pick {
            cpu: p.cpu,
            path: p.path.clone(),
            scanned: p.scanned,
            affine: p.affine.clone(),
            nr_idle_scan: p.nr_idle_scan,
        }),
        Some(Request::Migrate(_)) => d.migrated.as_ref().map(|m| Answer::Migrate {
            allowed: m.allowed,
            new_dst_cpu: m.new_dst_cpu,
            flags: m.flags.clone(),
            reason: m.reason.clone(),
            task_hot: m.task_hot,
        }),
        Some(Request::Allocate(_)) => Some(Answer::Allocate {
            cpus: d.granted.clone(),
            scanned: d.alloc_scanned,
        }),
        _ => None,
    }
}

/// What a placement's judgement needs of the request: the task's previous
/// CPU.
pub fn prev_cpu(d: &pb::RecordDecision, v: &Version) -> Option<usize> {
    let Some(Request::Pick(r)) = &d.request else {
        return None;
    };
    let snap = v.snapshot(v.features);
    let mut task = Task::new(1, 0);
    convert::pick_request(r, &snap, &mut task).ok()?;
    Some(task.prev_cpu)
}

/// Decides `d` again on version `v` under `features`; `None` for a request
/// that is recorded but not decided again (a balance pass).
pub fn decide(
    d: &pb::RecordDecision,
    v: &Version,
    features: Features,
    system: &System,
) -> Option<Answer> {
    let snap = v.snapshot(features);
    let view = snap.view(system);
    Some(match d.request.as_ref()? {
        Request::Pick(r) => {
            let mut task = Task::new(1, 0);
            match convert::pick_request(r, &snap, &mut task) {
                Ok(preq) => {
                    let p = select_task_rq(view, &task, &preq);
                    let a = convert::pick_response(&p, &snap, 0.0);
                    Answer::Pick {
                        cpu: a.cpu,
                        path: a.path.to_string(),
                        scanned: a.scanned,
                        affine: a.affine.to_string(),
                        nr_idle_scan: a.nr_idle_scan,
                    }
                }
                Err(e) => Answer::Refused(e.to_string()),
            }
        }
        Request::Migrate(r) => match convert::migrate_request(r, &snap) {
            Ok((task, env)) => {
                let m = convert::migrate_response(&can_migrate_task(view, &task, &env), &snap);
                Answer::Migrate {
                    allowed: m.allowed,
                    new_dst_cpu: m.new_dst_cpu,
                    flags: m.flags,
                    reason: m.reason,
                    task_hot: m.task_hot,
                }
            }
            Err(e) => Answer::Refused(e.to_string()),
        },
        Request::Allocate(r) => allocate(d, r, &snap, system),
        Request::Balance(_) => return None,
    })
}

fn allocate(
    d: &pb::RecordDecision,
    r: &pb::AllocateCpusRequest,
    snap: &crate::store::Snapshot,
    system: &System,
) -> Answer {
    let task = match convert::task(r.task.as_ref(), &snap.topo, false, 0) {
        Ok(t) => t,
        Err(e) => return Answer::Refused(e.to_string()),
    };
    let Some(policy) = Policy::parse(&r.policy) else {
        return Answer::Refused(format!("policy: {:?}", r.policy));
    };
    let Ok(leased) = CpuMask::parse_cpulist(&d.leased, MAX_CPUS) else {
        return Answer::Refused(format!("leased: {:?}", d.leased));
    };
    let req = alloc::Request {
        topo: &snap.topo,
        state: &snap.state,
        features: &snap.features,
        system,
        task: &task,
        count: r.count as usize,
        policy,
        leased: &leased,
    };
    match alloc::allocate(&req) {
        Ok(g) => Answer::Allocate {
            cpus: g.mask().to_string(),
            scanned: g.scanned,
        },
        Err(e) => Answer::Refused(e.message),
    }
}
