//! Cluster placement: the hierarchy's walk ([`crate::store::hierarchy::Hierarchy::pick`]) with each
//! candidate node's current aggregate read from its snapshot, or from its
//! owner's publication for another replica's node, and the same choice
//! recomputed naively for the tests and benchmarks.

use std::time::Instant;

use super::Cluster;
use crate::engine::cpumask::CpuMask;
use crate::engine::group::NodeAgg;
use crate::store::hierarchy::{ClusterChoice, ClusterRequest, naive_pick};

impl Cluster {
    /// Places a task with no node: the kernel's slow path over the cluster
    /// levels, with the incremental group sums.
    pub fn pick(&self, req: &ClusterRequest, allowed: &CpuMask) -> Option<ClusterChoice> {
        self.pick_excluding(req, allowed, &[])
    }

    /// The same, with the nodes in `excluded` out of the choice (their
    /// owners refused a placement chosen from their published figures).
    /// Other replicas' nodes (counted in the hierarchy) are candidates beside the
    /// local ones.
    pub fn pick_excluding(
        &self,
        req: &ClusterRequest,
        allowed: &CpuMask,
        excluded: &[String],
    ) -> Option<ClusterChoice> {
        let now = Instant::now();
        self.hierarchy.pick(req, |id| {
            if excluded.iter().any(|x| x == id) {
                return None;
            }
            let Some(n) = self.table.get(id) else {
                return self.hierarchy.remote_agg(id, allowed);
            };
            let s = n.snapshot();
            (self.table.is_fresh(&s, now) && s.topo.online.intersects(allowed)).then_some(s.agg)
        })
    }

    /// The same choice recomputed from every node's per-CPU state.
    pub fn naive_pick(&self, req: &ClusterRequest, allowed: &CpuMask) -> Option<ClusterChoice> {
        let now = Instant::now();
        let nodes: Vec<_> = self
            .table
            .nodes()
            .iter()
            .filter_map(|n| {
                let s = n.snapshot();
                self.table.is_fresh(&s, now).then(|| {
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
        naive_pick(&self.hierarchy.config, req, &nodes)
    }
}
