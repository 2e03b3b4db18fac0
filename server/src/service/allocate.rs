//! AllocateCpus, ReleaseCpus and RenewLease, and the hub that carries
//! leases to the agents that apply them.
//!
//! An allocation is validated (every field named in its refusal), decided
//! by a policy of `crate::engine::alloc` under the node's writer (so concurrent
//! allocations never share a CPU) and taken as a pending lease in the store,
//! where its CPUs count in every later decision; it is answered, counted
//! and sent to its agent only once the lease log acknowledged it. A
//! release frees nothing and a renewal extends nothing until their commits
//! are acknowledged; an unknown outcome is answered UNAVAILABLE and settled
//! by `store/leases/settle.rs`. With `apply`, the lease goes to the node's
//! agent over its Report stream as an unsolicited Ack, and the call returns
//! only when the agent answered, failed or timed out; a lease that could
//! not be applied is ended before the error is returned. Every lease,
//! applied or not, is sent to its node's agent, which keeps it on record
//! (the node is the lease's second witness, `store/leases/recovery.rs`).
//!
//! A `request_id` makes AllocateCpus idempotent: a retry by the same
//! identity gets the first grant's answer, waiting while the first is
//! still being committed.
//!
//! A lease belongs to the identity that took it: Renew and Release by
//! anyone else but an admin are PERMISSION_DENIED.
//!
//! Work is bounded: an allocation costs O(count x CPUs) and runs in the
//! heavy pool when that product is large; the hub holds one sender per
//! connected node and one waiter per allocation in flight.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use tonic::Status;

use super::cpu_pool::CpuPool;
use super::lease_hub::{LeaseHub, grant_pb, target_pb};
use crate::convert;
use crate::engine::alloc::{self, Grant, NoRoom, Policy};
use crate::engine::cpumask::{CpuMask, MAX_CPUS};
use crate::engine::state::Task;
use crate::identity::{self, Caller};
use crate::metrics as m;
use crate::store::leases::settle::{self, AgentSink, Settling};
use crate::store::{
    Commit, Lease, LeaseRecord, LeaseRefusal, NewLease, Node, Phase, Reconciled, Store, Target,
    Unallocatable, wall_ms,
};

/// What the lease calls use: the store, the hub to the agents, and the
/// heavy pool for large allocations.
pub struct Leasing<'a> {
    pub store: &'a Arc<Store>,
    pub hub: &'a Arc<LeaseHub>,
    pub heavy: &'a CpuPool,
    pub recorder: &'a Arc<crate::record::Hub>,
}

/// A lease's lifetime when the request gives none.
pub const DEFAULT_TTL: Duration = Duration::from_secs(30);
/// Longest holder name and cgroup path accepted, in bytes.
pub const MAX_HOLDER_BYTES: usize = 256;
pub const MAX_CGROUP_BYTES: usize = 4096;
/// Allocations whose cost (count x online CPUs) is above this run in the
/// heavy pool, off the async workers.
const HEAVY_COST: usize = 4096;

/// Longest request id accepted, in bytes.
pub const MAX_REQUEST_ID_BYTES: usize = 128;
/// How long a retried AllocateCpus waits for the first call with its
/// request id to be committed before it answers UNAVAILABLE.
const RETRY_WAIT: Duration = Duration::from_millis(1500);

/// Longest owner (a SPIFFE ID) and policy name a held lease may carry.
const MAX_OWNER_BYTES: usize = 2048;
const MAX_POLICY_BYTES: usize = 32;

/// Whether a lease an agent reports has the sizes of one this server grants.
fn held_fits(g: &pb::LeaseGrant) -> bool {
    g.holder.len() <= MAX_HOLDER_BYTES
        && g.owner.len() <= MAX_OWNER_BYTES
        && g.policy.len() <= MAX_POLICY_BYTES
        && g.cpus.len() <= 8 * MAX_CPUS
        && g.target.as_ref().is_none_or(|t| check_target(t).is_ok())
}

/// A lease an agent reports holding, as the log would keep it.
pub fn held_record(g: &pb::LeaseGrant, node: &str) -> LeaseRecord {
    LeaseRecord {
        id: g.lease_id,
        node: node.to_string(),
        cpus: g.cpus.clone(),
        policy: g.policy.clone(),
        holder: g.holder.clone(),
        owner: g.owner.clone(),
        target: g.target.as_ref().and_then(|t| check_target(t).ok()),
        ttl_ms: g.ttl_ms as u64,
        expires_at_ms: g.expires_at_unix_ms,
        granted_at_ms: g.granted_at_unix_ms,
        applied: g.target.is_some(),
        request_id: String::new(),
    }
}

/// Reconciles the leases a registering agent holds and logs what happened;
/// returns the ids the agent must drop. Waits for the adoptions to be
/// committed before the agent is told anything: an adopted lease is
/// pending until then, and settled like any grant.
pub async fn reconcile(
    store: &Arc<Store>,
    sink: &Arc<dyn AgentSink>,
    node: &Node,
    held: &[pb::LeaseGrant],
) -> Vec<u64> {
    // A report whose strings are beyond what a grant can carry is not a
    // lease this server made: refused, never stored.
    let (fit, unfit): (Vec<&pb::LeaseGrant>, Vec<&pb::LeaseGrant>) =
        held.iter().partition(|g| held_fits(g));
    let records: Vec<LeaseRecord> = fit.iter().map(|g| held_record(g, &node.id)).collect();
    let Reconciled {
        kept,
        adopted,
        mut conflicts,
        expired,
        mut release_on_node,
        commit,
        adopted_ids,
    } = store.leases.reconcile_leases(node, &records);
    for g in &unfit {
        tracing::warn!(node = %node.id, lease = g.lease_id, "a lease the agent holds has fields out of bounds: released on the node");
        release_on_node.push(g.lease_id);
        conflicts += 1;
    }
    if let Some(c) = commit {
        settle_adopted(store, sink, &node.id, adopted_ids, c).await;
    }
    if !held.is_empty() || !release_on_node.is_empty() {
        tracing::info!(node = %node.id, reported = held.len(), kept, adopted, conflicts, expired, "leases reconciled with the node's agent");
    }
    release_on_node
}

/// Settles the adoptions committed by `commit` (one batch): each a grant
/// settled forward (the agent holds it, and knows its id).
async fn settle_adopted(
    store: &Arc<Store>,
    sink: &Arc<dyn AgentSink>,
    node: &str,
    ids: Vec<u64>,
    commit: Commit,
) {
    let r = commit.wait().await;
    if let Err(e) = &r {
        tracing::error!(node, error = %e, "adopted leases could not be made durable");
    }
    for id in ids {
        match &r {
            Ok(()) => {
                store.leases.grant_settled(id, true);
            }
            Err(e) if !e.unknown => {
                store.leases.grant_settled(id, false);
            }
            Err(e) => {
                // Settled forward on its own: the write again decides.
                let again = Commit::done(Err(e.clone()));
                // Nobody waits for the first outcome: the settler goes on.
                drop(settle::spawn(
                    &store.leases,
                    sink,
                    id,
                    Settling::Grant { forward: true },
                    again,
                ));
            }
        }
    }
}

/// Leases as GetNode shows them.
pub fn leases_to_pb(leases: &[Lease], now: Instant) -> Vec<pb::Lease> {
    leases
        .iter()
        .map(|l| pb::Lease {
            lease_id: l.id,
            cpus: l.cpus.to_string(),
            policy: l.policy.clone(),
            holder: l.holder.clone(),
            expires_in_ms: l.expires.saturating_duration_since(now).as_millis() as u64,
            apply: l.target.as_ref().map(target_pb),
            applied: l.applied,
            owner: l.owner.clone(),
            expires_at_unix_ms: wall_ms(l.expires),
            granted_at_unix_ms: l.granted_at_ms,
        })
        .collect()
}

/// The request's fields that do not depend on the node, checked.
struct Checked {
    policy: Policy,
    count: usize,
    holder: String,
    /// The caller's identity, the lease's owner.
    owner: String,
    ttl: Duration,
    target: Option<Target>,
    request_id: String,
}

fn invalid(field: &str, msg: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("{field}: {msg}"))
}

/// A requested lifetime within `--max-lease-ttl-ms`.
fn check_ttl(ttl_ms: u32, max: Duration) -> Result<(), Status> {
    if ttl_ms as u128 > max.as_millis() {
        return Err(invalid(
            "ttl_ms",
            format!(
                "{ttl_ms} is out of range 0..{} (--max-lease-ttl-ms; renew for longer)",
                max.as_millis()
            ),
        ));
    }
    Ok(())
}

fn check(
    r: &pb::AllocateCpusRequest,
    caller: &Caller,
    max_ttl: Duration,
) -> Result<Checked, Status> {
    let policy = Policy::parse(&r.policy).ok_or_else(|| {
        invalid(
            "policy",
            format!(
                "{} is not a policy (kernel, cores, llc, llc-exclusive, spread)",
                convert::quote(&r.policy)
            ),
        )
    })?;
    if r.count == 0 {
        return Err(invalid("count", "must be at least 1"));
    }
    if r.count as usize > MAX_CPUS {
        return Err(invalid(
            "count",
            format!("{} is more than any node has ({MAX_CPUS})", r.count),
        ));
    }
    if r.holder.len() > MAX_HOLDER_BYTES || r.holder.chars().any(char::is_control) {
        return Err(invalid(
            "holder",
            format!(
                "{} must be at most {MAX_HOLDER_BYTES} bytes without control characters",
                convert::quote(&r.holder)
            ),
        ));
    }
    check_ttl(r.ttl_ms, max_ttl)?;
    if r.request_id.len() > MAX_REQUEST_ID_BYTES || r.request_id.chars().any(char::is_control) {
        return Err(invalid(
            "request_id",
            format!(
                "{} must be at most {MAX_REQUEST_ID_BYTES} bytes without control characters",
                convert::quote(&r.request_id)
            ),
        ));
    }
    // A pid or a cgroup path means something on one machine only: a
    // cluster allocation would hand it to whichever node the slow path
    // chose, which would pin its own process of that pid.
    if r.apply.is_some() && r.node_id.is_empty() {
        return Err(invalid(
            "node_id",
            "an apply target names a process or cgroup of one node: name the node",
        ));
    }
    let ttl = match r.ttl_ms {
        0 => DEFAULT_TTL.min(max_ttl),
        t => Duration::from_millis(t as u64),
    };
    Ok(Checked {
        policy,
        count: r.count as usize,
        holder: r.holder.clone(),
        owner: caller.owner(),
        ttl,
        target: r.apply.as_ref().map(check_target).transpose()?,
        request_id: r.request_id.clone(),
    })
}

fn check_target(a: &pb::ApplyTarget) -> Result<Target, Status> {
    match &a.target {
        None => Err(invalid("apply", "name a pid or a cgroup")),
        Some(pb::apply_target::Target::Pid(0)) => Err(invalid("apply.pid", "must not be 0")),
        Some(pb::apply_target::Target::Pid(p)) => Ok(Target::Pid(*p)),
        Some(pb::apply_target::Target::Cgroup(c)) => {
            let bad = c.is_empty()
                || c.len() > MAX_CGROUP_BYTES
                || c.chars().any(char::is_control)
                || c.split('/').any(|s| s == "..");
            if bad {
                return Err(invalid(
                    "apply.cgroup",
                    format!(
                        "{} must be a non-empty path of at most {MAX_CGROUP_BYTES} bytes, without '..' or control characters",
                        convert::quote(c)
                    ),
                ));
            }
            Ok(Target::Cgroup(c.clone()))
        }
    }
}

/// The node to allocate on: the named one, or the cluster slow path's
/// choice among fresh nodes with an allowed online CPU.
fn choose_node(p: &Leasing<'_>, r: &pb::AllocateCpusRequest) -> Result<Arc<Node>, Status> {
    if !r.node_id.is_empty() {
        return super::lookup::registered_node(p.store, &r.node_id);
    }
    let choice = choose_on_cluster(p.store, r, &[])?;
    super::lookup::registered_node(p.store, &choice)
}

/// The cluster slow path's node for an allocation with none named (not
/// one of `excluded`): local, or with replicas another replica's.
pub fn choose_on_cluster(
    store: &Store,
    r: &pb::AllocateCpusRequest,
    excluded: &[String],
) -> Result<String, Status> {
    let allowed = match r.task.as_ref().map_or("", |t| t.cpus_allowed.as_str()) {
        "" => CpuMask::first_n(MAX_CPUS),
        s => CpuMask::parse_cpulist(s, MAX_CPUS).map_err(|e| invalid("task.cpus_allowed", e))?,
    };
    if allowed.is_empty() {
        return Err(invalid("task.cpus_allowed", "must not be empty"));
    }
    let req = crate::store::hierarchy::ClusterRequest {
        first_allowed_cpu: allowed.first().unwrap_or(0),
        origin: None,
        selector: Vec::new(),
    };
    let choice = store
        .cluster
        .pick_excluding(&req, &allowed, excluded)
        .ok_or_else(|| {
            Status::failed_precondition("node_id: no fresh node can run the task; name a node")
        })?;
    Ok(choice.node)
}

/// The request's task on this node, and the check of `count` against its
/// allowed online CPUs.
fn node_task(
    r: &pb::AllocateCpusRequest,
    c: &Checked,
    topo: &crate::engine::topology::Topology,
) -> Result<Task, Status> {
    let task = convert::task(r.task.as_ref(), topo, false, 0).map_err(convert::invalid)?;
    let usable = task.cpus_allowed.and(&topo.online).weight();
    if usable == 0 {
        return Err(invalid("task.cpus_allowed", "no allowed CPU is online"));
    }
    if c.count > usable {
        return Err(invalid(
            "count",
            format!(
                "{} is more than the node's {usable} allowed online CPUs",
                c.count
            ),
        ));
    }
    Ok(task)
}

/// Why [`decide`] granted nothing: no room (or a store refusal, as the
/// policies word it), or the caller's request id already has a lease.
enum NotDecided {
    NoRoom(NoRoom),
    Requested,
}

impl From<NoRoom> for NotDecided {
    fn from(e: NoRoom) -> Self {
        NotDecided::NoRoom(e)
    }
}

impl From<Unallocatable> for NotDecided {
    fn from(u: Unallocatable) -> NotDecided {
        match u {
            Unallocatable::Requested(_) => NotDecided::Requested,
            u => NotDecided::NoRoom(u.into()),
        }
    }
}

/// A grant the store would not make, as the policies' refusal.
impl From<Unallocatable> for NoRoom {
    fn from(u: Unallocatable) -> NoRoom {
        match u {
            Unallocatable::NodeGone => NoRoom {
                reason: "node",
                message: "node_id: the node re-registered or was forgotten during the allocation; nothing was granted, retry".into(),
            },
            Unallocatable::Registering => NoRoom {
                reason: "node",
                message: "node_id: the node's agent is registering; nothing was granted, retry".into(),
            },
            Unallocatable::CallerLimit(why) => NoRoom {
                reason: "caller_limit",
                message: format!("count: {why}"),
            },
            Unallocatable::Requested(id) => NoRoom {
                reason: "request_id",
                message: format!("request_id: already granted as lease {id}"),
            },
        }
    }
}

/// A lease granted but not answered yet. Dropped before
/// [`Unanswered::answered`] (its caller went away and the call's future was
/// dropped mid-way, in the heavy pool or while it waited for the log or
/// the agent) the lease is ended once its grant is settled, so no lease
/// nobody can know the id of outlives its AllocateCpus. One with a request
/// id is kept: the caller's retry finds it.
struct Unanswered {
    store: Arc<Store>,
    sink: Arc<dyn AgentSink>,
    id: u64,
    armed: bool,
}

impl Unanswered {
    fn answered(mut self) {
        self.armed = false;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.armed {
            let (store, sink, id) = (Arc::clone(&self.store), Arc::clone(&self.sink), self.id);
            tokio::spawn(async move { end_when_settled(&store, &sink, id, "abandoned").await });
        }
    }
}

/// Ends lease `id` once no change of it is in flight (a pending grant is
/// settled first), counted as `how`, and waits for the end's first
/// outcome (an unknown one is settled on); gives up after a few seconds of
/// a change that does not settle (the settler then owns the lease's fate).
async fn end_when_settled(
    store: &Arc<Store>,
    sink: &Arc<dyn AgentSink>,
    id: u64,
    how: &'static str,
) {
    for _ in 0..100 {
        match store.leases.begin_end(id, |_| Ok::<(), ()>(())) {
            Ok((_, _, commit)) => {
                metrics::counter!(m::LEASES_ENDED, "how" => how).increment(1);
                let what = Settling::End;
                let _ = settle::settle(&store.leases, sink, id, what, commit).await;
                return;
            }
            Err(LeaseRefusal::Busy(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(_) => return,
        }
    }
}

/// What [`decide`] grants: the policy's answer, the lease, the snapshot
/// version it was decided on and the CPUs other leases held then, and its
/// commit.
type Decided = (Grant, Lease, (u64, CpuMask), Commit);

/// Decides the lease under the node's writer and submits its grant.
fn decide(
    store: &Arc<Store>,
    node: &Node,
    task: &Task,
    c: &Checked,
    now: Instant,
) -> Result<Decided, NotDecided> {
    let sys = store.config.system;
    let ((grant, version), lease, commit) =
        store.leases.allocate_locked(node, now, |snap, leased| {
            let req = alloc::Request {
                topo: &snap.topo,
                state: &snap.state,
                features: &snap.features,
                system: &sys,
                task,
                count: c.count,
                policy: c.policy,
                leased,
            };
            let grant = alloc::allocate(&req)?;
            let new = NewLease {
                cpus: grant.mask(),
                policy: c.policy.as_str().to_string(),
                holder: c.holder.clone(),
                owner: c.owner.clone(),
                ttl: c.ttl,
                target: c.target.clone(),
                request_id: c.request_id.clone(),
            };
            Ok::<_, NotDecided>(((grant, (snap.version, *leased)), new))
        })?;
    Ok((grant, lease, version, commit))
}

fn refused(policy: &str, reason: &str) {
    metrics::counter!(m::LEASE_REFUSALS, "policy" => policy.to_string(), "reason" => reason.to_string())
        .increment(1);
}

/// AllocateCpus.
pub async fn allocate_cpus(
    p: Leasing<'_>,
    caller: &Caller,
    r: pb::AllocateCpusRequest,
) -> Result<pb::AllocateCpusResponse, Status> {
    let policy_label = Policy::parse(&r.policy).map_or("unknown", Policy::as_str);
    let out = allocate_inner(&p, caller, r).await;
    if let Err((reason, _)) = &out {
        refused(policy_label, reason);
    }
    out.map_err(|(_, s)| s)
}

type Refusal = (&'static str, Status);

async fn allocate_inner(
    p: &Leasing<'_>,
    caller: &Caller,
    r: pb::AllocateCpusRequest,
) -> Result<pb::AllocateCpusResponse, Refusal> {
    let c = check(&r, caller, p.store.config.max_lease_ttl).map_err(|s| ("invalid", s))?;
    writable(p.store).map_err(|s| ("store", s))?;
    if let Some(answer) = retried(p.store, &r, &c).await? {
        return Ok(answer);
    }
    let node = choose_node(p, &r).map_err(|s| ("node", s))?;
    let now = Instant::now();
    let (snap, _) = super::lookup::fresh_snapshot(p.store, &node, now).map_err(|s| ("node", s))?;
    let task = node_task(&r, &c, &snap.topo).map_err(|s| ("invalid", s))?;
    let cost = c.count * snap.topo.online.weight();
    drop(snap);
    let c = Arc::new(c);
    let decided = if cost <= HEAVY_COST {
        decide(p.store, &node, &task, &c, now)
    } else {
        let store = Arc::clone(p.store);
        let (n, c2) = (Arc::clone(&node), Arc::clone(&c));
        p.heavy
            .run("allocate", move || decide(&store, &n, &task, &c2, now))
            .await
            .map_err(|s| ("busy", s))?
    };
    let (grant, lease, (version, leased), commit) = match decided {
        Ok(d) => d,
        Err(NotDecided::NoRoom(e)) => {
            return Err((e.reason, Status::resource_exhausted(e.message)));
        }
        // A retry that raced the first call to the index.
        Err(NotDecided::Requested) => {
            return retried(p.store, &r, &c).await?.ok_or_else(|| {
                (
                    "busy",
                    Status::unavailable(
                        "request_id: the first call's lease ended meanwhile; retry",
                    ),
                )
            });
        }
    };
    p.recorder
        .allocated(&node.id, version, &r, grant.mask(), leased, grant.scanned);
    let sink: Arc<dyn AgentSink> = Arc::clone(p.hub) as Arc<dyn AgentSink>;
    let guard = Unanswered {
        store: Arc::clone(p.store),
        sink: Arc::clone(&sink),
        id: lease.id,
        armed: c.request_id.is_empty(),
    };
    let forward = !c.request_id.is_empty();
    let settled = settle::settle(
        &p.store.leases,
        &sink,
        lease.id,
        Settling::Grant { forward },
        commit,
    );
    let lease = match settled.await {
        Ok(Some((_, l))) => l,
        Ok(None) => {
            guard.answered();
            return Err((
                "store",
                Status::unavailable(
                    "node_id: the node's leases were read again while the grant was committed; nothing was granted, retry",
                ),
            ));
        }
        Err(e) => {
            // Refused: nothing was granted. Unknown: the settler decides,
            // and a retry with the request id finds what it decided.
            guard.answered();
            return Err((
                "store",
                Status::unavailable(format!(
                    "{e}; nothing is granted until the lease store acknowledges it"
                )),
            ));
        }
    };
    // A lease whose apply never completed is no grant anybody can use:
    // a caller gone while it waits ends it, request id or not.
    let mut guard = guard;
    guard.armed |= lease.target.is_some();
    let applied = send_to_agent(p, &node, &lease, &sink).await?;
    guard.answered();
    metrics::counter!(m::LEASE_GRANTS, "policy" => c.policy.as_str()).increment(1);
    tracing::debug!(node = %node.id, lease = lease.id, cpus = %lease.cpus, policy = c.policy.as_str(), holder = %c.holder, "lease granted");
    Ok(pb::AllocateCpusResponse {
        lease_id: lease.id,
        cpus: lease.cpus.to_string(),
        per_cpu: grant
            .cpus
            .iter()
            .map(|(cpu, path)| pb::LeasedCpu {
                cpu: *cpu as u32,
                path: path.to_string(),
            })
            .collect(),
        scanned: grant.scanned,
        explanation: grant.explanation,
        node_id: node.id.clone(),
        policy: c.policy.as_str().to_string(),
        ttl_ms: lease.ttl.as_millis() as u32,
        applied,
        state_version: version,
    })
}

/// A committed lease to its node's agent: applied there (and waited for)
/// when it has a target, else kept on record. One that cannot be applied
/// is ended, and the agent's refusal is the answer.
async fn send_to_agent(
    p: &Leasing<'_>,
    node: &Node,
    lease: &Lease,
    sink: &Arc<dyn AgentSink>,
) -> Result<bool, Refusal> {
    if lease.target.is_none() {
        p.hub.push(
            &node.id,
            pb::Ack {
                grants: vec![grant_pb(lease, &node.id)],
                ..Default::default()
            },
        );
        return Ok(false);
    }
    if let Err(s) = p.hub.apply(p.store, node, lease).await {
        end_when_settled(p.store, sink, lease.id, "apply_failed").await;
        return Err(("apply", s));
    }
    Ok(true)
}

/// The answer for a retried AllocateCpus: the first grant's, when the
/// caller's request id has a lease (waiting while the first call is still
/// being committed); `None` when it has none.
async fn retried(
    store: &Store,
    r: &pb::AllocateCpusRequest,
    c: &Checked,
) -> Result<Option<pb::AllocateCpusResponse>, Refusal> {
    if c.request_id.is_empty() {
        return Ok(None);
    }
    let give_up = Instant::now() + RETRY_WAIT;
    loop {
        let Some((node, l)) = store.leases.requested(&c.owner, &c.request_id) else {
            return Ok(None);
        };
        if l.phase == Phase::Live {
            return first_answer(r, c, &node, &l).map(Some);
        }
        if l.phase == Phase::Ending {
            // The first grant is ending (released, or its caller went away
            // before it was applied): no answer of it stands.
            return Err((
                "busy",
                Status::unavailable(format!(
                    "request_id: the lease first granted to {} is ending; retry",
                    convert::quote(&c.request_id)
                )),
            ));
        }
        if Instant::now() >= give_up {
            return Err((
                "busy",
                Status::unavailable(format!(
                    "request_id: the first call with {} is still being committed; retry with the same request_id",
                    convert::quote(&c.request_id)
                )),
            ));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first grant's answer for a retry, or why the retry does not ask for
/// what the first call asked (a reused request id).
fn first_answer(
    r: &pb::AllocateCpusRequest,
    c: &Checked,
    node: &str,
    l: &Lease,
) -> Result<pb::AllocateCpusResponse, Refusal> {
    let other_node = !r.node_id.is_empty() && r.node_id != node;
    if other_node || l.cpus.weight() != c.count || l.policy != c.policy.as_str() {
        return Err((
            "invalid",
            invalid(
                "request_id",
                format!(
                    "{} was used for lease {} ({} CPUs, policy {}, node {}): a retry must ask for the same",
                    convert::quote(&c.request_id),
                    l.id,
                    l.cpus.weight(),
                    l.policy,
                    convert::quote(node)
                ),
            ),
        ));
    }
    Ok(pb::AllocateCpusResponse {
        lease_id: l.id,
        cpus: l.cpus.to_string(),
        per_cpu: l
            .cpus
            .iter()
            .map(|cpu| pb::LeasedCpu {
                cpu: cpu as u32,
                path: "retry".into(),
            })
            .collect(),
        scanned: 0,
        explanation: format!(
            "the lease granted to request_id {} (a retried call)",
            convert::quote(&c.request_id)
        ),
        node_id: node.to_string(),
        policy: l.policy.clone(),
        ttl_ms: l.ttl.as_millis() as u32,
        applied: l.applied,
        state_version: 0,
    })
}

/// A Release or Renew that did not happen, as a status.
fn refusal(id: u64, r: LeaseRefusal<Status>) -> Status {
    match r {
        LeaseRefusal::NotFound => no_lease(id),
        LeaseRefusal::Refused(s) => s,
        LeaseRefusal::Busy(why) => {
            Status::unavailable(format!("lease_id: lease {id}: {why}; retry"))
        }
    }
}

fn no_lease(id: u64) -> Status {
    Status::not_found(format!(
        "lease_id: no live lease {id} (never granted, released, expired, or ended with its target)"
    ))
}

/// UNAVAILABLE while lease changes cannot be committed (a replica that
/// lost etcd): refused before anything changes in memory.
fn writable(store: &Store) -> Result<(), Status> {
    store
        .leases
        .writable()
        .map_err(|e| Status::unavailable(e.to_string()))
}

/// ReleaseCpus: the owner's or an admin's; the CPUs are free and the call
/// answers only once the end is committed. A retry of a release whose
/// outcome was unknown joins it and answers OK once it is settled.
pub async fn release_cpus(
    p: Leasing<'_>,
    caller: &Caller,
    r: pb::ReleaseCpusRequest,
) -> Result<pb::ReleaseCpusResponse, Status> {
    if r.lease_id == 0 {
        return Err(invalid("lease_id", "must not be 0"));
    }
    writable(p.store)?;
    let (_, lease, commit) = p
        .store
        .leases
        .begin_end(r.lease_id, |l| {
            identity::check_lease_owner(caller, "release", l.id, &l.owner)
        })
        .map_err(|e| refusal(r.lease_id, e))?;
    let sink: Arc<dyn AgentSink> = Arc::clone(p.hub) as Arc<dyn AgentSink>;
    let what = Settling::End;
    let settled = settle::settle(&p.store.leases, &sink, r.lease_id, what, commit).await;
    match settled {
        Ok(Some((node, l))) => {
            metrics::counter!(m::LEASES_ENDED, "how" => "released").increment(1);
            Ok(pb::ReleaseCpusResponse {
                node_id: node,
                cpus: l.cpus.to_string(),
            })
        }
        // Settled by another call meanwhile (a retry, the settler): ended.
        Ok(None) => Ok(pb::ReleaseCpusResponse {
            node_id: p.store.leases.lease_node(r.lease_id).unwrap_or_default(),
            cpus: lease.cpus.to_string(),
        }),
        Err(e) => Err(Status::unavailable(format!(
            "lease {}: {e}; the lease keeps its CPUs until the outcome is known (retry the release)",
            r.lease_id
        ))),
    }
}

/// RenewLease: the owner's or an admin's; the lease is extended only once
/// the renewal is committed.
pub async fn renew_lease(
    p: Leasing<'_>,
    caller: &Caller,
    r: pb::RenewLeaseRequest,
) -> Result<pb::RenewLeaseResponse, Status> {
    if r.lease_id == 0 {
        return Err(invalid("lease_id", "must not be 0"));
    }
    check_ttl(r.ttl_ms, p.store.config.max_lease_ttl)?;
    writable(p.store)?;
    let ttl = (r.ttl_ms > 0).then(|| Duration::from_millis(r.ttl_ms as u64));
    let (_, renewal, commit) = p
        .store
        .leases
        .begin_renew(r.lease_id, ttl, Instant::now(), |l| {
            identity::check_lease_owner(caller, "renew", l.id, &l.owner)
        })
        .map_err(|e| refusal(r.lease_id, e))?;
    let sink: Arc<dyn AgentSink> = Arc::clone(p.hub) as Arc<dyn AgentSink>;
    let what = Settling::Renew(renewal);
    let (node, l) = match settle::settle(&p.store.leases, &sink, r.lease_id, what, commit).await {
        Ok(Some(x)) => x,
        Ok(None) => return Err(no_lease(r.lease_id)),
        Err(e) => return Err(Status::unavailable(e.to_string())),
    };
    p.hub.push(
        &node,
        pb::Ack {
            renewed: vec![pb::LeaseRenewal {
                lease_id: l.id,
                ttl_ms: l.ttl.as_millis() as u32,
                expires_at_unix_ms: wall_ms(l.expires),
            }],
            ..Default::default()
        },
    );
    Ok(pb::RenewLeaseResponse {
        ttl_ms: l.ttl.as_millis() as u32,
    })
}

/// Starts ending expired leases every 100 ms; each end is settled on its
/// own, and the agent told before the CPUs are free.
pub fn spawn_expiry(store: Arc<Store>, hub: Arc<LeaseHub>) -> tokio::task::JoinHandle<()> {
    let sink: Arc<dyn AgentSink> = hub;
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        loop {
            tick.tick().await;
            let ending = store.leases.begin_expiry(Instant::now());
            for (node, id, commit) in ending {
                let what = Settling::End;
                let (store, sink) = (Arc::clone(&store), Arc::clone(&sink));
                tokio::spawn(async move {
                    if let Ok(Some(_)) =
                        settle::settle(&store.leases, &sink, id, what, commit).await
                    {
                        metrics::counter!(m::LEASES_ENDED, "how" => "expired").increment(1);
                        tracing::info!(node = %node, lease = id, "lease expired");
                    }
                });
            }
        }
    })
}
