//! fairplace: placement decisions with the Linux kernel's fair-class
//! algorithms, as a library (the decision engine and the scenario format)
//! and, in the binary, as a server.

pub mod engine;
pub mod metrics;
pub mod offline;
pub mod pem;
pub mod replica;
pub use fairplace_types::quote;
pub mod service;
pub mod store;
