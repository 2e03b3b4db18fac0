//! Soak: the real server and the real agent with its default flags on a
//! busy machine. For over 60 s the test runs a few hundred processes and
//! threads: fork/exit churn (short-lived processes and threads), processes
//! whose threads wake every few milliseconds, long-lived sleepers and two
//! spinners. Throughout, the agent's updates must all be applied, its node
//! fresh, the state age's p99 under two report intervals, and the server's
//! and agent's resident memory flat.
//!
//! Everything the test starts is killed and reaped when it ends, failed or
//! not (a guard's drop); the worker processes also exit by themselves when
//! the test process goes away (their stdin closes) or after a deadline.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fairplace_client::Client;
use fairplace_e2e::{Agent, Server, http_get, rss_kib};

/// The agent's default --interval-ms.
const INTERVAL: Duration = Duration::from_millis(1000);
const WARM_UP: Duration = Duration::from_secs(8);
const MEASURED: Duration = Duration::from_secs(55);
const ROLE: &str = "FAIRPLACE_SOAK_ROLE";

/// Processes of the test binary run in a worker role (see `soak_worker`).
const WAKERS: usize = 12;
const THREADS_PER_WAKER: usize = 4;
/// Long-lived sleeping processes.
const SLEEPERS: usize = 150;
/// Threads starting short-lived processes, and ones starting short-lived
/// threads, in a loop.
const FORKERS: usize = 3;
const THREAD_CHURNERS: usize = 2;
const SPINNERS: usize = 2;

/// Not a test of its own: the entry point of the worker processes the soak
/// starts (this binary again, with `FAIRPLACE_SOAK_ROLE` set). Without the
/// variable it does nothing.
#[test]
fn soak_worker() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    // Exit when the parent goes away (stdin closes) or after a deadline.
    std::thread::spawn(|| {
        let mut buf = [0u8; 64];
        let mut stdin = std::io::stdin();
        while matches!(stdin.read(&mut buf), Ok(n) if n > 0) {}
        std::process::exit(0);
    });
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(300));
        std::process::exit(0);
    });
    assert_eq!(role, "waker");
    let handles: Vec<_> = (0..THREADS_PER_WAKER)
        .map(|t| {
            std::thread::spawn(move || {
                let mut x = t as u64 + 1;
                loop {
                    // A little work, then sleep 2 to 5 ms.
                    for _ in 0..20_000 {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    }
                    std::hint::black_box(x);
                    std::thread::sleep(Duration::from_millis(2 + (x >> 33) % 4));
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.join();
    }
}

/// The load: children and threads, all stopped and reaped on drop.
struct Load {
    stop: Arc<AtomicBool>,
    children: Vec<Child>,
    threads: Vec<JoinHandle<()>>,
    forks: Arc<AtomicU64>,
}

impl Load {
    fn start() -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let forks = Arc::new(AtomicU64::new(0));
        let mut load = Load {
            stop: Arc::clone(&stop),
            children: Vec::new(),
            threads: Vec::new(),
            forks: Arc::clone(&forks),
        };
        // The running image itself, even if a build meanwhile replaced the
        // file (the binaries' build in `bin()` can relink this test when
        // it was built alone): /proc/self/exe opens the running inode.
        let me = std::path::PathBuf::from("/proc/self/exe");
        for _ in 0..WAKERS {
            load.children.push(
                Command::new(&me)
                    .args(["--exact", "soak_worker", "--nocapture", "--test-threads=1"])
                    .env(ROLE, "waker")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start a waker"),
            );
        }
        for _ in 0..SLEEPERS {
            // Blocks on its stdin until the test ends (or goes away).
            load.children.push(
                Command::new("cat")
                    .stdin(Stdio::piped())
                    .stdout(Stdio::null())
                    .spawn()
                    .expect("start a sleeper"),
            );
        }
        for _ in 0..FORKERS {
            let (stop, forks) = (Arc::clone(&stop), Arc::clone(&forks));
            load.threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if Command::new("true").status().is_ok() {
                        forks.fetch_add(1, Ordering::Relaxed);
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
        for _ in 0..THREAD_CHURNERS {
            let stop = Arc::clone(&stop);
            load.threads.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let batch: Vec<_> = (0..8)
                        .map(|i| {
                            std::thread::spawn(move || {
                                std::thread::sleep(Duration::from_millis(1 + i % 3));
                            })
                        })
                        .collect();
                    for t in batch {
                        let _ = t.join();
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }));
        }
        for _ in 0..SPINNERS {
            let stop = Arc::clone(&stop);
            load.threads.push(std::thread::spawn(move || {
                let mut x = 1u64;
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..100_000 {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
                    }
                    std::hint::black_box(x);
                }
            }));
        }
        load
    }

    /// Threads of the machine (every /proc/PID/task entry).
    fn machine_threads() -> usize {
        std::fs::read_dir("/proc")
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        e.file_name()
                            .to_string_lossy()
                            .bytes()
                            .all(|b| b.is_ascii_digit())
                    })
                    .map(|e| std::fs::read_dir(e.path().join("task")).map_or(0, |t| t.count()))
                    .sum()
            })
            .unwrap_or(0)
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for c in &mut self.children {
            let _ = c.kill();
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The sum of a counter's series on the server's /metrics.
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|r| r.starts_with('{') || r.starts_with(' '))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

#[test]
fn the_real_agent_keeps_a_busy_machine_fresh_without_rejections() {
    let began = Instant::now();
    let server = Server::start(&[]);
    let agent = Agent::start(&server.grpc, &[]);
    let metrics_url = server.metrics.clone();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let c = rt.block_on(Client::connect(&server.grpc)).unwrap();
    let list = || rt.block_on(c.list_nodes()).unwrap_or_default();
    // The node appears with its first report.
    let t0 = Instant::now();
    let id = loop {
        if let Some(n) = list().into_iter().find(|n| n.state_version > 1) {
            break n.id;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the agent never reported"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let setup = began.elapsed();
    let load = Load::start();
    let mut ages = Vec::new();
    let sample = |ages: &mut Vec<f64>, at: Duration| {
        let nodes = list();
        let n = nodes
            .iter()
            .find(|n| n.id == id)
            .unwrap_or_else(|| panic!("node {id} listed at {at:?}: {nodes:?}"));
        assert!(
            n.fresh && n.connected,
            "node fresh and connected at {at:?}: {n:?}"
        );
        ages.push(n.age_seconds);
    };
    let start = Instant::now();
    while start.elapsed() < WARM_UP {
        sample(&mut ages, start.elapsed());
        std::thread::sleep(Duration::from_millis(250));
    }
    let threads = Load::machine_threads();
    let (server_rss0, agent_rss0) = (rss_kib(server.child.id()), rss_kib(agent.child.id()));
    let m0 = http_get(&metrics_url);
    let applied0 = counter(&m0, "fairplace_agent_reports_applied_total");
    while start.elapsed() < WARM_UP + MEASURED {
        sample(&mut ages, start.elapsed());
        std::thread::sleep(Duration::from_millis(250));
    }
    let (server_rss1, agent_rss1) = (rss_kib(server.child.id()), rss_kib(agent.child.id()));
    let m1 = http_get(&metrics_url);
    let forks = load.forks.load(Ordering::Relaxed);
    let t_drop = Instant::now();
    drop(load);
    eprintln!("soak: load stopped and reaped in {:?}", t_drop.elapsed());
    let rejected = counter(&m1, "fairplace_agent_reports_rejected_total") + 0.0;
    let applied = counter(&m1, "fairplace_agent_reports_applied_total") - applied0;
    let tasks = counter(&m1, "fairplace_agent_tasks_reported_total");
    ages.sort_by(f64::total_cmp);
    let (p50, p99, max) = (
        percentile(&ages, 0.5),
        percentile(&ages, 0.99),
        ages[ages.len() - 1],
    );
    eprintln!(
        "soak: setup {setup:?}, load {:.0} s, {threads} threads on the machine, {forks} short-lived processes; \
         {applied} updates applied while measured, {rejected} rejected, {tasks} tasks reported; \
         state age p50 {p50:.3} s, p99 {p99:.3} s, max {max:.3} s over {} samples; \
         RSS server {server_rss0} -> {server_rss1} KiB, agent {agent_rss0} -> {agent_rss1} KiB",
        start.elapsed().as_secs_f64(),
        ages.len()
    );
    assert!(
        threads >= 200,
        "the load runs a few hundred threads: {threads}"
    );
    assert_eq!(rejected, 0.0, "rejected updates:\n{m1}");
    // One update per interval over the measured time, give or take.
    let expected = MEASURED.as_secs_f64() / INTERVAL.as_secs_f64();
    assert!(
        applied >= expected * 0.9,
        "{applied} updates applied in {MEASURED:?}"
    );
    assert!(tasks > 0.0, "task lists are reported");
    assert!(
        p99 < 2.0 * INTERVAL.as_secs_f64(),
        "state age p99 {p99} s, max {max} s"
    );
    // Flat: the allocator keeps some slack, and the first minutes of a
    // process still fill caches (histograms, the agent's per-thread
    // runtime map of a changing thread set), so allow 25% or 8 MiB
    // (whichever is larger) over the RSS after warm-up; a leak per update
    // or per process seen outgrows that within the minute.
    for (who, before, after) in [
        ("server", server_rss0, server_rss1),
        ("agent", agent_rss0, agent_rss1),
    ] {
        let margin = (before / 4).max(8 * 1024);
        assert!(
            after <= before + margin,
            "{who} RSS grew from {before} to {after} KiB"
        );
    }
}
