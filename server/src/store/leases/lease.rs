//! A lease as the component keeps it: where it is applied, its phase, the
//! record the log holds of it, and a node's leases under the node's writer
//! (each leased CPU's agent state kept beside, so a snapshot is always the
//! agent's state plus claims plus leases).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::log::{LeaseRecord, unix_ms_now};
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

/// Where a lease is in its life (module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Decided, its commit not acknowledged: CPUs held, invisible.
    Pending,
    /// Committed.
    Live,
    /// Its end (release, expiry, a failed apply) submitted and not
    /// acknowledged: CPUs still held, shown as it was.
    Ending,
}

/// One lease the store holds.
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
    /// When it was granted, wall-clock ms (shown; no decision judges it).
    pub granted_at_ms: u64,
    pub target: Option<Target>,
    /// The agent confirmed it applied the lease.
    pub applied: bool,
    /// The caller's idempotency key (empty: none).
    pub request_id: String,
    pub phase: Phase,
    /// A change is being committed, or its outcome is being settled.
    pub busy: bool,
    /// Its grant was committed (it may be shown; a grant settled back,
    /// ending without ever being acknowledged, never is).
    pub committed: bool,
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
            request_id: self.request_id.clone(),
        }
    }

    /// Whether callers and agents may see it: its grant was committed.
    pub fn visible(&self) -> bool {
        self.committed
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
            request_id: r.request_id.clone(),
            phase: Phase::Live,
            busy: false,
            committed: true,
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
    /// The caller's idempotency key (empty: none).
    pub request_id: String,
}

/// A node's leases, under its writer mutex.
#[derive(Debug, Default)]
pub(in crate::store) struct NodeLeases {
    pub(in crate::store) leases: BTreeMap<u64, Lease>,
    /// Each leased CPU's agent state without its lease.
    base: HashMap<u32, CpuState>,
    /// The node left the store (forgotten, or replaced by a registration
    /// with another topology) and its leases were parked: this object
    /// takes no lease any more, or a caller still holding it would grant
    /// a parked lease's CPU again, into a node nobody reads.
    pub(in crate::store) retired: bool,
}

impl NodeLeases {
    /// The leases of a node that left the store: none, and none taken.
    pub(in crate::store) fn retired() -> Self {
        Self {
            retired: true,
            ..Self::default()
        }
    }

    /// The CPUs held by any lease.
    pub(in crate::store) fn leased(&self) -> CpuMask {
        let mut m = CpuMask::new();
        for l in self.leases.values() {
            m.or_assign(&l.cpus);
        }
        m
    }

    /// Puts the leased CPUs back to their agent state (after the claims'
    /// restore: a claim taken on a leased CPU saved the leased state).
    pub(in crate::store) fn restore(&self, cpus: &mut [CpuState]) {
        for (&cpu, c) in &self.base {
            cpus[cpu as usize] = *c;
        }
    }

    /// The agent state of `cpu` without the lease on it, if it has one.
    pub(in crate::store) fn base_of(&self, cpu: u32) -> Option<CpuState> {
        self.base.get(&cpu).copied()
    }

    /// Counts every lease in `cpus` (agent states): each leased CPU runs
    /// one more task, as a claim counts it. Saves the states it changes.
    pub(in crate::store) fn count_in(&mut self, cpus: &mut [CpuState]) {
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
