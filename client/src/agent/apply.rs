//! Applying leases on this machine: a process's affinity or a cgroup's
//! cpuset, as the server's grants say.
//!
//! The server sends a node's agent the leases to apply as unsolicited Acks
//! on its Report stream (new grants, and all live ones again after the
//! agent registers); the agent applies each at once and answers with an
//! `ApplyOutcome`. It also watches the targets it applied: when a process
//! exits or a cgroup is removed, it says so (`gone`) and the server
//! releases the lease.
//!
//! - A process: `sched_setaffinity()` on every thread listed in
//!   `/proc/PID/task`, passes repeated until one finds no new thread (a
//!   thread created meanwhile inherits its creator's mask, already set or
//!   set by the next pass).
//! - A cgroup: its `cpuset.cpus` (cgroup v2, or the v1 cpuset controller);
//!   a v1 cpuset with empty `cpuset.mems` gets its parent's, since the
//!   kernel refuses tasks in a v1 cpuset without memory nodes. A path is
//!   taken under `/sys/fs/cgroup` (the v1 `cpuset` mount, the unified v2
//!   mount or the root), never outside it.
//!
//! A pid may be reused after its process exits; a lease names a pid for
//! the life of that process, so the agent stops watching it once gone.

use std::collections::HashMap;
use std::io;
use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;
use pb::agent_message::Body;

/// Where cgroup hierarchies are mounted.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// A lease's target on this machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Pid(u32),
    Cgroup(String),
}

impl Target {
    pub fn from_pb(t: &pb::ApplyTarget) -> Option<Target> {
        match t.target.as_ref()? {
            pb::apply_target::Target::Pid(p) => Some(Target::Pid(*p)),
            pb::apply_target::Target::Cgroup(c) => Some(Target::Cgroup(c.clone())),
        }
    }

    /// Whether the target still exists.
    pub fn exists(&self) -> bool {
        match self {
            Target::Pid(p) => Path::new(&format!("/proc/{p}")).exists(),
            Target::Cgroup(c) => resolve_cgroup(c).is_ok(),
        }
    }
}

/// Why applying failed, as the protocol names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyError {
    pub reason: &'static str,
    pub message: String,
}

fn error_of(e: &io::Error, what: &str) -> ApplyError {
    let reason = match e.raw_os_error() {
        Some(libc::ESRCH) | Some(libc::ENOENT) => "not_found",
        Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => "permission_denied",
        Some(libc::EINVAL) => "invalid",
        _ => "failed",
    };
    ApplyError {
        reason,
        message: format!("{what}: {e}"),
    }
}

/// A cpulist as the kernel's CPU set type.
pub fn cpu_set(cpus: &[usize]) -> Result<libc::cpu_set_t, ApplyError> {
    // SAFETY: cpu_set_t is plain data; all zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    for &c in cpus {
        if c >= max {
            return Err(ApplyError {
                reason: "invalid",
                message: format!("CPU {c} is beyond the {max} a CPU set holds"),
            });
        }
        // SAFETY: `c` is below the set's size, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    Ok(set)
}

/// Parses a cpulist ("0-3,8") into CPU ids.
pub fn parse_cpulist(s: &str) -> Result<Vec<usize>, ApplyError> {
    use fairplace_types::cpumask::{CpuMask, MAX_CPUS};
    let m = CpuMask::parse_cpulist(s, MAX_CPUS).map_err(|e| ApplyError {
        reason: "invalid",
        message: format!("cpus {s:?}: {e}"),
    })?;
    if m.is_empty() {
        return Err(ApplyError {
            reason: "invalid",
            message: "cpus: empty".into(),
        });
    }
    Ok(m.iter().collect())
}

/// Sets the affinity of every thread of `pid`.
pub fn set_process_affinity(pid: u32, cpus: &[usize]) -> Result<usize, ApplyError> {
    let set = cpu_set(cpus)?;
    let dir = PathBuf::from(format!("/proc/{pid}/task"));
    let mut done: Vec<i32> = Vec::new();
    for _pass in 0..8 {
        let tids: Vec<i32> = std::fs::read_dir(&dir)
            .map_err(|e| error_of(&e, &format!("pid {pid}")))?
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .filter(|t| !done.contains(t))
            .collect();
        if tids.is_empty() {
            break;
        }
        for tid in tids {
            // SAFETY: sched_setaffinity reads `set`, of the size given.
            let rc = unsafe {
                libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set)
            };
            if rc != 0 {
                let e = io::Error::last_os_error();
                // A thread that exited meanwhile is not an error.
                if e.raw_os_error() == Some(libc::ESRCH) && tid != pid as i32 {
                    continue;
                }
                return Err(error_of(&e, &format!("pid {pid} thread {tid}")));
            }
            done.push(tid);
        }
    }
    Ok(done.len())
}

/// The cgroup directory `path` names, under the cgroup mounts: the v1
/// cpuset hierarchy first, then the unified (v2) mounts.
pub fn resolve_cgroup(path: &str) -> Result<PathBuf, ApplyError> {
    if path.split('/').any(|s| s == "..") {
        return Err(ApplyError {
            reason: "invalid",
            message: format!("cgroup {path:?}: '..' is not allowed"),
        });
    }
    let rel = path
        .strip_prefix(CGROUP_ROOT)
        .unwrap_or(path)
        .trim_start_matches('/');
    let direct = Path::new(CGROUP_ROOT).join(rel);
    let candidates = [
        direct.clone(),
        Path::new(CGROUP_ROOT).join("cpuset").join(rel),
        Path::new(CGROUP_ROOT).join("unified").join(rel),
    ];
    for c in candidates {
        if c.join("cpuset.cpus").is_file() {
            let real = c
                .canonicalize()
                .map_err(|e| error_of(&e, &format!("cgroup {path:?}")))?;
            if !real.starts_with(CGROUP_ROOT) {
                return Err(ApplyError {
                    reason: "invalid",
                    message: format!("cgroup {path:?} leads outside {CGROUP_ROOT}"),
                });
            }
            return Ok(real);
        }
    }
    Err(ApplyError {
        reason: "not_found",
        message: format!(
            "cgroup {path:?}: no cpuset cgroup there (looked under {CGROUP_ROOT}, its cpuset and unified mounts)"
        ),
    })
}

/// Writes a cgroup's `cpuset.cpus` (and, for an empty v1 `cpuset.mems`,
/// its parent's memory nodes).
pub fn set_cgroup_cpus(path: &str, cpulist: &str) -> Result<PathBuf, ApplyError> {
    let dir = resolve_cgroup(path)?;
    let mems = dir.join("cpuset.mems");
    let empty = std::fs::read_to_string(&mems).is_ok_and(|s| s.trim().is_empty());
    if empty && let Some(parent) = dir.parent() {
        let theirs = std::fs::read_to_string(parent.join("cpuset.mems")).unwrap_or_default();
        if !theirs.trim().is_empty() {
            std::fs::write(&mems, theirs.trim())
                .map_err(|e| error_of(&e, &format!("{}", mems.display())))?;
        }
    }
    let cpus = dir.join("cpuset.cpus");
    std::fs::write(&cpus, cpulist).map_err(|e| error_of(&e, &format!("{}", cpus.display())))?;
    Ok(dir)
}

/// Applies `cpulist` to `target`.
pub fn apply(target: &Target, cpulist: &str) -> Result<(), ApplyError> {
    let cpus = parse_cpulist(cpulist)?;
    match target {
        Target::Pid(pid) => set_process_affinity(*pid, &cpus).map(|_| ()),
        Target::Cgroup(path) => set_cgroup_cpus(path, cpulist).map(|_| ()),
    }
}

/// Whether an Ack is the server's push (grants, releases), not the answer
/// to an update.
pub fn is_push(a: &pb::Ack) -> bool {
    !a.grants.is_empty() || !a.released.is_empty()
}

fn outcome(lease_id: u64, r: Result<(), ApplyError>) -> pb::AgentMessage {
    let (ok, reason, message) = match r {
        Ok(()) => (true, String::new(), String::new()),
        Err(e) => (false, e.reason.to_string(), e.message),
    };
    pb::AgentMessage {
        body: Some(Body::Applied(pb::ApplyOutcome {
            lease_id,
            ok,
            reason,
            message,
        })),
    }
}

/// The leases this agent applied, by id, and the targets it watches.
#[derive(Debug, Default)]
pub struct Applier {
    applied: HashMap<u64, Target>,
}

impl Applier {
    /// Applies the push's grants and forgets its releases; returns the
    /// outcomes to send.
    pub fn on_push(&mut self, a: &pb::Ack) -> Vec<pb::AgentMessage> {
        for id in &a.released {
            self.applied.remove(id);
        }
        let mut out = Vec::new();
        for g in &a.grants {
            let Some(t) = g.target.as_ref().and_then(Target::from_pb) else {
                out.push(outcome(
                    g.lease_id,
                    Err(ApplyError {
                        reason: "invalid",
                        message: "the grant names no target".into(),
                    }),
                ));
                continue;
            };
            let r = apply(&t, &g.cpus);
            match &r {
                Ok(()) => {
                    tracing::info!(lease = g.lease_id, cpus = %g.cpus, target = ?t, "lease applied");
                    metrics::counter!("fairplace_agent_leases_applied_total", "outcome" => "ok")
                        .increment(1);
                    self.applied.insert(g.lease_id, t);
                }
                Err(e) => {
                    tracing::warn!(lease = g.lease_id, cpus = %g.cpus, target = ?t, reason = e.reason, message = %e.message, "lease not applied");
                    metrics::counter!("fairplace_agent_leases_applied_total", "outcome" => e.reason)
                        .increment(1);
                }
            }
            out.push(outcome(g.lease_id, r));
        }
        out
    }

    /// Targets that disappeared: each is reported `gone` (the server
    /// releases its lease) and no longer watched.
    pub fn check_targets(&mut self) -> Vec<pb::AgentMessage> {
        let gone: Vec<(u64, Target)> = self
            .applied
            .iter()
            .filter(|(_, t)| !t.exists())
            .map(|(id, t)| (*id, t.clone()))
            .collect();
        gone.into_iter()
            .map(|(id, t)| {
                self.applied.remove(&id);
                tracing::info!(lease = id, target = ?t, "lease target gone");
                outcome(
                    id,
                    Err(ApplyError {
                        reason: "gone",
                        message: format!("{t:?} no longer exists"),
                    }),
                )
            })
            .collect()
    }

    pub fn len(&self) -> usize {
        self.applied.len()
    }

    pub fn is_empty(&self) -> bool {
        self.applied.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPUs this process may use, from /proc.
    fn allowed(pid: u32) -> String {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string()
    }

    #[test]
    fn a_real_process_is_pinned_on_every_thread() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        let r = apply(&Target::Pid(pid), "0");
        let seen = allowed(pid);
        let _ = child.kill();
        let _ = child.wait();
        r.unwrap();
        assert_eq!(seen, "0");
    }

    #[test]
    fn a_missing_process_or_cgroup_is_not_found_and_bad_paths_are_refused() {
        let e = apply(&Target::Pid(u32::MAX - 1), "0").unwrap_err();
        assert_eq!(e.reason, "not_found", "{e:?}");
        let e = apply(&Target::Cgroup("no-such-fairplace-test".into()), "0").unwrap_err();
        assert_eq!(e.reason, "not_found", "{e:?}");
        let e = apply(&Target::Cgroup("a/../../etc".into()), "0").unwrap_err();
        assert_eq!(e.reason, "invalid", "{e:?}");
        let e = apply(&Target::Pid(1), "").unwrap_err();
        assert_eq!(e.reason, "invalid", "{e:?}");
    }

    #[test]
    fn the_applier_answers_each_grant_and_reports_a_target_gone() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let pid = child.id();
        let mut a = Applier::default();
        let push = pb::Ack {
            grants: vec![
                pb::LeaseGrant {
                    lease_id: 7,
                    cpus: "0".into(),
                    target: Some(pb::ApplyTarget {
                        target: Some(pb::apply_target::Target::Pid(pid)),
                    }),
                },
                pb::LeaseGrant {
                    lease_id: 8,
                    cpus: "0".into(),
                    target: None,
                },
            ],
            ..Default::default()
        };
        assert!(is_push(&push));
        let out = a.on_push(&push);
        let oks: Vec<(u64, bool)> = out
            .iter()
            .map(|m| match &m.body {
                Some(Body::Applied(o)) => (o.lease_id, o.ok),
                _ => panic!("{m:?}"),
            })
            .collect();
        assert_eq!(oks, vec![(7, true), (8, false)]);
        assert!(a.check_targets().is_empty());
        let _ = child.kill();
        let _ = child.wait();
        let gone = a.check_targets();
        assert_eq!(gone.len(), 1);
        match &gone[0].body {
            Some(Body::Applied(o)) => assert_eq!((o.lease_id, o.reason.as_str()), (7, "gone")),
            other => panic!("{other:?}"),
        }
        assert!(a.is_empty());
    }
}
