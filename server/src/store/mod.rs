//! The state store: every node's latest state, as an immutable snapshot that
//! is swapped atomically, and the owners that change it.
//!
//! Readers (PickCpu, CanMigrate, the admin calls) load the current snapshot
//! with one atomic pointer read and decide on it without any lock, so a
//! decision never waits behind a writer and never sees half an update.
//! Writers (agent reports, claims, leases, feature changes, claim expiry)
//! serialise per node on a small mutex, build the next snapshot beside the
//! current one and publish it. Claims are written optimistically: decide on
//! snapshot v, then commit the claim only if v is still current, else
//! decide again.
//!
//! This file holds what every owner shares: a node as stored ([`Node`],
//! its [`Snapshot`] and its writer state) and the [`Table`] of nodes that
//! publishes their snapshots. The owners, each with its own state and
//! locks, and [`Store`], the thin composition the service holds:
//!
//! | owner | folder | what it owns |
//! |---|---|---|
//! | [`nodes::Nodes`] | `nodes/` | registration, reports, claims, staleness, lifecycle, feature overrides |
//! | [`leases::Leases`] | `leases/` | the lease component: table, phases, settling, recovery, the log |
//! | [`cluster::Cluster`] | `cluster/` | the cluster hierarchy's picks and passes, other replicas' nodes |
//! | [`passes::Passes`] | `passes/` | each node's kept balancer and cache-aware state |
//! | [`features::Switches`] | `features.rs` | the global feature switches |
//!
//! Leaves below them: `hierarchy` (the cluster's groups and their sums, kept
//! by the table on every publish), `report` (an agent's update and its
//! checks), `labels`. Data flows one way: the service calls an owner; an
//! owner changes a node under its writer and publishes through the
//! [`Table`]; `compose` builds the owners and hands each what it needs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dashmap::DashMap;

pub mod cluster;
mod compose;
pub mod features;
pub mod hierarchy;
pub mod labels;
pub mod leases;
pub mod nodes;
pub mod passes;
pub mod report;
pub mod tap;

pub use compose::Store;
pub use features::check_features;
pub use hierarchy::{ClusterChoice, ClusterConfig, ClusterRequest, LevelConfig, RemoteNode};
pub use labels::{LabelPolicy, check_labels};
pub use leases::log::{Commit, Epoch, LeaseLog, LeaseOp, LeaseRecord, LogError};
pub use leases::recovery::{Loaded, Reconciled};
pub use leases::{
    Change, DEFAULT_MAX_LEASES_PER_CALLER, Ended, Lease, LeaseRefusal, NewLease, OwnerLimits,
    Phase, Renewal, Target, Unallocatable, wall_ms,
};
pub use report::{CpuTaskList, Reject, RuntimeEntry, Update};
/// The limits of one update, for agents to cut their reports to.
pub use report::{
    MAX_MASKS_PER_NODE, MAX_RUNTIME_NS, MAX_RUNTIME_PER_CPU, MAX_TASKS_PER_CPU, MAX_TASKS_PER_NODE,
};

use crate::engine::balance::Balancer;
use crate::engine::cache::{CacheParams, CacheState, LlcMap};
use crate::engine::cpumask::CpuMask;
use crate::engine::decision::Kind;
use crate::engine::features::{Features, Kernel, System};
use crate::engine::group::NodeAgg;
use crate::engine::rq::TaskTable;
use crate::engine::state::{CpuState, MAX_CLOCK, NodeState};
use crate::engine::topology::{FieldError, Topology, TopologySpec};
use hierarchy::Hierarchy;

/// Tunables of the store.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// A node with no report for this long is stale: PickCpu refuses it.
    pub stale_after: Duration,
    /// How long a claim counts when no report supersedes it.
    pub claim_ttl: Duration,
    /// A stale node is forgotten after this long without a report.
    pub forget_after: Duration,
    pub system: System,
    pub cluster: ClusterConfig,
    /// Cache-aware scheduling knobs (`sched/llc_balancing/`).
    pub cache: CacheParams,
    /// Nodes held at most: a registration of a new node id beyond it is
    /// refused ([`nodes::RegisterError::Full`]); re-registrations still work.
    pub max_nodes: usize,
    /// Longest node id accepted, in bytes (253: a DNS name).
    pub max_node_id_bytes: usize,
    /// Leases and leased CPUs one caller may hold at once.
    pub lease_limits: OwnerLimits,
    /// The longest lifetime a grant or a renewal may ask for.
    pub max_lease_ttl: Duration,
    /// How long a released lease's tombstone is kept at least, on this
    /// process's own clock, whatever the wall clock says (`leases/`).
    pub tombstone_min_keep: Duration,
    /// Which labels placement uses ([`labels`]); by default every reported
    /// one (a store with no identities to distrust).
    pub label_policy: LabelPolicy,
}

impl Default for StoreConfig {
    fn default() -> Self {
        Self {
            stale_after: Duration::from_secs(10),
            claim_ttl: Duration::from_millis(500),
            forget_after: Duration::from_secs(600),
            system: System::default(),
            cluster: ClusterConfig::default(),
            cache: CacheParams::default(),
            max_nodes: DEFAULT_MAX_NODES,
            max_node_id_bytes: DEFAULT_MAX_NODE_ID_BYTES,
            lease_limits: OwnerLimits::default(),
            max_lease_ttl: DEFAULT_MAX_LEASE_TTL,
            tombstone_min_keep: Duration::from_secs(30),
            label_policy: LabelPolicy::trust_all(),
        }
    }
}

/// Default of [`StoreConfig::max_lease_ttl`]: a day (renew for longer).
pub const DEFAULT_MAX_LEASE_TTL: Duration = Duration::from_secs(86_400);
/// Default of [`StoreConfig::max_nodes`].
pub const DEFAULT_MAX_NODES: usize = 20_000;
/// Default of [`StoreConfig::max_node_id_bytes`]: the length of a DNS name.
pub const DEFAULT_MAX_NODE_ID_BYTES: usize = 253;

/// One immutable version of a node's state.
#[derive(Debug)]
pub struct Snapshot {
    pub version: u64,
    pub topo: Arc<Topology>,
    pub state: NodeState,
    /// The features in force for this node (global plus its overrides).
    pub features: Features,
    /// When the agent report behind this state was applied; `None` before the
    /// first full snapshot.
    pub reported_at: Option<Instant>,
    /// Claims outstanding per CPU, included in `state`.
    pub claims: Vec<(u32, u32)>,
    /// What the node contributes to its cluster groups.
    pub agg: NodeAgg,
    /// The runnable tasks the agent reported, per CPU.
    pub tasks: Arc<TaskTable>,
}

impl Snapshot {
    /// What the engine reads of this snapshot under `system`: the one way
    /// a decision, a check or a pass sees a node's reported state.
    pub fn view<'a>(
        &'a self,
        system: &'a crate::engine::features::System,
    ) -> crate::engine::View<'a> {
        crate::engine::View {
            topo: &self.topo,
            state: &self.state,
            features: &self.features,
            system,
        }
    }

    /// Time since the report behind this state; `None` if there was none.
    pub fn age(&self, now: Instant) -> Option<Duration> {
        self.reported_at.map(|t| now.saturating_duration_since(t))
    }
}

/// The claims outstanding on one CPU, and its state without them.
#[derive(Debug, Clone)]
struct ClaimSlot {
    base: CpuState,
    expires: Vec<Instant>,
}

/// What only writers touch, under the node's mutex. The agent's state is
/// the current snapshot's, with the claimed CPUs' saved in their slots: a
/// node keeps one copy of its CPUs.
#[derive(Debug)]
struct Writer {
    claims: HashMap<u32, ClaimSlot>,
    last_seq: u64,
    /// Deltas are refused until a full snapshot arrives.
    needs_full: bool,
    overrides: HashMap<String, bool>,
    /// The node's kernel profile (`Register.kernel_profile`).
    kernel: Kernel,
    /// The group path and aggregate this node adds to the cluster sums;
    /// `None` while it is not counted (no state yet, or stale).
    counted: Option<(Vec<String>, NodeAgg)>,
    /// The node's id is in the store's `claimed` set (it may have claims
    /// to expire).
    listed: bool,
    /// Leases on this node, counted in every snapshot.
    leases: leases::NodeLeases,
}

/// A registered node.
pub struct Node {
    pub id: String,
    /// The labels placement uses: the server's ([`LabelPolicy`]).
    pub labels: Vec<(String, String)>,
    /// What the node's agent reported.
    pub reported_labels: Vec<(String, String)>,
    pub agent_version: String,
    /// Where the agent reads its signals (`pb::SignalSource` as i32; 0 =
    /// not said), set by the agent service after each registration.
    pub signal_source: std::sync::atomic::AtomicI32,
    pub spec: Arc<TopologySpec>,
    snap: ArcSwap<Snapshot>,
    writer: Mutex<Writer>,
    /// The registration (stream) that may write; a newer one supersedes it.
    pub generation: AtomicU64,
    pub connected: AtomicBool,
    /// Its agent registered and has not yet heard which of the leases it
    /// holds are over: it grants no lease meanwhile.
    pub reconciling: AtomicBool,
    pub registered_at: Instant,
    /// Cache-aware accounting, made at the first runtime report; only agent
    /// reports and balance passes touch it.
    cache: Mutex<Option<Box<NodeCache>>>,
    /// The balancer's per-domain state and scratch; one pass at a time.
    balancer: Mutex<Option<Box<Balancer>>>,
    /// Placement decisions made on this node, by request kind (wakeup,
    /// fork, exec): `fairplace_node_decisions_total`, rendered at scrape
    /// time so the series go with the node.
    decisions: [AtomicU64; Kind::ALL.len()],
}

/// A node's cache-aware state and the LLC map it was built for.
#[derive(Debug)]
struct NodeCache {
    state: CacheState,
    llc: LlcMap,
}

impl Node {
    /// The current snapshot: one atomic load, no lock.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snap.load_full()
    }

    /// Holds the node's balancer, as a running pass does (for tests).
    #[doc(hidden)]
    pub fn hold_balancer_for_test(&self) -> impl Drop + '_ {
        self.balancer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts one placement decision made on this node.
    pub fn count_decision(&self, kind: Kind) {
        self.decisions[kind as usize].fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions made on this node so far, by request kind.
    pub fn decisions(&self) -> [(Kind, u64); 3] {
        Kind::ALL.map(|k| (k, self.decisions[k as usize].load(Ordering::Relaxed)))
    }

    pub fn last_seq(&self) -> u64 {
        self.writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_seq
    }
}

/// What a published snapshot carries beside its CPU states: the reported
/// tasks, and the core cookies when a report changed them (`None` keeps the
/// current ones).
struct Carried {
    pub tasks: Arc<TaskTable>,
    pub core_cookies: Option<Vec<u64>>,
}

/// Built domain trees by (machine type, online CPUs).
type TopoCache = HashMap<(Arc<TopologySpec>, CpuMask), Weak<Topology>>;

/// Every registered node, and what publishing a node's snapshot takes:
/// the shared domain trees and task tables, the cluster sums it keeps in
/// step, the store's clock. Every owner reads nodes here; only
/// [`nodes::Nodes`] adds and removes them.
pub struct Table {
    /// Looked up on every decision: hashed with foldhash (seeded per
    /// store, so ids cannot be chosen to collide in advance), a few
    /// instructions for an id where SipHash takes a hundred and more.
    nodes: DashMap<String, Arc<Node>, foldhash::fast::RandomState>,
    /// Nodes of the same machine type share one built domain tree.
    topo_cache: Mutex<TopoCache>,
    specs: Mutex<HashMap<TopologySpec, Weak<TopologySpec>>>,
    /// One empty task table per CPU count, shared by every node without tasks.
    empty_tasks: Mutex<HashMap<usize, Arc<TaskTable>>>,
    /// Zones, racks and nodes, with incrementally kept group sums.
    hierarchy: Arc<Hierarchy>,
    /// The origin of the millisecond clock of balancing and cache epochs.
    epoch: Instant,
    stale_after: Duration,
    node_reclaim_distance: u32,
    /// Told of every snapshot published (a recorder, when one runs).
    tap: Arc<tap::TapSlot>,
}

impl Table {
    fn new(config: &StoreConfig, hierarchy: Arc<Hierarchy>, tap: Arc<tap::TapSlot>) -> Self {
        Self {
            nodes: DashMap::default(),
            topo_cache: Mutex::new(HashMap::new()),
            specs: Mutex::new(HashMap::new()),
            empty_tasks: Mutex::new(HashMap::new()),
            hierarchy,
            epoch: Instant::now(),
            stale_after: config.stale_after,
            node_reclaim_distance: config.system.node_reclaim_distance,
            tap,
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Node>> {
        self.nodes.get(id).map(|n| Arc::clone(n.value()))
    }

    /// Every node, in no particular order (cheaper than [`Table::nodes`]).
    pub fn unsorted_nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.iter().map(|n| Arc::clone(n.value())).collect()
    }

    /// Every node, by id.
    pub fn nodes(&self) -> Vec<Arc<Node>> {
        let mut v = self.unsorted_nodes();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Whether `snap` reports a state newer than `stale_after`.
    pub fn is_fresh(&self, snap: &Snapshot, now: Instant) -> bool {
        snap.age(now).is_some_and(|a| a <= self.stale_after)
    }

    /// The store's millisecond clock.
    pub fn now_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// The `idle_stamp` the store gives a CPU first reported idle at `now`
    /// (see [`report::fill_idle_stamp`]): ns since the store started,
    /// never 0.
    fn idle_stamp_at(&self, now: Instant) -> i64 {
        let ns = now.saturating_duration_since(self.epoch).as_nanos();
        ns.clamp(1, MAX_CLOCK as u128) as i64
    }

    /// The one shared copy of `spec`.
    fn intern_spec(&self, spec: TopologySpec) -> Arc<TopologySpec> {
        let mut specs = self.specs.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = specs.get(&spec).and_then(Weak::upgrade) {
            return s;
        }
        specs.retain(|_, w| w.strong_count() > 0);
        let s = Arc::new(spec.clone());
        specs.insert(spec, Arc::downgrade(&s));
        s
    }

    /// The domain tree of `spec` with these CPUs online, shared by every
    /// node of the same machine type.
    fn topology(
        &self,
        spec: &Arc<TopologySpec>,
        online: &CpuMask,
    ) -> Result<Arc<Topology>, FieldError> {
        let key = (Arc::clone(spec), *online);
        let cached = |cache: &TopoCache| cache.get(&key).and_then(Weak::upgrade);
        if let Some(t) = cached(
            &self
                .topo_cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        ) {
            return Ok(t);
        }
        // Built without the lock: a slow build of one machine type must not
        // hold up registrations of others. Two racing builds of the same
        // type both build; the first one stored is shared.
        let t = Arc::new(Topology::build(spec, online, self.node_reclaim_distance)?);
        let mut cache = self
            .topo_cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(t) = cached(&cache) {
            return Ok(t);
        }
        cache.retain(|_, w| w.strong_count() > 0);
        cache.insert(key, Arc::downgrade(&t));
        Ok(t)
    }

    /// The shared empty task table of `n` CPUs.
    fn empty_tasks(&self, n: usize) -> Arc<TaskTable> {
        let mut m = self
            .empty_tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(m.entry(n).or_insert_with(|| Arc::new(TaskTable::empty(n))))
    }

    /// Moves the node's contribution to the cluster sums from what it was
    /// to `now` (`None`: not counted).
    fn recount(&self, node: &Node, w: &mut Writer, now: Option<NodeAgg>) {
        if let Some((path, old)) = w.counted.take() {
            self.hierarchy.contribute(&path, &node.id, &old, -1);
        }
        if let Some(a) = now {
            let path = self.hierarchy.path(&node.labels);
            self.hierarchy.contribute(&path, &node.id, &a, 1);
            w.counted = Some((path, a));
        }
    }

    /// Publishes the next snapshot from the agent's state under the
    /// writer's claims and leases, with the snapshot's own topology and
    /// `features`; the tasks stay.
    fn republish(&self, node: &Node, w: &mut Writer, cur: &Snapshot, features: Features) -> u64 {
        let cpus = base_cpus(cur, w);
        let topo = Arc::clone(&cur.topo);
        self.publish(node, w, cpus, topo, features, None, cur)
    }

    /// Builds and publishes the next snapshot: the agent's state of every
    /// CPU (`cpus`) with the writer's claims on top; the tasks stay.
    #[allow(clippy::too_many_arguments)]
    fn publish(
        &self,
        node: &Node,
        w: &mut Writer,
        cpus: Vec<CpuState>,
        topo: Arc<Topology>,
        features: Features,
        reported_at: Option<Instant>,
        cur: &Snapshot,
    ) -> u64 {
        let carried = Carried {
            tasks: Arc::clone(&cur.tasks),
            core_cookies: None,
        };
        self.publish_with(node, w, cpus, topo, features, reported_at, cur, carried)
    }

    #[allow(clippy::too_many_arguments)]
    fn publish_with(
        &self,
        node: &Node,
        w: &mut Writer,
        mut cpus: Vec<CpuState>,
        topo: Arc<Topology>,
        features: Features,
        reported_at: Option<Instant>,
        cur: &Snapshot,
        carried: Carried,
    ) -> u64 {
        w.leases.count_in(&mut cpus);
        let mut claims: Vec<(u32, u32)> = Vec::with_capacity(w.claims.len());
        for (&cpu, slot) in &w.claims {
            let c = &mut cpus[cpu as usize];
            let k = slot.expires.len() as u32;
            c.nr_running = c.nr_running.saturating_add(k);
            c.cfs_h_nr_queued = c.cfs_h_nr_queued.saturating_add(k);
            c.curr_is_idle = false;
            claims.push((cpu, k));
        }
        claims.sort_unstable();
        let same = Arc::ptr_eq(&topo, &cur.topo);
        let mut state = NodeState::next(&topo, &cur.state, same, cpus, &[], &features);
        if let Some(cookies) = carried.core_cookies {
            state.set_core_cookies(&topo, cookies);
        }
        let tasks = carried.tasks;
        let version = cur.version + 1;
        let agg = NodeAgg::of(&topo, &state, features.util_est);
        let snap = Snapshot {
            version,
            topo,
            state,
            features,
            reported_at: reported_at.or(cur.reported_at),
            claims,
            agg,
            tasks,
        };
        let fresh = self.is_fresh(&snap, Instant::now());
        self.recount(node, w, fresh.then_some(agg));
        let snap = Arc::new(snap);
        // Before the store: a reader's decision on this version reaches the
        // tap after the version itself.
        self.tap.published(node, &snap, reported_at.is_some());
        node.snap.store(snap);
        version
    }
}

/// The agent's state of every CPU: the snapshot's, with claimed CPUs taken
/// back to what they were before their claims and leased ones to what
/// they were before their leases.
fn base_cpus(cur: &Snapshot, w: &Writer) -> Vec<CpuState> {
    let mut cpus = cur.state.cpus.clone();
    for (&cpu, slot) in &w.claims {
        cpus[cpu as usize] = slot.base;
    }
    w.leases.restore(&mut cpus);
    cpus
}
