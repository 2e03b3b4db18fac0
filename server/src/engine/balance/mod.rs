//! Load balancing: the periodic balancer of one node (`periodic`), the
//! migration rules it asks (`migrate`: `can_migrate_task`), the group
//! arithmetic it decides with (`lb`), and the same balancer run with nodes
//! as groups (`cluster`).
//!
//! Balancing depends on the cache-aware accounting (`crate::engine::cache`)
//! for its LLC preferences and on the shared group rules
//! (`crate::engine::group`); nothing below it depends on balancing.

pub mod lb;
pub mod migrate;
mod periodic;
pub mod src_rq;

pub use periodic::*;
pub mod cluster;
