//! `fairplace-load scale`: the replica set at cluster scale, measured as
//! users compare schedulers: placements per second over the whole
//! cluster, with the decision made durable, at tens of thousands of nodes.
//!
//! One server first, then a three-member etcd with three replicas, on the
//! same cores (`--server-cpus`), each holding the same `--nodes` simulated
//! nodes of `--cpus` CPUs (registered with one full snapshot each, their
//! streams held open by this process: cheap agents). The orchestrators
//! are routing clients ([`fairplace_client::routes`]), given the three
//! addresses. Phases:
//!
//! - node PickCpu (a wakeup on a node drawn in turn from all of them):
//!   on the single server, then over the replica set; the ratio is what
//!   being replicated costs a placement;
//! - the share of the replica set's calls that went through a forwarding
//!   hop (`fairplace_replica_forwards_total` over the calls made);
//! - cluster PickCpu (no node): where it lands, a replica chooses among
//!   every replica's nodes, and one hop places it when the node is
//!   another replica's;
//! - cluster AllocateCpus then ReleaseCpus, leases in etcd;
//! - each replica's resident memory, and what a remote node costs it.
//!
//! Last line: `scale: replica set / single A, forwarded F %, cluster picks
//! C/s, durable allocations D/s, M MiB per replica`.

use std::time::Duration;

use fairplace_benches::load::wakeup_on_load;
use fairplace_client::{Client, TlsOptions, pb};

use crate::etcd::{etcd_cluster, replica};
use crate::memory::register_at_owners;
use crate::shared::{Launch, Server, channels, http_body, pct, print_phase, run_phase};

/// The nodes are labelled into 10 zones of 20 racks (150 nodes a rack at
/// 30,000), as the cluster benchmark's: a cluster pick compares groups,
/// then a rack's nodes.
const ZONES: usize = 10;

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 30_000)]
    pub nodes: usize,
    #[arg(long, default_value_t = 128)]
    pub cpus: u32,
    #[arg(long, default_value_t = 8)]
    pub seconds: u64,
    /// Routing clients (each with its own connections to every replica).
    #[arg(long, default_value_t = 4)]
    pub connections: usize,
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
}

/// A wakeup on node `{prefix}-k`, `k` following the caller's turn over all
/// the nodes.
fn node_pick(prefix: &str, nodes: usize, i: usize, turn: usize) -> pb::PickCpuRequest {
    let k = (i.wrapping_mul(7_919) + turn.wrapping_mul(104_729)) % nodes;
    pb::PickCpuRequest {
        node_id: format!("{prefix}-{k}"),
        ..wakeup_on_load(turn)
    }
}

/// Node PickCpu from `clients` over all the nodes; throughput, and the
/// calls made (answered or not).
async fn node_phase(name: &str, clients: &[Client], nodes: usize, o: &Opts) -> (f64, u64) {
    let turn = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (all, errors, secs) = run_phase(clients, o.concurrency, o.seconds, move |c: Client, i| {
        let t = turn.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        async move { c.pick_cpu(node_pick("scale", nodes, i, t)).await.is_ok() }
    })
    .await;
    (print_phase(name, &all, errors, secs), all.len() + errors)
}

/// Cluster PickCpu (no node); throughput and p99 (µs).
async fn cluster_phase(clients: &[Client], o: &Opts) -> (f64, f64) {
    let (all, errors, secs) = run_phase(
        clients,
        o.concurrency,
        o.seconds,
        |c: Client, i| async move {
            let mut r = node_pick("", 1, i, i);
            r.node_id.clear();
            r.kind = pb::RequestKind::Fork as i32;
            c.pick_cpu(r).await.is_ok()
        },
    )
    .await;
    (
        print_phase("cluster PickCpu (no node), replica set", &all, errors, secs),
        pct(&all, 0.99),
    )
}

/// Cluster AllocateCpus (no node) and its ReleaseCpus, leases in etcd;
/// lives per second and p99 (µs).
async fn durable_phase(clients: &[Client], o: &Opts) -> (f64, f64) {
    let (all, errors, secs) = run_phase(
        clients,
        o.concurrency,
        o.seconds,
        |c: Client, _| async move {
            let r = c
                .allocate_cpus(pb::AllocateCpusRequest {
                    count: 1,
                    holder: "fairplace-load scale".into(),
                    ..Default::default()
                })
                .await;
            match r {
                Ok(g) => c.release_cpus(g.lease_id).await.is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
    (
        print_phase(
            "cluster AllocateCpus + ReleaseCpus, leases in etcd",
            &all,
            errors,
            secs,
        ),
        pct(&all, 0.99),
    )
}

/// A counter's total over its series in a /metrics body.
fn counter(body: &str, name: &str) -> f64 {
    body.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn forwards(servers: &[Server]) -> f64 {
    servers
        .iter()
        .map(|s| {
            counter(
                &http_body(&format!("http://{}/metrics", s.metrics)),
                "fairplace_replica_forwards_total",
            )
        })
        .sum()
}

/// The single server with the nodes; its node PickCpu throughput and RSS.
async fn single(launch: &Launch, o: &Opts) -> (f64, u64) {
    // Registrations (topology builds) wait rather than shed, as on the
    // replicas.
    let s = Server::start_with(
        &launch.cpus,
        launch.threads,
        &[
            "--heavy-queue".into(),
            "256".into(),
            "--max-nodes".into(),
            (o.nodes + 1_000).to_string(),
            "--max-agent-streams".into(),
            (o.nodes + 1_000).to_string(),
        ],
    );
    let chans = vec![channels(&s.grpc, 8).await];
    let (streams, _) = register_at_owners(
        &chans,
        &["single".into()],
        "scale",
        o.nodes,
        o.cpus,
        Some(ZONES),
    )
    .await;
    let clients: Vec<Client> = chans[0]
        .iter()
        .take(o.connections.max(1))
        .cloned()
        .map(Client::from_channel)
        .collect();
    let (rps, _) = node_phase("node PickCpu, one server", &clients, o.nodes, o).await;
    let rss = s.rss_kib();
    drop(streams);
    (rps, rss)
}

pub async fn run(server: Server, launch: &Launch, o: Opts) {
    drop(server);
    println!(
        "# fairplace-load scale: {} nodes x {} CPUs; one server, then 3 replicas on a 3-member etcd; {} routing clients, {} callers, {} s per phase",
        o.nodes, o.cpus, o.connections, o.concurrency, o.seconds
    );
    let (single_rps, single_rss) = single(launch, &o).await;
    let e = etcd_cluster(3);
    let ids: Vec<String> = (0..3).map(|i| format!("r{i}")).collect();
    let servers: Vec<Server> = ids
        .iter()
        .map(|id| replica(&launch.cpus, launch.threads, &e, id))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let base: Vec<u64> = servers.iter().map(Server::rss_kib).collect();
    let mut chans = Vec::new();
    for s in &servers {
        chans.push(channels(&s.grpc, 4).await);
    }
    let (streams, per) =
        register_at_owners(&chans, &ids, "scale", o.nodes, o.cpus, Some(ZONES)).await;
    // The aggregates reach every replica; the start-up hand-overs end.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let addrs: Vec<String> = servers.iter().map(|s| s.grpc.clone()).collect();
    let mut clients = Vec::new();
    for _ in 0..o.connections.max(1) {
        clients.push(
            Client::connect_routed(&addrs, &TlsOptions::default())
                .await
                .expect("a routing client"),
        );
    }
    let f0 = forwards(&servers);
    let (set_rps, calls) = node_phase(
        "node PickCpu, replica set, routing clients",
        &clients,
        o.nodes,
        &o,
    )
    .await;
    let forwarded = 100.0 * (forwards(&servers) - f0) / calls.max(1) as f64;
    let (cluster_rps, cluster_p99) = cluster_phase(&clients, &o).await;
    let (durable_rps, durable_p99) = durable_phase(&clients, &o).await;
    let rss: Vec<u64> = servers.iter().map(Server::rss_kib).collect();
    report(&o, (single_rps, single_rss), (&per, &base, &rss));
    let a = set_rps / single_rps;
    let m = rss.iter().copied().max().unwrap_or(0) as f64 / 1024.0;
    println!(
        "cluster PickCpu p99 {cluster_p99:.0} µs; cluster AllocateCpus + ReleaseCpus p99 {durable_p99:.0} µs"
    );
    println!(
        "scale: replica set / single {a:.2}, forwarded {forwarded:.2} %, cluster picks {cluster_rps:.0}/s, durable allocations {durable_rps:.0}/s, {m:.0} MiB per replica"
    );
    drop(streams);
}

/// Each replica's memory, and a remote node's bytes: what a replica holds
/// beyond its owned nodes at the single server's cost per node, over the
/// nodes it holds only as aggregates.
fn report(
    o: &Opts,
    (single_rps, single_rss): (f64, u64),
    (per, base, rss): (&[usize], &[u64], &[u64]),
) {
    let owned_kib = (single_rss as f64 - base[0] as f64).max(0.0) / o.nodes as f64;
    println!(
        "single server: {single_rps:.0} node picks/s; RSS {:.1} MiB, {owned_kib:.1} KiB per node",
        single_rss as f64 / 1024.0
    );
    for (i, n) in per.iter().enumerate() {
        let remote = o.nodes - n;
        let beyond = rss[i] as f64 - base[i] as f64 - owned_kib * *n as f64;
        println!(
            "replica r{i}: {n} nodes owned, {remote} remote; RSS {:.1} MiB (empty {:.1}); a remote node about {:.0} bytes ({:.0} % of an owned one)",
            rss[i] as f64 / 1024.0,
            base[i] as f64 / 1024.0,
            beyond.max(0.0) * 1024.0 / remote.max(1) as f64,
            100.0 * beyond.max(0.0) / remote.max(1) as f64 / owned_kib.max(f64::MIN_POSITIVE)
        );
    }
}
