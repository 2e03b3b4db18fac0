//! Which replica answers a call, when the server is one of several
//! (`--etcd-endpoints`): the node's owner. A call for a node this replica
//! holds is answered here; one for a node another replica owns is passed
//! to it ([`crate::replica::forward`]) with the caller's identity; a call
//! another replica passed here is answered here, never passed on again.
//!
//! Agents are routed at registration: a replica claims the node
//! ([`Replicated::take_over`]) or ends the stream with the owner's address
//! in [`OWNER_HEADER`], which the agent follows.

use std::sync::Arc;
use std::time::Instant;

use fairplace_proto::v1::admin_service_client::AdminServiceClient;
use fairplace_proto::v1::placement_service_client::PlacementServiceClient;
use tonic::Status;
use tonic::transport::Channel;

use crate::identity::{Caller, Forwarded, Routed};
use crate::replica::log::EtcdLog;
use crate::replica::{ClaimError, Member, Redirect, Replica};
use crate::store::Store;

/// The trailer metadata key with which a replica sends an agent to the
/// node's owner (`host:port`; absent: any replica).
pub const OWNER_HEADER: &str = "fairplace-owner";

/// A replica's membership and its lease store.
#[derive(Clone)]
pub struct Replicated {
    pub replica: Arc<Replica>,
    pub log: Arc<EtcdLog>,
}

/// Where a call is answered.
pub enum Route {
    Here,
    Peer(Member),
}

/// Whether the call was passed here by another replica.
pub fn forwarded(ext: &http::Extensions) -> bool {
    ext.get::<Forwarded>().is_some()
}

/// Where a call for a node `owner` holds goes: to it (forwarded), or, for
/// a client that routes itself, back to the client with the owner's
/// address, so its next call goes straight there.
fn to_owner(owner: Member, what: String, ext: &http::Extensions) -> Result<Route, Status> {
    if ext.get::<Routed>().is_none() {
        return Ok(Route::Peer(owner));
    }
    metrics::counter!(crate::metrics::REPLICA_HANDOFFS, "how" => "client_redirected").increment(1);
    Err(redirect_status(&Redirect {
        why: format!("{what} is owned by replica {}", owner.id),
        addr: owner.addr,
    }))
}

impl Replicated {
    /// The replica that answers a call for `node`: here when it is
    /// registered here, when the call was forwarded, or when no other live
    /// replica owns it; UNAVAILABLE (retry) while the node is moving
    /// between replicas.
    pub fn route_node(
        &self,
        store: &Store,
        node: &str,
        ext: &http::Extensions,
    ) -> Result<Route, Status> {
        if node.is_empty() || store.nodes.get(node).is_some() {
            return Ok(Route::Here);
        }
        let moving = |why: &str| {
            Err(Status::unavailable(format!(
                "node_id: node {} is moving between replicas ({why}, as replica {} sees it: owner key {:?}); retry",
                crate::quote::quote(node),
                self.replica.id,
                self.replica.owner_id(node)
            )))
        };
        match self.replica.owner_of(node) {
            Some(m) if m.id != self.replica.id && !forwarded(ext) => {
                to_owner(m, format!("node {}", crate::quote::quote(node)), ext)
            }
            // Claimed and not registered yet, or owned elsewhere and
            // forwarded here by a replica whose view was older.
            Some(_) => moving("its owner has not registered it yet"),
            None if self.replica.moving(node) => moving("its owner left"),
            None => Ok(Route::Here),
        }
    }

    /// The replica that answers a call for lease `id`: here when this
    /// replica holds it in memory, or when etcd has no such lease (then the
    /// answer is NOT_FOUND, and it is the truth); else its node's owner,
    /// found through the lease's key in etcd. A lease etcd holds on a node
    /// whose leases this replica has not loaded (it claimed the node and its
    /// agent has not registered yet, or a peer forwarded the call on an
    /// older view) is UNAVAILABLE, never a NOT_FOUND this replica cannot
    /// know to be true.
    pub async fn route_lease(
        &self,
        store: &Store,
        id: u64,
        ext: &http::Extensions,
    ) -> Result<Route, Status> {
        if store.leases.lease_node(id).is_some() {
            return Ok(Route::Here);
        }
        let kv = self
            .replica
            .etcd
            .get(&self.replica.keys.lease_id(id))
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let Some(kv) = kv else {
            return Ok(Route::Here);
        };
        let node = String::from_utf8_lossy(&kv.value).into_owned();
        match self.replica.owner_of(&node) {
            Some(m) if m.id != self.replica.id && !forwarded(ext) => to_owner(
                m,
                format!("lease {id}'s node {}", crate::quote::quote(&node)),
                ext,
            ),
            _ => Err(Status::unavailable(format!(
                "lease_id: lease {id} is on node {}, whose leases no replica this call reached has loaded now (the node is moving); retry",
                crate::quote::quote(&node)
            ))),
        }
    }

    /// `not_found` for lease `id` when etcd holds no such lease; else
    /// UNAVAILABLE: the lease lives, on a node whose leases moved while the
    /// call was made. A read that fails is UNAVAILABLE too.
    pub async fn confirm_not_found(&self, id: u64, not_found: Status) -> Status {
        match self.replica.etcd.get(&self.replica.keys.lease_id(id)).await {
            Ok(None) => not_found,
            Ok(Some(_)) => Status::unavailable(format!(
                "lease_id: lease {id} lives, on a node moving between replicas or read again here; retry"
            )),
            Err(e) => Status::unavailable(format!("lease_id: lease {id}: {e}; retry")),
        }
    }

    /// Whether this replica answers for `node`'s leases now: it holds the
    /// node's owner key, its etcd lease is alive, and the leases in memory
    /// were loaded in the key's ownership period. A replica that was paused
    /// or cut off past its etcd lease answers nothing from its old table.
    pub fn current(&self, store: &Store, node: &str) -> bool {
        self.replica
            .fence(node)
            .is_some_and(|(_, epoch)| store.leases.lease_epoch(node) == epoch)
    }

    /// The elected balancer, as a member; UNAVAILABLE while there is none.
    pub async fn leader(&self) -> Result<Member, Status> {
        self.replica
            .leader_id()
            .await
            .and_then(|id| self.replica.member(&id))
            .ok_or_else(|| Status::unavailable("no balancer leader is elected now; retry"))
    }

    pub fn placement(&self, m: &Member) -> Result<PlacementServiceClient<Channel>, Status> {
        Ok(PlacementServiceClient::new(
            self.replica.peers.channel(&m.addr)?,
        ))
    }

    pub fn admin(&self, m: &Member) -> Result<AdminServiceClient<Channel>, Status> {
        Ok(AdminServiceClient::new(
            self.replica.peers.channel(&m.addr)?,
        ))
    }

    /// Claims `node` for this replica and, when the claim is of another
    /// ownership period than the leases in memory, reads its leases from
    /// etcd again (dropping the memory's) before anything is decided on
    /// them; or says where its agent should go.
    pub async fn take_over(&self, store: &Store, node: &str) -> Result<(), Status> {
        let epoch = match self.replica.claim(node).await {
            Ok(epoch) => epoch,
            Err(ClaimError::Elsewhere(m)) => {
                metrics::counter!(crate::metrics::REPLICA_HANDOFFS, "how" => "redirected")
                    .increment(1);
                return Err(redirect_status(&Redirect {
                    addr: m.addr,
                    why: format!(
                        "node {} is owned by replica {}",
                        crate::quote::quote(node),
                        m.id
                    ),
                }));
            }
            Err(ClaimError::Unavailable(why)) => return Err(Status::unavailable(why)),
        };
        if store.leases.lease_epoch(node) == epoch {
            return Ok(());
        }
        match self.log.load_node(node).await {
            Ok(stored) => {
                if let Some(loaded) =
                    store
                        .leases
                        .take_over_leases(node, epoch, stored, Instant::now())
                {
                    metrics::counter!(crate::metrics::REPLICA_HANDOFFS, "how" => "claimed")
                        .increment(1);
                    tracing::info!(node, epoch, leases = loaded.loaded, "node claimed");
                }
                Ok(())
            }
            Err(e) => {
                self.replica.release(node).await;
                Err(Status::unavailable(format!(
                    "node {}: its leases cannot be read: {e}",
                    crate::quote::quote(node)
                )))
            }
        }
    }
}

/// The status that ends an agent's stream and sends it to `r.addr`.
pub fn redirect_status(r: &Redirect) -> Status {
    let msg = if r.addr.is_empty() {
        format!("{}; reconnect to any replica", r.why)
    } else {
        format!("{}; reconnect to {}", r.why, r.addr)
    };
    let mut s = Status::unavailable(msg);
    if let Ok(v) = r.addr.parse() {
        s.metadata_mut().insert(OWNER_HEADER, v);
    }
    s
}

/// `msg` passed to a peer for `caller`, counted under `method`.
pub async fn forward<T, R, F, Fut>(
    method: &'static str,
    caller: &Caller,
    msg: T,
    call: F,
) -> Result<tonic::Response<R>, Status>
where
    F: FnOnce(tonic::Request<T>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<R>, Status>>,
{
    let req = crate::replica::forward::Peers::request(msg, &caller.owner())?;
    let out = call(req).await.map_err(peer_failure);
    crate::replica::forward::count(method, &out);
    out
}

/// A peer's answer as the caller gets it: a connection that failed or
/// broke (the peer died under the call) is UNAVAILABLE, which a client
/// retries, not the transport's UNKNOWN.
fn peer_failure(s: Status) -> Status {
    let transport = s.code() == tonic::Code::Unknown && s.message().contains("transport error");
    if transport || s.code() == tonic::Code::Cancelled {
        Status::unavailable(format!(
            "the node's owner did not answer ({}); retry",
            s.message()
        ))
    } else {
        s
    }
}
