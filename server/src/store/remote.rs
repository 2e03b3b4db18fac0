//! Nodes other replicas own, as far as a cluster decision here needs them:
//! their aggregates (what the cluster levels sum), published by their
//! owners (the replicas' aggregate streams) and counted in this store's
//! cluster hierarchy beside the local nodes, so a placement with no node
//! sees the whole cluster wherever it is asked.
//!
//! A remote node is never decided on here: the choice goes to its owner,
//! which places the task on its live state and may refuse (the figures
//! here are up to 100 ms old). A node that is local here is never counted
//! as remote as well: registering it drops its remote entry, and a remote
//! update for a local node is ignored.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::{Store, Update, ingest, tasks};
use crate::engine::balance::cluster::ClusterMember;
use crate::engine::cpumask::CpuMask;
use crate::engine::group::NodeAgg;
use crate::engine::topology::{FieldError, TopologySpec};

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

/// Remote nodes by id.
#[derive(Debug, Default)]
pub struct RemoteNodes {
    nodes: Mutex<HashMap<String, RemoteNode>>,
}

impl RemoteNodes {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, RemoteNode>> {
        self.nodes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn get(&self, id: &str) -> Option<RemoteNode> {
        self.lock().get(id).cloned()
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

impl Store {
    /// Counts (or updates) another replica's node; ignored while the node
    /// is registered here.
    pub fn remote_put(&self, id: &str, labels: &[(String, String)], n: RemoteNode) {
        if self.get(id).is_some() {
            return;
        }
        let mut nodes = self.remote.lock();
        if let Some(old) = nodes.remove(id) {
            self.cluster.contribute(&old.path, id, &old.agg, -1);
        }
        let path = self.cluster.path(labels);
        let n = RemoteNode { path, ..n };
        self.cluster.contribute(&n.path, id, &n.agg, 1);
        nodes.insert(id.to_string(), n);
    }

    /// Stops counting another replica's node (gone there, or local now).
    pub fn remote_remove(&self, id: &str) {
        if let Some(old) = self.remote.lock().remove(id) {
            self.cluster.contribute(&old.path, id, &old.agg, -1);
        }
    }

    /// Stops counting every node `replica` published except `keep` (a full
    /// publication, or `keep` empty: the replica is gone).
    pub fn remote_retain(&self, replica: &str, keep: &std::collections::HashSet<String>) {
        let mut nodes = self.remote.lock();
        let gone: Vec<String> = nodes
            .iter()
            .filter(|(id, n)| n.replica == replica && !keep.contains(*id))
            .map(|(id, _)| id.clone())
            .collect();
        for id in gone {
            if let Some(old) = nodes.remove(&id) {
                self.cluster.contribute(&old.path, &id, &old.agg, -1);
            }
        }
    }

    /// The remote node `id`, if counted: its owner publishes only fresh
    /// nodes and says when one goes stale, and a subscription that breaks
    /// takes its replica's nodes with it.
    pub fn remote_node(&self, id: &str) -> Option<RemoteNode> {
        self.remote.get(id)
    }

    /// Another replica's node as a cluster balance pass here reads it: the
    /// topology, CPUs and tasks its owner stores, sent as a full report
    /// (`u`) and checked as an agent's would be, with the owner's sums.
    pub fn peer_member(
        &self,
        id: &str,
        spec: TopologySpec,
        u: &Update,
        util_est: bool,
        agg: NodeAgg,
    ) -> Result<ClusterMember, FieldError> {
        spec.validate("topology")?;
        if !u.full {
            return Err(FieldError::new(
                "update.full",
                "a node's state is a full snapshot",
            ));
        }
        ingest::check_update_cpus(&spec, u)?;
        let n = spec.cpus.len();
        let mut cpus = vec![u.cpus[0].1; n];
        let mut online = CpuMask::new();
        for &(cpu, c) in &u.cpus {
            cpus[cpu as usize] = c;
            if c.online {
                online.set(cpu as usize);
            }
        }
        if online.is_empty() {
            return Err(FieldError::new("update.cpus", "no CPU is online"));
        }
        let spec = self.intern_spec(spec);
        let topo = self.topology(&spec, &online)?;
        let empty = self.empty_tasks(n);
        let tasks = tasks::merge(&empty, u, n, &online, &empty)?;
        Ok(ClusterMember {
            id: id.to_string(),
            topo,
            cpus,
            tasks,
            util_est,
            agg,
        })
    }
}
