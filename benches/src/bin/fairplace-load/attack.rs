//! `fairplace-load attack`: Ping and PickCpu latency on an idle server,
//! then again while hostile clients run: callers flooding Decide with a
//! 4,096-CPU topology, idle TCP connections that never send a preface, and
//! calls to made-up method names; with the series count of /metrics before
//! and after.
//!
//! Why: the server's limits (the heavy pool for Decide, connection and
//! stream caps, bounded metric labels) must keep what an orchestrator
//! sees steady while a client misbehaves, and an attacker must not grow
//! the metrics without bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use fairplace_client::{Client, pb};
use hdrhistogram::Histogram;
use tokio::task::JoinHandle;

use crate::shared::{Launch, Server, channel, http_body, load_node, pct, probe_latency};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Callers flooding Decide with the large topology.
    #[arg(long, default_value_t = 16)]
    pub deciders: usize,
    /// TCP connections opened and left silent.
    #[arg(long, default_value_t = 500)]
    pub idle_connections: usize,
    /// Calls to made-up method names.
    #[arg(long, default_value_t = 2000)]
    pub unknown_methods: usize,
}

/// How the Decide flood's calls ended.
#[derive(Default)]
struct DecideCounts {
    answered: AtomicU64,
    shed: AtomicU64,
    other: AtomicU64,
}

/// Measures idle, starts the attack, measures under it, and prints both.
pub async fn run(server: Server, _launch: &Launch, o: Opts) {
    let Opts {
        seconds,
        deciders,
        idle_connections: idle,
        unknown_methods: unknown,
    } = o;
    let _reporter = load_node(channel(&server.grpc).await).await;
    let metrics_url = format!("http://{}/metrics", server.metrics);
    let probe = Client::from_channel(channel(&server.grpc).await);
    let measure = |secs| probe_latency(&probe, secs);
    let series_before = series_count(&metrics_url);
    let (ping0, pick0, e0) = measure(seconds).await;
    println!(
        "# fairplace-load attack: {deciders} Decide callers (4,096 CPUs), {idle} idle connections, {unknown} unknown-method calls"
    );
    print_latencies("idle", &ping0, &pick0, e0);

    // The attack.
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new(DecideCounts::default());
    let tasks = flood_decide(&server, deciders, &stop, &counts).await;
    let idle_conns = open_idle(&server, idle);
    let unknown_calls = call_unknown_methods(&server, unknown).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (ping1, pick1, e1) = measure(seconds).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let _ = unknown_calls.await;
    let conns = idle_conns.await.unwrap();
    let series_after = series_count(&metrics_url);
    print_latencies("attacked", &ping1, &pick1, e1);
    println!(
        "pick_cpu p99 attacked / idle: {:.1}x; ping p99 attacked / idle: {:.1}x",
        pct(&pick1, 0.99) / pct(&pick0, 0.99),
        pct(&ping1, 0.99) / pct(&ping0, 0.99)
    );
    println!(
        "decide: {} answered, {} shed (RESOURCE_EXHAUSTED), {} other errors; {} idle connections opened",
        counts.answered.load(Ordering::Relaxed),
        counts.shed.load(Ordering::Relaxed),
        counts.other.load(Ordering::Relaxed),
        conns.len()
    );
    println!("metrics series: {series_before} before, {series_after} after the attack");
}

/// A probe's line: its Ping and PickCpu p50 and p99, and its errors.
fn print_latencies(label: &str, ping: &Histogram<u64>, pick: &Histogram<u64>, errors: u64) {
    println!(
        "{label}: ping p50 {:.1} µs p99 {:.1} µs; pick_cpu p50 {:.1} µs p99 {:.1} µs; errors {errors}",
        pct(ping, 0.5),
        pct(ping, 0.99),
        pct(pick, 0.5),
        pct(pick, 0.99)
    );
}

/// `deciders` callers, each on its own connection, sending the large
/// Decide back to back until `stop`.
async fn flood_decide(
    server: &Server,
    deciders: usize,
    stop: &Arc<AtomicBool>,
    counts: &Arc<DecideCounts>,
) -> Vec<JoinHandle<()>> {
    let scenario = Arc::new(big_scenario());
    let mut tasks = Vec::new();
    for _ in 0..deciders {
        let c = Client::from_channel(channel(&server.grpc).await);
        let (stop, scenario) = (Arc::clone(stop), Arc::clone(&scenario));
        let counts = Arc::clone(counts);
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match c.decide(&scenario).await {
                    Ok(_) => counts.answered.fetch_add(1, Ordering::Relaxed),
                    Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                        counts.shed.fetch_add(1, Ordering::Relaxed)
                    }
                    Err(_) => counts.other.fetch_add(1, Ordering::Relaxed),
                };
            }
        }));
    }
    tasks
}

/// `idle` TCP connections, opened and left silent.
fn open_idle(server: &Server, idle: usize) -> JoinHandle<Vec<std::net::TcpStream>> {
    let grpc = server.grpc.clone();
    tokio::task::spawn_blocking(move || {
        (0..idle)
            .filter_map(|_| std::net::TcpStream::connect(&grpc).ok())
            .collect::<Vec<_>>()
    })
}

/// `unknown` calls to made-up method names, one after the other.
async fn call_unknown_methods(server: &Server, unknown: usize) -> JoinHandle<()> {
    let ch = channel(&server.grpc).await;
    tokio::spawn(async move {
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
    })
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
