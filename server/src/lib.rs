//! fairplace: placement decisions with the Linux kernel's fair-class
//! algorithms, as a library (the decision engine and the scenario format)
//! and, in the binary, as a server.

pub mod alloc;
pub mod decide;
pub mod engine;
pub mod exposition;
pub mod metrics;
pub mod pki;
pub mod resolve;
pub use fairplace_types::quote;
pub mod scenario;
pub mod service;
pub mod store;
