//! `fairplace-load leases`: AllocateCpus followed by its ReleaseCpus (one
//! measured operation: a lease's whole life, two commits on a durable
//! server) against the no-op Ping, on one 128-CPU node (7 busy CPUs), with
//! the leases in memory, committed to redb under a fresh --state-dir, and
//! in etcd (one replica on a one-member etcd), at each concurrency.
//!
//! Why: what keeping a lease durable costs against keeping it in memory,
//! as a share of Ping so the machine's speed cancels out; with
//! `--baseline`, another build's server runs every phase too, interleaved
//! with this build's, so the two compare within one run.

use std::time::Duration;

use fairplace_client::Client;

use crate::etcd::{self, Etcd};
use crate::shared::{Launch, Server, allocate_release, clients, load_node, print_phase, run_phase};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 8)]
    pub seconds: u64,
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Concurrent callers, one measurement each (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 64])]
    pub concurrency: Vec<usize>,
    /// CPUs per lease (the node has 128: count x callers must fit).
    #[arg(long, default_value_t = 1)]
    pub count: u32,
    /// The allocation policy.
    #[arg(long, default_value = "kernel")]
    pub policy: String,
    /// Another build's `fairplace-server` (an earlier version): every
    /// phase runs on it too, interleaved with this build's, and the
    /// last lines give this build's throughput over its.
    #[arg(long)]
    pub baseline: Option<std::path::PathBuf>,
}

/// Runs every store's phases on servers of its own (not `server`).
pub async fn run(server: Server, launch: &Launch, o: Opts) {
    drop(server);
    leases(
        (&launch.cpus, launch.threads),
        (o.seconds, o.connections),
        &o.concurrency,
        (o.count, o.policy),
        o.baseline,
    )
    .await
}

/// `fairplace-load leases`: a lease's whole life with the leases in
/// memory, in redb and in etcd (one replica on a one-member etcd), with
/// this build's server and, given `baseline`, another build's, phase by
/// phase in one run.
async fn leases(
    (cpus, threads): (&str, usize),
    (seconds, connections): (u64, usize),
    concurrency: &[usize],
    (count, policy): (u32, String),
    baseline: Option<std::path::PathBuf>,
) {
    println!(
        "# fairplace-load leases: {connections} connections, {seconds} s per phase, count {count}, policy {policy}, callers {concurrency:?}"
    );
    let this = std::env::current_exe()
        .expect("own path")
        .with_file_name("fairplace-server");
    let mut builds = vec![("this", this)];
    if let Some(b) = baseline {
        builds.insert(0, ("baseline", b));
    }
    // (store, build, callers) -> (ping, allocate+release) per second.
    let mut table = Vec::new();
    for store in ["memory", "redb", "etcd"] {
        for (build, bin) in &builds {
            let (server, _etcd) = lease_server(store, bin, cpus, threads);
            let _reporter = load_node(server.node_channel().await).await;
            let clients = clients(&server, connections).await;
            for &callers in concurrency {
                println!("## lease store {store}, {build} build, {callers} callers");
                let (ping, life) = lease_life(&clients, callers, seconds, (count, &policy)).await;
                table.push((store, *build, callers, ping, life));
            }
        }
    }
    print_lease_table(&table, concurrency, builds.len() > 1);
}

/// A server keeping its leases in `store`, from the binary `bin`, with its
/// etcd when it needs one.
fn lease_server(
    store: &str,
    bin: &std::path::Path,
    cpus: &str,
    threads: usize,
) -> (Server, Option<Etcd>) {
    match store {
        "memory" => (
            Server::start_bin(
                bin,
                cpus,
                threads,
                &["--lease-store".into(), "memory".into()],
            ),
            None,
        ),
        "etcd" => {
            let e = etcd::etcd();
            let s = etcd::replica_bin(bin, cpus, threads, &e, "r0");
            std::thread::sleep(Duration::from_millis(500));
            (s, Some(e))
        }
        _ => (Server::start_bin(bin, cpus, threads, &[]), None),
    }
}

/// Ping, then a lease's life, `callers` at once: both per second.
async fn lease_life(
    clients: &[Client],
    callers: usize,
    seconds: u64,
    (count, policy): (u32, &str),
) -> (f64, f64) {
    let (all, errors, secs) = run_phase(clients, callers, seconds, |c, _| async move {
        c.ping().await.is_ok()
    })
    .await;
    let ping = print_phase("ping", &all, errors, secs);
    let policy = policy.to_string();
    let (all, errors, secs) = run_phase(clients, callers, seconds, move |c, _| {
        let policy = policy.clone();
        async move { allocate_release(&c, count, policy).await }
    })
    .await;
    (ping, print_phase("allocate+release", &all, errors, secs))
}

type LeaseRow<'a> = (&'a str, &'a str, usize, f64, f64);

fn print_lease_table(table: &[LeaseRow<'_>], concurrency: &[usize], compared: bool) {
    println!("# same run: allocate+release per second, and as a share of ping");
    let row = |st: &str, b: &str, callers: usize| {
        table
            .iter()
            .find(|r| r.0 == st && r.1 == b && r.2 == callers)
            .map_or((0.0, 0.0), |r| (r.3, r.4))
    };
    for &callers in concurrency {
        let line: Vec<String> = ["memory", "redb", "etcd"]
            .iter()
            .map(|st| {
                let (p, l) = row(st, "this", callers);
                format!("{st} {l:.0}/s ({:.2} of ping)", l / p)
            })
            .collect();
        let (mem, dur) = (
            row("memory", "this", callers).1,
            row("redb", "this", callers).1,
        );
        println!(
            "{callers} callers: {}; redb / memory {:.2}",
            line.join(", "),
            dur / mem
        );
    }
    if compared {
        println!("# this build over the baseline, same run (allocate+release per second)");
        for &callers in concurrency {
            for st in ["memory", "redb", "etcd"] {
                let (b, t) = (row(st, "baseline", callers).1, row(st, "this", callers).1);
                println!(
                    "{callers} callers, {st}: baseline {b:.0}/s, this {t:.0}/s, this / baseline {:.2}",
                    t / b
                );
            }
        }
    }
}
