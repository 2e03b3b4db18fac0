//! The guest's init for the kernel fidelity harness (tests/kernel/run.sh).
//!
//! It mounts proc, sys, debugfs and tracefs, reads the topology the kernel
//! built, then runs rounds of experiments: pinned spinners (SCHED_OTHER and
//! SCHED_IDLE) make a known load, PELT settles, and one task at a time is
//! placed by a sync wakeup (pipe), a non-sync wakeup (futex), a fork or an
//! exec. Just before each placement it records the kernel's inputs
//! (`sched/debug` per CPU, the task's `/proc/PID/sched`), and afterwards the
//! kernel's answer (tracefs `sched_wakeup` / `sched_wakeup_new` target CPU,
//! or `sched_getcpu()` in the exec'ed image). Each record is printed on the
//! console as one line `SCN {scenario}` in the fairplace scenario format,
//! `kernel: "6.12"`, with the answer under `expected`. Nothing here uses a
//! network: the console is the only channel.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fmt::Write as _;
use std::fs;
use std::sync::Mutex;
use std::time::Duration;

mod load;
mod migrate;
mod pass;
mod probe;

use load::{Load, Profile};

/// Per CPU, the topology's LLC id (its first CPU), for the `llc` hints.
static LLC: Mutex<Vec<usize>> = Mutex::new(Vec::new());

/// Per CPU, the trace time (ns) of its last switch to the idle task: the
/// kernel's `rq->idle_stamp` is set at that moment (newidle balance) and
/// cleared when a task is woken onto the CPU.
static LAST_IDLE: Mutex<Vec<u64>> = Mutex::new(Vec::new());

/// Per CPU, its sched domains as the kernel built them (after
/// degeneration, lowest first): the scenario format's name of the level
/// (section 2.1) and the span. The `sgc_imbalance` hint names groups by them.
static DOMS: Mutex<Vec<Vec<Dom>>> = Mutex::new(Vec::new());

/// A sched domain: the format's level name and its span.
type Dom = (String, Vec<usize>);

const TRACE: &str = "/sys/kernel/tracing";

/// Whether the decision probes are defined (`probe::define` succeeded).
static PROBES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The runqueues from `sched/debug`, or nothing when the decision probes
/// will read them at the decision (`probed`): printing `sched/debug` walks
/// every task and is most of a placement's cost under TCG, and a probed
/// record replaces every field read here.
fn read_rqs_unless(nr: usize, probed: bool) -> Vec<Rq> {
    if probed && PROBES.load(std::sync::atomic::Ordering::Relaxed) {
        vec![Rq::default(); nr]
    } else {
        read_rqs(nr)
    }
}

/// The wake flags (kernel/sched/sched.h) that tell a decision's kind.
const WF_EXEC: i64 = 0x02;
const WF_FORK: i64 = 0x04;
const WF_TTWU: i64 = 0x08;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "exec-report" {
        exec_report(&args[2]);
        return;
    }
    if args.len() == 2 && args[1] == "noop" {
        return; // the exec-heavy profile's churn
    }
    mount_all();
    let nr = online_cpus();
    let topo = read_topology(nr);
    println!("TOPO {topo}");
    println!("UNAME {}", uname_release());
    let levels = print_domains();
    run_agent();
    let placements: usize = kernel_arg("fp.n")
        .and_then(|s| s.parse().ok())
        .unwrap_or(100);
    // Seeds and profiles, comma-separated; each seed makes an equal share.
    let seeds: Vec<u64> = kernel_arg("fp.seed")
        .unwrap_or_else(|| "1".into())
        .split(',')
        .filter_map(|s| s.parse().ok())
        .collect();
    let profiles: Vec<Profile> = match kernel_arg("fp.profiles") {
        Some(list) => list.split(',').filter_map(Profile::parse).collect(),
        None => load::ALL.to_vec(),
    };
    if seeds.is_empty() || profiles.is_empty() {
        println!("FAIL no seed or no known profile on the command line");
        power_off();
    }
    *LLC.lock().unwrap() = (0..nr)
        .map(|c| llc_of(&format!("/sys/devices/system/cpu/cpu{c}"), c))
        .collect();
    setup_trace(&levels);
    let mut id = 0;
    let mut done = 0;
    for (k, &seed) in seeds.iter().enumerate() {
        let quota = placements / seeds.len() + (k < placements % seeds.len()) as usize;
        let mut rng = Lcg(seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407));
        let mut made = 0;
        while made < quota {
            let p = profiles[rng.below(profiles.len())];
            let ctx = RoundCtx {
                nr,
                topo: &topo,
                seed,
                profile: p,
            };
            made += round(&mut rng, &ctx, &mut id, quota - made);
        }
        done += made;
    }
    println!("DONE {done}");
    // can_migrate_task() verdicts (fp.migrations), after the placements.
    let migrations: usize = kernel_arg("fp.migrations")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if migrations > 0 {
        migrate::run(&topo, nr, &seeds, migrations);
    }
    // Whole load-balance passes (fp.passes), last.
    let passes: usize = kernel_arg("fp.passes")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if passes > 0 {
        pass::run(&topo, nr, &seeds, passes);
    }
    power_off();
}

fn power_off() -> ! {
    unsafe {
        libc::sync();
        libc::reboot(libc::RB_POWER_OFF);
    }
    std::process::exit(0)
}

/// The exec'ed image: report the CPU the task runs on right after
/// `sched_exec()` through the inherited pipe, then leave.
fn exec_report(fd: &str) {
    let cpu = unsafe { libc::sched_getcpu() };
    let fd: i32 = fd.parse().unwrap_or(-1);
    let b = (cpu as u32).to_le_bytes();
    unsafe {
        libc::write(fd, b.as_ptr().cast(), 4);
    }
}

pub(crate) struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn mount_all() {
    let m = |src: &str, dst: &str, ty: &str| {
        let _ = fs::create_dir_all(dst);
        let (s, d, t) = (cs(src), cs(dst), cs(ty));
        unsafe { libc::mount(s.as_ptr(), d.as_ptr(), t.as_ptr(), 0, std::ptr::null()) };
    };
    m("proc", "/proc", "proc");
    m("sysfs", "/sys", "sysfs");
    m("debugfs", "/sys/kernel/debug", "debugfs");
    m("tracefs", TRACE, "tracefs");
    m("devtmpfs", "/dev", "devtmpfs");
    m("cgroup2", "/sys/fs/cgroup", "cgroup2");
}

pub(crate) fn cs(s: &str) -> CString {
    CString::new(s).expect("no NUL")
}

fn kernel_arg(key: &str) -> Option<String> {
    let cmd = fs::read_to_string("/proc/cmdline").ok()?;
    cmd.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")).map(str::to_string))
}

fn uname_release() -> String {
    fs::read_to_string("/proc/sys/kernel/osrelease")
        .unwrap_or_default()
        .trim()
        .to_string()
}

fn online_cpus() -> usize {
    (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }) as usize
}

/// A sysfs cpulist ("0-3,8") as CPU ids.
fn cpulist(s: &str) -> Vec<usize> {
    let mut v = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => v.extend(a.parse::<usize>().unwrap()..=b.parse::<usize>().unwrap()),
            None => v.push(part.parse().unwrap()),
        }
    }
    v
}

fn first_of(path: &str, cpu: usize) -> usize {
    fs::read_to_string(path)
        .ok()
        .map(|s| cpulist(&s))
        .and_then(|v| v.first().copied())
        .unwrap_or(cpu)
}

/// The topology object of the scenario format, from sysfs: SMT core, LLC
/// (the highest cache level's sharing list), NUMA node and distances.
fn read_topology(nr: usize) -> String {
    let mut node_of = vec![0usize; nr];
    let mut nodes = Vec::new();
    for k in 0..64 {
        let p = format!("/sys/devices/system/node/node{k}/cpulist");
        let Ok(s) = fs::read_to_string(&p) else {
            continue;
        };
        for c in cpulist(&s) {
            if c < nr {
                node_of[c] = k;
            }
        }
        let d = fs::read_to_string(format!("/sys/devices/system/node/node{k}/distance"))
            .unwrap_or_default();
        nodes.push(d.split_whitespace().map(str::to_string).collect::<Vec<_>>());
    }
    let mut cpus = Vec::new();
    for (c, node) in node_of.iter().enumerate() {
        let base = format!("/sys/devices/system/cpu/cpu{c}");
        let core = first_of(&format!("{base}/topology/thread_siblings_list"), c);
        let llc = llc_of(&base, c);
        let cap = fs::read_to_string(format!("{base}/cpu_capacity"))
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .unwrap_or(1024);
        cpus.push(format!(
            "{{\"id\":{c},\"core\":{core},\"llc\":{llc},\"node\":{node},\"capacity\":{cap}}}"
        ));
    }
    let dist: Vec<String> = nodes.iter().map(|r| format!("[{}]", r.join(","))).collect();
    format!(
        "{{\"cpus\":[{}],\"numa_distance\":[{}]}}",
        cpus.join(","),
        dist.join(",")
    )
}

fn llc_of(base: &str, c: usize) -> usize {
    let mut best = (0u32, c);
    for i in 0..8 {
        let d = format!("{base}/cache/index{i}");
        let Ok(level) = fs::read_to_string(format!("{d}/level")) else {
            continue;
        };
        let level: u32 = level.trim().parse().unwrap_or(0);
        if level >= best.0 {
            best = (level, first_of(&format!("{d}/shared_cpu_list"), c));
        }
    }
    best.1
}

/// The scenario format's name (section 2.1) of CPU `c`'s domain spanning
/// `span`: the lowest level whose span it is (SMT core, LLC, node, then the
/// NUMA level j whose nodes are those within the j-th distance), else the
/// kernel's own name `kname` (which the format then rejects, loudly).
fn format_level(c: usize, span: &[usize], kname: &str) -> String {
    let nr = online_cpus();
    let base = format!("/sys/devices/system/cpu/cpu{c}");
    let sib = fs::read_to_string(format!("{base}/topology/thread_siblings_list"))
        .map(|s| cpulist(&s))
        .unwrap_or_default();
    if span == sib.as_slice() {
        return "SMT".into();
    }
    let llc = llc_of(&base, c);
    let same_llc: Vec<usize> = (0..nr)
        .filter(|&d| llc_of(&format!("/sys/devices/system/cpu/cpu{d}"), d) == llc)
        .collect();
    if span == same_llc.as_slice() {
        return "MC".into();
    }
    let mut node_cpus = Vec::new();
    let mut dist: Vec<Vec<u32>> = Vec::new();
    for k in 0..64 {
        let Ok(list) = fs::read_to_string(format!("/sys/devices/system/node/node{k}/cpulist"))
        else {
            continue;
        };
        node_cpus.push(cpulist(&list));
        let d = fs::read_to_string(format!("/sys/devices/system/node/node{k}/distance"))
            .unwrap_or_default();
        dist.push(
            d.split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect(),
        );
    }
    let Some(home) = node_cpus.iter().position(|n| n.contains(&c)) else {
        return kname.into();
    };
    if span == node_cpus[home].as_slice() {
        return "PKG".into();
    }
    let mut ds: Vec<u32> = dist.iter().flatten().copied().collect();
    ds.sort_unstable();
    ds.dedup();
    for (j, &dj) in ds.iter().enumerate().skip(1) {
        let mut within: Vec<usize> = (0..node_cpus.len())
            .filter(|&n| dist[home].get(n).is_some_and(|&d| d <= dj))
            .flat_map(|n| node_cpus[n].clone())
            .collect();
        within.sort_unstable();
        if span == within.as_slice() {
            return format!("NUMA{j}");
        }
    }
    kname.into()
}

/// The domains the kernel built, as `sched_verbose` printed them, plus the
/// per-CPU domain names under debugfs, for the harness's topology check.
/// Returns the number of domains of each CPU.
fn print_domains() -> Vec<usize> {
    let Ok(kmsg) = std::process::Command::new("/bin/busybox")
        .arg("dmesg")
        .output()
    else {
        return Vec::new();
    };
    let nr = online_cpus();
    let mut doms: Vec<Vec<Dom>> = vec![Vec::new(); nr];
    let mut cur: Option<usize> = None;
    for line in String::from_utf8_lossy(&kmsg.stdout).lines() {
        if line.contains("domain-") || line.contains("CPU") && line.contains("attaching") {
            println!("KDOM {}", line.trim());
        }
        if let Some(i) = line.find("CPU")
            && line.contains(" attaching")
        {
            cur = line[i + 3..].split(' ').next().and_then(|n| n.parse().ok());
        }
        if let (Some(c), Some(i)) = (cur, line.find("span="))
            && line.contains("domain-")
            && c < nr
        {
            let mut w = line[i..].split_whitespace();
            let span = w.next().and_then(|x| x.strip_prefix("span=")).unwrap_or("");
            let name = w
                .next()
                .and_then(|x| x.strip_prefix("level="))
                .unwrap_or("?");
            doms[c].push((name.to_string(), cpulist(span)));
        }
    }
    for (c, d) in doms.iter_mut().enumerate() {
        for (name, span) in d.iter_mut() {
            *name = format_level(c, span, name);
        }
    }
    *DOMS.lock().unwrap() = doms;
    let mut levels = Vec::new();
    for c in 0..nr {
        let mut names = Vec::new();
        for d in 0..8 {
            let p = format!("/sys/kernel/debug/sched/domains/cpu{c}/domain{d}/name");
            match fs::read_to_string(&p) {
                Ok(s) => names.push(s.trim().to_string()),
                Err(_) => break,
            }
        }
        println!("KDOMNAMES {c} {}", names.join(","));
        levels.push(names.len());
    }
    levels
}

/// fairplace-agent, if the initramfs has it, prints what it read.
fn run_agent() {
    if fs::metadata("/bin/fairplace-agent").is_err() {
        return;
    }
    match std::process::Command::new("/bin/fairplace-agent")
        .args(["--node-id", "guest", "--print-once"])
        .output()
    {
        Ok(o) => {
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                println!("AGENT {line}");
            }
            for line in String::from_utf8_lossy(&o.stderr).lines() {
                println!("AGENTERR {line}");
            }
        }
        Err(e) => println!("AGENTERR {e}"),
    }
}

fn setup_trace(levels: &[usize]) {
    let w = |f: &str, v: &str| {
        let _ = fs::write(format!("{TRACE}/{f}"), v);
    };
    w("buffer_size_kb", "4096");
    for ev in [
        "sched_wakeup",
        "sched_wakeup_new",
        "sched_migrate_task",
        "sched_switch",
        "sched_process_exec",
    ] {
        w(&format!("events/sched/{ev}/enable"), "1");
    }
    // rq->idle_stamp is written in sched_balance_newidle(), also when an idle
    // CPU reschedules to idle again without a context switch (no
    // sched_switch event): a kprobe there sees every write.
    w("kprobe_events", "p:fp/newidle sched_balance_newidle");
    w("events/fp/newidle/enable", "1");
    if fs::metadata(format!("{TRACE}/events/fp/newidle")).is_err() {
        println!("NOTE no kprobe on sched_balance_newidle: idle stamps from sched_switch only");
    }
    match probe::define(TRACE, online_cpus(), levels) {
        Ok(()) => {
            PROBES.store(true, std::sync::atomic::Ordering::Relaxed);
            println!("NOTE decision probes on select_task_rq_fair")
        }
        Err(e) => {
            println!("NOTE no decision probes ({e}): records from sched/debug and tracefs only")
        }
    }
    w("tracing_on", "1");
    // Every CPU runs something once, so each has a recorded idle entry.
    let nr = online_cpus();
    *LAST_IDLE.lock().unwrap() = vec![0; nr];
    for c in 0..nr {
        pin(0, &[c]);
        std::thread::sleep(Duration::from_millis(2));
    }
    pin(0, &(0..nr).collect::<Vec<_>>());
}

/// Reads the trace buffer, updates LAST_IDLE from its sched_switch lines
/// and clears it; returns the text.
fn drain_trace(clear: bool) -> String {
    // Tracing pauses while the buffer is read: under a wake storm events
    // come as fast as they are read, and the read would not end.
    let _ = fs::write(format!("{TRACE}/tracing_on"), "0");
    let t = fs::read_to_string(format!("{TRACE}/trace")).unwrap_or_default();
    if clear {
        let _ = fs::write(format!("{TRACE}/trace"), "");
    }
    let _ = fs::write(format!("{TRACE}/tracing_on"), "1");
    let mut last = LAST_IDLE.lock().unwrap();
    for line in t.lines() {
        let event = if line.contains(" newidle: ") {
            ": newidle"
        } else if line.contains(" sched_switch: ") && line.contains("next_pid=0 ") {
            ": sched_switch"
        } else {
            continue;
        };
        let Some(open) = line.find('[') else { continue };
        let Some(cpu) = line[open + 1..]
            .split(']')
            .next()
            .and_then(|c| c.parse::<usize>().ok())
        else {
            continue;
        };
        let Some(colon) = line.find(event) else {
            continue;
        };
        let Some(ts) = line[..colon].split_whitespace().last() else {
            continue;
        };
        let Some((sec, frac)) = ts.split_once('.') else {
            continue;
        };
        let ns = sec.parse::<u64>().unwrap_or(0) * 1_000_000_000
            + frac.parse::<u64>().unwrap_or(0) * 1000;
        if cpu < last.len() {
            last[cpu] = ns;
        }
    }
    t
}

/// Empties the trace buffer before a placement. Without the decision
/// probes the events since the last read still update the idle stamps;
/// with them nothing in the buffer is needed (a probed record reads
/// `rq->idle_stamp` itself, and a record without probes is a wakeup or fork
/// with one allowed CPU, which reads no stamp), and formatting a buffer
/// that a round's settling filled is most of a placement's time under TCG.
fn clear_trace() {
    if PROBES.load(std::sync::atomic::Ordering::Relaxed) {
        let _ = fs::write(format!("{TRACE}/trace"), "");
    } else {
        drain_trace(true);
    }
}

/// The target CPU of the first `event` line for `pid` in the trace buffer,
/// and the staleness of the record (see `stale_cpus`).
fn traced_target(event: &str, pid: i32, flag: i64) -> (Option<usize>, Vec<usize>, Probe) {
    let t = drain_trace(true);
    let pat = format!(" pid={pid} ");
    let ev = format!(" {event}: ");
    let is_answer = |l: &str| l.contains(&ev) && l.contains(&pat);
    let stale = stale_cpus(&t, is_answer);
    let probe = probe::decision(&t, online_cpus(), pid, flag, is_answer);
    let cpu = t.lines().find(|l| is_answer(l)).and_then(|l| {
        let i = l.find("target_cpu=")?;
        l[i + 11..].trim().parse().ok()
    });
    (cpu, stale, probe)
}

/// Marks in the trace the moment the recorded state starts to be read:
/// anything that changes after it may or may not be in the record.
fn mark_state_read() {
    let _ = fs::write(format!("{TRACE}/trace_marker"), "fp-state-read");
}

/// The CPUs that went idle or left idle between the state read (the marker)
/// and the kernel's decision (the first line `is_answer` accepts): the record
/// then shows a state the kernel no longer had. Such records are reported
/// as stale, not compared.
fn stale_cpus(t: &str, is_answer: impl Fn(&str) -> bool) -> Vec<usize> {
    let mut after_mark = false;
    let mut out = Vec::new();
    for l in t.lines() {
        if l.contains("fp-state-read") {
            after_mark = true;
            continue;
        }
        if is_answer(l) {
            break;
        }
        if after_mark
            && l.contains(" sched_switch: ")
            && (l.contains(" prev_pid=0 ") || l.contains(" next_pid=0 "))
            && let Some(c) = l
                .find('[')
                .and_then(|i| l[i + 1..].split(']').next())
                .and_then(|c| c.parse::<usize>().ok())
            && !out.contains(&c)
        {
            out.push(c);
        }
    }
    out
}

pub(crate) fn pin(pid: i32, cpus: &[usize]) {
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cpus {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn getcpu() -> usize {
    unsafe { libc::sched_getcpu() as usize }
}

pub(crate) fn kill_all(pids: &[i32]) {
    for &p in pids {
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    for &p in pids {
        unsafe { libc::waitpid(p, std::ptr::null_mut(), 0) };
    }
}

/// One CPU's runqueue as `sched/debug` shows it (root cfs_rq fields).
#[derive(Default, Clone)]
struct Rq {
    nr_running: i64,
    curr_pid: i64,
    h_nr_idle: i64,
    h_nr_queued: i64,
    h_nr_delayed: i64,
    load_avg: i64,
    runnable_avg: i64,
    util_avg: i64,
    util_est: i64,
}

fn read_rqs(nr: usize) -> Vec<Rq> {
    let text = fs::read_to_string("/sys/kernel/debug/sched/debug").unwrap_or_default();
    let mut rqs = vec![Rq::default(); nr];
    // Which section we are in: Some((cpu, is_root_cfs)).
    let mut sec: Option<(usize, bool)> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("cpu#") {
            sec = rest
                .split(',')
                .next()
                .and_then(|s| s.parse().ok())
                .map(|c| (c, false));
            continue;
        }
        if let Some(rest) = line.strip_prefix("cfs_rq[") {
            sec = rest.split_once("]:").and_then(|(c, path)| {
                (path.trim() == "/")
                    .then(|| c.parse().ok())
                    .flatten()
                    .map(|c| (c, true))
            });
            continue;
        }
        if !line.starts_with("  .") {
            if !line.starts_with(' ') && !line.is_empty() {
                sec = None;
            }
            continue;
        }
        let Some((cpu, root)) = sec else { continue };
        if cpu >= nr {
            continue;
        }
        let Some((k, v)) = line[3..].split_once(':') else {
            continue;
        };
        let v: i64 = v
            .trim()
            .split('.')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let r = &mut rqs[cpu];
        match (k.trim(), root) {
            ("nr_running", false) => r.nr_running = v,
            ("curr->pid", false) => r.curr_pid = v,
            ("idle_h_nr_running", true) => r.h_nr_idle = v,
            ("h_nr_queued", true) => r.h_nr_queued = v,
            ("h_nr_delayed", true) => r.h_nr_delayed = v,
            ("load_avg", true) => r.load_avg = v,
            ("runnable_avg", true) => r.runnable_avg = v,
            ("util_avg", true) => r.util_avg = v,
            ("util_est", true) => r.util_est = v,
            _ => {}
        }
    }
    rqs
}

/// `se.avg.*` of a task from /proc/PID/sched.
fn task_avgs(pid: i32) -> BTreeMap<String, i64> {
    let t = fs::read_to_string(format!("/proc/{pid}/sched")).unwrap_or_default();
    let mut m = BTreeMap::new();
    for line in t.lines() {
        if let Some((k, v)) = line.split_once(':') {
            let k = k.trim();
            if k.starts_with("se.avg.") || k == "policy" {
                let v = v
                    .trim()
                    .split('.')
                    .next()
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                m.insert(k.to_string(), v);
            }
        }
    }
    m
}

/// `task_h_load()` of a task in the root group of a CPU whose cfs_rq load is
/// `rq_load`: `h_load * load / (rq_load + 1)` with `h_load = rq_load`.
fn h_load(load: i64, rq_load: i64) -> i64 {
    rq_load * load / (rq_load + 1)
}

fn cpus_json(rqs: &[Rq]) -> String {
    let stamps = LAST_IDLE.lock().unwrap().clone();
    let mut s = String::from("[");
    for (i, r) in rqs.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let _ = write!(
            s,
            "{{\"id\":{i},\"nr_running\":{},\"h_nr_idle\":{},\"nr_delayed\":{},\"cfs_h_nr_queued\":{},\"curr_is_idle\":{},\"load_avg\":{},\"runnable_avg\":{},\"util_avg\":{},\"util_est\":{},\"idle_stamp\":{}}}",
            r.nr_running,
            r.h_nr_idle.min(r.nr_running),
            r.h_nr_delayed.min(r.nr_running),
            r.h_nr_queued,
            r.curr_pid == 0,
            r.load_avg,
            r.runnable_avg,
            r.util_avg,
            r.util_est,
            if r.curr_pid == 0 {
                stamps.get(i).copied().unwrap_or(0)
            } else {
                0
            }
        );
    }
    s.push(']');
    s
}

fn cpulist_str(v: &[usize]) -> String {
    v.iter()
        .map(|c| c.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// Per CPU, what the decision probes read (see `probe`), if they fired.
type Probe = Option<Vec<BTreeMap<String, i64>>>;

/// A recorded placement: the scenario's body (cpus, task, request), the
/// kernel's CPU, the CPUs whose idle state changed between the state read
/// and the decision, and the probes' reading at the decision.
type Record = (String, usize, Vec<usize>, Probe);

/// What every record of a round shares.
struct RoundCtx<'a> {
    nr: usize,
    topo: &'a str,
    seed: u64,
    profile: Profile,
}

const KINDS: [&str; 4] = ["wakeup-sync", "wakeup", "fork", "exec"];

/// One round: the profile's load, then up to four placements on it. An
/// attempt that gives no record prints `DROP kind reason`, so the harness
/// counts it.
fn round(rng: &mut Lcg, ctx: &RoundCtx, id: &mut usize, left: usize) -> usize {
    let nr = ctx.nr;
    pin(0, &(0..nr).collect::<Vec<_>>());
    let avail = fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .map(|l| l.split_whitespace().nth(1).unwrap_or("?").to_string())
        .unwrap_or_default();
    let uptime = fs::read_to_string("/proc/uptime").unwrap_or_default();
    println!(
        "ROUND seed={} profile={} mem_available_kb={avail} uptime={}",
        ctx.seed,
        ctx.profile.name(),
        uptime.split_whitespace().next().unwrap_or("?")
    );
    let llc = LLC.lock().unwrap().clone();
    let load = Load::start(ctx.profile, rng, nr, &llc);
    // PELT's half-life is 32 ms: 250 ms settles a new spinner's signals
    // within half a percent.
    std::thread::sleep(Duration::from_millis(250));
    let mut n = 0;
    for k in 0..4.min(left) {
        let kind = ctx.profile.kind(rng, k);
        let mut allowed: Vec<usize> = (0..nr).collect();
        if rng.below(5) == 0 {
            allowed.retain(|_| rng.below(2) == 0);
        }
        if allowed.is_empty() {
            allowed.push(rng.below(nr));
        }
        // A fork or exec is made on an allowed CPU (the parent runs there).
        let this = if kind >= 2 {
            allowed[rng.below(allowed.len())]
        } else {
            rng.below(nr)
        };
        let flips = if ctx.profile == Profile::WakeStorm {
            (
                [0, 10, 40, 100, 200][rng.below(5)],
                [0, 4, 10, 20][rng.below(4)],
            )
        } else {
            (0, 0)
        };
        let rec = match kind {
            0 | 1 => wakeup(rng, nr, this, &allowed, kind == 0, flips, &load.helpers),
            2 => fork(nr, this, &allowed),
            _ => exec(nr, this, &allowed),
        };
        match rec {
            Ok(r) => {
                *id += 1;
                print_record(ctx, *id, r);
                n += 1;
            }
            Err(why) => println!("DROP {} {why}", KINDS[kind]),
        }
        std::thread::sleep(Duration::from_millis(30));
    }
    load.stop();
    n
}

/// Prints one record as a scenario line. The expected CPU is the return
/// value of `select_task_rq_fair()` where the return probe caught it; the
/// CPU the task was seen on (`observed`) is kept beside it.
fn print_record(ctx: &RoundCtx, id: usize, (body, cpu, stale, probe): Record) {
    let (body, hidden, ret) = match probe {
        Some(p) => at_decision(&body, &p),
        None => (body, String::new(), None),
    };
    let expected = ret.unwrap_or(cpu);
    println!(
        "SCN {{\"name\":\"k{id}\",\"kernel\":\"6.12\",\"generator\":{{\"seed\":{},\"profile\":\"{}\",\"observed\":{cpu},\"returned\":{},\"stale_cpus\":{stale:?}{hidden}}},\"topology\":{},{body},\"expected\":{{\"cpu\":{expected}}}}}",
        ctx.seed,
        ctx.profile.name(),
        ret.map_or("null".to_string(), |r| r.to_string()),
        ctx.topo,
    );
}

/// The record's body with the per-CPU state, prev and `recent_used_cpu`
/// the probes read at the decision, the LLCs' `nr_idle_scan` /
/// `has_idle_cores` as `llc` hints and every group with `sgc->imbalance`
/// set as the `sgc_imbalance` hint; the generator's note of the source; and
/// the value `select_task_rq_fair()` returned, if the return probe caught it.
fn at_decision(body: &str, p: &[BTreeMap<String, i64>]) -> (String, String, Option<usize>) {
    let v = |c: usize, k: &str| p[c].get(k).copied().unwrap_or(0);
    let mut cpus = String::from("[");
    for c in 0..p.len() {
        if c > 0 {
            cpus.push(',');
        }
        let nr = v(c, "nr");
        let _ = write!(
            cpus,
            "{{\"id\":{c},\"nr_running\":{nr},\"h_nr_idle\":{},\"nr_delayed\":{},\"cfs_h_nr_queued\":{},\"curr_is_idle\":{},\"ttwu_pending\":{},\"load_avg\":{},\"runnable_avg\":{},\"util_avg\":{},\"util_est\":{},\"idle_stamp\":{}}}",
            v(c, "i").min(nr),
            v(c, "d").min(nr),
            v(c, "q"),
            v(c, "cp") == 0,
            v(c, "tp") != 0,
            v(c, "l"),
            v(c, "r"),
            v(c, "u"),
            v(c, "e"),
            v(c, "st"),
        );
    }
    cpus.push(']');
    // The body starts with the `cpus` list read from sched/debug.
    let rest = body.find(']').map_or("", |i| &body[i + 1..]);
    let mut out = format!("\"cpus\":{cpus}{rest}");
    // The CPU the decision ran on is the kernel's `this_cpu`.
    if let Some(&on) = p[0].get("on") {
        out = set_int(&out, "this_cpu", on);
    }
    if out.contains("\"prev_cpu\":") {
        out = set_int(&out, "prev_cpu", v(0, "prev"));
        out = set_int(&out, "recent_used_cpu", v(0, "ruc"));
        out = with_flips(&out, p);
    }
    out = with_h_loads(&out, p);
    let llc = LLC.lock().unwrap().clone();
    let mut hints = BTreeMap::new();
    for (c, &l) in llc.iter().enumerate().take(p.len()) {
        hints.entry(l).or_insert_with(|| {
            format!(
                "\"{l}\":{{\"nr_idle_scan\":{},\"has_idle_cores\":{}}}",
                v(c, "ns"),
                v(c, "ic") != 0
            )
        });
    }
    let hints: Vec<String> = hints.into_values().collect();
    let _ = write!(out, ",\"llc\":{{{}}}", hints.join(","));
    let (marks, imb) = sgc_marks(p);
    if !marks.is_empty() {
        let keys: Vec<String> = marks
            .iter()
            .map(|(level, spans)| {
                let l: Vec<String> = spans.iter().map(|s| format!("\"{s}\"")).collect();
                format!("\"{level}\":[{}]", l.join(","))
            })
            .collect();
        let _ = write!(out, ",\"sgc_imbalance\":{{{}}}", keys.join(","));
    }
    // What changed each CPU: 1 idle entry or exit, 2 another wakeup, 4
    // another placement's answer, 8 a migration.
    let by: Vec<String> = (0..p.len())
        .filter(|&c| v(c, "changedk") != 0)
        .map(|c| format!("[{c},{}]", v(c, "changedk")))
        .collect();
    let hidden = format!(
        ",\"source\":\"kprobe\",\"changed_during\":{:?},\"changed_by\":[{}],\"on_cpu\":{},\"wake_flags\":{},\"sgc_marks\":[{}]",
        (0..p.len())
            .filter(|c| v(0, "changed") >> c & 1 == 1)
            .collect::<Vec<_>>(),
        by.join(","),
        v(0, "on"),
        v(0, "wf"),
        imb.join(",")
    );
    let hidden = hidden + &h_load_fresh(p, v(0, "on") as usize);
    let ret = p[0].get("ret").and_then(|&r| usize::try_from(r).ok());
    (out, hidden, ret)
}

/// The groups with `sgc->imbalance` set at the decision. The probe of CPU c
/// reads, at each level l above the lowest, the flag of its domain's local
/// group (the balancer sets it there: `sd_parent->groups->sgc`), whose span
/// is c's domain at level l - 1; every group of a level is some CPU's local
/// group, so this is every group's flag. Returns (level name -> cpulists)
/// and the raw `[cpu,level]` pairs.
fn sgc_marks(p: &[BTreeMap<String, i64>]) -> (BTreeMap<String, Vec<String>>, Vec<String>) {
    let doms = DOMS.lock().unwrap();
    let mut marks: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut raw = Vec::new();
    for (c, m) in p.iter().enumerate() {
        for (k, &x) in m {
            let Some(lvl) = k.strip_prefix("im").and_then(|l| l.parse::<usize>().ok()) else {
                continue;
            };
            if x == 0 {
                continue;
            }
            raw.push(format!("[{c},{lvl}]"));
            let (Some((name, _)), Some((_, child))) = (
                doms.get(c).and_then(|d| d.get(lvl)),
                doms.get(c).and_then(|d| d.get(lvl - 1)),
            ) else {
                continue;
            };
            let span = cpulist_str(child);
            let at = marks.entry(name.clone()).or_default();
            if !at.contains(&span) {
                at.push(span);
            }
        }
    }
    (marks, raw)
}

/// A wakeup's body with `wake_wide()`'s inputs as the probes read them: the
/// wakee's flips, and the waker's (the task current on `this_cpu`) flips,
/// last wakee and whether `record_wakee()` decays its flips first
/// (`time_after(jiffies, wakee_flip_decay_ts + HZ)`, HZ from `fp.hz`).
fn with_flips(body: &str, p: &[BTreeMap<String, i64>]) -> String {
    let v = |c: usize, k: &str| p.get(c).and_then(|m| m.get(k)).copied().unwrap_or(0);
    let this = body
        .split_once("\"this_cpu\":")
        .and_then(|(_, r)| r.split(|ch: char| !ch.is_ascii_digit()).next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(0);
    let hz: i64 = kernel_arg("fp.hz")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let expired = hz > 0 && v(this, "cd").wrapping_add(hz).wrapping_sub(v(0, "jf")) < 0;
    body.replacen("\"task\":{", &format!("\"task\":{{\"wakee_flips\":{},", v(0, "pf")), 1)
        .replacen(
            "\"waker_last_wakee_is_task\":false",
            &format!(
                "\"waker_last_wakee_is_task\":{},\"waker_wakee_flips\":{},\"waker_flip_decay_expired\":{expired}",
                v(this, "cl") == v(0, "p"),
                v(this, "cf"),
            ),
            1,
        )
}

/// The body with `task_h_load()` of the placed task (on its `task_cpu`, the
/// probe's prev) and, for a wakeup, of the waker (current on `this_cpu`),
/// computed as the kernel does from what the probes read: `se.avg.load_avg *
/// h_load / (cfs_rq load_avg + 1)`, where `h_load` is the stored value when it
/// was updated in this jiffy and the cfs_rq's load otherwise (every task is
/// in the root group: `noautogroup`).
fn with_h_loads(body: &str, p: &[BTreeMap<String, i64>]) -> String {
    let v = |c: usize, k: &str| p.get(c).and_then(|m| m.get(k)).copied().unwrap_or(0);
    let h_load = |c: usize, se_load: i64| task_h_load(p, c, se_load, false);
    let int_of = |key: &str| {
        body.split_once(&format!("\"{key}\":"))
            .and_then(|(_, r)| r.split(|ch: char| !ch.is_ascii_digit()).next())
            .and_then(|n| n.parse::<usize>().ok())
    };
    let mut out = body.to_string();
    let Some(t) = out.find("\"task\":{") else {
        return out;
    };
    if out[t..].contains("\"load_avg\":") {
        let cpu = v(0, "prev") as usize;
        let mut tail = set_int(&out[t..], "load_avg", h_load(cpu, v(0, "pl")));
        // The task's own signals as the kernel has them at the decision (a
        // queued exec'ing task's runnable grows between a /proc read and
        // sched_exec()); util_est without its UTIL_AVG_UNCHANGED flag bit.
        tail = set_int(&tail, "runnable_avg", v(0, "pr"));
        tail = set_int(&tail, "util_avg", v(0, "pu"));
        tail = set_int(&tail, "util_est", v(0, "pe") & 0x7fff_ffff);
        out = format!("{}{tail}", &out[..t]);
    }
    if let (Some(this), true) = (int_of("this_cpu"), out.contains("\"waker_load\":")) {
        out = set_int(&out, "waker_load", h_load(this, v(this, "sl")));
    }
    out
}

/// `task_h_load()` of a task with PELT load `se_load` in the root group of
/// CPU `c`: `se_load * h_load / (load_avg + 1)`, with the stored `h_load`
/// when it was updated in the probe's jiffy and the cfs_rq's load otherwise,
/// or, with `fresh`, as recomputed (what another placement in flight or a
/// tick during the decision makes the kernel use).
fn task_h_load(p: &[BTreeMap<String, i64>], c: usize, se_load: i64, fresh: bool) -> i64 {
    let v = |c: usize, k: &str| p.get(c).and_then(|m| m.get(k)).copied().unwrap_or(0);
    let h = if !fresh && v(c, "hu") == v(0, "jf") {
        v(c, "hl")
    } else {
        v(c, "l")
    };
    se_load * h / (v(c, "l") + 1)
}

/// The record's hidden `h_load_fresh`: the task's and the waker's
/// `task_h_load()` with `h_load` recomputed, and the jiffies at the
/// decision's start and end, so the comparison can tell whether a race on
/// `h_load` could change the answer.
fn h_load_fresh(p: &[BTreeMap<String, i64>], this: usize) -> String {
    let v = |c: usize, k: &str| p.get(c).and_then(|m| m.get(k)).copied().unwrap_or(0);
    format!(
        ",\"h_load_fresh\":{{\"load_avg\":{},\"waker_load\":{},\"jiffies\":[{},{}]}}",
        task_h_load(p, v(0, "prev") as usize, v(0, "pl"), true),
        task_h_load(p, this, v(this, "sl"), true),
        v(0, "jf"),
        p.first().and_then(|m| m.get("jr")).copied().unwrap_or(-1),
    )
}

/// `body` with the integer field `"key":N` set to `val`.
fn set_int(body: &str, key: &str, val: i64) -> String {
    let pat = format!("\"{key}\":");
    let Some(i) = body.find(&pat) else {
        return body.to_string();
    };
    let start = i + pat.len();
    let end = body[start..]
        .find(|ch: char| !(ch.is_ascii_digit() || ch == '-'))
        .map_or(body.len(), |j| start + j);
    format!("{}{val}{}", &body[..start], &body[end..])
}

/// A wakee forked on a random CPU (its `recent_used_cpu`), moved to `prev`
/// and blocked; the controller, pinned to `this`, wakes it through a pipe
/// (sync) or a futex (not sync). With `flips` (waker, wakee) the controller
/// and the wakee first wake that many helpers each (`helpers`, the
/// wake-storm profile's), so both carry real `wakee_flips`.
fn wakeup(
    rng: &mut Lcg,
    nr: usize,
    this: usize,
    allowed: &[usize],
    sync: bool,
    flips: (usize, usize),
    helpers: &[i32],
) -> Result<Record, &'static str> {
    let mut allowed = allowed.to_vec();
    let prev = if allowed.is_empty() {
        rng.below(nr)
    } else {
        allowed[rng.below(allowed.len())]
    };
    if allowed.is_empty() {
        allowed.push(prev);
    }
    let forked_on = rng.below(nr);
    pin(0, &[forked_on]);
    let mut fds = [0i32; 2];
    unsafe { libc::pipe(fds.as_mut_ptr()) };
    let futex = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS,
            -1,
            0,
        ) as *mut u32
    };
    let child = unsafe { libc::fork() };
    if child == 0 {
        pin(0, &[prev]);
        Load::wake_helpers(helpers, flips.1);
        pin(0, &allowed);
        if sync {
            let mut b = [0u8; 1];
            unsafe { libc::read(fds[0], b.as_mut_ptr().cast(), 1) };
        } else {
            while unsafe { std::ptr::read_volatile(futex) } == 0 {
                unsafe {
                    libc::syscall(libc::SYS_futex, futex, libc::FUTEX_WAIT, 0, 0, 0, 0);
                }
            }
        }
        unsafe { libc::_exit(0) };
    }
    pin(0, &[this]);
    std::thread::sleep(Duration::from_millis(40));
    Load::wake_helpers(helpers, flips.0);
    if flips.0 > 0 {
        // The helpers run and block again before the state is read.
        std::thread::sleep(Duration::from_millis(5));
    }
    let ok = getcpu() == this && task_cpu(child) == Some(prev);
    let t = task_avgs(child);
    let me = task_avgs(unsafe { libc::getpid() });
    clear_trace();
    mark_state_read();
    let rqs = read_rqs_unless(nr, allowed.len() > 1);
    let cpus = cpus_json(&rqs);
    if sync {
        unsafe { libc::write(fds[1], b"x".as_ptr().cast(), 1) };
    } else {
        unsafe {
            std::ptr::write_volatile(futex, 1);
            libc::syscall(libc::SYS_futex, futex, libc::FUTEX_WAKE, 1, 0, 0, 0);
        }
    }
    unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
    let (got, stale, probe) = traced_target("sched_wakeup", child, WF_TTWU);
    unsafe {
        libc::close(fds[0]);
        libc::close(fds[1]);
        libc::munmap(futex.cast(), 4096);
    }
    if !ok {
        return Err("wakee_or_waker_not_where_placed");
    }
    let cpu = got.ok_or("no_wakeup_in_trace")?;
    let g = |m: &BTreeMap<String, i64>, k: &str| m.get(k).copied().unwrap_or(0);
    let body = format!(
        "\"cpus\":{cpus},\"task\":{{\"prev_cpu\":{prev},\"recent_used_cpu\":{forked_on},\"cpus_allowed\":\"{}\",\"util_avg\":{},\"util_est\":{},\"runnable_avg\":{},\"load_avg\":{}}},\"request\":{{\"kind\":\"wakeup\",\"this_cpu\":{this},\"sync\":{sync},\"waker_load\":{},\"waker_last_wakee_is_task\":false}}",
        cpulist_str(&allowed),
        g(&t, "se.avg.util_avg"),
        g(&t, "se.avg.util_est"),
        g(&t, "se.avg.runnable_avg"),
        h_load(g(&t, "se.avg.load_avg"), rqs[prev].load_avg),
        h_load(g(&me, "se.avg.load_avg"), rqs[this].load_avg),
    );
    Ok((body, cpu, stale, probe))
}

/// The CPU a task last ran on (field 39 of /proc/PID/stat).
fn task_cpu(pid: i32) -> Option<usize> {
    let s = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let after = &s[s.rfind(')')? + 2..];
    after.split_whitespace().nth(36)?.parse().ok()
}

/// The controller, running on `this` with the mask `allowed`, forks.
fn fork(nr: usize, this: usize, allowed: &[usize]) -> Result<Record, &'static str> {
    pin(0, &[this]);
    std::thread::sleep(Duration::from_millis(5));
    pin(0, allowed);
    clear_trace();
    mark_state_read();
    let rqs = read_rqs_unless(nr, allowed.len() > 1);
    let cpus = cpus_json(&rqs);
    if getcpu() != this {
        return Err("parent_not_on_this_cpu");
    }
    let child = unsafe { libc::fork() };
    if child == 0 {
        unsafe { libc::_exit(0) };
    }
    let still = getcpu() == this;
    unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
    let (cpu, stale, probe) = traced_target("sched_wakeup_new", child, WF_FORK);
    let cpu = cpu.ok_or("no_wakeup_new_in_trace")?;
    if !still {
        return Err("parent_moved_during_fork");
    }
    let body = format!(
        "\"cpus\":{cpus},\"task\":{{\"cpus_allowed\":\"{}\"}},\"request\":{{\"kind\":\"fork\",\"this_cpu\":{this}}}",
        cpulist_str(allowed),
    );
    Ok((body, cpu, stale, probe))
}

/// A child running on `this` with the mask `allowed` records the state and
/// execs this program, which reports where `sched_exec()` put it.
fn exec(nr: usize, this: usize, allowed: &[usize]) -> Result<Record, &'static str> {
    let mut res = [0i32; 2];
    let mut rec = [0i32; 2];
    unsafe {
        libc::pipe(res.as_mut_ptr());
        libc::pipe(rec.as_mut_ptr());
    }
    clear_trace();
    let child = unsafe { libc::fork() };
    if child == 0 {
        pin(0, &[this]);
        // Run a little so the task has a PELT history of its own.
        let end = std::time::Instant::now() + Duration::from_millis(20);
        while std::time::Instant::now() < end {}
        pin(0, allowed);
        let me = task_avgs(unsafe { libc::getpid() });
        drain_trace(false);
        mark_state_read();
        // sched_exec() calls the class callback whatever the affinity.
        let rqs = read_rqs_unless(nr, true);
        let here = getcpu();
        let g = |k: &str| me.get(k).copied().unwrap_or(0);
        let body = format!(
            "{here}\n\"cpus\":{},\"task\":{{\"cpus_allowed\":\"{}\",\"util_avg\":{},\"util_est\":{},\"runnable_avg\":{},\"load_avg\":{}}},\"request\":{{\"kind\":\"exec\",\"this_cpu\":{this}}}",
            cpus_json(&rqs),
            cpulist_str(allowed),
            g("se.avg.util_avg"),
            g("se.avg.util_est"),
            g("se.avg.runnable_avg"),
            h_load(g("se.avg.load_avg"), rqs[this].load_avg),
        );
        unsafe {
            libc::write(rec[1], body.as_ptr().cast(), body.len());
            libc::close(rec[1]);
        }
        let prog = cs("/init");
        let a1 = cs("exec-report");
        let a2 = cs(&res[1].to_string());
        let argv = [prog.as_ptr(), a1.as_ptr(), a2.as_ptr(), std::ptr::null()];
        let envp = [std::ptr::null()];
        unsafe {
            libc::execve(prog.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(1);
        }
    }
    unsafe {
        libc::close(res[1]);
        libc::close(rec[1]);
    }
    // Wait for the exec'ed image to finish before reading the pipes: a
    // reader blocked on them would be woken by the child's write and could
    // land on a CPU the decision is about to look at.
    unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
    let t = drain_trace(true);
    let pat = format!(" pid={child} ");
    let is_answer = |l: &str| l.contains(" sched_process_exec: ") && l.contains(&pat);
    let stale = stale_cpus(&t, is_answer);
    let probe = probe::decision(&t, nr, child, WF_EXEC, is_answer);
    let mut body = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let k = unsafe { libc::read(rec[0], buf.as_mut_ptr().cast(), buf.len()) };
        if k <= 0 {
            break;
        }
        body.extend_from_slice(&buf[..k as usize]);
    }
    let mut b = [0u8; 4];
    let k = unsafe { libc::read(res[0], b.as_mut_ptr().cast(), 4) };
    unsafe {
        libc::close(res[0]);
        libc::close(rec[0]);
    }
    let body = String::from_utf8(body).map_err(|_| "exec_record_unreadable")?;
    let (here, body) = body.split_once('\n').ok_or("exec_record_unreadable")?;
    if k != 4 {
        return Err("exec_image_gave_no_cpu");
    }
    if here.parse::<usize>().ok() != Some(this) {
        return Err("execing_task_not_on_this_cpu");
    }
    Ok((
        body.to_string(),
        u32::from_le_bytes(b) as usize,
        stale,
        probe,
    ))
}
