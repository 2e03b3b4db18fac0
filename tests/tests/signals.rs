//! Fidelity of the agent's exact signal sources on the real machine: CPUs
//! kept busy in known ways, what the agent reports (through the real
//! server's GetNode) against what the kernel's sched/debug says at the same
//! moment. The sched-debug source always; the BPF source when the tests are
//! built with `--features fairplace-e2e/bpf` (it reports the same
//! `clock_task`, read by its program from the same runqueue).
//!
//! The workload (CPU 0 and CPU 1; the test needs two CPUs):
//! - CPU 1: two nice-0 spinners sharing it (nr_running 2, util ~1024,
//!   runnable ~2048);
//! - CPU 0: a SCHED_IDLE spinner (h_nr_idle 1) and a 30 % duty-cycle task
//!   (30 ms busy, 70 ms asleep), so CPU 0's counts change ten times a
//!   second and its averages are not those of a plain spinner.
//!
//! "The same moment", by the kernel's own clock: a thread of the test reads
//! the file every 3 ms and keeps what it read by each CPU's `clock_task`.
//! The agent reports that same `clock_task` with each CPU's task list
//! (`CpuTasks.clock_task`, read from the same file). Every enqueue, dequeue
//! and tick of a runqueue moves its clock, so the test's two reads whose
//! clocks bracket the agent's (at most a few milliseconds apart) hold the
//! kernel's state just before and just after the agent's read: a reported
//! count must equal one of theirs, and a reported average must lie between
//! theirs (PELT moves monotonically over a few milliseconds of one phase;
//! its distance outside that range is the error). When a read of the test
//! has the agent's very clock, that read is the kernel's state itself.
//!
//! Both the agent's read and the test's see every runnable thread of the
//! machine, and each reader is itself running while it reads (an artifact
//! of looking), so the test process is taken out of both sides: the agent
//! leaves its own threads out of what it sends; the test takes the agent's
//! threads and its own out of the kernel's counts, and out of the agent's
//! count the threads of the test the agent listed runnable on that CPU
//! (its reading thread, for one, waiting for a CPU when the agent read).
//!
//! A sample's error is the worst relative error over both CPUs of
//! load_avg, runnable_avg and util_avg, relative to the kernel's value with
//! a floor of 64 (1/16 of a CPU: below it a relative error measures noise).
//! The bar: the median over the samples under 15 %, and
//! nr_running and h_nr_idle matching in most samples.

use std::collections::HashSet;
use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use fairplace_agent::sched_debug;
use fairplace_client::Client;
use fairplace_e2e::{Agent, Server, pb};

/// Children killed when the test ends, however it ends.
struct Workload(Vec<Child>);

impl Drop for Workload {
    fn drop(&mut self) {
        for c in &mut self.0 {
            // Each leads its own process group: the group signal ends
            // its loop and the spinner the loop started.
            fairplace_e2e::send_signal_to_group(c.id(), libc::SIGKILL);
            let _ = c.wait();
        }
    }
}

fn spawn(cmd: &[&str]) -> Child {
    use std::os::unix::process::CommandExt;
    Command::new(cmd[0])
        .args(&cmd[1..])
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

fn workload() -> Workload {
    let spin = "while :; do :; done";
    let duty = "while :; do timeout 0.03 sh -c 'while :; do :; done'; sleep 0.07; done";
    Workload(vec![
        spawn(&["taskset", "-c", "1", "sh", "-c", spin]),
        spawn(&["taskset", "-c", "1", "sh", "-c", spin]),
        spawn(&[
            "chrt", "--idle", "0", "taskset", "-c", "0", "sh", "-c", spin,
        ]),
        spawn(&["taskset", "-c", "0", "sh", "-c", duty]),
    ])
}

/// sched/debug readable here, mounting debugfs read-only if need be (as
/// root); the reason if not.
fn readable() -> Result<sched_debug::Reader, String> {
    let path = Path::new(sched_debug::SCHED_DEBUG);
    sched_debug::ensure_mounted(path)?;
    sched_debug::Reader::open(path).map_err(|e| e.to_string())
}

/// The thread ids of process `pid`.
fn threads_of(pid: u32) -> HashSet<u32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// The kernel's view of one CPU, the agent's and the test's runnable
/// threads taken out.
#[derive(Clone, Copy, Debug)]
struct Kernel {
    clock_task: i64,
    nr_running: u32,
    h_nr_idle: u32,
    load: i64,
    runnable: i64,
    util: i64,
}

fn kernel_now(r: &mut sched_debug::Reader, readers: &HashSet<u32>) -> Vec<Kernel> {
    let text = r.read().expect("read sched/debug");
    let cpus = sched_debug::parse(text).expect("parse sched/debug");
    cpus.iter()
        .map(|c| {
            let theirs = c
                .tasks
                .iter()
                .filter(|t| t.runnable() && readers.contains(&t.tid))
                .count() as u32;
            let cfs = c.cfs.expect("a root cfs_rq");
            Kernel {
                clock_task: c.clock_task_ns,
                nr_running: c.nr_running.saturating_sub(theirs),
                h_nr_idle: cfs.h_nr_idle,
                load: cfs.load_avg,
                runnable: cfs.runnable_avg,
                util: cfs.util_avg,
            }
        })
        .collect()
}

/// Reads of the file, every 3 ms, the last two seconds' worth.
type History = std::sync::Arc<std::sync::Mutex<std::collections::VecDeque<Vec<Kernel>>>>;

fn sample_kernel(
    mut r: sched_debug::Reader,
    agent_pid: u32,
    history: History,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    let mut reads = 0u32;
    let mut readers = HashSet::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        // The agent's and the test's threads are their runtimes'; a new
        // one is rare.
        if reads.is_multiple_of(100) {
            readers = threads_of(agent_pid);
            readers.extend(threads_of(std::process::id()));
        }
        reads += 1;
        let k = kernel_now(&mut r, &readers);
        let mut h = history.lock().unwrap();
        if h.len() >= 700 {
            h.pop_front();
        }
        h.push_back(k);
        drop(h);
        std::thread::sleep(Duration::from_millis(3));
    }
}

/// The test's reads of `cpu` just before and just after the kernel clock
/// `clock_task` (the same read twice when its clock is that very clock).
fn bracket(history: &History, cpu: usize, clock_task: i64) -> Option<(Kernel, Kernel)> {
    let h = history.lock().unwrap();
    let reads = || h.iter().filter_map(|k| k.get(cpu).copied());
    let before = reads()
        .filter(|k| k.clock_task <= clock_task)
        .max_by_key(|k| k.clock_task)?;
    let after = reads()
        .filter(|k| k.clock_task >= clock_task)
        .min_by_key(|k| k.clock_task)?;
    Some((before, after))
}

/// How far `agent` lies outside the kernel's values before and after,
/// relative to the nearer one (floor 64).
fn outside(agent: i64, before: i64, after: i64) -> f64 {
    let (lo, hi) = (before.min(after), before.max(after));
    let near = agent.clamp(lo, hi);
    (agent - near).abs() as f64 / near.max(64) as f64
}

/// One report of the agent against the kernel's reads around it: the worst
/// relative error of the averages over both CPUs, and whether every count
/// matched.
fn compare(n: &pb::GetNodeResponse, history: &History) -> (f64, bool) {
    let mut worst = 0.0f64;
    let mut ok = true;
    for cpu in 0..2 {
        // Both CPUs are busy: both have a task list, with the clock_task
        // the agent read.
        let Some(clock) = n
            .tasks
            .iter()
            .find(|l| l.cpu == cpu as u32)
            .map(|l| l.clock_task)
        else {
            return (f64::INFINITY, false);
        };
        let Some((b, a)) = bracket(history, cpu, clock) else {
            println!("cpu {cpu}: no read of the test brackets clock_task {clock}");
            return (f64::INFINITY, false);
        };
        let r = &n.cpus[cpu];
        for (x, lo, hi) in [
            (r.load_avg, b.load, a.load),
            (r.runnable_avg, b.runnable, a.runnable),
            (r.util_avg, b.util, a.util),
        ] {
            worst = worst.max(outside(x, lo, hi));
        }
        let counts = |k: &Kernel| (k.nr_running, k.h_nr_idle);
        let test_threads = n
            .tasks
            .iter()
            .filter(|l| l.cpu == cpu as u32)
            .flat_map(|l| &l.tasks)
            .filter(|t| t.group == u64::from(std::process::id()))
            .count() as u32;
        let agent = (r.nr_running.saturating_sub(test_threads), r.h_nr_idle);
        if agent != counts(&b) && agent != counts(&a) {
            println!(
                "cpu {cpu}: agent (nr_running, h_nr_idle) {agent:?}, kernel {:?} at {} and {:?} at {} (agent {clock})",
                counts(&b),
                b.clock_task,
                counts(&a),
                a.clock_task
            );
            ok = false;
        }
    }
    (worst, ok)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

#[test]
fn the_agent_reports_the_kernels_own_signals() {
    fidelity("sched-debug", pb::SignalSource::SchedDebug);
}

#[cfg(feature = "bpf")]
#[test]
fn the_bpf_source_reports_the_kernels_own_signals() {
    // Skipped, saying why, where the program cannot load (no privilege, no
    // BTF): the agent would refuse --signal-source bpf.
    if let Err(why) = fairplace_agent::bpf::Program::load(1) {
        println!("skipped: the BPF program does not load here ({why})");
        return;
    }
    fidelity("bpf", pb::SignalSource::Bpf);
}

/// One comparison at a time: each keeps both CPUs busy in its own known
/// way, and two at once would each see the other's spinners.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The comparison, with the agent reading `source`, which it must report
/// as `expected`.
fn fidelity(source: &str, expected: pb::SignalSource) {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let reader = match readable() {
        Ok(r) => r,
        Err(why) => {
            println!("skipped: sched/debug is not readable here ({why})");
            return;
        }
    };
    let ncpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ncpus < 2 {
        println!("skipped: the workload needs two CPUs, this machine has {ncpus}");
        return;
    }
    // The server first: starting it builds the binaries when they are
    // not built, which the spinners would slow down.
    let server = Server::start(&[]);
    let agent = Agent::start(
        &server.grpc,
        &[
            "--node-id",
            "fidelity",
            "--interval-ms",
            "200",
            "--signal-source",
            source,
        ],
    );
    let work = workload();
    let history: History = Default::default();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (h, s) = (history.clone(), stop.clone());
        let pid = agent.child.id();
        std::thread::spawn(move || sample_kernel(reader, pid, h, s))
    };
    // PELT needs ~300 ms to settle on a new load.
    std::thread::sleep(Duration::from_secs(2));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (mut errors, mut counts_ok, spinners_listed) = rt.block_on(async {
        let c = Client::connect(&server.grpc).await.unwrap();
        let mut errors = Vec::new();
        let mut counts_ok = Vec::new();
        let mut spinners_listed = false;
        let mut seq = 0;
        while errors.len() < 25 {
            let n = c.get_node("fidelity").await.expect("the agent's node");
            if n.last_seq == seq {
                tokio::time::sleep(Duration::from_millis(25)).await;
                continue;
            }
            seq = n.last_seq;
            // Let the sampler read past the agent's read.
            tokio::time::sleep(Duration::from_millis(10)).await;
            let s = n.summary.as_ref().unwrap();
            assert_eq!(s.signal_source, expected as i32);
            assert!(s.exact_signals);
            let (worst, ok) = compare(&n, &history);
            errors.push(worst);
            counts_ok.push(if ok { 0.0 } else { 1.0 });
            // CPU 1's task list is the two spinners, one of them running.
            let spinning: Vec<&pb::RunnableTask> = n
                .tasks
                .iter()
                .filter(|l| l.cpu == 1)
                .flat_map(|l| &l.tasks)
                .filter(|t| t.group == work.0[0].id() as u64 || t.group == work.0[1].id() as u64)
                .collect();
            spinners_listed |=
                spinning.len() == 2 && spinning.iter().filter(|t| t.running).count() <= 1;
        }
        (errors, counts_ok, spinners_listed)
    });
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    sampler.join().unwrap();
    let med = median(&mut errors);
    let mismatched = median(&mut counts_ok);
    let matched = counts_ok.iter().filter(|&&x| x == 0.0).count();
    println!(
        "{source}: median worst relative error {:.1} %, counts matched in {matched}/{} samples, errors {errors:?}",
        med * 100.0,
        counts_ok.len()
    );
    assert!(
        med < 0.15,
        "median worst relative error {:.1} % >= 15 %",
        med * 100.0
    );
    assert_eq!(
        mismatched, 0.0,
        "nr_running or h_nr_idle differs in most samples"
    );
    assert!(
        spinners_listed,
        "CPU 1's task list never held both spinners"
    );
    drop(work);
}
