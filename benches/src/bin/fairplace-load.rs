//! Load generator for the fairplace service, on loopback only.
//!
//! Starts the release `fairplace-server` next to this binary on a free port,
//! then one of:
//! - `rpc`: PickCpu against a 128-CPU node, and in the same run the no-op
//!   AdminService.Ping (the framework's own limit), with many concurrent
//!   callers over several connections; throughput and p50/p99/p99.9. The
//!   unary calls come from a raw HTTP/2 caller (`wire.rs`: pre-framed
//!   requests, so the generator costs little and the server is the
//!   bottleneck), or with `--caller client` from the client library. With
//!   `--transport mtls` over mutual TLS (a PKI made here, an orchestrator
//!   certificate), with `both` plaintext then mutual TLS in one run.
//! - `ingest`: many nodes stream deltas as fast as the server acks them;
//!   applied CPU updates per second.
//! - `memory`: registers many nodes with a full snapshot each and reads the
//!   server's resident memory.
//! - `cache`: a 512-CPU node with 8 LLCs reports a 16-thread process's
//!   runtime on one LLC; task_cache_work runs with the full scan, then with
//!   SC_VISIT; the server's own `fairplace_cache_scan_cpus` histogram gives
//!   the CPUs each pass read.
//! - `cluster`: 10 zones x 20 racks x 50 nodes of 128 CPUs registered over
//!   agent streams, then PickCpu with no node (cluster placement) and the
//!   no-op Ping over gRPC, and in the same run the naive recomputation of
//!   the same cluster in this process.
//!
//! - `attack`: Ping and PickCpu latency on an idle server, then again while
//!   hostile clients run: callers flooding Decide with a 4,096-CPU topology,
//!   idle TCP connections that never send a preface, and calls to made-up
//!   method names; with the series count of /metrics before and after.
//!
//! Every loop is bounded in time and count and stops by itself.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use fairplace_client::{Client, TlsOptions, pb};
use hdrhistogram::Histogram;
use pb::agent_message::Body;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::{Channel, Endpoint};

use fairplace_benches::load::{states, topology, wakeup_on_load};

#[path = "fairplace-load/cost.rs"]
mod cost;
#[path = "fairplace-load/wire.rs"]
mod wire;

#[derive(Parser)]
#[command(
    name = "fairplace-load",
    about = "load benchmarks for the fairplace service (loopback only)"
)]
struct Args {
    /// Run the server on these CPUs only (taskset cpulist), e.g. 0, so it
    /// does not share cores with the generator; empty: anywhere.
    #[arg(long, default_value = "")]
    server_cpus: String,
    /// The server's runtime worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    server_threads: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// PickCpu and the no-op Ping, same server, same run.
    Rpc {
        #[arg(long, default_value_t = 8)]
        seconds: u64,
        #[arg(long, default_value_t = 8)]
        connections: usize,
        /// Concurrent callers in all.
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
        /// Claim the chosen CPU (a write per call).
        #[arg(long)]
        claim: bool,
        /// plain, mtls, or both (plaintext, then mutual TLS, same run).
        #[arg(long, default_value = "plain", value_parser = ["plain", "mtls", "both"])]
        transport: String,
        /// Who makes the unary calls: `raw`, pre-framed requests on hyper's
        /// HTTP/2 client (the server's own cost, the generator out of the
        /// way), or `client`, the fairplace client library (what an
        /// orchestrator using it sees; the generator then costs about as
        /// much per call as the server and shares the bottleneck).
        #[arg(long, default_value = "raw", value_parser = ["raw", "client"])]
        caller: String,
        /// How many different PickCpu requests the callers send (caller i
        /// sends request i mod N, each from another CPU of the node); 0:
        /// one per caller. Fewer requests decide from fewer CPUs, so their
        /// data stays in the server's caches: the difference shows what
        /// the decisions' spread over the node costs.
        #[arg(long, default_value_t = 0)]
        requests: usize,
    },
    /// AllocateCpus followed by its ReleaseCpus against the no-op Ping, on
    /// a server whose leases live in memory and on one that commits them
    /// to its lease store (--state-dir), same run, at each concurrency.
    Leases {
        #[arg(long, default_value_t = 8)]
        seconds: u64,
        #[arg(long, default_value_t = 8)]
        connections: usize,
        /// Concurrent callers, one measurement each (comma-separated).
        #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64])]
        concurrency: Vec<usize>,
        /// CPUs per lease (the node has 128: count x callers must fit).
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// The allocation policy.
        #[arg(long, default_value = "kernel")]
        policy: String,
        /// Another build's `fairplace-server` (an earlier version): every
        /// phase runs on it too, interleaved with this build's, and the
        /// last lines give this build's throughput over its.
        #[arg(long)]
        baseline: Option<std::path::PathBuf>,
    },
    /// Agent ingest: nodes stream deltas of all their CPUs.
    Ingest {
        #[arg(long, default_value_t = 1000)]
        nodes: usize,
        #[arg(long, default_value_t = 128)]
        cpus: u32,
        #[arg(long, default_value_t = 8)]
        seconds: u64,
        #[arg(long, default_value_t = 16)]
        connections: usize,
        /// Updates in flight per node.
        #[arg(long, default_value_t = 2)]
        window: usize,
    },
    /// task_cache_work's CPUs scanned per pass, full scan vs SC_VISIT, from
    /// the server's metrics.
    Cache {
        /// Reports (10 ms apart) per strategy.
        #[arg(long, default_value_t = 50)]
        reports: u32,
    },
    /// Cluster PickCpu (no node) over gRPC, Ping and the naive recomputation.
    Cluster {
        #[arg(long, default_value_t = 10)]
        zones: usize,
        #[arg(long, default_value_t = 20)]
        racks: usize,
        #[arg(long, default_value_t = 50)]
        nodes_per_rack: usize,
        #[arg(long, default_value_t = 128)]
        cpus: u32,
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        #[arg(long, default_value_t = 20)]
        connections: usize,
        #[arg(long, default_value_t = 32)]
        concurrency: usize,
    },
    /// Ping and PickCpu latency idle, then under a Decide flood, idle
    /// connections and unknown-method calls.
    Attack {
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Callers flooding Decide with the large topology.
        #[arg(long, default_value_t = 16)]
        deciders: usize,
        /// TCP connections opened and left silent.
        #[arg(long, default_value_t = 500)]
        idle_connections: usize,
        /// Calls to made-up method names.
        #[arg(long, default_value_t = 2000)]
        unknown_methods: usize,
    },
    /// Memory and Ping/PickCpu latency under a stream flood from one peer:
    /// health Watch streams and Report streams that never register, over
    /// many connections; on a server with its default limits, and in the
    /// same run on one with them lifted (the baseline).
    Flood {
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        /// Connections the flood opens (all from 127.0.0.1).
        #[arg(long, default_value_t = 1000)]
        connections: usize,
        /// Health Watch streams it asks for.
        #[arg(long, default_value_t = 40_000)]
        watches: usize,
        /// Report streams it opens and never registers.
        #[arg(long, default_value_t = 10_000)]
        reports: usize,
        /// Skip the server with its limits lifted.
        #[arg(long)]
        bounded_only: bool,
    },
    /// Replicas on etcd against one server, same run: PickCpu at the
    /// node's owner, through another replica (forwarded), and on a single
    /// server; AllocateCpus+ReleaseCpus with leases in etcd against the
    /// embedded store. Starts its own one-member etcd (`etcd` on the PATH,
    /// or FAIRPLACE_ETCD).
    Replicas {
        #[arg(long, default_value_t = 8)]
        seconds: u64,
        #[arg(long, default_value_t = 8)]
        connections: usize,
        #[arg(long, default_value_t = 64)]
        concurrency: usize,
    },
    /// Resident memory with many registered nodes.
    Memory {
        #[arg(long, default_value_t = 10_000)]
        nodes: usize,
        #[arg(long, default_value_t = 128)]
        cpus: u32,
        #[arg(long, default_value_t = 20)]
        connections: usize,
        /// Measure the store alone, in this process, without gRPC.
        #[arg(long)]
        in_process: bool,
        /// Spread the nodes over this many replicas on one etcd (each node
        /// registered at its owner) and report each replica's memory.
        #[arg(long, default_value_t = 0)]
        replicas: usize,
    },
}

struct Server {
    child: Child,
    grpc: String,
    metrics: String,
    /// Mutual TLS: the PKI's directory and the orchestrator's and node's
    /// client settings.
    tls: Option<(std::path::PathBuf, TlsOptions, TlsOptions)>,
    /// Its own lease store directory, removed with it.
    state: Option<std::path::PathBuf>,
}

impl Server {
    fn start(cpus: &str, threads: usize) -> Server {
        Self::start_with(cpus, threads, &[])
    }

    /// A server on mutual TLS, with a PKI made in a temporary directory.
    fn start_mtls(cpus: &str, threads: usize) -> Server {
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
    async fn channel(&self) -> Channel {
        match &self.tls {
            None => channel(&self.grpc).await,
            Some((_, orch, _)) => tls_channel(&self.grpc, orch).await,
        }
    }

    /// A connection as node `load`'s agent.
    async fn node_channel(&self) -> Channel {
        match &self.tls {
            None => channel(&self.grpc).await,
            Some((_, _, node)) => tls_channel(&self.grpc, node).await,
        }
    }

    /// A server for the load phases: its limits raised where one
    /// generator stands for many clients (thousands of simulated agents
    /// over a few connections, every caller in flight at once).
    fn start_with(cpus: &str, threads: usize, extra: &[String]) -> Server {
        let exe = std::env::current_exe().expect("own path");
        Self::start_bin(
            &exe.with_file_name("fairplace-server"),
            cpus,
            threads,
            extra,
        )
    }

    /// [`Server::start_with`] of the server binary `bin`.
    fn start_bin(bin: &std::path::Path, cpus: &str, threads: usize, extra: &[String]) -> Server {
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
    fn spawn(cpus: &str, threads: usize, extra: &[String]) -> Server {
        let exe = std::env::current_exe().expect("own path");
        Self::spawn_bin(
            &exe.with_file_name("fairplace-server"),
            cpus,
            threads,
            extra,
        )
    }

    /// [`Server::spawn`] of the server binary `bin` (another build's).
    fn spawn_bin(bin: &std::path::Path, cpus: &str, threads: usize, extra: &[String]) -> Server {
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

    fn rss_kib(&self) -> u64 {
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

async fn tls_channel(addr: &str, tls: &TlsOptions) -> Channel {
    tls.endpoint(addr)
        .expect("TLS endpoint")
        .tcp_nodelay(true)
        .connect()
        .await
        .expect("connect over TLS")
}

/// `n` plaintext connections to `addr`.
async fn channels(addr: &str, n: usize) -> Vec<Channel> {
    let mut chans = Vec::with_capacity(n);
    for _ in 0..n {
        chans.push(channel(addr).await);
    }
    chans
}

async fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .expect("connect")
}

/// A node's stream: register, then send updates and count acks.
struct NodeStream {
    tx: mpsc::Sender<pb::AgentMessage>,
    acks: tonic::Streaming<pb::Ack>,
}

/// The node "load" every RPC phase places on: 128 CPUs registered and one
/// full update acknowledged. Its stream stays open while the value lives.
async fn load_node(ch: Channel) -> NodeStream {
    let mut node = register(ch, "load", 128).await;
    node.tx.send(update(1, true, states(128, 7))).await.unwrap();
    node.acks.message().await.unwrap().unwrap();
    node
}

/// `n` placement clients, each on its own connection.
async fn clients(server: &Server, n: usize) -> Vec<Client> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(Client::from_channel(server.channel().await));
    }
    clients
}

async fn register(ch: Channel, id: &str, cpus: u32) -> NodeStream {
    register_node(ch, id, topology(cpus), Default::default()).await
}

/// Opens a Report stream and registers node `id`; returns once the
/// server acknowledged the registration.
async fn register_node(
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

fn update(seq: u64, full: bool, cpus: Vec<pb::CpuState>) -> pb::AgentMessage {
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

fn own_rss_kib() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The store's own footprint: the same registrations, no transport.
fn memory_in_process(nodes: usize, cpus: u32) {
    use fairplace::store::{Store, StoreConfig, Update};
    let base = own_rss_kib();
    let store = Store::new(StoreConfig::default());
    let spec = fairplace::service::convert::topology_spec(Some(&topology(cpus)), "t").unwrap();
    let now = Instant::now();
    for i in 0..nodes {
        let (n, g) = store
            .register(&format!("mem-{i}"), vec![], "load".into(), spec.clone())
            .unwrap();
        let u = Update {
            seq: 1,
            full: true,
            cpus: states(cpus, i as u64 + 1)
                .iter()
                .map(|c| {
                    (
                        c.id,
                        fairplace::service::convert::cpu_state(c, 1024).expect("in range"),
                    )
                })
                .collect(),
            ..Update::default()
        };
        store.apply(&n, g, &u, now).unwrap();
    }
    let rss = own_rss_kib();
    println!(
        "memory (store alone, in process): {:.1} MiB for {} nodes x {cpus} CPUs; {:.1} KiB per node",
        rss.saturating_sub(base) as f64 / 1024.0,
        store.len(),
        rss.saturating_sub(base) as f64 / nodes as f64
    );
}

/// `concurrency` callers spread over the clients call `call` back to back
/// for `seconds`; returns the latencies of the calls that succeeded, the
/// failures and the phase's length in seconds.
async fn run_phase<C, F, Fut>(
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
async fn measure(
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

/// One call of a ping-or-pick phase: the no-op Ping in the "ping" phase,
/// else `req` as a PickCpu; whether it succeeded.
async fn ping_or_pick(c: Client, phase: &str, req: pb::PickCpuRequest) -> bool {
    if phase == "ping" {
        c.ping().await.is_ok()
    } else {
        c.pick_cpu(req).await.is_ok()
    }
}

/// Prints one phase's line (throughput, latency percentiles, failures)
/// and returns its throughput in calls per second.
fn print_phase(phase: &str, all: &Histogram<u64>, errors: u64, secs: f64) -> f64 {
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

fn pct(h: &Histogram<u64>, q: f64) -> f64 {
    h.value_at_quantile(q) as f64 / 1000.0
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let server = Server::start(&args.server_cpus, args.server_threads);
    match args.cmd {
        Cmd::Rpc {
            seconds,
            connections,
            concurrency,
            claim,
            transport,
            caller,
            requests,
        } => {
            let shape = RpcShape {
                seconds,
                connections,
                concurrency,
                claim,
                raw: caller == "raw",
                requests,
            };
            let mut runs = vec![];
            if transport != "mtls" {
                runs.push(("plaintext", rpc(&server, &shape).await));
            }
            drop(server);
            if transport != "plain" {
                let tls = Server::start_mtls(&args.server_cpus, args.server_threads);
                runs.push(("mutual TLS", rpc(&tls, &shape).await));
            }
            if let [(_, plain), (_, tls)] = runs.as_slice() {
                println!("# same run: mutual TLS / plaintext");
                println!(
                    "ping throughput {:.2}, pick_cpu throughput {:.2}, pick_cpu/ping over mutual TLS {:.2} (plaintext {:.2}); p50 ping {:.1} -> {:.1} µs, pick_cpu {:.1} -> {:.1} µs",
                    tls.ping.0 / plain.ping.0,
                    tls.pick.0 / plain.pick.0,
                    tls.pick.0 / tls.ping.0,
                    plain.pick.0 / plain.ping.0,
                    plain.ping.1,
                    tls.ping.1,
                    plain.pick.1,
                    tls.pick.1,
                );
                println!(
                    "pick_cpus/pick_cpu over mutual TLS {:.2} (plaintext {:.2})",
                    tls.stream.0 / tls.pick.0,
                    plain.stream.0 / plain.pick.0,
                );
            }
        }
        Cmd::Ingest {
            nodes,
            cpus,
            seconds,
            connections,
            window,
        } => ingest(&server, nodes, cpus, seconds, connections, window).await,
        Cmd::Cache { reports } => cache(&server, reports).await,
        Cmd::Replicas {
            seconds,
            connections,
            concurrency,
        } => {
            drop(server);
            replicas::run(
                &args.server_cpus,
                args.server_threads,
                (seconds, connections, concurrency),
            )
            .await;
        }
        Cmd::Leases {
            seconds,
            connections,
            concurrency,
            count,
            policy,
            baseline,
        } => {
            drop(server);
            leases(
                (&args.server_cpus, args.server_threads),
                (seconds, connections),
                &concurrency,
                (count, policy),
                baseline,
            )
            .await
        }
        Cmd::Attack {
            seconds,
            deciders,
            idle_connections,
            unknown_methods,
        } => {
            attack(
                &server,
                seconds,
                deciders,
                idle_connections,
                unknown_methods,
            )
            .await
        }
        Cmd::Cluster {
            zones,
            racks,
            nodes_per_rack,
            cpus,
            seconds,
            connections,
            concurrency,
        } => {
            cluster(
                &server,
                (zones, racks, nodes_per_rack),
                cpus,
                seconds,
                connections,
                concurrency,
            )
            .await
        }
        Cmd::Flood {
            seconds,
            connections,
            watches,
            reports,
            bounded_only,
        } => {
            drop(server);
            let shape = FloodShape {
                seconds,
                connections,
                watches,
                reports,
            };
            // The probe's node sends one report: it must not go stale
            // during the run (not a limit under test).
            let fresh = ["--stale-after-ms", "3600000"].map(String::from).to_vec();
            let mut runs = vec![("default limits", fresh.clone())];
            if !bounded_only {
                let lifted = [
                    "--max-connections-per-peer",
                    "1000000",
                    "--max-connections",
                    "1000000",
                    "--max-streams-per-connection",
                    "1000000",
                    "--max-health-watches",
                    "1000000",
                    "--max-agent-streams",
                    "1000000",
                    "--max-pending-registrations",
                    "1000000",
                ];
                let lifted = lifted.map(String::from).into_iter();
                runs.push(("limits lifted", fresh.into_iter().chain(lifted).collect()));
            }
            for (name, extra) in runs {
                let server = Server::spawn(&args.server_cpus, args.server_threads, &extra);
                flood(&server, name, &shape).await;
            }
        }
        Cmd::Memory {
            nodes,
            cpus,
            in_process: true,
            ..
        } => memory_in_process(nodes, cpus),
        Cmd::Memory {
            nodes,
            cpus,
            connections,
            in_process: false,
            replicas: 0,
        } => memory(&server, nodes, cpus, connections).await,
        Cmd::Memory {
            nodes,
            cpus,
            replicas,
            ..
        } => {
            drop(server);
            replicas::memory(
                &args.server_cpus,
                args.server_threads,
                nodes,
                cpus,
                replicas,
            )
            .await;
        }
    }
}

/// Throughput (req/s) and p50 (µs) of Ping and PickCpu.
struct RpcResult {
    ping: (f64, f64),
    pick: (f64, f64),
    /// PickCpus: one stream per connection, as many requests in flight.
    stream: (f64, f64),
}

/// What an `rpc` run does.
struct RpcShape {
    seconds: u64,
    connections: usize,
    concurrency: usize,
    claim: bool,
    /// Unary calls from [`wire::Caller`], not the client library.
    raw: bool,
    /// Different requests sent (0: one per caller).
    requests: usize,
}

async fn rpc(server: &Server, shape: &RpcShape) -> RpcResult {
    let RpcShape {
        seconds,
        connections,
        concurrency,
        claim,
        raw,
        requests: distinct,
    } = *shape;
    let _reporter = load_node(server.node_channel().await).await;
    let clients = clients(server, connections).await;
    let mut callers = Vec::new();
    if raw {
        let tls = server.tls.as_ref().map(|(_, orch, _)| orch);
        for _ in 0..connections {
            callers.push(wire::Caller::connect(&server.grpc, tls).await);
        }
    }
    // Caller i's request, framed once (the raw caller sends it as is).
    let requests: Arc<Vec<pb::PickCpuRequest>> = Arc::new(
        (0..concurrency)
            .map(|i| pb::PickCpuRequest {
                claim,
                ..wakeup_on_load(if distinct > 0 { i % distinct } else { i })
            })
            .collect(),
    );
    let framed: Arc<Vec<wire::Bytes>> = Arc::new(requests.iter().map(wire::frame).collect());
    println!(
        "# fairplace-load rpc ({}, {}): {connections} connections, {concurrency} callers, {} different PickCpu requests, {seconds} s per phase (ping and pick_cpu in alternating 1 s slices)",
        if server.tls.is_some() {
            "mutual TLS"
        } else {
            "plaintext"
        },
        if raw {
            "raw HTTP/2 caller"
        } else {
            "client library"
        },
        if distinct > 0 {
            distinct.min(concurrency)
        } else {
            concurrency
        }
    );
    // The two phases alternate in one-second slices (ping first in even
    // rounds, PickCpu first in odd ones), so a change in the machine's speed
    // during the run (a VM's neighbours) weighs on both alike.
    const PHASES: [&str; 2] = ["ping", "pick_cpu"];
    let mut spent = [cost::Cost::default(); 2];
    let mut own = [cost::Cost::default(); 2];
    let mut acc: Vec<(Histogram<u64>, u64, f64)> = PHASES
        .iter()
        .map(|_| {
            (
                Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap(),
                0,
                0.0,
            )
        })
        .collect();
    for round in 0..seconds.max(1) {
        for k in [round as usize % 2, 1 - round as usize % 2] {
            let ping = PHASES[k] == "ping";
            let before = cost::read(server.child.id());
            let before_own = cost::read(std::process::id());
            let (all, errors, secs) = if raw {
                let framed = Arc::clone(&framed);
                run_phase(&callers, concurrency, 1, move |mut c: wire::Caller, i| {
                    let req = framed[i].clone();
                    async move {
                        if ping {
                            c.ping().await
                        } else {
                            c.pick_cpu(req, 128).await
                        }
                    }
                })
                .await
            } else {
                let requests = Arc::clone(&requests);
                run_phase(&clients, concurrency, 1, move |c, i| {
                    ping_or_pick(c, PHASES[k], requests[i].clone())
                })
                .await
            };
            spent[k] += cost::read(server.child.id()) - before;
            own[k] += cost::read(std::process::id()) - before_own;
            acc[k].0.add(&all).unwrap();
            acc[k].1 += errors;
            acc[k].2 += secs;
        }
    }
    let mut results = Vec::new();
    for (phase, (all, errors, secs)) in PHASES.iter().zip(&acc) {
        let rps = print_phase(phase, all, *errors, *secs);
        results.push((rps, pct(all, 0.5)));
    }
    let ratio = results[1].0 / results[0].0;
    println!("pick_cpu / ping throughput: {ratio:.2}");
    // What each call cost each side: the server's CPU per call is its own
    // measure of the ratio, apart from the generator's pace.
    for (k, phase) in PHASES.iter().enumerate() {
        let n = acc[k].0.len();
        println!("{}", cost::per_call(phase, "server", spent[k], n));
        println!("{}", cost::per_call(phase, "generator", own[k], n));
    }
    let per_call = |k: usize| spent[k].cpu_ns as f64 / acc[k].0.len().max(1) as f64;
    println!(
        "server CPU per call, ping / pick_cpu: {:.2}",
        per_call(0) / per_call(1)
    );
    let (all, errors, secs) = stream_phase(&clients, concurrency, seconds, claim).await;
    let rps = print_phase("pick_cpus (stream)", &all, errors, secs);
    let stream = (rps, pct(&all, 0.5));
    println!(
        "pick_cpus / pick_cpu throughput: {:.2}; pick_cpus / ping: {:.2}",
        stream.0 / results[1].0,
        stream.0 / results[0].0
    );
    RpcResult {
        ping: results[0],
        pick: results[1],
        stream,
    }
}

/// PickCpus: one stream per client connection, `concurrency` requests in
/// flight in all (as the unary phases have callers), each answer's
/// latency from its request's send.
async fn stream_phase(
    clients: &[Client],
    concurrency: usize,
    seconds: u64,
    claim: bool,
) -> (Histogram<u64>, u64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let window = (concurrency / clients.len()).max(1);
    let mut tasks = Vec::new();
    for (k, c) in clients.iter().enumerate() {
        let (c, stop, stride) = (c.clone(), Arc::clone(&stop), clients.len());
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let mut errors = 0u64;
            let (tx, rx) = mpsc::channel(window);
            let Ok(mut answers) = c.pick_cpus_stream(ReceiverStream::new(rx)).await else {
                return (h, 1);
            };
            let mut sent = std::collections::VecDeque::with_capacity(window);
            let mut i = k;
            let next = |i: &mut usize| {
                *i += stride;
                pb::PickCpuRequest {
                    claim,
                    ..wakeup_on_load(*i)
                }
            };
            for _ in 0..window {
                let _ = tx.send(next(&mut i)).await;
                sent.push_back(Instant::now());
            }
            while let Ok(Some(a)) = answers.message().await {
                let t0 = sent.pop_front().expect("an answer per request");
                match a.result {
                    Some(pb::pick_cpus_answer::Result::Ok(_)) => {
                        h.record(t0.elapsed().as_nanos() as u64).unwrap()
                    }
                    _ => errors += 1,
                }
                if stop.load(Ordering::Relaxed) {
                    if sent.is_empty() {
                        break;
                    }
                    continue;
                }
                let _ = tx.send(next(&mut i)).await;
                sent.push_back(Instant::now());
            }
            (h, errors)
        }));
    }
    measure(tasks, &stop, seconds).await
}

/// A Decide scenario on 4,096 CPUs, each its own core and LLC, in 256
/// NUMA nodes: the largest shape the server builds.
fn big_scenario() -> String {
    let nodes = 256;
    let cpus: Vec<String> = (0..4096)
        .map(|i| format!(r#"{{"id":{i},"core":{i},"llc":{i},"node":{}}}"#, i / 16))
        .collect();
    let dist: Vec<String> = (0..nodes)
        .map(|a: i32| {
            let row: Vec<String> = (0..nodes)
                .map(|b: i32| {
                    let d = if a == b {
                        10
                    } else if a / 16 == b / 16 {
                        20
                    } else {
                        30
                    };
                    d.to_string()
                })
                .collect();
            format!("[{}]", row.join(","))
        })
        .collect();
    format!(
        r#"{{"version":1,"name":"big","topology":{{"cpus":[{}],"numa_distance":[{}]}},"cpus":[],"task":{{}},"request":{{"kind":"fork","this_cpu":0}}}}"#,
        cpus.join(","),
        dist.join(",")
    )
}

fn series_count(metrics_url: &str) -> usize {
    let body = http_body(metrics_url);
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .count()
}

fn http_body(url: &str) -> String {
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
async fn probe_latency(probe: &Client, secs: u64) -> (Histogram<u64>, Histogram<u64>, u64) {
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

async fn attack(server: &Server, seconds: u64, deciders: usize, idle: usize, unknown: usize) {
    let _reporter = load_node(channel(&server.grpc).await).await;
    let metrics_url = format!("http://{}/metrics", server.metrics);
    let probe = Client::from_channel(channel(&server.grpc).await);
    let measure = |secs| probe_latency(&probe, secs);
    let series_before = series_count(&metrics_url);
    let (ping0, pick0, e0) = measure(seconds).await;
    println!(
        "# fairplace-load attack: {deciders} Decide callers (4,096 CPUs), {idle} idle connections, {unknown} unknown-method calls"
    );
    println!(
        "idle: ping p50 {:.1} µs p99 {:.1} µs; pick_cpu p50 {:.1} µs p99 {:.1} µs; errors {e0}",
        pct(&ping0, 0.5),
        pct(&ping0, 0.99),
        pct(&pick0, 0.5),
        pct(&pick0, 0.99)
    );

    // The attack.
    let stop = Arc::new(AtomicBool::new(false));
    let scenario = Arc::new(big_scenario());
    let (answered, shed, other) = (
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(AtomicU64::new(0)),
    );
    let mut tasks = Vec::new();
    for _ in 0..deciders {
        let c = Client::from_channel(channel(&server.grpc).await);
        let (stop, scenario) = (Arc::clone(&stop), Arc::clone(&scenario));
        let (answered, shed, other) =
            (Arc::clone(&answered), Arc::clone(&shed), Arc::clone(&other));
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match c.decide(&scenario).await {
                    Ok(_) => answered.fetch_add(1, Ordering::Relaxed),
                    Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                        shed.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => other.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    let grpc = server.grpc.clone();
    let idle_conns = tokio::task::spawn_blocking(move || {
        (0..idle)
            .filter_map(|_| std::net::TcpStream::connect(&grpc).ok())
            .collect::<Vec<_>>()
    });
    let ch = channel(&server.grpc).await;
    let unknown_calls = tokio::spawn(async move {
        let mut grpc = tonic::client::Grpc::new(ch);
        for i in 0..unknown {
            let path =
                http::uri::PathAndQuery::try_from(format!("/evil.Service/Method{i}")).unwrap();
            let _ = grpc.ready().await;
            let codec = tonic_prost::ProstCodec::<pb::PingRequest, pb::PingResponse>::default();
            let _ = grpc
                .unary(tonic::Request::new(pb::PingRequest::default()), path, codec)
                .await;
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (ping1, pick1, e1) = measure(seconds).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let _ = unknown_calls.await;
    let conns = idle_conns.await.unwrap();
    let series_after = series_count(&metrics_url);
    println!(
        "attacked: ping p50 {:.1} µs p99 {:.1} µs; pick_cpu p50 {:.1} µs p99 {:.1} µs; errors {e1}",
        pct(&ping1, 0.5),
        pct(&ping1, 0.99),
        pct(&pick1, 0.5),
        pct(&pick1, 0.99)
    );
    println!(
        "pick_cpu p99 attacked / idle: {:.1}x; ping p99 attacked / idle: {:.1}x",
        pct(&pick1, 0.99) / pct(&pick0, 0.99),
        pct(&ping1, 0.99) / pct(&ping0, 0.99)
    );
    println!(
        "decide: {} answered, {} shed (RESOURCE_EXHAUSTED), {} other errors; {} idle connections opened",
        answered.load(Ordering::Relaxed),
        shed.load(Ordering::Relaxed),
        other.load(Ordering::Relaxed),
        conns.len()
    );
    println!("metrics series: {series_before} before, {series_after} after the attack");
}

struct FloodShape {
    seconds: u64,
    connections: usize,
    watches: usize,
    reports: usize,
}

/// How the flood's streams fared.
#[derive(Default)]
struct FloodCounts {
    opened: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
}

impl FloodCounts {
    fn line(&self, asked: usize) -> String {
        let (o, r, f) = (
            self.opened.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        );
        let waiting = (asked as u64).saturating_sub(o + r + f);
        format!("{o} open, {r} refused (RESOURCE_EXHAUSTED), {f} failed, {waiting} still waiting")
    }

    fn record<T>(&self, r: &Result<T, tonic::Status>) {
        let c = match r {
            Ok(_) => &self.opened,
            Err(s) if s.code() == tonic::Code::ResourceExhausted => &self.refused,
            Err(_) => &self.failed,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }
}

/// Opens Watch streams and unregistered Report streams over many
/// connections and holds them, measuring the server's memory and a
/// probe's latency before and during.
async fn flood(server: &Server, name: &str, shape: &FloodShape) {
    let _reporter = load_node(channel(&server.grpc).await).await;
    let probe = Client::from_channel(channel(&server.grpc).await);
    let (ping0, pick0, e0) = probe_latency(&probe, shape.seconds).await;
    let rss0 = server.rss_kib();
    println!(
        "# fairplace-load flood, {name}: {} Watch + {} Report streams over {} connections",
        shape.watches, shape.reports, shape.connections
    );
    let mut chans = Vec::new();
    let mut refused_conns = 0;
    for _ in 0..shape.connections {
        match Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect_timeout(Duration::from_secs(2))
            .connect()
            .await
        {
            Ok(c) => chans.push(c),
            Err(_) => refused_conns += 1,
        }
    }
    if chans.is_empty() {
        println!("no connection opened");
        return;
    }
    let (watches, reports) = (
        Arc::new(FloodCounts::default()),
        Arc::new(FloodCounts::default()),
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let mut tasks = Vec::new();
    for i in 0..shape.watches + shape.reports {
        let ch = chans[i % chans.len()].clone();
        let stop = Arc::clone(&stop);
        let (watches, reports) = (Arc::clone(&watches), Arc::clone(&reports));
        let watch = i < shape.watches;
        tasks.push(tokio::spawn(async move {
            let held = if watch {
                let mut c = tonic_health::pb::health_client::HealthClient::new(ch);
                let r = c
                    .watch(tonic_health::pb::HealthCheckRequest::default())
                    .await;
                watches.record(&r);
                r.ok().map(|s| Box::new(s) as Box<dyn Send>)
            } else {
                // A Report stream that never sends its Register.
                let mut c = pb::agent_service_client::AgentServiceClient::new(ch);
                let r = c.report(tokio_stream::pending::<pb::AgentMessage>()).await;
                reports.record(&r);
                r.ok().map(|s| Box::new(s) as Box<dyn Send>)
            };
            stop.notified().await;
            drop(held);
        }));
    }
    // Let the flood reach its height, then measure under it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    // The highest resident memory seen while the probe runs.
    let peak = Arc::new(AtomicU64::new(server.rss_kib()));
    let sampler = {
        let (pid, peak) = (server.child.id(), Arc::clone(&peak));
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_of(pid), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let (ping1, pick1, e1) = probe_latency(&probe, shape.seconds).await;
    sampler.abort();
    let peak = peak.load(Ordering::Relaxed).max(server.rss_kib());
    // The server's own account of what it refused.
    let refusals: Vec<String> = http_body(&format!("http://{}/metrics", server.metrics))
        .lines()
        .filter(|l| {
            l.starts_with("fairplace_connections_refused_total{")
                || l.starts_with("fairplace_rpc_load_shed_total{")
        })
        .map(String::from)
        .collect();
    println!(
        "channels: {} connected, {refused_conns} not; watch streams: {}; report streams: {}",
        chans.len(),
        watches.line(shape.watches),
        reports.line(shape.reports)
    );
    println!("server's refusals: {}", refusals.join("; "));
    println!(
        "server RSS: {:.1} MiB idle, {:.1} MiB under the flood (+{:.1} MiB)",
        rss0 as f64 / 1024.0,
        peak as f64 / 1024.0,
        peak.saturating_sub(rss0) as f64 / 1024.0
    );
    println!(
        "idle: ping p99 {:.1} µs, pick_cpu p99 {:.1} µs, errors {e0}; flood: ping p99 {:.1} µs, pick_cpu p99 {:.1} µs, errors {e1}",
        pct(&ping0, 0.99),
        pct(&pick0, 0.99),
        pct(&ping1, 0.99),
        pct(&pick1, 0.99)
    );
    stop.notify_waiters();
    for t in tasks {
        t.abort();
    }
}

fn rss_of(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

async fn ingest(
    server: &Server,
    nodes: usize,
    cpus: u32,
    seconds: u64,
    connections: usize,
    window: usize,
) {
    let chans = channels(&server.grpc, connections).await;
    let mut streams = Vec::new();
    for i in 0..nodes {
        let mut s = register(chans[i % connections].clone(), &format!("ingest-{i}"), cpus).await;
        s.tx.send(update(1, true, states(cpus, i as u64 + 1)))
            .await
            .unwrap();
        s.acks.message().await.unwrap().unwrap();
        streams.push(s);
    }
    println!(
        "# fairplace-load ingest: {nodes} nodes x {cpus} CPUs over {connections} connections, window {window}, {seconds} s"
    );
    let applied = Arc::new(AtomicU64::new(0));
    let rejected = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for (i, mut s) in streams.into_iter().enumerate() {
        let applied = Arc::clone(&applied);
        let rejected = Arc::clone(&rejected);
        let stop = Arc::clone(&stop);
        tasks.push(tokio::spawn(async move {
            // Two alternating states, so every delta changes every CPU.
            let a = states(cpus, i as u64 + 11);
            let b = states(cpus, i as u64 + 12);
            let mut seq = 1u64;
            let mut in_flight = 0;
            while !stop.load(Ordering::Relaxed) {
                while in_flight < window {
                    seq += 1;
                    let body = if seq.is_multiple_of(2) {
                        a.clone()
                    } else {
                        b.clone()
                    };
                    if s.tx.send(update(seq, false, body)).await.is_err() {
                        return;
                    }
                    in_flight += 1;
                }
                match s.acks.message().await {
                    Ok(Some(ack)) => {
                        in_flight -= 1;
                        if ack.rejection.is_some() {
                            rejected.fetch_add(1, Ordering::Relaxed);
                        } else {
                            applied.fetch_add(cpus as u64, Ordering::Relaxed);
                        }
                    }
                    _ => return,
                }
            }
        }));
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let n = applied.load(Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    println!(
        "ingest: {:.0} CPU updates/s ({:.0} updates/s of {cpus} CPUs), rejected {}",
        n as f64 / secs,
        n as f64 / secs / cpus as f64,
        rejected.load(Ordering::Relaxed)
    );
    for t in tasks {
        t.abort();
    }
}

async fn memory(server: &Server, nodes: usize, cpus: u32, connections: usize) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = server.rss_kib();
    let chans = channels(&server.grpc, connections).await;
    let t0 = Instant::now();
    // Register and report in batches; the streams stay open (connected nodes).
    let mut streams = Vec::with_capacity(nodes);
    for i in 0..nodes {
        let mut s = register(chans[i % connections].clone(), &format!("mem-{i}"), cpus).await;
        s.tx.send(update(1, true, states(cpus, i as u64 + 1)))
            .await
            .unwrap();
        s.acks.message().await.unwrap().unwrap();
        streams.push(s);
    }
    let took = t0.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss = server.rss_kib();
    let c = Client::from_channel(chans[0].clone());
    let listed = c.list_nodes().await.map(|n| n.len()).unwrap_or(0);
    println!(
        "# fairplace-load memory: {nodes} nodes x {cpus} CPUs, each registered with one full snapshot"
    );
    println!(
        "memory: server RSS {:.1} MiB with {listed} nodes and their agent streams open (empty server {:.1} MiB); {:.1} KiB per node; registration took {:.1} s",
        rss as f64 / 1024.0,
        base as f64 / 1024.0,
        rss.saturating_sub(base) as f64 / nodes as f64,
        took.as_secs_f64()
    );
    // The nodes stay registered (until the forget TTL) after their agents go.
    drop(streams);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss = server.rss_kib();
    let listed = c.list_nodes().await.map(|n| n.len()).unwrap_or(0);
    println!(
        "memory: server RSS {:.1} MiB with {listed} nodes registered and their streams closed; {:.1} KiB per node",
        rss as f64 / 1024.0,
        rss.saturating_sub(base) as f64 / nodes as f64
    );
}

/// Cluster placement over gRPC against a large registered cluster.
async fn cluster(
    server: &Server,
    (zones, racks, per_rack): (usize, usize, usize),
    cpus: u32,
    seconds: u64,
    connections: usize,
    concurrency: usize,
) {
    use fairplace::engine::cpumask::CpuMask;
    use fairplace::store::cluster::ClusterRequest;
    use fairplace::store::{Store, StoreConfig, Update};

    let chans = channels(&server.grpc, connections).await;
    // The same cluster in this process, for the naive baseline.
    let local = Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        ..StoreConfig::default()
    });
    let spec = fairplace::service::convert::topology_spec(Some(&topology(cpus)), "topology")
        .expect("valid topology");
    let t0 = Instant::now();
    let mut streams = Vec::new();
    let mut k = 0usize;
    for z in 0..zones {
        for r in 0..racks {
            for n in 0..per_rack {
                let id = format!("z{z}-r{r}-n{n}");
                let labels: std::collections::HashMap<String, String> = [
                    ("zone".to_string(), format!("z{z}")),
                    ("rack".to_string(), format!("r{r}")),
                ]
                .into();
                let st = states(cpus, k as u64 + 1);
                let mut s = register_node(
                    chans[k % connections].clone(),
                    &id,
                    topology(cpus),
                    labels.clone(),
                )
                .await;
                s.tx.send(update(1, true, st.clone())).await.unwrap();
                s.acks.message().await.unwrap().unwrap();
                streams.push(s);
                let (node, g) = local
                    .register(
                        &id,
                        labels.into_iter().collect(),
                        "load".into(),
                        spec.clone(),
                    )
                    .unwrap();
                let u = Update {
                    seq: 1,
                    full: true,
                    cpus: st
                        .iter()
                        .map(|c| {
                            (
                                c.id,
                                fairplace::service::convert::cpu_state(c, 1024).expect("in range"),
                            )
                        })
                        .collect(),
                    ..Update::default()
                };
                local.apply(&node, g, &u, Instant::now()).unwrap();
                k += 1;
            }
        }
    }
    println!(
        "# fairplace-load cluster: {k} nodes x {cpus} CPUs ({zones} zones x {racks} racks x {per_rack}), registered in {:.1} s; {connections} connections, {concurrency} callers, {seconds} s per phase",
        t0.elapsed().as_secs_f64()
    );
    let clients: Vec<Client> = chans.iter().cloned().map(Client::from_channel).collect();
    let mut results = Vec::new();
    for phase in ["ping", "cluster_pick"] {
        let (all, errors, secs) = run_phase(&clients, concurrency, seconds, move |c, _| {
            let req = pb::PickCpuRequest {
                task: Some(pb::Task {
                    util_avg: 150,
                    load_avg: 200,
                    ..Default::default()
                }),
                kind: pb::RequestKind::Fork as i32,
                ..Default::default()
            };
            ping_or_pick(c, phase, req)
        })
        .await;
        print_phase(phase, &all, errors, secs);
        results.push(pct(&all, 0.5));
    }
    // The naive recomputation of the same cluster, in this process.
    let all = CpuMask::first_n(cpus as usize);
    let req = ClusterRequest::default();
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    for _ in 0..20 {
        let t0 = Instant::now();
        let c = local.naive_cluster_pick(&req, &all);
        h.record(t0.elapsed().as_nanos() as u64).unwrap();
        assert!(c.is_some());
    }
    let mut hi = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    for _ in 0..2000 {
        let t0 = Instant::now();
        let c = local.cluster_pick(&req, &all);
        hi.record(t0.elapsed().as_nanos() as u64).unwrap();
        assert!(c.is_some());
    }
    println!(
        "in process: incremental pick p50 {:.1} µs, naive recomputation p50 {:.1} µs",
        pct(&hi, 0.5),
        pct(&h, 0.5)
    );
    println!(
        "cluster PickCpu over gRPC p50 / Ping p50: {:.2}; naive recomputation / gRPC cluster PickCpu p50: {:.0}x",
        results[1] / results[0],
        pct(&h, 0.5) / results[1]
    );
    drop(streams);
}

/// 2 NUMA nodes x 4 LLCs x 32 cores x SMT2.
fn topology_512() -> pb::Topology {
    pb::Topology {
        cpus: (0..512)
            .map(|i| pb::CpuTopology {
                id: i,
                core: i / 2,
                cluster: None,
                llc: i / 64,
                node: i / 256,
                capacity: 1024,
            })
            .collect(),
        numa_distance: vec![],
    }
}

/// The server's `fairplace_cache_scan_cpus` sum and count for a strategy.
fn scan_histogram(metrics: &str, strategy: &str) -> (f64, f64) {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(metrics).expect("metrics");
    write!(c, "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").unwrap();
    let mut body = String::new();
    c.read_to_string(&mut body).unwrap();
    let get = |suffix: &str| {
        body.lines()
            .find(|l| {
                l.starts_with(&format!("fairplace_cache_scan_cpus_{suffix}{{"))
                    && l.contains(&format!("strategy=\"{strategy}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    (get("sum"), get("count"))
}

async fn cache(server: &Server, reports: u32) {
    let ch = channel(&server.grpc).await;
    let NodeStream { tx, mut acks } =
        register_node(ch.clone(), "cache", topology_512(), Default::default()).await;
    let admin = Client::from_channel(ch);
    let cpus: Vec<pb::CpuState> = (0..512)
        .map(|i| pb::CpuState {
            id: i,
            online: true,
            ..Default::default()
        })
        .collect();
    println!(
        "# fairplace-load cache: 512 CPUs, 8 LLCs of 64; process 7 (16 threads) runs on CPUs 192-207 (LLC 3); {reports} reports 10 ms apart per strategy"
    );
    let mut seq = 0;
    for visit in [false, true] {
        admin
            .set_features(pb::SetFeaturesRequest {
                node_id: "cache".into(),
                set: [("SC_VISIT".to_string(), visit)].into_iter().collect(),
                clear_overrides: false,
            })
            .await
            .expect("set SC_VISIT");
        for _ in 0..reports {
            seq += 1;
            let u = pb::Update {
                seq,
                full: true,
                cpus: cpus.clone(),
                runtime: (192..208)
                    .map(|c| pb::ProcessRuntime {
                        group: 7,
                        cpu: c,
                        runtime_ns: 8_000_000,
                        nr_threads: 16,
                    })
                    .collect(),
                ..Default::default()
            };
            tx.send(pb::AgentMessage {
                body: Some(Body::Update(u)),
            })
            .await
            .unwrap();
            let a = acks.message().await.unwrap().unwrap();
            assert!(a.rejection.is_none(), "{a:?}");
            tokio::time::sleep(Duration::from_millis(11)).await;
        }
    }
    let mut avg = Vec::new();
    for strategy in ["full", "visit"] {
        let (sum, count) = scan_histogram(&server.metrics, strategy);
        println!(
            "{strategy}: {count:.0} task_cache_work passes, {:.1} CPUs scanned per pass (fairplace_cache_scan_cpus sum {sum:.0})",
            sum / count.max(1.0)
        );
        avg.push(sum / count.max(1.0));
    }
    println!(
        "full / visit CPUs scanned per pass: {:.1}x",
        avg[0] / avg[1].max(1e-9)
    );
    let c = admin.get_cache("cache").await.expect("GetCache");
    let p = c
        .processes
        .iter()
        .find(|p| p.group == 7)
        .expect("process 7");
    println!(
        "process 7 prefers CPU {:?} (LLC {:?})",
        p.preferred_cpu, p.preferred_llc
    );
}

/// AllocateCpus followed by its ReleaseCpus (one measured operation: the
/// lease's whole life, two commits on a durable server), against Ping, on
/// one 128-CPU node (7 busy CPUs), for a server whose leases live in memory
/// and then one that commits them to redb under a fresh --state-dir, at
/// each concurrency; the ratios at the end are within this run.
/// `fairplace-load leases`: a lease's whole life with the leases in
/// memory, in redb and in etcd (one replica on a one-member etcd), with
/// this build's server and, given `baseline`, another build's, phase by
/// phase in one run.
async fn leases(
    (cpus, threads): (&str, usize),
    (seconds, connections): (u64, usize),
    concurrency: &[usize],
    (count, policy): (u32, String),
    baseline: Option<std::path::PathBuf>,
) {
    println!(
        "# fairplace-load leases: {connections} connections, {seconds} s per phase, count {count}, policy {policy}, callers {concurrency:?}"
    );
    let this = std::env::current_exe()
        .expect("own path")
        .with_file_name("fairplace-server");
    let mut builds = vec![("this", this)];
    if let Some(b) = baseline {
        builds.insert(0, ("baseline", b));
    }
    // (store, build, callers) -> (ping, allocate+release) per second.
    let mut table = Vec::new();
    for store in ["memory", "redb", "etcd"] {
        for (build, bin) in &builds {
            let (server, _etcd) = lease_server(store, bin, cpus, threads);
            let _reporter = load_node(server.node_channel().await).await;
            let clients = clients(&server, connections).await;
            for &callers in concurrency {
                println!("## lease store {store}, {build} build, {callers} callers");
                let (ping, life) = lease_life(&clients, callers, seconds, (count, &policy)).await;
                table.push((store, *build, callers, ping, life));
            }
        }
    }
    print_lease_table(&table, concurrency, builds.len() > 1);
}

/// A server keeping its leases in `store`, from the binary `bin`, with its
/// etcd when it needs one.
fn lease_server(
    store: &str,
    bin: &std::path::Path,
    cpus: &str,
    threads: usize,
) -> (Server, Option<replicas::Etcd>) {
    match store {
        "memory" => (
            Server::start_bin(
                bin,
                cpus,
                threads,
                &["--lease-store".into(), "memory".into()],
            ),
            None,
        ),
        "etcd" => {
            let e = replicas::etcd();
            let s = replicas::replica_bin(bin, cpus, threads, &e, "r0");
            std::thread::sleep(Duration::from_millis(500));
            (s, Some(e))
        }
        _ => (Server::start_bin(bin, cpus, threads, &[]), None),
    }
}

/// Ping, then a lease's life, `callers` at once: both per second.
async fn lease_life(
    clients: &[Client],
    callers: usize,
    seconds: u64,
    (count, policy): (u32, &str),
) -> (f64, f64) {
    let (all, errors, secs) = run_phase(clients, callers, seconds, |c, _| async move {
        c.ping().await.is_ok()
    })
    .await;
    let ping = print_phase("ping", &all, errors, secs);
    let policy = policy.to_string();
    let (all, errors, secs) = run_phase(clients, callers, seconds, move |c, _| {
        let policy = policy.clone();
        async move { allocate_release(&c, count, policy).await }
    })
    .await;
    (ping, print_phase("allocate+release", &all, errors, secs))
}

type LeaseRow<'a> = (&'a str, &'a str, usize, f64, f64);

fn print_lease_table(table: &[LeaseRow<'_>], concurrency: &[usize], compared: bool) {
    println!("# same run: allocate+release per second, and as a share of ping");
    let row = |st: &str, b: &str, callers: usize| {
        table
            .iter()
            .find(|r| r.0 == st && r.1 == b && r.2 == callers)
            .map_or((0.0, 0.0), |r| (r.3, r.4))
    };
    for &callers in concurrency {
        let line: Vec<String> = ["memory", "redb", "etcd"]
            .iter()
            .map(|st| {
                let (p, l) = row(st, "this", callers);
                format!("{st} {l:.0}/s ({:.2} of ping)", l / p)
            })
            .collect();
        let (mem, dur) = (
            row("memory", "this", callers).1,
            row("redb", "this", callers).1,
        );
        println!(
            "{callers} callers: {}; redb / memory {:.2}",
            line.join(", "),
            dur / mem
        );
    }
    if compared {
        println!("# this build over the baseline, same run (allocate+release per second)");
        for &callers in concurrency {
            for st in ["memory", "redb", "etcd"] {
                let (b, t) = (row(st, "baseline", callers).1, row(st, "this", callers).1);
                println!(
                    "{callers} callers, {st}: baseline {b:.0}/s, this {t:.0}/s, this / baseline {:.2}",
                    t / b
                );
            }
        }
    }
}

/// One lease's life: AllocateCpus, then ReleaseCpus of what it granted.
async fn allocate_release(c: &Client, count: u32, policy: String) -> bool {
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

/// `fairplace-load replicas`: what replication costs a call.
mod replicas {
    use super::*;

    /// A one-member etcd on free ports in a temporary directory.
    pub(super) struct Etcd {
        child: Child,
        dir: std::path::PathBuf,
        url: String,
    }

    impl Drop for Etcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port")
    }

    pub(super) fn etcd() -> Etcd {
        let bin = std::env::var("FAIRPLACE_ETCD").unwrap_or_else(|_| "etcd".into());
        let dir = std::env::temp_dir().join(format!("fairplace-load-etcd-{}", std::process::id()));
        let (c, p) = (free_port(), free_port());
        let url = format!("http://127.0.0.1:{c}");
        let peer = format!("http://127.0.0.1:{p}");
        let child = Command::new(bin)
            .args(["--name", "e0", "--data-dir"])
            .arg(&dir)
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &format!("e0={peer}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd (apt-get install etcd-server, or set FAIRPLACE_ETCD)");
        std::thread::sleep(Duration::from_secs(2));
        Etcd { child, dir, url }
    }

    /// Two replica ids of which rendezvous hashing gives node `load` to the
    /// first: the owner, and the one that forwards.
    fn ids() -> (String, String) {
        for i in 0.. {
            let (a, b) = (format!("ra{i}"), format!("rb{i}"));
            if fairplace::replica::hrw::owner([a.as_str(), b.as_str()], "load") == Some(a.as_str())
            {
                return (a, b);
            }
        }
        unreachable!()
    }

    fn replica(cpus: &str, threads: usize, etcd: &Etcd, id: &str) -> Server {
        let exe = std::env::current_exe().expect("own path");
        replica_bin(
            &exe.with_file_name("fairplace-server"),
            cpus,
            threads,
            etcd,
            id,
        )
    }

    /// [`replica`] of the server binary `bin`.
    pub(super) fn replica_bin(
        bin: &std::path::Path,
        cpus: &str,
        threads: usize,
        etcd: &Etcd,
        id: &str,
    ) -> Server {
        let addr = format!("127.0.0.1:{}", free_port());
        Server::start_bin(
            bin,
            cpus,
            threads,
            &[
                "--grpc-addr".into(),
                addr,
                "--etcd-endpoints".into(),
                etcd.url.clone(),
                "--replica-id".into(),
                id.into(),
                // Registrations (topology builds) wait rather than shed.
                "--heavy-queue".into(),
                "256".into(),
            ],
        )
    }

    async fn phase(
        name: &str,
        clients: &[Client],
        (seconds, concurrency): (u64, usize),
        pick: bool,
    ) -> f64 {
        let (all, errors, secs) = run_phase(clients, concurrency, seconds, move |c, i| {
            ping_or_pick(c, if pick { "pick_cpu" } else { "ping" }, wakeup_on_load(i))
        })
        .await;
        print_phase(name, &all, errors, secs)
    }

    async fn lease_phase(
        name: &str,
        clients: &[Client],
        (seconds, concurrency): (u64, usize),
    ) -> f64 {
        let (all, errors, secs) = run_phase(clients, concurrency, seconds, |c, _| async move {
            allocate_release(&c, 1, "kernel".into()).await
        })
        .await;
        print_phase(name, &all, errors, secs)
    }

    /// `nodes` nodes of `node_cpus` CPUs spread over `n` replicas, each
    /// registered at its owner with one full snapshot and its stream kept
    /// open; each replica's resident memory.
    pub async fn memory(cpus: &str, threads: usize, nodes: usize, node_cpus: u32, n: usize) {
        let e = etcd();
        let ids: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
        let servers: Vec<Server> = ids
            .iter()
            .map(|id| replica(cpus, threads, &e, id))
            .collect();
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let base: Vec<u64> = servers.iter().map(Server::rss_kib).collect();
        let mut chans = Vec::new();
        for s in &servers {
            chans.push(channels(&s.grpc, 8).await);
        }
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        let mut streams = Vec::with_capacity(nodes);
        let mut per = vec![0usize; n];
        for i in 0..nodes {
            let id = format!("mem-{i}");
            let owner = fairplace::replica::hrw::owner(ids.iter().map(String::as_str), &id)
                .and_then(|o| ids.iter().position(|x| x == o))
                .expect("an owner");
            per[owner] += 1;
            let ch = chans[owner][i % 8].clone();
            set.spawn(async move {
                let mut s = register(ch, &id, node_cpus).await;
                s.tx.send(update(1, true, states(node_cpus, i as u64 + 1)))
                    .await
                    .unwrap();
                s.acks.message().await.unwrap().unwrap();
                s
            });
            // A few registrations in flight per replica: each is a topology
            // build in the replica's heavy pool, which sheds beyond its queue.
            while set.len() >= 6 * n {
                streams.push(set.join_next().await.unwrap().unwrap());
            }
        }
        while let Some(s) = set.join_next().await {
            streams.push(s.unwrap());
        }
        let took = t0.elapsed();
        tokio::time::sleep(Duration::from_secs(2)).await;
        println!(
            "# fairplace-load memory --replicas {n}: {nodes} nodes x {node_cpus} CPUs over {n} replicas on one etcd, each node at its owner with one full snapshot, streams open; registration took {:.1} s",
            took.as_secs_f64()
        );
        let mut total = 0.0;
        for (i, s) in servers.iter().enumerate() {
            let rss = s.rss_kib();
            total += rss as f64 / 1024.0;
            println!(
                "replica r{i}: {} nodes, RSS {:.1} MiB (empty {:.1} MiB), {:.1} KiB per node",
                per[i],
                rss as f64 / 1024.0,
                base[i] as f64 / 1024.0,
                rss.saturating_sub(base[i]) as f64 / per[i].max(1) as f64
            );
        }
        println!("all replicas: {total:.1} MiB for {nodes} nodes");
        drop(streams);
    }

    pub async fn run(
        cpus: &str,
        threads: usize,
        (seconds, connections, concurrency): (u64, usize, usize),
    ) {
        println!(
            "# fairplace-load replicas: {connections} connections, {concurrency} callers, {seconds} s per phase"
        );
        let e = etcd();
        let (a, b) = ids();
        let owner = replica(cpus, threads, &e, &a);
        let other = replica(cpus, threads, &e, &b);
        // Both joined: the node goes to its owner.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let _node = load_node(owner.node_channel().await).await;
        let single = Server::start_with(cpus, threads, &[]);
        let _node1 = load_node(single.node_channel().await).await;
        let k = (seconds, concurrency);
        let at_single = clients(&single, connections).await;
        let at_owner = clients(&owner, connections).await;
        let at_other = clients(&other, connections).await;
        let ping = phase("ping (single server)", &at_single, k, false).await;
        let pick_single = phase("pick_cpu (single server)", &at_single, k, true).await;
        let ping_owner = phase("ping (replica)", &at_owner, k, false).await;
        let pick_owner = phase("pick_cpu (at the owner)", &at_owner, k, true).await;
        let pick_fwd = phase(
            "pick_cpu (forwarded by the other replica)",
            &at_other,
            k,
            true,
        )
        .await;
        let lease_redb = lease_phase("allocate+release (single server, redb)", &at_single, k).await;
        let lease_etcd = lease_phase("allocate+release (at the owner, etcd)", &at_owner, k).await;
        println!("# same run, per second and as a share of the single server's ping");
        for (what, v) in [
            ("ping, single server", ping),
            ("pick_cpu, single server", pick_single),
            ("ping, replica", ping_owner),
            ("pick_cpu at the owner", pick_owner),
            ("pick_cpu through another replica", pick_fwd),
            ("allocate+release, redb", lease_redb),
            ("allocate+release, etcd", lease_etcd),
        ] {
            println!("{what}: {v:.0}/s ({:.2} of ping)", v / ping);
        }
        println!(
            "forwarded/owner pick_cpu {:.2}; etcd/redb allocate+release {:.2}",
            pick_fwd / pick_owner,
            lease_etcd / lease_redb
        );
    }
}
