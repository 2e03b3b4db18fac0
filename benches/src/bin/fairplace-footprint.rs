//! The cache lines one PickCpu's handler touches on the server, against
//! Ping's: the instruction and data lines of the unary path's own steps
//! (decode, `Placement::pick_one`, encode, and the drops), counted from a
//! memory trace of real calls.
//!
//! Why: on a server pinned to one core, a PickCpu's cost over a Ping is
//! mostly the lines it brings back into a cache the call's HTTP/2 and
//! kernel work has emptied (BENCHMARKS.md, "A third VM"); a count of those
//! lines is a measure that does not move with the machine's neighbours,
//! where the end-to-end ratio moves by ±0.03 from one server to the next.
//!
//! `fairplace-footprint` runs itself under valgrind's lackey tool (every
//! instruction fetch and data access, with its address), then counts the
//! distinct 64-byte lines between markers: a store to a static word the
//! traced process names. The node and requests are the load generator's
//! (`fairplace_benches::load`). Each call is measured after the same
//! calls have run many times, so one-time work (first allocations, lazy
//! statics) is not counted.

use std::collections::HashSet;
use std::hint::black_box;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use clap::{Parser, Subcommand};
use fairplace::identity::Caller;
use fairplace_benches::load::{self, pick_cpu, ping_answer};
use fairplace_proto::codec::frame;
use fairplace_proto::v1 as pb;

#[derive(Parser)]
#[command(name = "fairplace-footprint")]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    /// Calls of each kind measured (one PickCpu per caller of the load
    /// generator, cycling).
    #[arg(long, default_value_t = 32)]
    calls: usize,
}

#[derive(Subcommand)]
enum Cmd {
    /// The traced program: warm up, then alternate marked PickCpu and
    /// Ping calls. Run by the default command under valgrind.
    Traced,
}

/// The word whose stores delimit the measured calls in the trace.
static MARK: AtomicU64 = AtomicU64::new(0);

#[inline(never)]
fn mark() {
    MARK.fetch_add(1, Ordering::SeqCst);
}

fn traced(calls: usize) {
    let p = load::placement();
    let caller = Caller::Open;
    let ext = http::Extensions::new();
    let requests: Vec<_> = (0..32).map(|i| frame(&load::wakeup_on_load(i))).collect();
    let ping = frame(&pb::PingRequest {});
    let stack_word = 0u64;
    // The parent reads these two addresses from the first line.
    println!(
        "mark {:x} stack {:x}",
        &MARK as *const _ as usize, &stack_word as *const _ as usize
    );
    for round in 0..20 {
        for m in &requests {
            black_box(pick_cpu(&p, &caller, &ext, m));
            black_box(ping_answer(&ping));
        }
        black_box(round);
    }
    for i in 0..calls {
        mark();
        drop(black_box(pick_cpu(&p, &caller, &ext, &requests[i % 32])));
        mark();
        drop(black_box(ping_answer(&ping)));
    }
    mark();
}

/// What one marked segment of the trace touched.
#[derive(Default)]
struct Segment {
    instructions: u64,
    code_lines: HashSet<u64>,
    stack_lines: HashSet<u64>,
    data_lines: HashSet<u64>,
}

/// Lines of `addr..addr+size` (a record may straddle two).
fn lines(addr: u64, size: u64) -> impl Iterator<Item = u64> {
    (addr / 64)..=((addr + size.max(1) - 1) / 64)
}

/// Parses lackey's `I  addr,size` / ` L addr,size` (S, M) records between
/// stores to `mark`, data within 1 MiB of `stack` counted as stack.
fn segments(trace: &str, mark: u64, stack: u64) -> Vec<Segment> {
    let mut out = Vec::new();
    let mut cur: Option<Segment> = None;
    for line in trace.lines() {
        let Some((kind, rest)) = line.get(..3).zip(line.get(3..)) else {
            continue;
        };
        let Some((a, s)) = rest.trim().split_once(',') else {
            continue;
        };
        let (Ok(addr), Ok(size)) = (u64::from_str_radix(a, 16), s.parse::<u64>()) else {
            continue;
        };
        let kind = kind.trim();
        if (kind == "S" || kind == "M") && addr == mark {
            out.extend(cur.take());
            cur = Some(Segment::default());
            continue;
        }
        let Some(seg) = cur.as_mut() else { continue };
        match kind {
            "I" => {
                seg.instructions += 1;
                seg.code_lines.extend(lines(addr, size));
            }
            "L" | "S" | "M" if addr.abs_diff(stack) < 1 << 20 => {
                seg.stack_lines.extend(lines(addr, size))
            }
            "L" | "S" | "M" => seg.data_lines.extend(lines(addr, size)),
            _ => {}
        }
    }
    // The last mark opens no call.
    out
}

fn median(mut v: Vec<usize>) -> usize {
    v.sort_unstable();
    v[v.len() / 2]
}

fn report(name: &str, segs: &[&Segment]) {
    let m = |f: &dyn Fn(&Segment) -> usize| median(segs.iter().map(|s| f(s)).collect());
    let code = m(&|s| s.code_lines.len());
    let stack = m(&|s| s.stack_lines.len());
    let data = m(&|s| s.data_lines.len());
    println!(
        "{name:<8} {:>12} {:>11} {:>11} {:>11} {:>11}",
        m(&|s| s.instructions as usize),
        code,
        stack,
        data,
        code + stack + data
    );
}

fn main() {
    let args = Args::parse();
    if let Some(Cmd::Traced) = args.cmd {
        return traced(args.calls);
    }
    let me = std::env::current_exe().expect("own path");
    let log = std::env::temp_dir().join(format!("fairplace-footprint.{}", std::process::id()));
    let out = Command::new("valgrind")
        .arg("--tool=lackey")
        .arg("--trace-mem=yes")
        .arg(format!("--log-file={}", log.display()))
        .arg(&me)
        .args(["--calls", &args.calls.to_string(), "traced"])
        .output()
        .expect("valgrind (apt-get install valgrind)");
    assert!(out.status.success(), "the traced run failed: {out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = stdout.split_whitespace().collect();
    let (mark, stack) = match words[..] {
        ["mark", m, "stack", s, ..] => (
            u64::from_str_radix(m, 16).unwrap(),
            u64::from_str_radix(s, 16).unwrap(),
        ),
        _ => panic!("the traced run printed no marks: {stdout}"),
    };
    let trace = std::fs::read_to_string(&log).expect("valgrind's trace");
    let _ = std::fs::remove_file(&log);
    let segs = segments(&trace, mark, stack);
    assert_eq!(segs.len(), 2 * args.calls, "one segment per call");
    let picks: Vec<&Segment> = segs.iter().step_by(2).collect();
    let pings: Vec<&Segment> = segs.iter().skip(1).step_by(2).collect();
    println!(
        "# distinct 64-byte lines one call touches, median of {} calls",
        args.calls
    );
    println!(
        "{:<8} {:>12} {:>11} {:>11} {:>11} {:>11}",
        "call", "instructions", "code lines", "stack lines", "data lines", "all lines"
    );
    report("pick_cpu", &picks);
    report("ping", &pings);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_split_at_stores_to_the_mark_and_count_distinct_lines() {
        let trace = "\
I  1000,4
 S 5000,8
I  1000,4
I  103e,4
 L 9000,8
 L 9008,8
 L 7efff0000,8
 M 5000,8
I  2000,2
 S 9040,8
 S 5000,8
";
        let segs = segments(trace, 0x5000, 0x7f0000000);
        assert_eq!(segs.len(), 2);
        let a = &segs[0];
        assert_eq!(a.instructions, 2);
        // 0x1000, and 0x103e..0x1042 straddles into the next line.
        assert_eq!(a.code_lines.len(), 2);
        assert_eq!(a.data_lines.len(), 1, "0x9000 and 0x9008 share a line");
        assert_eq!(a.stack_lines.len(), 1, "near the stack word");
        assert_eq!(segs[1].instructions, 1);
        assert_eq!(segs[1].data_lines.len(), 1);
    }
}
