//! Per-CPU busy time and runqueue occupancy read from procfs.
//!
//! The kernel does not export per-CPU `nr_running` outside of debugfs
//! (`/sys/kernel/debug/sched/debug`, root only and unstable format), so we
//! reconstruct it from the one thing every user can read: each thread's
//! `stat`, which says whether it is runnable (`R`) and on which CPU
//! (`processor`). The walk is not atomic — threads move and exit while we
//! read — so the counts are a best-effort snapshot, good enough for placement
//! decisions that are themselves re-evaluated every sample.

use std::fs;
use std::io;
use std::path::Path;

/// Cumulative time of one CPU, in USER_HZ ticks (normally 1/100 s).
///
/// Consumers compute deltas between two samples. Use saturating subtraction:
/// `idle` and `iowait` are known to go backwards on some NO_HZ kernels, and a
/// CPU that went offline and came back restarts from whatever it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    pub cpu: u32,
    /// user + nice + system + irq + softirq + steal.
    pub busy: u64,
    /// busy + idle + iowait.
    pub total: u64,
}

/// Parses the `cpuN` lines of `/proc/stat`.
///
/// * The aggregate `cpu ` line and every non-CPU line are skipped.
/// * Only online CPUs have a line, so the result is indexed by `cpu`, not by
///   position.
/// * `guest` and `guest_nice` are deliberately left out: the kernel already
///   folds them into `user` and `nice`, so adding them would double count.
/// * Steal counts as busy: from the placement point of view the CPU was not
///   available to us, exactly as if another task had run.
/// * Columns missing on old kernels (steal appeared in 2.6.11) count as 0;
///   a line with a non-numeric field is skipped rather than guessed at.
pub fn parse_proc_stat(text: &str) -> Vec<CpuTimes> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut fields = line.split_ascii_whitespace();
        let Some(cpu) = fields
            .next()
            .and_then(|name| name.strip_prefix("cpu"))
            .and_then(parse_digits::<u32>)
        else {
            continue;
        };
        let nums: Option<Vec<u64>> = fields.map(parse_digits::<u64>).collect();
        let Some(nums) = nums else { continue };
        if nums.len() < 4 {
            continue; // not even user/nice/system/idle: not a stat line we know
        }
        let f = |i: usize| nums.get(i).copied().unwrap_or(0);
        let (user, nice, system, idle, iowait, irq, softirq, steal) =
            (f(0), f(1), f(2), f(3), f(4), f(5), f(6), f(7));
        let busy = user
            .saturating_add(nice)
            .saturating_add(system)
            .saturating_add(irq)
            .saturating_add(softirq)
            .saturating_add(steal);
        let total = busy.saturating_add(idle).saturating_add(iowait);
        out.push(CpuTimes { cpu, busy, total });
    }
    out
}

/// The fields of `/proc/PID/task/TID/stat` the agent needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStat {
    /// Thread-group id. `stat` itself only contains the id of the thread it
    /// describes, so [`parse_task_stat`] sets this equal to `tid`;
    /// [`read_runqueues`] overwrites it from the `/proc/PID` directory name.
    pub pid: u32,
    /// Field 1: the id of the thread this file describes.
    pub tid: u32,
    /// Field 3: R, S, D, Z, T, t, X, I, …
    pub state: char,
    /// Field 9: the kernel's `task->flags` (`PF_*` bits, e.g.
    /// [`PF_KTHREAD`]).
    pub flags: u32,
    /// Field 19: nice value, -20 … 19. For RT and DEADLINE threads it is the
    /// nice they would have in the fair class, not their priority.
    pub nice: i32,
    /// Field 39: CPU the thread last ran on (for a runnable thread, the
    /// runqueue it is queued on).
    pub processor: u32,
    /// Field 41: scheduling policy (0 NORMAL, 1 FIFO, 2 RR, 3 BATCH, 5 IDLE,
    /// 6 DEADLINE).
    pub policy: u32,
    /// Field 2 without the parentheses.
    pub comm: String,
    /// Field 14, USER_HZ ticks.
    pub utime: u64,
    /// Field 15, USER_HZ ticks.
    pub stime: u64,
}

/// Parses one task's `stat` line.
///
/// `comm` is chosen by the thread itself (prctl/pthread_setname_np) and may
/// contain spaces, parentheses, even newlines, so the only safe split is at
/// the first `(` and the *last* `)`: nothing after comm can contain `)`.
/// Returns `None` for anything malformed or truncated (e.g. a read racing
/// with thread exit).
pub fn parse_task_stat(text: &str) -> Option<TaskStat> {
    let open = text.find('(')?;
    let close = text.rfind(')')?;
    if close < open {
        return None;
    }
    let tid = parse_digits::<u32>(text[..open].trim())?;
    let comm = text[open + 1..close].to_owned();
    // rest[0] is field 3, so field k is rest[k - 3].
    let rest: Vec<&str> = text[close + 1..].split_ascii_whitespace().collect();
    let field = |k: usize| rest.get(k - 3).copied();
    let mut state_chars = field(3)?.chars();
    let state = state_chars.next()?;
    if state_chars.next().is_some() {
        return None;
    }
    Some(TaskStat {
        pid: tid,
        tid,
        state,
        flags: parse_digits(field(9)?)?,
        nice: parse_signed_i32(field(19)?)?,
        processor: parse_digits(field(39)?)?,
        policy: parse_digits(field(41)?)?,
        comm,
        utime: parse_digits(field(14)?)?,
        stime: parse_digits(field(15)?)?,
    })
}

/// `PF_KTHREAD` in [`TaskStat::flags`]: the thread is a kernel thread (no
/// user address space).
pub const PF_KTHREAD: u32 = 0x0020_0000;

/// Per-CPU runnable-thread counts, indexed by CPU id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunqueueCounts {
    /// Threads in state `R` whose `processor` is this CPU (running or
    /// queued). Includes the thread doing the walk.
    pub nr_running: Vec<u32>,
    /// The subset of `nr_running` with policy SCHED_IDLE, named after the
    /// kernel's `cfs_rq->h_nr_idle`: such threads yield to anything else, so
    /// the server treats a CPU running only them as nearly free.
    pub h_nr_idle: Vec<u32>,
}

const SCHED_IDLE: u32 = 5;

/// Counts runnable threads per CPU by walking `proc_root/[0-9]*/task/[0-9]*/stat`.
///
/// Threads and processes that vanish mid-walk (`ENOENT`, `ESRCH`) are
/// skipped silently, as are `stat` files that do not parse (a read racing
/// with exit can return a truncated line). Any other I/O error is returned,
/// because it means the walk is systematically wrong (e.g. a mount without
/// access) rather than racing. Processor ids `>= nr_cpus` are ignored so a
/// caller that sized the vectors from a stale CPU count cannot panic.
pub fn read_runqueues(proc_root: &Path, nr_cpus: usize) -> io::Result<RunqueueCounts> {
    let mut counts = RunqueueCounts {
        nr_running: vec![0; nr_cpus],
        h_nr_idle: vec![0; nr_cpus],
    };
    for pid_entry in fs::read_dir(proc_root)? {
        let Some(pid) = numeric_entry(pid_entry)? else {
            continue;
        };
        let task_dir = proc_root.join(pid.to_string()).join("task");
        let tasks = match fs::read_dir(&task_dir) {
            Ok(t) => t,
            Err(e) if vanished(&e) => continue,
            Err(e) => return Err(e),
        };
        for task_entry in tasks {
            let Some(tid) = numeric_entry(task_entry)? else {
                continue;
            };
            let text = match fs::read_to_string(task_dir.join(tid.to_string()).join("stat")) {
                Ok(t) => t,
                Err(e) if vanished(&e) => continue,
                Err(e) => return Err(e),
            };
            let Some(mut st) = parse_task_stat(&text) else {
                continue;
            };
            st.pid = pid;
            let cpu = st.processor as usize;
            if st.state != 'R' || cpu >= nr_cpus {
                continue;
            }
            counts.nr_running[cpu] += 1;
            if st.policy == SCHED_IDLE {
                counts.h_nr_idle[cpu] += 1;
            }
        }
    }
    Ok(counts)
}

/// The numeric name of a directory entry, `None` for non-numeric names
/// (`self`, `sys`, …) and for entries that vanished while listing.
pub(super) fn numeric_entry(entry: io::Result<fs::DirEntry>) -> io::Result<Option<u32>> {
    match entry {
        Ok(e) => Ok(e.file_name().to_str().and_then(parse_digits)),
        Err(e) if vanished(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// ENOENT: the directory is gone. ESRCH: procfs found the pid but the task
/// exited before it could be inspected.
pub(super) fn vanished(e: &io::Error) -> bool {
    const ESRCH: i32 = 3;
    e.kind() == io::ErrorKind::NotFound || e.raw_os_error() == Some(ESRCH)
}

/// Scheduler statistics from `/proc/PID/task/TID/sched` (needs
/// CONFIG_SCHED_DEBUG on older kernels; the file may be absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TaskSched {
    /// `se.exec_start`: rq clock (ns) when the thread last started running.
    pub exec_start_ns: Option<u64>,
    /// `se.sum_exec_runtime`: total CPU time consumed, ns.
    pub sum_exec_runtime_ns: Option<u64>,
    /// `se.nr_migrations`: how often the thread changed CPU.
    pub nr_migrations: Option<u64>,
    /// `se.avg.load_avg`: PELT load average (runnable time weighted by the
    /// thread's load weight, so a nice-0 thread always runnable reads ~1024).
    /// The `se.avg.*` lines are printed only with CONFIG_SMP.
    pub load_avg: Option<u64>,
    /// `se.avg.runnable_avg`: PELT runnable (running or queued) average,
    /// 0 … 1024 per thread.
    pub runnable_avg: Option<u64>,
    /// `se.avg.util_avg`: PELT running average, 0 … 1024 per thread.
    pub util_avg: Option<u64>,
    /// Estimated utilization: `se.avg.util_est` since Linux 6.9,
    /// `se.avg.util_est.enqueued` before. Current kernels mask out the
    /// internal `UTIL_AVG_UNCHANGED` flag when printing it; old ones kept it
    /// in the low bit unmasked, so the value may read one too high there.
    pub util_est: Option<u64>,
}

/// Parses the `key : value` lines of a task's `sched` file.
///
/// The kernel prints nanosecond counters as milliseconds with exactly six
/// fractional digits (`%Ld.%06ld` of ns / 1e6 and ns % 1e6), so the fraction
/// *is* the sub-millisecond nanoseconds. Parsing it as integers keeps the
/// value exact; going through f64 would lose precision past 2^53 ns
/// (~104 days of uptime) and make deltas of `sum_exec_runtime` jitter.
/// Counts and PELT averages (`se.nr_migrations`, `se.avg.*`) are plain
/// integers.
/// A field that is absent, negative, malformed or overflows u64 is `None`.
/// Only the first occurrence of a key counts.
pub fn parse_task_sched(text: &str) -> TaskSched {
    let mut out = TaskSched::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key.trim() {
            "se.exec_start" if out.exec_start_ns.is_none() => {
                out.exec_start_ns = parse_ms_to_ns(value);
            }
            "se.sum_exec_runtime" if out.sum_exec_runtime_ns.is_none() => {
                out.sum_exec_runtime_ns = parse_ms_to_ns(value);
            }
            "se.nr_migrations" if out.nr_migrations.is_none() => {
                out.nr_migrations = parse_digits(value);
            }
            "se.avg.load_avg" if out.load_avg.is_none() => {
                out.load_avg = parse_digits(value);
            }
            "se.avg.runnable_avg" if out.runnable_avg.is_none() => {
                out.runnable_avg = parse_digits(value);
            }
            "se.avg.util_avg" if out.util_avg.is_none() => {
                out.util_avg = parse_digits(value);
            }
            "se.avg.util_est" | "se.avg.util_est.enqueued" if out.util_est.is_none() => {
                out.util_est = parse_digits(value);
            }
            _ => {}
        }
    }
    out
}

/// The fields of `/proc/PID/task/TID/status` the agent needs.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TaskStatus {
    /// `Cpus_allowed_list`, trimmed ("0-3,8"), with the number of CPUs it
    /// names. `None` if the line is absent or not a valid list.
    pub cpus_allowed: Option<(String, u32)>,
    /// `Threads`: number of threads in the thread group.
    pub nr_threads: Option<u32>,
}

/// Parses the `Key:\tvalue` lines of a task's `status` file.
///
/// `Name:` comes first and holds the thread's comm with `\n` and `\\`
/// escaped by the kernel, so a hostile name cannot forge a line; keys are
/// still matched exactly and only their first occurrence counts.
pub fn parse_task_status(text: &str) -> TaskStatus {
    let mut out = TaskStatus::default();
    let mut seen_cpus = false;
    for line in text.lines() {
        let Some((key, value)) = line.split_once(':') else {
            continue;
        };
        let value = value.trim();
        match key {
            "Cpus_allowed_list" if !seen_cpus => {
                seen_cpus = true;
                out.cpus_allowed = count_cpulist(value).map(|n| (value.to_owned(), n));
            }
            "Threads" if out.nr_threads.is_none() => out.nr_threads = parse_digits(value),
            _ => {}
        }
    }
    out
}

/// Number of CPUs in a kernel cpulist ("0-3,8" → 5), without building the
/// list: on a 4096-CPU machine every unpinned thread says "0-4095".
///
/// The kernel prints (`%*pbl`) ascending, disjoint ranges, so the count is
/// the sum of the range lengths. An empty list is 0 CPUs; an empty element,
/// a sign, a descending range or an overflow is `None`.
fn count_cpulist(s: &str) -> Option<u32> {
    if s.is_empty() {
        return Some(0);
    }
    let mut total: u32 = 0;
    for part in s.split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (parse_digits::<u32>(a)?, parse_digits::<u32>(b)?),
            None => {
                let v = parse_digits::<u32>(part)?;
                (v, v)
            }
        };
        let len = hi.checked_sub(lo)?.checked_add(1)?;
        total = total.checked_add(len)?;
    }
    Some(total)
}

/// "12345.678901" (ms) → 12_345_678_901 ns, exactly. Fractions shorter than
/// six digits are right-padded ("1.5" = 1.5 ms); digits beyond the sixth are
/// sub-nanosecond and truncated.
fn parse_ms_to_ns(s: &str) -> Option<u64> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let ms: u64 = parse_digits(int)?;
    let mut ns_part: u64 = 0;
    if !frac.is_empty() {
        if !frac.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        for i in 0..6 {
            let d = frac.as_bytes().get(i).map_or(0, |b| u64::from(b - b'0'));
            ns_part = ns_part * 10 + d;
        }
    } else if s.ends_with('.') {
        return None;
    }
    ms.checked_mul(1_000_000)?.checked_add(ns_part)
}

/// Strict decimal with an optional leading `-`, as the kernel's `%d` prints
/// it (nice values): no `+`, no spaces.
fn parse_signed_i32(s: &str) -> Option<i32> {
    match s.strip_prefix('-') {
        Some(abs) => i32::try_from(-parse_digits::<i64>(abs)?).ok(),
        None => parse_digits(s),
    }
}

/// Strict decimal: no sign, no spaces (`str::parse` would accept "+1").
pub(crate) fn parse_digits<T: std::str::FromStr>(s: &str) -> Option<T> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp_tree::TempTree;
    use std::path::PathBuf;

    /// A throw-away procfs tree (see `temp_tree`).
    struct Fixture {
        root: PathBuf,
        tree: TempTree,
    }

    impl Fixture {
        fn new(tag: &str) -> Self {
            let tree = TempTree::new("procfs", tag);
            Fixture {
                root: tree.root.clone(),
                tree,
            }
        }
        fn write(&self, rel: &str, content: &str) -> &Self {
            self.tree.put(rel, content);
            self
        }
        fn mkdir(&self, rel: &str) -> &Self {
            self.tree.mkdir(rel);
            self
        }
        fn task(&self, pid: u32, tid: u32, state: char, cpu: u32, policy: u32) -> &Self {
            self.write(
                &format!("{pid}/task/{tid}/stat"),
                &stat_line(tid, "worker", state, cpu, policy),
            )
        }
    }

    /// A realistic 52-field stat line with the interesting fields set.
    fn stat_line(tid: u32, comm: &str, state: char, cpu: u32, policy: u32) -> String {
        let mut f: Vec<String> = (1..=52).map(|k| (k * 10).to_string()).collect();
        f[0] = tid.to_string();
        f[1] = format!("({comm})");
        f[2] = state.to_string();
        f[13] = "1234".into(); // utime
        f[14] = "567".into(); // stime
        f[38] = cpu.to_string();
        f[40] = policy.to_string();
        f.join(" ") + "\n"
    }

    // ---- /proc/stat ----

    const PROC_STAT: &str = "\
cpu  84598 0 9365 1870321 595 0 76 739 0 0
cpu0 42771 1 4738 934143 177 2 25 342 100 7
cpu1 41827 0 4627 936178 417 0 51 396 0 0
intr 1234 5 6
ctxt 99
btime 1700000000
processes 4242
procs_running 2
";

    #[test]
    fn proc_stat_busy_and_total() {
        let v = parse_proc_stat(PROC_STAT);
        assert_eq!(v.len(), 2, "aggregate and non-cpu lines skipped");
        // busy = user+nice+system+irq+softirq+steal; guest not added.
        assert_eq!(
            v[0],
            CpuTimes {
                cpu: 0,
                busy: 42771 + 1 + 4738 + 2 + 25 + 342,
                total: 42771 + 1 + 4738 + 2 + 25 + 342 + 934143 + 177
            }
        );
        assert_eq!(v[1].cpu, 1);
        assert_eq!(v[1].busy, 41827 + 4627 + 51 + 396);
        assert_eq!(v[1].total, v[1].busy + 936178 + 417);
    }

    #[test]
    fn proc_stat_sparse_cpus_and_short_lines() {
        // Offline cpu1 has no line; an old kernel prints only 7 columns.
        let v = parse_proc_stat("cpu0 1 2 3 4 5 6 7\ncpu2 10 0 0 90\n");
        assert_eq!(
            v,
            vec![
                CpuTimes {
                    cpu: 0,
                    busy: 1 + 2 + 3 + 6 + 7,
                    total: 28
                },
                CpuTimes {
                    cpu: 2,
                    busy: 10,
                    total: 100
                }
            ]
        );
    }

    #[test]
    fn proc_stat_skips_malformed_lines() {
        let text = "cpufreq 1 2 3 4\ncpu0 1 2 x 4\ncpu1 1 2\ncpu-1 1 2 3 4\ncpu3 1 1 1 1\n\n";
        assert_eq!(
            parse_proc_stat(text),
            vec![CpuTimes {
                cpu: 3,
                busy: 3,
                total: 4
            }]
        );
        assert!(parse_proc_stat("").is_empty());
    }

    #[test]
    fn proc_stat_saturates_instead_of_overflowing() {
        let v = parse_proc_stat(&format!("cpu0 {} 1 0 1\n", u64::MAX));
        assert_eq!(v[0].busy, u64::MAX);
        assert_eq!(v[0].total, u64::MAX);
    }

    // ---- task stat ----

    #[test]
    fn task_stat_real_line() {
        let line = "17525 (cat) R 17512 17512 16805 0 -1 4194304 99 0 0 0 3 4 0 0 20 0 1 0 984596 3133440 408 18446744073709551615 94723972235264 94723972255145 140735919078448 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 94723972271152 94723972272768 94724647362560 140735919086092 140735919086112 140735919086112 140735919087595 0\n";
        let s = parse_task_stat(line).unwrap();
        assert_eq!(
            s,
            TaskStat {
                pid: 17525,
                tid: 17525,
                state: 'R',
                flags: 4194304,
                nice: 0,
                processor: 1,
                policy: 0,
                comm: "cat".into(),
                utime: 3,
                stime: 4
            }
        );
    }

    #[test]
    fn task_stat_field_positions() {
        // Field k holds k*10, so any off-by-one shows up as a wrong value.
        let mut f: Vec<String> = (1..=52).map(|k| (k * 10).to_string()).collect();
        f[1] = "(x)".into();
        f[2] = "S".into();
        let s = parse_task_stat(&f.join(" ")).unwrap();
        assert_eq!(
            (s.tid, s.utime, s.stime, s.processor, s.policy),
            (10, 140, 150, 390, 410)
        );
        assert_eq!((s.flags, s.nice), (90, 190));
    }

    #[test]
    fn task_stat_nice_and_kthread_flag() {
        // kthreadd on 6.18: flags 0x208040 (PF_KTHREAD | PF_NOFREEZE | …).
        let line = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 25 0 0 18446744073709551615 0 0 0 0 0 0 0 2147483647 0 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0\n";
        let s = parse_task_stat(line).unwrap();
        assert_eq!((s.flags, s.nice), (2_129_984, 0));
        assert_ne!(s.flags & PF_KTHREAD, 0);
        let mut f: Vec<String> = stat_line(7, "w", 'R', 0, 0)
            .split(' ')
            .map(str::to_owned)
            .collect();
        for (nice, want) in [("-20", Some(-20)), ("19", Some(19)), ("-0", Some(0))] {
            f[18] = nice.into();
            assert_eq!(
                parse_task_stat(&f.join(" ")).map(|s| s.nice),
                want,
                "{nice:?}"
            );
        }
        for bad in ["+1", "--1", "-", "1-", "-2147483649", "2147483648"] {
            f[18] = bad.into();
            assert!(parse_task_stat(&f.join(" ")).is_none(), "{bad:?}");
        }
        f[18] = "-2147483648".into();
        assert_eq!(parse_task_stat(&f.join(" ")).unwrap().nice, i32::MIN);
        f[18] = "0".into();
        f[8] = "-1".into();
        assert!(parse_task_stat(&f.join(" ")).is_none(), "negative flags");
    }

    #[test]
    fn task_stat_hostile_comm() {
        for comm in [
            "a b",
            "x) R 1 2 (y",
            ")",
            "((",
            "tab\there",
            "new\nline",
            "",
        ] {
            let s = parse_task_stat(&stat_line(42, comm, 'D', 3, 5)).unwrap();
            assert_eq!(
                (s.comm.as_str(), s.state, s.processor, s.policy),
                (comm, 'D', 3, 5),
                "{comm:?}"
            );
        }
    }

    #[test]
    fn task_stat_rejects_malformed() {
        let good = stat_line(1, "a", 'R', 0, 0);
        assert!(parse_task_stat(&good).is_some());
        let truncated: String = good.split(' ').take(40).collect::<Vec<_>>().join(" ");
        assert!(parse_task_stat(&truncated).is_none(), "no policy field");
        assert!(parse_task_stat("").is_none());
        assert!(parse_task_stat("12 no-parens R").is_none());
        assert!(
            parse_task_stat(&good.replacen("1 (", "x (", 1)).is_none(),
            "bad tid"
        );
        assert!(
            parse_task_stat(&good.replacen(") R ", ") RR ", 1)).is_none(),
            "bad state"
        );
        assert!(parse_task_stat(")1 (a").is_none());
    }

    // ---- runqueues ----

    #[test]
    fn runqueues_count_runnable_and_idle_policy() {
        let f = Fixture::new("rq");
        f.task(100, 100, 'R', 0, 0)
            .task(100, 101, 'R', 1, 0)
            .task(100, 102, 'S', 1, 0)
            .task(200, 200, 'R', 1, SCHED_IDLE)
            .task(200, 201, 'R', 1, 1) // FIFO
            .task(300, 300, 'D', 0, SCHED_IDLE)
            .task(300, 301, 'R', 3, SCHED_IDLE)
            .task(300, 302, 'R', 9, 0); // beyond nr_cpus: ignored
        let rq = read_runqueues(&f.root, 4).unwrap();
        assert_eq!(rq.nr_running, vec![1, 3, 0, 1]);
        assert_eq!(rq.h_nr_idle, vec![0, 1, 0, 1]);
    }

    #[test]
    fn runqueues_skip_vanished_and_irrelevant_entries() {
        let f = Fixture::new("rqvanish");
        f.task(10, 10, 'R', 0, 0);
        f.mkdir("11"); // process exited: no task dir
        f.mkdir("12/task/12"); // thread exited: no stat
        f.write("13/task/13/stat", "13 (trunc"); // truncated read
        f.write("self/task/1/stat", &stat_line(1, "x", 'R', 0, 0)); // non-numeric
        f.write("14/task/notatid/stat", &stat_line(14, "x", 'R', 0, 0));
        f.write("stat", "cpu0 1 1 1 1\n"); // a plain file at the top
        let rq = read_runqueues(&f.root, 2).unwrap();
        assert_eq!(rq.nr_running, vec![1, 0]);
        assert_eq!(rq.h_nr_idle, vec![0, 0]);
    }

    #[test]
    fn runqueues_zero_cpus_and_missing_root() {
        let f = Fixture::new("rqzero");
        f.task(1, 1, 'R', 0, 0);
        let rq = read_runqueues(&f.root, 0).unwrap();
        assert!(rq.nr_running.is_empty() && rq.h_nr_idle.is_empty());
        assert!(
            read_runqueues(&f.root.join("nope"), 1).is_err(),
            "root itself must exist"
        );
    }

    #[test]
    fn vanished_errors() {
        assert!(vanished(&io::Error::from_raw_os_error(3)), "ESRCH");
        assert!(vanished(&io::Error::from(io::ErrorKind::NotFound)));
        assert!(!vanished(&io::Error::from(io::ErrorKind::PermissionDenied)));
    }

    // ---- task sched ----

    const SCHED: &str = "\
head (17526, #threads: 1)
-------------------------------------------------------------------
se.exec_start                                :       9842283.455197
se.vruntime                                  :           183.009934
se.sum_exec_runtime                          :             0.780346
se.nr_migrations                             :                    1
nr_switches                                  :                    1
se.avg.last_update_time                      :        9842283454464
policy                                       :                    0
current_node=0, numa_group_id=0
";

    #[test]
    fn task_sched_exact_ns() {
        let s = parse_task_sched(SCHED);
        assert_eq!(s.exec_start_ns, Some(9_842_283_455_197));
        assert_eq!(s.sum_exec_runtime_ns, Some(780_346));
        assert_eq!(s.nr_migrations, Some(1));
    }

    #[test]
    fn task_sched_no_float_drift() {
        // 2^53 ns + 1 is not representable in f64.
        let ns: u64 = (1 << 53) + 1;
        let text = format!(
            "se.sum_exec_runtime : {}.{:06}\n",
            ns / 1_000_000,
            ns % 1_000_000
        );
        assert_eq!(parse_task_sched(&text).sum_exec_runtime_ns, Some(ns));
        let max = u64::MAX;
        let text = format!(
            "se.exec_start : {}.{:06}\n",
            max / 1_000_000,
            max % 1_000_000
        );
        assert_eq!(parse_task_sched(&text).exec_start_ns, Some(max));
    }

    #[test]
    fn ms_fraction_forms() {
        assert_eq!(parse_ms_to_ns("12345.678901"), Some(12_345_678_901));
        assert_eq!(parse_ms_to_ns("1.5"), Some(1_500_000));
        assert_eq!(parse_ms_to_ns("1.000001"), Some(1_000_001));
        assert_eq!(parse_ms_to_ns("7"), Some(7_000_000));
        assert_eq!(parse_ms_to_ns("0.0000019"), Some(1), "sub-ns truncated");
        for bad in [
            "",
            ".5",
            "1.",
            "-1.000000",
            "1.2.3",
            "1.x",
            "+1.0",
            "1e3",
            "18446744073709.551616",
        ] {
            assert_eq!(parse_ms_to_ns(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn task_sched_absent_or_bad_fields() {
        assert_eq!(parse_task_sched(""), TaskSched::default());
        let s = parse_task_sched(
            "se.exec_start : -5.000000\nse.nr_migrations : 1.5\nse.sum_exec_runtime : 2.000000\nse.sum_exec_runtime : 9.000000\n",
        );
        assert_eq!(
            s,
            TaskSched {
                exec_start_ns: None,
                sum_exec_runtime_ns: Some(2_000_000),
                nr_migrations: None,
                ..TaskSched::default()
            }
        );
        // Prefix keys must not match.
        let s = parse_task_sched(
            "se.exec_start_foo : 1.000000\nse.statistics.nr_migrations_cold : 3\n",
        );
        assert_eq!(s, TaskSched::default());
    }

    /// The 6.18 layout (`se.avg.*` present, single `se.avg.util_est`).
    const SCHED_AVG: &str = "\
sh (28868, #threads: 1)
-------------------------------------------------------------------
se.exec_start                                :      16950199.648690
se.vruntime                                  :           -1.048576
se.sum_exec_runtime                          :             1.143827
se.nr_migrations                             :                    0
se.load.weight                               :              1048576
se.avg.load_sum                              :                46704
se.avg.runnable_sum                          :             24425508
se.avg.util_sum                              :             24425508
se.avg.load_avg                              :                 1022
se.avg.runnable_avg                          :                  522
se.avg.util_avg                              :                  521
se.avg.last_update_time                      :       16950199648256
se.avg.util_est                              :                  520
policy                                       :                    0
";

    #[test]
    fn task_sched_pelt_averages() {
        assert_eq!(
            parse_task_sched(SCHED_AVG),
            TaskSched {
                exec_start_ns: Some(16_950_199_648_690),
                sum_exec_runtime_ns: Some(1_143_827),
                nr_migrations: Some(0),
                load_avg: Some(1022),
                runnable_avg: Some(522),
                util_avg: Some(521),
                util_est: Some(520),
            }
        );
        // Before 6.9 util_est had two lines; `enqueued` is the one we want.
        let old =
            "se.avg.util_avg : 300\nse.avg.util_est.ewma : 280\nse.avg.util_est.enqueued : 290\n";
        let s = parse_task_sched(old);
        assert_eq!((s.util_avg, s.util_est), (Some(300), Some(290)));
        // Without the se.avg lines (the SCHED fixture) they are all None.
        let s = parse_task_sched(SCHED);
        assert_eq!(
            (s.load_avg, s.runnable_avg, s.util_avg, s.util_est),
            (None, None, None, None)
        );
        // Negative, fractional or prefixed values are rejected, not guessed.
        let s = parse_task_sched(
            "se.avg.load_avg : -1\nse.avg.util_avg : 1.5\nse.avg.runnable_avg : +3\nse.avg.util_est_x : 4\n",
        );
        assert_eq!(s, TaskSched::default());
    }

    // ---- task status ----

    #[test]
    fn task_status_fields() {
        let text = "Name:\tev\\nCpus_allowed_list:\t9\nUmask:\t0022\nState:\tR (running)\n\
                    Threads:\t17\nCpus_allowed:\t10f\nCpus_allowed_list:\t0-3,8\n\
                    Mems_allowed_list:\t0\nThreads:\t2\n";
        assert_eq!(
            parse_task_status(text),
            TaskStatus {
                cpus_allowed: Some(("0-3,8".into(), 5)),
                nr_threads: Some(17),
            }
        );
        assert_eq!(parse_task_status(""), TaskStatus::default());
        let s = parse_task_status("Cpus_allowed_list:\t3-1\nThreads:\t-1\n");
        assert_eq!(s, TaskStatus::default(), "invalid values are absent");
    }

    #[test]
    fn cpulist_counts() {
        assert_eq!(count_cpulist(""), Some(0));
        assert_eq!(count_cpulist("0"), Some(1));
        assert_eq!(count_cpulist("0-4095"), Some(4096));
        assert_eq!(count_cpulist("0-3,8,10-11"), Some(7));
        assert_eq!(count_cpulist("0-4294967294"), Some(u32::MAX));
        for bad in [
            "0-4294967295",
            "1,",
            ",1",
            "3-1",
            "-1",
            "1-",
            "a",
            "0 -3",
            "+1",
        ] {
            assert_eq!(count_cpulist(bad), None, "{bad:?}");
        }
    }

    // ---- the real machine ----

    /// Reads this machine's procfs and checks only invariants that hold on
    /// any Linux box.
    #[test]
    fn real_machine_invariants() {
        let proc_root = Path::new("/proc");
        let Ok(stat) = fs::read_to_string(proc_root.join("stat")) else {
            eprintln!("no procfs; skipping");
            return;
        };
        let times = parse_proc_stat(&stat);
        assert!(!times.is_empty(), "at least one CPU online");
        assert!(times.windows(2).all(|w| w[0].cpu < w[1].cpu));
        assert!(times.iter().all(|t| t.busy <= t.total));

        // A running thread is on an online CPU, and online CPUs are in /proc/stat.
        let nr_cpus = times.last().unwrap().cpu as usize + 1;
        let rq = read_runqueues(proc_root, nr_cpus).unwrap();
        assert_eq!(rq.nr_running.len(), nr_cpus);
        assert!(
            rq.nr_running.iter().sum::<u32>() >= 1,
            "this test thread is runnable"
        );
        assert!(rq.nr_running.iter().zip(&rq.h_nr_idle).all(|(r, i)| i <= r));

        let me = parse_task_stat(&fs::read_to_string("/proc/thread-self/stat").unwrap()).unwrap();
        assert_eq!(me.state, 'R', "a thread reading its own stat is running");
        assert!((me.processor as usize) < nr_cpus);
        if let Ok(text) = fs::read_to_string("/proc/thread-self/sched") {
            let s = parse_task_sched(&text);
            // A new thread's runtime is accounted at its next tick or
            // switch, so it can still read 0.000000 here.
            assert!(s.sum_exec_runtime_ns.is_some());
            assert!(s.exec_start_ns.is_some() && s.nr_migrations.is_some());
        }
        let status = parse_task_status(&fs::read_to_string("/proc/thread-self/status").unwrap());
        let (list, n) = status.cpus_allowed.expect("Cpus_allowed_list since 2.6.26");
        assert!(n >= 1 && !list.is_empty(), "{list:?}");
        assert!(status.nr_threads.is_some_and(|n| n >= 1));
    }
}
