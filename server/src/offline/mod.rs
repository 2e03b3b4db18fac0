//! The offline tools of `fairplace-server`: `decide` runs scenario files
//! through the engine with no server (the JSON format of `scenario`, with
//! this project's `balance` request, both reached through `request`: the
//! kernel harness's and the differential tests' way in), and `pki` writes
//! a development PKI.

pub mod balance;
pub mod decide;
pub mod pki;
pub mod request;
pub mod scenario;
