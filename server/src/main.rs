//! The fairplace server binary: `serve` runs the gRPC service, `decide`
//! answers scenarios offline.

use std::io::Read;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fairplace::service::{ServeConfig, serve, shutdown_signal};
use fairplace::store::StoreConfig;

#[derive(Parser)]
#[command(
    name = "fairplace-server",
    version,
    about = "fairplace placement-decision server"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the gRPC API (agents report, orchestrators ask) and /metrics.
    #[command(args_override_self = true)]
    Serve(ServeArgs),
    /// Decide scenarios (one JSON object, a JSON array, or JSON Lines) and
    /// print one decision per scenario as JSON Lines.
    Decide {
        /// Scenario file, or - for standard input.
        file: String,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// gRPC listen address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    grpc_addr: SocketAddr,
    /// Prometheus /metrics listen address.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
    /// A node with no report for this long is stale (ms).
    #[arg(long, default_value_t = 10_000)]
    stale_after_ms: u64,
    /// A claim ends after this long unless a report supersedes it first (ms).
    #[arg(long, default_value_t = 500)]
    claim_ttl_ms: u64,
    /// A stale, disconnected node is forgotten after this long (s).
    #[arg(long, default_value_t = 600)]
    forget_after_s: u64,
    /// Per-request timeout (ms).
    #[arg(long, default_value_t = 2_000)]
    request_timeout_ms: u64,
    /// Requests in flight before new ones are shed with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 1024)]
    max_concurrency: usize,
    /// Largest accepted message (bytes).
    #[arg(long, default_value_t = 4 << 20)]
    max_message_bytes: usize,
    /// Require `authorization: Bearer TOKEN` for SetFeatures.
    #[arg(long, env = "FAIRPLACE_ADMIN_TOKEN")]
    admin_token: Option<String>,
    /// sysctl_sched_migration_cost in ns (-1: always hot, 0: never).
    #[arg(long, default_value_t = 500_000, allow_hyphen_values = true)]
    migration_cost_ns: i64,
    /// NUMA levels farther than this lose fork/exec balancing and wake-affine.
    #[arg(long, default_value_t = 30)]
    node_reclaim_distance: u32,
    /// Runtime worker threads (0: one per CPU).
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Cache-aware epoch length (ms; the kernel's llc_epoch_period, HZ/100).
    #[arg(long, default_value_t = 10)]
    cache_epoch_ms: u64,
    /// Epochs without a scan before a preference lapses
    /// (llc_epoch_affinity_timeout).
    #[arg(long, default_value_t = 5)]
    cache_affinity_timeout: u64,
    /// llc_aggr_tolerance: 0 disables aggregation, 100 or more always allows it.
    #[arg(long, default_value_t = 1)]
    cache_aggr_tolerance: u32,
    /// llc_overaggr_pct: an LLC above this share of its capacity is busy
    /// (x 3/2 without SMT).
    #[arg(long, default_value_t = 50)]
    cache_overaggr_pct: u32,
    /// llc_imb_pct: utilisation hysteresis between two LLCs.
    #[arg(long, default_value_t = 20)]
    cache_imb_pct: u32,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Decide { file } => decide(&file),
        Cmd::Serve(args) => {
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| "info".into()),
                )
                .with_writer(std::io::stderr)
                .init();
            let mut rt = tokio::runtime::Builder::new_multi_thread();
            if args.worker_threads > 0 {
                rt.worker_threads(args.worker_threads);
            }
            let rt = rt.enable_all().build().expect("tokio runtime");
            match rt.block_on(run_serve(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fairplace-server serve: {e}");
                    ExitCode::from(1)
                }
            }
        }
    }
}

async fn run_serve(a: ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut store = StoreConfig {
        stale_after: Duration::from_millis(a.stale_after_ms),
        claim_ttl: Duration::from_millis(a.claim_ttl_ms),
        forget_after: Duration::from_secs(a.forget_after_s),
        ..StoreConfig::default()
    };
    store.system.migration_cost_ns = a.migration_cost_ns;
    store.system.node_reclaim_distance = a.node_reclaim_distance;
    if a.cache_epoch_ms == 0 {
        return Err("--cache-epoch-ms: must be at least 1".into());
    }
    if a.cache_overaggr_pct == 0 || a.cache_overaggr_pct > 100 {
        return Err("--cache-overaggr-pct: must be in 1..100".into());
    }
    store.cache.epoch_period_ms = a.cache_epoch_ms;
    store.cache.epoch_affinity_timeout = a.cache_affinity_timeout;
    store.cache.aggr_tolerance = a.cache_aggr_tolerance;
    store.cache.overaggr_pct = a.cache_overaggr_pct;
    store.cache.imb_pct = a.cache_imb_pct;
    let cfg = ServeConfig {
        store,
        request_timeout: Duration::from_millis(a.request_timeout_ms),
        max_concurrency: a.max_concurrency,
        max_message_bytes: a.max_message_bytes,
        admin_token: a.admin_token,
    };
    let metrics_listener = std::net::TcpListener::bind(a.metrics_addr)?;
    let metrics_addr = metrics_listener.local_addr()?;
    drop(metrics_listener);
    fairplace::service::install_metrics(metrics_addr)?;
    let listener = tokio::net::TcpListener::bind(a.grpc_addr).await?;
    let grpc_addr = listener.local_addr()?;
    // One line a supervisor (or a test) can parse for the bound ports.
    println!("fairplace-server listening grpc={grpc_addr} metrics=http://{metrics_addr}/metrics");
    tracing::info!(%grpc_addr, %metrics_addr, "serving");
    serve(cfg, listener, shutdown_signal()).await
}

fn decide(file: &str) -> ExitCode {
    let mut input = String::new();
    let read = if file == "-" {
        std::io::stdin().read_to_string(&mut input).map(|_| ())
    } else {
        std::fs::read_to_string(file).map(|s| input = s)
    };
    if let Err(e) = read {
        eprintln!("fairplace-server decide: cannot read {file}: {e}");
        return ExitCode::from(2);
    }
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    match fairplace::decide::run(&input, &mut stdout.lock(), &mut stderr.lock()) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fairplace-server decide: {e}");
            ExitCode::from(2)
        }
    }
}
