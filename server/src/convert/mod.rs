//! The edge between protobuf and the engine: messages become engine types
//! here, with errors that name the field, so the engine never sees protobuf.
//! One file per kind of message (`report`, `request`, `balance`); the
//! helpers every direction shares (cpulists, CPU ids, signals, the policy
//! mapping) are in `fields`.

mod balance;
mod fields;
mod report;
mod request;

pub use balance::{
    balance_cpus, balance_response, cluster_balance_response, migration_type_to_pb, proposal_to_pb,
};
pub use report::{
    cpu_state, cpu_state_to_pb, cpu_states_to_pb, task_lists_to_pb, topology_spec, topology_to_pb,
    update,
};
pub use request::{
    PickAnswer, Picked, migrate_request, migrate_response, pick_request, pick_response, selector,
    task,
};

/// Quoting client strings in errors (kept here for the service's callers).
pub use crate::quote::{QUOTE_BYTES, field_key, quote};
pub use fields::invalid;
