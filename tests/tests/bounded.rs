//! Bounded series and memory under floods, over real loopback sockets:
//! calls to made-up methods share one label value, a forgotten node's
//! series leave /metrics at once, --max-nodes and --max-node-id-bytes
//! refuse what is beyond them, and error messages quote at most a short
//! prefix of a bad value.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use fairplace_client::Client;
use fairplace_e2e::{Reporter, Server, bin, http_get, pb, rt, states, topology, wait_for};
use tonic::Code;

/// Sample lines of an exposition (series; HELP, TYPE and blank lines
/// left out).
fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .count()
}

/// The value of the sample line starting with `prefix`.
fn value(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
}

/// GET over HTTP/1.0: (status code, body).
fn get(url: &str) -> (u16, String) {
    let rest = url.strip_prefix("http://").expect("http url");
    let (host, path) = rest.split_once('/').expect("a path");
    let mut s = std::net::TcpStream::connect(host).expect("connect");
    write!(s, "GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    let code = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .expect("a status line");
    let body = resp.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (code, body.to_string())
}

fn pick(node: &str) -> pb::PickCpuRequest {
    pb::PickCpuRequest {
        node_id: node.into(),
        task: Some(pb::Task {
            prev_cpu: Some(0),
            ..Default::default()
        }),
        kind: pb::RequestKind::Wakeup as i32,
        ..Default::default()
    }
}

/// An error message must not echo a huge value.
fn short(s: &tonic::Status) {
    assert!(
        s.message().len() < 400,
        "{} bytes: {:.200}",
        s.message().len(),
        s.message()
    );
}

/// A unary call to any path, with an empty message.
async fn call(ch: tonic::transport::Channel, path: String) -> Result<(), tonic::Status> {
    let mut g = tonic::client::Grpc::new(ch);
    g.ready()
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<pb::PingRequest, pb::PingResponse>::default();
    g.unary(
        tonic::Request::new(pb::PingRequest {}),
        path.parse().unwrap(),
        codec,
    )
    .await
    .map(|_| ())
}

#[test]
fn calls_to_made_up_methods_share_one_label_value() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        // One call of each kind first: the series a flood could add exist.
        let made_up = |i: usize| match i % 3 {
            0 => format!("/made.up.Service{i}/Method{i}"),
            1 => format!("/fairplace.v1.PlacementService/MadeUp{i}"),
            _ => format!("/grpc.health.v1.Health/Nope{i}"),
        };
        for i in 0..3 {
            let e = call(ch.clone(), made_up(i)).await.unwrap_err();
            assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
        }
        Client::from_channel(ch.clone()).ping().await.unwrap();
        let before = series(&http_get(&server.metrics));
        const FLOOD: usize = 2_000;
        for batch in (3..FLOOD + 3).collect::<Vec<_>>().chunks(100) {
            let calls: Vec<_> = batch
                .iter()
                .map(|&i| tokio::spawn(call(ch.clone(), made_up(i))))
                .collect();
            for c in calls {
                assert_eq!(c.await.unwrap().unwrap_err().code(), Code::Unimplemented);
            }
        }
        let t0 = Instant::now();
        let text = http_get(&server.metrics);
        let scrape = t0.elapsed();
        let after = series(&text);
        eprintln!(
            "series: {before} before, {after} after {FLOOD} calls to made-up methods; scrape {scrape:?}"
        );
        assert!(
            after <= before + 5,
            "{FLOOD} made-up calls added {} series",
            after - before
        );
        let unknown = value(
            &text,
            "fairplace_rpc_requests_total{method=\"unknown\",code=\"Unimplemented\"}",
        );
        assert_eq!(unknown, Some((FLOOD + 3) as f64), "{text}");
        for bad in ["MadeUp", "made.up", "Nope"] {
            assert!(!text.contains(bad), "{bad} became a label value");
        }
        // Served methods keep their own label.
        assert!(text.contains("fairplace_rpc_requests_total{method=\"AdminService/Ping\",code=\"OK\"}"));
        // Every family once: the store-rendered ones are not also in the
        // recorder.
        let mut types: Vec<&str> = text.lines().filter(|l| l.starts_with("# TYPE ")).collect();
        let n = types.len();
        types.sort();
        types.dedup();
        assert_eq!(types.len(), n, "a family appears twice");
    });
}

#[test]
fn a_forgotten_nodes_series_leave_metrics_and_its_place_is_free() {
    let server = Server::start(&[
        "--forget-after-s",
        "1",
        "--stale-after-ms",
        "5000",
        "--max-nodes",
        "1",
    ]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "gone", topology(1, 2, 2, 1))
            .await
            .unwrap();
        r.update(1, true, states(4, &[1]), "gone").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        c.pick_cpu(pick("gone")).await.unwrap();
        let text = http_get(&server.metrics);
        for name in [
            "fairplace_node_idle_cpus{node=\"gone\"} 3",
            "fairplace_node_nr_running{node=\"gone\"} 1",
            "fairplace_node_sched_idle_cpus{node=\"gone\"}",
            "fairplace_node_llc_util{node=\"gone\",llc=\"0\"}",
            "fairplace_node_llc_util{node=\"gone\",llc=\"1\"}",
            "fairplace_node_state_age_seconds{node=\"gone\"}",
            "fairplace_node_decisions_total{node=\"gone\",kind=\"wakeup\"} 1",
            "fairplace_nodes{freshness=\"fresh\"} 1",
        ] {
            assert!(text.contains(name), "{name} missing:\n{text}");
        }
        // The store is full: a new id is refused.
        let e = Reporter::register(&server.grpc, "next", topology(1, 1, 2, 1))
            .await
            .err()
            .expect("over --max-nodes");
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        // Silent past --forget-after-s: forgotten, and its series with it.
        drop(r);
        let t0 = Instant::now();
        let text = wait_for(Duration::from_secs(10), "the node's series to go", || {
            let t = http_get(&server.metrics);
            (!t.contains("node=\"gone\"")).then_some(t)
        });
        eprintln!("series gone {:?} after the stream closed", t0.elapsed());
        assert!(
            text.contains("fairplace_nodes{freshness=\"fresh\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("fairplace_nodes{freshness=\"stale\"} 0"),
            "{text}"
        );
        assert!(c.list_nodes().await.unwrap().is_empty());
        // Its place is free again.
        Reporter::register(&server.grpc, "next", topology(1, 1, 2, 1))
            .await
            .unwrap();
    });
}

#[test]
fn max_nodes_refuses_new_ids_and_still_takes_re_registrations() {
    let server = Server::start(&["--max-nodes", "3"]);
    rt().block_on(async {
        let mut streams = Vec::new();
        for id in ["a", "b", "c"] {
            streams.push(
                Reporter::register(&server.grpc, id, topology(1, 1, 2, 1))
                    .await
                    .unwrap(),
            );
        }
        let e = Reporter::register(&server.grpc, "d", topology(1, 1, 2, 1))
            .await
            .err()
            .expect("a fourth id");
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(
            e.message().contains("--max-nodes") && e.message().contains('3'),
            "{}",
            e.message()
        );
        short(&e);
        // The same id again: with the same topology, and with a new one.
        let mut a = Reporter::register(&server.grpc, "a", topology(1, 1, 2, 1))
            .await
            .unwrap();
        a.update(1, true, states(2, &[]), "a").await.unwrap();
        Reporter::register(&server.grpc, "b", topology(1, 2, 2, 1))
            .await
            .unwrap();
        let e = Reporter::register(&server.grpc, "d", topology(1, 1, 2, 1))
            .await
            .err()
            .expect("still full");
        assert_eq!(e.code(), Code::ResourceExhausted);
        let c = Client::connect(&server.grpc).await.unwrap();
        assert_eq!(c.list_nodes().await.unwrap().len(), 3);
        assert_eq!(c.get_node("b").await.unwrap().cpus.len(), 4);
        let text = http_get(&server.metrics);
        assert_eq!(
            value(
                &text,
                "fairplace_agent_reports_rejected_total{reason=\"too_many_nodes\"}"
            ),
            Some(2.0),
            "{text}"
        );
    });
}

#[test]
fn over_long_ids_are_refused_and_errors_quote_a_short_prefix() {
    let server = Server::start(&[]);
    let huge = "x".repeat(1 << 20);
    rt().block_on(async {
        // 253 bytes (a DNS name) is the default limit.
        let ok = "n".repeat(253);
        let mut r = Reporter::register(&server.grpc, &ok, topology(1, 1, 4, 1))
            .await
            .unwrap();
        r.update(1, true, states(4, &[]), &ok).await.unwrap();
        for id in ["n".repeat(254), huge.clone()] {
            let e = Reporter::register(&server.grpc, &id, topology(1, 1, 2, 1))
                .await
                .err()
                .expect("too long");
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert!(
                e.message().starts_with("register.node_id:") && e.message().contains("253"),
                "{}",
                e.message()
            );
            assert!(e.message().contains(&format!("({} bytes)", id.len())));
            short(&e);
        }
        let e = Reporter::register(&server.grpc, "a\nb", topology(1, 1, 2, 1))
            .await
            .err()
            .expect("a control character");
        assert_eq!(e.code(), Code::InvalidArgument);

        // Every error that names a client's string quotes a short prefix.
        let c = Client::connect(&server.grpc).await.unwrap();
        let e = c.pick_cpu(pick(&huge)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        assert!(e.message().contains("(1048576 bytes)"), "{}", e.message());
        short(&e);
        let e = c.get_node(&huge).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        short(&e);
        let mut no_node = pick("");
        no_node.origin_node = huge.clone();
        let e = c.pick_cpu(no_node.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        short(&e);
        no_node.origin_node.clear();
        no_node.selector = [(huge.clone(), "v".to_string())].into();
        let e = c.pick_cpu(no_node).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        short(&e);
        let mut bad_mask = pick(&ok);
        bad_mask.task.as_mut().unwrap().cpus_allowed = huge.clone();
        let e = c.pick_cpu(bad_mask).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        short(&e);
        for req in [
            pb::CanMigrateRequest {
                node_id: ok.clone(),
                src_cpu: 0,
                dst_cpu: 1,
                sd_level: huge.clone(),
                ..Default::default()
            },
            pb::CanMigrateRequest {
                node_id: ok.clone(),
                src_cpu: 0,
                dst_cpu: 1,
                flags: vec![huge.clone()],
                ..Default::default()
            },
        ] {
            let e = c.can_migrate(req).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            short(&e);
        }
        let e = c
            .balance(pb::BalanceRequest {
                cluster_level: huge.clone(),
                cluster_group: huge.clone(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        short(&e);
        let e = c
            .set_features(pb::SetFeaturesRequest {
                set: [(huge.clone(), true)].into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        short(&e);
        let mut unknown_key = serde_json::Map::new();
        unknown_key.insert(huge.clone(), serde_json::json!(1));
        for scenario in [
            serde_json::Value::Object(unknown_key),
            serde_json::json!({"request": {"kind": huge}}),
        ] {
            let e = c.decide(&scenario.to_string()).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            short(&e);
        }
        // An update naming another node.
        let e = r
            .update(2, false, vec![], &huge)
            .await
            .expect_err("another node's update");
        short(&e);
    });
}

#[test]
fn zero_limits_are_refused_at_startup_naming_the_flag() {
    for flag in [
        "--max-nodes",
        "--max-node-id-bytes",
        "--max-connections",
        "--max-connections-per-peer",
        "--max-streams-per-connection",
        "--max-agent-streams",
        "--max-pending-registrations",
        "--max-health-watches",
        "--max-reflection-streams",
    ] {
        let out = std::process::Command::new(bin("fairplace-server"))
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args([flag, "0"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} 0 was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{err}");
    }
}

#[test]
fn an_empty_admin_token_is_refused_at_startup() {
    for (how, token) in [("flag", ""), ("flag", "  "), ("env", "")] {
        let mut cmd = std::process::Command::new(bin("fairplace-server"));
        cmd.args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
            "--lease-store",
            "memory",
        ]);
        match how {
            "flag" => cmd.arg(format!("--admin-token={token}")),
            _ => cmd.env("FAIRPLACE_ADMIN_TOKEN", token),
        };
        let out = cmd.output().unwrap();
        assert!(!out.status.success(), "{how} {token:?} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--admin-token") && err.contains("empty"),
            "{err}"
        );
    }
}

#[test]
fn healthz_is_ok_while_serving_and_metrics_answers_only_get() {
    let server = Server::start(&[]);
    let base = server.metrics.trim_end_matches("/metrics");
    wait_for(Duration::from_secs(5), "/healthz 200", || {
        (get(&format!("{base}/healthz")) == (200, "ok\n".to_string())).then_some(())
    });
    let (code, body) = get(&format!("{base}/metrics"));
    assert_eq!(code, 200);
    assert!(body.contains("# TYPE fairplace_nodes gauge"), "{body}");
    assert_eq!(get(&format!("{base}/nope")).0, 404);
    let host = base.strip_prefix("http://").unwrap();
    let mut s = std::net::TcpStream::connect(host).unwrap();
    write!(
        s,
        "POST /metrics HTTP/1.0\r\nHost: {host}\r\nContent-Length: 0\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    assert!(
        resp.starts_with("HTTP/1.0 405") || resp.starts_with("HTTP/1.1 405"),
        "{resp}"
    );
}

/// Resident set size of a process, in MiB.
fn rss_mib(pid: u32) -> f64 {
    fairplace_e2e::rss_kib(pid) as f64 / 1024.0
}

/// CPU time (user + system) a process has used, in seconds.
fn cpu_s(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = s.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime), counted from after the name.
    let ticks: f64 = f.get(11..13).map_or(0.0, |v| {
        v.iter().filter_map(|x| x.parse::<f64>().ok()).sum()
    });
    ticks / 100.0
}

/// Registers `n` new node ids as fast as one client can (each on its own
/// Report stream, left open unless FLOOD_CLOSE is set); returns (accepted,
/// refused with RESOURCE_EXHAUSTED naming --max-nodes, other).
async fn register_flood(grpc: &str, n: usize) -> (usize, usize, usize) {
    use tokio::sync::Semaphore;
    let chans: Vec<_> = channels(grpc, 4).await;
    let slots = std::sync::Arc::new(Semaphore::new(64));
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let permit = std::sync::Arc::clone(&slots).acquire_owned().await.unwrap();
        let ch = chans[i % chans.len()].clone();
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            loop {
                let r = register_on(ch.clone(), &format!("flood-{i:05}")).await;
                match r {
                    Ok(()) => return 0,
                    Err(s) if s.code() == Code::ResourceExhausted => {
                        if s.message().contains("--max-nodes") {
                            return 1;
                        }
                        // The heavy pool was full: try again.
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err(_) => return 2,
                }
            }
        }));
    }
    let mut out = [0usize; 3];
    for t in tasks {
        out[t.await.unwrap()] += 1;
    }
    (out[0], out[1], out[2])
}

async fn channels(grpc: &str, n: usize) -> Vec<tonic::transport::Channel> {
    let mut v = Vec::new();
    for _ in 0..n {
        v.push(
            tonic::transport::Endpoint::from_shared(format!("http://{grpc}"))
                .unwrap()
                .connect()
                .await
                .unwrap(),
        );
    }
    v
}

/// Opens a Report stream, registers `id` (4 CPUs in 2 LLCs) and waits for
/// the answer.
async fn register_on(ch: tonic::transport::Channel, id: &str) -> Result<(), tonic::Status> {
    use tokio_stream::StreamExt as _;
    let mut client = pb::agent_service_client::AgentServiceClient::new(ch);
    let reg = pb::AgentMessage {
        body: Some(pb::agent_message::Body::Register(pb::Register {
            node_id: id.into(),
            topology: Some(topology(1, 2, 2, 1)),
            agent_version: "flood".into(),
            ..Default::default()
        })),
    };
    // Kept open (as an agent's is), or closed after the Register (the node
    // stays registered, disconnected) with FLOOD_CLOSE set.
    let keep_open = std::env::var_os("FLOOD_CLOSE").is_none();
    let rest = tokio_stream::pending().take(usize::from(keep_open));
    let mut acks = client
        .report(tokio_stream::iter([reg]).chain(rest))
        .await?
        .into_inner();
    match acks.message().await {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(tonic::Status::unknown("stream closed")),
        Err(s) => Err(s),
    }
}

/// The figures of BENCHMARKS.md: series after a flood of made-up methods
/// and of node registrations, scrape time, RSS and idle CPU. Slow; run with
/// `cargo test --release -p fairplace-e2e --test bounded -- --ignored
/// --nocapture` (FLOOD_NODES sets the registrations, default 50,000).
#[test]
#[ignore]
fn flood_figures() {
    let n: usize = std::env::var("FLOOD_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    // Thousands of simulated agents share 4 connections here.
    let server = Server::start(&["--max-streams-per-connection", "100000"]);
    let pid = server.child.id();
    let scrape = || {
        let mut times = Vec::new();
        let mut text = String::new();
        for _ in 0..5 {
            let t0 = Instant::now();
            text = http_get(&server.metrics);
            times.push(t0.elapsed());
        }
        times.sort();
        (series(&text), text.len(), times[times.len() / 2])
    };
    rt().block_on(async {
        let (s0, b0, t0) = scrape();
        eprintln!("idle server: {s0} series, {b0} bytes, scrape {t0:?}, RSS {:.1} MiB", rss_mib(pid));
        let ch = channels(&server.grpc, 1).await.remove(0);
        for i in 0..2_000 {
            let _ = call(ch.clone(), format!("/made.up.Service{i}/Method{i}")).await;
        }
        let (s1, b1, t1) = scrape();
        eprintln!("after 2,000 made-up method calls: {s1} series (+{}), {b1} bytes, scrape {t1:?}", s1 - s0);
        let t = Instant::now();
        let (ok, full, other) = register_flood(&server.grpc, n).await;
        let took = t.elapsed();
        eprintln!("RSS right after the flood, before a scrape: {:.1} MiB", rss_mib(pid));
        let listed = Client::connect(&server.grpc)
            .await
            .unwrap()
            .list_nodes()
            .await
            .unwrap();
        eprintln!(
            "{} nodes listed, {} of them with a stream still open",
            listed.len(),
            listed.iter().filter(|n| n.connected).count()
        );
        let (s2, b2, t2) = scrape();
        eprintln!(
            "after {n} registration attempts in {took:?}: {ok} accepted, {full} refused (--max-nodes), {other} other; \
             {s2} series, {b2} bytes, scrape {t2:?} (median of 5), RSS {:.1} MiB",
            rss_mib(pid)
        );
        let c0 = cpu_s(pid);
        tokio::time::sleep(Duration::from_secs(10)).await;
        let c1 = cpu_s(pid);
        eprintln!("idle CPU with {ok} nodes: {:.1} % of a core over 10 s", (c1 - c0) * 10.0);
    });
}

#[test]
fn labels_and_agent_versions_are_short_and_printable_or_refused_by_name() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let reg = |labels: Vec<(String, String)>, version: &str| pb::Register {
            node_id: "labelled".into(),
            labels: labels.into_iter().collect(),
            topology: Some(topology(1, 1, 2, 1)),
            agent_version: version.into(),
            ..Default::default()
        };
        let one = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let many: Vec<(String, String)> = (0..33).map(|i| (format!("k{i}"), "v".into())).collect();
        let cases = [
            (
                reg(one("zone", "eu\nn2  eu-2"), "1"),
                "register.labels[\"zone\"]:",
            ),
            (
                reg(one("zone", "\u{1b}[2J"), "1"),
                "register.labels[\"zone\"]:",
            ),
            (
                reg(one("zone", &"z".repeat(3 << 20)), "1"),
                "register.labels[\"zone\"]:",
            ),
            (reg(one("rack\r", "r1"), "1"), "register.labels["),
            (reg(many, "1"), "register.labels:"),
            (reg(vec![], "1.0\u{1b}[31m"), "register.agent_version:"),
            (reg(vec![], &"v".repeat(129)), "register.agent_version:"),
        ];
        for (r, field) in cases {
            let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
                .unwrap()
                .connect()
                .await
                .unwrap();
            let e = Reporter::register_with(ch, r).await.err().expect("refused");
            assert_eq!(e.code(), Code::InvalidArgument, "{field}: {e:?}");
            assert!(e.message().starts_with(field), "{field}: {}", e.message());
            assert!(
                e.message().len() < 400,
                "a short quote: {}",
                e.message().len()
            );
        }
        let c = Client::connect(&server.grpc).await.unwrap();
        assert_eq!(
            c.get_node("labelled").await.unwrap_err().code(),
            Code::NotFound
        );
        // A well-formed registration still gets in.
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        Reporter::register_with(ch, reg(one("zone", "eu-1"), "0.1.0"))
            .await
            .unwrap();
    });
}
