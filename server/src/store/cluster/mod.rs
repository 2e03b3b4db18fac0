//! The cluster owner: the kernel's slow path and periodic balancer applied
//! above the nodes, over the hierarchy's incrementally kept sums
//! ([`crate::store::hierarchy`]). A placement with no node walks down the
//! hierarchy (`pick`), then the chosen node's own slow path picks the CPU;
//! a cluster balance pass hands a group's fresh members to the engine's
//! balancer (`pass`). The algorithms they run are the engine's
//! (`engine::group`, `engine::balance::cluster`); the only state kept here
//! is the cluster levels' failure counts between passes.
//!
//! Other replicas' nodes enter here: their owners' publications are
//! counted in the hierarchy ([`Cluster::remote_put`]) and, for a pass, their
//! whole state is checked as an agent's report would be
//! ([`Cluster::peer_member`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::Table;
use super::hierarchy::{Hierarchy, RemoteNode};
use super::nodes::Nodes;
use super::report::{self, Update};
use crate::engine::balance::cluster::ClusterMember;
use crate::engine::cpumask::CpuMask;
use crate::engine::group::NodeAgg;
use crate::engine::topology::{FieldError, TopologySpec};

mod pass;
mod pick;

pub use pass::{ClusterBalanceRequest, PeerMembers};

/// Cluster picks and passes over the hierarchy.
pub struct Cluster {
    /// Zones, racks and nodes, with their sums (local and remote nodes).
    pub hierarchy: Arc<Hierarchy>,
    table: Arc<Table>,
    nodes: Arc<Nodes>,
    /// `nr_balance_failed` of the cluster levels, by (destination node, level).
    lb: Mutex<HashMap<(String, String), u32>>,
    migration_cost_ns: i64,
}

impl Cluster {
    pub(super) fn new(
        hierarchy: Arc<Hierarchy>,
        table: Arc<Table>,
        nodes: Arc<Nodes>,
        migration_cost_ns: i64,
    ) -> Self {
        Self {
            hierarchy,
            table,
            nodes,
            lb: Mutex::new(HashMap::new()),
            migration_cost_ns,
        }
    }

    /// Counts (or updates) another replica's node; ignored while the node
    /// is registered here (a node is never counted twice).
    pub fn remote_put(&self, id: &str, labels: &[(String, String)], n: RemoteNode) {
        if self.table.get(id).is_some() {
            return;
        }
        self.hierarchy.remote_put(id, labels, n);
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
        report::check_update_cpus(&spec, u)?;
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
        let spec = self.table.intern_spec(spec);
        let topo = self.table.topology(&spec, &online)?;
        let empty = self.table.empty_tasks(n);
        let tasks = report::merge(&empty, u, n, &online, &empty)?;
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
