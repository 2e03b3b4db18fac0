//! Applying a lease on this machine: a process's affinity or a cgroup's
//! cpuset, and only where the agent may. Which leases to apply, and when,
//! is `leases.rs`'s business; this file is the mechanism.
//!
//! - A process: `sched_setaffinity()` on every thread listed in
//!   `/proc/PID/task`, passes repeated until one finds no new thread (a
//!   thread created meanwhile inherits its creator's mask, already set or
//!   set by the next pass).
//! - A cgroup: its `cpuset.cpus` (cgroup v2, or the v1 cpuset controller);
//!   a v1 cpuset with empty `cpuset.mems` gets its parent's, since the
//!   kernel refuses tasks in a v1 cpuset without memory nodes. A path is
//!   the machine's name for the cgroup, found through [`CgroupFs`] (the
//!   v1 `cpuset` mount, the unified v2 mount or the root), never outside
//!   it.
//!
//! Whoever may allocate may name any pid or cgroup: the agent applies a
//! lease only inside its apply roots ([`Roots`]), and never to init, a
//! kernel thread or itself; a refusal is `permission_denied` and touches
//! nothing.
//!
//! A pid may be reused after its process exits; a lease names a pid for
//! the life of that process (the pid and its start time), so the agent
//! stops watching it once gone.

use std::io;
use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;

pub use super::apply_error::ApplyError;
use super::cgroupfs::{CGROUP_ROOT, CgroupFs};
use super::procfs;

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
    pub fn exists(&self, fs: &CgroupFs) -> bool {
        match self {
            Target::Pid(p) => Path::new(&format!("/proc/{p}")).exists(),
            Target::Cgroup(c) => fs.resolve(c).is_ok(),
        }
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
            .map_err(|e| ApplyError::of(&e, &format!("pid {pid}")))?
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
                return Err(ApplyError::of(&e, &format!("pid {pid} thread {tid}")));
            }
            done.push(tid);
        }
    }
    Ok(done.len())
}

/// Writes a cgroup's `cpuset.cpus` (and, for an empty v1 `cpuset.mems`,
/// its parent's memory nodes).
pub fn set_cgroup_cpus(fs: &CgroupFs, path: &str, cpulist: &str) -> Result<PathBuf, ApplyError> {
    let dir = fs.resolve(path)?;
    let mems = dir.join("cpuset.mems");
    let empty = std::fs::read_to_string(&mems).is_ok_and(|s| s.trim().is_empty());
    if empty && let Some(parent) = dir.parent() {
        let theirs = std::fs::read_to_string(parent.join("cpuset.mems")).unwrap_or_default();
        if !theirs.trim().is_empty() {
            std::fs::write(&mems, theirs.trim())
                .map_err(|e| ApplyError::of(&e, &format!("{}", mems.display())))?;
        }
    }
    let cpus = dir.join("cpuset.cpus");
    std::fs::write(&cpus, cpulist)
        .map_err(|e| ApplyError::of(&e, &format!("{}", cpus.display())))?;
    Ok(dir)
}

/// The cgroup directories (the machine's names, under [`CGROUP_ROOT`]) a
/// lease may be applied under when the agent is given none: a `fairplace` cgroup and the
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
    /// In the agent's mounts ([`CgroupFs::local`]).
    dirs: Vec<PathBuf>,
    fs: CgroupFs,
}

impl Default for Roots {
    fn default() -> Roots {
        Roots::new(default_roots(), CgroupFs::default()).expect("default roots are valid")
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
    /// without `..` (a root such as `/` would permit everything), as the
    /// machine names them; found through `fs`.
    pub fn new(dirs: Vec<PathBuf>, fs: CgroupFs) -> Result<Roots, String> {
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
        let dirs = dirs.iter().map(|d| fs.local(d)).collect();
        Ok(Roots { dirs, fs })
    }

    /// The roots, in the agent's mounts.
    pub fn dirs(&self) -> &[PathBuf] {
        &self.dirs
    }

    /// The cgroup tree the roots are in, and every target is found in.
    pub fn fs(&self) -> &CgroupFs {
        &self.fs
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
                .map(|p| self.fs.machine(p).display().to_string())
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
                let dir = self.fs.resolve(path)?;
                if self.contains(&dir) {
                    return Ok(());
                }
                Err(refused(format!(
                    "cgroup {path:?}: {} is outside {}",
                    self.fs.machine(&dir).display(),
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
            .map_err(|e| ApplyError::of(&e, &what))?;
        let flags = procfs::parse_task_stat(&stat).map_or(0, |t| t.flags);
        if flags & procfs::PF_KTHREAD != 0 {
            return Err(refused(format!("{what}: a kernel thread")));
        }
        if tgid(pid)? == std::process::id() {
            return Err(refused(format!("{what}: the agent's own process")));
        }
        let dirs = self.fs.process_cgroups(pid)?;
        if dirs.iter().any(|d| self.contains(d)) {
            return Ok(());
        }
        let shown: Vec<String> = dirs
            .iter()
            .map(|d| self.fs.machine(d).display().to_string())
            .collect();
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
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| ApplyError::of(&e, &what))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| ApplyError {
            reason: "failed",
            message: format!("{what}: no Tgid in /proc/{pid}/status"),
        })
}

/// A process's start time (clock ticks after boot, field 22 of its stat):
/// with the pid, it names one process (a pid is reused, this pair is not).
pub fn process_start(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    // rest's first field is field 3.
    rest.split_ascii_whitespace().nth(22 - 3)?.parse().ok()
}

/// The CPUs online on this machine now, as the kernel lists them.
fn online_cpus() -> Option<Vec<usize>> {
    let s = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    parse_cpulist(s.trim()).ok()
}

/// Every CPU of a lease must be online here: the kernel would take a mask
/// with one online CPU and pin the target to that one alone, silently.
fn check_online(cpus: &[usize], cpulist: &str) -> Result<(), ApplyError> {
    let Some(online) = online_cpus() else {
        return Ok(());
    };
    match cpus.iter().find(|c| !online.contains(c)) {
        Some(c) => Err(ApplyError {
            reason: "invalid",
            message: format!("cpus {cpulist:?}: CPU {c} is not online on this machine"),
        }),
        None => Ok(()),
    }
}

/// The CPUs `target` may run on now, as a cpulist: what a lease replaces,
/// and what its end puts back.
pub fn current_cpus(fs: &CgroupFs, target: &Target) -> Option<String> {
    let text = match target {
        Target::Pid(pid) => std::fs::read_to_string(format!("/proc/{pid}/status"))
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
            .trim()
            .to_string(),
        Target::Cgroup(path) => std::fs::read_to_string(fs.resolve(path).ok()?.join("cpuset.cpus"))
            .ok()?
            .trim()
            .to_string(),
    };
    (!text.is_empty()).then_some(text)
}

/// The CPUs of a cgroup target's parent cgroup (what an ended lease of a
/// cgroup falls back to); a process has none.
pub fn parent_cpus(fs: &CgroupFs, target: &Target) -> Option<String> {
    let Target::Cgroup(path) = target else {
        return None;
    };
    let dir = fs.resolve(path).ok()?;
    let text = std::fs::read_to_string(dir.parent()?.join("cpuset.cpus")).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// Applies `cpulist` to `target`, if `roots` permit it and this machine
/// has every CPU of it (nothing is touched otherwise).
pub fn apply(roots: &Roots, target: &Target, cpulist: &str) -> Result<(), ApplyError> {
    let cpus = parse_cpulist(cpulist)?;
    check_online(&cpus, cpulist)?;
    roots.permits(target)?;
    match target {
        Target::Pid(pid) => set_process_affinity(*pid, &cpus).map(|_| ()),
        Target::Cgroup(path) => set_cgroup_cpus(&roots.fs, path, cpulist).map(|_| ()),
    }
}

/// Helpers for tests that pin real processes, here and in the agent's
/// crate (feature `testing`).
#[cfg(any(test, feature = "testing"))]
pub mod testing {
    use super::*;

    /// Roots that permit this process's own cgroups (so its children's).
    pub fn own_roots() -> Roots {
        let fs = CgroupFs::default();
        let own = fs.process_cgroups(std::process::id()).unwrap();
        Roots::new(own, fs).unwrap()
    }

    /// CPUs this process may use, from /proc.
    pub fn allowed(pid: u32) -> String {
        let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        s.lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// A `sleep` child, killed and reaped when dropped.
    pub struct Sleeper(std::process::Child);

    impl Sleeper {
        pub fn start() -> Sleeper {
            Sleeper(
                std::process::Command::new("sleep")
                    .arg("30")
                    .spawn()
                    .expect("sleep"),
            )
        }

        pub fn pid(&self) -> u32 {
            self.0.id()
        }

        pub fn stop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    impl Drop for Sleeper {
        fn drop(&mut self) {
            self.stop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{Sleeper, allowed, own_roots};
    use super::*;

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
            assert!(
                Roots::new(vec![bad.into()], CgroupFs::default()).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn init_kernel_threads_and_the_agent_itself_are_always_refused() {
        // Roots that hold every cgroup: these are refused anyway.
        let all = Roots::new(vec![CGROUP_ROOT.into()], CgroupFs::default()).unwrap();
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
        let roots = Roots::new(vec![cg.dir.clone()], CgroupFs::default()).unwrap();
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
        let roots = Roots::new(vec![other.dir.clone()], CgroupFs::default()).unwrap();
        let m = refusal(apply(&roots, &Target::Cgroup(name.clone()), "0"));
        assert!(m.starts_with(&format!("cgroup {name:?}: ")), "{m}");
        assert!(m.contains("is outside the apply roots"), "{m}");
        assert_eq!(target.cpus(), before, "a refused cgroup is not written");
        // The same cgroup under a root is written.
        let roots = Roots::new(vec![target.dir.clone()], CgroupFs::default()).unwrap();
        apply(&roots, &Target::Cgroup(name), "0").unwrap();
        assert_eq!(target.cpus(), "0");
    }
}
