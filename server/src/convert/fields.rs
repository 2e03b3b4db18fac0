//! The checks and mappings every kind of message shares: CPU ids and
//! cpulists against a topology, signal ranges, the one policy mapping, and
//! the error that names a field.

use fairplace_proto::v1 as pb;
use tonic::Status;

use crate::engine::cpumask::CpuMask;
use crate::engine::state::{MAX_SIGNAL, Policy};
use crate::engine::topology::{FieldError, Topology};

pub fn invalid(e: FieldError) -> Status {
    Status::invalid_argument(e.to_string())
}

pub(super) fn err(field: impl Into<String>, msg: impl Into<String>) -> FieldError {
    FieldError::new(field, msg)
}

/// The one mapping between the wire's scheduling policy and the engine's.
pub(super) fn policy(v: i32, field: &str) -> Result<Policy, FieldError> {
    match pb::Policy::try_from(v) {
        Ok(pb::Policy::Normal) => Ok(Policy::Normal),
        Ok(pb::Policy::Batch) => Ok(Policy::Batch),
        Ok(pb::Policy::Idle) => Ok(Policy::Idle),
        Err(_) => Err(err(field, format!("{v} is not a policy"))),
    }
}

pub(super) fn policy_to_pb(p: Policy) -> pb::Policy {
    match p {
        Policy::Normal => pb::Policy::Normal,
        Policy::Batch => pb::Policy::Batch,
        Policy::Idle => pb::Policy::Idle,
    }
}

pub(super) fn signal(v: i64, field: &str) -> Result<i64, FieldError> {
    if (0..=MAX_SIGNAL).contains(&v) {
        Ok(v)
    } else {
        Err(err(field, format!("{v} is out of range 0..{MAX_SIGNAL}")))
    }
}

pub(super) fn cpu_in(topo: &Topology, cpu: u32, field: &str) -> Result<usize, FieldError> {
    if (cpu as usize) < topo.nr_cpus {
        Ok(cpu as usize)
    } else {
        Err(err(
            field,
            format!("CPU {cpu} is not in the topology ({} CPUs)", topo.nr_cpus),
        ))
    }
}

pub(super) fn cpulist(
    s: &str,
    topo: &Topology,
    field: &str,
) -> Result<Option<CpuMask>, FieldError> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    CpuMask::parse_cpulist(s, topo.nr_cpus)
        .map(Some)
        .map_err(|e| err(field, e))
}
