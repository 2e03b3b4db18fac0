//! The rules a history is checked against, one function each: double
//! grants, lost leases, resurrected leases, duplicate ids and retry
//! mismatches, overlaps in the store and at the agents, bad records.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use super::index::*;
use super::live::*;
use super::*;

// ---------------------------------------------------------------------------
// Rule 1: double_grant

#[derive(Clone, Copy)]
pub(super) struct Span {
    pub(super) start: Nanos,
    pub(super) end: Nanos,
    pub(super) lease: u64,
}

#[derive(Clone, Copy)]
pub(super) struct Witness {
    pub(super) proof: Proof,
    pub(super) lease: u64,
}

#[derive(Default)]
pub(super) struct Line {
    pub(super) spans: Vec<Span>,
    pub(super) witnesses: Vec<Witness>,
}

pub(super) struct Finding {
    pub(super) cpus: BTreeSet<u32>,
    pub(super) evidence: String,
}

pub(super) type Findings<'a> = BTreeMap<(&'a str, u64, u64), Finding>;

pub(super) fn note<'a>(
    f: &mut Findings<'a>,
    node: &'a str,
    cpu: u32,
    a: u64,
    b: u64,
    why: impl Fn() -> String,
) {
    let key = (node, a.min(b), a.max(b));
    f.entry(key)
        .or_insert_with(|| Finding {
            cpus: BTreeSet::new(),
            evidence: why(),
        })
        .cpus
        .insert(cpu);
}

pub(super) fn double_grant(ix: &Index, live: &HashMap<u64, LeaseLive>, out: &mut Vec<Violation>) {
    let mut lines: BTreeMap<(&str, u32), Line> = BTreeMap::new();
    for (&lease, l) in &ix.leases {
        let (Some(home), Some(ll)) = (&l.home, live.get(&lease)) else {
            continue;
        };
        for &cpu in &home.cpus {
            let line = lines.entry((home.node, cpu)).or_default();
            let spans = ll
                .spans
                .iter()
                .map(|&(start, end)| Span { start, end, lease });
            line.spans.extend(spans);
            let w = ll.proofs.iter().map(|&proof| Witness { proof, lease });
            line.witnesses.extend(w);
        }
    }
    let mut found = Findings::new();
    for ((node, cpu), mut line) in lines {
        line.spans.sort_by_key(|s| (s.start, s.end, s.lease));
        line.witnesses
            .sort_by_key(|w| (w.proof.lo, w.proof.hi, w.lease));
        overlapping_spans(&line.spans, node, cpu, &mut found);
        witnessed_inside(&line, node, cpu, &mut found);
    }
    for ((node, a, b), f) in found {
        out.push(Violation {
            rule: "double_grant",
            detail: format!(
                "leases {a} and {b} on node {node} both held CPUs {:?} at once: {}",
                f.cpus, f.evidence
            ),
        });
    }
}

/// Form 1: two certainly-live intervals of different leases overlap.
pub(super) fn overlapping_spans<'a>(spans: &[Span], node: &'a str, cpu: u32, f: &mut Findings<'a>) {
    let mut active: Vec<Span> = Vec::new();
    for s in spans {
        active.retain(|a| a.end > s.start);
        for a in active.iter().filter(|a| a.lease != s.lease) {
            note(f, node, cpu, a.lease, s.lease, || {
                format!(
                    "lease {} certainly live over {} and lease {} over {}",
                    a.lease,
                    half_open(a.start, a.end),
                    s.lease,
                    half_open(s.start, s.end)
                )
            });
        }
        active.push(*s);
    }
}

/// Form 2: a proof of life of one lease falls wholly inside a certainly-live
/// interval of another.
pub(super) fn witnessed_inside<'a>(line: &Line, node: &'a str, cpu: u32, f: &mut Findings<'a>) {
    let mut next = 0;
    let mut active: Vec<Span> = Vec::new();
    for w in &line.witnesses {
        let p = w.proof;
        while let Some(s) = line.spans.get(next) {
            if s.start >= p.lo {
                break;
            }
            active.push(*s);
            next += 1;
        }
        active.retain(|a| a.end > p.lo);
        for a in active.iter().filter(|a| a.lease != w.lease && a.end > p.hi) {
            note(f, node, cpu, a.lease, w.lease, || {
                format!(
                    "lease {} proven live by its {} within {} while lease {} was certainly live over {}",
                    w.lease,
                    p.kind,
                    window(p.lo, p.hi),
                    a.lease,
                    half_open(a.start, a.end)
                )
            });
        }
    }
}

// ---------------------------------------------------------------------------
// Rule 2: lost_lease

pub(super) fn lost_lease(ix: &Index, live: &HashMap<u64, LeaseLive>, out: &mut Vec<Violation>) {
    let mut probes: Vec<(&Op, u64, (Nanos, Nanos))> = Vec::new();
    for (&lease, l) in &ix.leases {
        let Some(ll) = live.get(&lease) else {
            continue;
        };
        for op in &l.probes {
            if let Some(span) = containing(&ll.spans, op.invoke, op.complete) {
                probes.push((op, lease, span));
            }
        }
    }
    probes.sort_by_key(|(op, lease, _)| (op.invoke, op.complete, *lease));
    for (op, lease, (s, e)) in probes {
        let what = match op.call {
            Call::Renew { .. } => "renew",
            _ => "release",
        };
        out.push(Violation {
            rule: "lost_lease",
            detail: format!(
                "{what} of lease {lease} ({}) answered NOT_FOUND while the lease was certainly live over {}",
                op_time(op),
                half_open(s, e)
            ),
        });
    }
    omitted_by_get(ix, live, out);
}

/// An Ok Get that does not list a lease of its node certainly live over the whole call.
pub(super) fn omitted_by_get(ix: &Index, live: &HashMap<u64, LeaseLive>, out: &mut Vec<Violation>) {
    let mut spans: HashMap<&str, Vec<Span>> = HashMap::new();
    for (&lease, l) in &ix.leases {
        let (Some(home), Some(ll)) = (&l.home, live.get(&lease)) else {
            continue;
        };
        let v = spans.entry(home.node).or_default();
        v.extend(
            ll.spans
                .iter()
                .map(|&(start, end)| Span { start, end, lease }),
        );
    }
    for v in spans.values_mut() {
        v.sort_by_key(|s| (s.start, s.end, s.lease));
    }
    let mut cursors: HashMap<&str, (usize, Vec<Span>)> = HashMap::new();
    for op in &ix.ops {
        let (Call::Get { node }, Effect::Applied(Answer::Listed { leases })) =
            (&op.call, effect(op))
        else {
            continue;
        };
        let Some(all) = spans.get(node.as_str()) else {
            continue;
        };
        let (next, active) = cursors.entry(node.as_str()).or_default();
        while let Some(s) = all.get(*next) {
            if s.start >= op.invoke {
                break;
            }
            active.push(*s);
            *next += 1;
        }
        active.retain(|a| a.end > op.invoke);
        let listed: HashSet<u64> = leases.iter().map(|e| e.lease).collect();
        for a in active.iter().filter(|a| a.end > op.complete) {
            if !listed.contains(&a.lease) {
                out.push(Violation {
                    rule: "lost_lease",
                    detail: format!(
                        "get on node {node} ({}) did not list lease {}, certainly live over {}",
                        op_time(op),
                        a.lease,
                        half_open(a.start, a.end)
                    ),
                });
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Rule 3: resurrected

pub(super) fn resurrected(ix: &Index, out: &mut Vec<Violation>) {
    let released = |lease: u64| ix.leases.get(&lease).and_then(|l| l.released_at);
    let mut say = |detail: String| {
        out.push(Violation {
            rule: "resurrected",
            detail,
        })
    };
    for op in &ix.ops {
        let Effect::Applied(answer) = effect(op) else {
            continue;
        };
        match (&op.call, answer) {
            (Call::Renew { lease, .. }, _) => {
                if let Some(r) = released(*lease).filter(|&r| op.invoke > r) {
                    say(format!(
                        "renew of lease {lease} ({}) succeeded after its release was acknowledged at {}",
                        op_time(op),
                        fmt_t(r)
                    ));
                }
            }
            (Call::Get { node }, Answer::Listed { leases }) => {
                for e in leases {
                    if let Some(r) = released(e.lease).filter(|&r| op.invoke > r) {
                        say(format!(
                            "get on node {node} ({}) listed lease {} whose release was acknowledged at {}",
                            op_time(op),
                            e.lease,
                            fmt_t(r)
                        ));
                    }
                }
            }
            (Call::Allocate { .. }, Answer::Granted { lease, node, .. }) => {
                let floor = ix.creation_floor(op);
                if let Some(r) = released(*lease).filter(|&r| floor > r) {
                    say(format!(
                        "allocate ({}) granted lease {lease} on node {node}, released at {} before any attempt that could create it (first at {})",
                        op_time(op),
                        fmt_t(r),
                        fmt_t(floor)
                    ));
                }
            }
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------
// Rule 4: duplicate_id and retry_mismatch

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Key<'a> {
    Retry(u32, &'a str),
    Single(usize),
}

pub(super) struct GrantSeen<'a> {
    pub(super) key: Key<'a>,
    pub(super) op: &'a Op,
    pub(super) node: &'a str,
    pub(super) cpus: Vec<u32>,
}

pub(super) fn duplicate_ids(ix: &Index, out: &mut Vec<Violation>) {
    let mut by_lease: BTreeMap<u64, Vec<GrantSeen>> = BTreeMap::new();
    let mut by_key: BTreeMap<(u32, &str), BTreeMap<u64, &Op>> = BTreeMap::new();
    for (i, op) in ix.ops.iter().enumerate() {
        let (
            Call::Allocate { request_id, .. },
            Outcome::Ok(Answer::Granted {
                lease, node, cpus, ..
            }),
        ) = (&op.call, &op.outcome)
        else {
            continue;
        };
        let key = match request_id {
            Some(r) => {
                let seen = by_key.entry((op.client, r.as_str())).or_default();
                seen.entry(*lease).or_insert(op);
                Key::Retry(op.client, r.as_str())
            }
            None => Key::Single(i),
        };
        let cpus = sorted_cpus(cpus);
        by_lease.entry(*lease).or_default().push(GrantSeen {
            key,
            op,
            node,
            cpus,
        });
    }
    for (lease, seen) in &by_lease {
        same_lease_grants(*lease, seen, out);
    }
    for ((client, rid), leases) in by_key.iter().filter(|(_, l)| l.len() > 1) {
        let list: Vec<String> = leases
            .iter()
            .map(|(l, op)| format!("lease {l} ({})", op_time(op)))
            .collect();
        out.push(Violation {
            rule: "retry_mismatch",
            detail: format!(
                "client {client} request_id {rid:?} was answered with different leases: {}",
                list.join(", ")
            ),
        });
    }
}

pub(super) fn same_lease_grants(lease: u64, seen: &[GrantSeen], out: &mut Vec<Violation>) {
    let keys: BTreeSet<Key> = seen.iter().map(|g| g.key).collect();
    let describe = |g: &GrantSeen| match g.key {
        Key::Retry(_, rid) => format!("{} request_id {rid:?} on {}", op_time(g.op), g.node),
        Key::Single(_) => format!("{} on {}", op_time(g.op), g.node),
    };
    if keys.len() > 1 {
        let list: Vec<String> = seen.iter().map(describe).collect();
        out.push(Violation {
            rule: "duplicate_id",
            detail: format!(
                "lease {lease} granted by independent allocates: {}",
                list.join("; ")
            ),
        });
    }
    for key in keys {
        let group: Vec<&GrantSeen> = seen.iter().filter(|g| g.key == key).collect();
        let Some(first) = group.first() else {
            continue;
        };
        if let Some(other) = group
            .iter()
            .find(|g| g.node != first.node || g.cpus != first.cpus)
        {
            out.push(Violation {
                rule: "retry_mismatch",
                detail: format!(
                    "retries answered lease {lease} differently: {} CPUs {:?} vs {} CPUs {:?}",
                    describe(first),
                    first.cpus,
                    describe(other),
                    other.cpus
                ),
            });
        }
    }
}

// ---------------------------------------------------------------------------
// Rule 5: store_overlap

pub(super) fn store_overlap(h: &History, out: &mut Vec<Violation>) {
    for s in &h.snapshots {
        let mut owner: HashMap<(&str, u32), u64> = HashMap::new();
        let mut pairs: BTreeMap<(&str, u64, u64), BTreeSet<u32>> = BTreeMap::new();
        for r in &s.records {
            for &cpu in &r.cpus {
                match owner.get(&(r.node.as_str(), cpu)) {
                    Some(&other) if other != r.lease => {
                        let key = (r.node.as_str(), other.min(r.lease), other.max(r.lease));
                        pairs.entry(key).or_default().insert(cpu);
                    }
                    Some(_) => {}
                    None => {
                        owner.insert((r.node.as_str(), cpu), r.lease);
                    }
                }
            }
        }
        for ((node, a, b), cpus) in pairs {
            out.push(Violation {
                rule: "store_overlap",
                detail: format!(
                    "snapshot at {} holds leases {a} and {b} on node {node} sharing CPUs {cpus:?}",
                    window(s.invoke, s.complete)
                ),
            });
        }
    }
}

// ---------------------------------------------------------------------------
// Rule 6: agent_overlap

#[derive(Default)]
pub(super) struct AgentView {
    pub(super) held: HashMap<u64, Vec<u32>>,
    pub(super) owners: HashMap<u32, Vec<u64>>,
}

impl AgentView {
    pub(super) fn drop_lease(&mut self, lease: u64) {
        for cpu in self.held.remove(&lease).unwrap_or_default() {
            if let Some(v) = self.owners.get_mut(&cpu) {
                v.retain(|&l| l != lease);
            }
        }
    }

    /// Adds a lease, returning the other leases it now shares CPUs with.
    pub(super) fn add(&mut self, lease: u64, cpus: &[u32]) -> BTreeMap<u64, BTreeSet<u32>> {
        self.drop_lease(lease);
        let cpus = sorted_cpus(cpus);
        let mut clash: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
        for &cpu in &cpus {
            let v = self.owners.entry(cpu).or_default();
            for &other in v.iter() {
                clash.entry(other).or_default().insert(cpu);
            }
            v.push(lease);
        }
        self.held.insert(lease, cpus);
        clash
    }
}

pub(super) fn agent_overlap(h: &History, out: &mut Vec<Violation>) {
    let mut by_node: BTreeMap<&str, Vec<&AgentEvent>> = BTreeMap::new();
    for e in &h.agents {
        by_node.entry(e.node.as_str()).or_default().push(e);
    }
    for (node, mut events) in by_node {
        events.sort_by_key(|e| e.at);
        let mut view = AgentView::default();
        for e in events {
            let mut added: Vec<(u64, BTreeMap<u64, BTreeSet<u32>>)> = Vec::new();
            match &e.what {
                AgentWhat::Grant { lease, cpus } => added.push((*lease, view.add(*lease, cpus))),
                AgentWhat::Release { lease } => view.drop_lease(*lease),
                AgentWhat::Reset { leases } => {
                    view = AgentView::default();
                    for (lease, cpus) in leases {
                        added.push((*lease, view.add(*lease, cpus)));
                    }
                }
            }
            for (lease, clash) in added {
                for (other, cpus) in clash {
                    out.push(Violation {
                        rule: "agent_overlap",
                        detail: format!(
                            "agent of node {node} at {} held lease {lease} and lease {other} sharing CPUs {cpus:?}",
                            fmt_t(e.at)
                        ),
                    });
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Rule 7: bad_record

pub(super) fn hygiene(h: &History, ix: &Index, out: &mut Vec<Violation>) {
    let mut say = |detail: String| {
        out.push(Violation {
            rule: "bad_record",
            detail,
        })
    };
    for op in &ix.ops {
        if !well_timed(op) {
            say(format!(
                "{:?} by {} completes before it was invoked",
                op.call,
                op_time(op)
            ));
        }
        let Outcome::Ok(answer) = &op.outcome else {
            continue;
        };
        if !answer_fits(&op.call, answer) {
            say(format!(
                "{:?} by {} answered with {answer:?}",
                op.call,
                op_time(op)
            ));
            continue;
        }
        if let (Call::Allocate { node: asked, .. }, Answer::Granted { lease, node, .. }) =
            (&op.call, answer)
            && !asked.is_empty()
            && asked != node
        {
            say(format!(
                "allocate on node {asked} ({}) granted lease {lease} on node {node}",
                op_time(op)
            ));
        }
    }
    for s in h.snapshots.iter().filter(|s| s.complete < s.invoke) {
        say(format!(
            "snapshot completes before it was invoked: {}",
            window(s.invoke, s.complete)
        ));
    }
}
