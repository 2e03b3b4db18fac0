//! When each lease was certainly live: the intervals in which every
//! correct linearization has it held.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::index::*;
use super::*;

// ---------------------------------------------------------------------------
// Certainly-live intervals

pub(super) struct LeaseLive {
    /// Disjoint, sorted half-open intervals `[start, end)`.
    pub(super) spans: Vec<(Nanos, Nanos)>,
    pub(super) proofs: Vec<Proof>,
}

/// Answers "how soon after a proof with window start `lo` may the lease end?"
pub(super) struct Clippers {
    /// Releases sorted by invoke, with the running max of their completes.
    pub(super) rel_invoke: Vec<Nanos>,
    pub(super) rel_reach: Vec<Nanos>,
    /// Renewals sorted by invoke, and the suffix minima of `invoke + ttl`.
    pub(super) renews: Vec<Clip>,
    pub(super) renew_floor: Vec<Nanos>,
}

impl Clippers {
    pub(super) fn new(l: &Lease) -> Self {
        let mut rel = l.releases.clone();
        rel.sort_by_key(|c| c.invoke);
        let rel_reach = rel
            .iter()
            .scan(0, |m, c| {
                *m = c.complete.max(*m);
                Some(*m)
            })
            .collect();
        let mut renews = l.renews.clone();
        renews.sort_by_key(|c| c.invoke);
        let mut renew_floor = vec![FOREVER; renews.len() + 1];
        for (i, c) in renews.iter().enumerate().rev() {
            let next = renew_floor.get(i + 1).copied().unwrap_or(FOREVER);
            if let Some(slot) = renew_floor.get_mut(i) {
                *slot = next.min(c.invoke.saturating_add(c.ttl));
            }
        }
        Clippers {
            rel_invoke: rel.iter().map(|c| c.invoke).collect(),
            rel_reach,
            renews,
            renew_floor,
        }
    }

    /// A release invoked before `lo` that may still apply after `lo` can end
    /// the lease right at the proof; otherwise the first one invoked later can.
    pub(super) fn release_end(&self, lo: Nanos) -> Nanos {
        let i = self.rel_invoke.partition_point(|&t| t < lo);
        let reach = i.checked_sub(1).and_then(|j| self.rel_reach.get(j));
        if reach.is_some_and(|&c| c >= lo) {
            return lo;
        }
        self.rel_invoke.get(i).copied().unwrap_or(FOREVER)
    }

    /// Renewals invoked at or after `lo` (all kept: extra clipping is only conservative).
    pub(super) fn later_renew_end(&self, lo: Nanos) -> Nanos {
        let i = self.renews.partition_point(|c| c.invoke < lo);
        self.renew_floor.get(i).copied().unwrap_or(FOREVER)
    }
}

/// Renewals invoked before a proof's `lo` that may still apply after it
/// shorten the lease to at least `lo + ttl`; proofs must be fed in `lo` order.
pub(super) struct StraddlingRenews<'c> {
    pub(super) renews: &'c [Clip],
    pub(super) next: usize,
    pub(super) heap: BinaryHeap<Reverse<(Nanos, Nanos)>>,
}

impl StraddlingRenews<'_> {
    pub(super) fn end(&mut self, lo: Nanos) -> Nanos {
        while let Some(r) = self.renews.get(self.next) {
            if r.invoke >= lo {
                break;
            }
            self.heap.push(Reverse((r.ttl, r.complete)));
            self.next += 1;
        }
        // A renewal that completed before `lo` stays irrelevant for every later proof.
        while let Some(Reverse((_, complete))) = self.heap.peek() {
            if *complete >= lo {
                break;
            }
            self.heap.pop();
        }
        self.heap
            .peek()
            .map_or(FOREVER, |Reverse((ttl, _))| lo.saturating_add(*ttl))
    }
}

pub(super) fn certainly_live(l: &Lease) -> LeaseLive {
    let mut proofs = l.all_proofs();
    proofs.sort_by_key(|p| (p.lo, p.hi));
    let clips = Clippers::new(l);
    let mut straddling = StraddlingRenews {
        renews: &clips.renews,
        next: 0,
        heap: BinaryHeap::new(),
    };
    let mut spans = Vec::new();
    for p in &proofs {
        let end =
            p.lo.saturating_add(p.ttl)
                .min(clips.release_end(p.lo))
                .min(clips.later_renew_end(p.lo))
                .min(straddling.end(p.lo));
        if p.hi < end {
            spans.push((p.hi, end));
        }
    }
    LeaseLive {
        spans: merge(spans),
        proofs,
    }
}

pub(super) fn merge(mut v: Vec<(Nanos, Nanos)>) -> Vec<(Nanos, Nanos)> {
    v.sort_unstable();
    let mut out: Vec<(Nanos, Nanos)> = Vec::with_capacity(v.len());
    for (s, e) in v {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    out
}

/// The certainly-live span strictly containing `[lo, hi]`, if any.
pub(super) fn containing(spans: &[(Nanos, Nanos)], lo: Nanos, hi: Nanos) -> Option<(Nanos, Nanos)> {
    let i = spans.partition_point(|s| s.0 < lo);
    let s = *spans.get(i.checked_sub(1)?)?;
    (s.1 > hi).then_some(s)
}
