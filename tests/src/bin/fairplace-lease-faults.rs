//! `fairplace-lease-faults`: the lease fault suite (`fairplace_e2e::faults`)
//! as a command, for long runs and CI's reduced run.
//!
//! ```text
//! fairplace-lease-faults [--seconds N] [--seed S] [--mode replicas|single|both]
//!                        [--clients N] [--nodes N] [--gap-ms LO-HI]
//! ```
//!
//! It prints every fault as it is injected (stderr), each mode's summary,
//! every violation found, and last the suite's line:
//! `lease history: O operations, F faults (K kinds), U unknown outcomes,
//! V violations`. It exits 1 on a violation, or when a fault kind the rig
//! can inject was never injected.
//!
//! It leads a process group of its own, and a SIGINT, SIGTERM or SIGHUP
//! (a `timeout`, say) ends the whole group, etcd and the servers with it,
//! after unmounting the tmpfs it made: nothing it started outlives it.

use std::time::Duration;

use fairplace_e2e::etcd::etcd_binary;
use fairplace_e2e::faults::{self, Config, Report};

struct Args {
    seconds: u64,
    seed: u64,
    mode: String,
    clients: u32,
    nodes: usize,
    gap: (u64, u64),
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seconds: 60,
        seed: 1,
        mode: "both".into(),
        clients: 8,
        nodes: 6,
        gap: (1_000, 3_000),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag}: needs a value"))?;
        let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{flag} {v}: {e}"));
        match flag.as_str() {
            "--seconds" => a.seconds = num(&v)?,
            "--seed" => a.seed = num(&v)?,
            "--mode" if ["replicas", "single", "both"].contains(&v.as_str()) => a.mode = v,
            "--clients" => a.clients = num(&v)? as u32,
            "--nodes" => a.nodes = num(&v)?.max(1) as usize,
            "--gap-ms" => {
                let (lo, hi) = v.split_once('-').ok_or(format!("--gap-ms {v}: LO-HI"))?;
                a.gap = (num(lo)?, num(hi)?.max(num(lo)?));
            }
            _ => {
                return Err(format!(
                    "{flag} {v}: not a flag of this command (see its doc)"
                ));
            }
        }
    }
    Ok(a)
}

/// Leads a process group of its own and ends it whole on a signal.
fn own_group() {
    // SAFETY: setpgid(0, 0) makes this process a group leader; it takes no
    // pointers.
    unsafe { libc::setpgid(0, 0) };
    std::thread::spawn(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("signal runtime");
        rt.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM");
            let mut int = signal(SignalKind::interrupt()).expect("SIGINT");
            let mut hup = signal(SignalKind::hangup()).expect("SIGHUP");
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
                _ = hup.recv() => {}
            }
            eprintln!("fairplace-lease-faults: stopped by a signal: ending everything it started");
            fairplace_e2e::faults::rig::unmount_all();
            // SAFETY: kill(0, ...) signals this process's own group: the
            // servers, etcd, the agents, and this process.
            unsafe { libc::kill(0, libc::SIGKILL) };
        });
    });
}

fn print(r: &Report) {
    println!("{}: {}", r.mode, r.line());
    println!("  faults by kind: {:?}", r.faults);
    println!("  grants answered OK: {}", r.granted);
    let mut by_rule = std::collections::BTreeMap::<&str, usize>::new();
    for v in &r.violations {
        *by_rule.entry(v.rule).or_default() += 1;
    }
    if !by_rule.is_empty() {
        println!("  violations by rule: {by_rule:?}");
    }
    for v in r.violations.iter().take(20) {
        println!("  VIOLATION {}: {}", v.rule, v.detail);
    }
    let missing = r.kinds_missing();
    if !missing.is_empty() {
        println!("  fault kinds never injected: {missing:?}");
    }
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("fairplace-lease-faults: {e}");
            std::process::exit(2);
        }
    };
    own_group();
    let rt = fairplace_e2e::rt();
    let mut modes = Vec::new();
    if a.mode != "single" {
        match etcd_binary() {
            Some(e) => modes.push(Some(e)),
            None if a.mode == "replicas" => {
                eprintln!("fairplace-lease-faults: no etcd binary (Debian's etcd-server)");
                std::process::exit(2);
            }
            None => eprintln!("fairplace-lease-faults: no etcd: the replica mode is skipped"),
        }
    }
    if a.mode != "replicas" {
        modes.push(None);
    }
    let mut total = Report::default();
    for etcd in modes {
        let cfg = Config {
            seed: a.seed,
            duration: Duration::from_secs(a.seconds),
            etcd,
            clients: a.clients,
            nodes: a.nodes,
            gap_ms: a.gap,
        };
        let r = rt.block_on(faults::run(&cfg));
        print(&r);
        total.operations += r.operations;
        total.unknown += r.unknown;
        for (k, n) in &r.faults {
            *total.faults.entry(k.clone()).or_default() += n;
        }
        total.kinds.extend(r.kinds_missing());
        total.violations.extend(r.violations);
    }
    println!("{}", total.line());
    let failed = !total.violations.is_empty() || !total.kinds.is_empty();
    std::process::exit(i32::from(failed));
}
