//! Node aggregates between replicas, so that a cluster decision (PickCpu or
//! AllocateCpus with no node) sees every node wherever it is asked.
//!
//! Each replica publishes the aggregates of the fresh nodes it holds
//! ([`Publisher`]): every [`PUBLISH_EVERY`] it compares each node's snapshot
//! version with the one it last sent and sends what changed, at most one
//! message per period to every subscriber (coalesced), and a subscriber's
//! first message lists them all. Each replica subscribes to every other
//! member ([`follow`]) and counts their nodes in its
//! cluster hierarchy (`store::hierarchy`). A choice that lands on a remote node
//! goes to its owner, which re-validates it on its live state.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::replica_service_client::ReplicaServiceClient;
use tokio::sync::broadcast;

use super::Replica;
use crate::engine::cpumask::{CpuMask, MAX_CPUS};
use crate::engine::group::NodeAgg;
use crate::engine::state::GroupSum;
use crate::store::Store;
use crate::store::hierarchy::RemoteNode;

/// How often a replica publishes what changed: a remote aggregate is at
/// most this much older than its owner's (plus one round trip).
pub const PUBLISH_EVERY: Duration = Duration::from_millis(100);

/// One node's aggregate as published.
pub fn to_pb(
    id: &str,
    labels: &[(String, String)],
    online: &CpuMask,
    a: &NodeAgg,
) -> pb::NodeAggregate {
    pb::NodeAggregate {
        node_id: id.to_string(),
        labels: labels.iter().cloned().collect(),
        online: online.to_string(),
        nr_cpus: a.nr_cpus,
        cpus: a.sum.cpus,
        idle_cpus: a.sum.idle_cpus,
        nr_running: a.sum.nr_running,
        load: a.sum.load,
        runnable: a.sum.runnable,
        util: a.sum.util,
        capacity: a.sum.capacity,
        max_capacity: a.sum.max_capacity,
    }
}

/// A published aggregate as a remote node of `replica`; `None` when its
/// CPU list does not parse.
fn from_pb(replica: &str, n: &pb::NodeAggregate, at: Instant) -> Option<RemoteNode> {
    Some(RemoteNode {
        replica: replica.to_string(),
        path: Vec::new(),
        online: CpuMask::parse_cpulist(&n.online, MAX_CPUS).ok()?,
        agg: agg_from_pb(n),
        at,
    })
}

/// A published aggregate's sums.
pub fn agg_from_pb(n: &pb::NodeAggregate) -> NodeAgg {
    NodeAgg {
        nr_cpus: n.nr_cpus,
        sum: GroupSum {
            cpus: n.cpus,
            idle_cpus: n.idle_cpus,
            nr_running: n.nr_running,
            load: n.load,
            runnable: n.runnable,
            util: n.util,
            capacity: n.capacity,
            max_capacity: n.max_capacity,
        },
    }
}

/// The replica's side that publishes: one scan per period, its changes
/// broadcast to every subscriber.
pub struct Publisher {
    tx: broadcast::Sender<Arc<pb::NodeAggregates>>,
    store: Arc<Store>,
}

impl Publisher {
    /// Starts the scan loop over `store`'s fresh nodes.
    pub fn start(store: Arc<Store>) -> Arc<Publisher> {
        let (tx, _) = broadcast::channel(16);
        let p = Arc::new(Publisher { tx, store });
        tokio::spawn(Arc::clone(&p).scan_loop());
        p
    }

    /// Every fresh node this replica holds, now.
    pub fn full(&self) -> pb::NodeAggregates {
        let now = Instant::now();
        let nodes = self
            .store
            .nodes
            .unsorted()
            .iter()
            .filter_map(|n| {
                let s = n.snapshot();
                self.store
                    .nodes
                    .is_fresh(&s, now)
                    .then(|| to_pb(&n.id, &n.labels, &s.topo.online, &s.agg))
            })
            .collect();
        pb::NodeAggregates {
            full: true,
            nodes,
            gone: Vec::new(),
        }
    }

    /// The changes from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<pb::NodeAggregates>> {
        self.tx.subscribe()
    }

    async fn scan_loop(self: Arc<Self>) {
        // node -> the snapshot version last published.
        let mut sent: HashMap<String, u64> = HashMap::new();
        let mut tick = tokio::time::interval(PUBLISH_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if self.tx.receiver_count() == 0 {
                sent.clear();
                continue;
            }
            let now = Instant::now();
            let mut msg = pb::NodeAggregates::default();
            let mut seen = HashSet::with_capacity(sent.len());
            for n in self.store.nodes.unsorted() {
                let s = n.snapshot();
                if !self.store.nodes.is_fresh(&s, now) {
                    continue;
                }
                seen.insert(n.id.clone());
                if sent.get(&n.id) != Some(&s.version) {
                    sent.insert(n.id.clone(), s.version);
                    msg.nodes
                        .push(to_pb(&n.id, &n.labels, &s.topo.online, &s.agg));
                }
            }
            sent.retain(|id, _| {
                let keep = seen.contains(id);
                if !keep {
                    msg.gone.push(id.clone());
                }
                keep
            });
            if !msg.nodes.is_empty() || !msg.gone.is_empty() {
                let _ = self.tx.send(Arc::new(msg));
            }
        }
    }
}

/// Keeps one subscription to every other live member's aggregates, and
/// forgets a member's nodes when it leaves: `replica`'s loop.
pub async fn follow(replica: Arc<Replica>, store: Arc<Store>) {
    let mut running: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    loop {
        let members = replica.members();
        let live: HashSet<&str> = members.iter().map(|m| m.id.as_str()).collect();
        running.retain(|id, h| {
            let keep = live.contains(id.as_str()) && !h.is_finished();
            if !keep {
                h.abort();
                store.cluster.hierarchy.remote_retain(id, &HashSet::new());
            }
            keep
        });
        for m in members.iter().filter(|m| m.id != replica.id) {
            if !running.contains_key(&m.id) {
                let (me, s, peer) = (Arc::clone(&replica), Arc::clone(&store), m.clone());
                running.insert(
                    m.id.clone(),
                    tokio::spawn(async move { subscribe_to(&me, &s, &peer).await }),
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One subscription, until it fails.
async fn subscribe_to(replica: &Replica, store: &Store, peer: &super::Member) {
    let Ok(ch) = replica.peers.channel(&peer.addr) else {
        return;
    };
    // Made as this replica itself (no caller is forwarded), and with no
    // deadline: it lasts as long as both replicas.
    let req = tonic::Request::new(pb::WatchAggregatesRequest {
        replica_id: replica.id.clone(),
    });
    let mut stream = match ReplicaServiceClient::new(ch).watch_aggregates(req).await {
        Ok(s) => s.into_inner(),
        Err(e) => {
            tracing::debug!(peer = %peer.id, error = %e, "cannot subscribe to a replica's aggregates yet");
            tokio::time::sleep(Duration::from_millis(500)).await;
            return;
        }
    };
    while let Ok(Some(msg)) = stream.message().await {
        apply(store, &peer.id, msg);
    }
    store
        .cluster
        .hierarchy
        .remote_retain(&peer.id, &HashSet::new());
}

/// One published message, counted in `store`.
fn apply(store: &Store, replica: &str, msg: pb::NodeAggregates) {
    let now = Instant::now();
    let mut keep = HashSet::with_capacity(msg.nodes.len());
    for n in &msg.nodes {
        let Some(r) = from_pb(replica, n, now) else {
            continue;
        };
        let mut labels: Vec<(String, String)> = n
            .labels
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        labels.sort();
        store.cluster.remote_put(&n.node_id, &labels, r);
        keep.insert(n.node_id.clone());
    }
    for id in &msg.gone {
        store.cluster.hierarchy.remote_remove(id);
    }
    if msg.full {
        store.cluster.hierarchy.remote_retain(replica, &keep);
    }
}
