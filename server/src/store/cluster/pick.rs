//! Cluster placement as the store serves it: the hierarchy's incremental
//! sums walked by [`super`], with each candidate node's current
//! aggregate read from its snapshot.

use std::time::Instant;

use crate::engine::cpumask::CpuMask;
use crate::engine::group::NodeAgg;
use crate::store::cluster::{ClusterChoice, ClusterRequest};

use crate::store::Store;

impl Store {
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
        crate::store::cluster::naive_pick(&self.cluster.config, req, &nodes)
    }
}
