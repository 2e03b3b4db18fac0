//! The cluster hierarchy: zones, racks (the levels are node labels,
//! configurable) and nodes above each node's own NUMA / LLC / core domains,
//! with their incrementally kept sums, and the nodes other replicas own as
//! far as those sums count them.
//!
//! The group statistics are kept incrementally: every published snapshot
//! carries its node's [`NodeAgg`] (the engine's), and the node table adds
//! the difference to the node's ancestor groups, O(depth) per report; a
//! pick reads each group's sums in O(1). [`Hierarchy::pick`] walks down from
//! the top: at each level the groups' statistics are compared with the
//! kernel's own rules, the same code the node slow path runs
//! ([`crate::engine::group`]: `group_classify`, `update_pick_idlest`, the
//! local-versus-idlest test with its NUMA allowance). [`naive_pick`]
//! recomputes everything from the per-CPU state and must agree.
//!
//! Other replicas' nodes are counted here beside the local ones (their
//! aggregates, published by their owners), so a placement with no node sees
//! the whole cluster wherever it is asked. A remote node is never decided
//! on here: the choice goes to its owner, which places the task on its live
//! state and may refuse (the figures here are up to 100 ms old).
//!
//! A leaf of the store: the node table writes the sums, the cluster owner
//! (`cluster/`) reads them; this file knows neither.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::Instant;

use crate::engine::cpumask::CpuMask;
use crate::engine::group::{DstDomain, NodeAgg, NumaPref, leave_local_group, update_pick_idlest};
use crate::engine::state::GroupSum;

/// One level of the hierarchy: the label that names its groups and the
/// domain's imbalance_pct.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelConfig {
    pub label: String,
    pub imbalance_pct: u32,
}

/// The hierarchy above the nodes. Defaults: zones compare at 125 (crossing
/// zones costs more, like a far NUMA level), racks at 117, nodes at 117.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    pub levels: Vec<LevelConfig>,
    pub node_imbalance_pct: u32,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            levels: vec![
                LevelConfig {
                    label: "zone".into(),
                    imbalance_pct: 125,
                },
                LevelConfig {
                    label: "rack".into(),
                    imbalance_pct: 117,
                },
            ],
            node_imbalance_pct: 117,
        }
    }
}

/// A group's sums, with the maxima kept as counted multisets so that a node
/// can leave in O(log n).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GroupAcc {
    pub sum: NodeAgg,
    pub nodes: i64,
    max_cap: BTreeMap<i64, u32>,
    max_cpus: BTreeMap<i64, u32>,
}

impl GroupAcc {
    fn add(&mut self, a: &NodeAgg, sign: i64) {
        self.sum.sum.add(&a.sum, sign);
        self.nodes += sign;
        for (m, v) in [
            (&mut self.max_cap, a.sum.max_capacity),
            (&mut self.max_cpus, a.nr_cpus),
        ] {
            if sign > 0 {
                *m.entry(v).or_default() += 1;
            } else if let Some(k) = m.get_mut(&v) {
                *k -= 1;
                if *k == 0 {
                    m.remove(&v);
                }
            }
        }
    }

    /// The group as one aggregate (sums, and the maxima over its nodes).
    pub fn agg(&self) -> NodeAgg {
        NodeAgg {
            sum: GroupSum {
                max_capacity: self.max_cap.keys().next_back().copied().unwrap_or(0),
                ..self.sum.sum
            },
            nr_cpus: self.max_cpus.keys().next_back().copied().unwrap_or(0),
        }
    }
}

/// A group of the hierarchy: its sums and its children (groups, or at the
/// last level the nodes), in name order so ties resolve the same way always.
#[derive(Debug, Default)]
pub struct Group {
    pub acc: Mutex<GroupAcc>,
    children: RwLock<BTreeMap<String, Arc<Group>>>,
    nodes: RwLock<BTreeMap<String, ()>>,
}

impl Group {
    /// The child groups, in name order.
    pub fn child_groups(&self) -> Vec<(String, Arc<Group>)> {
        self.children
            .read()
            .expect("children")
            .iter()
            .map(|(k, c)| (k.clone(), Arc::clone(c)))
            .collect()
    }

    /// The nodes counted directly in this group (at the last level), in
    /// name order.
    pub fn own_nodes(&self) -> Vec<String> {
        self.nodes
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .cloned()
            .collect()
    }

    /// Every node counted under this group, in path then name order.
    pub fn all_nodes(&self) -> Vec<String> {
        let mut out = self.own_nodes();
        for (_, c) in self.child_groups() {
            out.extend(c.all_nodes());
        }
        out
    }
}

/// The hierarchy, its incrementally kept sums, and the remote nodes
/// counted in them.
#[derive(Debug, Default)]
pub struct Hierarchy {
    pub config: ClusterConfig,
    root: Arc<Group>,
    remote: Mutex<HashMap<String, RemoteNode>>,
}

/// What a cluster pick needs to know about the task.
#[derive(Debug, Clone, Default)]
pub struct ClusterRequest {
    /// Lowest CPU id the task may run on: groups whose nodes all have fewer
    /// CPUs are skipped (the node check itself is exact).
    pub first_allowed_cpu: usize,
    /// The node the request comes from (a fork's parent) and its group
    /// path: those groups are the local ones.
    pub origin: Option<(Vec<String>, String)>,
    /// Required label values, on the hierarchy's own labels only.
    pub selector: Vec<(String, String)>,
}

/// The outcome of the walk down the hierarchy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterChoice {
    pub node: String,
    /// Candidates compared on the way (all levels, nodes included).
    pub compared: u32,
    /// The highest level where the choice left the local group ("node" if
    /// only the node changed, "none" if it stayed on the origin node, "top"
    /// when there was no origin).
    pub level: String,
}

impl Hierarchy {
    pub fn new(config: ClusterConfig) -> Self {
        Self {
            config,
            root: Arc::new(Group::default()),
            remote: Mutex::default(),
        }
    }

    /// The label values naming a node's groups, one per level (an absent
    /// label is the empty name: such nodes form one group of their own).
    pub fn path(&self, labels: &[(String, String)]) -> Vec<String> {
        self.config
            .levels
            .iter()
            .map(|l| {
                labels
                    .iter()
                    .find(|(k, _)| *k == l.label)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default()
            })
            .collect()
    }

    /// Adds (`sign` 1) or removes (-1) a node's contribution along its path,
    /// creating groups as needed.
    pub fn contribute(&self, path: &[String], node: &str, a: &NodeAgg, sign: i64) {
        let mut g = Arc::clone(&self.root);
        g.acc
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .add(a, sign);
        for key in path {
            let child = {
                let mut ch = g.children.write().unwrap_or_else(PoisonError::into_inner);
                Arc::clone(ch.entry(key.clone()).or_default())
            };
            child
                .acc
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .add(a, sign);
            g = child;
        }
        let mut nodes = g.nodes.write().unwrap_or_else(PoisonError::into_inner);
        if sign > 0 {
            nodes.insert(node.to_string(), ());
        } else {
            nodes.remove(node);
        }
    }

    /// The group named by `path` (label values from the top), if any.
    pub fn group(&self, path: &[String]) -> Option<Arc<Group>> {
        let mut g = Arc::clone(&self.root);
        for key in path {
            let child = g
                .children
                .read()
                .unwrap_or_else(PoisonError::into_inner)
                .get(key)
                .cloned()?;
            g = child;
        }
        Some(g)
    }

    /// The top group's sums (every counted node).
    pub fn total(&self) -> GroupAcc {
        self.root
            .acc
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// One other replica's node.
#[derive(Debug, Clone)]
pub struct RemoteNode {
    /// The replica that owns and published it.
    pub replica: String,
    pub path: Vec<String>,
    pub online: CpuMask,
    pub agg: NodeAgg,
    /// When its owner last published it.
    pub at: Instant,
}

impl Hierarchy {
    fn remote(&self) -> MutexGuard<'_, HashMap<String, RemoteNode>> {
        self.remote.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Counts (or updates) another replica's node under `labels` (the
    /// caller checked it is not registered here).
    pub fn remote_put(&self, id: &str, labels: &[(String, String)], n: RemoteNode) {
        let mut nodes = self.remote();
        if let Some(old) = nodes.remove(id) {
            self.contribute(&old.path, id, &old.agg, -1);
        }
        let path = self.path(labels);
        let n = RemoteNode { path, ..n };
        self.contribute(&n.path, id, &n.agg, 1);
        nodes.insert(id.to_string(), n);
    }

    /// Stops counting another replica's node (gone there, or local now).
    pub fn remote_remove(&self, id: &str) {
        if let Some(old) = self.remote().remove(id) {
            self.contribute(&old.path, id, &old.agg, -1);
        }
    }

    /// Stops counting every node `replica` published except `keep` (a full
    /// publication, or `keep` empty: the replica is gone).
    pub fn remote_retain(&self, replica: &str, keep: &HashSet<String>) {
        let mut nodes = self.remote();
        let gone: Vec<String> = nodes
            .iter()
            .filter(|(id, n)| n.replica == replica && !keep.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            if let Some(old) = nodes.remove(&id) {
                self.contribute(&old.path, &id, &old.agg, -1);
            }
        }
    }

    /// The remote node `id`, if counted: its owner publishes only fresh
    /// nodes and says when one goes stale, and a subscription that breaks
    /// takes its replica's nodes with it.
    pub fn remote_node(&self, id: &str) -> Option<RemoteNode> {
        self.remote().get(id).cloned()
    }

    /// A counted remote node's aggregate, if it has an online CPU in
    /// `allowed`: what a cluster pick compares, copied alone (the whole
    /// record is not, for each of a leaf's candidates).
    pub fn remote_agg(&self, id: &str, allowed: &CpuMask) -> Option<NodeAgg> {
        let r = self.remote();
        let n = r.get(id)?;
        n.online.intersects(allowed).then_some(n.agg)
    }

    /// Remote nodes counted.
    pub fn remote_len(&self) -> usize {
        self.remote().len()
    }
}

impl Hierarchy {
    /// Walks down the hierarchy with the incremental sums. `node_agg` gives
    /// a counted node's current aggregate if the node can run the task.
    pub fn pick(
        &self,
        req: &ClusterRequest,
        node_agg: impl Fn(&str) -> Option<NodeAgg>,
    ) -> Option<ClusterChoice> {
        let mut compared = 0;
        let mut level = if req.origin.is_some() { "none" } else { "top" }.to_string();
        let node = self.walk(&self.root, 0, req, &node_agg, &mut compared, &mut level)?;
        Some(ClusterChoice {
            node,
            compared,
            level,
        })
    }

    /// One level: choose among the children; when the chosen child cannot
    /// host the task after all, drop it and choose again.
    fn walk(
        &self,
        g: &Group,
        depth: usize,
        req: &ClusterRequest,
        node_agg: &impl Fn(&str) -> Option<NodeAgg>,
        compared: &mut u32,
        level: &mut String,
    ) -> Option<String> {
        let local_key = req
            .origin
            .as_ref()
            .map(|(path, node)| match path.get(depth) {
                Some(k) => k.clone(),
                None => node.clone(),
            });
        if depth == self.config.levels.len() {
            // The names are copied out of the group's lock first: the
            // aggregates are read under the remote nodes' lock, which
            // `remote_put` holds while it takes the group's.
            let names = g.own_nodes();
            let cands = names
                .iter()
                .filter_map(|id| node_agg(id).map(|a| (id.as_str(), a, 1, id.as_str())));
            let (node, n, moved) =
                choose(self.config.node_imbalance_pct, cands, local_key.as_deref())?;
            let node = node.to_string();
            *compared += n;
            if moved && level == "none" {
                *level = "node".into();
            }
            return Some(node);
        }
        let lvl = &self.config.levels[depth];
        let mut cands: Vec<(String, NodeAgg, i64, Arc<Group>)> = g
            .children
            .read()
            .expect("children")
            .iter()
            .filter_map(|(k, c)| {
                let acc = c.acc.lock().unwrap_or_else(PoisonError::into_inner);
                let a = acc.agg();
                let selected = req
                    .selector
                    .iter()
                    .all(|(sk, sv)| *sk != lvl.label || sv == k);
                (acc.nodes > 0 && a.nr_cpus as usize > req.first_allowed_cpu && selected)
                    .then(|| (k.clone(), a, acc.nodes, Arc::clone(c)))
            })
            .collect();
        while !cands.is_empty() {
            let (choice, n, moved) = choose(
                lvl.imbalance_pct,
                cands.iter().cloned(),
                local_key.as_deref(),
            )?;
            *compared += n;
            let before = level.clone();
            if moved && (level == "none" || level == "node") {
                *level = lvl.label.clone();
            }
            if let Some(node) = self.walk(&choice, depth + 1, req, node_agg, compared, level) {
                return Some(node);
            }
            *level = before;
            cands.retain(|c| !Arc::ptr_eq(&c.3, &choice));
        }
        None
    }
}

/// The end of `sched_balance_find_dst_group()` at a cluster level: the
/// kernel's rule with a NUMA level's allowance. A node plays the part of an
/// LLC: the allowance is the local group's node count, or for a one-node
/// group an eighth of its CPUs (at least 1), as `imb_numa_nr` is built.
fn leave_local(pct: u32, local: &NodeAgg, local_nodes: i64, idlest: &NodeAgg) -> bool {
    let allowed = if local_nodes == 1 {
        (local.sum.cpus >> 3).max(1)
    } else {
        local_nodes
    };
    let d = DstDomain {
        imbalance_pct: pct,
        numa: true,
        allowed,
        pref: NumaPref::None,
    };
    leave_local_group(&d, &local.stats(pct), &idlest.stats(pct))
}

/// One level of the walk: the idlest candidate (first in order on ties), or
/// the local one when the rules keep the task there. Returns the choice, the
/// number of candidates compared, and whether it left the local group.
fn choose<K: AsRef<str>, T>(
    pct: u32,
    cands: impl Iterator<Item = (K, NodeAgg, i64, T)>,
    local_key: Option<&str>,
) -> Option<(T, u32, bool)> {
    let mut n = 0;
    let mut idlest: Option<(NodeAgg, T)> = None;
    let mut local: Option<(NodeAgg, i64, T)> = None;
    for (k, a, nodes, t) in cands {
        n += 1;
        if Some(k.as_ref()) == local_key {
            local = Some((a, nodes, t));
            continue;
        }
        match &idlest {
            Some((best, _)) if !update_pick_idlest(&best.stats(pct), &a.stats(pct)) => {}
            _ => idlest = Some((a, t)),
        }
    }
    match (local, idlest) {
        (None, Some((_, t))) => Some((t, n, false)),
        (Some((_, _, t)), None) => Some((t, n, false)),
        (Some((la, ln, lt)), Some((ia, it))) => {
            if leave_local(pct, &la, ln, &ia) {
                Some((it, n, true))
            } else {
                Some((lt, n, false))
            }
        }
        (None, None) => None,
    }
}

/// The same walk from scratch: every counted node's aggregate recomputed
/// from its per-CPU state, the groups summed per request. The baseline of
/// the benchmark and the oracle of the differential test.
/// A counted node for [`naive_pick`]: id, labels, its aggregate recomputed
/// from its per-CPU state, and whether it can run the task.
pub type NaiveNode = (String, Vec<(String, String)>, NodeAgg, bool);

/// The naive walk over `nodes`.
pub fn naive_pick(
    config: &ClusterConfig,
    req: &ClusterRequest,
    nodes: &[NaiveNode],
) -> Option<ClusterChoice> {
    let c = Hierarchy::new(config.clone());
    for (id, labels, a, _) in nodes {
        c.contribute(&c.path(labels), id, a, 1);
    }
    let by_id: BTreeMap<&str, (NodeAgg, bool)> = nodes
        .iter()
        .map(|(id, _, a, h)| (id.as_str(), (*a, *h)))
        .collect();
    c.pick(req, |id| by_id.get(id).filter(|(_, h)| *h).map(|(a, _)| *a))
}
