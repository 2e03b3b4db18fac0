//! A cluster-level balance pass as the store serves it: the request is
//! checked against the hierarchy, the fresh members' published states are
//! handed to the engine's balancer ([`crate::engine::balance::cluster`]),
//! and with `apply` the destinations are claimed. The store keeps only the
//! state between passes (the failure counts); the balancing is the
//! engine's.

use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::Instant;

use crate::engine::balance::cluster::{
    ClusterBalanceOutcome, ClusterLevel, ClusterMember, cluster_balance,
};
use crate::engine::topology::FieldError;
use crate::quote::quote;

use super::Cluster;

/// The group's nodes that other replicas hold, fetched from their owners
/// for one pass ([`Cluster::peer_member`]), by id.
pub type PeerMembers = HashMap<String, ClusterMember>;

#[derive(Debug, Clone, Default)]
pub struct ClusterBalanceRequest {
    /// A hierarchy label (`zone`, `rack`).
    pub level: String,
    /// The group's label values from the top, joined by `/` (`z1/r3`).
    pub group: String,
    pub apply: bool,
    pub max_proposals: usize,
}

impl Cluster {
    /// One periodic balance across the members of a cluster group: the
    /// nodes registered here and, with replicas, `peers` (the group's
    /// nodes other replicas hold). With `apply`, the destinations on nodes
    /// registered here are claimed; the caller claims the others at their
    /// owners.
    pub fn balance(
        &self,
        req: &ClusterBalanceRequest,
        mut peers: PeerMembers,
        now: Instant,
    ) -> Result<ClusterBalanceOutcome, FieldError> {
        let (li, path) = self.cluster_level_of(req)?;
        let Some(group) = self.hierarchy.group(&path) else {
            return Err(FieldError::new(
                "cluster_group",
                format!("no {} {} has nodes", req.level, quote(&req.group)),
            ));
        };
        // The children: nodes at the last level, groups above it.
        let levels = &self.hierarchy.config.levels;
        let child_nodes: Vec<Vec<String>> = if li + 1 == levels.len() {
            group.all_nodes().into_iter().map(|id| vec![id]).collect()
        } else {
            let groups = group.child_groups();
            groups.into_iter().map(|(_, c)| c.all_nodes()).collect()
        };
        let mut members = Vec::new();
        let mut children = Vec::new();
        for ids in child_nodes {
            let v = self.fresh_members(ids, now, &mut peers, &mut members);
            if !v.is_empty() {
                children.push(v);
            }
        }
        let level = ClusterLevel {
            label: req.level.clone(),
            imbalance_pct: levels[li].imbalance_pct,
            migration_cost_ns: self.migration_cost_ns,
            max_proposals: req.max_proposals,
        };
        let mut out = {
            let mut failed = self.lb.lock().unwrap_or_else(PoisonError::into_inner);
            cluster_balance(&level, members, &children, &mut failed)
        };
        if req.apply {
            out.claimed = self.claim_destinations(&out, now);
        }
        Ok(out)
    }

    /// The level's index and the group's path, or the field that is wrong.
    fn cluster_level_of(
        &self,
        req: &ClusterBalanceRequest,
    ) -> Result<(usize, Vec<String>), FieldError> {
        let levels = &self.hierarchy.config.levels;
        let Some(li) = levels.iter().position(|l| l.label == req.level) else {
            let names: Vec<&str> = levels.iter().map(|l| l.label.as_str()).collect();
            return Err(FieldError::new(
                "cluster_level",
                format!(
                    "{} is not a level (levels: {})",
                    quote(&req.level),
                    names.join(", ")
                ),
            ));
        };
        let path: Vec<String> = req.group.split('/').map(str::to_string).collect();
        if path.len() != li + 1 {
            return Err(FieldError::new(
                "cluster_group",
                format!(
                    "{} must name {} label value(s) from the top, joined by '/'",
                    quote(&req.group),
                    li + 1
                ),
            ));
        }
        Ok((li, path))
    }

    /// The group's nodes that no registration here holds: with replicas,
    /// the nodes other replicas publish, whose state the pass must fetch.
    pub fn peer_nodes(&self, req: &ClusterBalanceRequest) -> Result<Vec<String>, FieldError> {
        let (_, path) = self.cluster_level_of(req)?;
        let Some(group) = self.hierarchy.group(&path) else {
            return Ok(Vec::new());
        };
        let mut ids = group.all_nodes();
        ids.retain(|id| self.table.get(id).is_none());
        Ok(ids)
    }

    /// Appends the fresh nodes among `ids` to `members` (a node registered
    /// here from its snapshot, another replica's from `peers`); their
    /// indices.
    fn fresh_members(
        &self,
        ids: Vec<String>,
        now: Instant,
        peers: &mut PeerMembers,
        members: &mut Vec<ClusterMember>,
    ) -> Vec<usize> {
        let mut idx = Vec::new();
        for id in ids {
            let Some(n) = self.table.get(&id) else {
                if let Some(m) = peers.remove(&id) {
                    idx.push(members.len());
                    members.push(m);
                }
                continue;
            };
            let snap = n.snapshot();
            if !self.table.is_fresh(&snap, now) {
                continue;
            }
            idx.push(members.len());
            members.push(ClusterMember {
                id,
                topo: snap.topo.clone(),
                cpus: snap.state.cpus.clone(),
                tasks: snap.tasks.clone(),
                util_est: snap.features.util_est,
                agg: snap.agg,
            });
        }
        idx
    }

    /// Claims each proposal's destination CPU on its node, where the node
    /// is registered here.
    fn claim_destinations(&self, out: &ClusterBalanceOutcome, now: Instant) -> u32 {
        let mut by_node: HashMap<&str, Vec<usize>> = HashMap::new();
        for p in &out.proposals {
            by_node.entry(&p.dst_node).or_default().push(p.dst_cpu);
        }
        let mut claimed = 0;
        for (id, cpus) in by_node {
            if let Some(n) = self.table.get(id) {
                claimed += self.nodes.claim_cpus(&n, &cpus, now);
            }
        }
        claimed
    }
}
