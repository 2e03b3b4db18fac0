//! The load a round of placements runs on, one profile per round.
//!
//! A profile is chosen per round by the seed among those the kernel command
//! line enables (`fp.profiles`), and every record of the round names it. The
//! profiles push the kernel down the paths a light load rarely reaches:
//! fully busy and overloaded groups in the slow path, SIS_UTIL's scan limit,
//! `sched_idle_cpu()` among busy CPUs, group entities of task groups in the
//! runqueues' loads, `wake_wide()` with real flip counts, and exec among a
//! churn of short-lived processes.

use std::fs;
use std::time::Duration;

use crate::{Lcg, pin};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Profile {
    /// Random pinned spinners, on average under half the CPUs.
    Light,
    /// Every CPU but one or two runs a pinned spinner.
    Busy,
    /// Two to four runnable tasks per CPU, mixed nice levels and SCHED_IDLE.
    Oversubscribed,
    /// One LLC fully busy, a few spinners elsewhere.
    LlcFull,
    /// Spinners in a two-level hierarchy of task groups with random
    /// `cpu.weight`s: the root runqueues' loads are group entities'.
    Cgroups,
    /// Short sleepers waking each other in the background, and the placed
    /// wakee and its waker both waking other tasks just before, so
    /// `wake_wide()` sees real flip counts.
    WakeStorm,
    /// Mostly exec and fork placements among a background fork/exec churn.
    ExecHeavy,
}

pub const ALL: [Profile; 7] = [
    Profile::Light,
    Profile::Busy,
    Profile::Oversubscribed,
    Profile::LlcFull,
    Profile::Cgroups,
    Profile::WakeStorm,
    Profile::ExecHeavy,
];

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Light => "light",
            Profile::Busy => "busy",
            Profile::Oversubscribed => "oversubscribed",
            Profile::LlcFull => "llc-full",
            Profile::Cgroups => "cgroups",
            Profile::WakeStorm => "wake-storm",
            Profile::ExecHeavy => "exec-heavy",
        }
    }

    pub fn parse(s: &str) -> Option<Profile> {
        ALL.into_iter().find(|p| p.name() == s)
    }

    /// The kind of the `k`-th placement of a round (0, 1 wakeup sync / not
    /// sync, 2 fork, 3 exec).
    pub fn kind(self, rng: &mut Lcg, k: usize) -> usize {
        match self {
            // Exec three times in five, fork once, a wakeup once.
            Profile::ExecHeavy => [3, 3, 3, 2, rng.below(2)][rng.below(5)],
            // Wakeups: the profile is about them.
            Profile::WakeStorm => rng.below(2),
            _ => (k + rng.below(4)) % 4,
        }
    }
}

/// What a round's load is made of, to be ended by [`Load::stop`].
pub struct Load {
    pids: Vec<i32>,
    /// Task groups made for the round, leaves first.
    cgroups: Vec<String>,
    /// Write ends of the helpers' pipes (wake-storm): a byte wakes one.
    pub helpers: Vec<i32>,
}

const CGROOT: &str = "/sys/fs/cgroup";

/// How a spinner runs.
#[derive(Clone, Copy)]
struct Spin {
    idle: bool,
    nice: i32,
}

impl Load {
    pub fn start(p: Profile, rng: &mut Lcg, nr: usize, llc: &[usize]) -> Load {
        let mut l = Load {
            pids: Vec::new(),
            cgroups: Vec::new(),
            helpers: Vec::new(),
        };
        let plain = |idle| Spin { idle, nice: 0 };
        match p {
            Profile::Light | Profile::WakeStorm | Profile::ExecHeavy => {
                let mut busy = vec![false; nr];
                for _ in 0..rng.below(nr + 1) {
                    let c = rng.below(nr);
                    if !busy[c] || rng.below(4) == 0 {
                        busy[c] = true;
                        l.spin(&[c], plain(rng.below(4) == 0), None);
                    }
                }
            }
            Profile::Busy => {
                let free: Vec<usize> = (0..1 + rng.below(2)).map(|_| rng.below(nr)).collect();
                for c in (0..nr).filter(|c| !free.contains(c)) {
                    l.spin(&[c], plain(rng.below(5) == 0), None);
                }
            }
            Profile::Oversubscribed => {
                for c in 0..nr {
                    for _ in 0..2 + rng.below(3) {
                        let s = Spin {
                            idle: rng.below(5) == 0,
                            nice: [-5, 0, 0, 0, 5, 10][rng.below(6)],
                        };
                        l.spin(&[c], s, None);
                    }
                }
            }
            Profile::LlcFull => {
                let full = llc[rng.below(nr)];
                for (c, &at) in llc.iter().enumerate().take(nr) {
                    if at == full || rng.below(4) == 0 {
                        l.spin(&[c], plain(rng.below(6) == 0), None);
                    }
                }
            }
            Profile::Cgroups => l.cgroup_load(rng, nr),
        }
        if p == Profile::WakeStorm {
            l.storm(rng, nr);
        }
        if p == Profile::ExecHeavy {
            l.churn();
        }
        l
    }

    /// A spinner allowed on `cpus`, in the task group `cg` if given.
    fn spin(&mut self, cpus: &[usize], s: Spin, cg: Option<&str>) {
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            name_load_task();
            if let Some(cg) = cg {
                let me = unsafe { libc::getpid() };
                let _ = fs::write(format!("{CGROOT}/{cg}/cgroup.procs"), me.to_string());
            }
            pin(0, cpus);
            if s.idle {
                let p = libc::sched_param { sched_priority: 0 };
                unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &p) };
            } else if s.nice != 0 {
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, s.nice) };
            }
            let mut x = 0u64;
            loop {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        }
        self.pids.push(pid);
    }

    /// Groups `fpa/x`, `fpa/y` and `fpb` with random weights; each CPU gets
    /// zero to two pinned spinners in random leaves (pinned, so the loads
    /// settle in the 400 ms before the placements).
    fn cgroup_load(&mut self, rng: &mut Lcg, nr: usize) {
        let _ = fs::write(format!("{CGROOT}/cgroup.subtree_control"), "+cpu");
        let mk = |path: &str, weight: usize| {
            let dir = format!("{CGROOT}/{path}");
            let _ = fs::create_dir(&dir);
            let _ = fs::write(format!("{dir}/cpu.weight"), weight.to_string());
        };
        let w = |rng: &mut Lcg| [1, 10, 50, 100, 300, 1000, 5000][rng.below(7)];
        mk("fpa", w(rng));
        let _ = fs::write(format!("{CGROOT}/fpa/cgroup.subtree_control"), "+cpu");
        mk("fpa/x", w(rng));
        mk("fpa/y", w(rng));
        mk("fpb", w(rng));
        self.cgroups = ["fpa/x", "fpa/y", "fpb", "fpa"].map(String::from).to_vec();
        let leaves = ["fpa/x", "fpa/y", "fpb"];
        for c in 0..nr {
            for _ in 0..rng.below(3) {
                let cg = leaves[rng.below(3)];
                let s = Spin {
                    idle: rng.below(6) == 0,
                    nice: 0,
                };
                self.spin(&[c], s, Some(cg));
            }
        }
    }

    /// Pairs of unpinned short sleepers waking each other through pipes,
    /// and eight helpers blocked on pipes of their own (the placed wakee and
    /// its waker wake them to raise their flip counts).
    fn storm(&mut self, rng: &mut Lcg, nr: usize) {
        // A pair wakes its partner every 0.2 to 2 ms: enough to keep
        // wakeups, flips and recent CPUs moving on every CPU, few enough
        // that most placements see no other wakeup inside their decision.
        for _ in 0..1 + rng.below(nr / 4 + 1) {
            let (mut a, mut b) = ([0i32; 2], [0i32; 2]);
            unsafe {
                libc::pipe(a.as_mut_ptr());
                libc::pipe(b.as_mut_ptr());
            }
            let spin_us = [200, 500, 2000][rng.below(3)];
            for (rd, wr, first) in [(a[0], b[1], true), (b[0], a[1], false)] {
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    name_load_task();
                    pin(0, &(0..nr).collect::<Vec<_>>());
                    if first {
                        unsafe { libc::write(wr, b"x".as_ptr().cast(), 1) };
                    }
                    let mut byte = [0u8; 1];
                    loop {
                        if unsafe { libc::read(rd, byte.as_mut_ptr().cast(), 1) } != 1 {
                            unsafe { libc::_exit(0) };
                        }
                        busy_for(Duration::from_micros(spin_us));
                        unsafe { libc::write(wr, b"x".as_ptr().cast(), 1) };
                    }
                }
                self.pids.push(pid);
            }
            unsafe {
                for fd in [a[0], a[1], b[0], b[1]] {
                    libc::close(fd);
                }
            }
        }
        for _ in 0..8 {
            let mut p = [0i32; 2];
            unsafe { libc::pipe(p.as_mut_ptr()) };
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                name_load_task();
                pin(0, &(0..nr).collect::<Vec<_>>());
                unsafe { libc::close(p[1]) };
                let mut buf = [0u8; 64];
                while unsafe { libc::read(p[0], buf.as_mut_ptr().cast(), 64) } > 0 {}
                unsafe { libc::_exit(0) };
            }
            unsafe { libc::close(p[0]) };
            self.pids.push(pid);
            self.helpers.push(p[1]);
        }
    }

    /// A process that forks and execs a short-lived image every 10 ms.
    fn churn(&mut self) {
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            name_load_task();
            let prog = crate::cs("/init");
            let arg = crate::cs("noop");
            loop {
                let c = unsafe { libc::fork() };
                if c == 0 {
                    let argv = [prog.as_ptr(), arg.as_ptr(), std::ptr::null()];
                    let envp = [std::ptr::null()];
                    unsafe {
                        libc::execve(prog.as_ptr(), argv.as_ptr(), envp.as_ptr());
                        libc::_exit(1);
                    }
                }
                unsafe { libc::waitpid(c, std::ptr::null_mut(), 0) };
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.pids.push(pid);
    }

    /// Wakes `n` helpers one after the other (each a different task from the
    /// last, so every wakeup that finds one asleep counts a flip).
    pub fn wake_helpers(helpers: &[i32], n: usize) {
        if helpers.is_empty() {
            return;
        }
        for i in 0..n {
            let fd = helpers[i % helpers.len()];
            unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) };
            if i % helpers.len() == helpers.len() - 1 {
                // Let the helpers block again so the next round wakes them.
                std::thread::sleep(Duration::from_micros(300));
            }
        }
    }

    pub fn stop(self) {
        for &fd in &self.helpers {
            unsafe { libc::close(fd) };
        }
        crate::kill_all(&self.pids);
        for cg in &self.cgroups {
            let _ = fs::remove_dir(format!("{CGROOT}/{cg}"));
        }
    }
}

/// Names the calling task `fpload`, so the decision probes (filtered on
/// the harness's own `init`) skip its decisions.
fn name_load_task() {
    unsafe { libc::prctl(libc::PR_SET_NAME, c"fpload".as_ptr()) };
}

fn busy_for(d: Duration) {
    let end = std::time::Instant::now() + d;
    while std::time::Instant::now() < end {}
}
