//! Placement: where a waking, forking or exec'ing task runs.
//!
//! `core` is `select_task_rq()` and its fallbacks, `fair` the wakeup path's
//! affine decisions and domain walk, `sis` `select_idle_sibling()` with its
//! scans, `slowpath` the fork/exec search down the domains. Placement reads
//! the node's state through [`crate::engine::ctx::Ctx`] and the shared group
//! rules in [`crate::engine::group`]; it never reaches into the balancer.

pub mod core;
pub mod fair;
pub mod sis;
pub mod slowpath;
