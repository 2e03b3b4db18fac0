//! Replicas on etcd: several `fairplace-server serve --etcd-endpoints ...`
//! share the nodes, so losing one loses nothing and grants nothing twice.
//!
//! What this module owns, and why each part needs consensus:
//! - **Membership** ([`Replica::join`], [`Replica::keep_alive`]): each
//!   replica's key is bound to an etcd lease it keeps alive; a replica that
//!   dies or loses etcd leaves the set when the lease ends.
//! - **Ownership**: a node's owner is its rendezvous-hash winner among the
//!   members ([`hrw`]), and is *confirmed* by the key `owners/NODE`, bound to
//!   the owner's etcd lease, created only where absent ([`Replica::claim`]).
//!   The key, not the hash, is what lease writes are fenced on: two
//!   replicas that both believe they own a node can never both commit.
//! - **Leases** ([`log::EtcdLog`]): the lease store's etcd implementation,
//!   each commit fenced on the owner key.
//! - **One balancer** ([`Replica::campaign`]): etcd's election API, the
//!   election `leader`.
//! - **Feature switches** ([`features`]): the global set and each node's
//!   overrides, so SetFeatures means the same on every replica and a
//!   node's overrides follow it to its next owner.
//! - **Forwarding** ([`forward`]): any replica answers any call by passing
//!   it to the node's owner over mutual TLS, with the caller's identity.
//!
//! Node state itself is soft (agents send it again), so it never goes
//! through etcd: only membership, ownership, leases, the leader and the
//! feature switches do.

pub mod aggregates;
pub mod client_tls;
pub mod etcd;
pub mod features;
pub mod forward;
pub use fairplace_types::hrw;
pub mod keys;
pub mod log;
pub mod peers;
pub mod route;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::metrics as m;
use etcd::{Etcd, EtcdError, EtcdSettings};
use keys::Keys;

/// `--replica-id`, `--advertise-addr` and the etcd to join.
#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub id: String,
    /// Where peers and agents reach this replica's gRPC port.
    pub advertise: String,
    pub etcd: EtcdSettings,
    /// The etcd lease membership and ownership are bound to: a replica that
    /// stops keeping it alive leaves within this long.
    pub lease_ttl: Duration,
    /// How to reach peers when forwarding (TLS, client certificate).
    pub peer_tls: Option<forward::PeerTls>,
}

/// A member of the replica set, as its key holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub id: String,
    pub addr: String,
}

/// Why a node could not be claimed.
#[derive(Debug, Clone)]
pub enum ClaimError {
    /// Another live replica owns it (or should): go there.
    Elsewhere(Member),
    /// Another replica holds it and its address is not known, or etcd
    /// cannot be reached: try again.
    Unavailable(String),
}

/// What [`Replica::take_key`] found.
pub(crate) enum Taken {
    /// The key was absent and is now this replica's, created at this
    /// revision.
    Created(i64),
    /// Someone holds it (`None`: it changed again before it was read).
    Held(Option<fairplace_proto::etcd::KeyValue>),
}

/// Where an agent should go instead of this replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Redirect {
    /// The owner's advertised address; empty: any replica.
    pub addr: String,
    pub why: String,
}

/// Why a replica refuses to commit lease changes now: it may have lost
/// etcd, and with it its ownership of nodes, so a commit could race the
/// replica that took them over. Callers answer "retry elsewhere or later";
/// the refusal ends when the replica's etcd lease is renewed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaWriteError {
    /// No keep-alive confirmed the replica's etcd lease within its TTL.
    EtcdLeaseLost { replica: String },
}

impl std::fmt::Display for ReplicaWriteError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplicaWriteError::EtcdLeaseLost { replica } => write!(
                f,
                "replica {replica} has lost etcd (its etcd lease may have ended): lease changes are refused until it is back"
            ),
        }
    }
}

impl std::error::Error for ReplicaWriteError {}

/// One replica's view of the set, and its own standing in it.
pub struct Replica {
    pub id: String,
    pub advertise: String,
    pub etcd: Etcd,
    pub keys: Keys,
    ttl: Duration,
    /// The etcd lease this replica's keys are bound to (0: none yet).
    lease: AtomicI64,
    /// Milliseconds after `epoch` until which the lease is known alive:
    /// the last keep-alive's send time plus the TTL etcd granted.
    alive_until_ms: AtomicU64,
    epoch: Instant,
    members: ArcSwap<Vec<Member>>,
    /// node -> its owner's id, as watched in etcd.
    owners: DashMap<String, String>,
    /// Nodes whose owner key this replica wrote -> the lease it is bound
    /// to, the key's create revision (the ownership period's epoch, what
    /// lease commits are fenced on), and when it was claimed.
    owned: DashMap<String, (i64, i64, Instant)>,
    /// Nodes whose owner key ended (owner gone, node handed over) and that
    /// no replica has claimed since -> when: a call for one is "retry"
    /// (UNAVAILABLE), not "no such node".
    orphaned: DashMap<String, Instant>,
    leader: AtomicBool,
    /// node -> the redirect channel of its registered Report stream.
    streams: DashMap<String, (u64, watch::Sender<Option<Redirect>>)>,
    /// node -> its feature overrides in etcd ([`features`]).
    node_features: DashMap<String, features::Switches>,
    pub peers: forward::Peers,
}

impl Replica {
    /// Connects to etcd, takes an etcd lease, registers this replica and
    /// reads the set and the owners. Retries for `start_timeout` while
    /// etcd cannot be reached (a pod may start before its etcd).
    pub async fn join(
        cfg: ReplicaConfig,
        start_timeout: Duration,
    ) -> Result<Arc<Replica>, EtcdError> {
        if cfg.id.is_empty() || cfg.id.contains('/') || cfg.id.chars().any(char::is_control) {
            return Err(EtcdError(format!(
                "--replica-id: {:?} must be non-empty, without '/' or control characters",
                cfg.id
            )));
        }
        let etcd = Etcd::connect(&cfg.etcd)?;
        let keys = Keys {
            prefix: cfg.etcd.prefix.clone(),
        };
        let r = Arc::new(Replica {
            id: cfg.id.clone(),
            advertise: cfg.advertise.clone(),
            etcd,
            keys,
            ttl: cfg.lease_ttl.max(Duration::from_secs(2)),
            lease: AtomicI64::new(0),
            alive_until_ms: AtomicU64::new(0),
            epoch: Instant::now(),
            members: ArcSwap::from_pointee(Vec::new()),
            owners: DashMap::new(),
            owned: DashMap::new(),
            orphaned: DashMap::new(),
            leader: AtomicBool::new(false),
            streams: DashMap::new(),
            node_features: DashMap::new(),
            peers: forward::Peers::new(cfg.peer_tls.clone())
                .map_err(|e| EtcdError(format!("--replica-tls-*/--peer-ca: {e}")))?,
        });
        let deadline = Instant::now() + start_timeout;
        loop {
            match r.register_member().await {
                Ok(()) => break,
                Err(e) if Instant::now() < deadline => {
                    tracing::warn!(error = %e, "cannot join the replica set yet; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => return Err(e),
            }
        }
        r.read_members().await?;
        r.read_owners().await?;
        Ok(r)
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// The etcd lease this replica's keys are bound to, while it is known
    /// alive; `None` once it may have ended.
    pub fn live_lease(&self) -> Option<i64> {
        let l = self.lease.load(Ordering::SeqCst);
        (l != 0 && self.now_ms() < self.alive_until_ms.load(Ordering::SeqCst)).then_some(l)
    }

    /// Whether this replica may commit lease changes now, and if not why.
    pub fn writable(&self) -> Result<(), ReplicaWriteError> {
        match self.live_lease() {
            Some(_) => Ok(()),
            None => Err(ReplicaWriteError::EtcdLeaseLost {
                replica: self.id.clone(),
            }),
        }
    }

    /// A new etcd lease and this replica's member key bound to it.
    async fn register_member(&self) -> Result<(), EtcdError> {
        let ttl_s = self.ttl.as_secs().max(1) as i64;
        let sent = self.now_ms();
        let lease = self.etcd.grant(ttl_s).await?;
        let me = serde_json::to_vec(&Member {
            id: self.id.clone(),
            addr: self.advertise.clone(),
        })
        .map_err(|e| EtcdError(e.to_string()))?;
        let r = self
            .etcd
            .txn(
                vec![],
                vec![etcd::put(self.keys.member(&self.id), me, lease)],
                vec![],
            )
            .await?;
        if !r.succeeded {
            return Err(EtcdError("member registration failed".into()));
        }
        self.lease.store(lease, Ordering::SeqCst);
        self.alive_until_ms
            .store(sent + ttl_s as u64 * 1000, Ordering::SeqCst);
        tracing::info!(replica = %self.id, addr = %self.advertise, lease, "joined the replica set");
        Ok(())
    }

    /// The live members, sorted by id.
    pub fn members(&self) -> Arc<Vec<Member>> {
        self.members.load_full()
    }

    pub fn member(&self, id: &str) -> Option<Member> {
        self.members().iter().find(|m| m.id == id).cloned()
    }

    /// The member rendezvous hashing gives `node` to.
    pub fn hrw_owner(&self, node: &str) -> Option<Member> {
        let ms = self.members();
        let id = hrw::owner(ms.iter().map(|m| m.id.as_str()), node)?.to_string();
        ms.iter().find(|m| m.id == id).cloned()
    }

    /// The replica id `node`'s owner key names, as watched.
    pub fn owner_id(&self, node: &str) -> Option<String> {
        self.owners.get(node).map(|o| o.clone())
    }

    /// The replica whose owner key `node` has, if it is a live member.
    pub fn owner_of(&self, node: &str) -> Option<Member> {
        let id = self.owners.get(node)?.clone();
        self.member(&id)
    }

    /// Whether `node` lost its owner within [`MOVING_FOR`] and no replica
    /// has claimed it since: its agent is on its way to the next owner.
    pub fn moving(&self, node: &str) -> bool {
        self.orphaned
            .get(node)
            .is_some_and(|t| t.elapsed() < MOVING_FOR)
    }

    /// Nodes this replica holds the owner key of.
    pub fn owned_count(&self) -> usize {
        self.owned.len()
    }

    pub fn is_leader(&self) -> bool {
        self.leader.load(Ordering::Relaxed) && self.live_lease().is_some()
    }

    /// The fence of `node`: the etcd lease its owner key was written under
    /// and the key's create revision (the epoch), if this replica holds it
    /// and is alive.
    pub fn fence(&self, node: &str) -> Option<(i64, i64)> {
        let live = self.live_lease()?;
        let (l, epoch, _) = *self.owned.get(node)?;
        (l == live).then_some((l, epoch))
    }

    /// Claims `node` for this replica: its owner key is created, bound to
    /// this replica's etcd lease, only where there is none (or it is this
    /// replica's already). Refused when rendezvous hashing gives the node
    /// to another live member. Returns the ownership period's epoch (the
    /// key's create revision): a new one means the node's leases must be
    /// read again before anything is decided on them.
    pub async fn claim(&self, node: &str) -> Result<i64, ClaimError> {
        if let Some(o) = self.hrw_owner(node)
            && o.id != self.id
        {
            return Err(ClaimError::Elsewhere(o));
        }
        let lease = self.live_lease().ok_or_else(|| {
            ClaimError::Unavailable(format!(
                "replica {} cannot reach etcd: it claims no node until it can",
                self.id
            ))
        })?;
        let taken = self
            .take_key(self.keys.owner(node), lease, "claim")
            .await
            .map_err(|e| ClaimError::Unavailable(e.to_string()))?;
        let (holder, created) = match taken {
            Taken::Created(rev) => (None, rev),
            Taken::Held(kv) => (Some(kv), 0),
        };
        if holder.is_none() {
            self.owned
                .insert(node.to_string(), (lease, created, Instant::now()));
            self.owners.insert(node.to_string(), self.id.clone());
            metrics::gauge!(m::REPLICA_OWNED_NODES).set(self.owned.len() as f64);
            // The member set may have changed while the claim was in
            // flight, after the hand-over pass looked at the held nodes:
            // looked at again now that the node is held, it is handed on
            // at once rather than kept against the hash.
            if let Some(o) = self.hrw_owner(node)
                && o.id != self.id
            {
                self.release(node).await;
                return Err(ClaimError::Elsewhere(o));
            }
            return Ok(created);
        }
        match holder.flatten() {
            Some(kv) if self.is_mine(&kv, lease) => {
                let epoch = kv.create_revision;
                self.owned
                    .entry(node.to_string())
                    .and_modify(|e| {
                        if e.1 != epoch {
                            *e = (lease, epoch, Instant::now());
                        }
                    })
                    .or_insert((lease, epoch, Instant::now()));
                Ok(epoch)
            }
            // Rendezvous hashing gives the node to this replica: the holder
            // is handing it over, or left and its etcd lease has not ended.
            Some(kv) => Err(ClaimError::Unavailable(format!(
                "node {node} is still held by replica {} (handing over, or its etcd lease has not ended yet); retry",
                String::from_utf8_lossy(&kv.value)
            ))),
            None => Err(ClaimError::Unavailable(format!(
                "node {node}: its owner key changed while it was claimed"
            ))),
        }
    }

    /// Creates `key` with this replica's id, bound to `lease`, where it is
    /// absent (an owner key); else reads who holds it.
    pub(crate) async fn take_key(
        &self,
        key: Vec<u8>,
        lease: i64,
        op: &'static str,
    ) -> Result<Taken, EtcdError> {
        let t0 = Instant::now();
        let r = self
            .etcd
            .txn(
                vec![etcd::absent(key.clone())],
                vec![etcd::put(key.clone(), self.id.clone().into_bytes(), lease)],
                vec![etcd::get_op(key)],
            )
            .await?;
        observe_etcd(op, t0);
        if r.succeeded {
            return Ok(Taken::Created(r.header.map_or(0, |h| h.revision)));
        }
        Ok(Taken::Held(r.responses.into_iter().find_map(
            |op| match op.response {
                Some(fairplace_proto::etcd::response_op::Response::ResponseRange(rr)) => {
                    rr.kvs.into_iter().next()
                }
                _ => None,
            },
        )))
    }

    /// Whether `kv` is this replica's, written under `lease`.
    fn is_mine(&self, kv: &fairplace_proto::etcd::KeyValue, lease: i64) -> bool {
        kv.lease == lease && kv.value == self.id.as_bytes()
    }

    /// Gives up `node`: its owner key is deleted if it is still this
    /// replica's (bound to the lease it was written under).
    pub async fn release(&self, node: &str) {
        let Some((_, (lease, _, _))) = self.owned.remove(node) else {
            return;
        };
        metrics::gauge!(m::REPLICA_OWNED_NODES).set(self.owned.len() as f64);
        let key = self.keys.owner(node);
        let t0 = Instant::now();
        if let Err(e) = self
            .etcd
            .txn(
                vec![etcd::bound_to(key.clone(), lease)],
                vec![etcd::delete(key)],
                vec![],
            )
            .await
        {
            // The key ends with the lease anyway.
            tracing::warn!(node, error = %e, "could not delete the owner key; it ends with the etcd lease");
        }
        observe_etcd("release", t0);
        metrics::counter!(m::REPLICA_HANDOFFS, "how" => "released").increment(1);
    }

    /// A registered Report stream of `node` (its registration
    /// `generation`): the receiver says where to send the agent when the
    /// node is handed over. A node this replica no longer holds (handed
    /// over while its registration was in flight, before there was a
    /// stream to end) is sent on at once.
    pub fn attach_stream(&self, node: &str, generation: u64) -> watch::Receiver<Option<Redirect>> {
        let (tx, rx) = watch::channel(None);
        self.streams.insert(node.to_string(), (generation, tx));
        if !self.owned.contains_key(node) {
            self.send_to_owner(node);
        }
        rx
    }

    /// Ends `node`'s stream, sending its agent to the node's
    /// rendezvous-hash owner (or to any replica when that is this one).
    fn send_to_owner(&self, node: &str) {
        let addr = self
            .hrw_owner(node)
            .filter(|m| m.id != self.id)
            .map(|m| m.addr)
            .unwrap_or_default();
        let why = format!("replica {} does not hold node {node}", self.id);
        self.redirect(node, Redirect { addr, why });
    }

    pub fn detach_stream(&self, node: &str, generation: u64) {
        self.streams.remove_if(node, |_, (g, _)| *g == generation);
    }

    /// Ends `node`'s stream with `to`; false when it has none.
    fn redirect(&self, node: &str, to: Redirect) -> bool {
        match self.streams.get(node) {
            Some(s) => s.1.send(Some(to)).is_ok(),
            None => false,
        }
    }
}

/// How long a node that lost its owner counts as moving (its agent
/// reconnects within a few seconds; one that does not is gone).
pub const MOVING_FOR: Duration = Duration::from_secs(30);

/// etcd round trips, by operation.
pub(crate) fn observe_etcd(op: &'static str, t0: Instant) {
    metrics::histogram!(m::REPLICA_ETCD_SECONDS, "op" => op).record(t0.elapsed().as_secs_f64());
}

mod background;
pub use background::Hooks;
