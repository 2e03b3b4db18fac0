//! Load generator for the fairplace service, on loopback only.
//!
//! Starts the release `fairplace-server` next to this binary on a free port,
//! then one of:
//! - `rpc`: PickCpu against a 128-CPU node, and in the same run the no-op
//!   AdminService.Ping (the framework's own limit), with many concurrent
//!   callers over several connections; throughput and p50/p99/p99.9. The
//!   unary calls come from a raw HTTP/2 caller (`wire.rs`: pre-framed
//!   requests, so the generator costs little and the server is the
//!   bottleneck), or with `--caller client` from the client library. With
//!   `--transport mtls` over mutual TLS (a PKI made here, an orchestrator
//!   certificate), with `both` plaintext then mutual TLS in one run.
//! - `ingest`: many nodes stream deltas as fast as the server acks them;
//!   applied CPU updates per second.
//! - `memory`: registers many nodes with a full snapshot each and reads the
//!   server's resident memory.
//! - `cache`: a 512-CPU node with 8 LLCs reports a 16-thread process's
//!   runtime on one LLC; task_cache_work runs with the full scan, then with
//!   SC_VISIT; the server's own `fairplace_cache_scan_cpus` histogram gives
//!   the CPUs each pass read.
//! - `cluster`: 10 zones x 20 racks x 50 nodes of 128 CPUs registered over
//!   agent streams, then PickCpu with no node (cluster placement) and the
//!   no-op Ping over gRPC, and in the same run the naive recomputation of
//!   the same cluster in this process.
//!
//! - `attack`: Ping and PickCpu latency on an idle server, then again while
//!   hostile clients run: callers flooding Decide with a 4,096-CPU topology,
//!   idle TCP connections that never send a preface, and calls to made-up
//!   method names; with the series count of /metrics before and after.
//! - `flood`: memory and probe latency while one peer holds tens of
//!   thousands of streams, with the server's default limits and lifted.
//! - `leases`: a lease's life (AllocateCpus, then ReleaseCpus) against
//!   Ping, with the leases in memory, in redb and in etcd.
//! - `replicas`: PickCpu at a node's owner, forwarded by another replica
//!   and on a single server, and a lease's life in etcd against redb.
//! - `scale`: 3 replicas on a 3-member etcd with 30,000 nodes, routing
//!   clients: node PickCpu against one server with the same nodes, the
//!   share forwarded, cluster picks and durable allocations per second,
//!   memory per replica.
//! - `record`: PickCpu throughput and report ingest on a server recording
//!   (`--record`) against one that is not, same run, alternating slices;
//!   what the recording wrote per event.
//!
//! Every loop is bounded in time and count and stops by itself.
//!
//! Each subcommand lives in its own module (`fairplace-load/<name>.rs`,
//! its flags with it); `shared.rs` starts the server and runs and prints
//! the measured phases, `etcd.rs` starts the etcd of the replicated runs.

use clap::{Parser, Subcommand};

#[path = "fairplace-load/attack.rs"]
mod attack;
#[path = "fairplace-load/cache.rs"]
mod cache;
#[path = "fairplace-load/cluster.rs"]
mod cluster;
#[path = "fairplace-load/cost.rs"]
mod cost;
#[path = "fairplace-load/etcd.rs"]
mod etcd;
#[path = "fairplace-load/flood.rs"]
mod flood;
#[path = "fairplace-load/ingest.rs"]
mod ingest;
#[path = "fairplace-load/leases.rs"]
mod leases;
#[path = "fairplace-load/memory.rs"]
mod memory;
#[path = "fairplace-load/record.rs"]
mod record;
#[path = "fairplace-load/replicas.rs"]
mod replicas;
#[path = "fairplace-load/rpc.rs"]
mod rpc;
#[path = "fairplace-load/scale.rs"]
mod scale;
#[path = "fairplace-load/shared.rs"]
mod shared;
#[path = "fairplace-load/wire.rs"]
mod wire;

#[derive(Parser)]
#[command(
    name = "fairplace-load",
    about = "load benchmarks for the fairplace service (loopback only)"
)]
struct Args {
    /// Run the server on these CPUs only (taskset cpulist), e.g. 0, so it
    /// does not share cores with the generator; empty: anywhere.
    #[arg(long, default_value = "")]
    server_cpus: String,
    /// The server's runtime worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    server_threads: usize,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// PickCpu and the no-op Ping, same server, same run.
    Rpc(rpc::Opts),
    /// AllocateCpus followed by its ReleaseCpus against the no-op Ping, on
    /// a server whose leases live in memory and on one that commits them
    /// to its lease store (--state-dir), same run, at each concurrency.
    Leases(leases::Opts),
    /// Agent ingest: nodes stream deltas of all their CPUs.
    Ingest(ingest::Opts),
    /// task_cache_work's CPUs scanned per pass, full scan vs SC_VISIT, from
    /// the server's metrics.
    Cache(cache::Opts),
    /// Cluster PickCpu (no node) over gRPC, Ping and the naive recomputation.
    Cluster(cluster::Opts),
    /// Ping and PickCpu latency idle, then under a Decide flood, idle
    /// connections and unknown-method calls.
    Attack(attack::Opts),
    /// Memory and Ping/PickCpu latency under a stream flood from one peer:
    /// health Watch streams and Report streams that never register, over
    /// many connections; on a server with its default limits, and in the
    /// same run on one with them lifted (the baseline).
    Flood(flood::Opts),
    /// Replicas on etcd against one server, same run: PickCpu at the
    /// node's owner, through another replica (forwarded), and on a single
    /// server; AllocateCpus+ReleaseCpus with leases in etcd against the
    /// embedded store. Starts its own one-member etcd (`etcd` on the PATH,
    /// or FAIRPLACE_ETCD).
    Replicas(replicas::Opts),
    /// Resident memory with many registered nodes.
    Memory(memory::Opts),
    /// The replica set at cluster scale: 3 replicas on a 3-member etcd
    /// with tens of thousands of nodes, routing clients; node PickCpu
    /// against one server with the same nodes, the share forwarded,
    /// cluster picks and durable allocations per second, memory.
    Scale(scale::Opts),
    /// What a recording costs: PickCpu throughput and report ingest on a
    /// server with --record against one without, same run, alternating.
    Record(record::Opts),
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let launch = shared::Launch {
        cpus: args.server_cpus,
        threads: args.server_threads,
    };
    // Every subcommand gets this build's server, started first; those that
    // measure servers of their own stop it.
    let server = launch.start();
    match args.cmd {
        Cmd::Rpc(o) => rpc::run(server, &launch, o).await,
        Cmd::Leases(o) => leases::run(server, &launch, o).await,
        Cmd::Ingest(o) => ingest::run(server, &launch, o).await,
        Cmd::Cache(o) => cache::run(server, &launch, o).await,
        Cmd::Cluster(o) => cluster::run(server, &launch, o).await,
        Cmd::Attack(o) => attack::run(server, &launch, o).await,
        Cmd::Flood(o) => flood::run(server, &launch, o).await,
        Cmd::Replicas(o) => replicas::run(server, &launch, o).await,
        Cmd::Memory(o) => memory::run(server, &launch, o).await,
        Cmd::Scale(o) => scale::run(server, &launch, o).await,
        Cmd::Record(o) => record::run(server, &launch, o).await,
    }
}
