//! fairplace: placement decisions with the Linux kernel's fair-class
//! algorithms, as a library (the decision engine and the scenario format)
//! and, in the binary, as a server.
//!
//! # Layout
//!
//! From the bottom up; each folder uses only those above it in this list
//! (the module-graph test keeps it so), and data flows down the list for a
//! request and back up for its answer.
//!
//! | module | owns | uses |
//! |---|---|---|
//! | `engine/` | the kernel's algorithms over one node's state, step by step as in `fair.c`; pure: no I/O, no locks, no protobuf | nothing of the crate |
//! | `metrics/`, `metrics.rs`, `pem.rs` | the metric names and their rendering; PEM reading | engine |
//! | `offline/` | the scenario format `fairplace-server decide` reads, and the dev PKI | engine |
//! | `store/` | the live state, by owner: nodes (reports, claims, lifecycle), leases (the lease component), the cluster hierarchy, each node's balancer and cache state, the feature switches; `Store` composes them | engine |
//! | `convert/` | protobuf to engine types and back, with errors that name the field | engine, store |
//! | `identity.rs` | who may call what: the caller's identity and the one role table | nothing |
//! | `replica/` | several servers sharing the nodes through etcd: ownership, the lease log in etcd, which replica answers a call and the forwarding to it, what replicas serve each other | store, convert, identity |
//! | `record/` | recordings: every published node state (told by the store's `tap`) and every decision, written by one thread as checksummed segments; `replay/` decides them again under each switch setting | store, convert, engine |
//! | `transport/` | sockets to messages: listeners, TLS, tower layers, the hand-framed fast paths (PickCpu, Ping, the agents' Report streams), the metrics port; it knows no handler | convert, identity |
//! | `service/` | the RPC handlers: a decoded message in, an answer out, over the store; the fast paths reach them through the traits `transport/` declares | store, convert, identity, replica, record, transport |
//! | `serve.rs` | the server assembled from its configuration: handlers behind the transport, the replica's loops, health, shutdown | all of the above |
//!
//! A PickCpu arrives at `transport/listener.rs`, passes the layers
//! (`transport/layers.rs`, `identity.rs`), is taken from its frame by
//! `transport/fast_unary.rs`, decided by `service/placement.rs` (through
//! `replica/route.rs` when another replica owns the node) on a snapshot of
//! `store/`, with `engine/`'s `select_task_rq`, and goes back framed by
//! `convert/`. An agent's report is decoded by `transport/agent_wire.rs`,
//! handled by `service/agent.rs`, and applied through its one way in,
//! `Store::report` (`store/compose.rs`): checked by `store/report.rs`,
//! published by `store/nodes/`.

pub mod convert;
pub mod engine;
pub mod identity;
pub mod metrics;
pub mod offline;
pub mod pem;
pub mod record;
pub mod replica;
pub mod serve;
pub use fairplace_types::quote;
pub mod service;
pub mod store;
pub mod transport;
