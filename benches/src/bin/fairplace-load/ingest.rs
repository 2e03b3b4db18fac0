//! `fairplace-load ingest`: many nodes stream deltas of all their CPUs as
//! fast as the server acknowledges them, a few updates in flight per node;
//! applied CPU updates per second.
//!
//! Why: the agents' reports are the server's other load besides the
//! placement calls; this is the rate at which it takes in the state it
//! decides from, every CPU changing in every delta.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fairplace_benches::load::states;

use crate::shared::{Launch, NodeStream, Server, channels, register_nodes, update};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    #[arg(long, default_value_t = 128)]
    pub cpus: u32,
    #[arg(long, default_value_t = 8)]
    pub seconds: u64,
    #[arg(long, default_value_t = 16)]
    pub connections: usize,
    /// Updates in flight per node.
    #[arg(long, default_value_t = 2)]
    pub window: usize,
}

/// What the nodes' streams count, and the flag that stops them.
#[derive(Default)]
struct Tally {
    applied: AtomicU64,
    rejected: AtomicU64,
    stop: AtomicBool,
}

/// Registers the nodes, lets them stream for `--seconds` and prints the
/// rate.
pub async fn run(server: Server, _launch: &Launch, o: Opts) {
    let Opts {
        nodes,
        cpus,
        seconds,
        connections,
        window,
    } = o;
    let chans = channels(&server.grpc, connections).await;
    let streams = register_nodes(&chans, "ingest", nodes, cpus).await;
    println!(
        "# fairplace-load ingest: {nodes} nodes x {cpus} CPUs over {connections} connections, window {window}, {seconds} s"
    );
    let tally = Arc::new(Tally::default());
    let mut tasks = Vec::new();
    for (i, s) in streams.into_iter().enumerate() {
        let tally = Arc::clone(&tally);
        tasks.push(tokio::spawn(stream_deltas(s, i, cpus, window, tally)));
    }
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let n = tally.applied.load(Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    tally.stop.store(true, Ordering::Relaxed);
    println!(
        "ingest: {:.0} CPU updates/s ({:.0} updates/s of {cpus} CPUs), rejected {}",
        n as f64 / secs,
        n as f64 / secs / cpus as f64,
        tally.rejected.load(Ordering::Relaxed)
    );
    for t in tasks {
        t.abort();
    }
}

/// Node `i`'s stream: deltas with `window` in flight, counted as they are
/// acknowledged, until the stop flag.
async fn stream_deltas(mut s: NodeStream, i: usize, cpus: u32, window: usize, tally: Arc<Tally>) {
    // Two alternating states, so every delta changes every CPU.
    let a = states(cpus, i as u64 + 11);
    let b = states(cpus, i as u64 + 12);
    let mut seq = 1u64;
    let mut in_flight = 0;
    while !tally.stop.load(Ordering::Relaxed) {
        while in_flight < window {
            seq += 1;
            let body = if seq.is_multiple_of(2) {
                a.clone()
            } else {
                b.clone()
            };
            if s.tx.send(update(seq, false, body)).await.is_err() {
                return;
            }
            in_flight += 1;
        }
        match s.acks.message().await {
            Ok(Some(ack)) => {
                in_flight -= 1;
                if ack.rejection.is_some() {
                    tally.rejected.fetch_add(1, Ordering::Relaxed);
                } else {
                    tally.applied.fetch_add(cpus as u64, Ordering::Relaxed);
                }
            }
            _ => return,
        }
    }
}
