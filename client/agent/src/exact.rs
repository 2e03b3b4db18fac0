//! The machine's state from the kernel's own signals (`sched/debug`): the
//! exact per-CPU counts and PELT averages, runnable tasks from the kernel's
//! per-CPU task table, per-process runtime from the same table.
//!
//! This module owns turning one read of the file into what the server
//! takes: the agent's own threads taken out of the counts (it is running
//! while it reads, it is not the workload), an idle stamp for idle CPUs,
//! task lists read from `/proc` only for the threads the table shows
//! runnable, and runtime deltas from the table's `sum-exec` column. The
//! cost then follows the runnable threads, not all threads: the kernel
//! prints one short row per thread (a few hundred nanoseconds each), and
//! `/proc` is opened three times per runnable thread plus once per thread
//! the agent has not seen before (its process id, kept in a cache).
//!
//! The kernel's side of a read is not free: it walks every thread of the
//! machine once per CPU and prints a row for each, about 1 µs per thread
//! (3-5 ms with 3,000 threads, cold caches). Reads are therefore paced by
//! a CPU budget ([`Exact::with_budget`], a share of one core): each call
//! earns the budget's share of the time since the previous one, a read
//! spends its measured thread CPU time, and a call without credit skips the
//! read and returns the last state (the update is then a heartbeat). At a
//! 1 s interval nothing is ever skipped; at 100 ms with thousands of
//! threads some ticks are.
//!
//! If the file stops being readable (debugfs unmounted), the agent logs
//! once and goes on with the procfs reader it was built around.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use fairplace_proto::v1 as pb;

use super::sched_debug::{self, CpuSignals};
use super::tasks::{self, TaskSample};
use super::{MAX_CLOCK, MAX_SIGNAL, Machine, Source, TaskReport, procfs, sysfs, task_to_pb};

/// A thread the table listed, as the runtime accounting needs it.
#[derive(Debug, Clone, Copy)]
struct Thread {
    tgid: u32,
    kernel: bool,
    /// `sum-exec` when last seen: a smaller one means the tid was reused.
    sum_exec_ns: u64,
}

/// The kernel's signals for every CPU of this machine.
pub struct Exact {
    machine: Machine,
    reader: sched_debug::Reader,
    /// The file failed: the procfs reader answers from then on.
    failed: bool,
    /// The last read, for the task lists of the same sample.
    last: Vec<CpuSignals>,
    /// Per CPU: the rq clock when it was first seen idle; 0 while busy.
    idle_stamp: Vec<i64>,
    threads: HashMap<u32, Thread>,
    /// Reading budget in parts per million of one core; 0: unpaced.
    budget_ppm: u64,
    /// CPU time (ns) reads may still spend; negative: skip.
    credit_ns: i64,
    last_call: Option<std::time::Instant>,
    /// The states of the last read, returned when a read is skipped.
    last_states: Vec<pb::CpuState>,
    /// The last call skipped its read (its task lists are not sent).
    skipped: bool,
}

/// This thread's CPU time, ns.
fn thread_cpu_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

impl Exact {
    pub fn new(machine: Machine, reader: sched_debug::Reader) -> Exact {
        let n = machine.nr_cpus();
        Exact {
            machine,
            reader,
            failed: false,
            last: Vec::new(),
            idle_stamp: vec![0; n],
            threads: HashMap::new(),
            budget_ppm: 0,
            credit_ns: 0,
            last_call: None,
            last_states: Vec::new(),
            skipped: false,
        }
    }

    /// Paces reads to `pct` % of one core (0: every call reads).
    pub fn with_budget(mut self, pct: f64) -> Exact {
        self.budget_ppm = (pct.clamp(0.0, 100.0) * 10_000.0) as u64;
        self
    }

    /// Whether this call may read: credit earned since the last call, at
    /// most one second's worth banked.
    fn may_read(&mut self) -> bool {
        if self.budget_ppm == 0 || self.last_states.is_empty() {
            return true;
        }
        let now = std::time::Instant::now();
        let dt = self.last_call.map_or(0, |t| (now - t).as_nanos() as i64);
        self.last_call = Some(now);
        let cap = (self.budget_ppm as i64) * 1_000; // 1 s of budget, ns
        self.credit_ns = (self.credit_ns + dt * self.budget_ppm as i64 / 1_000_000).min(cap);
        self.credit_ns >= 0
    }

    /// Charges a read. The debt is bounded by one second of budget: the
    /// first read after many new threads (one `status` each) would
    /// otherwise stop reads for many seconds.
    fn spend(&mut self, ns: i64) {
        let cap = (self.budget_ppm as i64) * 1_000;
        self.credit_ns = (self.credit_ns - ns).max(-cap);
    }

    /// One read of the file; on the first failure, the switch to procfs.
    fn read(&mut self) -> Option<Vec<CpuSignals>> {
        let parsed = self
            .reader
            .read()
            .map_err(|e| e.to_string())
            .and_then(|t| sched_debug::parse(t).map_err(|e| e.to_string()));
        match parsed {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(error = %e, "sched/debug stopped being readable: signals come from /proc from now on (approximate)");
                self.failed = true;
                None
            }
        }
    }
}

/// This process's thread ids: the agent's own rows in the table.
fn own_threads(proc: &Path) -> HashSet<u32> {
    std::fs::read_dir(proc.join("self/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Subtracts `k` runnable tasks of the agent from a count.
fn less(v: u32, k: u32) -> u32 {
    v.saturating_sub(k)
}

/// `rq->idle_stamp`, which sched/debug does not print: the runqueue clock
/// the file printed when the CPU was first seen idle. An idle CPU's clock
/// stops with its tick (NOHZ) and was last updated about when it went idle,
/// so this is close to, and never after, the kernel's stamp; it stays while
/// the CPU stays idle and is 0 while it is busy, as the kernel's is.
pub(crate) fn update_idle_stamp(stamp: &mut i64, idle: bool, clock_ns: i64) -> i64 {
    if !idle {
        *stamp = 0;
    } else if *stamp == 0 {
        *stamp = clock_ns.clamp(1, MAX_CLOCK);
    }
    *stamp
}

/// The runnable rows of one CPU's table to list, as (tid, running): the
/// agent's own left out, and the rows of a thread `listed` already holds.
///
/// The file is printed CPU by CPU without the runqueue locks: a thread that
/// migrates meanwhile shows on two CPUs, and a CPU that switches tasks
/// meanwhile marks two rows current. The server rightly refuses both (a
/// task listed twice, a second running task), so a thread is listed where
/// it was seen first, and one row per CPU runs: `rq->curr` as the CPU's
/// block printed it, else the first row marked current.
fn runnable_rows(
    c: &CpuSignals,
    own: &HashSet<u32>,
    listed: &mut HashSet<u32>,
) -> Vec<(u32, bool)> {
    let rows = || {
        c.tasks
            .iter()
            .filter(|t| t.runnable() && !own.contains(&t.tid))
    };
    let curr = rows()
        .find(|t| t.current && t.tid == c.curr_pid)
        .or_else(|| rows().find(|t| t.current))
        .map(|t| t.tid);
    rows()
        .filter(|t| listed.insert(t.tid))
        .map(|t| (t.tid, curr == Some(t.tid)))
        .collect()
}

/// One CPU as the protocol carries it, the agent's own runnable threads
/// taken out.
fn cpu_state(c: &CpuSignals, id: u32, online: bool, own: u32) -> pb::CpuState {
    let cfs = c.cfs.unwrap_or_default();
    let nr = less(c.nr_running, own);
    let queued = less(cfs.h_nr_queued, own).min(nr);
    let runnable = less(cfs.h_nr_runnable, own).min(queued);
    let clamp = |v: i64| v.clamp(0, MAX_SIGNAL);
    pb::CpuState {
        id,
        online,
        nr_running: nr,
        h_nr_idle: cfs.h_nr_idle.min(nr),
        nr_delayed: queued - runnable,
        cfs_h_nr_queued: Some(queued),
        load_avg: clamp(cfs.load_avg),
        runnable_avg: clamp(cfs.runnable_avg),
        util_avg: clamp(cfs.util_avg),
        util_est: clamp(cfs.util_est),
        ..Default::default()
    }
}

impl Source for Exact {
    fn topology(&self) -> pb::Topology {
        self.machine.topology()
    }

    fn signal_source(&self) -> pb::SignalSource {
        crate::source_or_procfs(self.failed, pb::SignalSource::SchedDebug)
    }

    fn sample(&mut self) -> Vec<pb::CpuState> {
        if self.failed {
            return self.machine.sample();
        }
        if !self.may_read() {
            self.skipped = true;
            metrics::counter!("fairplace_agent_reads_skipped_total").increment(1);
            return self.last_states.clone();
        }
        self.skipped = false;
        let t0 = std::time::Instant::now();
        let c0 = thread_cpu_ns();
        let Some(cpus) = self.read() else {
            return self.machine.sample();
        };
        let n = self.machine.nr_cpus();
        let online = sysfs::read_online(&self.machine.sys).ok();
        let own = own_threads(&self.machine.proc);
        let by_id: HashMap<u32, &CpuSignals> = cpus.iter().map(|c| (c.cpu, c)).collect();
        let out = (0..n as u32)
            .map(|i| {
                // Offline CPUs are not printed.
                let Some(c) = by_id.get(&i) else {
                    self.idle_stamp[i as usize] = 0;
                    return pb::CpuState {
                        id: i,
                        ..Default::default()
                    };
                };
                let is_online = online.as_ref().is_none_or(|o| o.contains(&i));
                let mine = c
                    .tasks
                    .iter()
                    .filter(|t| t.runnable() && own.contains(&t.tid))
                    .count() as u32;
                let mut s = cpu_state(c, i, is_online, mine);
                let idle = is_online && s.nr_running == 0;
                s.idle_stamp =
                    update_idle_stamp(&mut self.idle_stamp[i as usize], idle, c.clock_ns);
                s.idle_exit_latency = sysfs::idle_exit_latency(&self.machine.sys, i);
                s
            })
            .collect();
        self.last = cpus;
        self.machine.last_read = t0.elapsed();
        self.spend(thread_cpu_ns() - c0);
        self.last_states.clone_from(&out);
        out
    }

    fn sample_tasks(&mut self) -> Option<TaskReport> {
        if self.failed {
            return self.machine.sample_tasks();
        }
        if self.machine.task_cap == 0 || self.skipped {
            return None;
        }
        let c0 = thread_cpu_ns();
        let report = self.tasks();
        self.spend(thread_cpu_ns() - c0);
        Some(report)
    }
}

impl Exact {
    /// The task lists and runtime of the last read.
    fn tasks(&mut self) -> TaskReport {
        let n = self.machine.nr_cpus();
        let own = own_threads(&self.machine.proc);
        let runtime = self.runtime(&own, n);
        let mut per_cpu: Vec<Vec<TaskSample>> = vec![Vec::new(); n];
        let mut clocks = vec![0i64; n];
        let mut listed: HashSet<u32> = HashSet::new();
        for c in self.last.iter().filter(|c| (c.cpu as usize) < n) {
            clocks[c.cpu as usize] = c.clock_task_ns.max(0);
            let queue = &mut per_cpu[c.cpu as usize];
            for (tid, running) in runnable_rows(c, &own, &mut listed) {
                if let Some(mut s) = read_runnable(&self.machine.proc, tid, self.machine.tick_ns)
                    && matches!(s.policy, 0 | 3 | 5)
                {
                    s.cpu = c.cpu;
                    s.running = running;
                    queue.push(s);
                }
            }
        }
        tasks::cap_biggest_first(&mut per_cpu, self.machine.task_cap);
        let cpus = per_cpu
            .iter()
            .enumerate()
            .map(|(i, l)| pb::CpuTasks {
                cpu: i as u32,
                tasks: l.iter().map(|t| task_to_pb(t, n)).collect(),
                clock_task: clocks[i],
            })
            .collect();
        TaskReport { cpus, runtime }
    }

    /// Per-(process, CPU) runtime since the last sample, from the table's
    /// `sum-exec` of every thread, attributed to the CPU it is on now (as
    /// the procfs reader does). A thread seen for the first time costs one
    /// read of its `status` for its process id; the cache forgets threads
    /// the table no longer lists.
    fn runtime(&mut self, own: &HashSet<u32>, n: usize) -> Vec<pb::ProcessRuntime> {
        let me = std::process::id();
        let mut seen: HashMap<u32, Thread> = HashMap::with_capacity(self.threads.len());
        let mut samples = Vec::with_capacity(self.threads.len());
        let mut per_group: HashMap<u32, u32> = HashMap::new();
        for c in self.last.iter().filter(|c| (c.cpu as usize) < n) {
            for t in &c.tasks {
                let known = self
                    .threads
                    .get(&t.tid)
                    .filter(|k| k.sum_exec_ns <= t.sum_exec_ns)
                    .copied();
                let Some(mut th) = known.or_else(|| thread_info(&self.machine.proc, t.tid)) else {
                    continue;
                };
                th.sum_exec_ns = t.sum_exec_ns;
                // The file is printed CPU by CPU without one lock: a thread
                // that migrates meanwhile shows on two CPUs. It is listed
                // once, where it was seen first (the server refuses a task
                // listed twice).
                if seen.insert(t.tid, th).is_some() {
                    continue;
                }
                if th.kernel || th.tgid == me || own.contains(&t.tid) {
                    continue;
                }
                *per_group.entry(th.tgid).or_default() += 1;
                samples.push(TaskSample {
                    sum_exec_runtime_ns: t.sum_exec_ns,
                    ..TaskSample::bare(t.tid, th.tgid, c.cpu, t.state)
                });
            }
        }
        self.threads = seen;
        for s in &mut samples {
            s.nr_threads = per_group.get(&s.pid).copied().unwrap_or(1);
        }
        self.machine
            .tracker
            .update(&samples)
            .into_iter()
            .map(|d| pb::ProcessRuntime {
                group: d.pid as u64,
                cpu: d.cpu,
                runtime_ns: d.runtime_ns.min(1_000_000_000_000),
                nr_threads: d.nr_threads,
            })
            .collect()
    }
}

/// A thread's process id and whether it is a kernel thread, from its
/// `status` (`Tgid`, and `Kthread` where the kernel prints it, else a
/// parent of 0 or kthreadd); `None` if it is gone.
fn thread_info(proc: &Path, tid: u32) -> Option<Thread> {
    let text = std::fs::read_to_string(proc.join(tid.to_string()).join("status")).ok()?;
    let field = |k: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(k)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse::<u32>().ok())
    };
    let tgid = field("Tgid")?;
    let kernel = match field("Kthread") {
        Some(k) => k == 1,
        None => tid == 2 || matches!(field("PPid"), Some(0 | 2)) && tid != 1,
    };
    Some(Thread {
        tgid,
        kernel,
        sum_exec_ns: 0,
    })
}

/// A runnable thread's sample from `/proc/TID/{stat,sched,status}`; `None`
/// if it exited meanwhile.
fn read_runnable(proc: &Path, tid: u32, ns_per_tick: u64) -> Option<TaskSample> {
    let dir = proc.join(tid.to_string());
    let stat = procfs::parse_task_stat(&std::fs::read_to_string(dir.join("stat")).ok()?)?;
    let status_text = std::fs::read_to_string(dir.join("status")).ok()?;
    let status = procfs::parse_task_status(&status_text);
    let tgid = status_text
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(stat.pid);
    let sched = std::fs::read_to_string(dir.join("sched"))
        .map(|t| procfs::parse_task_sched(&t))
        .unwrap_or_default();
    let (cpus_allowed, nr_cpus_allowed) = status.cpus_allowed.unwrap_or_default();
    let avg = |v: Option<u64>| v.map_or(0, |v| i64::try_from(v).unwrap_or(i64::MAX));
    let ticks = stat.utime.saturating_add(stat.stime);
    Some(TaskSample {
        tid,
        pid: tgid,
        cpu: stat.processor,
        state: 'R',
        policy: stat.policy,
        nice: stat.nice,
        kernel_thread: stat.flags & procfs::PF_KTHREAD != 0,
        cpus_allowed,
        nr_cpus_allowed,
        nr_threads: status.nr_threads.unwrap_or(0),
        load_avg: avg(sched.load_avg),
        util_avg: avg(sched.util_avg),
        runnable_avg: avg(sched.runnable_avg),
        util_est: avg(sched.util_est),
        exec_start_ns: sched.exec_start_ns.unwrap_or(0),
        sum_exec_runtime_ns: sched
            .sum_exec_runtime_ns
            .unwrap_or_else(|| ticks.saturating_mul(ns_per_tick)),
        running: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signals(nr: u32, queued: u32, runnable: u32, idle: u32) -> CpuSignals {
        CpuSignals {
            cpu: 0,
            nr_running: nr,
            cfs: Some(sched_debug::RootCfs {
                nr_queued: queued,
                h_nr_queued: queued,
                h_nr_runnable: runnable,
                h_nr_idle: idle,
                load_avg: 886,
                runnable_avg: 2047,
                util_avg: 1023,
                util_est: 1100,
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_kernel_values_go_through_and_the_agent_is_taken_out() {
        // Two spinners and the agent's reading thread on one CPU, one of
        // the spinners delayed-dequeued: nr 3 -> 2, queued 3 -> 2.
        let s = cpu_state(&signals(3, 3, 2, 0), 0, true, 1);
        assert_eq!(s.nr_running, 2);
        assert_eq!(s.cfs_h_nr_queued, Some(2));
        assert_eq!(s.nr_delayed, 1);
        assert_eq!((s.load_avg, s.runnable_avg, s.util_avg), (886, 2047, 1023));
        assert_eq!(s.util_est, 1100);
        // A SCHED_IDLE-only CPU keeps h_nr_idle, never above nr_running.
        let s = cpu_state(&signals(1, 1, 1, 1), 0, true, 0);
        assert_eq!((s.nr_running, s.h_nr_idle), (1, 1));
        let s = cpu_state(&signals(1, 1, 1, 1), 0, true, 1);
        assert_eq!((s.nr_running, s.h_nr_idle, s.nr_delayed), (0, 0, 0));
    }

    fn row(tid: u32, state: char, current: bool) -> sched_debug::TableTask {
        sched_debug::TableTask {
            tid,
            state,
            current,
            sum_exec_ns: 0,
            prio: 120,
        }
    }

    #[test]
    fn a_thread_printed_twice_is_listed_once_and_one_row_per_cpu_runs() {
        let own: HashSet<u32> = [9].into_iter().collect();
        let mut listed = HashSet::new();
        // CPU 0 switched from 11 to 12 while the file was printed: both
        // rows say current; the block's curr->pid (12) decides. 13 sleeps,
        // 9 is the agent.
        let c0 = CpuSignals {
            cpu: 0,
            curr_pid: 12,
            tasks: vec![
                row(11, 'R', true),
                row(12, 'R', true),
                row(13, 'S', false),
                row(9, 'R', false),
            ],
            ..Default::default()
        };
        assert_eq!(
            runnable_rows(&c0, &own, &mut listed),
            vec![(11, false), (12, true)]
        );
        // CPU 1: 12 migrated here during the print (listed on CPU 0
        // already); curr->pid names a task the table does not mark, so the
        // first row marked current runs.
        let c1 = CpuSignals {
            cpu: 1,
            curr_pid: 99,
            tasks: vec![row(12, 'R', false), row(14, 'R', true), row(15, 'R', true)],
            ..Default::default()
        };
        assert_eq!(
            runnable_rows(&c1, &own, &mut listed),
            vec![(14, true), (15, false)]
        );
        // No row current (the CPU was idle when its block was printed).
        let c2 = CpuSignals {
            cpu: 2,
            tasks: vec![row(16, 'R', false)],
            ..Default::default()
        };
        assert_eq!(runnable_rows(&c2, &own, &mut listed), vec![(16, false)]);
    }

    #[test]
    fn an_idle_cpu_keeps_the_clock_it_was_first_seen_idle_at() {
        let mut stamp = 0;
        assert_eq!(update_idle_stamp(&mut stamp, false, 5_000), 0);
        assert_eq!(update_idle_stamp(&mut stamp, true, 7_000), 7_000);
        // Still idle: the clock moved (blocked-load updates), the stamp not.
        assert_eq!(update_idle_stamp(&mut stamp, true, 9_000), 7_000);
        assert_eq!(update_idle_stamp(&mut stamp, false, 10_000), 0);
        assert_eq!(update_idle_stamp(&mut stamp, true, 12_000), 12_000);
        // Never 0 for an idle CPU, even with a clock at 0.
        let mut stamp = 0;
        assert_eq!(update_idle_stamp(&mut stamp, true, 0), 1);
    }

    #[test]
    fn thread_info_reads_the_process_and_kernel_threads() {
        let proc = Path::new("/proc");
        let me = thread_info(proc, std::process::id()).unwrap();
        assert_eq!((me.tgid, me.kernel), (std::process::id(), false));
        if let Some(k) = thread_info(proc, 2) {
            assert!(k.kernel, "kthreadd is a kernel thread");
        }
        let tid = unsafe { libc::gettid() } as u32;
        assert_eq!(thread_info(proc, tid).unwrap().tgid, std::process::id());
    }
}
