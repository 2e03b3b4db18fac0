//! Settling lease changes: every grant, renewal and end the lease table
//! (`leases.rs`) starts is driven here to an outcome that is known, and
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
//! late, cannot undo a settled outcome (the log's conditions, `durable/`).
//! Only an acknowledged write settles: a write again that is refused (the
//! replica lost the node's fence meanwhile, say) says nothing of whether
//! the first one applied before, so the lease keeps its CPUs and the
//! settler tries again.
//! A change of a lease that left memory meanwhile (its node let go, or
//! claimed again in a new ownership period and read again from the log)
//! stops being settled here: the log holds the truth and the next owner
//! reads it.
//!
//! Settling runs on its own task, so a caller that goes away mid-call does
//! not leave a change half done.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::durable::{Commit, LogError};
use super::leases::{Change, EndKind, Renewal};
use super::{Lease, Store};
use crate::metrics as m;

/// The first wait before a change is written again; it doubles up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Who hears that a lease ended, before its CPUs are free: the node's
/// agent, through the lease hub.
pub trait EndSink: Send + Sync {
    fn ended(&self, node: &str, id: u64);
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
    End(EndKind),
}

impl Settling {
    fn label(self) -> &'static str {
        match self {
            Settling::Grant { .. } => "grant",
            Settling::Renew(_) => "renew",
            Settling::End(_) => "end",
        }
    }
}

/// A settled change: the lease with its node as the change left it
/// (granted, renewed, or ended), or `None` when the change did not apply
/// or the lease left memory meanwhile.
pub type Outcome = Result<Option<(String, Lease)>, LogError>;

/// Settles `what` of lease `id`, whose first write is `first`, on its own
/// task; the receiver hears the first outcome (an unknown one as an
/// error), while settling goes on until it is known.
pub fn spawn(
    store: &Arc<Store>,
    sink: &Arc<dyn EndSink>,
    id: u64,
    what: Settling,
    first: Commit,
) -> oneshot::Receiver<Outcome> {
    let (tx, rx) = oneshot::channel();
    let (store, sink) = (Arc::clone(store), Arc::clone(sink));
    tokio::spawn(async move { drive(&store, sink.as_ref(), id, what, first, tx).await });
    rx
}

/// Waits for `commit`, and writes the change again after every unknown
/// outcome until the outcome is known (module doc).
async fn drive(
    store: &Store,
    sink: &dyn EndSink,
    id: u64,
    what: Settling,
    mut commit: Commit,
    tx: oneshot::Sender<Outcome>,
) {
    let mut tx = Some(tx);
    let mut again: Option<Change> = None;
    let mut backoff = RETRY_MIN;
    loop {
        let r = commit.wait().await;
        // The first write's refusal is conclusive: that write was judged
        // and can never apply. A write again's refusal is not (the fence
        // moved, or the lease changed: the first write may have applied
        // before), so only its success settles an unknown outcome.
        let known = match &r {
            Ok(()) => true,
            Err(e) => !e.unknown && again.is_none(),
        };
        if known {
            let applied = r.is_ok();
            let out = apply(store, sink, id, what, again, applied);
            if again.is_some() {
                metrics::counter!(m::LEASE_SETTLED, "change" => what.label(), "outcome" => "applied")
                    .increment(1);
                tracing::info!(
                    lease = id,
                    change = what.label(),
                    "an unknown lease commit outcome is settled"
                );
            }
            if let Some(tx) = tx.take() {
                let _ = tx.send(r.map(|()| out));
            }
            return;
        }
        if again.is_none() {
            metrics::counter!(m::LEASE_UNKNOWN, "change" => what.label()).increment(1);
            again = Some(settling_change(store, id, what));
        }
        if let (Some(tx), Err(e)) = (tx.take(), r) {
            let _ = tx.send(Err(e));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
        let Some(change) = again else { return };
        // `None`: the lease left memory (its node was let go, or read
        // again in a new ownership period): the log holds the truth.
        match store.resubmit(id, change) {
            Some(c) => commit = c,
            None => return,
        }
    }
}

/// The write that settles `what` once its first outcome was unknown.
fn settling_change(store: &Store, id: u64, what: Settling) -> Change {
    match what {
        Settling::Grant { forward: true } => Change::GrantForward,
        Settling::Grant { forward: false } => {
            store.grant_abandoned(id);
            Change::GrantBack
        }
        Settling::Renew(r) => Change::Renew(r),
        Settling::End(how) => Change::End(how),
    }
}

/// Makes memory match a known outcome.
fn apply(
    store: &Store,
    sink: &dyn EndSink,
    id: u64,
    what: Settling,
    again: Option<Change>,
    applied: bool,
) -> Option<(String, Lease)> {
    let told = |node: &str, id: u64| sink.ended(node, id);
    match (what, again) {
        (Settling::Grant { .. }, Some(Change::GrantBack)) | (Settling::End(_), _) => store
            .end_settled(id, applied, &told)
            .map(|e| (e.node, e.lease)),
        (Settling::Grant { .. }, _) => {
            let node = store.lease_node(id)?;
            store.grant_settled(id, applied).map(|l| (node, l))
        }
        (Settling::Renew(r), _) => store.renew_settled(id, &r, applied),
    }
}

/// An [`EndSink`] for a store without agents (tests, offline tools).
pub struct NoAgents;

impl EndSink for NoAgents {
    fn ended(&self, _node: &str, _id: u64) {}
}

/// Ends every lease whose time is over at `now` and waits until each end
/// is settled; returns the ended leases with their nodes. The service's
/// expiry loop does the same without waiting; this is for callers that
/// want the outcome (tests, a store without agents).
pub async fn expire(store: &Arc<Store>, now: std::time::Instant) -> Vec<(String, Lease)> {
    let sink: Arc<dyn EndSink> = Arc::new(NoAgents);
    let mut out = Vec::new();
    for (_, id, commit) in store.begin_expiry(now) {
        let rx = spawn(store, &sink, id, Settling::End(EndKind::Expire), commit);
        if let Ok(Ok(Some(ended))) = rx.await {
            out.push(ended);
        }
    }
    out
}
