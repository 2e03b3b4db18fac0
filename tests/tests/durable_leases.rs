//! Leases that survive, with the real server, agent and CLI on this
//! machine, real processes and a real cpuset cgroup: the server killed
//! (-9) with leases outstanding (a pinned process, a cgroup, a
//! `fairplace run` child) and restarted on its state directory; the same
//! with the state directory deleted (the leases come back from the agent's
//! checkpoint); server and agent killed together, and the agent alone;
//! another orchestrator's Renew and Release refused over mutual TLS, before
//! and after a restart, and guessed ids NOT_FOUND; targets outside the
//! agent's `--apply-cgroup-root` refused with nothing on the machine
//! changed. Every check reads the kernel's view back (`/proc/PID/status`,
//! `cpuset.cpus`).

use std::collections::BTreeSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fairplace_client::Client;
use fairplace_e2e::tls::TestPki;
use fairplace_e2e::{
    Agent, Reporter, Server, StateDir, TestCgroup, bin, cli, cpus_allowed, free_port, http_get, pb,
    send_signal, states, topology,
};
use tonic::Code;

const NODE: &str = "durable-e2e";

/// A server on a fixed port with its own state directory, and an agent
/// reading this machine as `NODE` that may apply leases under `root`.
struct Rig {
    addr: String,
    server: Server,
    server_state: StateDir,
    agent: Agent,
    agent_state: StateDir,
    root: String,
}

impl Rig {
    async fn start(root: &TestCgroup) -> (Rig, Client) {
        let addr = format!("127.0.0.1:{}", free_port());
        let server_state = StateDir::new("durable-server");
        let agent_state = StateDir::new("durable-agent");
        let server = start_server(&addr, &server_state);
        let agent = start_agent(&addr, &agent_state, root.path());
        let rig = Rig {
            addr,
            server,
            server_state,
            agent,
            agent_state,
            root: root.path().to_string(),
        };
        let c = rig.client().await;
        wait_fresh(&c).await;
        (rig, c)
    }

    async fn client(&self) -> Client {
        Client::connect(&self.addr).await.unwrap()
    }

    fn kill_server(&mut self) {
        send_signal(self.server.pid(), 9);
        self.server.wait();
    }

    fn restart_server(&mut self) {
        self.server = start_server(&self.addr, &self.server_state);
    }

    fn kill_agent(&mut self) {
        let _ = self.agent.child.kill();
        let _ = self.agent.child.wait();
    }

    fn restart_agent(&mut self) {
        self.agent = start_agent(&self.addr, &self.agent_state, &self.root);
    }
}

fn start_server(addr: &str, state: &StateDir) -> Server {
    Server::start(&["--grpc-addr", addr, "--state-dir", state.path()])
}

fn start_agent(addr: &str, state: &StateDir, root: &str) -> Agent {
    Agent::start(
        addr,
        &[
            "--node-id",
            NODE,
            "--interval-ms",
            "100",
            "--state-dir",
            state.path(),
            "--apply-cgroup-root",
            root,
        ],
    )
}

async fn wait_fresh(c: &Client) {
    wait_until(Duration::from_secs(15), "the agent reports", || async {
        c.get_node(NODE)
            .await
            .ok()
            .and_then(|n| n.summary)
            .is_some_and(|s| s.fresh)
    })
    .await;
}

async fn wait_until<F, Fut>(limit: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < limit, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The node's leases as (id, holder, owner, cpus), sorted.
async fn leases(c: &Client) -> Vec<(u64, String, String, String)> {
    let mut v: Vec<_> = c
        .get_node(NODE)
        .await
        .map(|n| n.leases)
        .unwrap_or_default()
        .into_iter()
        .map(|l| (l.lease_id, l.holder, l.owner, l.cpus))
        .collect();
    v.sort();
    v
}

fn apply_pid(pid: u32) -> Option<pb::ApplyTarget> {
    Some(pb::ApplyTarget {
        target: Some(pb::apply_target::Target::Pid(pid)),
    })
}

fn apply_cgroup(path: &str) -> Option<pb::ApplyTarget> {
    Some(pb::ApplyTarget {
        target: Some(pb::apply_target::Target::Cgroup(path.into())),
    })
}

async fn lease(
    c: &Client,
    holder: &str,
    apply: Option<pb::ApplyTarget>,
) -> Result<pb::AllocateCpusResponse, tonic::Status> {
    c.allocate_cpus(pb::AllocateCpusRequest {
        node_id: NODE.into(),
        count: 1,
        holder: holder.into(),
        ttl_ms: 120_000,
        apply,
        ..Default::default()
    })
    .await
}

fn cpu_list(s: &str) -> BTreeSet<u32> {
    let mut v = BTreeSet::new();
    for part in s.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => v.extend(a.parse::<u32>().unwrap()..=b.parse::<u32>().unwrap()),
            None => {
                v.insert(part.parse().unwrap());
            }
        }
    }
    v
}

/// Takes single CPUs until the node has none left; asserts none of them
/// is one of `leased`; releases them.
async fn no_leased_cpu_is_granted_again(c: &Client, leased: &BTreeSet<u32>) {
    let mut taken = Vec::new();
    loop {
        match lease(c, "probe", None).await {
            Ok(r) => {
                let got = cpu_list(&r.cpus);
                assert!(
                    got.is_disjoint(leased),
                    "granted {} again (leased {leased:?})",
                    r.cpus
                );
                taken.push(r.lease_id);
            }
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                break;
            }
        }
        assert!(taken.len() < 4096);
    }
    for id in taken {
        c.release_cpus(id).await.unwrap();
    }
}

/// `fairplace run` of a command that prints its CPUs, sleeps, exits 7.
fn run_child(addr: &str, secs: u32) -> Child {
    Command::new(bin("fairplace"))
        .args(["--server", addr, "run", "--node", NODE, "--cpus", "1", "--ttl-ms", "3000"])
        .args([
            "--",
            "sh",
            "-c",
            &format!("grep Cpus_allowed_list /proc/self/status; sleep {secs}; grep Cpus_allowed_list /proc/self/status; exit 7"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_survive_a_kill_9_of_the_server_and_fairplace_run_rides_through() {
    let Some(root) = TestCgroup::new("kill9") else {
        return;
    };
    let (mut rig, c) = Rig::start(&root).await;
    let mut sleeper = root.sleeper(120);
    let pid = sleeper.id();
    let pinned = lease(&c, "pinned", apply_pid(pid)).await.unwrap();
    assert!(pinned.applied);
    assert_eq!(cpus_allowed(pid), pinned.cpus);
    let run = run_child(&rig.addr, 6);
    wait_until(
        Duration::from_secs(10),
        "both leases are listed",
        || async { leases(&c).await.len() == 2 },
    )
    .await;
    let before = leases(&c).await;
    let leased: BTreeSet<u32> = before.iter().flat_map(|l| cpu_list(&l.3)).collect();

    rig.kill_server();
    // Down for a while: the run's renewals fail and are retried.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        cpus_allowed(pid),
        pinned.cpus,
        "nothing on the node changed"
    );
    rig.restart_server();
    let c = rig.client().await;
    wait_fresh(&c).await;
    assert_eq!(
        leases(&c).await,
        before,
        "the same ids, holders, owners and CPUs"
    );
    no_leased_cpu_is_granted_again(&c, &leased).await;
    assert_eq!(
        cpus_allowed(pid),
        pinned.cpus,
        "the process's affinity never changed"
    );

    let out = run.wait_with_output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert_eq!(out.status.code(), Some(7), "{stderr}");
    let printed: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(str::trim)
        .collect();
    assert_eq!(printed.len(), 2, "{stdout}");
    assert_eq!(printed[0], printed[1], "the command's CPUs never changed");
    assert!(!stderr.contains("expired"), "{stderr}");
    wait_until(
        Duration::from_secs(10),
        "the run's lease is released",
        || async { leases(&c).await.len() == 1 },
    )
    .await;
    assert_eq!(leases(&c).await[0].0, pinned.lease_id);
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_state_directory_lost_the_leases_come_back_from_the_agent() {
    let Some(root) = TestCgroup::new("lost") else {
        return;
    };
    // A cgroup for the lease to write, under the agent's root.
    let job = root.dir.join("job");
    std::fs::create_dir(&job).unwrap();
    for f in ["cpuset.mems", "cpuset.cpus"] {
        let v = std::fs::read_to_string(root.dir.join(f)).unwrap();
        std::fs::write(job.join(f), v.trim()).unwrap();
    }
    let job_rel = job
        .strip_prefix(fairplace_e2e::CPUSET_ROOT)
        .unwrap()
        .display()
        .to_string();
    let (mut rig, c) = Rig::start(&root).await;
    let mut sleeper = root.sleeper(120);
    let pid = sleeper.id();
    let on_cgroup = lease(&c, "cgroup", apply_cgroup(&job_rel)).await.unwrap();
    let on_pid = lease(&c, "pid", apply_pid(pid)).await.unwrap();
    assert!(on_cgroup.applied && on_pid.applied);
    let cg_cpus = std::fs::read_to_string(job.join("cpuset.cpus")).unwrap();
    assert_eq!(cg_cpus.trim(), on_cgroup.cpus);
    let before = leases(&c).await;
    assert_eq!(before.len(), 2);

    rig.kill_server();
    std::fs::remove_dir_all(&rig.server_state.0).unwrap();
    rig.restart_server();
    let c = rig.client().await;
    wait_until(
        Duration::from_secs(15),
        "the agent's leases are adopted",
        || async { leases(&c).await.len() == 2 },
    )
    .await;
    wait_fresh(&c).await;
    assert_eq!(
        leases(&c).await,
        before,
        "ids, holders, owners and CPUs from the node"
    );
    let metrics = http_get(&rig.server.metrics);
    assert!(
        metrics.contains("fairplace_leases_recovered_total{how=\"adopted\"} 2"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("recovered"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(
        std::fs::read_to_string(job.join("cpuset.cpus")).unwrap(),
        cg_cpus
    );
    assert_eq!(cpus_allowed(pid), on_pid.cpus);
    let leased: BTreeSet<u32> = before.iter().flat_map(|l| cpu_list(&l.3)).collect();
    no_leased_cpu_is_granted_again(&c, &leased).await;
    // Adopted leases are real ones: durable again, and releasable.
    rig.kill_server();
    rig.restart_server();
    let c = rig.client().await;
    wait_fresh(&c).await;
    assert_eq!(leases(&c).await, before);
    c.release_cpus(on_cgroup.lease_id).await.unwrap();
    c.release_cpus(on_pid.lease_id).await.unwrap();
    assert!(leases(&c).await.is_empty());
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    let _ = std::fs::remove_dir(&job);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_alone_and_then_both_together_restart_without_losing_a_lease() {
    let Some(root) = TestCgroup::new("both") else {
        return;
    };
    let (mut rig, c) = Rig::start(&root).await;
    let mut sleeper = root.sleeper(120);
    let pid = sleeper.id();
    let pinned = lease(&c, "pinned", apply_pid(pid)).await.unwrap();
    let before = leases(&c).await;

    // The agent alone: its checkpoint keeps the lease; the server kept it.
    rig.kill_agent();
    assert_eq!(cpus_allowed(pid), pinned.cpus);
    rig.restart_agent();
    wait_fresh(&c).await;
    assert_eq!(leases(&c).await, before);
    let applied = c.get_node(NODE).await.unwrap().leases[0].applied;
    assert!(applied, "applied again after the agent's restart");

    // Both at once.
    rig.kill_agent();
    rig.kill_server();
    rig.restart_server();
    rig.restart_agent();
    let c = rig.client().await;
    wait_fresh(&c).await;
    assert_eq!(leases(&c).await, before);
    assert_eq!(cpus_allowed(pid), pinned.cpus);
    no_leased_cpu_is_granted_again(&c, &cpu_list(&pinned.cpus)).await;
    // The process exits: the lease ends with it, as before any restart.
    let _ = sleeper.kill();
    let _ = sleeper.wait();
    wait_until(
        Duration::from_secs(10),
        "the lease ends with its process",
        || async { leases(&c).await.is_empty() },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_owner_ends_a_lease_over_mutual_tls_even_after_a_restart() {
    let pki = TestPki::new();
    let state = StateDir::new("owner");
    let addr = format!("127.0.0.1:{}", free_port());
    let mut args = pki.server_args();
    args.extend([
        "--grpc-addr".into(),
        addr.clone(),
        "--state-dir".into(),
        state.path().into(),
    ]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut server = Server::start(&args);
    let node_tls = pki.client("node", NODE);
    let o = pki.client("orchestrator", "o");
    let mallory = pki.client("orchestrator", "mallory");
    let admin = pki.client("admin", "ops");
    let ch = fairplace_e2e::tls::channel(&addr, &node_tls).await.unwrap();
    let mut reporter = Reporter::register_on(ch, NODE, topology(1, 1, 2, 2), &[])
        .await
        .unwrap();
    reporter
        .update(1, true, states(4, &[]), NODE)
        .await
        .unwrap();
    let co = Client::connect_tls(&addr, &o).await.unwrap();
    let r = lease(&co, "o's job", None).await.unwrap();
    let cli_as = |tls: &fairplace_e2e::tls::TlsOptions, args: &[&str]| {
        let mut a = TestPki::cli_args(tls);
        a.extend(args.iter().map(|s| s.to_string()));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        cli(&addr, &a)
    };
    let id = r.lease_id.to_string();
    for round in ["before", "after"] {
        if round == "after" {
            send_signal(server.pid(), 9);
            server.wait();
            server = Server::start(&args);
        }
        let (code, _, err) = cli_as(&mallory, &["release", &id]);
        assert_ne!(code, 0, "{round}: mallory released o's lease");
        assert!(
            err.contains("PermissionDenied") || err.contains("permission"),
            "{err}"
        );
        assert!(err.contains("spiffe://fairplace/orchestrator/o"), "{err}");
        assert!(
            err.contains("spiffe://fairplace/orchestrator/mallory"),
            "{err}"
        );
        let cm = Client::connect_tls(&addr, &mallory).await.unwrap();
        let e = cm.renew_lease(r.lease_id, 0).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{round}");
        for guess in [1, 2, r.lease_id ^ 1] {
            let e = cm.release_cpus(guess).await.unwrap_err();
            assert_eq!(e.code(), Code::NotFound, "{round}: {guess}");
        }
        // The owner still renews it.
        let co = Client::connect_tls(&addr, &o).await.unwrap();
        co.renew_lease(r.lease_id, 0).await.unwrap();
    }
    // An admin may end it.
    let (code, _, err) = cli_as(&admin, &["release", &id]);
    assert_eq!(code, 0, "{err}");
    let ca = Client::connect_tls(&addr, &admin).await.unwrap();
    assert_eq!(
        ca.release_cpus(r.lease_id).await.unwrap_err().code(),
        Code::NotFound
    );
    drop(server);
}

/// A target the agent must refuse: what it is, the target, and how to read
/// back what applying it would have changed.
type RefusalCase = (String, Option<pb::ApplyTarget>, Box<dyn Fn() -> String>);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_outside_the_apply_roots_are_refused_and_nothing_changes() {
    let Some(root) = TestCgroup::new("roots") else {
        return;
    };
    let Some(other) = TestCgroup::new("outside") else {
        return;
    };
    let (rig, c) = Rig::start(&root).await;
    let mut outside = other.sleeper(120);
    let mut plain = Command::new("sleep").arg("120").spawn().unwrap();
    let kthreadd = 2;
    let cases: Vec<RefusalCase> = vec![
        {
            let pid = outside.id();
            (
                "a process in another cgroup".into(),
                apply_pid(pid),
                Box::new(move || cpus_allowed(pid)),
            )
        },
        {
            let pid = plain.id();
            (
                "a process in the root cgroup".into(),
                apply_pid(pid),
                Box::new(move || cpus_allowed(pid)),
            )
        },
        ("pid 1".into(), apply_pid(1), Box::new(|| cpus_allowed(1))),
        (
            "a kernel thread".into(),
            apply_pid(kthreadd),
            Box::new(move || cpus_allowed(kthreadd)),
        ),
        {
            let pid = rig.agent.child.id();
            (
                "the agent itself".into(),
                apply_pid(pid),
                Box::new(move || cpus_allowed(pid)),
            )
        },
        {
            let rel = other.dir.file_name().unwrap().to_str().unwrap().to_string();
            let dir = other.dir.clone();
            (
                "a cgroup outside the roots".into(),
                apply_cgroup(&rel),
                Box::new(move || std::fs::read_to_string(dir.join("cpuset.cpus")).unwrap()),
            )
        },
    ];
    for (what, target, read) in &cases {
        let before = read();
        let e = lease(&c, "refused", target.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{what}: {e:?}");
        assert!(e.message().starts_with("apply:"), "{what}: {}", e.message());
        assert_eq!(read(), before, "{what}: the machine changed");
        assert!(leases(&c).await.is_empty(), "{what}: a lease was left");
    }
    for p in [&mut outside, &mut plain] {
        let _ = p.kill();
        let _ = p.wait();
    }
}

/// The agent obeys only a server it can trust: over plaintext, without
/// `--insecure-apply`, a grant naming a process is refused (whoever sent
/// it: a server that took the address could), and the process keeps its
/// CPUs. A lease without a target is still recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plaintext_agent_without_insecure_apply_pins_nothing() {
    let Some(root) = TestCgroup::new("plaintext") else {
        return;
    };
    let addr = format!("127.0.0.1:{}", free_port());
    let server_state = StateDir::new("plaintext-server");
    let _server = start_server(&addr, &server_state);
    let _agent = Agent::spawn(
        &addr,
        &[
            "--node-id",
            NODE,
            "--interval-ms",
            "100",
            "--apply-cgroup-root",
            root.path(),
        ],
    );
    let c = Client::connect(&addr).await.unwrap();
    wait_fresh(&c).await;
    let mut child = root.sleeper(120);
    let before = cpus_allowed(child.id());
    let e = lease(&c, "victim", apply_pid(child.id()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("--insecure-apply"), "{}", e.message());
    assert_eq!(cpus_allowed(child.id()), before, "the process was pinned");
    assert!(leases(&c).await.is_empty(), "a refused lease was left");
    let recorded = lease(&c, "no-target", None)
        .await
        .expect("a lease without a target");
    assert_eq!(leases(&c).await.len(), 1, "{recorded:?}");
    let _ = child.kill();
    let _ = child.wait();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_registration_holding_more_leases_than_a_node_can_hold_is_refused_by_name() {
    let server = Server::start(&[]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let held: Vec<pb::LeaseGrant> = (1..=4097u64)
        .map(|i| pb::LeaseGrant {
            lease_id: 7_000_000_000 + i,
            cpus: "0".into(),
            owner: "spiffe://fairplace/orchestrator/o".into(),
            ttl_ms: 30_000,
            expires_at_unix_ms: now + 30_000,
            granted_at_unix_ms: now,
            ..Default::default()
        })
        .collect();
    let reg = pb::Register {
        node_id: "hoarder".into(),
        topology: Some(topology(1, 1, 2, 2)),
        held_leases: held,
        ..Default::default()
    };
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let e = Reporter::register_with(ch, reg)
        .await
        .err()
        .expect("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message().starts_with("register.held_leases:"),
        "{}",
        e.message()
    );
    let c = Client::connect(&server.grpc).await.unwrap();
    assert_eq!(
        c.get_node("hoarder").await.unwrap_err().code(),
        Code::NotFound
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_allocate_cpus_whose_caller_went_away_leaves_no_lease() {
    let server = Server::start(&[]);
    // A node whose agent never answers a grant: the allocation waits for it.
    let mut silent = Reporter::register(&server.grpc, "silent", topology(1, 1, 2, 2))
        .await
        .unwrap();
    silent
        .update(1, true, states(4, &[]), "silent")
        .await
        .unwrap();
    let mut impatient = Client::connect(&server.grpc).await.unwrap();
    impatient.deadline = Duration::from_millis(300);
    // One call, not the library's retries with its request id: the caller
    // goes away for good.
    impatient.attempts = 1;
    let e = impatient
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: "silent".into(),
            count: 1,
            ttl_ms: 3_600_000,
            apply: apply_pid(std::process::id()),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert!(
        matches!(e.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{e:?}"
    );
    // Released when the call was dropped, not an hour later (and before
    // the server's own 1.5 s wait for the agent would have ended it).
    let c = Client::connect(&server.grpc).await.unwrap();
    let t0 = Instant::now();
    loop {
        let n = c.get_node("silent").await.unwrap();
        if n.leases.is_empty() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_millis(1000),
            "the lease outlived its call: {:?}",
            n.leases
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let metrics = http_get(&server.metrics);
    assert!(
        metrics.contains("fairplace_leases_ended_total{how=\"abandoned\"} 1"),
        "{}",
        metrics
            .lines()
            .filter(|l| l.contains("ended"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_or_expired_lease_gives_the_process_its_cpus_back() {
    let Some(root) = TestCgroup::new("undo") else {
        return;
    };
    let (_rig, c) = Rig::start(&root).await;
    let mut sleeper = root.sleeper(120);
    let pid = sleeper.id();
    let before = cpus_allowed(pid);
    // Released by its owner.
    let r = lease(&c, "released", apply_pid(pid)).await.unwrap();
    assert_eq!(cpus_allowed(pid), r.cpus);
    c.release_cpus(r.lease_id).await.unwrap();
    wait_until(
        Duration::from_secs(5),
        "the CPUs are back after the release",
        || async { cpus_allowed(pid) == before },
    )
    .await;
    // Expired (one second, never renewed).
    let r = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: NODE.into(),
            count: 1,
            ttl_ms: 1_000,
            apply: apply_pid(pid),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(cpus_allowed(pid), r.cpus);
    wait_until(
        Duration::from_secs(5),
        "the CPUs are back after the expiry",
        || async { cpus_allowed(pid) == before },
    )
    .await;
    assert!(leases(&c).await.is_empty());
    let _ = sleeper.kill();
    let _ = sleeper.wait();
}
