//! Getting leases back after a restart, from both witnesses: the lease log
//! at start ([`Leases::load_leases`]) and each node's agent when it
//! registers ([`Leases::reconcile_leases`]).
//!
//! The log is the first witness: every lease it holds is parked under its
//! node and goes back into the node when the node's
//! agent registers. The agent is the second: it checkpoints the leases it
//! was sent and reports them with its registration, so a server whose
//! state directory was lost gets them back. Each lease the agent reports:
//! - known to the server on this node: kept;
//! - unknown, unexpired, on CPUs the node has, overlapping no live lease:
//!   adopted (committed to the log as if granted again), unless the log is
//!   the replicas' one truth (etcd): there a lease the log does not hold
//!   was never acknowledged or has ended, and is released on the node;
//! - overlapping a lease the server holds: released on the node. The
//!   server's lease is the committed one; the agent's is one whose end was
//!   asked for (or that was never acknowledged): the acknowledged lease
//!   never loses to it, whichever was granted first;
//! - expired, ended early while the agent was away (a tombstone, kept
//!   until the expiry the lease had), naming another node's lease, or
//!   unreadable: released on the node.
//!
//! Clocks: a server loading leases (at start, or a replica taking a node
//! over) never judges a stored wall-clock expiry, written by another
//! machine or by itself before its clock moved. Each lease it loads gets
//! its whole TTL again from the moment it is loaded: the load comes after
//! every acknowledged renewal was committed, so no acknowledged lease ends
//! early whatever the clocks say. A lease may live up to one TTL longer
//! than its holder was told (its CPUs held longer, never shorter), and one
//! that expired while the server was down lives one TTL more unless its
//! holder releases it.
//!
//! Leases the server knows and the agent does not report are sent to it
//! again by the service after registration (applied again).

use std::time::Instant;

use super::Leases;
use super::log::Commit;
use super::log::{Epoch, LeaseOp, LeaseRecord, LogError, unix_ms_now};
use super::{Lease, Phase};
use crate::engine::cpumask::CpuMask;
use crate::metrics as m;
use crate::store::Node;

fn recovered(how: &'static str, n: usize) {
    if n > 0 {
        metrics::counter!(m::LEASES_RECOVERED, "how" => how).increment(n as u64);
    }
}

/// What [`Leases::load_leases`] found in the log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// Live leases, parked until their nodes register.
    pub loaded: usize,
    /// Records whose CPUs could not be read: ended.
    pub unreadable: usize,
}

/// What [`Leases::reconcile_leases`] did with an agent's report.
#[derive(Default)]
pub struct Reconciled {
    pub kept: usize,
    pub adopted: usize,
    pub conflicts: usize,
    pub expired: usize,
    /// Lease ids the agent must drop (its refused reports).
    pub release_on_node: Vec<u64>,
    /// Makes the adoptions and ends durable.
    pub commit: Option<Commit>,
    /// The adopted leases, pending until `commit` is acknowledged.
    pub adopted_ids: Vec<u64>,
}

/// An agent's report of one lease, decided.
enum Verdict {
    Kept,
    Adopt(Box<Lease>),
    Refuse(&'static str),
}

impl Leases {
    /// Reads the log once at start: live leases are parked under their
    /// nodes, expired and unreadable ones are deleted, tombstones still in
    /// their time kept (the others deleted).
    pub fn load_leases(&self, now: Instant) -> Result<Loaded, LogError> {
        let stored = self.log.load()?;
        Ok(self.park_stored(stored, now))
    }

    /// The ownership period `node`'s leases in memory were loaded in (0:
    /// none): a claim at another epoch must load them again.
    pub fn lease_epoch(&self, node: &str) -> Epoch {
        self.index.epoch(node)
    }

    /// A replica taking over `node` in ownership period `epoch` (it now
    /// holds the node's owner key, created at that revision): `stored`, the
    /// node's leases and tombstones read from the log after the claim, are
    /// parked so the node's registration finds them. Whatever memory held
    /// of the node from another period is dropped first: it may be stale
    /// (another replica owned the node meanwhile). `None` when memory is
    /// already of this period (another registration loaded it).
    pub fn take_over_leases(
        &self,
        node: &str,
        epoch: Epoch,
        mut stored: super::log::Stored,
        now: Instant,
    ) -> Option<Loaded> {
        if self.index.epoch(node) == epoch {
            return None;
        }
        let dropped = self.drop_node_leases(node);
        if dropped > 0 {
            tracing::info!(
                node,
                dropped,
                epoch,
                "leases of an earlier ownership period dropped; reading them again"
            );
        }
        self.index.set_epoch(node, Some(epoch));
        stored.leases.retain(|r| r.node == node);
        let loaded = self.park_stored(stored, now);
        // A node still registered here takes them at once: its decisions
        // must count them before anything more is granted on it.
        if let Some(n) = self.table.get(node) {
            self.unpark_leases(&n);
        }
        Some(loaded)
    }

    /// Parks the live leases of `stored` under their nodes, each with its
    /// whole TTL from `now` (no wall clock is judged, module doc), and
    /// keeps its tombstones still in their time; deletes the unreadable
    /// records and the tombstones past their time.
    fn park_stored(&self, stored: super::log::Stored, now: Instant) -> Loaded {
        let now_ms = unix_ms_now();
        let mut out = Loaded::default();
        let mut gone = Vec::new();
        {
            // Every tombstone is kept here for a while whatever the wall
            // clock says; pruning forgets it later.
            let mut ended = self.index.ended();
            for (until_ms, id) in stored.ended.into_iter().map(|(id, u)| (u, id)) {
                let since = now;
                ended.insert(id, super::Tomb { until_ms, since });
            }
        }
        let mut parked = self.index.parked();
        let mut index = self.index.lock();
        for r in stored.leases {
            let Some(mut lease) = Lease::from_record(&r, now, now_ms) else {
                out.unreadable += 1;
                gone.push(LeaseOp::Delete {
                    id: r.id,
                    node: r.node.clone(),
                });
                continue;
            };
            lease.expires = now + lease.ttl;
            index.add(
                r.id,
                &r.node,
                &lease.owner,
                lease.cpus.weight(),
                &lease.request_id,
            );
            parked.entry(r.node).or_default().insert(r.id, lease);
            out.loaded += 1;
        }
        drop((index, parked));
        // One node's ops (a take-over) are fenced on its epoch; a restart's
        // embedded log fences nothing.
        let epoch = stored_epoch(self, &gone);
        self.log.submit(epoch, gone).detach();
        recovered("loaded", out.loaded);
        recovered("expired", out.unreadable);
        out
    }

    /// Reconciles the leases `node`'s agent reports holding (its
    /// checkpoint) with the server's, under the node's writer.
    pub fn reconcile_leases(&self, node: &Node, held: &[LeaseRecord]) -> Reconciled {
        let now = Instant::now();
        let now_ms = unix_ms_now();
        let mut out = Reconciled::default();
        let mut ops = Vec::new();
        let mut w = node
            .writer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if w.leases.retired {
            // A newer registration replaced this node; it reconciles its
            // own report.
            return out;
        }
        let cur = node.snapshot();
        let base = crate::store::base_cpus(&cur, &w);
        // The CPUs live leases hold: most reports overlap none, and are
        // judged without a look at each lease.
        let mut held_cpus = w.leases.leased();
        for r in held {
            let verdict = self.judge(node, (&w.leases, &held_cpus), r, now, now_ms);
            match verdict {
                Verdict::Kept => out.kept += 1,
                Verdict::Refuse(why) => {
                    if why == "expired" {
                        out.expired += 1;
                    } else {
                        out.conflicts += 1;
                        tracing::warn!(node = %node.id, lease = r.id, cpus = %r.cpus, why, "a lease the agent holds is refused: released on the node");
                    }
                    out.release_on_node.push(r.id);
                }
                Verdict::Adopt(lease) => {
                    held_cpus.or_assign(&lease.cpus);
                    out.adopted_ids.push(lease.id);
                    self.adopt(node, &mut w.leases, *lease, &mut ops);
                    out.adopted += 1;
                }
            }
        }
        if !ops.is_empty() {
            out.commit = Some(self.log.submit(self.index.epoch(&node.id), ops));
            let topo = std::sync::Arc::clone(&cur.topo);
            self.table
                .publish(node, &mut w, base, topo, cur.features, None, &cur);
        }
        recovered("kept", out.kept);
        recovered("adopted", out.adopted);
        recovered("conflict", out.conflicts);
        recovered("expired", out.expired);
        out
    }

    /// Takes an agent's lease in, pending (its CPUs held, not shown) until
    /// its grant is committed.
    fn adopt(
        &self,
        node: &Node,
        leases: &mut super::NodeLeases,
        mut l: Lease,
        ops: &mut Vec<LeaseOp>,
    ) {
        tracing::info!(node = %node.id, lease = l.id, cpus = %l.cpus, holder = %l.holder, "lease adopted from the node's agent");
        ops.push(LeaseOp::Grant(l.record(&node.id)));
        self.index
            .lock()
            .add(l.id, &node.id, &l.owner, l.cpus.weight(), &l.request_id);
        l.phase = Phase::Pending;
        l.busy = true;
        l.committed = false;
        leases.leases.insert(l.id, l);
    }

    /// What to do with one lease the agent reports.
    fn judge(
        &self,
        node: &Node,
        (leases, held_cpus): (&super::NodeLeases, &CpuMask),
        r: &LeaseRecord,
        now: Instant,
        now_ms: u64,
    ) -> Verdict {
        if leases.leases.contains_key(&r.id) {
            return Verdict::Kept;
        }
        if self.index.ended().contains_key(&r.id) {
            return Verdict::Refuse("it ended while the agent was away");
        }
        if r.id == 0 || self.index.lock().contains(r.id) {
            return Verdict::Refuse("its id is another node's lease");
        }
        if self.log.authoritative() {
            return Verdict::Refuse(
                "the lease store does not hold it (never acknowledged, or ended)",
            );
        }
        let Some(lease) = Lease::from_record(r, now, now_ms) else {
            return Verdict::Refuse("its CPUs cannot be read");
        };
        if r.expires_at_ms <= now_ms {
            return Verdict::Refuse("expired");
        }
        if lease.cpus.iter().any(|c| c >= node.spec.cpus.len()) {
            return Verdict::Refuse("it names a CPU the node does not have");
        }
        if lease.cpus.and(held_cpus).is_empty() {
            return Verdict::Adopt(Box::new(lease));
        }
        // The server's lease on these CPUs is the committed one: the
        // agent's loses, whichever was granted first (module doc).
        Verdict::Refuse("it overlaps a lease the server holds")
    }
}

/// The epoch a batch of recovery ops is fenced on: its node's, when every
/// op is of one node; else none (a restart's embedded log).
fn stored_epoch(store: &Leases, ops: &[LeaseOp]) -> Epoch {
    let mut nodes = ops.iter().filter_map(LeaseOp::node);
    match nodes.next() {
        Some(n) if nodes.all(|m| m == n) => store.index.epoch(n),
        _ => 0,
    }
}
