//! Leases: sets of CPUs held for a holder (AllocateCpus) until released or
//! expired, owned by the identity that took them, and durable.
//!
//! This folder is the lease component: no other module writes lease state.
//! Here the table and its phases, in `settle` the driving of every change
//! to a known outcome, in `recovery` the leases read back (a restart, a
//! take-over, an agent's registration), in `log/` the durable copy behind
//! the [`log::LeaseLog`] trait. Two adapters plug in from outside through
//! its traits: the etcd log (`replica/log.rs`, a [`log::LeaseLog`]) and the
//! hub to the agents (`service/lease_hub.rs`, a [`settle::AgentSink`]). What
//! the service calls: [`Leases::allocate_locked`] and the lookups
//! ([`Leases::requested`], [`Leases::lease`], [`Leases::leases_of`]) for a
//! grant, [`Leases::begin_end`] and [`Leases::begin_renew`] for the other
//! changes, each settled by [`settle::spawn`]; the expiry loop calls
//! [`Leases::begin_expiry`]; an agent's registration
//! [`Leases::reconcile_leases`]; a replica's claim
//! [`Leases::take_over_leases`].
//!
//! A wakeup claim counts a CPU as running one more task for half a second;
//! a lease does the same for as long as it lives, so every decision made on
//! the node (PickCpu, Balance, other allocations) sees its CPUs as busy. The
//! bookkeeping lives beside the claims, under the node's writer mutex:
//! `NodeLeases` keeps each leased CPU's agent state without the lease, so a
//! published snapshot is always "the agent's state plus claims plus leases"
//! and releasing a lease restores exactly what the agent last said. Unlike a
//! claim, a report of a leased CPU does not end the lease: it replaces the
//! state underneath it.
//!
//! Every change is submitted to the store's [`LeaseLog`] under the same
//! mutex that changes the table (so the log's order is the table's), and
//! nothing of it is visible before the log acknowledged it. A lease moves
//! through explicit [`Phase`]s:
//!
//! ```text
//!   begin_grant -> Pending --grant_settled(applied)--> Live --begin_end--> Ending
//!                     |                                  ^                   |
//!                     +--(refused)--> gone               +--(refused)--------+
//!                                                                            |
//!                                                    end_settled(applied) -> gone
//! ```
//!
//! Its CPUs are held from the moment it is `Pending` and given back only
//! when its end is committed. A `Pending` lease is neither answered, nor
//! shown, nor sent to its agent; an `Ending` one still holds its CPUs and
//! is shown as it was; a renewal extends the lease only once committed.
//! While a change is in flight or its outcome unknown the lease is `busy`:
//! no other change starts, and `leases/settle.rs` drives the one in
//! flight to a known outcome.
//!
//! A lease outlives its node's registration: when the node is forgotten,
//! restarts its agent with another topology, or has not registered yet
//! after a server restart, its leases are *parked* (still in the index,
//! still renewable and releasable, still expiring) and go back into the
//! node when it registers. The store keeps an index lease id -> node id,
//! so Release and Renew name a lease alone. Leases are exclusive: an
//! allocation never hands out a CPU another live lease holds.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

mod index;
mod lease;
pub mod log;
pub mod recovery;
pub mod settle;

pub use index::{DEFAULT_MAX_LEASES_PER_CALLER, OwnerLimits, Unallocatable};
pub(in crate::store) use lease::NodeLeases;
pub use lease::{Lease, NewLease, Phase, Target, wall_ms};

use super::{Node, Snapshot, Table, Writer, base_cpus};
use crate::engine::cpumask::CpuMask;
use index::{LeaseIndex, Tomb};
use log::{Commit, Epoch, LeaseLog, LeaseOp, LogError, unix_ms_now};

/// Tombstones are pruned at most this often: a busy server may hold many
/// (one per early end within a lease's lifetime), and a scan of them every
/// expiry tick would cost more than they save.
const PRUNE_EVERY_MS: u64 = 1_000;

/// A lease that ended, for the node's agent and the metrics.
#[derive(Debug, Clone)]
pub struct Ended {
    pub node: String,
    pub lease: Lease,
}

/// Why a Release or Renew did not happen.
#[derive(Debug)]
pub enum LeaseRefusal<E> {
    /// No live lease has the id.
    NotFound,
    /// The check refused the caller.
    Refused(E),
    /// Another change of the lease is in flight or being settled: retry.
    Busy(&'static str),
}

/// An edit's outcome as a refusal: not found (no map held the lease, or
/// the edit found it gone) or refused by the caller's check.
fn settle<R, E>(r: Option<Result<R, LeaseRefusal<E>>>) -> Result<R, LeaseRefusal<E>> {
    r.unwrap_or(Err(LeaseRefusal::NotFound))
}

/// An edit that found no lease in the phase it settles.
struct Gone;

/// One lease op on a node's lease map, wherever the map lives.
type Edit<'a, R, E> = &'a mut dyn FnMut(&mut BTreeMap<u64, Lease>) -> Result<R, E>;

/// A renewal submitted and not yet acknowledged: what the lease becomes
/// once it is.
#[derive(Debug, Clone, Copy)]
pub struct Renewal {
    pub ttl: Duration,
    pub expires: Instant,
}

/// The change of a busy lease whose outcome is being settled: the op the
/// settler writes again until the log acknowledges it.
#[derive(Debug, Clone, Copy)]
pub enum Change {
    /// A grant whose caller can find it again (a request id): made certain.
    GrantForward,
    /// A grant nobody can know the id of: ended for certain.
    GrantBack,
    Renew(Renewal),
    /// An end (release or expiry).
    End,
}

/// The lease component's owner: every lease's table and phases, the
/// index by id, owner and request, the tombstones, and the durable log.
pub struct Leases {
    table: Arc<Table>,
    /// Lease id -> node id, and the leases of nodes not registered now.
    index: LeaseIndex,
    /// The durable copy of the leases.
    log: Arc<dyn LeaseLog>,
    limits: OwnerLimits,
    /// How long a tombstone is kept at least, on this process's clock.
    tombstone_min_keep: Duration,
}

impl Leases {
    pub(super) fn new(
        table: Arc<Table>,
        log: Arc<dyn LeaseLog>,
        limits: OwnerLimits,
        tombstone_min_keep: Duration,
    ) -> Self {
        Self {
            table,
            index: LeaseIndex::default(),
            log,
            limits,
            tombstone_min_keep,
        }
    }

    /// Where leases are kept, for the start-up log line.
    pub fn describe(&self) -> String {
        self.log.describe()
    }
}

impl Leases {
    /// Decides a lease under the node's writer and submits its grant:
    /// `decide` sees the current snapshot and the CPUs other leases hold,
    /// and returns the lease to make or why not. Deciding under the writer
    /// makes two concurrent allocations see each other: they never share a
    /// CPU. The lease is `Pending` (its CPUs held, nothing shown) until
    /// [`Leases::grant_settled`] hears the commit's outcome.
    pub fn allocate_locked<T, E: From<Unallocatable>>(
        &self,
        node: &Node,
        now: Instant,
        decide: impl FnOnce(&Snapshot, &CpuMask) -> Result<(T, NewLease), E>,
    ) -> Result<(T, Lease, Commit), E> {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if w.leases.retired {
            return Err(Unallocatable::NodeGone.into());
        }
        if node.reconciling.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(Unallocatable::Registering.into());
        }
        let cur = node.snapshot();
        let held = w.leases.leased();
        let (out, new) = decide(&cur, &held)?;
        let id = self.index.reserve(&node.id, &new, self.limits)?;
        let lease = Lease {
            id,
            cpus: new.cpus,
            policy: new.policy,
            holder: new.holder,
            owner: new.owner,
            ttl: new.ttl,
            expires: now + new.ttl,
            granted_at_ms: unix_ms_now(),
            target: new.target,
            applied: false,
            request_id: new.request_id,
            phase: Phase::Pending,
            busy: true,
            committed: false,
        };
        let epoch = self.index.epoch(&node.id);
        let commit = self
            .log
            .submit(epoch, vec![LeaseOp::Grant(lease.record(&node.id))]);
        w.leases.leases.insert(lease.id, lease.clone());
        self.republish(node, &mut w, &cur);
        Ok((out, lease, commit))
    }

    /// The outcome of a grant's commit: `applied`, the lease is live and
    /// returned; not, it is gone and its CPUs are free again.
    pub fn grant_settled(&self, id: u64, applied: bool) -> Option<Lease> {
        let mut edit = |m: &mut BTreeMap<u64, Lease>| -> Result<Option<Lease>, Gone> {
            let l = m.get_mut(&id).filter(|l| l.phase == Phase::Pending);
            let l = l.ok_or(Gone)?;
            if applied {
                l.phase = Phase::Live;
                l.busy = false;
                l.committed = true;
                return Ok(Some(l.clone()));
            }
            m.remove(&id);
            Ok(None)
        };
        self.edit_lease(id, &mut edit)
            .and_then(Result::ok)
            .flatten()
    }

    /// The lease granted to `owner` for `request_id`, with its node, if it
    /// is held (in any phase).
    pub fn requested(&self, owner: &str, request_id: &str) -> Option<(String, Lease)> {
        let id = self.index.lock().by_request(owner, request_id)?;
        self.lease(id)
    }

    /// Lease `id` with its node, in whatever phase it is.
    pub fn lease(&self, id: u64) -> Option<(String, Lease)> {
        let node = self.index.node_of(id)?;
        let mut edit = |m: &mut BTreeMap<u64, Lease>| m.get(&id).cloned().ok_or(Gone);
        let l = self.edit_lease(id, &mut edit)?.ok()?;
        Some((node, l))
    }

    /// Builds the next snapshot from the agent's state with the writer's
    /// claims and leases on top.
    fn republish(&self, node: &Node, w: &mut Writer, cur: &Snapshot) {
        self.table.republish(node, w, cur, cur.features);
    }

    /// Runs `edit` on the lease map that holds lease `id`: its node's (the
    /// snapshot is republished when the lease left it) or its parked one. `None` when no
    /// map holds it. A lease that moves between the two while it is looked
    /// for (its node registering or leaving) is looked for again.
    fn edit_lease<R, E>(&self, id: u64, edit: Edit<'_, R, E>) -> Option<Result<R, E>> {
        for _ in 0..4 {
            let node_id = self.index.node_of(id)?;
            if let Some(node) = self.table.get(&node_id) {
                let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
                if w.leases.leases.contains_key(&id) {
                    let r = edit(&mut w.leases.leases);
                    if !w.leases.leases.contains_key(&id) {
                        self.index.lock().remove(id);
                        // The leased CPUs' saved agent states are kept
                        // until the next publish: the state without the
                        // lease is still at hand.
                        let cur = node.snapshot();
                        let cpus = base_cpus(&cur, &w);
                        let topo = Arc::clone(&cur.topo);
                        self.table
                            .publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
                    }
                    return Some(r);
                }
                if let Some(r) = self.edit_parked(id, &node_id, &mut *edit) {
                    return Some(r);
                }
            } else if let Some(r) = self.edit_parked(id, &node_id, &mut *edit) {
                return Some(r);
            }
        }
        None
    }

    fn edit_parked<R, E>(
        &self,
        id: u64,
        node_id: &str,
        edit: Edit<'_, R, E>,
    ) -> Option<Result<R, E>> {
        let mut parked = self.index.parked();
        let map = parked.get_mut(node_id).filter(|m| m.contains_key(&id))?;
        let r = edit(map);
        if !map.contains_key(&id) {
            self.index.lock().remove(id);
        }
        if map.is_empty() {
            parked.remove(node_id);
        }
        Some(r)
    }

    /// Starts ending lease `id` if `may` allows it: it turns `Ending` (its
    /// CPUs still held) and its end is submitted. Returns its node, the
    /// lease, and the commit. A lease that is already ending has its end
    /// submitted again (a retried release joins the one in flight); one
    /// with another change in flight is [`LeaseRefusal::Busy`].
    pub fn begin_end<E>(
        &self,
        id: u64,
        mut may: impl FnMut(&Lease) -> Result<(), E>,
    ) -> Result<(String, Lease, Commit), LeaseRefusal<E>> {
        let node = self.index.node_of(id).ok_or(LeaseRefusal::NotFound)?;
        let epoch = self.index.epoch(&node);
        let mut edit = |m: &mut BTreeMap<u64, Lease>| {
            let l = m.get_mut(&id).ok_or(LeaseRefusal::NotFound)?;
            may(l).map_err(LeaseRefusal::Refused)?;
            // A retried release joins an end in flight.
            in_flight(l, true)?;
            l.phase = Phase::Ending;
            l.busy = true;
            let op = self.end_op(&node, l);
            Ok((l.clone(), self.log.submit(epoch, vec![op])))
        };
        let (lease, commit) = settle(self.edit_lease(id, &mut edit))?;
        Ok((node, lease, commit))
    }

    /// The outcome of an end's commit. `applied`: `told` hears the lease's
    /// id first (the node's agent is told before the CPUs are free, so a
    /// grant of them always reaches it after the end), then the lease is
    /// gone and returned. Not applied: it is live again.
    pub fn end_settled(&self, id: u64, applied: bool, told: &dyn Fn(&str, u64)) -> Option<Ended> {
        let node = self.index.node_of(id)?;
        let mut edit = |m: &mut BTreeMap<u64, Lease>| -> Result<Option<Lease>, Gone> {
            let l = m.get_mut(&id).filter(|l| l.phase == Phase::Ending);
            let l = l.ok_or(Gone)?;
            if !applied {
                l.phase = Phase::Live;
                l.busy = false;
                return Ok(None);
            }
            told(&node, id);
            Ok(m.remove(&id))
        };
        let lease = self.edit_lease(id, &mut edit)?.ok()??;
        Some(Ended { node, lease })
    }

    /// Starts renewing lease `id` to `ttl` (or its own ttl) from `now` if
    /// `may` allows it: the renewed record is submitted and nothing changes
    /// in memory until [`Leases::renew_settled`]. Returns its node, what the
    /// lease becomes, and the commit.
    pub fn begin_renew<E>(
        &self,
        id: u64,
        ttl: Option<Duration>,
        now: Instant,
        mut may: impl FnMut(&Lease) -> Result<(), E>,
    ) -> Result<(String, Renewal, Commit), LeaseRefusal<E>> {
        let node = self.index.node_of(id).ok_or(LeaseRefusal::NotFound)?;
        let epoch = self.index.epoch(&node);
        let mut edit = |m: &mut BTreeMap<u64, Lease>| {
            let l = m.get_mut(&id).ok_or(LeaseRefusal::NotFound)?;
            may(l).map_err(LeaseRefusal::Refused)?;
            in_flight(l, false)?;
            let ttl = ttl.unwrap_or(l.ttl);
            let r = Renewal {
                ttl,
                expires: now + ttl,
            };
            l.busy = true;
            let op = LeaseOp::Put(renewed(l, &r).record(&node));
            Ok((r, self.log.submit(epoch, vec![op])))
        };
        let (r, commit) = settle(self.edit_lease(id, &mut edit))?;
        Ok((node, r, commit))
    }

    /// The outcome of a renewal's commit: `applied`, the lease takes the
    /// renewal and is returned with its node; either way it is free for
    /// the next change.
    pub fn renew_settled(&self, id: u64, r: &Renewal, applied: bool) -> Option<(String, Lease)> {
        let node = self.index.node_of(id)?;
        let mut edit = |m: &mut BTreeMap<u64, Lease>| -> Result<Lease, Gone> {
            let l = m.get_mut(&id).filter(|l| l.phase == Phase::Live && l.busy);
            let l = l.ok_or(Gone)?;
            l.busy = false;
            if applied {
                *l = renewed(l, r);
            }
            Ok(l.clone())
        };
        let l = self.edit_lease(id, &mut edit)?.ok()?;
        Some((node, l))
    }

    /// Writes `change` of busy lease `id` again (the settler, after an
    /// unknown outcome); `None` when the lease is no longer here or no
    /// longer busy with a change (settled meanwhile, or its node was let
    /// go or taken over again).
    pub fn resubmit(&self, id: u64, change: Change) -> Option<Commit> {
        let node = self.index.node_of(id)?;
        let epoch = self.index.epoch(&node);
        let mut edit = |m: &mut BTreeMap<u64, Lease>| -> Result<Commit, Gone> {
            let l = m.get(&id).filter(|l| l.busy).ok_or(Gone)?;
            let op = match change {
                Change::GrantForward => LeaseOp::Settle(l.record(&node)),
                Change::GrantBack => self.end_op(&node, l),
                Change::Renew(r) => LeaseOp::Put(renewed(l, &r).record(&node)),
                Change::End => self.end_op(&node, l),
            };
            Ok(self.log.submit(epoch, vec![op]))
        };
        self.edit_lease(id, &mut edit)?.ok()
    }

    /// A grant whose outcome could not be settled forward is being ended:
    /// the pending lease turns `Ending`, so its end settles it.
    pub fn grant_abandoned(&self, id: u64) {
        let mut edit = |m: &mut BTreeMap<u64, Lease>| {
            if let Some(l) = m.get_mut(&id).filter(|l| l.phase == Phase::Pending) {
                l.phase = Phase::Ending;
            }
            Ok::<(), ()>(())
        };
        let _ = self.edit_lease(id, &mut edit);
    }

    /// The op that ends `l`, released or expired alike: gone, with its
    /// tombstone kept (in memory and in the log) until the expiry it had
    /// and at least `tombstone_min_keep` here, so an agent that missed the
    /// end cannot bring it back, and a write of it landing late fails.
    pub(super) fn end_op(&self, node: &str, l: &Lease) -> LeaseOp {
        let until_ms = wall_ms(l.expires);
        let since = Instant::now();
        self.index.ended().insert(l.id, Tomb { until_ms, since });
        LeaseOp::End {
            id: l.id,
            node: node.to_string(),
            until_ms,
        }
    }

    /// Forgets the tombstones whose time passed, in memory and in the log.
    fn prune_ended(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        let now_ms = unix_ms_now();
        let last = self.index.pruned_at_ms.load(Relaxed);
        if now_ms < last.saturating_add(PRUNE_EVERY_MS) {
            return;
        }
        self.index.pruned_at_ms.store(now_ms, Relaxed);
        let mut past = Vec::new();
        // Kept at least `tombstone_min_keep` on this process's own clock,
        // whatever the wall clock says: a clock ahead must not forget one
        // while a write of its lease may still land late (seconds: a
        // paused etcd member's).
        let min_keep = self.tombstone_min_keep;
        self.index.ended().retain(|id, t| {
            let keep = t.until_ms > now_ms || t.since.elapsed() < min_keep;
            if !keep {
                past.push(*id);
            }
            keep
        });
        self.log
            .submit(0, past.into_iter().map(LeaseOp::Forget).collect())
            .detach();
    }

    /// Records the agent's confirmation of a lease (durably, without
    /// waiting: a lost confirmation only means the agent applies it again).
    /// Not while another change of it is in flight: the record written
    /// would carry the lease as it was before that change.
    pub fn mark_lease_applied(&self, node: &Node, id: u64) {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = w.leases.leases.get_mut(&id)
            && !l.applied
            && l.phase == Phase::Live
            && !l.busy
        {
            l.applied = true;
            let epoch = self.index.epoch(&node.id);
            self.log
                .submit(epoch, vec![LeaseOp::Put(l.record(&node.id))])
                .detach();
        }
    }

    /// The node lease `id` is on, if this store holds the lease.
    pub fn lease_node(&self, id: u64) -> Option<String> {
        self.index.node_of(id)
    }

    /// Whether lease changes can be committed now (a replica that lost
    /// etcd cannot): checked before a change is made in memory.
    pub fn writable(&self) -> Result<(), LogError> {
        self.log.writable()
    }

    /// The node's committed leases, by id (a pending grant is not shown).
    pub fn leases_of(&self, node: &Node) -> Vec<Lease> {
        let w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        w.leases
            .leases
            .values()
            .filter(|l| l.visible())
            .cloned()
            .collect()
    }

    /// Nodes that hold leases (registered or parked), each once.
    fn lease_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .index
            .lock()
            .ids
            .values()
            .map(|l| l.node.clone())
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// Starts ending every lease whose time is over, registered and
    /// parked: each turns `Ending` and its end is submitted; returns them
    /// with their commits, for the settler. A lease with a change in
    /// flight expires once that change is settled. Visits only the nodes
    /// that hold leases.
    pub fn begin_expiry(&self, now: Instant) -> Vec<(String, u64, Commit)> {
        self.prune_ended();
        let mut out = Vec::new();
        for id in self.lease_nodes() {
            let epoch = self.index.epoch(&id);
            if let Some(node) = self.table.get(&id) {
                let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
                self.take_expired(&id, epoch, &mut w.leases.leases, now, &mut out);
            }
            if let Some(map) = self.index.parked().get_mut(&id) {
                self.take_expired(&id, epoch, map, now, &mut out);
            }
        }
        out
    }

    /// Turns the expired, settled leases of `map` `Ending` and submits
    /// their ends.
    fn take_expired(
        &self,
        node: &str,
        epoch: Epoch,
        map: &mut BTreeMap<u64, Lease>,
        now: Instant,
        out: &mut Vec<(String, u64, Commit)>,
    ) {
        for l in map.values_mut() {
            if l.phase == Phase::Live && !l.busy && l.expires <= now {
                l.phase = Phase::Ending;
                l.busy = true;
                let op = self.end_op(node, l);
                out.push((node.to_string(), l.id, self.log.submit(epoch, vec![op])));
            }
        }
    }

    /// A node leaving the store (forgotten, or re-registered with another
    /// topology): its leases are parked until it registers again or they
    /// expire. Returns how many.
    pub(super) fn park_leases(&self, node: &str, w: &mut Writer) -> usize {
        let leases = std::mem::take(&mut w.leases.leases);
        w.leases = NodeLeases::retired();
        let n = leases.len();
        if n > 0 {
            self.index
                .parked()
                .entry(node.to_string())
                .or_default()
                .extend(leases);
        }
        n
    }

    /// A node (re)entering the store takes back its parked leases. A lease
    /// naming a CPU the node no longer has ends (counted as `topology`);
    /// the ended ones are returned.
    pub(super) fn unpark_leases(&self, node: &Node) -> Vec<Ended> {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if w.leases.retired {
            // Replaced already: the newer node takes them.
            return Vec::new();
        }
        let Some(parked) = self.index.parked().remove(&node.id) else {
            return Vec::new();
        };
        let nr_cpus = node.spec.cpus.len();
        let epoch = self.index.epoch(&node.id);
        let mut ended = Vec::new();
        for (id, lease) in parked {
            let fits = lease.cpus.iter().all(|c| c < nr_cpus);
            if fits {
                // Two stored leases on one CPU (data from a store written
                // before leases were settled, say): neither is ended on a
                // guess, whichever was granted first; both keep their CPUs
                // and nothing else is granted on them until one ends.
                if !lease.cpus.and(&w.leases.leased()).is_empty() {
                    metrics::counter!(crate::metrics::LEASES_RECOVERED, "how" => "conflict")
                        .increment(1);
                    tracing::warn!(node = %node.id, lease = id, cpus = %lease.cpus, "a stored lease overlaps another on this node: both are kept");
                }
                w.leases.leases.insert(id, lease);
            } else {
                // Its CPUs are not this node's any more: nothing is held
                // by keeping it until the end is acknowledged.
                self.log
                    .submit(epoch, vec![self.end_op(&node.id, &lease)])
                    .detach();
                self.index.lock().remove(id);
                ended.push(Ended {
                    node: node.id.clone(),
                    lease,
                });
            }
        }
        if !ended.is_empty() {
            metrics::counter!(crate::metrics::LEASES_ENDED, "how" => "topology")
                .increment(ended.len() as u64);
            tracing::warn!(node = %node.id, ended = ended.len(), "leases naming CPUs the node no longer has ended");
        }
        let cur = node.snapshot();
        self.republish(node, &mut w, &cur);
        ended
    }

    /// Drops every lease of `node` from memory (registered and parked)
    /// without ending any: a replica that claimed the node in a new
    /// ownership period reads them again from the log before it decides.
    pub(super) fn drop_node_leases(&self, node: &str) -> usize {
        let mut dropped = Vec::new();
        if let Some(n) = self.table.get(node) {
            let mut w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if !w.leases.leases.is_empty() {
                dropped.extend(std::mem::take(&mut w.leases.leases).into_keys());
                let cur = n.snapshot();
                self.republish(&n, &mut w, &cur);
            }
        }
        if let Some(p) = self.index.parked().remove(node) {
            dropped.extend(p.into_keys());
        }
        let mut index = self.index.lock();
        for id in &dropped {
            index.remove(*id);
        }
        dropped.len()
    }

    /// A replica letting `node` go (its node left the store, its leases
    /// parked): they leave memory without ending, and whoever claims the
    /// node next reads them from the log again. Returns how many.
    pub(super) fn let_go_leases(&self, node: &str) -> usize {
        self.index.set_epoch(node, None);
        let Some(parked) = self.index.parked().remove(node) else {
            return 0;
        };
        let mut index = self.index.lock();
        for id in parked.keys() {
            index.remove(*id);
        }
        parked.len()
    }

    /// Leases outstanding and the CPUs they hold, across all nodes (parked
    /// ones included).
    pub fn leases_outstanding(&self) -> (usize, usize) {
        let (mut leases, mut cpus) = (0, 0);
        for id in self.lease_nodes() {
            if let Some(n) = self.table.get(&id) {
                let w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
                leases += w.leases.leases.len();
                cpus += w.leases.leased().weight();
            }
            if let Some(m) = self.index.parked().get(&id) {
                leases += m.len();
                cpus += m.values().map(|l| l.cpus.weight()).sum::<usize>();
            }
        }
        (leases, cpus)
    }
}

/// Why no change of `l` may start now: another is in flight or being
/// settled. `joining_end`: an end may join an end in flight.
fn in_flight<E>(l: &Lease, joining_end: bool) -> Result<(), LeaseRefusal<E>> {
    match (l.phase, l.busy) {
        (Phase::Pending, _) => Err(LeaseRefusal::Busy("its grant is being committed")),
        (Phase::Ending, _) if !joining_end => Err(LeaseRefusal::Busy("its end is being committed")),
        (Phase::Live, true) => Err(LeaseRefusal::Busy("a renewal of it is being committed")),
        _ => Ok(()),
    }
}

/// `l` as `r` makes it.
fn renewed(l: &Lease, r: &Renewal) -> Lease {
    Lease {
        ttl: r.ttl,
        expires: r.expires,
        ..l.clone()
    }
}
