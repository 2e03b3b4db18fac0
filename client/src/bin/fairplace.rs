//! The fairplace CLI: ask a server for placements and migration checks, look
//! at its nodes and features, and `demo`, which runs a server with a local
//! agent and makes a few real decisions.

use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use fairplace_client::agent::{Machine, Simulated, StreamConfig, StreamStats, stream};
use fairplace_client::table::render;
use fairplace_client::{Client, pb};
use serde_json::json;
use tokio::sync::watch;

#[derive(Parser)]
#[command(name = "fairplace", version, about = "fairplace placement client")]
struct Cli {
    /// Server gRPC address.
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
    tls: fairplace_client::TlsArgs,
    #[command(subcommand)]
    cmd: Cmd,
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
    Pick {
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
        /// Ask this many times (with --claim: distinct CPUs while idle ones last).
        #[arg(long, default_value_t = 1)]
        count: u32,
        #[command(flatten)]
        task: TaskArgs,
    },
    /// CanMigrate: may the balancer move the task from src to dst?
    Migrate {
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
    },
    /// List the registered nodes.
    Nodes,
    /// One node's topology and per-CPU state.
    Node { id: String },
    /// Show or set features: --set NAME=on|off (repeatable), --node for one node.
    Features {
        #[arg(long, default_value = "")]
        node: String,
        #[arg(long = "set")]
        set: Vec<String>,
        #[arg(long)]
        clear_overrides: bool,
    },
    /// Load-balance proposals for a node (Balance RPC), or with --cluster
    /// LEVEL=PATH across a rack or zone (e.g. --cluster rack=z1/r2).
    Balance {
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
    },
    /// A node's cache-aware state: per-process LLC preference and occupancy.
    Cache { node: String },
    /// Decide a scenario file: with --server on the server (Decide RPC).
    Decide { file: String },
    /// Start a server and an agent for this machine, make a few real
    /// decisions against the live state, and keep serving for a while.
    Demo {
        /// gRPC port for the demo server (0: any free port).
        #[arg(long, default_value_t = 50051)]
        grpc_port: u16,
        /// /metrics port (0: any free port).
        #[arg(long, default_value_t = 9464)]
        metrics_port: u16,
        /// Keep serving this long after the decisions (s).
        #[arg(long, default_value_t = 20)]
        linger_s: u64,
    },
}

fn migration_type_name(t: i32) -> &'static str {
    match pb::MigrationType::try_from(t) {
        Ok(pb::MigrationType::Load) => "load",
        Ok(pb::MigrationType::Util) => "util",
        Ok(pb::MigrationType::Task) => "task",
        Ok(pb::MigrationType::Misfit) => "misfit",
        Ok(pb::MigrationType::LlcTask) => "llc_task",
        Err(_) => "?",
    }
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
    let tls: fairplace_client::TlsOptions = cli.tls.clone().into();
    let mut c = Client::connect_tls(&cli.server, &tls)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", cli.server))?
        .with_token(cli.token.clone());
    c.deadline = Duration::from_millis(cli.deadline_ms);
    Ok(c)
}

fn status(s: tonic::Status) -> String {
    format!("{:?}: {}", s.code(), s.message())
}

async fn run(cli: Cli) -> Result<(), String> {
    match &cli.cmd {
        Cmd::Demo {
            grpc_port,
            metrics_port,
            linger_s,
        } => demo(*grpc_port, *metrics_port, *linger_s).await,
        Cmd::Pick {
            node,
            kind: k,
            this_cpu,
            prev_cpu,
            sync,
            claim,
            count,
            task: t,
        } => {
            let c = connect(&cli).await?;
            let req = pb::PickCpuRequest {
                node_id: node.clone(),
                task: Some(task(t, prev_cpu.or(Some(*this_cpu)))?),
                kind: kind(k)? as i32,
                this_cpu: *this_cpu,
                sync: *sync,
                claim: *claim,
                ..Default::default()
            };
            let mut rows = Vec::new();
            let mut out = Vec::new();
            for _ in 0..*count {
                let r = c.pick_cpu(req.clone()).await.map_err(status)?;
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
        Cmd::Migrate {
            node,
            src,
            dst,
            sd_level,
            idle,
            nr_balance_failed,
            running,
            task: t,
        } => {
            let c = connect(&cli).await?;
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
        Cmd::Balance {
            node,
            cluster,
            cpus,
            honor_intervals,
            apply,
            max,
        } => {
            let c = connect(&cli).await?;
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
        Cmd::Cache { node } => {
            let c = connect(&cli).await?;
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
        Cmd::Nodes => {
            let c = connect(&cli).await?;
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
        Cmd::Node { id } => {
            let c = connect(&cli).await?;
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
                    "claims": n.claims, "cpus": cpus})
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
            }
            Ok(())
        }
        Cmd::Features {
            node,
            set,
            clear_overrides,
        } => {
            let c = connect(&cli).await?;
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
        Cmd::Decide { file } => {
            let c = connect(&cli).await?;
            let text = std::fs::read_to_string(file).map_err(|e| format!("{file}: {e}"))?;
            let mut bad = 0;
            for item in fairplace::scenario::split_input(&text) {
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
    }
}

/// The main job: server, agent and a few real decisions, on defaults.
async fn demo(grpc_port: u16, metrics_port: u16, linger_s: u64) -> Result<(), String> {
    // The usual ports, or any free one when something else holds them.
    let grpc = match tokio::net::TcpListener::bind(("127.0.0.1", grpc_port)).await {
        Ok(l) => l,
        Err(_) => tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| format!("bind a gRPC port: {e}"))?,
    };
    let grpc_addr = grpc.local_addr().map_err(|e| e.to_string())?;
    let probe = std::net::TcpListener::bind(("127.0.0.1", metrics_port))
        .or_else(|_| std::net::TcpListener::bind(("127.0.0.1", 0)))
        .map_err(|e| format!("bind a metrics port: {e}"))?;
    let metrics_addr = probe.local_addr().map_err(|e| e.to_string())?;
    drop(probe);
    fairplace::service::install_metrics(metrics_addr)?;
    let (stop_tx, mut stop_rx) = watch::channel(false);
    let server = tokio::spawn(fairplace::service::serve(
        fairplace::service::ServeConfig::default(),
        grpc,
        async move {
            let _ = stop_rx.changed().await;
        },
    ));

    // A busy thread stands in for a task that is running and will exec, so
    // the live state has a CPU an exec can come from.
    let spin = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let spinner = {
        let spin = std::sync::Arc::clone(&spin);
        std::thread::spawn(move || {
            let mut x = 0u64;
            while spin.load(std::sync::atomic::Ordering::Relaxed) {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        })
    };
    let machine = Machine::local()
        .map_err(|e| format!("reading this machine's topology: {e}"))?
        .with_task_cap(32);
    let n = machine.nr_cpus() as u32;
    let node_id = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into());
    let (agent_stop_tx, agent_stop) = watch::channel(false);
    let (stats_tx, _stats) = watch::channel(StreamStats::default());
    let agent = tokio::spawn(stream(
        StreamConfig {
            server: grpc_addr.to_string(),
            node_id: node_id.clone(),
            labels: vec![("zone".into(), "local".into())],
            interval: Duration::from_millis(250),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_message_bytes: 4 << 20,
            tls: Default::default(),
        },
        machine,
        agent_stop.clone(),
        stats_tx,
    ));

    // A simulated node with task lists beside it, so the balancer has work:
    // this machine's own kernel keeps it balanced already.
    let sim_id = format!("{node_id}-sim16");
    let mut sim = Simulated::new(16, 7);
    sim.tasks = true;
    sim.llc_cpus = Some(8);
    sim.churn_pct = 25;
    let (sim_stats_tx, _sim_stats) = watch::channel(StreamStats::default());
    let sim_agent = tokio::spawn(stream(
        StreamConfig {
            server: grpc_addr.to_string(),
            node_id: sim_id.clone(),
            labels: vec![("zone".into(), "sim".into())],
            interval: Duration::from_millis(250),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_secs(2),
            max_message_bytes: 4 << 20,
            tls: Default::default(),
        },
        sim,
        agent_stop.clone(),
        sim_stats_tx,
    ));

    let client = Client::connect(&grpc_addr.to_string())
        .await
        .map_err(|e| e.to_string())?;
    // Wait for the agent's first full snapshot and one delta on top of it,
    // so util reflects a measured interval.
    let t0 = Instant::now();
    loop {
        let seq = |id: &str| {
            let c = &client;
            let id = id.to_string();
            async move { c.get_node(&id).await.map_or(0, |n| n.last_seq) }
        };
        if seq(&node_id).await >= 2 && seq(&sim_id).await >= 2 {
            break;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            return Err("the local agent did not report within 10 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let last = n - 1;
    // exec needs a CPU that runs a task (the exec'ing one) in the state.
    let exec_cpu = client
        .get_node(&node_id)
        .await
        .ok()
        .and_then(|nd| {
            nd.cpus
                .iter()
                .find(|c| c.online && c.nr_running > 0)
                .map(|c| c.id)
        })
        .unwrap_or(0);
    let asks: Vec<(&str, pb::PickCpuRequest)> = vec![
        (
            "wakeup, last ran on CPU 0",
            pick(&node_id, pb::RequestKind::Wakeup, 0, Some(0), "", false),
        ),
        (
            "sync wakeup from the last CPU",
            pb::PickCpuRequest {
                sync: true,
                ..pick(&node_id, pb::RequestKind::Wakeup, last, Some(0), "", false)
            },
        ),
        (
            "fork on CPU 0",
            pick(&node_id, pb::RequestKind::Fork, 0, None, "", false),
        ),
        (
            "exec from a busy CPU",
            pick(&node_id, pb::RequestKind::Exec, exec_cpu, None, "", false),
        ),
        (
            "exec bound to that CPU",
            pick(
                &node_id,
                pb::RequestKind::Exec,
                exec_cpu,
                None,
                &exec_cpu.to_string(),
                false,
            ),
        ),
        (
            "fork with no node (cluster)",
            pb::PickCpuRequest {
                node_id: String::new(),
                ..pick(&node_id, pb::RequestKind::Fork, 0, None, "", false)
            },
        ),
        (
            "claimed wakeup #1",
            pick(&node_id, pb::RequestKind::Wakeup, 0, Some(0), "", true),
        ),
        (
            "claimed wakeup #2",
            pick(&node_id, pb::RequestKind::Wakeup, 0, Some(0), "", true),
        ),
    ];
    let mut rows = Vec::new();
    for (what, req) in asks {
        let row = match client.pick_cpu(req).await {
            Ok(r) => vec![
                what.to_string(),
                r.node_id.clone(),
                r.cpu.to_string(),
                r.path,
                r.scanned.to_string(),
                r.state_version.to_string(),
                format!("{:.3}", r.state_age_seconds),
            ],
            Err(s) => vec![
                what.to_string(),
                "-".into(),
                status(s),
                "".into(),
                "".into(),
                "".into(),
            ],
        };
        rows.push(row);
    }
    println!("fairplace demo: node {node_id} ({n} CPUs) reported by the local agent\n");
    print!(
        "{}",
        render(
            &[
                "request", "node", "cpu", "path", "scanned", "state", "age_s"
            ],
            &rows
        )
    );
    spin.store(false, std::sync::atomic::Ordering::Relaxed);
    let _ = spinner.join();
    for (what, id) in [("this machine", &node_id), ("the simulated node", &sim_id)] {
        let r = client
            .balance(pb::BalanceRequest {
                node_id: id.clone(),
                ..Default::default()
            })
            .await
            .map_err(status)?;
        println!(
            "\nload balance of {what} ({id}): {} proposals, {} domains balanced, {} declined by should_we_balance",
            r.proposals.len(),
            r.domains_balanced,
            r.domains_declined
        );
        let rows: Vec<Vec<String>> = r
            .proposals
            .iter()
            .map(|p| {
                vec![
                    p.task.to_string(),
                    format!("{} -> {}", p.src_cpu, p.dst_cpu),
                    migration_type_name(p.migration_type).into(),
                    p.level.clone(),
                    p.reason.clone(),
                ]
            })
            .collect();
        if !rows.is_empty() {
            print!(
                "{}",
                render(&["task", "cpus", "type", "level", "why"], &rows)
            );
        }
    }
    if let Ok(c) = client.get_cache(&sim_id).await {
        println!(
            "\ncache-aware scheduling on {sim_id}: {} processes tracked, {} with a preferred LLC; {} task_cache_work passes read {} CPUs",
            c.processes.len(),
            c.processes
                .iter()
                .filter(|p| p.preferred_llc.is_some())
                .count(),
            c.scan_passes,
            c.cpus_scanned
        );
    }
    println!("\ngRPC:    {grpc_addr}   (try: fairplace --server {grpc_addr} nodes)");
    println!("metrics: http://{metrics_addr}/metrics");
    if linger_s > 0 {
        println!("serving for {linger_s} s more; Ctrl-C stops it now");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(linger_s)) => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    agent_stop_tx.send(true).ok();
    let _ = agent.await;
    let _ = sim_agent.await;
    stop_tx.send(true).ok();
    let _ = server.await;
    Ok(())
}

fn pick(
    node: &str,
    kind: pb::RequestKind,
    this_cpu: u32,
    prev: Option<u32>,
    allowed: &str,
    claim: bool,
) -> pb::PickCpuRequest {
    pb::PickCpuRequest {
        node_id: node.to_string(),
        task: Some(pb::Task {
            prev_cpu: prev,
            cpus_allowed: allowed.to_string(),
            util_avg: 200,
            load_avg: 300,
            ..Default::default()
        }),
        kind: kind as i32,
        this_cpu,
        claim,
        ..Default::default()
    }
}

/// A node's signal source as `fairplace nodes` and `fairplace node` print it.
fn signal_name(source: i32) -> &'static str {
    fairplace_client::agent::signal::name(source)
}
