//! The durable copy of the leases: one narrow trait, [`LeaseLog`], that
//! keeps lease records across restarts, and its implementations.
//!
//! A lease is the one piece of state an agent's next report cannot give
//! back, so every grant, renewal and release is committed to the log
//! before its RPC answers. The in-memory table in `store/leases/mod.rs` stays
//! the one decisions read; the log is its write-ahead copy, read once at
//! start ([`LeaseLog::load`]).
//!
//! The trait is the seam for replicas: [`redb::RedbLog`] keeps the records
//! in an embedded database under `--state-dir`; a store in etcd for several
//! replicas is another implementation of the same two calls. [`MemoryLog`]
//! keeps nothing: stores built in tests, and the benchmark's in-memory
//! baseline (`--lease-store memory`).
//!
//! Order: ops submitted one after the other are committed in that order.
//! The store submits under the node's writer mutex, so the log's order is
//! the table's, and a renewal can never land after the release it raced.
//!
//! Outcomes: a commit either applied, was refused ([`LogError::refused`]:
//! it certainly did not apply, e.g. a fence that no longer holds), or its
//! outcome is unknown ([`LogError::unknown`]: a timeout, a lost
//! connection, a failing disk). The store treats an unknown outcome as
//! possibly applied and settles it (`store/leases/settle.rs`); a log must
//! never report a refusal for a write that may still land.
//!
//! Fencing: a batch carries its node's ownership [`Epoch`]. A replicated
//! log commits it only while the node's owner key is the one created at
//! that epoch; embedded logs (one writer) take every batch.

pub mod redb;

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::Target;

/// One lease as the log keeps it. Times are wall-clock milliseconds since
/// the Unix epoch: an `Instant` means nothing to the next process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub id: u64,
    pub node: String,
    /// The leased CPUs as a cpulist.
    pub cpus: String,
    pub policy: String,
    pub holder: String,
    /// The identity that took it (a SPIFFE ID, or "anonymous").
    pub owner: String,
    pub target: Option<Target>,
    pub ttl_ms: u64,
    pub expires_at_ms: u64,
    pub granted_at_ms: u64,
    /// The agent confirmed it applied the lease.
    pub applied: bool,
    /// The caller's idempotency key (empty: none): a retried AllocateCpus
    /// with it is answered with this lease, wherever it lands.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub request_id: String,
}

/// A node's ownership period in a replicated log: the revision at which
/// its owner key was created (0: not fenced, an embedded log).
pub type Epoch = i64;

/// One change of the log.
#[derive(Debug, Clone)]
pub enum LeaseOp {
    /// A new lease (a grant, an adoption): the record, whole. It applies
    /// only where the lease has neither a record nor a tombstone, so a
    /// grant whose first commit was lost and that was ended meanwhile can
    /// never land late.
    Grant(LeaseRecord),
    /// A grant whose first commit had an unknown outcome, made certain:
    /// the record, whole, whether or not the first write applied, only
    /// where the lease has no tombstone.
    Settle(LeaseRecord),
    /// A change of a committed lease (a renewal, the agent's confirmation):
    /// the record, whole. It applies only where the record still exists
    /// and has no tombstone, so it can never bring back an ended lease.
    Put(LeaseRecord),
    /// A lease ended (released, expired, its target gone): gone, with a
    /// tombstone kept until `until_ms` (the expiry it had), so a node's
    /// agent that missed the end and still holds it cannot bring it back,
    /// and a write of the lease landing late fails.
    End {
        id: u64,
        node: String,
        until_ms: u64,
    },
    /// A record that cannot be read: the lease of `node` is
    /// forgotten (with any tombstone of its id).
    Delete { id: u64, node: String },
    /// A tombstone past its time: the id is forgotten.
    Forget(u64),
}

impl LeaseOp {
    /// The node whose leases the op changes (none for a tombstone's end):
    /// a replicated log fences the op on that node's owner.
    pub fn node(&self) -> Option<&str> {
        match self {
            LeaseOp::Grant(r) | LeaseOp::Settle(r) | LeaseOp::Put(r) => Some(&r.node),
            LeaseOp::End { node, .. } | LeaseOp::Delete { node, .. } => Some(node),
            LeaseOp::Forget(_) => None,
        }
    }
}

/// What the log keeps: the live leases, and the tombstones of the ones
/// that ended early (id, kept until, wall-clock ms).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Stored {
    pub leases: Vec<LeaseRecord>,
    pub ended: Vec<(u64, u64)>,
}

/// Why the log could not load or commit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogError {
    pub message: String,
    /// The write may have applied (or may still): a timeout, a lost
    /// answer, a failed fsync. False: it certainly did not.
    pub unknown: bool,
}

impl LogError {
    /// The write certainly did not apply (or nothing was written).
    pub fn refused(message: impl Into<String>) -> LogError {
        LogError {
            message: message.into(),
            unknown: false,
        }
    }

    /// The write may have applied.
    pub fn unknown(message: impl Into<String>) -> LogError {
        LogError {
            message: message.into(),
            unknown: true,
        }
    }
}

impl std::fmt::Display for LogError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lease store: {}", self.message)
    }
}

impl std::error::Error for LogError {}

/// A submitted batch of ops; [`Commit::wait`] resolves once they are
/// durable (or failed).
#[must_use = "a lease op is durable only once its commit is waited for"]
pub struct Commit(Pending);

enum Pending {
    Done(Result<(), LogError>),
    Waiting(oneshot::Receiver<Result<(), LogError>>),
}

impl Commit {
    /// A commit that is already over.
    pub fn done(r: Result<(), LogError>) -> Commit {
        Commit(Pending::Done(r))
    }

    /// A commit the log answers on `rx`.
    pub fn waiting(rx: oneshot::Receiver<Result<(), LogError>>) -> Commit {
        Commit(Pending::Waiting(rx))
    }

    pub async fn wait(self) -> Result<(), LogError> {
        match self.0 {
            Pending::Done(r) => r,
            Pending::Waiting(rx) => rx
                .await
                .unwrap_or_else(|_| Err(LogError::unknown("the committer stopped"))),
        }
    }

    /// Lets the commit finish on its own: for ops no caller waits for
    /// (expiry), whose failure the log itself reports.
    pub fn detach(self) {}
}

/// Where leases are kept durably. Implementations must commit the ops of
/// one [`LeaseLog::submit`] atomically, batches in submission order, and
/// never block the caller of `submit`.
pub trait LeaseLog: Send + Sync + 'static {
    /// Every record and tombstone kept, once at start. A replicated log,
    /// whose leases are loaded node by node as replicas take nodes over,
    /// returns nothing here.
    fn load(&self) -> Result<Stored, LogError>;
    /// Queues `ops` for commit, fenced on `epoch`, and returns at once.
    fn submit(&self, epoch: Epoch, ops: Vec<LeaseOp>) -> Commit;
    /// What and where it is, for the start-up log line.
    fn describe(&self) -> String;
    /// Whether an op can be committed now: a replicated log that has lost
    /// its quorum says why not, so a change is refused before it is made
    /// in memory. Embedded logs always can.
    fn writable(&self) -> Result<(), LogError> {
        Ok(())
    }
    /// Whether the log is the one truth of several servers (etcd): a lease
    /// an agent reports and the log does not hold was never committed or
    /// has ended, and is never adopted. An embedded log may have been lost
    /// with its state directory, and the agents' copies bring leases back.
    fn authoritative(&self) -> bool {
        false
    }
}

/// A log that keeps nothing: leases live as long as the process.
#[derive(Debug, Default)]
pub struct MemoryLog;

impl LeaseLog for MemoryLog {
    fn load(&self) -> Result<Stored, LogError> {
        Ok(Stored::default())
    }

    fn submit(&self, _epoch: Epoch, _ops: Vec<LeaseOp>) -> Commit {
        Commit::done(Ok(()))
    }

    fn describe(&self) -> String {
        "memory (leases do not survive a restart)".into()
    }
}

/// Milliseconds since the Unix epoch, now.
pub fn unix_ms_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
