//! fairplace-demo: the main job on embedded defaults. It starts a server,
//! an agent streaming this machine's CPUs and runnable tasks beside a
//! simulated 16-CPU two-LLC node (this machine's own kernel keeps it
//! balanced; the simulated one has work to move), asks for a few real
//! placements against the live state, runs a load-balance pass of both
//! nodes, shows the cache-aware state, takes and releases a durable lease,
//! and keeps serving for a while.
//!
//! It is the one program that links the server and the client library
//! together, which is why it is a crate of its own.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use clap::Parser;
use fairplace_agent::{Simulated, Source, StreamConfig, StreamStats, signal, stream};
use fairplace_client::table::{migration_type_name, render};
use fairplace_client::{Client, pb};
use tokio::sync::watch;
use tokio::task::JoinHandle;

#[derive(Parser)]
#[command(
    name = "fairplace-demo",
    version,
    about = "a fairplace server with a local agent and a few real decisions"
)]
struct Args {
    /// gRPC port for the demo server (0: any free port).
    #[arg(long, default_value_t = 50051)]
    grpc_port: u16,
    /// /metrics port (0: any free port).
    #[arg(long, default_value_t = 9464)]
    metrics_port: u16,
    /// Keep serving this long after the decisions (s).
    #[arg(long, default_value_t = 20)]
    linger_s: u64,
    /// Record what the server sees and decides into DIR (for
    /// `fairplace-server replay DIR`); while it lingers, the demo then
    /// keeps placing tasks on both nodes, so the recording has decisions
    /// to replay.
    #[arg(long, value_name = "DIR")]
    record: Option<std::path::PathBuf>,
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    if let Err(e) = demo(a.grpc_port, a.metrics_port, a.linger_s, a.record).await {
        eprintln!("fairplace-demo: {e}");
        std::process::exit(1);
    }
}

fn status(s: tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// A server running in this process.
struct Server {
    grpc: SocketAddr,
    metrics: SocketAddr,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), Box<dyn std::error::Error + Send + Sync>>>,
    /// The demo's lease store: a fresh directory, gone with the demo.
    state: StateDir,
}

/// A temporary `--state-dir`, removed on drop.
struct StateDir(std::path::PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Binds the usual ports, or any free one when something else holds them,
/// and serves on defaults.
async fn start_server(
    grpc_port: u16,
    metrics_port: u16,
    record: Option<std::path::PathBuf>,
) -> Result<Server, String> {
    let grpc = match tokio::net::TcpListener::bind(("127.0.0.1", grpc_port)).await {
        Ok(l) => l,
        Err(_) => tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| format!("bind a gRPC port: {e}"))?,
    };
    let grpc_addr = grpc.local_addr().map_err(|e| e.to_string())?;
    let probe = std::net::TcpListener::bind(("127.0.0.1", metrics_port))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| format!("bind a metrics port: {e}"))?;
    let metrics = probe.local_addr().map_err(|e| e.to_string())?;
    drop(probe);
    let state =
        StateDir(std::env::temp_dir().join(format!("fairplace-demo-state-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&state.0);
    let cfg = fairplace::serve::ServeConfig {
        leases: fairplace::serve::LeaseStorage::Dir(state.0.clone()),
        record: record.map(|dir| fairplace::serve::RecordConfig {
            dir,
            max_bytes: 1 << 30,
        }),
        ..Default::default()
    };
    let store = fairplace::serve::open_store(&cfg).map_err(|e| e.to_string())?;
    fairplace::transport::exposition::start(
        metrics,
        std::sync::Arc::clone(&store),
        cfg.ready.clone(),
    )
    .map_err(|e| e.to_string())?;
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(fairplace::serve::serve_store(
        cfg,
        store,
        grpc,
        async move {
            let _ = stop_rx.changed().await;
        },
    ));
    Ok(Server {
        grpc: grpc_addr,
        metrics,
        stop,
        task,
        state,
    })
}

/// The agents: this machine's, and a simulated node with task lists.
struct Agents {
    node_id: String,
    sim_id: String,
    nr_cpus: u32,
    /// Where the local agent's signals come from (`signal::name`).
    signals: &'static str,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

fn stream_config(server: SocketAddr, node_id: &str, zone: &str) -> StreamConfig {
    StreamConfig {
        server: server.to_string(),
        node_id: node_id.to_string(),
        labels: vec![("zone".into(), zone.into())],
        interval: Duration::from_millis(250),
        backoff_min: Duration::from_millis(50),
        backoff_max: Duration::from_secs(2),
        max_message_bytes: 4 << 20,
        tls: Default::default(),
        trust_domain: "fairplace".into(),
        // In memory only (no state file); plaintext, so nothing is applied
        // (the demo's lease names no target).
        leases: Default::default(),
    }
}

fn start_agents(server: SocketAddr) -> Result<Agents, String> {
    // The agent's own choice: the kernel's signals where readable (root),
    // else /proc, with a log line saying why.
    let machine = signal::open(signal::Choice::Auto, &signal::Paths::default(), 32, 3.5)
        .map_err(|e| format!("reading this machine's topology: {e}"))?;
    let nr_cpus = machine.topology().cpus.len() as u32;
    let signals = signal::name(machine.signal_source() as i32);
    let node_id = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let (stop, stop_rx) = watch::channel(false);
    let (stats_tx, _) = watch::channel(StreamStats::default());
    let local = tokio::spawn(stream(
        stream_config(server, &node_id, "local"),
        machine,
        stop_rx.clone(),
        stats_tx,
    ));
    // This machine's own kernel keeps it balanced already: the simulated
    // node gives the balancer and the cache-aware accounting work.
    let sim_id = format!("{node_id}-sim16");
    let mut sim = Simulated::new(16, 7);
    sim.tasks = true;
    sim.llc_cpus = Some(8);
    sim.churn_pct = 25;
    let (sim_stats_tx, _) = watch::channel(StreamStats::default());
    let simulated = tokio::spawn(stream(
        stream_config(server, &sim_id, "sim"),
        sim,
        stop_rx,
        sim_stats_tx,
    ));
    Ok(Agents {
        node_id,
        sim_id,
        nr_cpus,
        signals,
        stop,
        tasks: vec![local, simulated],
    })
}

/// Waits for each node's first full snapshot and one delta on top of it,
/// so util reflects a measured interval.
async fn wait_for_reports(client: &Client, ids: &[&str]) -> Result<(), String> {
    let t0 = Instant::now();
    loop {
        let mut ready = true;
        for id in ids {
            ready &= client.get_node(id).await.map_or(0, |n| n.last_seq) >= 2;
        }
        if ready {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err("the local agent did not report within 10 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pick(
    node: &str,
    kind: pb::RequestKind,
    this_cpu: u32,
    prev: Option<u32>,
    allowed: &str,
    claim: bool,
) -> pb::PickCpuRequest {
    pb::PickCpuRequest {
        node_id: node.to_string(),
        task: Some(pb::Task {
            prev_cpu: prev,
            cpus_allowed: allowed.to_string(),
            util_avg: 200,
            load_avg: 300,
            ..Default::default()
        }),
        kind: kind as i32,
        this_cpu,
        claim,
        ..Default::default()
    }
}

/// The placements the demo asks for: each path a caller reaches.
fn placement_asks(node: &str, last: u32, exec_cpu: u32) -> Vec<(&'static str, pb::PickCpuRequest)> {
    use pb::RequestKind::{Exec, Fork, Wakeup};
    let bound = exec_cpu.to_string();
    vec![
        (
            "wakeup, last ran on CPU 0",
            pick(node, Wakeup, 0, Some(0), "", false),
        ),
        (
            "sync wakeup from the last CPU",
            pb::PickCpuRequest {
                sync: true,
                ..pick(node, Wakeup, last, Some(0), "", false)
            },
        ),
        ("fork on CPU 0", pick(node, Fork, 0, None, "", false)),
        (
            "exec from a busy CPU",
            pick(node, Exec, exec_cpu, None, "", false),
        ),
        (
            "exec bound to that CPU",
            pick(node, Exec, exec_cpu, None, &bound, false),
        ),
        (
            "fork with no node (cluster)",
            pb::PickCpuRequest {
                node_id: String::new(),
                ..pick(node, Fork, 0, None, "", false)
            },
        ),
        (
            "claimed wakeup #1",
            pick(node, Wakeup, 0, Some(0), "", true),
        ),
        (
            "claimed wakeup #2",
            pick(node, Wakeup, 0, Some(0), "", true),
        ),
    ]
}

/// Asks each placement and prints the answers as a table.
async fn show_decisions(client: &Client, agents: &Agents) {
    // exec needs a CPU that runs a task (the exec'ing one) in the state.
    let exec_cpu = client
        .get_node(&agents.node_id)
        .await
        .ok()
        .and_then(|nd| {
            nd.cpus
                .iter()
                .find(|c| c.online && c.nr_running > 0)
                .map(|c| c.id)
        })
        .unwrap_or(0);
    let mut rows = Vec::new();
    for (what, req) in placement_asks(&agents.node_id, agents.nr_cpus - 1, exec_cpu) {
        let row = match client.pick_cpu(req).await {
            Ok(r) => vec![
                what.to_string(),
                r.node_id.clone(),
                r.cpu.to_string(),
                r.path,
                r.scanned.to_string(),
                r.state_version.to_string(),
                format!("{:.3}", r.state_age_seconds),
            ],
            Err(s) => vec![
                what.to_string(),
                "-".into(),
                status(s),
                "".into(),
                "".into(),
                "".into(),
            ],
        };
        rows.push(row);
    }
    println!(
        "fairplace demo: node {} ({} CPUs) reported by the local agent (signals: {})\n",
        agents.node_id, agents.nr_cpus, agents.signals
    );
    let header = [
        "request", "node", "cpu", "path", "scanned", "state", "age_s",
    ];
    print!("{}", render(&header, &rows));
}

/// One load-balance pass of each node, with its proposals.
async fn show_balance(client: &Client, agents: &Agents) -> Result<(), String> {
    let nodes = [
        ("this machine", &agents.node_id),
        ("the simulated node", &agents.sim_id),
    ];
    for (what, id) in nodes {
        let r = client
            .balance(pb::BalanceRequest {
                node_id: id.clone(),
                ..Default::default()
            })
            .await
            .map_err(status)?;
        println!(
            "\nload balance of {what} ({id}): {} proposals, {} domains balanced, {} declined by should_we_balance",
            r.proposals.len(),
            r.domains_balanced,
            r.domains_declined
        );
        let rows: Vec<Vec<String>> = r
            .proposals
            .iter()
            .map(|p| {
                vec![
                    p.task.to_string(),
                    format!("{} -> {}", p.src_cpu, p.dst_cpu),
                    migration_type_name(p.migration_type).into(),
                    p.level.clone(),
                    p.reason.clone(),
                ]
            })
            .collect();
        if !rows.is_empty() {
            print!(
                "{}",
                render(&["task", "cpus", "type", "level", "why"], &rows)
            );
        }
    }
    Ok(())
}

/// The simulated node's cache-aware state in one line.
async fn show_cache(client: &Client, sim_id: &str) {
    if let Ok(c) = client.get_cache(sim_id).await {
        let preferring = c
            .processes
            .iter()
            .filter(|p| p.preferred_llc.is_some())
            .count();
        println!(
            "\ncache-aware scheduling on {sim_id}: {} processes tracked, {preferring} with a preferred LLC; {} task_cache_work passes read {} CPUs",
            c.processes.len(),
            c.scan_passes,
            c.cpus_scanned
        );
    }
}

/// A lease on one CPU of this machine's node: granted (committed to the
/// demo's lease store before the answer), listed by GetNode with its owner,
/// released.
async fn show_lease(client: &Client, node: &str, store: &std::path::Path) {
    let granted = client
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: node.into(),
            count: 1,
            holder: "fairplace-demo".into(),
            ..Default::default()
        })
        .await;
    let l = match granted {
        Ok(l) => l,
        Err(e) => {
            println!("\nlease on {node}: refused: {}", e.message());
            return;
        }
    };
    let owner = client
        .get_node(node)
        .await
        .ok()
        .and_then(|n| n.leases.into_iter().find(|x| x.lease_id == l.lease_id))
        .map_or_else(|| "?".into(), |x| x.owner);
    println!(
        "\nlease {} on {node}: CPU {} ({}), owner {owner}, committed to {} before it was answered",
        l.lease_id,
        l.cpus,
        l.per_cpu.first().map_or("", |c| c.path.as_str()),
        store.join("leases.redb").display()
    );
    match client.release_cpus(l.lease_id).await {
        Ok(_) => println!("lease {} released", l.lease_id),
        Err(e) => println!("lease {} not released: {}", l.lease_id, e.message()),
    }
}

/// A child shell spinning on a CPU while the decisions are asked; it
/// stops when dropped, and by itself if the demo dies first (it spins only
/// while its parent lives).
struct Spinner(std::process::Child);

impl Spinner {
    fn start() -> Result<Spinner, String> {
        let script = format!(
            "while kill -0 {} 2>/dev/null; do :; done",
            std::process::id()
        );
        std::process::Command::new("sh")
            .args(["-c", &script])
            .spawn()
            .map(Spinner)
            .map_err(|e| format!("starting a busy process (sh): {e}"))
    }
}

impl Drop for Spinner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// While a recording runs: placements on both nodes, from CPUs and to
/// previous CPUs that move round the node, some claimed, some SCHED_IDLE,
/// some bound to one CPU.
async fn keep_placing(client: Client, node: String, nr_cpus: u32, sim: String) {
    let mut tick = tokio::time::interval(Duration::from_millis(20));
    for i in 0u32.. {
        tick.tick().await;
        for (id, n) in [(&node, nr_cpus), (&sim, 16)] {
            for kind in [
                pb::RequestKind::Wakeup,
                pb::RequestKind::Fork,
                pb::RequestKind::Exec,
            ] {
                let task = pb::Task {
                    prev_cpu: Some((i * 7) % n),
                    policy: if i % 5 == 0 {
                        pb::Policy::Idle as i32
                    } else {
                        0
                    },
                    cpus_allowed: if i % 11 == 0 {
                        ((i / 11) % n).to_string()
                    } else {
                        String::new()
                    },
                    util_avg: ((i * 37) % 800) as i64,
                    ..Default::default()
                };
                let req = pb::PickCpuRequest {
                    node_id: id.clone(),
                    kind: kind as i32,
                    this_cpu: (i * 3) % n,
                    claim: i % 4 == 0,
                    task: Some(task),
                    ..Default::default()
                };
                let _ = client.pick_cpu(req).await;
            }
        }
    }
}

/// The main job: server, agents, a few real decisions, then serve a while.
async fn demo(
    grpc_port: u16,
    metrics_port: u16,
    linger_s: u64,
    record: Option<std::path::PathBuf>,
) -> Result<(), String> {
    let recording = record.clone();
    let server = start_server(grpc_port, metrics_port, record).await?;
    // A busy process stands in for a task that is running and will exec,
    // so the live state has a CPU an exec can come from. A process, not a
    // thread of the demo: the agent leaves its own process's threads out.
    let spinner = Spinner::start()?;
    let agents = start_agents(server.grpc)?;
    let client = Client::connect(&server.grpc.to_string())
        .await
        .map_err(|e| e.to_string())?;
    wait_for_reports(&client, &[&agents.node_id, &agents.sim_id]).await?;
    show_decisions(&client, &agents).await;
    drop(spinner);
    show_balance(&client, &agents).await?;
    show_cache(&client, &agents.sim_id).await;
    show_lease(&client, &agents.node_id, &server.state.0).await;
    let grpc = server.grpc;
    println!("\ngRPC:    {grpc}   (try: fairplace --server {grpc} nodes)");
    println!("metrics: http://{}/metrics", server.metrics);
    let placing = recording.as_ref().map(|dir| {
        println!(
            "recording into {}; placing a wakeup, a fork and an exec on each node every 20 ms",
            dir.display()
        );
        tokio::spawn(keep_placing(
            client.clone(),
            agents.node_id.clone(),
            agents.nr_cpus,
            agents.sim_id.clone(),
        ))
    });
    if linger_s > 0 {
        println!("serving for {linger_s} s more; Ctrl-C stops it now");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(linger_s)) => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    if let Some(p) = placing {
        p.abort();
    }
    agents.stop.send(true).ok();
    for t in agents.tasks {
        let _ = t.await;
    }
    server.stop.send(true).ok();
    let _ = server.task.await;
    drop(server.state);
    Ok(())
}
