//! `fairplace-load memory`: registers many nodes, each with one full
//! snapshot, and reads the server's resident memory with their agent
//! streams open and again once they closed; with `--in-process`, the
//! store alone in this process, with no transport; with `--replicas`, the
//! nodes spread over replicas on one etcd, each replica's memory.
//!
//! Why: the server holds every node's topology and state; this is what a
//! node costs it, what of that is the store's own, and how the cost
//! divides when replicas share the nodes.

use std::time::{Duration, Instant};

use fairplace_client::Client;

use fairplace_benches::load::{states, topology};

use crate::etcd::{etcd, replica};
use crate::shared::{
    Launch, NodeStream, Server, channels, register_node, register_nodes, store_update, update,
};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    #[arg(long, default_value_t = 128)]
    pub cpus: u32,
    #[arg(long, default_value_t = 20)]
    pub connections: usize,
    /// Measure the store alone, in this process, without gRPC.
    #[arg(long)]
    pub in_process: bool,
    /// Spread the nodes over this many replicas on one etcd (each node
    /// registered at its owner) and report each replica's memory.
    #[arg(long, default_value_t = 0)]
    pub replicas: usize,
}

/// Measures as the flags ask: in this process, on `server`, or on
/// replicas of its own (`server` stopped first).
pub async fn run(server: Server, launch: &Launch, o: Opts) {
    match o {
        Opts {
            nodes,
            cpus,
            in_process: true,
            ..
        } => memory_in_process(nodes, cpus),
        Opts {
            nodes,
            cpus,
            connections,
            in_process: false,
            replicas: 0,
        } => memory(&server, nodes, cpus, connections).await,
        Opts {
            nodes,
            cpus,
            replicas,
            ..
        } => {
            drop(server);
            over_replicas(&launch.cpus, launch.threads, nodes, cpus, replicas).await;
        }
    }
}

/// This process's resident memory, KiB.
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
    use fairplace::store::{Store, StoreConfig};
    let base = own_rss_kib();
    let store = Store::new(StoreConfig::default());
    let spec = fairplace::convert::topology_spec(Some(&topology(cpus)), "t").unwrap();
    let now = Instant::now();
    for i in 0..nodes {
        let (n, g) = store
            .nodes
            .register(&format!("mem-{i}"), vec![], "load".into(), spec.clone())
            .unwrap();
        let u = store_update(&states(cpus, i as u64 + 1));
        store.nodes.apply(&n, g, &u, now).unwrap();
    }
    let rss = own_rss_kib();
    println!(
        "memory (store alone, in process): {:.1} MiB for {} nodes x {cpus} CPUs; {:.1} KiB per node",
        rss.saturating_sub(base) as f64 / 1024.0,
        store.nodes.len(),
        rss.saturating_sub(base) as f64 / nodes as f64
    );
}

/// The server's memory with `nodes` registered nodes, streams open and
/// then closed.
async fn memory(server: &Server, nodes: usize, cpus: u32, connections: usize) {
    tokio::time::sleep(Duration::from_millis(200)).await;
    let base = server.rss_kib();
    let chans = channels(&server.grpc, connections).await;
    let t0 = Instant::now();
    // Register and report in batches; the streams stay open (connected nodes).
    let streams = register_nodes(&chans, "mem", nodes, cpus).await;
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

/// `nodes` nodes of `node_cpus` CPUs spread over `n` replicas, each
/// registered at its owner with one full snapshot and its stream kept
/// open; each replica's resident memory.
async fn over_replicas(cpus: &str, threads: usize, nodes: usize, node_cpus: u32, n: usize) {
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
    let (streams, per) = register_at_owners(&chans, &ids, "mem", nodes, node_cpus, None).await;
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

/// Registers nodes `{prefix}-0` to `{prefix}-{nodes - 1}` each at its
/// owner among the replicas `ids` (their connections `chans`; one id: a
/// single server), a few registrations in flight per replica; with
/// `zones`, node `i` labelled zone `z{i % zones}` and rack `r{i / zones %
/// 20}` (the cluster hierarchy's levels); the streams, kept open, and how
/// many nodes each replica got.
pub async fn register_at_owners(
    chans: &[Vec<tonic::transport::Channel>],
    ids: &[String],
    prefix: &str,
    nodes: usize,
    node_cpus: u32,
    zones: Option<usize>,
) -> (Vec<NodeStream>, Vec<usize>) {
    let n = ids.len();
    let mut set = tokio::task::JoinSet::new();
    let mut streams = Vec::with_capacity(nodes);
    let mut per = vec![0usize; n];
    for i in 0..nodes {
        let id = format!("{prefix}-{i}");
        let owner = fairplace::replica::hrw::owner(ids.iter().map(String::as_str), &id)
            .and_then(|o| ids.iter().position(|x| x == o))
            .expect("an owner");
        per[owner] += 1;
        let ch = chans[owner][i % chans[owner].len()].clone();
        let labels: std::collections::HashMap<String, String> = match zones {
            Some(z) => [
                ("zone".to_string(), format!("z{}", i % z)),
                ("rack".to_string(), format!("r{}", i / z % 20)),
            ]
            .into(),
            None => Default::default(),
        };
        set.spawn(async move {
            let mut s = register_node(ch, &id, topology(node_cpus), labels).await;
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
    (streams, per)
}
