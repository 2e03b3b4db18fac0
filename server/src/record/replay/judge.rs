//! What a setting changed, and whether it was better: counts of changed
//! decisions by kind and path, the CPUs scanned, and each placement judged
//! against what its node reported next.
//!
//! The judgement reads the node's first report after the decision (claims,
//! leases and expiries are not reports). It holds for the recorded choice
//! and the switched one alike, with one bias to keep in mind: the task
//! really ran on the recorded choice (when the caller placed it), so that
//! CPU's next report may carry it.

use std::collections::BTreeMap;

use serde::Serialize;

use super::decide::Answer;
use super::nodes::Version;
use crate::engine::topology::TopologySpec;

/// Placement outcomes, counted over the placements judged.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Outcomes {
    /// Placements with a later report of their node.
    pub judged: u64,
    /// The chosen CPU was idle at the next report.
    pub idle: u64,
    /// An SMT sibling of the chosen CPU was busy at the next report.
    pub busy_sibling: u64,
    /// The chosen CPU's LLC is not the task's previous CPU's.
    pub cross_llc: u64,
    /// The chosen CPU ran only SCHED_IDLE tasks at the next report.
    pub sched_idle_only: u64,
}

impl Outcomes {
    /// `n` as a percentage of the judged placements.
    pub fn pct(&self, n: u64) -> f64 {
        if self.judged == 0 {
            0.0
        } else {
            100.0 * n as f64 / self.judged as f64
        }
    }

    fn judge(&mut self, spec: &TopologySpec, next: &Version, cpu: usize, prev: Option<usize>) {
        let Some(c) = next.cpus.get(cpu) else {
            return;
        };
        self.judged += 1;
        self.idle += c.idle_cpu() as u64;
        self.sched_idle_only += c.sched_idle_rq() as u64;
        let busy = next
            .topo
            .smt_mask(cpu)
            .iter()
            .any(|s| s != cpu && next.cpus.get(s).is_some_and(|x| x.nr_running > 0));
        self.busy_sibling += busy as u64;
        let llc = |x: usize| spec.cpus.get(x).map(|c| c.llc);
        if let Some(p) = prev {
            self.cross_llc += (llc(p) != llc(cpu)) as u64;
        }
    }
}

/// Decisions of one kind and recorded path, how many a setting sent
/// elsewhere, and how many it decided by another path.
#[derive(Debug, Default, Clone, Serialize)]
pub struct Changed {
    pub decisions: u64,
    pub changed: u64,
    pub path_changed: u64,
}

/// One setting's table.
#[derive(Debug, Default, Clone, Serialize)]
pub struct SettingStats {
    /// `NAME=on|off[,NAME=on|off]`.
    pub setting: String,
    pub decisions: u64,
    /// Sent elsewhere (another CPU, another verdict).
    pub changed: u64,
    /// Decided by another path (whether or not it lands elsewhere).
    pub path_changed: u64,
    /// By "kind path" (the recorded path).
    pub by_path: BTreeMap<String, Changed>,
    #[serde(skip)]
    scanned_before: Vec<u32>,
    #[serde(skip)]
    scanned_after: Vec<u32>,
    pub scanned_mean_before: f64,
    pub scanned_mean_after: f64,
    pub scanned_p99_before: u32,
    pub scanned_p99_after: u32,
    pub before: Outcomes,
    pub after: Outcomes,
}

impl SettingStats {
    pub fn new(setting: String) -> Self {
        Self {
            setting,
            ..Self::default()
        }
    }

    /// One decision: `base` as the recorded features decide it, `new` as
    /// this setting does.
    pub fn count(&mut self, kind: &str, base: &Answer, new: &Answer) {
        self.decisions += 1;
        let moved = base.moved_from(new);
        let other_path = base.path() != new.path();
        self.changed += moved as u64;
        self.path_changed += other_path as u64;
        let row = self
            .by_path
            .entry(format!("{kind} {}", base.path()))
            .or_default();
        row.decisions += 1;
        row.changed += moved as u64;
        row.path_changed += other_path as u64;
        if let (Some(a), Some(b)) = (base.scanned(), new.scanned()) {
            self.scanned_before.push(a);
            self.scanned_after.push(b);
        }
    }

    /// A placement judged at its node's next report.
    pub fn judge(
        &mut self,
        spec: &TopologySpec,
        next: &Version,
        prev: Option<usize>,
        base: usize,
        new: usize,
    ) {
        self.before.judge(spec, next, base, prev);
        self.after.judge(spec, next, new, prev);
    }

    /// Fills the scan figures from the samples.
    pub fn finish(&mut self) {
        let (m, p) = mean_p99(&mut self.scanned_before);
        self.scanned_mean_before = m;
        self.scanned_p99_before = p;
        let (m, p) = mean_p99(&mut self.scanned_after);
        self.scanned_mean_after = m;
        self.scanned_p99_after = p;
    }

    /// The setting's line:
    /// `switch NAME=on|off: D of N decisions changed, scanned S -> S', next-report idle I % -> I' %`.
    pub fn line(&self) -> String {
        format!(
            "switch {}: {} of {} decisions changed, scanned {:.2} -> {:.2}, next-report idle {:.1} % -> {:.1} %",
            self.setting,
            self.changed,
            self.decisions,
            self.scanned_mean_before,
            self.scanned_mean_after,
            self.before.pct(self.before.idle),
            self.after.pct(self.after.idle),
        )
    }
}

fn mean_p99(v: &mut [u32]) -> (f64, u32) {
    if v.is_empty() {
        return (0.0, 0);
    }
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    v.sort_unstable();
    let i = ((v.len() as f64) * 0.99).ceil() as usize;
    (mean, v[i.clamp(1, v.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p99_is_the_value_below_which_99_percent_lie() {
        let mut v: Vec<u32> = (1..=100).collect();
        assert_eq!(mean_p99(&mut v), (50.5, 99));
        assert_eq!(mean_p99(&mut [7]), (7.0, 7));
        assert_eq!(mean_p99(&mut []), (0.0, 0));
    }

    #[test]
    fn a_different_cpu_is_a_change_a_different_path_alone_is_not() {
        let pick = |cpu, path: &str| Answer::Pick {
            cpu,
            path: path.into(),
            scanned: 1,
            affine: String::new(),
            nr_idle_scan: None,
        };
        let mut s = SettingStats::new("X=on".into());
        s.count("wakeup", &pick(1, "a"), &pick(1, "b"));
        s.count("wakeup", &pick(1, "a"), &pick(2, "a"));
        s.count("fork", &pick(3, "c"), &Answer::Refused("no".into()));
        assert_eq!((s.decisions, s.changed, s.path_changed), (3, 2, 2));
        assert_eq!(s.by_path["wakeup a"].changed, 1);
        assert_eq!(s.by_path["fork c"].decisions, 1);
    }
}
