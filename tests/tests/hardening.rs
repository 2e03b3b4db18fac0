//! The real server against clients that misbehave: streams that never
//! register or go silent, connections that never speak HTTP/2, frames too
//! large to read, nonsensical flags, and SIGTERM with streams open. Each
//! must end with a bounded, named answer while well-behaved clients go on.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fairplace_e2e::{Reporter, Server, bin, pb, rt, send_signal, states, topology, wait_for};
use pb::agent_message::Body;
use tokio::sync::mpsc;
use tonic::Code;

async fn agent_client(
    server: &str,
) -> pb::agent_service_client::AgentServiceClient<tonic::transport::Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{server}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    pb::agent_service_client::AgentServiceClient::new(ch)
}

async fn admin_client(
    server: &str,
) -> pb::admin_service_client::AdminServiceClient<tonic::transport::Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{server}"))
        .unwrap()
        .connect()
        .await
        .expect("connect");
    pb::admin_service_client::AdminServiceClient::new(ch)
}

async fn node_ids(server: &str) -> Vec<String> {
    admin_client(server)
        .await
        .list_nodes(pb::ListNodesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .nodes
        .into_iter()
        .map(|n| n.id)
        .collect()
}

/// Opens a Report stream whose messages the test sends through the returned
/// sender; returns the first answer (an Ack or the status that ended it).
async fn open_stream(
    server: &str,
    first: Option<pb::AgentMessage>,
) -> (mpsc::Sender<pb::AgentMessage>, tonic::Streaming<pb::Ack>) {
    let (tx, rx) = mpsc::channel(4);
    if let Some(m) = first {
        tx.send(m).await.unwrap();
    }
    let acks = agent_client(server)
        .await
        .report(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("the stream opens")
        .into_inner();
    (tx, acks)
}

#[test]
fn a_stream_that_never_registers_is_closed_with_deadline_exceeded() {
    let server = Server::start(&["--register-timeout-ms", "300"]);
    rt().block_on(async {
        let t0 = Instant::now();
        let (_tx, mut acks) = open_stream(&server.grpc, None).await;
        let err = acks
            .message()
            .await
            .expect_err("the stream ends with a status");
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        assert!(err.message().contains("Register"), "{}", err.message());
        // Closed by the server's timer, not by this test giving up.
        assert!(t0.elapsed() < Duration::from_secs(5));
        // A well-behaved agent is still served.
        Reporter::register(&server.grpc, "ok", topology(1, 1, 2, 1))
            .await
            .unwrap();
    });
}

#[test]
fn an_oversized_first_frame_ends_the_stream_with_a_reason() {
    let server = Server::start(&["--max-message-bytes", "4096"]);
    rt().block_on(async {
        let big = pb::AgentMessage {
            body: Some(Body::Register(pb::Register {
                node_id: "big".into(),
                labels: [("blob".to_string(), "x".repeat(64 << 10))].into(),
                topology: Some(topology(1, 1, 2, 1)),
                agent_version: "test".into(),
                ..Default::default()
            })),
        };
        let (_tx, mut acks) = open_stream(&server.grpc, Some(big)).await;
        let err = acks.message().await.expect_err("never an OK end");
        assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
        assert!(err.message().starts_with("message:"), "{}", err.message());
        assert!(node_ids(&server.grpc).await.is_empty(), "nothing stored");
    });
}

#[test]
fn a_registered_stream_that_goes_silent_is_closed_and_its_node_forgotten() {
    let server = Server::start(&["--forget-after-s", "1"]);
    rt().block_on(async {
        let mut quiet = Reporter::register(&server.grpc, "quiet", topology(1, 1, 2, 1))
            .await
            .unwrap();
        quiet
            .update(1, true, states(2, &[]), "quiet")
            .await
            .unwrap();
        assert_eq!(node_ids(&server.grpc).await, ["quiet"]);
        // Nothing more is sent; the stream stays open from this side.
        let err = tokio::time::timeout(Duration::from_secs(10), quiet.acks.message())
            .await
            .expect("the server ends the silent stream")
            .expect_err("with a status");
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
        assert!(err.message().contains("forgotten"), "{}", err.message());
        assert!(node_ids(&server.grpc).await.is_empty());
        // The agent can come back.
        let mut back = Reporter::register(&server.grpc, "quiet", topology(1, 1, 2, 1))
            .await
            .unwrap();
        back.update(1, true, states(2, &[]), "quiet").await.unwrap();
        assert_eq!(node_ids(&server.grpc).await, ["quiet"]);
    });
}

/// Host and port of the server's gRPC listener.
fn addr(server: &Server) -> String {
    server.grpc.clone()
}

/// True once the peer has closed `s` (EOF or reset) within `limit`.
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut buf = [0u8; 64];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return false,
            Err(_) => return true,
        }
    }
}

#[test]
fn connections_that_never_speak_http2_are_closed() {
    let server = Server::start(&["--preface-timeout-ms", "300"]);
    // Silent.
    let mut silent = TcpStream::connect(addr(&server)).unwrap();
    // Half a preface, then nothing.
    let mut half = TcpStream::connect(addr(&server)).unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").unwrap();
    // Not HTTP/2 at all.
    let mut http1 = TcpStream::connect(addr(&server)).unwrap();
    http1
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    for (name, s) in [
        ("silent", &mut silent),
        ("half", &mut half),
        ("http1", &mut http1),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(5)),
            "{name} connection still open"
        );
    }
    // Real clients are served meanwhile and after.
    rt().block_on(async {
        assert!(node_ids(&server.grpc).await.is_empty());
    });
}

#[test]
fn sigterm_ends_open_streams_with_unavailable_and_exits_within_the_grace() {
    let mut server = Server::start(&["--shutdown-grace-ms", "1000"]);
    rt().block_on(async {
        let mut r = Reporter::register(&server.grpc, "n", topology(1, 1, 2, 1))
            .await
            .unwrap();
        r.update(1, true, states(2, &[]), "n").await.unwrap();
        // A stream that never registers stays open too.
        let (_tx, mut idle) = open_stream(&server.grpc, None).await;
        let t0 = Instant::now();
        send_signal(server.child.id(), 15);
        let err = tokio::time::timeout(Duration::from_secs(5), r.acks.message())
            .await
            .expect("the stream ends")
            .expect_err("with a status");
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        let err = tokio::time::timeout(Duration::from_secs(5), idle.message())
            .await
            .expect("the unregistered stream ends")
            .expect_err("with a status");
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        let status = wait_for(Duration::from_secs(10), "server exit", || {
            server.child.try_wait().unwrap()
        });
        assert!(status.success(), "{status:?}");
        // Streams closed at once; the exit comes at most one grace later.
        assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    });
}

#[test]
fn nonsensical_flag_values_are_refused_naming_the_flag() {
    for flag in [
        "--max-concurrency",
        "--max-message-bytes",
        "--stale-after-ms",
        "--forget-after-s",
        "--register-timeout-ms",
        "--request-timeout-ms",
    ] {
        let out = Command::new(bin("fairplace-server"))
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .args([flag, "0"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{flag} 0 accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(flag), "{flag}: {err}");
    }
}

/// CPU time (user + system, clock ticks) of a process.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime) are 12 and 13 after the name.
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

#[test]
fn out_of_descriptors_the_server_backs_off_and_logs_once_per_interval() {
    // The server with 64 descriptors; 200 connections exhaust them, so
    // accept() fails with EMFILE while they stay open.
    let log = std::env::temp_dir().join(format!("fairplace-emfile-{}.log", std::process::id()));
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!(
            "ulimit -n 64 && exec {} serve --grpc-addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 --lease-store memory 2>{}",
            bin("fairplace-server").display(),
            log.display()
        ))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let grpc = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("grpc="))
        .expect("grpc address")
        .to_string();
    let conns: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(&grpc).ok())
        .collect();
    assert!(conns.len() > 64, "the backlog took the connections");
    std::thread::sleep(Duration::from_millis(500));
    let t0 = cpu_ticks(child.id());
    std::thread::sleep(Duration::from_secs(3));
    let used = cpu_ticks(child.id()) - t0;
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    std::fs::remove_file(&log).ok();
    let warnings = text.lines().filter(|l| l.contains("accept failed")).count();
    assert!(warnings >= 1, "the failure is logged: {text}");
    // At most one line per 10 s (plus the first), not one per attempt.
    assert!(warnings <= 2, "{warnings} accept warnings:\n{text}");
    // Backing off, not spinning: well under a core over 3 s (300 ticks).
    assert!(
        used < 60,
        "{used} ticks of CPU in 3 s while out of descriptors"
    );
    drop(conns);
}
