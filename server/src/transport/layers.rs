//! tower layers around every gRPC service: load shedding under a concurrency
//! limit, caps on long-lived streams, and request metrics. (The per-request
//! timeout is tonic's own.)

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::Status;
use tower::{Layer, Service};

use crate::metrics as m;

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// The gRPC health service's path prefix.
const HEALTH_PREFIX: &str = "/grpc.health.v1.Health/";

/// Calls whose cost grows with their input: each also needs a heavy slot.
const HEAVY_PATHS: [&str; 2] = [
    "/fairplace.v1.PlacementService/Decide",
    "/fairplace.v1.PlacementService/Balance",
];

/// Refuses a request at once with RESOURCE_EXHAUSTED when `limit` requests
/// are already in flight: no queue builds up behind a slow server. Heavy
/// calls (Decide, Balance) are limited again by `heavy_limit`, checked here,
/// before their body is read, so a flood of large requests is refused for
/// the price of its headers; the heavy pool then bounds how many run at
/// once. Health checks are never shed.
#[derive(Clone)]
pub struct ShedLayer {
    permits: Arc<Semaphore>,
    heavy: Arc<Semaphore>,
}

impl ShedLayer {
    pub fn new(limit: usize, heavy_limit: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(limit)),
            heavy: Arc::new(Semaphore::new(heavy_limit.max(1))),
        }
    }
}

impl<S> Layer<S> for ShedLayer {
    type Service = Shed<S>;
    fn layer(&self, inner: S) -> Shed<S> {
        Shed {
            inner,
            permits: Arc::clone(&self.permits),
            heavy: Arc::clone(&self.heavy),
        }
    }
}

#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    permits: Arc<Semaphore>,
    heavy: Arc<Semaphore>,
}

fn shed<RB: Default + Send + 'static, E: Send + 'static>(
    limit: &'static str,
    msg: &'static str,
) -> BoxFuture<http::Response<RB>, E> {
    metrics::counter!(m::RPC_SHED, "limit" => limit).increment(1);
    let resp = Status::resource_exhausted(msg).into_http::<RB>();
    Box::pin(async move { Ok(resp) })
}

impl<S, B, RB> Service<http::Request<B>> for Shed<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let path = req.uri().path();
        // Health is never behind the limit: an overloaded server that fails
        // its liveness probe gets restarted, which makes the overload worse.
        if path.starts_with(HEALTH_PREFIX) {
            return Box::pin(self.inner.call(req));
        }
        let heavy = if HEAVY_PATHS.contains(&path) {
            match Arc::clone(&self.heavy).try_acquire_owned() {
                Ok(p) => Some(p),
                Err(_) => {
                    return shed(
                        "heavy",
                        "server busy: the limit of concurrent Decide/Balance calls is reached, retry later",
                    );
                }
            }
        } else {
            None
        };
        let Ok(permit) = Arc::clone(&self.permits).try_acquire_owned() else {
            return shed(
                "concurrency",
                "server overloaded: concurrency limit reached, retry later",
            );
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            drop((permit, heavy));
            r
        })
    }
}

/// Caps on the streams that stay open for as long as the client wants:
/// the concurrency limit counts a call until its handler returns, which for
/// a stream is at once, so these are counted until the response body ends.
#[derive(Debug, Clone, Copy)]
pub struct StreamCaps {
    /// AgentService.Report streams (one per connected agent).
    pub agent: usize,
    /// grpc.health.v1 Watch streams, over the gRPC and health ports together.
    pub health_watch: usize,
    /// Server reflection streams.
    pub reflection: usize,
    /// PlacementService.PickCpus streams (a scheduler holds one or a few).
    pub pick: usize,
}

impl Default for StreamCaps {
    fn default() -> Self {
        Self {
            // Room for the default node limit (20,000) with reconnects
            // overlapping their old streams.
            agent: 24_576,
            // A probe or a mesh sidecar each hold one.
            health_watch: 256,
            reflection: 64,
            pick: 1024,
        }
    }
}

/// One kind of long-lived stream and its cap.
struct StreamPool {
    kind: &'static str,
    shed_as: &'static str,
    message: &'static str,
    open: Arc<Semaphore>,
}

/// Holds a slot for each long-lived stream until its response body ends
/// (finished, or dropped when the client resets it); a stream over its cap
/// is refused at once with RESOURCE_EXHAUSTED naming the flag. Shared by the
/// gRPC and health ports, so the caps are totals.
#[derive(Clone)]
pub struct StreamLimitLayer {
    pools: Arc<[StreamPool; 4]>,
}

impl StreamLimitLayer {
    pub fn new(caps: StreamCaps) -> Self {
        let pool = |kind, shed_as, message, n: usize| StreamPool {
            kind,
            shed_as,
            message,
            open: Arc::new(Semaphore::new(n.max(1))),
        };
        Self {
            pools: Arc::new([
                pool(
                    "agent",
                    "agent_streams",
                    "server busy: the limit of open Report streams (--max-agent-streams) is reached, retry later",
                    caps.agent,
                ),
                pool(
                    "health_watch",
                    "health_watches",
                    "server busy: the limit of open health Watch streams (--max-health-watches) is reached; use Check, or retry later",
                    caps.health_watch,
                ),
                pool(
                    "reflection",
                    "reflection_streams",
                    "server busy: the limit of open reflection streams (--max-reflection-streams) is reached, retry later",
                    caps.reflection,
                ),
                pool(
                    "pick",
                    "pick_streams",
                    "server busy: the limit of open PickCpus streams (--max-pick-streams) is reached; use PickCpu, or retry later",
                    caps.pick,
                ),
            ]),
        }
    }

    /// The pool of a long-lived stream's path; None for every other call.
    fn pool_of(&self, path: &str) -> Option<&StreamPool> {
        let i = match path {
            "/fairplace.v1.AgentService/Report" => 0,
            "/grpc.health.v1.Health/Watch" => 1,
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
            | "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo" => 2,
            "/fairplace.v1.PlacementService/PickCpus" => 3,
            _ => return None,
        };
        Some(&self.pools[i])
    }
}

impl<S> Layer<S> for StreamLimitLayer {
    type Service = StreamLimit<S>;
    fn layer(&self, inner: S) -> StreamLimit<S> {
        StreamLimit {
            inner,
            limits: self.clone(),
        }
    }
}

#[derive(Clone)]
pub struct StreamLimit<S> {
    inner: S,
    limits: StreamLimitLayer,
}

/// A stream's slot: counted in `fairplace_streams_open` while held.
struct StreamSlot {
    kind: &'static str,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        metrics::gauge!(m::STREAMS_OPEN, "kind" => self.kind).decrement(1.0);
    }
}

/// A response body that keeps its stream's slot until it is dropped.
struct SlotBody {
    inner: tonic::body::Body,
    _slot: StreamSlot,
}

impl http_body::Body for SlotBody {
    type Data = <tonic::body::Body as http_body::Body>::Data;
    type Error = <tonic::body::Body as http_body::Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<S, B> Service<http::Request<B>> for StreamLimit<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let Some(pool) = self.limits.pool_of(req.uri().path()) else {
            return Box::pin(self.inner.call(req));
        };
        let Ok(permit) = Arc::clone(&pool.open).try_acquire_owned() else {
            return shed(pool.shed_as, pool.message);
        };
        metrics::gauge!(m::STREAMS_OPEN, "kind" => pool.kind).increment(1.0);
        let slot = StreamSlot {
            kind: pool.kind,
            _permit: permit,
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|inner| tonic::body::Body::new(SlotBody { inner, _slot: slot })))
        })
    }
}

/// Counts requests by method and status code and times them.
#[derive(Clone, Default)]
pub struct MetricsLayer;

impl<S> Layer<S> for MetricsLayer {
    type Service = Metered<S>;
    fn layer(&self, inner: S) -> Metered<S> {
        Metered { inner }
    }
}

#[derive(Clone)]
pub struct Metered<S> {
    inner: S,
}

/// The method label of every call to a path nobody serves: the path is the
/// client's to choose, so it never becomes a label value itself.
pub const UNKNOWN_METHOD: &str = "unknown";

/// The method label of each gRPC path the server serves (the fairplace.v1
/// services, grpc.health.v1.Health and both reflection services), read once
/// from their descriptor sets: `/fairplace.v1.PlacementService/PickCpu` ->
/// `PlacementService/PickCpu`.
static METHODS: LazyLock<HashMap<String, &'static str>> = LazyLock::new(|| {
    use prost::Message as _;
    let mut methods = HashMap::new();
    for fds in [
        fairplace_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
        tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
    ] {
        let set = prost_types::FileDescriptorSet::decode(fds).expect("a built-in descriptor set");
        for file in set.file {
            let package = file.package().to_string();
            for service in &file.service {
                let full = if package.is_empty() {
                    service.name().to_string()
                } else {
                    format!("{package}.{}", service.name())
                };
                for method in &service.method {
                    let label = format!("{}/{}", service.name(), method.name());
                    // A fixed set, made once: leaked so each call's label
                    // is a static string.
                    methods.insert(
                        format!("/{full}/{}", method.name()),
                        &*Box::leak(label.into_boxed_str()),
                    );
                }
            }
        }
    }
    methods
});

/// The method label of a request path: the served method's name, or
/// [`UNKNOWN_METHOD`].
fn method_name(path: &str) -> &'static str {
    METHODS.get(path).copied().unwrap_or(UNKNOWN_METHOD)
}

fn code_name(code: &str) -> &'static str {
    match code {
        "0" => "OK",
        "1" => "Cancelled",
        "2" => "Unknown",
        "3" => "InvalidArgument",
        "4" => "DeadlineExceeded",
        "5" => "NotFound",
        "6" => "AlreadyExists",
        "7" => "PermissionDenied",
        "8" => "ResourceExhausted",
        "9" => "FailedPrecondition",
        "10" => "Aborted",
        "11" => "OutOfRange",
        "12" => "Unimplemented",
        "13" => "Internal",
        "14" => "Unavailable",
        "15" => "DataLoss",
        "16" => "Unauthenticated",
        _ => "Unknown",
    }
}

impl<S, B, RB> Service<http::Request<B>> for Metered<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    RB: Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let method = method_name(req.uri().path());
        let t0 = Instant::now();
        let fut = self.inner.call(req);
        Box::pin(async move {
            let r = fut.await;
            // An error status travels in the headers ("trailers-only"); a
            // response without one is OK (its status follows in trailers).
            let code = match &r {
                Ok(resp) => resp
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .map_or("OK", code_name),
                Err(_) => "Internal",
            };
            metrics::counter!(m::RPC_REQUESTS, "method" => method, "code" => code).increment(1);
            metrics::histogram!(m::RPC_DURATION, "method" => method)
                .record(t0.elapsed().as_secs_f64());
            r
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::ServiceExt;

    #[tokio::test]
    async fn requests_over_the_limit_are_shed_at_once_with_resource_exhausted() {
        let slow = tower::service_fn(|_req: http::Request<()>| async {
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok::<_, std::convert::Infallible>(http::Response::new(String::from("done")))
        });
        let svc = ShedLayer::new(1, 1).layer(slow);
        let first = tokio::spawn(svc.clone().oneshot(http::Request::new(())));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t0 = Instant::now();
        let shed = svc.clone().oneshot(http::Request::new(())).await.unwrap();
        assert!(t0.elapsed() < Duration::from_millis(100), "no queueing");
        assert_eq!(shed.headers().get("grpc-status").unwrap(), "8");
        let ok = first.await.unwrap().unwrap();
        assert_eq!(ok.body(), "done");
        assert!(ok.headers().get("grpc-status").is_none());
        // The permit came back: the next request runs.
        let again = svc.oneshot(http::Request::new(())).await.unwrap();
        assert_eq!(again.body(), "done");
    }

    #[test]
    fn method_names_drop_the_package() {
        assert_eq!(
            method_name("/fairplace.v1.PlacementService/PickCpu"),
            "PlacementService/PickCpu"
        );
        assert_eq!(method_name("/grpc.health.v1.Health/Check"), "Health/Check");
        assert_eq!(
            method_name("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"),
            "ServerReflection/ServerReflectionInfo"
        );
        assert_eq!(
            method_name("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"),
            "ServerReflection/ServerReflectionInfo"
        );
        for svc in ["PlacementService", "AgentService", "AdminService"] {
            assert!(
                METHODS
                    .keys()
                    .any(|p| p.starts_with(&format!("/fairplace.v1.{svc}/"))),
                "{svc}"
            );
        }
        assert_eq!(
            method_name("/fairplace.v1.AgentService/Report"),
            "AgentService/Report"
        );
    }

    #[test]
    fn paths_nobody_serves_share_one_label() {
        for path in [
            "/fairplace.v1.PlacementService/MadeUp",
            "/made.up.Service/PickCpu",
            "/PlacementService/PickCpu",
            "/fairplace.v1.PlacementService/PickCpu/extra",
            "/",
            "",
        ] {
            assert_eq!(method_name(path), UNKNOWN_METHOD, "{path}");
        }
        assert_eq!(code_name("3"), "InvalidArgument");
        assert_eq!(code_name("99"), "Unknown");
    }
}

#[cfg(test)]
mod health_tests {
    use super::*;
    use std::convert::Infallible;

    /// A service whose calls never finish, and one that answers at once.
    #[derive(Clone)]
    struct Stuck;

    impl Service<http::Request<()>> for Stuck {
        type Response = http::Response<()>;
        type Error = Infallible;
        type Future = BoxFuture<Self::Response, Self::Error>;
        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: http::Request<()>) -> Self::Future {
            let health = req.uri().path().starts_with(HEALTH_PREFIX);
            Box::pin(async move {
                if !health {
                    std::future::pending::<()>().await;
                }
                Ok(http::Response::new(()))
            })
        }
    }

    fn req(path: &str) -> http::Request<()> {
        http::Request::builder().uri(path).body(()).unwrap()
    }

    fn grpc_status(r: &http::Response<()>) -> Option<&str> {
        r.headers().get("grpc-status").and_then(|v| v.to_str().ok())
    }

    #[tokio::test]
    async fn at_the_limit_calls_are_shed_but_health_checks_pass() {
        let mut svc = ShedLayer::new(1, 1).layer(Stuck);
        // The only permit is taken by a call that never finishes.
        let stuck = tokio::spawn(svc.call(req("/fairplace.v1.PlacementService/Decide")));
        tokio::task::yield_now().await;
        let shed = svc
            .call(req("/fairplace.v1.PlacementService/PickCpu"))
            .await
            .unwrap();
        assert_eq!(grpc_status(&shed), Some("8"), "RESOURCE_EXHAUSTED");
        let health = svc.call(req("/grpc.health.v1.Health/Check")).await.unwrap();
        assert_eq!(grpc_status(&health), None, "health reached the service");
        stuck.abort();
    }
}
