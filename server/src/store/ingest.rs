//! Ingest: registrations (the node's topology built once per machine type,
//! outside any lock) and agent updates, checked whole before anything is
//! stored and published as the node's next snapshot.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::engine::cpumask::CpuMask;
use crate::engine::features::Kernel;
use crate::engine::group::NodeAgg;
use crate::engine::rq::TaskTable;
use crate::engine::state::{CpuState, MAX_CLOCK, NodeState};
use crate::engine::topology::{FieldError, Topology, TopologySpec};

use super::claims::base_cpus;
use super::{
    Carried, Node, RegisterError, Reject, Snapshot, Store, TopoCache, Update, Writer, tasks,
};

impl Store {
    pub(super) fn intern_spec(&self, spec: TopologySpec) -> Arc<TopologySpec> {
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
    pub(super) fn topology(
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
        self.register_as(id, labels, agent_version, spec, false)
    }

    /// [`Store::register`] for an agent's stream: the node grants no lease
    /// until [`Store::reconciled`], so no grant reaches the agent before it
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
        if self.nodes.len() >= self.config.max_nodes && !self.nodes.contains_key(id) {
            return Err(RegisterError::Full {
                max: self.config.max_nodes,
            });
        }
        spec.validate("register.topology")?;
        let spec = self.intern_spec(spec);
        let reported_labels = labels;
        let labels = self.config.label_policy.effective(id, &reported_labels);
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
            self.recount(&old, &mut w, None);
            // Its leases wait for the new node, which takes back those
            // whose CPUs it still has.
            self.park_leases(id, &mut w);
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
                tasks: self.empty_tasks(n),
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
            if self.nodes.len() >= self.config.max_nodes && !self.nodes.contains_key(id) {
                return Err(RegisterError::Full {
                    max: self.config.max_nodes,
                });
            }
            self.nodes.insert(id.to_string(), Arc::clone(&node));
        }
        // Counted here from now on, not as another replica's.
        self.remote_remove(id);
        // Leases kept while the node was away (forgotten, restarting, or
        // this server restarting) count again from its first snapshot.
        self.unpark_leases(&node);
        Ok((node, generation))
    }

    /// A node id must be non-empty, at most `max_node_id_bytes` long and
    /// free of control characters (it is a metric label value and appears
    /// in logs).
    pub(super) fn check_node_id(&self, id: &str) -> Result<(), FieldError> {
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
}

/// Labels a node may carry at most.
pub const MAX_LABELS: usize = 32;
/// Longest label key or value, in bytes (a DNS subdomain, as Kubernetes'
/// label prefixes).
pub const MAX_LABEL_BYTES: usize = 253;
/// Longest agent version string, in bytes.
pub const MAX_AGENT_VERSION_BYTES: usize = 128;

/// Why a client's string is not fit to store and show: too long, or with a
/// control character (a newline or an escape sequence would forge a row or
/// reach a terminal); `None` when fit.
fn unfit(s: &str, max: usize) -> Option<String> {
    let q = crate::quote::quote(s);
    if s.len() > max {
        Some(format!("{q} is longer than {max} bytes"))
    } else if s.chars().any(char::is_control) {
        Some(format!("{q} contains a control character"))
    } else {
        None
    }
}

/// A registration's labels: at most [`MAX_LABELS`], keys non-empty, keys
/// and values short and printable.
pub fn check_labels(labels: &[(String, String)]) -> Result<(), FieldError> {
    if labels.len() > MAX_LABELS {
        return Err(FieldError::new(
            "register.labels",
            format!("{} labels is more than {MAX_LABELS}", labels.len()),
        ));
    }
    for (k, v) in labels {
        let field = || format!("register.labels[{}]", crate::quote::quote(k));
        if k.is_empty() {
            return Err(FieldError::new("register.labels", "a key is empty"));
        }
        if let Some(why) = unfit(k, MAX_LABEL_BYTES) {
            return Err(FieldError::new(field(), format!("key {why}")));
        }
        if let Some(why) = unfit(v, MAX_LABEL_BYTES) {
            return Err(FieldError::new(field(), format!("value {why}")));
        }
    }
    Ok(())
}

fn check_agent_version(v: &str) -> Result<(), FieldError> {
    match unfit(v, MAX_AGENT_VERSION_BYTES) {
        Some(why) => Err(FieldError::new("register.agent_version", why)),
        None => Ok(()),
    }
}

impl Store {
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
        let seen = check_update_cpus(&node.spec, u).map_err(Reject::Invalid)?;
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
            Carried {
                tasks: table,
                core_cookies: next_core_cookies(&cur.state.core_cookies, u, n),
            },
        );
        Ok(v)
    }

    /// The shared empty task table of `n` CPUs.
    pub(super) fn empty_tasks(&self, n: usize) -> Arc<TaskTable> {
        let mut m = self
            .empty_tasks
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        Arc::clone(m.entry(n).or_insert_with(|| Arc::new(TaskTable::empty(n))))
    }

    /// The `idle_stamp` the store gives a CPU first reported idle at `now`
    /// (see [`fill_idle_stamp`]): ns since the store started, never 0.
    pub(super) fn idle_stamp_at(&self, now: Instant) -> i64 {
        let ns = now.saturating_duration_since(self.epoch).as_nanos();
        ns.clamp(1, MAX_CLOCK as u128) as i64
    }
}

/// A node's core cookies after `u` (by CPU); `None` when neither the node
/// nor the update has any, so nodes without core scheduling copy nothing.
fn next_core_cookies(cur: &[u64], u: &Update, n: usize) -> Option<Vec<u64>> {
    if cur.is_empty() && u.core_cookies.is_empty() {
        return None;
    }
    let mut next = if cur.is_empty() {
        vec![0; n]
    } else {
        cur.to_vec()
    };
    for (k, (id, _)) in u.cpus.iter().enumerate() {
        next[*id as usize] = u.core_cookies.get(k).copied().unwrap_or(0);
    }
    Some(next)
}

/// An update's CPU states checked against the node's hardware: each CPU
/// in the topology, listed once, in range, and every CPU in a full
/// snapshot. Returns the CPUs listed.
pub(super) fn check_update_cpus(spec: &TopologySpec, u: &Update) -> Result<CpuMask, FieldError> {
    let n = spec.cpus.len();
    let mut seen = CpuMask::new();
    for (k, (id, c)) in u.cpus.iter().enumerate() {
        let field = |f: &str| format!("update.cpus[{k}].{f}");
        let id = *id as usize;
        if id >= n {
            return Err(FieldError::new(
                field("id"),
                format!("CPU {id} is not in the topology ({n} CPUs)"),
            ));
        }
        if seen.test(id) {
            return Err(FieldError::new(
                field("id"),
                format!("CPU {id} is listed twice"),
            ));
        }
        seen.set(id);
        c.check(spec.cpus[id].capacity)
            .map_err(|(f, msg)| FieldError::new(field(f), msg))?;
    }
    if u.full && seen.weight() != n {
        let missing = CpuMask::first_n(n).andnot(&seen);
        return Err(FieldError::new(
            "update.cpus",
            format!("a full snapshot must list every CPU; missing {missing}"),
        ));
    }
    Ok(seen)
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
pub(super) fn fill_idle_stamp(mut c: CpuState, prev: &CpuState, now: i64) -> CpuState {
    if c.idle_stamp == 0 && c.online && c.idle_cpu() {
        c.idle_stamp = if prev.online && prev.idle_cpu() && prev.idle_stamp != 0 {
            prev.idle_stamp
        } else {
            now
        };
    }
    c
}
