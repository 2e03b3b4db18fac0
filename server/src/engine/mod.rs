//! The decision engine: the Linux fair class's placement and migration
//! algorithms over one node's read-only state.
//!
//! The engine is pure: it knows nothing of gRPC, the store, time or metrics.
//! `decide`, the service and the benchmarks all call the same functions:
//! [`select_task_rq`] for wakeup, fork and exec, and [`can_migrate_task`].

pub mod alloc;
pub mod balance;
pub mod cache;
pub(crate) mod ctx;
pub mod decision;
pub mod features;
pub mod group;
pub mod placement;
pub mod resolve;
pub mod rq;
pub mod state;
pub mod topology;
pub mod v6_12;

pub use fairplace_types::cpumask;

pub use balance::migrate::can_migrate_task;
pub use ctx::View;
pub use placement::core::select_task_rq;
