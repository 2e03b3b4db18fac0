//! Differential test of the load balancer: the real server's `Balance` RPC
//! against an independent Python model of the kernel's periodic balancer
//! (tests/oracle_balance/model.py, written from fair.c and topology.c), on
//! random nodes from tests/oracle_balance/gen.py: SMT1/2/4/8, 1-4 LLCs, 1-2
//! NUMA nodes, 4-64 CPUs, several tasks per CPU, idle CPUs, pinned and partly
//! pinned tasks, per-CPU kthreads, nice-weighted loads, symmetric capacity.
//!
//! Every node gets a fresh node id, so each `Balance` is a fresh on-demand
//! pass (all domains, `nr_balance_failed` 0, no `sgc->imbalance` set). The
//! model's moves are collapsed the way the RPC reports a pass (one proposal
//! per task, first source to last destination, a task that came back left
//! out); each proposal's task, source, destination, migration type, kind and
//! level must agree, in order. Every disagreement is printed with its node
//! and the model's uncollapsed moves.
//!
//! `FAIRPLACE_BALANCE_SEED` (default 2026) and `FAIRPLACE_BALANCE_COUNT`
//! (default 400) choose the nodes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use fairplace_e2e::{Server, pb};
use serde_json::Value;
use tokio::sync::mpsc;

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("oracle_balance")
}

fn python(args: &[&str]) -> String {
    let out = Command::new("python3")
        .args(args)
        .current_dir(model_dir())
        .output()
        .expect("python3 runs the balancer model");
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(s) if !s.trim().is_empty() => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={s:?} is not a number")),
        _ => default,
    }
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or(0)
}

fn i(v: &Value, k: &str) -> i64 {
    v[k].as_i64().unwrap_or(0)
}

fn topology(node: &Value) -> pb::Topology {
    let t = &node["topology"];
    pb::Topology {
        cpus: t["cpus"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| pb::CpuTopology {
                id: u(c, "id") as u32,
                core: u(c, "core") as u32,
                cluster: None,
                llc: u(c, "llc") as u32,
                node: u(c, "node") as u32,
                capacity: u(c, "capacity") as u32,
            })
            .collect(),
        numa_distance: t["numa_distance"]
            .as_array()
            .map(|rows| {
                rows.iter()
                    .map(|r| pb::DistanceRow {
                        distance: r
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|d| d.as_u64().unwrap() as u32)
                            .collect(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// A full snapshot: every CPU's state and task list, task clocks unknown
/// (every task cold).
fn update(node: &Value) -> pb::Update {
    let cpus = node["cpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| pb::CpuState {
            id: u(c, "id") as u32,
            online: true,
            nr_running: u(c, "nr_running") as u32,
            load_avg: i(c, "load_avg"),
            runnable_avg: i(c, "runnable_avg"),
            util_avg: i(c, "util_avg"),
            util_est: i(c, "util_est"),
            ..Default::default()
        })
        .collect();
    let tasks = node["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| pb::CpuTasks {
            cpu: u(l, "cpu") as u32,
            tasks: l["tasks"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| pb::RunnableTask {
                    id: u(t, "id"),
                    group: u(t, "group"),
                    nice: i(t, "nice") as i32,
                    cpus_allowed: t["cpus_allowed"].as_str().unwrap_or("").to_string(),
                    load_avg: i(t, "load_avg"),
                    util_avg: i(t, "util_avg"),
                    util_est: i(t, "util_est"),
                    runnable_avg: i(t, "runnable_avg"),
                    running: t["running"].as_bool().unwrap_or(false),
                    exec_start: i(t, "exec_start"),
                    per_cpu_kthread: t["per_cpu_kthread"].as_bool().unwrap_or(false),
                    migration_disabled: t["migration_disabled"].as_bool().unwrap_or(false),
                    nr_threads: 1,
                    ..Default::default()
                })
                .collect(),
            clock_task: 0,
        })
        .collect();
    pb::Update {
        seq: 1,
        full: true,
        cpus,
        tasks,
        node_id: node["name"].as_str().unwrap().to_string(),
        ..Default::default()
    }
}

fn migration_name(m: i32) -> &'static str {
    match pb::MigrationType::try_from(m) {
        Ok(pb::MigrationType::Load) => "load",
        Ok(pb::MigrationType::Util) => "util",
        Ok(pb::MigrationType::Task) => "task",
        Ok(pb::MigrationType::Misfit) => "misfit",
        Ok(pb::MigrationType::LlcTask) => "llc_task",
        Err(_) => "?",
    }
}

/// (task, src, dst, migration_type, kind, level)
type Prop = (u64, u32, u32, String, String, String);

fn fmt_props(p: &[Prop]) -> String {
    if p.is_empty() {
        return "(none)".into();
    }
    p.iter()
        .map(|(t, s, d, m, k, l)| format!("task {t} {s}->{d} {m} {k} {l}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Registers the node on a Report stream of its own, sends its snapshot and
/// runs one Balance pass; the stream stays open until the pass is done.
async fn engine_pass(ch: &tonic::transport::Channel, node: &Value) -> Result<Vec<Prop>, String> {
    use pb::agent_message::Body;
    let id = node["name"].as_str().unwrap().to_string();
    let mut agent = pb::agent_service_client::AgentServiceClient::new(ch.clone());
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::AgentMessage {
        body: Some(Body::Register(pb::Register {
            node_id: id.clone(),
            labels: Default::default(),
            topology: Some(topology(node)),
            agent_version: "balance-diff".into(),
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let mut acks = agent
        .report(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|s| format!("register: {s}"))?
        .into_inner();
    let ack = acks
        .message()
        .await
        .map_err(|s| format!("register: {s}"))?
        .ok_or("register: stream closed")?;
    if let Some(r) = ack.rejection {
        return Err(format!("register rejected: {r:?}"));
    }
    tx.send(pb::AgentMessage {
        body: Some(Body::Update(update(node))),
    })
    .await
    .unwrap();
    let ack = acks
        .message()
        .await
        .map_err(|s| format!("update: {s}"))?
        .ok_or("update: stream closed")?;
    if let Some(r) = ack.rejection {
        return Err(format!("update rejected: {r:?}"));
    }
    let mut placement = pb::placement_service_client::PlacementServiceClient::new(ch.clone());
    let resp = placement
        .balance(pb::BalanceRequest {
            node_id: id,
            cpus: node["dst_cpus"].as_str().unwrap_or("").to_string(),
            honor_intervals: false,
            apply: false,
            max_proposals: 0,
            ..Default::default()
        })
        .await
        .map_err(|s| format!("balance: {s}"))?
        .into_inner();
    drop(tx);
    Ok(resp
        .proposals
        .iter()
        .map(|p| {
            (
                p.task,
                p.src_cpu,
                p.dst_cpu,
                migration_name(p.migration_type).to_string(),
                p.kind.clone(),
                p.level.clone(),
            )
        })
        .collect())
}

fn model_props(v: &Value, key: &str) -> Vec<Prop> {
    v[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                u(p, "task"),
                u(p, "src") as u32,
                u(p, "dst") as u32,
                p["migration_type"].as_str().unwrap().to_string(),
                p["kind"].as_str().unwrap().to_string(),
                p["level"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn shape_key(node: &Value) -> String {
    let s = &node["shape"];
    format!(
        "SMT{} {} LLC {} node{}",
        u(s, "smt"),
        u(s, "llcs"),
        u(s, "nodes"),
        if u(s, "nodes") > 1 { "s" } else { "" }
    )
}

#[test]
fn balance_agrees_with_the_kernel_model_on_random_nodes() {
    let seed = env_u64("FAIRPLACE_BALANCE_SEED", 2026);
    let count = env_u64("FAIRPLACE_BALANCE_COUNT", 400).max(1);
    eprintln!(
        "balance_diff: seed {seed} ({count} nodes); rerun with FAIRPLACE_BALANCE_SEED={seed}"
    );

    let nodes_text = python(&[
        "gen.py",
        "--seed",
        &seed.to_string(),
        "--count",
        &count.to_string(),
    ]);
    let file = std::env::temp_dir().join(format!(
        "fairplace-balance-diff-{seed}-{}.jsonl",
        std::process::id()
    ));
    std::fs::write(&file, &nodes_text).unwrap();
    let model_text = python(&["model.py", file.to_str().unwrap()]);
    std::fs::remove_file(&file).ok();

    let nodes: Vec<(&str, Value)> = nodes_text
        .lines()
        .map(|l| (l, serde_json::from_str(l).unwrap()))
        .collect();
    let expected: Vec<Value> = model_text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(nodes.len(), count as usize, "gen.py gave every node");
    assert_eq!(expected.len(), nodes.len(), "one model answer per node");

    let server = Server::start(&[]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let results: Vec<Result<Vec<Prop>, String>> = rt.block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect()
            .await
            .expect("connect to the server");
        let mut out = Vec::with_capacity(nodes.len());
        for (_, node) in &nodes {
            out.push(engine_pass(&ch, node).await);
        }
        out
    });

    let mut agree = 0usize;
    let mut proposals = 0usize;
    let mut by_shape: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    let mut failures = Vec::new();
    for (((line, node), want), got) in nodes.iter().zip(&expected).zip(results) {
        let name = node["name"].as_str().unwrap();
        assert_eq!(want["name"].as_str(), Some(name), "model answers in order");
        let hops = model_props(want, "migrations");
        let want = model_props(want, "proposals");
        let entry = by_shape.entry(shape_key(node)).or_default();
        entry.0 += 1;
        proposals += want.len();
        let got = match got {
            Ok(g) => g,
            Err(e) => {
                entry.1 += 1;
                failures.push(format!(
                    "{name}: the server refused the node: {e}\n  node: {line}"
                ));
                continue;
            }
        };
        if got == want {
            agree += 1;
            continue;
        }
        entry.1 += 1;
        let first = want
            .iter()
            .zip(&got)
            .position(|(a, b)| a != b)
            .unwrap_or(want.len().min(got.len()));
        failures.push(format!(
            "{name} ({}, dst_cpus {:?}): first difference at proposal {first}\n  model:  {}\n  engine: {}\n  model, every move in kernel order: {}\n  node: {line}",
            node["shape"],
            node["dst_cpus"].as_str().unwrap_or(""),
            fmt_props(&want),
            fmt_props(&got),
            fmt_props(&hops),
        ));
    }
    for f in &failures {
        eprintln!("DISAGREE {f}\n");
    }
    let table = by_shape
        .iter()
        .map(|(k, (n, bad))| format!("  {k}: {n} nodes, {bad} disagree"))
        .collect::<Vec<_>>()
        .join("\n");
    eprintln!(
        "balance_diff: seed {seed}: {agree} of {count} nodes agree ({proposals} model proposals)\n{table}"
    );
    assert!(
        failures.is_empty(),
        "{} of {count} nodes disagree (seed {seed}; each is printed above with its node):\n{table}",
        failures.len()
    );
}

/// The passes the live kernel ran that the balancer once answered
/// differently (tests/oracle_balance/kernel_cases.jsonl, recorded by the
/// kernel harness, docs/kernel-fidelity.md): each must replay, through
/// `decide`'s balance request, to the kernel's own outcome: the runqueues
/// walked, the migration type, the tasks detached.
#[test]
fn passes_the_live_kernel_ran_replay_to_the_kernels_outcome() {
    let text = std::fs::read_to_string(model_dir().join("kernel_cases.jsonl"))
        .expect("tests/oracle_balance/kernel_cases.jsonl");
    let detached = |v: &Value| {
        let mut d: Vec<(u64, u64, u64)> = v
            .as_array()
            .expect("a list")
            .iter()
            .map(|t| {
                let f = |k: &str| t[k].as_u64().expect("an id");
                (f("id"), f("src_cpu"), f("dst_cpu"))
            })
            .collect();
        d.sort_unstable();
        d
    };
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let s: Value = serde_json::from_str(line).expect("a scenario per line");
        let want = &s["expected"];
        let got = fairplace::offline::request::decide_value(&s).expect("decides");
        let name = s["name"].as_str().unwrap_or("?");
        let why = s["generator"]["why"].as_str().unwrap_or("");
        assert_eq!(got["busiest"], want["busiest"], "{name} ({why}): {got}");
        if want["busiest"].as_array().is_some_and(|b| !b.is_empty()) {
            assert_eq!(
                got["migration_type"], want["migration_type"],
                "{name} ({why}): {got}"
            );
        }
        assert_eq!(
            detached(&got["detached"]),
            detached(&want["detached"]),
            "{name} ({why}): {got}"
        );
        n += 1;
    }
    assert!(n >= 3, "only {n} recorded kernel passes");
}
