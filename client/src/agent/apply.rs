//! Applying leases on this machine: a process's affinity or a cgroup's
//! cpuset, as the server's grants say, and only where the agent may.
//!
//! The server sends a node's agent every lease of the node as unsolicited
//! Acks on its Report stream (new grants, and all live ones again after
//! the agent registers), with its releases and renewals. The agent keeps
//! them all ([`Applier`], saved in its [`checkpoint`]); a grant naming a
//! target it applies at once and answers with an `ApplyOutcome`, a grant
//! without one it only records. It also watches the targets it applied:
//! when a process exits or a cgroup is removed, it says so (`gone`) and
//! the server releases the lease.
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
//! Whoever may allocate may name any pid or cgroup: the agent applies a
//! lease only inside its apply roots ([`Roots`]), and never to init, a
//! kernel thread or itself; a refusal is `permission_denied` and touches
//! nothing.
//!
//! A pid may be reused after its process exits; a lease names a pid for
//! the life of that process (the pid and its start time), so the agent
//! stops watching it once gone.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;
use pb::agent_message::Body;

use super::checkpoint::{self, HeldLease};
use super::{LeaseSettings, procfs};

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

/// The cgroup directories (under [`CGROUP_ROOT`]) a lease may be applied
/// under when the agent is given none: a `fairplace` cgroup and the
/// kubelet's pod trees, in the v1 cpuset hierarchy, the unified (v2)
/// mount of a hybrid machine, or a pure v2 mount.
pub fn default_roots() -> Vec<PathBuf> {
    let names = ["fairplace", "fairplace.slice", "kubepods", "kubepods.slice"];
    ["", "cpuset", "unified"]
        .iter()
        .flat_map(|m| {
            names
                .iter()
                .map(move |n| Path::new(CGROUP_ROOT).join(m).join(n))
        })
        .collect()
}

/// The cgroup directories under which the agent may apply leases. A lease
/// names any pid or cgroup; the server checks who asks, but only the node
/// knows what a pid is. The roots keep a lease to what the node's operator
/// handed to fairplace: never a system service, another tenant outside
/// the pod trees, init, a kernel thread or the agent itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    dirs: Vec<PathBuf>,
}

impl Default for Roots {
    fn default() -> Roots {
        Roots {
            dirs: default_roots(),
        }
    }
}

fn refused(message: String) -> ApplyError {
    ApplyError {
        reason: "permission_denied",
        message,
    }
}

impl Roots {
    /// Roots from the command line: absolute paths under [`CGROUP_ROOT`]
    /// without `..` (a root such as `/` would permit everything).
    pub fn new(dirs: Vec<PathBuf>) -> Result<Roots, String> {
        for d in &dirs {
            let bad = !d.is_absolute()
                || !d.starts_with(CGROUP_ROOT)
                || d.components().any(|c| c == std::path::Component::ParentDir);
            if bad {
                return Err(format!(
                    "apply cgroup root {}: not an absolute path under {CGROUP_ROOT} without '..'",
                    d.display()
                ));
            }
        }
        Ok(Roots { dirs })
    }

    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The roots that exist now, canonical. Resolved at every check, not
    /// once: a root made after the agent started (`kubepods` when the
    /// kubelet starts later) counts from then on; one missing matches
    /// nothing.
    fn existing(&self) -> Vec<PathBuf> {
        self.dirs
            .iter()
            .filter_map(|d| d.canonicalize().ok())
            .collect()
    }

    fn contains(&self, dir: &Path) -> bool {
        let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
        self.existing().iter().any(|r| dir.starts_with(r))
    }

    /// The roots, for a refusal's message.
    fn describe(&self) -> String {
        let list = |v: &[PathBuf]| {
            v.iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        match self.existing() {
            e if e.is_empty() => format!("the apply roots (none exists of {})", list(&self.dirs)),
            e => format!("the apply roots ({})", list(&e)),
        }
    }

    /// Whether a lease may be applied to `target`: `Ok`, or the error
    /// (`permission_denied` when refused) saying why. Nothing is written.
    pub fn permits(&self, target: &Target) -> Result<(), ApplyError> {
        match target {
            Target::Cgroup(path) => {
                let dir = resolve_cgroup(path)?;
                if self.contains(&dir) {
                    return Ok(());
                }
                Err(refused(format!(
                    "cgroup {path:?}: {} is outside {}",
                    dir.display(),
                    self.describe()
                )))
            }
            Target::Pid(pid) => self.permits_pid(*pid),
        }
    }

    fn permits_pid(&self, pid: u32) -> Result<(), ApplyError> {
        if pid == 1 {
            return Err(refused("pid 1: init is never pinned".into()));
        }
        let what = format!("pid {pid}");
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_err(|e| error_of(&e, &what))?;
        let flags = procfs::parse_task_stat(&stat).map_or(0, |t| t.flags);
        if flags & procfs::PF_KTHREAD != 0 {
            return Err(refused(format!("{what}: a kernel thread")));
        }
        if tgid(pid)? == std::process::id() {
            return Err(refused(format!("{what}: the agent's own process")));
        }
        let dirs = process_cgroups(pid)?;
        if dirs.iter().any(|d| self.contains(d)) {
            return Ok(());
        }
        let shown: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
        Err(refused(match shown.as_slice() {
            [] => format!("{what}: /proc/{pid}/cgroup names no cpuset or unified cgroup"),
            [one] => format!("{what}: its cgroup {one} is outside {}", self.describe()),
            all => format!(
                "{what}: its cgroups {} are outside {}",
                all.join(" and "),
                self.describe()
            ),
        }))
    }
}

/// The thread group (process) `pid` belongs to: a thread id of the agent
/// is the agent too.
fn tgid(pid: u32) -> Result<u32, ApplyError> {
    let what = format!("pid {pid}");
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| error_of(&e, &what))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| ApplyError {
            reason: "failed",
            message: format!("{what}: no Tgid in /proc/{pid}/status"),
        })
}

/// Where the unified (v2) hierarchy is mounted: [`CGROUP_ROOT`] itself on
/// a pure v2 machine, its `unified` directory on a hybrid one.
fn unified_mount() -> Option<PathBuf> {
    let root = Path::new(CGROUP_ROOT);
    [root.to_path_buf(), root.join("unified")]
        .into_iter()
        .find(|m| m.join("cgroup.controllers").is_file())
}

/// The directories of `pid`'s cgroups that can hold a cpuset: its v1
/// cpuset cgroup and its unified one, from `/proc/PID/cgroup`.
fn process_cgroups(pid: u32) -> Result<Vec<PathBuf>, ApplyError> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| error_of(&e, &format!("pid {pid}")))?;
    Ok(cgroup_dirs(&text, unified_mount().as_deref()))
}

/// `/proc/PID/cgroup` lines (`ID:controllers:/path`) as directories: the
/// v1 cpuset line under the cpuset mount, the v2 line (`0::/path`) under
/// `unified` when there is one.
fn cgroup_dirs(text: &str, unified: Option<&Path>) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "cpuset") {
            out.push(Path::new(CGROUP_ROOT).join("cpuset").join(rel));
        } else if id == "0"
            && controllers.is_empty()
            && let Some(m) = unified
        {
            out.push(m.join(rel));
        }
    }
    out
}

/// A process's start time (clock ticks after boot, field 22 of its stat):
/// with the pid, it names one process (a pid is reused, this pair is not).
pub fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest's first field is field 3.
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// Applies `cpulist` to `target`, if `roots` permit it (nothing is
/// touched otherwise).
pub fn apply(roots: &Roots, target: &Target, cpulist: &str) -> Result<(), ApplyError> {
    let cpus = parse_cpulist(cpulist)?;
    roots.permits(target)?;
    match target {
        Target::Pid(pid) => set_process_affinity(*pid, &cpus).map(|_| ()),
        Target::Cgroup(path) => set_cgroup_cpus(path, cpulist).map(|_| ()),
    }
}

/// Whether an Ack is the server's push (grants, releases, renewals), not
/// the answer to an update.
pub fn is_push(a: &pb::Ack) -> bool {
    !a.grants.is_empty() || !a.released.is_empty() || !a.renewed.is_empty()
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

fn gone(id: u64, t: &Target) -> pb::AgentMessage {
    tracing::info!(lease = id, target = ?t, "lease target gone");
    outcome(
        id,
        Err(ApplyError {
            reason: "gone",
            message: format!("{t:?} no longer exists"),
        }),
    )
}

/// The leases of this node, as the server sent them, and the targets the
/// agent watches. It lives as long as the agent's stream (across
/// reconnects: a lease outlives a connection) and, with a state file, the
/// agent itself ([`checkpoint`]).
#[derive(Debug)]
pub struct Applier {
    leases: BTreeMap<u64, HeldLease>,
    /// Leases reported gone this run: the same grant again (a re-push that
    /// crossed the report) is answered gone, not applied to whatever
    /// process has the pid now.
    gone: BTreeSet<u64>,
    roots: Roots,
    state_file: Option<PathBuf>,
    node_id: String,
    /// The count last added to the `leases_held` gauge (several streams
    /// of one process add theirs).
    published: usize,
}

impl Applier {
    /// The applier of `node_id`, with the leases of its checkpoint.
    pub fn new(node_id: &str, settings: &LeaseSettings) -> Applier {
        let leases = settings
            .state_file
            .as_deref()
            .map(|p| checkpoint::load(p, node_id, checkpoint::now_unix_ms()))
            .unwrap_or_default();
        let mut a = Applier {
            leases: leases.into_iter().map(|l| (l.id, l)).collect(),
            gone: BTreeSet::new(),
            roots: settings.roots.clone(),
            state_file: settings.state_file.clone(),
            node_id: node_id.to_string(),
            published: 0,
        };
        a.publish();
        a
    }

    /// An applier without a state file.
    pub fn in_memory(node_id: &str, roots: Roots) -> Applier {
        Applier::new(
            node_id,
            &LeaseSettings {
                state_file: None,
                roots,
            },
        )
    }

    /// The held leases as the registration reports them.
    pub fn held_grants(&self) -> Vec<pb::LeaseGrant> {
        self.leases.values().map(HeldLease::to_grant).collect()
    }

    pub fn get(&self, lease_id: u64) -> Option<&HeldLease> {
        self.leases.get(&lease_id)
    }

    /// Forgets the push's releases, takes its renewals, records its
    /// grants and applies those with a target; returns the outcomes to
    /// send (one per grant with a target). Saves the checkpoint once.
    pub fn on_push(&mut self, a: &pb::Ack) -> Vec<pb::AgentMessage> {
        let mut changed = false;
        for id in &a.released {
            changed |= self.leases.remove(id).is_some();
            self.gone.remove(id);
        }
        for r in &a.renewed {
            if let Some(l) = self.leases.get_mut(&r.lease_id) {
                l.ttl_ms = r.ttl_ms;
                l.expires_at_unix_ms = r.expires_at_unix_ms;
                changed = true;
            }
        }
        let mut out = Vec::new();
        for g in &a.grants {
            out.extend(self.on_grant(g));
            changed = true;
        }
        if changed {
            self.save();
        }
        out
    }

    /// One grant: recorded; applied and answered when it names a target.
    /// A grant that fails to apply is not kept (the server releases it).
    fn on_grant(&mut self, g: &pb::LeaseGrant) -> Option<pb::AgentMessage> {
        let Some(pt) = &g.target else {
            self.leases
                .insert(g.lease_id, HeldLease::from_grant(g, None));
            return None;
        };
        let Some(t) = Target::from_pb(pt) else {
            self.leases.remove(&g.lease_id);
            return Some(outcome(
                g.lease_id,
                Err(ApplyError {
                    reason: "invalid",
                    message: "target: names neither a pid nor a cgroup".into(),
                }),
            ));
        };
        // The same lease again (the re-push after a registration) whose
        // process ended meanwhile, maybe while the agent was down: its pid
        // may be another process's now.
        let was_gone = self.gone.contains(&g.lease_id)
            || self
                .leases
                .get(&g.lease_id)
                .is_some_and(|h| h.applied && h.target.as_ref() == Some(&t) && !alive(h));
        if was_gone {
            self.leases.remove(&g.lease_id);
            self.gone.insert(g.lease_id);
            return Some(gone(g.lease_id, &t));
        }
        let r = apply(&self.roots, &t, &g.cpus);
        match &r {
            Ok(()) => {
                tracing::info!(lease = g.lease_id, cpus = %g.cpus, target = ?t, "lease applied");
                metrics::counter!("fairplace_agent_leases_applied_total", "outcome" => "ok")
                    .increment(1);
                let mut held = HeldLease::from_grant(g, Some(t.clone()));
                held.applied = true;
                if let Target::Pid(p) = t {
                    held.pid_start = process_start(p);
                }
                self.leases.insert(g.lease_id, held);
            }
            Err(e) => {
                tracing::warn!(lease = g.lease_id, cpus = %g.cpus, target = ?t, reason = e.reason, message = %e.message, "lease not applied");
                metrics::counter!("fairplace_agent_leases_applied_total", "outcome" => e.reason)
                    .increment(1);
                self.leases.remove(&g.lease_id);
            }
        }
        Some(outcome(g.lease_id, r))
    }

    /// Applied leases whose target disappeared: each is reported `gone`
    /// (the server releases its lease) and forgotten.
    pub fn check_targets(&mut self) -> Vec<pb::AgentMessage> {
        let ended: Vec<(u64, Target)> = self
            .leases
            .values()
            .filter(|h| h.applied && !alive(h))
            .filter_map(|h| Some((h.id, h.target.clone()?)))
            .collect();
        if ended.is_empty() {
            return Vec::new();
        }
        let out = ended
            .iter()
            .map(|(id, t)| {
                self.leases.remove(id);
                self.gone.insert(*id);
                gone(*id, t)
            })
            .collect();
        self.save();
        out
    }

    /// Writes the checkpoint (when there is a state file); a failure is
    /// logged and counted: the leases stay held in memory.
    fn save(&mut self) {
        self.publish();
        let Some(path) = &self.state_file else {
            return;
        };
        if let Err(e) = checkpoint::save(path, &self.node_id, self.leases.values()) {
            tracing::warn!(node = %self.node_id, file = %path.display(), error = %e, "cannot write the lease checkpoint");
            metrics::counter!("fairplace_agent_checkpoint_errors_total").increment(1);
        }
    }

    fn publish(&mut self) {
        let n = self.leases.len();
        metrics::gauge!("fairplace_agent_leases_held").increment(n as f64 - self.published as f64);
        self.published = n;
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
}

/// Whether a held lease's target is still there: its cgroup, or the very
/// process it was applied to (same pid and start time), on this boot.
fn alive(h: &HeldLease) -> bool {
    match &h.target {
        None => true,
        Some(_) if h.stale => false,
        Some(Target::Pid(p)) => match h.pid_start {
            Some(start) => process_start(*p) == Some(start),
            None => Target::Pid(*p).exists(),
        },
        Some(t) => t.exists(),
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

    /// A `sleep` child, killed and reaped when dropped.
    struct Sleeper(std::process::Child);

    impl Sleeper {
        fn start() -> Sleeper {
            Sleeper(
                std::process::Command::new("sleep")
                    .arg("30")
                    .spawn()
                    .expect("sleep"),
            )
        }

        fn pid(&self) -> u32 {
            self.0.id()
        }

        fn stop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            self.stop();
        }
    }

    /// A real v1 cpuset cgroup under the cpuset mount, with its parent's
    /// CPUs and memory nodes; its tasks go back to the parent and it is
    /// removed when dropped.
    struct Cpuset {
        dir: PathBuf,
    }

    impl Cpuset {
        fn make(name: &str) -> Option<Cpuset> {
            let base = Path::new(CGROUP_ROOT).join("cpuset");
            let dir = base.join(format!("fairplace-test-{}-{name}", std::process::id()));
            let made = (|| {
                std::fs::create_dir(&dir)?;
                for f in ["cpuset.mems", "cpuset.cpus"] {
                    let parent = std::fs::read_to_string(base.join(f))?;
                    std::fs::write(dir.join(f), parent.trim())?;
                }
                io::Result::Ok(())
            })();
            let c = Cpuset { dir };
            match made {
                Ok(()) => Some(c),
                Err(e) => {
                    println!("skipped: cannot make a v1 cpuset {}: {e}", c.dir.display());
                    None
                }
            }
        }

        fn cpus(&self) -> String {
            std::fs::read_to_string(self.dir.join("cpuset.cpus"))
                .unwrap()
                .trim()
                .to_string()
        }

        fn join(&self, pid: u32) {
            std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).unwrap();
        }
    }

    impl Drop for Cpuset {
        fn drop(&mut self) {
            let parent = self.dir.parent().unwrap().join("tasks");
            let tasks = std::fs::read_to_string(self.dir.join("tasks")).unwrap_or_default();
            for t in tasks.lines() {
                let _ = std::fs::write(&parent, t);
            }
            let _ = std::fs::remove_dir(&self.dir);
        }
    }

    /// Roots that permit the test's own cgroups (and so its children's).
    fn own_roots() -> Roots {
        let text = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        Roots::new(cgroup_dirs(&text, unified_mount().as_deref())).unwrap()
    }

    fn refusal(r: Result<(), ApplyError>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.reason, "permission_denied", "{e:?}");
        e.message
    }

    #[test]
    fn a_real_process_is_pinned_on_every_thread() {
        let child = Sleeper::start();
        let r = apply(&own_roots(), &Target::Pid(child.pid()), "0");
        r.unwrap();
        assert_eq!(allowed(child.pid()), "0");
    }

    #[test]
    fn a_missing_process_or_cgroup_is_not_found_and_bad_paths_are_refused() {
        let roots = Roots::default();
        let e = apply(&roots, &Target::Pid(u32::MAX - 1), "0").unwrap_err();
        assert_eq!(e.reason, "not_found", "{e:?}");
        let e = apply(
            &roots,
            &Target::Cgroup("no-such-fairplace-test".into()),
            "0",
        )
        .unwrap_err();
        assert_eq!(e.reason, "not_found", "{e:?}");
        let e = apply(&roots, &Target::Cgroup("a/../../etc".into()), "0").unwrap_err();
        assert_eq!(e.reason, "invalid", "{e:?}");
        let e = apply(&roots, &Target::Pid(1), "").unwrap_err();
        assert_eq!(e.reason, "invalid", "{e:?}");
        for bad in ["fairplace", "/etc", "/sys/fs/cgroup/../../etc"] {
            assert!(Roots::new(vec![bad.into()]).is_err(), "{bad}");
        }
    }

    #[test]
    fn init_kernel_threads_and_the_agent_itself_are_always_refused() {
        // Roots that hold every cgroup: these are refused anyway.
        let all = Roots::new(vec![CGROUP_ROOT.into()]).unwrap();
        let before = allowed(1);
        let m = refusal(apply(&all, &Target::Pid(1), "0"));
        assert_eq!(m, "pid 1: init is never pinned");
        assert_eq!(allowed(1), before);
        let m = refusal(apply(&all, &Target::Pid(2), "0"));
        assert_eq!(m, "pid 2: a kernel thread");
        let me = std::process::id();
        let m = refusal(apply(&all, &Target::Pid(me), "0"));
        assert_eq!(m, format!("pid {me}: the agent's own process"));
        // A thread of the agent is the agent too.
        // SAFETY: gettid has no arguments and cannot fail.
        let tid = std::thread::spawn(|| unsafe { libc::gettid() } as u32)
            .join()
            .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // SAFETY: as above.
            tx.send(unsafe { libc::gettid() } as u32).unwrap();
            let _ = stop_rx.recv();
        });
        let live = rx.recv().unwrap();
        let m = refusal(all.permits(&Target::Pid(live)));
        assert!(m.ends_with("the agent's own process"), "{m} ({tid})");
        stop_tx.send(()).unwrap();
        t.join().unwrap();
    }

    #[test]
    fn a_process_outside_the_roots_is_refused_and_left_alone_inside_it_is_pinned() {
        let Some(cg) = Cpuset::make("proc") else {
            return;
        };
        let roots = Roots::new(vec![cg.dir.clone()]).unwrap();
        let child = Sleeper::start();
        let pid = child.pid();
        let before = allowed(pid);
        let m = refusal(apply(&roots, &Target::Pid(pid), "0"));
        println!("{m}");
        assert!(m.starts_with(&format!("pid {pid}: its cgroup")), "{m}");
        assert!(m.contains("/sys/fs/cgroup/cpuset/"), "{m}");
        let listed = format!("outside the apply roots ({})", cg.dir.display());
        assert!(m.ends_with(&listed), "{m}");
        assert_eq!(allowed(pid), before, "a refused target is not touched");
        cg.join(pid);
        apply(&roots, &Target::Pid(pid), "0").unwrap();
        assert_eq!(allowed(pid), "0");
    }

    #[test]
    fn a_cgroup_outside_the_roots_is_refused_and_its_cpus_unchanged() {
        let (Some(target), Some(other)) = (Cpuset::make("target"), Cpuset::make("root")) else {
            return;
        };
        let before = target.cpus();
        let name = target
            .dir
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .to_string();
        let roots = Roots::new(vec![other.dir.clone()]).unwrap();
        let m = refusal(apply(&roots, &Target::Cgroup(name.clone()), "0"));
        assert!(m.starts_with(&format!("cgroup {name:?}: ")), "{m}");
        assert!(m.contains("is outside the apply roots"), "{m}");
        assert_eq!(target.cpus(), before, "a refused cgroup is not written");
        // The same cgroup under a root is written.
        let roots = Roots::new(vec![target.dir.clone()]).unwrap();
        apply(&roots, &Target::Cgroup(name), "0").unwrap();
        assert_eq!(target.cpus(), "0");
    }

    #[test]
    fn proc_cgroup_lines_map_to_the_cpuset_and_unified_mounts() {
        let hybrid = "9:name=systemd:/x\n3:cpu,cpuset:/kubepods/pod1\n0::/kubepods/pod1\n";
        let unified = Path::new("/sys/fs/cgroup/unified");
        assert_eq!(
            cgroup_dirs(hybrid, Some(unified)),
            vec![
                PathBuf::from("/sys/fs/cgroup/cpuset/kubepods/pod1"),
                PathBuf::from("/sys/fs/cgroup/unified/kubepods/pod1"),
            ]
        );
        let v2 = "0::/fairplace.slice/job.scope\n";
        assert_eq!(
            cgroup_dirs(v2, Some(Path::new(CGROUP_ROOT))),
            vec![PathBuf::from("/sys/fs/cgroup/fairplace.slice/job.scope")]
        );
        assert!(cgroup_dirs(v2, None).is_empty());
    }

    fn grant(id: u64, target: Option<pb::apply_target::Target>) -> pb::LeaseGrant {
        pb::LeaseGrant {
            lease_id: id,
            cpus: "0".into(),
            target: target.map(|t| pb::ApplyTarget { target: Some(t) }),
            policy: "spread".into(),
            holder: "test".into(),
            owner: "anonymous".into(),
            ttl_ms: 30_000,
            expires_at_unix_ms: checkpoint::now_unix_ms() + 30_000,
            granted_at_unix_ms: checkpoint::now_unix_ms(),
        }
    }

    fn outcomes(out: &[pb::AgentMessage]) -> Vec<(u64, bool, String)> {
        out.iter()
            .map(|m| match &m.body {
                Some(Body::Applied(o)) => (o.lease_id, o.ok, o.reason.clone()),
                _ => panic!("{m:?}"),
            })
            .collect()
    }

    #[test]
    fn the_applier_answers_each_targeted_grant_records_the_others_and_reports_a_target_gone() {
        let mut child = Sleeper::start();
        let pid = child.pid();
        let mut a = Applier::in_memory("n", own_roots());
        let push = pb::Ack {
            grants: vec![
                grant(7, Some(pb::apply_target::Target::Pid(pid))),
                grant(8, None),
                grant(9, Some(pb::apply_target::Target::Pid(u32::MAX - 1))),
            ],
            ..Default::default()
        };
        assert!(is_push(&push));
        let out = a.on_push(&push);
        // No outcome for the targetless grant; the failed one is not kept.
        assert_eq!(
            outcomes(&out),
            vec![(7, true, String::new()), (9, false, "not_found".into())]
        );
        assert_eq!((a.len(), a.get(8).map(|l| l.applied)), (2, Some(false)));
        assert!(a.check_targets().is_empty());
        child.stop();
        let gone = a.check_targets();
        assert_eq!(outcomes(&gone), vec![(7, false, "gone".into())]);
        assert_eq!(a.len(), 1, "the targetless lease stays");
        // The same grant again (a re-push crossing the report) is gone too.
        let again = a.on_push(&pb::Ack {
            grants: vec![grant(7, Some(pb::apply_target::Target::Pid(pid)))],
            ..Default::default()
        });
        assert_eq!(outcomes(&again), vec![(7, false, "gone".into())]);
    }

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("fairplace-applier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn releases_and_renewals_reach_the_checkpoint_and_a_new_agent_reloads_it() {
        let dir = scratch("ckpt");
        let settings = LeaseSettings {
            state_file: Some(checkpoint::state_file(&dir, "n")),
            roots: own_roots(),
        };
        let mut a = Applier::new("n", &settings);
        assert!(a.is_empty());
        a.on_push(&pb::Ack {
            grants: vec![grant(1, None), grant(2, None)],
            ..Default::default()
        });
        let later = checkpoint::now_unix_ms() + 90_000;
        let out = a.on_push(&pb::Ack {
            released: vec![2],
            renewed: vec![pb::LeaseRenewal {
                lease_id: 1,
                ttl_ms: 90_000,
                expires_at_unix_ms: later,
            }],
            ..Default::default()
        });
        assert!(out.is_empty());
        // A restarted agent: the checkpoint holds lease 1, renewed.
        let b = Applier::new("n", &settings);
        let held = b.held_grants();
        assert_eq!(held.len(), 1);
        assert_eq!(
            (held[0].lease_id, held[0].ttl_ms, held[0].expires_at_unix_ms),
            (1, 90_000, later)
        );
        assert_eq!(held[0].owner, "anonymous");
        assert!(held[0].target.is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_checkpointed_pid_now_another_process_is_gone_not_applied() {
        let dir = scratch("reuse");
        let child = Sleeper::start();
        let pid = child.pid();
        let before = allowed(pid);
        // As if the lease's process had ended while the agent was down and
        // the pid been given to this sleep: another start time.
        let mut held = HeldLease::from_grant(&grant(5, None), Some(Target::Pid(pid)));
        held.applied = true;
        held.pid_start = process_start(pid).map(|s| s + 1);
        let file = checkpoint::state_file(&dir, "n");
        checkpoint::save(&file, "n", [&held].into_iter()).unwrap();
        let settings = LeaseSettings {
            state_file: Some(file),
            roots: own_roots(),
        };
        let mut a = Applier::new("n", &settings);
        assert_eq!(a.held_grants().len(), 1, "reported at registration");
        let out = a.on_push(&pb::Ack {
            grants: vec![grant(5, Some(pb::apply_target::Target::Pid(pid)))],
            ..Default::default()
        });
        assert_eq!(outcomes(&out), vec![(5, false, "gone".into())]);
        assert_eq!(allowed(pid), before);
        assert!(a.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
