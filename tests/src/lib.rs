//! Shared helpers for the end-to-end tests: the real binaries, started on
//! loopback with free ports, and stopped when dropped.

pub mod etcd;
pub mod faults;
pub mod history;
pub mod partition;
pub mod slurm;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The workspace's target directory for the running profile.
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable");
    // target/<profile>/deps/<test> -> target/<profile>; a binary of this
    // crate (target/<profile>/<bin>) is there already.
    let dir = exe.parent().expect("target dir");
    match dir.file_name() {
        Some(d) if d == "deps" => dir.parent().expect("target dir").to_path_buf(),
        _ => dir.to_path_buf(),
    }
}

/// Path of one of the workspace's binaries, built once per test run;
/// with `FAIRPLACE_BIN_DIR`, that folder's (another build's binaries: the
/// fault suite run against an earlier version, say), built by nobody here.
pub fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("FAIRPLACE_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let release = bin_dir().ends_with("release");
        let mut cmd = Command::new(env!("CARGO"));
        // The same targets `cargo test --workspace` builds, so the features
        // unify the same way: after a workspace test build this is a no-op,
        // not a relink of every binary against another set of features.
        // `--lib` for the libraries Slurm loads (the SPANK plugin).
        cmd.args(["build", "--workspace", "--lib", "--bins", "--tests"]);
        // With the BPF source under test, the agent is built with it (the
        // test run itself was started with `--features fairplace-e2e/bpf`).
        if cfg!(feature = "bpf") {
            cmd.args(["--features", "fairplace-e2e/bpf"]);
        }
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "building the binaries failed");
    });
    bin_dir().join(name)
}

/// Where a started binary's stderr goes: a file `NAME-PID.log` (PID of the
/// test process) in the folder `FAIRPLACE_TEST_LOGS` names, so a failing
/// end-to-end test's server and agent logs can be read afterwards; otherwise
/// nowhere.
fn log_sink(name: &str) -> Stdio {
    let Some(dir) = std::env::var_os("FAIRPLACE_TEST_LOGS") else {
        return Stdio::null();
    };
    let path = Path::new(&dir).join(format!("{name}-{}.log", std::process::id()));
    match std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
    {
        Ok(f) => Stdio::from(f),
        Err(e) => panic!("FAIRPLACE_TEST_LOGS: cannot open {}: {e}", path.display()),
    }
}

/// A fresh directory under the system's temporary one, for one server's
/// lease store or one agent's checkpoint; removed by [`StateDir`]'s drop.
pub struct StateDir(pub PathBuf);

impl StateDir {
    pub fn new(what: &str) -> StateDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let d =
            std::env::temp_dir().join(format!("fairplace-test-{what}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("state dir");
        StateDir(d)
    }

    pub fn path(&self) -> &str {
        self.0.to_str().expect("utf-8 temp dir")
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running `fairplace-server serve`.
pub struct Server {
    pub child: Child,
    pub grpc: String,
    pub metrics: String,
    /// The plaintext health-only listener (`--health-addr`).
    pub health: Option<String>,
    /// Its own lease store, when the caller named none.
    pub state: Option<StateDir>,
}

impl Server {
    /// A server on free ports, with a lease store of its own (a fresh
    /// temporary `--state-dir`) unless `extra` names one.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_env(extra, &[])
    }

    /// [`Server::start`] with `env` set for the server (a preloaded
    /// libfaketime, say).
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let named = extra
            .iter()
            .any(|a| *a == "--state-dir" || *a == "--lease-store");
        let state = (!named).then(|| StateDir::new("server"));
        let mut args: Vec<&str> = extra.to_vec();
        if let Some(d) = &state {
            args.extend(["--state-dir", d.path()]);
        }
        let mut s = Server::spawn(&args, env);
        s.state = state;
        s
    }

    fn spawn(extra: &[&str], env: &[(&str, &str)]) -> Server {
        let mut child = Command::new(bin("fairplace-server"))
            .envs(env.iter().copied())
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(log_sink("server"))
            .spawn()
            .expect("start fairplace-server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("server prints its addresses");
        let grpc = field(&line, "grpc=").expect("grpc address");
        let metrics = field(&line, "metrics=").expect("metrics address");
        let health = field(&line, "health=");
        Server {
            child,
            grpc,
            metrics,
            health,
            state: None,
        }
    }

    /// SIGTERM, then wait for the graceful exit.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        send_signal(self.child.id(), 15);
        self.wait()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits for the server to exit (after a signal sent by the caller).
    pub fn wait(&mut self) -> std::process::ExitStatus {
        self.child.wait().expect("server exits")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .map(str::to_string)
}

/// Sends signal `sig` to the one process `pid`.
///
/// Through kill(2), never the `kill` command: procps-ng 4.0.2's `kill -9
/// -PGID` reads the group as its first digit, so a group whose id starts
/// with 1 became kill(-1, SIGKILL), every process on the machine.
pub fn send_signal(pid: u32, sig: i32) {
    // A pid of 0 or one above i32::MAX would name a group or everyone.
    let Ok(pid) = i32::try_from(pid) else { return };
    if pid > 0 {
        // SAFETY: kill(2) takes no pointers; pid names one process.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Sends signal `sig` to every process of the process group `pgid`.
pub fn send_signal_to_group(pgid: u32, sig: i32) {
    let Ok(pgid) = i32::try_from(pgid) else {
        return;
    };
    // Group 0 is the caller's own and 1 would read as "everyone" once
    // negated: neither is a workload's group.
    if pgid > 1 {
        // SAFETY: kill(2) takes no pointers; -pgid names one group.
        unsafe { libc::kill(-pgid, sig) };
    }
}

/// A running `fairplace-agent`.
pub struct Agent {
    pub child: Child,
    /// Its own checkpoint directory, when the caller named none.
    pub state: Option<StateDir>,
}

impl Agent {
    /// An agent with a checkpoint of its own (a fresh temporary
    /// `--state-dir`) unless `args` names one; over plaintext (no
    /// `--tls-ca`) it applies leases (`--insecure-apply`), as a local trial
    /// does.
    pub fn start(server: &str, args: &[&str]) -> Agent {
        let mut args = args.to_vec();
        if !args.contains(&"--tls-ca") {
            args.push("--insecure-apply");
        }
        Agent::spawn(server, &args)
    }

    /// An agent with exactly these flags (and its own checkpoint unless
    /// `args` names one).
    pub fn spawn(server: &str, args: &[&str]) -> Agent {
        Agent::spawn_through(&[], server, args)
    }

    /// An agent with exactly these flags, started by `wrapper`: a command
    /// line that ends by running the agent's, given as its last arguments
    /// (e.g. `unshare --cgroup`, or `sh -c '...; exec "$@"' sh`).
    pub fn spawn_through(wrapper: &[&str], server: &str, args: &[&str]) -> Agent {
        let state = (!args.contains(&"--state-dir")).then(|| StateDir::new("agent"));
        let agent = bin("fairplace-agent");
        let mut cmd = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut c = Command::new(program);
                c.args(rest).arg(&agent);
                c
            }
            None => Command::new(&agent),
        };
        cmd.args(["--server", server]).args(args);
        if let Some(d) = &state {
            cmd.args(["--state-dir", d.path()]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(log_sink("agent"))
            .spawn()
            .expect("start fairplace-agent");
        Agent { child, state }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs the `fairplace` CLI and returns (exit code, stdout, stderr).
pub fn cli(server: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin("fairplace"))
        .args(["--server", server])
        .args(args)
        .output()
        .expect("run fairplace");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Polls `f` until it returns Some, or panics after `limit`.
pub fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let t0 = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// GET over plain HTTP/1.0 (for /metrics).
pub fn http_get(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let mut s = std::net::TcpStream::connect(host).expect("connect to metrics");
    write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    body.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or(body)
}

pub use fairplace_proto::v1 as pb;

pub mod tls;
use pb::agent_message::Body;
use tokio::sync::mpsc;

/// A hand-driven agent stream: the test decides every message.
pub struct Reporter {
    pub tx: mpsc::Sender<pb::AgentMessage>,
    pub acks: tonic::Streaming<pb::Ack>,
}

impl Reporter {
    /// Opens a Report stream and registers `node_id` with `topology`;
    /// returns the stream, or the status the server answered with.
    pub async fn register(
        server: &str,
        node_id: &str,
        topology: pb::Topology,
    ) -> Result<Reporter, tonic::Status> {
        Self::register_labelled(server, node_id, topology, &[("zone", "z1")]).await
    }

    /// Like `register`, with the given labels.
    pub async fn register_labelled(
        server: &str,
        node_id: &str,
        topology: pb::Topology,
        labels: &[(&str, &str)],
    ) -> Result<Reporter, tonic::Status> {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{server}"))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        Self::register_on(ch, node_id, topology, labels).await
    }

    /// Like `register_labelled`, on a channel made by the caller (over TLS).
    pub async fn register_on(
        ch: tonic::transport::Channel,
        node_id: &str,
        topology: pb::Topology,
        labels: &[(&str, &str)],
    ) -> Result<Reporter, tonic::Status> {
        let reg = pb::Register {
            node_id: node_id.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            topology: Some(topology),
            agent_version: "test".into(),
            ..Default::default()
        };
        Reporter::register_with(ch, reg).await
    }

    /// Opens a Report stream with `reg` as its registration, whatever it
    /// holds.
    pub async fn register_with(
        ch: tonic::transport::Channel,
        reg: pb::Register,
    ) -> Result<Reporter, tonic::Status> {
        let mut client = pb::agent_service_client::AgentServiceClient::new(ch);
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::AgentMessage {
            body: Some(Body::Register(reg)),
        })
        .await
        .unwrap();
        let mut acks = client
            .report(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        match acks.message().await {
            Ok(Some(_)) => Ok(Reporter { tx, acks }),
            Ok(None) => Err(tonic::Status::unknown("stream closed")),
            Err(s) => Err(s),
        }
    }

    /// Sends an update and returns the server's answer to it.
    pub async fn update(
        &mut self,
        seq: u64,
        full: bool,
        cpus: Vec<pb::CpuState>,
        node_id: &str,
    ) -> Result<pb::Ack, tonic::Status> {
        self.send(pb::Update {
            seq,
            full,
            cpus,
            node_id: node_id.into(),
            ..Default::default()
        })
        .await
    }

    /// Sends any update and returns the server's answer to it.
    pub async fn send(&mut self, u: pb::Update) -> Result<pb::Ack, tonic::Status> {
        self.tx
            .send(pb::AgentMessage {
                body: Some(Body::Update(u)),
            })
            .await
            .map_err(|_| tonic::Status::unavailable("stream closed"))?;
        match self.acks.message().await {
            Ok(Some(a)) => Ok(a),
            Ok(None) => Err(tonic::Status::unknown("stream closed")),
            Err(s) => Err(s),
        }
    }
}

/// `nodes` x `llcs` LLCs x `cores` cores x `smt` threads, packed numbering.
pub fn topology(nodes: u32, llcs: u32, cores: u32, smt: u32) -> pb::Topology {
    let mut cpus = vec![];
    for node in 0..nodes {
        for l in 0..llcs {
            let llc = node * llcs + l;
            for c in 0..cores {
                for _ in 0..smt {
                    cpus.push(pb::CpuTopology {
                        id: cpus.len() as u32,
                        core: llc * cores + c,
                        cluster: None,
                        llc,
                        node,
                        capacity: 1024,
                    });
                }
            }
        }
    }
    pb::Topology {
        cpus,
        numa_distance: vec![],
    }
}

/// Every CPU online and idle, except `busy` (one task, util 600).
pub fn states(n: u32, busy: &[u32]) -> Vec<pb::CpuState> {
    (0..n)
        .map(|i| {
            let b = busy.contains(&i);
            pb::CpuState {
                id: i,
                online: true,
                nr_running: b as u32,
                load_avg: if b { 700 } else { 0 },
                runnable_avg: if b { 700 } else { 0 },
                util_avg: if b { 600 } else { 0 },
                util_est: if b { 600 } else { 0 },
                ..Default::default()
            }
        })
        .collect()
}

/// The scenario (format v1) of a node as GetNode shows it, with a task and a
/// request added by the caller: what `decide` must answer like PickCpu.
pub fn scenario_of(node: &pb::GetNodeResponse) -> serde_json::Value {
    use serde_json::json;
    let topo = node.topology.as_ref().expect("topology");
    let tcpus: Vec<_> = topo
        .cpus
        .iter()
        .map(|c| {
            let mut v = json!({"id": c.id, "core": c.core, "llc": c.llc, "node": c.node, "capacity": c.capacity});
            if let Some(cl) = c.cluster {
                v["cluster"] = json!(cl);
            }
            v
        })
        .collect();
    let cpus: Vec<_> = node
        .cpus
        .iter()
        .map(|s| {
            json!({
                "id": s.id, "online": s.online, "nr_running": s.nr_running, "h_nr_idle": s.h_nr_idle,
                "nr_delayed": s.nr_delayed, "cfs_h_nr_queued": s.cfs_h_nr_queued, "curr_is_idle": s.curr_is_idle,
                "ttwu_pending": s.ttwu_pending, "vcpu_preempted": s.vcpu_preempted, "load_avg": s.load_avg,
                "runnable_avg": s.runnable_avg, "util_avg": s.util_avg, "util_est": s.util_est,
                "capacity": s.capacity, "actual_capacity": s.actual_capacity,
                "idle_exit_latency": s.idle_exit_latency, "idle_stamp": s.idle_stamp,
                "curr_is_per_cpu_kthread": s.curr_is_per_cpu_kthread, "core_cookie": s.core_cookie
            })
        })
        .collect();
    let mut t = json!({"cpus": tcpus});
    if !topo.numa_distance.is_empty() {
        t["numa_distance"] = json!(
            topo.numa_distance
                .iter()
                .map(|r| r.distance.clone())
                .collect::<Vec<_>>()
        );
    }
    json!({"topology": t, "cpus": cpus})
}

/// A full update of `ncpus` CPUs where each `(cpu, k)` runs `k` nice-0
/// tasks of process 7 (load 1024 each, the first running, the others
/// queued 1 ms apart and cold), and every other CPU is idle.
pub fn tasks_update(seq: u64, ncpus: u32, busy: &[(u32, u32)]) -> pb::Update {
    let clock = 10_000_000_000i64;
    let mut cpus = Vec::new();
    let mut tasks = Vec::new();
    for id in 0..ncpus {
        let k = busy.iter().find(|(c, _)| *c == id).map_or(0, |(_, k)| *k);
        cpus.push(pb::CpuState {
            id,
            online: true,
            nr_running: k,
            load_avg: 1024 * k as i64,
            runnable_avg: 1024 * k as i64,
            util_avg: if k > 0 { 1000 } else { 0 },
            util_est: if k > 0 { 1000 } else { 0 },
            ..Default::default()
        });
        tasks.push(pb::CpuTasks {
            cpu: id,
            tasks: (0..k)
                .map(|j| pb::RunnableTask {
                    id: (id * 100 + j + 1) as u64,
                    group: 7,
                    load_avg: 1024,
                    util_avg: 1000 / k as i64,
                    runnable_avg: 1024,
                    running: j == 0,
                    exec_start: clock - 10_000_000 * j as i64,
                    nr_threads: 3,
                    ..Default::default()
                })
                .collect(),
            clock_task: clock,
        });
    }
    pb::Update {
        seq,
        full: true,
        cpus,
        tasks,
        ..Default::default()
    }
}

/// A real v1 cpuset cgroup for a test, `/sys/fs/cgroup/cpuset/NAME`, with
/// its parent's CPUs and memory nodes; its processes are moved back to the
/// root cpuset and it is removed on drop. `None` (with the reason printed)
/// where this machine cannot make one: the test then says SKIPPED.
pub struct TestCgroup {
    pub dir: PathBuf,
}

/// Where the v1 cpuset controller is mounted.
pub const CPUSET_ROOT: &str = "/sys/fs/cgroup/cpuset";

impl TestCgroup {
    pub fn new(tag: &str) -> Option<TestCgroup> {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let root = std::path::Path::new(CPUSET_ROOT);
        let dir = root.join(format!("fairplace-e2e-{tag}-{}-{n}", std::process::id()));
        let made = std::fs::create_dir(&dir).and_then(|()| {
            for f in ["cpuset.mems", "cpuset.cpus"] {
                let v = std::fs::read_to_string(root.join(f))?;
                std::fs::write(dir.join(f), v.trim())?;
            }
            Ok(())
        });
        match made {
            Ok(()) => Some(TestCgroup { dir }),
            Err(e) => {
                eprintln!(
                    "SKIPPED: no v1 cpuset cgroup can be made here ({}: {e})",
                    dir.display()
                );
                let _ = std::fs::remove_dir(&dir);
                None
            }
        }
    }

    pub fn path(&self) -> &str {
        self.dir.to_str().expect("utf-8 cgroup path")
    }

    /// Moves process `pid` (all its threads) into the cgroup.
    pub fn add(&self, pid: u32) {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string()).expect("join the cgroup");
    }

    /// A `sleep` started inside the cgroup.
    pub fn sleeper(&self, secs: u32) -> Child {
        let c = Command::new("sleep")
            .arg(secs.to_string())
            .spawn()
            .expect("sleep");
        self.add(c.id());
        c
    }

    /// A cgroup inside this one, with its CPUs and memory nodes; dropped
    /// (its processes moved to the root cpuset) like this one, so declare
    /// it after its parent.
    pub fn child(&self, name: &str) -> TestCgroup {
        let dir = self.dir.join(name);
        std::fs::create_dir(&dir).expect("make a child cpuset");
        for f in ["cpuset.mems", "cpuset.cpus"] {
            let v = std::fs::read_to_string(self.dir.join(f)).expect("the parent's cpuset");
            std::fs::write(dir.join(f), v.trim()).expect("the child's cpuset");
        }
        TestCgroup { dir }
    }

    /// The cgroup's cpuset.cpus as the kernel shows it.
    pub fn cpus(&self) -> String {
        std::fs::read_to_string(self.dir.join("cpuset.cpus"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let procs = std::fs::read_to_string(self.dir.join("cgroup.procs")).unwrap_or_default();
        for p in procs.lines() {
            let _ = std::fs::write(std::path::Path::new(CPUSET_ROOT).join("cgroup.procs"), p);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The CPUs process `pid` may run on, from `/proc/PID/status`.
pub fn cpus_allowed(pid: u32) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A two-worker runtime for a test's client side.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Resident memory of process `pid` (VmRSS), in KiB; 0 once it is gone.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A free loopback port (bound, then closed), for a server that must come
/// back on the same address.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}
