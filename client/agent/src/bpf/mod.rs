//! The BPF signal source: the kernel's own per-CPU runqueue state and
//! runnable tasks, read by a small CO-RE program through a task iterator
//! (built with the `bpf` feature).
//!
//! This module owns loading the program ([`Program`]), one read per report
//! and turning its records ([`record`]) into what the server takes, the
//! same structures the sched/debug source ([`super::exact`]) fills: per-CPU
//! counts and PELT averages of the root cfs_rq with the agent's own
//! runnable threads taken out, task lists of the runnable fair-class tasks
//! (capped per CPU, biggest first), per-process runtime deltas.
//!
//! Why it is cheaper: a read is one `read()` loop on a fresh iterator fd,
//! binary records, no text. Its kernel side visits each task once with a
//! few loads and writes records only for the queued tasks and, for the
//! runtime accounting, for the tasks that ran since the previous read (the
//! agent gives the program each CPU's previous `clock_task`; a task whose
//! `exec_start` is not older ran since). Every [`FULL_EVERY`] reads lists
//! every task once, so the agent forgets the threads that exited.
//!
//! What it reads that sched/debug does not print: `rq->idle_stamp` itself
//! (the rq clock when the CPU last went idle, the clock `exact` uses for
//! its stand-in), the capacity left for CFS (`rq->cpu_capacity`), the
//! exit latency of the idle state the CPU is in (`rq->idle_state`), and
//! each task's `migration_disabled` and delayed-dequeue state.
//!
//! If a read fails (the program detached, an unexpected record), the agent
//! logs once and answers from the procfs reader from then on, as `exact`
//! does when sched/debug stops being readable.

pub mod record;

#[allow(clippy::all, clippy::pedantic, missing_docs, dead_code, unused_imports)]
mod skel {
    include!(concat!(env!("OUT_DIR"), "/snapshot.skel.rs"));
}

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::mem::MaybeUninit;

use fairplace_proto::v1 as pb;
use libbpf_rs::skel::{OpenSkel, SkelBuilder};

use super::tasks::{self, TaskSample};
use super::{MAX_CLOCK, MAX_SIGNAL, Machine, Source, TaskReport, task_to_pb};
use record::{CpuRec, Snapshot};

/// Task records (queued or ran) a read may hold; the program stops writing
/// past it and the agent stops reading past its bytes.
pub const MAX_TASK_RECORDS: u32 = 16_384;

/// Every this many reads, the program lists every task (not only the ones
/// that ran): the runtime accounting then forgets the threads that exited.
pub const FULL_EVERY: u64 = 64;

/// The loaded program and its iterator link.
pub struct Program {
    // The link first: it is dropped before the object its program is in.
    link: libbpf_rs::Link,
    skel: skel::SnapshotSkel<'static>,
    nr_cpus: usize,
    /// The bytes of a read past which the rest is not read.
    max_bytes: usize,
}

// SAFETY: the skeleton and link are handles to kernel objects (fds) and
// libbpf's bookkeeping of them; nothing in them is tied to the thread that
// made them. A Program is owned by one source, used through `&mut self`
// only, and moved (never shared) to the thread that reports.
unsafe impl Send for Program {}

impl Program {
    /// Loads and attaches the program for `nr_cpus` CPUs (at most
    /// [`record::MAX_CPUS`]). The error says what failed: no BTF, no
    /// privilege (CAP_BPF and CAP_PERFMON, or CAP_SYS_ADMIN), a kernel
    /// without task iterators (before 5.8), a verifier refusal.
    pub fn load(nr_cpus: usize) -> Result<Program, String> {
        if nr_cpus == 0 || nr_cpus > record::MAX_CPUS {
            return Err(format!(
                "{nr_cpus} CPUs: the BPF source reports 1..={} CPUs",
                record::MAX_CPUS
            ));
        }
        if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
            return Err(
                "the kernel has no BTF (/sys/kernel/btf/vmlinux): CO-RE cannot relocate".into(),
            );
        }
        // libbpf's own messages go to the agent's log, at debug level: the
        // reason a load failed is in the error returned (one log line when
        // `auto` moves on), not on stderr beside it.
        libbpf_rs::set_print(Some((libbpf_rs::PrintLevel::Debug, libbpf_log)));
        // The open object must outlive the skeleton, which lives as long as
        // the agent: one small allocation per load, kept.
        let open_object: &'static mut MaybeUninit<libbpf_rs::OpenObject> =
            Box::leak(Box::new(MaybeUninit::uninit()));
        let mut open = skel::SnapshotSkelBuilder::default()
            .open(open_object)
            .map_err(|e| format!("opening the BPF object: {e}"))?;
        let rodata = open
            .maps
            .rodata_data
            .as_deref_mut()
            .ok_or("the BPF object's read-only data is not mapped")?;
        rodata.nr_cpus = nr_cpus as u32;
        rodata.max_tasks = MAX_TASK_RECORDS;
        let skel = open
            .load()
            .map_err(|e| format!("loading the BPF program: {e}"))?;
        let link = skel
            .progs
            .snapshot
            .attach()
            .map_err(|e| format!("attaching the task iterator: {e}"))?;
        let max_bytes = record::HEADER_SIZE
            + nr_cpus * record::CPU_SIZE
            + MAX_TASK_RECORDS as usize * record::TASK_SIZE;
        let mut p = Program {
            link,
            skel,
            nr_cpus,
            max_bytes,
        };
        p.check()?;
        Ok(p)
    }

    /// One read at load time, so that a source that cannot work is refused
    /// at start (and `auto` moves on) rather than failing at its first
    /// report: it must decode and name at least one CPU (none without group
    /// scheduling, where a task's cfs_rq does not lead to its rq).
    fn check(&mut self) -> Result<(), String> {
        let mut buf = Vec::new();
        let mut snap = Snapshot::default();
        self.read(&vec![0; self.nr_cpus], &mut buf)
            .map_err(|e| format!("reading the task iterator: {e}"))?;
        record::decode(&buf, self.nr_cpus, &mut snap).map_err(|e| e.to_string())?;
        if !snap.cpus.iter().flatten().any(|c| c.present()) {
            return Err(
                "the program found no runqueue (a kernel without CONFIG_FAIR_GROUP_SCHED?)".into(),
            );
        }
        Ok(())
    }

    /// One read into `buf` (cleared first): a new iterator fd, read until
    /// its end or [`Program::max_bytes`]. `ran_since[cpu]` is each CPU's
    /// `clock_task` at the previous read (zeros: list every task).
    pub fn read(&mut self, ran_since: &[u64], buf: &mut Vec<u8>) -> std::io::Result<()> {
        if let Some(bss) = self.skel.maps.bss_data.as_deref_mut() {
            let n = self.nr_cpus.min(bss.ran_since.len());
            for (i, slot) in bss.ran_since[..n].iter_mut().enumerate() {
                *slot = ran_since.get(i).copied().unwrap_or(0);
            }
        }
        let mut it = libbpf_rs::Iter::new(&self.link).map_err(std::io::Error::other)?;
        buf.clear();
        loop {
            let at = buf.len();
            if at >= self.max_bytes {
                break;
            }
            // Each read() returns at most the iterator's buffer (8 pages).
            buf.resize(at + (64 << 10), 0);
            let got = match it.read(&mut buf[at..]) {
                Ok(k) => k,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                Err(e) => {
                    buf.truncate(at);
                    return Err(e);
                }
            };
            buf.truncate(at + got);
            if got == 0 {
                break;
            }
        }
        Ok(())
    }

    /// Task records the program wrote in the last read.
    pub fn tasks_written(&self) -> u32 {
        self.skel
            .maps
            .bss_data
            .as_deref()
            .map_or(0, |b| b.tasks_written)
    }
}

/// libbpf's messages, one trimmed line each, at debug level.
fn libbpf_log(_level: libbpf_rs::PrintLevel, msg: String) {
    tracing::debug!(target: "libbpf", "{}", msg.trim_end());
}

/// A thread the runtime accounting knows.
#[derive(Debug, Clone, Copy)]
struct Thread {
    tgid: u32,
    sum_exec_ns: u64,
    /// The read that last listed it.
    seen: u64,
}

/// The machine's signals from the BPF program.
pub struct Bpf {
    machine: Machine,
    program: Program,
    failed: bool,
    buf: Vec<u8>,
    snap: Snapshot,
    reads: u64,
    /// Per CPU, `clock_task` at the last read: the program's `ran_since`.
    clock_task: Vec<u64>,
    /// Per CPU: the rq clock when an idle CPU without a kernel stamp was
    /// first seen idle; 0 while busy (see [`idle_stamp`]).
    first_idle: Vec<i64>,
    /// Topology capacity per CPU: the bound of `capacity`.
    capacity_orig: Vec<u32>,
    accounting: Accounting,
    runtime: Vec<pb::ProcessRuntime>,
}

impl Bpf {
    /// Loads the program for `machine`'s CPUs.
    pub fn open(machine: Machine) -> Result<Bpf, String> {
        let program = Program::load(machine.nr_cpus())?;
        Ok(Bpf::new(machine, program))
    }

    pub fn new(machine: Machine, program: Program) -> Bpf {
        let n = machine.nr_cpus();
        let capacity_orig = machine.topo.cpus.iter().map(|c| c.capacity).collect();
        Bpf {
            machine,
            program,
            failed: false,
            buf: Vec::new(),
            snap: Snapshot::default(),
            reads: 0,
            clock_task: vec![0; n],
            first_idle: vec![0; n],
            capacity_orig,
            accounting: Accounting::default(),
            runtime: Vec::new(),
        }
    }

    /// One read, decoded into `self.snap`; the error says why not.
    fn read(&mut self) -> Result<bool, String> {
        let full = self.reads.is_multiple_of(FULL_EVERY);
        let zeros;
        let since: &[u64] = if full {
            zeros = vec![0u64; self.clock_task.len()];
            &zeros
        } else {
            &self.clock_task
        };
        self.program
            .read(since, &mut self.buf)
            .map_err(|e| format!("reading the task iterator: {e}"))?;
        record::decode(&self.buf, self.machine.nr_cpus(), &mut self.snap)
            .map_err(|e| e.to_string())?;
        self.reads += 1;
        Ok(full)
    }
}

/// The kernel's idle stamp as the agent sends it: `rq->idle_stamp` for an
/// idle CPU (the kernel's own, on the rq clock as `exact` documents), or,
/// for an idle CPU the kernel has not stamped (it was woken and the
/// wakee, the agent's own reader, left; or no newidle balance ran), the
/// rq clock when the agent first saw it idle. 0 while busy, as the
/// kernel's is; never 0 for an idle CPU.
fn idle_stamp(first_idle: &mut i64, idle: bool, c: &CpuRec) -> i64 {
    let seen =
        super::exact::update_idle_stamp(first_idle, idle, c.clock.min(MAX_CLOCK as u64) as i64);
    if idle && c.idle_stamp > 0 {
        c.idle_stamp.min(MAX_CLOCK as u64) as i64
    } else {
        seen
    }
}

/// One CPU as the protocol carries it, `own` runnable threads of the agent
/// taken out; `cap` is the topology's capacity of the CPU.
fn cpu_state(c: &CpuRec, own: u32, cap: u32) -> pb::CpuState {
    let nr = c.nr_running.saturating_sub(own);
    let queued = c.h_nr_queued.saturating_sub(own).min(nr);
    let runnable = c.h_nr_runnable.saturating_sub(own).min(queued);
    let clamp = |v: u64| v.min(MAX_SIGNAL as u64) as i64;
    let capacity = (c.capacity > 0).then(|| (c.capacity.min(cap as u64) as u32).max(1));
    pb::CpuState {
        id: c.cpu,
        online: c.flags & record::CPU_ONLINE != 0,
        nr_running: nr,
        h_nr_idle: c.h_nr_idle.min(nr),
        nr_delayed: queued - runnable,
        cfs_h_nr_queued: Some(queued),
        load_avg: clamp(c.load_avg),
        runnable_avg: clamp(c.runnable_avg),
        util_avg: clamp(c.util_avg),
        util_est: clamp(c.util_est),
        capacity,
        idle_exit_latency: (c.flags & record::CPU_IN_IDLE_STATE != 0)
            .then_some(c.idle_exit_latency),
        ..Default::default()
    }
}

impl Snapshot {
    /// The agent's process as the records name it: the reader's tgid the
    /// program saw (the initial pid namespace, where a containerised agent
    /// has another pid than its own getpid()).
    fn me(&self) -> u32 {
        if self.reader_tgid != 0 {
            self.reader_tgid
        } else {
            std::process::id()
        }
    }
}

/// Runnable threads of process `me` per CPU, from the task records.
fn own_per_cpu(snap: &Snapshot, me: u32, n: usize) -> Vec<u32> {
    let mut own = vec![0u32; n];
    for t in snap.tasks.iter().filter(|t| t.tgid == me) {
        if let Some(k) = own.get_mut(t.cpu as usize) {
            *k += 1;
        }
    }
    own
}

impl Source for Bpf {
    fn topology(&self) -> pb::Topology {
        self.machine.topology()
    }

    fn signal_source(&self) -> pb::SignalSource {
        crate::source_or_procfs(self.failed, pb::SignalSource::Bpf)
    }

    fn sample(&mut self) -> Vec<pb::CpuState> {
        if self.failed {
            return self.machine.sample();
        }
        let t0 = std::time::Instant::now();
        let full = match self.read() {
            Ok(full) => full,
            Err(e) => {
                tracing::warn!(error = %e, "the BPF source stopped working: signals come from /proc from now on (approximate)");
                self.failed = true;
                return self.machine.sample();
            }
        };
        let n = self.machine.nr_cpus();
        let me = self.snap.me();
        let own = own_per_cpu(&self.snap, me, n);
        let mut out = Vec::with_capacity(n);
        for (i, &mine) in own.iter().enumerate() {
            let Some(c) = self
                .snap
                .cpus
                .get(i)
                .copied()
                .flatten()
                .filter(|c| c.present())
            else {
                self.first_idle[i] = 0;
                out.push(pb::CpuState {
                    id: i as u32,
                    ..Default::default()
                });
                continue;
            };
            let cap = self.capacity_orig.get(i).copied().unwrap_or(1024);
            let mut s = cpu_state(&c, mine, cap);
            s.id = i as u32;
            let idle = s.online && s.nr_running == 0;
            s.idle_stamp = idle_stamp(&mut self.first_idle[i], idle, &c);
            self.clock_task[i] = c.clock_task;
            out.push(s);
        }
        if self.machine.task_cap > 0 {
            let truncated = self.program.tasks_written() >= MAX_TASK_RECORDS;
            self.runtime =
                self.accounting
                    .account(&self.snap, self.reads, full && !truncated, me, n);
        }
        self.machine.last_read = t0.elapsed();
        out
    }

    fn sample_tasks(&mut self) -> Option<TaskReport> {
        if self.failed {
            return self.machine.sample_tasks();
        }
        if self.machine.task_cap == 0 {
            return None;
        }
        let n = self.machine.nr_cpus();
        let cpus = task_lists(
            &self.snap,
            self.snap.me(),
            n,
            self.machine.task_cap,
            &self.clock_task,
        );
        Some(TaskReport {
            cpus,
            runtime: std::mem::take(&mut self.runtime),
        })
    }
}

/// The runnable fair-class tasks of `snap` per CPU, the agent's (`me`)
/// left out, at most `cap` per CPU (biggest first), with each CPU's
/// `clock_task` of the same read.
fn task_lists(
    snap: &Snapshot,
    me: u32,
    n: usize,
    cap: usize,
    clock_task: &[u64],
) -> Vec<pb::CpuTasks> {
    let curr: Vec<u32> = (0..n)
        .map(|i| {
            snap.cpus
                .get(i)
                .copied()
                .flatten()
                .map_or(0, |c| c.curr_pid)
        })
        .collect();
    let mut per_cpu: Vec<Vec<TaskSample>> = vec![Vec::new(); n];
    // Flags the sample type has no room for, by thread id.
    let mut extra: HashMap<u32, (bool, bool)> = HashMap::new();
    for t in &snap.tasks {
        let cpu = t.cpu as usize;
        if cpu >= n || t.tgid == me || !matches!(t.policy, 0 | 3 | 5) {
            continue;
        }
        let delayed = t.flags & record::TASK_SCHED_DELAYED != 0;
        if t.migration_disabled > 0 || delayed {
            extra.insert(t.pid, (t.migration_disabled > 0, delayed));
        }
        let avg = |v: u64| v.min(i64::MAX as u64) as i64;
        per_cpu[cpu].push(TaskSample {
            policy: t.policy,
            nice: t.nice(),
            kernel_thread: t.kernel_thread(),
            cpus_allowed: t.cpulist(n),
            nr_cpus_allowed: t.nr_cpus_allowed,
            nr_threads: t.nr_threads,
            load_avg: avg(t.load_avg),
            util_avg: avg(t.util_avg),
            runnable_avg: avg(t.runnable_avg),
            util_est: avg(t.util_est),
            exec_start_ns: t.exec_start,
            sum_exec_runtime_ns: t.sum_exec_runtime,
            running: t.pid == curr[cpu] && t.pid != 0,
            ..TaskSample::bare(t.pid, t.tgid, t.cpu, 'R')
        });
    }
    tasks::cap_biggest_first(&mut per_cpu, cap);
    per_cpu
        .iter()
        .enumerate()
        .map(|(i, l)| pb::CpuTasks {
            cpu: i as u32,
            tasks: l
                .iter()
                .map(|t| {
                    let mut p = task_to_pb(t, n);
                    if let Some(&(md, delayed)) = extra.get(&t.tid) {
                        p.migration_disabled = md;
                        p.sched_delayed = delayed;
                    }
                    p
                })
                .collect(),
            clock_task: clock_task
                .get(i)
                .map_or(0, |&c| c.min(MAX_CLOCK as u64) as i64),
        })
        .collect()
}

/// Per-thread runtime counters between reads.
#[derive(Debug, Default)]
struct Accounting {
    threads: HashMap<u32, Thread>,
}

impl Accounting {
    /// Per-(process, CPU) runtime since the previous read, from the queued
    /// and ran records of read number `read`, attributed to the CPU the
    /// thread is on now (as the other sources do). A thread seen for the
    /// first time only sets its base. Threads are forgotten only after a
    /// full listing (`prune`) that did not list them: between full
    /// listings a thread that did not run is not listed, and keeps its
    /// base. Kernel threads, the agent's (`me`) and CPUs `>= n` count for
    /// nothing.
    fn account(
        &mut self,
        snap: &Snapshot,
        read: u64,
        prune: bool,
        me: u32,
        n: usize,
    ) -> Vec<pb::ProcessRuntime> {
        let mut sums: BTreeMap<(u32, u32), u64> = BTreeMap::new();
        let mut nr_threads: HashMap<u32, u32> = HashMap::new();
        let queued = snap.tasks.iter().map(|t| {
            (
                t.pid,
                t.tgid,
                t.cpu,
                t.task_flags,
                t.nr_threads,
                t.sum_exec_runtime,
            )
        });
        let ran = snap.ran.iter().map(|r| {
            (
                r.pid,
                r.tgid,
                r.cpu,
                r.task_flags,
                r.nr_threads,
                r.sum_exec_runtime,
            )
        });
        for (pid, tgid, cpu, flags, threads, sum) in queued.chain(ran) {
            let delta = match self.threads.get(&pid) {
                Some(k) if k.seen == read => continue, // listed twice
                Some(k) if k.tgid == tgid && k.sum_exec_ns <= sum => sum - k.sum_exec_ns,
                _ => 0,
            };
            self.threads.insert(
                pid,
                Thread {
                    tgid,
                    sum_exec_ns: sum,
                    seen: read,
                },
            );
            if flags & record::PF_KTHREAD != 0 || tgid == me || cpu as usize >= n {
                continue;
            }
            let k = nr_threads.entry(tgid).or_default();
            *k = (*k).max(threads);
            if delta > 0 {
                let s = sums.entry((tgid, cpu)).or_default();
                *s = s.saturating_add(delta);
            }
        }
        if prune {
            self.threads.retain(|_, t| t.seen == read);
        }
        sums.into_iter()
            .map(|((group, cpu), ns)| pb::ProcessRuntime {
                group: group as u64,
                cpu,
                runtime_ns: ns.min(1_000_000_000_000),
                nr_threads: nr_threads.get(&group).copied().unwrap_or(1).max(1),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
