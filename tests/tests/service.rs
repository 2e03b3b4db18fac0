//! The service over real loopback sockets: PickCpu against reported state,
//! claims, staleness, and every RPC's bad input.

use std::time::Duration;

use fairplace_client::Client;
use fairplace_e2e::{Reporter, Server, pb, rt, states, topology, wait_for};
use tonic::Code;

fn wakeup(node: &str, this: u32, prev: u32, claim: bool) -> pb::PickCpuRequest {
    pb::PickCpuRequest {
        node_id: node.into(),
        task: Some(pb::Task {
            prev_cpu: Some(prev),
            ..Default::default()
        }),
        kind: pb::RequestKind::Wakeup as i32,
        this_cpu: this,
        claim,
        ..Default::default()
    }
}

#[test]
fn pick_cpu_answers_from_the_reported_state() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "n1", topology(1, 1, 4, 2))
            .await
            .unwrap();
        // CPUs 0-1 (core 0) and 2 are busy; this = prev = 0 so the target is
        // 0, busy. Idle cores exist, so select_idle_cpu walks cores from CPU
        // 1: core {0,1} tests 0 and 1 (both busy, nothing recorded), core
        // {2,3} tests 2 (busy) and 3 (idle: the fallback), core {4,5} tests
        // 4 and 5, both idle: idle core 4 after 6 tests.
        let ack = r
            .update(1, true, states(8, &[0, 1, 2]), "n1")
            .await
            .unwrap();
        assert_eq!(ack.applied_seq, 1);
        assert!(ack.rejection.is_none());
        let c = Client::connect(&server.grpc).await.unwrap();
        let p = c.pick_cpu(wakeup("n1", 0, 0, false)).await.unwrap();
        assert_eq!((p.cpu, p.path.as_str()), (4, "idle_core"));
        assert_eq!(p.scanned, 6);
        assert_eq!(p.state_version, 2);
        assert!(p.state_age_seconds >= 0.0 && p.state_age_seconds < 5.0);
        // The same request through Decide and through the CLI-free scenario path.
        let node = c.get_node("n1").await.unwrap();
        let mut sc = fairplace_e2e::scenario_of(&node);
        sc["task"] = serde_json::json!({"prev_cpu": 0});
        sc["request"] = serde_json::json!({"kind": "wakeup", "this_cpu": 0});
        let a: serde_json::Value =
            serde_json::from_str(&c.decide(&sc.to_string()).await.unwrap()).unwrap();
        assert_eq!(
            (a["cpu"].as_u64(), a["path"].as_str(), a["scanned"].as_u64()),
            (Some(4), Some("idle_core"), Some(6))
        );
    });
}

#[test]
fn sixty_four_concurrent_claims_get_sixty_four_distinct_cpus() {
    let server = Server::start(&["--claim-ttl-ms", "60000"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "big", topology(1, 1, 32, 2))
            .await
            .unwrap();
        r.update(1, true, states(64, &[]), "big").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let mut tasks = Vec::new();
        for i in 0..64u32 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                c.pick_cpu(wakeup("big", i % 64, i % 64, true)).await
            }));
        }
        let mut cpus = Vec::new();
        for t in tasks {
            cpus.push(t.await.unwrap().unwrap().cpu);
        }
        cpus.sort_unstable();
        cpus.dedup();
        assert_eq!(
            cpus.len(),
            64,
            "claims must make every answer distinct: {cpus:?}"
        );
        let node = c.get_node("big").await.unwrap();
        assert_eq!(node.claims.values().sum::<u32>(), 64);
        assert!(node.summary.unwrap().idle_cpus == 0);
        // A report of CPU 5 supersedes its claim.
        let ack = r
            .update(
                2,
                false,
                states(64, &[]).into_iter().filter(|s| s.id == 5).collect(),
                "big",
            )
            .await
            .unwrap();
        assert!(ack.rejection.is_none());
        let node = c.get_node("big").await.unwrap();
        assert_eq!(node.claims.get(&5), None);
        assert_eq!(node.claims.values().sum::<u32>(), 63);
    });
}

#[test]
fn sixty_four_claimed_forks_without_idle_stamps_spread_over_the_idle_cpus() {
    // Every CPU idle, with no idle-state exit latency and idle_stamp 0: what
    // an agent on a machine without cpuidle sent. The slow path's
    // sched_balance_find_dst_group_cpu takes the most recently idle CPU with
    // a stamp above 0; with none it keeps this_cpu, and every fork landed on
    // CPU 0. The store stamps such CPUs with the report that first showed
    // them idle, as the kernel stamps a CPU going idle.
    let server = Server::start(&["--claim-ttl-ms", "60000"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "forks", topology(2, 1, 16, 2))
            .await
            .unwrap();
        let idle = states(64, &[]);
        assert!(
            idle.iter()
                .all(|s| s.idle_stamp == 0 && s.idle_exit_latency.is_none())
        );
        let ack = r.update(1, true, idle, "forks").await.unwrap();
        assert!(ack.rejection.is_none());
        let c = Client::connect(&server.grpc).await.unwrap();
        let node = c.get_node("forks").await.unwrap();
        assert!(
            node.cpus.iter().all(|s| s.idle_stamp > 0),
            "the store stamps idle CPUs reported without a stamp"
        );
        let mut tasks = Vec::new();
        for _ in 0..64 {
            let c = c.clone();
            tasks.push(tokio::spawn(async move {
                c.pick_cpu(pb::PickCpuRequest {
                    node_id: "forks".into(),
                    kind: pb::RequestKind::Fork as i32,
                    this_cpu: 0,
                    claim: true,
                    ..Default::default()
                })
                .await
            }));
        }
        let mut cpus = Vec::new();
        for t in tasks {
            cpus.push(t.await.unwrap().unwrap().cpu);
        }
        let on_0 = cpus.iter().filter(|&&c| c == 0).count();
        cpus.sort_unstable();
        cpus.dedup();
        assert_eq!(
            cpus.len(),
            64,
            "64 claimed forks on 64 idle CPUs take one each ({on_0} on CPU 0): {cpus:?}"
        );
        let node = c.get_node("forks").await.unwrap();
        assert_eq!(node.claims.values().sum::<u32>(), 64);
        // A report showing a CPU still idle keeps its stamp; one that shows
        // it busy drops it, and idle again restamps it later.
        let stamp = |n: &pb::GetNodeResponse, cpu: usize| n.cpus[cpu].idle_stamp;
        let s3 = stamp(&node, 3);
        let mut busy = states(64, &[4]);
        busy.retain(|s| s.id == 3 || s.id == 4);
        r.update(2, false, busy, "forks").await.unwrap();
        let n2 = c.get_node("forks").await.unwrap();
        assert_eq!(stamp(&n2, 3), s3);
        assert_eq!(stamp(&n2, 4), 0);
        let mut again = states(64, &[]);
        again.retain(|s| s.id == 4);
        r.update(3, false, again, "forks").await.unwrap();
        let n3 = c.get_node("forks").await.unwrap();
        assert!(stamp(&n3, 4) > s3, "{} > {s3}", stamp(&n3, 4));
    });
}

#[test]
fn pick_cpus_answers_in_order_as_pick_cpu_does_and_errors_do_not_end_the_stream() {
    let server = Server::start(&["--claim-ttl-ms", "60000", "--max-pick-streams", "2"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "big", topology(1, 1, 32, 2))
            .await
            .unwrap();
        r.update(1, true, states(64, &[0, 1, 2]), "big")
            .await
            .unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        // The unary call and the stream agree on the same unclaimed request.
        let unary = c.pick_cpu(wakeup("big", 0, 0, false)).await.unwrap();
        // 61 claimed wakeups (one per idle CPU), with two bad requests among
        // them, on one stream.
        let mut reqs: Vec<pb::PickCpuRequest> =
            (0..61u32).map(|i| wakeup("big", i, i, true)).collect();
        reqs.insert(10, wakeup("big", 1000, 0, true));
        reqs.insert(20, wakeup("nowhere", 0, 0, true));
        reqs.insert(0, wakeup("big", 0, 0, false));
        let answers = c.pick_cpus(reqs).await.expect("the stream");
        assert_eq!(answers.len(), 64);
        let first = answers[0].as_ref().unwrap();
        assert_eq!(
            (first.cpu, first.path.as_str(), first.scanned),
            (unary.cpu, unary.path.as_str(), unary.scanned)
        );
        let e = answers[11].as_ref().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().starts_with("this_cpu:"), "{e}");
        assert_eq!(answers[21].as_ref().unwrap_err().code(), Code::NotFound);
        // The claims hold across the stream: every idle CPU once.
        let mut cpus: Vec<u32> = answers
            .iter()
            .enumerate()
            .filter(|(i, _)| ![0, 11, 21].contains(i))
            .map(|(_, a)| a.as_ref().unwrap().cpu)
            .collect();
        cpus.sort_unstable();
        cpus.dedup();
        assert_eq!(
            cpus.len(),
            61,
            "claimed picks on one stream must be distinct: {cpus:?}"
        );
        assert!(cpus.iter().all(|c| *c > 2), "a busy CPU chosen: {cpus:?}");
        let node = c.get_node("big").await.unwrap();
        assert_eq!(node.claims.values().sum::<u32>(), 61);
        // The streams open at once are capped: a third is refused at once.
        let (_tx1, rx1) = tokio::sync::mpsc::channel::<pb::PickCpuRequest>(1);
        let (_tx2, rx2) = tokio::sync::mpsc::channel::<pb::PickCpuRequest>(1);
        let (_tx3, rx3) = tokio::sync::mpsc::channel::<pb::PickCpuRequest>(1);
        let _s1 = c
            .pick_cpus_stream(tokio_stream::wrappers::ReceiverStream::new(rx1))
            .await
            .unwrap();
        let _s2 = c
            .pick_cpus_stream(tokio_stream::wrappers::ReceiverStream::new(rx2))
            .await
            .unwrap();
        let e = c
            .pick_cpus_stream(tokio_stream::wrappers::ReceiverStream::new(rx3))
            .await
            .expect_err("a third stream over --max-pick-streams 2");
        assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
        assert!(e.message().contains("--max-pick-streams"), "{e}");
    });
}

#[test]
fn an_open_pick_cpus_stream_ends_at_shutdown_and_does_not_hold_it_up() {
    let mut server = Server::start(&[]);
    let rt = rt();
    let (tx, mut answers) = rt.block_on(async {
        let mut r = Reporter::register(&server.grpc, "n", topology(1, 1, 2, 1))
            .await
            .unwrap();
        r.update(1, true, states(2, &[]), "n").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut answers = c
            .pick_cpus_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap();
        tx.send(wakeup("n", 0, 0, false)).await.unwrap();
        let a = answers.message().await.unwrap().unwrap();
        assert_eq!(a.seq, 0);
        (tx, answers)
    });
    // The stream stays open (its sender is held); SIGTERM must still end
    // the server, and the stream with UNAVAILABLE.
    let t0 = std::time::Instant::now();
    fairplace_e2e::send_signal(server.pid(), 15);
    let end = rt
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), answers.message()).await });
    let e = end
        .expect("the stream ended")
        .expect_err("ended with a status");
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(e.message().contains("shutting down"), "{e}");
    let status = server.wait();
    assert!(status.success(), "{status:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        t0.elapsed()
    );
    drop(tx);
}

#[test]
fn claims_end_with_their_ttl() {
    let server = Server::start(&["--claim-ttl-ms", "100"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "n", topology(1, 1, 2, 1))
            .await
            .unwrap();
        r.update(1, true, states(2, &[]), "n").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let p = c.pick_cpu(wakeup("n", 0, 0, true)).await.unwrap();
        assert_eq!(c.get_node("n").await.unwrap().claims.get(&p.cpu), Some(&1));
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(c.get_node("n").await.unwrap().claims.is_empty());
    });
}

#[test]
fn a_stale_node_is_refused_with_its_age_and_listed_as_stale() {
    let server = Server::start(&["--stale-after-ms", "300"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "s", topology(1, 1, 2, 1))
            .await
            .unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        // Registered but never reported: no state to decide on.
        let e = c.pick_cpu(wakeup("s", 0, 0, false)).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        r.update(1, true, states(2, &[]), "s").await.unwrap();
        assert!(c.pick_cpu(wakeup("s", 0, 0, false)).await.is_ok());
        tokio::time::sleep(Duration::from_millis(500)).await;
        let e = c.pick_cpu(wakeup("s", 0, 0, false)).await.unwrap_err();
        assert_eq!(e.code(), Code::FailedPrecondition);
        assert!(
            e.message().contains("stale") && e.message().contains(" s ago"),
            "{}",
            e.message()
        );
        let n = &c.list_nodes().await.unwrap()[0];
        assert!(!n.fresh && n.connected && n.age_seconds >= 0.4);
        // A fresh report makes it usable again.
        r.update(2, false, vec![], "s").await.unwrap();
        assert!(c.pick_cpu(wakeup("s", 0, 0, false)).await.is_ok());
    });
}

#[test]
fn bad_placement_requests_are_invalid_argument_naming_the_field() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "n", topology(1, 1, 4, 1))
            .await
            .unwrap();
        r.update(1, true, states(4, &[1]), "n").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let before = c.get_node("n").await.unwrap();
        let e = c.pick_cpu(wakeup("nope", 0, 0, false)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound);
        assert!(e.message().starts_with("node_id:"));
        let check = |e: tonic::Status, field: &str| {
            assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
            assert!(
                e.message().starts_with(field),
                "{} should name {field}",
                e.message()
            );
        };
        check(
            c.pick_cpu(wakeup("n", 9, 0, false)).await.unwrap_err(),
            "this_cpu:",
        );
        check(
            c.pick_cpu(wakeup("n", 0, 4, false)).await.unwrap_err(),
            "task.prev_cpu:",
        );
        for bad in ["", "0-9", "a", "3-1", "1,,2"] {
            let mut req = wakeup("n", 0, 0, false);
            req.task.as_mut().unwrap().cpus_allowed = bad.into();
            if bad.is_empty() {
                // Empty means every CPU: valid.
                assert!(c.pick_cpu(req).await.is_ok());
            } else {
                check(c.pick_cpu(req).await.unwrap_err(), "task.cpus_allowed:");
            }
        }
        let mut req = wakeup("n", 0, 0, false);
        req.task.as_mut().unwrap().load_avg = -5;
        check(c.pick_cpu(req).await.unwrap_err(), "task.load_avg:");
        let mut req = wakeup("n", 0, 0, false);
        req.task.as_mut().unwrap().uclamp_min = 2000;
        check(c.pick_cpu(req).await.unwrap_err(), "task.uclamp_min:");
        let mut req = wakeup("n", 0, 0, false);
        req.task = None;
        check(c.pick_cpu(req).await.unwrap_err(), "task.prev_cpu:");
        let mut req = wakeup("n", 0, 0, false);
        req.kind = 7;
        check(c.pick_cpu(req).await.unwrap_err(), "kind:");
        // CanMigrate and Decide.
        let m = pb::CanMigrateRequest {
            node_id: "n".into(),
            src_cpu: 1,
            dst_cpu: 1,
            ..Default::default()
        };
        check(c.can_migrate(m.clone()).await.unwrap_err(), "dst_cpu:");
        check(
            c.can_migrate(pb::CanMigrateRequest {
                dst_cpu: 2,
                sd_level: "NUMA9".into(),
                ..m.clone()
            })
            .await
            .unwrap_err(),
            "sd_level:",
        );
        check(
            c.can_migrate(pb::CanMigrateRequest {
                dst_cpu: 2,
                flags: vec!["X".into()],
                ..m.clone()
            })
            .await
            .unwrap_err(),
            "flags[0]:",
        );
        let ok = c
            .can_migrate(pb::CanMigrateRequest { dst_cpu: 2, ..m })
            .await
            .unwrap();
        // now (0) - exec_start (0) < migration_cost: hot, and no balance
        // failures yet, so the balancer must leave it.
        assert_eq!(
            (ok.allowed, ok.reason.as_str(), ok.task_hot),
            (false, "hot", Some(true))
        );
        check(c.decide("{not json").await.unwrap_err(), "scenario_json:");
        check(
            c.decide(r#"{"request": {"kind": "wakeup"}}"#)
                .await
                .unwrap_err(),
            "topology:",
        );
        // None of it touched the stored state.
        let after = c.get_node("n").await.unwrap();
        assert_eq!(before.cpus, after.cpus);
        assert_eq!(
            before.summary.unwrap().state_version,
            after.summary.unwrap().state_version
        );
    });
}

#[test]
fn bad_reports_are_rejected_and_leave_the_state_unchanged() {
    let server = Server::start(&["--max-message-bytes", "65536"]);
    rt().block_on(async {
        // An inconsistent topology: core 0 in two LLCs.
        let mut t = topology(1, 2, 1, 2);
        t.cpus[1].llc = 1;
        t.cpus[1].core = 0;
        let e = Reporter::register(&server.grpc, "bad", t)
            .await
            .err()
            .expect("refused");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(
            e.message().starts_with("register.topology.cpus[1].llc:"),
            "{}",
            e.message()
        );
        let mut t = topology(1, 1, 2, 1);
        t.cpus[1].capacity = 5000;
        let e = Reporter::register(&server.grpc, "bad", t)
            .await
            .err()
            .expect("refused");
        assert!(
            e.message()
                .starts_with("register.topology.cpus[1].capacity:"),
            "{}",
            e.message()
        );

        let c = Client::connect(&server.grpc).await.unwrap();
        let mut r = Reporter::register(&server.grpc, "n", topology(1, 1, 4, 1))
            .await
            .unwrap();
        r.update(1, true, states(4, &[0]), "n").await.unwrap();
        let before = c.get_node("n").await.unwrap();

        // A delta out of sequence: rejected, resync asked.
        let a = r.update(5, false, states(4, &[]), "n").await.unwrap();
        let rej = a.rejection.expect("rejected");
        assert_eq!(rej.reason, "out_of_sequence");
        assert!(a.resync_required);
        assert!(rej.message.starts_with("update.seq:"));
        // Negative load, too many SCHED_IDLE tasks, a CPU out of range, a
        // full snapshot missing CPUs: each names its field.
        let mut s = states(4, &[]);
        s[2].load_avg = -1;
        let a = r.update(2, false, s, "n").await.unwrap();
        assert!(
            a.rejection
                .unwrap()
                .message
                .starts_with("update.cpus[2].load_avg:")
        );
        let mut s = states(4, &[1]);
        s[1].h_nr_idle = 3;
        let a = r.update(2, false, s, "n").await.unwrap();
        assert!(
            a.rejection
                .unwrap()
                .message
                .starts_with("update.cpus[1].h_nr_idle:")
        );
        let mut s = states(4, &[]);
        s[3].id = 40;
        let a = r.update(2, false, s, "n").await.unwrap();
        assert!(
            a.rejection
                .unwrap()
                .message
                .starts_with("update.cpus[3].id:")
        );
        let a = r.update(2, true, states(3, &[]), "n").await.unwrap();
        assert!(a.rejection.unwrap().message.starts_with("update.cpus:"));
        let after = c.get_node("n").await.unwrap();
        assert_eq!(before.cpus, after.cpus, "rejected updates change nothing");
        assert_eq!(after.last_seq, 1);

        // A report naming another node ends the stream with INVALID_ARGUMENT.
        let e = r.update(2, false, vec![], "other").await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(
            e.message().starts_with("update.node_id:"),
            "{}",
            e.message()
        );
        assert_eq!(c.get_node("n").await.unwrap().cpus, before.cpus);

        // An oversized message is refused by the transport.
        let mut r = Reporter::register(&server.grpc, "n2", topology(1, 1, 4, 1))
            .await
            .unwrap();
        let mut huge = states(4, &[]);
        for i in 0..20_000 {
            huge.push(pb::CpuState {
                id: i,
                ..Default::default()
            });
        }
        let e = r.update(1, true, huge, "n2").await.unwrap_err();
        assert!(
            matches!(e.code(), Code::ResourceExhausted | Code::OutOfRange),
            "{e:?}"
        );
        let n2 = c.get_node("n2").await.unwrap();
        assert_eq!(n2.last_seq, 0);
    });
}

#[test]
fn health_and_reflection_answer() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut h = tonic_health::pb::health_client::HealthClient::new(ch.clone());
        for svc in [
            "",
            "fairplace.v1.PlacementService",
            "fairplace.v1.AgentService",
            "fairplace.v1.AdminService",
        ] {
            let r = h
                .check(tonic_health::pb::HealthCheckRequest {
                    service: svc.into(),
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(
                r.status,
                tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
                "{svc}"
            );
        }
        let e = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: "nope".into(),
            })
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound);

        use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
        let mut refl = ServerReflectionClient::new(ch);
        let req = tonic_reflection::pb::v1::ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = refl
            .server_reflection_info(tokio_stream::iter([req]))
            .await
            .unwrap()
            .into_inner();
        let msg = resp.message().await.unwrap().unwrap();
        let Some(MessageResponse::ListServicesResponse(list)) = msg.message_response else {
            panic!("no service list")
        };
        let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
        for want in [
            "fairplace.v1.PlacementService",
            "fairplace.v1.AgentService",
            "fairplace.v1.AdminService",
            "grpc.health.v1.Health",
        ] {
            assert!(
                names.iter().any(|n| n == want),
                "{want} missing from {names:?}"
            );
        }
    });
}

#[test]
fn sigterm_shuts_down_gracefully() {
    // One heavy worker, so Decide calls queue behind each other and are
    // still in flight when the signal comes.
    let mut server = Server::start(&["--heavy-workers", "1", "--heavy-queue", "16"]);
    let addr = server.grpc.clone();
    let pid = server.pid();
    let rt = rt();
    let (health, mut report, calls) = rt.block_on(async {
        let mut r = Reporter::register(&addr, "n", topology(1, 1, 2, 1))
            .await
            .unwrap();
        r.update(1, true, states(2, &[]), "n").await.unwrap();
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        let mut hc = tonic_health::pb::health_client::HealthClient::new(ch);
        let mut watch = hc
            .watch(tonic_health::pb::HealthCheckRequest {
                service: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        let first = watch.message().await.unwrap().unwrap();
        assert_eq!(
            first.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32
        );
        let c = Client::connect(&addr).await.unwrap();
        let scenario = big_fork_scenario().to_string();
        let calls: Vec<_> = (0..8)
            .map(|_| {
                let (c, s) = (c.clone(), scenario.clone());
                tokio::spawn(async move {
                    let r = c.decide(&s).await;
                    (r, std::time::Instant::now())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        (watch, r, calls)
    });
    fairplace_e2e::send_signal(pid, 15);
    let signalled = std::time::Instant::now();
    rt.block_on(async {
        // Health turns NOT_SERVING for those watching.
        let mut health = health;
        let mut seen = vec![];
        while let Ok(Some(m)) = health.message().await {
            seen.push(m.status);
        }
        let not_serving = tonic_health::pb::health_check_response::ServingStatus::NotServing as i32;
        assert!(
            seen.contains(&not_serving),
            "health statuses after SIGTERM: {seen:?}"
        );
        // The agent's stream is ended by the server, retriably.
        let e = report
            .acks
            .message()
            .await
            .expect_err("the Report stream ends");
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        // Every call in flight is answered, some of them after the signal.
        let mut after = 0;
        for h in calls {
            let (r, done) = h.await.unwrap();
            let answer = r.expect("a call in flight at SIGTERM completes");
            assert!(answer.contains("\"cpu\""), "{answer}");
            after += (done > signalled) as u32;
        }
        assert!(after > 0, "no call was still in flight at SIGTERM");
    });
    let status = server.wait();
    assert!(status.success(), "graceful exit: {status:?}");
    wait_for(Duration::from_secs(2), "the port to close", || {
        std::net::TcpStream::connect(&addr).is_err().then_some(())
    });
}

/// A fork on 2,048 CPUs (8 NUMA nodes of 16 LLCs of 8 SMT2 cores): a
/// Decide that builds a large domain tree and walks the slow path, slow
/// enough to queue.
fn big_fork_scenario() -> serde_json::Value {
    let cpus: Vec<serde_json::Value> = (0..2048)
        .map(|i| serde_json::json!({"id": i, "core": i / 2, "llc": i / 16, "node": i / 256}))
        .collect();
    serde_json::json!({
        "topology": {"cpus": cpus},
        "task": {},
        "request": {"kind": "fork", "this_cpu": 0}
    })
}

#[test]
fn features_are_set_globally_and_per_node() {
    let server = Server::start(&["--admin-token", "s3cret"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "n", topology(1, 1, 2, 1))
            .await
            .unwrap();
        r.update(1, true, states(2, &[]), "n").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let set = |node: &str, name: &str, on: bool| pb::SetFeaturesRequest {
            node_id: node.into(),
            set: [(name.to_string(), on)].into(),
            clear_overrides: false,
        };
        // The authorization hook: SetFeatures needs the token.
        let e = c.set_features(set("", "WA_BIAS", false)).await.unwrap_err();
        assert_eq!(e.code(), Code::Unauthenticated);
        let c = c.with_token(Some("s3cret".into()));
        let g = c.set_features(set("", "WA_BIAS", false)).await.unwrap();
        assert!(!g.features["WA_BIAS"]);
        assert!(!c.get_features("n").await.unwrap().features["WA_BIAS"]);
        let f = c
            .set_features(set("n", "PREFER_LAST_IDLE_CPU", true))
            .await
            .unwrap();
        assert!(f.features["PREFER_LAST_IDLE_CPU"]);
        assert_eq!(f.overridden, vec!["PREFER_LAST_IDLE_CPU".to_string()]);
        assert!(!c.get_features("").await.unwrap().features["PREFER_LAST_IDLE_CPU"]);
        let e = c.set_features(set("", "SIS_PROP", true)).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().starts_with("set.SIS_PROP:"));
    });
}

#[test]
fn the_client_retries_while_the_server_is_unavailable() {
    // Reserve a port, then start the server on it only after the first call.
    fairplace_e2e::bin("fairplace-server");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    rt().block_on(async {
        let mut c = Client::connect_lazy(&addr).unwrap();
        c.attempts = 1;
        let e = c.ping().await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "nothing listens yet");
        let e = c.list_nodes().await.unwrap_err();
        assert_eq!(e.code(), Code::Unavailable, "one attempt gives up at once");
        let starter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(150));
            Server::start(&["--grpc-addr", &format!("127.0.0.1:{port}")])
        });
        // 20 + 40 + 80 + 160 + 320 ms of backoff cover the server's start;
        // Ping retries as every other call does.
        c.attempts = 8;
        c.ping().await.expect("retried until the server came up");
        let nodes = c.list_nodes().await.expect("the server is up");
        assert!(nodes.is_empty());
        drop(starter.join().unwrap());
    });
}

#[test]
fn a_hung_server_answers_no_client_call_past_its_deadline() {
    // A peer that completes TCP handshakes (the kernel's backlog) and never
    // answers: a hung server.
    let hung = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = hung.local_addr().unwrap().to_string();
    rt().block_on(async {
        let mut c = Client::connect_lazy(&addr).unwrap();
        c.deadline = Duration::from_millis(300);
        c.attempts = 1;
        // The channel applies the request's grpc-timeout itself (CANCELLED,
        // "Timeout expired") at the instant the client's own timer does
        // (DEADLINE_EXCEEDED); either ends the call.
        let ended =
            |s: &tonic::Status| matches!(s.code(), Code::DeadlineExceeded | Code::Cancelled);
        let ping = tokio::time::timeout(Duration::from_secs(10), c.ping())
            .await
            .expect("Ping came back on its own")
            .unwrap_err();
        assert!(ended(&ping), "{ping:?}");
        let list = tokio::time::timeout(Duration::from_secs(10), c.list_nodes())
            .await
            .expect("ListNodes came back on its own")
            .unwrap_err();
        assert!(ended(&list), "{list:?}");
    });
    drop(hung);
}

#[test]
fn pick_cpu_without_a_node_places_on_the_cluster() {
    let server = Server::start(&[]);
    rt().block_on(async {
        // Zone a: 8 CPUs, 6 busy; zone b: 8 CPUs, 1 busy.
        let mut a = Reporter::register_labelled(
            &server.grpc,
            "a1",
            topology(1, 1, 4, 2),
            &[("zone", "a"), ("rack", "r")],
        )
        .await
        .unwrap();
        a.update(1, true, states(8, &[0, 1, 2, 3, 4, 5]), "a1")
            .await
            .unwrap();
        let mut b = Reporter::register_labelled(
            &server.grpc,
            "b1",
            topology(1, 1, 4, 2),
            &[("zone", "b"), ("rack", "r")],
        )
        .await
        .unwrap();
        b.update(1, true, states(8, &[0]), "b1").await.unwrap();
        let c = Client::connect(&server.grpc).await.unwrap();
        let req = pb::PickCpuRequest {
            kind: pb::RequestKind::Fork as i32,
            ..Default::default()
        };
        let p = c.pick_cpu(req.clone()).await.unwrap();
        assert_eq!(p.node_id, "b1", "the idler zone");
        assert_eq!(p.cluster_level, "top");
        assert_eq!(p.path, "slow_path");
        assert_ne!(p.cpu, 0, "CPU 0 of b1 is busy");
        assert!(
            p.groups_compared >= 3,
            "2 zones + 1 rack + 1 node at least: {}",
            p.groups_compared
        );
        // A selector on the zone.
        let mut sel = req.clone();
        sel.selector = [("zone".to_string(), "a".to_string())].into();
        assert_eq!(c.pick_cpu(sel).await.unwrap().node_id, "a1");
        // Only hierarchy labels select.
        let mut bad = req.clone();
        bad.selector = [("gpu".to_string(), "yes".to_string())].into();
        let e = c.pick_cpu(bad).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().starts_with("selector.gpu:"), "{}", e.message());
        // Two bad keys: the first in key order is named, every time.
        for _ in 0..8 {
            let mut two = req.clone();
            two.selector = [
                ("zone_x".to_string(), "1".to_string()),
                ("gpu".to_string(), "yes".to_string()),
            ]
            .into();
            let e = c.pick_cpu(two).await.unwrap_err();
            assert!(e.message().starts_with("selector.gpu:"), "{}", e.message());
        }
        // A wakeup naming its previous node stays there while it is fresh.
        let w = pb::PickCpuRequest {
            kind: pb::RequestKind::Wakeup as i32,
            prev_node: "a1".into(),
            task: Some(pb::Task {
                prev_cpu: Some(0),
                ..Default::default()
            }),
            ..Default::default()
        };
        let p = c.pick_cpu(w).await.unwrap();
        assert_eq!(
            (p.node_id.as_str(), p.cluster_level.as_str()),
            ("a1", "prev_node")
        );
        // No node has CPU 100.
        let mut far = req.clone();
        far.task = Some(pb::Task {
            cpus_allowed: "100".into(),
            ..Default::default()
        });
        assert_eq!(
            c.pick_cpu(far).await.unwrap_err().code(),
            Code::FailedPrecondition
        );
    });
}
