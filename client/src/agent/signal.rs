//! Which reader supplies a machine's per-CPU signals, chosen once when the
//! agent starts, and how the choice is named on the wire and to people.
//!
//! The order of preference is the order of fidelity: BPF (not built into
//! this agent yet), then the kernel's `sched/debug` (exact values, needs
//! root and debugfs), then `/proc` (everyone can read it, but the counts are
//! reconstructed and the PELT averages re-derived, so it is marked
//! approximate). `auto` takes the best that works here and says in one log
//! line why a better one was passed over; naming a source forces it (and
//! fails if it cannot be read).

use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;

use super::{Machine, Source, exact::Exact, sched_debug};

/// The `--signal-source` choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    Auto,
    SchedDebug,
    Procfs,
}

impl std::str::FromStr for Choice {
    type Err = String;

    fn from_str(s: &str) -> Result<Choice, String> {
        match s {
            "auto" => Ok(Choice::Auto),
            "sched-debug" => Ok(Choice::SchedDebug),
            "procfs" => Ok(Choice::Procfs),
            _ => Err(format!(
                "{s:?}: expected auto, sched-debug or procfs (bpf is not built into this agent)"
            )),
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
/// unpaced). `auto` falls back to procfs with one log line saying why.
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
    match pb::SignalSource::try_from(source) {
        Ok(pb::SignalSource::Procfs) => "procfs",
        Ok(pb::SignalSource::SchedDebug) => "sched_debug",
        Ok(pb::SignalSource::Bpf) => "bpf",
        Ok(pb::SignalSource::Simulated) => "simulated",
        Ok(pb::SignalSource::Unspecified) | Err(_) => "unspecified",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_and_bpf_is_refused_with_a_reason() {
        assert_eq!("auto".parse::<Choice>(), Ok(Choice::Auto));
        assert_eq!("sched-debug".parse::<Choice>(), Ok(Choice::SchedDebug));
        assert_eq!("procfs".parse::<Choice>(), Ok(Choice::Procfs));
        assert!("bpf".parse::<Choice>().unwrap_err().contains("not built"));
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
        assert_eq!(s.signal_source(), pb::SignalSource::Procfs);
        assert!(open(Choice::SchedDebug, &paths, 0, 0.0).is_err());
    }

    #[test]
    fn auto_takes_sched_debug_where_it_is_readable() {
        let paths = Paths::default();
        if std::fs::File::open(&paths.sched_debug).is_err() {
            eprintln!("skipped: sched/debug is not readable here");
            return;
        }
        let s = open(Choice::Auto, &paths, 0, 0.0).unwrap();
        assert_eq!(s.signal_source(), pb::SignalSource::SchedDebug);
        assert_eq!(name(s.signal_source() as i32), "sched_debug");
    }
}
