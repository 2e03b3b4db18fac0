//! PickCpus: PickCpu for many tasks on one stream.
//!
//! A scheduler placing thousands of tasks a second pays, with the unary
//! call, a whole HTTP/2 stream per decision (headers both ways, a stream
//! opened and closed, the call's layers); the decision itself costs far
//! less. On one PickCpus stream each request is one message and each
//! answer one message. The answers are PickCpu's own, in the order the
//! requests came, each decided as the unary call decides it
//! ([`Placement::pick_one`]: claims, forwarding to another replica's
//! node, the metrics). A request that fails gets its error in its answer,
//! and the stream goes on.
//!
//! Bounds: one request is decided at a time per stream, and at most
//! [`AHEAD`] answers wait for the client to read them; past that the
//! server stops reading requests, so a client that does not read holds no
//! more than that. A stream with no request for [`IDLE`] is ended, as is
//! every stream when the server shuts down; how many may be open at once
//! is capped (`--max-pick-streams`, [`super::layers::StreamCaps`]).

use std::pin::Pin;
use std::time::Duration;

use fairplace_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Status, Streaming};

use super::identity::Caller;
use super::placement::Placement;

/// The answers of one stream, as the service returns them.
pub type Answers = Pin<Box<dyn Stream<Item = Result<pb::PickCpusAnswer, Status>> + Send>>;

/// Answers decided ahead of the client's reading.
pub const AHEAD: usize = 32;

/// A stream with no request for this long is ended (UNAVAILABLE: open a
/// new one).
pub const IDLE: Duration = Duration::from_secs(120);

impl Placement {
    /// Serves one PickCpus stream until the client ends it.
    pub(super) fn pick_stream(&self, req: Request<Streaming<pb::PickCpuRequest>>) -> Answers {
        let (_, ext, mut input) = req.into_parts();
        let me = self.clone();
        let (tx, rx) = mpsc::channel(AHEAD);
        tokio::spawn(async move {
            let caller = Caller::of(&ext);
            let mut stopping = me.stopping.clone();
            for seq in 0u64.. {
                let next = tokio::select! {
                    r = tokio::time::timeout(IDLE, input.message()) => Some(r),
                    _ = stopping.wait_for(|s| *s) => None,
                    _ = tx.closed() => return,
                };
                let r = match next {
                    Some(Ok(Ok(Some(r)))) => r,
                    // The client ended its side: the answers are all sent.
                    Some(Ok(Ok(None))) => return,
                    // Undecodable or oversized: the stream cannot go on.
                    Some(Ok(Err(s))) => {
                        let _ = tx.send(Err(s)).await;
                        return;
                    }
                    Some(Err(_)) => {
                        let idle =
                            format!("no request for {} s; open a new stream", IDLE.as_secs());
                        let _ = tx.send(Err(Status::unavailable(idle))).await;
                        return;
                    }
                    None => {
                        let bye = "the server is shutting down; open a new stream elsewhere";
                        let _ = tx.send(Err(Status::unavailable(bye))).await;
                        return;
                    }
                };
                let result = match me.pick_one(&caller, &ext, r).await {
                    Ok(resp) => pb::pick_cpus_answer::Result::Ok(resp),
                    Err(s) => pb::pick_cpus_answer::Result::Error(pb::PickError {
                        code: s.code() as i32,
                        message: s.message().to_string(),
                    }),
                };
                let answer = pb::PickCpusAnswer {
                    seq,
                    result: Some(result),
                };
                if tx.send(Ok(answer)).await.is_err() {
                    return;
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}
