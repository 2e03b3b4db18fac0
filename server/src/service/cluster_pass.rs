//! A cluster Balance (a level and a group, no node) as the service runs it.
//!
//! One server: the pass reads the group's registered nodes
//! ([`crate::store::cluster::Cluster::balance`]). Several replicas: the group's nodes are
//! spread over their owners, so the replica running the pass first fetches
//! the state of the nodes other replicas hold (`ReplicaService.NodeStates`,
//! each owner asked once, all in parallel) and counts them beside its own;
//! with `apply` it claims the destinations on its own nodes and asks each
//! owner to claim those on its nodes (`ReplicaService.ClaimCpus`). A pass
//! that acts runs on the elected balancer only: the failure counts it keeps
//! between passes, like a domain's `nr_balance_failed`, live in one place.
//!
//! An owner that cannot send its nodes fails the pass with UNAVAILABLE:
//! a pass that silently left out a share of the group would balance a
//! different cluster than the one asked about.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::replica_service_client::ReplicaServiceClient;
use tokio::task::JoinSet;
use tonic::{Response, Status};

use super::placement::{Placement, count_claims};
use crate::convert;
use crate::engine::balance::cluster::ClusterBalanceOutcome;
use crate::engine::topology::FieldError;
use crate::identity::{self, Caller};
use crate::metrics as m;
use crate::replica::aggregates;
use crate::replica::forward;
use crate::replica::peers::MAX_NODE_STATES;
use crate::replica::route::{self, Replicated};
use crate::store::Store;
use crate::store::cluster::ClusterBalanceRequest;
use crate::store::cluster::PeerMembers;

/// How long a pass waits for the owners' node states.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

impl Placement {
    /// A cluster Balance: checked, sent to the elected balancer when it
    /// acts and this replica is not it, else run here.
    pub(super) async fn balance_cluster(
        &self,
        caller: &Caller,
        ext: &http::Extensions,
        r: pb::BalanceRequest,
    ) -> Result<Response<pb::BalanceResponse>, Status> {
        if r.cluster_level.is_empty() {
            return Err(Status::invalid_argument(
                "node_id: name a node, or cluster_level and cluster_group for a cluster balance",
            ));
        }
        if !r.cpus.is_empty() {
            return Err(Status::invalid_argument(
                "cpus: only a node balance takes destination CPUs",
            ));
        }
        if r.apply {
            identity::check_apply(caller)?;
        }
        // A pass that acts runs on the elected balancer only.
        if r.apply
            && let Some(rep) = self.replicated.as_ref()
            && !route::forwarded(ext)
            && !rep.replica.is_leader()
        {
            let leader = rep.leader().await?;
            let mut c = rep.placement(&leader)?;
            return route::forward("Balance", caller, r, |q| async move { c.balance(q).await })
                .await;
        }
        let creq = ClusterBalanceRequest {
            level: r.cluster_level.clone(),
            group: r.cluster_group.clone(),
            apply: r.apply,
            max_proposals: r.max_proposals as usize,
        };
        let t0 = Instant::now();
        let fetched = match self.replicated.as_ref() {
            Some(rep) => fetch_peer_states(rep, &self.store, &creq).await?,
            None => Vec::new(),
        };
        let store = Arc::clone(&self.store);
        let mut out = self
            .heavy
            .run("balance", move || {
                let peers = peer_members(&store, fetched).map_err(|e| {
                    Status::unavailable(format!(
                        "a replica sent a node state that does not check: {e}"
                    ))
                })?;
                store
                    .cluster
                    .balance(&creq, peers, t0)
                    .map_err(convert::invalid)
            })
            .await??;
        if r.apply
            && let Some(rep) = self.replicated.as_ref()
        {
            out.claimed += claim_at_owners(rep, &self.store, &out).await;
        }
        m::record_balance(
            "cluster",
            &out.stats,
            out.proposals
                .iter()
                .map(|p| (p.migration_type.as_str(), false)),
            t0.elapsed().as_secs_f64(),
        );
        if r.apply {
            count_claims(caller, out.proposals.len());
        }
        Ok(Response::new(convert::cluster_balance_response(&out)))
    }
}

/// The group's nodes other replicas hold, by the replica that publishes
/// them.
fn peer_nodes_by_owner(
    rep: &Replicated,
    store: &Store,
    creq: &ClusterBalanceRequest,
) -> Result<HashMap<String, Vec<String>>, Status> {
    let ids = store.cluster.peer_nodes(creq).map_err(convert::invalid)?;
    let mut by_owner: HashMap<String, Vec<String>> = HashMap::new();
    for id in ids {
        if let Some(n) = store.cluster.hierarchy.remote_node(&id)
            && n.replica != rep.replica.id
        {
            by_owner.entry(n.replica).or_default().push(id);
        }
    }
    Ok(by_owner)
}

/// The state of the group's nodes other replicas hold, fetched from every
/// owner at once; UNAVAILABLE naming the first owner that cannot send.
async fn fetch_peer_states(
    rep: &Replicated,
    store: &Store,
    creq: &ClusterBalanceRequest,
) -> Result<Vec<pb::NodeState>, Status> {
    let mut calls = JoinSet::new();
    for (owner, ids) in peer_nodes_by_owner(rep, store, creq)? {
        let Some(member) = rep.replica.member(&owner) else {
            return Err(Status::unavailable(format!(
                "cluster_group: replica {owner} holds nodes of the group and has left the set; retry"
            )));
        };
        let ch = rep.replica.peers.channel(&member.addr)?;
        calls.spawn(async move {
            let r = tokio::time::timeout(FETCH_TIMEOUT, node_states(ch, ids)).await;
            let r = r.unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer in time")));
            forward::count("NodeStates", &r);
            r.map_err(|e| {
                Status::unavailable(format!(
                    "cluster_group: replica {owner} did not send its nodes' state ({}: {}); retry",
                    e.code(),
                    e.message()
                ))
            })
        });
    }
    let mut all = Vec::new();
    while let Some(done) = calls.join_next().await {
        let states = done.map_err(|e| Status::internal(format!("node state fetch: {e}")))??;
        all.extend(states);
    }
    Ok(all)
}

/// One owner's answer for `ids`, in calls of at most [`MAX_NODE_STATES`].
async fn node_states(
    ch: tonic::transport::Channel,
    ids: Vec<String>,
) -> Result<Vec<pb::NodeState>, Status> {
    let mut client = ReplicaServiceClient::new(ch);
    let mut out = Vec::with_capacity(ids.len());
    for chunk in ids.chunks(MAX_NODE_STATES) {
        let req = pb::NodeStatesRequest {
            node_ids: chunk.to_vec(),
        };
        let mut stream = client.node_states(req).await?.into_inner();
        while let Some(st) = stream.message().await? {
            out.push(st);
        }
    }
    Ok(out)
}

/// The fetched states as pass members, each checked as an agent's full
/// report is.
fn peer_members(store: &Store, fetched: Vec<pb::NodeState>) -> Result<PeerMembers, FieldError> {
    let mut peers = PeerMembers::with_capacity(fetched.len());
    for st in fetched {
        let Some(a) = st.aggregate.as_ref() else {
            continue;
        };
        let at = |e: FieldError| FieldError::new(format!("node {}: {}", a.node_id, e.field), e.msg);
        let spec = convert::topology_spec(st.topology.as_ref(), "topology").map_err(at)?;
        let u = pb::Update {
            full: true,
            cpus: st.cpus,
            tasks: st.tasks,
            ..Default::default()
        };
        let u = convert::update(&u, &spec).map_err(at)?;
        let agg = aggregates::agg_from_pb(a);
        let m = store
            .cluster
            .peer_member(&a.node_id, spec, &u, st.util_est, agg)
            .map_err(at)?;
        peers.insert(a.node_id.clone(), m);
    }
    Ok(peers)
}

/// Claims the pass's destinations on other replicas' nodes at their
/// owners; the CPUs claimed. An owner that does not answer claims nothing
/// (the proposals stand; the claims only hold off other decisions).
async fn claim_at_owners(rep: &Replicated, store: &Store, out: &ClusterBalanceOutcome) -> u32 {
    let mut by_node: HashMap<&str, Vec<u32>> = HashMap::new();
    for p in &out.proposals {
        if store.nodes.get(&p.dst_node).is_none() {
            by_node
                .entry(p.dst_node.as_str())
                .or_default()
                .push(p.dst_cpu as u32);
        }
    }
    let mut calls = JoinSet::new();
    for (node, cpus) in by_node {
        let Some(owner) = store
            .cluster
            .hierarchy
            .remote_node(node)
            .and_then(|n| rep.replica.member(&n.replica))
        else {
            continue;
        };
        let Ok(ch) = rep.replica.peers.channel(&owner.addr) else {
            continue;
        };
        let req = pb::ClaimCpusRequest {
            node_id: node.to_string(),
            cpus,
        };
        calls.spawn(async move {
            let r =
                tokio::time::timeout(FETCH_TIMEOUT, ReplicaServiceClient::new(ch).claim_cpus(req))
                    .await
                    .unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer in time")));
            forward::count("ClaimCpus", &r);
            r.map_or(0, |r| r.into_inner().claimed)
        });
    }
    let mut claimed = 0;
    while let Some(done) = calls.join_next().await {
        claimed += done.unwrap_or(0);
    }
    claimed
}
