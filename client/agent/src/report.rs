//! One connection of a node's Report stream, from connect to its end, in
//! named steps: [`connect`], [`register`], then per tick [`cpu_changes`],
//! [`task_parts`] and [`fit_to_server`] build an update, and [`on_ack`]
//! handles what the server answers. The leases the server pushes go to
//! the stream's [`leases::Applier`], which outlives the connection.
//!
//! Deltas carry only the CPUs whose signals moved: a CPU is resent when any
//! count, flag, stamp or latency differs from what was last *sent* for it,
//! or when a PELT average moved from its last sent value by more than
//! [`pelt_threshold`] (16, or 1/32 of the value if that is larger). PELT
//! averages drift every millisecond; without a threshold a 100 ms agent on
//! a quiet node would resend every CPU every tick. Comparing with the last
//! sent value, not the last sample, bounds the server's error by the
//! threshold however slowly a signal drifts.

use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use pb::agent_message::Body;
use pb::agent_service_client::AgentServiceClient;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::{Source, StreamConfig, StreamStats, leases, limits};

type Acks = tonic::Streaming<pb::Ack>;

/// What the server holds, as far as this connection knows.
#[derive(Default)]
struct Sent {
    /// Per CPU, the state last sent for it.
    cpus: Option<Vec<pb::CpuState>>,
    tasks: Option<Vec<pb::CpuTasks>>,
    need_full: bool,
}

/// The smallest move of a PELT average (kernel units) worth a delta.
pub fn pelt_threshold(old: i64) -> i64 {
    (old.abs() / 32).max(16)
}

/// `now` differs from `sent` enough to be resent.
pub fn changed(now: &pb::CpuState, sent: &pb::CpuState) -> bool {
    let pelt = |a: i64, b: i64| (a - b).abs() > pelt_threshold(b);
    let strip = |c: &pb::CpuState| pb::CpuState {
        load_avg: 0,
        runnable_avg: 0,
        util_avg: 0,
        util_est: 0,
        ..*c
    };
    strip(now) != strip(sent)
        || pelt(now.load_avg, sent.load_avg)
        || pelt(now.runnable_avg, sent.runnable_avg)
        || pelt(now.util_avg, sent.util_avg)
        || pelt(now.util_est, sent.util_est)
}

/// Whether the update is full, and the CPUs it carries; `sent` then holds
/// what the server will hold.
fn cpu_changes(sent: &mut Sent, now: Vec<pb::CpuState>) -> (bool, Vec<pb::CpuState>) {
    match sent.cpus.as_mut() {
        Some(prev) if !sent.need_full && prev.len() == now.len() => {
            let mut out = Vec::new();
            for (c, p) in now.into_iter().zip(prev.iter_mut()) {
                if changed(&c, p) {
                    *p = c;
                    out.push(c);
                }
            }
            (false, out)
        }
        _ => {
            sent.cpus = Some(now.clone());
            (true, now)
        }
    }
}

/// The task lists to send: all with a full update; otherwise every CPU
/// with tasks (their clock moves on) and every CPU whose list emptied.
pub(super) fn task_lists(
    full: bool,
    last: Option<&[pb::CpuTasks]>,
    now: &[pb::CpuTasks],
) -> Vec<pb::CpuTasks> {
    match last {
        Some(prev) if !full && prev.len() == now.len() => now
            .iter()
            .zip(prev)
            .filter(|(a, b)| !a.tasks.is_empty() || !b.tasks.is_empty())
            .map(|(a, _)| a.clone())
            .collect(),
        _ => now.to_vec(),
    }
}

/// Task lists and runtime of this sample, cut to the server's limits and
/// without the parts the server refused.
fn task_parts<S: Source>(
    source: &mut S,
    shed: &mut limits::Shedding,
    sent: &mut Sent,
    full: bool,
    nr_cpus: usize,
) -> (Vec<pb::CpuTasks>, Vec<pb::ProcessRuntime>) {
    let report = source.sample_tasks();
    let skip_tasks = shed.take_skip(limits::Part::Tasks);
    let skip_runtime = shed.take_skip(limits::Part::Runtime);
    let Some(mut r) = report else {
        return (Vec::new(), Vec::new());
    };
    let caps = shed.caps(limits::Caps::server(nr_cpus));
    let cut = limits::fit(&mut r, nr_cpus, &caps);
    if cut.tasks > 0 {
        metrics::counter!("fairplace_agent_capped_total", "part" => "tasks")
            .increment(cut.tasks as u64);
    }
    if cut.runtime > 0 {
        metrics::counter!("fairplace_agent_capped_total", "part" => "runtime")
            .increment(cut.runtime as u64);
    }
    for (skip, part) in [(skip_tasks, "tasks"), (skip_runtime, "runtime")] {
        if skip {
            metrics::counter!("fairplace_agent_parts_left_out_total", "part" => part).increment(1);
        }
    }
    let lists = if skip_tasks {
        // A full update without lists empties the server's; the next
        // update sends them all.
        sent.tasks = None;
        Vec::new()
    } else {
        let lists = task_lists(full, sent.tasks.as_deref(), &r.cpus);
        sent.tasks = Some(r.cpus);
        lists
    };
    (lists, if skip_runtime { Vec::new() } else { r.runtime })
}

/// Drops the task lists, then the runtime, from an update the server would
/// refuse as too big.
fn fit_to_server(u: &mut pb::Update, cfg: &StreamConfig, sent: &mut Sent) {
    let len = |u: &pb::Update| {
        prost::Message::encoded_len(&pb::AgentMessage {
            body: Some(Body::Update(u.clone())),
        })
    };
    if len(u) > cfg.max_message_bytes {
        tracing::warn!(node = %cfg.node_id, tasks = u.tasks.len(), "update too big for the server: sent without task lists");
        metrics::counter!("fairplace_agent_task_lists_dropped_total").increment(1);
        u.tasks.clear();
        // The server keeps its old lists; the next full update resends them.
        sent.tasks = None;
    }
    if len(u) > cfg.max_message_bytes {
        tracing::warn!(node = %cfg.node_id, runtime = u.runtime.len(), "update too big for the server: sent without runtime");
        u.runtime.clear();
    }
}

/// A channel to the server, with keepalive so a silently dropped
/// connection is noticed.
/// Over TLS the server must also prove it is a fairplace server
/// ([`fairplace_client::verified`]): the agent obeys what it says.
async fn connect(cfg: &StreamConfig, server: &str) -> Result<AgentServiceClient<Channel>, String> {
    let endpoint = |e: tonic::transport::Endpoint| {
        e.connect_timeout(Duration::from_secs(3))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(20))
            .keep_alive_while_idle(true)
    };
    let channel = if cfg.tls.enabled() {
        let plain = fairplace_client::TlsOptions::default().endpoint(server)?;
        fairplace_client::verified::connect(endpoint(plain), server, &cfg.tls, &cfg.trust_domain)
            .await
            .map_err(|e| format!("connect: {e}"))?
    } else {
        endpoint(cfg.tls.endpoint(server)?)
            .connect()
            .await
            .map_err(|e| format!("connect: {e}: {}", fairplace_client::source_chain(&e)))?
    };
    Ok(AgentServiceClient::new(channel)
        .max_decoding_message_size(16 << 20)
        .max_encoding_message_size(16 << 20))
}

/// Opens the stream with a Register and waits for its Ack.
/// (`source` is read before the first await: a reader need not be `Sync`.)
async fn register(
    client: &mut AgentServiceClient<Channel>,
    cfg: &StreamConfig,
    (topology, signal_source): (pb::Topology, pb::SignalSource),
    held_leases: Vec<pb::LeaseGrant>,
    tx: &mpsc::Sender<pb::AgentMessage>,
    rx: mpsc::Receiver<pb::AgentMessage>,
) -> Result<(Acks, usize), Failure> {
    let nr_cpus = topology.cpus.len();
    tx.send(pb::AgentMessage {
        body: Some(Body::Register(pb::Register {
            node_id: cfg.node_id.clone(),
            labels: cfg.labels.iter().cloned().collect(),
            topology: Some(topology),
            agent_version: env!("CARGO_PKG_VERSION").to_string(),
            signal_source: signal_source as i32,
            held_leases,
            ..Default::default()
        })),
    })
    .await
    .map_err(|e| e.to_string())?;
    let mut acks = client
        .report(ReceiverStream::new(rx))
        .await
        .map_err(|e| Failure::from_status("report", &e))?
        .into_inner();
    match acks.message().await {
        Ok(Some(_)) => Ok((acks, nr_cpus)),
        Ok(None) => Err("the server closed the stream at registration".into()),
        Err(s) => Err(Failure::from_status("registration refused", &s)),
    }
}

/// The shortest silence (no Ack) after which a server counts as gone.
pub const SILENT_SERVER: Duration = Duration::from_secs(3);

/// The trailer key with which a replica sends the agent to its node's
/// owner (the server's `service::route::OWNER_HEADER`).
pub const OWNER_HEADER: &str = "fairplace-owner";

/// Why a connection ended, and where the server said to go next.
#[derive(Debug)]
pub struct Failure {
    pub message: String,
    /// The node's owner (`host:port`), when a replica sent the agent there.
    pub redirect: Option<String>,
    /// A live server refused for now (UNAVAILABLE: the node is moving
    /// between replicas): try again soon, without growing the backoff.
    pub retry_soon: bool,
}

impl Failure {
    fn from_status(what: &str, s: &tonic::Status) -> Failure {
        let redirect = s
            .metadata()
            .get(OWNER_HEADER)
            .and_then(|v| v.to_str().ok())
            .filter(|a| !a.is_empty())
            .map(str::to_string);
        Failure {
            message: format!("{what}: {}", s.message()),
            redirect,
            retry_soon: s.code() == tonic::Code::Unavailable && !s.message().contains("transport"),
        }
    }
}

impl From<&str> for Failure {
    fn from(message: &str) -> Failure {
        message.to_string().into()
    }
}

impl From<String> for Failure {
    fn from(message: String) -> Failure {
        Failure {
            message,
            redirect: None,
            retry_soon: false,
        }
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// One Ack: a rejection makes the next update a full one without the
/// refused part.
fn on_ack(
    a: &pb::Ack,
    cfg: &StreamConfig,
    shed: &mut limits::Shedding,
    sent: &mut Sent,
    stats: &watch::Sender<StreamStats>,
) {
    if let Some(r) = &a.rejection {
        metrics::counter!("fairplace_agent_rejections_total", "reason" => r.reason.clone())
            .increment(1);
        stats.send_modify(|s| s.rejections += 1);
        match shed.rejected(&r.reason, &r.message) {
            Some(v) if v.first => tracing::warn!(
                node = %cfg.node_id, reason = %r.reason, message = %r.message, part = v.part.name(),
                "update rejected: the next update goes without this part and later ones cut it further \
                 (further rejections of it are logged at debug level)"
            ),
            Some(v) => {
                tracing::debug!(node = %cfg.node_id, reason = %r.reason, message = %r.message, part = v.part.name(), "update rejected")
            }
            None => {
                tracing::debug!(node = %cfg.node_id, reason = %r.reason, message = %r.message, "update rejected; resyncing")
            }
        }
        // The server kept its old state of those CPUs: a full snapshot
        // (without the refused part) puts both sides in step again.
        sent.need_full = true;
    } else {
        shed.applied();
    }
    if a.resync_required {
        sent.need_full = true;
    }
    stats.send_modify(|s| s.last_ack_seq = a.applied_seq);
}

/// One tick's update: a sample, its changes, its task parts, cut to fit.
fn build_update<S: Source>(
    cfg: &StreamConfig,
    source: &mut S,
    seq: &mut u64,
    shed: &mut limits::Shedding,
    sent: &mut Sent,
    nr_cpus: usize,
) -> pb::Update {
    let t0 = Instant::now();
    let now = source.sample();
    metrics::histogram!("fairplace_agent_read_duration_seconds").record(t0.elapsed().as_secs_f64());
    let (full, cpus) = cpu_changes(sent, now);
    let (tasks, runtime) = task_parts(source, shed, sent, full, nr_cpus);
    *seq += 1;
    let mut u = pb::Update {
        seq: *seq,
        full,
        cpus,
        node_id: cfg.node_id.clone(),
        tasks,
        runtime,
    };
    fit_to_server(&mut u, cfg, sent);
    u
}

/// Runs one connection to `server` until `stop` (Ok) or an error (to
/// reconnect, where the failure says if it names the node's owner).
pub(super) async fn run_once<S: Source>(
    cfg: &StreamConfig,
    server: &str,
    source: &mut S,
    seq: &mut u64,
    (shed, applier): (&mut limits::Shedding, &mut leases::Applier),
    stop: &mut watch::Receiver<bool>,
    stats: &watch::Sender<StreamStats>,
) -> Result<(), Failure> {
    let mut client = connect(cfg, server).await?;
    let (tx, rx) = mpsc::channel::<pb::AgentMessage>(8);
    let about = (source.topology(), source.signal_source());
    // The leases held are reported; the server answers with every live
    // lease of the node (pushed), and releases the ones it refuses.
    let held = applier.held_grants();
    let (mut acks, nr_cpus) = register(&mut client, cfg, about, held, &tx, rx).await?;
    stats.send_modify(|s| s.connects += 1);
    let mut sent = Sent {
        need_full: true,
        ..Default::default()
    };
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A server that stops answering (frozen, cut off behind a live TCP
    // connection) is left for another after this long without an Ack.
    let silence = (cfg.interval * 5).max(SILENT_SERVER);
    let mut last_ack = Instant::now();
    loop {
        tokio::select! {
            changed = stop.changed() => {
                // A dropped stop sender means stop too.
                if changed.is_err() || *stop.borrow() { return Ok(()); }
            }
            ack = acks.message() => match ack {
                Ok(Some(a)) if leases::is_push(&a) => {
                    last_ack = Instant::now();
                    for m in applier.on_push(&a) {
                        tx.send(m).await.map_err(|_| "the stream closed".to_string())?;
                    }
                }
                Ok(Some(a)) => {
                    last_ack = Instant::now();
                    on_ack(&a, cfg, shed, &mut sent, stats);
                }
                Ok(None) => return Err("the server closed the stream".to_string().into()),
                Err(s) => return Err(Failure::from_status("stream", &s)),
            },
            _ = tick.tick() => {
                if last_ack.elapsed() > silence {
                    return Err(format!(
                        "the server acknowledged nothing for {:.1} s; trying another",
                        last_ack.elapsed().as_secs_f64()
                    )
                    .into());
                }
                for m in applier.check_targets() {
                    tx.send(m).await.map_err(|_| "the stream closed".to_string())?;
                }
                let u = build_update(cfg, source, seq, shed, &mut sent, nr_cpus);
                let (full, n) = (u.full, u.cpus.len() as u64);
                let t1 = Instant::now();
                tokio::select! {
                    r = tx.send(pb::AgentMessage { body: Some(Body::Update(u)) }) => r.map_err(|_| "the stream closed".to_string())?,
                    _ = stop.changed() => return Ok(()),
                }
                metrics::histogram!("fairplace_agent_send_duration_seconds").record(t1.elapsed().as_secs_f64());
                metrics::counter!("fairplace_agent_updates_sent_total", "kind" => if full { "full" } else { "delta" }).increment(1);
                stats.send_modify(|s| { s.updates_sent += 1; s.cpus_sent += n; });
                sent.need_full = false;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpu(util: i64, nr: u32) -> pb::CpuState {
        pb::CpuState {
            nr_running: nr,
            util_avg: util,
            load_avg: util,
            runnable_avg: util,
            util_est: util,
            online: true,
            ..Default::default()
        }
    }

    #[test]
    fn small_pelt_drift_is_not_resent_but_adds_up_against_the_last_sent() {
        let mut sent = Sent {
            need_full: true,
            ..Default::default()
        };
        let (full, c) = cpu_changes(&mut sent, vec![cpu(500, 1), cpu(0, 0)]);
        assert!(full && c.len() == 2);
        sent.need_full = false;
        // 500 -> 510: within max(16, 500/32 = 15) = 16.
        let (full, c) = cpu_changes(&mut sent, vec![cpu(510, 1), cpu(3, 0)]);
        assert!(!full && c.is_empty());
        // 500 -> 520 (two small steps from the sample, 20 from the sent).
        let (_, c) = cpu_changes(&mut sent, vec![cpu(520, 1), cpu(3, 0)]);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].util_avg, 520);
        // A count always goes, however small the PELT move.
        let (_, c) = cpu_changes(&mut sent, vec![cpu(520, 1), cpu(3, 1)]);
        assert_eq!(c.len(), 1);
        assert_eq!(c[0].nr_running, 1);
        // An idle stamp is a change too.
        let mut s = cpu(520, 1);
        s.idle_stamp = 5;
        assert!(changed(&s, &cpu(520, 1)));
    }

    #[test]
    fn the_threshold_grows_with_the_value() {
        assert_eq!(pelt_threshold(0), 16);
        assert_eq!(pelt_threshold(1024), 32);
        assert_eq!(pelt_threshold(64 * 1024), 2048);
    }
}
