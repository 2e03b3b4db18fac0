//! The transport: everything between a socket and a handler. The accept
//! loop and its screening (`listener`), TLS (`tls`), the tower layers every
//! call passes (`layers`: shedding, stream caps, request metrics), the
//! hand-framed fast paths for PickCpu and Ping (`fast_unary`) and for the
//! agents' Report streams (`agent_wire`, with the answers queued for each
//! stream in `ack_queue`), and the metrics port (`exposition`).
//!
//! It knows no handler: the fast paths reach the handlers through the
//! traits they declare ([`fast_unary::PickHere`],
//! [`agent_wire::OpenReport`]), which the handlers implement and the
//! server's wiring (`serve.rs`) connects.

pub mod ack_queue;
pub mod agent_wire;
pub mod exposition;
pub mod fast_unary;
pub mod layers;
pub mod listener;
pub mod tls;
