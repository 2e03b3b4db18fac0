//! [`EtcdLog`]: the lease store in etcd, for replicas. Each commit is one
//! etcd transaction fenced on the node's owner key: it applies only while
//! `owners/NODE` is still bound to this replica's etcd lease *and* is the
//! key created at the batch's epoch (its create revision), so a replica
//! that lost the node (its lease ended, another replica claimed it) can
//! never commit a grant, a renewal or a release for it, and a replica that
//! got the node back commits nothing decided on the table of an earlier
//! ownership period.
//!
//! Each op also states what it expects of its own keys, in the same
//! transaction: a grant that the lease has neither a record nor a
//! tombstone, an update that the record exists and has no tombstone. A
//! transaction whose answer was lost may still be applied by etcd later
//! (a paused member forwarding it once it resumes); these conditions make
//! such a late write fail once the lease was settled otherwise.
//!
//! Group commit, as the embedded store: `submit` only queues; the
//! committer takes every waiting batch, groups them by node (order kept
//! within a node) and sends one transaction per node at once, so 64
//! concurrent grants on 64 nodes cost one round of parallel round trips.
//! A transaction holds at most [`MAX_TXN_OPS`] writes (etcd's default
//! `--max-txn-ops` is 128), and writes one key at most once: ops on the
//! same key within a transaction are folded to the last.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};

use super::Replica;
use super::etcd;
use super::keys::Keys;
use crate::store::leases::log::{Commit, Epoch, LeaseLog, LeaseOp, LeaseRecord, LogError, Stored};

/// Writes in one transaction at most.
pub const MAX_TXN_OPS: usize = 120;
/// The longest a commit waits for etcd.
pub const COMMIT_TIMEOUT: std::time::Duration = std::time::Duration::from_millis(1500);
/// Batches taken into one round at most.
const MAX_BATCHES: usize = 4096;

struct Batch {
    epoch: Epoch,
    ops: Vec<LeaseOp>,
    done: oneshot::Sender<Result<(), LogError>>,
}

/// Tombstone id -> its node: a tombstone's end (`LeaseOp::Forget`) names
/// only the id, its key names the node too.
type Tombs = Arc<Mutex<HashMap<u64, String>>>;

/// The lease log in etcd.
pub struct EtcdLog {
    replica: Arc<Replica>,
    queue: mpsc::UnboundedSender<Batch>,
    tombs: Tombs,
}

impl EtcdLog {
    /// The log of `replica`, its committer running on the current runtime.
    pub fn start(replica: Arc<Replica>) -> EtcdLog {
        let (queue, rx) = mpsc::unbounded_channel();
        let tombs = Tombs::default();
        tokio::spawn(committer(Arc::clone(&replica), Arc::clone(&tombs), rx));
        EtcdLog {
            replica,
            queue,
            tombs,
        }
    }

    /// The leases and tombstones of `node`, read after this replica
    /// claimed it.
    pub async fn load_node(&self, node: &str) -> Result<Stored, LogError> {
        let keys = &self.replica.keys;
        let t0 = Instant::now();
        let err = |e: etcd::EtcdError| LogError::refused(e.to_string());
        let (kvs, _) = self
            .replica
            .etcd
            .range_prefix(&keys.leases_of(node))
            .await
            .map_err(err)?;
        let mut out = Stored::default();
        for kv in kvs {
            match serde_json::from_slice::<LeaseRecord>(&kv.value) {
                Ok(r) if Some(r.id) == Keys::id_at_end(&kv.key) && r.node == node => {
                    out.leases.push(r)
                }
                _ => {
                    tracing::error!(key = %String::from_utf8_lossy(&kv.key), "a lease record in etcd cannot be read; left out")
                }
            }
        }
        let (kvs, _) = self
            .replica
            .etcd
            .range_prefix(&keys.ended_of(node))
            .await
            .map_err(err)?;
        let mut tombs = self.tombs.lock().unwrap_or_else(PoisonError::into_inner);
        for kv in kvs {
            let until = std::str::from_utf8(&kv.value)
                .ok()
                .and_then(|s| s.parse::<u64>().ok());
            if let (Some(id), Some(until)) = (Keys::id_at_end(&kv.key), until) {
                tombs.insert(id, node.to_string());
                out.ended.push((id, until));
            }
        }
        super::observe_etcd("read", t0);
        Ok(out)
    }
}

impl LeaseLog for EtcdLog {
    /// Leases are loaded node by node as this replica claims nodes.
    fn load(&self) -> Result<Stored, LogError> {
        Ok(Stored::default())
    }

    fn submit(&self, epoch: Epoch, ops: Vec<LeaseOp>) -> Commit {
        if ops.is_empty() {
            return Commit::done(Ok(()));
        }
        let (done, rx) = oneshot::channel();
        match self.queue.send(Batch { epoch, ops, done }) {
            Ok(()) => Commit::waiting(rx),
            Err(_) => Commit::done(Err(LogError::refused("the committer stopped"))),
        }
    }

    fn describe(&self) -> String {
        format!(
            "etcd under {} (replica {}, fenced on node ownership)",
            self.replica.keys.prefix, self.replica.id
        )
    }

    fn writable(&self) -> Result<(), LogError> {
        self.replica
            .writable()
            .map_err(|e| LogError::refused(e.to_string()))
    }

    fn authoritative(&self) -> bool {
        true
    }
}

/// Takes every waiting batch and commits them, one transaction per node,
/// the nodes in parallel.
async fn committer(replica: Arc<Replica>, tombs: Tombs, mut rx: mpsc::UnboundedReceiver<Batch>) {
    while let Some(first) = rx.recv().await {
        let mut batches = vec![first];
        while batches.len() < MAX_BATCHES {
            match rx.try_recv() {
                Ok(b) => batches.push(b),
                Err(_) => break,
            }
        }
        metrics::histogram!(crate::metrics::LEASE_COMMIT_BATCHES).record(batches.len() as f64);
        // One group per node and ownership period: a transaction is
        // fenced on one epoch.
        let mut groups: Vec<(Option<String>, Vec<Batch>)> = Vec::new();
        for b in batches {
            let node = b.ops.iter().find_map(|o| o.node()).map(str::to_string);
            match groups
                .iter_mut()
                .find(|g| g.0 == node && g.1[0].epoch == b.epoch)
            {
                Some(g) => g.1.push(b),
                None => groups.push((node, vec![b])),
            }
        }
        let mut set = tokio::task::JoinSet::new();
        for (node, bs) in groups {
            set.spawn(commit_group(
                Arc::clone(&replica),
                Arc::clone(&tombs),
                node,
                bs,
            ));
        }
        while set.join_next().await.is_some() {}
    }
}

/// One node's batches, in order, in as few transactions as fit.
async fn commit_group(replica: Arc<Replica>, tombs: Tombs, node: Option<String>, bs: Vec<Batch>) {
    let mut chunk: Vec<Batch> = Vec::new();
    let mut n = 0;
    for b in bs {
        let k = b.ops.len() * 3;
        if !chunk.is_empty() && n + k > MAX_TXN_OPS {
            commit_chunk(
                &replica,
                &tombs,
                node.as_deref(),
                std::mem::take(&mut chunk),
            )
            .await;
            n = 0;
        }
        n += k;
        chunk.push(b);
    }
    if !chunk.is_empty() {
        commit_chunk(&replica, &tombs, node.as_deref(), chunk).await;
    }
}

/// One transaction for `chunk`. One whose conditions failed is made again
/// batch by batch (a refusal is certain: nothing of it applied), so one
/// stale batch refuses only itself.
async fn commit_chunk(replica: &Replica, tombs: &Tombs, node: Option<&str>, chunk: Vec<Batch>) {
    let r = write_observed(replica, tombs, node, &chunk).await;
    if matches!(&r, Err(e) if !e.unknown) && chunk.len() > 1 {
        for b in chunk {
            let one = [b];
            let r = write_observed(replica, tombs, node, &one).await;
            let [b] = one;
            let _ = b.done.send(r);
        }
        return;
    }
    for b in chunk {
        let _ = b.done.send(r.clone());
    }
}

async fn write_observed(
    replica: &Replica,
    tombs: &Tombs,
    node: Option<&str>,
    chunk: &[Batch],
) -> Result<(), LogError> {
    let t0 = Instant::now();
    let r = write(replica, tombs, node, chunk).await;
    metrics::histogram!(crate::metrics::LEASE_COMMIT_SECONDS).record(t0.elapsed().as_secs_f64());
    super::observe_etcd("commit", t0);
    if let Err(e) = &r {
        metrics::counter!(crate::metrics::LEASE_STORE_ERRORS).increment(1);
        tracing::warn!(error = %e, unknown = e.unknown, node, "lease commit not acknowledged");
    }
    r
}

/// The chunk's ops as one transaction, fenced on `node`'s owner key at
/// the chunk's epoch, each op's own condition beside the fence.
async fn write(
    replica: &Replica,
    tombs: &Tombs,
    node: Option<&str>,
    chunk: &[Batch],
) -> Result<(), LogError> {
    let keys = &replica.keys;
    let mut compare = Vec::new();
    if let Some(n) = node {
        compare.extend(fence(replica, n, chunk[0].epoch)?);
    }
    // Key -> its last value (None: deleted), in key order: etcd refuses a
    // transaction that writes one key twice.
    let mut writes: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
    let mut expected = std::collections::HashSet::new();
    {
        let mut tombs = tombs.lock().unwrap_or_else(PoisonError::into_inner);
        for op in chunk.iter().flat_map(|b| &b.ops) {
            // The state before the transaction is what the first op on a
            // lease expects of it; later ops on it follow from that one.
            if let Some(c) = expects(keys, op)
                && expected.insert(c.0)
            {
                compare.extend(c.1);
            }
            fold(keys, &mut tombs, op, &mut writes)?;
        }
    }
    let ops = writes
        .into_iter()
        .map(|(k, v)| match v {
            Some(v) => etcd::put(k, v, 0),
            None => etcd::delete(k),
        })
        .collect();
    // Bounded well inside a call's deadline: without a quorum the caller
    // hears UNAVAILABLE, not its own timeout, and the outcome is settled.
    let r = tokio::time::timeout(COMMIT_TIMEOUT, replica.etcd.txn(compare, ops, Vec::new()))
        .await
        .map_err(|_| {
            LogError::unknown(format!(
                "etcd did not answer within {} ms (no quorum?); the change may still apply",
                COMMIT_TIMEOUT.as_millis()
            ))
        })?
        .map_err(|e| LogError::unknown(e.to_string()))?;
    if !r.succeeded {
        return Err(LogError::refused(format!(
            "replica {} no longer owns node {} in this ownership period, or the lease changed: the change is refused",
            replica.id,
            node.unwrap_or("")
        )));
    }
    Ok(())
}

/// The fence of a batch on `node` at `epoch`: the owner key is still this
/// replica's, bound to its etcd lease, and is the key created at `epoch`.
fn fence(replica: &Replica, node: &str, epoch: Epoch) -> Result<Vec<etcd::Compare>, LogError> {
    let keys = &replica.keys;
    let (lease, now) = replica.fence(node).ok_or_else(|| {
        LogError::refused(format!(
            "replica {} does not hold node {node} now (handed over, or etcd lost): the change is refused",
            replica.id
        ))
    })?;
    if epoch == 0 || epoch != now {
        return Err(LogError::refused(format!(
            "node {node}: the change was decided in ownership period {epoch}, replica {} holds it in period {now}: refused",
            replica.id
        )));
    }
    Ok(vec![
        etcd::bound_to(keys.owner(node), lease),
        etcd::created_at(keys.owner(node), epoch),
    ])
}

/// What an op expects of its lease's keys before the transaction: the
/// lease's id, and the conditions.
fn expects(keys: &Keys, op: &LeaseOp) -> Option<(u64, Vec<etcd::Compare>)> {
    match op {
        LeaseOp::Grant(r) => Some((
            r.id,
            vec![
                etcd::absent(keys.lease(&r.node, r.id)),
                etcd::absent(keys.ended(&r.node, r.id)),
            ],
        )),
        LeaseOp::Put(r) => Some((
            r.id,
            vec![
                etcd::present(keys.lease(&r.node, r.id)),
                etcd::absent(keys.ended(&r.node, r.id)),
            ],
        )),
        LeaseOp::Settle(r) => Some((r.id, vec![etcd::absent(keys.ended(&r.node, r.id))])),
        _ => None,
    }
}

/// One op as the key writes it makes.
fn fold(
    keys: &Keys,
    tombs: &mut HashMap<u64, String>,
    op: &LeaseOp,
    w: &mut BTreeMap<Vec<u8>, Option<Vec<u8>>>,
) -> Result<(), LogError> {
    match op {
        LeaseOp::Grant(r) | LeaseOp::Settle(r) | LeaseOp::Put(r) => {
            let json =
                serde_json::to_vec(r).map_err(|e| LogError::refused(format!("encode: {e}")))?;
            w.insert(keys.lease(&r.node, r.id), Some(json));
            w.insert(keys.lease_id(r.id), Some(r.node.clone().into_bytes()));
        }
        LeaseOp::End { id, node, until_ms } => {
            w.insert(keys.lease(node, *id), None);
            w.insert(keys.lease_id(*id), None);
            w.insert(
                keys.ended(node, *id),
                Some(until_ms.to_string().into_bytes()),
            );
            tombs.insert(*id, node.clone());
        }
        LeaseOp::Delete { id, node } => {
            w.insert(keys.lease(node, *id), None);
            w.insert(keys.lease_id(*id), None);
            w.insert(keys.ended(node, *id), None);
            tombs.remove(id);
        }
        LeaseOp::Forget(id) => {
            if let Some(node) = tombs.remove(id) {
                w.insert(keys.ended(&node, *id), None);
            }
        }
    }
    Ok(())
}
