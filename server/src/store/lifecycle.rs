//! Node lifecycle: freshness, counting in the cluster sums while fresh,
//! and forgetting nodes whose agent went away or fell silent.

use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Instant;

use crate::engine::group::NodeAgg;

use super::{Node, Snapshot, Store, Writer};

impl Store {
    /// Moves the node's contribution to the cluster sums from what it was
    /// to `now` (`None`: not counted).
    pub(super) fn recount(&self, node: &Node, w: &mut Writer, now: Option<NodeAgg>) {
        if let Some((path, old)) = w.counted.take() {
            self.cluster.contribute(&path, &node.id, &old, -1);
        }
        if let Some(a) = now {
            let path = self.cluster.path(&node.labels);
            self.cluster.contribute(&path, &node.id, &a, 1);
            w.counted = Some((path, a));
        }
    }

    /// Stops counting nodes that went stale; returns how many.
    pub fn uncount_stale(&self, now: Instant) -> usize {
        let mut n = 0;
        for node in self.unsorted_nodes() {
            // A fresh node stays counted: no lock needed to know.
            if self.is_fresh(&node.snapshot(), now) {
                continue;
            }
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.counted.is_some() && !self.is_fresh(&node.snapshot(), now) {
                self.recount(&node, &mut w, None);
                n += 1;
            }
        }
        n
    }

    pub fn is_fresh(&self, snap: &Snapshot, now: Instant) -> bool {
        snap.age(now).is_some_and(|a| a <= self.config.stale_after)
    }

    /// Forgets nodes that have not reported for `forget_after`, whether or
    /// not a stream is still open for them: an open but silent stream does
    /// not keep its node (its next update is refused and the stream ends).
    pub fn forget_stale(&self, now: Instant) -> usize {
        let limit = self.config.forget_after;
        let before = self.nodes.len();
        self.nodes.retain(|_, n| {
            let s = n.snapshot();
            let since = s.reported_at.unwrap_or(n.registered_at);
            let keep = now.saturating_duration_since(since) <= limit;
            if !keep {
                self.retire(n);
            }
            keep
        });
        before - self.nodes.len()
    }

    /// Forgets `node` if `generation` is still its registration.
    pub fn forget_node(&self, node: &Node, generation: u64) {
        let removed = self.nodes.remove_if(&node.id, |_, n| {
            std::ptr::eq(Arc::as_ptr(n), node) && n.generation.load(Ordering::SeqCst) == generation
        });
        if let Some((_, n)) = removed {
            self.retire(&n);
        }
    }

    /// A replica handing `node` over to another (or losing its claim on
    /// it): the node leaves the store, and its leases leave memory without
    /// ending; the replicated log keeps them for the next owner. Returns
    /// how many leases were let go.
    pub fn let_go(&self, node: &str) -> usize {
        if let Some((_, n)) = self.nodes.remove(node) {
            self.retire(&n);
        }
        self.let_go_leases(node)
    }

    /// A node leaving the store: out of the cluster sums, and its stream's
    /// registration void, so a late update is refused.
    pub(super) fn retire(&self, n: &Node) {
        let mut w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
        self.recount(n, &mut w, None);
        // Its leases outlive the registration: parked until the node is
        // back or they expire.
        self.park_leases(&n.id, &mut w);
        let g = self.next_generation.fetch_add(1, Ordering::Relaxed);
        n.generation.store(g, Ordering::SeqCst);
        n.connected.store(false, Ordering::SeqCst);
    }

    pub fn disconnect(&self, node: &Node, generation: u64) {
        if node.generation.load(Ordering::SeqCst) == generation {
            node.connected.store(false, Ordering::SeqCst);
        }
    }
}
