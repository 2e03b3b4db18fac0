//! fairplace-agent-cost: the real agent's CPU time per report against the
//! number of threads on the machine, by signal source and interval.
//!
//! For each thread count a child process parks that many threads (sleeping,
//! as most threads of a node are); a real `fairplace-server` takes the
//! reports of a real `fairplace-agent` (default flags but for the interval
//! and source). The agent's CPU time is the sum of its threads'
//! `schedstat` run time (ns) between a warm-up and the end of the window;
//! the reports are the server's `fairplace_agent_reports_applied_total`
//! over the same window. This file measures; it asserts nothing.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use clap::Parser;

#[derive(Parser)]
#[command(
    name = "fairplace-agent-cost",
    about = "agent CPU time per report vs threads on the machine"
)]
struct Args {
    /// Thread counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,3000,10000")]
    threads: Vec<usize>,
    /// Report intervals (ms).
    #[arg(long, value_delimiter = ',', default_value = "1000,100")]
    intervals_ms: Vec<u64>,
    /// Signal sources (the agent's --signal-source values). A source the
    /// agent cannot open here (bpf not built in, no privilege) is left out
    /// with a line saying why.
    #[arg(long, value_delimiter = ',', default_value = "bpf,sched-debug,procfs")]
    sources: Vec<String>,
    /// procfs is measured at intervals of at least this many ms only (it
    /// reads every thread each report).
    #[arg(long, default_value_t = 1000)]
    procfs_min_interval_ms: u64,
    /// Measured window per point (s), after a 3 s warm-up.
    #[arg(long, default_value_t = 10)]
    window_s: u64,
    /// Internal: park this many threads and wait for stdin to close.
    #[arg(long, hide = true)]
    sleepers: Option<usize>,
}

/// The release (or debug) binaries next to this one.
fn sibling(name: &str) -> PathBuf {
    let me = std::env::current_exe().expect("current_exe");
    me.parent().expect("bin dir").join(name)
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// The `--sleepers` child: N parked threads until stdin closes.
fn park_threads(n: usize) {
    let mut handles = Vec::with_capacity(n);
    for _ in 0..n {
        let h = std::thread::Builder::new()
            .stack_size(64 << 10)
            .spawn(|| {
                loop {
                    std::thread::park();
                }
            })
            .expect("spawn a sleeper");
        handles.push(h);
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    std::process::exit(0);
}

fn sleepers(n: usize) -> Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args(["--sleepers", &n.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("sleepers");
    let mut buf = [0u8; 6];
    c.stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut buf)
        .expect("sleepers ready");
    c
}

/// Sum of a process's threads' on-CPU time, ns (`schedstat` field 1).
fn cpu_ns(pid: u32) -> u64 {
    let dir = Path::new("/proc").join(pid.to_string()).join("task");
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| {
                let s = std::fs::read_to_string(e.ok()?.path().join("schedstat")).ok()?;
                s.split_whitespace().next()?.parse::<u64>().ok()
            })
            .sum()
        })
        .unwrap_or(0)
}

/// The sum of a counter family's samples on a /metrics page.
fn counter(metrics: &str, family: &str) -> u64 {
    let Ok(mut s) = TcpStream::connect(metrics) else {
        return 0;
    };
    let _ = write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\nConnection: close\r\n\r\n"
    );
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .filter(|l| l.starts_with(family) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The server's applied reports.
fn reports(metrics: &str) -> u64 {
    counter(metrics, "fairplace_agent_reports_applied_total{")
}

/// The node's state age (s) as the server's gauge says now.
fn state_age(metrics: &str) -> Option<f64> {
    let mut s = TcpStream::connect(metrics).ok()?;
    write!(s, "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.lines()
        .find(|l| l.starts_with("fairplace_node_state_age_seconds{node=\"cost\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// Polls the state age every 20 ms for `window`; its 99th percentile.
fn age_p99(metrics: &str, window: Duration) -> f64 {
    let t0 = Instant::now();
    let mut ages = Vec::new();
    while t0.elapsed() < window {
        ages.extend(state_age(metrics));
        std::thread::sleep(Duration::from_millis(20));
    }
    ages.sort_by(|a, b| a.partial_cmp(b).unwrap());
    ages.get(ages.len() * 99 / 100).copied().unwrap_or(f64::NAN)
}

/// Whether the agent opens `source` here: the error it prints if not.
fn opens(source: &str) -> Result<(), String> {
    let out = Command::new(sibling("fairplace-agent"))
        .args(["--signal-source", source, "--print-once"])
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(err.lines().last().unwrap_or("failed").trim().to_string())
}

/// One point: the agent's CPU ms per report, its share of one core, the
/// reports and the share of them that read sched/debug.
fn measure(
    grpc: &str,
    metrics: &str,
    source: &str,
    interval_ms: u64,
    window: Duration,
) -> (f64, f64, u64, f64, f64) {
    let warm = Duration::from_secs(3);
    let own = format!("127.0.0.1:{}", free_port());
    let mut agent = Command::new(sibling("fairplace-agent"))
        .args([
            "--server",
            grpc,
            "--node-id",
            "cost",
            "--interval-ms",
            &interval_ms.to_string(),
            "--signal-source",
            source,
            "--metrics-addr",
            &own,
        ])
        .stderr(Stdio::null())
        .spawn()
        .expect("fairplace-agent");
    std::thread::sleep(warm);
    let skipped = || counter(&own, "fairplace_agent_reads_skipped_total");
    let (c0, r0, s0, t0) = (
        cpu_ns(agent.id()),
        reports(metrics),
        skipped(),
        Instant::now(),
    );
    let p99 = age_p99(metrics, window);
    let (c1, r1, s1, t1) = (
        cpu_ns(agent.id()),
        reports(metrics),
        skipped(),
        Instant::now(),
    );
    let _ = agent.kill();
    let _ = agent.wait();
    let cpu = (c1 - c0) as f64;
    let n = r1.saturating_sub(r0).max(1);
    let read = 100.0 * (1.0 - s1.saturating_sub(s0) as f64 / n as f64).max(0.0);
    (
        cpu / 1e6 / n as f64,
        100.0 * cpu / (t1 - t0).as_nanos() as f64,
        n,
        read,
        p99 * 1e3,
    )
}

fn main() {
    let a = Args::parse();
    if let Some(n) = a.sleepers {
        park_threads(n);
    }
    let (gp, mp) = (free_port(), free_port());
    let (grpc, metrics) = (format!("127.0.0.1:{gp}"), format!("127.0.0.1:{mp}"));
    let mut server = Command::new(sibling("fairplace-server"))
        .args(["serve", "--grpc-addr", &grpc, "--metrics-addr", &metrics])
        .stderr(Stdio::null())
        .spawn()
        .expect("fairplace-server");
    std::thread::sleep(Duration::from_millis(500));
    let sources: Vec<&String> = a
        .sources
        .iter()
        .filter(|s| match opens(s) {
            Ok(()) => true,
            Err(why) => {
                eprintln!("left out: --signal-source {s}: {why}");
                false
            }
        })
        .collect();
    println!(
        "| threads on the machine | source | interval | agent CPU per report | agent CPU (% of one core) | reports | reports that read the kernel | server's state age p99 |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|");
    for &n in &a.threads {
        let mut kids = sleepers(n);
        let total = std::fs::read_dir("/proc")
            .map(|d| {
                d.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
                    .filter_map(|p| std::fs::read_dir(format!("/proc/{p}/task")).ok())
                    .map(|t| t.count())
                    .sum::<usize>()
            })
            .unwrap_or(0);
        for src in sources.iter().copied() {
            for &iv in &a.intervals_ms {
                if src == "procfs" && iv < a.procfs_min_interval_ms {
                    continue;
                }
                let (ms, pct, k, read, p99) =
                    measure(&grpc, &metrics, src, iv, Duration::from_secs(a.window_s));
                println!(
                    "| {n} parked (+{} others) | {src} | {iv} ms | {ms:.3} ms | {pct:.2} % | {k} | {read:.0} % | {p99:.0} ms |",
                    total.saturating_sub(n)
                );
            }
        }
        drop(kids.stdin.take());
        let _ = kids.wait();
    }
    let _ = server.kill();
    let _ = server.wait();
}
