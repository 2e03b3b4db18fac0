//! The state store: every node's latest state, as an immutable snapshot that
//! is swapped atomically.
//!
//! Readers (PickCpu, CanMigrate, the admin calls) load the current snapshot
//! with one atomic pointer read and decide on it without any lock, so a
//! decision never waits behind a writer and never sees half an update.
//! Writers (agent reports, claims, feature changes, claim expiry) serialise
//! per node on a small mutex, build the next snapshot beside the current one
//! and publish it. Claims are written optimistically: decide on snapshot v,
//! then commit the claim only if v is still current, else decide again.
//!
//! This file holds the types and publication; each kind of mutation has its
//! own file: `ingest` (registration and agent updates), `claims`,
//! `lifecycle` (freshness, forgetting nodes), `leases/` (the lease
//! component: their table and phases, their durable log in `log/`, the
//! settling of every change to a known outcome in `settle`, and their
//! recovery after a restart or a take-over in `recovery`), `features`, `tasks` (task lists
//! and runtime reports), `balance` (the node balancer's kept state around
//! an engine pass), `cache` (the cache-aware accounting), `cluster_pick` and
//! `cluster_pass` (the cluster hierarchy's placement and balance passes).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dashmap::DashMap;

mod balance;
mod cache;
mod claims;
pub mod cluster;
mod features;
mod ingest;
pub mod labels;
pub mod leases;
mod lifecycle;
pub mod remote;
mod tasks;

pub use balance::{BalanceOutcome, BalanceRequest};
pub use cache::{CacheSummary, ProcSummary};
pub use cluster::pass::{ClusterBalanceRequest, PeerMembers};
pub use features::check_features;
pub use ingest::check_labels;
pub use labels::LabelPolicy;
pub use leases::log::{Commit, Epoch, LeaseLog, LeaseOp, LeaseRecord, LogError};
pub use leases::recovery::{Loaded, Reconciled};
pub use leases::{
    Change, DEFAULT_MAX_LEASES_PER_CALLER, Ended, Lease, LeaseRefusal, NewLease, OwnerLimits,
    Phase, Renewal, Target, Unallocatable, wall_ms,
};
pub use tasks::{CpuTaskList, RuntimeEntry};
/// The limits of one update, for agents to cut their reports to.
pub use tasks::{
    MAX_MASKS_PER_NODE, MAX_RUNTIME_NS, MAX_RUNTIME_PER_CPU, MAX_TASKS_PER_CPU, MAX_TASKS_PER_NODE,
};

use crate::engine::balance::Balancer;
use crate::engine::cache::{CacheParams, CacheState, LlcMap};
use crate::engine::cpumask::CpuMask;
use crate::engine::decision::Kind;
use crate::engine::features::{Features, Kernel, System};
use crate::engine::group::NodeAgg;
use crate::engine::rq::TaskTable;
use crate::engine::state::{CpuState, NodeState};
use crate::engine::topology::{FieldError, Topology, TopologySpec};
use cluster::{Cluster, ClusterConfig};

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
    /// refused ([`RegisterError::Full`]); re-registrations still work.
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

/// Why a registration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegisterError {
    /// A bad node id or topology (INVALID_ARGUMENT).
    Invalid(FieldError),
    /// A new node id while the store holds `max` nodes (RESOURCE_EXHAUSTED).
    Full { max: usize },
}

impl RegisterError {
    /// The `fairplace_agent_reports_rejected_total` reason.
    pub fn reason(&self) -> &'static str {
        match self {
            RegisterError::Invalid(_) => "invalid",
            RegisterError::Full { .. } => "too_many_nodes",
        }
    }
}

impl From<FieldError> for RegisterError {
    fn from(e: FieldError) -> Self {
        RegisterError::Invalid(e)
    }
}

impl std::fmt::Display for RegisterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegisterError::Invalid(e) => write!(f, "{e}"),
            RegisterError::Full { max } => write!(
                f,
                "register.node_id: the server holds its limit of {max} nodes (--max-nodes); \
                 a new node is refused until one is forgotten"
            ),
        }
    }
}

impl std::error::Error for RegisterError {}

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

/// Why an update was refused; the stored state is unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// A delta whose sequence does not follow the last applied one, or a delta
    /// before the first full snapshot.
    OutOfSequence {
        expected: u64,
        got: u64,
    },
    Invalid(FieldError),
    /// Another registration took over this node, or it was forgotten.
    Superseded,
    /// The server had no room to do the work now (the heavy pool is full).
    Busy(String),
}

impl Reject {
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::OutOfSequence { .. } => "out_of_sequence",
            Reject::Invalid(_) => "invalid",
            Reject::Superseded => "superseded",
            Reject::Busy(_) => "busy",
        }
    }
}

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reject::OutOfSequence { expected, got } => write!(
                f,
                "update.seq: {got} does not follow the last applied sequence (expected {expected}, or a full snapshot)"
            ),
            Reject::Invalid(e) => write!(f, "{e}"),
            Reject::Superseded => f.write_str("node_id: a newer registration took over this node"),
            Reject::Busy(m) => write!(f, "{m}"),
        }
    }
}

/// An update from an agent: complete states of some or all CPUs, their
/// task lists, and runtime per process.
#[derive(Debug, Clone, Default)]
pub struct Update {
    pub seq: u64,
    pub full: bool,
    pub cpus: Vec<(u32, CpuState)>,
    /// The core cookie of each CPU of `cpus`, in the same order; empty when
    /// all are 0 (then every listed CPU's cookie is 0).
    pub core_cookies: Vec<u64>,
    /// Each list replaces its CPU's; with `full`, unlisted CPUs have none.
    pub tasks: Vec<CpuTaskList>,
    pub runtime: Vec<RuntimeEntry>,
}

/// What a published snapshot carries beside its CPU states: the reported
/// tasks, and the core cookies when a report changed them (`None` keeps the
/// current ones).
pub(super) struct Carried {
    pub tasks: Arc<TaskTable>,
    pub core_cookies: Option<Vec<u64>>,
}

/// Built domain trees by (machine type, online CPUs).
type TopoCache = HashMap<(Arc<TopologySpec>, CpuMask), Weak<Topology>>;

/// Every node's state.
pub struct Store {
    /// Looked up on every decision: hashed with foldhash (seeded per
    /// store, so ids cannot be chosen to collide in advance), a few
    /// instructions for an id where SipHash takes a hundred and more.
    nodes: DashMap<String, Arc<Node>, foldhash::fast::RandomState>,
    /// Held while a new node id is checked against `max_nodes` and inserted.
    admit: Mutex<()>,
    /// Ids of the nodes that may hold claims: claim expiry visits only
    /// these, so an idle store does no per-node work for it.
    claimed: Mutex<std::collections::HashSet<String>>,
    /// Nodes of the same machine type share one built domain tree.
    topo_cache: Mutex<TopoCache>,
    specs: Mutex<HashMap<TopologySpec, Weak<TopologySpec>>>,
    global: ArcSwap<Features>,
    /// Serialises changes of the global features (read, modify, store).
    global_lock: Mutex<()>,
    next_generation: AtomicU64,
    pub config: StoreConfig,
    /// Zones, racks and nodes, with incrementally kept group sums.
    pub cluster: Cluster,
    /// The origin of the millisecond clock of balancing and cache epochs.
    epoch: Instant,
    /// `nr_balance_failed` of the cluster levels, by (destination node, level).
    cluster_lb: Mutex<HashMap<(String, String), u32>>,
    /// One empty task table per CPU count, shared by every node without tasks.
    empty_tasks: Mutex<HashMap<usize, Arc<TaskTable>>>,
    /// Lease id -> node id, and the leases of nodes not registered now.
    leases: leases::LeaseIndex,
    /// The durable copy of the leases.
    log: Arc<dyn LeaseLog>,
    /// Other replicas' nodes, counted in `cluster` for cluster decisions.
    remote: remote::RemoteNodes,
}

impl Store {
    /// A store whose leases live in memory only.
    pub fn new(config: StoreConfig) -> Self {
        Self::with_log(config, Arc::new(leases::log::MemoryLog))
    }

    /// A store whose leases are committed to `log` (load them with
    /// [`Store::load_leases`] before serving).
    pub fn with_log(config: StoreConfig, log: Arc<dyn LeaseLog>) -> Self {
        Self {
            nodes: DashMap::default(),
            admit: Mutex::new(()),
            claimed: Mutex::new(Default::default()),
            topo_cache: Mutex::new(HashMap::new()),
            specs: Mutex::new(HashMap::new()),
            global: ArcSwap::from_pointee(Features::default()),
            global_lock: Mutex::new(()),
            next_generation: AtomicU64::new(1),
            cluster: Cluster::new(config.cluster.clone()),
            config,
            epoch: Instant::now(),
            cluster_lb: Mutex::new(HashMap::new()),
            empty_tasks: Mutex::new(HashMap::new()),
            leases: leases::LeaseIndex::default(),
            log,
            remote: Default::default(),
        }
    }

    /// Where leases are kept, for the start-up log line.
    pub fn lease_log(&self) -> String {
        self.log.describe()
    }

    pub fn get(&self, id: &str) -> Option<Arc<Node>> {
        self.nodes.get(id).map(|n| Arc::clone(n.value()))
    }

    /// Every node, in no particular order (cheaper than [`Store::nodes`]).
    pub fn unsorted_nodes(&self) -> Vec<Arc<Node>> {
        self.nodes.iter().map(|n| Arc::clone(n.value())).collect()
    }

    pub fn nodes(&self) -> Vec<Arc<Node>> {
        let mut v: Vec<Arc<Node>> = self.nodes.iter().map(|n| Arc::clone(n.value())).collect();
        v.sort_by(|a, b| a.id.cmp(&b.id));
        v
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
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
        node.snap.store(Arc::new(snap));
        version
    }

    /// The store's millisecond clock.
    pub fn now_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::topology::CpuTopo;

    fn spec(n: u32) -> TopologySpec {
        TopologySpec {
            cpus: (0..n)
                .map(|i| CpuTopo {
                    core: i / 2,
                    cluster: None,
                    llc: 0,
                    node: 0,
                    capacity: 1024,
                })
                .collect(),
            numa_distance: None,
        }
    }

    fn full(n: u32, seq: u64, busy: &[u32]) -> Update {
        Update {
            seq,
            full: true,
            cpus: (0..n)
                .map(|i| {
                    let mut c = CpuState::idle(1024);
                    if busy.contains(&i) {
                        c.nr_running = 1;
                        c.curr_is_idle = false;
                    }
                    (i, c)
                })
                .collect(),
            ..Update::default()
        }
    }

    #[test]
    fn deltas_must_follow_a_full_snapshot_in_sequence() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        let delta = |seq| Update {
            seq,
            full: false,
            cpus: vec![(1, CpuState::idle(1024))],
            ..Update::default()
        };
        assert!(matches!(
            s.apply(&n, g, &delta(1), now),
            Err(Reject::OutOfSequence { .. })
        ));
        assert_eq!(s.apply(&n, g, &full(4, 7, &[0]), now), Ok(2));
        assert!(matches!(
            s.apply(&n, g, &delta(9), now),
            Err(Reject::OutOfSequence {
                expected: 8,
                got: 9
            })
        ));
        assert!(s.apply(&n, g, &delta(8), now).is_ok());
        assert_eq!(n.last_seq(), 8);
    }

    #[test]
    fn a_rejected_update_leaves_the_state_unchanged() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        s.apply(&n, g, &full(4, 1, &[2]), now).unwrap();
        let before = n.snapshot();
        let mut bad = CpuState::idle(1024);
        bad.h_nr_idle = 3;
        let u = Update {
            seq: 2,
            full: false,
            cpus: vec![(0, CpuState::idle(1024)), (3, bad)],
            ..Update::default()
        };
        match s.apply(&n, g, &u, now) {
            Err(Reject::Invalid(e)) => assert_eq!(e.field, "update.cpus[1].h_nr_idle"),
            other => panic!("{other:?}"),
        }
        let after = n.snapshot();
        assert_eq!(before.version, after.version);
        assert_eq!(before.state.cpus, after.state.cpus);
        // A full snapshot that misses a CPU is refused too.
        let mut u = full(4, 2, &[]);
        u.cpus.pop();
        assert!(matches!(s.apply(&n, g, &u, now), Err(Reject::Invalid(_))));
        assert_eq!(n.last_seq(), 1);
    }

    #[test]
    fn claims_count_until_a_report_or_the_ttl() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        s.apply(&n, g, &full(4, 1, &[]), now).unwrap();
        let v = n.snapshot().version;
        assert!(s.try_claim(&n, v, 2, now));
        assert!(
            !s.try_claim(&n, v, 3, now),
            "a stale version must decide again"
        );
        let snap = n.snapshot();
        assert_eq!(snap.state.cpus[2].nr_running, 1);
        assert!(!snap.state.cpus[2].idle_cpu());
        assert_eq!(snap.claims, vec![(2, 1)]);
        // A report of another CPU keeps the claim; a report of CPU 2 ends it.
        s.apply(
            &n,
            g,
            &Update {
                seq: 2,
                full: false,
                cpus: vec![(1, CpuState::idle(1024))],
                ..Update::default()
            },
            now,
        )
        .unwrap();
        assert_eq!(n.snapshot().state.cpus[2].nr_running, 1);
        s.apply(
            &n,
            g,
            &Update {
                seq: 3,
                full: false,
                cpus: vec![(2, CpuState::idle(1024))],
                ..Update::default()
            },
            now,
        )
        .unwrap();
        assert_eq!(n.snapshot().state.cpus[2].nr_running, 0);
        // Expiry.
        let v = n.snapshot().version;
        assert!(s.try_claim(&n, v, 0, now));
        assert_eq!(s.expire_claims(now), 0);
        assert_eq!(s.expire_claims(now + Duration::from_secs(1)), 1);
        assert!(n.snapshot().state.cpus[0].idle_cpu());
    }

    #[test]
    fn a_claim_decided_under_the_writer_counts_like_an_optimistic_one() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        s.apply(&n, g, &full(4, 1, &[]), now).unwrap();
        let seen = s.claim_locked(&n, now, |cur| (cur.version, Some(3)));
        let snap = n.snapshot();
        assert_eq!(snap.version, seen + 1);
        assert_eq!(snap.claims, vec![(3, 1)]);
        assert!(!snap.state.cpus[3].idle_cpu());
        // Claiming nothing publishes nothing.
        s.claim_locked(&n, now, |_| ((), None));
        assert_eq!(n.snapshot().version, snap.version);
    }

    #[test]
    fn nodes_of_one_machine_type_share_the_domain_tree() {
        let s = Store::new(StoreConfig::default());
        let (a, _) = s.register("a", vec![], "t".into(), spec(8)).unwrap();
        let (b, _) = s.register("b", vec![], "t".into(), spec(8)).unwrap();
        assert!(Arc::ptr_eq(&a.snapshot().topo, &b.snapshot().topo));
    }

    #[test]
    fn a_new_registration_supersedes_the_old_stream() {
        let s = Store::new(StoreConfig::default());
        let (n, g1) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let (_, g2) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        assert_eq!(
            s.apply(&n, g1, &full(4, 1, &[]), now),
            Err(Reject::Superseded)
        );
        assert!(s.apply(&n, g2, &full(4, 1, &[]), now).is_ok());
    }

    #[test]
    fn new_ids_beyond_max_nodes_are_refused_but_re_registration_works() {
        let s = Store::new(StoreConfig {
            max_nodes: 2,
            ..StoreConfig::default()
        });
        s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let (b, _) = s.register("b", vec![], "t".into(), spec(4)).unwrap();
        b.count_decision(Kind::Fork);
        let full_err = s
            .register("c", vec![], "t".into(), spec(4))
            .err()
            .expect("refused");
        assert_eq!(full_err, RegisterError::Full { max: 2 });
        assert_eq!(full_err.reason(), "too_many_nodes");
        assert!(full_err.to_string().contains("--max-nodes"), "{full_err}");
        // The same topology, and a new one: both are the same node id.
        s.register("a", vec![], "t".into(), spec(4)).unwrap();
        let (b2, _) = s.register("b", vec![], "t".into(), spec(8)).unwrap();
        assert_eq!(b2.decisions()[1], (Kind::Fork, 1), "counts carry over");
        assert_eq!(s.len(), 2);
        // A forgotten node makes room.
        s.forget_stale(Instant::now() + Duration::from_secs(3600));
        s.register("c", vec![], "t".into(), spec(4)).unwrap();
    }

    #[test]
    fn node_ids_are_bounded_and_refusals_quote_a_short_prefix() {
        let s = Store::new(StoreConfig::default());
        let ok = "n".repeat(DEFAULT_MAX_NODE_ID_BYTES);
        s.register(&ok, vec![], "t".into(), spec(2)).unwrap();
        let long = "n".repeat(1 << 20);
        match s.register(&long, vec![], "t".into(), spec(2)).err() {
            Some(RegisterError::Invalid(e)) => {
                assert_eq!(e.field, "register.node_id");
                assert!(e.msg.len() < 200, "{}", e.msg);
                assert!(e.msg.contains("(1048576 bytes)"), "{}", e.msg);
            }
            other => panic!("{other:?}"),
        }
        for bad in ["", "a\nb", "tab\there"] {
            assert!(
                matches!(
                    s.register(bad, vec![], "t".into(), spec(2)).err(),
                    Some(RegisterError::Invalid(_))
                ),
                "{bad:?}"
            );
        }
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn claim_expiry_visits_only_nodes_with_claims() {
        let s = Store::new(StoreConfig::default());
        let now = Instant::now();
        let (a, g) = s.register("a", vec![], "t".into(), spec(4)).unwrap();
        s.apply(&a, g, &full(4, 1, &[]), now).unwrap();
        s.register("b", vec![], "t".into(), spec(4)).unwrap();
        assert!(s.claimed.lock().unwrap().is_empty());
        assert!(s.try_claim(&a, a.snapshot().version, 1, now));
        assert_eq!(s.claimed.lock().unwrap().len(), 1);
        assert_eq!(s.expire_claims(now), 0);
        assert_eq!(s.claimed.lock().unwrap().len(), 1, "still has a claim");
        assert_eq!(s.expire_claims(now + Duration::from_secs(1)), 1);
        assert!(s.claimed.lock().unwrap().is_empty());
        // A claim taken again after expiry is listed again.
        assert!(s.try_claim(&a, a.snapshot().version, 2, now));
        assert_eq!(s.claims_outstanding(), 1);
        assert_eq!(s.expire_claims(now + Duration::from_secs(1)), 1);
        assert_eq!(s.claims_outstanding(), 0);
    }
}
