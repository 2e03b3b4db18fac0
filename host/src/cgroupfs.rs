//! The machine's cgroup tree as the agent reaches it. Two things can stand
//! between a cgroup's name and the directory the agent writes:
//!
//! - **The mount.** Lease targets and `--apply-cgroup-root` name cgroups as
//!   the machine does, under `/sys/fs/cgroup`. An agent on the machine
//!   finds them there; one in a container finds the machine's tree where
//!   it was mounted (`--cgroup-root`, e.g. `/host/cgroup`), since the
//!   container's own `/sys/fs/cgroup` shows only its own cgroup.
//! - **The cgroup namespace.** A container has its own (containerd and
//!   Docker make one on cgroup v2): `/proc/PID/cgroup` then names every
//!   cgroup relative to the agent's own, `/../../kubepods.slice/...` for a
//!   pod beside it. To tell which cgroup a pid is in, the agent needs where
//!   its namespace starts in the machine's tree; [`ns_root`] finds it once,
//!   by the cgroup whose `cgroup.procs` lists the agent.
//!
//! Pids need no such mapping: a pid is looked up in the agent's own
//! `/proc` and pinned with `sched_setaffinity()`, both in the agent's pid
//! namespace, which must be the machine's for a lease's pid to mean the
//! process the orchestrator meant ([`same_pid_namespace`]).

use std::collections::VecDeque;
use std::io;
use std::path::{Component, Path, PathBuf};

use super::apply_error::ApplyError;

/// Where the machine mounts its cgroup hierarchies; cgroups are named
/// under it in leases and flags whatever the agent's own mount is.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Most directories the namespace search visits (a node has a few
/// thousand cgroups).
const NS_SEARCH_DIRS: usize = 200_000;

/// The machine's cgroup hierarchies as mounted for the agent, and the
/// agent's cgroup-namespace root in each one that can hold a cpuset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupFs {
    /// Where the machine's `/sys/fs/cgroup` is in the agent's mounts.
    mount: PathBuf,
    /// The v1 cpuset hierarchy's mount and the agent's namespace root in
    /// it (`None`: no v1 cpuset, or the agent is not found in it).
    cpuset: Option<Hierarchy>,
    /// The same for the unified (v2) hierarchy.
    unified: Option<Hierarchy>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Hierarchy {
    mount: PathBuf,
    /// The agent's cgroup-namespace root: `mount` when the agent sees the
    /// whole tree.
    ns_root: PathBuf,
}

impl Default for CgroupFs {
    fn default() -> CgroupFs {
        CgroupFs::at(Path::new(CGROUP_ROOT))
    }
}

impl CgroupFs {
    /// The hierarchies under `mount` (the machine's `/sys/fs/cgroup`), and
    /// where the agent's cgroup namespace starts in each.
    pub fn at(mount: &Path) -> CgroupFs {
        let mount = mount.canonicalize().unwrap_or_else(|_| mount.to_path_buf());
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        let pid = std::process::id();
        let find = |dir: PathBuf, line: Option<&str>| {
            let ns_root = ns_root(&dir, line?, pid)?;
            Some(Hierarchy {
                mount: dir,
                ns_root,
            })
        };
        let cpuset_dir = mount.join("cpuset");
        let cpuset = cpuset_dir
            .join("cpuset.cpus")
            .is_file()
            .then(|| find(cpuset_dir, own_path(&own, |c, _| c.contains(&"cpuset"))))
            .flatten();
        let unified = [mount.to_path_buf(), mount.join("unified")]
            .into_iter()
            .find(|m| m.join("cgroup.controllers").is_file())
            .and_then(|m| find(m, own_path(&own, |c, id| id == "0" && c == [""])));
        CgroupFs {
            mount,
            cpuset,
            unified,
        }
    }

    /// Where the machine's `/sys/fs/cgroup` is mounted for the agent.
    pub fn mount(&self) -> &Path {
        &self.mount
    }

    /// A cgroup path as the machine names it (absolute under
    /// `/sys/fs/cgroup`, or relative to it) in the agent's mounts.
    pub fn local(&self, machine: &Path) -> PathBuf {
        let rel = machine.strip_prefix(CGROUP_ROOT).unwrap_or(machine);
        let rel = rel.strip_prefix("/").unwrap_or(rel);
        self.mount.join(rel)
    }

    /// A directory in the agent's mounts as the machine names it, for
    /// messages an operator reads.
    pub fn machine(&self, local: &Path) -> PathBuf {
        match local.strip_prefix(&self.mount) {
            Ok(rel) if rel.as_os_str().is_empty() => PathBuf::from(CGROUP_ROOT),
            Ok(rel) => Path::new(CGROUP_ROOT).join(rel),
            Err(_) => local.to_path_buf(),
        }
    }

    /// The cgroup directory `path` names: the v1 cpuset hierarchy first,
    /// then the unified one, never outside the mount.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, ApplyError> {
        if path.split('/').any(|s| s == "..") {
            return Err(ApplyError {
                reason: "invalid",
                message: format!("cgroup {path:?}: '..' is not allowed"),
            });
        }
        let direct = self.local(Path::new(path));
        let rel = direct.strip_prefix(&self.mount).unwrap_or(&direct);
        let candidates = [
            direct.clone(),
            self.mount.join("cpuset").join(rel),
            self.mount.join("unified").join(rel),
        ];
        let mount = self.mount.canonicalize().unwrap_or(self.mount.clone());
        for c in candidates {
            if c.join("cpuset.cpus").is_file() {
                let real = c.canonicalize().map_err(|e| ApplyError::of(&e, path))?;
                if !real.starts_with(&mount) {
                    return Err(ApplyError {
                        reason: "invalid",
                        message: format!("cgroup {path:?} leads outside {}", mount.display()),
                    });
                }
                return Ok(real);
            }
        }
        Err(ApplyError {
            reason: "not_found",
            message: format!(
                "cgroup {path:?}: no cpuset cgroup there (looked under {}, its cpuset and unified mounts)",
                self.mount.display()
            ),
        })
    }

    /// The directories of `pid`'s cgroups that can hold a cpuset (its v1
    /// cpuset cgroup and its unified one), from `/proc/PID/cgroup`.
    pub fn process_cgroups(&self, pid: u32) -> Result<Vec<PathBuf>, ApplyError> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
            .map_err(|e| ApplyError::of(&e, &format!("pid {pid}")))?;
        Ok(self.cgroup_dirs(&text))
    }

    /// `/proc/PID/cgroup` lines (`ID:controllers:/path`, the path relative
    /// to the agent's namespace root) as directories in the agent's mounts.
    pub fn cgroup_dirs(&self, text: &str) -> Vec<PathBuf> {
        let mut out = Vec::new();
        for line in text.lines() {
            let mut f = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
                continue;
            };
            let h = if controllers.split(',').any(|c| c == "cpuset") {
                self.cpuset.as_ref()
            } else if id == "0" && controllers.is_empty() {
                self.unified.as_ref()
            } else {
                None
            };
            if let Some(dir) = h.and_then(|h| h.place(path)) {
                out.push(dir);
            }
        }
        out
    }
}

impl Hierarchy {
    /// A path relative to the namespace root, as a directory under the
    /// mount; `None` if it climbs above the mount.
    fn place(&self, path: &str) -> Option<PathBuf> {
        let mut dir = self.ns_root.clone();
        for c in Path::new(path).components() {
            match c {
                Component::Normal(s) => dir.push(s),
                // The namespace root is at or below the mount, so a pop
                // short of it always has a parent to go to.
                Component::ParentDir if dir == self.mount => return None,
                Component::ParentDir => {
                    dir.pop();
                }
                _ => {}
            }
        }
        Some(dir)
    }
}

/// The agent's own path in one hierarchy, from `/proc/self/cgroup`: the
/// line whose controllers (split on ',') and id `which` accepts.
fn own_path(text: &str, which: impl Fn(&[&str], &str) -> bool) -> Option<&str> {
    text.lines().find_map(|l| {
        let mut f = l.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let c: Vec<&str> = controllers.split(',').collect();
        which(&c, id).then_some(path)
    })
}

/// Where the namespace `own` (the agent's path in it, as its
/// `/proc/self/cgroup` shows it) starts in the hierarchy mounted at
/// `mount`: the directory that lists `pid` in its `cgroup.procs`, less
/// `own`. Without a namespace that is `mount/own` itself, found at once;
/// in one, a breadth-first search of the tree (once, at start).
pub fn ns_root(mount: &Path, own: &str, pid: u32) -> Option<PathBuf> {
    let own_rel = own.trim_start_matches('/');
    let direct = match own_rel {
        "" => mount.to_path_buf(),
        rel => mount.join(rel),
    };
    let holds = |d: &Path| lists(d, pid).unwrap_or(false);
    let found = if !own.contains("..") && holds(&direct) {
        direct
    } else {
        let mut queue = VecDeque::from([mount.to_path_buf()]);
        let mut seen = 0;
        loop {
            let d = queue.pop_front()?;
            seen += 1;
            if seen > NS_SEARCH_DIRS {
                return None;
            }
            if holds(&d) {
                break d;
            }
            let Ok(rd) = std::fs::read_dir(&d) else {
                continue;
            };
            queue.extend(
                rd.filter_map(|e| e.ok())
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    };
    // The agent's cgroup is `own` below the root: strip it off the end.
    let mut root = found;
    for c in Path::new(own_rel).components().rev() {
        match c {
            Component::Normal(s) if root.file_name() == Some(s) => {
                root.pop();
            }
            _ => return None,
        }
    }
    root.starts_with(mount).then_some(root)
}

/// Whether a cgroup directory's `cgroup.procs` lists `pid`.
fn lists(dir: &Path, pid: u32) -> io::Result<bool> {
    let procs = std::fs::read_to_string(dir.join("cgroup.procs"))?;
    let want = pid.to_string();
    Ok(procs.lines().any(|l| l.trim() == want))
}

/// Whether the procfs at `proc_root` shows the agent's own pid namespace:
/// leases name pids as the machine sees them and the agent pins them with
/// `sched_setaffinity()` in its own namespace, so the two must be one. A
/// procfs of another namespace shows the agent under another pid (or not
/// at all); the error says which and what to change.
pub fn same_pid_namespace(proc_root: &Path) -> Result<(), String> {
    let own = std::fs::read_link("/proc/self")
        .map_err(|e| format!("/proc/self: {e}"))?
        .to_string_lossy()
        .into_owned();
    let there = std::fs::read_link(proc_root.join("self"))
        .map(|p| p.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "absent".into());
    if own == there {
        return Ok(());
    }
    Err(format!(
        "--proc-root {} shows another pid namespace than the agent's (the agent is pid {there} there, \
         {own} in its own): a lease's pid would name another process; run the agent in the \
         machine's pid namespace (Kubernetes hostPID, Docker --pid host) and leave --proc-root at /proc",
        proc_root.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fs_with(mount: &str, cpuset_ns: &str, unified_ns: &str) -> CgroupFs {
        let h = |m: &str, ns: &str| Hierarchy {
            mount: PathBuf::from(m),
            ns_root: PathBuf::from(ns),
        };
        CgroupFs {
            mount: mount.into(),
            cpuset: Some(h(&format!("{mount}/cpuset"), cpuset_ns)),
            unified: Some(h(&format!("{mount}/unified"), unified_ns)),
        }
    }

    #[test]
    fn paths_relative_to_a_namespace_root_are_placed_under_the_machines_tree() {
        let fs = fs_with(
            "/host/cgroup",
            "/host/cgroup/cpuset/kubepods/pod-a/agent",
            "/host/cgroup/unified/kubepods.slice/pod-a.slice/agent.scope",
        );
        let text = "3:cpuset:/../../pod-b/work\n\
                    4:memory:/../x\n\
                    0::/../../pod-b.slice/work.scope\n";
        assert_eq!(
            fs.cgroup_dirs(text),
            vec![
                PathBuf::from("/host/cgroup/cpuset/kubepods/pod-b/work"),
                PathBuf::from("/host/cgroup/unified/kubepods.slice/pod-b.slice/work.scope"),
            ]
        );
        // The agent's own cgroup, and one below it.
        assert_eq!(
            fs.cgroup_dirs("3:cpuset:/\n3:cpuset:/child\n"),
            vec![
                PathBuf::from("/host/cgroup/cpuset/kubepods/pod-a/agent"),
                PathBuf::from("/host/cgroup/cpuset/kubepods/pod-a/agent/child"),
            ]
        );
    }

    #[test]
    fn without_a_namespace_the_cpuset_and_unified_lines_are_the_machines_paths() {
        let fs = fs_with(
            "/sys/fs/cgroup",
            "/sys/fs/cgroup/cpuset",
            "/sys/fs/cgroup/unified",
        );
        let hybrid = "9:name=systemd:/x\n3:cpu,cpuset:/kubepods/pod1\n0::/kubepods/pod1\n";
        assert_eq!(
            fs.cgroup_dirs(hybrid),
            vec![
                PathBuf::from("/sys/fs/cgroup/cpuset/kubepods/pod1"),
                PathBuf::from("/sys/fs/cgroup/unified/kubepods/pod1"),
            ]
        );
        // A machine without the unified hierarchy places no v2 line.
        let v1 = CgroupFs {
            unified: None,
            ..fs
        };
        assert!(v1.cgroup_dirs("0::/fairplace.slice/job.scope\n").is_empty());
    }

    #[test]
    fn a_path_that_climbs_above_the_mount_places_nothing() {
        let fs = fs_with("/m", "/m/cpuset/a", "/m/unified");
        assert!(
            fs.cgroup_dirs("3:cpuset:/../../../x\n0::/../y\n")
                .is_empty()
        );
        assert_eq!(
            fs.cgroup_dirs("3:cpuset:/../\n"),
            vec![PathBuf::from("/m/cpuset")]
        );
    }

    #[test]
    fn machine_names_are_found_under_the_agents_mount() {
        let fs = fs_with(
            "/host/cgroup",
            "/host/cgroup/cpuset",
            "/host/cgroup/unified",
        );
        for name in ["/sys/fs/cgroup/cpuset/x", "cpuset/x", "/cpuset/x"] {
            assert_eq!(
                fs.local(Path::new(name)),
                PathBuf::from("/host/cgroup/cpuset/x"),
                "{name}"
            );
        }
        // And named back as the machine does in what an operator reads.
        let back = |p: &str| fs.machine(Path::new(p));
        assert_eq!(
            back("/host/cgroup/cpuset/x"),
            PathBuf::from("/sys/fs/cgroup/cpuset/x")
        );
        assert_eq!(back("/host/cgroup"), PathBuf::from("/sys/fs/cgroup"));
        assert_eq!(back("/elsewhere"), PathBuf::from("/elsewhere"));
    }

    #[test]
    fn this_processs_own_namespace_root_is_its_hierarchys_mount_when_unshared() {
        // The test runs without a cgroup namespace of its own: each
        // hierarchy's namespace root is its mount, whichever cgroup the
        // test itself is in.
        let fs = CgroupFs::default();
        for h in [&fs.cpuset, &fs.unified].into_iter().flatten() {
            assert_eq!(h.ns_root, h.mount, "{h:?}");
        }
    }

    #[test]
    fn the_own_procfs_is_the_own_pid_namespace_and_a_copy_is_not() {
        same_pid_namespace(Path::new("/proc")).unwrap();
        let dir = std::env::temp_dir().join(format!("fp-pidns-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let e = same_pid_namespace(&dir).unwrap_err();
        assert!(
            e.contains("another pid namespace") && e.contains("absent"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
