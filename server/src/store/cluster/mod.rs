//! Cluster placement: the kernel's slow path applied above the nodes. The
//! hierarchy and its locked, incrementally kept sums live here, in the
//! store; the store's picks and passes over it are `pick.rs` and `pass.rs`;
//! the algorithms they run are the engine's (`engine::group`,
//! `engine::balance::cluster`).
//!
//! Zones, racks (the levels are node labels, configurable) and nodes are the
//! levels above each node's own NUMA / LLC / core domains. A placement with
//! no node walks down from the top: at each level the groups' statistics are
//! compared with the kernel's own rules, the same code the node slow path
//! runs ([`crate::engine::group`]: `group_classify`, `update_pick_idlest`,
//! the local-versus-idlest test with its NUMA allowance), then the
//! chosen node's own slow path picks the CPU.
//!
//! The group statistics are kept incrementally: every published snapshot
//! carries its node's [`NodeAgg`] (the engine's), and the store adds the difference to the
//! node's ancestor groups, O(depth) per report; a pick reads each group's
//! sums in O(1). [`naive_pick`] recomputes everything from the per-CPU state
//! and must agree.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

use crate::engine::group::NodeAgg;
use crate::engine::state::GroupSum;

pub(super) mod pass;
mod pick;

pub use pick::naive_pick;

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

/// The hierarchy and its incrementally kept sums.
#[derive(Debug, Default)]
pub struct Cluster {
    pub config: ClusterConfig,
    root: Arc<Group>,
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

impl Cluster {
    pub fn new(config: ClusterConfig) -> Self {
        Self {
            config,
            root: Arc::new(Group::default()),
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
