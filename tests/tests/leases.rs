//! Leases reaching real workloads, through the real server, agent and CLI:
//! a real process pinned by the agent and read back from
//! `/proc/PID/status`, a real v1 cpuset cgroup (skipped with a message
//! where the machine has none), the lease released when its process exits,
//! leases re-applied after the agent restarts, `fairplace run` with its
//! exit status and no lease left after, two concurrent runs on different
//! CPUs, and the local fallback without a server.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fairplace_client::Client;
use fairplace_e2e::{Agent, Server, bin, cli, pb};

const NODE: &str = "lease-e2e";
/// The agent may apply leases anywhere on the cgroup file system (pid 1,
/// kernel threads and itself excepted): these tests are about applying;
/// `durable_leases.rs` tests the roots.
const AGENT_ARGS: &[&str] = &[
    "--node-id",
    NODE,
    "--interval-ms",
    "100",
    "--apply-cgroup-root",
    "/sys/fs/cgroup",
];

/// A server and an agent reading this machine as `NODE`, reported.
async fn setup() -> (Server, Agent, Client) {
    let server = Server::start(&[]);
    let agent = Agent::start(&server.grpc, AGENT_ARGS);
    let c = Client::connect(&server.grpc).await.unwrap();
    for _ in 0..200 {
        if let Ok(n) = c.get_node(NODE).await
            && n.summary.as_ref().is_some_and(|s| s.fresh)
        {
            return (server, agent, c);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the agent never reported");
}

fn cpus_allowed(pid: u32) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

fn sleeper() -> Child {
    Command::new("sleep").arg("60").spawn().expect("sleep")
}

fn apply_pid(pid: u32) -> Option<pb::ApplyTarget> {
    Some(pb::ApplyTarget {
        target: Some(pb::apply_target::Target::Pid(pid)),
    })
}

async fn leases(c: &Client) -> Vec<pb::Lease> {
    c.get_node(NODE).await.unwrap().leases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_pins_a_real_process_and_the_lease_ends_with_it() {
    let (_server, _agent, c) = setup().await;
    let mut p = sleeper();
    let pid = p.id();
    let r = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: NODE.into(),
            count: 1,
            holder: "e2e".into(),
            apply: apply_pid(pid),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(r.applied, "{r:?}");
    assert_eq!(
        cpus_allowed(pid),
        r.cpus,
        "the kernel's view of the process"
    );
    let l = leases(&c).await;
    assert_eq!(l.len(), 1);
    assert_eq!((l[0].lease_id, l[0].applied), (r.lease_id, true));
    assert_eq!(l[0].cpus, r.cpus);
    assert_eq!(
        c.get_node(NODE).await.unwrap().summary.unwrap().leased_cpus,
        1
    );
    // The process exits: the agent says so and the server releases the lease.
    p.kill().unwrap();
    p.wait().unwrap();
    for _ in 0..200 {
        if leases(&c).await.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the lease outlived its process");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn applying_to_a_missing_process_is_not_found_and_leaves_no_lease() {
    let (_server, _agent, c) = setup().await;
    let e = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: NODE.into(),
            count: 1,
            apply: apply_pid(u32::MAX - 3),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    assert!(e.message().starts_with("apply:"), "{}", e.message());
    assert!(leases(&c).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_applies_a_lease_to_a_real_cpuset_cgroup() {
    let root = std::path::Path::new("/sys/fs/cgroup/cpuset");
    let name = format!("fairplace-e2e-{}", std::process::id());
    let dir = root.join(&name);
    if let Err(e) = std::fs::create_dir(&dir) {
        eprintln!(
            "SKIPPED: no v1 cpuset cgroup can be made here ({}: {e})",
            dir.display()
        );
        return;
    }
    let (_server, _agent, c) = setup().await;
    let r = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: NODE.into(),
            count: 1,
            policy: "cores".into(),
            apply: Some(pb::ApplyTarget {
                target: Some(pb::apply_target::Target::Cgroup(name.clone())),
            }),
            ..Default::default()
        })
        .await;
    let written = std::fs::read_to_string(dir.join("cpuset.cpus")).unwrap_or_default();
    let mems = std::fs::read_to_string(dir.join("cpuset.mems")).unwrap_or_default();
    // A process put in the cgroup runs on the lease's CPUs.
    let inside = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > {}/cgroup.procs && grep Cpus_allowed_list /proc/self/status",
            dir.display()
        ))
        .output()
        .unwrap();
    let _ = std::fs::remove_dir(&dir);
    let r = r.unwrap();
    assert!(r.applied);
    assert_eq!(written.trim(), r.cpus);
    assert!(
        !mems.trim().is_empty(),
        "cpuset.mems copied from the parent"
    );
    let out = String::from_utf8_lossy(&inside.stdout);
    assert!(out.trim().ends_with(&r.cpus), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_applies_the_live_leases_again() {
    let server = Server::start(&[]);
    let mut agent = Agent::start(&server.grpc, AGENT_ARGS);
    let c = Client::connect(&server.grpc).await.unwrap();
    wait_for_fresh(&c).await;
    let mut p = sleeper();
    let pid = p.id();
    let r = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: NODE.into(),
            count: 1,
            apply: apply_pid(pid),
            ..Default::default()
        })
        .await
        .unwrap();
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    // While the agent is down, something widens the process's affinity.
    let all = format!(
        "0-{}",
        std::thread::available_parallelism().unwrap().get() - 1
    );
    let widened = Command::new("taskset")
        .args(["-a", "-p", "-c", &all, &pid.to_string()])
        .stdout(Stdio::null())
        .status();
    if !widened.is_ok_and(|s| s.success()) || all == "0-0" {
        eprintln!("SKIPPED: taskset is missing or this machine has one CPU");
        let _ = p.kill();
        let _ = p.wait();
        return;
    }
    assert_eq!(cpus_allowed(pid), all);
    let _agent = Agent::start(&server.grpc, AGENT_ARGS);
    let mut seen = String::new();
    for _ in 0..200 {
        seen = cpus_allowed(pid);
        if seen == r.cpus {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let _ = p.kill();
    let _ = p.wait();
    assert_eq!(seen, r.cpus, "re-applied after the restart");
}

async fn wait_for_fresh(c: &Client) {
    for _ in 0..200 {
        if let Ok(n) = c.get_node(NODE).await
            && n.summary.as_ref().is_some_and(|s| s.fresh)
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("the agent never reported");
}

/// The CPU list a `grep Cpus_allowed_list` printed.
fn printed_cpus(out: &str) -> String {
    out.lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fairplace_run_passes_the_exit_status_and_leaves_no_lease() {
    let (server, _agent, c) = setup().await;
    let (code, out, err) = cli(
        &server.grpc,
        &[
            "run",
            "--node",
            NODE,
            "--cpus",
            "1",
            "--",
            "sh",
            "-c",
            "grep Cpus_allowed_list /proc/self/status; exit 7",
        ],
    );
    assert_eq!(code, 7, "{err}");
    // "lease N on node NODE: CPUs X" and the command ran on X.
    let leased = err
        .lines()
        .find_map(|l| l.split("CPUs ").nth(1))
        .expect(&err)
        .trim()
        .to_string();
    assert_eq!(printed_cpus(&out), leased, "{out}\n{err}");
    assert!(leases(&c).await.is_empty(), "released after the command");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_concurrent_runs_get_different_cpus_and_show_in_get_node() {
    let (server, _agent, c) = setup().await;
    let run = || {
        Command::new(bin("fairplace"))
            .args([
                "--server",
                &server.grpc,
                "run",
                "--node",
                NODE,
                "--cpus",
                "1",
            ])
            .args([
                "--",
                "sh",
                "-c",
                "grep Cpus_allowed_list /proc/self/status; sleep 1",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let a = run();
    let b = run();
    // While both sleep, GetNode shows both leases.
    let mut during = 0;
    for _ in 0..40 {
        during = leases(&c).await.len();
        if during == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let a = a.wait_with_output().unwrap();
    let b = b.wait_with_output().unwrap();
    assert!(a.status.success() && b.status.success());
    let (ca, cb) = (
        printed_cpus(&String::from_utf8_lossy(&a.stdout)),
        printed_cpus(&String::from_utf8_lossy(&b.stdout)),
    );
    assert!(!ca.is_empty() && !cb.is_empty());
    assert_ne!(ca, cb, "two leases share no CPU while idle ones exist");
    assert_eq!(during, 2, "both leases visible while the commands ran");
    assert!(leases(&c).await.is_empty());
}

#[test]
fn without_a_server_run_falls_back_to_a_local_choice_says_so_and_counts_it() {
    // A port nothing listens on: bind one, then close it.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("fairplace-textfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir_s = dir.to_str().unwrap().to_string();
    let run = || {
        cli(
            &format!("127.0.0.1:{port}"),
            &[
                "run",
                "--cpus",
                "1",
                "--timeout-ms",
                "300",
                "--textfile-dir",
                &dir_s,
                "--",
                "sh",
                "-c",
                "grep Cpus_allowed_list /proc/self/status; exit 3",
            ],
        )
    };
    let (code, out, err) = run();
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("warning") && err.contains("local choice"),
        "{err}"
    );
    let cpus = printed_cpus(&out);
    assert!(
        !cpus.is_empty() && !cpus.contains(',') && !cpus.contains('-'),
        "one CPU: {out}"
    );
    // The metric, for node_exporter's textfile collector: one per fallback.
    let prom = dir.join("fairplace_run.prom");
    let count = || {
        std::fs::read_to_string(&prom)
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("fairplace_run_fallbacks_total "))
            .map(|v| v.trim().to_string())
    };
    assert_eq!(count().as_deref(), Some("1"));
    assert_eq!(run().0, 3);
    assert_eq!(count().as_deref(), Some("2"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fairplace_run_of_a_command_that_cannot_start_releases_its_lease() {
    let (server, _agent, c) = setup().await;
    let (code, _, err) = cli(
        &server.grpc,
        &[
            "run",
            "--node",
            NODE,
            "--cpus",
            "1",
            "--ttl-ms",
            "3600000",
            "--",
            "/nonexistent/fairplace-e2e-command",
        ],
    );
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("/nonexistent/fairplace-e2e-command"), "{err}");
    assert!(
        leases(&c).await.is_empty(),
        "an hour's lease left behind: {err}"
    );
}

/// The children of process `pid` (every thread's `children` file).
fn children(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let f = t.path().join("children");
        out.extend(
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .split_whitespace()
                .filter_map(|w| w.parse::<u32>().ok()),
        );
    }
    out
}

/// `fairplace run -- sleep 60` on NODE, and the sleep's pid once started.
async fn run_sleep(server: &Server) -> (Child, u32) {
    let mut run = Command::new(bin("fairplace"))
        .args([
            "--server",
            &server.grpc,
            "run",
            "--node",
            NODE,
            "--cpus",
            "1",
        ])
        .args(["--", "sleep", "60"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    for _ in 0..200 {
        if let Some(&c) = children(run.id()).first() {
            return (run, c);
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let _ = run.kill();
    let _ = run.wait();
    panic!("fairplace run never started its command");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hang_up_reaches_the_command_and_the_command_dies_with_fairplace_run() {
    let (server, _agent, c) = setup().await;
    // SIGHUP to fairplace run: passed on, the command dies of it, the
    // lease is released, and run reports 128 + 1.
    let (run, sleep) = run_sleep(&server).await;
    fairplace_e2e::send_signal(run.id(), libc::SIGHUP);
    let out = run.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(129),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!std::path::Path::new(&format!("/proc/{sleep}")).exists());
    assert!(leases(&c).await.is_empty());
    // SIGKILL to fairplace run (nothing to pass on): the command dies too.
    let (mut run, sleep) = run_sleep(&server).await;
    fairplace_e2e::send_signal(run.id(), libc::SIGKILL);
    run.wait().unwrap();
    let gone = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(20));
        !std::path::Path::new(&format!("/proc/{sleep}/stat")).exists()
            || std::fs::read_to_string(format!("/proc/{sleep}/stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            })
    });
    assert!(gone, "the command outlived fairplace run");
}

/// Whether `pid` is gone (or a zombie nobody reaped yet).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |s| {
        s.rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z'))
    })
}

/// `fairplace run -- sh -c 'CMD'`: the shell forks CMD, which ignores
/// SIGHUP and SIGTERM. A hang-up reaches the whole command (its process
/// group), the shell dies of it, and what is left of the command is ended
/// before the lease is released: nothing keeps running on CPUs that may be
/// granted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fairplace_run_of_a_shell_command_ends_all_of_it_before_the_lease_is_released() {
    let (server, _agent, c) = setup().await;
    let dir = fairplace_e2e::StateDir::new("run-group");
    let pidfile = dir.0.join("pid");
    let script = format!(
        "(trap '' HUP TERM; exec sleep 300) & echo $! > {}; wait",
        pidfile.display()
    );
    let run = Command::new(bin("fairplace"))
        .args([
            "--server",
            &server.grpc,
            "run",
            "--node",
            NODE,
            "--cpus",
            "1",
        ])
        .args(["--", "sh", "-c", &script])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut cmd = None;
    for _ in 0..200 {
        cmd = std::fs::read_to_string(&pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok());
        if cmd.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let cmd = cmd.expect("the shell started its command");
    assert_eq!(leases(&c).await.len(), 1);
    fairplace_e2e::send_signal(run.id(), libc::SIGHUP);
    let out = run.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(129), "{err}");
    assert!(gone(cmd), "CMD outlived fairplace run: {err}");
    assert!(err.contains("other processes are still running"), "{err}");
    assert!(leases(&c).await.is_empty());
}

/// A pid or cgroup names something on one machine: an AllocateCpus that
/// lets the cluster choose the node cannot carry one (a hostile node the
/// cluster chose would otherwise be handed another node's pid).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_allocation_with_an_apply_target_is_refused_naming_node_id() {
    let (_server, _agent, c) = setup().await;
    let mut victim = sleeper();
    let before = cpus_allowed(victim.id());
    for apply in [
        apply_pid(victim.id()),
        Some(pb::ApplyTarget {
            target: Some(pb::apply_target::Target::Cgroup("fairplace/job".into())),
        }),
    ] {
        let e = c
            .allocate_cpus(pb::AllocateCpusRequest {
                count: 1,
                holder: "cluster".into(),
                apply,
                ..Default::default()
            })
            .await
            .expect_err("a cluster allocation with a target");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().starts_with("node_id"), "{}", e.message());
    }
    let node = c.get_node(NODE).await.unwrap();
    assert!(node.leases.is_empty(), "{:?}", node.leases);
    assert_eq!(cpus_allowed(victim.id()), before);
    let _ = victim.kill();
    let _ = victim.wait();
}
