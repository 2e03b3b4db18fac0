//! AgentService.Report: one registration, then a stream of full snapshots and
//! deltas, each answered with an Ack.
//!
//! Every stream ends, and always with a reason: no Register within
//! `register_timeout` (DEADLINE_EXCEEDED), an oversized or undecodable frame
//! (RESOURCE_EXHAUSTED / INVALID_ARGUMENT), silence past the store's forget
//! time (the node is forgotten: DEADLINE_EXCEEDED), a newer registration
//! (ABORTED), or server shutdown (UNAVAILABLE, so agents reconnect elsewhere).

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::agent_message::Body;
use tokio::sync::watch;
use tonic::Status;

use super::cpu_pool::CpuPool;
use super::lease_hub::AckTx;
use crate::convert;
use crate::engine::features::Kernel;
use crate::engine::topology::FieldError;
use crate::identity::{self, Caller};
use crate::metrics as m;
use crate::quote::quote;
use crate::replica::Redirect;
use crate::replica::route::{Replicated, redirect_status};
use crate::store::nodes::RegisterError;
use crate::store::report::{Applied, changes_online};
use crate::store::{Reject, Store, Update};
use crate::transport::ack_queue::{AckRx, ack_queue};
use crate::transport::agent_wire::{Inbound, OpenReport};

pub struct Agent {
    pub store: Arc<Store>,
    /// Topology builds (registrations, hotplug updates) run here.
    pub heavy: CpuPool,
    /// A stream must register within this long.
    pub register_timeout: Duration,
    /// True once the server shuts down: every stream ends with UNAVAILABLE.
    pub stopping: watch::Receiver<bool>,
    /// Leases to apply go to the node's stream through here.
    pub hub: Arc<super::lease_hub::LeaseHub>,
    /// Streams opened and not yet registered: each costs a stream and a
    /// task for up to `register_timeout` before anyone has said who it is,
    /// so they are capped apart from registered ones (bounded by the
    /// store's node limit).
    pub pending: Arc<tokio::sync::Semaphore>,
    /// With `--etcd-endpoints`: a node is claimed before it registers, and
    /// its agent sent to the owner when this replica is not.
    pub replicated: Option<Replicated>,
}

/// Report streams that may wait for their Register at once, by default.
pub const DEFAULT_MAX_PENDING_REGISTRATIONS: usize = 4096;

/// Leases an agent may report holding at registration (a node's CPUs, and
/// then some: every lease holds at least one CPU).
pub const MAX_HELD_LEASES: usize = crate::engine::cpumask::MAX_CPUS;

fn rejected(reason: &'static str) {
    metrics::counter!(m::REPORTS_REJECTED, "reason" => reason).increment(1);
}

/// Registers the stream's node. Takes the message by value: the stream lives
/// as long as the agent, and the registration (its topology) must not.
fn register(
    store: &Store,
    reg: pb::Register,
) -> Result<(Arc<crate::store::Node>, u64), RegisterError> {
    let kernel = Kernel::from_name(&reg.kernel_profile).ok_or_else(|| {
        FieldError::new(
            "register.kernel_profile",
            format!(
                "{} is not one of \"mainline\", \"6.12\"",
                quote(&reg.kernel_profile)
            ),
        )
    })?;
    let spec = convert::topology_spec(reg.topology.as_ref(), "register.topology")?;
    let mut labels: Vec<(String, String)> = reg.labels.into_iter().collect();
    labels.sort();
    let source = pb::SignalSource::try_from(reg.signal_source)
        .unwrap_or(pb::SignalSource::Unspecified) as i32;
    let (node, generation) =
        store
            .nodes
            .register_agent(&reg.node_id, labels, reg.agent_version, spec)?;
    node.signal_source
        .store(source, std::sync::atomic::Ordering::Relaxed);
    store.nodes.set_kernel(&node, kernel);
    Ok((node, generation))
}

/// A frame the transport could not hand over: too large, or undecodable.
/// The agent is told which, never a bare end of stream.
fn frame_error(s: Status) -> Status {
    match s.code() {
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted => {
            rejected("oversized");
            Status::resource_exhausted(format!("message: {}", s.message()))
        }
        tonic::Code::Internal | tonic::Code::InvalidArgument => {
            rejected("undecodable");
            Status::invalid_argument(format!("message: {}", s.message()))
        }
        _ => {
            rejected("transport");
            s
        }
    }
}

fn shutting_down() -> Status {
    Status::unavailable("server shutting down; reconnect to another")
}

/// What one message of a registered stream leads to.
enum Step {
    Ack(pb::Ack),
    End(Status),
    /// Nothing to answer (an apply outcome).
    Quiet,
}

/// One agent's stream, from its registration to its end.
struct ReportStream {
    store: Arc<Store>,
    heavy: CpuPool,
    stopping: watch::Receiver<bool>,
    tx: AckTx,
    /// Who opened the stream: a node certificate reports only its node.
    caller: Caller,
    hub: Arc<super::lease_hub::LeaseHub>,
    replicated: Option<Replicated>,
}

/// Resolves when the node is handed to another replica, with where its
/// agent goes; never without replicas.
async fn handed_over(rx: &mut Option<watch::Receiver<Option<Redirect>>>) -> Redirect {
    let Some(rx) = rx else {
        return std::future::pending().await;
    };
    loop {
        if let Some(r) = rx.borrow_and_update().clone() {
            return r;
        }
        if rx.changed().await.is_err() {
            // The replica dropped the channel: the stream stays.
            return std::future::pending().await;
        }
    }
}

/// What ended a registered stream's wait for its next report.
enum Next {
    Report(Result<Option<pb::AgentMessage>, Status>),
    Silent,
    Stopping,
    HandedOver(Redirect),
}

/// The wait between two reports: all an idle stream's task holds, so it is
/// only the four things it waits on.
async fn next_report(
    inbound: &mut Inbound,
    silence: Duration,
    stopping: &mut watch::Receiver<bool>,
    moved: &mut Option<watch::Receiver<Option<Redirect>>>,
) -> Next {
    tokio::select! {
        r = tokio::time::timeout(silence, inbound.message()) => match r {
            Ok(r) => Next::Report(r),
            Err(_) => Next::Silent,
        },
        _ = stopping.wait_for(|s| *s) => Next::Stopping,
        to = handed_over(moved) => Next::HandedOver(to),
    }
}

impl ReportStream {
    async fn end(&self, s: Status) {
        let _ = self.tx.send(Err(Box::new(s))).await;
    }

    /// The stream's life. Only the wait between two reports is held in the
    /// task's own state: ten thousand idle streams keep theirs for as long
    /// as they live, so every other step (registration, the leases'
    /// reconcile, each report's handling, the end) is a boxed future that
    /// lives only while it runs.
    async fn run(
        mut self,
        mut inbound: Inbound,
        register_timeout: Duration,
        pending: tokio::sync::OwnedSemaphorePermit,
    ) {
        let opened = Box::pin(self.open(&mut inbound, register_timeout, pending)).await;
        let Some((node, generation, mut moved, serving)) = opened else {
            return;
        };
        let mut handed = false;
        if serving {
            let silence = self.store.config.forget_after;
            handed = loop {
                let next = next_report(&mut inbound, silence, &mut self.stopping, &mut moved).await;
                if let Some(handed) = Box::pin(self.on_next(&node, generation, next)).await {
                    break handed;
                }
            };
            self.hub.detach(&node.id, generation);
        }
        Box::pin(self.close(&node, generation, handed)).await;
    }

    /// Registration, the first Ack, and the leases' reconcile and re-send.
    /// Returns the node, its generation, the replica's hand-over watch, and
    /// whether the stream is still there to serve.
    async fn open(
        &mut self,
        inbound: &mut Inbound,
        register_timeout: Duration,
        pending: tokio::sync::OwnedSemaphorePermit,
    ) -> Option<(
        Arc<crate::store::Node>,
        u64,
        Option<watch::Receiver<Option<Redirect>>>,
        bool,
    )> {
        let registered = Box::pin(self.accept_register(inbound, register_timeout)).await;
        drop(pending);
        let (node, generation, held) = registered?;
        tracing::info!(node = %node.id, cpus = node.spec.cpus.len(), "agent registered");
        let first = pb::Ack {
            applied_seq: 0,
            rejection: None,
            resync_required: true,
            ..Default::default()
        };
        let moved = self
            .replicated
            .as_ref()
            .map(|r| r.replica.attach_stream(&node.id, generation));
        let serving = self.tx.send(Ok(Box::new(first))).await.is_ok();
        if serving {
            // Leases reach this node through this stream from now on, and
            // its live ones are applied again.
            self.hub.attach(&node.id, generation, self.tx.clone());
            let sink: Arc<dyn crate::store::leases::settle::AgentSink> =
                Arc::clone(&self.hub) as Arc<dyn crate::store::leases::settle::AgentSink>;
            let drop = Box::pin(super::allocate::reconcile(&self.store, &sink, &node, &held)).await;
            Box::pin(self.hub.resend(&self.store, &node, &self.tx, drop)).await;
        }
        self.store.nodes.reconciled(&node);
        Some((node, generation, moved, serving))
    }

    /// The stream ended: the node is disconnected, and released to the
    /// next replica when it was handed over.
    async fn close(&self, node: &Arc<crate::store::Node>, generation: u64, handed: bool) {
        self.store.nodes.disconnect(node, generation);
        if let Some(rep) = &self.replicated {
            rep.replica.detach_stream(&node.id, generation);
            if handed {
                // The next owner reads the node's leases from etcd once
                // this replica's owner key is gone.
                self.store.nodes.let_go(&node.id);
                rep.replica.release(&node.id).await;
            }
        }
        tracing::info!(node = %node.id, handed_over = handed, "agent stream ended");
    }

    /// The first message: a Register, within `timeout`. Anything else ends
    /// the stream with a status that says why.
    async fn accept_register(
        &mut self,
        inbound: &mut Inbound,
        timeout: Duration,
    ) -> Option<(Arc<crate::store::Node>, u64, Vec<pb::LeaseGrant>)> {
        let first = tokio::select! {
            r = tokio::time::timeout(timeout, inbound.message()) => Some(r),
            _ = self.stopping.wait_for(|s| *s) => None,
        };
        let Some(first) = first else {
            self.end(shutting_down()).await;
            return None;
        };
        let msg = match first {
            Err(_) => {
                rejected("register_timeout");
                self.end(Status::deadline_exceeded(format!(
                    "body: no Register within {} ms of opening the stream",
                    timeout.as_millis()
                )))
                .await;
                return None;
            }
            Ok(Ok(Some(m))) => m,
            Ok(Ok(None)) => return None,
            Ok(Err(s)) => {
                self.end(frame_error(s)).await;
                return None;
            }
        };
        let Some(Body::Register(mut reg)) = msg.body else {
            rejected("not_registered");
            self.end(Status::invalid_argument(
                "body: the first message must be a Register",
            ))
            .await;
            return None;
        };
        if let Err(s) = identity::check_report_node(&self.caller, &reg.node_id) {
            rejected("permission_denied");
            tracing::warn!(caller = self.caller.claimant(), node = %convert::quote(&reg.node_id), "registration of another node refused");
            self.end(s).await;
            return None;
        }
        // The leases the agent holds are reconciled once the node is in.
        let held = std::mem::take(&mut reg.held_leases);
        if held.len() > MAX_HELD_LEASES {
            rejected("invalid");
            self.end(Status::invalid_argument(format!(
                "register.held_leases: {} leases is more than the {MAX_HELD_LEASES} a node may hold",
                held.len()
            )))
            .await;
            return None;
        }
        if let Some(rep) = &self.replicated
            && let Err(s) = rep.take_over(&self.store, &reg.node_id).await
        {
            rejected("not_owner");
            self.end(s).await;
            return None;
        }
        let store = Arc::clone(&self.store);
        let node_id = reg.node_id.clone();
        let registered = self
            .heavy
            .run("register", move || register(&store, reg))
            .await;
        if let (false, Some(rep)) = (matches!(registered, Ok(Ok(_))), &self.replicated) {
            // Claimed but not registered: nothing may dangle in etcd.
            self.store.nodes.let_go(&node_id);
            rep.replica.release(&node_id).await;
        }
        match registered {
            Ok(Ok((node, generation))) => {
                // The overrides an earlier owner set follow the node here.
                if let Some(over) = self
                    .replicated
                    .as_ref()
                    .and_then(|rep| rep.replica.node_overrides(&node.id))
                {
                    let _ = self.store.nodes.set_features(Some(&node), &over, true);
                }
                Some((node, generation, held))
            }
            Ok(Err(e)) => {
                rejected(e.reason());
                let status = match e {
                    RegisterError::Invalid(e) => convert::invalid(e),
                    full @ RegisterError::Full { .. } => {
                        Status::resource_exhausted(full.to_string())
                    }
                };
                self.end(status).await;
                None
            }
            Err(s) => {
                rejected("busy");
                self.end(s).await;
                None
            }
        }
    }

    /// Answers what ended a wait; `Some(handed over)` ends the stream.
    async fn on_next(
        &self,
        node: &Arc<crate::store::Node>,
        generation: u64,
        next: Next,
    ) -> Option<bool> {
        let msg = match next {
            Next::HandedOver(to) => {
                self.end(redirect_status(&to)).await;
                return Some(true);
            }
            Next::Stopping => {
                self.end(shutting_down()).await;
                return Some(false);
            }
            Next::Silent => {
                // A stream that stays open but says nothing does not keep
                // its node alive.
                self.store.nodes.forget(node, generation);
                rejected("silent");
                self.end(Status::deadline_exceeded(format!(
                    "no report for {} s: node {} forgotten; reconnect and register again",
                    self.store.config.forget_after.as_secs(),
                    node.id
                )))
                .await;
                return Some(false);
            }
            Next::Report(Ok(Some(m))) => m,
            Next::Report(Ok(None)) => return Some(false),
            Next::Report(Err(s)) => {
                self.end(frame_error(s)).await;
                return Some(false);
            }
        };
        let step = match msg.body {
            Some(Body::Update(u)) => self.on_update(node, generation, u).await,
            Some(Body::Applied(o)) => {
                self.hub.outcome(&self.store, node, o);
                Step::Quiet
            }
            Some(Body::Register(_)) => {
                rejected("invalid");
                Step::End(Status::invalid_argument(
                    "body: already registered; a topology change is a new registration on a new stream",
                ))
            }
            None => {
                rejected("invalid");
                Step::Ack(pb::Ack {
                    applied_seq: node.last_seq(),
                    resync_required: false,
                    rejection: Some(pb::Rejection {
                        reason: "invalid".into(),
                        message: "body: empty message".into(),
                    }),
                    ..Default::default()
                })
            }
        };
        match step {
            Step::Ack(ack) => self
                .tx
                .send(Ok(Box::new(ack)))
                .await
                .is_err()
                .then_some(false),
            Step::End(s) => {
                self.end(s).await;
                Some(false)
            }
            Step::Quiet => None,
        }
    }

    /// Validates and applies one update; a refusal is an Ack with a
    /// rejection (the stream goes on), except where the stream must end.
    async fn on_update(
        &self,
        node: &Arc<crate::store::Node>,
        generation: u64,
        u: pb::Update,
    ) -> Step {
        if !u.node_id.is_empty()
            && let Err(s) = identity::check_report_node(&self.caller, &u.node_id)
        {
            rejected("permission_denied");
            return Step::End(s);
        }
        if !u.node_id.is_empty() && u.node_id != node.id {
            rejected("wrong_node");
            return Step::End(Status::invalid_argument(format!(
                "update.node_id: {} is not the node this stream registered ({})",
                convert::quote(&u.node_id),
                convert::quote(&node.id)
            )));
        }
        let t0 = Instant::now();
        let update = match convert::update(&u, &node.spec) {
            Ok(x) => x,
            Err(e) => {
                rejected("invalid");
                return Step::Ack(rejection_ack(node, "invalid", e.to_string(), false));
            }
        };
        match self.apply(node, generation, update, t0).await {
            Ok(applied) => {
                record_applied(&applied, t0);
                Step::Ack(pb::Ack {
                    applied_seq: applied.seq,
                    rejection: None,
                    resync_required: false,
                    ..Default::default()
                })
            }
            Err(Reject::Superseded) => {
                if self.store.nodes.get(&node.id).is_none() {
                    rejected("forgotten");
                    return Step::End(Status::failed_precondition(
                        "node_id: this node was forgotten (silent too long); register again",
                    ));
                }
                rejected("superseded");
                Step::End(Status::aborted(Reject::Superseded.to_string()))
            }
            Err(Reject::Busy(s)) => {
                rejected("busy");
                Step::Ack(rejection_ack(node, "busy", s, false))
            }
            Err(r) => {
                rejected(r.reason());
                let resync = matches!(r, Reject::OutOfSequence { .. });
                Step::Ack(rejection_ack(node, r.reason(), r.to_string(), resync))
            }
        }
    }

    /// Applies an update through the store's one way in; one that changes
    /// which CPUs are online rebuilds the domain tree, so it runs in the
    /// heavy pool.
    async fn apply(
        &self,
        node: &Arc<crate::store::Node>,
        generation: u64,
        update: Update,
        t0: Instant,
    ) -> Result<Applied, Reject> {
        if !changes_online(&node.snapshot().topo.online, &update) {
            return self.store.report(node, generation, &update, t0);
        }
        let (store, n) = (Arc::clone(&self.store), Arc::clone(node));
        self.heavy
            .run("topology", move || {
                store.report(&n, generation, &update, t0)
            })
            .await
            .unwrap_or_else(|s| Err(Reject::Busy(s.message().to_string())))
    }
}

/// An applied report's metrics, recorded once from what it changed.
fn record_applied(a: &Applied, t0: Instant) {
    let kind = if a.full { "full" } else { "delta" };
    metrics::counter!(m::REPORTS_APPLIED, "kind" => kind).increment(1);
    metrics::counter!(m::CPU_UPDATES).increment(a.cpus as u64);
    metrics::histogram!(m::REPORT_APPLY_DURATION).record(t0.elapsed().as_secs_f64());
    metrics::counter!(m::TASKS_REPORTED).increment(a.tasks as u64);
    for r in &a.scans {
        m::record_cache_scan(r);
    }
}

fn rejection_ack(
    node: &crate::store::Node,
    reason: &str,
    message: String,
    resync: bool,
) -> pb::Ack {
    pb::Ack {
        applied_seq: node.last_seq(),
        resync_required: resync,
        rejection: Some(pb::Rejection {
            reason: reason.into(),
            message,
        }),
        ..Default::default()
    }
}

impl OpenReport for Agent {
    /// Opens a Report stream for `caller`: its task reads `inbound` (the
    /// agent's messages, decoded) and its acks come out of the returned
    /// queue (the transport's response body).
    fn open_report(&self, caller: Caller, inbound: Inbound) -> Result<AckRx, Status> {
        let Ok(pending) = Arc::clone(&self.pending).try_acquire_owned() else {
            rejected("pending_registrations");
            return Err(Status::resource_exhausted(
                "server busy: the limit of Report streams waiting for their Register \
                 (--max-pending-registrations) is reached; retry later",
            ));
        };
        // The agent waits for each Ack, so four slots are plenty.
        let (tx, rx) = ack_queue(4);
        let stream = ReportStream {
            store: Arc::clone(&self.store),
            heavy: self.heavy.clone(),
            stopping: self.stopping.clone(),
            tx,
            caller,
            hub: Arc::clone(&self.hub),
            replicated: self.replicated.clone(),
        };
        tokio::spawn(stream.run(inbound, self.register_timeout, pending));
        Ok(rx)
    }
}
