//! Settling lease changes: every grant, renewal and end the lease table
//! (`leases/mod.rs`) starts is driven here to an outcome that is known, and
//! memory is made to match it.
//!
//! A commit answers one of three ways. Applied: the change takes effect in
//! memory. Refused (it certainly did not apply): memory goes back to what
//! it was. Unknown (a timeout, a lost answer, a failing disk): the write
//! may have applied, or may still. Then the caller is answered UNAVAILABLE
//! at once, the lease keeps its CPUs and its phase, and a task here writes
//! the change again, backing off, until the log acknowledges or refuses
//! the new write, which settles the question:
//!
//! | change | written again | once acknowledged |
//! |---|---|---|
//! | grant with a request id | the record, unless a tombstone exists | live: the caller's retry finds it |
//! | grant without one | its end, with a tombstone | ended for certain (nobody could know its id) |
//! | renewal | the renewed record, if it still exists | renewed |
//! | end (release, expiry) | the end | ended, its CPUs free |
//!
//! Every write again is idempotent, and the first write, should it land
//! late, cannot undo a settled outcome (the log's conditions, `log/`).
//! Only an acknowledged write settles: a write again that is refused (the
//! replica lost the node's fence meanwhile, say) says nothing of whether
//! the first one applied before, so the lease keeps its CPUs and the
//! settler tries again.
//! A change of a lease that left memory meanwhile (its node let go, or
//! claimed again in a new ownership period and read again from the log)
//! stops being settled here: the log holds the truth and the next owner
//! reads it.
//!
//! A caller that goes away while it waits for the first write does not
//! leave a change half done: its outcome is settled on a task, as an
//! unknown one.

use std::sync::Arc;
use std::time::Duration;

use super::Leases;
use super::log::{Commit, LogError};
use super::{Change, Lease, Renewal};
use crate::metrics as m;

/// The first wait before a change is written again; it doubles up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// The node's agent, through the lease hub: it hears that a lease ended
/// before the lease's CPUs are free, and of a grant settled forward after
/// its caller was answered UNAVAILABLE (nobody else would send it).
pub trait AgentSink: Send + Sync {
    fn ended(&self, node: &str, id: u64);
    fn granted(&self, node: &str, lease: &Lease);
}

/// A change being settled, as the settler knows it.
#[derive(Debug, Clone, Copy)]
pub enum Settling {
    /// A grant's first write; settled forward (it has a request id) or
    /// back (it has none) if its outcome is unknown.
    Grant {
        forward: bool,
    },
    Renew(Renewal),
    /// An end: a release, an expiry, a failed apply.
    End,
}

impl Settling {
    fn label(self) -> &'static str {
        match self {
            Settling::Grant { .. } => "grant",
            Settling::Renew(_) => "renew",
            Settling::End => "end",
        }
    }
}

/// A settled change: the lease with its node as the change left it
/// (granted, renewed, or ended), or `None` when the change did not apply
/// or the lease left memory meanwhile.
pub type Outcome = Result<Option<(String, Lease)>, LogError>;

/// Waits for the first write of `what` of lease `id` and makes memory
/// match its outcome; an unknown one is answered as an error at once and
/// settled on a task of its own (module doc). Dropped before the first
/// outcome (its caller went away), the change is settled on a task all
/// the same, as an unknown one.
pub async fn settle(
    store: &Arc<Leases>,
    sink: &Arc<dyn AgentSink>,
    id: u64,
    what: Settling,
    first: Commit,
) -> Outcome {
    let mut waiting = Waiting {
        store,
        sink,
        id,
        what,
        armed: true,
    };
    let r = first.wait().await;
    waiting.armed = false;
    match r {
        Ok(()) => Ok(apply(store, sink.as_ref(), id, what, None, true)),
        Err(e) if !e.unknown => {
            apply(store, sink.as_ref(), id, what, None, false);
            Err(e)
        }
        Err(e) => {
            tokio::spawn(again(Arc::clone(store), Arc::clone(sink), id, what));
            Err(e)
        }
    }
}

/// [`settle`] on a task of its own, for callers that do not wait.
pub fn spawn(
    store: &Arc<Leases>,
    sink: &Arc<dyn AgentSink>,
    id: u64,
    what: Settling,
    first: Commit,
) -> tokio::task::JoinHandle<Outcome> {
    let (store, sink) = (Arc::clone(store), Arc::clone(sink));
    tokio::spawn(async move { settle(&store, &sink, id, what, first).await })
}

/// A first write waited for; dropped while armed, its outcome is settled
/// as an unknown one.
struct Waiting<'a> {
    store: &'a Arc<Leases>,
    sink: &'a Arc<dyn AgentSink>,
    id: u64,
    what: Settling,
    armed: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.armed {
            let (store, sink) = (Arc::clone(self.store), Arc::clone(self.sink));
            tokio::spawn(again(store, sink, self.id, self.what));
        }
    }
}

/// Writes the settling change of `what` again, backing off, until one
/// write is acknowledged; then memory takes the outcome. Only an
/// acknowledged write settles: a refused one says nothing of whether the
/// first write applied before (the fence moved, the lease changed).
async fn again(store: Arc<Leases>, sink: Arc<dyn AgentSink>, id: u64, what: Settling) {
    metrics::counter!(m::LEASE_UNKNOWN, "change" => what.label()).increment(1);
    let change = settling_change(&store, id, what);
    let mut backoff = RETRY_MIN;
    loop {
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
        // `None`: the lease left memory (its node was let go, or read
        // again in a new ownership period): the log holds the truth.
        let Some(c) = store.resubmit(id, change) else {
            return;
        };
        if c.wait().await.is_ok() {
            let out = apply(&store, sink.as_ref(), id, what, Some(change), true);
            if let (Change::GrantForward, Some((node, l))) = (change, &out) {
                sink.granted(node, l);
            }
            metrics::counter!(m::LEASE_SETTLED, "change" => what.label(), "outcome" => "applied")
                .increment(1);
            tracing::info!(
                lease = id,
                change = what.label(),
                "an unknown lease commit outcome is settled"
            );
            return;
        }
    }
}

/// The write that settles `what` once its first outcome was unknown.
fn settling_change(store: &Leases, id: u64, what: Settling) -> Change {
    match what {
        Settling::Grant { forward: true } => Change::GrantForward,
        Settling::Grant { forward: false } => {
            store.grant_abandoned(id);
            Change::GrantBack
        }
        Settling::Renew(r) => Change::Renew(r),
        Settling::End => Change::End,
    }
}

/// Makes memory match a known outcome.
fn apply(
    store: &Leases,
    sink: &dyn AgentSink,
    id: u64,
    what: Settling,
    again: Option<Change>,
    applied: bool,
) -> Option<(String, Lease)> {
    let told = |node: &str, id: u64| sink.ended(node, id);
    match (what, again) {
        (Settling::Grant { .. }, Some(Change::GrantBack)) | (Settling::End, _) => store
            .end_settled(id, applied, &told)
            .map(|e| (e.node, e.lease)),
        (Settling::Grant { .. }, _) => {
            let node = store.lease_node(id)?;
            store.grant_settled(id, applied).map(|l| (node, l))
        }
        (Settling::Renew(r), _) => store.renew_settled(id, &r, applied),
    }
}

/// An [`AgentSink`] for a store without agents (tests, offline tools).
pub struct NoAgents;

impl AgentSink for NoAgents {
    fn ended(&self, _node: &str, _id: u64) {}
    fn granted(&self, _node: &str, _lease: &Lease) {}
}

/// Ends every lease whose time is over at `now` and waits until each end
/// is settled; returns the ended leases with their nodes. The service's
/// expiry loop does the same without waiting; this is for callers that
/// want the outcome (tests, a store without agents).
pub async fn expire(store: &Arc<Leases>, now: std::time::Instant) -> Vec<(String, Lease)> {
    let sink: Arc<dyn AgentSink> = Arc::new(NoAgents);
    let mut out = Vec::new();
    for (_, id, commit) in store.begin_expiry(now) {
        let what = Settling::End;
        if let Ok(Some(ended)) = settle(store, &sink, id, what, commit).await {
            out.push(ended);
        }
    }
    out
}
