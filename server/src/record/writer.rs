//! The recording's writer thread: events in, entries out, blocks to every
//! sink.
//!
//! It keeps each node's last recorded snapshot, so a state is written as
//! the CPUs that changed since it, and so any sink can start with a
//! keyframe: the start entry, then every node's topology and full state.
//! Keyframes are made only between blocks (nothing pending), so a diff
//! never follows a keyframe newer than its base. Every segment file and
//! every admin stream begins with one: each replays without the others.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::record_entry::Entry;

use super::segment::{self, BLOCK_TARGET, SUFFIX};
use super::{Decided, Decision, Event, Hub, Recorder};
use crate::convert;
use crate::engine::features::{FEATURE_NAMES, Features, System};
use crate::engine::topology::TopologySpec;
use crate::metrics as m;
use crate::store::Snapshot;

/// Blocks an admin stream holds for a slow reader before it is ended.
pub const STREAM_QUEUE: usize = 64;
/// A block is written at least this often, however little it holds.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How long the writer sleeps when its queue is empty.
const POLL: Duration = Duration::from_millis(2);

/// A node's last recorded state.
struct Last {
    incarnation: usize,
    spec: Arc<TopologySpec>,
    snap: Arc<Snapshot>,
}

/// Where blocks go.
pub(crate) enum Sink {
    File(FileSink),
    Stream(StreamSink),
}

/// Segment files in a directory, rotated by size.
pub(crate) struct FileSink {
    dir: PathBuf,
    max_total: u64,
    seg_max: u64,
    next_index: u64,
    cur: Option<(File, u64)>,
    /// Every segment of the directory, oldest first, with its size.
    segs: VecDeque<(PathBuf, u64)>,
}

impl FileSink {
    /// Opens `dir` (made if missing); segments continue the numbering of
    /// those already there, which count towards `max_total`.
    pub fn open(dir: PathBuf, max_total: u64) -> std::io::Result<FileSink> {
        std::fs::create_dir_all(&dir)?;
        let mut segs = VecDeque::new();
        let mut next_index = 1;
        for p in segment::segments(&dir)? {
            let stem = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if let Ok(i) = stem.trim_end_matches(SUFFIX).parse::<u64>() {
                next_index = next_index.max(i + 1);
            }
            let len = std::fs::metadata(&p).map_or(0, |m| m.len());
            segs.push_back((p, len));
        }
        Ok(FileSink {
            dir,
            max_total,
            // Four segments to the budget, so deleting the oldest frees a
            // quarter; at least a block's worth.
            seg_max: (max_total / 4).max(BLOCK_TARGET as u64),
            next_index,
            cur: None,
            segs,
        })
    }

    /// Starts the next segment with `keyframe` (a block); deletes the
    /// oldest while the directory holds over the budget.
    fn rotate(&mut self, keyframe: &[u8]) -> std::io::Result<()> {
        let path = self.dir.join(format!("{:08}{SUFFIX}", self.next_index));
        self.next_index += 1;
        let mut f = File::create(&path)?;
        let head = segment::header();
        f.write_all(&head)?;
        f.write_all(keyframe)?;
        let len = (head.len() + keyframe.len()) as u64;
        metrics::counter!(m::RECORD_BYTES, "sink" => "file").increment(len);
        self.cur = Some((f, len));
        self.segs.push_back((path, len));
        self.trim();
        Ok(())
    }

    /// Deletes the oldest segments until the others and the room the new
    /// one may still grow into fit the budget: the directory stays within
    /// it (but for the last block written).
    fn trim(&mut self) {
        let mut total: u64 = self.segs.iter().map(|(_, l)| l).sum();
        let growing = self
            .segs
            .back()
            .map_or(0, |(_, l)| self.seg_max.saturating_sub(*l));
        while total + growing > self.max_total && self.segs.len() > 1 {
            let Some((p, l)) = self.segs.pop_front() else {
                break;
            };
            if let Err(e) = std::fs::remove_file(&p) {
                tracing::warn!(segment = %p.display(), error = %e, "an old recording segment was not deleted");
            }
            total -= l;
        }
    }

    fn write(&mut self, block: &[u8]) -> std::io::Result<()> {
        let Some((f, len)) = self.cur.as_mut() else {
            return Ok(());
        };
        f.write_all(block)?;
        *len += block.len() as u64;
        if let Some(last) = self.segs.back_mut() {
            last.1 = *len;
        }
        metrics::counter!(m::RECORD_BYTES, "sink" => "file").increment(block.len() as u64);
        Ok(())
    }

    fn full(&self) -> bool {
        self.cur
            .as_ref()
            .is_none_or(|(_, len)| *len >= self.seg_max)
    }
}

/// One admin call's stream: a single segment, for a while.
pub(crate) struct StreamSink {
    tx: tokio::sync::mpsc::Sender<Result<pb::RecordChunk, tonic::Status>>,
    until: Instant,
    left: u64,
    started: bool,
    /// Counted among the streams running until the sink goes.
    _slot: StreamSlot,
}

/// One of the streams allowed at once, given back when dropped.
pub(crate) struct StreamSlot(Arc<std::sync::atomic::AtomicUsize>);

impl StreamSlot {
    /// A slot of `running`, if fewer than `max` are taken.
    pub fn take(running: &Arc<std::sync::atomic::AtomicUsize>, max: usize) -> Option<StreamSlot> {
        running
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(Arc::clone(running)))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl StreamSink {
    pub fn new(
        tx: tokio::sync::mpsc::Sender<Result<pb::RecordChunk, tonic::Status>>,
        until: Instant,
        max_bytes: u64,
        slot: StreamSlot,
    ) -> StreamSink {
        StreamSink {
            tx,
            until,
            left: if max_bytes == 0 { 1 << 30 } else { max_bytes },
            started: false,
            _slot: slot,
        }
    }

    /// Sends `data`; false when the stream is over (its time, its bytes,
    /// its reader gone or too slow).
    fn send(&mut self, data: Vec<u8>) -> bool {
        let n = data.len() as u64;
        match self.tx.try_send(Ok(pb::RecordChunk { data })) {
            Ok(()) => {
                metrics::counter!(m::RECORD_BYTES, "sink" => "stream").increment(n);
                self.left = self.left.saturating_sub(n);
                self.left > 0
            }
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => {
                // Its last message says why it ends (room is not needed:
                // the reader is behind, so it finds this one when it
                // catches up, or never).
                let tx = self.tx.clone();
                std::thread::spawn(move || {
                    let _ = tx.blocking_send(Err(tonic::Status::resource_exhausted(
                        "the recording was read too slowly and ended early; what came before is whole",
                    )));
                });
                false
            }
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => false,
        }
    }
}

/// The writer's state.
struct Writer {
    hub: Arc<Hub>,
    rec: Arc<Recorder>,
    nodes: HashMap<String, Last>,
    raw: Vec<u8>,
    sinks: Vec<Sink>,
    last_flush: Instant,
    /// The server stops ([`Event::Finish`]).
    finishing: bool,
    /// The wall clock entries are stamped with, read once per batch of
    /// events (a read per entry would cost more than the entry).
    now_ms: u64,
    /// Buffers of the hand-written state entries.
    scratch: [Vec<u8>; 3],
    counted: Counted,
}

/// The writer's counters, registered once.
struct Counted {
    states: metrics::Counter,
    decisions: metrics::Counter,
    keyframes: metrics::Counter,
}

/// The writer thread: until its last sink ends.
pub(crate) fn run(hub: Arc<Hub>, rec: Arc<Recorder>, rx: Receiver<Event>, first: Sink) {
    let mut w = Writer {
        hub,
        rec,
        nodes: HashMap::new(),
        raw: Vec::with_capacity(BLOCK_TARGET * 2),
        sinks: Vec::new(),
        last_flush: Instant::now(),
        finishing: false,
        now_ms: unix_ms(),
        scratch: Default::default(),
        counted: Counted {
            states: metrics::counter!(m::RECORD_ENTRIES, "kind" => "state"),
            decisions: metrics::counter!(m::RECORD_ENTRIES, "kind" => "decision"),
            keyframes: metrics::counter!(m::RECORD_ENTRIES, "kind" => "keyframe"),
        },
    };
    w.attach(first);
    let mut batch = 0u32;
    loop {
        // Polled, never waited on: a sender finds no sleeping receiver to
        // wake, so recording adds no system call to a decision.
        let idle = match rx.try_recv() {
            Ok(e) => {
                w.event(e);
                false
            }
            Err(TryRecvError::Empty) => true,
            Err(TryRecvError::Disconnected) => break,
        };
        if w.finishing {
            break;
        }
        batch += 1;
        if idle || batch >= 256 {
            // The clocks are read once per batch, not per event.
            batch = 0;
            w.now_ms = unix_ms();
            w.hub.now_ms.store(w.now_ms, Ordering::Relaxed);
            if w.last_flush.elapsed() >= FLUSH_EVERY {
                w.flush();
            }
            if idle {
                std::thread::sleep(POLL);
            }
        }
        if w.raw.len() >= BLOCK_TARGET {
            w.flush();
        }
        if w.sinks.is_empty() && w.end(&rx) {
            return;
        }
    }
    w.flush();
}

impl Writer {
    fn event(&mut self, e: Event) {
        match e {
            Event::State {
                node,
                incarnation,
                spec,
                snap,
                report,
            } => self.state(node, incarnation, spec, snap, report),
            Event::Decision(d) => {
                let entry = decision_entry(*d, self.now_ms);
                segment::push_entry(&mut self.raw, &entry);
                self.counted.decisions.increment(1);
            }
            Event::Encoded(bytes) => {
                self.raw.extend_from_slice(&bytes);
                self.counted.decisions.increment(1);
            }
            Event::Attach(s) => self.attach(s),
            Event::Finish => self.finishing = true,
        }
    }

    /// A node's new state: against its last recorded one, or whole when
    /// the node is new, registered anew or went back in version.
    fn state(
        &mut self,
        node: String,
        incarnation: usize,
        spec: Arc<TopologySpec>,
        snap: Arc<Snapshot>,
        report: bool,
    ) {
        // One lookup: the node's last state is replaced where it lies.
        let (raw, scratch, now_ms) = (&mut self.raw, &mut self.scratch, self.now_ms);
        let last = match self.nodes.get_mut(&node) {
            Some(l) => l,
            None => self.nodes.entry(node.clone()).or_insert(Last {
                incarnation: 0,
                spec: Arc::clone(&spec),
                snap: Arc::clone(&snap),
            }),
        };
        let same = last.incarnation == incarnation
            && Arc::ptr_eq(&last.spec, &spec)
            && last.snap.version < snap.version;
        if !same {
            segment::push_entry(raw, &node_entry(&node, &spec));
        }
        let prev = same.then_some(&last.snap);
        push_state(raw, scratch, &node, (&snap, prev), report, now_ms);
        self.counted.states.increment(1);
        *last = Last {
            incarnation,
            spec,
            snap,
        };
    }

    /// The start entry and every node whole: what a sink begins with.
    fn keyframe(&mut self) -> Vec<u8> {
        let mut raw = Vec::new();
        let start = pb::RecordStart {
            format: segment::FORMAT,
            server_version: env!("CARGO_PKG_VERSION").to_string(),
            unix_ms: unix_ms(),
            system: Some(system_to_pb(&self.hub.system)),
            features: Some(features_to_pb(&self.hub.switches.global())),
            dropped: self.rec.dropped.load(Ordering::Relaxed),
        };
        segment::push_entry(&mut raw, &entry(Entry::Start(start)));
        let mut ids: Vec<&String> = self.nodes.keys().collect();
        ids.sort();
        for id in ids {
            let l = &self.nodes[id];
            segment::push_entry(&mut raw, &node_entry(id, &l.spec));
            let snap = (&*l.snap, None);
            push_state(&mut raw, &mut self.scratch, id, snap, false, self.now_ms);
        }
        self.counted.keyframes.increment(1);
        segment::block(&raw)
    }

    /// A new sink starts at a keyframe, after what the others have pending.
    fn attach(&mut self, sink: Sink) {
        self.flush();
        self.sinks.push(sink);
        self.start_sinks();
    }

    /// Gives every sink that needs one a keyframe (a new stream, a file
    /// sink whose segment is full); drops those that failed or ended.
    fn start_sinks(&mut self) {
        let mut keyframe: Option<Vec<u8>> = None;
        let mut kept = Vec::with_capacity(self.sinks.len());
        for mut s in std::mem::take(&mut self.sinks) {
            let alive = match &mut s {
                Sink::File(f) if f.full() => {
                    let k = keyframe.get_or_insert_with(|| self.keyframe());
                    f.rotate(k).map_err(|e| file_failed(&f.dir, e)).is_ok()
                }
                Sink::Stream(st) if !st.started => {
                    st.started = true;
                    let k = keyframe.get_or_insert_with(|| self.keyframe());
                    let mut first = segment::header().to_vec();
                    first.extend_from_slice(k);
                    st.send(first)
                }
                _ => true,
            };
            if alive {
                kept.push(s);
            }
        }
        self.sinks = kept;
    }

    /// Writes the pending entries as one block to every sink.
    fn flush(&mut self) {
        self.last_flush = Instant::now();
        let now = Instant::now();
        if !self.raw.is_empty() {
            let block = segment::block(&self.raw);
            self.raw.clear();
            self.sinks.retain_mut(|s| match s {
                Sink::File(f) => f.write(&block).map_err(|e| file_failed(&f.dir, e)).is_ok(),
                Sink::Stream(st) => st.send(block.clone()),
            });
        }
        self.sinks
            .retain(|s| !matches!(s, Sink::Stream(st) if now >= st.until));
        self.start_sinks();
    }

    /// With no sink left: ends the recorder unless a sink is on its way.
    fn end(&mut self, rx: &Receiver<Event>) -> bool {
        let hub = Arc::clone(&self.hub);
        let _one = hub.starting.lock().unwrap_or_else(PoisonError::into_inner);
        while let Ok(e) = rx.try_recv() {
            self.event(e);
        }
        if !self.sinks.is_empty() && !self.finishing {
            return false;
        }
        self.flush();
        // Only this writer's recorder: another may have started since a
        // finish took this one out.
        if hub
            .active
            .load()
            .as_ref()
            .is_some_and(|a| Arc::ptr_eq(a, &self.rec))
        {
            hub.active.store(None);
        }
        true
    }
}

fn file_failed(dir: &std::path::Path, e: std::io::Error) {
    tracing::error!(dir = %dir.display(), error = %e, "the recording stopped: its directory cannot be written");
}

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn entry(e: Entry) -> pb::RecordEntry {
    pb::RecordEntry { entry: Some(e) }
}

fn node_entry(id: &str, spec: &TopologySpec) -> pb::RecordEntry {
    entry(Entry::Node(pb::RecordNode {
        node_id: id.to_string(),
        topology: Some(convert::topology_to_pb(spec)),
    }))
}

/// Appends `snap` as the CPUs that changed since `prev` (all without
/// one), stamped `unix_ms`.
fn push_state(
    raw: &mut Vec<u8>,
    scratch: &mut [Vec<u8>; 3],
    id: &str,
    (snap, prev): (&Snapshot, Option<&Arc<Snapshot>>),
    report: bool,
    unix_ms: u64,
) {
    let st = &snap.state;
    let prev = prev.filter(|p| p.state.cpus.len() == st.cpus.len());
    let head = super::wire::StateHead {
        node: id,
        version: snap.version,
        unix_ms,
        report,
        full: prev.is_none(),
        features: match prev {
            Some(p) if p.features == snap.features => None,
            _ => Some(features_to_pb(&snap.features)),
        },
    };
    let changed = (0..st.cpus.len())
        .filter(|&i| {
            prev.is_none_or(|p| {
                st.cpus[i] != p.state.cpus[i] || st.core_cookie(i) != p.state.core_cookie(i)
            })
        })
        .map(|i| (i, &st.cpus[i], st.core_cookie(i)));
    super::wire::push_state(raw, &head, changed, scratch);
}

fn decision_entry(d: Decision, unix_ms: u64) -> pb::RecordEntry {
    use pb::record_decision::Request;
    let mut r = pb::RecordDecision {
        node_id: d.node,
        version: d.version,
        unix_ms,
        ..Default::default()
    };
    match d.what {
        Decided::Migrate { req, answer } => {
            r.request = Some(Request::Migrate(req));
            r.migrated = Some(answer);
        }
        Decided::Allocate {
            req,
            granted,
            leased,
            scanned,
        } => {
            r.request = Some(Request::Allocate(req));
            r.granted = granted.to_string();
            r.leased = leased.to_string();
            r.alloc_scanned = scanned;
        }
        Decided::Balance { req, answer } => {
            r.request = Some(Request::Balance(req));
            r.balanced = Some(answer);
        }
    }
    entry(Entry::Decision(r))
}

pub fn features_to_pb(f: &Features) -> pb::RecordFeatures {
    pb::RecordFeatures {
        on: FEATURE_NAMES
            .iter()
            .filter(|n| f.get(n) == Some(true))
            .map(|n| n.to_string())
            .collect(),
        kernel: f.kernel.as_str().to_string(),
    }
}

fn system_to_pb(s: &System) -> pb::RecordSystem {
    pb::RecordSystem {
        uclamp_used: s.uclamp_used,
        core_sched: s.core_sched,
        migration_cost_ns: s.migration_cost_ns,
        node_reclaim_distance: s.node_reclaim_distance,
    }
}
