//! Per-thread samples read from procfs: which fair-class threads are queued
//! on each CPU, and how much CPU time each process used on each CPU.
//!
//! [`read_threads`] walks every thread once per sample. [`runnable_fair`]
//! groups the runnable fair-class threads by CPU and [`mark_running`] guesses
//! which of them is the one on the CPU; [`cap_biggest_first`] bounds how many
//! are reported. [`RuntimeTracker`] turns the cumulative per-thread runtime
//! counters into per-(process, CPU) deltas between two samples.
//!
//! As in [`super::procfs`], the walk is not atomic: threads are created,
//! migrate and exit while it runs, so a sample is a best-effort snapshot.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io;
use std::path::Path;

use super::procfs::{self, PF_KTHREAD, TaskSched, TaskStatus};

/// One thread as sampled from procfs.
#[derive(Debug, Clone, PartialEq)]
pub struct TaskSample {
    /// Thread id (stat field 1).
    pub tid: u32,
    /// Thread-group id, from the `/proc/PID` directory name.
    pub pid: u32,
    /// Stat field 39: the CPU the thread last ran on; for a runnable thread,
    /// the runqueue it is queued on.
    pub cpu: u32,
    /// Stat field 3: R, S, D, Z, T, t, X, I, …
    pub state: char,
    /// Stat field 41, raw: 0 NORMAL, 3 BATCH, 5 IDLE (fair class), 1 FIFO,
    /// 2 RR (RT class), 6 DEADLINE.
    pub policy: u32,
    /// Stat field 19: nice, -20 … 19.
    pub nice: i32,
    /// Stat field 9 (`task->flags`) has `PF_KTHREAD`.
    pub kernel_thread: bool,
    /// `Cpus_allowed_list` of the thread's `status`, trimmed ("0-3,8");
    /// empty if absent, invalid, or not read (only runnable threads' status
    /// is read, see [`read_threads`]).
    pub cpus_allowed: String,
    /// Number of CPUs in `cpus_allowed` (0 if absent).
    pub nr_cpus_allowed: u32,
    /// `Threads` of the thread's `status`: threads in its process (0 if
    /// absent or not read).
    pub nr_threads: u32,
    /// `se.avg.load_avg` of the thread's `sched` (0 if absent).
    pub load_avg: i64,
    /// `se.avg.util_avg` (0 if absent).
    pub util_avg: i64,
    /// `se.avg.runnable_avg` (0 if absent).
    pub runnable_avg: i64,
    /// `se.avg.util_est`, or `se.avg.util_est.enqueued` before Linux 6.9
    /// (0 if absent).
    pub util_est: i64,
    /// `se.exec_start`: the runqueue clock (ns) when the thread last started
    /// running or was last updated while running (0 if absent).
    pub exec_start_ns: u64,
    /// `se.sum_exec_runtime`: CPU time consumed so far, ns. Without it (no
    /// `sched` file, e.g. CONFIG_SCHED_DEBUG off on older kernels),
    /// (utime + stime) ticks × `ns_per_tick`, which is coarser by up to two
    /// ticks.
    pub sum_exec_runtime_ns: u64,
    /// The thread is taken as the one on its CPU; set by [`mark_running`],
    /// always false from [`read_threads`].
    pub running: bool,
}

impl TaskSample {
    /// A thread known only by its ids, CPU and state; every signal 0, to be
    /// filled by whichever reader knows it.
    pub fn bare(tid: u32, pid: u32, cpu: u32, state: char) -> Self {
        TaskSample {
            tid,
            pid,
            cpu,
            state,
            policy: 0,
            nice: 0,
            kernel_thread: false,
            cpus_allowed: String::new(),
            nr_cpus_allowed: 0,
            nr_threads: 0,
            load_avg: 0,
            util_avg: 0,
            runnable_avg: 0,
            util_est: 0,
            exec_start_ns: 0,
            sum_exec_runtime_ns: 0,
            running: false,
        }
    }
}

/// Every thread of every process under `proc_root`
/// (`[0-9]*/task/[0-9]*/{stat,sched,status}`).
///
/// Cost: `stat` is read for every thread, and so is `sched`, because sleeping
/// threads also ran since the previous sample and [`RuntimeTracker`] needs
/// their runtime. `sched` is the expensive one: the kernel formats some
/// thirty lines per thread under the task's locks, so a sample of a machine
/// with 100k threads costs 200k file reads. `status` (another fifty lines) is
/// read only for runnable (`R`) threads, the only ones whose affinity and
/// thread count are reported; for the others `cpus_allowed`,
/// `nr_cpus_allowed` and `nr_threads` stay empty / 0.
///
/// Errors: a thread or process that vanishes during the walk is skipped
/// silently, as is a `stat` that does not parse (a read racing with exit). A
/// missing `sched` or `status` file in a thread that still exists is not an
/// error: its fields take the defaults documented on [`TaskSample`]. Any
/// other I/O error is returned, as in [`procfs::read_runqueues`].
pub fn read_threads(proc_root: &Path, ns_per_tick: u64) -> io::Result<Vec<TaskSample>> {
    let mut out = Vec::new();
    for pid_entry in fs::read_dir(proc_root)? {
        let Some(pid) = procfs::numeric_entry(pid_entry)? else {
            continue;
        };
        let task_dir = proc_root.join(pid.to_string()).join("task");
        let tasks = match fs::read_dir(&task_dir) {
            Ok(t) => t,
            Err(e) if procfs::vanished(&e) => continue,
            Err(e) => return Err(e),
        };
        for task_entry in tasks {
            let Some(tid) = procfs::numeric_entry(task_entry)? else {
                continue;
            };
            let thread_dir = task_dir.join(tid.to_string());
            if let Some(t) = read_thread(&thread_dir, pid, ns_per_tick)? {
                out.push(t);
            }
        }
    }
    Ok(out)
}

/// One thread's sample from its `task/TID` directory; `None` if it vanished
/// or its `stat` does not parse.
fn read_thread(dir: &Path, pid: u32, ns_per_tick: u64) -> io::Result<Option<TaskSample>> {
    let text = match fs::read_to_string(dir.join("stat")) {
        Ok(t) => t,
        Err(e) if procfs::vanished(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(stat) = procfs::parse_task_stat(&text) else {
        return Ok(None);
    };
    let sched = match read_task_file(dir, "sched")? {
        TaskFile::Text(t) => procfs::parse_task_sched(&t),
        TaskFile::Absent => TaskSched::default(),
        TaskFile::Vanished => return Ok(None),
    };
    let status = if stat.state == 'R' {
        match read_task_file(dir, "status")? {
            TaskFile::Text(t) => procfs::parse_task_status(&t),
            TaskFile::Absent => TaskStatus::default(),
            TaskFile::Vanished => return Ok(None),
        }
    } else {
        TaskStatus::default()
    };
    let (cpus_allowed, nr_cpus_allowed) = status.cpus_allowed.unwrap_or_default();
    let ticks = stat.utime.saturating_add(stat.stime);
    Ok(Some(TaskSample {
        tid: stat.tid,
        pid,
        cpu: stat.processor,
        state: stat.state,
        policy: stat.policy,
        nice: stat.nice,
        kernel_thread: stat.flags & PF_KTHREAD != 0,
        cpus_allowed,
        nr_cpus_allowed,
        nr_threads: status.nr_threads.unwrap_or(0),
        load_avg: pelt_avg(sched.load_avg),
        util_avg: pelt_avg(sched.util_avg),
        runnable_avg: pelt_avg(sched.runnable_avg),
        util_est: pelt_avg(sched.util_est),
        exec_start_ns: sched.exec_start_ns.unwrap_or(0),
        sum_exec_runtime_ns: sched
            .sum_exec_runtime_ns
            .unwrap_or_else(|| ticks.saturating_mul(ns_per_tick)),
        running: false,
    }))
}

/// A PELT average as the wire type; absent is 0, and values past `i64::MAX`
/// (which the kernel cannot produce) saturate.
fn pelt_avg(v: Option<u64>) -> i64 {
    v.map_or(0, |v| i64::try_from(v).unwrap_or(i64::MAX))
}

/// What reading an optional per-thread file gave.
#[derive(Debug, PartialEq)]
enum TaskFile {
    Text(String),
    /// The thread is there but the file is not (kernel built without it).
    Absent,
    /// The thread exited.
    Vanished,
}

/// Reads `dir/name`, telling "this kernel has no such file" from "the thread
/// is gone": both give `ENOENT`, so on `ENOENT` the thread directory itself
/// is checked. That costs one extra `lstat` only on the error path.
fn read_task_file(dir: &Path, name: &str) -> io::Result<TaskFile> {
    match fs::read_to_string(dir.join(name)) {
        Ok(t) => Ok(TaskFile::Text(t)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => match fs::symlink_metadata(dir) {
            Ok(_) => Ok(TaskFile::Absent),
            Err(e) if procfs::vanished(&e) => Ok(TaskFile::Vanished),
            Err(e) => Err(e),
        },
        Err(e) if procfs::vanished(&e) => Ok(TaskFile::Vanished),
        Err(e) => Err(e),
    }
}

/// Policies served by the fair class (EEVDF): NORMAL, BATCH and IDLE.
fn is_fair(policy: u32) -> bool {
    matches!(policy, 0 | 3 | 5)
}

/// Per CPU (index = CPU id), the runnable (`R`) threads of a fair-class
/// policy (0, 3 or 5), in the order of `threads`, with [`mark_running`]
/// applied. Threads on a CPU `>= nr_cpus` are ignored so a stale CPU count
/// cannot panic. Kernel threads are included: they compete for the CPU too.
pub fn runnable_fair(threads: &[TaskSample], nr_cpus: usize) -> Vec<Vec<TaskSample>> {
    let mut per_cpu: Vec<Vec<TaskSample>> = vec![Vec::new(); nr_cpus];
    // A directory listing racing with exits can show a thread twice: the
    // server refuses a task id listed twice, so the first one stands.
    let mut seen = std::collections::HashSet::new();
    for t in threads {
        if t.state == 'R'
            && is_fair(t.policy)
            && seen.insert(t.tid)
            && let Some(queue) = per_cpu.get_mut(t.cpu as usize)
        {
            queue.push(t.clone());
        }
    }
    mark_running(&mut per_cpu);
    per_cpu
}

/// Marks, on each CPU, the thread taken as the one currently on it.
///
/// procfs says which CPU a runnable thread is on, not whether it is that
/// CPU's `curr` or waiting in its queue. The approximation: the runnable
/// thread with the largest `exec_start_ns` (ties: the lowest tid). The
/// kernel refreshes the current thread's `exec_start` from the runqueue
/// clock on every update of its runtime, while a queued thread's is from
/// when it last ran there (or 0 if it migrated since), so the current one
/// normally has the largest value. The guess can be wrong when the CPU
/// switches threads while the walk reads them, since each `sched` file is
/// read at a different moment.
///
/// Exactly one thread of each CPU with a runnable thread ends up with
/// `running == true`; any other flag, including a stale one from an earlier
/// call, is cleared. Threads not in state `R` are never marked.
pub fn mark_running(per_cpu: &mut [Vec<TaskSample>]) {
    for queue in per_cpu {
        let current = queue
            .iter()
            .enumerate()
            .filter(|(_, t)| t.state == 'R')
            .max_by(|(_, a), (_, b)| {
                a.exec_start_ns
                    .cmp(&b.exec_start_ns)
                    .then(b.tid.cmp(&a.tid))
            })
            .map(|(i, _)| i);
        for (i, t) in queue.iter_mut().enumerate() {
            t.running = current == Some(i);
        }
    }
}

/// Keeps at most `cap` threads per CPU (`cap == 0` keeps none).
///
/// Kept first: the running thread(s), then the biggest by `load_avg`, then by
/// `util_avg`, then the lowest tid. Whatever is kept is then ordered by
/// `exec_start_ns` descending (most recently run first), ties by tid.
pub fn cap_biggest_first(per_cpu: &mut [Vec<TaskSample>], cap: usize) {
    for queue in per_cpu {
        if queue.len() > cap {
            queue.sort_by(|a, b| {
                b.running
                    .cmp(&a.running)
                    .then(b.load_avg.cmp(&a.load_avg))
                    .then(b.util_avg.cmp(&a.util_avg))
                    .then(a.tid.cmp(&b.tid))
            });
            queue.truncate(cap);
        }
        queue.sort_by(|a, b| {
            b.exec_start_ns
                .cmp(&a.exec_start_ns)
                .then(a.tid.cmp(&b.tid))
        });
    }
}

/// CPU time one process used on one CPU between two samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuntimeDelta {
    pub pid: u32,
    pub cpu: u32,
    pub runtime_ns: u64,
    /// Threads of the process: the largest `nr_threads` among its threads in
    /// the sample, or, when all of them had 0 (status is read only for
    /// runnable threads), how many of its threads the sample holds.
    pub nr_threads: u32,
}

/// Turns the cumulative per-thread `sum_exec_runtime_ns` into per-process,
/// per-CPU deltas between consecutive samples.
#[derive(Debug, Default)]
pub struct RuntimeTracker {
    /// Each user thread's counter in the previous sample, by (pid, tid), so
    /// that a tid reused by another process starts from scratch.
    last: HashMap<(u32, u32), u64>,
}

impl RuntimeTracker {
    pub fn new() -> Self {
        Self::default()
    }

    /// The runtime each process accumulated on each CPU since the previous
    /// call, sorted by (pid, cpu), without zero entries.
    ///
    /// * A thread's delta is the increase of its `sum_exec_runtime_ns`,
    ///   attributed to the CPU it is on now: procfs gives no per-CPU split,
    ///   so the shorter the interval, the more accurate the attribution.
    /// * A thread seen for the first time contributes nothing (its counter
    ///   holds its whole life), and neither does one whose counter went
    ///   backwards (e.g. a reused tid): its new value is the base for the
    ///   next call.
    /// * Threads missing from `threads` are forgotten; if they come back
    ///   they count as new.
    /// * Kernel threads are left out: they belong to no process that could
    ///   be placed.
    /// * A thread listed twice counts once (the first listing).
    pub fn update(&mut self, threads: &[TaskSample]) -> Vec<RuntimeDelta> {
        let mut seen: HashMap<(u32, u32), u64> = HashMap::with_capacity(self.last.len());
        let mut runtime: BTreeMap<(u32, u32), u64> = BTreeMap::new();
        // Per pid: (largest nr_threads, threads present).
        let mut counts: HashMap<u32, (u32, u32)> = HashMap::new();
        for t in threads.iter().filter(|t| !t.kernel_thread) {
            let Entry::Vacant(slot) = seen.entry((t.pid, t.tid)) else {
                continue;
            };
            slot.insert(t.sum_exec_runtime_ns);
            let c = counts.entry(t.pid).or_default();
            c.0 = c.0.max(t.nr_threads);
            c.1 += 1;
            let delta = self
                .last
                .get(&(t.pid, t.tid))
                .map_or(0, |&prev| t.sum_exec_runtime_ns.saturating_sub(prev));
            if delta > 0 {
                let sum = runtime.entry((t.pid, t.cpu)).or_default();
                *sum = sum.saturating_add(delta);
            }
        }
        self.last = seen;
        runtime
            .into_iter()
            .map(|((pid, cpu), runtime_ns)| {
                let (largest, present) = counts[&pid];
                RuntimeDelta {
                    pid,
                    cpu,
                    runtime_ns,
                    nr_threads: if largest > 0 { largest } else { present },
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp_tree::TempTree;
    use std::path::PathBuf;

    const TICK: u64 = 10_000_000;

    /// A throw-away procfs tree (see `temp_tree`).
    struct Fixture {
        root: PathBuf,
        tree: TempTree,
    }

    impl Fixture {
        fn new(tag: &str) -> Self {
            let tree = TempTree::new("tasks", tag);
            Fixture {
                root: tree.root.clone(),
                tree,
            }
        }
        fn put(&self, pid: u32, tid: u32, file: &str, content: &str) -> &Self {
            self.tree.put(&format!("{pid}/task/{tid}/{file}"), content);
            self
        }
        /// Writes a thread's stat, and its sched and status when given.
        fn thread(&self, s: &Stat, sched: Option<&str>, status: Option<&str>) -> &Self {
            self.put(s.pid, s.tid, "stat", &s.line());
            if let Some(text) = sched {
                self.put(s.pid, s.tid, "sched", text);
            }
            if let Some(text) = status {
                self.put(s.pid, s.tid, "status", text);
            }
            self
        }
        /// All threads, by tid.
        fn read(&self) -> Vec<TaskSample> {
            let mut v = read_threads(&self.root, TICK).unwrap();
            v.sort_by_key(|t| t.tid);
            v
        }
    }

    /// The stat fields the reader uses.
    struct Stat {
        pid: u32,
        tid: u32,
        state: char,
        cpu: u32,
        policy: u32,
        nice: i32,
        flags: u32,
        utime: u64,
        stime: u64,
    }

    fn stat(pid: u32, tid: u32, state: char, cpu: u32) -> Stat {
        Stat {
            pid,
            tid,
            state,
            cpu,
            policy: 0,
            nice: 0,
            flags: 0x40_0040, // PF_FORKNOEXEC | PF_RANDOMIZE, a user thread
            utime: 7,
            stime: 3,
        }
    }

    impl Stat {
        /// A 52-field line; the comm contains ") R 9 (" to catch naive splits.
        fn line(&self) -> String {
            let mut f: Vec<String> = (1..=52).map(|k| (k * 10).to_string()).collect();
            f[0] = self.tid.to_string();
            f[1] = "(evil) R 9 (x)".into();
            f[2] = self.state.to_string();
            f[8] = self.flags.to_string();
            f[13] = self.utime.to_string();
            f[14] = self.stime.to_string();
            f[18] = self.nice.to_string();
            f[38] = self.cpu.to_string();
            f[40] = self.policy.to_string();
            f.join(" ") + "\n"
        }
    }

    /// PELT lines of a `sched` file.
    struct Avg {
        load: u64,
        runnable: u64,
        util: u64,
        util_est: u64,
    }

    /// A `sched` file laid out as the kernel prints it; `util_est_key` is
    /// "se.avg.util_est" (6.9+) or "se.avg.util_est.enqueued" (older).
    fn sched(exec_start_ns: u64, runtime_ns: u64, avg: Option<(&str, Avg)>) -> String {
        let ms = |ns: u64| format!("{}.{:06}", ns / 1_000_000, ns % 1_000_000);
        let line = |k: &str, v: String| format!("{k:<45}:{v:>21}\n");
        let mut s = String::from(
            "worker (1, #threads: 1)\n-------------------------------------------------------------------\n",
        );
        s += &line("se.exec_start", ms(exec_start_ns));
        s += &line("se.vruntime", "-1.048576".into());
        s += &line("se.sum_exec_runtime", ms(runtime_ns));
        s += &line("se.nr_migrations", "4".into());
        if let Some((util_est_key, a)) = avg {
            s += &line("se.load.weight", "1048576".into());
            s += &line("se.avg.load_sum", "46704".into());
            s += &line("se.avg.load_avg", a.load.to_string());
            s += &line("se.avg.runnable_avg", a.runnable.to_string());
            s += &line("se.avg.util_avg", a.util.to_string());
            s += &line("se.avg.last_update_time", "16950199648256".into());
            if util_est_key.ends_with("enqueued") {
                s += &line("se.avg.util_est.ewma", "1".into());
            }
            s += &line(util_est_key, a.util_est.to_string());
        }
        s += &line("policy", "0".into());
        s + "current_node=0, numa_group_id=0\n"
    }

    /// A `status` file with the interesting lines among real neighbours.
    fn status(cpus: &str, threads: u32) -> String {
        format!(
            "Name:\tworker\nUmask:\t0022\nState:\tR (running)\nTgid:\t1\nKthread:\t0\n\
             Threads:\t{threads}\nSigQ:\t0/96362\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\n\
             Mems_allowed_list:\t0\nvoluntary_ctxt_switches:\t4\n"
        )
    }

    /// A sample with only the fields the pure functions look at set.
    fn sample(pid: u32, tid: u32, cpu: u32) -> TaskSample {
        TaskSample::bare(tid, pid, cpu, 'R')
    }

    fn tids(queue: &[TaskSample]) -> Vec<u32> {
        queue.iter().map(|t| t.tid).collect()
    }

    // ---- read_threads ----

    #[test]
    fn reads_runnable_and_sleeping_threads() {
        let f = Fixture::new("full");
        let avg = |load, runnable, util, util_est| Avg {
            load,
            runnable,
            util,
            util_est,
        };
        f.thread(
            &Stat {
                nice: -5,
                policy: 3,
                ..stat(100, 100, 'R', 1)
            },
            Some(&sched(
                5_000_123_456,
                2_000_000_001,
                Some(("se.avg.util_est", avg(1022, 522, 521, 520))),
            )),
            Some(&status("0-3,8", 2)),
        )
        // Sleeping: its status is there but must not be read.
        .thread(
            &Stat {
                nice: 19,
                ..stat(100, 101, 'S', 0)
            },
            Some(&sched(
                4_000_000_000,
                1_500_000,
                Some(("se.avg.util_est", avg(3, 2, 1, 8))),
            )),
            Some(&status("0-1", 2)),
        );
        let got = f.read();
        assert_eq!(
            got,
            vec![
                TaskSample {
                    tid: 100,
                    pid: 100,
                    cpu: 1,
                    state: 'R',
                    policy: 3,
                    nice: -5,
                    kernel_thread: false,
                    cpus_allowed: "0-3,8".into(),
                    nr_cpus_allowed: 5,
                    nr_threads: 2,
                    load_avg: 1022,
                    util_avg: 521,
                    runnable_avg: 522,
                    util_est: 520,
                    exec_start_ns: 5_000_123_456,
                    sum_exec_runtime_ns: 2_000_000_001,
                    running: false,
                },
                TaskSample {
                    tid: 101,
                    pid: 100,
                    cpu: 0,
                    state: 'S',
                    policy: 0,
                    nice: 19,
                    kernel_thread: false,
                    cpus_allowed: String::new(),
                    nr_cpus_allowed: 0,
                    nr_threads: 0,
                    load_avg: 3,
                    util_avg: 1,
                    runnable_avg: 2,
                    util_est: 8,
                    exec_start_ns: 4_000_000_000,
                    sum_exec_runtime_ns: 1_500_000,
                    running: false,
                },
            ]
        );
    }

    #[test]
    fn kernel_thread_flag_and_rt_policy() {
        let f = Fixture::new("kthread");
        // kthreadd's real flags on 6.18: 0x208040.
        f.thread(
            &Stat {
                flags: 0x20_8040,
                ..stat(2, 2, 'S', 0)
            },
            Some(&sched(1, 6_774_296, None)),
            None,
        )
        // migration/0: a runnable FIFO kernel thread.
        .thread(
            &Stat {
                flags: PF_KTHREAD,
                policy: 1,
                ..stat(18, 18, 'R', 0)
            },
            Some(&sched(9, 229_755_224, None)),
            Some(&status("0", 1)),
        )
        .thread(&stat(30, 30, 'R', 0), Some(&sched(5, 1, None)), None);
        let got = f.read();
        let summary: Vec<_> = got
            .iter()
            .map(|t| (t.tid, t.kernel_thread, t.policy, t.sum_exec_runtime_ns))
            .collect();
        assert_eq!(
            summary,
            vec![
                (2, true, 0, 6_774_296),
                (18, true, 1, 229_755_224),
                (30, false, 0, 1)
            ]
        );
        let per_cpu = runnable_fair(&got, 1);
        assert_eq!(tids(&per_cpu[0]), vec![30], "RT migration/0 is not fair");
        assert!(per_cpu[0][0].running);
    }

    #[test]
    fn sched_without_pelt_lines_and_old_util_est() {
        let f = Fixture::new("noavg");
        f.thread(
            &stat(1, 1, 'R', 0),
            Some(&sched(123_000_000, 456_789, None)),
            Some(&status("0", 1)),
        )
        .thread(
            &stat(2, 2, 'R', 0),
            Some(&sched(
                1,
                2,
                Some((
                    "se.avg.util_est.enqueued",
                    Avg {
                        load: 40,
                        runnable: 30,
                        util: 20,
                        util_est: 10,
                    },
                )),
            )),
            Some(&status("0", 1)),
        );
        let got = f.read();
        let avgs = |t: &TaskSample| {
            (
                t.load_avg,
                t.runnable_avg,
                t.util_avg,
                t.util_est,
                t.exec_start_ns,
                t.sum_exec_runtime_ns,
            )
        };
        assert_eq!(avgs(&got[0]), (0, 0, 0, 0, 123_000_000, 456_789));
        assert_eq!(avgs(&got[1]), (40, 30, 20, 10, 1, 2));
    }

    #[test]
    fn missing_sched_and_status_use_defaults() {
        let f = Fixture::new("nosched");
        // Runnable, neither sched nor status: runtime from the ticks.
        f.thread(
            &Stat {
                utime: 1234,
                stime: 567,
                ..stat(5, 5, 'R', 1)
            },
            None,
            None,
        )
        // sched without se.sum_exec_runtime: also ticks.
        .thread(
            &stat(5, 6, 'S', 1),
            Some("se.exec_start : 9.000001\n"),
            None,
        );
        let got = f.read();
        let t = &got[0];
        assert_eq!(t.sum_exec_runtime_ns, (1234 + 567) * TICK);
        assert_eq!((t.exec_start_ns, t.load_avg, t.util_est), (0, 0, 0));
        assert_eq!(
            (t.cpus_allowed.as_str(), t.nr_cpus_allowed, t.nr_threads),
            ("", 0, 0)
        );
        assert_eq!(
            (got[1].exec_start_ns, got[1].sum_exec_runtime_ns),
            (9_000_001, 10 * TICK)
        );
        // A huge tick count saturates rather than wrapping.
        let f = Fixture::new("nosched-big");
        f.thread(
            &Stat {
                utime: u64::MAX,
                ..stat(1, 1, 'S', 0)
            },
            None,
            None,
        );
        assert_eq!(f.read()[0].sum_exec_runtime_ns, u64::MAX);
    }

    #[test]
    fn status_parsing_of_runnable_threads() {
        let f = Fixture::new("status");
        f.thread(
            &stat(7, 7, 'R', 0),
            Some(&sched(1, 1, None)),
            Some(&status("0-4095", 17)),
        )
        .thread(
            &stat(7, 8, 'R', 0),
            Some(&sched(1, 1, None)),
            Some(&status("2,5-6", 17)),
        )
        // An invalid list is treated as absent: string and count agree.
        .thread(
            &stat(7, 9, 'R', 0),
            Some(&sched(1, 1, None)),
            Some(&status("3-1", 17)),
        )
        .thread(
            &stat(7, 10, 'R', 0),
            Some(&sched(1, 1, None)),
            Some("Name:\tx\n"),
        );
        let got: Vec<_> = f
            .read()
            .into_iter()
            .map(|t| (t.tid, t.cpus_allowed, t.nr_cpus_allowed, t.nr_threads))
            .collect();
        assert_eq!(
            got,
            vec![
                (7, "0-4095".to_owned(), 4096, 17),
                (8, "2,5-6".to_owned(), 3, 17),
                (9, String::new(), 0, 17),
                (10, String::new(), 0, 0),
            ]
        );
    }

    #[test]
    fn vanished_and_irrelevant_entries_skipped() {
        let f = Fixture::new("vanish");
        f.thread(&stat(10, 10, 'R', 0), Some(&sched(1, 1, None)), None);
        f.tree.mkdir("11"); // process exited: no task dir
        f.tree.mkdir("12/task/12"); // thread exited: no stat
        f.put(13, 13, "stat", "13 (trunc"); // truncated read
        f.tree.put("self/task/1/stat", &stat(1, 1, 'R', 0).line());
        f.tree.put("14/task/me/stat", &stat(14, 14, 'R', 0).line());
        f.tree.put("stat", "cpu0 1 1 1 1\n");
        assert_eq!(tids(&f.read()), vec![10]);
        assert!(read_threads(&f.root.join("nope"), TICK).is_err());
    }

    #[test]
    fn other_io_errors_are_returned() {
        let f = Fixture::new("eisdir");
        f.thread(&stat(1, 1, 'S', 0), None, None);
        f.tree.mkdir("1/task/1/sched"); // reading it fails with EISDIR
        let err = read_threads(&f.root, TICK).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(21), "{err}");
    }

    #[test]
    fn task_file_absent_versus_vanished() {
        let f = Fixture::new("taskfile");
        f.put(1, 1, "sched", "x");
        let dir = f.root.join("1/task/1");
        assert_eq!(
            read_task_file(&dir, "sched").unwrap(),
            TaskFile::Text("x".into())
        );
        assert_eq!(read_task_file(&dir, "status").unwrap(), TaskFile::Absent);
        assert_eq!(
            read_task_file(&f.root.join("1/task/2"), "sched").unwrap(),
            TaskFile::Vanished
        );
    }

    // ---- runnable_fair / mark_running / cap ----

    #[test]
    fn runnable_fair_filters_and_groups() {
        let mut threads = Vec::new();
        for (tid, state, cpu, policy) in [
            (1, 'R', 0, 0),
            (2, 'R', 1, 3),  // BATCH
            (3, 'R', 1, 5),  // IDLE
            (4, 'S', 1, 0),  // sleeping
            (5, 'R', 1, 1),  // FIFO
            (6, 'R', 0, 2),  // RR
            (7, 'R', 0, 6),  // DEADLINE
            (8, 'R', 3, 0),  // beyond nr_cpus
            (9, 'D', 0, 0),  // uninterruptible sleep
            (10, 'R', 1, 0), // fair
        ] {
            threads.push(TaskSample {
                state,
                policy,
                exec_start_ns: u64::from(tid),
                ..sample(1, tid, cpu)
            });
        }
        let per_cpu = runnable_fair(&threads, 3);
        assert_eq!(per_cpu.len(), 3);
        assert_eq!(tids(&per_cpu[0]), vec![1]);
        assert_eq!(tids(&per_cpu[1]), vec![2, 3, 10], "input order kept");
        assert!(per_cpu[2].is_empty());
        let running: Vec<_> = per_cpu
            .iter()
            .flatten()
            .filter(|t| t.running)
            .map(|t| t.tid)
            .collect();
        assert_eq!(running, vec![1, 10]);
        assert!(runnable_fair(&threads, 0).is_empty());
    }

    #[test]
    fn mark_running_picks_latest_exec_start_then_lowest_tid() {
        let with = |tid, exec_start_ns| TaskSample {
            exec_start_ns,
            ..sample(1, tid, 0)
        };
        let mut per_cpu = vec![
            vec![with(5, 100), with(3, 300), with(4, 200)],
            // Tie on exec_start: the lowest tid.
            vec![with(9, 50), with(7, 50), with(8, 10)],
            vec![],
            // A stale flag is cleared; a sleeping thread is never chosen.
            vec![
                TaskSample {
                    running: true,
                    ..with(1, 1)
                },
                TaskSample {
                    state: 'S',
                    ..with(2, 99)
                },
                with(3, 2),
            ],
            vec![TaskSample {
                state: 'S',
                running: true,
                ..with(6, 1)
            }],
        ];
        mark_running(&mut per_cpu);
        let flags: Vec<Vec<bool>> = per_cpu
            .iter()
            .map(|q| q.iter().map(|t| t.running).collect())
            .collect();
        assert_eq!(
            flags,
            vec![
                vec![false, true, false],
                vec![false, true, false],
                vec![],
                vec![false, false, true],
                vec![false],
            ]
        );
    }

    #[test]
    fn cap_keeps_running_then_biggest_ordered_by_exec_start() {
        let t = |tid, load_avg, util_avg, exec_start_ns| TaskSample {
            load_avg,
            util_avg,
            exec_start_ns,
            ..sample(1, tid, 0)
        };
        let queue = vec![
            TaskSample {
                running: true,
                ..t(1, 5, 5, 900)
            },
            t(2, 100, 10, 100),
            t(3, 100, 20, 50),
            t(4, 100, 20, 700), // ties tid 3 on load and util: 3 wins
            t(5, 300, 0, 50),
            t(6, 1, 1, 800),
        ];
        let capped = |cap| {
            let mut per_cpu = vec![queue.clone(), vec![]];
            cap_biggest_first(&mut per_cpu, cap);
            assert!(per_cpu[1].is_empty());
            tids(&per_cpu[0])
        };
        assert_eq!(capped(1), vec![1]);
        // Kept: 1 (running), 5 (load 300), 3 (load 100, util 20, tid 3),
        // then ordered by exec_start 900, 50, 50 (ties by tid).
        assert_eq!(capped(3), vec![1, 3, 5]);
        assert_eq!(capped(4), vec![1, 4, 3, 5]);
        assert_eq!(capped(6), vec![1, 6, 4, 2, 3, 5], "all kept, reordered");
        assert_eq!(capped(100), vec![1, 6, 4, 2, 3, 5]);
        assert!(capped(0).is_empty(), "cap 0 keeps none");
    }

    // ---- RuntimeTracker ----

    fn ran(pid: u32, tid: u32, cpu: u32, sum_exec_runtime_ns: u64) -> TaskSample {
        TaskSample {
            sum_exec_runtime_ns,
            state: 'S',
            ..sample(pid, tid, cpu)
        }
    }

    fn delta(pid: u32, cpu: u32, runtime_ns: u64, nr_threads: u32) -> RuntimeDelta {
        RuntimeDelta {
            pid,
            cpu,
            runtime_ns,
            nr_threads,
        }
    }

    #[test]
    fn tracker_deltas_per_pid_and_current_cpu() {
        let mut tr = RuntimeTracker::new();
        assert_eq!(
            tr.update(&[ran(20, 20, 0, 1000), ran(10, 10, 1, 5000)]),
            vec![],
            "first sight contributes nothing"
        );
        let d = tr.update(&[
            ran(20, 20, 2, 1600),   // +600, moved to cpu 2
            ran(10, 10, 1, 5000),   // +0: omitted
            ran(10, 11, 1, 70),     // new thread: nothing yet
            ran(20, 21, 0, 99_999), // new thread: nothing yet
        ]);
        assert_eq!(d, vec![delta(20, 2, 600, 2)]);
        let d = tr.update(&[
            ran(20, 20, 2, 1700),    // +100 on cpu 2
            ran(20, 21, 2, 100_099), // +100 on cpu 2: summed
            ran(10, 10, 0, 5001),    // +1 on cpu 0
            ran(10, 11, 1, 80),      // +10 on cpu 1
        ]);
        assert_eq!(
            d,
            vec![
                delta(10, 0, 1, 2),
                delta(10, 1, 10, 2),
                delta(20, 2, 200, 2)
            ],
            "sorted by (pid, cpu)"
        );
    }

    #[test]
    fn tracker_backwards_counter_resets() {
        let mut tr = RuntimeTracker::new();
        tr.update(&[ran(1, 1, 0, 10_000)]);
        assert_eq!(tr.update(&[ran(1, 1, 0, 300)]), vec![], "went backwards");
        assert_eq!(
            tr.update(&[ran(1, 1, 0, 350)]),
            vec![delta(1, 0, 50, 1)],
            "counts from the new base"
        );
    }

    #[test]
    fn tracker_forgets_missing_threads_and_keys_by_pid() {
        let mut tr = RuntimeTracker::new();
        tr.update(&[ran(1, 5, 0, 100), ran(2, 6, 0, 100)]);
        assert_eq!(tr.update(&[ran(2, 6, 0, 150)]), vec![delta(2, 0, 50, 1)]);
        // tid 5 was absent for one sample: its return counts as new.
        assert_eq!(tr.update(&[ran(1, 5, 0, 900), ran(2, 6, 0, 150)]), vec![]);
        // tid 5 reused by another process: new, even though it is larger.
        assert_eq!(tr.update(&[ran(3, 5, 0, 5000)]), vec![]);
        assert_eq!(tr.update(&[ran(3, 5, 1, 5007)]), vec![delta(3, 1, 7, 1)]);
    }

    #[test]
    fn tracker_excludes_kernel_threads_and_duplicates() {
        let mut tr = RuntimeTracker::new();
        let kthread = |sum| TaskSample {
            kernel_thread: true,
            ..ran(2, 2, 0, sum)
        };
        tr.update(&[kthread(100), ran(9, 9, 0, 100)]);
        let d = tr.update(&[kthread(900), ran(9, 9, 0, 130), ran(9, 9, 0, 500)]);
        assert_eq!(d, vec![delta(9, 0, 30, 1)], "first listing counts once");
        assert_eq!(tr.update(&[ran(9, 9, 0, 140)]), vec![delta(9, 0, 10, 1)]);
    }

    #[test]
    fn tracker_nr_threads_rule() {
        let with_threads = |t: TaskSample, nr_threads| TaskSample { nr_threads, ..t };
        let mut tr = RuntimeTracker::new();
        let sample1 = [
            ran(1, 1, 0, 0),
            ran(1, 2, 0, 0),
            ran(1, 3, 1, 0),
            ran(4, 4, 0, 0),
        ];
        tr.update(&sample1);
        // pid 1: status read for one runnable thread saying 8 (the process
        // has threads the sample missed); pid 4: no status read, 2 present
        // (one of them new).
        let d = tr.update(&[
            with_threads(ran(1, 1, 0, 10), 8),
            ran(1, 2, 0, 10),
            with_threads(ran(1, 3, 1, 10), 5),
            ran(4, 4, 0, 10),
            ran(4, 5, 0, 10),
        ]);
        assert_eq!(
            d,
            vec![delta(1, 0, 20, 8), delta(1, 1, 10, 8), delta(4, 0, 10, 2)]
        );
    }

    // ---- the real machine ----

    /// Reads this machine's procfs and checks invariants that hold on any
    /// Linux box.
    #[test]
    fn real_machine_invariants() {
        let proc_root = Path::new("/proc");
        let Ok(me) = fs::read_to_string(proc_root.join("thread-self/stat")) else {
            eprintln!("no procfs; skipping");
            return;
        };
        let my_tid = procfs::parse_task_stat(&me).unwrap().tid;
        let my_pid = std::process::id();
        let nr_cpus = procfs::parse_proc_stat(&fs::read_to_string("/proc/stat").unwrap())
            .last()
            .map_or(1, |c| c.cpu as usize + 1);
        let has_sched = proc_root.join("thread-self/sched").exists();

        let mut tracker = RuntimeTracker::new();
        let first = read_threads(proc_root, TICK).unwrap();
        assert!(tracker.update(&first).is_empty());
        let mut seen: Vec<(u32, u32)> = first.iter().map(|t| (t.pid, t.tid)).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), first.len(), "each thread once");

        // Burn some CPU so this process has a delta to report.
        let t0 = std::time::Instant::now();
        let mut x = 0u64;
        while t0.elapsed() < std::time::Duration::from_millis(50) {
            x = std::hint::black_box(x.wrapping_add(1));
        }

        let threads = read_threads(proc_root, TICK).unwrap();
        let mine = threads.iter().find(|t| t.tid == my_tid).expect("my thread");
        assert_eq!(mine.pid, my_pid);
        assert_eq!(mine.state, 'R', "the reading thread is running");
        assert!(!mine.kernel_thread && !mine.running);
        assert!(mine.nr_threads >= 1 && mine.nr_cpus_allowed >= 1);
        assert!((mine.cpu as usize) < nr_cpus);
        assert!(
            threads.iter().any(|t| t.pid == my_pid && t.tid == my_pid),
            "the main thread"
        );
        assert!(
            threads.iter().all(|t| t.state == 'R' || t.nr_threads == 0),
            "status read only for runnable threads"
        );

        let per_cpu = runnable_fair(&threads, nr_cpus);
        assert_eq!(per_cpu.len(), nr_cpus);
        for (cpu, queue) in per_cpu.iter().enumerate() {
            assert!(
                queue
                    .iter()
                    .all(|t| t.cpu as usize == cpu && t.state == 'R')
            );
            let running = queue.iter().filter(|t| t.running).count();
            assert_eq!(running, usize::from(!queue.is_empty()), "cpu {cpu}");
        }

        let deltas = tracker.update(&threads);
        assert!(
            deltas
                .windows(2)
                .all(|w| (w[0].pid, w[0].cpu) < (w[1].pid, w[1].cpu))
        );
        assert!(deltas.iter().all(|d| d.runtime_ns > 0 && d.nr_threads >= 1));
        if has_sched {
            assert!(deltas.iter().any(|d| d.pid == my_pid), "{deltas:?}");
        }
    }
}
