//! AgentService on the wire: the Report stream's gRPC framing, by hand.
//!
//! A server holds one Report stream per node for as long as the node's agent
//! lives, so whatever a stream keeps between two reports is paid ten
//! thousand times over. tonic's `Streaming` keeps one decode buffer per
//! stream, grows it to the largest message the stream has carried (an
//! agent's full snapshot: ~8 KiB for 128 CPUs) and never gives it back, and
//! its encoder keeps a buffer of its own for the acks. Here a message is
//! assembled only while its bytes are in flight: once decoded, the buffer is
//! released, and an idle stream holds the HTTP/2 body and two words. Each
//! ack is encoded into a buffer of its own exact size and handed to HTTP/2.
//!
//! The framing is gRPC's length-prefixed messages: a compressed flag byte
//! (0; no compression is offered), a big-endian u32 length, the protobuf
//! message. A stream's end is `grpc-status` in the trailers.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes, BytesMut};
use fairplace_proto::codec::{PREFIX, frame};
use fairplace_proto::v1 as pb;
use http_body::{Body as _, Frame};
use prost::Message;
use tonic::Status;
use tonic::body::Body;

use std::sync::Arc;

use super::ack_queue::AckRx;
use crate::identity::Caller;

/// The one method AgentService has.
pub const REPORT_PATH: &str = "/fairplace.v1.AgentService/Report";

/// Why a request cannot open a Report stream (wrong method, compressed
/// messages), as the status to answer; `None` when it can.
pub fn refusal(req: &http::Request<Body>) -> Option<Status> {
    if req.uri().path() != REPORT_PATH {
        return Some(Status::unimplemented(format!(
            "method: {} is not a method of fairplace.v1.AgentService",
            crate::quote::quote(req.uri().path())
        )));
    }
    if let Some(enc) = req.headers().get("grpc-encoding")
        && enc.as_bytes() != b"identity"
    {
        return Some(Status::unimplemented(format!(
            "grpc-encoding: {} is not supported; send messages uncompressed",
            String::from_utf8_lossy(enc.as_bytes())
        )));
    }
    None
}

/// The response of an open stream: its acks as they come, then its status.
pub fn ack_response(acks: AckRx) -> http::Response<Body> {
    let mut res = http::Response::new(Body::new(AckBody { acks, done: false }));
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    res
}

/// The agent's messages, decoded from the request body as they arrive.
pub struct Inbound {
    body: Body,
    /// The bytes of a message not yet whole; empty (no allocation) between
    /// messages.
    partial: BytesMut,
    max_message: usize,
    ended: bool,
}

impl Inbound {
    pub fn new(body: Body, max_message: usize) -> Self {
        Self {
            body,
            partial: BytesMut::new(),
            max_message,
            ended: false,
        }
    }

    /// The next message; `None` once the agent has closed its side.
    pub async fn message(&mut self) -> Result<Option<pb::AgentMessage>, Status> {
        std::future::poll_fn(|cx| self.poll_message(cx)).await
    }

    fn poll_message(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<pb::AgentMessage>, Status>> {
        loop {
            if let Some(msg) = self.take_message()? {
                return Poll::Ready(Ok(Some(msg)));
            }
            if self.ended {
                if self.partial.is_empty() {
                    return Poll::Ready(Ok(None));
                }
                return Poll::Ready(Err(Status::invalid_argument(format!(
                    "the stream ended {} bytes into a message",
                    self.partial.len()
                ))));
            }
            match ready!(Pin::new(&mut self.body).poll_frame(cx)) {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        self.partial.extend_from_slice(&data);
                    }
                }
                Some(Err(s)) => return Poll::Ready(Err(s)),
                None => self.ended = true,
            }
        }
    }

    /// Decodes the message at the front of `partial` if it is whole; checks
    /// its prefix as soon as the prefix is.
    fn take_message(&mut self) -> Result<Option<pb::AgentMessage>, Status> {
        if self.partial.len() < PREFIX {
            return Ok(None);
        }
        let flag = self.partial[0];
        let len = u32::from_be_bytes([
            self.partial[1],
            self.partial[2],
            self.partial[3],
            self.partial[4],
        ]) as usize;
        if flag != 0 {
            return Err(Status::invalid_argument(format!(
                "compressed flag {flag}, but no compression was negotiated"
            )));
        }
        if len > self.max_message {
            return Err(Status::resource_exhausted(format!(
                "{len} bytes is more than the limit of {} bytes",
                self.max_message
            )));
        }
        if self.partial.len() < PREFIX + len {
            return Ok(None);
        }
        let msg = pb::AgentMessage::decode(&self.partial[PREFIX..PREFIX + len])
            .map_err(|e| Status::invalid_argument(e.to_string()));
        self.partial.advance(PREFIX + len);
        if self.partial.is_empty() {
            // Released, not kept for the next report: see the module doc.
            self.partial = BytesMut::new();
        }
        msg.map(Some)
    }
}

/// The response body: each Ack as one length-prefixed message, then the
/// stream's status in the trailers.
struct AckBody {
    acks: AckRx,
    done: bool,
}

impl http_body::Body for AckBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let status = match ready!(self.acks.poll_recv(cx)) {
            Some(Ok(ack)) => return Poll::Ready(Some(Ok(Frame::data(frame(&*ack))))),
            Some(Err(s)) => *s,
            None => Status::ok(""),
        };
        self.done = true;
        let mut trailers = http::HeaderMap::new();
        // A status whose metadata cannot be headers still ends the stream.
        if status.add_header(&mut trailers).is_err() {
            trailers.clear();
            let _ = Status::internal("status not encodable").add_header(&mut trailers);
        }
        Poll::Ready(Some(Ok(Frame::trailers(trailers))))
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

/// What opens a Report stream: the agent handler, which takes the agent's
/// decoded messages and answers through the returned queue; it knows no
/// framing, and this file names no handler.
pub trait OpenReport: Send + Sync + 'static {
    fn open_report(&self, caller: Caller, inbound: Inbound) -> Result<AckRx, Status>;
}

/// AgentService as a tower service, in place of tonic's generated server:
/// the Report stream's framing is this file's (see the module doc).
pub struct AgentServer<A> {
    agent: Arc<A>,
    /// The largest message a stream may carry (`--max-message-bytes`).
    max_message: usize,
}

impl<A> Clone for AgentServer<A> {
    fn clone(&self) -> Self {
        Self {
            agent: Arc::clone(&self.agent),
            max_message: self.max_message,
        }
    }
}

impl<A: OpenReport> AgentServer<A> {
    pub fn new(agent: A, max_message: usize) -> Self {
        Self {
            agent: Arc::new(agent),
            max_message,
        }
    }

    /// Opens a Report stream, or answers with the status that says why not
    /// (a trailers-only response, as gRPC servers do).
    fn open(&self, req: http::Request<tonic::body::Body>) -> http::Response<tonic::body::Body> {
        if let Some(s) = refusal(&req) {
            return s.into_http();
        }
        let caller = Caller::of(req.extensions());
        let inbound = Inbound::new(req.into_body(), self.max_message);
        match self.agent.open_report(caller, inbound) {
            Ok(acks) => ack_response(acks),
            Err(s) => s.into_http(),
        }
    }
}

impl<A> tonic::server::NamedService for AgentServer<A> {
    const NAME: &'static str = "fairplace.v1.AgentService";
}

impl<A: OpenReport> tower::Service<http::Request<tonic::body::Body>> for AgentServer<A> {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Self::Response, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        std::future::ready(Ok(self.open(req)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn framed(msgs: &[pb::AgentMessage]) -> Vec<u8> {
        msgs.iter().flat_map(|m| frame(m).to_vec()).collect()
    }

    fn body_of(chunks: Vec<Vec<u8>>) -> Body {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c))));
        Body::new(http_body_util::StreamBody::new(tokio_stream::iter(frames)))
    }

    fn update(seq: u64, cpus: u32) -> pb::AgentMessage {
        pb::AgentMessage {
            body: Some(pb::agent_message::Body::Update(pb::Update {
                seq,
                full: true,
                cpus: (0..cpus)
                    .map(|id| pb::CpuState {
                        id,
                        online: true,
                        util_avg: 300,
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })),
        }
    }

    #[tokio::test]
    async fn messages_split_anywhere_across_frames_decode_in_order_and_release_the_buffer() {
        let msgs = [update(1, 128), update(2, 3), update(3, 64)];
        let bytes = framed(&msgs);
        // Every cut of the byte stream into three frames.
        for cut in [1, 4, 5, 6, 100, bytes.len() - 1] {
            let mid = (cut + bytes.len()) / 2;
            let chunks = vec![
                bytes[..cut].to_vec(),
                bytes[cut..mid].to_vec(),
                bytes[mid..].to_vec(),
            ];
            let mut inbound = Inbound::new(body_of(chunks), 1 << 20);
            for want in &msgs {
                let got = inbound.message().await.unwrap().unwrap();
                assert_eq!(&got, want, "cut at {cut}");
            }
            assert_eq!(inbound.message().await.unwrap(), None);
            assert_eq!(
                inbound.partial.capacity(),
                0,
                "buffer kept after the last message"
            );
        }
    }

    #[tokio::test]
    async fn a_whole_message_leaves_no_buffer_behind() {
        let mut inbound = Inbound::new(body_of(vec![framed(&[update(1, 128)])]), 1 << 20);
        inbound.message().await.unwrap().unwrap();
        assert_eq!(inbound.partial.capacity(), 0);
    }

    #[tokio::test]
    async fn an_oversized_prefix_is_refused_before_its_bytes_arrive() {
        let mut prefix = vec![0u8];
        prefix.extend_from_slice(&(1u32 << 30).to_be_bytes());
        let mut inbound = Inbound::new(body_of(vec![prefix]), 1 << 20);
        let e = inbound.message().await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("1073741824 bytes"), "{}", e.message());
    }

    #[tokio::test]
    async fn compressed_truncated_and_undecodable_messages_are_invalid() {
        let mut compressed = framed(&[update(1, 1)]);
        compressed[0] = 1;
        let mut truncated = framed(&[update(1, 4)]);
        truncated.truncate(truncated.len() - 3);
        let garbage = vec![0, 0, 0, 0, 3, 0xff, 0xff, 0xff];
        for (bytes, says) in [
            (compressed, "compressed flag 1"),
            (truncated, "ended"),
            (garbage, "decode"),
        ] {
            let mut inbound = Inbound::new(body_of(vec![bytes]), 1 << 20);
            let e = inbound.message().await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().contains(says), "{}", e.message());
        }
    }

    #[tokio::test]
    async fn acks_are_framed_and_the_status_ends_the_stream_in_trailers() {
        let (tx, acks) = crate::transport::ack_queue::ack_queue(4);
        let ack = pb::Ack {
            applied_seq: 7,
            ..Default::default()
        };
        tx.send(Ok(Box::new(ack.clone()))).await.unwrap();
        tx.send(Err(Box::new(Status::aborted("superseded"))))
            .await
            .unwrap();
        let mut body = AckBody { acks, done: false };
        let data = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(data[0], 0);
        assert_eq!(
            u32::from_be_bytes(data[1..5].try_into().unwrap()) as usize,
            data.len() - 5
        );
        assert_eq!(pb::Ack::decode(&data[5..]).unwrap(), ack);
        let trailers = body
            .frame()
            .await
            .unwrap()
            .unwrap()
            .into_trailers()
            .unwrap();
        assert_eq!(trailers["grpc-status"], "10");
        assert_eq!(trailers["grpc-message"], "superseded");
        assert!(body.frame().await.is_none());
    }
}
