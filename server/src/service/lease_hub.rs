//! The hub between leases and the agents that apply them: one sender per
//! connected node's Report stream (an unsolicited Ack carries grants and
//! releases to it), and one waiter per allocation waiting for its agent's
//! answer. A leaf of the service: the Report handler (`agent.rs`) attaches
//! and detaches streams and hands it outcomes; the lease calls
//! (`allocate.rs`) send through it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use fairplace_proto::v1 as pb;
use tokio::sync::oneshot;
use tonic::Status;

use crate::convert;
use crate::metrics as m;
use crate::store::leases::settle::{self, AgentSink, Settling};
use crate::store::{Lease, Node, Store, Target};

pub(crate) use crate::transport::ack_queue::AckTx;

/// How long an allocation with `apply` waits for its agent's answer (under
/// the server's default 2 s request timeout).
pub const APPLY_TIMEOUT: Duration = Duration::from_millis(1500);

/// The connected agents' streams and the allocations waiting for them.
#[derive(Default)]
pub struct LeaseHub {
    streams: Mutex<HashMap<String, (u64, AckTx)>>,
    /// Lease id -> (node id, the waiting allocation).
    pending: Mutex<HashMap<u64, (String, oneshot::Sender<pb::ApplyOutcome>)>>,
}

impl LeaseHub {
    /// A registered stream: grants for `node` go to `tx` from now on.
    pub fn attach(&self, node: &str, generation: u64, tx: AckTx) {
        lock(&self.streams).insert(node.to_string(), (generation, tx));
    }

    /// The stream of `generation` ended; allocations waiting on it fail now.
    pub fn detach(&self, node: &str, generation: u64) {
        let mut s = lock(&self.streams);
        if s.get(node).is_some_and(|(g, _)| *g == generation) {
            s.remove(node);
            lock(&self.pending).retain(|_, (n, _)| n != node);
        }
    }

    fn sender(&self, node: &str) -> Option<AckTx> {
        lock(&self.streams).get(node).map(|(_, tx)| tx.clone())
    }

    /// After a registration: tells the agent which of its leases it must
    /// drop (reconciliation) and sends it every live lease of the node, so
    /// it (re)applies the ones with a target and keeps all on record.
    pub async fn resend(&self, store: &Store, node: &Node, tx: &AckTx, released: Vec<u64>) {
        let grants: Vec<pb::LeaseGrant> = store
            .leases
            .leases_of(node)
            .iter()
            .map(|l| grant_pb(l, &node.id))
            .collect();
        if !grants.is_empty() || !released.is_empty() {
            let ack = pb::Ack {
                grants,
                released,
                ..Default::default()
            };
            let _ = tx.send(Ok(Box::new(ack))).await;
        }
    }

    /// Tells the node's agent of a lease it only keeps on record (no
    /// target), or of a renewal. Never dropped while the stream lives
    /// (`AckTx::send_lease`); an agent that is not connected gets the full
    /// set again at its next registration.
    pub(super) fn push(&self, node: &str, ack: pb::Ack) {
        if let Some(tx) = self.sender(node) {
            let _ = tx.send_lease(Ok(Box::new(ack)));
        }
    }

    /// Tells the node's agent that leases ended. Never dropped while the
    /// stream lives; an agent that is not connected learns it at its next
    /// registration (the ended lease it reports is refused).
    pub fn notify_released(&self, node: &str, ids: Vec<u64>) {
        if let Some(tx) = self.sender(node) {
            let _ = tx.send_lease(Ok(Box::new(pb::Ack {
                released: ids,
                ..Default::default()
            })));
        }
    }

    /// An outcome from `node`'s agent: the answer an allocation waits for,
    /// or an unsolicited report (a re-applied lease, a target gone).
    pub fn outcome(self: &Arc<Self>, store: &Arc<Store>, node: &Node, o: pb::ApplyOutcome) {
        let waiter = {
            let mut p = lock(&self.pending);
            match p.get(&o.lease_id) {
                Some((n, _)) if *n == node.id => p.remove(&o.lease_id).map(|(_, w)| w),
                _ => None,
            }
        };
        if let Some(w) = waiter {
            let _ = w.send(o);
            return;
        }
        // Only this node's own leases: a node may not end another's.
        if !store
            .leases
            .leases_of(node)
            .iter()
            .any(|l| l.id == o.lease_id)
        {
            return;
        }
        if o.ok {
            store.leases.mark_lease_applied(node, o.lease_id);
        } else if matches!(
            o.reason.as_str(),
            "gone" | "not_found" | "permission_denied"
        ) {
            // The node's own report ends its own lease (checked above);
            // settled like any end, nobody waits for it.
            if let Ok((_, _, commit)) = store.leases.begin_end(o.lease_id, |_| Ok::<(), ()>(())) {
                let sink: Arc<dyn AgentSink> = Arc::clone(self) as Arc<dyn AgentSink>;
                let what = Settling::End;
                drop(settle::spawn(
                    &store.leases,
                    &sink,
                    o.lease_id,
                    what,
                    commit,
                ));
                metrics::counter!(m::LEASES_ENDED, "how" => "target_gone").increment(1);
                tracing::info!(node = %node.id, lease = o.lease_id, reason = %o.reason, message = %o.message, "lease released: the agent cannot apply it");
            }
        } else {
            tracing::warn!(node = %node.id, lease = o.lease_id, reason = %o.reason, message = %o.message, "the agent could not re-apply a lease");
        }
    }

    /// Sends a lease to its node's agent and waits for the outcome.
    pub(super) async fn apply(
        &self,
        store: &Store,
        node: &Node,
        lease: &Lease,
    ) -> Result<(), Status> {
        let q = convert::quote(&node.id);
        let Some(tx) = self.sender(&node.id) else {
            return Err(Status::unavailable(format!(
                "apply: no agent is connected for node {q}"
            )));
        };
        let (wtx, wrx) = oneshot::channel();
        lock(&self.pending).insert(lease.id, (node.id.clone(), wtx));
        let ack = pb::Ack {
            grants: vec![grant_pb(lease, &node.id)],
            ..Default::default()
        };
        let sent = tokio::time::timeout(APPLY_TIMEOUT, tx.send(Ok(Box::new(ack)))).await;
        if !matches!(sent, Ok(Ok(()))) {
            lock(&self.pending).remove(&lease.id);
            return Err(Status::unavailable(format!(
                "apply: the agent stream of node {q} is not taking messages"
            )));
        }
        let answer = tokio::time::timeout(APPLY_TIMEOUT, wrx).await;
        lock(&self.pending).remove(&lease.id);
        match answer {
            Ok(Ok(o)) if o.ok => {
                store.leases.mark_lease_applied(node, lease.id);
                Ok(())
            }
            Ok(Ok(o)) => Err(outcome_status(&o)),
            Ok(Err(_)) => Err(Status::unavailable(format!(
                "apply: the agent stream of node {q} ended before it answered"
            ))),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "apply: the agent of node {q} did not answer within {} ms",
                APPLY_TIMEOUT.as_millis()
            ))),
        }
    }
}

/// The node's agent hears of every end before the lease's CPUs are free,
/// and of a grant settled after its caller was answered.
impl AgentSink for LeaseHub {
    fn ended(&self, node: &str, id: u64) {
        self.notify_released(node, vec![id]);
    }

    fn granted(&self, node: &str, lease: &Lease) {
        self.push(
            node,
            pb::Ack {
                grants: vec![grant_pb(lease, node)],
                ..Default::default()
            },
        );
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The status an agent's failure becomes.
fn outcome_status(o: &pb::ApplyOutcome) -> Status {
    let msg = format!("apply: {}", o.message);
    match o.reason.as_str() {
        "not_found" | "gone" => Status::not_found(msg),
        "permission_denied" => Status::permission_denied(msg),
        "invalid" => Status::invalid_argument(msg),
        _ => Status::failed_precondition(msg),
    }
}

pub fn target_pb(t: &Target) -> pb::ApplyTarget {
    pb::ApplyTarget {
        target: Some(match t {
            Target::Pid(p) => pb::apply_target::Target::Pid(*p),
            Target::Cgroup(c) => pb::apply_target::Target::Cgroup(c.clone()),
        }),
    }
}

pub(super) fn grant_pb(l: &Lease, node: &str) -> pb::LeaseGrant {
    let r = l.record(node);
    pb::LeaseGrant {
        lease_id: r.id,
        cpus: r.cpus,
        target: r.target.as_ref().map(target_pb),
        policy: r.policy,
        holder: r.holder,
        owner: r.owner,
        ttl_ms: r.ttl_ms.min(u32::MAX as u64) as u32,
        expires_at_unix_ms: r.expires_at_ms,
        granted_at_unix_ms: r.granted_at_ms,
    }
}
