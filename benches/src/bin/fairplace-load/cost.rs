//! What a phase cost a process (the server, or the generator itself), read
//! from its `/proc` entries: CPU time of all its threads, read and write
//! system calls, and voluntary context switches.
//!
//! Throughput alone mixes the server's cost with the generator's pace:
//! a slower generator hands the server fewer requests per wakeup, and each
//! costs it more system calls. Dividing these counters by the calls made
//! gives the server's own cost per call, phase by phase.

use std::ops::{AddAssign, Sub};

/// Cumulative counters of one process.
#[derive(Clone, Copy, Debug, Default)]
pub struct Cost {
    /// CPU time of all threads, nanoseconds (`schedstat`).
    pub cpu_ns: u64,
    /// Read-like and write-like system calls (`io`: syscr + syscw).
    pub syscalls: u64,
    /// Voluntary context switches of all threads.
    pub switches: u64,
}

impl Sub for Cost {
    type Output = Cost;
    fn sub(self, o: Cost) -> Cost {
        Cost {
            cpu_ns: self.cpu_ns.saturating_sub(o.cpu_ns),
            syscalls: self.syscalls.saturating_sub(o.syscalls),
            switches: self.switches.saturating_sub(o.switches),
        }
    }
}

impl AddAssign for Cost {
    fn add_assign(&mut self, o: Cost) {
        self.cpu_ns += o.cpu_ns;
        self.syscalls += o.syscalls;
        self.switches += o.switches;
    }
}

/// `pid`'s counters now (zeros where `/proc` does not say).
pub fn read(pid: u32) -> Cost {
    let mut c = Cost::default();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"));
    for t in tasks.into_iter().flatten().flatten() {
        let p = t.path();
        c.cpu_ns += match std::fs::read_to_string(p.join("schedstat")) {
            Ok(sched) => field(sched.split_whitespace().next()),
            // Without schedstat: user + system time, in clock ticks.
            Err(_) => ticks_ns(&std::fs::read_to_string(p.join("stat")).unwrap_or_default()),
        };
        let status = std::fs::read_to_string(p.join("status")).unwrap_or_default();
        c.switches += status
            .lines()
            .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
            .map_or(0, |v| field(Some(v.trim())));
    }
    let io = std::fs::read_to_string(format!("/proc/{pid}/io")).unwrap_or_default();
    for l in io.lines() {
        if let Some(v) = l.strip_prefix("syscr:").or(l.strip_prefix("syscw:")) {
            c.syscalls += field(Some(v.trim()));
        }
    }
    c
}

/// utime + stime of a `stat` line, in nanoseconds (ticks of 10 ms, the
/// USER_HZ of every Linux port this runs on).
fn ticks_ns(stat: &str) -> u64 {
    // Fields after the command's closing parenthesis: state is the 1st,
    // utime the 12th and stime the 13th.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let mut f = rest.split_whitespace().skip(11);
    (field(f.next()) + field(f.next())) * 10_000_000
}

fn field(v: Option<&str>) -> u64 {
    v.and_then(|v| v.parse().ok()).unwrap_or(0)
}

/// One line: per call, `who`'s CPU microseconds, system calls and
/// context switches.
pub fn per_call(phase: &str, who: &str, c: Cost, calls: u64) -> String {
    let n = calls.max(1) as f64;
    format!(
        "{phase}: {who} {:.2} µs CPU, {:.3} syscalls, {:.3} voluntary context switches per call",
        c.cpu_ns as f64 / 1e3 / n,
        c.syscalls as f64 / n,
        c.switches as f64 / n
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn own_reads_and_cpu_show_in_the_counters() {
        let before = read(std::process::id());
        let mut f = std::fs::File::open("/proc/self/stat").unwrap();
        let mut buf = [0u8; 64];
        for _ in 0..200 {
            let _ = f.read(&mut buf).unwrap();
        }
        // Some CPU time to count.
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let spent = read(std::process::id()) - before;
        assert!(spent.syscalls >= 200, "200 reads made, {spent:?}");
        assert!(spent.cpu_ns > 0, "CPU was spent, {spent:?}");
    }

    #[test]
    fn stat_ticks_are_user_plus_system_time() {
        let stat = "42 (a (b) c) R 1 2 3 4 5 6 7 8 9 10 300 45 0 0 20 0 1 0";
        assert_eq!(ticks_ns(stat), 345 * 10_000_000);
        assert_eq!(ticks_ns(""), 0);
    }

    #[test]
    fn a_line_divides_by_the_calls() {
        let c = Cost {
            cpu_ns: 20_000_000,
            syscalls: 1_500,
            switches: 10,
        };
        assert_eq!(
            per_call("ping", "server", c, 1_000),
            "ping: server 20.00 µs CPU, 1.500 syscalls, 0.010 voluntary context switches per call"
        );
        let none = per_call("ping", "server", Cost::default(), 0);
        assert!(none.contains("0.00 µs"), "{none}");
    }
}
