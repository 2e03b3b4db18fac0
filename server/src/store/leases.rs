//! Leases: sets of CPUs held for a holder (AllocateCpus) until released or
//! expired, owned by the identity that took them, and durable.
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
//! mutex that changes the table (so the log's order is the table's) and
//! the caller waits for the returned [`Commit`] before it answers.
//!
//! A lease outlives its node's registration: when the node is forgotten,
//! restarts its agent with another topology, or has not registered yet
//! after a server restart, its leases are *parked* (still in the index,
//! still renewable and releasable, still expiring) and go back into the
//! node when it registers. The store keeps an index lease id -> node id,
//! so Release and Renew name a lease alone. Leases are exclusive: an
//! allocation never hands out a CPU another live lease holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::claims::base_cpus;
use super::durable::{Commit, LeaseOp, LeaseRecord, unix_ms_now};
use super::{Node, Snapshot, Store, Writer};
use crate::engine::cpumask::{CpuMask, MAX_CPUS};
use crate::engine::state::CpuState;

/// Where a lease is applied on its node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Target {
    /// Every thread of a process (sched_setaffinity).
    Pid(u32),
    /// A cgroup directory's cpuset.cpus.
    Cgroup(String),
}

/// One live lease.
#[derive(Debug, Clone)]
pub struct Lease {
    pub id: u64,
    pub cpus: CpuMask,
    pub policy: String,
    pub holder: String,
    /// The identity that took it: only it or an admin may end it.
    pub owner: String,
    pub ttl: Duration,
    pub expires: Instant,
    /// When it was granted, wall-clock ms (conflicts: the later one loses).
    pub granted_at_ms: u64,
    pub target: Option<Target>,
    /// The agent confirmed it applied the lease.
    pub applied: bool,
}

/// `t` on the wall clock, in ms since the Unix epoch.
pub fn wall_ms(t: Instant) -> u64 {
    let now = Instant::now();
    let base = unix_ms_now();
    if t >= now {
        base.saturating_add(t.duration_since(now).as_millis() as u64)
    } else {
        base.saturating_sub(now.duration_since(t).as_millis() as u64)
    }
}

/// A wall-clock time (ms since the epoch) as an `Instant` of this process.
fn instant_of(ms: u64, now: Instant, now_ms: u64) -> Instant {
    if ms >= now_ms {
        now + Duration::from_millis(ms - now_ms)
    } else {
        now.checked_sub(Duration::from_millis(now_ms - ms))
            .unwrap_or(now)
    }
}

impl Lease {
    /// The lease as the log keeps it.
    pub fn record(&self, node: &str) -> LeaseRecord {
        LeaseRecord {
            id: self.id,
            node: node.to_string(),
            cpus: self.cpus.to_string(),
            policy: self.policy.clone(),
            holder: self.holder.clone(),
            owner: self.owner.clone(),
            target: self.target.clone(),
            ttl_ms: self.ttl.as_millis() as u64,
            expires_at_ms: wall_ms(self.expires),
            granted_at_ms: self.granted_at_ms,
            applied: self.applied,
        }
    }

    /// A kept record as a live lease; `None` for CPUs that do not parse.
    pub fn from_record(r: &LeaseRecord, now: Instant, now_ms: u64) -> Option<Lease> {
        let cpus = CpuMask::parse_cpulist(&r.cpus, MAX_CPUS).ok()?;
        if cpus.is_empty() {
            return None;
        }
        Some(Lease {
            id: r.id,
            cpus,
            policy: r.policy.clone(),
            holder: r.holder.clone(),
            owner: r.owner.clone(),
            ttl: Duration::from_millis(r.ttl_ms),
            expires: instant_of(r.expires_at_ms, now, now_ms),
            granted_at_ms: r.granted_at_ms,
            target: r.target.clone(),
            applied: r.applied,
        })
    }
}

/// What a new lease is made of, before it has an id.
#[derive(Debug, Clone)]
pub struct NewLease {
    pub cpus: CpuMask,
    pub policy: String,
    pub holder: String,
    pub owner: String,
    pub ttl: Duration,
    pub target: Option<Target>,
}

/// A node's leases, under its writer mutex.
#[derive(Debug, Default)]
pub(super) struct NodeLeases {
    pub(super) leases: BTreeMap<u64, Lease>,
    /// Each leased CPU's agent state without its lease.
    base: HashMap<u32, CpuState>,
    /// The node left the store (forgotten, or replaced by a registration
    /// with another topology) and its leases were parked: this object
    /// takes no lease any more, or a caller still holding it would grant
    /// a parked lease's CPU again, into a node nobody reads.
    pub(super) retired: bool,
}

impl NodeLeases {
    /// The CPUs held by any lease.
    pub(super) fn leased(&self) -> CpuMask {
        let mut m = CpuMask::new();
        for l in self.leases.values() {
            m.or_assign(&l.cpus);
        }
        m
    }

    /// Puts the leased CPUs back to their agent state (after the claims'
    /// restore: a claim taken on a leased CPU saved the leased state).
    pub(super) fn restore(&self, cpus: &mut [CpuState]) {
        for (&cpu, c) in &self.base {
            cpus[cpu as usize] = *c;
        }
    }

    /// The agent state of `cpu` without the lease on it, if it has one.
    pub(super) fn base_of(&self, cpu: u32) -> Option<CpuState> {
        self.base.get(&cpu).copied()
    }

    /// Counts every lease in `cpus` (agent states): each leased CPU runs
    /// one more task, as a claim counts it. Saves the states it changes.
    pub(super) fn count_in(&mut self, cpus: &mut [CpuState]) {
        self.base.clear();
        for l in self.leases.values() {
            for cpu in l.cpus.iter() {
                let Some(c) = cpus.get_mut(cpu) else {
                    continue;
                };
                self.base.entry(cpu as u32).or_insert(*c);
                c.nr_running = c.nr_running.saturating_add(1);
                c.cfs_h_nr_queued = c.cfs_h_nr_queued.saturating_add(1);
                c.curr_is_idle = false;
            }
        }
    }
}

type Parked = HashMap<String, BTreeMap<u64, Lease>>;

/// The store's lease index: id -> node, and the leases of nodes that are
/// not registered now. Lock order: a node's writer, then `parked`, then
/// `by_id`.
#[derive(Debug, Default)]
pub struct LeaseIndex {
    by_id: Mutex<Index>,
    parked: Mutex<Parked>,
    /// Leases that ended early, until the expiry they had: an agent that
    /// missed the end reports them again, and they are not adopted.
    ended: Mutex<HashMap<u64, u64>>,
    /// When the tombstones were last pruned (wall-clock ms).
    pruned_at_ms: std::sync::atomic::AtomicU64,
}

/// Tombstones are pruned at most this often: a busy server may hold many
/// (one per early end within a lease's lifetime), and a scan of them every
/// expiry tick would cost more than they save.
const PRUNE_EVERY_MS: u64 = 1_000;

/// Every live lease's node and owner, and what each owner holds: one
/// lock, so a grant's check of its owner's limits and its reservation are
/// one step.
#[derive(Debug, Default)]
pub(super) struct Index {
    ids: HashMap<u64, Indexed>,
    owners: HashMap<String, Held>,
}

#[derive(Debug)]
struct Indexed {
    node: String,
    owner: String,
    cpus: usize,
}

/// Leases and CPUs one owner holds.
#[derive(Debug, Default, Clone, Copy)]
struct Held {
    leases: usize,
    cpus: usize,
}

/// Leases and leased CPUs one caller identity may hold at once (`None`:
/// no limit), from `--max-leases-per-caller` and
/// `--max-leased-cpus-per-caller`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OwnerLimits {
    pub leases: Option<usize>,
    pub cpus: Option<usize>,
}

impl Default for OwnerLimits {
    fn default() -> Self {
        Self {
            leases: Some(DEFAULT_MAX_LEASES_PER_CALLER),
            cpus: None,
        }
    }
}

/// Default of [`OwnerLimits::leases`].
pub const DEFAULT_MAX_LEASES_PER_CALLER: usize = 1024;

impl Index {
    pub(super) fn contains(&self, id: u64) -> bool {
        self.ids.contains_key(&id)
    }

    /// Records lease `id` of `node`, held by `owner` on `cpus` CPUs.
    pub(super) fn add(&mut self, id: u64, node: &str, owner: &str, cpus: usize) {
        let held = self.owners.entry(owner.to_string()).or_default();
        held.leases += 1;
        held.cpus += cpus;
        if let Some(old) = self.ids.insert(
            id,
            Indexed {
                node: node.to_string(),
                owner: owner.to_string(),
                cpus,
            },
        ) {
            self.forget_use(&old);
        }
    }

    /// Forgets lease `id`; returns whether it was there.
    pub(super) fn remove(&mut self, id: u64) -> bool {
        match self.ids.remove(&id) {
            Some(old) => {
                self.forget_use(&old);
                true
            }
            None => false,
        }
    }

    fn forget_use(&mut self, l: &Indexed) {
        if let Some(h) = self.owners.get_mut(&l.owner) {
            h.leases = h.leases.saturating_sub(1);
            h.cpus = h.cpus.saturating_sub(l.cpus);
            if h.leases == 0 {
                self.owners.remove(&l.owner);
            }
        }
    }

    /// Why `owner` may not take one more lease of `cpus` CPUs, if so.
    fn over_limit(&self, owner: &str, cpus: usize, lim: OwnerLimits) -> Option<String> {
        let h = self.owners.get(owner).copied().unwrap_or_default();
        if let Some(max) = lim.leases
            && h.leases + 1 > max
        {
            return Some(format!(
                "{owner} holds {} leases, the most a caller may (--max-leases-per-caller {max})",
                h.leases
            ));
        }
        if let Some(max) = lim.cpus
            && h.cpus + cpus > max
        {
            return Some(format!(
                "{owner} holds {} leased CPUs; {cpus} more is above --max-leased-cpus-per-caller {max}",
                h.cpus
            ));
        }
        None
    }
}

impl LeaseIndex {
    fn node_of(&self, id: u64) -> Option<String> {
        self.lock().ids.get(&id).map(|l| l.node.clone())
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Index> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn parked(&self) -> MutexGuard<'_, Parked> {
        self.parked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn ended(&self) -> MutexGuard<'_, HashMap<u64, u64>> {
        self.ended.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new id for a lease of `owner` on `cpus` CPUs of `node`: 64 random
    /// bits, never 0, never one that is live, reserved in the index before
    /// it is returned; or why the owner may not take it.
    fn reserve(
        &self,
        node: &str,
        owner: &str,
        cpus: usize,
        lim: OwnerLimits,
    ) -> Result<u64, Unallocatable> {
        let mut index = self.lock();
        if let Some(why) = index.over_limit(owner, cpus, lim) {
            return Err(Unallocatable::CallerLimit(why));
        }
        loop {
            let id = random_u64();
            if id != 0 && !index.contains(id) {
                index.add(id, node, owner, cpus);
                return Ok(id);
            }
        }
    }
}

/// 64 bits from the operating system's generator; should it ever fail, a
/// hash keyed by std's per-process random keys over the time and a counter.
fn random_u64() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        use std::hash::{BuildHasher, Hasher};
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(unix_ms_now());
        h.write_u64(N.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
        h.write_u32(std::process::id());
        h.finish()
    })
}

/// Why a decided allocation was not granted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Unallocatable {
    /// The node object left the store while the allocation was decided
    /// (the node re-registered with another topology, or was forgotten):
    /// nothing was granted; the caller may retry.
    NodeGone,
    /// The caller holds as many leases or CPUs as it may; why.
    CallerLimit(String),
}

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
}

/// An edit's outcome as a refusal: not found (no map held the lease, or
/// the edit found it gone) or refused by the caller's check.
fn settle<R, E>(r: Option<Result<R, Option<E>>>) -> Result<R, LeaseRefusal<E>> {
    match r {
        Some(Ok(v)) => Ok(v),
        Some(Err(Some(e))) => Err(LeaseRefusal::Refused(e)),
        Some(Err(None)) | None => Err(LeaseRefusal::NotFound),
    }
}

/// One lease op on a node's lease map, wherever the map lives.
type Edit<'a, R, E> = &'a mut dyn FnMut(&mut BTreeMap<u64, Lease>) -> Result<R, E>;

impl Store {
    /// Decides and commits a lease under the node's writer: `decide` sees
    /// the current snapshot and the CPUs other leases hold, and returns the
    /// lease to make or why not. Deciding under the writer makes two
    /// concurrent allocations see each other: they never share a CPU. The
    /// returned commit makes it durable.
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
        let cur = node.snapshot();
        let held = w.leases.leased();
        let (out, new) = decide(&cur, &held)?;
        let id = self.leases.reserve(
            &node.id,
            &new.owner,
            new.cpus.weight(),
            self.config.lease_limits,
        )?;
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
        };
        let commit = self.log.submit(vec![LeaseOp::Put(lease.record(&node.id))]);
        w.leases.leases.insert(lease.id, lease.clone());
        self.republish(node, &mut w, &cur);
        Ok((out, lease, commit))
    }

    /// Builds the next snapshot from the agent's state with the writer's
    /// claims and leases on top.
    pub(super) fn republish(&self, node: &Node, w: &mut Writer, cur: &Snapshot) {
        let cpus = base_cpus(cur, w);
        let topo = Arc::clone(&cur.topo);
        self.publish(node, w, cpus, topo, cur.features, None, cur);
    }

    /// Runs `edit` on the lease map that holds lease `id`: its node's (the
    /// snapshot is republished when the lease left it) or its parked one. `None` when no
    /// map holds it. A lease that moves between the two while it is looked
    /// for (its node registering or leaving) is looked for again.
    fn edit_lease<R, E>(&self, id: u64, edit: Edit<'_, R, E>) -> Option<Result<R, E>> {
        for _ in 0..4 {
            let node_id = self.leases.node_of(id)?;
            if let Some(node) = self.get(&node_id) {
                let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
                if w.leases.leases.contains_key(&id) {
                    let cur = node.snapshot();
                    // The agent's state as it is, before a lease leaves.
                    let cpus = base_cpus(&cur, &w);
                    let r = edit(&mut w.leases.leases);
                    if !w.leases.leases.contains_key(&id) {
                        self.leases.lock().remove(id);
                        let topo = Arc::clone(&cur.topo);
                        self.publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
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
        let mut parked = self.leases.parked();
        let map = parked.get_mut(node_id).filter(|m| m.contains_key(&id))?;
        let r = edit(map);
        if !map.contains_key(&id) {
            self.leases.lock().remove(id);
        }
        if map.is_empty() {
            parked.remove(node_id);
        }
        Some(r)
    }

    /// Ends lease `id` if `may` allows it; returns it with its node id and
    /// the commit that makes the end durable.
    pub fn release_lease<E>(
        &self,
        id: u64,
        mut may: impl FnMut(&Lease) -> Result<(), E>,
    ) -> Result<(Ended, Commit), LeaseRefusal<E>> {
        let node = self.leases.node_of(id).ok_or(LeaseRefusal::NotFound)?;
        let mut edit = |m: &mut BTreeMap<u64, Lease>| {
            let l = m.get(&id).ok_or(None)?;
            may(l).map_err(Some)?;
            let commit = self.log.submit(vec![self.end_op(&node, l)]);
            let lease = m.remove(&id).ok_or(None)?;
            Ok((lease, commit))
        };
        let (lease, commit) = settle(self.edit_lease(id, &mut edit))?;
        Ok((Ended { node, lease }, commit))
    }

    /// Extends lease `id` to `ttl` (or its own ttl) from `now` if `may`
    /// allows it; returns its node, the lease as it now is and the commit.
    pub fn renew_lease<E>(
        &self,
        id: u64,
        ttl: Option<Duration>,
        now: Instant,
        mut may: impl FnMut(&Lease) -> Result<(), E>,
    ) -> Result<(String, Lease, Commit), LeaseRefusal<E>> {
        let node = self.leases.node_of(id).ok_or(LeaseRefusal::NotFound)?;
        let mut edit = |m: &mut BTreeMap<u64, Lease>| {
            let l = m.get_mut(&id).ok_or(None)?;
            may(l).map_err(Some)?;
            if let Some(t) = ttl {
                l.ttl = t;
            }
            l.expires = now + l.ttl;
            let commit = self.log.submit(vec![LeaseOp::Put(l.record(&node))]);
            Ok((l.clone(), commit))
        };
        let (lease, commit) = settle(self.edit_lease(id, &mut edit))?;
        Ok((node, lease, commit))
    }

    /// The op that ends `l` before its time, with its tombstone kept (in
    /// memory and in the log) until the expiry it had.
    pub(super) fn end_op(&self, node: &str, l: &Lease) -> LeaseOp {
        let until_ms = wall_ms(l.expires);
        self.leases.ended().insert(l.id, until_ms);
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
        let last = self.leases.pruned_at_ms.load(Relaxed);
        if now_ms < last.saturating_add(PRUNE_EVERY_MS) {
            return;
        }
        self.leases.pruned_at_ms.store(now_ms, Relaxed);
        let mut past = Vec::new();
        self.leases.ended().retain(|id, until| {
            let keep = *until > now_ms;
            if !keep {
                past.push(*id);
            }
            keep
        });
        self.log
            .submit(past.into_iter().map(LeaseOp::Forget).collect())
            .detach();
    }

    /// Records the agent's confirmation of a lease (durably, without
    /// waiting: a lost confirmation only means the agent applies it again).
    pub fn mark_lease_applied(&self, node: &Node, id: u64) {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = w.leases.leases.get_mut(&id)
            && !l.applied
        {
            l.applied = true;
            self.log
                .submit(vec![LeaseOp::Put(l.record(&node.id))])
                .detach();
        }
    }

    /// The node lease `id` is on, if this store holds the lease.
    pub fn lease_node(&self, id: u64) -> Option<String> {
        self.leases.node_of(id)
    }

    /// Whether lease changes can be committed now (a replica that lost
    /// etcd cannot): checked before a change is made in memory.
    pub fn leases_writable(&self) -> Result<(), super::LogError> {
        self.log.writable()
    }

    /// The node's live leases, by id.
    pub fn leases_of(&self, node: &Node) -> Vec<Lease> {
        let w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        w.leases.leases.values().cloned().collect()
    }

    /// Nodes that hold leases (registered or parked), each once.
    fn lease_nodes(&self) -> Vec<String> {
        let mut nodes: Vec<String> = self
            .leases
            .lock()
            .ids
            .values()
            .map(|l| l.node.clone())
            .collect();
        nodes.sort();
        nodes.dedup();
        nodes
    }

    /// Drops leases whose time ended, registered and parked; returns them.
    /// Visits only the nodes that hold leases.
    pub fn expire_leases(&self, now: Instant) -> Vec<Ended> {
        self.prune_ended();
        let mut ended = Vec::new();
        for id in self.lease_nodes() {
            if let Some(node) = self.get(&id) {
                let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
                if w.leases.leases.values().any(|l| l.expires <= now) {
                    let cur = node.snapshot();
                    let cpus = base_cpus(&cur, &w);
                    self.take_expired(&id, &mut w.leases.leases, now, &mut ended);
                    let topo = Arc::clone(&cur.topo);
                    self.publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
                }
            }
            let mut parked = self.leases.parked();
            if let Some(map) = parked.get_mut(&id) {
                self.take_expired(&id, map, now, &mut ended);
                if map.is_empty() {
                    parked.remove(&id);
                }
            }
        }
        ended
    }

    /// Moves the expired leases of `map` to `ended`, out of the index and
    /// the log.
    fn take_expired(
        &self,
        node: &str,
        map: &mut BTreeMap<u64, Lease>,
        now: Instant,
        ended: &mut Vec<Ended>,
    ) {
        let gone: Vec<u64> = map
            .values()
            .filter(|l| l.expires <= now)
            .map(|l| l.id)
            .collect();
        if gone.is_empty() {
            return;
        }
        self.log
            .submit(
                gone.iter()
                    .map(|&id| LeaseOp::Delete {
                        id,
                        node: node.to_string(),
                    })
                    .collect(),
            )
            .detach();
        let mut index = self.leases.lock();
        for lid in gone {
            if let Some(lease) = map.remove(&lid) {
                index.remove(lid);
                ended.push(Ended {
                    node: node.to_string(),
                    lease,
                });
            }
        }
    }

    /// A node leaving the store (forgotten, or re-registered with another
    /// topology): its leases are parked until it registers again or they
    /// expire. Returns how many.
    pub(super) fn park_leases(&self, node: &str, w: &mut Writer) -> usize {
        let leases = std::mem::take(&mut w.leases.leases);
        w.leases = NodeLeases {
            retired: true,
            ..NodeLeases::default()
        };
        let n = leases.len();
        if n > 0 {
            self.leases
                .parked()
                .entry(node.to_string())
                .or_default()
                .extend(leases);
        }
        n
    }

    /// A node (re)entering the store takes back its parked leases. A lease
    /// naming a CPU the node no longer has, or overlapping one it holds,
    /// ends (counted as `topology`); the ended ones are returned.
    pub(super) fn unpark_leases(&self, node: &Node) -> Vec<Ended> {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if w.leases.retired {
            // Replaced already: the newer node takes them.
            return Vec::new();
        }
        let Some(parked) = self.leases.parked().remove(&node.id) else {
            return Vec::new();
        };
        let nr_cpus = node.spec.cpus.len();
        let mut ended = Vec::new();
        for (id, lease) in parked {
            let fits = lease.cpus.iter().all(|c| c < nr_cpus)
                && lease.cpus.and(&w.leases.leased()).is_empty();
            if fits {
                w.leases.leases.insert(id, lease);
            } else {
                self.log
                    .submit(vec![self.end_op(&node.id, &lease)])
                    .detach();
                self.leases.lock().remove(id);
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

    /// Leases outstanding and the CPUs they hold, across all nodes (parked
    /// ones included).
    pub fn leases_outstanding(&self) -> (usize, usize) {
        let (mut leases, mut cpus) = (0, 0);
        for id in self.lease_nodes() {
            if let Some(n) = self.get(&id) {
                let w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
                leases += w.leases.leases.len();
                cpus += w.leases.leased().weight();
            }
            if let Some(m) = self.leases.parked().get(&id) {
                leases += m.len();
                cpus += m.values().map(|l| l.cpus.weight()).sum::<usize>();
            }
        }
        (leases, cpus)
    }
}
