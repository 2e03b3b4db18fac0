//! What every subcommand shares: starting and stopping the server under
//! test, connections to it, registering simulated nodes, and the measured
//! phases (many callers back to back for a fixed time, merged into one
//! latency histogram, printed as throughput and percentiles).
//!
//! Each subcommand measures something else, but they must all measure it
//! the same way: one server start (limits raised for a generator that
//! stands for many clients), one way to run a phase, one way to print it,
//! so that their figures compare within and across runs.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use fairplace_client::{Client, TlsOptions, pb};
use hdrhistogram::Histogram;
use pb::agent_message::Body;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use fairplace_benches::load::{states, topology};

/// Where every server of a run goes: `--server-cpus` (a taskset cpulist,
/// empty: anywhere) and `--server-threads` (0: one per CPU).
pub struct Launch {
    pub cpus: String,
    pub threads: usize,
}

impl Launch {
    /// This build's server, with the load phases' raised limits.
    pub fn start(&self) -> Server {
        Server::start(&self.cpus, self.threads)
    }
}

/// A running `fairplace-server`, killed (and its files removed) on drop.
pub struct Server {
    pub child: Child,
    pub grpc: String,
    pub metrics: String,
    /// Mutual TLS: the PKI's directory and the orchestrator's and node's
    /// client settings.
    pub tls: Option<(std::path::PathBuf, TlsOptions, TlsOptions)>,
    /// Its own lease store directory, removed with it.
    state: Option<std::path::PathBuf>,
}

impl Server {
    /// This build's server, plaintext, with the load phases' limits.
    pub fn start(cpus: &str, threads: usize) -> Server {
        Self::start_with(cpus, threads, &[])
    }

    /// A server on mutual TLS, with a PKI made in a temporary directory.
    pub fn start_mtls(cpus: &str, threads: usize) -> Server {
        use fairplace::offline::pki::{Ca, Leaf};
        let dir = std::env::temp_dir().join(format!("fairplace-load-pki-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Ca::new("fairplace-load CA").unwrap();
        ca.pem.write(&dir, "ca").unwrap();
        let localhost = std::net::IpAddr::from([127, 0, 0, 1]);
        ca.issue(&Leaf::server("fairplace", &["localhost"], &[localhost]))
            .unwrap()
            .write(&dir, "server")
            .unwrap();
        let client = |role: &str, name: &str| {
            ca.issue(&Leaf::client("fairplace", role, name))
                .unwrap()
                .write(&dir, role)
                .unwrap();
            TlsOptions {
                ca: Some(dir.join("ca.crt")),
                cert: Some(dir.join(format!("{role}.crt"))),
                key: Some(dir.join(format!("{role}.key"))),
                server_name: None,
            }
        };
        let orch = client("orchestrator", "load");
        let node = client("node", "load");
        let p = |f: &str| dir.join(f).display().to_string();
        let args = [
            "--tls-cert".to_string(),
            p("server.crt"),
            "--tls-key".into(),
            p("server.key"),
            "--client-ca".into(),
            p("ca.crt"),
        ];
        let mut s = Self::start_with(cpus, threads, &args);
        s.tls = Some((dir, orch, node));
        s
    }

    /// A connection as an orchestrator (with mutual TLS when the server has
    /// it).
    pub async fn channel(&self) -> Channel {
        match &self.tls {
            None => channel(&self.grpc).await,
            Some((_, orch, _)) => tls_channel(&self.grpc, orch).await,
        }
    }

    /// A connection as node `load`'s agent.
    pub async fn node_channel(&self) -> Channel {
        match &self.tls {
            None => channel(&self.grpc).await,
            Some((_, _, node)) => tls_channel(&self.grpc, node).await,
        }
    }

    /// A server for the load phases: its limits raised where one
    /// generator stands for many clients (thousands of simulated agents
    /// over a few connections, every caller in flight at once).
    pub fn start_with(cpus: &str, threads: usize, extra: &[String]) -> Server {
        let exe = std::env::current_exe().expect("own path");
        Self::start_bin(
            &exe.with_file_name("fairplace-server"),
            cpus,
            threads,
            extra,
        )
    }

    /// [`Server::start_with`] of the server binary `bin`.
    pub fn start_bin(
        bin: &std::path::Path,
        cpus: &str,
        threads: usize,
        extra: &[String],
    ) -> Server {
        let mut args: Vec<String> = [
            "--stale-after-ms",
            "3600000",
            "--max-concurrency",
            "100000",
            "--max-message-bytes",
            "67108864",
            "--max-streams-per-connection",
            "100000",
        ]
        .map(String::from)
        .to_vec();
        args.extend_from_slice(extra);
        Self::spawn_bin(bin, cpus, threads, &args)
    }

    /// A server with its own defaults but for `extra`.
    pub fn spawn(cpus: &str, threads: usize, extra: &[String]) -> Server {
        let exe = std::env::current_exe().expect("own path");
        Self::spawn_bin(
            &exe.with_file_name("fairplace-server"),
            cpus,
            threads,
            extra,
        )
    }

    /// [`Server::spawn`] of the server binary `bin` (another build's).
    pub fn spawn_bin(
        bin: &std::path::Path,
        cpus: &str,
        threads: usize,
        extra: &[String],
    ) -> Server {
        let bin = bin.to_path_buf();
        assert!(
            bin.exists(),
            "{bin:?} not found: cargo build --release -p fairplace-server first"
        );
        let state = state_dir_unless_named(extra);
        let mut cmd = if cpus.is_empty() {
            Command::new(bin)
        } else {
            let mut c = Command::new("taskset");
            c.args(["-c", cpus]).arg(bin);
            c
        };
        let mut child = cmd
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args(["--worker-threads".to_string(), threads.to_string()])
            .args(extra)
            .args(&state)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let grpc = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("grpc="))
            .expect("grpc address")
            .to_string();
        let metrics = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("metrics=http://"))
            .and_then(|w| w.split('/').next())
            .expect("metrics address")
            .to_string();
        Server {
            child,
            grpc,
            metrics,
            tls: None,
            state: state.get(1).map(std::path::PathBuf::from),
        }
    }

    /// The server's resident memory, KiB.
    pub fn rss_kib(&self) -> u64 {
        rss_of(self.child.id())
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some((dir, _, _)) = &self.tls {
            let _ = std::fs::remove_dir_all(dir);
        }
        if let Some(dir) = &self.state {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// One connection to `addr` over mutual TLS with `tls`' files.
async fn tls_channel(addr: &str, tls: &TlsOptions) -> Channel {
    tls.endpoint(addr)
        .expect("TLS endpoint")
        .tcp_nodelay(true)
        .connect()
        .await
        .expect("connect over TLS")
}

/// `n` plaintext connections to `addr`.
pub async fn channels(addr: &str, n: usize) -> Vec<Channel> {
    let mut chans = Vec::with_capacity(n);
    for _ in 0..n {
        chans.push(channel(addr).await);
    }
    chans
}

/// One plaintext connection to `addr`.
pub async fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .expect("connect")
}

/// A node's stream: register, then send updates and count acks.
pub struct NodeStream {
    pub tx: mpsc::Sender<pb::AgentMessage>,
    pub acks: tonic::Streaming<pb::Ack>,
}

/// The node "load" every RPC phase places on: 128 CPUs registered and one
/// full update acknowledged. Its stream stays open while the value lives.
pub async fn load_node(ch: Channel) -> NodeStream {
    let mut node = register(ch, "load", 128).await;
    node.tx.send(update(1, true, states(128, 7))).await.unwrap();
    node.acks.message().await.unwrap().unwrap();
    node
}

/// `n` placement clients, each on its own connection.
pub async fn clients(server: &Server, n: usize) -> Vec<Client> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(Client::from_channel(server.channel().await));
    }
    clients
}

/// Registers node `id` with the load topology of `cpus` CPUs.
pub async fn register(ch: Channel, id: &str, cpus: u32) -> NodeStream {
    register_node(ch, id, topology(cpus), Default::default()).await
}

/// Registers nodes `{prefix}-0` to `{prefix}-{nodes - 1}` of `cpus` CPUs
/// one after the other, spread over `chans`, each with one full snapshot
/// acknowledged; their streams stay open while the values live.
pub async fn register_nodes(
    chans: &[Channel],
    prefix: &str,
    nodes: usize,
    cpus: u32,
) -> Vec<NodeStream> {
    let mut streams = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let mut s = register(
            chans[i % chans.len()].clone(),
            &format!("{prefix}-{i}"),
            cpus,
        )
        .await;
        s.tx.send(update(1, true, states(cpus, i as u64 + 1)))
            .await
            .unwrap();
        s.acks.message().await.unwrap().unwrap();
        streams.push(s);
    }
    streams
}

/// Opens a Report stream and registers node `id`; returns once the
/// server acknowledged the registration.
pub async fn register_node(
    ch: Channel,
    id: &str,
    topology: pb::Topology,
    labels: std::collections::HashMap<String, String>,
) -> NodeStream {
    let mut client = pb::agent_service_client::AgentServiceClient::new(ch)
        .max_encoding_message_size(64 << 20)
        .max_decoding_message_size(64 << 20);
    let (tx, rx) = mpsc::channel(64);
    tx.send(pb::AgentMessage {
        body: Some(Body::Register(pb::Register {
            node_id: id.into(),
            labels,
            topology: Some(topology),
            agent_version: "load".into(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut acks = client
        .report(ReceiverStream::new(rx))
        .await
        .expect("report")
        .into_inner();
    acks.message().await.expect("ack").expect("registered");
    NodeStream { tx, acks }
}

/// An agent's Update message of `cpus`' states.
pub fn update(seq: u64, full: bool, cpus: Vec<pb::CpuState>) -> pb::AgentMessage {
    pb::AgentMessage {
        body: Some(Body::Update(pb::Update {
            seq,
            full,
            cpus,
            node_id: String::new(),
            ..Default::default()
        })),
    }
}

/// `concurrency` callers spread over the clients call `call` back to back
/// for `seconds`; returns the latencies of the calls that succeeded, the
/// failures and the phase's length in seconds.
pub async fn run_phase<C, F, Fut>(
    clients: &[C],
    concurrency: usize,
    seconds: u64,
    call: F,
) -> (Histogram<u64>, u64, f64)
where
    C: Clone + Send + 'static,
    F: Fn(C, usize) -> Fut + Send + Sync + Clone + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..concurrency {
        let c = clients[i % clients.len()].clone();
        let stop = Arc::clone(&stop);
        let call = call.clone();
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let mut errors = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                if call(c.clone(), i).await {
                    h.record(t0.elapsed().as_nanos() as u64).unwrap();
                } else {
                    errors += 1;
                }
            }
            (h, errors)
        }));
    }
    measure(tasks, &stop, seconds).await
}

/// Lets the phase's tasks run for `seconds`, stops them, and merges what
/// they recorded: latencies, failures, and the seconds it ran.
pub async fn measure(
    tasks: Vec<tokio::task::JoinHandle<(Histogram<u64>, u64)>>,
    stop: &AtomicBool,
    seconds: u64,
) -> (Histogram<u64>, u64, f64) {
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let mut errors = 0;
    for t in tasks {
        let (h, e) = t.await.unwrap();
        all.add(h).unwrap();
        errors += e;
    }
    (all, errors, t0.elapsed().as_secs_f64())
}

/// The first update of a node in an in-process store: `cpus`' states as
/// the service converts an agent's.
pub fn store_update(cpus: &[pb::CpuState]) -> fairplace::store::Update {
    fairplace::store::Update {
        seq: 1,
        full: true,
        cpus: cpus
            .iter()
            .map(|c| {
                (
                    c.id,
                    fairplace::convert::cpu_state(c, 1024).expect("in range"),
                )
            })
            .collect(),
        ..fairplace::store::Update::default()
    }
}

/// One call of a ping-or-pick phase: the no-op Ping in the "ping" phase,
/// else `req` as a PickCpu; whether it succeeded.
pub async fn ping_or_pick(c: Client, phase: &str, req: pb::PickCpuRequest) -> bool {
    if phase == "ping" {
        c.ping().await.is_ok()
    } else {
        c.pick_cpu(req).await.is_ok()
    }
}

/// Prints one phase's line (throughput, latency percentiles, failures)
/// and returns its throughput in calls per second.
pub fn print_phase(phase: &str, all: &Histogram<u64>, errors: u64, secs: f64) -> f64 {
    let rps = all.len() as f64 / secs;
    println!(
        "{phase}: {rps:.0} req/s, p50 {:.1} µs, p99 {:.1} µs, p99.9 {:.1} µs, errors {errors}",
        pct(all, 0.5),
        pct(all, 0.99),
        pct(all, 0.999)
    );
    rps
}

/// A fresh `--state-dir` for a server, unless `extra` chooses its lease
/// store: load runs never share (or leave behind) a lease store.
fn state_dir_unless_named(extra: &[String]) -> Vec<String> {
    if extra
        .iter()
        .any(|a| a == "--lease-store" || a == "--state-dir")
    {
        return Vec::new();
    }
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = std::env::temp_dir().join(format!(
        "fairplace-load-state-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    vec!["--state-dir".into(), dir.display().to_string()]
}

/// Quantile `q` of `h`, from nanoseconds to microseconds.
pub fn pct(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

/// The body of an HTTP/1.0 GET of `url` (empty if it cannot connect).
pub fn http_body(url: &str) -> String {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_string()), |(h, p)| (h, format!("/{p}")));
    let Ok(mut s) = std::net::TcpStream::connect(host) else {
        return String::new();
    };
    let _ = write!(s, "GET {path} HTTP/1.0\r\nHost: {host}\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body
}

/// PickCpu for the node `load`, a wakeup.
fn load_pick() -> pb::PickCpuRequest {
    pb::PickCpuRequest {
        node_id: "load".into(),
        task: Some(pb::Task {
            prev_cpu: Some(17),
            ..Default::default()
        }),
        kind: pb::RequestKind::Wakeup as i32,
        this_cpu: 3,
        ..Default::default()
    }
}

/// One caller, back to back for `secs`: Ping then PickCpu, what a probe or
/// an orchestrator sees; their latencies (ns) and the errors.
pub async fn probe_latency(probe: &Client, secs: u64) -> (Histogram<u64>, Histogram<u64>, u64) {
    let mut ping = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let mut pickh = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let mut errors = 0u64;
    let end = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < end {
        let t0 = Instant::now();
        match probe.ping().await {
            Ok(()) => ping.record(t0.elapsed().as_nanos() as u64).unwrap(),
            Err(_) => errors += 1,
        }
        let t0 = Instant::now();
        match probe.pick_cpu(load_pick()).await {
            Ok(_) => pickh.record(t0.elapsed().as_nanos() as u64).unwrap(),
            Err(_) => errors += 1,
        }
    }
    (ping, pickh, errors)
}

/// Resident memory of process `pid`, KiB (0 if `/proc` does not say).
pub fn rss_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// One lease's life: AllocateCpus, then ReleaseCpus of what it granted.
pub async fn allocate_release(c: &Client, count: u32, policy: String) -> bool {
    let r = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: "load".into(),
            count,
            policy,
            holder: "fairplace-load".into(),
            ..Default::default()
        })
        .await;
    match r {
        Ok(r) => c.release_cpus(r.lease_id).await.is_ok(),
        Err(_) => false,
    }
}
