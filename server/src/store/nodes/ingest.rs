//! Ingest: registrations (the node's topology built once per machine type,
//! outside any lock) and agent updates, checked whole before anything is
//! stored and published as the node's next snapshot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::engine::cpumask::CpuMask;
use crate::engine::features::Kernel;
use crate::engine::group::NodeAgg;
use crate::engine::state::{CpuState, NodeState};
use crate::engine::topology::{FieldError, TopologySpec};

use super::Nodes;
use crate::store::labels::{check_labels, unfit};
use crate::store::report::{self, Reject, Update};
use crate::store::{Carried, Node, Snapshot, Writer, base_cpus};

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

impl Nodes {
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
        self.register_as(id, labels, agent_version, spec, false)
    }

    /// [`Nodes::register`] for an agent's stream: the node grants no lease
    /// until [`Nodes::reconciled`], so no grant reaches the agent before it
    /// heard which of the leases it holds are over (an agent applying a new
    /// grant beside an ended lease on the same CPUs).
    pub fn register_agent(
        &self,
        id: &str,
        labels: Vec<(String, String)>,
        agent_version: String,
        spec: TopologySpec,
    ) -> Result<(Arc<Node>, u64), RegisterError> {
        self.register_as(id, labels, agent_version, spec, true)
    }

    /// The node's agent heard the outcome of its registration's lease
    /// reconciliation: the node grants leases again.
    pub fn reconciled(&self, node: &Node) {
        node.reconciling.store(false, Ordering::SeqCst);
    }

    fn register_as(
        &self,
        id: &str,
        labels: Vec<(String, String)>,
        agent_version: String,
        spec: TopologySpec,
        reconciling: bool,
    ) -> Result<(Arc<Node>, u64), RegisterError> {
        self.check_node_id(id)?;
        check_labels(&labels)?;
        check_agent_version(&agent_version)?;
        // A new id beyond the limit is refused before any topology work;
        // the insert below checks again under `admit`.
        if self.table.nodes.len() >= self.max_nodes && !self.table.nodes.contains_key(id) {
            return Err(RegisterError::Full {
                max: self.max_nodes,
            });
        }
        spec.validate("register.topology")?;
        let spec = self.table.intern_spec(spec);
        let reported_labels = labels;
        let labels = self.label_policy.effective(id, &reported_labels);
        let generation = self.next_generation.fetch_add(1, Ordering::Relaxed);
        if let Some(old) = self.get(id)
            && *old.spec == *spec
            && old.labels == labels
            && old.reported_labels == reported_labels
            && old.agent_version == agent_version
        {
            old.reconciling.store(reconciling, Ordering::SeqCst);
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
            self.table.recount(&old, &mut w, None);
            // Its leases wait for the new node, which takes back those
            // whose CPUs it still has.
            self.leases.park_leases(id, &mut w);
            old.generation.store(generation, Ordering::SeqCst);
            overrides = std::mem::take(&mut w.overrides);
            decisions = old.decisions.each_ref().map(|d| d.load(Ordering::Relaxed));
        }
        let n = spec.cpus.len();
        let online = CpuMask::first_n(n);
        let topo = self.table.topology(&spec, &online)?;
        let reported: Vec<CpuState> = spec
            .cpus
            .iter()
            .map(|c| CpuState::idle(c.capacity))
            .collect();
        let mut features = self.switches.global();
        for (k, v) in &overrides {
            features.set(k, *v);
        }
        let state = NodeState::new(&topo, reported, &[], &features);
        let node = Arc::new(Node {
            id: id.to_string(),
            labels,
            reported_labels,
            agent_version,
            signal_source: Default::default(),
            spec,
            snap: ArcSwap::from_pointee(Snapshot {
                version: 1,
                agg: NodeAgg::of(&topo, &state, features.util_est),
                topo,
                state,
                features,
                reported_at: None,
                claims: Vec::new(),
                tasks: self.table.empty_tasks(n),
            }),
            writer: Mutex::new(Writer {
                claims: HashMap::new(),
                last_seq: 0,
                needs_full: true,
                overrides,
                counted: None,
                listed: false,
                leases: Default::default(),
                kernel: Kernel::Mainline,
            }),
            generation: AtomicU64::new(generation),
            connected: AtomicBool::new(true),
            reconciling: AtomicBool::new(reconciling),
            registered_at: Instant::now(),
            cache: Mutex::new(None),
            balancer: Mutex::new(None),
            decisions: decisions.map(AtomicU64::new),
        });
        {
            // New ids are admitted one at a time, so the limit holds exactly
            // (removals only make room).
            let _admit = self.admit.lock().unwrap_or_else(PoisonError::into_inner);
            if self.table.nodes.len() >= self.max_nodes && !self.table.nodes.contains_key(id) {
                return Err(RegisterError::Full {
                    max: self.max_nodes,
                });
            }
            self.table.nodes.insert(id.to_string(), Arc::clone(&node));
        }
        // Counted here from now on, not as another replica's.
        self.table.hierarchy.remote_remove(id);
        // Leases kept while the node was away (forgotten, restarting, or
        // this server restarting) count again from its first snapshot.
        self.leases.unpark_leases(&node);
        Ok((node, generation))
    }

    /// A node id must be non-empty, at most `max_node_id_bytes` long and
    /// free of control characters (it is a metric label value and appears
    /// in logs).
    fn check_node_id(&self, id: &str) -> Result<(), FieldError> {
        const FIELD: &str = "register.node_id";
        let max = self.max_node_id_bytes;
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
}

/// Longest agent version string, in bytes.
pub const MAX_AGENT_VERSION_BYTES: usize = 128;

fn check_agent_version(v: &str) -> Result<(), FieldError> {
    match unfit(v, MAX_AGENT_VERSION_BYTES) {
        Some(why) => Err(FieldError::new("register.agent_version", why)),
        None => Ok(()),
    }
}

impl Nodes {
    /// Validates and applies one update atomically; the version published.
    /// A rejected update leaves the node exactly as it was.
    pub fn apply(
        &self,
        node: &Node,
        generation: u64,
        u: &Update,
        now: Instant,
    ) -> Result<u64, Reject> {
        self.apply_update(node, generation, u, now)
            .map(|(version, _)| version)
    }

    /// [`Nodes::apply`], and whether the update changed which CPUs are
    /// online (the domain tree was rebuilt).
    pub(in crate::store) fn apply_update(
        &self,
        node: &Node,
        generation: u64,
        u: &Update,
        now: Instant,
    ) -> Result<(u64, bool), Reject> {
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
        report::check_update_cpus(&node.spec, u).map_err(Reject::Invalid)?;
        // The online set after the update, without touching the stored state.
        let cur = node.snapshot();
        let online = report::online_after(&cur.topo.online, u);
        if online.is_empty() {
            return Err(Reject::Invalid(FieldError::new(
                "update.cpus",
                "no CPU would be online",
            )));
        }
        report::check_runtime(&u.runtime, n).map_err(Reject::Invalid)?;
        let empty = self.table.empty_tasks(n);
        let table = report::merge(&cur.tasks, u, n, &online, &empty).map_err(Reject::Invalid)?;
        let rebuilt = cur.topo.online != online;
        let topo = if !rebuilt {
            Arc::clone(&cur.topo)
        } else {
            self.table
                .topology(&node.spec, &online)
                .map_err(Reject::Invalid)?
        };
        let mut cpus = base_cpus(&cur, &w);
        // A report of a CPU supersedes the claims on it.
        let stamp = self.table.idle_stamp_at(now);
        for (id, c) in &u.cpus {
            w.claims.remove(id);
            let prev = &cpus[*id as usize];
            cpus[*id as usize] = report::fill_idle_stamp(*c, prev, stamp);
        }
        w.last_seq = u.seq;
        w.needs_full = false;
        let v = self.table.publish_with(
            node,
            &mut w,
            cpus,
            topo,
            cur.features,
            Some(now),
            &cur,
            Carried {
                tasks: table,
                core_cookies: report::next_core_cookies(&cur.state.core_cookies, u, n),
            },
        );
        Ok((v, rebuilt))
    }
}
