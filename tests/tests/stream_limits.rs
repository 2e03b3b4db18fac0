//! Streams and connections are bounded: one client, however hostile, holds
//! at most its share of the server. Real server binary, real loopback
//! sockets; each cap is set small so the test reaches it, and each refusal
//! must name its flag while well-behaved calls go on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use fairplace_client::Client;
use fairplace_e2e::{Reporter, Server, pb, rss_kib, rt, states, topology, wait_for};
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

async fn channel(addr: &str) -> Channel {
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// Opens a health Watch stream on `ch`: the stream, or the status.
async fn watch(
    ch: Channel,
) -> Result<tonic::Streaming<tonic_health::pb::HealthCheckResponse>, tonic::Status> {
    let mut s = HealthClient::new(ch)
        .watch(HealthCheckRequest::default())
        .await?
        .into_inner();
    // The first answer proves the stream is being served, not queued.
    s.message().await?;
    Ok(s)
}

/// The value of the sample line starting with `prefix` on /metrics.
fn metric(server: &Server, prefix: &str) -> f64 {
    fairplace_e2e::http_get(&server.metrics)
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Sends the HTTP/2 preface (so the connection passes screening) and
/// reports whether the server closed it within a second.
fn closed_after_preface(addr: &str) -> bool {
    let mut s = TcpStream::connect(addr).expect("tcp connect");
    s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
    let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    let mut buf = [0u8; 256];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            // The server's SETTINGS frame: it kept the connection; read on
            // until the timeout tells it stays open.
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

#[test]
fn health_watches_over_the_cap_are_refused_by_name_on_both_ports_and_their_slots_come_back() {
    let server = Server::start(&["--max-health-watches", "3", "--health-addr", "127.0.0.1:0"]);
    let health = server.health.clone().expect("health address");
    rt().block_on(async {
        let main = channel(&server.grpc).await;
        let side = channel(&health).await;
        let w1 = watch(main.clone()).await.expect("first watch");
        let _w2 = watch(main.clone()).await.expect("second watch");
        let _w3 = watch(side.clone())
            .await
            .expect("third watch, on the health port");
        for (port, ch) in [("grpc", &main), ("health", &side)] {
            let e = watch(ch.clone()).await.expect_err("a fourth watch");
            assert_eq!(e.code(), Code::ResourceExhausted, "{port}: {e:?}");
            assert!(
                e.message().contains("--max-health-watches"),
                "{port}: {e:?}"
            );
        }
        // Check is never limited, and other calls go on.
        let mut h = HealthClient::new(side.clone());
        h.check(HealthCheckRequest::default()).await.expect("Check");
        Client::from_channel(main.clone())
            .ping()
            .await
            .expect("Ping");
        assert_eq!(
            metric(&server, "fairplace_streams_open{kind=\"health_watch\"}"),
            3.0
        );
        // A stream the client drops gives its slot back.
        drop(w1);
        wait_for(Duration::from_secs(5), "a freed watch slot", || {
            rt_watch_ok(&server.grpc)
        });
    });
}

/// Whether a new Watch opens now (on its own runtime, for wait_for).
fn rt_watch_ok(addr: &str) -> Option<()> {
    let addr = addr.to_string();
    std::thread::spawn(move || {
        rt().block_on(async { watch(channel(&addr).await).await.ok().map(|_| ()) })
    })
    .join()
    .unwrap()
}

#[test]
fn connections_over_the_per_peer_cap_are_closed_at_accept_and_the_place_comes_back() {
    let server = Server::start(&["--max-connections-per-peer", "3"]);
    let held: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut s = TcpStream::connect(&server.grpc).unwrap();
            s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
            s
        })
        .collect();
    // The three are admitted: wait until the server counts them.
    wait_for(Duration::from_secs(5), "three connections open", || {
        (metric(&server, "fairplace_connections_open ") >= 3.0).then_some(())
    });
    assert!(
        closed_after_preface(&server.grpc),
        "a fourth connection is closed"
    );
    assert!(
        metric(
            &server,
            "fairplace_connections_refused_total{limit=\"per_peer\"}"
        ) >= 1.0,
        "counted by the cap it hit"
    );
    drop(held);
    // Their places come back: a real client is served again.
    wait_for(
        Duration::from_secs(5),
        "Ping after the connections closed",
        || {
            let addr = server.grpc.clone();
            std::thread::spawn(move || {
                rt().block_on(async { Client::connect(&addr).await.ok()?.ping().await.ok() })
            })
            .join()
            .unwrap()
        },
    );
}

#[test]
fn a_connection_carries_at_most_max_streams_per_connection_at_once() {
    let server = Server::start(&["--max-streams-per-connection", "2"]);
    rt().block_on(async {
        let ch = channel(&server.grpc).await;
        let w1 = watch(ch.clone()).await.expect("first");
        let _w2 = watch(ch.clone()).await.expect("second");
        // The third waits for a stream of this connection (the client
        // honours the server's SETTINGS_MAX_CONCURRENT_STREAMS).
        let third = tokio::spawn(watch(ch.clone()));
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(!third.is_finished(), "a third stream was served at once");
        // Another connection is not affected.
        Client::from_channel(channel(&server.grpc).await)
            .ping()
            .await
            .expect("Ping on another connection");
        drop(w1);
        tokio::time::timeout(Duration::from_secs(5), third)
            .await
            .expect("the third stream is served once one closes")
            .unwrap()
            .expect("third watch");
    });
}

/// A Report stream that sends nothing: (the stream's first answer or its
/// status).
async fn silent_report(addr: &str) -> Result<tonic::Streaming<pb::Ack>, tonic::Status> {
    let mut c = pb::agent_service_client::AgentServiceClient::new(channel(addr).await);
    Ok(c.report(tokio_stream::pending::<pb::AgentMessage>())
        .await?
        .into_inner())
}

#[test]
fn report_streams_waiting_for_their_register_and_in_all_are_capped_by_name() {
    // A stream that never registers is ended after a second.
    let server = Server::start(&[
        "--max-pending-registrations",
        "2",
        "--max-agent-streams",
        "4",
        "--register-timeout-ms",
        "1000",
    ]);
    rt().block_on(async {
        let s1 = silent_report(&server.grpc)
            .await
            .expect("first silent stream");
        let _s2 = silent_report(&server.grpc)
            .await
            .expect("second silent stream");
        let e = silent_report(&server.grpc).await.expect_err("a third");
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("--max-pending-registrations"), "{e:?}");
        // A real agent is refused too while they wait; once one is ended
        // for its silence, it registers.
        let e = wait_for_register(&server.grpc, "early", Duration::ZERO).await;
        assert!(e.is_none(), "registered while two streams were waiting");
        drop(s1);
        let r1 = wait_for_register(&server.grpc, "a", Duration::from_secs(5))
            .await
            .expect("a registers");
        let _r2 = wait_for_register(&server.grpc, "b", Duration::from_secs(5))
            .await
            .expect("b registers");
        // Once both silent streams have ended, two are registered: two
        // more streams fit, then the total cap.
        wait_for(Duration::from_secs(5), "the silent streams ended", || {
            (metric(&server, "fairplace_streams_open{kind=\"agent\"}") == 2.0).then_some(())
        });
        let _s3 = silent_report(&server.grpc).await.expect("third stream");
        let _s4 = silent_report(&server.grpc).await.expect("fourth stream");
        let e = silent_report(&server.grpc).await;
        let e = match e {
            Err(e) => e,
            Ok(mut s) => s.message().await.expect_err("a fifth stream"),
        };
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("--max-agent-streams"), "{e:?}");
        drop(r1);
    });
}

/// Registers node `id` on its own connection, retrying for up to `within`
/// while the server sheds it with RESOURCE_EXHAUSTED; None if it still
/// does.
async fn wait_for_register(addr: &str, id: &str, within: Duration) -> Option<Reporter> {
    let t0 = Instant::now();
    loop {
        let ch = channel(addr).await;
        match Reporter::register_on(ch, id, topology(1, 1, 2, 1), &[]).await {
            Ok(r) => return Some(r),
            Err(s) if s.code() == Code::ResourceExhausted => {
                if t0.elapsed() >= within {
                    return None;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(s) => panic!("register {id}: {s:?}"),
        }
    }
}

/// The flood: 40,000 health Watch streams over 4 connections from
/// one client, against the server's defaults. It must stay within 128 MiB
/// of its idle memory, hold no more than the default 256 watches at any
/// moment, and keep answering Ping and PickCpu.
///
/// The cap is on watches held at once, read from the server's own count
/// while the flood runs. The client's tally of watches ever opened can pass
/// it: a flood of refused streams can exhaust HTTP/2's small-frame budget
/// of a connection, the server then closes that connection
/// (ENHANCE_YOUR_CALM), the watches on it end and their slots go to the
/// streams the client sends on its new connection.
#[test]
fn a_watch_flood_leaves_the_server_within_its_memory_and_answering() {
    let server = Server::start(&[]);
    let pid = server.child.id();
    rt().block_on(async {
        let ch = channel(&server.grpc).await;
        let mut node = Reporter::register_on(ch.clone(), "n", topology(1, 1, 2, 1), &[])
            .await
            .expect("register");
        node.update(1, true, states(2, &[]), "n")
            .await
            .expect("state");
        let probe = Client::from_channel(channel(&server.grpc).await);
        probe.ping().await.unwrap();
        let idle = rss_kib(pid);
        let mut conns = Vec::new();
        for _ in 0..4 {
            conns.push(channel(&server.grpc).await);
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..40_000 {
            let ch = conns[i % 4].clone();
            let tx = tx.clone();
            tokio::spawn(async move {
                let r = HealthClient::new(ch)
                    .watch(HealthCheckRequest::default())
                    .await;
                let _ = tx.send(r.as_ref().map(|_| ()).map_err(|s| s.code()));
                // Held until the test ends.
                std::future::pending::<()>().await;
                drop(r);
            });
        }
        drop(tx);
        // Under the flood: calls on another connection are answered.
        let mut peak = idle;
        let held = "fairplace_streams_open{kind=\"health_watch\"}";
        let mut most_held = 0.0f64;
        for _ in 0..20 {
            probe.ping().await.expect("Ping under the flood");
            let pick = pb::PickCpuRequest {
                node_id: "n".into(),
                task: Some(pb::Task {
                    prev_cpu: Some(0),
                    ..Default::default()
                }),
                kind: pb::RequestKind::Wakeup as i32,
                ..Default::default()
            };
            probe.pick_cpu(pick).await.expect("PickCpu under the flood");
            peak = peak.max(rss_kib(pid));
            most_held = most_held.max(metric(&server, held));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (mut open, mut refused) = (0, 0);
        while let Ok(r) = rx.try_recv() {
            match r {
                Ok(()) => open += 1,
                Err(Code::ResourceExhausted) => refused += 1,
                Err(_) => {}
            }
        }
        peak = peak.max(rss_kib(pid));
        most_held = most_held.max(metric(&server, held));
        eprintln!(
            "idle {idle} KiB, peak {peak} KiB; at most {most_held} watches held, \
             {open} opened, {refused} refused"
        );
        assert!(
            most_held <= 256.0,
            "{most_held} watches held past the default cap"
        );
        assert!(most_held > 0.0, "the watches opened are held");
        assert!(refused > 0, "the flood was refused, not only queued");
        assert!(
            peak < idle + 128 * 1024,
            "RSS grew from {idle} KiB to {peak} KiB"
        );
    });
}
