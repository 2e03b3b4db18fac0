//! The agent as the DaemonSet runs it, with the kernel's own namespaces:
//!
//! - in a mount namespace whose `/sys/fs/cgroup` is not the machine's (an
//!   empty tmpfs over it, as a container's own view hides the tree) with
//!   the machine's tree mounted elsewhere (`--cgroup-root`), and in a
//!   cgroup namespace of its own rooted in another cgroup than the
//!   workloads': a pid and a cgroup named as the machine names them are
//!   applied, read back from `/proc/PID/status` and `cpuset.cpus`, and a
//!   pid outside the apply roots is still refused;
//! - in a pid namespace of its own with the machine's `/proc` as
//!   `--proc-root` (a container without hostPID): no pid is pinned, and
//!   the refusal says why.
//!
//! Each needs root and a v1 cpuset hierarchy (skipped with a message
//! otherwise), and `unshare` and `mount` from util-linux.

use std::time::Duration;

use fairplace_client::Client;
use fairplace_e2e::{Agent, Server, StateDir, TestCgroup, cpus_allowed, pb};

/// A client of `server`, once `node`'s agent has reported.
async fn reported(server: &Server, node: &str) -> Client {
    let c = Client::connect(&server.grpc).await.unwrap();
    for _ in 0..400 {
        if let Ok(n) = c.get_node(node).await
            && n.summary.as_ref().is_some_and(|s| s.fresh)
        {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the agent of {node} never reported");
}

fn pid(pid: u32) -> Option<pb::ApplyTarget> {
    Some(pb::ApplyTarget {
        target: Some(pb::apply_target::Target::Pid(pid)),
    })
}

/// Whether this machine lets the test make the namespaces (root, and a
/// kernel and sandbox that allow them); says SKIPPED otherwise.
fn namespaces_available() -> bool {
    let ok = std::process::Command::new("unshare")
        .args(["--mount", "--cgroup", "--pid", "--fork", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: unshare cannot make mount, cgroup and pid namespaces here");
    }
    ok
}

/// A `sleep` in `cg`, killed when dropped.
struct Sleeper(std::process::Child);

impl Sleeper {
    fn id(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn sleeper_in(cg: &TestCgroup) -> Sleeper {
    Sleeper(cg.sleeper(60))
}

async fn allocate(
    c: &Client,
    node: &str,
    apply: Option<pb::ApplyTarget>,
) -> Result<pb::AllocateCpusResponse, tonic::Status> {
    c.allocate_cpus(pb::AllocateCpusRequest {
        node_id: node.into(),
        count: 1,
        holder: "container-e2e".into(),
        apply,
        ..Default::default()
    })
    .await
}

/// The namespace `ns` (e.g. "cgroup") a process is in.
fn ns_of(pid: u32, ns: &str) -> String {
    std::fs::read_link(format!("/proc/{pid}/ns/{ns}"))
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_in_its_own_mount_and_cgroup_namespaces_applies_through_the_machines_tree() {
    if !namespaces_available() {
        return;
    }
    let Some(top) = TestCgroup::new("ns") else {
        return;
    };
    let agent_cg = top.child("agent");
    let work = top.child("work");
    let other = top.child("other");
    let host_cgroup = StateDir::new("host-cgroup");
    let node = "container-cgroupns";
    let server = Server::start(&[]);
    // As a container runtime does: a private mount namespace where the
    // machine's tree is mounted at --cgroup-root and /sys/fs/cgroup is
    // something else, then a cgroup namespace rooted at the agent's own
    // cgroup (not the workloads').
    let agent_procs = agent_cg.dir.join("cgroup.procs");
    let hc = host_cgroup.path();
    let rel = agent_procs.strip_prefix("/sys/fs/cgroup").unwrap();
    let script = format!(
        "mount --rbind /sys/fs/cgroup {hc} && mount -t tmpfs none /sys/fs/cgroup && \
         echo $$ > {hc}/{} && exec unshare --cgroup \"$@\"",
        rel.display()
    );
    let wrapper = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
        "sh",
    ];
    let agent = Agent::spawn_through(
        &wrapper,
        &server.grpc,
        &[
            "--node-id",
            node,
            "--interval-ms",
            "100",
            "--insecure-apply",
            "--cgroup-root",
            hc,
            "--apply-cgroup-root",
            work.path(),
        ],
    );
    let c = reported(&server, node).await;
    let me = std::process::id();
    let agent_pid = agent.child.id();
    assert_ne!(ns_of(agent_pid, "cgroup"), ns_of(me, "cgroup"));
    assert_ne!(ns_of(agent_pid, "mnt"), ns_of(me, "mnt"));
    assert_eq!(ns_of(agent_pid, "pid"), ns_of(me, "pid"), "hostPID");
    let procs = std::fs::read_to_string(&agent_procs).unwrap();
    assert!(procs.lines().any(|l| l == agent_pid.to_string()), "{procs}");

    // A process in a cgroup beside the agent's, outside the roots: refused
    // by its cgroup as the machine names it, and left alone.
    let outsider = sleeper_in(&other);
    let before = cpus_allowed(outsider.id());
    let e = allocate(&c, node, pid(outsider.id())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message()
            .contains(&format!("{}/other", top.dir.display()))
            && e.message().contains("outside the apply roots"),
        "{}",
        e.message()
    );
    assert_eq!(cpus_allowed(outsider.id()), before);

    // A process inside the roots: its cgroup, seen by the agent as
    // /../work, is found in the machine's tree and the process pinned.
    let worker = sleeper_in(&work);
    let r = allocate(&c, node, pid(worker.id())).await.unwrap();
    assert!(r.applied, "{r:?}");
    assert_eq!(cpus_allowed(worker.id()), r.cpus);

    // A cgroup named as the machine names it, written through the mount.
    let r2 = allocate(
        &c,
        node,
        Some(pb::ApplyTarget {
            target: Some(pb::apply_target::Target::Cgroup(work.path().into())),
        }),
    )
    .await
    .unwrap();
    assert!(r2.applied, "{r2:?}");
    assert_eq!(work.cpus(), r2.cpus);
    drop(agent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_outside_the_machines_pid_namespace_pins_nothing_and_says_why() {
    if !namespaces_available() {
        return;
    }
    let Some(cg) = TestCgroup::new("pidns") else {
        return;
    };
    let host_proc = StateDir::new("host-proc");
    let node = "container-pidns";
    let server = Server::start(&[]);
    // A container without hostPID: its own pid namespace and /proc, the
    // machine's /proc mounted beside it for the signals.
    let hp = host_proc.path();
    let script = format!("mount --rbind /proc {hp} && mount -t proc proc /proc && exec \"$@\"");
    let wrapper = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        &script,
        "sh",
    ];
    let _agent = Agent::spawn_through(
        &wrapper,
        &server.grpc,
        &[
            "--node-id",
            node,
            "--interval-ms",
            "100",
            "--insecure-apply",
            "--proc-root",
            hp,
            "--apply-cgroup-root",
            cg.path(),
        ],
    );
    // It reports (the signals come from the machine's /proc all the same).
    let c = reported(&server, node).await;

    let p = sleeper_in(&cg);
    let before = cpus_allowed(p.id());
    let e = allocate(&c, node, pid(p.id())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(
        e.message().contains("another pid namespace") && e.message().contains("hostPID"),
        "{}",
        e.message()
    );
    assert_eq!(cpus_allowed(p.id()), before, "nothing pinned");
    assert!(c.get_node(node).await.unwrap().leases.is_empty());
}
