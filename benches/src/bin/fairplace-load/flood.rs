//! `fairplace-load flood`: memory and Ping/PickCpu latency under a stream
//! flood from one peer: health Watch streams and Report streams that never
//! register, over many connections; on a server with its default limits,
//! and in the same run on one with them lifted (the baseline).
//!
//! Why: one client holding tens of thousands of cheap streams must cost
//! the server bounded memory and leave a well-behaved caller's latency
//! alone; the lifted run shows what the limits save.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use fairplace_client::{Client, pb};
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

use crate::shared::{Launch, Server, channel, http_body, load_node, pct, probe_latency, rss_of};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Connections the flood opens (all from 127.0.0.1).
    #[arg(long, default_value_t = 1000)]
    pub connections: usize,
    /// Health Watch streams it asks for.
    #[arg(long, default_value_t = 40_000)]
    pub watches: usize,
    /// Report streams it opens and never registers.
    #[arg(long, default_value_t = 10_000)]
    pub reports: usize,
    /// Skip the server with its limits lifted.
    #[arg(long)]
    pub bounded_only: bool,
}

/// Floods a server with its default limits, then (unless
/// `--bounded-only`) one with them lifted; servers of its own, not
/// `server`.
pub async fn run(server: Server, launch: &Launch, o: Opts) {
    drop(server);
    let shape = FloodShape {
        seconds: o.seconds,
        connections: o.connections,
        watches: o.watches,
        reports: o.reports,
    };
    // The probe's node sends one report: it must not go stale
    // during the run (not a limit under test).
    let fresh = ["--stale-after-ms", "3600000"].map(String::from).to_vec();
    let mut runs = vec![("default limits", fresh.clone())];
    if !o.bounded_only {
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
        let server = Server::spawn(&launch.cpus, launch.threads, &extra);
        flood(&server, name, &shape).await;
    }
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
    let (chans, refused_conns) = connect(server, shape.connections).await;
    if chans.is_empty() {
        println!("no connection opened");
        return;
    }
    let (watches, reports) = (
        Arc::new(FloodCounts::default()),
        Arc::new(FloodCounts::default()),
    );
    let stop = Arc::new(tokio::sync::Notify::new());
    let tasks = hold_streams(&chans, shape, &stop, (&watches, &reports));
    // Let the flood reach its height, then measure under it.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (peak, (ping1, pick1, e1)) =
        peak_rss_during(server, probe_latency(&probe, shape.seconds)).await;
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

/// `n` connections, each given 2 s to open: those that opened, and how
/// many did not.
async fn connect(server: &Server, n: usize) -> (Vec<Channel>, usize) {
    let mut chans = Vec::new();
    let mut refused_conns = 0;
    for _ in 0..n {
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
    (chans, refused_conns)
}

/// The flood's streams, spread over `chans`, each held until `stop`.
fn hold_streams(
    chans: &[Channel],
    shape: &FloodShape,
    stop: &Arc<tokio::sync::Notify>,
    (watches, reports): (&Arc<FloodCounts>, &Arc<FloodCounts>),
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for i in 0..shape.watches + shape.reports {
        let ch = chans[i % chans.len()].clone();
        let stop = Arc::clone(stop);
        let (watches, reports) = (Arc::clone(watches), Arc::clone(reports));
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
    tasks
}

/// The highest resident memory of `server` seen while `during` runs
/// (sampled every 100 ms), and what `during` gave.
async fn peak_rss_during<T>(server: &Server, during: impl Future<Output = T>) -> (u64, T) {
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
    let out = during.await;
    sampler.abort();
    let peak = peak.load(Ordering::Relaxed).max(server.rss_kib());
    (peak, out)
}
