//! The lease index: every live lease's node, owner and request id, what
//! each owner holds against its limits, the leases of nodes not registered
//! now (parked), the tombstones of leases that ended early, and each
//! node's ownership epoch. One lock per map; a grant's limit check and its
//! id's reservation are one step.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::lease::{Lease, NewLease};
use super::log::{Epoch, unix_ms_now};

pub(super) type Parked = HashMap<String, BTreeMap<u64, Lease>>;

/// The store's lease index: id -> node, and the leases of nodes that are
/// not registered now. Lock order: a node's writer, then `parked`, then
/// `by_id`.
#[derive(Debug, Default)]
pub struct LeaseIndex {
    pub(super) by_id: Mutex<Index>,
    pub(super) parked: Mutex<Parked>,
    /// Leases that ended early, until the expiry they had: an agent that
    /// missed the end reports them again, and they are not adopted; a
    /// grant's first write landing late finds its tombstone and fails.
    pub(super) ended: Mutex<HashMap<u64, Tomb>>,
    /// When the tombstones were last pruned (wall-clock ms).
    pub(super) pruned_at_ms: std::sync::atomic::AtomicU64,
    /// Node -> the ownership period its leases were loaded in (replicas):
    /// every commit of the node's leases is fenced on it.
    pub(super) epochs: Mutex<HashMap<String, Epoch>>,
}

/// A tombstone: until when (wall-clock ms) it is kept, and since when it
/// is known here (this process's clock).
#[derive(Debug, Clone, Copy)]
pub(super) struct Tomb {
    pub(super) until_ms: u64,
    pub(super) since: Instant,
}

/// Every live lease's node and owner, and what each owner holds: one
/// lock, so a grant's check of its owner's limits and its reservation are
/// one step.
#[derive(Debug, Default)]
pub(super) struct Index {
    pub(super) ids: HashMap<u64, Indexed>,
    pub(super) owners: HashMap<String, Held>,
    /// Owner -> its request ids -> the lease granted for each (two levels,
    /// so a lookup by `&str` allocates nothing).
    pub(super) requests: HashMap<String, HashMap<String, u64>>,
}

#[derive(Debug)]
pub(super) struct Indexed {
    pub(super) node: String,
    pub(super) owner: String,
    pub(super) cpus: usize,
    pub(super) request_id: String,
}

/// Leases and CPUs one owner holds.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Held {
    pub(super) leases: usize,
    pub(super) cpus: usize,
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

    /// Records lease `id` of `node`, held by `owner` on `cpus` CPUs, taken
    /// for `request_id` (empty: none).
    pub(super) fn add(&mut self, id: u64, node: &str, owner: &str, cpus: usize, request_id: &str) {
        let new = Indexed {
            node: node.to_string(),
            owner: owner.to_string(),
            cpus,
            request_id: request_id.to_string(),
        };
        if let Some(old) = self.ids.remove(&id) {
            self.forget_use(id, &old);
        }
        let held = self.owners.entry(owner.to_string()).or_default();
        held.leases += 1;
        held.cpus += cpus;
        if !request_id.is_empty() {
            self.requests
                .entry(owner.to_string())
                .or_default()
                .insert(request_id.to_string(), id);
        }
        self.ids.insert(id, new);
    }

    /// The lease granted to `owner` for `request_id`, if it is held.
    pub(super) fn by_request(&self, owner: &str, request_id: &str) -> Option<u64> {
        self.requests.get(owner)?.get(request_id).copied()
    }

    /// Forgets lease `id`; returns whether it was there.
    pub(super) fn remove(&mut self, id: u64) -> bool {
        match self.ids.remove(&id) {
            Some(old) => {
                self.forget_use(id, &old);
                true
            }
            None => false,
        }
    }

    pub(super) fn forget_use(&mut self, id: u64, l: &Indexed) {
        if !l.request_id.is_empty()
            && let Some(ids) = self.requests.get_mut(&l.owner)
        {
            if ids.get(&l.request_id) == Some(&id) {
                ids.remove(&l.request_id);
            }
            if ids.is_empty() {
                self.requests.remove(&l.owner);
            }
        }
        if let Some(h) = self.owners.get_mut(&l.owner) {
            h.leases = h.leases.saturating_sub(1);
            h.cpus = h.cpus.saturating_sub(l.cpus);
            if h.leases == 0 {
                self.owners.remove(&l.owner);
            }
        }
    }

    /// Why `owner` may not take one more lease of `cpus` CPUs, if so.
    pub(super) fn over_limit(&self, owner: &str, cpus: usize, lim: OwnerLimits) -> Option<String> {
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
    pub(super) fn node_of(&self, id: u64) -> Option<String> {
        self.lock().ids.get(&id).map(|l| l.node.clone())
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Index> {
        self.by_id.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn parked(&self) -> MutexGuard<'_, Parked> {
        self.parked.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn ended(&self) -> MutexGuard<'_, HashMap<u64, Tomb>> {
        self.ended.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A new id for a lease of `owner` on `cpus` CPUs of `node`: 64 random
    /// bits, never 0, never one that is live, reserved in the index before
    /// it is returned; or why the owner may not take it, or the lease
    /// already granted for its `request_id` (checked in the same step, so
    /// two concurrent calls with one request id take one lease).
    pub(super) fn reserve(
        &self,
        node: &str,
        new: &NewLease,
        lim: OwnerLimits,
    ) -> Result<u64, Unallocatable> {
        let mut index = self.lock();
        if !new.request_id.is_empty()
            && let Some(id) = index.by_request(&new.owner, &new.request_id)
        {
            return Err(Unallocatable::Requested(id));
        }
        let cpus = new.cpus.weight();
        if let Some(why) = index.over_limit(&new.owner, cpus, lim) {
            return Err(Unallocatable::CallerLimit(why));
        }
        loop {
            let id = random_u64();
            if id != 0 && !index.contains(id) {
                index.add(id, node, &new.owner, cpus, &new.request_id);
                return Ok(id);
            }
        }
    }

    /// The ownership period `node`'s leases were loaded in (0: none).
    pub(super) fn epoch(&self, node: &str) -> Epoch {
        self.epochs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(node)
            .copied()
            .unwrap_or(0)
    }

    pub(super) fn set_epoch(&self, node: &str, epoch: Option<Epoch>) {
        let mut e = self.epochs.lock().unwrap_or_else(PoisonError::into_inner);
        match epoch {
            Some(x) => e.insert(node.to_string(), x),
            None => e.remove(node),
        };
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
    /// The node's agent is registering and has not yet heard which of its
    /// leases are over: the caller may retry.
    Registering,
    /// The caller holds as many leases or CPUs as it may; why.
    CallerLimit(String),
    /// The caller's request id already has this lease: a retry, answered
    /// with the first grant.
    Requested(u64),
}
