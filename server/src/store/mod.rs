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

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use dashmap::DashMap;

mod balance;
mod cluster_balance;
mod tasks;

pub use balance::{BalanceOutcome, BalanceRequest, CacheSummary, ProcSummary};
pub use cluster_balance::{ClusterBalanceOutcome, ClusterBalanceRequest, ClusterProposal};
pub use tasks::{CpuTaskList, RuntimeEntry};
/// The limits of one update, for agents to cut their reports to.
pub use tasks::{
    MAX_MASKS_PER_NODE, MAX_RUNTIME_NS, MAX_RUNTIME_PER_CPU, MAX_TASKS_PER_CPU, MAX_TASKS_PER_NODE,
};

use crate::cluster::{Cluster, ClusterChoice, ClusterConfig, ClusterRequest, NodeAgg};
use crate::engine::balance::{Balancer, TaskTable};
use crate::engine::cache::{CacheParams, CacheState, LlcMap};
use crate::engine::cpumask::CpuMask;
use crate::engine::decision::Kind;
use crate::engine::features::{Features, Kernel, System};
use crate::engine::state::{CpuState, NodeState};
use crate::engine::topology::{FieldError, Topology, TopologySpec};

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
        }
    }
}

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
}

/// A registered node.
pub struct Node {
    pub id: String,
    pub labels: Vec<(String, String)>,
    pub agent_version: String,
    pub spec: Arc<TopologySpec>,
    snap: ArcSwap<Snapshot>,
    writer: Mutex<Writer>,
    /// The registration (stream) that may write; a newer one supersedes it.
    pub generation: AtomicU64,
    pub connected: AtomicBool,
    pub registered_at: Instant,
    /// Cache-aware accounting, made at the first runtime report; only agent
    /// reports and balance passes touch it.
    cache: Mutex<Option<Box<NodeCache>>>,
    /// The balancer's per-domain state and scratch; one pass at a time.
    balancer: Mutex<Option<Box<Balancer>>>,
    /// Placement decisions made on this node, by request kind (wakeup,
    /// fork, exec): `fairplace_node_decisions_total`, rendered at scrape
    /// time so the series go with the node.
    decisions: [AtomicU64; 3],
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
        self.decisions[kind_index(kind)].fetch_add(1, Ordering::Relaxed);
    }

    /// Decisions made on this node so far, by request kind.
    pub fn decisions(&self) -> [(Kind, u64); 3] {
        KINDS.map(|k| (k, self.decisions[kind_index(k)].load(Ordering::Relaxed)))
    }

    pub fn last_seq(&self) -> u64 {
        self.writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .last_seq
    }
}

const KINDS: [Kind; 3] = [Kind::Wakeup, Kind::Fork, Kind::Exec];

fn kind_index(k: Kind) -> usize {
    match k {
        Kind::Wakeup => 0,
        Kind::Fork => 1,
        Kind::Exec => 2,
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
    /// Each list replaces its CPU's; with `full`, unlisted CPUs have none.
    pub tasks: Vec<CpuTaskList>,
    pub runtime: Vec<RuntimeEntry>,
}

/// Built domain trees by (machine type, online CPUs).
type TopoCache = HashMap<(Arc<TopologySpec>, CpuMask), Weak<Topology>>;

/// Every node's state.
pub struct Store {
    nodes: DashMap<String, Arc<Node>>,
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
}

impl Store {
    pub fn new(config: StoreConfig) -> Self {
        Self {
            nodes: DashMap::new(),
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
        }
    }

    /// Moves the node's contribution to the cluster sums from what it was
    /// to `now` (`None`: not counted).
    fn recount(&self, node: &Node, w: &mut Writer, now: Option<NodeAgg>) {
        if let Some((path, old)) = w.counted.take() {
            self.cluster.contribute(&path, &node.id, &old, -1);
        }
        if let Some(a) = now {
            let path = self.cluster.path(&node.labels);
            self.cluster.contribute(&path, &node.id, &a, 1);
            w.counted = Some((path, a));
        }
    }

    /// Stops counting nodes that went stale; returns how many.
    pub fn uncount_stale(&self, now: Instant) -> usize {
        let mut n = 0;
        for node in self.unsorted_nodes() {
            // A fresh node stays counted: no lock needed to know.
            if self.is_fresh(&node.snapshot(), now) {
                continue;
            }
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.counted.is_some() && !self.is_fresh(&node.snapshot(), now) {
                self.recount(&node, &mut w, None);
                n += 1;
            }
        }
        n
    }

    /// Places a task with no node: the kernel's slow path over the cluster
    /// levels, with the incremental group sums.
    pub fn cluster_pick(&self, req: &ClusterRequest, allowed: &CpuMask) -> Option<ClusterChoice> {
        let now = Instant::now();
        self.cluster.pick(req, |id| {
            let n = self.get(id)?;
            let s = n.snapshot();
            (self.is_fresh(&s, now) && s.topo.online.intersects(allowed)).then_some(s.agg)
        })
    }

    /// The same choice recomputed from every node's per-CPU state.
    pub fn naive_cluster_pick(
        &self,
        req: &ClusterRequest,
        allowed: &CpuMask,
    ) -> Option<ClusterChoice> {
        let now = Instant::now();
        let nodes: Vec<_> = self
            .nodes()
            .iter()
            .filter_map(|n| {
                let s = n.snapshot();
                self.is_fresh(&s, now).then(|| {
                    let a = NodeAgg::of(&s.topo, &s.state, s.features.util_est);
                    (
                        n.id.clone(),
                        n.labels.clone(),
                        a,
                        s.topo.online.intersects(allowed),
                    )
                })
            })
            .collect();
        crate::cluster::naive_pick(&self.cluster.config, req, &nodes)
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
        let t = Arc::new(Topology::build(
            spec,
            online,
            self.config.system.node_reclaim_distance,
        )?);
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

    /// Registers (or re-registers) a node. The same topology keeps the stored
    /// state, which a full snapshot must then refresh; a new topology starts
    /// over. Returns the node and the registration's generation.
    pub fn register(
        &self,
        id: &str,
        labels: Vec<(String, String)>,
        agent_version: String,
        spec: TopologySpec,
    ) -> Result<(Arc<Node>, u64), RegisterError> {
        self.check_node_id(id)?;
        // A new id beyond the limit is refused before any topology work;
        // the insert below checks again under `admit`.
        if self.nodes.len() >= self.config.max_nodes && !self.nodes.contains_key(id) {
            return Err(RegisterError::Full {
                max: self.config.max_nodes,
            });
        }
        spec.validate("register.topology")?;
        let spec = self.intern_spec(spec);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.get(id)
            && *old.spec == *spec
            && old.labels == labels
            && old.agent_version == agent_version
        {
            old.generation.store(generation, Ordering::SeqCst);
            old.connected.store(true, Ordering::SeqCst);
            old.writer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .needs_full = true;
            return Ok((old, generation));
        }
        let mut overrides = HashMap::new();
        let mut decisions = [0u64; 3];
        if let Some(old) = self.get(id) {
            // A new topology (or new labels): the old node leaves its groups,
            // its stream is superseded, and its feature overrides and
            // decision counts carry over.
            let mut w = old.writer.lock().unwrap_or_else(PoisonError::into_inner);
            self.recount(&old, &mut w, None);
            old.generation.store(generation, Ordering::SeqCst);
            overrides = std::mem::take(&mut w.overrides);
            decisions = old.decisions.each_ref().map(|d| d.load(Ordering::Relaxed));
        }
        let n = spec.cpus.len();
        let online = CpuMask::first_n(n);
        let topo = self.topology(&spec, &online)?;
        let reported: Vec<CpuState> = spec
            .cpus
            .iter()
            .map(|c| CpuState::idle(c.capacity))
            .collect();
        let mut features = **self.global.load();
        for (k, v) in &overrides {
            features.set(k, *v);
        }
        let state = NodeState::new(&topo, reported, &[], &features);
        let node = Arc::new(Node {
            id: id.to_string(),
            labels,
            agent_version,
            spec,
            snap: ArcSwap::from_pointee(Snapshot {
                version: 1,
                agg: NodeAgg::of(&topo, &state, features.util_est),
                topo,
                state,
                features,
                reported_at: None,
                claims: Vec::new(),
                tasks: self.empty_tasks(n),
            }),
            writer: Mutex::new(Writer {
                claims: HashMap::new(),
                last_seq: 0,
                needs_full: true,
                overrides,
                kernel: Kernel::Mainline,
                counted: None,
                listed: false,
            }),
            generation: AtomicU64::new(generation),
            connected: AtomicBool::new(true),
            registered_at: Instant::now(),
            cache: Mutex::new(None),
            balancer: Mutex::new(None),
            decisions: decisions.map(AtomicU64::new),
        });
        {
            // New ids are admitted one at a time, so the limit holds exactly
            // (removals only make room).
            let _admit = self.admit.lock().unwrap_or_else(PoisonError::into_inner);
            if self.nodes.len() >= self.config.max_nodes && !self.nodes.contains_key(id) {
                return Err(RegisterError::Full {
                    max: self.config.max_nodes,
                });
            }
            self.nodes.insert(id.to_string(), Arc::clone(&node));
        }
        Ok((node, generation))
    }

    /// A node id must be non-empty, at most `max_node_id_bytes` long and
    /// free of control characters (it is a metric label value and appears
    /// in logs).
    fn check_node_id(&self, id: &str) -> Result<(), FieldError> {
        const FIELD: &str = "register.node_id";
        let max = self.config.max_node_id_bytes;
        if id.is_empty() {
            return Err(FieldError::new(FIELD, "must not be empty"));
        }
        if id.len() > max {
            return Err(FieldError::new(
                FIELD,
                format!(
                    "{} is longer than {max} bytes (--max-node-id-bytes)",
                    crate::quote::quote(id)
                ),
            ));
        }
        if id.chars().any(char::is_control) {
            return Err(FieldError::new(
                FIELD,
                format!("{} contains a control character", crate::quote::quote(id)),
            ));
        }
        Ok(())
    }

    /// Validates and applies one update atomically. A rejected update leaves
    /// the node exactly as it was.
    pub fn apply(
        &self,
        node: &Node,
        generation: u64,
        u: &Update,
        now: Instant,
    ) -> Result<u64, Reject> {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if node.generation.load(Ordering::SeqCst) != generation {
            return Err(Reject::Superseded);
        }
        let expected = w.last_seq.wrapping_add(1);
        if !u.full && (w.needs_full || u.seq != expected) {
            return Err(Reject::OutOfSequence {
                expected,
                got: u.seq,
            });
        }
        let n = node.spec.cpus.len();
        let mut seen = CpuMask::new();
        for (k, (id, c)) in u.cpus.iter().enumerate() {
            let field = |f: &str| format!("update.cpus[{k}].{f}");
            let id = *id as usize;
            if id >= n {
                return Err(Reject::Invalid(FieldError::new(
                    field("id"),
                    format!("CPU {id} is not in the topology ({n} CPUs)"),
                )));
            }
            if seen.test(id) {
                return Err(Reject::Invalid(FieldError::new(
                    field("id"),
                    format!("CPU {id} is listed twice"),
                )));
            }
            seen.set(id);
            c.check(node.spec.cpus[id].capacity)
                .map_err(|(f, msg)| Reject::Invalid(FieldError::new(field(f), msg)))?;
        }
        if u.full && seen.weight() != n {
            let missing = CpuMask::first_n(n).andnot(&seen);
            return Err(Reject::Invalid(FieldError::new(
                "update.cpus",
                format!("a full snapshot must list every CPU; missing {missing}"),
            )));
        }
        // The online set after the update, without touching the stored state.
        let cur = node.snapshot();
        let mut online = cur.topo.online.andnot(&seen);
        for (id, c) in &u.cpus {
            if c.online {
                online.set(*id as usize);
            }
        }
        if online.is_empty() {
            return Err(Reject::Invalid(FieldError::new(
                "update.cpus",
                "no CPU would be online",
            )));
        }
        tasks::check_runtime(&u.runtime, n).map_err(Reject::Invalid)?;
        let empty = self.empty_tasks(n);
        let table = tasks::merge(&cur.tasks, u, n, &online, &empty).map_err(Reject::Invalid)?;
        let topo = if cur.topo.online == online {
            Arc::clone(&cur.topo)
        } else {
            self.topology(&node.spec, &online)
                .map_err(Reject::Invalid)?
        };
        let mut cpus = base_cpus(&cur, &w);
        // A report of a CPU supersedes the claims on it.
        let stamp = self.idle_stamp_at(now);
        for (id, c) in &u.cpus {
            w.claims.remove(id);
            let prev = &cpus[*id as usize];
            cpus[*id as usize] = fill_idle_stamp(*c, prev, stamp);
        }
        w.last_seq = u.seq;
        w.needs_full = false;
        let v = self.publish_with(
            node,
            &mut w,
            cpus,
            topo,
            cur.features,
            Some(now),
            &cur,
            table,
        );
        Ok(v)
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
        let tasks = Arc::clone(&cur.tasks);
        self.publish_with(node, w, cpus, topo, features, reported_at, cur, tasks)
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
        tasks: Arc<TaskTable>,
    ) -> u64 {
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
        let state = NodeState::next(&topo, &cur.state, same, cpus, &[], &features);
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

    /// Commits a claim on `cpu` if the node is still at `version`; returns
    /// false if another writer got there first (decide again).
    pub fn try_claim(&self, node: &Node, version: u64, cpu: usize, now: Instant) -> bool {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        if cur.version != version {
            return false;
        }
        self.add_claim(node, &mut w, &cur, cpu, now);
        true
    }

    /// Counts one more task on `cpu` until its TTL, and publishes.
    fn add_claim(&self, node: &Node, w: &mut Writer, cur: &Snapshot, cpu: usize, now: Instant) {
        let base = cur.state.cpus[cpu];
        w.claims
            .entry(cpu as u32)
            .or_insert_with(|| ClaimSlot {
                base,
                expires: Vec::new(),
            })
            .expires
            .push(now + self.config.claim_ttl);
        if !w.listed {
            w.listed = true;
            self.claimed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(node.id.clone());
        }
        let cpus = base_cpus(cur, w);
        let topo = Arc::clone(&cur.topo);
        self.publish(node, w, cpus, topo, cur.features, None, cur);
    }

    /// Decides and claims under the node's writer lock: the fallback when
    /// optimistic claims keep losing to other writers. `decide` returns the
    /// CPU to claim, or None to claim nothing.
    pub fn claim_locked<T>(
        &self,
        node: &Node,
        now: Instant,
        decide: impl FnOnce(&Snapshot) -> (T, Option<usize>),
    ) -> T {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        let (out, cpu) = decide(&cur);
        if let Some(cpu) = cpu {
            self.add_claim(node, &mut w, &cur, cpu, now);
        }
        out
    }

    /// Drops claims whose TTL ended; returns how many expired.
    pub fn expire_claims(&self, now: Instant) -> usize {
        let mut expired = 0;
        // The nodes that took claims since; a node keeps its place in the
        // set while it still has some.
        let ids = std::mem::take(&mut *self.claimed.lock().unwrap_or_else(PoisonError::into_inner));
        let mut keep = Vec::new();
        for id in ids {
            // A forgotten or replaced node's claims no longer count.
            let Some(node) = self.get(&id) else {
                continue;
            };
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.claims.is_empty() {
                w.listed = false;
                continue;
            }
            let before: usize = w.claims.values().map(|s| s.expires.len()).sum();
            let cur = node.snapshot();
            let cpus = base_cpus(&cur, &w);
            for slot in w.claims.values_mut() {
                slot.expires.retain(|&t| t > now);
            }
            w.claims.retain(|_, s| !s.expires.is_empty());
            let after: usize = w.claims.values().map(|s| s.expires.len()).sum();
            if after != before {
                expired += before - after;
                let topo = Arc::clone(&cur.topo);
                self.publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
            }
            if w.claims.is_empty() {
                w.listed = false;
            } else {
                keep.push(id);
            }
        }
        if !keep.is_empty() {
            self.claimed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(keep);
        }
        expired
    }

    /// Claims outstanding across all nodes.
    pub fn claims_outstanding(&self) -> usize {
        self.unsorted_nodes()
            .iter()
            .map(|n| {
                n.snapshot()
                    .claims
                    .iter()
                    .map(|(_, k)| *k as usize)
                    .sum::<usize>()
            })
            .sum()
    }

    /// The shared empty task table of `n` CPUs.
    fn empty_tasks(&self, n: usize) -> Arc<TaskTable> {
        let mut m = self
            .empty_tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(m.entry(n).or_insert_with(|| Arc::new(TaskTable::empty(n))))
    }

    /// The `idle_stamp` the store gives a CPU first reported idle at `now`
    /// (see [`fill_idle_stamp`]): ns since the store started, never 0.
    fn idle_stamp_at(&self, now: Instant) -> i64 {
        let ns = now.saturating_duration_since(self.epoch).as_nanos();
        ns.clamp(1, 1 << 62) as i64
    }

    /// The store's millisecond clock.
    pub fn now_ms(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    pub fn is_fresh(&self, snap: &Snapshot, now: Instant) -> bool {
        snap.age(now).is_some_and(|a| a <= self.config.stale_after)
    }

    /// Forgets nodes that have not reported for `forget_after`, whether or
    /// not a stream is still open for them: an open but silent stream does
    /// not keep its node (its next update is refused and the stream ends).
    pub fn forget_stale(&self, now: Instant) -> usize {
        let limit = self.config.forget_after;
        let before = self.nodes.len();
        self.nodes.retain(|_, n| {
            let s = n.snapshot();
            let since = s.reported_at.unwrap_or(n.registered_at);
            let keep = now.saturating_duration_since(since) <= limit;
            if !keep {
                self.retire(n);
            }
            keep
        });
        before - self.nodes.len()
    }

    /// Forgets `node` if `generation` is still its registration.
    pub fn forget_node(&self, node: &Node, generation: u64) {
        let removed = self.nodes.remove_if(&node.id, |_, n| {
            std::ptr::eq(Arc::as_ptr(n), node) && n.generation.load(Ordering::SeqCst) == generation
        });
        if let Some((_, n)) = removed {
            self.retire(&n);
        }
    }

    /// A node leaving the store: out of the cluster sums, and its stream's
    /// registration void, so a late update is refused.
    fn retire(&self, n: &Node) {
        let mut w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
        self.recount(n, &mut w, None);
        let g = self.next_generation.fetch_add(1, Ordering::Relaxed);
        n.generation.store(g, Ordering::SeqCst);
        n.connected.store(false, Ordering::SeqCst);
    }

    pub fn disconnect(&self, node: &Node, generation: u64) {
        if node.generation.load(Ordering::SeqCst) == generation {
            node.connected.store(false, Ordering::SeqCst);
        }
    }

    pub fn global_features(&self) -> Features {
        **self.global.load()
    }

    /// The node's overrides of the global features.
    pub fn overrides(&self, node: &Node) -> HashMap<String, bool> {
        node.writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overrides
            .clone()
    }

    /// Sets global features (`node = None`) or a node's overrides, and
    /// republishes the affected snapshots with the new effective features.
    pub fn set_features(
        &self,
        node: Option<&Node>,
        set: &[(String, bool)],
        clear_overrides: bool,
    ) -> Result<(), FieldError> {
        let mut check = Features::default();
        for (k, v) in set {
            if !check.set(k, *v) {
                // A long name is quoted and cut, never echoed whole.
                let name = crate::quote::field_key(k);
                return Err(FieldError::new(format!("set.{name}"), "unknown feature"));
            }
        }
        match node {
            None => {
                let _serial = self
                    .global_lock
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let mut g = self.global_features();
                for (k, v) in set {
                    g.set(k, *v);
                }
                self.global.store(Arc::new(g));
                for n in self.nodes() {
                    self.refresh_features(&n, None, false);
                }
            }
            Some(n) => self.refresh_features(n, Some(set), clear_overrides),
        }
        Ok(())
    }

    /// Sets a node's kernel profile (from its registration) and republishes
    /// its state with the profile's features.
    pub fn set_kernel(&self, node: &Node, kernel: Kernel) {
        {
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.kernel == kernel && node.snapshot().features.kernel == kernel {
                return;
            }
            w.kernel = kernel;
        }
        self.refresh_features(node, None, false);
    }

    fn refresh_features(&self, node: &Node, set: Option<&[(String, bool)]>, clear: bool) {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if clear {
            w.overrides.clear();
        }
        if let Some(set) = set {
            for (k, v) in set {
                w.overrides.insert(k.clone(), *v);
            }
        }
        let mut f = self.global_features();
        for (k, v) in &w.overrides {
            f.set(k, *v);
        }
        let f = kernel_features(f, w.kernel, &w.overrides);
        let cur = node.snapshot();
        let cpus = base_cpus(&cur, &w);
        let topo = Arc::clone(&cur.topo);
        self.publish(node, &mut w, cpus, topo, f, None, &cur);
    }
}

/// The features of a node under its kernel profile: under "6.12" the two
/// switches whose default differs are off unless the node overrides them.
fn kernel_features(
    global: Features,
    kernel: Kernel,
    overrides: &HashMap<String, bool>,
) -> Features {
    let mut f = global;
    f.kernel = kernel;
    if kernel == Kernel::V6_12 {
        let d = Features::for_kernel(kernel);
        for name in ["SKIP_SCHED_IDLE_FOR_IDLE_TASK", "EXEC_BOUND_FAST_PATH"] {
            if !overrides.contains_key(name) {
                f.set(name, d.get(name).unwrap_or(false));
            }
        }
    }
    f
}

/// A reported CPU, with an `idle_stamp` if it is idle and came without one.
///
/// The kernel sets `rq->idle_stamp` (its runqueue clock) whenever a CPU goes
/// idle, so an idle CPU has a non-zero one; `sched_balance_find_dst_group_cpu`
/// takes, among idle CPUs of equal exit latency (or none), the one with the
/// latest stamp *above 0*. With every stamp 0, as a reporter without
/// cpuidle information sends, it takes none and falls back to `this_cpu`:
/// concurrent claimed forks would all land there. So an idle CPU reported
/// with 0 gets the time of the report that first showed it idle (the store's
/// clock, ns since it started), kept while later reports show it still idle
/// and dropped once one shows it running. Stamps a reporter sends are kept
/// as they are; a reporter that sends some and leaves others 0 mixes two
/// clocks, as unsynchronised runqueue clocks would.
fn fill_idle_stamp(mut c: CpuState, prev: &CpuState, now: i64) -> CpuState {
    if c.idle_stamp == 0 && c.online && c.idle_cpu() {
        c.idle_stamp = if prev.online && prev.idle_cpu() && prev.idle_stamp != 0 {
            prev.idle_stamp
        } else {
            now
        };
    }
    c
}

/// The agent's state of every CPU: the snapshot's, with claimed CPUs taken
/// back to what they were before their claims.
fn base_cpus(cur: &Snapshot, w: &Writer) -> Vec<CpuState> {
    let mut cpus = cur.state.cpus.clone();
    for (&cpu, slot) in &w.claims {
        cpus[cpu as usize] = slot.base;
    }
    cpus
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
