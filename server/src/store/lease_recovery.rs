//! Getting leases back after a restart, from both witnesses: the lease log
//! at start ([`Store::load_leases`]) and each node's agent when it
//! registers ([`Store::reconcile_leases`]).
//!
//! The log is the first witness: every lease it holds that has not expired
//! is parked under its node and goes back into the node when the node's
//! agent registers. The agent is the second: it checkpoints the leases it
//! was sent and reports them with its registration, so a server whose
//! state directory was lost gets them back. Each lease the agent reports:
//! - known to the server on this node: kept;
//! - unknown, unexpired, on CPUs the node has, overlapping no live lease:
//!   adopted (committed to the log as if granted again);
//! - overlapping a live lease: the one granted later is released on the
//!   node, the conflict logged and counted;
//! - expired, ended early while the agent was away (a tombstone, kept
//!   until the expiry the lease had), naming another node's lease, or
//!   unreadable: released on the node.
//!
//! Leases the server knows and the agent does not report are sent to it
//! again by the service after registration (applied again).

use std::time::Instant;

use super::durable::{LeaseOp, LeaseRecord, LogError, unix_ms_now};
use super::{Commit, Ended, Lease, Node, Store};
use crate::engine::cpumask::CpuMask;
use crate::metrics as m;

fn recovered(how: &'static str, n: usize) {
    if n > 0 {
        metrics::counter!(m::LEASES_RECOVERED, "how" => how).increment(n as u64);
    }
}

/// What [`Store::load_leases`] found in the log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// Live leases, parked until their nodes register.
    pub loaded: usize,
    /// Leases whose expiry passed while the server was down: ended.
    pub expired: usize,
    /// Records whose CPUs could not be read: ended.
    pub unreadable: usize,
}

/// What [`Store::reconcile_leases`] did with an agent's report.
#[derive(Default)]
pub struct Reconciled {
    pub kept: usize,
    pub adopted: usize,
    pub conflicts: usize,
    pub expired: usize,
    /// Lease ids the agent must drop (refused reports, and the server's
    /// leases that lost a conflict).
    pub release_on_node: Vec<u64>,
    /// The server's own leases that lost a conflict.
    pub ended: Vec<Ended>,
    /// Makes the adoptions and ends durable.
    pub commit: Option<Commit>,
}

/// An agent's report of one lease, decided.
enum Verdict {
    Kept,
    Adopt(Lease),
    /// Adopt it, ending these later leases of the server.
    AdoptOver(Lease, Vec<u64>),
    Refuse(&'static str),
}

impl Store {
    /// Reads the log once at start: live leases are parked under their
    /// nodes, expired and unreadable ones are deleted, tombstones still in
    /// their time kept (the others deleted).
    pub fn load_leases(&self, now: Instant) -> Result<Loaded, LogError> {
        let stored = self.log.load()?;
        Ok(self.park_stored(stored, now))
    }

    /// A replica taking over `node` (it now holds the node's ownership in
    /// the replicated log): `stored`, the node's leases and tombstones read
    /// from the log after the ownership was committed, are parked so the
    /// node's registration finds them. Leases already in memory are kept as
    /// they are.
    pub fn take_over_leases(
        &self,
        node: &str,
        mut stored: super::durable::Stored,
        now: Instant,
    ) -> Loaded {
        {
            let index = self.leases.lock();
            stored
                .leases
                .retain(|r| r.node == node && !index.contains(r.id));
        }
        self.park_stored(stored, now)
    }

    /// Parks the live leases of `stored` under their nodes and keeps its
    /// tombstones still in their time; deletes the expired, the unreadable
    /// and the tombstones past their time.
    fn park_stored(&self, stored: super::durable::Stored, now: Instant) -> Loaded {
        let now_ms = unix_ms_now();
        let mut out = Loaded::default();
        let mut gone = Vec::new();
        {
            let mut ended = self.leases.ended();
            for (id, until) in stored.ended {
                if until > now_ms {
                    ended.insert(id, until);
                } else {
                    gone.push(LeaseOp::Forget(id));
                }
            }
        }
        let mut parked = self.leases.parked();
        let mut index = self.leases.lock();
        for r in stored.leases {
            let Some(lease) = Lease::from_record(&r, now, now_ms) else {
                out.unreadable += 1;
                gone.push(LeaseOp::Delete {
                    id: r.id,
                    node: r.node.clone(),
                });
                continue;
            };
            if r.expires_at_ms <= now_ms {
                out.expired += 1;
                gone.push(LeaseOp::Delete {
                    id: r.id,
                    node: r.node.clone(),
                });
                continue;
            }
            index.add(r.id, &r.node, &lease.owner, lease.cpus.weight());
            parked.entry(r.node).or_default().insert(r.id, lease);
            out.loaded += 1;
        }
        drop((index, parked));
        self.log.submit(gone).detach();
        recovered("loaded", out.loaded);
        recovered("expired", out.expired + out.unreadable);
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
        let base = super::claims::base_cpus(&cur, &w);
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
                Verdict::AdoptOver(lease, losers) => {
                    out.conflicts += 1;
                    for id in losers {
                        if let Some(l) = w.leases.leases.remove(&id) {
                            tracing::warn!(node = %node.id, lease = id, cpus = %l.cpus, over = lease.id, "a later lease conflicts with one the agent holds: the later one is released");
                            self.leases.lock().remove(id);
                            ops.push(self.end_op(&node.id, &l));
                            out.release_on_node.push(id);
                            out.ended.push(Ended {
                                node: node.id.clone(),
                                lease: l,
                            });
                        }
                    }
                    self.adopt(node, &mut w.leases, lease, &mut ops);
                    out.adopted += 1;
                    held_cpus = w.leases.leased();
                }
                Verdict::Adopt(lease) => {
                    held_cpus.or_assign(&lease.cpus);
                    self.adopt(node, &mut w.leases, lease, &mut ops);
                    out.adopted += 1;
                }
            }
        }
        if !ops.is_empty() {
            out.commit = Some(self.log.submit(ops));
            let topo = std::sync::Arc::clone(&cur.topo);
            self.publish(node, &mut w, base, topo, cur.features, None, &cur);
        }
        recovered("kept", out.kept);
        recovered("adopted", out.adopted);
        recovered("conflict", out.conflicts);
        recovered("expired", out.expired);
        out
    }

    fn adopt(
        &self,
        node: &Node,
        leases: &mut super::leases::NodeLeases,
        l: Lease,
        ops: &mut Vec<LeaseOp>,
    ) {
        tracing::info!(node = %node.id, lease = l.id, cpus = %l.cpus, holder = %l.holder, "lease adopted from the node's agent");
        ops.push(LeaseOp::Put(l.record(&node.id)));
        self.leases
            .lock()
            .add(l.id, &node.id, &l.owner, l.cpus.weight());
        leases.leases.insert(l.id, l);
    }

    /// What to do with one lease the agent reports.
    fn judge(
        &self,
        node: &Node,
        (leases, held_cpus): (&super::leases::NodeLeases, &CpuMask),
        r: &LeaseRecord,
        now: Instant,
        now_ms: u64,
    ) -> Verdict {
        if leases.leases.contains_key(&r.id) {
            return Verdict::Kept;
        }
        if self.leases.ended().contains_key(&r.id) {
            return Verdict::Refuse("it ended while the agent was away");
        }
        if r.id == 0 || self.leases.lock().contains(r.id) {
            return Verdict::Refuse("its id is another node's lease");
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
            return Verdict::Adopt(lease);
        }
        let overlapping: Vec<&Lease> = leases
            .leases
            .values()
            .filter(|l| !l.cpus.and(&lease.cpus).is_empty())
            .collect();
        if overlapping.is_empty() {
            return Verdict::Adopt(lease);
        }
        if overlapping
            .iter()
            .any(|l| l.granted_at_ms <= lease.granted_at_ms)
        {
            return Verdict::Refuse("it overlaps a lease granted before it");
        }
        let losers = overlapping.iter().map(|l| l.id).collect();
        Verdict::AdoptOver(lease, losers)
    }
}
