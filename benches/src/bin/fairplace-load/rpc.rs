//! `fairplace-load rpc`: PickCpu against a 128-CPU node and, in the same
//! run, the no-op AdminService.Ping, with many concurrent callers over
//! several connections: throughput, p50/p99/p99.9 and what a call cost the
//! server and the generator; then PickCpus, one stream per connection.
//!
//! Why: Ping is the framework's own limit, so PickCpu / Ping is the share
//! of a call's cost that is the decision rather than gRPC. The two unary
//! phases alternate in one-second slices, so a change in the machine's
//! speed weighs on both alike; `--transport both` measures plaintext and
//! then mutual TLS in one run, and `--caller raw` (`wire.rs`) keeps the
//! generator's own cost out of the way.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use fairplace_client::{Client, pb};
use hdrhistogram::Histogram;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use fairplace_benches::load::wakeup_on_load;

use crate::shared::{
    Launch, Server, clients, load_node, measure, pct, ping_or_pick, print_phase, run_phase,
};
use crate::{cost, wire};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 8)]
    pub seconds: u64,
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Concurrent callers in all.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Claim the chosen CPU (a write per call).
    #[arg(long)]
    pub claim: bool,
    /// plain, mtls, or both (plaintext, then mutual TLS, same run).
    #[arg(long, default_value = "plain", value_parser = ["plain", "mtls", "both"])]
    pub transport: String,
    /// Who makes the unary calls: `raw`, pre-framed requests on hyper's
    /// HTTP/2 client (the server's own cost, the generator out of the
    /// way), or `client`, the fairplace client library (what an
    /// orchestrator using it sees; the generator then costs about as
    /// much per call as the server and shares the bottleneck).
    #[arg(long, default_value = "raw", value_parser = ["raw", "client"])]
    pub caller: String,
    /// How many different PickCpu requests the callers send (caller i
    /// sends request i mod N, each from another CPU of the node); 0:
    /// one per caller. Fewer requests decide from fewer CPUs, so their
    /// data stays in the server's caches: the difference shows what
    /// the decisions' spread over the node costs.
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
}

/// Runs the phases on `server` (plaintext), then, as `--transport` asks,
/// on a server of its own over mutual TLS, and compares the two.
pub async fn run(server: Server, launch: &Launch, o: Opts) {
    let shape = RpcShape {
        seconds: o.seconds,
        connections: o.connections,
        concurrency: o.concurrency,
        claim: o.claim,
        raw: o.caller == "raw",
        requests: o.requests,
    };
    let mut runs = vec![];
    if o.transport != "mtls" {
        runs.push(("plaintext", rpc(&server, &shape).await));
    }
    drop(server);
    if o.transport != "plain" {
        let tls = Server::start_mtls(&launch.cpus, launch.threads);
        runs.push(("mutual TLS", rpc(&tls, &shape).await));
    }
    if let [(_, plain), (_, tls)] = runs.as_slice() {
        print_same_run(plain, tls);
    }
}

/// The last lines of `--transport both`: mutual TLS against plaintext.
fn print_same_run(plain: &RpcResult, tls: &RpcResult) {
    println!("# same run: mutual TLS / plaintext");
    println!(
        "ping throughput {:.2}, pick_cpu throughput {:.2}, pick_cpu/ping over mutual TLS {:.2} (plaintext {:.2}); p50 ping {:.1} -> {:.1} µs, pick_cpu {:.1} -> {:.1} µs",
        tls.ping.0 / plain.ping.0,
        tls.pick.0 / plain.pick.0,
        tls.pick.0 / tls.ping.0,
        plain.pick.0 / plain.ping.0,
        plain.ping.1,
        tls.ping.1,
        plain.pick.1,
        tls.pick.1,
    );
    println!(
        "pick_cpus/pick_cpu over mutual TLS {:.2} (plaintext {:.2})",
        tls.stream.0 / tls.pick.0,
        plain.stream.0 / plain.pick.0,
    );
}

/// Throughput (req/s) and p50 (µs) of Ping and PickCpu.
struct RpcResult {
    ping: (f64, f64),
    pick: (f64, f64),
    /// PickCpus: one stream per connection, as many requests in flight.
    stream: (f64, f64),
}

/// What an `rpc` run does.
struct RpcShape {
    seconds: u64,
    connections: usize,
    concurrency: usize,
    claim: bool,
    /// Unary calls from [`wire::Caller`], not the client library.
    raw: bool,
    /// Different requests sent (0: one per caller).
    requests: usize,
}

/// The unary phases, in the order of their slices' sums.
const PHASES: [&str; 2] = ["ping", "pick_cpu"];

/// Who makes the unary calls, and what they send: the raw callers (with
/// `--caller raw`, else none) or the clients, and caller i's request,
/// framed once (the raw caller sends it as is).
struct Calls {
    callers: Vec<wire::Caller>,
    clients: Vec<Client>,
    requests: Arc<Vec<pb::PickCpuRequest>>,
    framed: Arc<Vec<wire::Bytes>>,
}

/// The unary phases' sums over their slices, by phase: latencies,
/// failures and seconds, and what they cost the server and the generator.
struct Unary {
    acc: Vec<(Histogram<u64>, u64, f64)>,
    spent: [cost::Cost; 2],
    own: [cost::Cost; 2],
}

/// One run on `server`: the unary phases, then the stream phase.
async fn rpc(server: &Server, shape: &RpcShape) -> RpcResult {
    let _reporter = load_node(server.node_channel().await).await;
    let calls = calls(server, shape).await;
    print_header(server, shape);
    let unary = alternate(server, shape, &calls).await;
    let results = unary.report();
    let (all, errors, secs) = stream_phase(
        &calls.clients,
        shape.concurrency,
        shape.seconds,
        shape.claim,
    )
    .await;
    let rps = print_phase("pick_cpus (stream)", &all, errors, secs);
    let stream = (rps, pct(&all, 0.5));
    println!(
        "pick_cpus / pick_cpu throughput: {:.2}; pick_cpus / ping: {:.2}",
        stream.0 / results[1].0,
        stream.0 / results[0].0
    );
    RpcResult {
        ping: results[0],
        pick: results[1],
        stream,
    }
}

/// The clients, the raw callers when they make the calls, and the
/// requests.
async fn calls(server: &Server, shape: &RpcShape) -> Calls {
    let RpcShape {
        connections,
        concurrency,
        claim,
        raw,
        requests: distinct,
        ..
    } = *shape;
    let clients = clients(server, connections).await;
    let mut callers = Vec::new();
    if raw {
        let tls = server.tls.as_ref().map(|(_, orch, _)| orch);
        for _ in 0..connections {
            callers.push(wire::Caller::connect(&server.grpc, tls).await);
        }
    }
    // Caller i's request, framed once (the raw caller sends it as is).
    let requests: Arc<Vec<pb::PickCpuRequest>> = Arc::new(
        (0..concurrency)
            .map(|i| pb::PickCpuRequest {
                claim,
                ..wakeup_on_load(if distinct > 0 { i % distinct } else { i })
            })
            .collect(),
    );
    let framed: Arc<Vec<wire::Bytes>> = Arc::new(requests.iter().map(wire::frame).collect());
    Calls {
        callers,
        clients,
        requests,
        framed,
    }
}

/// The run's first line: its transport, caller and shape.
fn print_header(server: &Server, shape: &RpcShape) {
    let RpcShape {
        seconds,
        connections,
        concurrency,
        raw,
        requests: distinct,
        ..
    } = *shape;
    println!(
        "# fairplace-load rpc ({}, {}): {connections} connections, {concurrency} callers, {} different PickCpu requests, {seconds} s per phase (ping and pick_cpu in alternating 1 s slices)",
        if server.tls.is_some() {
            "mutual TLS"
        } else {
            "plaintext"
        },
        if raw {
            "raw HTTP/2 caller"
        } else {
            "client library"
        },
        if distinct > 0 {
            distinct.min(concurrency)
        } else {
            concurrency
        }
    );
}

/// The unary phases, alternating in one-second slices (ping first in even
/// rounds, PickCpu first in odd ones), so a change in the machine's speed
/// during the run (a VM's neighbours) weighs on both alike.
async fn alternate(server: &Server, shape: &RpcShape, calls: &Calls) -> Unary {
    let mut u = Unary {
        acc: PHASES
            .iter()
            .map(|_| {
                (
                    Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap(),
                    0,
                    0.0,
                )
            })
            .collect(),
        spent: [cost::Cost::default(); 2],
        own: [cost::Cost::default(); 2],
    };
    for round in 0..shape.seconds.max(1) {
        for k in [round as usize % 2, 1 - round as usize % 2] {
            let before = cost::read(server.child.id());
            let before_own = cost::read(std::process::id());
            let (all, errors, secs) = slice(calls, shape, k).await;
            u.spent[k] += cost::read(server.child.id()) - before;
            u.own[k] += cost::read(std::process::id()) - before_own;
            u.acc[k].0.add(&all).unwrap();
            u.acc[k].1 += errors;
            u.acc[k].2 += secs;
        }
    }
    u
}

/// One second of phase `k`, from the raw callers or the client library.
async fn slice(calls: &Calls, shape: &RpcShape, k: usize) -> (Histogram<u64>, u64, f64) {
    let ping = PHASES[k] == "ping";
    if shape.raw {
        let framed = Arc::clone(&calls.framed);
        run_phase(
            &calls.callers,
            shape.concurrency,
            1,
            move |mut c: wire::Caller, i| {
                let req = framed[i].clone();
                async move {
                    if ping {
                        c.ping().await
                    } else {
                        c.pick_cpu(req, 128).await
                    }
                }
            },
        )
        .await
    } else {
        let requests = Arc::clone(&calls.requests);
        run_phase(&calls.clients, shape.concurrency, 1, move |c, i| {
            ping_or_pick(c, PHASES[k], requests[i].clone())
        })
        .await
    }
}

impl Unary {
    /// Prints each phase's line, their ratio and what a call cost each
    /// side; returns each phase's throughput and p50.
    fn report(&self) -> Vec<(f64, f64)> {
        let mut results = Vec::new();
        for (phase, (all, errors, secs)) in PHASES.iter().zip(&self.acc) {
            let rps = print_phase(phase, all, *errors, *secs);
            results.push((rps, pct(all, 0.5)));
        }
        let ratio = results[1].0 / results[0].0;
        println!("pick_cpu / ping throughput: {ratio:.2}");
        // What each call cost each side: the server's CPU per call is its own
        // measure of the ratio, apart from the generator's pace.
        for (k, phase) in PHASES.iter().enumerate() {
            let n = self.acc[k].0.len();
            println!("{}", cost::per_call(phase, "server", self.spent[k], n));
            println!("{}", cost::per_call(phase, "generator", self.own[k], n));
        }
        let per_call = |k: usize| self.spent[k].cpu_ns as f64 / self.acc[k].0.len().max(1) as f64;
        println!(
            "server CPU per call, ping / pick_cpu: {:.2}",
            per_call(0) / per_call(1)
        );
        results
    }
}

/// PickCpus: one stream per client connection, `concurrency` requests in
/// flight in all (as the unary phases have callers), each answer's
/// latency from its request's send.
async fn stream_phase(
    clients: &[Client],
    concurrency: usize,
    seconds: u64,
    claim: bool,
) -> (Histogram<u64>, u64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let window = (concurrency / clients.len()).max(1);
    let mut tasks = Vec::new();
    for (k, c) in clients.iter().enumerate() {
        let (c, stop, stride) = (c.clone(), Arc::clone(&stop), clients.len());
        tasks.push(tokio::spawn(async move {
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
            let mut errors = 0u64;
            let (tx, rx) = mpsc::channel(window);
            let Ok(mut answers) = c.pick_cpus_stream(ReceiverStream::new(rx)).await else {
                return (h, 1);
            };
            let mut sent = std::collections::VecDeque::with_capacity(window);
            let mut i = k;
            let next = |i: &mut usize| {
                *i += stride;
                pb::PickCpuRequest {
                    claim,
                    ..wakeup_on_load(*i)
                }
            };
            for _ in 0..window {
                let _ = tx.send(next(&mut i)).await;
                sent.push_back(Instant::now());
            }
            while let Ok(Some(a)) = answers.message().await {
                let t0 = sent.pop_front().expect("an answer per request");
                match a.result {
                    Some(pb::pick_cpus_answer::Result::Ok(_)) => {
                        h.record(t0.elapsed().as_nanos() as u64).unwrap()
                    }
                    _ => errors += 1,
                }
                if stop.load(Ordering::Relaxed) {
                    if sent.is_empty() {
                        break;
                    }
                    continue;
                }
                let _ = tx.send(next(&mut i)).await;
                sent.push_back(Instant::now());
            }
            (h, errors)
        }));
    }
    measure(tasks, &stop, seconds).await
}
