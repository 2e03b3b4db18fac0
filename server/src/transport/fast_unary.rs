//! The hot unary calls, PickCpu and Ping, served straight from the HTTP/2
//! request, innermost of the tower layers (after authentication, stream caps
//! and shedding, so they apply unchanged).
//!
//! Why: a PickCpu's decision is a few hundred nanoseconds; tonic's generic
//! unary path around it (a decode stream, an encode stream with its buffer,
//! the boxed handler) costs more than the decision. A unary call as schedulers
//! send it is one DATA frame holding one uncompressed message, so this path
//! takes the message from that frame, calls the same handler the tonic
//! service calls (through [`PickHere`], which the placement handler
//! implements: this file names no handler), and answers with one framed message
//! and `grpc-status: 0`. Ping, the no-op the decision is measured against,
//! takes the same path, so the comparison stays like for like.
//!
//! Anything else (another method, a `grpc-encoding`, a compressed or
//! oversized or undecodable message, several messages, request trailers, a
//! body error) goes to tonic with the bytes already read put back in front,
//! so its answers, errors included, are exactly tonic's.

use std::cell::RefCell;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use fairplace_proto::codec::{PREFIX, frame};
use fairplace_proto::v1 as pb;
use http::{HeaderMap, HeaderValue};
use http_body::Frame;
use http_body_util::BodyExt;
use prost::Message;
use tonic::Status;
use tonic::body::Body;
use tower::{Layer, Service, ServiceExt};

use crate::convert::Picked;
use crate::identity::Caller;

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

const PICK_CPU: &str = "/fairplace.v1.PlacementService/PickCpu";
const PING: &str = "/fairplace.v1.AdminService/Ping";

/// What decides a PickCpu on the fast path: the placement handler's own
/// pick, which takes the decoded message and knows no framing. An answer
/// decided at once is framed here straight from the decision.
pub trait PickHere: Send + Sync + 'static {
    /// Decides `r` for `caller` (`ext`: the request's extensions, for a
    /// forward's identity); may take the message away (a forward).
    fn pick_here<'a>(
        &'a self,
        caller: &'a Caller,
        ext: &'a http::Extensions,
        r: &mut pb::PickCpuRequest,
    ) -> Result<Picked<'a>, Status>;
}

/// Puts [`FastUnary`] around the service routes.
pub struct FastUnaryLayer<P> {
    placement: Arc<P>,
    max_message_bytes: usize,
}

impl<P> Clone for FastUnaryLayer<P> {
    fn clone(&self) -> Self {
        Self {
            placement: Arc::clone(&self.placement),
            max_message_bytes: self.max_message_bytes,
        }
    }
}

impl<P: PickHere> FastUnaryLayer<P> {
    pub fn new(placement: P, max_message_bytes: usize) -> Self {
        Self {
            placement: Arc::new(placement),
            max_message_bytes,
        }
    }
}

impl<S, P> Layer<S> for FastUnaryLayer<P> {
    type Service = FastUnary<S, P>;
    fn layer(&self, inner: S) -> FastUnary<S, P> {
        FastUnary {
            inner,
            placement: Arc::clone(&self.placement),
            max_message_bytes: self.max_message_bytes,
        }
    }
}

/// PickCpu and Ping answered from their one DATA frame; everything else
/// handed to `inner` (tonic's routes).
pub struct FastUnary<S, P> {
    inner: S,
    placement: Arc<P>,
    max_message_bytes: usize,
}

impl<S: Clone, P> Clone for FastUnary<S, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            placement: Arc::clone(&self.placement),
            max_message_bytes: self.max_message_bytes,
        }
    }
}

#[derive(Clone, Copy)]
enum Hot {
    PickCpu,
    Ping,
}

impl Hot {
    /// The hot call a request is, when it can take this path at all.
    fn of<B>(req: &http::Request<B>) -> Option<Hot> {
        let hot = match req.uri().path() {
            PICK_CPU => Hot::PickCpu,
            PING => Hot::Ping,
            _ => return None,
        };
        // A compressed request is tonic's to accept or refuse.
        match req.headers().get("grpc-encoding") {
            Some(e) if e != "identity" => None,
            _ => Some(hot),
        }
    }
}

impl<S, P: PickHere> Service<http::Request<Body>> for FastUnary<S, P>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let Some(hot) = Hot::of(&req) else {
            return Box::pin(self.inner.call(req));
        };
        let placement = Arc::clone(&self.placement);
        let max = self.max_message_bytes;
        // The ready service goes with the call, for a request handed on.
        let inner = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, inner);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let msg = match read_one(body, max).await {
                Ok(msg) => msg,
                Err(replay) => {
                    let req = http::Request::from_parts(parts, Body::new(replay));
                    return inner.oneshot(req).await;
                }
            };
            let answered = match hot {
                // Both decode from the frame's bytes as a slice: a `Bytes`
                // view of them would take and drop a reference count.
                Hot::Ping => match pb::PingRequest::decode(&msg[PREFIX..]) {
                    Ok(_) => Ok(one_message(frame(&pb::PingResponse {}))),
                    Err(_) => Err(msg),
                },
                Hot::PickCpu => {
                    let ext = &parts.extensions;
                    let caller = Caller::of(ext);
                    match pick_cpu_here(&*placement, &caller, ext, &msg[PREFIX..]) {
                        Step::Framed(answer) => Ok(one_message(answer)),
                        Step::Refused(s) => Ok(s.into_http()),
                        Step::Later(later) => Ok(answer_later(later).await),
                        Step::Undecodable => Err(msg),
                    }
                }
            };
            match answered {
                Ok(resp) => Ok(resp),
                // An undecodable message: tonic's codec names the error.
                Err(msg) => {
                    let replay = Replay::new(Some(msg), None);
                    let req = http::Request::from_parts(parts, Body::new(replay));
                    inner.oneshot(req).await
                }
            }
        })
    }
}

/// What a PickCpu's message came to on this worker.
pub enum Step<'a> {
    /// Decided here: the answer's frame.
    Framed(Bytes),
    /// Refused here (an unknown node, a bad field, a stale state).
    Refused(Status),
    /// Forwarded to the node's owner, or on the cluster path: to await.
    Later(Picked<'a>),
    /// Not a PickCpuRequest: tonic's codec names the error.
    Undecodable,
}

/// A request up to this size leaves its message's buffers to the next call
/// on the worker; a larger one's are freed, so what a worker keeps between
/// calls is what a 1 KiB message can grow (a few KiB at most, a selector's
/// table) whatever a caller sent.
const KEEP_REQUEST_BYTES: usize = 1024;

thread_local! {
    /// The message each PickCpu on this worker is decoded into, cleared
    /// and merged again: its strings keep their buffers, so a request for a
    /// named node allocates nothing to be decoded, and the message is
    /// neither built nor dropped per call. The call that takes the request
    /// away (a forward, the cluster path) leaves an empty one.
    static REQUEST: RefCell<pb::PickCpuRequest> = RefCell::new(pb::PickCpuRequest::default());
}

/// PickCpu through the tonic service's own handler, without an await: an
/// answer decided here is framed straight from the decision (the bytes
/// prost would write for the message, without building it). `msg` is the
/// message without its gRPC prefix. Public for the handler's benchmark.
pub fn pick_cpu_here<'a, P: PickHere>(
    placement: &'a P,
    caller: &'a Caller,
    ext: &'a http::Extensions,
    msg: &[u8],
) -> Step<'a> {
    REQUEST.with_borrow_mut(|r| {
        // `clear` then `merge` is `decode`, into buffers already there.
        r.clear();
        let step = if r.merge(msg).is_err() {
            Step::Undecodable
        } else {
            match placement.pick_here(caller, ext, r) {
                Ok(Picked::Now(answer)) => Step::Framed(answer.framed(&r.node_id)),
                Ok(later) => Step::Later(later),
                Err(s) => Step::Refused(s),
            }
        };
        // Whether it decoded or not: a message cut short after a long
        // string has already grown the buffer.
        if msg.len() > KEEP_REQUEST_BYTES {
            *r = pb::PickCpuRequest::default();
        }
        step
    })
}

/// A PickCpu answered elsewhere: its message, framed.
async fn answer_later(later: Picked<'_>) -> http::Response<Body> {
    match later.into_response(String::new()).await {
        Ok(resp) => one_message(frame(&resp)),
        Err(s) => s.into_http(),
    }
}

/// The request's one framed message, when the body is exactly that (one
/// uncompressed message of at most `max` bytes, no trailers); otherwise the
/// body as read so far followed by the rest, for tonic.
async fn read_one(mut body: Body, max: usize) -> Result<Bytes, Replay> {
    let mut got: Option<Bytes> = None;
    let mut more: Option<BytesMut> = None;
    loop {
        let f = match body.frame().await {
            None => break,
            Some(Ok(f)) => f,
            Some(Err(e)) => return Err(Replay::failed(joined(got, more), e)),
        };
        let data = match f.into_data() {
            Ok(d) => d,
            Err(f) => {
                let mut r = Replay::new(joined(got, more), Some(body));
                r.trailers = f.into_trailers().ok();
                return Err(r);
            }
        };
        // An empty frame (some clients end the stream with one) adds nothing.
        if data.is_empty() {
            continue;
        }
        // The first frame is kept as it is (no copy); a second starts a
        // buffer that later ones are appended to.
        match (got.take(), &mut more) {
            (_, Some(b)) => b.extend_from_slice(&data),
            (None, None) => got = Some(data),
            (Some(g), None) => {
                let mut b = BytesMut::with_capacity(g.len() + data.len());
                b.extend_from_slice(&g);
                b.extend_from_slice(&data);
                more = Some(b);
            }
        }
        let len = got.as_ref().map_or(0, Bytes::len) + more.as_ref().map_or(0, BytesMut::len);
        if len > PREFIX + max {
            return Err(Replay::new(joined(got, more), Some(body)));
        }
    }
    let all = joined(got, more).unwrap_or_default();
    if is_one_message(&all) {
        Ok(all)
    } else {
        Err(Replay::new(Some(all), None))
    }
}

fn joined(got: Option<Bytes>, more: Option<BytesMut>) -> Option<Bytes> {
    more.map(BytesMut::freeze).or(got)
}

/// One uncompressed message in gRPC's framing, and nothing after it.
fn is_one_message(b: &[u8]) -> bool {
    if b.len() < PREFIX || b[0] != 0 {
        return false;
    }
    let mut len = &b[1..PREFIX];
    len.get_u32() as usize == b.len() - PREFIX
}

/// A successful unary answer: one framed message, then `grpc-status: 0`.
fn one_message(framed: Bytes) -> http::Response<Body> {
    let mut resp = http::Response::new(Body::new(OneMessage {
        data: Some(framed),
        trailers: true,
    }));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    resp
}

/// The body of a successful unary answer.
struct OneMessage {
    data: Option<Bytes>,
    trailers: bool,
}

impl http_body::Body for OneMessage {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(d) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if std::mem::take(&mut self.trailers) {
            let mut t = HeaderMap::with_capacity(1);
            t.insert(Status::GRPC_STATUS, HeaderValue::from_static("0"));
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        Poll::Ready(None)
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && !self.trailers
    }
}

/// A request body handed on: what was read, then the rest of the original.
struct Replay {
    read: Option<Bytes>,
    trailers: Option<HeaderMap>,
    error: Option<Status>,
    rest: Option<Body>,
}

impl Replay {
    fn new(read: Option<Bytes>, rest: Option<Body>) -> Self {
        Self {
            read,
            trailers: None,
            error: None,
            rest,
        }
    }

    fn failed(read: Option<Bytes>, e: Status) -> Self {
        Self {
            read,
            trailers: None,
            error: Some(e),
            rest: None,
        }
    }
}

impl http_body::Body for Replay {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if let Some(d) = self.read.take() {
            return Poll::Ready(Some(Ok(Frame::data(d))));
        }
        if let Some(t) = self.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(t))));
        }
        if let Some(e) = self.error.take() {
            return Poll::Ready(Some(Err(e)));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::Mutex;

    use super::*;
    use crate::service::placement::Placement;
    use crate::service::{cpu_pool::CpuPool, lease_hub::LeaseHub};
    use crate::store::{Store, StoreConfig};

    /// What tonic (stood in for here) was handed.
    #[derive(Debug, Default, PartialEq)]
    struct Seen {
        path: String,
        data: Vec<u8>,
        trailers: Option<HeaderMap>,
        error: Option<tonic::Code>,
    }

    #[derive(Clone, Default)]
    struct Tonic(Arc<Mutex<Vec<Seen>>>);

    impl Service<http::Request<Body>> for Tonic {
        type Response = http::Response<Body>;
        type Error = Infallible;
        type Future = BoxFuture<Self::Response, Infallible>;

        fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
            Poll::Ready(Ok(()))
        }

        fn call(&mut self, req: http::Request<Body>) -> Self::Future {
            let log = Arc::clone(&self.0);
            Box::pin(async move {
                let mut seen = Seen {
                    path: req.uri().path().to_string(),
                    ..Seen::default()
                };
                let mut body = req.into_body();
                while let Some(f) = body.frame().await {
                    match f.map(Frame::into_data) {
                        Ok(Ok(d)) => seen.data.extend_from_slice(&d),
                        Ok(Err(f)) => seen.trailers = f.into_trailers().ok(),
                        Err(e) => {
                            seen.error = Some(e.code());
                            break;
                        }
                    }
                }
                log.lock().unwrap().push(seen);
                Ok(http::Response::new(Body::empty()))
            })
        }
    }

    fn placement() -> Placement {
        let (_, stopping) = tokio::sync::watch::channel(false);
        let store = Arc::new(Store::new(StoreConfig::default()));
        Placement {
            recorder: crate::record::Hub::new(&store),
            store,
            heavy: CpuPool::new(1, 1),
            hub: Arc::new(LeaseHub::default()),
            replicated: None,
            stopping,
        }
    }

    /// A request whose body is `frames`, then `trailers` or `error`.
    struct Sent<'a> {
        path: &'a str,
        encoding: Option<&'a str>,
        frames: Vec<Vec<u8>>,
        trailers: Option<HeaderMap>,
        error: Option<Status>,
    }

    impl Sent<'_> {
        fn ping(frames: Vec<Vec<u8>>) -> Sent<'static> {
            Sent {
                path: PING,
                encoding: None,
                frames,
                trailers: None,
                error: None,
            }
        }

        fn request(&self) -> http::Request<Body> {
            let mut tail = Replay::new(None, None);
            tail.trailers = self.trailers.clone();
            tail.error = self.error.clone();
            let mut body = Body::new(tail);
            for f in self.frames.iter().rev() {
                body = Body::new(Replay::new(Some(Bytes::from(f.clone())), Some(body)));
            }
            let mut req = http::Request::new(body);
            *req.uri_mut() = self.path.parse().unwrap();
            if let Some(e) = self.encoding {
                req.headers_mut()
                    .insert("grpc-encoding", HeaderValue::from_str(e).unwrap());
            }
            req
        }
    }

    /// The answer's data and trailers, and what tonic was handed.
    async fn call(
        sent: &Sent<'_>,
        max: usize,
    ) -> (http::Response<()>, Vec<u8>, Option<HeaderMap>, Vec<Seen>) {
        let tonic = Tonic::default();
        let fast = FastUnaryLayer::new(placement(), max).layer(tonic.clone());
        let resp = fast.oneshot(sent.request()).await.unwrap();
        let (parts, mut body) = resp.into_parts();
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(f) = body.frame().await {
            match f.unwrap().into_data() {
                Ok(d) => data.extend_from_slice(&d),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        let seen = std::mem::take(&mut *tonic.0.lock().unwrap());
        (http::Response::from_parts(parts, ()), data, trailers, seen)
    }

    #[tokio::test]
    async fn a_ping_in_one_frame_is_answered_here_with_status_ok() {
        let (resp, data, trailers, seen) = call(&Sent::ping(vec![vec![0; 5]]), 64).await;
        assert!(seen.is_empty(), "tonic was handed {seen:?}");
        assert_eq!(resp.headers()["content-type"], "application/grpc");
        assert_eq!(data, [0, 0, 0, 0, 0]);
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
    }

    #[tokio::test]
    async fn a_ping_in_pieces_is_answered_here() {
        let sent = Sent::ping(vec![vec![0, 0], vec![0], vec![], vec![0, 0], vec![]]);
        let (_, data, trailers, seen) = call(&sent, 64).await;
        assert!(seen.is_empty(), "tonic was handed {seen:?}");
        assert_eq!(data, [0, 0, 0, 0, 0]);
        assert_eq!(trailers.unwrap()["grpc-status"], "0");
    }

    #[tokio::test]
    async fn a_pick_cpu_is_decided_here_by_the_services_own_handler() {
        let r = pb::PickCpuRequest {
            node_id: "ghost".into(),
            ..Default::default()
        };
        let sent = Sent {
            path: PICK_CPU,
            ..Sent::ping(vec![frame(&r).to_vec()])
        };
        let (resp, data, trailers, seen) = call(&sent, 64).await;
        assert!(seen.is_empty(), "tonic was handed {seen:?}");
        // The handler's NOT_FOUND, trailers-only, as tonic sends an error.
        assert_eq!(resp.headers()["grpc-status"], "5");
        let msg = resp.headers()["grpc-message"].to_str().unwrap();
        assert!(msg.starts_with("node_id"), "{msg}");
        assert!(data.is_empty() && trailers.is_none());
    }

    /// The worker's reused message after `pick_cpu_here` took `msg`, and
    /// whether the message decoded.
    fn take_here(msg: &[u8]) -> (pb::PickCpuRequest, bool) {
        let (p, caller, ext) = (placement(), Caller::Open, http::Extensions::new());
        let decoded = match pick_cpu_here(&p, &caller, &ext, msg) {
            Step::Refused(_) => true,
            Step::Undecodable => false,
            _ => panic!("no node is registered: refused or undecodable"),
        };
        (REQUEST.with_borrow(|kept| kept.clone()), decoded)
    }

    fn decode_here(r: &pb::PickCpuRequest) -> pb::PickCpuRequest {
        let (kept, decoded) = take_here(&r.encode_to_vec());
        assert!(decoded);
        kept
    }

    #[test]
    fn the_reused_message_holds_exactly_the_last_request() {
        let full = pb::PickCpuRequest {
            node_id: "ghost".into(),
            task: Some(pb::Task {
                cpus_allowed: "0-3".into(),
                prev_cpu: Some(2),
                ..Default::default()
            }),
            claim: true,
            this_cpu: 3,
            prev_node: "elsewhere".into(),
            selector: [("zone".to_string(), "a".to_string())].into(),
            ..Default::default()
        };
        assert_eq!(decode_here(&full), full);
        // Nothing of the first request survives into the second.
        let bare = pb::PickCpuRequest {
            node_id: "x".into(),
            ..Default::default()
        };
        assert_eq!(decode_here(&bare), bare);
    }

    #[test]
    fn a_request_over_the_kept_size_leaves_no_buffer_behind() {
        let big = pb::PickCpuRequest {
            node_id: "n".repeat(2 * KEEP_REQUEST_BYTES),
            ..Default::default()
        };
        let kept = decode_here(&big);
        assert_eq!(kept, pb::PickCpuRequest::default());
        REQUEST.with_borrow(|r| assert_eq!(r.node_id.capacity(), 0, "its buffer is freed"));
        // A large message that does not decode (a wire type 7 after the
        // long node id) frees what it grew too.
        let mut bad = big.encode_to_vec();
        bad.push(0x0f);
        let (kept, decoded) = take_here(&bad);
        assert!(!decoded);
        assert_eq!(kept, pb::PickCpuRequest::default());
        REQUEST.with_borrow(|r| assert_eq!(r.node_id.capacity(), 0, "its buffer is freed"));
    }

    #[tokio::test]
    async fn whatever_this_path_does_not_take_reaches_tonic_byte_for_byte() {
        let mut trailers = HeaderMap::new();
        trailers.insert("x-note", HeaderValue::from_static("a"));
        let oversized = [vec![0, 0, 0, 0, 16], vec![7; 8], vec![7; 8]];
        let cases: Vec<(&str, Sent, usize)> = vec![
            ("compressed flag", Sent::ping(vec![vec![1, 0, 0, 0, 0]]), 64),
            ("two messages", Sent::ping(vec![vec![0; 10]]), 64),
            (
                "two messages, two frames",
                Sent::ping(vec![vec![0; 5], vec![0; 5]]),
                64,
            ),
            ("cut short", Sent::ping(vec![vec![0, 0, 0, 0, 3, 8]]), 64),
            ("no message", Sent::ping(vec![]), 64),
            ("shorter than a prefix", Sent::ping(vec![vec![0, 0]]), 64),
            // Field 1 with wire type 7: no such wire type.
            (
                "undecodable",
                Sent::ping(vec![vec![0, 0, 0, 0, 1, 0x0f]]),
                64,
            ),
            ("over the size limit", Sent::ping(oversized.to_vec()), 8),
            (
                "request trailers",
                Sent {
                    trailers: Some(trailers.clone()),
                    ..Sent::ping(vec![vec![0; 5]])
                },
                64,
            ),
            (
                "a body that fails",
                Sent {
                    error: Some(Status::cancelled("reset")),
                    ..Sent::ping(vec![vec![0, 0]])
                },
                64,
            ),
            (
                "compressed",
                Sent {
                    encoding: Some("gzip"),
                    ..Sent::ping(vec![vec![0; 5]])
                },
                64,
            ),
            (
                "another method",
                Sent {
                    path: "/fairplace.v1.PlacementService/CanMigrate",
                    ..Sent::ping(vec![vec![0; 5]])
                },
                64,
            ),
        ];
        for (what, sent, max) in cases {
            let (_, _, _, seen) = call(&sent, max).await;
            let want = Seen {
                path: sent.path.to_string(),
                data: sent.frames.concat(),
                trailers: sent.trailers.clone(),
                error: sent.error.as_ref().map(Status::code),
            };
            assert_eq!(seen, vec![want], "{what}");
        }
    }

    #[test]
    fn one_message_is_a_clear_flag_and_a_length_that_ends_the_body() {
        assert!(is_one_message(&[0, 0, 0, 0, 0]));
        assert!(is_one_message(&[0, 0, 0, 0, 2, 8, 1]));
        assert!(!is_one_message(&[0, 0, 0, 0, 2, 8]), "cut short");
        assert!(!is_one_message(&[0, 0, 0, 0, 1, 8, 1]), "more after it");
        assert!(!is_one_message(&[1, 0, 0, 0, 0]), "compressed");
        assert!(!is_one_message(&[0, 0, 0, 0]), "no full prefix");
    }
}
