//! Mutual TLS and the role table, with the real binaries over loopback and
//! a test PKI made here (rcgen): what is refused without a trusted
//! certificate, what each role may call, node A against node B, rotation of
//! the certificates while an agent streams, and the real agent and CLI.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use fairplace::offline::pki::{Ca, Leaf};
use fairplace_client::Client;
use fairplace_e2e::tls::{
    Kind, TestPki, TlsOptions, call_empty, channel, replace_file, server_leaf,
};
use fairplace_e2e::{Agent, Reporter, Server, cli, http_get, pb, rt, states, topology, wait_for};
use prost::Message;
use tonic::Code;

fn mtls_server(pki: &TestPki, extra: &[&str]) -> Server {
    let mut args = pki.server_args();
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start(&args)
}

async fn client(addr: &str, tls: &TlsOptions) -> Client {
    Client::connect_tls(addr, tls).await.expect("connect")
}

/// Registers `node` over `tls` and sends one full update.
async fn report(addr: &str, tls: &TlsOptions, node: &str) -> Result<Reporter, tonic::Status> {
    let ch = channel(addr, tls)
        .await
        .map_err(tonic::Status::unavailable)?;
    let mut r = Reporter::register_on(ch, node, topology(1, 1, 2, 2), &[]).await?;
    let a = r.update(1, true, states(4, &[0]), node).await?;
    assert!(a.rejection.is_none(), "{a:?}");
    Ok(r)
}

fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Polls the server's /metrics until `series` reaches `want`.
async fn wait_metric(url: &str, series: &str, want: f64) {
    let t0 = Instant::now();
    while metric(&http_get(url), series) < want {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{series} never reached {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn plaintext_and_callers_without_a_client_certificate_are_refused() {
    let pki = TestPki::new();
    let server = mtls_server(&pki, &["--health-addr", "127.0.0.1:0"]);
    rt().block_on(async {
        // Plaintext on the TLS port: no call goes through.
        let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect_lazy();
        let s = call_empty(plain, "/fairplace.v1.AdminService/ListNodes", Kind::Unary).await;
        assert_ne!(s.code(), Code::Ok, "{s:?}");
        // TLS trusting the server, but no client certificate: refused at the
        // handshake, for every method, health included.
        for path in [
            "/fairplace.v1.AdminService/ListNodes",
            "/grpc.health.v1.Health/Check",
        ] {
            let s = match channel(&server.grpc, &pki.ca_only()).await {
                Ok(ch) => call_empty(ch, path, Kind::Unary).await,
                Err(e) => tonic::Status::unavailable(e),
            };
            assert_ne!(s.code(), Code::Ok, "{path}: {s:?}");
            assert_ne!(
                s.code(),
                Code::PermissionDenied,
                "{path}: refused before any role"
            );
        }
        // The health-only listener answers probes in plaintext, and only
        // health.
        let h = server.health.as_ref().expect("health listener");
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{h}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut hc = tonic_health::pb::health_client::HealthClient::new(ch.clone());
        let r = hc
            .check(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        let s = call_empty(ch, "/fairplace.v1.AdminService/ListNodes", Kind::Unary).await;
        assert_eq!(s.code(), Code::Unimplemented, "{s:?}");
    });
    let text = http_get(&server.metrics);
    assert!(
        metric(&text, "fairplace_tls_handshake_failures_total") >= 2.0,
        "{text}"
    );
}

#[test]
fn untrusted_and_unidentified_certificates_are_refused() {
    let pki = TestPki::new();
    let server = mtls_server(&pki, &[]);
    // A certificate from another CA, with a valid SPIFFE ID.
    let other = Ca::new("someone else's CA").unwrap();
    let stranger = other
        .issue(&Leaf::client("fairplace", "admin", "mallory"))
        .unwrap();
    stranger.write(&pki.dir, "stranger").unwrap();
    let stranger = TlsOptions {
        ca: Some(pki.path("ca.crt")),
        cert: Some(pki.path("stranger.crt")),
        key: Some(pki.path("stranger.key")),
        server_name: None,
    };
    let no_san = pki.client_leaf(
        "nosan",
        &Leaf {
            common_name: "admin".into(),
            client: true,
            ..Leaf::default()
        },
    );
    let other_td = pki.client_leaf("othertd", &Leaf::client("elsewhere", "admin", "x"));
    let bad_role = pki.client_leaf("badrole", &Leaf::client("fairplace", "root", "x"));
    let two_ids = pki.client_leaf(
        "twoids",
        &Leaf {
            common_name: "two".into(),
            uris: vec![
                "spiffe://fairplace/admin/a".into(),
                "spiffe://fairplace/node/b".into(),
            ],
            client: true,
            ..Leaf::default()
        },
    );
    rt().block_on(async {
        let s = match channel(&server.grpc, &stranger).await {
            Ok(ch) => call_empty(ch, "/grpc.health.v1.Health/Check", Kind::Unary).await,
            Err(e) => tonic::Status::unavailable(e),
        };
        assert_ne!(s.code(), Code::Ok, "untrusted CA: {s:?}");
        for (what, tls, says) in [
            ("no SAN", &no_san, "no URI SAN spiffe://fairplace/ROLE/NAME"),
            (
                "another trust domain",
                &other_td,
                "trust domain \"elsewhere\"",
            ),
            ("an unknown role", &bad_role, "unknown role \"root\""),
            ("two SPIFFE IDs", &two_ids, "exactly one"),
        ] {
            let ch = channel(&server.grpc, tls).await.unwrap();
            for path in [
                "/grpc.health.v1.Health/Check",
                "/fairplace.v1.AdminService/ListNodes",
            ] {
                let s = call_empty(ch.clone(), path, Kind::Unary).await;
                assert_eq!(s.code(), Code::Unauthenticated, "{what} {path}: {s:?}");
                assert!(s.message().contains(says), "{what}: {}", s.message());
            }
        }
    });
}

#[test]
fn a_node_certificate_writes_only_its_own_node() {
    let pki = TestPki::new();
    let server = mtls_server(&pki, &[]);
    let a = pki.client("node", "a");
    let orch = pki.client("orchestrator", "o");
    rt().block_on(async {
        let mut ra = report(&server.grpc, &a, "a").await.unwrap();
        // Registering node b with a's certificate: refused, naming both.
        let e = report(&server.grpc, &a, "b").await.err().expect("refused");
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(
            e.message().contains("\"a\"") && e.message().contains("\"b\""),
            "{}",
            e.message()
        );
        let o = client(&server.grpc, &orch).await;
        let ids: Vec<String> = o
            .list_nodes()
            .await
            .unwrap()
            .into_iter()
            .map(|n| n.id)
            .collect();
        assert_eq!(ids, ["a"], "b was not registered");
        // An update naming b on a's own stream: refused, the stream ends and
        // a's state is unchanged.
        let before = o.get_node("a").await.unwrap().last_seq;
        let e = ra.update(2, true, states(4, &[1]), "b").await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("\"a\"") && e.message().contains("\"b\""));
        assert_eq!(o.get_node("a").await.unwrap().last_seq, before);
        // A node certificate may not place, read or change anything.
        let node = client(&server.grpc, &a).await;
        let e = node
            .pick_cpu(pb::PickCpuRequest {
                node_id: "a".into(),
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        assert_eq!(
            node.list_nodes().await.unwrap_err().code(),
            Code::PermissionDenied
        );
        let e = node
            .set_features(pb::SetFeaturesRequest::default())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        // An admin may report any node.
        let admin = pki.client("admin", "ops");
        report(&server.grpc, &admin, "b").await.unwrap();
    });
}

/// Whether `role` may call `method` (by its full path): the table as the
/// issue states it, written out independently of the server's.
fn expected(role: &str, method: &str) -> bool {
    let service = method.rsplit_once('/').map_or("", |(s, _)| s);
    match role {
        "admin" => true,
        _ if service == "/grpc.health.v1.Health" || service.starts_with("/grpc.reflection.") => {
            true
        }
        "node" => method == "/fairplace.v1.AgentService/Report",
        // Replicas call each other's ReplicaService; what they forward is
        // authorized as the caller they name (tests/replicas.rs).
        "replica" => service == "/fairplace.v1.ReplicaService",
        "orchestrator" => matches!(
            method,
            "/fairplace.v1.PlacementService/PickCpu"
                | "/fairplace.v1.PlacementService/PickCpus"
                | "/fairplace.v1.PlacementService/CanMigrate"
                | "/fairplace.v1.PlacementService/Decide"
                | "/fairplace.v1.PlacementService/Balance"
                // Leases (issue 14): the orchestrator role, like PickCpu.
                | "/fairplace.v1.PlacementService/AllocateCpus"
                | "/fairplace.v1.PlacementService/ReleaseCpus"
                | "/fairplace.v1.PlacementService/RenewLease"
                | "/fairplace.v1.AdminService/ListNodes"
                | "/fairplace.v1.AdminService/GetNode"
                | "/fairplace.v1.AdminService/GetFeatures"
                | "/fairplace.v1.AdminService/GetCache"
                | "/fairplace.v1.AdminService/Ping"
                // Routing clients (issue 46): who owns what.
                | "/fairplace.v1.AdminService/WatchMembers"
        ),
        _ => false,
    }
}

/// Every method the server serves: the API's from its descriptor set, and
/// health's and reflection's.
fn all_methods() -> Vec<(String, Kind)> {
    let mut out = vec![];
    for bytes in [
        fairplace_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ] {
        let set = prost_types::FileDescriptorSet::decode(bytes).unwrap();
        for f in set.file {
            for s in &f.service {
                for m in &s.method {
                    let kind = if m.client_streaming() {
                        Kind::ClientStreaming
                    } else if m.server_streaming() {
                        Kind::ServerStreaming
                    } else {
                        Kind::Unary
                    };
                    out.push((format!("/{}.{}/{}", f.package(), s.name(), m.name()), kind));
                }
            }
        }
    }
    for p in ["grpc.reflection.v1", "grpc.reflection.v1alpha"] {
        out.push((
            format!("/{p}.ServerReflection/ServerReflectionInfo"),
            Kind::ClientStreaming,
        ));
    }
    out
}

#[test]
fn every_rpc_for_every_role() {
    let pki = TestPki::new();
    let server = mtls_server(&pki, &[]);
    let methods = all_methods();
    assert_eq!(methods.len(), 24, "{methods:?}");
    let mut table: BTreeMap<(String, &str), Code> = BTreeMap::new();
    rt().block_on(async {
        for role in ["node", "orchestrator", "admin", "replica"] {
            let tls = pki.client(role, "n0");
            let ch = channel(&server.grpc, &tls).await.unwrap();
            for (m, kind) in &methods {
                let s = call_empty(ch.clone(), m, *kind).await;
                table.insert((m.clone(), role), s.code());
            }
        }
    });
    let mut wrong = vec![];
    for ((m, role), code) in &table {
        let refused = matches!(code, Code::PermissionDenied | Code::Unauthenticated);
        if refused == expected(role, m) {
            wrong.push(format!("{role} {m}: {code:?}"));
        }
        // Refusals are PERMISSION_DENIED (the caller is known).
        if refused {
            assert_eq!(*code, Code::PermissionDenied, "{role} {m}");
        }
    }
    assert!(
        wrong.is_empty(),
        "role table differs:\n{}",
        wrong.join("\n")
    );
}

#[test]
fn orchestrators_place_and_claim_but_neither_apply_nor_change_features() {
    let pki = TestPki::new();
    let server = mtls_server(&pki, &[]);
    let orch = pki.client("orchestrator", "sched-1");
    let admin = pki.client("admin", "ops");
    rt().block_on(async {
        let _r = report(&server.grpc, &pki.client("node", "n1"), "n1")
            .await
            .unwrap();
        let o = client(&server.grpc, &orch).await;
        for _ in 0..3 {
            o.pick_cpu(pb::PickCpuRequest {
                node_id: "n1".into(),
                task: Some(pb::Task::default()),
                kind: pb::RequestKind::Fork as i32,
                claim: true,
                ..Default::default()
            })
            .await
            .unwrap();
        }
        let balance = |apply| pb::BalanceRequest {
            node_id: "n1".into(),
            apply,
            ..Default::default()
        };
        o.balance(balance(false)).await.unwrap();
        let e = o.balance(balance(true)).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains("apply"), "{}", e.message());
        let set = pb::SetFeaturesRequest {
            set: [("PREFER_LAST_IDLE_CPU".to_string(), true)].into(),
            ..Default::default()
        };
        let e = o.set_features(set.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied);
        assert!(!o.get_features("").await.unwrap().features["PREFER_LAST_IDLE_CPU"]);
        let a = client(&server.grpc, &admin).await;
        a.balance(balance(true)).await.unwrap();
        assert!(a.set_features(set).await.unwrap().features["PREFER_LAST_IDLE_CPU"]);
    });
    let text = http_get(&server.metrics);
    assert_eq!(
        metric(&text, "fairplace_claims_total{caller=\"sched-1\"}"),
        3.0,
        "claims attributed to the orchestrator's name:\n{text}"
    );
}

#[test]
fn certificates_rotate_while_an_agent_streams() {
    let pki = TestPki::new();
    let server = mtls_server(
        &pki,
        &["--tls-reload-ms", "100", "--stale-after-ms", "2000"],
    );
    let node = pki.client("node", "rot");
    let orch = pki.client("orchestrator", "o");
    let metrics_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let agent_metrics = format!("127.0.0.1:{metrics_port}");
    let mut args = TestPki::cli_args(&node);
    args.extend(
        [
            "--node-id",
            "rot",
            "--interval-ms",
            "100",
            "--task-cap",
            "0",
            "--metrics-addr",
            &agent_metrics,
        ]
        .map(String::from),
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _agent = Agent::start(&server.grpc, &args);
    rt().block_on(async {
        let o = client(&server.grpc, &orch).await;
        let version = async || {
            o.get_node("rot")
                .await
                .map(|n| n.summary.unwrap().state_version)
        };
        let t0 = Instant::now();
        while version().await.is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "the agent never registered"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }

        // 1. A new server certificate and key (cert-manager renews in place):
        // reloaded, new connections get it, the agent's stream goes on.
        let renewed = pki.ca.issue(&server_leaf()).unwrap();
        replace_file(&pki.path("server.key"), &renewed.key);
        replace_file(&pki.path("server.crt"), &renewed.cert);
        wait_metric(&server.metrics, "fairplace_tls_reloads_total", 1.0).await;
        let v1 = version().await.unwrap();
        client(&server.grpc, &orch)
            .await
            .list_nodes()
            .await
            .unwrap();

        // 2. A half-written rotation (a certificate without its key) is
        // refused, and the server keeps serving with what it had.
        let half = pki.ca.issue(&server_leaf()).unwrap();
        replace_file(&pki.path("server.crt"), &half.cert);
        wait_metric(&server.metrics, "fairplace_tls_reload_errors_total", 1.0).await;
        client(&server.grpc, &orch)
            .await
            .list_nodes()
            .await
            .unwrap();
        replace_file(&pki.path("server.key"), &half.key);
        wait_metric(&server.metrics, "fairplace_tls_reloads_total", 2.0).await;

        // 3. A new client CA: certificates of the old one are refused on new
        // connections, the new one's accepted, and the agent's stream
        // (opened with the old CA's certificate) is not dropped.
        let ca2 = Ca::new("fairplace test CA 2").unwrap();
        replace_file(&pki.path("ca.crt"), &ca2.pem.cert);
        // The server's own certificate still chains to CA 1, which the
        // clients trust: only the client CA changed.
        wait_metric(&server.metrics, "fairplace_tls_reloads_total", 3.0).await;
        let server_ca = pki.dir.join("server-ca.crt");
        std::fs::write(&server_ca, &pki.ca.pem.cert).unwrap();
        let old = TlsOptions {
            ca: Some(server_ca.clone()),
            ..orch.clone()
        };
        let s = match channel(&server.grpc, &old).await {
            Ok(ch) => call_empty(ch, "/fairplace.v1.AdminService/ListNodes", Kind::Unary).await,
            Err(e) => tonic::Status::unavailable(e),
        };
        assert_ne!(s.code(), Code::Ok, "a certificate of the old CA: {s:?}");
        let o2 = ca2
            .issue(&Leaf::client("fairplace", "orchestrator", "o2"))
            .unwrap();
        o2.write(&pki.dir, "o2").unwrap();
        let new = TlsOptions {
            ca: Some(server_ca),
            cert: Some(pki.path("o2.crt")),
            key: Some(pki.path("o2.key")),
            server_name: None,
        };
        let o2 = client(&server.grpc, &new).await;
        // The stream goes on through all of it: the state keeps advancing.
        let t0 = Instant::now();
        loop {
            let n = o2.get_node("rot").await.unwrap();
            let s = n.summary.unwrap();
            if s.state_version > v1 + 5 && s.fresh && s.connected {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "the agent's stream stalled: {s:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    let text = http_get(&format!("http://{agent_metrics}/metrics"));
    assert_eq!(
        metric(&text, "fairplace_agent_reconnects_total"),
        0.0,
        "the agent's stream was never dropped:\n{text}"
    );
}

#[test]
fn the_real_agent_and_cli_work_over_mtls() {
    let pki = TestPki::new();
    let server = mtls_server(&pki, &[]);
    let node = pki.client("node", "cli-node");
    let mut args = TestPki::cli_args(&node);
    args.extend(["--node-id", "cli-node", "--interval-ms", "200"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _agent = Agent::start(&server.grpc, &args);
    let as_role = |role: &str| TestPki::cli_args(&pki.client(role, "cli"));
    let run = |tls: &[String], rest: &[&str]| {
        let mut a: Vec<&str> = tls.iter().map(String::as_str).collect();
        a.extend_from_slice(rest);
        cli(&server.grpc, &a)
    };
    let orch = as_role("orchestrator");
    wait_for(Duration::from_secs(15), "the agent's node", || {
        let (code, out, _) = run(&orch, &["nodes"]);
        (code == 0 && out.contains("cli-node") && out.contains("fresh")).then_some(())
    });
    let (code, out, err) = run(&orch, &["pick", "cli-node", "--prev-cpu", "0"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("cpu"), "{out}");
    let (code, _, err) = run(&orch, &["features", "--set", "PREFER_LAST_IDLE_CPU=on"]);
    assert_eq!(code, 1);
    assert!(err.contains("PermissionDenied"), "{err}");
    let (code, out, err) = run(
        &as_role("admin"),
        &["features", "--set", "PREFER_LAST_IDLE_CPU=on"],
    );
    assert_eq!(code, 0, "{out}{err}");
    // No certificate: nothing works.
    let (code, _, _) = cli(&server.grpc, &["nodes"]);
    assert_eq!(code, 1);
    let ca_only = TestPki::cli_args(&pki.ca_only());
    let (code, _, _) = run(&ca_only, &["nodes"]);
    assert_eq!(code, 1);
}

#[test]
fn a_non_loopback_address_needs_client_certificates() {
    // Refused before anything is bound.
    let out = std::process::Command::new(fairplace_e2e::bin("fairplace-server"))
        .args([
            "serve",
            "--grpc-addr",
            "0.0.0.0:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("not a loopback address")
            && err.contains("--client-ca")
            && err.contains("--allow-unauthenticated"),
        "{err}"
    );
    // TLS files that do not fit are refused at start.
    let pki = TestPki::new();
    let out = std::process::Command::new(fairplace_e2e::bin("fairplace-server"))
        .args([
            "serve",
            "--grpc-addr",
            "127.0.0.1:0",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .args(["--tls-cert", &pki.path("server.crt").display().to_string()])
        .args(["--tls-key", &pki.path("ca.key").display().to_string()])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not fit"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The agent obeys only a fairplace server: a certificate from the same CA,
/// valid for the address and for serving TLS, but naming an orchestrator
/// (what a hostile orchestrator with a serverAuth certificate would hold),
/// gets no stream. Once the server's files carry a `server` SPIFFE ID
/// (reloaded in place), the same agent registers.
#[test]
fn an_agent_refuses_a_server_whose_certificate_does_not_name_a_fairplace_server() {
    let pki = TestPki::new();
    let impostor = Leaf {
        common_name: "localhost".into(),
        uris: vec!["spiffe://fairplace/orchestrator/mallory".into()],
        dns_names: vec!["localhost".into()],
        ips: vec![std::net::IpAddr::from([127, 0, 0, 1])],
        server: true,
        ..Leaf::default()
    };
    pki.write_leaf("server", &impostor);
    let mut args = pki.server_args();
    args.extend(["--tls-reload-ms", "100"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let node = pki.client("node", "picky");
    let orch = pki.client("orchestrator", "o");
    let mut agent_args = TestPki::cli_args(&node);
    agent_args.extend(["--node-id", "picky", "--interval-ms", "100"].map(String::from));
    let agent_args: Vec<&str> = agent_args.iter().map(String::as_str).collect();
    let _agent = Agent::start(&server.grpc, &agent_args);
    rt().block_on(async {
        let o = client(&server.grpc, &orch).await;
        // The orchestrator's TLS does not check the role: the server is up.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let e = o.get_node("picky").await.expect_err("the agent registered");
        assert_eq!(e.code(), Code::NotFound, "{e:?}");
        // The real server certificate, swapped in as cert-manager would.
        let real = pki.ca.issue(&server_leaf()).unwrap();
        replace_file(&pki.path("server.key"), &real.key);
        replace_file(&pki.path("server.crt"), &real.cert);
        let t0 = Instant::now();
        while o.get_node("picky").await.is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the agent never registered with the real server"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
}

/// A node decides neither its zone nor where placements aimed at a zone
/// go. Under mutual TLS a node certificate registers `fake` claiming
/// zone=eu-1 and 64 idle CPUs; the admin's `--node-labels` file puts only
/// `real` in eu-1. Every PickCpu selecting eu-1 lands on `real`; `fake`'s
/// claim is shown as reported, never used. A key the file lets nodes set
/// (`team`) is used.
#[test]
fn placement_labels_are_the_servers_and_a_node_cannot_claim_a_zone() {
    let pki = TestPki::new();
    let labels = pki.path("labels.json");
    std::fs::write(
        &labels,
        r#"{"nodes": {"real": {"zone": "eu-1", "rack": "r1"}}, "reported": {"*": ["team"]}}"#,
    )
    .unwrap();
    let mut args = pki.server_args();
    args.extend(["--node-labels".to_string(), labels.display().to_string()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let orch = pki.client("orchestrator", "o");
    rt().block_on(async {
        let register = async |name: &str, topo, claims: &[(&str, &str)]| {
            let tls = pki.client("node", name);
            let ch = channel(&server.grpc, &tls).await.unwrap();
            let mut r = Reporter::register_on(ch, name, topo, claims).await.unwrap();
            let n = match name {
                "fake" => 64,
                _ => 4,
            };
            r.update(1, true, states(n, &[0]), name).await.unwrap();
            r
        };
        let _real = register("real", topology(1, 1, 2, 2), &[("zone", "us-2")]).await;
        let _fake = register(
            "fake",
            topology(1, 1, 32, 2),
            &[("zone", "eu-1"), ("rack", "r1"), ("team", "blue")],
        )
        .await;
        let o = client(&server.grpc, &orch).await;
        for _ in 0..50 {
            let p = o
                .pick_cpu(pb::PickCpuRequest {
                    kind: pb::RequestKind::Fork as i32,
                    selector: [("zone".to_string(), "eu-1".to_string())].into(),
                    ..Default::default()
                })
                .await
                .unwrap();
            assert_eq!(p.node_id, "real", "{p:?}");
        }
        let fake = o.get_node("fake").await.unwrap().summary.unwrap();
        let used: BTreeMap<_, _> = fake.labels.into_iter().collect();
        let reported: BTreeMap<_, _> = fake.reported_labels.into_iter().collect();
        assert_eq!(used, BTreeMap::from([("team".into(), "blue".into())]));
        assert_eq!(reported.get("zone").map(String::as_str), Some("eu-1"));
        let real = o.get_node("real").await.unwrap().summary.unwrap();
        let used: BTreeMap<_, _> = real.labels.into_iter().collect();
        assert_eq!(
            used.get("zone").map(String::as_str),
            Some("eu-1"),
            "the file's, not us-2"
        );
    });
}

/// Without a labels file, under mutual TLS, no reported label places a
/// node: a selector nobody was given matches nothing.
#[test]
fn under_mutual_tls_reported_labels_are_ignored_without_an_admins_word() {
    let pki = TestPki::new();
    let args = pki.server_args();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let orch = pki.client("orchestrator", "o");
    rt().block_on(async {
        let tls = pki.client("node", "fake");
        let ch = channel(&server.grpc, &tls).await.unwrap();
        let mut r = Reporter::register_on(ch, "fake", topology(1, 1, 2, 1), &[("zone", "eu-1")])
            .await
            .unwrap();
        r.update(1, true, states(2, &[]), "fake").await.unwrap();
        let o = client(&server.grpc, &orch).await;
        let e = o
            .pick_cpu(pb::PickCpuRequest {
                kind: pb::RequestKind::Fork as i32,
                selector: [("zone".to_string(), "eu-1".to_string())].into(),
                ..Default::default()
            })
            .await
            .expect_err("a node chose its own zone");
        assert_ne!(e.code(), Code::Ok);
        let s = o.get_node("fake").await.unwrap().summary.unwrap();
        assert!(s.labels.is_empty(), "{:?}", s.labels);
    });
}
