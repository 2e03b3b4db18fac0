//! Recordings: what a server sees and decides, kept so that `replay` can
//! decide it all again, under the recorded features and under others
//! (docs/replay.md).
//!
//! A recording is every node's published states (each one the CPUs that
//! changed since the last, told by the store's [`Tap`] as it publishes) and
//! every placement request with the snapshot version it was decided on and
//! its answer. Nothing of it is written on the request's path: the handler
//! hands the recorder an event (a PickCpu's entry already encoded, the
//! other requests and answers, an `Arc` of a snapshot) through a bounded
//! queue that never blocks, and one writer thread encodes the rest,
//! compresses and writes. An event the queue has no room for is counted
//! as dropped, never waited for.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | the [`Hub`] handlers and the store tell, and starting and stopping recorders |
//! | `segment.rs` | the bytes: segment files of checksummed blocks |
//! | `wire.rs` | the two bulk entries (a node's state, a PickCpu) in protobuf's wire format, written by hand |
//! | `writer.rs` | the writer thread: entries, keyframes, sinks (files rotated by size, admin streams) |
//! | `replay/` | `fairplace-server replay`: states rebuilt, decisions made again, switches judged |

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;
use fairplace_proto::v1 as pb;

use crate::convert::PickAnswer;
use crate::engine::cpumask::CpuMask;
use crate::engine::features::System;
use crate::metrics as m;
use crate::store::features::Switches;
use crate::store::tap::Tap;
use crate::store::{Node, Snapshot, Store};

pub mod replay;
pub mod segment;
mod wire;
mod writer;

use writer::{FileSink, Sink, StreamSink};

/// Events the queue to the writer holds before new ones are dropped.
const QUEUE: usize = 1 << 16;
/// AdminService.Record streams at once.
pub const MAX_STREAMS: usize = 4;

/// What the store and the handlers tell a recorder.
pub(crate) enum Event {
    /// A node's next snapshot (`incarnation` tells a node registered
    /// anew from the one before it under the same id).
    State {
        node: String,
        incarnation: usize,
        spec: Arc<crate::engine::topology::TopologySpec>,
        snap: Arc<Snapshot>,
        report: bool,
    },
    Decision(Box<Decision>),
    /// An entry encoded where it was decided (a PickCpu: `wire.rs`).
    Encoded(Vec<u8>),
    /// Another sink joins the running recorder.
    Attach(Sink),
    /// The server stops: write what is pending and end.
    Finish,
}

/// One placement request as decided.
pub(crate) struct Decision {
    pub node: String,
    pub version: u64,
    pub what: Decided,
}

// It travels boxed (`Event::Decision`): a variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Decided {
    Migrate {
        req: pb::CanMigrateRequest,
        answer: pb::CanMigrateResponse,
    },
    Allocate {
        req: pb::AllocateCpusRequest,
        granted: CpuMask,
        leased: CpuMask,
        scanned: u32,
    },
    Balance {
        req: pb::BalanceRequest,
        answer: pb::BalanceResponse,
    },
}

/// A running recorder: the queue to its writer thread.
pub(crate) struct Recorder {
    tx: SyncSender<Event>,
    dropped: AtomicU64,
}

/// What the handlers and the store tell, and the recorders it runs: at
/// most one writer thread, which every sink (the `--record` directory,
/// each admin stream) shares; it ends when its last sink does.
pub struct Hub {
    active: ArcSwapOption<Recorder>,
    /// Starting a writer, attaching to it and its ending are one at a time.
    starting: Mutex<()>,
    /// The writer thread, joined at [`Hub::finish`].
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// AdminService.Record streams running.
    streams: Arc<std::sync::atomic::AtomicUsize>,
    /// The wall clock in ms, as the writer last read it: what a PickCpu's
    /// entry is stamped with (a clock read per decision would cost more).
    now_ms: AtomicU64,
    system: System,
    switches: Arc<Switches>,
}

impl Hub {
    /// A hub for `store`, installed as its tap.
    pub fn new(store: &Store) -> Arc<Hub> {
        let hub = Arc::new(Hub {
            active: ArcSwapOption::empty(),
            starting: Mutex::new(()),
            writer: Mutex::new(None),
            streams: Default::default(),
            now_ms: AtomicU64::new(writer::unix_ms()),
            system: store.config.system,
            switches: Arc::clone(&store.switches),
        });
        store.tap.install(Arc::clone(&hub) as Arc<dyn Tap>);
        hub
    }

    /// Whether anything is being recorded now.
    pub fn is_on(&self) -> bool {
        self.active.load().is_some()
    }

    /// Records into `dir` from now until the process ends: segment files
    /// rotated by size, the oldest deleted once they hold over `max_bytes`.
    pub fn record_to(self: &Arc<Self>, dir: PathBuf, max_bytes: u64) -> std::io::Result<()> {
        let sink = FileSink::open(dir, max_bytes)?;
        self.attach(Sink::File(sink));
        Ok(())
    }

    /// Records for `seconds` (or until `max_bytes` are sent, or the
    /// receiver goes) into the returned stream of one segment's bytes; at
    /// most [`MAX_STREAMS`] at once (each may hold a few MiB queued for a
    /// slow reader), RESOURCE_EXHAUSTED beyond.
    pub fn stream(
        self: &Arc<Self>,
        seconds: u32,
        max_bytes: u64,
    ) -> Result<tokio::sync::mpsc::Receiver<Result<pb::RecordChunk, tonic::Status>>, tonic::Status>
    {
        let slot = writer::StreamSlot::take(&self.streams, MAX_STREAMS).ok_or_else(|| {
            tonic::Status::resource_exhausted(format!(
                "Record: {MAX_STREAMS} recordings are streaming already; retry when one ends"
            ))
        })?;
        let (tx, rx) = tokio::sync::mpsc::channel(writer::STREAM_QUEUE);
        let until = Instant::now() + Duration::from_secs(seconds as u64);
        self.attach(Sink::Stream(StreamSink::new(tx, until, max_bytes, slot)));
        Ok(rx)
    }

    fn attach(self: &Arc<Self>, sink: Sink) {
        let _one = self.starting.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(r) = self.active.load_full() {
            // The writer ends only under `starting`: it is there to take it.
            let _ = r.tx.send(Event::Attach(sink));
            return;
        }
        let (tx, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let rec = Arc::new(Recorder {
            tx,
            dropped: AtomicU64::new(0),
        });
        self.active.store(Some(Arc::clone(&rec)));
        let hub = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("fairplace-record".into())
            .spawn(move || writer::run(hub, rec, rx, sink));
        match spawned {
            Ok(h) => {
                // A writer that ended before is done: its handle goes.
                *self.writer.lock().unwrap_or_else(PoisonError::into_inner) = Some(h);
            }
            Err(e) => {
                tracing::error!(error = %e, "the recording's writer thread did not start");
                self.active.store(None);
            }
        }
    }

    /// Writes what is pending and stops recording (at the server's exit:
    /// a segment then ends on a whole block). Blocks until the writer is
    /// done.
    pub fn finish(&self) {
        let (r, handle) = {
            let _one = self.starting.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(r) = self.active.swap(None) else {
                return;
            };
            let h = self
                .writer
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            (r, h)
        };
        // Sent without `starting`: a writer ending on its own takes it.
        let _ = r.tx.send(Event::Finish);
        if let Some(h) = handle {
            let _ = h.join();
        }
    }

    /// Hands `e` to the writer, or counts it dropped.
    fn send(&self, e: impl FnOnce() -> Event) {
        let guard = self.active.load();
        let Some(r) = guard.as_ref() else {
            return;
        };
        match r.tx.try_send(e()) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                r.dropped.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::RECORD_DROPPED).increment(1);
            }
        }
    }

    fn decided(&self, node: &str, version: u64, what: impl FnOnce() -> Decided) {
        self.send(|| {
            Event::Decision(Box::new(Decision {
                node: node.to_string(),
                version,
                what: what(),
            }))
        });
    }

    /// A PickCpu decided on `node`'s snapshot `version` (down the cluster
    /// path when `cluster`).
    pub fn picked(
        &self,
        node: &str,
        version: u64,
        req: &pb::PickCpuRequest,
        answer: &PickAnswer,
        cluster: bool,
    ) {
        self.send(|| {
            let ms = self.now_ms.load(Ordering::Relaxed);
            Event::Encoded(wire::pick_entry(node, version, ms, req, answer, cluster))
        });
    }

    pub fn migrated(
        &self,
        node: &str,
        version: u64,
        req: &pb::CanMigrateRequest,
        answer: &pb::CanMigrateResponse,
    ) {
        self.decided(node, version, || Decided::Migrate {
            req: req.clone(),
            answer: answer.clone(),
        });
    }

    /// An AllocateCpus granted `granted` with `leased` held by other leases.
    pub fn allocated(
        &self,
        node: &str,
        version: u64,
        req: &pb::AllocateCpusRequest,
        granted: CpuMask,
        leased: CpuMask,
        scanned: u32,
    ) {
        self.decided(node, version, || Decided::Allocate {
            req: req.clone(),
            granted,
            leased,
            scanned,
        });
    }

    pub fn balanced(
        &self,
        node: &str,
        version: u64,
        req: &pb::BalanceRequest,
        answer: &pb::BalanceResponse,
    ) {
        self.decided(node, version, || Decided::Balance {
            req: req.clone(),
            answer: answer.clone(),
        });
    }
}

impl Tap for Hub {
    fn published(&self, node: &Node, snap: &Arc<Snapshot>, report: bool) {
        self.send(|| Event::State {
            node: node.id.clone(),
            incarnation: node as *const Node as usize,
            spec: Arc::clone(&node.spec),
            snap: Arc::clone(snap),
            report,
        });
    }
}
