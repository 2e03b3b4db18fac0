//! AgentService.Report: one registration, then a stream of full snapshots and
//! deltas, each answered with an Ack.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::agent_message::Body;
use fairplace_proto::v1::agent_service_server::AgentService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

use super::convert;
use crate::metrics as m;
use crate::store::{Reject, Store};

pub struct Agent {
    pub store: Arc<Store>,
}

type AckStream = Pin<Box<dyn Stream<Item = Result<pb::Ack, Status>> + Send>>;

fn rejected(reason: &'static str) {
    metrics::counter!(m::REPORTS_REJECTED, "reason" => reason).increment(1);
}

/// Registers the stream's node. Takes the message by value: the stream lives
/// as long as the agent, and the registration (its topology) must not.
fn register(
    store: &Store,
    reg: pb::Register,
) -> Result<(Arc<crate::store::Node>, u64), crate::engine::topology::FieldError> {
    let spec = convert::topology_spec(reg.topology.as_ref(), "register.topology")?;
    let mut labels: Vec<(String, String)> = reg.labels.into_iter().collect();
    labels.sort();
    store.register(&reg.node_id, labels, reg.agent_version, spec)
}

#[tonic::async_trait]
impl AgentService for Agent {
    type ReportStream = AckStream;

    async fn report(
        &self,
        req: Request<Streaming<pb::AgentMessage>>,
    ) -> Result<Response<AckStream>, Status> {
        let mut inbound = req.into_inner();
        let store = Arc::clone(&self.store);
        // Acks are small and the agent waits for them; errors are boxed so
        // the channel's slot blocks stay small with thousands of streams.
        let (tx, rx) = mpsc::channel::<Result<pb::Ack, Box<Status>>>(4);
        tokio::spawn(async move {
            let first = match inbound.message().await {
                Ok(Some(m)) => m,
                _ => return,
            };
            let Some(Body::Register(reg)) = first.body else {
                rejected("not_registered");
                let _ = tx
                    .send(Err(Box::new(Status::invalid_argument(
                        "body: the first message must be a Register",
                    ))))
                    .await;
                return;
            };
            let registered = register(&store, reg);
            let (node, generation) = match registered {
                Ok(x) => x,
                Err(e) => {
                    rejected("invalid");
                    let _ = tx.send(Err(Box::new(convert::invalid(e)))).await;
                    return;
                }
            };
            tracing::info!(node = %node.id, cpus = node.spec.cpus.len(), "agent registered");
            if tx
                .send(Ok(pb::Ack {
                    applied_seq: 0,
                    rejection: None,
                    resync_required: true,
                }))
                .await
                .is_err()
            {
                store.disconnect(&node, generation);
                return;
            }
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => break,
                    Err(s) => {
                        // Oversized or undecodable: tell the agent why the
                        // stream ends.
                        rejected(if s.code() == tonic::Code::OutOfRange {
                            "oversized"
                        } else {
                            "transport"
                        });
                        let _ = tx.send(Err(Box::new(s))).await;
                        break;
                    }
                };
                let ack = match msg.body {
                    Some(Body::Update(u)) => {
                        if !u.node_id.is_empty() && u.node_id != node.id {
                            rejected("wrong_node");
                            let _ = tx.send(Err(Box::new(Status::invalid_argument(format!(
                                    "update.node_id: {:?} is not the node this stream registered ({:?})",
                                    u.node_id, node.id
                                )))))
                                .await;
                            break;
                        }
                        let t0 = Instant::now();
                        let update = match convert::update(&u, &node.spec) {
                            Ok(x) => x,
                            Err(e) => {
                                rejected("invalid");
                                let ack = pb::Ack {
                                    applied_seq: node.last_seq(),
                                    resync_required: false,
                                    rejection: Some(pb::Rejection {
                                        reason: "invalid".into(),
                                        message: e.to_string(),
                                    }),
                                };
                                if tx.send(Ok(ack)).await.is_err() {
                                    break;
                                }
                                continue;
                            }
                        };
                        match store.apply(&node, generation, &update, t0) {
                            Ok(_) => {
                                let kind = if u.full { "full" } else { "delta" };
                                metrics::counter!(m::REPORTS_APPLIED, "kind" => kind).increment(1);
                                metrics::counter!(m::CPU_UPDATES).increment(u.cpus.len() as u64);
                                metrics::histogram!(m::REPORT_APPLY_DURATION)
                                    .record(t0.elapsed().as_secs_f64());
                                let tasks: usize = update.tasks.iter().map(|l| l.tasks.len()).sum();
                                metrics::counter!(m::TASKS_REPORTED).increment(tasks as u64);
                                for r in store.account(&node, &update.runtime, t0) {
                                    m::record_cache_scan(&r);
                                }
                                pb::Ack {
                                    applied_seq: u.seq,
                                    rejection: None,
                                    resync_required: false,
                                }
                            }
                            Err(Reject::Superseded) => {
                                rejected("superseded");
                                let _ = tx
                                    .send(Err(Box::new(Status::aborted(
                                        Reject::Superseded.to_string(),
                                    ))))
                                    .await;
                                break;
                            }
                            Err(r) => {
                                rejected(r.reason());
                                pb::Ack {
                                    applied_seq: node.last_seq(),
                                    resync_required: matches!(r, Reject::OutOfSequence { .. }),
                                    rejection: Some(pb::Rejection {
                                        reason: r.reason().to_string(),
                                        message: r.to_string(),
                                    }),
                                }
                            }
                        }
                    }
                    Some(Body::Register(_)) => {
                        rejected("invalid");
                        let _ = tx.send(Err(Box::new(Status::invalid_argument(
                                "body: already registered; a topology change is a new registration on a new stream",
                            ))))
                            .await;
                        break;
                    }
                    None => {
                        rejected("invalid");
                        pb::Ack {
                            applied_seq: node.last_seq(),
                            resync_required: false,
                            rejection: Some(pb::Rejection {
                                reason: "invalid".into(),
                                message: "body: empty message".into(),
                            }),
                        }
                    }
                };
                if tx.send(Ok(ack)).await.is_err() {
                    break;
                }
            }
            store.disconnect(&node, generation);
            tracing::info!(node = %node.id, "agent stream ended");
        });
        Ok(Response::new(Box::pin(
            ReceiverStream::new(rx).map(|r| r.map_err(|s| *s)),
        )))
    }
}
