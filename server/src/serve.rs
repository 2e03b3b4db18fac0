//! The server assembled: the handlers (`service/`) behind the transport
//! (`transport/`: listeners, TLS, tower layers, the hand-framed fast paths),
//! over the store, with health, reflection, the replica's loops and
//! graceful shutdown. Nothing here decides or frames: it builds the parts
//! from [`ServeConfig`], wires them, and runs them until shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1::admin_service_server::AdminServiceServer;
use fairplace_proto::v1::placement_service_server::PlacementServiceServer;
use fairplace_proto::v1::replica_service_server::ReplicaServiceServer;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::transport::Server;
use tonic_health::pb::health_server::{Health, HealthServer};

use crate::identity;
use crate::metrics as m;
use crate::replica::{peers, route};
use crate::service::cpu_pool as heavy;
use crate::service::{admin, agent, allocate, lease_hub, placement};
use crate::store::{Store, StoreConfig};
use crate::transport::{exposition, fast_unary, layers, listener, tls};

/// Everything `serve` needs; the binary fills it from its flags.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub store: StoreConfig,
    pub request_timeout: Duration,
    pub max_concurrency: usize,
    pub max_message_bytes: usize,
    pub admin_token: Option<String>,
    /// A Report stream must register within this long.
    pub register_timeout: Duration,
    /// After a shutdown signal, calls in flight get this long; then the
    /// server returns whatever is still open.
    pub shutdown_grace: Duration,
    /// Screening of new connections (preface timeout, accept backoff).
    pub listen: listener::ListenOpts,
    /// Heavy jobs (Decide, Balance, topology builds) running at once, and
    /// how many more may wait.
    pub heavy_workers: usize,
    pub heavy_queue: usize,
    /// TLS on the gRPC port; with a client CA, mutual TLS and the role
    /// table (`identity`).
    pub tls: Option<tls::TlsSettings>,
    /// The SPIFFE trust domain client certificates must name.
    pub trust_domain: String,
    /// A plaintext listener that serves only grpc.health.v1 (for probes
    /// that cannot present a client certificate).
    pub health_listener: Option<Arc<std::net::TcpListener>>,
    /// Where leases are kept durably.
    pub leases: LeaseStorage,
    /// HTTP/2 streams one connection may have open at once
    /// (SETTINGS_MAX_CONCURRENT_STREAMS; a client queues beyond it).
    pub max_streams_per_connection: u32,
    /// Long-lived streams open at once, by kind.
    pub streams: layers::StreamCaps,
    /// Report streams waiting for their Register at once.
    pub max_pending_registrations: usize,
    /// Set while serving, cleared when shutdown begins: the metrics port's
    /// `/healthz` reads it ([`exposition::start`]).
    pub ready: exposition::Readiness,
    /// `--etcd-endpoints`: this server is one replica of several, its
    /// leases in etcd (then `leases` is not used).
    pub replica: Option<crate::replica::ReplicaConfig>,
    /// `--record DIR`: everything seen and decided is recorded there
    /// (docs/replay.md).
    pub record: Option<RecordConfig>,
}

/// A recording kept from start to exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordConfig {
    pub dir: std::path::PathBuf,
    /// The directory's budget: the oldest segments go beyond it.
    pub max_bytes: u64,
}

/// Where a server keeps its leases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseStorage {
    /// In memory: they do not survive the process (tests, benchmarks).
    Memory,
    /// `DIR/leases.redb`, committed before each grant, renewal or release
    /// is answered.
    Dir(std::path::PathBuf),
}

impl Default for ServeConfig {
    fn default() -> Self {
        let heavy_workers = heavy::default_workers();
        Self {
            store: StoreConfig::default(),
            request_timeout: Duration::from_secs(2),
            max_concurrency: 1024,
            max_message_bytes: 4 << 20,
            admin_token: None,
            register_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(5),
            listen: listener::ListenOpts::default(),
            heavy_workers,
            heavy_queue: 4 * heavy_workers,
            tls: None,
            trust_domain: "fairplace".into(),
            health_listener: None,
            leases: LeaseStorage::Memory,
            max_streams_per_connection: DEFAULT_MAX_STREAMS_PER_CONNECTION,
            streams: layers::StreamCaps::default(),
            max_pending_registrations: agent::DEFAULT_MAX_PENDING_REGISTRATIONS,
            ready: exposition::Readiness::default(),
            replica: None,
            record: None,
        }
    }
}

/// HTTP/2 streams per connection by default: an agent uses one, an
/// orchestrator's channel queues its calls beyond this many.
pub const DEFAULT_MAX_STREAMS_PER_CONNECTION: u32 = 256;

/// The store `cfg` describes, its leases loaded from the lease store (the
/// expired ones ended); an unusable state directory is an error here,
/// before anything is served.
pub fn open_store(cfg: &ServeConfig) -> Result<Arc<Store>, crate::store::LogError> {
    let log: Arc<dyn crate::store::LeaseLog> = match &cfg.leases {
        LeaseStorage::Memory => Arc::new(crate::store::leases::log::MemoryLog),
        LeaseStorage::Dir(d) => Arc::new(crate::store::leases::log::redb::RedbLog::open(d)?),
    };
    let store = Arc::new(Store::with_log(cfg.store.clone(), log));
    let loaded = store.leases.load_leases(Instant::now())?;
    tracing::info!(
        store = %store.leases.describe(),
        loaded = loaded.loaded,
        unreadable = loaded.unreadable,
        "leases loaded"
    );
    Ok(store)
}

/// Serves until `shutdown` resolves; then health turns NOT_SERVING, the
/// listener closes, Report streams end with UNAVAILABLE (agents reconnect
/// elsewhere), unary calls in flight finish, and this returns within
/// `shutdown_grace` whatever is still open.
pub async fn serve(
    cfg: ServeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (store, replicated) = open(&cfg).await?;
    serve_replicated(cfg, store, replicated, listener, shutdown).await
}

/// The store `cfg` describes: with `cfg.replica`, this replica joined to
/// its set and its leases in etcd; else [`open_store`].
pub async fn open(
    cfg: &ServeConfig,
) -> Result<(Arc<Store>, Option<route::Replicated>), Box<dyn std::error::Error + Send + Sync>> {
    let Some(rc) = cfg.replica.clone() else {
        return Ok((open_store(cfg)?, None));
    };
    let replica = crate::replica::Replica::join(rc, REPLICA_START_TIMEOUT).await?;
    let log = Arc::new(crate::replica::log::EtcdLog::start(Arc::clone(&replica)));
    let store = Arc::new(Store::with_log(
        cfg.store.clone(),
        Arc::clone(&log) as Arc<dyn crate::store::LeaseLog>,
    ));
    tracing::info!(store = %store.leases.describe(), "leases are kept in etcd, loaded node by node as nodes are claimed");
    Ok((store, Some(route::Replicated { replica, log })))
}

/// How long a replica keeps trying to join etcd at start before it gives up.
pub const REPLICA_START_TIMEOUT: Duration = Duration::from_secs(30);

pub async fn serve_store(
    cfg: ServeConfig,
    store: Arc<Store>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    serve_replicated(cfg, store, None, listener, shutdown).await
}

/// The recorder every handler tells; with `--record`, recording into its
/// directory from now on.
fn start_recorder(
    store: &Store,
    record: Option<&RecordConfig>,
) -> Result<Arc<crate::record::Hub>, String> {
    let recorder = crate::record::Hub::new(store);
    if let Some(rc) = record {
        recorder
            .record_to(rc.dir.clone(), rc.max_bytes)
            .map_err(|e| format!("--record {}: {e}", rc.dir.display()))?;
        tracing::info!(dir = %rc.dir.display(), max_bytes = rc.max_bytes, "recording what is seen and decided");
    }
    Ok(recorder)
}

/// Serves `store`; with `replicated`, as one replica of several.
pub async fn serve_replicated(
    cfg: ServeConfig,
    store: Arc<Store>,
    replicated: Option<route::Replicated>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (health, health_service) = serving_health().await;
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let max = cfg.max_message_bytes;
    let heavy = heavy::CpuPool::new(cfg.heavy_workers, cfg.heavy_queue);
    // Flips to true when shutdown begins: Report streams end on it.
    let (stopping_tx, stopping) = watch::channel(false);
    let hub = Arc::new(lease_hub::LeaseHub::default());
    let recorder = start_recorder(&store, cfg.record.as_ref())?;
    let placement = placement::Placement {
        store: Arc::clone(&store),
        heavy: heavy.clone(),
        hub: Arc::clone(&hub),
        recorder: Arc::clone(&recorder),
        replicated: replicated.clone(),
        stopping: stopping.clone(),
    };
    let fast_unary = fast_unary::FastUnaryLayer::new(placement.clone(), max);
    let placement = PlacementServiceServer::new(placement).max_decoding_message_size(max);
    let agent = crate::transport::agent_wire::AgentServer::new(
        agent::Agent {
            store: Arc::clone(&store),
            heavy: heavy.clone(),
            register_timeout: cfg.register_timeout,
            stopping: stopping.clone(),
            hub: Arc::clone(&hub),
            pending: Arc::new(tokio::sync::Semaphore::new(
                cfg.max_pending_registrations.max(1),
            )),
            replicated: replicated.clone(),
        },
        max,
    );
    let admin = AdminServiceServer::new(admin::Admin {
        store: Arc::clone(&store),
        auth: Box::new(admin::TokenAuth {
            token: cfg.admin_token.clone(),
        }),
        replicated: replicated.clone(),
        recorder: Arc::clone(&recorder),
    })
    .max_decoding_message_size(max);

    let sweeper = tokio::spawn(housekeeping(Arc::clone(&store), cfg.ready.clone()));
    let lease_expiry = allocate::spawn_expiry(Arc::clone(&store), hub);
    let (replica_loops, peers) = start_replica(replicated.as_ref(), &store, &health, max);

    // One set of stream caps for both ports: they are totals.
    let stream_limits = layers::StreamLimitLayer::new(cfg.streams);
    let layers = tower::ServiceBuilder::new()
        .layer(layers::MetricsLayer)
        // The role table: who may call what (everyone without --client-ca).
        .layer(identity::AuthLayer::new(
            cfg.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
            &cfg.trust_domain,
        ))
        .layer(stream_limits.clone())
        .layer(layers::ShedLayer::new(
            cfg.max_concurrency,
            cfg.heavy_workers + cfg.heavy_queue,
        ))
        // Innermost: PickCpu and Ping straight from their one DATA frame.
        .layer(fast_unary);
    let health_on_stop = health.clone();
    let ready_on_stop = cfg.ready.clone();
    // TLS material is checked before anything is served; a bad file stops
    // the server here.
    let tls = cfg
        .tls
        .clone()
        .map(|t| tls::TlsReloader::load(t, &cfg.trust_domain))
        .transpose()?;
    let tls_watch = tls.as_ref().map(|t| t.spawn_watch());
    let health_only = match &cfg.health_listener {
        Some(l) => Some(serve_health_only(
            l,
            health_service.clone(),
            &cfg,
            stream_limits,
        )?),
        None => None,
    };
    let router = Server::builder()
        .timeout(cfg.request_timeout)
        // Each connection's streams are bounded, so its HTTP/2 state is.
        .max_concurrent_streams(Some(cfg.max_streams_per_connection.max(1)))
        // A silently dropped agent connection is noticed and its stream ended.
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        // A small per-stream window: a request shed before its body is read
        // has sent at most 64 KiB of it, not megabytes.
        .initial_stream_window_size(Some(64 << 10))
        .initial_connection_window_size(Some(1 << 20))
        .layer(layers)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(placement)
        .add_service(agent)
        .add_service(admin)
        .add_optional_service(peers);
    let signal = async move {
        shutdown.await;
        tracing::info!(
            "shutting down: health NOT_SERVING, Report streams end, finishing calls in flight"
        );
        set_not_serving(&health_on_stop, &ready_on_stop).await;
        let _ = stopping_tx.send(true);
    };
    // The same router over TLS connections (each handshake a screening
    // stage of the listener) or over plaintext ones.
    let server: Serving = match tls {
        Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
            listener::incoming(listener, cfg.listen, move |s| Arc::clone(&tls).accept(s)),
            signal,
        )),
        None => Box::pin(router.serve_with_incoming_shutdown(
            listener::incoming(listener, cfg.listen, listener::http2_preface),
            signal,
        )),
    };
    let grace = cfg.shutdown_grace;
    let deadline = async move {
        let mut stopping = stopping;
        let _ = stopping.wait_for(|s| *s).await;
        tokio::time::sleep(grace).await;
    };
    let result = tokio::select! {
        r = server => r.map_err(Into::into),
        _ = deadline => {
            tracing::warn!(grace_ms = grace.as_millis() as u64, "shutdown grace over: closing what is still open");
            Ok(())
        }
    };
    let _ = tokio::task::spawn_blocking(move || recorder.finish()).await;
    sweeper.abort();
    lease_expiry.abort();
    for l in replica_loops {
        l.abort();
    }
    if let Some(r) = &replicated {
        // The other replicas take the nodes over now, not after the TTL.
        r.replica.leave().await;
    }
    if let Some(w) = tls_watch {
        w.abort();
    }
    if let Some(h) = health_only {
        h.abort();
    }
    result
}

/// Server reflection over the API and health protocols (both versions of
/// the reflection protocol are served: grpcurl and older tools differ).
fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fairplace_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// The health service, every API service SERVING.
async fn serving_health() -> (
    tonic_health::server::HealthReporter,
    HealthServer<impl Health>,
) {
    let (health, service) = tonic_health::server::health_reporter();
    health
        .set_serving::<PlacementServiceServer<placement::Placement>>()
        .await;
    health
        .set_serving::<crate::transport::agent_wire::AgentServer<agent::Agent>>()
        .await;
    health
        .set_serving::<AdminServiceServer<admin::Admin>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;
    health
        .set_service_status(LEASES_HEALTH, tonic_health::ServingStatus::Serving)
        .await;
    (health, service)
}

/// The health service name that says whether this server grants, renews
/// and releases leases now: always for one server; for a replica, while
/// its etcd lease is alive. The server as a whole (service "") stays
/// SERVING without etcd: placements go on, and a probe on "" must not
/// restart every replica through an etcd outage.
pub const LEASES_HEALTH: &str = "fairplace.leases";

/// Keeps [`LEASES_HEALTH`] in step with the replica's standing in etcd.
async fn report_lease_health(
    replica: Arc<crate::replica::Replica>,
    health: tonic_health::server::HealthReporter,
) {
    let mut was = None;
    loop {
        let up = replica.live_lease().is_some();
        if was != Some(up) {
            let status = if up {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            health.set_service_status(LEASES_HEALTH, status).await;
            was = Some(up);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A replica's loops (membership, ownership, the balancer's election, the
/// peers' aggregates) and the ReplicaService its peers subscribe to; none
/// for a single server.
fn start_replica(
    replicated: Option<&route::Replicated>,
    store: &Arc<Store>,
    health: &tonic_health::server::HealthReporter,
    max_message_bytes: usize,
) -> (
    Vec<tokio::task::JoinHandle<()>>,
    Option<ReplicaServiceServer<peers::Peers>>,
) {
    let Some(r) = replicated else {
        return (Vec::new(), None);
    };
    let mut loops = r.replica.spawn(crate::replica::Hooks {
        store: Arc::clone(store),
    });
    // Replicas publish their nodes' aggregates to each other.
    let publisher = crate::replica::aggregates::Publisher::start(Arc::clone(store));
    loops.push(tokio::spawn(crate::replica::aggregates::follow(
        Arc::clone(&r.replica),
        Arc::clone(store),
    )));
    loops.push(tokio::spawn(report_lease_health(
        Arc::clone(&r.replica),
        health.clone(),
    )));
    let svc = ReplicaServiceServer::new(peers::Peers {
        publisher,
        store: Arc::clone(store),
    })
    .max_decoding_message_size(max_message_bytes);
    (loops, Some(svc))
}

/// The server's future, whichever connections it serves.
type Serving = std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>>;

/// Serves grpc.health.v1 alone, in plaintext, on its own listener: the
/// kubelet's gRPC probes present no client certificate. It reports what the
/// main port's health service reports (NOT_SERVING from shutdown on).
/// It is bounded as the main port is: connection caps, streams per
/// connection, and the same Watch cap.
fn serve_health_only(
    l: &std::net::TcpListener,
    health: HealthServer<impl Health>,
    cfg: &ServeConfig,
    streams: layers::StreamLimitLayer,
) -> std::io::Result<tokio::task::JoinHandle<()>> {
    let l = l.try_clone()?;
    l.set_nonblocking(true)?;
    let l = TcpListener::from_std(l)?;
    let incoming = listener::incoming(l, cfg.listen, listener::http2_preface);
    let max_streams = cfg.max_streams_per_connection.max(1);
    let timeout = cfg.request_timeout;
    Ok(tokio::spawn(async move {
        if let Err(e) = Server::builder()
            .timeout(timeout)
            .max_concurrent_streams(Some(max_streams))
            .http2_keepalive_interval(Some(Duration::from_secs(10)))
            .http2_keepalive_timeout(Some(Duration::from_secs(20)))
            .layer(streams)
            .add_service(health)
            .serve_with_incoming(incoming)
            .await
        {
            tracing::warn!(error = %e, "health listener stopped");
        }
    }))
}

async fn set_not_serving(
    health: &tonic_health::server::HealthReporter,
    ready: &exposition::Readiness,
) {
    // The metrics port's /healthz too.
    ready.set(false);
    health
        .set_service_status("", tonic_health::ServingStatus::NotServing)
        .await;
    health
        .set_not_serving::<PlacementServiceServer<placement::Placement>>()
        .await;
    health
        .set_not_serving::<crate::transport::agent_wire::AgentServer<agent::Agent>>()
        .await;
    health
        .set_not_serving::<AdminServiceServer<admin::Admin>>()
        .await;
}

/// Claim expiry and forgetting long-dead nodes. The per-node series and
/// the node counts are rendered from the store at scrape time
/// (`crate::transport::exposition`), so this loop keeps no metrics per node, and claim
/// expiry visits only the nodes that hold claims.
async fn housekeeping(store: Arc<Store>, ready: exposition::Readiness) {
    // /healthz answers 200 while this runs.
    ready.set(true);
    struct NotServing(exposition::Readiness);
    impl Drop for NotServing {
        fn drop(&mut self) {
            self.0.set(false);
        }
    }
    let _not_serving = NotServing(ready);
    let tick =
        (store.config.claim_ttl / 4).clamp(Duration::from_millis(5), Duration::from_millis(250));
    let mut interval = tokio::time::interval(tick);
    let mut last_sweep = Instant::now() - Duration::from_secs(1);
    loop {
        interval.tick().await;
        let now = Instant::now();
        let expired = store.nodes.expire_claims(now);
        if expired > 0 {
            metrics::counter!(m::CLAIMS_EXPIRED).increment(expired as u64);
        }
        if now.duration_since(last_sweep) >= Duration::from_millis(500) {
            last_sweep = now;
            store.nodes.uncount_stale(now);
            store.nodes.forget_stale(now);
        }
    }
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
