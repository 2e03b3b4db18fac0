//! fairplace-agent: streams this machine's CPU state (or N simulated nodes)
//! to a fairplace server.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use fairplace_agent::{
    LeaseSettings, Simulated, Source, StreamConfig, StreamStats, apply, cgroupfs, checkpoint,
    signal, stream,
};
use tokio::sync::watch;

#[derive(Parser)]
#[command(
    name = "fairplace-agent",
    version,
    about = "streams CPU state to a fairplace server"
)]
struct Args {
    /// The server's gRPC address; with replicas, any replica's (a Service
    /// address), or several comma-separated: a replica that does not own
    /// the node sends the agent to the one that does.
    #[arg(long, default_value = "127.0.0.1:50051")]
    server: String,
    #[command(flatten)]
    tls: TlsArgs,
    /// Node id; default: this machine's hostname.
    #[arg(long, env = "FAIRPLACE_NODE_ID")]
    node_id: Option<String>,
    /// Placement labels, KEY=VALUE (repeatable), e.g. zone=eu-1a.
    #[arg(long = "label")]
    labels: Vec<String>,
    /// Time between reports (ms); 100 is supported (deltas carry only the
    /// CPUs whose signals moved).
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Run N synthetic nodes instead of reading this machine.
    #[arg(long)]
    simulate: Option<u32>,
    /// CPUs per simulated node.
    #[arg(long, default_value_t = 128)]
    simulate_cpus: u32,
    /// Share of a simulated node's CPUs that change per report (%).
    #[arg(long, default_value_t = 10)]
    simulate_churn_pct: u32,
    /// Runnable tasks reported per CPU, biggest load first, for load
    /// balancing (0: report no tasks). With sched/debug, /proc is read
    /// only for the runnable threads; with procfs, every thread's.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u64).range(0..=1024))]
    task_cap: u64,
    /// Simulated nodes report task lists matching their runqueues.
    #[arg(long)]
    simulate_tasks: bool,
    /// CPUs per LLC of a simulated node (default: one LLC per NUMA node).
    #[arg(long)]
    simulate_llc_cpus: Option<u32>,
    /// The server's --max-message-bytes: bigger updates go without task lists.
    #[arg(long, default_value_t = 4 << 20)]
    max_message_bytes: usize,
    /// Serve the agent's own Prometheus metrics here.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Stop after this many seconds (0: run until interrupted).
    #[arg(long, default_value_t = 0)]
    run_for_s: u64,
    /// sysfs root (for testing against a copy).
    #[arg(long, default_value = "/sys/devices/system")]
    sys_root: String,
    /// procfs root, for the signals. Leases name pids as the machine sees
    /// them and are applied through the agent's own /proc: one that names
    /// another pid namespace than the agent's (a container's /host/proc
    /// without hostPID) turns applying off, said at start and in every
    /// refusal.
    #[arg(long, default_value = "/proc")]
    proc_root: String,
    /// Where the machine's /sys/fs/cgroup is mounted for the agent: leave
    /// it on the machine; in a container, mount the machine's there
    /// (writable, e.g. /host/cgroup). Lease targets and
    /// --apply-cgroup-root name cgroups as the machine does.
    #[arg(long, default_value = "/sys/fs/cgroup")]
    cgroup_root: PathBuf,
    /// Where per-CPU signals come from: auto (bpf if built in and it
    /// loads, else sched-debug if readable, else procfs, with a log line
    /// per fallback saying why), bpf (the kernel's own values read by a BPF
    /// program; needs the `bpf` build feature and CAP_BPF + CAP_PERFMON),
    /// sched-debug (the kernel's own values; root and debugfs, mounted
    /// read-only if it is not), or procfs (approximate).
    #[arg(long, default_value = "auto", value_parser = ["auto", "bpf", "sched-debug", "procfs"])]
    signal_source: String,
    /// CPU budget of sched/debug reads, % of one core: the kernel walks
    /// every thread to print the file (about 1 µs each), so with many
    /// threads and a short interval some ticks send the last state instead
    /// of reading (0: read every tick).
    #[arg(long, default_value_t = 3.5)]
    read_budget_pct: f64,
    /// The kernel's sched/debug file.
    #[arg(long, default_value = "/sys/kernel/debug/sched/debug")]
    sched_debug_path: String,
    /// Print the Register and the first Update this machine would send, as
    /// two JSON lines on stdout, and exit without connecting (to check what
    /// the agent reads, e.g. in a test VM).
    #[arg(long)]
    print_once: bool,
    /// A cgroup directory under which leases may be applied (repeatable;
    /// the environment variable takes a comma-separated list): an absolute
    /// path on the cgroup file system, e.g. /sys/fs/cgroup/cpuset/fairplace
    /// (v1 cpuset) or /sys/fs/cgroup/fairplace.slice (v2). A process is
    /// pinned only when its cpuset or unified cgroup is inside one; init,
    /// kernel threads and the agent never. Default: fairplace,
    /// fairplace.slice, kubepods and kubepods.slice under /sys/fs/cgroup
    /// and its cpuset/ and unified/ mounts.
    #[arg(
        long = "apply-cgroup-root",
        env = "FAIRPLACE_APPLY_CGROUP_ROOT",
        value_delimiter = ','
    )]
    apply_cgroup_roots: Vec<PathBuf>,
    /// Where the agent keeps its leases (agent-<node id>.json), to report
    /// them after a restart. Default: /var/lib/fairplace as root, else
    /// $XDG_STATE_HOME/fairplace, else ~/.local/state/fairplace.
    #[arg(long, env = "FAIRPLACE_STATE_DIR")]
    state_dir: Option<PathBuf>,
    /// The SPIFFE trust domain: with TLS, the server's certificate must
    /// carry spiffe://TRUST_DOMAIN/server/NAME.
    #[arg(long, default_value = "fairplace")]
    trust_domain: String,
    /// Apply leases (pin processes, write cpusets) for a server reached in
    /// plaintext, which anyone who can take its address can impersonate.
    /// For local trials only; with --tls-ca the server is verified and
    /// this is not needed.
    #[arg(long)]
    insecure_apply: bool,
}

/// The TLS flags (the same as the `fairplace` CLI's), turned into the
/// client library's `TlsOptions` for the stream's connection.
#[derive(clap::Args, Debug, Clone, Default)]
struct TlsArgs {
    /// PEM CA bundle the server's certificate chains to; turns TLS on.
    #[arg(long, env = "FAIRPLACE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS; its URI SAN
    /// spiffe://TRUST_DOMAIN/ROLE/NAME says what it may call.
    #[arg(long, env = "FAIRPLACE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "FAIRPLACE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Check the server's certificate for this name instead of the
    /// address's host.
    #[arg(long, env = "FAIRPLACE_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
}

impl From<TlsArgs> for fairplace_client::TlsOptions {
    fn from(a: TlsArgs) -> fairplace_client::TlsOptions {
        fairplace_client::TlsOptions {
            ca: a.tls_ca,
            cert: a.tls_cert,
            key: a.tls_key,
            server_name: a.tls_server_name,
        }
    }
}

/// `--label KEY=VALUE` values as pairs.
fn parse_labels(labels: &[String]) -> Result<Vec<(String, String)>, String> {
    labels
        .iter()
        .map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| format!("--label {l:?}: expected KEY=VALUE"))
        })
        .collect()
}

/// Whether grants naming a target are applied: from a server verified
/// over TLS, or with --insecure-apply; said at start either way.
fn may_apply(a: &Args) -> bool {
    let verified = a.tls.tls_ca.is_some();
    if !verified && a.insecure_apply {
        tracing::warn!(
            server = %a.server,
            "--insecure-apply: leases from this plaintext server are applied; anyone who can take its address can pin processes here"
        );
    } else if !verified {
        tracing::warn!(
            server = %a.server,
            "plaintext server: leases are recorded but none is applied (use --tls-ca, or --insecure-apply for a local trial)"
        );
    }
    verified || a.insecure_apply
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".into())
}

/// `--print-once`: the Register (node id, topology) and the first full
/// Update (every CPU's state), each as one JSON line.
fn print_once<S: Source>(mut m: S, node_id: &str) -> Result<(), Box<dyn std::error::Error>> {
    let t = m.topology();
    let cpus: Vec<_> = t
        .cpus
        .iter()
        .map(|c| {
            serde_json::json!({"id": c.id, "core": c.core, "cluster": c.cluster, "llc": c.llc,
                "node": c.node, "capacity": c.capacity})
        })
        .collect();
    let dist: Vec<_> = t.numa_distance.iter().map(|r| r.distance.clone()).collect();
    let register = serde_json::json!({"node_id": node_id,
        "agent_version": env!("CARGO_PKG_VERSION"),
        "topology": {"cpus": cpus, "numa_distance": dist}});
    println!("{register}");
    let states: Vec<_> = m
        .sample()
        .iter()
        .map(|c| {
            serde_json::json!({"id": c.id, "online": c.online, "nr_running": c.nr_running,
                "h_nr_idle": c.h_nr_idle, "load_avg": c.load_avg, "runnable_avg": c.runnable_avg,
                "util_avg": c.util_avg, "util_est": c.util_est, "capacity": c.capacity})
        })
        .collect();
    println!(
        "{}",
        serde_json::json!({"seq": 1, "full": true, "cpus": states})
    );
    Ok(())
}

/// The agent's metrics, with their help text.
fn describe_metrics() {
    metrics::describe_counter!(
        "fairplace_agent_updates_sent_total",
        "Updates sent to the server, by kind (full or delta)."
    );
    metrics::describe_counter!(
        "fairplace_agent_reconnects_total",
        "Times the stream failed and was reopened."
    );
    metrics::describe_counter!(
        "fairplace_agent_rejections_total",
        "Updates the server rejected, by reason."
    );
    metrics::describe_counter!(
        "fairplace_agent_capped_total",
        "Tasks or runtime entries left out to fit the server's limits, by part."
    );
    metrics::describe_counter!(
        "fairplace_agent_parts_left_out_total",
        "Updates sent without a part (tasks, runtime) the server had refused, by part."
    );
    metrics::describe_histogram!(
        "fairplace_agent_send_duration_seconds",
        metrics::Unit::Seconds,
        "Time to hand one update to the stream."
    );
    metrics::describe_counter!(
        "fairplace_agent_reads_skipped_total",
        "Ticks that sent the last state instead of reading sched/debug (read budget spent)."
    );
    metrics::describe_histogram!(
        "fairplace_agent_read_duration_seconds",
        metrics::Unit::Seconds,
        "Time to read /proc and /sys for one update."
    );
    metrics::describe_counter!(
        "fairplace_agent_leases_applied_total",
        "Leases applied to a target, by outcome (ok, or the reason it failed)."
    );
    metrics::describe_gauge!(
        "fairplace_agent_leases_held",
        "Leases of the node the agent holds (applied or recorded)."
    );
    metrics::describe_counter!(
        "fairplace_agent_checkpoint_errors_total",
        "Lease checkpoint writes that failed, and checkpoints set aside as unreadable."
    );
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    if let Some(addr) = a.metrics_addr {
        let buckets = [
            1e-6, 5e-6, 1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5,
        ];
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .set_buckets(&buckets)?
            .install()?;
        describe_metrics();
    }
    let labels = parse_labels(&a.labels)?;
    let base = a.node_id.clone().unwrap_or_else(hostname);
    let fs = cgroupfs::CgroupFs::at(&a.cgroup_root);
    let roots = if a.apply_cgroup_roots.is_empty() {
        apply::Roots::new(apply::default_roots(), fs)?
    } else {
        apply::Roots::new(a.apply_cgroup_roots.clone(), fs)?
    };
    let state_dir = Some(
        a.state_dir
            .clone()
            .unwrap_or_else(fairplace_types::state_dir::default_state_dir),
    );
    if let Some(d) = &state_dir {
        tracing::info!(dir = %d.display(), "lease checkpoints kept here");
    }
    let refusal = cgroupfs::same_pid_namespace(std::path::Path::new(&a.proc_root)).err();
    if let Some(why) = &refusal {
        tracing::warn!("no lease naming a pid or a cgroup is applied: {why}");
    }
    let may_apply = may_apply(&a) && refusal.is_none();
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let cfg = |id: String| StreamConfig {
        server: a.server.clone(),
        node_id: id.clone(),
        labels: labels.clone(),
        interval: Duration::from_millis(a.interval_ms.max(1)),
        backoff_min: Duration::from_millis(100),
        backoff_max: Duration::from_secs(10),
        max_message_bytes: a.max_message_bytes,
        tls: a.tls.clone().into(),
        trust_domain: a.trust_domain.clone(),
        leases: LeaseSettings {
            state_file: state_dir.as_deref().map(|d| checkpoint::state_file(d, &id)),
            roots: roots.clone(),
            may_apply,
            refusal: refusal.clone(),
        },
    };
    match a.simulate {
        Some(n) => {
            for i in 0..n {
                let mut sim = Simulated::new(a.simulate_cpus, i as u64 + 1);
                sim.churn_pct = a.simulate_churn_pct;
                sim.tasks = a.simulate_tasks;
                sim.llc_cpus = a.simulate_llc_cpus;
                let (st, _) = watch::channel(StreamStats::default());
                tasks.push(tokio::spawn(stream(
                    cfg(format!("{base}-sim-{i}")),
                    sim,
                    stop_rx.clone(),
                    st,
                )));
            }
            tracing::info!(nodes = n, cpus = a.simulate_cpus, "simulating");
        }
        None => {
            let paths = signal::Paths {
                sys: a.sys_root.clone().into(),
                proc: a.proc_root.clone().into(),
                sched_debug: a.sched_debug_path.clone().into(),
            };
            let m = signal::open(
                a.signal_source.parse()?,
                &paths,
                a.task_cap as usize,
                a.read_budget_pct,
            )?;
            if a.print_once {
                return print_once(m, &base);
            }
            tracing::info!(
                node = %base,
                cpus = m.topology().cpus.len(),
                signals = signal::name(m.signal_source() as i32),
                "reading this machine"
            );
            let (st, _) = watch::channel(StreamStats::default());
            tasks.push(tokio::spawn(stream(
                cfg(base.clone()),
                m,
                stop_rx.clone(),
                st,
            )));
        }
    }
    let run_for = a.run_for_s;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = async {
            if run_for > 0 { tokio::time::sleep(Duration::from_secs(run_for)).await } else { std::future::pending::<()>().await }
        } => {}
    }
    stop_tx.send(true).ok();
    for t in tasks {
        let _ = t.await;
    }
    Ok(())
}
