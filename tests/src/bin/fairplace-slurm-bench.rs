//! `fairplace-slurm-bench`: what the SPANK plugin buys and costs a Slurm
//! step, on this machine, with the real Slurm beside the server and agent
//! of the same build.
//!
//! ```text
//! fairplace-slurm-bench [--starts N] [--work N] [--rounds N]
//! ```
//!
//! - A CPU-bound task (`--work` iterations of a shell loop) as a one-task
//!   `--exclusive` step, on a node where a loop pinned outside Slurm keeps
//!   the CPU Slurm binds such a task to busy: its wall time with Slurm's
//!   binding (`--fairplace=off`) and with fairplace's (`--fairplace=kernel`),
//!   alternated, `--rounds` of each.
//! - A step's start: `srun -n1 true`, `--starts` of each policy, alternated;
//!   the time the plugin adds is fairplace's median (and p99) less Slurm's.
//!
//! Last line: `slurm: cpu-bound wall fairplace/slurm R, step start +M ms
//! median, +P ms p99 (N steps each)`.

use std::time::{Duration, Instant};

use fairplace_e2e::slurm::{self, Slurm};
use fairplace_e2e::{Agent, Server};

struct Args {
    starts: usize,
    work: u64,
    rounds: usize,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        starts: 100,
        work: 2_000_000,
        rounds: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |name: &str| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{name} takes a whole number"))
        };
        match flag.as_str() {
            "--starts" => a.starts = num("--starts")? as usize,
            "--work" => a.work = num("--work")?,
            "--rounds" => a.rounds = num("--rounds")? as usize,
            _ => {
                return Err(format!(
                    "unknown argument {flag:?} (--starts, --work, --rounds)"
                ));
            }
        }
    }
    Ok(a)
}

fn main() {
    let args = parse().unwrap_or_else(|e| {
        eprintln!("fairplace-slurm-bench: {e}");
        std::process::exit(2)
    });
    if let Err(why) = slurm::available() {
        eprintln!("fairplace-slurm-bench: {why}");
        std::process::exit(2);
    }
    let server = Server::start(&[]);
    let _agent = Agent::start(&server.grpc, &[]);
    let plugstack = format!(
        "required {} server={}\n",
        slurm::plugin().display(),
        server.grpc
    );
    let s = Slurm::start(&plugstack);
    let (slurms, fairplaces) = cpu_bound(&s, &args);
    let ratio = median(&fairplaces) / median(&slurms);
    println!(
        "cpu-bound step ({} rounds): Slurm's binding median {:.3} s, fairplace's {:.3} s",
        args.rounds,
        median(&slurms),
        median(&fairplaces)
    );
    let (off, on) = starts(&s, args.starts);
    println!(
        "step start (srun -n1 true, {} each): --fairplace=off median {:.1} ms p99 {:.1} ms; kernel median {:.1} ms p99 {:.1} ms",
        args.starts,
        median(&off) * 1e3,
        p99(&off) * 1e3,
        median(&on) * 1e3,
        p99(&on) * 1e3
    );
    println!(
        "slurm: cpu-bound wall fairplace/slurm {ratio:.2}, step start {:+.1} ms median, {:+.1} ms p99 ({} steps each)",
        (median(&on) - median(&off)) * 1e3,
        (p99(&on) - p99(&off)) * 1e3,
        args.starts
    );
}

/// Seconds a command took, and whether it succeeded.
fn timed(s: &Slurm, args: &[&str]) -> f64 {
    let t0 = Instant::now();
    let o = s.run("srun", args);
    let t = t0.elapsed().as_secs_f64();
    assert!(
        o.status.success(),
        "srun {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    t
}

/// The CPU-bound step's wall times: (Slurm's binding, fairplace's).
fn cpu_bound(s: &Slurm, a: &Args) -> (Vec<f64>, Vec<f64>) {
    let cpu = s.own_binding();
    let mut busy = slurm::busy_loop(&cpu);
    // The agent reports every second or so; give the server a sample of it.
    std::thread::sleep(Duration::from_secs(3));
    let work = format!("i=0; while [ $i -lt {} ]; do i=$((i+1)); done", a.work);
    let mut slurms = Vec::new();
    let mut fairplaces = Vec::new();
    for _ in 0..a.rounds {
        for (policy, out) in [
            ("--fairplace=off", &mut slurms),
            ("--fairplace=kernel", &mut fairplaces),
        ] {
            out.push(timed(s, &["-n1", "--exclusive", policy, "sh", "-c", &work]));
        }
    }
    let _ = busy.kill();
    let _ = busy.wait();
    (slurms, fairplaces)
}

/// `srun -n1 true` times: (off, kernel), alternated.
fn starts(s: &Slurm, n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut off = Vec::new();
    let mut on = Vec::new();
    for _ in 0..n {
        off.push(timed(s, &["-n1", "--fairplace=off", "true"]));
        on.push(timed(s, &["-n1", "--fairplace=kernel", "true"]));
    }
    (off, on)
}

fn sorted(v: &[f64]) -> Vec<f64> {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v
}

fn median(v: &[f64]) -> f64 {
    let v = sorted(v);
    v[v.len() / 2]
}

fn p99(v: &[f64]) -> f64 {
    let v = sorted(v);
    v[((v.len() as f64 * 0.99).ceil() as usize).clamp(1, v.len()) - 1]
}
