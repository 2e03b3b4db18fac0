//! [`RedbLog`]: leases in an embedded redb database, `leases.redb` under
//! the server's `--state-dir`, committed by one thread in groups.
//!
//! Why redb: it is crash-safe by construction (copy-on-write B-trees, a
//! commit is durable once its fsync returns and a torn write is detected
//! by checksum and rolled back), in pure Rust (no C build, no server
//! process), and it locks its file, so two servers cannot share a state
//! directory by mistake.
//!
//! Group commit: `submit` only queues; the committer thread takes every
//! batch that is waiting, writes them in one transaction and fsyncs once,
//! then answers each. While one fsync runs the next callers queue up, so
//! 64 concurrent grants cost a few fsyncs, not 64 in a row.
//!
//! A failing disk (full, or an I/O error): the batch's outcome is unknown
//! and the store settles it by writing it again. redb refuses every write
//! after an I/O error until the database is opened again, so the committer
//! closes and reopens it (redb recovers the last committed state on open)
//! before the next batch.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Instant;

use redb::{Database, ReadableTable, TableDefinition};
use tokio::sync::oneshot;

use super::{Commit, Epoch, LeaseLog, LeaseOp, LeaseRecord, LogError, Stored};

/// Lease id -> the record as JSON (a format a person can read with any
/// redb tool, and that can gain fields without a migration).
const LEASES: TableDefinition<u64, &[u8]> = TableDefinition::new("leases");
/// Lease id -> until when its tombstone is kept (wall-clock ms).
const ENDED: TableDefinition<u64, u64> = TableDefinition::new("ended");
/// The database file under the state directory.
pub const FILE: &str = "leases.redb";
/// Batches taken into one transaction at most (a bound on one commit's work).
const MAX_BATCHES: usize = 4096;

struct Batch {
    ops: Vec<LeaseOp>,
    done: oneshot::Sender<Result<(), LogError>>,
}

/// The lease log in `DIR/leases.redb`.
pub struct RedbLog {
    path: PathBuf,
    /// Shared with the committer, which reopens it after an I/O error.
    db: Shared,
    /// `None` only while dropping.
    queue: Option<mpsc::Sender<Batch>>,
    committer: Option<std::thread::JoinHandle<()>>,
}

/// The database, `None` while it is being reopened.
type Shared = std::sync::Arc<std::sync::Mutex<Option<Database>>>;

fn lock_db(db: &Shared) -> std::sync::MutexGuard<'_, Option<Database>> {
    db.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Dropping the log ends its committer after the batches queued, so the
/// file is closed (and its lock released) when the drop returns.
impl Drop for RedbLog {
    fn drop(&mut self) {
        self.queue = None;
        if let Some(t) = self.committer.take() {
            let _ = t.join();
        }
    }
}

/// A failure before anything was written: the batch certainly did not apply.
fn err(what: &str, e: impl std::fmt::Display) -> LogError {
    LogError::refused(format!("{what}: {e}"))
}

/// A failure once the transaction was writing (an I/O error, a failed
/// fsync): whether the batch is on disk is not known, and it is settled by
/// writing it again.
fn err_unknown(what: &str, e: impl std::fmt::Display) -> LogError {
    LogError::unknown(format!("{what}: {e}"))
}

impl RedbLog {
    /// Opens (or creates) the database in `dir`, creating `dir` if needed,
    /// and starts its committer thread.
    pub fn open(dir: &Path) -> Result<RedbLog, LogError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| err(&format!("--state-dir {}", dir.display()), e))?;
        let path = dir.join(FILE);
        let db = Database::create(&path).map_err(|e| match e {
            redb::DatabaseError::DatabaseAlreadyOpen => LogError::refused(format!(
                "{} is in use by another process (another fairplace-server with the same --state-dir?)",
                path.display()
            )),
            e => err(&path.display().to_string(), e),
        })?;
        // The table exists from the first start on, so load never has to
        // tell "empty" from "missing".
        let txn = db.begin_write().map_err(|e| err("begin", e))?;
        txn.open_table(LEASES).map_err(|e| err("open table", e))?;
        txn.open_table(ENDED).map_err(|e| err("open table", e))?;
        txn.commit().map_err(|e| err("commit", e))?;
        let db: Shared = std::sync::Arc::new(std::sync::Mutex::new(Some(db)));
        let (queue, rx) = mpsc::channel();
        let (worker, at) = (std::sync::Arc::clone(&db), path.clone());
        let committer = std::thread::Builder::new()
            .name("lease-commit".into())
            .spawn(move || committer(&worker, &at, &rx))
            .map_err(|e| err("committer thread", e))?;
        Ok(RedbLog {
            path,
            db,
            queue: Some(queue),
            committer: Some(committer),
        })
    }
}

/// Takes every waiting batch, commits them together, answers each.
fn committer(db: &Shared, path: &Path, rx: &mpsc::Receiver<Batch>) {
    while let Ok(first) = rx.recv() {
        let mut batches = vec![first];
        while batches.len() < MAX_BATCHES {
            match rx.try_recv() {
                Ok(b) => batches.push(b),
                Err(_) => break,
            }
        }
        let t0 = Instant::now();
        if lock_db(db).is_none() {
            reopen(db, path);
        }
        let r = match lock_db(db).as_ref() {
            Some(d) => write(d, &batches),
            None => Err(LogError::refused(
                "the lease database could not be opened again",
            )),
        };
        metrics::histogram!(crate::metrics::LEASE_COMMIT_SECONDS)
            .record(t0.elapsed().as_secs_f64());
        metrics::histogram!(crate::metrics::LEASE_COMMIT_BATCHES).record(batches.len() as f64);
        if let Err(e) = &r {
            metrics::counter!(crate::metrics::LEASE_STORE_ERRORS).increment(1);
            tracing::error!(error = %e, batches = batches.len(), "lease commit failed");
            reopen(db, path);
        }
        for b in batches {
            let _ = b.done.send(r.clone());
        }
    }
}

/// Closes the database and opens it again: after an I/O error redb takes
/// no write until then, and opening recovers its last committed state.
fn reopen(db: &Shared, path: &Path) {
    let mut d = lock_db(db);
    *d = None;
    match Database::create(path) {
        Ok(n) => *d = Some(n),
        Err(e) => {
            tracing::error!(error = %e, "the lease database could not be opened again; retried at the next commit")
        }
    }
}

/// One write transaction with every op of `batches`, in order.
fn write(db: &Database, batches: &[Batch]) -> Result<(), LogError> {
    let txn = db.begin_write().map_err(|e| err("begin", e))?;
    {
        let mut t = txn.open_table(LEASES).map_err(|e| err("open table", e))?;
        let mut ended = txn.open_table(ENDED).map_err(|e| err("open table", e))?;
        // One writer (this thread) and no late writes: a grant's or an
        // update's condition (no tombstone) always holds here, as the store
        // never reuses an id.
        for op in batches.iter().flat_map(|b| &b.ops) {
            match op {
                LeaseOp::Grant(r) | LeaseOp::Settle(r) | LeaseOp::Put(r) => {
                    let json = serde_json::to_vec(r).map_err(|e| err("encode", e))?;
                    t.insert(r.id, json.as_slice())
                        .map_err(|e| err_unknown("insert", e))?;
                }
                LeaseOp::End { id, until_ms, .. } => {
                    t.remove(*id).map_err(|e| err_unknown("remove", e))?;
                    ended
                        .insert(*id, *until_ms)
                        .map_err(|e| err_unknown("insert", e))?;
                }
                LeaseOp::Delete { id, .. } | LeaseOp::Forget(id) => {
                    t.remove(*id).map_err(|e| err_unknown("remove", e))?;
                    ended.remove(*id).map_err(|e| err_unknown("remove", e))?;
                }
            }
        }
    }
    txn.commit().map_err(|e| err_unknown("commit", e))
}

impl LeaseLog for RedbLog {
    fn load(&self) -> Result<Stored, LogError> {
        let guard = lock_db(&self.db);
        let db = guard
            .as_ref()
            .ok_or_else(|| LogError::refused("the lease database is being opened again"))?;
        let txn = db.begin_read().map_err(|e| err("begin read", e))?;
        let t = txn.open_table(LEASES).map_err(|e| err("open table", e))?;
        let mut out = Vec::new();
        for entry in t.iter().map_err(|e| err("read", e))? {
            let (k, v) = entry.map_err(|e| err("read", e))?;
            match serde_json::from_slice::<LeaseRecord>(v.value()) {
                Ok(r) if r.id == k.value() => out.push(r),
                // A record this version cannot read is kept on disk and
                // left out, never guessed at.
                Ok(_) | Err(_) => {
                    tracing::error!(lease = k.value(), "a lease record cannot be read; left out")
                }
            }
        }
        let e = txn.open_table(ENDED).map_err(|e| err("open table", e))?;
        let mut ended = Vec::new();
        for entry in e.iter().map_err(|e| err("read", e))? {
            let (k, v) = entry.map_err(|e| err("read", e))?;
            ended.push((k.value(), v.value()));
        }
        Ok(Stored { leases: out, ended })
    }

    fn submit(&self, _epoch: Epoch, ops: Vec<LeaseOp>) -> Commit {
        if ops.is_empty() {
            return Commit::done(Ok(()));
        }
        let (done, rx) = oneshot::channel();
        match self.queue.as_ref().map(|q| q.send(Batch { ops, done })) {
            Some(Ok(())) => Commit::waiting(rx),
            _ => Commit::done(Err(LogError::refused("the committer stopped"))),
        }
    }

    fn describe(&self) -> String {
        format!("redb {}", self.path.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: u64) -> LeaseRecord {
        LeaseRecord {
            id,
            node: "n1".into(),
            cpus: "2-3".into(),
            policy: "kernel".into(),
            holder: "job".into(),
            owner: "spiffe://fairplace/orchestrator/o".into(),
            target: Some(crate::store::Target::Cgroup("fairplace/job".into())),
            ttl_ms: 30_000,
            expires_at_ms: 2_000_000_000_000,
            granted_at_ms: 1_000_000_000_000,
            applied: true,
            request_id: String::new(),
        }
    }

    fn tempdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fp-redb-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[tokio::test]
    async fn records_survive_a_reopen_and_deletes_stick() {
        let dir = tempdir("reopen");
        {
            let log = RedbLog::open(&dir).unwrap();
            let commits: Vec<Commit> = (1..=3u64)
                .map(|i| log.submit(0, vec![LeaseOp::Grant(record(i))]))
                .collect();
            for c in commits {
                c.wait().await.unwrap();
            }
            log.submit(
                0,
                vec![LeaseOp::Delete {
                    id: 2,
                    node: "n1".into(),
                }],
            )
            .wait()
            .await
            .unwrap();
            log.submit(
                0,
                vec![LeaseOp::End {
                    id: 3,
                    node: "n1".into(),
                    until_ms: 99,
                }],
            )
            .wait()
            .await
            .unwrap();
        }
        let log = RedbLog::open(&dir).unwrap();
        let stored = log.load().unwrap();
        let ids: Vec<u64> = stored.leases.iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![1]);
        assert_eq!(stored.leases[0], record(1));
        assert_eq!(
            stored.ended,
            vec![(3, 99)],
            "an early end leaves a tombstone"
        );
        log.submit(0, vec![LeaseOp::Forget(3)])
            .wait()
            .await
            .unwrap();
        assert!(log.load().unwrap().ended.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_second_open_of_the_same_directory_is_refused_by_name() {
        let dir = tempdir("twice");
        let _first = RedbLog::open(&dir).unwrap();
        let e = RedbLog::open(&dir).err().expect("the file is locked");
        assert!(e.message.contains("in use"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
