//! tower layers around every gRPC service: load shedding under a concurrency
//! limit, and request metrics. (The per-request timeout is tonic's own.)

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use tokio::sync::Semaphore;
use tonic::Status;
use tower::{Layer, Service};

use crate::metrics as m;

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

/// Refuses a request at once with RESOURCE_EXHAUSTED when `limit` requests
/// are already in flight: no queue builds up behind a slow server.
#[derive(Clone)]
pub struct ShedLayer {
    permits: Arc<Semaphore>,
}

impl ShedLayer {
    pub fn new(limit: usize) -> Self {
        Self {
            permits: Arc::new(Semaphore::new(limit)),
        }
    }
}

impl<S> Layer<S> for ShedLayer {
    type Service = Shed<S>;
    fn layer(&self, inner: S) -> Shed<S> {
        Shed {
            inner,
            permits: Arc::clone(&self.permits),
        }
    }
}

#[derive(Clone)]
pub struct Shed<S> {
    inner: S,
    permits: Arc<Semaphore>,
}

impl<S, B, RB> Service<http::Request<B>> for Shed<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        match Arc::clone(&self.permits).try_acquire_owned() {
            Ok(permit) => {
                let fut = self.inner.call(req);
                Box::pin(async move {
                    let r = fut.await;
                    drop(permit);
                    r
                })
            }
            Err(_) => {
                metrics::counter!(m::RPC_SHED).increment(1);
                let resp = Status::resource_exhausted(
                    "server overloaded: concurrency limit reached, retry later",
                )
                .into_http::<RB>();
                Box::pin(async move { Ok(resp) })
            }
        }
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

/// `/fairplace.v1.PlacementService/PickCpu` -> `PlacementService/PickCpu`.
fn method_name(path: &str) -> String {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let service = parts.next().unwrap_or("");
    let method = parts.next().unwrap_or("");
    let service = service.rsplit('.').next().unwrap_or(service);
    format!("{service}/{method}")
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
            metrics::counter!(m::RPC_REQUESTS, "method" => method.clone(), "code" => code)
                .increment(1);
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
        let svc = ShedLayer::new(1).layer(slow);
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
        assert_eq!(code_name("3"), "InvalidArgument");
        assert_eq!(code_name("99"), "Unknown");
    }
}
