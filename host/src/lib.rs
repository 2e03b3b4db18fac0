//! fairplace-host: this machine as `/sys` and `/proc` show it (topology,
//! per-CPU and per-task signals, PELT), and CPU sets applied to its
//! processes and cgroups (the apply roots, the cgroup tree as mounted).
//!
//! Two programs need it: the agent (`fairplace-agent`: its readings, its
//! leases) and `fairplace run` in the CLI (`fairplace-cli`: its local
//! fallback, its command's affinity or cgroup). It is a crate of its own,
//! kept here once, so that the client library orchestrators link carries
//! none of it: no libc, nothing that reads or writes this machine.
//!
//! Feature `testing`: helpers for tests that pin real processes
//! (`apply::testing`), for the agent's tests.

pub mod apply;
mod apply_error;
pub mod cgroupfs;
pub mod pelt;
pub mod procfs;
pub mod sysfs;
pub mod tasks;
#[cfg(test)]
mod temp_tree;

pub use apply_error::ApplyError;

/// A signal source's name, as the agent logs it and the CLI shows it.
pub fn signal_source_name(source: i32) -> &'static str {
    use fairplace_proto::v1 as pb;
    match pb::SignalSource::try_from(source) {
        Ok(pb::SignalSource::Procfs) => "procfs",
        Ok(pb::SignalSource::SchedDebug) => "sched_debug",
        Ok(pb::SignalSource::Bpf) => "bpf",
        Ok(pb::SignalSource::Simulated) => "simulated",
        Ok(pb::SignalSource::Unspecified) | Err(_) => "unspecified",
    }
}
