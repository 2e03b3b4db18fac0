//! Cluster placement: the walk down the hierarchy (`Cluster::pick`), one
//! level at a time with the kernel's slow-path rules over the incremental
//! sums, its naive recomputation for the tests and benchmarks, and the
//! store's pick with each candidate node's current aggregate read from its
//! snapshot.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use super::{Cluster, ClusterChoice, ClusterConfig, ClusterRequest, Group};
use crate::engine::cpumask::CpuMask;
use crate::engine::group::NodeAgg;
use crate::engine::group::{DstDomain, NumaPref, leave_local_group, update_pick_idlest};

use crate::store::Store;

impl Store {
    /// Places a task with no node: the kernel's slow path over the cluster
    /// levels, with the incremental group sums.
    pub fn cluster_pick(&self, req: &ClusterRequest, allowed: &CpuMask) -> Option<ClusterChoice> {
        self.cluster_pick_excluding(req, allowed, &[])
    }

    /// The same, with the nodes in `excluded` out of the choice (their
    /// owners refused a placement chosen from their published figures).
    /// Other replicas' nodes (`store::remote`) are candidates beside the
    /// local ones.
    pub fn cluster_pick_excluding(
        &self,
        req: &ClusterRequest,
        allowed: &CpuMask,
        excluded: &[String],
    ) -> Option<ClusterChoice> {
        let now = Instant::now();
        self.cluster.pick(req, |id| {
            if excluded.iter().any(|x| x == id) {
                return None;
            }
            let Some(n) = self.get(id) else {
                let r = self.remote_node(id)?;
                return r.online.intersects(allowed).then_some(r.agg);
            };
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
        crate::store::cluster::naive_pick(&self.cluster.config, req, &nodes)
    }
}

impl Cluster {
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
            let names = g.own_nodes();
            let cands: Vec<(String, NodeAgg, i64, String)> = names
                .into_iter()
                .filter_map(|id| node_agg(&id).map(|a| (id.clone(), a, 1, id)))
                .collect();
            let (node, n, moved) = choose(
                self.config.node_imbalance_pct,
                cands.into_iter(),
                local_key.as_deref(),
            )?;
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
fn choose<T>(
    pct: u32,
    cands: impl Iterator<Item = (String, NodeAgg, i64, T)>,
    local_key: Option<&str>,
) -> Option<(T, u32, bool)> {
    let mut n = 0;
    let mut idlest: Option<(NodeAgg, T)> = None;
    let mut local: Option<(NodeAgg, i64, T)> = None;
    for (k, a, nodes, t) in cands {
        n += 1;
        if Some(k.as_str()) == local_key {
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
    let c = Cluster::new(config.clone());
    for (id, labels, a, _) in nodes {
        c.contribute(&c.path(labels), id, a, 1);
    }
    let by_id: BTreeMap<&str, (NodeAgg, bool)> = nodes
        .iter()
        .map(|(id, _, a, h)| (id.as_str(), (*a, *h)))
        .collect();
    c.pick(req, |id| by_id.get(id).filter(|(_, h)| *h).map(|(a, _)| *a))
}
