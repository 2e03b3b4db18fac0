//! Lookups every handler makes before it decides: the registered node a
//! request names, and its snapshot if fresh enough to decide on, each
//! refused with the status and field a caller can act on.

use std::sync::Arc;
use std::time::Instant;

use crate::convert;
use crate::store::{Node, Snapshot, Store};

/// The registered node `id` names: INVALID_ARGUMENT when empty, NOT_FOUND
/// when no such node is registered (both naming `node_id`).
pub fn registered_node(store: &Store, id: &str) -> Result<Arc<Node>, tonic::Status> {
    if id.is_empty() {
        return Err(tonic::Status::invalid_argument(
            "node_id: must not be empty",
        ));
    }
    store.nodes.get(id).ok_or_else(|| {
        tonic::Status::not_found(format!(
            "node_id: no node {} is registered",
            convert::quote(id)
        ))
    })
}

/// The node's current snapshot and its age, refused (FAILED_PRECONDITION)
/// when it has none yet or is stale.
pub fn fresh_snapshot(
    store: &Store,
    node: &Node,
    now: Instant,
) -> Result<(Arc<Snapshot>, f64), tonic::Status> {
    let snap = node.snapshot();
    match snap.age(now) {
        None => Err(tonic::Status::failed_precondition(format!(
            "node {} has not reported its state yet",
            convert::quote(&node.id)
        ))),
        Some(age) if age > store.config.stale_after => {
            Err(tonic::Status::failed_precondition(format!(
                "node {} is stale: last report {:.3} s ago (TTL {:.3} s)",
                convert::quote(&node.id),
                age.as_secs_f64(),
                store.config.stale_after.as_secs_f64()
            )))
        }
        Some(age) => Ok((snap, age.as_secs_f64())),
    }
}
