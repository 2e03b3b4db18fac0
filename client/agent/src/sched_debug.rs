//! The kernel's own per-CPU scheduler signals, parsed from debugfs
//! (`/sys/kernel/debug/sched/debug`).
//!
//! This module owns the text format and nothing else: [`parse`] turns one
//! read of the file into per-CPU [`CpuSignals`], [`Reader`] reads it cheaply
//! again and again, and [`ensure_mounted`] makes debugfs readable. What the
//! agent does with the values (subtracting itself, idle stamps, task lists)
//! is in `exact.rs`.
//!
//! Why this file: it prints, per CPU and under the kernel's own locks, the
//! runqueue's `nr_running` and clocks (`cpu#N` block), the root `cfs_rq`'s
//! counts and PELT averages (`cfs_rq[N]:/` block: exact values at their last
//! update, the very numbers `cpu_load()`, `cpu_util()` and `cpu_runnable()`
//! read), and a table of every task whose `task_cpu()` is that CPU, with
//! its state, so the runnable ones need no walk of `/proc`.
//!
//! The format is the kernel's debugging output, not an ABI, and it changes:
//! fields are found by name, never by position, and renamed ones are read
//! under every name they have had (see [`RootCfs`]). The task table's
//! columns are located from its header line. Each CPU is printed by one
//! `show()` call, so a CPU's block is consistent with itself; different
//! CPUs are a few microseconds apart.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

/// Where debugfs normally lives and the file in it.
pub const DEBUGFS: &str = "/sys/kernel/debug";
pub const SCHED_DEBUG: &str = "/sys/kernel/debug/sched/debug";

/// The root `cfs_rq` of one CPU (`cfs_rq[N]:/`, or `cfs_rq[N]:` without
/// group scheduling).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RootCfs {
    /// `nr_queued` (6.13+), `nr_running` before: entities queued here.
    pub nr_queued: u32,
    /// `h_nr_queued` (6.13+), `h_nr_running` before: fair tasks queued in
    /// the whole hierarchy, delayed-dequeue ones included.
    pub h_nr_queued: u32,
    /// `h_nr_runnable` (6.13+); before, `h_nr_running - h_nr_delayed`
    /// (6.12) or `h_nr_running` (no delayed dequeue).
    pub h_nr_runnable: u32,
    /// `h_nr_idle` (6.13+), `idle_h_nr_running` (5.13+); 0 if absent.
    pub h_nr_idle: u32,
    pub load_avg: i64,
    pub runnable_avg: i64,
    pub util_avg: i64,
    /// `util_est` (6.9+), `util_est_enqueued` before.
    pub util_est: i64,
}

/// One row of a CPU's task table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableTask {
    /// The `PID` column: the thread id.
    pub tid: u32,
    /// `task_state_to_char()`: R, S, D, I, T, ...
    pub state: char,
    /// The row starts with `>R`: the CPU's current task.
    pub current: bool,
    /// `sum-exec`: the thread's total CPU time, ns.
    pub sum_exec_ns: u64,
    /// `prio`: the kernel priority (120 + nice for the fair class).
    pub prio: i32,
}

impl TableTask {
    /// Queued on or running on its CPU.
    pub fn runnable(&self) -> bool {
        self.state == 'R'
    }
}

/// One CPU as the file prints it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CpuSignals {
    pub cpu: u32,
    /// `rq->nr_running`: runnable tasks of every class.
    pub nr_running: u32,
    /// `rq->curr`'s pid (0: the idle task).
    pub curr_pid: u32,
    /// `rq->clock` and `rq->clock_task`, ns, at their last update.
    pub clock_ns: i64,
    pub clock_task_ns: i64,
    /// `rq->avg_idle`, ns.
    pub avg_idle_ns: i64,
    /// The root cfs_rq; `None` if the CPU block had none.
    pub cfs: Option<RootCfs>,
    /// Every task whose `task_cpu()` is this CPU, in the kernel's order.
    pub tasks: Vec<TableTask>,
}

/// Why a read could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParseError(pub String);

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sched/debug: {}", self.0)
    }
}

/// `SPLIT_NS()` output ("12.000345", "-1.048576": milliseconds and the
/// nanoseconds below them) or a plain integer, as ns.
pub fn parse_split_ns(s: &str) -> Option<i64> {
    let (neg, s) = match s.strip_prefix('-') {
        Some(r) => (true, r),
        None => (false, s),
    };
    let v = match s.split_once('.') {
        Some((ms, ns)) if ns.len() == 6 => ms
            .parse::<i64>()
            .ok()?
            .checked_mul(1_000_000)?
            .checked_add(ns.parse::<i64>().ok()?)?,
        Some(_) => return None,
        None => s.parse::<i64>().ok()?,
    };
    Some(if neg { -v } else { v })
}

/// A `  .name : value` line as (name, value).
fn field(line: &str) -> Option<(&str, &str)> {
    let rest = line.trim_start().strip_prefix('.')?;
    let (k, v) = rest.split_once(':')?;
    Some((k.trim_end(), v.trim()))
}

/// What the parser is inside of.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Block {
    Other,
    Cpu,
    RootCfs,
    /// The task table, with its columns: (pid, sum-exec, prio) indexes
    /// counted from the first column after the comm.
    Tasks(Option<(usize, usize, usize)>),
}

/// Names a root cfs_rq's fields have had, in the order they are preferred.
struct CfsRaw {
    v: std::collections::HashMap<String, i64>,
}

impl CfsRaw {
    fn get(&self, names: &[&str]) -> Option<i64> {
        names.iter().find_map(|n| self.v.get(*n).copied())
    }

    fn count(&self, names: &[&str]) -> u32 {
        self.get(names).unwrap_or(0).clamp(0, u32::MAX as i64) as u32
    }

    fn finish(&self) -> RootCfs {
        let h_nr_queued = self.count(&["h_nr_queued", "h_nr_running"]);
        // Before 6.13 there was no h_nr_runnable: 6.12 printed the delayed
        // entities instead, and older kernels have no delayed dequeue.
        let h_nr_runnable = match self.get(&["h_nr_runnable"]) {
            Some(v) => v.clamp(0, u32::MAX as i64) as u32,
            None => h_nr_queued.saturating_sub(self.count(&["h_nr_delayed"])),
        };
        RootCfs {
            nr_queued: self.count(&["nr_queued", "nr_running"]),
            h_nr_queued,
            h_nr_runnable,
            h_nr_idle: self.count(&["h_nr_idle", "idle_h_nr_running"]),
            load_avg: self.get(&["load_avg"]).unwrap_or(0),
            runnable_avg: self.get(&["runnable_avg"]).unwrap_or(0),
            util_avg: self.get(&["util_avg"]).unwrap_or(0),
            util_est: self.get(&["util_est", "util_est_enqueued"]).unwrap_or(0),
        }
    }
}

/// `cpu#N` or `cpu#N, 2600.000 MHz` (x86).
fn cpu_header(line: &str) -> Option<u32> {
    let rest = line.strip_prefix("cpu#")?;
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// `cfs_rq[N]:PATH`: Some(is_root) for a cfs_rq header.
fn cfs_header(line: &str) -> Option<bool> {
    let rest = line.strip_prefix("cfs_rq[")?;
    let (_, path) = rest.split_once("]:")?;
    Some(path.is_empty() || path == "/")
}

/// The column indexes of the task table from its header line, counted from
/// the first column after `task` (the comm).
fn table_columns(header: &str) -> Option<(usize, usize, usize)> {
    let cols: Vec<&str> = header.split_whitespace().collect();
    let first = cols.iter().position(|c| *c == "task")? + 1;
    let at = |name: &str| cols.iter().position(|c| *c == name).map(|i| i - first);
    Some((at("PID")?, at("sum-exec")?, at("prio")?))
}

/// One task-table row. The comm is printed `%15s` after the two state
/// characters and may hold spaces, so it is skipped by position (it ends at
/// byte 18); the rest splits on whitespace. 6.12+ prints a lone `S` after
/// the deadline for a custom slice, a column the header does not name: it
/// is dropped (no other value column is a bare `S`).
fn table_row(line: &str, cols: (usize, usize, usize)) -> Option<TableTask> {
    let b = line.as_bytes();
    if b.len() < 19 || b[18] != b' ' {
        return None;
    }
    let current = b[0] == b'>';
    let state = if current { 'R' } else { b[1] as char };
    let rest = std::str::from_utf8(&b[18..]).ok()?;
    // Thousands of rows per read: no allocation per row, and no token past
    // the last column wanted.
    let (pid, sum, prio) = cols;
    let last = pid.max(sum).max(prio);
    let (mut tid, mut sum_exec, mut pr) = (None, None, None);
    let toks = rest.split_ascii_whitespace().filter(|t| *t != "S");
    for (i, t) in toks.enumerate().take(last + 1) {
        if i == pid {
            tid = t.parse().ok();
        }
        if i == sum {
            sum_exec = parse_split_ns(t);
        }
        if i == prio {
            pr = t.parse().ok();
        }
    }
    Some(TableTask {
        tid: tid?,
        state,
        current,
        sum_exec_ns: sum_exec?.max(0) as u64,
        prio: pr?,
    })
}

/// Parses one read of the file. CPUs come in the order printed (CPU id
/// order; offline CPUs are not printed). Unknown blocks and fields are
/// skipped; a file with no `cpu#` block is an error.
pub fn parse(text: &str) -> Result<Vec<CpuSignals>, ParseError> {
    let mut cpus: Vec<CpuSignals> = Vec::new();
    let mut block = Block::Other;
    let mut cfs: Option<CfsRaw> = None;
    let finish_cfs = |cpus: &mut Vec<CpuSignals>, cfs: &mut Option<CfsRaw>| {
        if let (Some(c), Some(raw)) = (cpus.last_mut(), cfs.take()) {
            c.cfs = Some(raw.finish());
        }
    };
    for line in text.lines() {
        if let Some(id) = cpu_header(line) {
            finish_cfs(&mut cpus, &mut cfs);
            cpus.push(CpuSignals {
                cpu: id,
                ..Default::default()
            });
            block = Block::Cpu;
            continue;
        }
        if let Some(root) = cfs_header(line) {
            finish_cfs(&mut cpus, &mut cfs);
            block = if root && !cpus.is_empty() {
                cfs = Some(CfsRaw {
                    v: Default::default(),
                });
                Block::RootCfs
            } else {
                Block::Other
            };
            continue;
        }
        if line.starts_with("rt_rq[") || line.starts_with("dl_rq[") {
            finish_cfs(&mut cpus, &mut cfs);
            block = Block::Other;
            continue;
        }
        if line.starts_with("runnable tasks:") {
            finish_cfs(&mut cpus, &mut cfs);
            block = Block::Tasks(None);
            continue;
        }
        match block {
            Block::Cpu => cpu_field(cpus.last_mut(), line),
            Block::RootCfs => {
                if let (Some(raw), Some((k, v))) = (cfs.as_mut(), field(line))
                    && let Ok(v) = v.parse::<i64>()
                {
                    raw.v.insert(k.to_string(), v);
                }
            }
            Block::Tasks(None) if line.contains(" task ") && line.contains("PID") => {
                block = Block::Tasks(table_columns(line));
            }
            Block::Tasks(Some(cols)) => {
                if let (Some(c), Some(t)) = (cpus.last_mut(), table_row(line, cols)) {
                    c.tasks.push(t);
                }
            }
            _ => {}
        }
    }
    finish_cfs(&mut cpus, &mut cfs);
    if cpus.is_empty() {
        return Err(ParseError("no cpu# block".into()));
    }
    Ok(cpus)
}

/// A `cpu#N` block's field.
fn cpu_field(cpu: Option<&mut CpuSignals>, line: &str) {
    let (Some(c), Some((k, v))) = (cpu, field(line)) else {
        return;
    };
    let num = || parse_split_ns(v);
    match k {
        "nr_running" => c.nr_running = num().unwrap_or(0).clamp(0, u32::MAX as i64) as u32,
        "curr->pid" => c.curr_pid = num().unwrap_or(0).clamp(0, u32::MAX as i64) as u32,
        "clock" => c.clock_ns = num().unwrap_or(0),
        "clock_task" => c.clock_task_ns = num().unwrap_or(0),
        "avg_idle" => c.avg_idle_ns = num().unwrap_or(0),
        _ => {}
    }
}

/// Reads the file again and again through one open descriptor. The kernel
/// prints a CPU's block into one buffer, doubling and reprinting it until
/// it fits; a descriptor kept open keeps the grown buffer, so later reads
/// print each block once (a fresh open per read costs about three times as
/// much with a few thousand threads).
pub struct Reader {
    file: File,
    buf: Vec<u8>,
}

impl Reader {
    pub fn open(path: &Path) -> io::Result<Reader> {
        Ok(Reader {
            file: File::open(path)?,
            buf: Vec::with_capacity(1 << 16),
        })
    }

    /// The whole file as it is now.
    pub fn read(&mut self) -> io::Result<&str> {
        self.file.seek(SeekFrom::Start(0))?;
        self.buf.clear();
        self.file.read_to_end(&mut self.buf)?;
        std::str::from_utf8(&self.buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// Makes `path` readable, mounting debugfs read-only at [`DEBUGFS`] if the
/// file is missing and debugfs is not mounted there. Returns why not.
pub fn ensure_mounted(path: &Path) -> Result<(), String> {
    if File::open(path).is_ok() {
        return Ok(());
    }
    let sched = Path::new(DEBUGFS).join("sched");
    if path == Path::new(SCHED_DEBUG) && !sched.exists() {
        mount_debugfs_ro()?;
    }
    File::open(path)
        .map(|_| ())
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `mount -t debugfs -o ro none /sys/kernel/debug`.
fn mount_debugfs_ro() -> Result<(), String> {
    let c = |s: &str| std::ffi::CString::new(s).expect("no NUL");
    let (src, target, fstype) = (c("none"), c(DEBUGFS), c("debugfs"));
    // SAFETY: every pointer is a valid NUL-terminated string that outlives
    // the call; no data argument.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(format!(
            "mounting debugfs read-only at {DEBUGFS}: {}",
            io::Error::last_os_error()
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const V6_18: &str = include_str!("testdata/sched_debug_6.18.txt");
    const V6_12: &str = include_str!("testdata/sched_debug_6.12.txt");
    const V5_15: &str = include_str!("testdata/sched_debug_5.15.txt");

    #[test]
    fn split_ns_is_milliseconds_and_nanoseconds() {
        assert_eq!(parse_split_ns("13589458.872463"), Some(13_589_458_872_463));
        assert_eq!(parse_split_ns("-1.048576"), Some(-1_048_576));
        assert_eq!(parse_split_ns("0.000001"), Some(1));
        assert_eq!(parse_split_ns("209571"), Some(209_571));
        assert_eq!(parse_split_ns("1.5"), None);
        assert_eq!(parse_split_ns("x"), None);
    }

    #[test]
    fn a_6_18_capture_gives_the_root_cfs_rq_and_the_table() {
        let cpus = parse(V6_18).unwrap();
        assert_eq!(cpus.len(), 2);
        let c0 = &cpus[0];
        assert_eq!((c0.cpu, c0.nr_running, c0.curr_pid), (0, 3, 385));
        assert_eq!(c0.clock_ns, 13_589_458_872_463);
        assert_eq!(c0.clock_task_ns, 13_585_651_027_258);
        assert_eq!(c0.avg_idle_ns, 209_571);
        // The root block, not the autogroup blocks printed before it.
        assert_eq!(
            c0.cfs,
            Some(RootCfs {
                nr_queued: 2,
                h_nr_queued: 3,
                h_nr_runnable: 3,
                h_nr_idle: 0,
                load_avg: 1375,
                runnable_avg: 1554,
                util_avg: 1022,
                util_est: 310,
            })
        );
        // Every task of the CPU is listed; two are runnable, one current.
        let runnable: Vec<_> = c0.tasks.iter().filter(|t| t.runnable()).collect();
        assert_eq!(runnable.len(), 2);
        assert!(runnable.iter().any(|t| t.tid == 385 && t.current));
        let tokio = c0.tasks.iter().find(|t| t.tid == 69).unwrap();
        assert_eq!((tokio.state, tokio.prio), ('S', 110));
        assert_eq!(tokio.sum_exec_ns, 2_845_168_468);
        // A comm with a space does not shift the columns.
        let spaced = c0.tasks.iter().find(|t| t.tid == 4242).unwrap();
        assert_eq!((spaced.state, spaced.sum_exec_ns), ('R', 12_000_001));
        // A custom slice's lone S column does not shift them either.
        let custom = c0.tasks.iter().find(|t| t.tid == 4243).unwrap();
        assert_eq!((custom.prio, custom.sum_exec_ns), (139, 3_000_000));
        let c1 = &cpus[1];
        assert_eq!(c1.cfs.unwrap().h_nr_idle, 1);
        assert_eq!(c1.cfs.unwrap().util_avg, 1023);
    }

    #[test]
    fn a_6_12_capture_reads_the_old_names_and_delayed_entities() {
        let cpus = parse(V6_12).unwrap();
        assert_eq!(cpus.len(), 2);
        let cfs = cpus[0].cfs.unwrap();
        // nr_running / h_nr_running / idle_h_nr_running, and runnable =
        // queued - delayed.
        assert_eq!(cfs.nr_queued, 1);
        assert_eq!(cfs.h_nr_queued, 3);
        assert_eq!(cfs.h_nr_runnable, 2);
        assert_eq!(cfs.h_nr_idle, 1);
        assert_eq!((cfs.load_avg, cfs.util_est), (2048, 512));
        assert_eq!(cpus[0].nr_running, 3);
        assert_eq!(cpus[0].tasks.iter().filter(|t| t.runnable()).count(), 2);
    }

    #[test]
    fn a_5_15_capture_without_group_scheduling_or_eevdf_columns() {
        let cpus = parse(V5_15).unwrap();
        assert_eq!(cpus.iter().map(|c| c.cpu).collect::<Vec<_>>(), [0, 1]);
        let cfs = cpus[1].cfs.unwrap();
        assert_eq!(cfs.h_nr_queued, 2);
        assert_eq!(cfs.h_nr_runnable, 2, "no delayed dequeue before 6.12");
        assert_eq!(cfs.util_est, 100, "util_est_enqueued");
        assert_eq!(cfs.load_avg, 2040);
        let t = cpus[1].tasks.iter().find(|t| t.tid == 900).unwrap();
        assert!(t.current);
        assert_eq!((t.prio, t.sum_exec_ns), (120, 5_000_123_456));
    }

    #[test]
    fn garbage_is_an_error_and_partial_blocks_are_tolerated() {
        assert!(parse("").is_err());
        assert!(parse("hello\nworld\n").is_err());
        let cpus = parse("cpu#3\n  .nr_running   : 2\n").unwrap();
        assert_eq!((cpus[0].cpu, cpus[0].nr_running, cpus[0].cfs), (3, 2, None));
        // A row cut short (a read racing nothing, but a truncated file) is
        // skipped, not a panic.
        let t = "cpu#0\n\nrunnable tasks:\n S            task   PID  sum-exec prio\n\
                 --\n S            bash   12";
        assert!(parse(t).unwrap()[0].tasks.is_empty());
    }

    #[test]
    fn the_running_kernel_parses_when_readable() {
        let Ok(mut r) = Reader::open(Path::new(SCHED_DEBUG)) else {
            eprintln!("skipped: {SCHED_DEBUG} is not readable here");
            return;
        };
        let cpus = parse(r.read().unwrap()).unwrap();
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(cpus.len() <= n.max(cpus.len()));
        // This thread is running while it reads: some CPU lists it as R.
        let me = unsafe { libc::gettid() } as u32;
        let mut again = cpus.clone();
        if !again.iter().any(|c| c.tasks.iter().any(|t| t.tid == me)) {
            again = parse(r.read().unwrap()).unwrap();
        }
        let mine = again
            .iter()
            .flat_map(|c| &c.tasks)
            .find(|t| t.tid == me)
            .expect("the reading thread is in the table");
        assert!(mine.runnable());
        assert!(again.iter().all(|c| c.cfs.is_some()));
    }
}
