//! The real agent, server and CLI binaries together on loopback.

use std::process::Command;
use std::time::Duration;

use fairplace_client::Client;
use fairplace_e2e::{Agent, Server, bin, cli, http_get, pb, rt, scenario_of, wait_for};
use serde_json::{Value, json};

/// Waits until `node` has applied at least `seq`, and returns its view.
async fn reported(c: &Client, node: &str, seq: u64) -> pb::GetNodeResponse {
    for _ in 0..400 {
        if let Ok(n) = c.get_node(node).await
            && n.last_seq >= seq
        {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("node {node} never reached seq {seq}");
}

fn decide_binary(scenario: &Value) -> Value {
    let out = Command::new(bin("fairplace-server"))
        .args(["decide", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .unwrap()
                .write_all(scenario.to_string().as_bytes())?;
            child.wait_with_output()
        })
        .expect("run decide");
    serde_json::from_slice(&out.stdout).expect("decide prints JSON")
}

#[test]
fn pick_cpu_on_the_agents_state_equals_decide_on_the_same_scenario() {
    let server = Server::start(&["--stale-after-ms", "600000"]);
    // One report, then none for a minute: the state the test reads stays put.
    let _agent = Agent::start(
        &server.grpc,
        &["--node-id", "real", "--interval-ms", "60000"],
    );
    rt().block_on(async {
        let c = Client::connect(&server.grpc).await.unwrap();
        let node = reported(&c, "real", 1).await;
        let n = node.cpus.len() as u32;
        assert!(n >= 1);
        let base = scenario_of(&node);
        let busy = node.cpus.iter().find(|s| s.nr_running > 0).map(|s| s.id);
        let mut cases: Vec<(pb::PickCpuRequest, Value)> = vec![];
        for (this, prev, sync) in [(0, 0, false), (n - 1, 0, true), (0, n - 1, false)] {
            cases.push((
                pb::PickCpuRequest {
                    node_id: "real".into(),
                    task: Some(pb::Task {
                        prev_cpu: Some(prev),
                        util_avg: 100,
                        load_avg: 150,
                        ..Default::default()
                    }),
                    kind: pb::RequestKind::Wakeup as i32,
                    this_cpu: this,
                    sync,
                    ..Default::default()
                },
                json!({"task": {"prev_cpu": prev, "util_avg": 100, "load_avg": 150},
                       "request": {"kind": "wakeup", "this_cpu": this, "sync": sync}}),
            ));
        }
        cases.push((
            pb::PickCpuRequest {
                node_id: "real".into(),
                kind: pb::RequestKind::Fork as i32,
                this_cpu: n - 1,
                ..Default::default()
            },
            json!({"request": {"kind": "fork", "this_cpu": n - 1}}),
        ));
        if let Some(b) = busy {
            cases.push((
                pb::PickCpuRequest {
                    node_id: "real".into(),
                    kind: pb::RequestKind::Exec as i32,
                    this_cpu: b,
                    ..Default::default()
                },
                json!({"request": {"kind": "exec", "this_cpu": b}}),
            ));
        }
        for (req, extra) in cases {
            let p = c.pick_cpu(req).await.unwrap();
            assert_eq!(
                p.state_version,
                node.summary.as_ref().unwrap().state_version,
                "the state did not move"
            );
            let mut sc = base.clone();
            for (k, v) in extra.as_object().unwrap() {
                sc[k] = v.clone();
            }
            let d = decide_binary(&sc);
            assert_eq!(
                (d["cpu"].as_u64(), d["path"].as_str(), d["scanned"].as_u64()),
                (
                    Some(p.cpu as u64),
                    Some(p.path.as_str()),
                    Some(p.scanned as u64)
                ),
                "PickCpu and decide disagree on {sc}"
            );
        }
    });
}

#[test]
fn a_killed_agent_restarts_and_resyncs_with_a_full_snapshot() {
    let server = Server::start(&[]);
    let agent = Agent::start(&server.grpc, &["--node-id", "r", "--interval-ms", "50"]);
    rt().block_on(async {
        let c = Client::connect(&server.grpc).await.unwrap();
        let before = reported(&c, "r", 5).await;
        drop(agent);
        let mut disconnected = false;
        for _ in 0..200 {
            let n = c.get_node("r").await.unwrap();
            if !n.summary.unwrap().connected {
                disconnected = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        assert!(disconnected, "the node shows its agent gone");
        // The node is kept (still fresh) while its agent is away.
        assert!(
            c.pick_cpu(pb::PickCpuRequest {
                node_id: "r".into(),
                task: Some(pb::Task {
                    prev_cpu: Some(0),
                    ..Default::default()
                }),
                this_cpu: 0,
                ..Default::default()
            })
            .await
            .is_ok()
        );
        let _agent = Agent::start(&server.grpc, &["--node-id", "r", "--interval-ms", "50"]);
        // The new agent's sequence starts over with a full snapshot; the
        // server accepts it and then its deltas.
        let mut resynced = None;
        for _ in 0..400 {
            let n = c.get_node("r").await.unwrap();
            let s = n.summary.clone().unwrap();
            if s.connected && n.last_seq >= 3 && n.last_seq < before.last_seq && s.fresh {
                resynced = Some(n);
                break;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        let n = resynced.expect("resynced");
        assert!(n.summary.unwrap().state_version > before.summary.unwrap().state_version);
    });
}

#[test]
fn the_cli_shows_nodes_picks_and_decides() {
    let server = Server::start(&[]);
    let _agent = Agent::start(
        &server.grpc,
        &[
            "--node-id",
            "cli-node",
            "--interval-ms",
            "100",
            "--label",
            "zone=z9",
        ],
    );
    wait_for(Duration::from_secs(10), "the node to report", || {
        let (code, out, _) = cli(&server.grpc, &["--json", "nodes"]);
        (code == 0 && out.contains("\"fresh\":true")).then_some(())
    });
    let (code, out, err) = cli(&server.grpc, &["nodes"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("node "), "{out}");
    assert!(
        out.contains("cli-node") && out.contains("fresh") && out.contains("zone=z9"),
        "{out}"
    );

    let (code, out, err) = cli(&server.grpc, &["pick", "cli-node", "--prev-cpu", "0"]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.lines().next().unwrap().starts_with("cpu  path"),
        "{out}"
    );
    let (code, out, _) = cli(
        &server.grpc,
        &[
            "--json", "pick", "cli-node", "--kind", "fork", "--count", "2",
        ],
    );
    assert_eq!(code, 0);
    for line in out.lines() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["path"], "slow_path");
    }
    let (code, out, _) = cli(&server.grpc, &["node", "cli-node"]);
    assert_eq!(code, 0);
    assert!(out.contains("nr_running"), "{out}");
    let (code, out, _) = cli(&server.grpc, &["features"]);
    assert_eq!(code, 0);
    let line = |name: &str| {
        out.lines()
            .find(|l| l.starts_with(name))
            .unwrap_or("")
            .split_whitespace()
            .nth(1)
            .map(str::to_string)
    };
    assert_eq!(line("EXEC_BOUND_FAST_PATH").as_deref(), Some("on"), "{out}");
    assert_eq!(
        line("PREFER_LAST_IDLE_CPU").as_deref(),
        Some("off"),
        "{out}"
    );
    let (code, _, err) = cli(&server.grpc, &["pick", "no-such-node"]);
    assert_eq!(code, 1);
    assert!(err.contains("NotFound"), "{err}");

    // decide through the server agrees with decide offline, line by line.
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../server/tests/cases/examples.jsonl"
    );
    let (code, online, err) = cli(&server.grpc, &["decide", file]);
    assert_eq!(code, 0, "{err}");
    let offline = Command::new(bin("fairplace-server"))
        .args(["decide", file])
        .output()
        .unwrap();
    assert_eq!(online, String::from_utf8(offline.stdout).unwrap());
}

#[test]
fn metrics_show_every_documented_series_after_some_traffic() {
    // Recording, so the recording's series are there too.
    let rec = fairplace_e2e::StateDir::new("recording");
    let server = Server::start(&["--claim-ttl-ms", "50", "--record", rec.path()]);
    let _agent = Agent::start(&server.grpc, &["--node-id", "m", "--interval-ms", "100"]);
    rt().block_on(async {
        let c = Client::connect(&server.grpc).await.unwrap();
        reported(&c, "m", 2).await;
        for claim in [false, true] {
            c.pick_cpu(pb::PickCpuRequest {
                node_id: "m".into(),
                task: Some(pb::Task {
                    prev_cpu: Some(0),
                    ..Default::default()
                }),
                claim,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        let _ = c
            .pick_cpu(pb::PickCpuRequest {
                node_id: "m".into(),
                ..Default::default()
            })
            .await;
        // A placement with no node, on the cluster.
        let p = c
            .pick_cpu(pb::PickCpuRequest {
                kind: pb::RequestKind::Fork as i32,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(p.node_id, "m");
        let n = c.get_node("m").await.unwrap().cpus.len() as u32;
        if n > 1 {
            c.can_migrate(pb::CanMigrateRequest {
                node_id: "m".into(),
                src_cpu: 0,
                dst_cpu: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        // A rejected report, on a stream of its own.
        let mut r = fairplace_e2e::Reporter::register(
            &server.grpc,
            "x",
            fairplace_e2e::topology(1, 1, 2, 1),
        )
        .await
        .unwrap();
        let a = r.update(3, false, vec![], "x").await.unwrap();
        assert!(a.rejection.is_some());
        // Tasks and runtime on a two-LLC node, then a balance pass: the
        // balance, task and cache-aware series.
        let mut t = fairplace_e2e::Reporter::register(
            &server.grpc,
            "t",
            fairplace_e2e::topology(1, 2, 2, 1),
        )
        .await
        .unwrap();
        for seq in 1..=3 {
            let mut u = fairplace_e2e::tasks_update(seq, 4, &[(0, 3)]);
            u.runtime = vec![pb::ProcessRuntime {
                group: 7,
                cpu: 0,
                runtime_ns: 5_000_000,
                nr_threads: 3,
            }];
            let a = t.send(u).await.unwrap();
            assert!(a.rejection.is_none(), "{a:?}");
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        let b = c
            .balance(pb::BalanceRequest {
                node_id: "t".into(),
                ..Default::default()
            })
            .await
            .unwrap();
        assert!(!b.proposals.is_empty(), "{b:?}");
        // A lease's life: the lease store's commit series.
        let l = c
            .allocate_cpus(pb::AllocateCpusRequest {
                node_id: "t".into(),
                count: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        c.release_cpus(l.lease_id).await.unwrap();
        // Past the recording's first flush (once a second).
        tokio::time::sleep(Duration::from_millis(1200)).await;
    });
    let text = http_get(&server.metrics);
    for (name, kind, _) in fairplace::metrics::ALL {
        // One server: the replicas' series are tested in tests/replicas.rs.
        if fairplace::metrics::REPLICA_ONLY.contains(&name) {
            continue;
        }
        assert!(
            text.contains(&format!("# TYPE {name} {kind}")),
            "{name} ({kind}) missing:\n{text}"
        );
        assert!(
            text.contains(&format!("# HELP {name} ")),
            "{name} has no HELP"
        );
    }
    assert!(
        text.contains("fairplace_decisions_total{kind=\"wakeup\",path="),
        "decisions by kind and path"
    );
    assert!(
        text.contains(
            "fairplace_decision_duration_seconds_bucket{kind=\"wakeup\",le=\"0.0000001\"}"
        ),
        "buckets from 100 ns"
    );
    assert!(text.contains("fairplace_agent_reports_rejected_total{reason=\"out_of_sequence\"}"));
    assert!(text.contains("method=\"PlacementService/PickCpu\",code=\"OK\""));
    assert!(text.contains("method=\"PlacementService/PickCpu\",code=\"InvalidArgument\""));
}

#[test]
fn the_agent_reports_this_machines_runnable_tasks() {
    // A busy child process is runnable somewhere: the agent's task list
    // (--task-cap) carries it with its process id, and its own threads are
    // left out.
    let server = Server::start(&[]);
    let mut spin = Command::new("sh")
        .args(["-c", "while :; do :; done"])
        .spawn()
        .unwrap();
    let agent = Agent::start(
        &server.grpc,
        &[
            "--node-id",
            "tasks",
            "--interval-ms",
            "100",
            "--task-cap",
            "8",
        ],
    );
    let pid = spin.id() as u64;
    let found = rt().block_on(async {
        let c = Client::connect(&server.grpc).await.unwrap();
        for _ in 0..100 {
            if let Ok(n) = c.get_node("tasks").await {
                let all: Vec<&pb::RunnableTask> =
                    n.tasks.iter().flat_map(|l| l.tasks.iter()).collect();
                assert!(all.iter().all(|t| t.group != agent.child.id() as u64));
                assert!(n.tasks.iter().all(|l| l.tasks.len() <= 8));
                if let Some(t) = all.iter().find(|t| t.group == pid) {
                    // sh is single-threaded; it ran within this sample.
                    assert_eq!(t.id, pid);
                    assert!(t.nr_threads <= 1, "{t:?}");
                    return true;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    });
    let _ = spin.kill();
    let _ = spin.wait();
    assert!(found, "the busy child never appeared in a task list");
}

#[test]
fn the_cli_shows_balance_proposals_and_cache_state() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let mut r = fairplace_e2e::Reporter::register_labelled(
            &server.grpc,
            "bal",
            fairplace_e2e::topology(1, 1, 4, 1),
            &[("zone", "z1"), ("rack", "r1")],
        )
        .await
        .unwrap();
        let a = r
            .send(fairplace_e2e::tasks_update(1, 4, &[(0, 3)]))
            .await
            .unwrap();
        assert!(a.rejection.is_none(), "{a:?}");
    });
    // From CPU 1 (the first idle CPU): the tail task of CPU 0 (id 3).
    let (code, out, err) = cli(&server.grpc, &["balance", "bal", "--cpus", "1"]);
    assert_eq!(code, 0, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("3 "))
        .unwrap_or_else(|| panic!("no row for task 3:\n{out}"));
    assert!(
        row.contains("bal/0") && row.contains("bal/1") && row.contains("task"),
        "{row}"
    );
    assert!(out.contains("1 proposals"), "{out}");
    // JSON, and the cluster form (one node in the rack: nothing to move).
    let (code, out, _) = cli(&server.grpc, &["--json", "balance", "bal", "--cpus", "1"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!(
        (v["task"].as_u64(), v["dst_cpu"].as_u64()),
        (Some(3), Some(1))
    );
    let (code, out, err) = cli(&server.grpc, &["balance", "--cluster", "rack=z1/r1"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("0 proposals"), "{out}");
    let (code, _, err) = cli(&server.grpc, &["balance", "--cluster", "rack=r1"]);
    assert_eq!(code, 1);
    assert!(err.contains("cluster_group"), "{err}");
    // One LLC: cache-aware scheduling is off for this node.
    let (code, out, err) = cli(&server.grpc, &["cache", "bal"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("cache-aware: off"), "{out}");
}

/// `fairplace_cache_scan_cpus{strategy}` sum and count from /metrics.
fn scan_histogram(text: &str, strategy: &str) -> (f64, f64) {
    let get = |suffix: &str| {
        text.lines()
            .find(|l| {
                l.starts_with(&format!("fairplace_cache_scan_cpus_{suffix}{{"))
                    && l.contains(&format!("strategy=\"{strategy}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    (get("sum"), get("count"))
}

#[test]
fn the_scan_metric_shows_sc_visit_reading_fewer_cpus_than_the_full_scan() {
    // A 512-CPU node of 8 LLCs (2 NUMA nodes x 4 LLCs x 32 cores x SMT2);
    // a 16-thread process reports runtime on CPUs 192-207 (LLC 3) every
    // 12 ms, so each report starts a new epoch and one task_cache_work
    // pass: the full scan reads all 512 CPUs' records, SC_VISIT only the 16
    // the process visited.
    let server = Server::start(&[]);
    rt().block_on(async {
        let mut r = fairplace_e2e::Reporter::register(
            &server.grpc,
            "big",
            fairplace_e2e::topology(2, 4, 32, 2),
        )
        .await
        .unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let cpus: Vec<pb::CpuState> = (0..512)
            .map(|i| pb::CpuState {
                id: i,
                online: true,
                ..Default::default()
            })
            .collect();
        let mut seq = 0;
        for visit in [false, true] {
            c.set_features(pb::SetFeaturesRequest {
                node_id: "big".into(),
                set: [("SC_VISIT".to_string(), visit)].into_iter().collect(),
                clear_overrides: false,
            })
            .await
            .unwrap();
            for _ in 0..6 {
                seq += 1;
                let a = r
                    .send(pb::Update {
                        seq,
                        full: true,
                        cpus: cpus.clone(),
                        runtime: (192..208)
                            .map(|cpu| pb::ProcessRuntime {
                                group: 7,
                                cpu,
                                runtime_ns: 8_000_000,
                                nr_threads: 16,
                            })
                            .collect(),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
                assert!(a.rejection.is_none(), "{a:?}");
                tokio::time::sleep(Duration::from_millis(12)).await;
            }
        }
        let cache = c.get_cache("big").await.unwrap();
        assert!(cache.enabled);
        assert_eq!(cache.strategy, "visit");
        let p = cache.processes.iter().find(|p| p.group == 7).unwrap();
        assert_eq!(p.preferred_llc, Some(3));
    });
    let text = http_get(&server.metrics);
    let (full_sum, full_n) = scan_histogram(&text, "full");
    let (visit_sum, visit_n) = scan_histogram(&text, "visit");
    assert!(full_n >= 5.0 && visit_n >= 5.0, "{full_n} {visit_n}");
    assert_eq!(full_sum / full_n, 512.0);
    assert_eq!(visit_sum / visit_n, 16.0);
    assert!(full_sum / full_n >= 8.0 * visit_sum / visit_n);
}
