//! Leases: sets of CPUs held for a holder (AllocateCpus) until released,
//! expired or their node forgotten.
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
//! The store keeps an index lease id -> node id, so Release and Renew name a
//! lease alone, and expiry visits only nodes that hold leases. Leases are
//! exclusive: an allocation never hands out a CPU another live lease holds.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::claims::base_cpus;
use super::{Node, Snapshot, Store, Writer};
use crate::engine::cpumask::CpuMask;
use crate::engine::state::CpuState;

/// Where a lease is applied on its node.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    pub ttl: Duration,
    pub expires: Instant,
    pub target: Option<Target>,
    /// The agent confirmed it applied the lease.
    pub applied: bool,
}

/// What a new lease is made of, before it has an id.
#[derive(Debug, Clone)]
pub struct NewLease {
    pub cpus: CpuMask,
    pub policy: String,
    pub holder: String,
    pub ttl: Duration,
    pub target: Option<Target>,
}

/// A node's leases, under its writer mutex.
#[derive(Debug, Default)]
pub(super) struct NodeLeases {
    leases: BTreeMap<u64, Lease>,
    /// Each leased CPU's agent state without its lease.
    base: HashMap<u32, CpuState>,
}

impl NodeLeases {
    /// The CPUs held by any lease.
    fn leased(&self) -> CpuMask {
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

/// The store's lease index: id -> node, and the id counter.
#[derive(Debug)]
pub struct LeaseIndex {
    next_id: AtomicU64,
    by_id: Mutex<HashMap<u64, String>>,
}

impl Default for LeaseIndex {
    fn default() -> Self {
        Self {
            next_id: AtomicU64::new(1),
            by_id: Mutex::new(HashMap::new()),
        }
    }
}

impl LeaseIndex {
    fn node_of(&self, id: u64) -> Option<String> {
        self.lock().get(&id).cloned()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, String>> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A lease that ended, for the node's agent and the metrics.
#[derive(Debug, Clone)]
pub struct Ended {
    pub node: String,
    pub lease: Lease,
}

impl Store {
    /// Decides and commits a lease under the node's writer: `decide` sees
    /// the current snapshot and the CPUs other leases hold, and returns the
    /// lease to make or why not. Deciding under the writer makes two
    /// concurrent allocations see each other: they never share a CPU.
    pub fn allocate_locked<T, E>(
        &self,
        node: &Node,
        now: Instant,
        decide: impl FnOnce(&Snapshot, &CpuMask) -> Result<(T, NewLease), E>,
    ) -> Result<(T, Lease), E> {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        let held = w.leases.leased();
        let (out, new) = decide(&cur, &held)?;
        let id = self.leases.next_id.fetch_add(1, Ordering::Relaxed);
        let lease = Lease {
            id,
            cpus: new.cpus,
            policy: new.policy,
            holder: new.holder,
            ttl: new.ttl,
            expires: now + new.ttl,
            target: new.target,
            applied: false,
        };
        w.leases.leases.insert(id, lease.clone());
        self.leases.lock().insert(id, node.id.clone());
        self.republish(node, &mut w, &cur);
        Ok((out, lease))
    }

    /// Builds the next snapshot from the agent's state with the writer's
    /// claims and leases on top.
    fn republish(&self, node: &Node, w: &mut Writer, cur: &Snapshot) {
        let cpus = base_cpus(cur, w);
        let topo = Arc::clone(&cur.topo);
        self.publish(node, w, cpus, topo, cur.features, None, cur);
    }

    /// Ends a lease; returns it with its node id, or `None` if it is not
    /// live (never granted, released, expired or forgotten).
    pub fn release_lease(&self, id: u64) -> Option<Ended> {
        let node_id = self.leases.node_of(id)?;
        let node = self.get(&node_id)?;
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        // The agent's state as it is, before the lease leaves the writer.
        let cpus = base_cpus(&cur, &w);
        let lease = w.leases.leases.remove(&id)?;
        self.leases.lock().remove(&id);
        let topo = Arc::clone(&cur.topo);
        self.publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
        Some(Ended {
            node: node_id,
            lease,
        })
    }

    /// Extends a live lease to `ttl` (or its own ttl) from `now`; returns
    /// the lifetime it now has.
    pub fn renew_lease(&self, id: u64, ttl: Option<Duration>, now: Instant) -> Option<Duration> {
        let node = self.get(&self.leases.node_of(id)?)?;
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let l = w.leases.leases.get_mut(&id)?;
        if let Some(t) = ttl {
            l.ttl = t;
        }
        l.expires = now + l.ttl;
        Some(l.ttl)
    }

    /// Records the agent's confirmation of a lease.
    pub fn mark_lease_applied(&self, node: &Node, id: u64) {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = w.leases.leases.get_mut(&id) {
            l.applied = true;
        }
    }

    /// The node's live leases, by id.
    pub fn leases_of(&self, node: &Node) -> Vec<Lease> {
        let w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        w.leases.leases.values().cloned().collect()
    }

    /// Drops leases whose time ended; returns them. Visits only the nodes
    /// that hold leases.
    pub fn expire_leases(&self, now: Instant) -> Vec<Ended> {
        let mut nodes: Vec<String> = self.leases.lock().values().cloned().collect();
        nodes.sort();
        nodes.dedup();
        let mut ended = Vec::new();
        for id in nodes {
            let Some(node) = self.get(&id) else {
                continue;
            };
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            let gone: Vec<u64> = w
                .leases
                .leases
                .values()
                .filter(|l| l.expires <= now)
                .map(|l| l.id)
                .collect();
            if gone.is_empty() {
                continue;
            }
            let cur = node.snapshot();
            let cpus = base_cpus(&cur, &w);
            let mut index = self.leases.lock();
            for lid in gone {
                if let Some(lease) = w.leases.leases.remove(&lid) {
                    index.remove(&lid);
                    ended.push(Ended {
                        node: id.clone(),
                        lease,
                    });
                }
            }
            drop(index);
            let topo = Arc::clone(&cur.topo);
            self.publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
        }
        ended
    }

    /// A node leaving the store (forgotten, or re-registered with another
    /// topology): its leases end with it.
    pub(super) fn drop_leases(&self, w: &mut Writer) -> usize {
        let ids: Vec<u64> = w.leases.leases.keys().copied().collect();
        let mut index = self.leases.lock();
        for id in &ids {
            index.remove(id);
        }
        w.leases = NodeLeases::default();
        if !ids.is_empty() {
            metrics::counter!(crate::metrics::LEASES_ENDED, "how" => "forgotten")
                .increment(ids.len() as u64);
        }
        ids.len()
    }

    /// Leases outstanding and the CPUs they hold, across all nodes.
    pub fn leases_outstanding(&self) -> (usize, usize) {
        let mut nodes: Vec<String> = self.leases.lock().values().cloned().collect();
        nodes.sort();
        nodes.dedup();
        let (mut leases, mut cpus) = (0, 0);
        for id in nodes {
            if let Some(n) = self.get(&id) {
                let w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
                leases += w.leases.leases.len();
                cpus += w.leases.leased().weight();
            }
        }
        (leases, cpus)
    }
}
