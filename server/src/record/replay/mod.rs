//! `fairplace-server replay DIR`: a recording's nodes rebuilt version by
//! version and each recorded request decided again, first under the
//! features it was decided with (every answer must come out the same),
//! then under each switch setting asked for, judged against the next
//! reports (docs/replay.md).
//!
//! It streams: segments are read in order, one block at a time; a node
//! keeps its last few versions and the placements waiting for its next
//! report, so memory follows the nodes, not the recording's length.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::record_entry::Entry;
use serde::Serialize;

use super::segment::{self, Damage, SegmentReader};
use crate::engine::features::{FEATURE_NAMES, Features};

pub mod decide;
pub mod judge;
pub mod nodes;
pub mod out;

use judge::SettingStats;
use nodes::Tracks;

/// Answers not reproduced that the report keeps whole (all are counted).
const MAX_MISMATCHES: usize = 1000;
/// Placements one node keeps waiting for its next report.
const MAX_WAITING: usize = 1 << 16;

/// One setting to replay under: switches set over each decision's own
/// features.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Setting {
    pub set: Vec<(&'static str, bool)>,
}

impl Setting {
    /// `NAME=on|off`, several joined by commas for one setting.
    pub fn parse(s: &str) -> Result<Setting, String> {
        let mut set = Vec::new();
        for part in s.split(',') {
            let (name, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected NAME=on or NAME=off"))?;
            let name = FEATURE_NAMES
                .iter()
                .find(|n| n.eq_ignore_ascii_case(name.trim()))
                .ok_or_else(|| {
                    format!(
                        "{name:?} is not a switch (one of {})",
                        FEATURE_NAMES.join(", ")
                    )
                })?;
            let on = match value.trim() {
                "on" | "true" | "1" => true,
                "off" | "false" | "0" => false,
                v => return Err(format!("{name}={v}: the value is on or off")),
            };
            set.push((*name, on));
        }
        Ok(Setting { set })
    }

    pub fn label(&self) -> String {
        self.set
            .iter()
            .map(|(n, on)| format!("{n}={}", if *on { "on" } else { "off" }))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn apply(&self, mut f: Features) -> Features {
        for (n, on) in &self.set {
            f.set(n, *on);
        }
        f
    }
}

/// What to replay and how.
#[derive(Debug, Clone)]
pub struct Options {
    pub dir: PathBuf,
    pub settings: Vec<Setting>,
    /// Every switch, one at a time, set the other way from the recording's
    /// global features.
    pub each_switch: bool,
    /// Answers not reproduced that the report lists in full.
    pub show: usize,
}

/// An answer that did not come out the same.
#[derive(Debug, Clone, Serialize)]
pub struct Mismatch {
    pub node: String,
    pub version: u64,
    pub kind: String,
    pub recorded: String,
    pub replayed: String,
    pub request: String,
}

/// The replay's findings.
#[derive(Debug, Default, Serialize)]
pub struct Report {
    pub segments: usize,
    pub entries: u64,
    pub nodes: usize,
    /// Decisions decided again.
    pub decisions: u64,
    pub reproduced: u64,
    pub mismatches: Vec<Mismatch>,
    /// Decisions whose snapshot the recording does not hold.
    pub no_state: u64,
    /// States that could not be rebuilt (and why, the first few).
    pub bad_states: u64,
    pub bad_state_reasons: Vec<String>,
    /// Balance passes recorded, not decided again.
    pub balances: u64,
    /// Events lost while recording, as the last segment start says.
    pub dropped: u64,
    pub damaged: Vec<String>,
    /// Placements whose node sent no report after them.
    pub unjudged: u64,
    pub settings: Vec<SettingStats>,
}

/// A placement waiting for its node's next report.
struct Pending {
    prev: Option<usize>,
    /// The recorded features' choice, then each setting's.
    chosen: Vec<usize>,
}

struct Replay {
    opts: Options,
    nodes: Tracks,
    /// Resolved at the first segment start (`--each-switch` needs it).
    settings: Option<Vec<Setting>>,
    pending: HashMap<String, Vec<Pending>>,
    report: Report,
}

/// Replays `opts.dir`.
pub fn run(opts: Options) -> Result<Report, String> {
    let files = recording_files(&opts.dir)?;
    if files.is_empty() {
        return Err(format!(
            "{}: no recording segments (*{}) here",
            opts.dir.display(),
            segment::SUFFIX
        ));
    }
    let mut r = Replay {
        nodes: Tracks::new(Default::default()),
        settings: None,
        pending: HashMap::new(),
        report: Report::default(),
        opts,
    };
    for f in &files {
        r.segment(f);
    }
    r.report.unjudged += r.pending.values().map(|p| p.len() as u64).sum::<u64>();
    r.report.nodes = r.nodes.tracks.len();
    for s in &mut r.report.settings {
        s.finish();
    }
    Ok(r.report)
}

/// The segments of `dir`, oldest first; without any there, those of each
/// folder in it (`fairplace record` with several replicas writes one
/// folder each; their nodes are their own, so folders replay one after
/// another).
fn recording_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let read = |d: &Path| segment::segments(d).map_err(|e| format!("{}: {e}", d.display()));
    let files = read(dir)?;
    if !files.is_empty() {
        return Ok(files);
    }
    let mut subdirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    subdirs.sort();
    let mut out = Vec::new();
    for d in subdirs {
        out.extend(read(&d)?);
    }
    Ok(out)
}

impl Replay {
    fn segment(&mut self, path: &Path) {
        self.report.segments += 1;
        let reader = match SegmentReader::open(path) {
            Ok(r) => r,
            Err(d) => return self.damaged(d),
        };
        for e in reader {
            match e {
                Ok(e) => {
                    self.report.entries += 1;
                    self.entry(e);
                }
                Err(d) => return self.damaged(d),
            }
        }
    }

    fn damaged(&mut self, d: Damage) {
        self.report.damaged.push(d.to_string());
    }

    fn entry(&mut self, e: pb::RecordEntry) {
        match e.entry {
            Some(Entry::Start(s)) => self.start(&s),
            Some(Entry::Node(n)) => {
                if let Err(e) = self.nodes.node(&n) {
                    self.bad_state(format!("node {}: {e}", n.node_id));
                }
            }
            Some(Entry::State(s)) => match self.nodes.state(&s) {
                Ok(v) if v.report => self.judge(&s.node_id, &v),
                Ok(_) => {}
                Err(e) => self.bad_state(e),
            },
            Some(Entry::Decision(d)) => self.decision(&d),
            None => {}
        }
    }

    fn bad_state(&mut self, why: String) {
        self.report.bad_states += 1;
        if self.report.bad_state_reasons.len() < 10 {
            self.report.bad_state_reasons.push(why);
        }
    }

    fn start(&mut self, s: &pb::RecordStart) {
        if let Some(sys) = &s.system {
            self.nodes.system = nodes::system_from_pb(sys);
        }
        self.report.dropped = s.dropped;
        if self.settings.is_some() {
            return;
        }
        let mut settings = self.opts.settings.clone();
        if self.opts.each_switch {
            let global = s
                .features
                .as_ref()
                .and_then(|f| nodes::features_from_pb(f).ok())
                .unwrap_or_default();
            for name in FEATURE_NAMES {
                let flipped = Setting {
                    set: vec![(name, global.get(name) != Some(true))],
                };
                if !settings.contains(&flipped) {
                    settings.push(flipped);
                }
            }
        }
        self.report.settings = settings
            .iter()
            .map(|s| SettingStats::new(s.label()))
            .collect();
        self.settings = Some(settings);
    }

    fn decision(&mut self, d: &pb::RecordDecision) {
        let kind = decide::kind(d);
        if kind == "balance" {
            self.report.balances += 1;
            return;
        }
        let Some(recorded) = decide::recorded(d) else {
            self.bad_state(format!(
                "node {} version {}: a decision without its answer",
                d.node_id, d.version
            ));
            return;
        };
        let Some(v) = self
            .nodes
            .tracks
            .get(&d.node_id)
            .and_then(|t| t.version(d.version))
            .cloned()
        else {
            self.report.no_state += 1;
            return;
        };
        let system = self.nodes.system;
        let Some(base) = decide::decide(d, &v, v.features, &system) else {
            return;
        };
        self.report.decisions += 1;
        if base == recorded {
            self.report.reproduced += 1;
        } else if self.report.mismatches.len() < MAX_MISMATCHES {
            self.report.mismatches.push(Mismatch {
                node: d.node_id.clone(),
                version: d.version,
                kind: kind.to_string(),
                recorded: format!("{recorded:?}"),
                replayed: format!("{base:?}"),
                request: format!("{:?}", d.request),
            });
        }
        let settings = self.settings.clone().unwrap_or_default();
        let mut chosen = vec![base.cpu()];
        for (i, s) in settings.iter().enumerate() {
            let f = s.apply(v.features);
            let new = if f == v.features {
                base.clone()
            } else {
                decide::decide(d, &v, f, &system).unwrap_or_else(|| base.clone())
            };
            chosen.push(new.cpu());
            self.report.settings[i].count(kind, &base, &new);
        }
        if settings.is_empty() {
            return;
        }
        if let Some(chosen) = chosen.into_iter().collect::<Option<Vec<usize>>>() {
            let waiting = self.pending.entry(d.node_id.clone()).or_default();
            // A node that stops reporting would hold its placements for the
            // rest of the recording: beyond a bound they go unjudged.
            if waiting.len() >= MAX_WAITING {
                self.report.unjudged += 1;
                return;
            }
            let prev = decide::prev_cpu(d, &v);
            waiting.push(Pending { prev, chosen });
        }
    }

    /// A node's report: the placements made since its last are judged.
    fn judge(&mut self, node: &str, next: &nodes::Version) {
        let Some(waiting) = self.pending.remove(node) else {
            return;
        };
        let Some(spec) = self
            .nodes
            .tracks
            .get(node)
            .map(|t| std::sync::Arc::clone(&t.spec))
        else {
            return;
        };
        for p in waiting {
            for (i, s) in self.report.settings.iter_mut().enumerate() {
                s.judge(&spec, next, p.prev, p.chosen[0], p.chosen[i + 1]);
            }
        }
    }
}
