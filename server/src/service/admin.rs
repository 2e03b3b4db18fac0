//! AdminService: the registered nodes and the feature switches.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::admin_service_server::AdminService;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::convert;
use crate::engine::features::{FEATURE_NAMES, Features};
use crate::identity::Caller;
use crate::replica::Member;
use crate::replica::route::{self, Replicated, Route, forwarded};
use crate::store::{Node, Store};

/// The admin service's own check, after the role table (`identity.rs`):
/// under mutual TLS only an admin certificate reaches SetFeatures at all;
/// this adds the bearer token (`--admin-token`) on top, and is the one
/// check without client certificates.
pub trait Authorize: Send + Sync + 'static {
    fn authorize(&self, method: &str, metadata: &MetadataMap) -> Result<(), Status>;
}

/// Reads are open; SetFeatures and Record need `authorization: Bearer
/// <token>` when a token is configured.
pub struct TokenAuth {
    pub token: Option<String>,
}

impl Authorize for TokenAuth {
    fn authorize(&self, method: &str, metadata: &MetadataMap) -> Result<(), Status> {
        let Some(token) = &self.token else {
            return Ok(());
        };
        if method != "SetFeatures" && method != "Record" {
            return Ok(());
        }
        let Some(v) = metadata.get("authorization").map(|v| v.as_bytes()) else {
            return Err(Status::unauthenticated(
                "authorization: a bearer token is required",
            ));
        };
        // `Bearer` in any case (RFC 9110: the scheme is case-insensitive),
        // then the token, compared in constant time.
        let (scheme, given) = match v.iter().position(|b| *b == b' ') {
            Some(i) => (&v[..i], v[i + 1..].trim_ascii()),
            None => (v, &[][..]),
        };
        if !scheme.eq_ignore_ascii_case(b"bearer") {
            return Err(Status::unauthenticated(
                "authorization: expected `Bearer TOKEN`",
            ));
        }
        if constant_time_eq(given, token.as_bytes()) {
            Ok(())
        } else {
            Err(Status::permission_denied("authorization: wrong token"))
        }
    }
}

/// Equality whose time depends only on the lengths, not on where the first
/// difference is.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

pub struct Admin {
    pub store: Arc<Store>,
    pub auth: Box<dyn Authorize>,
    /// With `--etcd-endpoints`: node calls go to the node's owner, and
    /// ListNodes merges every replica's nodes.
    pub replicated: Option<Replicated>,
    /// Records for AdminService.Record.
    pub recorder: Arc<crate::record::Hub>,
}

impl Admin {
    /// The peer that answers a call for `node`, if not this replica.
    fn peer_for(
        &self,
        node: &str,
        ext: &http::Extensions,
    ) -> Result<Option<(&Replicated, Member)>, Status> {
        let Some(rep) = self.replicated.as_ref() else {
            return Ok(None);
        };
        match rep.route_node(&self.store, node, ext)? {
            Route::Here => Ok(None),
            Route::Peer(m) => Ok(Some((rep, m))),
        }
    }

    /// Every other live replica's nodes, asked at once; a replica that does
    /// not answer is left out (its nodes are being taken over).
    async fn peers_nodes(&self, caller: &Caller) -> Vec<pb::NodeSummary> {
        let Some(rep) = &self.replicated else {
            return Vec::new();
        };
        let mut set = tokio::task::JoinSet::new();
        for m in rep.replica.members().iter() {
            if m.id == rep.replica.id {
                continue;
            }
            let (Ok(mut c), Ok(req)) = (
                rep.admin(m),
                crate::replica::forward::Peers::request(pb::ListNodesRequest {}, &caller.owner()),
            ) else {
                continue;
            };
            let id = m.id.clone();
            set.spawn(async move { (id, c.list_nodes(req).await) });
        }
        let mut out = Vec::new();
        while let Some(Ok((id, r))) = set.join_next().await {
            crate::replica::forward::count("ListNodes", &r);
            match r {
                Ok(r) => out.extend(r.into_inner().nodes),
                Err(e) => {
                    tracing::warn!(replica = %id, error = %e, "ListNodes: a replica did not answer; its nodes are left out")
                }
            }
        }
        out
    }
}

/// A node's summary from one snapshot (the caller's, so that a GetNode's
/// summary and CPU list describe the same version).
pub fn summary(
    store: &Store,
    n: &Node,
    s: &crate::store::Snapshot,
    now: Instant,
) -> pb::NodeSummary {
    let idle = s
        .state
        .cpus
        .iter()
        .filter(|c| c.online && c.available_idle())
        .count();
    let leases = store.leases.leases_of(n);
    pb::NodeSummary {
        id: n.id.clone(),
        labels: n.labels.iter().cloned().collect(),
        reported_labels: n.reported_labels.iter().cloned().collect(),
        cpus: s.topo.nr_cpus as u32,
        online_cpus: s.topo.online.weight() as u32,
        idle_cpus: idle as u32,
        age_seconds: s.age(now).map_or(-1.0, |a| a.as_secs_f64()),
        fresh: store.nodes.is_fresh(s, now),
        connected: n.connected.load(Ordering::SeqCst),
        state_version: s.version,
        signal_source: n.signal_source.load(Ordering::Relaxed),
        exact_signals: signal_source_is_exact(n.signal_source.load(Ordering::Relaxed)),
        leases: leases.len() as u32,
        leased_cpus: leases.iter().map(|l| l.cpus.weight() as u32).sum(),
        kernel_profile: s.features.kernel.as_str().to_string(),
    }
}

/// The kernel's own values rather than estimates.
pub fn signal_source_is_exact(source: i32) -> bool {
    matches!(
        pb::SignalSource::try_from(source),
        Ok(pb::SignalSource::SchedDebug | pb::SignalSource::Bpf)
    )
}

fn features_pb(f: &Features, overridden: Vec<String>) -> pb::Features {
    pb::Features {
        features: FEATURE_NAMES
            .iter()
            .map(|n| (n.to_string(), f.get(n).unwrap_or(false)))
            .collect(),
        overridden,
    }
}

impl Admin {
    fn node(&self, id: &str) -> Result<Arc<Node>, Status> {
        self.store.nodes.get(id).ok_or_else(|| {
            Status::not_found(format!(
                "node_id: no node {} is registered",
                convert::quote(id)
            ))
        })
    }
}

#[tonic::async_trait]
impl AdminService for Admin {
    async fn list_nodes(
        &self,
        req: Request<pb::ListNodesRequest>,
    ) -> Result<Response<pb::ListNodesResponse>, Status> {
        self.auth.authorize("ListNodes", req.metadata())?;
        let now = Instant::now();
        let mut nodes: Vec<pb::NodeSummary> = self
            .store
            .nodes
            .all()
            .iter()
            .map(|n| summary(&self.store, n, &n.snapshot(), now))
            .collect();
        if !forwarded(req.extensions()) {
            let caller = Caller::of(req.extensions());
            nodes.extend(self.peers_nodes(&caller).await);
            nodes.sort_by(|a, b| a.id.cmp(&b.id));
            // A node seen at two replicas while it moves: the first (any).
            nodes.dedup_by(|a, b| a.id == b.id);
        }
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }

    async fn get_node(
        &self,
        req: Request<pb::GetNodeRequest>,
    ) -> Result<Response<pb::GetNodeResponse>, Status> {
        self.auth.authorize("GetNode", req.metadata())?;
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            let caller = Caller::of(req.extensions());
            let mut c = rep.admin(&m)?;
            return route::forward("GetNode", &caller, req.into_inner(), |q| async move {
                c.get_node(q).await
            })
            .await;
        }
        let n = self.node(&req.get_ref().node_id)?;
        if let Some(rep) = &self.replicated
            && !rep.current(&self.store, &n.id)
        {
            return Err(Status::unavailable(format!(
                "node_id: replica {} does not hold node {} in its current ownership period (moving, or this replica lost etcd); retry",
                rep.replica.id,
                crate::quote::quote(&n.id)
            )));
        }
        let s = n.snapshot();
        Ok(Response::new(pb::GetNodeResponse {
            summary: Some(summary(&self.store, &n, &s, Instant::now())),
            topology: Some(convert::topology_to_pb(&n.spec)),
            cpus: convert::cpu_states_to_pb(&s.state),
            claims: s.claims.iter().copied().collect(),
            agent_version: n.agent_version.clone(),
            last_seq: n.last_seq(),
            tasks: convert::task_lists_to_pb(&s.tasks),
            leases: super::allocate::leases_to_pb(&self.store.leases.leases_of(&n), Instant::now()),
        }))
    }

    async fn get_cache(
        &self,
        req: Request<pb::GetCacheRequest>,
    ) -> Result<Response<pb::GetCacheResponse>, Status> {
        self.auth.authorize("GetCache", req.metadata())?;
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            let caller = Caller::of(req.extensions());
            let mut c = rep.admin(&m)?;
            return route::forward("GetCache", &caller, req.into_inner(), |q| async move {
                c.get_cache(q).await
            })
            .await;
        }
        let n = self.node(&req.get_ref().node_id)?;
        let c = self.store.passes.cache_summary(&n, Instant::now());
        Ok(Response::new(pb::GetCacheResponse {
            enabled: c.enabled,
            strategy: c.strategy.as_str().to_string(),
            node_limited: c.node_limited,
            llcs: c
                .llcs
                .iter()
                .enumerate()
                .map(|(i, (id, cpus))| pb::Llc {
                    index: i as u32,
                    llc_id: *id,
                    cpus: cpus.to_string(),
                })
                .collect(),
            processes: c
                .procs
                .iter()
                .map(|p| pb::ProcessCache {
                    group: p.group,
                    preferred_cpu: p.preferred_cpu.map(|x| x as u32),
                    preferred_llc: p.preferred_llc.map(|x| x as u32),
                    nr_threads: p.nr_threads,
                    nr_running_avg: p.nr_running_avg,
                    occupancy: p.occupancy.clone(),
                })
                .collect(),
            tasks_with_preference: c.tasks_with_preference,
            tasks_on_preferred_llc: c.tasks_on_preferred_llc,
            scan_passes: c.passes,
            cpus_scanned: c.scanned,
            preference_changes: c.changes,
        }))
    }

    async fn get_features(
        &self,
        req: Request<pb::GetFeaturesRequest>,
    ) -> Result<Response<pb::Features>, Status> {
        self.auth.authorize("GetFeatures", req.metadata())?;
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            let caller = Caller::of(req.extensions());
            let mut c = rep.admin(&m)?;
            return route::forward("GetFeatures", &caller, req.into_inner(), |q| async move {
                c.get_features(q).await
            })
            .await;
        }
        let id = &req.get_ref().node_id;
        if id.is_empty() {
            return Ok(Response::new(features_pb(
                &self.store.switches.global(),
                vec![],
            )));
        }
        let n = self.node(id)?;
        let mut over: Vec<String> = self.store.nodes.overrides(&n).into_keys().collect();
        over.sort();
        Ok(Response::new(features_pb(&n.snapshot().features, over)))
    }

    async fn set_features(
        &self,
        req: Request<pb::SetFeaturesRequest>,
    ) -> Result<Response<pb::Features>, Status> {
        self.auth.authorize("SetFeatures", req.metadata())?;
        let caller = Caller::of(req.extensions());
        if let Some((rep, m)) = self.peer_for(&req.get_ref().node_id, req.extensions())? {
            // The owner checks the token again: it travels with the call.
            let auth = req.metadata().get("authorization").cloned();
            let mut c = rep.admin(&m)?;
            return route::forward(
                "SetFeatures",
                &caller,
                req.into_inner(),
                |mut q| async move {
                    if let Some(a) = auth {
                        q.metadata_mut().insert("authorization", a);
                    }
                    c.set_features(q).await
                },
            )
            .await;
        }
        let r = req.into_inner();
        let mut set: Vec<(String, bool)> = r.set.into_iter().collect();
        set.sort();
        crate::store::check_features(&set).map_err(convert::invalid)?;
        let node = if r.node_id.is_empty() {
            None
        } else {
            Some(self.node(&r.node_id)?)
        };
        if let Some(rep) = &self.replicated {
            // In etcd first: a change etcd did not take changes nothing.
            share_features(rep, &self.store, node.as_deref(), &set, r.clear_overrides).await?;
        }
        self.store
            .nodes
            .set_features(node.as_deref(), &set, r.clear_overrides)
            .map_err(convert::invalid)?;
        tracing::info!(node = %r.node_id, ?set, "features changed");
        match node {
            None => Ok(Response::new(features_pb(
                &self.store.switches.global(),
                vec![],
            ))),
            Some(n) => {
                let mut over: Vec<String> = self.store.nodes.overrides(&n).into_keys().collect();
                over.sort();
                Ok(Response::new(features_pb(&n.snapshot().features, over)))
            }
        }
    }

    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {}))
    }

    type WatchMembersStream = ReceiverStream<Result<pb::ReplicaSet, Status>>;
    type RecordStream = ReceiverStream<Result<pb::RecordChunk, Status>>;

    /// Records what this server sees and decides for `seconds`, streamed
    /// as one segment (the nodes this replica holds, when it is one of
    /// several).
    async fn record(
        &self,
        req: Request<pb::RecordRequest>,
    ) -> Result<Response<Self::RecordStream>, Status> {
        self.auth.authorize("Record", req.metadata())?;
        let r = req.into_inner();
        if !(1..=MAX_RECORD_SECONDS).contains(&r.seconds) {
            return Err(Status::invalid_argument(format!(
                "seconds: {} is out of range 1..{MAX_RECORD_SECONDS}",
                r.seconds
            )));
        }
        let rx = self.recorder.stream(r.seconds, r.max_bytes)?;
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    /// The member set now, then at each change (read every
    /// [`MEMBERS_EVERY`] from the replica's view, which follows etcd),
    /// until the client goes away.
    async fn watch_members(
        &self,
        _: Request<pb::WatchMembersRequest>,
    ) -> Result<Response<Self::WatchMembersStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        let Some(rep) = self.replicated.clone() else {
            let _ = tx.try_send(Ok(pb::ReplicaSet {
                replicated: false,
                owner_hash: crate::replica::hrw::NAME.into(),
                ..Default::default()
            }));
            return Ok(Response::new(ReceiverStream::new(rx)));
        };
        tokio::spawn(async move {
            let mut sent: Option<Arc<Vec<Member>>> = None;
            loop {
                let now = rep.replica.members();
                if sent.as_ref() != Some(&now) {
                    if tx.send(Ok(replica_set(&rep, &now))).await.is_err() {
                        return;
                    }
                    sent = Some(now);
                }
                tokio::select! {
                    _ = tokio::time::sleep(MEMBERS_EVERY) => {}
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// The longest recording one Record call takes (an hour).
pub const MAX_RECORD_SECONDS: u32 = 3600;

/// How often a WatchMembers stream looks at the member set: a member that
/// joins or leaves reaches routing clients within this of the replica
/// seeing it.
const MEMBERS_EVERY: std::time::Duration = std::time::Duration::from_millis(250);

fn replica_set(rep: &Replicated, members: &[Member]) -> pb::ReplicaSet {
    pb::ReplicaSet {
        replicated: true,
        members: members
            .iter()
            .map(|m| pb::ReplicaMember {
                id: m.id.clone(),
                addr: m.addr.clone(),
            })
            .collect(),
        owner_hash: crate::replica::hrw::NAME.into(),
        replica_id: rep.replica.id.clone(),
    }
}

/// A SetFeatures change written to etcd, for the other replicas and for
/// the node's next owner ([`crate::replica::features`]).
async fn share_features(
    rep: &Replicated,
    store: &Store,
    node: Option<&Node>,
    set: &[(String, bool)],
    clear: bool,
) -> Result<(), Status> {
    let unavailable = |e: crate::replica::etcd::EtcdError| {
        Status::unavailable(format!(
            "the feature switches could not be stored in etcd: {e}; retry"
        ))
    };
    match node {
        None => rep.replica.set_global_features(set).await.map(|_| ()),
        Some(n) => {
            let mut over: crate::replica::features::Switches = if clear {
                Default::default()
            } else {
                store.nodes.overrides(n).into_iter().collect()
            };
            over.extend(set.iter().cloned());
            rep.replica.put_node_features(&n.id, &over).await
        }
    }
    .map_err(unavailable)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(token: &str, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut md = MetadataMap::new();
        if let Some(h) = header {
            md.insert("authorization", h.parse().unwrap());
        }
        TokenAuth {
            token: Some(token.into()),
        }
        .authorize("SetFeatures", &md)
        .map_err(|s| s.code())
    }

    #[test]
    fn the_token_takes_bearer_in_any_case_and_nothing_else() {
        assert_eq!(check("s3cret", Some("Bearer s3cret")), Ok(()));
        assert_eq!(check("s3cret", Some("bearer s3cret")), Ok(()));
        assert_eq!(check("s3cret", Some("BEARER s3cret")), Ok(()));
        use tonic::Code::{PermissionDenied, Unauthenticated};
        assert_eq!(check("s3cret", Some("Bearer s3cre")), Err(PermissionDenied));
        let longer = check("s3cret", Some("Bearer s3cret2"));
        assert_eq!(longer, Err(PermissionDenied));
        assert_eq!(check("s3cret", Some("Bearer ")), Err(PermissionDenied));
        assert_eq!(check("s3cret", Some("Basic s3cret")), Err(Unauthenticated));
        assert_eq!(check("s3cret", Some("s3cret")), Err(Unauthenticated));
        assert_eq!(check("s3cret", None), Err(Unauthenticated));
        assert!(constant_time_eq(b"", b""));
        assert!(!constant_time_eq(b"a", b""));
        assert!(!constant_time_eq(b"", b"a"));
    }
}
