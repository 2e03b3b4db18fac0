//! Safety checker for recorded histories of the distributed CPU-lease service.
//!
//! # What this module owns
//!
//! One question: given everything a test run recorded (every client call
//! with its invoke and complete times and its outcome, snapshots of the
//! durable store, and the event stream each node agent was fed), is there
//! *proof* that the service broke one of its safety promises? [`check`]
//! answers with a list of [`Violation`]s, each naming a rule, and
//! [`summarize`] condenses a run for a report. The module does not search
//! for a linearization of the whole history (that is exponential in the
//! number of uncertain calls). Instead every rule is a short local argument
//! that holds for *every* linearization a correct service could have chosen.
//! That makes the checker sound (a reported violation is real) but
//! incomplete (some real bugs can slip through). When a rule had to choose
//! between catching more and never crying wolf, it chose never crying wolf.
//!
//! # Model and assumptions
//!
//! All rules are relative to this model of a correct service:
//!
//! * A call answered Ok took effect at one instant inside `[invoke, complete]`.
//!   A Failed call never took effect. An Unknown call took effect at some
//!   instant at or after `invoke` (possibly after `complete`), or never.
//! * The test's monotonic clock and the service's lease clock advance at the
//!   same rate. A lease is live from the instant it is created until the
//!   earlier of its expiry and its release. Allocate sets expiry to creation
//!   plus ttl. Renew sets expiry to "now" plus ttl, which can *shorten* a
//!   lease as well as extend it. The ttl applied is the one requested; an Ok
//!   answer reports it, and when the two differ the smaller is used.
//! * Lease ids are never reused. Renew and Release of a lease that does not
//!   exist answer NOT_FOUND, so an Ok Release means the lease existed.
//! * An Allocate retried by the same client with the same request id is
//!   idempotent: it may replay the original answer (even after that lease has
//!   ended) and has no further effect. Clients never share request ids.
//! * Get returns exactly the node's live leases at one instant. Its
//!   `expires_in_ms` may be rounded by less than a millisecond either way, so
//!   the checker subtracts one millisecond from it and takes a listing as
//!   proof of life only when `expires_in_ms >= 1`.
//! * An agent's event stream reports every end of a lease it holds (release
//!   or expiry) as a Release event, in the order the agent was told.
//! * A call whose `complete < invoke`, or whose Ok answer is of the wrong
//!   kind, is reported (`bad_record`) and never used as evidence that
//!   something happened at some time. It is still assumed that it may have
//!   ended or shortened its lease at any time after the earlier of its two
//!   timestamps, because dropping a possible release could invent overlaps.
//!
//! # Certainly-live intervals (used by rules 1 and 2)
//!
//! A *proof of life* is an Ok Granted answer, an Ok Renewed answer, or an Ok
//! Get listing a lease. Each proof has a window `[lo, hi]` containing an
//! instant at which the lease was live, and a floor on the expiry it set,
//! `lo + ttl`. For a listing the window is the Get's, and the ttl is
//! `expires_in - 1 ms`. For a renewal the window is the call's, and the ttl is
//! the applied one. For a grant, an idempotent retry may only replay an old
//! answer. So every Ok grant of the lease is folded into one proof: `lo` is the
//! earliest invoke among the calls that could have created it (for a request
//! id, every non-Failed attempt of that client and id), `hi` is the earliest
//! complete of an Ok grant, and the ttl is the smallest requested or answered.
//!
//! From a proof the lease is certainly live over `[hi, end)`. Here `end` is
//! the smallest of:
//!
//! * `lo + ttl`;
//! * for every non-Failed Release that could take effect after the proof (it
//!   is Unknown, or it completed at or after `lo`): `max(release.invoke, lo)`.
//!   The proof's instant is at or after `lo` and the release's is at or after
//!   its invoke. A release that completed before `lo` took effect before the
//!   proof, and a correct service would then not have given it;
//! * for every non-Failed Renew that could take effect after the proof:
//!   `max(renew.invoke, lo) + renew ttl`, because a later renewal with a
//!   shorter ttl moves the expiry *earlier*. Without this, a long grant
//!   followed by a short renewal would give a false overlap.
//!
//! If `hi >= end` the interval is empty. Since a lease that is live at the
//! proof's instant stays live until its expiry or release, every instant of
//! `[hi, end)` lies after the proof's instant, before any possible release,
//! and before any possible expiry. A lease's intervals are merged; touching
//! half-open intervals cover no gap.
//!
//! # Rules
//!
//! 1. `double_grant`: two different leases on the same node that share a CPU
//!    are both proven live at one instant. *Form 1:* their certainly-live
//!    intervals overlap over a positive length. *Form 2:* one lease has a
//!    proof of life whose whole window `[lo, hi]` lies strictly inside a
//!    certainly-live interval of the other. The proof fixes one instant in
//!    the window when the first lease was live, and the second lease was
//!    live at every instant of the window. Form 2 catches the case where a
//!    listing proves a lease live only at a point: for example, its release
//!    is Unknown and was invoked before the Get, so its interval is empty.
//!    Strict inequalities avoid reasoning about several calls in one
//!    nanosecond.
//! 2. `lost_lease`: the store lost a lease that was certainly live. A Renew or
//!    Release answered NOT_FOUND, or an Ok Get on the lease's node that does
//!    not list it, whose whole window lies strictly inside a certainly-live
//!    interval of the lease. The call took effect inside its window, when
//!    the lease certainly existed. Only proofs that completed before the call
//!    began can produce such an interval, and every such grant, renewal and
//!    listing counts. A Release invoked before the call completed (Ok or
//!    Unknown) ends the interval before the call does, so it suppresses the
//!    finding. Shortening renewals and replayed retries are accounted for,
//!    so a single `max(invoke + ttl)` bound would be unsound here.
//! 3. `resurrected`: a Renew answered Ok, or a Get listing the lease, invoked
//!    after an Ok Release of that lease completed. The release took effect
//!    before the call began, and ids are not reused. Also an Ok Allocate
//!    answering with a lease released before *every* attempt that could have
//!    created it was invoked (for a request id, all the client's
//!    non-Failed attempts with it). A retry may legitimately replay an old
//!    answer, so only the first attempt's invoke time is evidence.
//! 4. `duplicate_id`: two Ok Allocate answers with the same lease id, unless
//!    both come from the same client with the same request id. Since ids are
//!    unique, two independent grants cannot name the same lease.
//!    `retry_mismatch`: answers for one (client, request id) that name
//!    different leases, or the same lease on different nodes or CPUs. An
//!    idempotent call has exactly one result.
//! 5. `store_overlap`: one snapshot holds two different leases of one node
//!    sharing a CPU. A snapshot is a consistent read at one instant, and the
//!    store must never hold such a pair, whether or not the leases are still
//!    live. Duplicate records of the same lease are not overlaps.
//! 6. `agent_overlap`: replaying a node's agent events in time order (ties in
//!    recorded order), the agent at some point holds two leases sharing a CPU.
//!    A Grant of a lease already held replaces it, a Reset replaces
//!    everything, and a Release of an unknown lease is ignored. Because the
//!    stream reports every lease end, the agent's view must always be
//!    exclusive. Each conflict is reported when it appears.
//! 7. `bad_record`: input hygiene, not a service bug. It covers an op or
//!    snapshot whose `complete < invoke`, an Ok answer of the wrong kind for
//!    its call, and a Granted answer on another node than the Allocate named
//!    (an empty node means "any").
//!
//! # Cost
//!
//! The history is indexed by lease and by node. Per lease, the clipping
//! bounds are answered by binary searches over prefix or suffix extrema, plus
//! a heap swept in time order for renewals that straddle a proof. Rule 1 and
//! the Get half of rule 2 sweep intervals sorted per (node, CPU) or per node.
//! The sweep's active set holds only the leases live at once, so a correct
//! history is checked in `O(n log n)`.

use std::collections::HashMap;

mod index;
mod live;
mod rules;

use index::Index;
use live::{LeaseLive, certainly_live};
use rules::{
    agent_overlap, double_grant, duplicate_ids, hygiene, lost_lease, resurrected, store_overlap,
};

/// Monotonic nanoseconds since the test began.
pub type Nanos = u64;

/// Everything one test run recorded.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct History {
    pub ops: Vec<Op>,
    pub snapshots: Vec<Snapshot>,
    pub agents: Vec<AgentEvent>,
}

/// One client call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Op {
    pub client: u32,
    pub invoke: Nanos,
    pub complete: Nanos,
    pub call: Call,
    pub outcome: Outcome,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Allocate {
        node: String,
        count: u32,
        ttl_ms: u64,
        request_id: Option<String>,
    },
    Renew {
        lease: u64,
        ttl_ms: u64,
    },
    Release {
        lease: u64,
    },
    Get {
        node: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Allocate: the lease; Renew: its ttl; Release: nothing; Get: the leases listed.
    Ok(Answer),
    /// Certainly not applied; `not_found` is true for NOT_FOUND (the lease did not exist at that moment).
    Failed {
        not_found: bool,
        message: String,
    },
    Unknown {
        message: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Granted {
        lease: u64,
        node: String,
        cpus: Vec<u32>,
        ttl_ms: u64,
    },
    Renewed {
        ttl_ms: u64,
    },
    Released,
    Listed {
        leases: Vec<Listed>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    pub lease: u64,
    pub cpus: Vec<u32>,
    pub expires_in_ms: u64,
}

/// A consistent read of the durable store, taken at one instant of `[invoke, complete]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub invoke: Nanos,
    pub complete: Nanos,
    pub records: Vec<Record>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub node: String,
    pub lease: u64,
    pub cpus: Vec<u32>,
}

/// One thing a node agent was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentEvent {
    pub node: String,
    pub at: Nanos,
    pub what: AgentWhat,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentWhat {
    Grant { lease: u64, cpus: Vec<u32> },
    Release { lease: u64 },
    Reset { leases: Vec<(u64, Vec<u32>)> },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub rule: &'static str,
    /// Names the leases, nodes, CPUs and op times involved.
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    pub operations: usize,
    pub unknown: usize,
    pub violations: usize,
}

/// Checks every rule of the module documentation; the result is ordered by
/// rule, then deterministically within a rule.
pub fn check(h: &History) -> Vec<Violation> {
    let mut out = Vec::new();
    let ix = Index::build(h);
    hygiene(h, &ix, &mut out);
    let live: HashMap<u64, LeaseLive> = ix
        .leases
        .iter()
        .map(|(id, l)| (*id, certainly_live(l)))
        .collect();
    double_grant(&ix, &live, &mut out);
    lost_lease(&ix, &live, &mut out);
    resurrected(&ix, &mut out);
    duplicate_ids(&ix, &mut out);
    store_overlap(h, &mut out);
    agent_overlap(h, &mut out);
    out
}

pub fn summarize(h: &History, v: &[Violation]) -> Summary {
    Summary {
        operations: h.ops.len(),
        unknown: h
            .ops
            .iter()
            .filter(|o| matches!(o.outcome, Outcome::Unknown { .. }))
            .count(),
        violations: v.len(),
    }
}

// ---------------------------------------------------------------------------
// Small helpers

const NS_PER_MS: u64 = 1_000_000;
const FOREVER: Nanos = Nanos::MAX;

fn ms_to_ns(ms: u64) -> Nanos {
    ms.saturating_mul(NS_PER_MS)
}

fn fmt_t(t: Nanos) -> String {
    if t == FOREVER {
        return "forever".to_string();
    }
    format!("{}.{:09}s", t / 1_000_000_000, t % 1_000_000_000)
}

fn window(lo: Nanos, hi: Nanos) -> String {
    format!("[{}, {}]", fmt_t(lo), fmt_t(hi))
}

fn half_open(lo: Nanos, hi: Nanos) -> String {
    format!("[{}, {})", fmt_t(lo), fmt_t(hi))
}

fn op_time(op: &Op) -> String {
    format!("client {} at {}", op.client, window(op.invoke, op.complete))
}

fn well_timed(op: &Op) -> bool {
    op.complete >= op.invoke
}

/// The earliest instant a call can have taken effect even if its timestamps are swapped.
fn earliest(op: &Op) -> Nanos {
    op.invoke.min(op.complete)
}

fn sorted_cpus(cpus: &[u32]) -> Vec<u32> {
    let mut c = cpus.to_vec();
    c.sort_unstable();
    c.dedup();
    c
}

fn answer_fits(call: &Call, answer: &Answer) -> bool {
    matches!(
        (call, answer),
        (Call::Allocate { .. }, Answer::Granted { .. })
            | (Call::Renew { .. }, Answer::Renewed { .. })
            | (Call::Release { .. }, Answer::Released)
            | (Call::Get { .. }, Answer::Listed { .. })
    )
}

/// What an op may be relied on to have done.
enum Effect<'a> {
    /// Took effect inside its (well-ordered) window, with this answer.
    Applied(&'a Answer),
    NotApplied {
        not_found: bool,
    },
    /// May have taken effect at any time after `earliest(op)`, or never.
    Maybe,
}

fn effect(op: &Op) -> Effect<'_> {
    match &op.outcome {
        Outcome::Ok(a) if well_timed(op) && answer_fits(&op.call, a) => Effect::Applied(a),
        Outcome::Failed { not_found, .. } => Effect::NotApplied {
            not_found: *not_found,
        },
        _ => Effect::Maybe,
    }
}

// ---------------------------------------------------------------------------

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const S: u64 = 1_000; // one second, in ms

    fn t(ms: u64) -> Nanos {
        ms * NS_PER_MS
    }

    fn op(client: u32, invoke_ms: u64, complete_ms: u64, call: Call, outcome: Outcome) -> Op {
        Op {
            client,
            invoke: t(invoke_ms),
            complete: t(complete_ms),
            call,
            outcome,
        }
    }

    fn alloc(node: &str, count: u32, ttl_ms: u64) -> Call {
        Call::Allocate {
            node: node.into(),
            count,
            ttl_ms,
            request_id: None,
        }
    }

    fn alloc_rid(node: &str, count: u32, ttl_ms: u64, rid: &str) -> Call {
        Call::Allocate {
            node: node.into(),
            count,
            ttl_ms,
            request_id: Some(rid.into()),
        }
    }

    fn renew(lease: u64, ttl_ms: u64) -> Call {
        Call::Renew { lease, ttl_ms }
    }

    fn release(lease: u64) -> Call {
        Call::Release { lease }
    }

    fn get(node: &str) -> Call {
        Call::Get { node: node.into() }
    }

    fn granted(lease: u64, node: &str, cpus: &[u32], ttl_ms: u64) -> Outcome {
        Outcome::Ok(Answer::Granted {
            lease,
            node: node.into(),
            cpus: cpus.to_vec(),
            ttl_ms,
        })
    }

    fn renewed(ttl_ms: u64) -> Outcome {
        Outcome::Ok(Answer::Renewed { ttl_ms })
    }

    fn released() -> Outcome {
        Outcome::Ok(Answer::Released)
    }

    fn listed(leases: &[(u64, &[u32], u64)]) -> Outcome {
        Outcome::Ok(Answer::Listed {
            leases: leases
                .iter()
                .map(|&(lease, cpus, expires_in_ms)| Listed {
                    lease,
                    cpus: cpus.to_vec(),
                    expires_in_ms,
                })
                .collect(),
        })
    }

    fn unknown() -> Outcome {
        Outcome::Unknown {
            message: "deadline exceeded".into(),
        }
    }

    fn not_found() -> Outcome {
        Outcome::Failed {
            not_found: true,
            message: "NOT_FOUND".into(),
        }
    }

    fn ops(ops: Vec<Op>) -> History {
        History {
            ops,
            ..History::default()
        }
    }

    fn rules(h: &History) -> BTreeSet<&'static str> {
        let v = check(h);
        for x in &v {
            println!("{}: {}", x.rule, x.detail);
        }
        v.iter().map(|x| x.rule).collect()
    }

    fn set(r: &[&'static str]) -> BTreeSet<&'static str> {
        r.iter().copied().collect()
    }

    const C0_3: &[u32] = &[0, 1, 2, 3];

    // ----- clean histories

    #[test]
    fn clean_grant_renew_release_then_regrant() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(1, 5 * S, 5 * S + 5, renew(1, 10 * S), renewed(10 * S)),
            op(1, 6 * S, 6 * S + 5, get("n1"), listed(&[(1, C0_3, 9_000)])),
            op(1, 8 * S, 8 * S + 5, release(1), released()),
            op(
                2,
                9 * S,
                9 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(2, "n1", C0_3, 10 * S),
            ),
            op(
                2,
                10 * S,
                10 * S + 5,
                get("n1"),
                listed(&[(2, C0_3, 9_000)]),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_unknown_release_then_regrant() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(1, 2 * S, 3 * S, release(1), unknown()),
            op(
                2,
                4 * S,
                4 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(2, "n1", C0_3, 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_unknown_renew() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(1, 5 * S, 6 * S, renew(1, 10 * S), unknown()),
            op(1, 7 * S, 7 * S + 5, get("n1"), listed(&[(1, C0_3, 8_000)])),
            // Expired at 10 s if the renewal never applied; regranting later is fine.
            op(
                2,
                16 * S,
                16 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(2, "n1", C0_3, 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_expiry_then_regrant() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 2 * S),
                granted(1, "n1", C0_3, 2 * S),
            ),
            op(
                2,
                3 * S,
                3 * S + 5,
                alloc("n1", 4, 2 * S),
                granted(2, "n1", C0_3, 2 * S),
            ),
            op(3, 4 * S, 4 * S + 5, get("n1"), listed(&[(2, C0_3, 1_000)])),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_concurrent_allocations_on_different_cpus() {
        let h = ops(vec![
            op(
                1,
                0,
                10,
                alloc("n1", 2, 10 * S),
                granted(1, "n1", &[0, 1], 10 * S),
            ),
            op(
                2,
                1,
                9,
                alloc("n1", 2, 10 * S),
                granted(2, "n1", &[2, 3], 10 * S),
            ),
            op(
                3,
                20,
                30,
                get("n1"),
                listed(&[(1, &[0, 1], 9_990), (2, &[2, 3], 9_990)]),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_idempotent_retry_same_lease() {
        let h = ops(vec![
            op(1, 0, 3 * S, alloc_rid("n1", 4, 10 * S, "r1"), unknown()),
            op(
                1,
                3 * S,
                3 * S + 5,
                alloc_rid("n1", 4, 10 * S, "r1"),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(
                1,
                4 * S,
                4 * S + 5,
                alloc_rid("n1", 4, 10 * S, "r1"),
                granted(1, "n1", C0_3, 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_retry_replay_after_original_expired() {
        // The first attempt created lease 1 at ~0 s (ttl 1 s); the retry at 5 s
        // replays that answer. Lease 2 on the same CPUs from 2 s is correct.
        let h = ops(vec![
            op(1, 0, 4 * S, alloc_rid("n1", 4, S, "r1"), unknown()),
            op(
                2,
                2 * S,
                2 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(2, "n1", C0_3, 10 * S),
            ),
            op(
                1,
                5 * S,
                5 * S + 5,
                alloc_rid("n1", 4, S, "r1"),
                granted(1, "n1", C0_3, S),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_get_omits_lease_with_unknown_release() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(1, 2 * S, 3 * S, release(1), unknown()),
            op(2, 4 * S, 4 * S + 5, get("n1"), listed(&[])),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_shortening_renewal_then_regrant() {
        // A renewal can shorten a lease: expiry moves from 10 s to ~2 s.
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(1, S, S + 5, renew(1, S), renewed(S)),
            op(
                2,
                3 * S,
                3 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(2, "n1", C0_3, 10 * S),
            ),
            op(1, 4 * S, 4 * S + 5, renew(1, S), not_found()),
            op(3, 5 * S, 5 * S + 5, get("n1"), listed(&[(2, C0_3, 8_000)])),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn clean_ops_out_of_order_in_vector() {
        let h = ops(vec![
            op(
                2,
                9 * S,
                9 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(2, "n1", C0_3, 10 * S),
            ),
            op(1, 8 * S, 8 * S + 5, release(1), released()),
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&[]));
    }

    // ----- planted violations

    /// The real bug: the Get at 6 s lists L3 (release Unknown since 2 s) and not L4.
    fn l3_l4_story() -> Vec<Op> {
        vec![
            op(
                1,
                0,
                10,
                alloc("n1", 4, 10 * S),
                granted(3, "n1", C0_3, 10 * S),
            ),
            op(1, 2 * S, 2 * S + 500, release(3), unknown()),
            op(
                2,
                4 * S,
                4 * S + 10,
                alloc("n1", 4, 10 * S),
                granted(4, "n1", C0_3, 10 * S),
            ),
        ]
    }

    #[test]
    fn story_get_lists_released_lease_and_omits_new_one() {
        let mut v = l3_l4_story();
        v.push(op(
            3,
            6 * S,
            6 * S + 10,
            get("n1"),
            listed(&[(3, C0_3, 4_000)]),
        ));
        let found = check(&ops(v));
        for x in &found {
            println!("{}: {}", x.rule, x.detail);
        }
        let names: BTreeSet<_> = found.iter().map(|x| x.rule).collect();
        assert_eq!(names, set(&["double_grant", "lost_lease"]));
        let dg = found.iter().find(|x| x.rule == "double_grant");
        assert!(dg.is_some_and(|x| x.detail.contains("leases 3 and 4 on node n1")));
    }

    #[test]
    fn story_get_lists_both_leases() {
        let mut v = l3_l4_story();
        let both = listed(&[(3, C0_3, 4_000), (4, C0_3, 8_000)]);
        v.push(op(3, 6 * S, 6 * S + 10, get("n1"), both));
        assert_eq!(rules(&ops(v)), set(&["double_grant"]));
    }

    #[test]
    fn story_prefix_is_clean() {
        assert_eq!(rules(&ops(l3_l4_story())), set(&[]));
    }

    #[test]
    fn double_grant_overlapping_grants() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 2, 10 * S),
                granted(1, "n1", &[0, 1], 10 * S),
            ),
            op(
                2,
                S,
                S + 5,
                alloc("n1", 2, 10 * S),
                granted(2, "n1", &[1, 2], 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&["double_grant"]));
    }

    #[test]
    fn lost_lease_renew_not_found() {
        let mut v = l3_l4_story();
        v.push(op(2, 7 * S, 7 * S + 10, renew(4, 10 * S), not_found()));
        assert_eq!(rules(&ops(v)), set(&["lost_lease"]));
    }

    #[test]
    fn lost_lease_suppressed_by_release_request() {
        let mut v = l3_l4_story();
        v.push(op(2, 6 * S, 9 * S, release(4), unknown()));
        v.push(op(2, 7 * S, 7 * S + 10, renew(4, 10 * S), not_found()));
        assert_eq!(rules(&ops(v)), set(&[]));
    }

    #[test]
    fn resurrected_renew_and_get_after_release() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 4, 10 * S),
                granted(1, "n1", C0_3, 10 * S),
            ),
            op(1, S, S + 5, release(1), released()),
            op(1, 2 * S, 2 * S + 5, renew(1, 10 * S), renewed(10 * S)),
            op(2, 3 * S, 3 * S + 5, get("n1"), listed(&[(1, C0_3, 7_000)])),
        ]);
        assert_eq!(rules(&h), set(&["resurrected"]));
        assert_eq!(check(&h).len(), 2);
    }

    #[test]
    fn resurrected_allocate_after_release() {
        let h = ops(vec![
            op(1, 0, 5, get("n1"), listed(&[(9, C0_3, 5_000)])),
            op(1, S, S + 5, release(9), released()),
            op(
                2,
                2 * S,
                2 * S + 5,
                alloc("n1", 4, 10 * S),
                granted(9, "n1", C0_3, 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&["resurrected"]));
    }

    #[test]
    fn duplicate_id_two_clients() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 2, 10 * S),
                granted(7, "n1", &[0, 1], 10 * S),
            ),
            op(
                2,
                0,
                6,
                alloc("n1", 2, 10 * S),
                granted(7, "n1", &[0, 1], 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&["duplicate_id"]));
    }

    #[test]
    fn retry_mismatch_cpus_differ() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc_rid("n1", 2, 10 * S, "r"),
                granted(7, "n1", &[0, 1], 10 * S),
            ),
            op(
                1,
                6,
                9,
                alloc_rid("n1", 2, 10 * S, "r"),
                granted(7, "n1", &[2, 3], 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&["retry_mismatch"]));
    }

    #[test]
    fn retry_mismatch_different_leases() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc_rid("n1", 2, 10 * S, "r"),
                granted(7, "n1", &[0, 1], 10 * S),
            ),
            op(
                1,
                6,
                9,
                alloc_rid("n1", 2, 10 * S, "r"),
                granted(8, "n1", &[2, 3], 10 * S),
            ),
        ]);
        assert_eq!(rules(&h), set(&["retry_mismatch"]));
    }

    #[test]
    fn store_overlap_in_snapshot() {
        let rec = |lease, cpus: &[u32]| Record {
            node: "n1".into(),
            lease,
            cpus: cpus.to_vec(),
        };
        let h = History {
            snapshots: vec![
                Snapshot {
                    invoke: t(0),
                    complete: t(1),
                    records: vec![rec(1, &[0, 1]), rec(2, &[2])],
                },
                Snapshot {
                    invoke: t(5),
                    complete: t(6),
                    records: vec![rec(1, &[0, 1]), rec(2, &[1, 2])],
                },
            ],
            ..History::default()
        };
        assert_eq!(rules(&h), set(&["store_overlap"]));
    }

    fn ev(at: u64, what: AgentWhat) -> AgentEvent {
        AgentEvent {
            node: "n1".into(),
            at: t(at),
            what,
        }
    }

    fn agent_grant(lease: u64, cpus: &[u32]) -> AgentWhat {
        AgentWhat::Grant {
            lease,
            cpus: cpus.to_vec(),
        }
    }

    #[test]
    fn agent_overlap_grant_without_release() {
        let h = History {
            agents: vec![ev(1, agent_grant(1, &[0, 1])), ev(2, agent_grant(2, &[1]))],
            ..History::default()
        };
        assert_eq!(rules(&h), set(&["agent_overlap"]));
    }

    #[test]
    fn agent_reset_clears_view() {
        // Out of order in the vector on purpose: replay sorts by time.
        let h = History {
            agents: vec![
                ev(3, agent_grant(2, &[1])),
                ev(1, agent_grant(1, &[0, 1])),
                ev(2, AgentWhat::Reset { leases: vec![] }),
                ev(4, AgentWhat::Release { lease: 2 }),
                ev(5, agent_grant(3, &[0, 1])),
            ],
            ..History::default()
        };
        assert_eq!(rules(&h), set(&[]));
    }

    #[test]
    fn agent_overlap_reported_once_then_reset_repairs() {
        let h = History {
            agents: vec![
                ev(1, agent_grant(1, &[0, 1])),
                ev(2, agent_grant(2, &[1])),
                ev(3, agent_grant(4, &[7])),
                ev(
                    4,
                    AgentWhat::Reset {
                        leases: vec![(2, vec![1])],
                    },
                ),
                ev(5, agent_grant(3, &[0])),
            ],
            ..History::default()
        };
        assert_eq!(check(&h).len(), 1);
        assert_eq!(rules(&h), set(&["agent_overlap"]));
    }

    #[test]
    fn bad_record_inverted_times_and_wrong_node() {
        let h = ops(vec![
            op(
                1,
                10,
                5,
                alloc("n1", 2, 10 * S),
                granted(1, "n1", &[0, 1], 10 * S),
            ),
            op(
                1,
                20,
                25,
                alloc("n1", 2, 10 * S),
                granted(2, "n2", &[0, 1], 10 * S),
            ),
            op(
                1,
                30,
                35,
                alloc("", 2, 10 * S),
                granted(3, "n3", &[0, 1], 10 * S),
            ),
            op(1, 40, 45, renew(3, 10 * S), released()),
        ]);
        assert_eq!(rules(&h), set(&["bad_record"]));
        assert_eq!(check(&h).len(), 3);
    }

    #[test]
    fn hostile_values_do_not_panic() {
        let h = ops(vec![
            op(
                1,
                0,
                5,
                alloc("n1", 2, u64::MAX),
                granted(1, "n1", &[0, 1], u64::MAX),
            ),
            op(1, 7, 8, renew(1, u64::MAX), renewed(u64::MAX)),
            op(1, 9, 3, release(1), unknown()),
            op(
                2,
                10,
                11,
                get("n1"),
                listed(&[(1, &[0, 1], u64::MAX), (2, &[], 0)]),
            ),
            Op {
                client: 1,
                invoke: u64::MAX,
                complete: 0,
                call: get("n1"),
                outcome: listed(&[]),
            },
        ]);
        let v = check(&h);
        assert!(v.iter().all(|x| x.rule == "bad_record"));
        let s = summarize(&h, &v);
        assert_eq!((s.operations, s.unknown, s.violations), (5, 1, v.len()));
    }

    // ----- performance

    /// One lease lifecycle per 8 ms on each node: allocate, renew, get,
    /// release (every tenth release Unknown), consecutive leases sharing CPUs.
    fn big_history(nodes: u32, leases_per_node: u64) -> History {
        let mut h = History::default();
        for n in 0..nodes {
            let node = format!("n{n}");
            for k in 0..leases_per_node {
                let id = u64::from(n) * 1_000_000 + k;
                let b = k * 8;
                let cpus: Vec<u32> = if k % 2 == 0 {
                    vec![0, 1, 2, 3]
                } else {
                    vec![2, 3, 4, 5]
                };
                let client = n * 10 + (k % 3) as u32;
                let req = if k % 7 == 0 {
                    alloc_rid(&node, 4, 10 * S, &format!("r{id}"))
                } else {
                    alloc(&node, 4, 10 * S)
                };
                h.ops
                    .push(op(client, b, b + 1, req, granted(id, &node, &cpus, 10 * S)));
                h.ops
                    .push(op(client, b + 2, b + 3, renew(id, 10 * S), renewed(10 * S)));
                let row = [(id, cpus.as_slice(), 9_995)];
                h.ops
                    .push(op(client, b + 4, b + 5, get(&node), listed(&row)));
                let gone = if k % 10 == 9 { unknown() } else { released() };
                h.ops.push(op(client, b + 6, b + 7, release(id), gone));
                h.agents.push(AgentEvent {
                    node: node.clone(),
                    at: t(b + 1),
                    what: agent_grant(id, &cpus),
                });
                h.agents.push(AgentEvent {
                    node: node.clone(),
                    at: t(b + 7),
                    what: AgentWhat::Release { lease: id },
                });
            }
        }
        h
    }

    #[test]
    fn performance_100k_ops_clean() {
        let h = big_history(50, 500);
        assert_eq!(h.ops.len(), 100_000);
        let v = check(&h);
        assert!(v.is_empty(), "unexpected: {:?}", v.first());
        let s = summarize(&h, &v);
        assert_eq!(s.operations, 100_000);
        assert_eq!(s.unknown, 2_500);
    }
}
