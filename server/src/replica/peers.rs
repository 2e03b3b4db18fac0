//! ReplicaService: what a replica serves its peers: the aggregates of the
//! nodes it holds ([`crate::replica::aggregates`]), and for a cluster
//! balance pass on the elected balancer, those nodes' whole state and
//! claims on their CPUs. Only `replica` (and admin) certificates reach it
//! under mutual TLS (the role table).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::replica_service_server::ReplicaService;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::convert;
use crate::replica::aggregates::{Publisher, to_pb};
use crate::store::Store;

/// Node ids one NodeStates call may list.
pub const MAX_NODE_STATES: usize = 4096;

pub struct Peers {
    pub publisher: Arc<Publisher>,
    pub store: Arc<Store>,
}

type Aggregates = Pin<Box<dyn Stream<Item = Result<pb::NodeAggregates, Status>> + Send>>;
type NodeStates = Pin<Box<dyn Stream<Item = Result<pb::NodeState, Status>> + Send>>;

/// A node registered here as a balance pass on another replica reads it;
/// `None` when it is not registered here or not fresh.
fn node_state(store: &Store, id: &str, now: Instant) -> Option<pb::NodeState> {
    let n = store.nodes.get(id)?;
    let s = n.snapshot();
    if !store.nodes.is_fresh(&s, now) {
        return None;
    }
    Some(pb::NodeState {
        aggregate: Some(to_pb(&n.id, &n.labels, &s.topo.online, &s.agg)),
        topology: Some(convert::topology_to_pb(&n.spec)),
        cpus: convert::cpu_states_to_pb(&s.state),
        tasks: convert::task_lists_to_pb(&s.tasks),
        util_est: s.features.util_est,
    })
}

#[tonic::async_trait]
impl ReplicaService for Peers {
    type WatchAggregatesStream = Aggregates;
    type NodeStatesStream = NodeStates;

    async fn node_states(
        &self,
        req: Request<pb::NodeStatesRequest>,
    ) -> Result<Response<NodeStates>, Status> {
        let ids = req.into_inner().node_ids;
        if ids.len() > MAX_NODE_STATES {
            return Err(Status::invalid_argument(format!(
                "node_ids: {} ids, at most {MAX_NODE_STATES}",
                ids.len()
            )));
        }
        // One node converted at a time, as the caller reads: the memory
        // held is the channel's few messages, whatever the list's length.
        let (tx, out) = mpsc::channel(8);
        let store = Arc::clone(&self.store);
        tokio::spawn(async move {
            let now = Instant::now();
            for id in ids {
                let Some(st) = node_state(&store, &id, now) else {
                    continue;
                };
                if tx.send(Ok(st)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }

    async fn claim_cpus(
        &self,
        req: Request<pb::ClaimCpusRequest>,
    ) -> Result<Response<pb::ClaimCpusResponse>, Status> {
        let r = req.into_inner();
        let Some(n) = self.store.nodes.get(&r.node_id) else {
            return Ok(Response::new(pb::ClaimCpusResponse { claimed: 0 }));
        };
        if r.cpus.len() > n.spec.cpus.len() {
            return Err(Status::invalid_argument(format!(
                "cpus: {} CPUs listed, the node has {}",
                r.cpus.len(),
                n.spec.cpus.len()
            )));
        }
        let cpus: Vec<usize> = r.cpus.iter().map(|&c| c as usize).collect();
        let claimed = self.store.nodes.claim_cpus(&n, &cpus, Instant::now());
        Ok(Response::new(pb::ClaimCpusResponse { claimed }))
    }

    async fn watch_aggregates(
        &self,
        req: Request<pb::WatchAggregatesRequest>,
    ) -> Result<Response<Aggregates>, Status> {
        let who = req.into_inner().replica_id;
        // Subscribed before the full list is read: no change falls between.
        let mut rx = self.publisher.subscribe();
        let first = self.publisher.full();
        tracing::info!(replica = %who, nodes = first.nodes.len(), "a replica subscribed to this one's aggregates");
        let (tx, out) = mpsc::channel(4);
        let publisher = Arc::clone(&self.publisher);
        tokio::spawn(async move {
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            loop {
                let msg = match rx.recv().await {
                    Ok(m) => (*m).clone(),
                    // Too slow to keep up: the whole list again.
                    Err(RecvError::Lagged(_)) => publisher.full(),
                    Err(RecvError::Closed) => return,
                };
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}
