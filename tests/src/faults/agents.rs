//! Simulated agents that record what they are told: each keeps the
//! leases of its node as the server sent them (grants, releases), reports
//! them back when it registers again, follows the owner a stream names
//! when it ends, and logs every change of its view in the history, so the
//! checker can replay what each node would have applied.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use fairplace_proto::v1 as pb;
use pb::agent_message::Body;
use tokio::sync::{mpsc, watch};

use super::record::{Recorder, cpus};
use crate::history::AgentWhat;
use crate::partition::Link;

/// CPUs of every simulated node.
pub const NODE_CPUS: u32 = 4;

/// One simulated node: its id, and its links to each replica (in the
/// replicas' order), through which its stream goes.
pub struct SimNode {
    pub id: String,
    pub links: Vec<Arc<Link>>,
    /// Each replica's real address, in the same order: an owner trailer
    /// names one of these.
    pub addrs: Vec<String>,
}

/// Runs `node`'s agent until `stop` turns true.
pub async fn run(rec: Arc<Recorder>, node: SimNode, mut stop: watch::Receiver<bool>) {
    let mut view: BTreeMap<u64, pb::LeaseGrant> = BTreeMap::new();
    let mut at = node.id.bytes().map(usize::from).sum::<usize>() % node.links.len();
    while !*stop.borrow() {
        let next = tokio::select! {
            n = session(&rec, &node, at, &mut view) => n,
            _ = stop.changed() => return,
        };
        at = next.unwrap_or((at + 1) % node.links.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One stream to replica `at`: register with the leases held, then report
/// every 300 ms and take every Ack, until the stream ends. Returns the
/// replica the end named as the node's owner, if any.
async fn session(
    rec: &Recorder,
    node: &SimNode,
    at: usize,
    view: &mut BTreeMap<u64, pb::LeaseGrant>,
) -> Option<usize> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", node.links[at].addr))
        .ok()?
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await
        .ok()?;
    let mut client = pb::agent_service_client::AgentServiceClient::new(ch);
    let (tx, rx) = mpsc::channel(16);
    let reg = pb::Register {
        node_id: node.id.clone(),
        labels: [("zone".to_string(), "z1".to_string())].into(),
        topology: Some(crate::topology(1, 1, NODE_CPUS, 1)),
        agent_version: "faults".into(),
        held_leases: view.values().cloned().collect(),
        ..Default::default()
    };
    tx.send(msg(Body::Register(reg))).await.ok()?;
    let stream = tokio::time::timeout(
        Duration::from_secs(5),
        client.report(tokio_stream::wrappers::ReceiverStream::new(rx)),
    )
    .await;
    let mut acks = match stream {
        Ok(Ok(s)) => s.into_inner(),
        Ok(Err(s)) => return owner(node, &s),
        Err(_) => return None,
    };
    let mut tick = tokio::time::interval(Duration::from_millis(300));
    let mut seq = 0u64;
    loop {
        tokio::select! {
            m = acks.message() => match m {
                Ok(Some(a)) => take(rec, &node.id, view, a),
                Ok(None) => return None,
                Err(s) => return owner(node, &s),
            },
            _ = tick.tick() => {
                seq += 1;
                let u = pb::Update {
                    seq,
                    full: true,
                    cpus: crate::states(NODE_CPUS, &[]),
                    node_id: node.id.clone(),
                    ..Default::default()
                };
                if tx.send(msg(Body::Update(u))).await.is_err() {
                    return None;
                }
            }
        }
    }
}

fn msg(body: Body) -> pb::AgentMessage {
    pb::AgentMessage { body: Some(body) }
}

/// An Ack's leases, as an agent applies them: its releases first, then its
/// grants (one Ack of a registration carries both).
fn take(rec: &Recorder, node: &str, view: &mut BTreeMap<u64, pb::LeaseGrant>, a: pb::Ack) {
    for id in a.released {
        if view.remove(&id).is_some() {
            rec.agent(node, AgentWhat::Release { lease: id });
        }
    }
    for g in a.grants {
        rec.agent(
            node,
            AgentWhat::Grant {
                lease: g.lease_id,
                cpus: cpus(&g.cpus),
            },
        );
        view.insert(g.lease_id, g);
    }
    for r in a.renewed {
        if let Some(g) = view.get_mut(&r.lease_id) {
            g.ttl_ms = r.ttl_ms;
            g.expires_at_unix_ms = r.expires_at_unix_ms;
        }
    }
}

/// The replica a stream's end names as the node's owner.
fn owner(node: &SimNode, s: &tonic::Status) -> Option<usize> {
    let addr = s.metadata().get("fairplace-owner")?.to_str().ok()?;
    node.addrs.iter().position(|a| a == addr)
}
