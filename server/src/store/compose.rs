//! [`Store`]: the owners of the state, built once and held together. Each
//! owner is made with what it needs of the configuration and of the others
//! (the node table, the hierarchy's sums, the lease component), so what
//! an owner may touch is written in its constructor; the service holds the
//! composition and calls the owner a request concerns.

use std::sync::Arc;
use std::time::Instant;

use super::cluster::Cluster;
use super::features::Switches;
use super::hierarchy::Hierarchy;
use super::leases::Leases;
use super::leases::log::{LeaseLog, MemoryLog};
use super::nodes::Nodes;
use super::passes::Passes;
use super::report::{Applied, Reject, Update};
use super::{Node, StoreConfig, Table};

/// Every node's state and every lease, by owner.
pub struct Store {
    pub config: StoreConfig,
    pub nodes: Arc<Nodes>,
    pub leases: Arc<Leases>,
    pub cluster: Cluster,
    pub passes: Passes,
    pub switches: Arc<Switches>,
    /// Where a recorder is told of every published snapshot.
    pub tap: Arc<super::tap::TapSlot>,
}

impl Store {
    /// A store whose leases live in memory only.
    pub fn new(config: StoreConfig) -> Self {
        Self::with_log(config, Arc::new(MemoryLog))
    }

    /// A store whose leases are committed to `log` (load them with
    /// [`Leases::load_leases`] before serving).
    pub fn with_log(config: StoreConfig, log: Arc<dyn LeaseLog>) -> Self {
        let hierarchy = Arc::new(Hierarchy::new(config.cluster.clone()));
        let tap = Arc::new(super::tap::TapSlot::default());
        let table = Arc::new(Table::new(
            &config,
            Arc::clone(&hierarchy),
            Arc::clone(&tap),
        ));
        let switches = Arc::new(Switches::default());
        let leases = Arc::new(Leases::new(
            Arc::clone(&table),
            log,
            config.lease_limits,
            config.tombstone_min_keep,
        ));
        let nodes = Arc::new(Nodes::new(
            &config,
            Arc::clone(&table),
            Arc::clone(&switches),
            Arc::clone(&leases),
        ));
        let cluster = Cluster::new(
            hierarchy,
            Arc::clone(&table),
            Arc::clone(&nodes),
            config.system.migration_cost_ns,
        );
        let passes = Passes::new(&config, table, Arc::clone(&nodes));
        Self {
            config,
            nodes,
            leases,
            cluster,
            passes,
            switches,
            tap,
        }
    }

    /// The one way in for an agent's report: checked whole and applied to
    /// the node (or refused, the node unchanged), then its runtime
    /// accounted by the cache-aware state. What changed comes back for the
    /// caller to record.
    pub fn report(
        &self,
        node: &Node,
        generation: u64,
        u: &Update,
        now: Instant,
    ) -> Result<Applied, Reject> {
        let (version, rebuilt) = self.nodes.apply_update(node, generation, u, now)?;
        let scans = self.passes.account(node, &u.runtime, now);
        Ok(Applied {
            version,
            seq: u.seq,
            full: u.full,
            cpus: u.cpus.len(),
            tasks: u.tasks.iter().map(|l| l.tasks.len()).sum(),
            rebuilt,
            scans,
        })
    }
}
