//! The replica's loops: keeping its etcd lease alive (and re-joining when
//! it ended), following the member set and the owner keys, handing nodes
//! over when the set changes, and campaigning for the balancer.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fairplace_proto::etcd as pb;

use super::etcd::EtcdError;
use super::{Member, Redirect, Replica, observe_etcd};
use crate::metrics as m;
use crate::store::Store;

/// How often held nodes are checked against the hash and their agents.
const TIDY_EVERY: Duration = Duration::from_secs(2);

/// What the loops act on outside the replica: the store whose nodes are
/// let go when they are handed over.
#[derive(Clone)]
pub struct Hooks {
    pub store: Arc<Store>,
}

impl Replica {
    /// Starts the loops; they run until the returned handles are aborted.
    pub fn spawn(self: &Arc<Self>, hooks: Hooks) -> Vec<tokio::task::JoinHandle<()>> {
        // The series exist from the start (the recorder is installed by
        // now; it was not when the replica joined).
        self.export_standing();
        metrics::gauge!(m::REPLICA_LEADER).set(0.0);
        metrics::gauge!(m::REPLICA_MEMBERS).set(self.members().len() as f64);
        vec![
            tokio::spawn(Arc::clone(self).keep_alive(hooks.clone())),
            tokio::spawn(Arc::clone(self).follow_members(hooks.clone())),
            tokio::spawn(Arc::clone(self).follow_owners()),
            tokio::spawn(Arc::clone(self).campaign()),
            tokio::spawn(Arc::clone(self).follow_features(Arc::clone(&hooks.store))),
            tokio::spawn(Arc::clone(self).tidy(hooks)),
            tokio::spawn(Arc::clone(self).refresh_tls()),
        ]
    }

    /// Reads the client certificates (to etcd, to the peers) again every
    /// few seconds: they are renewed in place while the replica runs.
    async fn refresh_tls(self: Arc<Self>) {
        loop {
            tokio::time::sleep(super::client_tls::RELOAD_EVERY).await;
            self.etcd.refresh_tls();
            self.peers.refresh_tls();
        }
    }

    /// Leaves the set at once (shutdown): the etcd lease is revoked, so the
    /// member key, the owner keys and the leader key go with it and the
    /// other replicas take the nodes over without waiting for the TTL.
    pub async fn leave(&self) {
        let lease = self.lease.swap(0, Ordering::SeqCst);
        if lease != 0 {
            let _ = self.etcd.revoke(lease).await;
        }
    }

    /// Refreshes the etcd lease every third of its TTL. A lease etcd says
    /// is gone (the replica was cut off longer than the TTL) is replaced:
    /// the replica joins again and claims its nodes again.
    async fn keep_alive(self: Arc<Self>, hooks: Hooks) {
        let every = self.ttl / 3;
        let mut lost_logged = false;
        loop {
            tokio::time::sleep(every).await;
            let lease = self.lease.load(Ordering::SeqCst);
            if lease == 0 {
                return; // left
            }
            let sent = self.now_ms();
            let t0 = Instant::now();
            // A keep-alive may wait on every member in turn (seconds when
            // they are cut off); the gauges follow the lease's deadline
            // meanwhile, so a scrape never shows a lost lease as up.
            let call = self.etcd.keep_alive_once(lease);
            tokio::pin!(call);
            let answer = loop {
                tokio::select! {
                    r = &mut call => break r,
                    _ = tokio::time::sleep(every) => self.export_standing(),
                }
            };
            match answer {
                Ok(ttl) if ttl > 0 => {
                    observe_etcd("keepalive", t0);
                    self.alive_until_ms
                        .store(sent + ttl as u64 * 1000, Ordering::SeqCst);
                    if lost_logged {
                        tracing::info!(replica = %self.id, "etcd is back; the etcd lease survived");
                        lost_logged = false;
                    }
                }
                Ok(_) => {
                    tracing::warn!(replica = %self.id, "the etcd lease ended: joining again and claiming the nodes again");
                    if self.register_member().await.is_ok() {
                        lost_logged = false;
                        self.claim_again(&hooks).await;
                    }
                }
                Err(e) => {
                    if self.live_lease().is_none() && !lost_logged {
                        tracing::error!(replica = %self.id, error = %e, "etcd lost for longer than the lease TTL: refusing lease changes and claims");
                        lost_logged = true;
                    }
                }
            }
            self.export_standing();
        }
    }

    /// Whether the etcd lease is known alive, and the nodes held, as gauges.
    fn export_standing(&self) {
        let up = if self.live_lease().is_some() {
            1.0
        } else {
            0.0
        };
        metrics::gauge!(m::REPLICA_ETCD_UP).set(up);
        metrics::gauge!(m::REPLICA_OWNED_NODES).set(self.owned.len() as f64);
    }

    /// After a new etcd lease: every owner key of the old one is gone, and
    /// another replica may have owned the nodes meanwhile, so the table in
    /// memory may be stale. Each node is let go and its agent sent to its
    /// owner by the hash (this replica, most often): its registration
    /// claims it in a new ownership period and reads its leases again.
    async fn claim_again(&self, hooks: &Hooks) {
        let nodes: Vec<String> = self.owned.iter().map(|e| e.key().clone()).collect();
        for node in nodes {
            self.owned.remove(&node);
            let to = match self.hrw_owner(&node) {
                Some(m) if m.id != self.id => m.addr,
                _ => String::new(),
            };
            self.hand_over(&node, to, "lost", hooks).await;
        }
    }

    /// Sends `node`'s agent to `to` (empty: any replica) and lets the node
    /// go. A node with a stream is let go when its stream ends (the
    /// service's part); one without, here.
    async fn hand_over(&self, node: &str, to: String, how: &'static str, hooks: &Hooks) {
        metrics::counter!(m::REPLICA_HANDOFFS, "how" => how).increment(1);
        let r = Redirect {
            addr: to,
            why: format!("node {node} is handed over by replica {}", self.id),
        };
        if !self.redirect(node, r) {
            hooks.store.nodes.let_go(node);
            self.release(node).await;
        }
    }

    /// The member set: read whole, then watched; every change re-reads it
    /// (a few keys) and hands over the nodes that are now another's.
    async fn follow_members(self: Arc<Self>, hooks: Hooks) {
        loop {
            let rev = match self.read_members().await {
                Ok(rev) => rev,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the replica set failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            self.rebalance(&hooks).await;
            let prefix = self.keys.members();
            let Ok(mut events) = self.etcd.watch_prefix(&prefix, rev + 1).await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            while events.recv().await.is_some() {
                if self.read_members().await.is_ok() {
                    self.rebalance(&hooks).await;
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Reads the member set; returns the revision read at.
    pub(super) async fn read_members(&self) -> Result<i64, EtcdError> {
        let t0 = Instant::now();
        let (kvs, rev) = self.etcd.range_prefix(&self.keys.members()).await?;
        observe_etcd("read", t0);
        let mut ms: Vec<Member> = kvs
            .iter()
            .filter_map(|kv| serde_json::from_slice(&kv.value).ok())
            .collect();
        ms.sort_by(|a, b| a.id.cmp(&b.id));
        if *self.members.load_full() != ms {
            let ids: Vec<&str> = ms.iter().map(|m| m.id.as_str()).collect();
            tracing::info!(members = ?ids, "replica set changed");
        }
        metrics::gauge!(m::REPLICA_MEMBERS).set(ms.len() as f64);
        self.members.store(Arc::new(ms));
        Ok(rev)
    }

    /// Hands over every held node that rendezvous hashing now gives to
    /// another live member.
    async fn rebalance(&self, hooks: &Hooks) {
        let moving: Vec<(String, Member)> = self
            .owned
            .iter()
            .filter_map(|e| {
                let o = self.hrw_owner(e.key())?;
                (o.id != self.id).then(|| (e.key().clone(), o))
            })
            .collect();
        if !moving.is_empty() {
            tracing::info!(
                nodes = moving.len(),
                "handing nodes over to their new owners"
            );
        }
        for (node, to) in moving {
            self.hand_over(&node, to.addr, "released", hooks).await;
        }
    }

    /// Every [`TIDY_EVERY`]: the held nodes are checked against the hash
    /// again (a claim that raced a member change is handed on), and a node
    /// held for longer than that with neither a registration nor a stream
    /// here (its agent went elsewhere or away) is let go, so no owner key
    /// outlives what it stands for.
    async fn tidy(self: Arc<Self>, hooks: Hooks) {
        loop {
            tokio::time::sleep(TIDY_EVERY).await;
            if self.live_lease().is_none() {
                continue;
            }
            self.rebalance(&hooks).await;
            let idle: Vec<String> = self
                .owned
                .iter()
                .filter(|e| {
                    e.value().2.elapsed() > TIDY_EVERY
                        && !self.streams.contains_key(e.key())
                        && hooks.store.nodes.get(e.key()).is_none()
                })
                .map(|e| e.key().clone())
                .collect();
            for node in idle {
                tracing::info!(node, "held without a registration: let go");
                self.release(&node).await;
            }
            // And the reverse: a stream for a node this replica does not
            // hold is sent to the owner (a hand-over that raced it).
            let strays: Vec<String> = self
                .streams
                .iter()
                .filter(|e| !self.owned.contains_key(e.key()))
                .map(|e| e.key().clone())
                .collect();
            for node in strays {
                tracing::warn!(node, "a stream for a node not held here: sent to its owner");
                self.send_to_owner(&node);
            }
        }
    }

    /// The owner keys: read whole (in pages), then watched.
    async fn follow_owners(self: Arc<Self>) {
        loop {
            let rev = match self.read_owners().await {
                Ok(rev) => rev,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the node owners failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let prefix = self.keys.owners();
            let Ok(mut events) = self.etcd.watch_prefix(&prefix, rev + 1).await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            while let Some(batch) = events.recv().await {
                for ev in batch {
                    self.apply_owner_event(&prefix, ev);
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn apply_owner_event(&self, prefix: &[u8], ev: pb::Event) {
        let Some(kv) = ev.kv else { return };
        let Some(node) = self.keys.name_in(prefix, &kv.key) else {
            return;
        };
        if ev.r#type == pb::event::EventType::Delete as i32 {
            tracing::debug!(replica = %self.id, node, rev = kv.mod_revision, "owner key deleted");
            self.owners.remove(&node);
            self.orphaned.insert(node, Instant::now());
        } else {
            tracing::debug!(replica = %self.id, node, rev = kv.mod_revision, owner = %String::from_utf8_lossy(&kv.value), "owner key written");
            self.orphaned.remove(&node);
            self.owners
                .insert(node, String::from_utf8_lossy(&kv.value).into_owned());
        }
        if self.orphaned.len() > 4096 {
            self.orphaned.retain(|_, t| t.elapsed() < super::MOVING_FOR);
        }
    }

    pub(super) async fn read_owners(&self) -> Result<i64, EtcdError> {
        let t0 = Instant::now();
        let prefix = self.keys.owners();
        let (kvs, rev) = self.etcd.range_prefix(&prefix).await?;
        observe_etcd("read", t0);
        tracing::debug!(replica = %self.id, rev, owners = kvs.len(), "owner keys read");
        // Refreshed in place, never cleared first: a call routed while the
        // map is re-read must not find it empty.
        let mut seen = std::collections::HashSet::with_capacity(kvs.len());
        for kv in kvs {
            if let Some(node) = self.keys.name_in(&prefix, &kv.key) {
                self.owners.insert(
                    node.clone(),
                    String::from_utf8_lossy(&kv.value).into_owned(),
                );
                seen.insert(node);
            }
        }
        self.owners.retain(|node, _| {
            let kept = seen.contains(node);
            if !kept {
                // Deleted while no watch was open: its owner left.
                self.orphaned.insert(node.clone(), Instant::now());
            }
            kept
        });
        Ok(rev)
    }

    /// The balancer's election, through etcd's election API: this
    /// replica campaigns with its etcd lease, so its key (`leader/LEASE`)
    /// ends with it and the next campaigner in line is elected. It leads
    /// while etcd names its lease as the leader's and the lease is alive.
    async fn campaign(self: Arc<Self>) {
        let every = self.ttl / 3;
        loop {
            let now_leader = match self.live_lease() {
                Some(lease) => self.try_lead(lease).await.unwrap_or(false),
                None => false,
            };
            let was = self.leader.swap(now_leader, Ordering::Relaxed);
            if was != now_leader {
                tracing::info!(replica = %self.id, leader = now_leader, "balancer leadership changed");
            }
            metrics::gauge!(m::REPLICA_LEADER).set(if now_leader { 1.0 } else { 0.0 });
            tokio::time::sleep(every).await;
        }
    }

    /// Whether this replica leads: the election's leader is its lease. A
    /// campaign that is still waiting behind another leader ends at its
    /// deadline: not the leader (yet).
    async fn try_lead(&self, lease: i64) -> Result<bool, EtcdError> {
        let name = self.keys.leader();
        if let Some(kv) = self.etcd.leader(&name).await?
            && kv.lease == lease
        {
            return Ok(true);
        }
        let t0 = Instant::now();
        let r = self.etcd.campaign(&name, lease, self.id.as_bytes()).await;
        observe_etcd("campaign", t0);
        Ok(r.is_ok_and(|k| k.lease == lease))
    }

    /// The elected balancer's id, if any is known.
    pub async fn leader_id(&self) -> Option<String> {
        let kv = self.etcd.leader(&self.keys.leader()).await.ok()??;
        Some(String::from_utf8_lossy(&kv.value).into_owned())
    }
}
