//! Updates the server takes: cut to its limits before they are sent, and
//! without what it refused once it refused something.
//!
//! [`fit`] cuts a sample's task lists and runtime entries to the server's
//! limits (the constants of `fairplace_types::limits`, so the two cannot drift
//! apart), keeping the biggest. [`Shedding`] remembers which part of an
//! update the server refused anyway (a server with lower limits, a race in
//! the /proc walk): the next update leaves that part out, so the node stays
//! fresh with the rest, and later ones send it cut to half the share they
//! had; a run of applied updates doubles the share again. A part the server
//! keeps refusing is cut further on every rejection, until it is left out,
//! and each rejection makes the next growth wait twice as long: rejections
//! never loop.

use std::cmp::Ordering;
use std::collections::HashSet;

use fairplace_proto::v1 as pb;
use fairplace_types::limits::{
    MAX_MASKS_PER_NODE, MAX_RUNTIME_NS, MAX_RUNTIME_PER_CPU, MAX_TASKS_PER_CPU, MAX_TASKS_PER_NODE,
};

use super::TaskReport;

/// How much one update may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caps {
    pub tasks_per_cpu: usize,
    pub tasks_per_node: usize,
    /// Distinct affinity masks among the listed tasks.
    pub masks_per_node: usize,
    pub runtime: usize,
}

impl Caps {
    /// The server's limits for a node of `nr_cpus` CPUs.
    pub fn server(nr_cpus: usize) -> Caps {
        Caps {
            tasks_per_cpu: MAX_TASKS_PER_CPU,
            tasks_per_node: MAX_TASKS_PER_NODE,
            masks_per_node: MAX_MASKS_PER_NODE,
            runtime: MAX_RUNTIME_PER_CPU.saturating_mul(nr_cpus),
        }
    }
}

/// What [`fit`] left out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cut {
    pub tasks: usize,
    pub runtime: usize,
}

/// Which task is kept first: the running one, then the biggest by load,
/// then by util, then the lowest id.
fn keep_first(a: &pb::RunnableTask, b: &pb::RunnableTask) -> Ordering {
    b.running
        .cmp(&a.running)
        .then(b.load_avg.cmp(&a.load_avg))
        .then(b.util_avg.cmp(&a.util_avg))
        .then(a.id.cmp(&b.id))
}

/// Cuts `r` to what a node of `nr_cpus` CPUs may send under `caps`:
/// entries the server would refuse whatever the limits (a CPU beyond the
/// topology, process 0) are left out and runtime is capped at the server's
/// maximum; then at most `runtime` entries, the biggest; at most
/// `tasks_per_cpu` tasks per CPU and `tasks_per_node` in all, using at most
/// `masks_per_node` distinct affinity masks, the biggest (as
/// [`keep_first`]). The kept tasks keep their order; runtime entries are
/// ordered by (process, CPU).
pub fn fit(r: &mut TaskReport, nr_cpus: usize, caps: &Caps) -> Cut {
    let mut cut = Cut::default();
    let before = r.runtime.len();
    r.runtime
        .retain(|e| (e.cpu as usize) < nr_cpus && e.group != 0 && e.runtime_ns > 0);
    for e in &mut r.runtime {
        e.runtime_ns = e.runtime_ns.min(MAX_RUNTIME_NS);
    }
    if r.runtime.len() > caps.runtime {
        r.runtime.sort_by(|a, b| {
            b.runtime_ns
                .cmp(&a.runtime_ns)
                .then((a.group, a.cpu).cmp(&(b.group, b.cpu)))
        });
        r.runtime.truncate(caps.runtime);
        r.runtime.sort_by_key(|e| (e.group, e.cpu));
    }
    cut.runtime = before - r.runtime.len();

    let before: usize = r.cpus.iter().map(|l| l.tasks.len()).sum();
    r.cpus.retain(|l| (l.cpu as usize) < nr_cpus);
    for l in &mut r.cpus {
        if l.tasks.len() > caps.tasks_per_cpu {
            let mut order: Vec<usize> = (0..l.tasks.len()).collect();
            order.sort_by(|&a, &b| keep_first(&l.tasks[a], &l.tasks[b]));
            let mut keep = vec![false; l.tasks.len()];
            for &i in order.iter().take(caps.tasks_per_cpu) {
                keep[i] = true;
            }
            let mut k = keep.into_iter();
            l.tasks.retain(|_| k.next().unwrap_or(false));
        }
    }
    let total: usize = r.cpus.iter().map(|l| l.tasks.len()).sum();
    let masks: HashSet<&str> = r
        .cpus
        .iter()
        .flat_map(|l| l.tasks.iter())
        .map(|t| t.cpus_allowed.trim())
        .filter(|m| !m.is_empty())
        .collect();
    if total > caps.tasks_per_node || masks.len() > caps.masks_per_node {
        // The biggest tasks of the whole node, each new mask while there is
        // room for one.
        let mut order: Vec<(usize, usize)> = r
            .cpus
            .iter()
            .enumerate()
            .flat_map(|(c, l)| (0..l.tasks.len()).map(move |i| (c, i)))
            .collect();
        order.sort_by(|&(c, i), &(d, j)| keep_first(&r.cpus[c].tasks[i], &r.cpus[d].tasks[j]));
        let mut keep: Vec<Vec<bool>> = r.cpus.iter().map(|l| vec![false; l.tasks.len()]).collect();
        let mut kept = 0;
        let mut masks: HashSet<String> = HashSet::new();
        for (c, i) in order {
            if kept == caps.tasks_per_node {
                break;
            }
            let m = r.cpus[c].tasks[i].cpus_allowed.trim();
            if !m.is_empty() && !masks.contains(m) {
                if masks.len() == caps.masks_per_node {
                    continue;
                }
                masks.insert(m.to_string());
            }
            keep[c][i] = true;
            kept += 1;
        }
        for (l, keep) in r.cpus.iter_mut().zip(keep) {
            let mut k = keep.into_iter();
            l.tasks.retain(|_| k.next().unwrap_or(false));
        }
    }
    cut.tasks = before - r.cpus.iter().map(|l| l.tasks.len()).sum::<usize>();
    cut
}

/// The parts of an update the server refuses on their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Runtime,
    Tasks,
    /// The CPU states (or anything else): nothing can be left out of a
    /// full snapshot, but the next one goes without tasks and runtime.
    Cpus,
}

impl Part {
    /// The part a rejection's message names: it starts with the field
    /// (`update.runtime: 16 entries exceed …`, `update.tasks[3].cpu: …`).
    pub fn of(message: &str) -> Part {
        if message.starts_with("update.runtime") {
            Part::Runtime
        } else if message.starts_with("update.tasks") {
            Part::Tasks
        } else {
            Part::Cpus
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Part::Runtime => "runtime",
            Part::Tasks => "tasks",
            Part::Cpus => "cpus",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Halvings after which a part is left out altogether (2^17 > any limit).
const MAX_SHIFT: u32 = 17;
/// Applied updates before a cut part's share doubles again, at first; each
/// rejection of the part doubles it, up to [`MAX_GROW_AFTER`].
const GROW_AFTER: u32 = 30;
const MAX_GROW_AFTER: u32 = 3_600;

/// What one stream leaves out after the server refused part of an update.
#[derive(Debug, Clone)]
pub struct Shedding {
    /// Per part (runtime, tasks): the share of the server's limit sent, as
    /// a number of halvings.
    shift: [u32; 2],
    /// Leave the part out of the next update.
    skip_next: [bool; 3],
    /// Applied updates since the last change of the part's share.
    applied: [u32; 2],
    /// Applied updates before the share grows.
    grow_after: [u32; 2],
    /// The part's first rejection was logged.
    warned: [bool; 3],
}

impl Default for Shedding {
    fn default() -> Self {
        Shedding {
            shift: [0; 2],
            skip_next: [false; 3],
            applied: [0; 2],
            grow_after: [GROW_AFTER; 2],
            warned: [false; 3],
        }
    }
}

/// What to do about one rejection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub part: Part,
    /// The first rejection of this part: worth a warning (later ones are
    /// logged at debug level).
    pub first: bool,
}

impl Shedding {
    pub fn new() -> Shedding {
        Shedding::default()
    }

    /// The server refused an update (`reason`, `message` of its rejection).
    /// An out-of-sequence rejection needs only the full snapshot the caller
    /// sends next anyway, and changes nothing here.
    pub fn rejected(&mut self, reason: &str, message: &str) -> Option<Verdict> {
        if reason == "out_of_sequence" {
            return None;
        }
        let part = Part::of(message);
        match part {
            Part::Runtime | Part::Tasks => {
                let p = part.index();
                self.skip_next[p] = true;
                self.shift[p] = (self.shift[p] + 1).min(MAX_SHIFT);
                self.applied[p] = 0;
                self.grow_after[p] = (self.grow_after[p] * 2).min(MAX_GROW_AFTER);
            }
            Part::Cpus => {
                self.skip_next[Part::Runtime.index()] = true;
                self.skip_next[Part::Tasks.index()] = true;
            }
        }
        let first = !self.warned[part.index()];
        self.warned[part.index()] = true;
        Some(Verdict { part, first })
    }

    /// The server applied an update: cut parts grow back in time.
    pub fn applied(&mut self) {
        for p in 0..2 {
            if self.shift[p] == 0 {
                continue;
            }
            self.applied[p] += 1;
            if self.applied[p] >= self.grow_after[p] {
                self.shift[p] -= 1;
                self.applied[p] = 0;
            }
        }
    }

    /// Whether the next update leaves `part` out; asking clears it.
    pub fn take_skip(&mut self, part: Part) -> bool {
        std::mem::take(&mut self.skip_next[part.index()])
    }

    /// `caps` cut to the shares left after rejections.
    pub fn caps(&self, caps: Caps) -> Caps {
        let cut = |v: usize, s: u32| v.checked_shr(s).unwrap_or(0);
        let r = self.shift[Part::Runtime.index()];
        let t = self.shift[Part::Tasks.index()];
        Caps {
            tasks_per_cpu: cut(caps.tasks_per_cpu, t),
            tasks_per_node: cut(caps.tasks_per_node, t),
            masks_per_node: cut(caps.masks_per_node, t),
            runtime: cut(caps.runtime, r),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(id: u64, load: i64, running: bool, mask: &str) -> pb::RunnableTask {
        pb::RunnableTask {
            id,
            group: 1,
            load_avg: load,
            util_avg: load / 2,
            running,
            cpus_allowed: mask.into(),
            exec_start: 1_000 - id as i64,
            ..Default::default()
        }
    }

    fn rt(group: u64, cpu: u32, ns: u64) -> pb::ProcessRuntime {
        pb::ProcessRuntime {
            group,
            cpu,
            runtime_ns: ns,
            nr_threads: 1,
        }
    }

    fn ids(r: &TaskReport) -> Vec<Vec<u64>> {
        r.cpus
            .iter()
            .map(|l| l.tasks.iter().map(|t| t.id).collect())
            .collect()
    }

    #[test]
    fn the_servers_limits_come_from_the_server_crate() {
        let c = Caps::server(2);
        assert_eq!(c.runtime, 2 * MAX_RUNTIME_PER_CPU);
        assert_eq!(c.tasks_per_cpu, MAX_TASKS_PER_CPU);
        assert_eq!(c.tasks_per_node, MAX_TASKS_PER_NODE);
        assert_eq!(c.masks_per_node, MAX_MASKS_PER_NODE);
        // A busy 2-CPU machine (a dozen processes on both CPUs) fits.
        assert!(c.runtime >= 24);
    }

    #[test]
    fn runtime_keeps_the_biggest_entries_in_process_order() {
        let mut r = TaskReport {
            cpus: vec![],
            runtime: (1..=20u64)
                .map(|g| rt(g, (g % 2) as u32, g * 1_000))
                .chain([
                    rt(0, 0, 1 << 40),
                    rt(99, 7, 1 << 40),
                    rt(50, 1, u64::MAX),
                    rt(51, 1, 0),
                ])
                .collect(),
        };
        let caps = Caps {
            runtime: 5,
            ..Caps::server(2)
        };
        let cut = fit(&mut r, 2, &caps);
        let kept: Vec<(u64, u64)> = r.runtime.iter().map(|e| (e.group, e.runtime_ns)).collect();
        assert_eq!(
            kept,
            vec![
                (17, 17_000),
                (18, 18_000),
                (19, 19_000),
                (20, 20_000),
                (50, MAX_RUNTIME_NS)
            ]
        );
        // Process 0, CPU 7 (of 2) and a zero entry are left out whatever the caps.
        assert_eq!(cut.runtime, 24 - 5);
        assert_eq!(cut.tasks, 0);
    }

    #[test]
    fn tasks_keep_the_running_one_then_the_biggest_per_cpu_and_node() {
        let mut r = TaskReport {
            cpus: vec![
                pb::CpuTasks {
                    cpu: 0,
                    tasks: vec![
                        task(1, 10, false, ""),
                        task(2, 5, true, ""),
                        task(3, 30, false, ""),
                        task(4, 20, false, ""),
                    ],
                    clock_task: 1,
                },
                pb::CpuTasks {
                    cpu: 1,
                    tasks: vec![task(5, 25, true, ""), task(6, 1, false, "")],
                    clock_task: 1,
                },
                pb::CpuTasks {
                    cpu: 9,
                    tasks: vec![task(7, 100, true, "")],
                    clock_task: 1,
                },
            ],
            runtime: vec![],
        };
        let caps = Caps {
            tasks_per_cpu: 3,
            tasks_per_node: 4,
            ..Caps::server(2)
        };
        let cut = fit(&mut r, 2, &caps);
        // Per CPU: 2 (running), 3, 4 of CPU 0; then the node's four: both
        // running tasks, then loads 30 and 25 (5 is running) -> 3, then 4
        // (20) beats 6 (1). Order within a CPU is kept; CPU 9 is not in the
        // topology.
        assert_eq!(ids(&r), vec![vec![2, 3, 4], vec![5]]);
        assert_eq!(cut.tasks, 7 - 4);
    }

    #[test]
    fn tasks_beyond_the_mask_limit_are_left_out_biggest_kept() {
        let mut r = TaskReport {
            cpus: vec![pb::CpuTasks {
                cpu: 0,
                tasks: vec![
                    task(1, 10, true, "0"),
                    task(2, 50, false, "1"),
                    task(3, 40, false, "0-1"),
                    task(4, 30, false, "1"),
                    task(5, 20, false, ""),
                ],
                clock_task: 1,
            }],
            runtime: vec![],
        };
        let caps = Caps {
            masks_per_node: 2,
            ..Caps::server(2)
        };
        fit(&mut r, 2, &caps);
        // Masks "0" (running, first) and "1" (biggest); "0-1" is a third.
        assert_eq!(ids(&r), vec![vec![1, 2, 4, 5]]);
    }

    #[test]
    fn within_the_limits_nothing_changes() {
        let mut r = TaskReport {
            cpus: vec![pb::CpuTasks {
                cpu: 1,
                tasks: vec![task(1, 10, true, ""), task(2, 20, false, "1")],
                clock_task: 5,
            }],
            runtime: vec![rt(3, 0, 5), rt(1, 1, 9)],
        };
        let before = r.clone();
        assert_eq!(fit(&mut r, 2, &Caps::server(2)), Cut::default());
        assert_eq!(r, before);
    }

    #[test]
    fn a_refused_part_is_left_out_once_then_cut_then_grows_back() {
        let mut s = Shedding::new();
        let full = Caps::server(2);
        let v = s
            .rejected(
                "invalid",
                "update.runtime: 16 entries exceed the limit of 8 (4 per CPU)",
            )
            .unwrap();
        assert_eq!(
            v,
            Verdict {
                part: Part::Runtime,
                first: true
            }
        );
        assert!(s.take_skip(Part::Runtime));
        assert!(!s.take_skip(Part::Runtime), "left out of one update only");
        assert!(!s.take_skip(Part::Tasks));
        assert_eq!(s.caps(full).runtime, full.runtime / 2);
        assert_eq!(s.caps(full).tasks_per_cpu, full.tasks_per_cpu);
        // Refused again: cut further, and the log says it once.
        let v = s.rejected("invalid", "update.runtime: ...").unwrap();
        assert!(!v.first);
        assert_eq!(s.caps(full).runtime, full.runtime / 4);
        // Two rejections: growth waits 4 x GROW_AFTER applied updates per step.
        for _ in 0..4 * GROW_AFTER - 1 {
            s.applied();
        }
        assert_eq!(s.caps(full).runtime, full.runtime / 4);
        s.applied();
        assert_eq!(s.caps(full).runtime, full.runtime / 2);
        for _ in 0..4 * GROW_AFTER {
            s.applied();
        }
        assert_eq!(s.caps(full), full);
    }

    #[test]
    fn a_part_refused_over_and_over_ends_left_out() {
        let mut s = Shedding::new();
        for _ in 0..40 {
            s.rejected(
                "invalid",
                "update.tasks[0].tasks[3].id: task 9 is listed twice",
            );
            s.take_skip(Part::Tasks);
        }
        let c = s.caps(Caps::server(4096));
        assert_eq!(
            (c.tasks_per_cpu, c.tasks_per_node, c.masks_per_node),
            (0, 0, 0)
        );
        // It comes back only after an hour's worth of applied updates.
        for _ in 0..MAX_GROW_AFTER - 1 {
            s.applied();
        }
        assert_eq!(s.caps(Caps::server(4096)).tasks_per_node, 0);
        s.applied();
        assert_eq!(s.caps(Caps::server(4096)).tasks_per_node, 1);
    }

    #[test]
    fn refused_cpu_states_leave_tasks_and_runtime_out_of_the_next_update() {
        let mut s = Shedding::new();
        assert_eq!(
            s.rejected("out_of_sequence", "update.seq: 9 does not follow"),
            None
        );
        assert!(!s.take_skip(Part::Tasks));
        let v = s
            .rejected(
                "invalid",
                "update.cpus[1].h_nr_idle: 3 exceeds nr_running 1",
            )
            .unwrap();
        assert_eq!(v.part, Part::Cpus);
        assert!(s.take_skip(Part::Tasks) && s.take_skip(Part::Runtime));
        // Nothing is cut for later updates.
        assert_eq!(s.caps(Caps::server(8)), Caps::server(8));
    }
}
