//! Which reader supplies a machine's per-CPU signals, chosen once when the
//! agent starts, and how the choice is named on the wire and to people.
//!
//! The order of preference is the order of fidelity and cost: BPF (the
//! kernel's values read by a small program, cheapest; needs CAP_BPF and
//! CAP_PERFMON, and the agent built with the `bpf` feature), then the
//! kernel's `sched/debug` (exact values, needs root and debugfs), then
//! `/proc` (everyone can read it, but the counts are reconstructed and the
//! PELT averages re-derived, so it is marked approximate). `auto` takes the
//! best that works here and says in one log line per source passed over
//! why; naming a source forces it (and fails if it cannot be read, or, for
//! bpf, if it is not built in).

use std::path::{Path, PathBuf};

use super::{Machine, Source, exact::Exact, sched_debug};

/// The `--signal-source` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Auto,
    Bpf,
    SchedDebug,
    Procfs,
}

impl std::str::FromStr for Choice {
    type Err = String;

    fn from_str(s: &str) -> Result<Choice, String> {
        match s {
            "auto" => Ok(Choice::Auto),
            "bpf" if cfg!(feature = "bpf") => Ok(Choice::Bpf),
            "bpf" => Err(
                "bpf: this agent was built without the BPF source (build fairplace-agent with \
                 --features bpf, which needs clang and libelf-dev)"
                    .into(),
            ),
            "sched-debug" => Ok(Choice::SchedDebug),
            "procfs" => Ok(Choice::Procfs),
            _ => Err(format!("{s:?}: expected auto, bpf, sched-debug or procfs")),
        }
    }
}

/// Where the reader looks; paths differ only in tests.
#[derive(Debug, Clone)]
pub struct Paths {
    pub sys: PathBuf,
    pub proc: PathBuf,
    pub sched_debug: PathBuf,
}

impl Default for Paths {
    fn default() -> Paths {
        Paths {
            sys: PathBuf::from("/sys/devices/system"),
            proc: PathBuf::from("/proc"),
            sched_debug: PathBuf::from(sched_debug::SCHED_DEBUG),
        }
    }
}

/// The machine's reader for `choice`, with up to `task_cap` runnable tasks
/// per CPU, sched/debug reads paced to `read_budget_pct` % of one core (0:
/// unpaced). `auto` falls back from bpf to sched/debug to procfs with one
/// log line per fallback saying why.
pub fn open(
    choice: Choice,
    paths: &Paths,
    task_cap: usize,
    read_budget_pct: f64,
) -> std::io::Result<Box<dyn Source>> {
    let machine = Machine::new(paths.sys.clone(), paths.proc.clone())?.with_task_cap(task_cap);
    if choice == Choice::Procfs {
        return Ok(Box::new(machine));
    }
    let machine = match open_bpf(choice, machine)? {
        Ok(source) => return Ok(source),
        Err(machine) => machine,
    };
    match try_sched_debug(&paths.sched_debug) {
        Ok(reader) => Ok(Box::new(
            Exact::new(machine, reader).with_budget(read_budget_pct),
        )),
        Err(why) if choice == Choice::Auto => {
            tracing::warn!(
                reason = %why,
                "sched/debug is not readable: signals come from /proc and are approximate"
            );
            Ok(Box::new(machine))
        }
        Err(why) => Err(std::io::Error::other(why)),
    }
}

/// The BPF source where `choice` asks for it (bpf, auto) and it loads; the
/// machine back otherwise (auto, with one log line saying why), or an
/// error (bpf).
#[cfg(feature = "bpf")]
fn open_bpf(choice: Choice, machine: Machine) -> std::io::Result<Result<Box<dyn Source>, Machine>> {
    if !matches!(choice, Choice::Bpf | Choice::Auto) {
        return Ok(Err(machine));
    }
    match super::bpf::Program::load(machine.nr_cpus()) {
        Ok(p) => Ok(Ok(Box::new(super::bpf::Bpf::new(machine, p)))),
        Err(why) if choice == Choice::Auto => {
            tracing::warn!(reason = %why, "the BPF source does not load: trying sched/debug");
            Ok(Err(machine))
        }
        Err(why) => Err(std::io::Error::other(format!("bpf: {why}"))),
    }
}

/// Without the `bpf` feature there is no BPF source: `auto` says so once.
#[cfg(not(feature = "bpf"))]
fn open_bpf(choice: Choice, machine: Machine) -> std::io::Result<Result<Box<dyn Source>, Machine>> {
    if choice == Choice::Auto {
        tracing::info!(
            "the BPF source is not built into this agent (feature bpf): trying sched/debug"
        );
    }
    Ok(Err(machine))
}

/// Opens and parses the file once, mounting debugfs read-only first if
/// that is what is missing (root only).
fn try_sched_debug(path: &Path) -> Result<sched_debug::Reader, String> {
    sched_debug::ensure_mounted(path)?;
    let mut r = sched_debug::Reader::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let text = r.read().map_err(|e| format!("{}: {e}", path.display()))?;
    let cpus = sched_debug::parse(text).map_err(|e| e.to_string())?;
    if cpus.iter().all(|c| c.cfs.is_none()) {
        return Err(format!("{}: no root cfs_rq block", path.display()));
    }
    Ok(r)
}

/// A source as `fairplace nodes` prints it and metrics label it.
pub fn name(source: i32) -> &'static str {
    fairplace_host::signal_source_name(source)
}

#[cfg(test)]
mod tests {
    use super::*;
    use fairplace_proto::v1 as pb;

    #[test]
    fn choices_parse_and_bpf_needs_the_feature() {
        assert_eq!("auto".parse::<Choice>(), Ok(Choice::Auto));
        assert_eq!("sched-debug".parse::<Choice>(), Ok(Choice::SchedDebug));
        assert_eq!("procfs".parse::<Choice>(), Ok(Choice::Procfs));
        if cfg!(feature = "bpf") {
            assert_eq!("bpf".parse::<Choice>(), Ok(Choice::Bpf));
        } else {
            assert!(
                "bpf"
                    .parse::<Choice>()
                    .unwrap_err()
                    .contains("without the BPF source")
            );
        }
        assert!("ebpf".parse::<Choice>().is_err());
    }

    #[test]
    fn auto_falls_back_to_procfs_when_the_file_is_missing() {
        let paths = Paths {
            sched_debug: PathBuf::from("/nonexistent/sched/debug"),
            ..Paths::default()
        };
        let Ok(s) = open(Choice::Auto, &paths, 0, 0.0) else {
            return; // no sysfs topology here
        };
        // Where the BPF source is built and loads, auto never gets to it.
        if s.signal_source() != pb::SignalSource::Bpf {
            assert_eq!(s.signal_source(), pb::SignalSource::Procfs);
        }
        assert!(open(Choice::SchedDebug, &paths, 0, 0.0).is_err());
    }

    #[test]
    fn auto_takes_sched_debug_where_it_is_readable() {
        let paths = Paths::default();
        if std::fs::File::open(&paths.sched_debug).is_err() {
            eprintln!("skipped: sched/debug is not readable here");
            return;
        }
        let s = open(Choice::SchedDebug, &paths, 0, 0.0).unwrap();
        assert_eq!(s.signal_source(), pb::SignalSource::SchedDebug);
        assert_eq!(name(s.signal_source() as i32), "sched_debug");
        // auto prefers BPF where it is built and loads.
        let s = open(Choice::Auto, &paths, 0, 0.0).unwrap();
        if cfg!(feature = "bpf") && s.signal_source() == pb::SignalSource::Bpf {
            return;
        }
        assert_eq!(s.signal_source(), pb::SignalSource::SchedDebug);
    }
}
