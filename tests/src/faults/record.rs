//! The history a fault run records: every client call with its monotonic
//! invoke and complete times and outcome, what each simulated agent was
//! told, and snapshots of the lease store, in the checker's types
//! (`crate::history`).

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tonic::{Code, Status};

use crate::history::{
    AgentEvent, AgentWhat, Answer, Call, History, Nanos, Op, Outcome, Record, Snapshot,
};

/// Everything recorded so far, with the run's clock.
pub struct Recorder {
    t0: Instant,
    ops: Mutex<Vec<Op>>,
    agents: Mutex<Vec<AgentEvent>>,
    snapshots: Mutex<Vec<Snapshot>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            t0: Instant::now(),
            ops: Mutex::default(),
            agents: Mutex::default(),
            snapshots: Mutex::default(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Recorder {
    /// Nanoseconds since the run began.
    pub fn now(&self) -> Nanos {
        self.t0.elapsed().as_nanos() as Nanos
    }

    pub fn op(&self, client: u32, invoke: Nanos, call: Call, outcome: Outcome) {
        let complete = self.now();
        lock(&self.ops).push(Op {
            client,
            invoke,
            complete,
            call,
            outcome,
        });
    }

    pub fn agent(&self, node: &str, what: AgentWhat) {
        let at = self.now();
        lock(&self.agents).push(AgentEvent {
            node: node.to_string(),
            at,
            what,
        });
    }

    pub fn snapshot(&self, invoke: Nanos, records: Vec<Record>) {
        let complete = self.now();
        lock(&self.snapshots).push(Snapshot {
            invoke,
            complete,
            records,
        });
    }

    /// The history as recorded.
    pub fn history(&self) -> History {
        History {
            ops: lock(&self.ops).clone(),
            snapshots: lock(&self.snapshots).clone(),
            agents: lock(&self.agents).clone(),
        }
    }

    pub fn elapsed(&self) -> Duration {
        self.t0.elapsed()
    }
}

/// A failed call's outcome: certainly not applied (the server refused it
/// before it changed anything) or unknown (it may have applied: a
/// timeout, a lost connection, UNAVAILABLE from a store that did not
/// acknowledge).
pub fn failed(s: &Status) -> Outcome {
    let certain = matches!(
        s.code(),
        Code::NotFound
            | Code::InvalidArgument
            | Code::PermissionDenied
            | Code::ResourceExhausted
            | Code::FailedPrecondition
            | Code::AlreadyExists
            | Code::Unauthenticated
    );
    let message = format!("{:?}: {}", s.code(), s.message());
    if certain {
        Outcome::Failed {
            not_found: s.code() == Code::NotFound,
            message,
        }
    } else {
        Outcome::Unknown { message }
    }
}

/// The outcome of a call that gave no answer in time.
pub fn timed_out() -> Outcome {
    Outcome::Unknown {
        message: "no answer within the call's deadline".into(),
    }
}

/// An Ok answer.
pub fn ok(a: Answer) -> Outcome {
    Outcome::Ok(a)
}

/// The CPUs of a cpulist ("0-2,5"); an unreadable one is empty.
pub fn cpus(list: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        if let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) {
            out.extend(a..=b.min(a.saturating_add(4096)));
        }
    }
    out
}

/// A small, seeded generator (SplitMix64): runs are repeatable from a seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next_u64() % n }
    }

    /// A duration in `lo..=hi` milliseconds.
    pub fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.below(hi.saturating_sub(lo) + 1))
    }
}
