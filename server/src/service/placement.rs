//! PlacementService: PickCpu and CanMigrate against the live state, and the
//! stateless Decide.

use std::sync::Arc;
use std::time::Instant;

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::placement_service_server::PlacementService;
use tonic::{Request, Response, Status};

use super::cpu_pool::CpuPool;
use crate::convert::{self, PickAnswer, Picked};
use crate::engine::cpumask::{CpuMask, MAX_CPUS};
use crate::engine::decision::{PlaceRequest, Placement as Decision};
use crate::engine::{can_migrate_task, select_task_rq};
use crate::identity::{self, Caller};
use crate::metrics as m;
use crate::offline::request::decide_value;
use crate::replica::route::{self, Replicated, Route};
use crate::store::hierarchy::ClusterRequest;
use crate::store::passes::BalanceRequest;
use crate::store::{Node, Store};
use crate::transport::fast_unary::PickHere;

/// The answers of one PickCpus stream (`pick_stream.rs`), as the service
/// returns them.
pub type Answers =
    std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::PickCpusAnswer, Status>> + Send>>;

/// How often a claimed placement is decided again when other claims keep
/// changing the node under it, before it decides under the node's writer.
const CLAIM_ATTEMPTS: usize = 64;

#[derive(Clone)]
pub struct Placement {
    pub store: Arc<Store>,
    /// Decide and Balance run here, off the async workers.
    pub heavy: CpuPool,
    /// Carries leases to the agents that apply them.
    pub hub: Arc<super::lease_hub::LeaseHub>,
    /// Told of every decision, for a recording when one runs.
    pub recorder: Arc<crate::record::Hub>,
    /// With `--etcd-endpoints`: the replica set, and calls for other
    /// replicas' nodes go to them.
    pub replicated: Option<Replicated>,
    /// Flips to true when shutdown begins: PickCpus streams end on it.
    pub stopping: tokio::sync::watch::Receiver<bool>,
}

impl Placement {
    /// One PickCpu, unary or on a PickCpus stream: here, or at the node's
    /// owner when another replica holds it.
    ///
    /// A placement on a node this replica holds is decided at once, with no
    /// await: the caller's future then holds no more than the request.
    /// A forward to the node's owner and the cluster path await, and are
    /// boxed where they are taken: their states (a gRPC client call, the
    /// cluster walk) are kilobytes, and every call's future, which the
    /// server boxes and moves, would otherwise carry them.
    pub fn pick_one<'a>(
        &'a self,
        caller: &'a Caller,
        ext: &'a http::Extensions,
        r: &mut pb::PickCpuRequest,
    ) -> Result<Picked<'a>, Status> {
        if let Some((rep, m)) = self.peer_for(&r.node_id, ext)? {
            let mut c = rep.placement(&m)?;
            let r = std::mem::take(r);
            let forward =
                route::forward("PickCpu", caller, r, |q| async move { c.pick_cpu(q).await });
            return Ok(Picked::Later(Box::pin(async move {
                forward.await.map(Response::into_inner)
            })));
        }
        if r.node_id.is_empty() {
            let r = std::mem::take(r);
            let claim = r.claim;
            return Ok(Picked::Later(Box::pin(async move {
                let resp = self.pick_on_cluster(caller, r).await?;
                if claim {
                    count_claim_here(&self.store, caller, &resp);
                }
                Ok(resp)
            })));
        }
        let node = super::lookup::registered_node(&self.store, &r.node_id)?;
        let answer = self.pick_on(&node, r, false)?;
        if r.claim {
            count_claims(caller, 1);
        }
        Ok(Picked::Now(answer))
    }

    /// The peer that answers a call for `node`, if not this replica.
    fn peer_for(
        &self,
        node: &str,
        ext: &http::Extensions,
    ) -> Result<Option<(&Replicated, crate::replica::Member)>, Status> {
        let Some(rep) = self.replicated.as_ref() else {
            return Ok(None);
        };
        match rep.route_node(&self.store, node, ext)? {
            Route::Here => Ok(None),
            Route::Peer(m) => Ok(Some((rep, m))),
        }
    }

    /// The peer that answers a call for lease `id`, if not this replica.
    async fn peer_for_lease(
        &self,
        id: u64,
        ext: &http::Extensions,
    ) -> Result<Option<(&Replicated, crate::replica::Member)>, Status> {
        let Some(rep) = self.replicated.as_ref() else {
            return Ok(None);
        };
        match rep.route_lease(&self.store, id, ext).await? {
            Route::Here => Ok(None),
            Route::Peer(m) => Ok(Some((rep, m))),
        }
    }

    /// What the lease calls use of the service.
    fn leasing(&self) -> super::allocate::Leasing<'_> {
        super::allocate::Leasing {
            store: &self.store,
            hub: &self.hub,
            heavy: &self.heavy,
            recorder: &self.recorder,
        }
    }

    /// A placement on one node, against its live state; with `claim`, decided
    /// again until the claim commits on the snapshot it was decided on. The
    /// answer names no node: its caller does (a named node's is the
    /// request's own string, moved or borrowed, not copied).
    /// `cluster`: the request came down the cluster path (a recording says so).
    fn pick_on(
        &self,
        node: &Node,
        r: &pb::PickCpuRequest,
        cluster: bool,
    ) -> Result<PickAnswer, Status> {
        let mut attempt = 0;
        let mut task = crate::engine::state::Task::new(1, 0);
        loop {
            let now = Instant::now();
            let (snap, age) = super::lookup::fresh_snapshot(&self.store, node, now)?;
            let preq = convert::pick_request(r, &snap, &mut task).map_err(convert::invalid)?;
            let view = snap.view(&self.store.config.system);
            let t0 = quanta::Instant::now();
            let p = select_task_rq(view, &task, &preq);
            let took = t0.elapsed().as_secs_f64();
            if r.claim && !self.store.nodes.try_claim(node, snap.version, p.cpu, now) {
                attempt += 1;
                metrics::counter!(m::CLAIM_RETRIES).increment(1);
                if attempt < CLAIM_ATTEMPTS {
                    continue;
                }
                // Contended: decide once more, holding the node's writer.
                let sys = self.store.config.system;
                let (p, version, took) = self.store.nodes.claim_locked(node, now, |cur| {
                    let view = cur.view(&sys);
                    let t0 = quanta::Instant::now();
                    let p = select_task_rq(view, &task, &preq);
                    let took = t0.elapsed().as_secs_f64();
                    ((p, cur.version, took), Some(p.cpu))
                });
                record_decision(node, &preq, &p, took, age);
                let mut resp = convert::pick_response(&p, &node.snapshot(), age);
                resp.state_version = version;
                self.recorder.picked(&node.id, version, r, &resp, cluster);
                return Ok(resp);
            }
            record_decision(node, &preq, &p, took, age);
            let resp = convert::pick_response(&p, &snap, age);
            self.recorder
                .picked(&node.id, snap.version, r, &resp, cluster);
            return Ok(resp);
        }
    }

    /// A placement with no node: a wakeup naming a fresh previous node that
    /// can run the task stays on that node's fast path; anything else runs
    /// the slow path down the cluster and then on the chosen node as a fork.
    async fn pick_on_cluster(
        &self,
        caller: &Caller,
        mut r: pb::PickCpuRequest,
    ) -> Result<pb::PickCpuResponse, Status> {
        let allowed = match r
            .task
            .as_ref()
            .map(|t| t.cpus_allowed.as_str())
            .unwrap_or("")
        {
            "" => CpuMask::first_n(MAX_CPUS),
            s => CpuMask::parse_cpulist(s, MAX_CPUS)
                .map_err(|e| Status::invalid_argument(format!("task.cpus_allowed: {e}")))?,
        };
        if allowed.is_empty() {
            return Err(Status::invalid_argument(
                "task.cpus_allowed: must not be empty",
            ));
        }
        let now = Instant::now();
        if r.kind == pb::RequestKind::Wakeup as i32
            && !r.prev_node.is_empty()
            && let Some(prev) = self.store.nodes.get(&r.prev_node)
        {
            let s = prev.snapshot();
            if self.store.nodes.is_fresh(&s, now) && s.topo.online.intersects(&allowed) {
                let mut resp = self
                    .pick_on(&prev, &r, true)?
                    .into_response(prev.id.clone());
                resp.cluster_level = "prev_node".into();
                return Ok(resp);
            }
        }
        let selector = convert::selector(&r.selector, &self.store.cluster.hierarchy.config)?;
        let origin = if r.origin_node.is_empty() {
            None
        } else {
            let o = super::lookup::registered_node(&self.store, &r.origin_node).map_err(|_| {
                Status::not_found(format!(
                    "origin_node: no node {} is registered",
                    convert::quote(&r.origin_node)
                ))
            })?;
            Some((self.store.cluster.hierarchy.path(&o.labels), o.id.clone()))
        };
        let req = ClusterRequest {
            first_allowed_cpu: allowed.first().unwrap_or(0),
            origin,
            selector,
        };
        let mut excluded = Vec::new();
        let choice = loop {
            let choice = self
                .store
                .cluster
                .pick_excluding(&req, &allowed, &excluded)
                .ok_or_else(|| {
                    Status::failed_precondition(
                        "no fresh node matches the selector and can run the task",
                    )
                })?;
            metrics::counter!(m::CLUSTER_DECISIONS, "level" => choice.level.clone()).increment(1);
            metrics::histogram!(m::CLUSTER_GROUPS_COMPARED).record(choice.compared as f64);
            if self.store.nodes.get(&choice.node).is_some() {
                break choice;
            }
            // Another replica's node: its owner places the task on its live
            // state, and may refuse what its published figures promised.
            match self.pick_remote(caller, &r, &allowed, &choice).await {
                Err(s) if refused_by_owner(&s) && excluded.len() < REVALIDATE_RETRIES => {
                    metrics::counter!(m::REPLICA_REFUSALS, "method" => "PickCpu").increment(1);
                    excluded.push(choice.node);
                }
                out => return out,
            }
        };
        let node = super::lookup::registered_node(&self.store, &choice.node)?;
        // On the chosen node the task is placed like a fork, from this_cpu
        // on the origin node, else from its lowest allowed online CPU.
        let snap = node.snapshot();
        if choice.node != r.origin_node {
            r.this_cpu = allowed.first_and(&snap.topo.online).unwrap_or(0) as u32;
        }
        r.kind = pb::RequestKind::Fork as i32;
        let mut resp = self
            .pick_on(&node, &r, true)?
            .into_response(node.id.clone());
        resp.cluster_level = choice.level;
        resp.groups_compared = choice.compared;
        Ok(resp)
    }
}

impl Placement {
    /// The cluster's choice of another replica's node, placed there as a
    /// fork (as a local choice is), through the node's owner.
    async fn pick_remote(
        &self,
        caller: &Caller,
        r: &pb::PickCpuRequest,
        allowed: &CpuMask,
        choice: &crate::store::hierarchy::ClusterChoice,
    ) -> Result<pb::PickCpuResponse, Status> {
        let (rep, owner) = self.remote_owner(&choice.node)?;
        let online = self
            .store
            .cluster
            .hierarchy
            .remote_node(&choice.node)
            .map(|n| n.online)
            .unwrap_or_default();
        let mut q = r.clone();
        q.node_id = choice.node.clone();
        if choice.node != r.origin_node {
            q.this_cpu = allowed.first_and(&online).unwrap_or(0) as u32;
        }
        q.kind = pb::RequestKind::Fork as i32;
        let mut c = rep.placement(&owner)?;
        let mut resp = route::forward("PickCpu", caller, q, |q| async move { c.pick_cpu(q).await })
            .await?
            .into_inner();
        resp.cluster_level = choice.level.clone();
        resp.groups_compared = choice.compared;
        Ok(resp)
    }

    /// AllocateCpus with no node, one replica of several: the cluster's
    /// choice among every replica's nodes, allocated here or by its owner
    /// (who may refuse on its live state: then another node, twice at most).
    async fn allocate_on_cluster(
        &self,
        caller: &Caller,
        r: pb::AllocateCpusRequest,
    ) -> Result<pb::AllocateCpusResponse, Status> {
        let mut excluded = Vec::new();
        loop {
            let node = super::allocate::choose_on_cluster(&self.store, &r, &excluded)?;
            let mut q = r.clone();
            q.node_id = node.clone();
            if self.store.nodes.get(&node).is_some() {
                return super::allocate::allocate_cpus(self.leasing(), caller, q).await;
            }
            let (rep, owner) = self.remote_owner(&node)?;
            let mut c = rep.placement(&owner)?;
            let out = route::forward("AllocateCpus", caller, q, |q| async move {
                c.allocate_cpus(q).await
            })
            .await;
            match out {
                Err(s) if refused_by_owner(&s) && excluded.len() < REVALIDATE_RETRIES => {
                    metrics::counter!(m::REPLICA_REFUSALS, "method" => "AllocateCpus").increment(1);
                    excluded.push(node);
                }
                out => return out.map(Response::into_inner),
            }
        }
    }

    /// The replica set and the owner of another replica's node.
    fn remote_owner(&self, node: &str) -> Result<(&Replicated, crate::replica::Member), Status> {
        let rep = self.replicated.as_ref().ok_or_else(|| {
            Status::internal(format!(
                "node {} is not registered here",
                convert::quote(node)
            ))
        })?;
        let owner = rep.replica.owner_of(node).ok_or_else(|| {
            Status::unavailable(format!(
                "node {}: its owner is not known here now; retry",
                convert::quote(node)
            ))
        })?;
        Ok((rep, owner))
    }
}

/// Placements chosen from another replica's figures that its owner may
/// refuse, each time with another node, before the refusal is the answer.
const REVALIDATE_RETRIES: usize = 2;

/// The owner turned the node down on its live state (stale, gone, moving,
/// or no longer able to take the task): another node may do.
fn refused_by_owner(s: &Status) -> bool {
    matches!(
        s.code(),
        tonic::Code::FailedPrecondition
            | tonic::Code::NotFound
            | tonic::Code::Unavailable
            | tonic::Code::ResourceExhausted
    )
}

#[tonic::async_trait]
impl PlacementService for Placement {
    async fn pick_cpu(
        &self,
        req: Request<pb::PickCpuRequest>,
    ) -> Result<Response<pb::PickCpuResponse>, Status> {
        let (_, ext, mut r) = req.into_parts();
        let caller = Caller::of(&ext);
        let picked = self.pick_one(&caller, &ext, &mut r)?;
        let node_id = std::mem::take(&mut r.node_id);
        picked.into_response(node_id).await.map(Response::new)
    }

    type PickCpusStream = Answers;

    async fn pick_cpus(
        &self,
        req: Request<tonic::Streaming<pb::PickCpuRequest>>,
    ) -> Result<Response<Self::PickCpusStream>, Status> {
        Ok(Response::new(self.pick_stream(req)))
    }

    async fn can_migrate(
        &self,
        req: Request<pb::CanMigrateRequest>,
    ) -> Result<Response<pb::CanMigrateResponse>, Status> {
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            let caller = Caller::of(req.extensions());
            let mut c = rep.placement(&m)?;
            return route::forward("CanMigrate", &caller, req.into_inner(), |q| async move {
                c.can_migrate(q).await
            })
            .await;
        }
        let r = req.into_inner();
        let node = super::lookup::registered_node(&self.store, &r.node_id)?;
        let (snap, _) = super::lookup::fresh_snapshot(&self.store, &node, Instant::now())?;
        let (task, env) = convert::migrate_request(&r, &snap).map_err(convert::invalid)?;
        let view = snap.view(&self.store.config.system);
        let d = can_migrate_task(view, &task, &env);
        let verdict = if d.allowed { "allowed" } else { "refused" };
        metrics::counter!(m::MIGRATE_CHECKS, "verdict" => verdict, "reason" => d.reason.as_str())
            .increment(1);
        let answer = convert::migrate_response(&d, &snap);
        self.recorder.migrated(&node.id, snap.version, &r, &answer);
        Ok(Response::new(answer))
    }

    async fn balance(
        &self,
        req: Request<pb::BalanceRequest>,
    ) -> Result<Response<pb::BalanceResponse>, Status> {
        let caller = Caller::of(req.extensions());
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            let mut c = rep.placement(&m)?;
            return route::forward("Balance", &caller, req.into_inner(), |q| async move {
                c.balance(q).await
            })
            .await;
        }
        let ext = req.extensions().clone();
        let r = req.into_inner();
        if r.node_id.is_empty() {
            return self.balance_cluster(&caller, &ext, r).await;
        }
        if r.apply {
            identity::check_apply(&caller)?;
        }
        let store = Arc::clone(&self.store);
        if !r.cluster_level.is_empty() || !r.cluster_group.is_empty() {
            return Err(Status::invalid_argument(
                "cluster_level: a node balance takes no cluster group",
            ));
        }
        let node = super::lookup::registered_node(&self.store, &r.node_id)?;
        let (snap, _) = super::lookup::fresh_snapshot(&self.store, &node, Instant::now())?;
        let version = snap.version;
        let dst_cpus = convert::balance_cpus(&r.cpus, &snap.topo).map_err(convert::invalid)?;
        let breq = BalanceRequest {
            dst_cpus,
            honor_intervals: r.honor_intervals,
            apply: r.apply,
            max_proposals: r.max_proposals as usize,
        };
        let t0 = Instant::now();
        let n = Arc::clone(&node);
        let out = self
            .heavy
            .run("balance", move || store.passes.try_balance(&n, &breq, t0))
            .await?
            .ok_or_else(|| {
                Status::aborted(format!(
                    "node_id: a balance pass of {} is already running; try again",
                    convert::quote(&r.node_id)
                ))
            })?;
        m::record_balance(
            "node",
            &out.stats,
            out.proposals
                .iter()
                .map(|p| (p.migration_type.as_str(), p.active)),
            t0.elapsed().as_secs_f64(),
        );
        if r.apply {
            count_claims(&caller, out.proposals.len());
        }
        let answer = convert::balance_response(&out, &node.id);
        self.recorder.balanced(&node.id, version, &r, &answer);
        Ok(Response::new(answer))
    }

    async fn decide(
        &self,
        req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        let r = req.into_inner();
        // Parsing, the topology build and the decision all scale with the
        // scenario's size: all of it runs in the heavy pool.
        let answer = self
            .heavy
            .run("decide", move || {
                let v: serde_json::Value = serde_json::from_str(&r.scenario_json).map_err(|e| {
                    Status::invalid_argument(format!("scenario_json: malformed JSON: {e}"))
                })?;
                decide_value(&v).map_err(convert::invalid)
            })
            .await??;
        Ok(Response::new(pb::DecideResponse {
            answer_json: answer.to_string(),
        }))
    }

    async fn allocate_cpus(
        &self,
        req: Request<pb::AllocateCpusRequest>,
    ) -> Result<Response<pb::AllocateCpusResponse>, Status> {
        let caller = Caller::of(req.extensions());
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            let mut c = rep.placement(&m)?;
            return route::forward("AllocateCpus", &caller, req.into_inner(), |q| async move {
                c.allocate_cpus(q).await
            })
            .await;
        }
        if req.get_ref().node_id.is_empty()
            && self.replicated.is_some()
            && !route::forwarded(req.extensions())
        {
            return self
                .allocate_on_cluster(&caller, req.into_inner())
                .await
                .map(Response::new);
        }
        super::allocate::allocate_cpus(self.leasing(), &caller, req.into_inner())
            .await
            .map(Response::new)
    }

    async fn release_cpus(
        &self,
        req: Request<pb::ReleaseCpusRequest>,
    ) -> Result<Response<pb::ReleaseCpusResponse>, Status> {
        let caller = Caller::of(req.extensions());
        if let Some((rep, m)) = self
            .peer_for_lease(req.get_ref().lease_id, req.extensions())
            .await?
        {
            let mut c = rep.placement(&m)?;
            return route::forward("ReleaseCpus", &caller, req.into_inner(), |q| async move {
                c.release_cpus(q).await
            })
            .await;
        }
        let id = req.get_ref().lease_id;
        let out = super::allocate::release_cpus(self.leasing(), &caller, req.into_inner()).await;
        self.confirmed(id, out).await.map(Response::new)
    }

    async fn renew_lease(
        &self,
        req: Request<pb::RenewLeaseRequest>,
    ) -> Result<Response<pb::RenewLeaseResponse>, Status> {
        let caller = Caller::of(req.extensions());
        if let Some((rep, m)) = self
            .peer_for_lease(req.get_ref().lease_id, req.extensions())
            .await?
        {
            let mut c = rep.placement(&m)?;
            return route::forward("RenewLease", &caller, req.into_inner(), |q| async move {
                c.renew_lease(q).await
            })
            .await;
        }
        let id = req.get_ref().lease_id;
        let out = super::allocate::renew_lease(self.leasing(), &caller, req.into_inner()).await;
        self.confirmed(id, out).await.map(Response::new)
    }
}

impl Placement {
    /// A lease call's answer, its NOT_FOUND confirmed with replicas: a
    /// replica's memory may have dropped the lease between the routing and
    /// the call (its node let go, or read again in a new ownership
    /// period), so NOT_FOUND stands only when etcd holds no such lease;
    /// otherwise the call is UNAVAILABLE (the node is moving).
    async fn confirmed<T>(&self, id: u64, out: Result<T, Status>) -> Result<T, Status> {
        match (&self.replicated, out) {
            (Some(rep), Err(s)) if s.code() == tonic::Code::NotFound && id != 0 => {
                Err(rep.confirm_not_found(id, s).await)
            }
            (_, out) => out,
        }
    }
}

/// A cluster path claim is counted here when the chosen node is
/// this replica's (one made through another replica is counted at its
/// owner).
fn count_claim_here(store: &Store, caller: &Caller, resp: &pb::PickCpuResponse) {
    if store.nodes.get(&resp.node_id).is_some() {
        count_claims(caller, 1);
    }
}

/// Claims made, attributed to the caller's certificate name.
pub(super) fn count_claims(caller: &Caller, n: usize) {
    if n > 0 {
        metrics::counter!(m::CLAIMS_BY_CALLER, "caller" => caller.claimant()).increment(n as u64);
    }
}

/// The decision metrics, on whichever path (first try or contended) the
/// placement was decided.
fn record_decision(node: &Node, preq: &PlaceRequest, p: &Decision, took: f64, age: f64) {
    m::record_decision(preq.kind, p.path, p.scanned, took, age);
    // Per node: kept on the node, rendered at scrape time.
    node.count_decision(preq.kind);
}

/// The fast path (`transport::fast_unary`) decides with the same pick.
impl PickHere for Placement {
    fn pick_here<'a>(
        &'a self,
        caller: &'a Caller,
        ext: &'a http::Extensions,
        r: &mut pb::PickCpuRequest,
    ) -> Result<Picked<'a>, Status> {
        self.pick_one(caller, ext, r)
    }
}
