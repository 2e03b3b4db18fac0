//! The gRPC service: PlacementService, AgentService and AdminService over the
//! store, with health, reflection, the tower layers and graceful shutdown.

pub mod admin;
pub mod agent;
pub mod convert;
pub mod layers;
pub mod placement;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1::admin_service_server::AdminServiceServer;
use fairplace_proto::v1::agent_service_server::AgentServiceServer;
use fairplace_proto::v1::placement_service_server::PlacementServiceServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::Server;

use crate::metrics as m;
use crate::store::{Store, StoreConfig};

/// Everything `serve` needs; the binary fills it from its flags.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub store: StoreConfig,
    pub request_timeout: Duration,
    pub max_concurrency: usize,
    pub max_message_bytes: usize,
    pub admin_token: Option<String>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self {
            store: StoreConfig::default(),
            request_timeout: Duration::from_secs(2),
            max_concurrency: 1024,
            max_message_bytes: 4 << 20,
            admin_token: None,
        }
    }
}

/// Serves until `shutdown` resolves; then health turns NOT_SERVING and the
/// calls in flight finish before this returns.
pub async fn serve(
    cfg: ServeConfig,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let store = Arc::new(Store::new(cfg.store.clone()));
    serve_store(cfg, store, listener, shutdown).await
}

pub async fn serve_store(
    cfg: ServeConfig,
    store: Arc<Store>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<PlacementServiceServer<placement::Placement>>()
        .await;
    health
        .set_serving::<AgentServiceServer<agent::Agent>>()
        .await;
    health
        .set_serving::<AdminServiceServer<admin::Admin>>()
        .await;
    health
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fairplace_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(fairplace_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let max = cfg.max_message_bytes;
    let placement = PlacementServiceServer::new(placement::Placement {
        store: Arc::clone(&store),
    })
    .max_decoding_message_size(max);
    let agent = AgentServiceServer::new(agent::Agent {
        store: Arc::clone(&store),
    })
    .max_decoding_message_size(max);
    let admin = AdminServiceServer::new(admin::Admin {
        store: Arc::clone(&store),
        auth: Box::new(admin::TokenAuth {
            token: cfg.admin_token.clone(),
        }),
    })
    .max_decoding_message_size(max);

    let sweeper = tokio::spawn(housekeeping(Arc::clone(&store)));

    let layers = tower::ServiceBuilder::new()
        .layer(layers::MetricsLayer)
        .layer(layers::ShedLayer::new(cfg.max_concurrency));
    let health_on_stop = health.clone();
    let result = Server::builder()
        .timeout(cfg.request_timeout)
        // A silently dropped agent connection is noticed and its stream ended.
        .http2_keepalive_interval(Some(Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .layer(layers)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(placement)
        .add_service(agent)
        .add_service(admin)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async move {
            shutdown.await;
            tracing::info!("shutting down: health NOT_SERVING, finishing calls in flight");
            health_on_stop
                .set_service_status("", tonic_health::ServingStatus::NotServing)
                .await;
            health_on_stop
                .set_not_serving::<PlacementServiceServer<placement::Placement>>()
                .await;
            health_on_stop
                .set_not_serving::<AgentServiceServer<agent::Agent>>()
                .await;
            health_on_stop
                .set_not_serving::<AdminServiceServer<admin::Admin>>()
                .await;
        })
        .await;
    sweeper.abort();
    result.map_err(Into::into)
}

/// Claim expiry, freshness gauges and forgetting long-dead nodes.
async fn housekeeping(store: Arc<Store>) {
    let tick =
        (store.config.claim_ttl / 4).clamp(Duration::from_millis(5), Duration::from_millis(250));
    let mut interval = tokio::time::interval(tick);
    let mut last_gauges = Instant::now() - Duration::from_secs(1);
    loop {
        interval.tick().await;
        let now = Instant::now();
        let expired = store.expire_claims(now);
        if expired > 0 {
            metrics::counter!(m::CLAIMS_EXPIRED).increment(expired as u64);
        }
        if now.duration_since(last_gauges) >= Duration::from_millis(500) {
            last_gauges = now;
            store.uncount_stale(now);
            store.forget_stale(now);
            let (mut fresh, mut stale) = (0usize, 0usize);
            for n in store.nodes() {
                let snap = n.snapshot();
                if store.is_fresh(&snap, now) {
                    fresh += 1;
                } else {
                    stale += 1;
                }
                node_gauges(&n.id, &snap, now);
                // Only nodes that report runtime have cache-aware series.
                if let Some((procs, with, on)) = store.cache_gauges(&n) {
                    let id = n.id.clone();
                    metrics::gauge!(m::NODE_CACHE_PROCESSES, "node" => id.clone())
                        .set(procs as f64);
                    metrics::gauge!(m::NODE_CACHE_TASKS_PREF, "node" => id.clone())
                        .set(with as f64);
                    metrics::gauge!(m::NODE_CACHE_TASKS_ON_PREF, "node" => id).set(on as f64);
                }
            }
            metrics::gauge!(m::NODES, "freshness" => "fresh").set(fresh as f64);
            metrics::gauge!(m::NODES, "freshness" => "stale").set(stale as f64);
            metrics::gauge!(m::CLAIMS_OUTSTANDING).set(store.claims_outstanding() as f64);
        }
    }
}

/// The per-node series of the node drill-down dashboard.
fn node_gauges(id: &str, snap: &crate::store::Snapshot, now: Instant) {
    let node = id.to_string();
    let (mut idle, mut running, mut sched_idle) = (0u64, 0u64, 0u64);
    let mut llc: std::collections::BTreeMap<u32, (i64, i64)> = Default::default();
    for (i, c) in snap.state.cpus.iter().enumerate() {
        if !c.online {
            continue;
        }
        idle += c.available_idle() as u64;
        running += c.nr_running as u64;
        sched_idle += c.sched_idle_rq() as u64;
        let e = llc.entry(snap.topo.spec.cpus[i].llc).or_default();
        e.0 += c.util_avg;
        e.1 += 1;
    }
    metrics::gauge!(m::NODE_IDLE_CPUS, "node" => node.clone()).set(idle as f64);
    metrics::gauge!(m::NODE_NR_RUNNING, "node" => node.clone()).set(running as f64);
    metrics::gauge!(m::NODE_SCHED_IDLE_CPUS, "node" => node.clone()).set(sched_idle as f64);
    for (l, (sum, n)) in llc {
        metrics::gauge!(m::NODE_LLC_UTIL, "node" => node.clone(), "llc" => l.to_string())
            .set((sum / n.max(1)) as f64);
    }
    if let Some(age) = snap.age(now) {
        metrics::gauge!(m::NODE_STATE_AGE, "node" => node).set(age.as_secs_f64());
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

/// Binds the metrics endpoint and returns its address.
pub fn install_metrics(addr: SocketAddr) -> Result<(), String> {
    m::install(addr).map(|_| ())
}
