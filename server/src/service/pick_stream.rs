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
//! The answers are a stream the response encoder pulls: a request is read
//! and decided only when the encoder asks for the next answer, so the
//! answers of requests that arrived together are encoded into one write,
//! and a client that does not read its answers stops the server reading
//! its requests (HTTP/2 flow control then holds the client back). One
//! request is decided at a time per stream. A stream with no request for
//! [`IDLE`] is ended, as is every stream when the server shuts down; how
//! many may be open at once is capped (`--max-pick-streams`,
//! [`super::layers::StreamCaps`]).

use std::pin::Pin;
use std::time::Duration;

use fairplace_proto::v1 as pb;
use tokio::sync::watch;
use tokio::time::{Instant, Sleep};
use tonic::{Request, Status, Streaming};

use super::placement::{Answers, Placement};
use crate::identity::Caller;

/// A stream with no request for this long (give or take a second) is
/// ended (UNAVAILABLE: open a new one).
pub const IDLE: Duration = Duration::from_secs(120);

/// How often the idle deadline is moved: not at every message, which
/// would touch the timer wheel per decision.
const IDLE_RESET_EVERY: Duration = Duration::from_secs(1);

/// One stream's state between answers.
struct State {
    me: Placement,
    caller: Caller,
    ext: http::Extensions,
    input: Streaming<pb::PickCpuRequest>,
    stopping: watch::Receiver<bool>,
    idle: Pin<Box<Sleep>>,
    idle_set: Instant,
    seq: u64,
    /// The stream has sent its last item (an error).
    done: bool,
}

/// What ended the wait for the next request. Lives on the stack for one
/// step: boxing the request would allocate per decision.
#[allow(clippy::large_enum_variant)]
enum Next {
    Request(pb::PickCpuRequest),
    End,
    Fail(Status),
}

impl State {
    async fn next_request(&mut self) -> Next {
        tokio::select! {
            r = self.input.message() => match r {
                Ok(Some(r)) => Next::Request(r),
                // The client ended its side: every answer is sent.
                Ok(None) => Next::End,
                // Undecodable or oversized: the stream cannot go on.
                Err(s) => Next::Fail(s),
            },
            _ = self.idle.as_mut() => Next::Fail(Status::unavailable(format!(
                "no request for {} s; open a new stream",
                IDLE.as_secs()
            ))),
            _ = self.stopping.wait_for(|s| *s) => Next::Fail(Status::unavailable(
                "the server is shutting down; open a new stream elsewhere",
            )),
        }
    }

    /// The next answer, or the stream's end.
    async fn answer(mut self) -> Option<(Result<pb::PickCpusAnswer, Status>, State)> {
        if self.done {
            return None;
        }
        let mut r = match self.next_request().await {
            Next::Request(r) => r,
            Next::End => return None,
            Next::Fail(s) => {
                self.done = true;
                return Some((Err(s), self));
            }
        };
        let now = Instant::now();
        if now.duration_since(self.idle_set) > IDLE_RESET_EVERY {
            self.idle.as_mut().reset(now + IDLE);
            self.idle_set = now;
        }
        let answer = match self.me.pick_one(&self.caller, &self.ext, &mut r) {
            Ok(picked) => picked.into_response(std::mem::take(&mut r.node_id)).await,
            Err(s) => Err(s),
        };
        let result = match answer {
            Ok(resp) => pb::pick_cpus_answer::Result::Ok(resp),
            Err(s) => pb::pick_cpus_answer::Result::Error(pb::PickError {
                code: s.code() as i32,
                message: s.message().to_string(),
            }),
        };
        let answer = pb::PickCpusAnswer {
            seq: self.seq,
            result: Some(result),
        };
        self.seq += 1;
        Some((Ok(answer), self))
    }
}

impl Placement {
    /// Serves one PickCpus stream until the client ends it.
    pub(super) fn pick_stream(&self, req: Request<Streaming<pb::PickCpuRequest>>) -> Answers {
        let (_, ext, input) = req.into_parts();
        let now = Instant::now();
        let state = State {
            me: self.clone(),
            caller: Caller::of(&ext),
            ext,
            input,
            stopping: self.stopping.clone(),
            idle: Box::pin(tokio::time::sleep_until(now + IDLE)),
            idle_set: now,
            seq: 0,
            done: false,
        };
        Box::pin(futures_util::stream::unfold(state, State::answer))
    }
}
