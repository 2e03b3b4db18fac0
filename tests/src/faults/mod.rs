//! The lease fault suite: the real binaries (a three-member etcd with
//! three replicas, or one server on redb), simulated agents that record
//! what they are told and the real agent, concurrent clients that
//! allocate, renew, release and read nodes, and a scheduler that injects
//! faults at random, repeatably from a seed. Every call is recorded with
//! monotonic times and its outcome (ok, refused, or unknown), the
//! agents' views and snapshots of the lease store too, and the history is
//! checked at the end by `crate::history`, counting an unknown outcome as
//! possibly applied.
//!
//! Its summary line: `lease history: O operations, F faults (K kinds), U
//! unknown outcomes, V violations`.

pub mod agents;
pub mod clients;
pub mod record;
pub mod rig;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::history::{self, Outcome, Record, Violation};
use record::{Recorder, Rng, cpus};
use rig::Rig;

/// What one run does.
#[derive(Debug, Clone)]
pub struct Config {
    pub seed: u64,
    /// How long clients run and faults are injected.
    pub duration: Duration,
    /// The etcd binary: replicas on etcd; `None`: one server on redb.
    pub etcd: Option<String>,
    pub clients: u32,
    pub nodes: usize,
    /// The pause between two faults, at random within.
    pub gap_ms: (u64, u64),
}

/// What a run found.
#[derive(Debug, Default)]
pub struct Report {
    pub mode: &'static str,
    pub operations: usize,
    pub faults: BTreeMap<String, usize>,
    /// The kinds the rig could inject.
    pub kinds: Vec<&'static str>,
    pub unknown: usize,
    pub violations: Vec<Violation>,
    /// Grants answered OK, to tell a run that did something.
    pub granted: usize,
}

impl Report {
    /// The suite's summary line.
    pub fn line(&self) -> String {
        format!(
            "lease history: {} operations, {} faults ({} kinds), {} unknown outcomes, {} violations",
            self.operations,
            self.faults.values().sum::<usize>(),
            self.faults.len(),
            self.unknown,
            self.violations.len()
        )
    }

    /// Kinds the rig could inject that the run never did.
    pub fn kinds_missing(&self) -> Vec<&'static str> {
        self.kinds
            .iter()
            .copied()
            .filter(|k| !self.faults.contains_key(*k))
            .collect()
    }
}

/// Runs the suite once.
pub async fn run(cfg: &Config) -> Report {
    let rec = Arc::new(Recorder::default());
    let mut rig = Rig::start(cfg.etcd.as_deref(), cfg.nodes).await;
    let nodes: Vec<String> = (0..cfg.nodes).map(|i| format!("n{i}")).collect();
    let (stop, stopped) = watch::channel(false);
    let mut tasks = tokio::task::JoinSet::new();
    for (i, id) in nodes.iter().enumerate() {
        let node = agents::SimNode {
            id: id.clone(),
            links: rig.node_links[i].clone(),
            addrs: rig.addrs.clone(),
        };
        tasks.spawn(agents::run(Arc::clone(&rec), node, stopped.clone()));
    }
    wait_registered(&rig.addrs, &nodes).await;
    let mut all_nodes = nodes.clone();
    all_nodes.push("real".into());
    let target = Arc::new(clients::Target {
        servers: rig.addrs.clone(),
        nodes: all_nodes,
    });
    let until = Instant::now() + cfg.duration;
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..cfg.clients {
        let (rec, t) = (Arc::clone(&rec), Arc::clone(&target));
        clients.spawn(clients::run(rec, c, t, cfg.seed, until));
    }
    if let Some(e) = &rig.etcd {
        tasks.spawn(snapshots(Arc::clone(&rec), e.client(), stopped.clone()));
    }
    let faults = inject(&mut rig, cfg, until, &rec).await;
    rig.heal_all();
    while clients.join_next().await.is_some() {}
    // Let every unknown outcome settle and every agent catch up, then one
    // last look at the store.
    tokio::time::sleep(Duration::from_secs(3)).await;
    if let Some(e) = &rig.etcd {
        snapshot_once(&rec, &e.client()).await;
    }
    stop.send_replace(true);
    while tasks.join_next().await.is_some() {}
    let h = rec.history();
    let violations = history::check(&h);
    Report {
        mode: if cfg.etcd.is_some() {
            "replicas on etcd"
        } else {
            "one server on redb"
        },
        operations: h.ops.len(),
        unknown: h
            .ops
            .iter()
            .filter(|o| matches!(o.outcome, Outcome::Unknown { .. }))
            .count(),
        granted: h
            .ops
            .iter()
            .filter(|o| matches!(o.outcome, Outcome::Ok(history::Answer::Granted { .. })))
            .count(),
        faults,
        kinds: rig.kinds(),
        violations,
    }
}

/// Injects faults until `until`: every kind once first (in an order drawn
/// from the seed), then kinds at random.
async fn inject(
    rig: &mut Rig,
    cfg: &Config,
    until: Instant,
    rec: &Recorder,
) -> BTreeMap<String, usize> {
    let mut rng = Rng::new(cfg.seed);
    let mut order = rig.kinds();
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut done: BTreeMap<String, usize> = BTreeMap::new();
    let mut k = 0usize;
    tokio::time::sleep(rng.ms(500, 1_500)).await;
    while Instant::now() < until {
        let kind = match order.get(k) {
            Some(kind) => *kind,
            None => order[rng.below(order.len() as u64) as usize],
        };
        k += 1;
        let what = rig.inject(kind, &mut rng).await;
        eprintln!("fault {k} at {:?}: {kind}: {what}", rec.elapsed());
        *done.entry(kind.to_string()).or_default() += 1;
        tokio::time::sleep(rng.ms(cfg.gap_ms.0, cfg.gap_ms.1)).await;
    }
    done
}

/// Waits (at most 30 s) until every simulated node answers GetNode.
async fn wait_registered(addrs: &[String], nodes: &[String]) {
    use fairplace_proto::v1::admin_service_client::AdminServiceClient;
    let t0 = Instant::now();
    for n in nodes {
        loop {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", addrs[0]))
                .expect("address")
                .connect_lazy();
            let req = fairplace_proto::v1::GetNodeRequest { node_id: n.clone() };
            if AdminServiceClient::new(ch).get_node(req).await.is_ok()
                || t0.elapsed() > Duration::from_secs(30)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

/// A snapshot of the leases in etcd every 700 ms until `stop`.
async fn snapshots(
    rec: Arc<Recorder>,
    etcd: fairplace::replica::etcd::Etcd,
    mut stop: watch::Receiver<bool>,
) {
    while !*stop.borrow() {
        snapshot_once(&rec, &etcd).await;
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(700)) => {}
            _ = stop.changed() => return,
        }
    }
}

/// One consistent read of every lease record (skipped when etcd has no
/// quorum to answer).
async fn snapshot_once(rec: &Recorder, etcd: &fairplace::replica::etcd::Etcd) {
    let t = rec.now();
    let read = tokio::time::timeout(
        Duration::from_secs(2),
        etcd.range_prefix(b"/fairplace/leases/"),
    )
    .await;
    let Ok(Ok((kvs, _))) = read else { return };
    let records = kvs
        .iter()
        .filter_map(|kv| serde_json::from_slice::<fairplace::store::LeaseRecord>(&kv.value).ok())
        .map(|r| Record {
            node: r.node,
            lease: r.id,
            cpus: cpus(&r.cpus),
        })
        .collect();
    rec.snapshot(t, records);
}
