//! What the store shows a recorder (the server's `record` module): every
//! snapshot a node publishes, at the moment it is published.
//!
//! The store cannot name the recorder (the recorder reads the store), so
//! it holds whatever implements [`Tap`], installed once; a store nobody
//! taps pays one atomic load per publish.

use std::sync::Arc;

use arc_swap::ArcSwapOption;

use super::{Node, Snapshot};

/// Sees each node's snapshots as they are published.
pub trait Tap: Send + Sync {
    /// `snap` is `node`'s next snapshot. Called under the node's writer,
    /// before any reader can load it: whatever a tap is told of a decision
    /// made on this snapshot, it is told after this. `report` says the
    /// agent's report made it (not a claim, a lease or an expiry).
    fn published(&self, node: &Node, snap: &Arc<Snapshot>, report: bool);
}

/// The store's one tap, if any.
#[derive(Default)]
pub struct TapSlot(ArcSwapOption<Box<dyn Tap>>);

impl TapSlot {
    /// Installs `tap` (replacing any other).
    pub fn install(&self, tap: Arc<dyn Tap>) {
        self.0.store(Some(Arc::new(Box::new(Forward(tap)))));
    }

    pub(super) fn published(&self, node: &Node, snap: &Arc<Snapshot>, report: bool) {
        if let Some(t) = self.0.load().as_ref() {
            t.published(node, snap, report);
        }
    }
}

/// An `Arc<dyn Tap>` behind the slot's box.
struct Forward(Arc<dyn Tap>);

impl Tap for Forward {
    fn published(&self, node: &Node, snap: &Arc<Snapshot>, report: bool) {
        self.0.published(node, snap, report);
    }
}
