//! The RPC handlers: PlacementService, AgentService, AdminService. Each
//! takes decoded messages and returns answers over the store; none knows
//! framing, listeners or TLS (`transport/`), and none knows which replica
//! answers (`replica/route.rs` says, and forwards).
//!
//! | file | answers |
//! |---|---|
//! | `placement.rs` | PickCpu, CanMigrate, Balance, Decide |
//! | `pick_stream.rs` | PickCpus, many picks on one stream |
//! | `cluster_pass.rs` | a cluster Balance (a level and a group) |
//! | `allocate.rs` | AllocateCpus, ReleaseCpus, RenewLease, and lease expiry |
//! | `lease_hub.rs` | leases to the agents that apply them, and their outcomes |
//! | `agent.rs` | AgentService.Report: registration, then reports |
//! | `admin.rs` | AdminService: nodes, features |
//! | `lookup.rs` | the registered node a request names, its fresh snapshot |
//! | `cpu_pool.rs` | the bounded pool CPU-heavy requests run in |

pub mod admin;
pub mod agent;
pub mod allocate;
mod cluster_pass;
pub mod cpu_pool;
pub mod lease_hub;
pub mod lookup;
mod pick_stream;
pub mod placement;
