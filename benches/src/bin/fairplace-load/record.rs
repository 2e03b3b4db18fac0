//! `fairplace-load record`: what a recording costs. Two servers of this
//! build run side by side, one with `--record`; PickCpu throughput (the
//! raw caller, so the generator's own cost stays small) and report ingest
//! (nodes streaming deltas of every CPU) are measured on each in
//! alternating one-second slices, so a change in the machine's speed
//! weighs on both alike; then what the recording wrote per event.
//!
//! Why: a recording is meant to be left on (docs/replay.md); its price is
//! the recorded server's rate over the other's.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fairplace_benches::load::{states, wakeup_on_load};
use fairplace_client::pb;

use crate::shared::{
    Launch, NodeStream, Server, channels, http_body, load_node, register_nodes, run_phase, update,
};
use crate::{cost, wire};

#[derive(clap::Args)]
pub struct Opts {
    /// Slices per phase and server (one second each).
    #[arg(long, default_value_t = 10)]
    pub seconds: u64,
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Concurrent PickCpu callers.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Nodes streaming in the ingest phase.
    #[arg(long, default_value_t = 200)]
    pub nodes: usize,
    #[arg(long, default_value_t = 128)]
    pub cpus: u32,
    /// Updates in flight per node.
    #[arg(long, default_value_t = 2)]
    pub window: usize,
    /// Share of a node's CPUs each delta carries (the agent sends only
    /// those that moved; its simulator's default is 10); 100: every CPU
    /// changes in every delta, the ingest benchmark's worst case.
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub churn_pct: u32,
}

/// The two servers' slices, `[without, with]`: events, seconds and the
/// server's CPU time in all, and each round's rate ratio (with / without,
/// from the round's two adjacent slices: the machine's drift cancels).
#[derive(Default)]
struct Rates {
    sums: [(u64, f64, u64); 2],
    round: [f64; 2],
    ratios: Vec<f64>,
}

impl Rates {
    fn add(&mut self, k: usize, n: u64, secs: f64, cpu_ns: u64) {
        self.sums[k].0 += n;
        self.sums[k].1 += secs;
        self.sums[k].2 += cpu_ns;
        self.round[k] = n as f64 / secs.max(1e-9);
    }

    /// Closes a round: its ratio of rates.
    fn end_round(&mut self) {
        self.ratios.push(self.round[1] / self.round[0].max(1e-9));
    }

    fn rate(&self, k: usize) -> f64 {
        self.sums[k].0 as f64 / self.sums[k].1.max(1e-9)
    }

    /// The server's CPU per event, µs.
    fn cpu_us(&self, k: usize) -> f64 {
        self.sums[k].2 as f64 / 1e3 / self.sums[k].0.max(1) as f64
    }

    /// The median of the rounds' ratios.
    fn median_ratio(&self) -> f64 {
        let mut v = self.ratios.clone();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    }

    fn line(&self, what: &str, unit: &str) -> String {
        format!(
            "{what}: {:.0} {unit}/s without, {:.0}/s recorded: median round ratio {:.3} (of {} rounds; whole-run ratio {:.3}); server CPU per {unit} {:.3} -> {:.3} µs ({:+.1} %)",
            self.rate(0),
            self.rate(1),
            self.median_ratio(),
            self.ratios.len(),
            self.rate(1) / self.rate(0),
            self.cpu_us(0),
            self.cpu_us(1),
            100.0 * (self.cpu_us(1) / self.cpu_us(0) - 1.0)
        )
    }
}

pub async fn run(server: Server, launch: &Launch, o: Opts) {
    let dir = std::env::temp_dir().join(format!("fairplace-load-record-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let recorded = Server::start_with(
        &launch.cpus,
        launch.threads,
        &[
            "--record".into(),
            dir.display().to_string(),
            "--record-max-bytes".into(),
            (1u64 << 30).to_string(),
        ],
    );
    let servers = [&server, &recorded];
    println!(
        "# fairplace-load record: a server without a recording and one with --record, alternating 1 s slices, {} slices each; PickCpu: {} callers over {} connections (raw caller); ingest: {} nodes x {} CPUs, {} % of them in each delta, window {}",
        o.seconds, o.concurrency, o.connections, o.nodes, o.cpus, o.churn_pct, o.window
    );
    let picks = pick_phase(servers, &o).await;
    let before_ingest = recording_bytes(&dir);
    let ingest = ingest_phase(servers, &o).await;
    let after = recording_bytes(&dir);
    println!("{}", picks.line("pick_cpu", "call"));
    println!("{}", ingest.line("ingest", "CPU update"));
    let decisions = picks.sums[1].0.max(1);
    let updates = ingest.sums[1].0.max(1);
    println!(
        "recording: {:.1} MB in all; {:.1} bytes per PickCpu (with its node's claims: none), {:.2} bytes per CPU update",
        after as f64 / 1e6,
        before_ingest as f64 / decisions as f64,
        (after - before_ingest) as f64 / updates as f64
    );
    let metrics = http_body(&format!("http://{}/metrics", recorded.metrics));
    let series = |name: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(name))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    println!(
        "recorded server: {} entries written, {} events dropped",
        series("fairplace_record_entries_total"),
        series("fairplace_record_dropped_total")
    );
    println!(
        "record: pick_cpu ratio {:.3}, ingest ratio {:.3} (medians of the rounds)",
        picks.median_ratio(),
        ingest.median_ratio()
    );
    drop(recorded);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The recording's bytes on disk now.
fn recording_bytes(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| {
            d.filter_map(|e| e.ok()?.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

async fn pick_phase(servers: [&Server; 2], o: &Opts) -> Rates {
    let mut nodes = Vec::new();
    let mut callers = Vec::new();
    for s in servers {
        nodes.push(load_node(s.node_channel().await).await);
        let mut c = Vec::new();
        for _ in 0..o.connections {
            c.push(wire::Caller::connect(&s.grpc, None).await);
        }
        callers.push(c);
    }
    let framed: Arc<Vec<wire::Bytes>> = Arc::new(
        (0..o.concurrency)
            .map(|i| wire::frame(&wakeup_on_load(i)))
            .collect(),
    );
    let mut r = Rates::default();
    for round in 0..o.seconds.max(1) {
        for k in [round as usize % 2, 1 - round as usize % 2] {
            let framed = Arc::clone(&framed);
            let before = cost::read(servers[k].child.id());
            let (all, errors, secs) = run_phase(
                &callers[k],
                o.concurrency,
                1,
                move |mut c: wire::Caller, i| {
                    let req = framed[i].clone();
                    async move { c.pick_cpu(req, 128).await }
                },
            )
            .await;
            assert_eq!(errors, 0, "PickCpu failed");
            let spent = cost::read(servers[k].child.id()) - before;
            r.add(k, all.len(), secs, spent.cpu_ns);
        }
        r.end_round();
    }
    drop(nodes);
    r
}

async fn ingest_phase(servers: [&Server; 2], o: &Opts) -> Rates {
    // Each node's stream with the sequence number it last sent.
    let mut streams: Vec<Vec<(NodeStream, u64)>> = Vec::new();
    for s in servers {
        let chans = channels(&s.grpc, o.connections).await;
        let nodes = register_nodes(&chans, "ingest", o.nodes, o.cpus).await;
        streams.push(nodes.into_iter().map(|n| (n, 1)).collect());
    }
    let mut r = Rates::default();
    for round in 0..o.seconds.max(1) {
        for k in [round as usize % 2, 1 - round as usize % 2] {
            let stop = Arc::new(AtomicBool::new(false));
            let applied = Arc::new(AtomicU64::new(0));
            let before = cost::read(servers[k].child.id());
            let mut tasks = Vec::new();
            for (i, (s, seq)) in std::mem::take(&mut streams[k]).into_iter().enumerate() {
                let (stop, applied) = (Arc::clone(&stop), Arc::clone(&applied));
                let shape = Shape {
                    cpus: o.cpus,
                    window: o.window,
                    per_delta: (o.cpus * o.churn_pct / 100).max(1),
                };
                tasks.push(tokio::spawn(stream_slice(s, i, shape, seq, stop, applied)));
            }
            let t0 = Instant::now();
            tokio::time::sleep(Duration::from_secs(1)).await;
            stop.store(true, Ordering::Relaxed);
            let secs = t0.elapsed().as_secs_f64();
            let n = applied.load(Ordering::Relaxed);
            for t in tasks {
                streams[k].push(t.await.unwrap());
            }
            let spent = cost::read(servers[k].child.id()) - before;
            r.add(k, n, secs, spent.cpu_ns);
        }
        r.end_round();
    }
    r
}

/// What each node streams.
#[derive(Clone, Copy)]
struct Shape {
    cpus: u32,
    window: usize,
    /// CPUs in each delta.
    per_delta: u32,
}

/// Delta `seq` of a node: `per_delta` CPUs, the next ones round the node,
/// each with the other of its two states than at its last visit, so every
/// CPU sent has changed.
fn delta(a: &[pb::CpuState], b: &[pb::CpuState], shape: Shape, seq: u64) -> Vec<pb::CpuState> {
    let (n, k) = (shape.cpus as u64, shape.per_delta as u64);
    (0..k)
        .map(|j| {
            let visit = seq * k + j;
            let cpu = (visit % n) as usize;
            if (visit / n).is_multiple_of(2) {
                a[cpu]
            } else {
                b[cpu]
            }
        })
        .collect()
}

/// One node's deltas for a slice, `window` in flight; its in-flight updates
/// are drained (not counted) before the stream is handed back with the
/// last sequence number.
async fn stream_slice(
    mut s: NodeStream,
    i: usize,
    shape: Shape,
    mut seq: u64,
    stop: Arc<AtomicBool>,
    applied: Arc<AtomicU64>,
) -> (NodeStream, u64) {
    let a = states(shape.cpus, i as u64 + 11);
    let b = states(shape.cpus, i as u64 + 12);
    let mut in_flight = 0;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        while !stopping && in_flight < shape.window {
            seq += 1;
            let body = delta(&a, &b, shape, seq);
            if s.tx.send(update(seq, false, body)).await.is_err() {
                return (s, seq);
            }
            in_flight += 1;
        }
        if in_flight == 0 {
            return (s, seq);
        }
        match s.acks.message().await {
            Ok(Some(ack)) => {
                in_flight -= 1;
                if !stopping && ack.rejection.is_none() {
                    applied.fetch_add(shape.per_delta as u64, Ordering::Relaxed);
                }
            }
            _ => return (s, seq),
        }
    }
}
