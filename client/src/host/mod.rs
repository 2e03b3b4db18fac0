//! This machine as `/sys` and `/proc` show it, and CPU sets applied to its
//! processes and cgroups: what `fairplace run` (its local fallback, its
//! command's affinity or cgroup) and the agent (its readings, its leases)
//! both need, kept here once.

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
