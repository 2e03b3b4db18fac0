//! The binary records the BPF program (`snapshot.bpf.c`) writes, decoded.
//!
//! This module owns the byte layout on the Rust side and nothing else: one
//! read of the iterator is a sequence of fixed-size records, each starting
//! with its kind, in the C structs' natural layout (little-endian on the
//! machines the agent runs on; the program is compiled for the host).
//! [`decode`] fills reusable vectors, so a report allocates nothing once
//! they have grown. A record cut short or of an unknown kind ends the
//! decoding with an error that says so; no input panics.
//!
//! Keep [`CPU_SIZE`], [`TASK_SIZE`] and friends equal to the C structs'
//! sizes: the program's record version ([`VERSION`]) changes with them.

/// Record kinds and the layout version (`FP_REC_*`, `FP_RECORD_VERSION`).
pub const HEADER: u32 = 1;
pub const CPU: u32 = 2;
pub const TASK: u32 = 3;
pub const RAN: u32 = 4;
pub const VERSION: u32 = 1;

/// Sizes of `struct fp_header`, `fp_cpu`, `fp_task`, `fp_ran`.
pub const HEADER_SIZE: usize = 24;
pub const CPU_SIZE: usize = 128;
pub const TASK_SIZE: usize = 232;
pub const RAN_SIZE: usize = 32;

/// Words of a task's affinity mask in a record (`FP_MASK_WORDS`): the
/// program reports CPUs below `MAX_CPUS` only.
pub const MASK_WORDS: usize = 16;
pub const MAX_CPUS: usize = MASK_WORDS * 64;

/// `fp_cpu.flags`.
pub const CPU_PRESENT: u32 = 1 << 0;
pub const CPU_HAS_CAPACITY_ORIG: u32 = 1 << 2;
pub const CPU_CURR_IDLE: u32 = 1 << 3;
pub const CPU_ONLINE: u32 = 1 << 4;
pub const CPU_IN_IDLE_STATE: u32 = 1 << 5;

/// `fp_task.flags`.
pub const TASK_SCHED_DELAYED: u32 = 1 << 0;

/// The kernel's `PF_KTHREAD` in `task->flags`.
pub const PF_KTHREAD: u32 = 0x0020_0000;

/// One CPU's runqueue (`struct fp_cpu`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CpuRec {
    pub cpu: u32,
    pub flags: u32,
    pub nr_running: u32,
    pub nr_queued: u32,
    pub h_nr_queued: u32,
    pub h_nr_runnable: u32,
    pub h_nr_idle: u32,
    pub curr_pid: u32,
    pub ttwu_pending: u32,
    pub load_avg: u64,
    pub runnable_avg: u64,
    pub util_avg: u64,
    pub util_est: u64,
    /// `rq->clock` and `rq->clock_task`, ns.
    pub clock: u64,
    pub clock_task: u64,
    /// `rq->idle_stamp` (the rq clock when it last went idle; 0 once a
    /// task woke there) and `rq->avg_idle`, ns.
    pub idle_stamp: u64,
    pub avg_idle: u64,
    /// `rq->cpu_capacity` (capacity_of) and the CPU's original capacity.
    pub capacity: u64,
    pub capacity_orig: u64,
    /// `rq->idle_state->exit_latency`, µs, with [`CPU_IN_IDLE_STATE`].
    pub idle_exit_latency: u32,
}

impl CpuRec {
    pub fn present(&self) -> bool {
        self.flags & CPU_PRESENT != 0
    }
}

/// A queued task (`struct fp_task`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskRec {
    pub pid: u32,
    pub tgid: u32,
    pub cpu: u32,
    pub policy: u32,
    pub static_prio: i32,
    pub task_flags: u32,
    pub nr_cpus_allowed: u32,
    pub nr_threads: u32,
    pub migration_disabled: u32,
    pub on_rq: u32,
    pub flags: u32,
    pub weight: u64,
    pub load_avg: u64,
    pub runnable_avg: u64,
    pub util_avg: u64,
    pub util_est: u64,
    pub sum_exec_runtime: u64,
    pub exec_start: u64,
    pub cpus_allowed: [u64; MASK_WORDS],
}

impl TaskRec {
    pub fn kernel_thread(&self) -> bool {
        self.task_flags & PF_KTHREAD != 0
    }

    /// nice, from `static_prio` (120 + nice for normal tasks).
    pub fn nice(&self) -> i32 {
        (self.static_prio - 120).clamp(-20, 19)
    }

    /// The affinity as a cpulist ("0-3,8") of CPUs below `nr_cpus`.
    pub fn cpulist(&self, nr_cpus: usize) -> String {
        use std::fmt::Write;
        let n = nr_cpus.min(MAX_CPUS);
        let on = |c: usize| self.cpus_allowed[c / 64] & (1u64 << (c % 64)) != 0;
        let mut out = String::new();
        let mut c = 0;
        while c < n {
            if !on(c) {
                c += 1;
                continue;
            }
            let start = c;
            while c + 1 < n && on(c + 1) {
                c += 1;
            }
            let sep = if out.is_empty() { "" } else { "," };
            let _ = if start == c {
                write!(out, "{sep}{start}")
            } else {
                write!(out, "{sep}{start}-{c}")
            };
            c += 1;
        }
        out
    }
}

/// A task that is not queued but ran since the previous read: only what
/// the runtime accounting needs (`struct fp_ran`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RanRec {
    pub pid: u32,
    pub tgid: u32,
    pub cpu: u32,
    pub task_flags: u32,
    pub nr_threads: u32,
    pub sum_exec_runtime: u64,
}

/// One read, decoded.
#[derive(Debug, Default, Clone)]
pub struct Snapshot {
    /// The header's CPU count and `bpf_ktime_get_ns()` (CLOCK_MONOTONIC).
    pub nr_cpus: u32,
    pub ktime_ns: u64,
    /// The reading process's tgid in the initial pid namespace (the
    /// namespace of every pid in the records), 0 if unknown.
    pub reader_tgid: u32,
    /// CPU records by CPU id, `None` where none came.
    pub cpus: Vec<Option<CpuRec>>,
    pub tasks: Vec<TaskRec>,
    pub ran: Vec<RanRec>,
}

impl Snapshot {
    fn clear(&mut self) {
        self.nr_cpus = 0;
        self.ktime_ns = 0;
        self.reader_tgid = 0;
        self.cpus.clear();
        self.tasks.clear();
        self.ran.clear();
    }
}

/// Why a read could not be decoded whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    NoHeader,
    Version(u32),
    UnknownKind { kind: u32, at: usize },
    Truncated { kind: u32, at: usize },
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::NoHeader => write!(f, "the read does not start with a header record"),
            DecodeError::Version(v) => {
                write!(f, "record version {v}, this agent reads {VERSION}")
            }
            DecodeError::UnknownKind { kind, at } => {
                write!(f, "unknown record kind {kind} at byte {at}")
            }
            DecodeError::Truncated { kind, at } => {
                write!(f, "record of kind {kind} cut short at byte {at}")
            }
        }
    }
}

/// Little-endian fields of one record, read by offset.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn u32(&self, at: usize) -> u32 {
        self.0
            .get(at..at + 4)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u32::from_le_bytes)
    }
    fn i32(&self, at: usize) -> i32 {
        self.u32(at) as i32
    }
    fn u64(&self, at: usize) -> u64 {
        self.0
            .get(at..at + 8)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_le_bytes)
    }
}

fn cpu_rec(f: &Fields) -> CpuRec {
    CpuRec {
        cpu: f.u32(4),
        flags: f.u32(8),
        nr_running: f.u32(12),
        nr_queued: f.u32(16),
        h_nr_queued: f.u32(20),
        h_nr_runnable: f.u32(24),
        h_nr_idle: f.u32(28),
        curr_pid: f.u32(32),
        ttwu_pending: f.u32(36),
        load_avg: f.u64(40),
        runnable_avg: f.u64(48),
        util_avg: f.u64(56),
        util_est: f.u64(64),
        clock: f.u64(72),
        clock_task: f.u64(80),
        idle_stamp: f.u64(88),
        avg_idle: f.u64(96),
        capacity: f.u64(104),
        capacity_orig: f.u64(112),
        idle_exit_latency: f.u32(120),
    }
}

fn task_rec(f: &Fields) -> TaskRec {
    let mut cpus_allowed = [0u64; MASK_WORDS];
    for (i, w) in cpus_allowed.iter_mut().enumerate() {
        *w = f.u64(104 + 8 * i);
    }
    TaskRec {
        pid: f.u32(4),
        tgid: f.u32(8),
        cpu: f.u32(12),
        policy: f.u32(16),
        static_prio: f.i32(20),
        task_flags: f.u32(24),
        nr_cpus_allowed: f.u32(28),
        nr_threads: f.u32(32),
        migration_disabled: f.u32(36),
        on_rq: f.u32(40),
        flags: f.u32(44),
        weight: f.u64(48),
        load_avg: f.u64(56),
        runnable_avg: f.u64(64),
        util_avg: f.u64(72),
        util_est: f.u64(80),
        sum_exec_runtime: f.u64(88),
        exec_start: f.u64(96),
        cpus_allowed,
    }
}

fn ran_rec(f: &Fields) -> RanRec {
    RanRec {
        pid: f.u32(4),
        tgid: f.u32(8),
        cpu: f.u32(12),
        task_flags: f.u32(16),
        nr_threads: f.u32(20),
        sum_exec_runtime: f.u64(24),
    }
}

/// Decodes one read into `out` (cleared first). CPU records with an id of
/// `max_cpus` or more are dropped. On an error `out` holds what came
/// before it.
pub fn decode(buf: &[u8], max_cpus: usize, out: &mut Snapshot) -> Result<(), DecodeError> {
    out.clear();
    let mut at = 0;
    let mut header = false;
    while at < buf.len() {
        let kind = Fields(&buf[at..]).u32(0);
        let size = match kind {
            HEADER => HEADER_SIZE,
            CPU => CPU_SIZE,
            TASK => TASK_SIZE,
            RAN => RAN_SIZE,
            _ => return Err(DecodeError::UnknownKind { kind, at }),
        };
        let Some(rec) = buf.get(at..at + size) else {
            return Err(DecodeError::Truncated { kind, at });
        };
        let f = Fields(rec);
        match kind {
            HEADER => {
                let v = f.u32(4);
                if v != VERSION {
                    return Err(DecodeError::Version(v));
                }
                header = true;
                out.nr_cpus = f.u32(8);
                out.reader_tgid = f.u32(12);
                out.ktime_ns = f.u64(16);
                let n = (out.nr_cpus as usize).min(max_cpus);
                out.cpus.resize(n, None);
            }
            _ if !header => return Err(DecodeError::NoHeader),
            CPU => {
                let c = cpu_rec(&f);
                if let Some(slot) = out.cpus.get_mut(c.cpu as usize) {
                    *slot = Some(c);
                }
            }
            TASK => out.tasks.push(task_rec(&f)),
            _ => out.ran.push(ran_rec(&f)),
        }
        at += size;
    }
    if header {
        Ok(())
    } else {
        Err(DecodeError::NoHeader)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds records the way the C structs lay them out.
    #[derive(Default)]
    pub(crate) struct Writer(pub Vec<u8>);

    impl Writer {
        fn u32(&mut self, v: u32) -> &mut Self {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.0.extend_from_slice(&v.to_le_bytes());
            self
        }
        pub(crate) fn header(&mut self, nr_cpus: u32) -> &mut Self {
            self.u32(HEADER).u32(VERSION).u32(nr_cpus).u32(77).u64(42)
        }
        pub(crate) fn cpu(&mut self, c: &CpuRec) -> &mut Self {
            self.u32(CPU).u32(c.cpu).u32(c.flags).u32(c.nr_running);
            self.u32(c.nr_queued)
                .u32(c.h_nr_queued)
                .u32(c.h_nr_runnable);
            self.u32(c.h_nr_idle).u32(c.curr_pid).u32(c.ttwu_pending);
            for v in [
                c.load_avg,
                c.runnable_avg,
                c.util_avg,
                c.util_est,
                c.clock,
                c.clock_task,
                c.idle_stamp,
                c.avg_idle,
                c.capacity,
                c.capacity_orig,
            ] {
                self.u64(v);
            }
            self.u32(c.idle_exit_latency).u32(0)
        }
        pub(crate) fn task(&mut self, t: &TaskRec) -> &mut Self {
            self.u32(TASK)
                .u32(t.pid)
                .u32(t.tgid)
                .u32(t.cpu)
                .u32(t.policy);
            self.u32(t.static_prio as u32).u32(t.task_flags);
            self.u32(t.nr_cpus_allowed).u32(t.nr_threads);
            self.u32(t.migration_disabled).u32(t.on_rq).u32(t.flags);
            for v in [
                t.weight,
                t.load_avg,
                t.runnable_avg,
                t.util_avg,
                t.util_est,
                t.sum_exec_runtime,
                t.exec_start,
            ] {
                self.u64(v);
            }
            for w in t.cpus_allowed {
                self.u64(w);
            }
            self
        }
        pub(crate) fn ran(&mut self, r: &RanRec) -> &mut Self {
            self.u32(RAN)
                .u32(r.pid)
                .u32(r.tgid)
                .u32(r.cpu)
                .u32(r.task_flags);
            self.u32(r.nr_threads).u64(r.sum_exec_runtime)
        }
    }

    pub(crate) fn task(pid: u32, tgid: u32, cpu: u32) -> TaskRec {
        TaskRec {
            pid,
            tgid,
            cpu,
            policy: 0,
            static_prio: 120,
            task_flags: 0,
            nr_cpus_allowed: 2,
            nr_threads: 1,
            migration_disabled: 0,
            on_rq: 1,
            flags: 0,
            weight: 1024,
            load_avg: 512,
            runnable_avg: 600,
            util_avg: 500,
            util_est: 480,
            sum_exec_runtime: 1_000_000,
            exec_start: 5_000,
            cpus_allowed: [0b11, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        }
    }

    #[test]
    fn sizes_match_the_writer() {
        let c = CpuRec::default();
        assert_eq!(Writer::default().header(1).0.len(), HEADER_SIZE);
        assert_eq!(Writer::default().cpu(&c).0.len(), CPU_SIZE);
        assert_eq!(Writer::default().task(&task(1, 1, 0)).0.len(), TASK_SIZE);
        let r = RanRec {
            pid: 1,
            tgid: 1,
            cpu: 0,
            task_flags: 0,
            nr_threads: 1,
            sum_exec_runtime: 9,
        };
        assert_eq!(Writer::default().ran(&r).0.len(), RAN_SIZE);
    }

    #[test]
    fn a_read_decodes_into_cpus_tasks_and_ran() {
        let c1 = CpuRec {
            cpu: 1,
            flags: CPU_PRESENT | CPU_ONLINE,
            nr_running: 2,
            h_nr_queued: 2,
            h_nr_runnable: 2,
            load_avg: 886,
            runnable_avg: 2047,
            util_avg: 1023,
            util_est: 1100,
            clock: 77,
            clock_task: 70,
            idle_stamp: 0,
            avg_idle: 500_000,
            capacity: 1000,
            capacity_orig: 1024,
            ..Default::default()
        };
        let ran = RanRec {
            pid: 9,
            tgid: 8,
            cpu: 0,
            task_flags: PF_KTHREAD,
            nr_threads: 1,
            sum_exec_runtime: 123,
        };
        let mut w = Writer::default();
        w.header(2).cpu(&c1).task(&task(5, 4, 1)).ran(&ran);
        let mut s = Snapshot::default();
        decode(&w.0, 64, &mut s).unwrap();
        assert_eq!((s.nr_cpus, s.ktime_ns, s.reader_tgid), (2, 42, 77));
        assert_eq!(s.cpus, vec![None, Some(c1)]);
        assert_eq!(s.tasks, vec![task(5, 4, 1)]);
        assert_eq!(s.ran, vec![ran]);
        // Decoding again reuses the vectors.
        decode(&w.0, 1, &mut s).unwrap();
        assert_eq!(s.cpus, vec![None], "CPUs past max_cpus are dropped");
        assert_eq!(s.tasks.len(), 1);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        let mut s = Snapshot::default();
        assert_eq!(decode(&[], 8, &mut s), Err(DecodeError::NoHeader));
        let mut w = Writer::default();
        w.cpu(&CpuRec::default());
        assert_eq!(decode(&w.0, 8, &mut s), Err(DecodeError::NoHeader));
        let mut w = Writer::default();
        w.header(1).task(&task(1, 1, 0));
        let cut = &w.0[..w.0.len() - 3];
        assert_eq!(
            decode(cut, 8, &mut s),
            Err(DecodeError::Truncated {
                kind: TASK,
                at: HEADER_SIZE
            })
        );
        let mut w = Writer::default();
        w.header(1);
        w.0.extend_from_slice(&[7, 0, 0, 0, 1]);
        assert_eq!(
            decode(&w.0, 8, &mut s),
            Err(DecodeError::UnknownKind {
                kind: 7,
                at: HEADER_SIZE
            })
        );
        let mut v = Writer::default().header(1).0.clone();
        v[4] = 99;
        assert_eq!(decode(&v, 8, &mut s), Err(DecodeError::Version(99)));
        // A header claiming four billion CPUs allocates only max_cpus.
        let mut w = Writer::default();
        w.header(u32::MAX);
        decode(&w.0, 8, &mut s).unwrap();
        assert_eq!(s.cpus.len(), 8);
        // Arbitrary bytes: an error or a decoding, never a panic.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..600 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % 5) as u8
                })
                .collect();
            let _ = decode(&bytes, 8, &mut s);
        }
    }

    #[test]
    fn a_task_knows_its_nice_affinity_and_kind() {
        let mut t = task(1, 1, 0);
        assert_eq!(t.nice(), 0);
        t.static_prio = 139;
        assert_eq!(t.nice(), 19);
        t.static_prio = 0; // an RT task's static_prio is not a nice
        assert_eq!(t.nice(), -20);
        assert_eq!(t.cpulist(2), "0-1");
        t.cpus_allowed[0] = 0b1011_0001;
        assert_eq!(t.cpulist(8), "0,4-5,7");
        assert_eq!(t.cpulist(5), "0,4");
        t.cpus_allowed[1] = 1;
        assert_eq!(t.cpulist(MAX_CPUS + 10), "0,4-5,7,64");
        assert!(!t.kernel_thread());
        t.task_flags = PF_KTHREAD;
        assert!(t.kernel_thread());
    }
}
