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

use super::Store;
use crate::engine::cpumask::CpuMask;
use crate::engine::group::NodeAgg;

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
}
