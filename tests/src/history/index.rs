//! The history indexed by lease: each lease's grant, renewals and
//! release with their proofs, and the retry floors.

use std::collections::HashMap;

use super::*;

// ---------------------------------------------------------------------------
// Index by lease

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub(super) enum Source {
    Grant,
    Listing,
    Snapshot,
}

/// Where a lease lives; the most authoritative, earliest source wins.
pub(super) struct Home<'a> {
    pub(super) node: &'a str,
    pub(super) cpus: Vec<u32>,
    pub(super) rank: (Source, Nanos),
}

/// The lease was live at some instant of `[lo, hi]`, with expiry at least `lo + ttl`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Proof {
    pub(super) lo: Nanos,
    pub(super) hi: Nanos,
    pub(super) ttl: Nanos,
    pub(super) kind: &'static str,
}

/// A call that may end the lease (release) or reset its expiry to `now + ttl`
/// (renew) at some instant at or after `invoke`; `complete` is `FOREVER` when
/// it may still apply at any later time.
#[derive(Clone, Copy, Debug)]
pub(super) struct Clip {
    pub(super) invoke: Nanos,
    pub(super) complete: Nanos,
    pub(super) ttl: Nanos,
}

#[derive(Default)]
pub(super) struct Lease<'a> {
    pub(super) home: Option<Home<'a>>,
    pub(super) creation: Option<Proof>,
    pub(super) proofs: Vec<Proof>,
    pub(super) releases: Vec<Clip>,
    pub(super) renews: Vec<Clip>,
    pub(super) released_at: Option<Nanos>,
    pub(super) probes: Vec<&'a Op>,
}

impl<'a> Lease<'a> {
    pub(super) fn offer_home(&mut self, node: &'a str, cpus: &[u32], rank: (Source, Nanos)) {
        if self.home.as_ref().is_none_or(|h| rank < h.rank) {
            self.home = Some(Home {
                node,
                cpus: sorted_cpus(cpus),
                rank,
            });
        }
    }

    /// Every proof of life, the folded creation proof included.
    pub(super) fn all_proofs(&self) -> Vec<Proof> {
        let mut v = self.proofs.clone();
        v.extend(self.creation.filter(|c| c.ttl > 0));
        v
    }
}

pub(super) struct Index<'a> {
    /// All ops, sorted by (invoke, complete), stable.
    pub(super) ops: Vec<&'a Op>,
    pub(super) leases: HashMap<u64, Lease<'a>>,
    /// Earliest possible effect among the non-Failed attempts of each (client, request id).
    pub(super) retry_floor: HashMap<(u32, &'a str), Nanos>,
}

impl<'a> Index<'a> {
    pub(super) fn build(h: &'a History) -> Self {
        let mut ops: Vec<&Op> = h.ops.iter().collect();
        ops.sort_by_key(|o| (o.invoke, o.complete));
        let mut ix = Index {
            retry_floor: retry_floors(&ops),
            ops: Vec::new(),
            leases: HashMap::new(),
        };
        for op in &ops {
            ix.absorb(op);
        }
        for s in &h.snapshots {
            for r in &s.records {
                let rank = (Source::Snapshot, s.complete);
                ix.lease(r.lease).offer_home(&r.node, &r.cpus, rank);
            }
        }
        ix.ops = ops;
        ix
    }

    pub(super) fn lease(&mut self, id: u64) -> &mut Lease<'a> {
        self.leases.entry(id).or_default()
    }

    /// Earliest instant at which the lease named by this Ok Allocate can have been created.
    pub(super) fn creation_floor(&self, op: &Op) -> Nanos {
        let rid = match &op.call {
            Call::Allocate {
                request_id: Some(r),
                ..
            } => Some(r.as_str()),
            _ => None,
        };
        let group = rid.and_then(|r| self.retry_floor.get(&(op.client, r)).copied());
        group.unwrap_or(op.invoke).min(earliest(op))
    }

    pub(super) fn absorb(&mut self, op: &'a Op) {
        match &op.call {
            Call::Allocate { ttl_ms, .. } => self.absorb_grant(op, *ttl_ms),
            Call::Renew { lease, ttl_ms } => self.absorb_renew(op, *lease, *ttl_ms),
            Call::Release { lease } => self.absorb_release(op, *lease),
            Call::Get { node } => self.absorb_get(op, node),
        }
    }

    pub(super) fn absorb_grant(&mut self, op: &'a Op, asked_ttl: u64) {
        let Effect::Applied(Answer::Granted {
            lease,
            node,
            cpus,
            ttl_ms,
        }) = effect(op)
        else {
            return;
        };
        let p = Proof {
            lo: self.creation_floor(op),
            hi: op.complete,
            ttl: ms_to_ns((*ttl_ms).min(asked_ttl)),
            kind: "grant",
        };
        let l = self.lease(*lease);
        l.offer_home(node, cpus, (Source::Grant, op.complete));
        l.creation = Some(match l.creation {
            None => p,
            Some(c) => Proof {
                lo: c.lo.min(p.lo),
                hi: c.hi.min(p.hi),
                ttl: c.ttl.min(p.ttl),
                kind: "grant",
            },
        });
    }

    pub(super) fn absorb_renew(&mut self, op: &'a Op, lease: u64, asked_ttl: u64) {
        let l = self.lease(lease);
        match effect(op) {
            Effect::Applied(a) => {
                let answered = match a {
                    Answer::Renewed { ttl_ms } => *ttl_ms,
                    _ => asked_ttl,
                };
                let ttl = ms_to_ns(answered.min(asked_ttl));
                l.renews.push(Clip {
                    invoke: op.invoke,
                    complete: op.complete,
                    ttl,
                });
                if ttl > 0 {
                    let (lo, hi, kind) = (op.invoke, op.complete, "renew");
                    l.proofs.push(Proof { lo, hi, ttl, kind });
                }
            }
            Effect::NotApplied { not_found } => {
                if not_found && well_timed(op) {
                    l.probes.push(op);
                }
            }
            Effect::Maybe => l.renews.push(Clip {
                invoke: earliest(op),
                complete: FOREVER,
                ttl: ms_to_ns(asked_ttl),
            }),
        }
    }

    pub(super) fn absorb_release(&mut self, op: &'a Op, lease: u64) {
        let l = self.lease(lease);
        match effect(op) {
            Effect::Applied(_) => {
                l.releases.push(Clip {
                    invoke: op.invoke,
                    complete: op.complete,
                    ttl: 0,
                });
                let first = l.released_at.map_or(op.complete, |t| t.min(op.complete));
                l.released_at = Some(first);
            }
            Effect::NotApplied { not_found } => {
                if not_found && well_timed(op) {
                    l.probes.push(op);
                }
            }
            Effect::Maybe => l.releases.push(Clip {
                invoke: earliest(op),
                complete: FOREVER,
                ttl: 0,
            }),
        }
    }

    pub(super) fn absorb_get(&mut self, op: &'a Op, node: &'a str) {
        let Effect::Applied(Answer::Listed { leases }) = effect(op) else {
            return;
        };
        for e in leases {
            let l = self.lease(e.lease);
            l.offer_home(node, &e.cpus, (Source::Listing, op.complete));
            if e.expires_in_ms >= 1 {
                l.proofs.push(Proof {
                    lo: op.invoke,
                    hi: op.complete,
                    ttl: ms_to_ns(e.expires_in_ms - 1),
                    kind: "listing",
                });
            }
        }
    }
}

pub(super) fn retry_floors<'a>(ops: &[&'a Op]) -> HashMap<(u32, &'a str), Nanos> {
    let mut m: HashMap<(u32, &str), Nanos> = HashMap::new();
    for op in ops {
        let Call::Allocate {
            request_id: Some(rid),
            ..
        } = &op.call
        else {
            continue;
        };
        if matches!(op.outcome, Outcome::Failed { .. }) {
            continue;
        }
        let e = m.entry((op.client, rid.as_str())).or_insert(FOREVER);
        *e = (*e).min(earliest(op));
    }
    m
}
