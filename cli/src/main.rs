//! The fairplace CLI (`fairplace-cli`, binary `fairplace`): ask a server
//! for placements and migration checks, balance proposals and scenario
//! decisions, and look at its nodes, features and cache-aware state. One
//! function per subcommand. (The demo, which runs a server beside a local
//! agent, is its own binary, `fairplace-demo`.)
//!
//! A crate of its own, so that the client library carries no command line
//! and nothing of this machine: the flags are parsed here (clap) and turned
//! into the library's options ([`TlsArgs`] into `TlsOptions`), and `fairplace
//! run` (module `run`), which starts a command on leased CPUs, uses
//! `fairplace-host` to read this machine and pin the command.

mod run;

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Parser, Subcommand};
use fairplace_client::table::{migration_type_name, render};
use fairplace_client::{Client, TlsOptions, pb};
use serde_json::json;

#[derive(Parser)]
#[command(name = "fairplace", version, about = "fairplace placement client")]
struct Cli {
    /// Server gRPC address; several, comma-separated, for a replica set
    /// (node calls then go to each node's owner directly).
    #[arg(
        long,
        global = true,
        default_value = "127.0.0.1:50051",
        env = "FAIRPLACE_SERVER"
    )]
    server: String,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Per-call deadline (ms).
    #[arg(long, global = true, default_value_t = 2000)]
    deadline_ms: u64,
    /// Bearer token for admin calls.
    #[arg(
        long,
        global = true,
        env = "FAIRPLACE_ADMIN_TOKEN",
        hide_env_values = true
    )]
    token: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(subcommand)]
    cmd: Cmd,
}

/// The TLS flags (the agent takes the same ones).
#[derive(clap::Args, Debug, Clone, Default)]
struct TlsArgs {
    /// PEM CA bundle the server's certificate chains to; turns TLS on.
    #[arg(long, global = true, env = "FAIRPLACE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// PEM client certificate for mutual TLS; its URI SAN
    /// spiffe://TRUST_DOMAIN/ROLE/NAME says what it may call.
    #[arg(long, global = true, env = "FAIRPLACE_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, global = true, env = "FAIRPLACE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Check the server's certificate for this name instead of the
    /// address's host.
    #[arg(long, global = true, env = "FAIRPLACE_TLS_SERVER_NAME")]
    tls_server_name: Option<String>,
}

impl From<TlsArgs> for TlsOptions {
    fn from(a: TlsArgs) -> TlsOptions {
        TlsOptions {
            ca: a.tls_ca,
            cert: a.tls_cert,
            key: a.tls_key,
            server_name: a.tls_server_name,
        }
    }
}

#[derive(clap::Args, Clone)]
struct TaskArgs {
    /// Allowed CPUs (cpulist); default: all.
    #[arg(long, default_value = "")]
    cpus_allowed: String,
    /// normal, batch or idle.
    #[arg(long, default_value = "normal")]
    policy: String,
    #[arg(long, default_value_t = 0)]
    util: i64,
    #[arg(long, default_value_t = 0)]
    load: i64,
    #[arg(long)]
    migration_disabled: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// PickCpu: where should this task run?
    Pick(PickArgs),
    /// CanMigrate: may the balancer move the task from src to dst?
    Migrate(MigrateArgs),
    /// List the registered nodes.
    Nodes,
    /// One node's topology and per-CPU state.
    Node(NodeArgs),
    /// Show or set features: --set NAME=on|off (repeatable), --node for one node.
    Features(FeaturesArgs),
    /// Load-balance proposals for a node (Balance RPC), or with --cluster
    /// LEVEL=PATH across a rack or zone (e.g. --cluster rack=z1/r2).
    Balance(BalanceArgs),
    /// A node's cache-aware state: per-process LLC preference and occupancy.
    Cache(CacheArgs),
    /// Decide a scenario file: with --server on the server (Decide RPC).
    Decide(DecideArgs),
    /// Run CMD on CPUs the server leases (AllocateCpus), renewing the lease
    /// while it runs and releasing it after; exits with CMD's status.
    Run(RunArgs),
    /// AllocateCpus: lease CPUs (optionally applied by the node's agent to a
    /// process or a cgroup); prints the lease.
    Allocate(AllocateArgs),
    /// ReleaseCpus: end a lease.
    Release(ReleaseArgs),
    /// Record what the server sees and decides for a while (AdminService.
    /// Record; an admin call) into DIR, for `fairplace-server replay DIR`.
    /// With several --server addresses, each replica's nodes go to a
    /// folder of DIR of their own.
    Record(RecordArgs),
}

#[derive(clap::Args)]
struct RecordArgs {
    /// Where the segment goes (made if missing).
    dir: PathBuf,
    /// How long to record (s, 1..3600).
    #[arg(long, default_value_t = 60)]
    seconds: u32,
    /// Stop after this many bytes (0: the server's limit, 1 GiB).
    #[arg(long, default_value_t = 0)]
    max_bytes: u64,
}

#[derive(clap::Args)]
struct PickArgs {
    node: String,
    /// wakeup, fork or exec.
    #[arg(long, default_value = "wakeup")]
    kind: String,
    #[arg(long, default_value_t = 0)]
    this_cpu: u32,
    /// The wakee's previous CPU (wakeup).
    #[arg(long)]
    prev_cpu: Option<u32>,
    #[arg(long)]
    sync: bool,
    /// Count the chosen CPU as busy until the next report.
    #[arg(long)]
    claim: bool,
    /// Ask this many times, on one PickCpus stream (with --claim: distinct
    /// CPUs while idle ones last).
    #[arg(long, default_value_t = 1)]
    count: u32,
    #[command(flatten)]
    task: TaskArgs,
}

#[derive(clap::Args)]
struct MigrateArgs {
    node: String,
    src: u32,
    dst: u32,
    #[arg(long, default_value = "")]
    sd_level: String,
    /// idle, not_idle or newly_idle.
    #[arg(long, default_value = "idle")]
    idle: String,
    #[arg(long, default_value_t = 0)]
    nr_balance_failed: u32,
    #[arg(long)]
    running: bool,
    #[command(flatten)]
    task: TaskArgs,
}

#[derive(clap::Args)]
struct NodeArgs {
    id: String,
}

#[derive(clap::Args)]
struct FeaturesArgs {
    #[arg(long, default_value = "")]
    node: String,
    #[arg(long = "set")]
    set: Vec<String>,
    #[arg(long)]
    clear_overrides: bool,
}

#[derive(clap::Args)]
struct BalanceArgs {
    /// The node; omit with --cluster.
    node: Option<String>,
    #[arg(long)]
    cluster: Option<String>,
    /// Destination CPUs (cpulist); default: every online CPU.
    #[arg(long, default_value = "")]
    cpus: String,
    /// Only domains whose balance interval expired.
    #[arg(long)]
    honor_intervals: bool,
    /// Commit the proposals as claims on their destination CPUs.
    #[arg(long)]
    apply: bool,
    #[arg(long, default_value_t = 0)]
    max: u32,
}

#[derive(clap::Args)]
struct CacheArgs {
    node: String,
}

#[derive(clap::Args)]
struct DecideArgs {
    file: String,
}

#[derive(clap::Args)]
struct RunArgs {
    /// The node; default: this machine's hostname (the agent's node id).
    #[arg(long)]
    node: Option<String>,
    /// CPUs to lease.
    #[arg(long)]
    cpus: u32,
    /// kernel, cores, llc, llc-exclusive or spread.
    #[arg(long, default_value = "kernel")]
    policy: String,
    /// Run CMD inside this cgroup, its cpuset.cpus set to the lease.
    #[arg(long)]
    cgroup: Option<String>,
    /// Lease lifetime (renewed every third of it); 0: the server's default.
    #[arg(long, default_value_t = 0)]
    ttl_ms: u32,
    /// Wait this long for the server, then run on a local choice.
    #[arg(long, default_value_t = 2000)]
    timeout_ms: u64,
    /// Count a local fallback in DIR/fairplace_run.prom for node_exporter's
    /// textfile collector (default: its usual directory, if it exists).
    #[arg(long, env = "FAIRPLACE_TEXTFILE_DIR")]
    textfile_dir: Option<PathBuf>,
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    cmd: Vec<std::ffi::OsString>,
}

#[derive(clap::Args)]
struct AllocateArgs {
    /// The node; empty: the cluster chooses.
    #[arg(long, default_value = "")]
    node: String,
    #[arg(long)]
    cpus: u32,
    #[arg(long, default_value = "kernel")]
    policy: String,
    #[arg(long, default_value = "")]
    holder: String,
    #[arg(long, default_value_t = 0)]
    ttl_ms: u32,
    /// The agent applies the lease to this process's threads.
    #[arg(long, conflicts_with = "cgroup")]
    pid: Option<u32>,
    /// The agent applies the lease to this cgroup's cpuset.cpus.
    #[arg(long)]
    cgroup: Option<String>,
    /// Idempotency key: the same caller running `allocate` again with it
    /// gets the first grant, not a second lease (default: a random one,
    /// used for this command's own retries).
    #[arg(long, default_value = "")]
    request_id: String,
}

#[derive(clap::Args)]
struct ReleaseArgs {
    lease_id: u64,
}

fn task(t: &TaskArgs, prev: Option<u32>) -> Result<pb::Task, String> {
    let policy = match t.policy.as_str() {
        "normal" => pb::Policy::Normal,
        "batch" => pb::Policy::Batch,
        "idle" => pb::Policy::Idle,
        p => return Err(format!("--policy {p:?}: expected normal, batch or idle")),
    };
    Ok(pb::Task {
        policy: policy as i32,
        cpus_allowed: t.cpus_allowed.clone(),
        prev_cpu: prev,
        util_avg: t.util,
        util_est: t.util,
        load_avg: t.load,
        migration_disabled: t.migration_disabled,
        ..Default::default()
    })
}

fn kind(s: &str) -> Result<pb::RequestKind, String> {
    Ok(match s {
        "wakeup" => pb::RequestKind::Wakeup,
        "fork" => pb::RequestKind::Fork,
        "exec" => pb::RequestKind::Exec,
        k => return Err(format!("--kind {k:?}: expected wakeup, fork or exec")),
    })
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("fairplace: {e}");
        std::process::exit(1);
    }
}

async fn connect(cli: &Cli) -> Result<Client, String> {
    let tls: TlsOptions = cli.tls.clone().into();
    // Several addresses (or one replica of a set): node calls go to each
    // node's owner directly, from the set WatchMembers gives.
    let addrs: Vec<String> = cli
        .server
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(String::from)
        .collect();
    let mut c = Client::connect_routed(&addrs, &tls)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", cli.server))?
        .with_token(cli.token.clone());
    c.deadline = Duration::from_millis(cli.deadline_ms);
    Ok(c)
}

fn status(s: tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

/// Runs the parsed command: one function per subcommand.
async fn run(cli: Cli) -> Result<(), String> {
    match &cli.cmd {
        Cmd::Pick(args) => pick_cmd(&cli, args).await,
        Cmd::Migrate(args) => migrate_cmd(&cli, args).await,
        Cmd::Balance(args) => balance_cmd(&cli, args).await,
        Cmd::Cache(args) => cache_cmd(&cli, args).await,
        Cmd::Nodes => nodes_cmd(&cli).await,
        Cmd::Node(args) => node_cmd(&cli, args).await,
        Cmd::Features(args) => features_cmd(&cli, args).await,
        Cmd::Decide(args) => decide_cmd(&cli, args).await,
        Cmd::Run(args) => run_cmd(&cli, args).await,
        Cmd::Allocate(args) => allocate_cmd(&cli, args).await,
        Cmd::Release(args) => release_cmd(&cli, args).await,
        Cmd::Record(args) => record_cmd(&cli, args).await,
    }
}

/// `fairplace record`: one segment per server address, written as it
/// arrives (what came before an error is whole and replays).
async fn record_cmd(cli: &Cli, args: &RecordArgs) -> Result<(), String> {
    let tls: TlsOptions = cli.tls.clone().into();
    let addrs: Vec<&str> = cli
        .server
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect();
    let one = addrs.len() == 1;
    let calls = addrs.iter().enumerate().map(|(i, addr)| {
        let dir = if one {
            args.dir.clone()
        } else {
            args.dir.join(format!("replica-{i}"))
        };
        let tls = &tls;
        async move {
            let mut c = Client::connect_tls(addr, tls)
                .await
                .map_err(|e| format!("cannot connect to {addr}: {e}"))?
                .with_token(cli.token.clone());
            c.deadline = Duration::from_millis(cli.deadline_ms);
            record_one(&c, addr, &dir, args).await
        }
    });
    let mut failed = Vec::new();
    for r in futures_util::future::join_all(calls).await {
        match r {
            Ok(line) => println!("{line}"),
            Err(e) => failed.push(e),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

async fn record_one(
    c: &Client,
    addr: &str,
    dir: &Path,
    args: &RecordArgs,
) -> Result<String, String> {
    use std::io::Write;
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    // The next number after any segment already there: a second recording
    // into the same folder adds to it.
    let next = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_suffix(".fprec")?
                .parse::<u64>()
                .ok()
        })
        .max()
        .unwrap_or(0)
        + 1;
    let path = dir.join(format!("{next:08}.fprec"));
    let mut stream = c
        .record(args.seconds, args.max_bytes)
        .await
        .map_err(status)?;
    let mut f = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut bytes = 0u64;
    loop {
        match stream.message().await {
            Ok(Some(chunk)) => {
                f.write_all(&chunk.data)
                    .map_err(|e| format!("{}: {e}", path.display()))?;
                bytes += chunk.data.len() as u64;
            }
            Ok(None) => break,
            Err(s) => {
                return Err(format!(
                    "{addr}: {} (the {bytes} bytes before it are in {})",
                    status(s),
                    path.display()
                ));
            }
        }
    }
    Ok(format!(
        "recorded {bytes} bytes from {addr} in {}",
        path.display()
    ))
}

/// `fairplace run`: lease, run CMD on the lease, exit with its status.
async fn run_cmd(cli: &Cli, args: &RunArgs) -> Result<(), String> {
    let o = run::RunOptions {
        node: args.node.clone(),
        count: args.cpus,
        policy: args.policy.clone(),
        cgroup: args.cgroup.clone(),
        holder: format!("fairplace run (pid {})", std::process::id()),
        ttl_ms: args.ttl_ms,
        timeout: Duration::from_millis(args.timeout_ms),
        cmd: args.cmd.clone(),
        textfile_dir: args.textfile_dir.clone().or_else(|| {
            let usual = PathBuf::from("/var/lib/node_exporter/textfile_collector");
            usual.is_dir().then_some(usual)
        }),
    };
    let client = tokio::time::timeout(o.timeout, connect(cli))
        .await
        .ok()
        .and_then(Result::ok);
    let code = run::run(client.as_ref(), &o).await?;
    std::process::exit(code);
}

async fn allocate_cmd(cli: &Cli, args: &AllocateArgs) -> Result<(), String> {
    let c = connect(cli).await?;
    let target = match (args.pid, &args.cgroup) {
        (Some(p), _) => Some(pb::apply_target::Target::Pid(p)),
        (_, Some(g)) => Some(pb::apply_target::Target::Cgroup(g.clone())),
        _ => None,
    };
    let r = c
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: args.node.clone(),
            count: args.cpus,
            policy: args.policy.clone(),
            holder: args.holder.clone(),
            ttl_ms: args.ttl_ms,
            apply: target.map(|t| pb::ApplyTarget { target: Some(t) }),
            request_id: args.request_id.clone(),
            ..Default::default()
        })
        .await
        .map_err(status)?;
    let paths: Vec<_> = r
        .per_cpu
        .iter()
        .map(|c| json!({"cpu": c.cpu, "path": c.path}))
        .collect();
    println!(
        "{}",
        json!({"lease_id": r.lease_id, "node_id": r.node_id, "cpus": r.cpus,
        "policy": r.policy, "ttl_ms": r.ttl_ms, "applied": r.applied,
        "per_cpu": paths, "scanned": r.scanned, "explanation": r.explanation})
    );
    Ok(())
}

async fn release_cmd(cli: &Cli, args: &ReleaseArgs) -> Result<(), String> {
    let c = connect(cli).await?;
    let r = c.release_cpus(args.lease_id).await.map_err(status)?;
    println!(
        "released lease {}: node {} CPUs {}",
        args.lease_id, r.node_id, r.cpus
    );
    Ok(())
}

/// A node's leases as JSON.
fn lease_json(leases: &[pb::Lease]) -> serde_json::Value {
    leases
        .iter()
        .map(|l| {
            json!({"lease_id": l.lease_id, "cpus": l.cpus, "policy": l.policy, "holder": l.holder,
            "owner": l.owner, "expires_in_ms": l.expires_in_ms, "applied": l.applied})
        })
        .collect()
}

/// A node's leases as a table (nothing without leases).
fn lease_table(leases: &[pb::Lease]) -> String {
    if leases.is_empty() {
        return String::new();
    }
    let rows: Vec<Vec<String>> = leases
        .iter()
        .map(|l| {
            vec![
                l.lease_id.to_string(),
                l.cpus.clone(),
                l.policy.clone(),
                l.holder.clone(),
                l.owner.clone(),
                l.expires_in_ms.to_string(),
                l.applied.to_string(),
            ]
        })
        .collect();
    let head = [
        "lease",
        "cpus",
        "policy",
        "holder",
        "owner",
        "expires_ms",
        "applied",
    ];
    format!("leases:\n{}", render(&head, &rows))
}

async fn pick_cmd(cli: &Cli, args: &PickArgs) -> Result<(), String> {
    let PickArgs {
        node,
        kind: k,
        this_cpu,
        prev_cpu,
        sync,
        claim,
        count,
        task: t,
    } = args;
    let c = connect(cli).await?;
    let req = pb::PickCpuRequest {
        node_id: node.clone(),
        task: Some(task(t, prev_cpu.or(Some(*this_cpu)))?),
        kind: kind(k)? as i32,
        this_cpu: *this_cpu,
        sync: *sync,
        claim: *claim,
        ..Default::default()
    };
    // More than one: all on one PickCpus stream, answered in order.
    let answers = if *count > 1 {
        c.pick_cpus(vec![req; *count as usize])
            .await
            .map_err(status)?
    } else {
        vec![c.pick_cpu(req).await]
    };
    let mut rows = Vec::new();
    let mut out = Vec::new();
    for r in answers {
        let r = r.map_err(status)?;
        rows.push(vec![
            r.cpu.to_string(),
            r.path.clone(),
            r.scanned.to_string(),
            r.state_version.to_string(),
            format!("{:.3}", r.state_age_seconds),
        ]);
        out.push(json!({"cpu": r.cpu, "path": r.path, "scanned": r.scanned,
            "state_version": r.state_version, "state_age_seconds": r.state_age_seconds}));
    }
    if cli.json {
        for o in out {
            println!("{o}");
        }
    } else {
        print!(
            "{}",
            render(&["cpu", "path", "scanned", "version", "age_s"], &rows)
        );
    }
    Ok(())
}

async fn migrate_cmd(cli: &Cli, args: &MigrateArgs) -> Result<(), String> {
    let MigrateArgs {
        node,
        src,
        dst,
        sd_level,
        idle,
        nr_balance_failed,
        running,
        task: t,
    } = args;
    let c = connect(cli).await?;
    let mut tk = task(t, None)?;
    tk.running = *running;
    let idle = match idle.as_str() {
        "idle" => pb::IdleType::Idle,
        "not_idle" => pb::IdleType::NotIdle,
        "newly_idle" => pb::IdleType::NewlyIdle,
        i => {
            return Err(format!(
                "--idle {i:?}: expected idle, not_idle or newly_idle"
            ));
        }
    };
    let r = c
        .can_migrate(pb::CanMigrateRequest {
            node_id: node.clone(),
            task: Some(tk),
            src_cpu: *src,
            dst_cpu: *dst,
            sd_level: sd_level.clone(),
            idle: idle as i32,
            nr_balance_failed: *nr_balance_failed,
            ..Default::default()
        })
        .await
        .map_err(status)?;
    if cli.json {
        println!(
            "{}",
            json!({"allowed": r.allowed, "new_dst_cpu": r.new_dst_cpu, "flags": r.flags,
                "reason": r.reason, "task_hot": r.task_hot, "state_version": r.state_version})
        );
    } else {
        print!(
            "{}",
            render(
                &["allowed", "reason", "new_dst_cpu", "flags", "task_hot"],
                &[vec![
                    r.allowed.to_string(),
                    r.reason,
                    r.new_dst_cpu.map_or("-".into(), |c| c.to_string()),
                    r.flags.join(","),
                    r.task_hot.map_or("-".into(), |h| h.to_string()),
                ]]
            )
        );
    }
    Ok(())
}

async fn balance_cmd(cli: &Cli, args: &BalanceArgs) -> Result<(), String> {
    let BalanceArgs {
        node,
        cluster,
        cpus,
        honor_intervals,
        apply,
        max,
    } = args;
    let c = connect(cli).await?;
    let mut req = pb::BalanceRequest {
        cpus: cpus.clone(),
        honor_intervals: *honor_intervals,
        apply: *apply,
        max_proposals: *max,
        ..Default::default()
    };
    match (node, cluster) {
        (Some(n), None) => req.node_id = n.clone(),
        (None, Some(spec)) => {
            let (level, group) = spec
                .split_once('=')
                .ok_or_else(|| format!("--cluster {spec:?}: expected LEVEL=PATH"))?;
            req.cluster_level = level.to_string();
            req.cluster_group = group.to_string();
        }
        _ => return Err("name a node, or --cluster LEVEL=PATH (not both)".into()),
    }
    let r = c.balance(req).await.map_err(status)?;
    if cli.json {
        for p in &r.proposals {
            println!(
                "{}",
                json!({"task": p.task, "group": p.group, "src_node": p.src_node,
                    "src_cpu": p.src_cpu, "dst_node": p.dst_node, "dst_cpu": p.dst_cpu,
                    "migration_type": migration_type_name(p.migration_type), "kind": p.kind,
                    "level": p.level, "busiest_group": p.busiest_group, "local_group": p.local_group,
                    "imbalance": p.imbalance, "forced_hot": p.forced_hot,
                    "llc_preference": p.llc_preference, "reason": p.reason})
            );
        }
    } else {
        let rows: Vec<Vec<String>> = r
            .proposals
            .iter()
            .map(|p| {
                vec![
                    p.task.to_string(),
                    p.group.to_string(),
                    format!("{}/{}", p.src_node, p.src_cpu),
                    format!("{}/{}", p.dst_node, p.dst_cpu),
                    migration_type_name(p.migration_type).into(),
                    p.kind.clone(),
                    p.level.clone(),
                    format!("{}>{}", p.busiest_group, p.local_group),
                    p.imbalance.to_string(),
                    if p.forced_hot { "yes" } else { "no" }.into(),
                    if p.llc_preference { "yes" } else { "no" }.into(),
                ]
            })
            .collect();
        print!(
            "{}",
            render(
                &[
                    "task",
                    "process",
                    "from",
                    "to",
                    "type",
                    "kind",
                    "level",
                    "groups",
                    "imbalance",
                    "hot",
                    "llc_pref"
                ],
                &rows
            )
        );
        let rej: Vec<String> = r
            .rejections
            .iter()
            .map(|x| format!("{}={}", x.reason, x.count))
            .collect();
        println!(
            "{} proposals; domains balanced {}, declined {}; refused: {}{}",
            r.proposals.len(),
            r.domains_balanced,
            r.domains_declined,
            if rej.is_empty() {
                "none".into()
            } else {
                rej.join(" ")
            },
            if *apply {
                format!("; {} claimed", r.claimed)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

async fn cache_cmd(cli: &Cli, args: &CacheArgs) -> Result<(), String> {
    let CacheArgs { node } = args;
    let c = connect(cli).await?;
    let r = c.get_cache(node).await.map_err(status)?;
    if cli.json {
        let procs: Vec<_> = r
            .processes
            .iter()
            .map(|p| {
                json!({"group": p.group, "preferred_cpu": p.preferred_cpu,
                    "preferred_llc": p.preferred_llc, "nr_threads": p.nr_threads,
                    "nr_running_avg": p.nr_running_avg, "occupancy": p.occupancy})
            })
            .collect();
        println!(
            "{}",
            json!({"enabled": r.enabled, "strategy": r.strategy, "node_limited": r.node_limited,
                "tasks_with_preference": r.tasks_with_preference,
                "tasks_on_preferred_llc": r.tasks_on_preferred_llc,
                "scan_passes": r.scan_passes, "cpus_scanned": r.cpus_scanned,
                "preference_changes": r.preference_changes, "processes": procs})
        );
    } else {
        println!(
            "cache-aware: {}, scan {}{}; {} passes, {} CPUs scanned, {} preference changes; tasks on preferred LLC {}/{}",
            if r.enabled { "on" } else { "off" },
            r.strategy,
            if r.node_limited {
                " (NUMA-node limited)"
            } else {
                ""
            },
            r.scan_passes,
            r.cpus_scanned,
            r.preference_changes,
            r.tasks_on_preferred_llc,
            r.tasks_with_preference
        );
        let llcs: Vec<String> = r
            .llcs
            .iter()
            .map(|l| format!("llc{}={}", l.index, l.cpus))
            .collect();
        println!("{}", llcs.join(" "));
        let mut header: Vec<String> = vec![
            "process".into(),
            "threads".into(),
            "running_avg".into(),
            "pref_cpu".into(),
            "pref_llc".into(),
        ];
        header.extend(r.llcs.iter().map(|l| format!("occ_llc{}", l.index)));
        let rows: Vec<Vec<String>> = r
            .processes
            .iter()
            .map(|p| {
                let mut row = vec![
                    p.group.to_string(),
                    p.nr_threads.to_string(),
                    p.nr_running_avg.to_string(),
                    p.preferred_cpu.map_or("-".into(), |c| c.to_string()),
                    p.preferred_llc.map_or("-".into(), |c| c.to_string()),
                ];
                // Occupancy in CPUs' worth (2^20 = one CPU fully).
                row.extend(
                    p.occupancy
                        .iter()
                        .map(|o| format!("{:.2}", *o as f64 / (1u64 << 20) as f64)),
                );
                row
            })
            .collect();
        let h: Vec<&str> = header.iter().map(String::as_str).collect();
        print!("{}", render(&h, &rows));
    }
    Ok(())
}

async fn nodes_cmd(cli: &Cli) -> Result<(), String> {
    let c = connect(cli).await?;
    let nodes = c.list_nodes().await.map_err(status)?;
    if cli.json {
        for n in &nodes {
            println!(
                "{}",
                json!({"id": n.id, "labels": n.labels, "cpus": n.cpus, "online_cpus": n.online_cpus,
                    "idle_cpus": n.idle_cpus, "age_seconds": n.age_seconds, "fresh": n.fresh,
                    "connected": n.connected, "state_version": n.state_version,
                    "signal_source": signal_name(n.signal_source), "exact_signals": n.exact_signals})
            );
        }
    } else {
        let rows: Vec<Vec<String>> = nodes
            .iter()
            .map(|n| {
                let mut labels: Vec<String> =
                    n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                labels.sort();
                vec![
                    n.id.clone(),
                    n.cpus.to_string(),
                    n.online_cpus.to_string(),
                    n.idle_cpus.to_string(),
                    format!("{:.2}", n.age_seconds),
                    if n.fresh { "fresh" } else { "stale" }.into(),
                    if n.connected { "yes" } else { "no" }.into(),
                    signal_name(n.signal_source).into(),
                    labels.join(","),
                ]
            })
            .collect();
        print!(
            "{}",
            render(
                &[
                    "node", "cpus", "online", "idle", "age_s", "state", "agent", "signals",
                    "labels"
                ],
                &rows
            )
        );
    }
    Ok(())
}

async fn node_cmd(cli: &Cli, args: &NodeArgs) -> Result<(), String> {
    let NodeArgs { id } = args;
    let c = connect(cli).await?;
    let n = c.get_node(id).await.map_err(status)?;
    let topo = n.topology.unwrap_or_default();
    if cli.json {
        let cpus: Vec<_> = n
            .cpus
            .iter()
            .map(|s| {
                json!({"id": s.id, "online": s.online, "nr_running": s.nr_running,
                "h_nr_idle": s.h_nr_idle, "util_avg": s.util_avg, "load_avg": s.load_avg,
                "runnable_avg": s.runnable_avg, "util_est": s.util_est, "nr_delayed": s.nr_delayed,
                "cfs_h_nr_queued": s.cfs_h_nr_queued, "idle_stamp": s.idle_stamp,
                "idle_exit_latency": s.idle_exit_latency})
            })
            .collect();
        println!(
            "{}",
            json!({"id": id, "last_seq": n.last_seq, "agent_version": n.agent_version,
            "signal_source": n.summary.as_ref().map(|s| signal_name(s.signal_source)),
            "exact_signals": n.summary.as_ref().map(|s| s.exact_signals),
            "claims": n.claims, "cpus": cpus, "leases": lease_json(&n.leases)})
        );
    } else {
        let rows: Vec<Vec<String>> = n
            .cpus
            .iter()
            .zip(&topo.cpus)
            .map(|(s, t)| {
                vec![
                    s.id.to_string(),
                    t.core.to_string(),
                    t.llc.to_string(),
                    t.node.to_string(),
                    if s.online { "yes" } else { "no" }.into(),
                    s.nr_running.to_string(),
                    s.h_nr_idle.to_string(),
                    s.util_avg.to_string(),
                    n.claims.get(&s.id).map_or("0".into(), |k| k.to_string()),
                ]
            })
            .collect();
        let (source, exact) = n
            .summary
            .as_ref()
            .map_or((0, false), |s| (s.signal_source, s.exact_signals));
        println!(
            "node {id}: agent {} seq {} signals {} ({})",
            n.agent_version,
            n.last_seq,
            signal_name(source),
            if exact { "exact" } else { "approximate" }
        );
        print!(
            "{}",
            render(
                &[
                    "cpu",
                    "core",
                    "llc",
                    "numa",
                    "online",
                    "nr_running",
                    "sched_idle",
                    "util",
                    "claims"
                ],
                &rows
            )
        );
        print!("{}", lease_table(&n.leases));
    }
    Ok(())
}

async fn features_cmd(cli: &Cli, args: &FeaturesArgs) -> Result<(), String> {
    let FeaturesArgs {
        node,
        set,
        clear_overrides,
    } = args;
    let c = connect(cli).await?;
    let f = if set.is_empty() && !clear_overrides {
        c.get_features(node).await.map_err(status)?
    } else {
        let mut map = std::collections::HashMap::new();
        for s in set {
            let (k, v) = s
                .split_once('=')
                .ok_or_else(|| format!("--set {s:?}: expected NAME=on|off"))?;
            let on = match v {
                "on" | "true" | "1" => true,
                "off" | "false" | "0" => false,
                _ => return Err(format!("--set {s:?}: expected on or off")),
            };
            map.insert(k.to_string(), on);
        }
        c.set_features(pb::SetFeaturesRequest {
            node_id: node.clone(),
            set: map,
            clear_overrides: *clear_overrides,
        })
        .await
        .map_err(status)?
    };
    let mut names: Vec<(&String, &bool)> = f.features.iter().collect();
    names.sort();
    if cli.json {
        println!(
            "{}",
            json!({"features": f.features, "overridden": f.overridden})
        );
    } else {
        let rows: Vec<Vec<String>> = names
            .iter()
            .map(|(k, v)| {
                vec![
                    k.to_string(),
                    if **v { "on" } else { "off" }.into(),
                    if f.overridden.contains(k) { "node" } else { "" }.into(),
                ]
            })
            .collect();
        print!("{}", render(&["feature", "value", "set_for"], &rows));
    }
    Ok(())
}

async fn decide_cmd(cli: &Cli, args: &DecideArgs) -> Result<(), String> {
    let DecideArgs { file } = args;
    let c = connect(cli).await?;
    let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
    let mut bad = 0;
    for item in fairplace_types::input::split_input(&text) {
        let line = match item {
            Ok(v) => match c.decide(&v.to_string()).await {
                Ok(a) => a,
                Err(s) => {
                    bad += 1;
                    json!({"error": s.message()}).to_string()
                }
            },
            Err(e) => {
                bad += 1;
                json!({"error": e.to_string()}).to_string()
            }
        };
        println!("{line}");
    }
    if bad > 0 {
        return Err(format!("{bad} scenario(s) were invalid"));
    }
    Ok(())
}

/// A node's signal source as `fairplace nodes` and `fairplace node` print it.
fn signal_name(source: i32) -> &'static str {
    fairplace_host::signal_source_name(source)
}
