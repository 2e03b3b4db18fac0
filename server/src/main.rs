//! The fairplace server binary: `serve` runs the gRPC service, `decide`
//! answers scenarios offline.

use std::io::Read;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use fairplace::serve::{LeaseStorage, ServeConfig, shutdown_signal};
use fairplace::service::cpu_pool::default_workers as default_heavy_workers;
use fairplace::store::StoreConfig;
use fairplace::transport::layers::StreamCaps;
use fairplace::transport::listener::ListenOpts;

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

// Parsed once at start-up: the size of the large variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Cmd {
    /// Serve the gRPC API (agents report, orchestrators ask) and /metrics.
    #[command(args_override_self = true)]
    Serve(ServeArgs),
    /// Decide scenarios (one JSON object, a JSON array, or JSON Lines) and
    /// print one decision per scenario as JSON Lines.
    ///
    /// JSON Lines are answered line by line as they arrive, with bounded
    /// memory, so the input may be endless; a JSON array or an object over
    /// several lines is read whole, up to --max-document-bytes.
    Decide {
        /// Scenario file, or - for standard input.
        file: String,
        /// Longest JSON Lines line (bytes); a longer line is an error for
        /// that line only.
        #[arg(long, default_value_t = fairplace::offline::decide::DEFAULT_MAX_LINE_BYTES)]
        max_line_bytes: usize,
        /// Largest JSON array or multi-line object (bytes); a larger one is
        /// an error.
        #[arg(long, default_value_t = fairplace::offline::decide::DEFAULT_MAX_DOCUMENT_BYTES)]
        max_document_bytes: usize,
    },
    /// Replay a recording: every decision again on the state it read,
    /// under the recorded features (`replay: A/N answers reproduced`), then
    /// under each --switch setting, with what changed and what the nodes'
    /// next reports say of it.
    Replay(ReplayArgs),
    /// Write a development PKI (a CA, a server certificate and client
    /// certificates with SPIFFE IDs) as PEM files, for the compose demo and
    /// trying mutual TLS; production certificates come from cert-manager or
    /// any CA.
    Pki(PkiArgs),
}

#[derive(clap::Args)]
struct PkiArgs {
    /// Directory for ca.crt/ca.key, server.crt/server.key and one
    /// ROLE-NAME.crt/.key per client.
    #[arg(long)]
    dir: std::path::PathBuf,
    #[arg(long, default_value = "fairplace")]
    trust_domain: String,
    /// DNS names and IP addresses of the server certificate (repeatable).
    #[arg(long = "server-name", default_values_t = ["localhost".to_string(), "127.0.0.1".to_string()])]
    server_names: Vec<String>,
    /// A node certificate, spiffe://TD/node/NAME (repeatable).
    #[arg(long = "node")]
    nodes: Vec<String>,
    /// An orchestrator certificate (repeatable).
    #[arg(long = "orchestrator")]
    orchestrators: Vec<String>,
    /// An admin certificate (repeatable).
    #[arg(long = "admin")]
    admins: Vec<String>,
    /// A replica's peer certificate, spiffe://TD/replica/NAME, with which
    /// it forwards calls to the other replicas (repeatable).
    #[arg(long = "replica")]
    replicas: Vec<String>,
    /// Keep files that exist (the CA is reused to sign what is missing).
    #[arg(long)]
    keep_existing: bool,
    /// Validity of the leaf certificates (days).
    #[arg(long, default_value_t = 90)]
    days: i64,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Where leases are kept (DIR/leases.redb): every grant, renewal and
    /// release is committed there before it is answered, and loaded again
    /// at start. Default: /var/lib/fairplace as root, else the user's state
    /// directory ($XDG_STATE_HOME/fairplace or ~/.local/state/fairplace).
    #[arg(long, env = "FAIRPLACE_STATE_DIR")]
    state_dir: Option<std::path::PathBuf>,
    /// redb (durable, under --state-dir) or memory (leases end with the
    /// process; for benchmarks and throwaway servers).
    #[arg(long, default_value = "redb", value_parser = ["redb", "memory"])]
    lease_store: String,
    /// Leases one caller identity may hold at once (0: no limit).
    #[arg(long, default_value_t = fairplace::store::DEFAULT_MAX_LEASES_PER_CALLER)]
    max_leases_per_caller: usize,
    /// CPUs one caller identity may hold leased at once (0: no limit).
    #[arg(long, default_value_t = 0)]
    max_leased_cpus_per_caller: usize,
    /// The longest lifetime an AllocateCpus or RenewLease may ask for (ms).
    #[arg(long, default_value_t = 86_400_000, value_parser = positive_u64)]
    max_lease_ttl_ms: u64,
    /// gRPC listen address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:50051")]
    grpc_addr: SocketAddr,
    /// Prometheus /metrics listen address.
    #[arg(long, default_value = "127.0.0.1:9464")]
    metrics_addr: SocketAddr,
    /// A node with no report for this long is stale (ms).
    #[arg(long, default_value_t = 10_000, value_parser = positive_u64)]
    stale_after_ms: u64,
    /// A claim ends after this long unless a report supersedes it first (ms).
    #[arg(long, default_value_t = 500, value_parser = positive_u64)]
    claim_ttl_ms: u64,
    /// A node with no report for this long is forgotten, and a stream that
    /// stays open but silent that long is closed (s).
    #[arg(long, default_value_t = 600, value_parser = positive_u64)]
    forget_after_s: u64,
    /// Nodes held at most: a Register of a new node id beyond it is refused
    /// with RESOURCE_EXHAUSTED (re-registrations still work; a forgotten
    /// node makes room).
    #[arg(long, default_value_t = fairplace::store::DEFAULT_MAX_NODES, value_parser = positive_usize)]
    max_nodes: usize,
    /// Longest node id accepted, in bytes (default: a DNS name); longer ids
    /// are refused with INVALID_ARGUMENT.
    #[arg(long, default_value_t = fairplace::store::DEFAULT_MAX_NODE_ID_BYTES, value_parser = positive_usize)]
    max_node_id_bytes: usize,
    /// Per-request timeout (ms).
    #[arg(long, default_value_t = 2_000, value_parser = positive_u64)]
    request_timeout_ms: u64,
    /// Requests in flight before new ones are shed with RESOURCE_EXHAUSTED
    /// (health checks are never shed).
    #[arg(long, default_value_t = 1024, value_parser = positive_usize)]
    max_concurrency: usize,
    /// CPU-heavy calls (Decide, Balance, topology builds) running at once
    /// (0: one fewer than the machine's CPUs, at least 1).
    #[arg(long, default_value_t = 0)]
    heavy_workers: usize,
    /// CPU-heavy calls that may wait for a worker before more are shed
    /// (default: 4 per worker).
    #[arg(long)]
    heavy_queue: Option<usize>,
    /// Largest accepted message (bytes).
    #[arg(long, default_value_t = 4 << 20, value_parser = positive_usize)]
    max_message_bytes: usize,
    /// A Report stream must send its Register within this long (ms).
    #[arg(long, default_value_t = 10_000, value_parser = positive_u64)]
    register_timeout_ms: u64,
    /// Connections open at once on each port (gRPC, health), screening
    /// included; more are closed at accept.
    #[arg(long, default_value_t = ListenOpts::default().max_connections, value_parser = positive_usize)]
    max_connections: usize,
    /// Connections open at once from one peer address on each port.
    #[arg(long, default_value_t = ListenOpts::default().max_connections_per_peer, value_parser = positive_usize)]
    max_connections_per_peer: usize,
    /// HTTP/2 streams one connection may have open at once.
    #[arg(long, default_value_t = fairplace::serve::DEFAULT_MAX_STREAMS_PER_CONNECTION, value_parser = clap::value_parser!(u32).range(1..))]
    max_streams_per_connection: u32,
    /// AgentService.Report streams open at once; more are refused with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = StreamCaps::default().agent, value_parser = positive_usize)]
    max_agent_streams: usize,
    /// Report streams waiting for their Register at once.
    #[arg(long, default_value_t = fairplace::service::agent::DEFAULT_MAX_PENDING_REGISTRATIONS, value_parser = positive_usize)]
    max_pending_registrations: usize,
    /// grpc.health.v1 Watch streams open at once (both ports together);
    /// Check is never limited.
    #[arg(long, default_value_t = StreamCaps::default().health_watch, value_parser = positive_usize)]
    max_health_watches: usize,
    /// Server reflection streams open at once.
    #[arg(long, default_value_t = StreamCaps::default().reflection, value_parser = positive_usize)]
    max_reflection_streams: usize,
    /// PlacementService.PickCpus streams open at once; more are refused
    /// with RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = StreamCaps::default().pick, value_parser = positive_usize)]
    max_pick_streams: usize,
    /// A new connection must send the HTTP/2 preface within this long (ms).
    #[arg(long, default_value_t = 10_000, value_parser = positive_u64)]
    preface_timeout_ms: u64,
    /// After SIGTERM, calls in flight get this long before the server exits
    /// whatever is still open (ms).
    #[arg(long, default_value_t = 5_000)]
    shutdown_grace_ms: u64,
    /// Require `authorization: Bearer TOKEN` for SetFeatures.
    // hide_env_values: --help must never print the secret from the
    // environment.
    #[arg(long, env = "FAIRPLACE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Serve TLS on the gRPC port with this PEM certificate chain (leaf
    /// first); reloaded when the file changes.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The PEM private key of --tls-cert (PKCS#8, PKCS#1 or SEC1).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// Mutual TLS: every client must present a certificate chained to this
    /// PEM CA bundle, whose URI SAN spiffe://TRUST_DOMAIN/ROLE/NAME sets
    /// what it may call (ROLE: node, orchestrator or admin).
    #[arg(long, requires = "tls_cert")]
    client_ca: Option<std::path::PathBuf>,
    /// The SPIFFE trust domain client certificates must name.
    #[arg(long, default_value = "fairplace")]
    trust_domain: String,
    /// Serve a non-loopback --grpc-addr without --client-ca, to anyone who
    /// can connect (refused otherwise).
    #[arg(long)]
    allow_unauthenticated: bool,
    /// How often the TLS files are checked for a rotation (ms).
    #[arg(long, default_value_t = 1_000, value_parser = positive_u64)]
    tls_reload_ms: u64,
    /// The labels placement uses for each node, as JSON: {"nodes": {ID:
    /// {KEY: VALUE}}, "reported": {ID or "*": [KEY]}} ("reported": the keys
    /// a node may still set itself). Read at start.
    #[arg(long)]
    node_labels: Option<std::path::PathBuf>,
    /// Label keys every node may set itself (for agents that are trusted).
    /// Under mutual TLS, without this or --node-labels, placement uses no
    /// label a node reports.
    #[arg(long, value_delimiter = ',')]
    trust_reported_labels: Vec<String>,
    /// Also serve grpc.health.v1 alone, in plaintext, here (for probes that
    /// cannot present a client certificate, like the kubelet's).
    #[arg(long)]
    health_addr: Option<SocketAddr>,
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
    /// Record what this server sees (registrations, every published node
    /// state) and decides (PickCpu, PickCpus, CanMigrate, AllocateCpus,
    /// Balance, with the features in force) into segment files in DIR,
    /// for `fairplace-server replay DIR`.
    #[arg(long, value_name = "DIR")]
    record: Option<std::path::PathBuf>,
    /// The recording's budget (bytes): segments rotate at a quarter of it,
    /// and the oldest are deleted so that DIR never holds more (but for the
    /// block being written).
    #[arg(long, default_value_t = 1 << 30, value_parser = clap::value_parser!(u64).range(256 << 10..), requires = "record")]
    record_max_bytes: u64,
    #[command(flatten)]
    replicas: ReplicaArgs,
}

#[derive(clap::Args)]
struct ReplayArgs {
    /// A recording's directory (--record, or `fairplace record`).
    dir: std::path::PathBuf,
    /// Decide again with this switch set (NAME=on|off; several joined by
    /// commas are one setting); repeatable, one setting each.
    #[arg(long = "switch", value_name = "NAME=on|off", value_parser = parse_setting)]
    switches: Vec<fairplace::record::replay::Setting>,
    /// Every switch, one at a time, set the other way from the recording.
    #[arg(long)]
    each_switch: bool,
    /// Print the report as JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Write a chart of each setting's table here (SVG).
    #[arg(long, value_name = "FILE.svg")]
    chart: Option<std::path::PathBuf>,
    /// Answers not reproduced to print whole (all are counted).
    #[arg(long, default_value_t = 10)]
    show: usize,
}

fn parse_setting(s: &str) -> Result<fairplace::record::replay::Setting, String> {
    fairplace::record::replay::Setting::parse(s)
}

/// Several replicas sharing the nodes through etcd.
#[derive(clap::Args)]
struct ReplicaArgs {
    /// Join a replica set through this etcd cluster (comma-separated
    /// client URLs, http:// or https://): nodes are shared among the
    /// replicas, leases kept in etcd. Without it: one server, leases in
    /// --state-dir.
    #[arg(long, env = "FAIRPLACE_ETCD_ENDPOINTS", value_delimiter = ',')]
    etcd_endpoints: Vec<String>,
    /// CA bundle the etcd members' certificates chain to (https endpoints).
    #[arg(long)]
    etcd_tls_ca: Option<std::path::PathBuf>,
    /// Client certificate and key for etcd (its --client-cert-auth).
    #[arg(long)]
    etcd_tls_cert: Option<std::path::PathBuf>,
    #[arg(long)]
    etcd_tls_key: Option<std::path::PathBuf>,
    /// Every key of this replica set lives under this prefix.
    #[arg(long, default_value = "/fairplace/")]
    etcd_prefix: String,
    /// This replica's etcd lease: a replica that stops refreshing it
    /// (killed, cut off) leaves the set, and its nodes move, within this
    /// long (s).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(2..=60))]
    etcd_lease_ttl_s: u64,
    /// This replica's id in the set (default: the hostname).
    #[arg(long, env = "FAIRPLACE_REPLICA_ID")]
    replica_id: Option<String>,
    /// The gRPC address (host:port) other replicas and agents reach this
    /// replica at (default: --grpc-addr, or HOSTNAME:PORT when it listens
    /// on every address).
    #[arg(long, env = "FAIRPLACE_ADVERTISE_ADDR")]
    advertise_addr: Option<String>,
    /// This replica's peer certificate and key (spiffe://TD/replica/ID,
    /// client auth), presented when it forwards a call to another replica;
    /// needed with --client-ca.
    #[arg(long)]
    replica_tls_cert: Option<std::path::PathBuf>,
    #[arg(long)]
    replica_tls_key: Option<std::path::PathBuf>,
    /// The CA other replicas' server certificates chain to (default:
    /// --client-ca).
    #[arg(long)]
    peer_ca: Option<std::path::PathBuf>,
}

/// `replay`: the report on standard output; exit 1 when an answer was not
/// reproduced (a bug to report), 2 when nothing could be read.
fn replay(a: ReplayArgs) -> ExitCode {
    use fairplace::record::replay::{self, out};
    let opts = replay::Options {
        dir: a.dir,
        settings: a.switches,
        each_switch: a.each_switch,
        show: a.show,
    };
    let report = match replay::run(opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("fairplace-server replay: {e}");
            return ExitCode::from(2);
        }
    };
    if a.json {
        println!("{}", out::json(&report));
    } else {
        print!("{}", out::text(&report, a.show));
    }
    if let Some(path) = &a.chart
        && let Err(e) = std::fs::write(path, out::svg(&report))
    {
        eprintln!("fairplace-server replay: --chart {}: {e}", path.display());
        return ExitCode::from(2);
    }
    if report.reproduced < report.decisions {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Decide {
            file,
            max_line_bytes,
            max_document_bytes,
        } => decide(
            &file,
            fairplace::offline::decide::Limits {
                max_line_bytes,
                max_document_bytes,
            },
        ),
        Cmd::Replay(a) => replay(a),
        Cmd::Pki(a) => match pki(&a) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("fairplace-server pki: {e}");
                ExitCode::from(1)
            }
        },
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
            let code = match rt.block_on(run_serve(args)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("fairplace-server serve: {e}");
                    ExitCode::from(1)
                }
            };
            // Heavy work still running after the grace period is abandoned,
            // not waited for.
            rt.shutdown_timeout(Duration::from_millis(100));
            code
        }
    }
}

/// Whose labels place nodes: the admin's file and trusted keys when given;
/// otherwise none a node reports under mutual TLS (a node certificate
/// proves the node, not its zone), and all of them without client
/// authentication (every caller is trusted there).
fn label_policy(
    a: &ServeArgs,
) -> Result<fairplace::store::LabelPolicy, fairplace::store::labels::LabelPolicyError> {
    use fairplace::store::LabelPolicy;
    if a.node_labels.is_some() || !a.trust_reported_labels.is_empty() {
        LabelPolicy::load(a.node_labels.as_deref(), &a.trust_reported_labels)
    } else if a.client_ca.is_some() {
        Ok(LabelPolicy::default())
    } else {
        Ok(LabelPolicy::trust_all())
    }
}

async fn run_serve(a: ServeArgs) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let mut store = StoreConfig {
        stale_after: Duration::from_millis(a.stale_after_ms),
        claim_ttl: Duration::from_millis(a.claim_ttl_ms),
        forget_after: Duration::from_secs(a.forget_after_s),
        max_nodes: a.max_nodes,
        max_node_id_bytes: a.max_node_id_bytes,
        lease_limits: fairplace::store::OwnerLimits {
            leases: (a.max_leases_per_caller > 0).then_some(a.max_leases_per_caller),
            cpus: (a.max_leased_cpus_per_caller > 0).then_some(a.max_leased_cpus_per_caller),
        },
        max_lease_ttl: Duration::from_millis(a.max_lease_ttl_ms),
        label_policy: label_policy(&a)?,
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
    // An empty token would let anyone who sends an empty bearer through:
    // usually an unset variable in a manifest, never what was meant.
    if a.admin_token
        .as_deref()
        .is_some_and(|t| t.trim().is_empty())
    {
        return Err(
            "--admin-token (FAIRPLACE_ADMIN_TOKEN): empty; set a secret, or leave it unset".into(),
        );
    }
    let heavy_workers = match a.heavy_workers {
        0 => default_heavy_workers(),
        n => n,
    };
    let mut cfg = ServeConfig {
        store,
        request_timeout: Duration::from_millis(a.request_timeout_ms),
        max_concurrency: a.max_concurrency,
        max_message_bytes: a.max_message_bytes,
        admin_token: a.admin_token.clone(),
        register_timeout: Duration::from_millis(a.register_timeout_ms),
        shutdown_grace: Duration::from_millis(a.shutdown_grace_ms),
        listen: ListenOpts {
            screen_timeout: Duration::from_millis(a.preface_timeout_ms),
            max_connections: a.max_connections,
            max_connections_per_peer: a.max_connections_per_peer,
            ..ListenOpts::default()
        },
        max_streams_per_connection: a.max_streams_per_connection,
        streams: StreamCaps {
            agent: a.max_agent_streams,
            health_watch: a.max_health_watches,
            reflection: a.max_reflection_streams,
            pick: a.max_pick_streams,
        },
        max_pending_registrations: a.max_pending_registrations,
        heavy_workers,
        heavy_queue: a.heavy_queue.unwrap_or(4 * heavy_workers),
        tls: tls_settings(&a)?,
        trust_domain: a.trust_domain.clone(),
        health_listener: None,
        ready: Default::default(),
        replica: None,
        record: a.record.clone().map(|dir| fairplace::serve::RecordConfig {
            dir,
            max_bytes: a.record_max_bytes,
        }),
        leases: match a.lease_store.as_str() {
            "memory" => LeaseStorage::Memory,
            _ => LeaseStorage::Dir(
                a.state_dir
                    .clone()
                    .unwrap_or_else(fairplace_types::state_dir::default_state_dir),
            ),
        },
    };
    cfg.replica = replica_config(&a)?;
    // The lease store before the ports: a state directory in use or
    // unreadable, or an etcd that cannot be joined, stops the server
    // before it listens.
    let (store, replicated) = fairplace::serve::open(&cfg).await?;
    let metrics_addr = fairplace::transport::exposition::start(
        a.metrics_addr,
        std::sync::Arc::clone(&store),
        cfg.ready.clone(),
    )?;
    let listener = tokio::net::TcpListener::bind(a.grpc_addr).await?;
    let grpc_addr = listener.local_addr()?;
    let mut health_note = String::new();
    if let Some(h) = a.health_addr {
        let l = std::net::TcpListener::bind(h)?;
        health_note = format!(" health={}", l.local_addr()?);
        cfg.health_listener = Some(std::sync::Arc::new(l));
    }
    // One line a supervisor (or a test) can parse for the bound ports.
    println!(
        "fairplace-server listening grpc={grpc_addr} metrics=http://{metrics_addr}/metrics{health_note}"
    );
    tracing::info!(%grpc_addr, %metrics_addr, "serving");
    fairplace::serve::serve_replicated(cfg, store, replicated, listener, shutdown_signal()).await
}

/// The replica flags, checked; `None` without --etcd-endpoints.
fn replica_config(
    a: &ServeArgs,
) -> Result<Option<fairplace::replica::ReplicaConfig>, Box<dyn std::error::Error + Send + Sync>> {
    let r = &a.replicas;
    if r.etcd_endpoints.is_empty() {
        return Ok(None);
    }
    if !r.etcd_prefix.starts_with('/') || !r.etcd_prefix.ends_with('/') {
        return Err(format!(
            "--etcd-prefix {:?}: must start and end with '/'",
            r.etcd_prefix
        )
        .into());
    }
    let host = fairplace_types::state_dir::hostname();
    let advertise = match &r.advertise_addr {
        Some(x) => x.clone(),
        None if !a.grpc_addr.ip().is_unspecified() && a.grpc_addr.port() != 0 => {
            a.grpc_addr.to_string()
        }
        None if a.grpc_addr.port() != 0 => format!("{host}:{}", a.grpc_addr.port()),
        None => {
            return Err("--advertise-addr: needed when --grpc-addr picks its port (port 0)".into());
        }
    };
    let peer_tls = match (&r.replica_tls_cert, &r.replica_tls_key) {
        (Some(cert), Some(key)) => Some(fairplace::replica::forward::PeerTls {
            ca: r
                .peer_ca
                .clone()
                .or_else(|| a.client_ca.clone())
                .ok_or("--replica-tls-cert: give --peer-ca (or --client-ca)")?,
            cert: cert.clone(),
            key: key.clone(),
        }),
        (None, None) if a.client_ca.is_some() => {
            return Err(
                "--client-ca with --etcd-endpoints: replicas forward calls to each other with \
                        a replica certificate; give --replica-tls-cert and --replica-tls-key"
                    .into(),
            );
        }
        (None, None) => None,
        _ => return Err("--replica-tls-cert and --replica-tls-key go together".into()),
    };
    Ok(Some(fairplace::replica::ReplicaConfig {
        id: r.replica_id.clone().unwrap_or(host),
        advertise,
        etcd: fairplace::replica::etcd::EtcdSettings {
            endpoints: r.etcd_endpoints.clone(),
            ca: r.etcd_tls_ca.clone(),
            cert: r.etcd_tls_cert.clone(),
            key: r.etcd_tls_key.clone(),
            prefix: r.etcd_prefix.clone(),
        },
        lease_ttl: Duration::from_secs(r.etcd_lease_ttl_s),
        peer_tls,
    }))
}

fn decide(file: &str, limits: fairplace::offline::decide::Limits) -> ExitCode {
    let input: Box<dyn Read> = if file == "-" {
        Box::new(std::io::stdin().lock())
    } else {
        match std::fs::File::open(file) {
            Ok(f) => Box::new(f),
            Err(e) => {
                eprintln!("fairplace-server decide: cannot read {file}: {e}");
                return ExitCode::from(2);
            }
        }
    };
    let input = ReadErrorsNamed { inner: input, file };
    // Answers are buffered and flushed whenever the input has nothing more
    // ready, so a pipe sees each answer as soon as its line is in.
    let mut out = std::io::BufWriter::with_capacity(64 * 1024, std::io::stdout().lock());
    let stderr = std::io::stderr();
    match fairplace::offline::decide::run_stream(input, &mut out, &mut stderr.lock(), limits) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(_) => ExitCode::from(1),
        Err(e) => {
            eprintln!("fairplace-server decide: {e}");
            ExitCode::from(2)
        }
    }
}

/// A flag that must be at least 1 (0 would disable what it bounds).
fn positive_u64(v: &str) -> Result<u64, String> {
    match v.parse::<u64>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn positive_usize(v: &str) -> Result<usize, String> {
    positive_u64(v).and_then(|n| usize::try_from(n).map_err(|e| e.to_string()))
}

/// Names the input in its read errors (the decide loop also writes).
struct ReadErrorsNamed<'a, R> {
    inner: R,
    file: &'a str,
}

impl<R: Read> Read for ReadErrorsNamed<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.inner
            .read(buf)
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot read {}: {e}", self.file)))
    }
}

/// The TLS flags, checked: a non-loopback gRPC address needs client
/// certificates (`--client-ca`) unless `--allow-unauthenticated` says so.
fn tls_settings(
    a: &ServeArgs,
) -> Result<Option<fairplace::transport::tls::TlsSettings>, Box<dyn std::error::Error + Send + Sync>>
{
    fairplace::identity::parse_spiffe_id(
        &format!("spiffe://{}/admin/x", a.trust_domain),
        &a.trust_domain,
    )
    .map_err(|_| {
        format!(
            "--trust-domain {:?}: a SPIFFE trust domain is lowercase letters, digits, '.', '-' and '_'",
            a.trust_domain
        )
    })?;
    if a.client_ca.is_none() && !a.grpc_addr.ip().is_loopback() {
        if !a.allow_unauthenticated {
            return Err(format!(
                "--grpc-addr {} is not a loopback address, and without --client-ca anyone who can reach it could \
                 register nodes, claim CPUs and read every node's tasks: give --tls-cert, --tls-key and --client-ca \
                 (mutual TLS), or --allow-unauthenticated to serve it open anyway",
                a.grpc_addr
            )
            .into());
        }
        tracing::warn!(
            grpc_addr = %a.grpc_addr,
            "serving a non-loopback address without client authentication (--allow-unauthenticated)"
        );
    }
    Ok(match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => {
            let mut t = fairplace::transport::tls::TlsSettings::new(
                cert.clone(),
                key.clone(),
                a.client_ca.clone(),
            );
            t.reload_interval = Duration::from_millis(a.tls_reload_ms);
            Some(t)
        }
        _ => None,
    })
}

fn pki(a: &PkiArgs) -> Result<(), Box<dyn std::error::Error>> {
    use fairplace::offline::pki::{Ca, Leaf};
    std::fs::create_dir_all(&a.dir)?;
    let exists = |name: &str| a.keep_existing && a.dir.join(format!("{name}.crt")).exists();
    let ca = if exists("ca") {
        Ca::load(
            &std::fs::read_to_string(a.dir.join("ca.crt"))?,
            &std::fs::read_to_string(a.dir.join("ca.key"))?,
        )?
    } else {
        let ca = Ca::new(&format!("fairplace development CA ({})", a.trust_domain))?;
        ca.pem.write(&a.dir, "ca")?;
        ca
    };
    let mut written = vec![];
    if !exists("server") {
        let (mut dns, mut ips) = (vec![], vec![]);
        for n in &a.server_names {
            match n.parse::<std::net::IpAddr>() {
                Ok(ip) => ips.push(ip),
                Err(_) => dns.push(n.as_str()),
            }
        }
        let mut leaf = Leaf::server(&a.trust_domain, &dns, &ips);
        leaf.days = a.days;
        ca.issue(&leaf)?.write(&a.dir, "server")?;
        written.push("server".to_string());
    }
    for (role, names) in [
        ("node", &a.nodes),
        ("orchestrator", &a.orchestrators),
        ("admin", &a.admins),
        ("replica", &a.replicas),
    ] {
        for n in names {
            let file = format!("{role}-{n}");
            if exists(&file) {
                continue;
            }
            let mut leaf = Leaf::client(&a.trust_domain, role, n);
            fairplace::identity::parse_spiffe_id(&leaf.uris[0], &a.trust_domain)?;
            leaf.days = a.days;
            ca.issue(&leaf)?.write(&a.dir, &file)?;
            written.push(file);
        }
    }
    println!(
        "fairplace-server pki: {} (CA ca.crt) wrote {}",
        a.dir.display(),
        if written.is_empty() {
            "nothing new".to_string()
        } else {
            written.join(", ")
        }
    );
    Ok(())
}
