//! `fairplace-load cluster`: 10 zones x 20 racks x 50 nodes of 128 CPUs
//! registered over agent streams, then PickCpu with no node (cluster
//! placement) and the no-op Ping over gRPC, and in the same run the naive
//! recomputation of the same cluster in this process.
//!
//! Why: a cluster placement chooses among every node from aggregates kept
//! up to date as reports arrive; this shows what it costs over gRPC
//! against Ping, and how much the incremental choice saves over computing
//! it afresh from every node.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::topology::TopologySpec;
use fairplace::store::hierarchy::ClusterRequest;
use fairplace::store::{Store, StoreConfig};
use fairplace_client::{Client, pb};
use hdrhistogram::Histogram;
use tonic::transport::Channel;

use fairplace_benches::load::{states, topology};

use crate::shared::{
    Launch, NodeStream, Server, channels, pct, ping_or_pick, print_phase, register_node, run_phase,
    store_update, update,
};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 10)]
    pub zones: usize,
    #[arg(long, default_value_t = 20)]
    pub racks: usize,
    #[arg(long, default_value_t = 50)]
    pub nodes_per_rack: usize,
    #[arg(long, default_value_t = 128)]
    pub cpus: u32,
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    #[arg(long, default_value_t = 20)]
    pub connections: usize,
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
}

/// Cluster placement over gRPC against a large registered cluster.
pub async fn run(server: Server, _launch: &Launch, o: Opts) {
    let Opts {
        zones,
        racks,
        nodes_per_rack: per_rack,
        cpus,
        seconds,
        connections,
        concurrency,
    } = o;
    let chans = channels(&server.grpc, connections).await;
    // The same cluster in this process, for the naive baseline.
    let local = Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        ..StoreConfig::default()
    });
    let spec = fairplace::convert::topology_spec(Some(&topology(cpus)), "topology")
        .expect("valid topology");
    let t0 = Instant::now();
    let (streams, k) =
        register_cluster(&chans, &local, &spec, (zones, racks, per_rack), cpus).await;
    println!(
        "# fairplace-load cluster: {k} nodes x {cpus} CPUs ({zones} zones x {racks} racks x {per_rack}), registered in {:.1} s; {connections} connections, {concurrency} callers, {seconds} s per phase",
        t0.elapsed().as_secs_f64()
    );
    let clients: Vec<Client> = chans.iter().cloned().map(Client::from_channel).collect();
    let results = grpc_phases(&clients, concurrency, seconds).await;
    let (h, hi) = in_process(&local, cpus);
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

/// Registers every node over gRPC (zone and rack labels, one full
/// snapshot) and the same in `local`; the streams, kept open, and the
/// count.
async fn register_cluster(
    chans: &[Channel],
    local: &Store,
    spec: &TopologySpec,
    (zones, racks, per_rack): (usize, usize, usize),
    cpus: u32,
) -> (Vec<NodeStream>, usize) {
    let mut streams = Vec::new();
    let mut k = 0usize;
    for z in 0..zones {
        for r in 0..racks {
            for n in 0..per_rack {
                let id = format!("z{z}-r{r}-n{n}");
                let labels: HashMap<String, String> = [
                    ("zone".to_string(), format!("z{z}")),
                    ("rack".to_string(), format!("r{r}")),
                ]
                .into();
                let st = states(cpus, k as u64 + 1);
                let ch = chans[k % chans.len()].clone();
                let mut s = register_node(ch, &id, topology(cpus), labels.clone()).await;
                s.tx.send(update(1, true, st.clone())).await.unwrap();
                s.acks.message().await.unwrap().unwrap();
                streams.push(s);
                let (node, g) = local
                    .nodes
                    .register(
                        &id,
                        labels.into_iter().collect(),
                        "load".into(),
                        spec.clone(),
                    )
                    .unwrap();
                local
                    .nodes
                    .apply(&node, g, &store_update(&st), Instant::now())
                    .unwrap();
                k += 1;
            }
        }
    }
    (streams, k)
}

/// Ping, then PickCpu with no node; each phase's p50 (µs).
async fn grpc_phases(clients: &[Client], concurrency: usize, seconds: u64) -> Vec<f64> {
    let mut results = Vec::new();
    for phase in ["ping", "cluster_pick"] {
        let (all, errors, secs) = run_phase(clients, concurrency, seconds, move |c, _| {
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
    results
}

/// The naive recomputation of the same cluster and the incremental pick,
/// in this process: their latencies.
fn in_process(local: &Store, cpus: u32) -> (Histogram<u64>, Histogram<u64>) {
    let all = CpuMask::first_n(cpus as usize);
    let req = ClusterRequest::default();
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    for _ in 0..20 {
        let t0 = Instant::now();
        let c = local.cluster.naive_pick(&req, &all);
        h.record(t0.elapsed().as_nanos() as u64).unwrap();
        assert!(c.is_some());
    }
    let mut hi = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    for _ in 0..2000 {
        let t0 = Instant::now();
        let c = local.cluster.pick(&req, &all);
        hi.record(t0.elapsed().as_nanos() as u64).unwrap();
        assert!(c.is_some());
    }
    (h, hi)
}
