//! PickCpu and Ping over raw HTTP/2 against the real server. The server
//! takes a unary call that is one uncompressed message on its own path
//! (server/src/service/lean.rs) and hands anything else to tonic; either
//! way the answer must be tonic's. A call that ends with request trailers is
//! always tonic's, so the same call with trailers is the reference each
//! answer is held to: the decision, or the error's code and message.

use bytes::Bytes;
use fairplace_e2e::{Reporter, Server, pb, rt, states, topology};
use prost::Message;

const PICK_CPU: &str = "/fairplace.v1.PlacementService/PickCpu";
const PING: &str = "/fairplace.v1.AdminService/Ping";

/// A call's answer: its status, message and body.
#[derive(Debug, PartialEq)]
struct Answer {
    status: String,
    message: Option<String>,
    data: Vec<u8>,
}

/// How a call's body is sent.
#[derive(Clone, Copy, Debug)]
enum Framing {
    /// One DATA frame, ending the stream.
    Whole,
    /// Three DATA frames.
    Pieces,
    /// One DATA frame, then trailers: tonic's path, the reference.
    WithTrailers,
}

async fn call(addr: &str, path: &str, body: &[u8], framing: Framing) -> Answer {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let mut client = client.ready().await.unwrap();
    let req = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (resp, mut tx) = client.send_request(req, false).unwrap();
    let b = Bytes::copy_from_slice(body);
    match framing {
        Framing::Whole => tx.send_data(b, true).unwrap(),
        Framing::Pieces => {
            let (a, c) = (b.len() / 3, 2 * b.len() / 3);
            tx.send_data(b.slice(..a), false).unwrap();
            tx.send_data(b.slice(a..c), false).unwrap();
            tx.send_data(b.slice(c..), true).unwrap();
        }
        Framing::WithTrailers => {
            tx.send_data(b, false).unwrap();
            let mut t = http::HeaderMap::new();
            t.insert("x-reference", http::HeaderValue::from_static("tonic"));
            tx.send_trailers(t).unwrap();
        }
    }
    let (parts, mut rx) = resp.await.unwrap().into_parts();
    let mut data = Vec::new();
    while let Some(d) = rx.data().await {
        let d = d.unwrap();
        let _ = rx.flow_control().release_capacity(d.len());
        data.extend_from_slice(&d);
    }
    let trailers = rx.trailers().await.unwrap();
    // An error comes trailers-only (in the headers); an answer's status
    // follows it in trailers.
    let h = trailers.as_ref().unwrap_or(&parts.headers);
    let get = |k: &str| h.get(k).map(|v| v.to_str().unwrap().to_string());
    Answer {
        status: get("grpc-status").expect("a grpc-status"),
        message: get("grpc-message"),
        data,
    }
}

/// A PickCpu answer with its state age (which differs call to call) zeroed.
fn decision(a: &Answer) -> pb::PickCpuResponse {
    let mut r = pb::PickCpuResponse::decode(&a.data[5..]).unwrap();
    r.state_age_seconds = 0.0;
    r
}

fn framed(r: &pb::PickCpuRequest) -> Vec<u8> {
    fairplace_proto::codec::frame(r).to_vec()
}

#[test]
fn pick_cpu_answers_are_tonics_however_the_call_is_framed() {
    let server = Server::start(&[]);
    rt().block_on(async {
        let mut agent = Reporter::register(&server.grpc, "n1", topology(1, 1, 4, 2))
            .await
            .unwrap();
        agent
            .update(1, true, states(8, &[1, 2, 5]), "n1")
            .await
            .unwrap();
        let on = |kind: pb::RequestKind, this_cpu: u32, prev: Option<u32>| pb::PickCpuRequest {
            node_id: "n1".into(),
            kind: kind as i32,
            this_cpu,
            task: Some(pb::Task {
                prev_cpu: prev,
                util_avg: 100,
                ..Default::default()
            }),
            ..Default::default()
        };
        let cases = [
            ("fork", on(pb::RequestKind::Fork, 0, None), "0"),
            ("wakeup", on(pb::RequestKind::Wakeup, 1, Some(2)), "0"),
            ("exec", on(pb::RequestKind::Exec, 5, None), "0"),
            (
                "no node named: the cluster's choice",
                pb::PickCpuRequest {
                    node_id: String::new(),
                    ..on(pb::RequestKind::Fork, 0, None)
                },
                "0",
            ),
            (
                "an unknown node",
                pb::PickCpuRequest {
                    node_id: "ghost".into(),
                    ..on(pb::RequestKind::Fork, 0, None)
                },
                "5",
            ),
            (
                "a CPU off the node",
                on(pb::RequestKind::Fork, 99, None),
                "3",
            ),
            (
                "a wakeup without prev_cpu",
                on(pb::RequestKind::Wakeup, 1, None),
                "3",
            ),
            (
                "exec from an idle CPU",
                on(pb::RequestKind::Exec, 0, None),
                "3",
            ),
        ];
        for (what, r, status) in cases {
            let body = framed(&r);
            let reference = call(&server.grpc, PICK_CPU, &body, Framing::WithTrailers).await;
            assert_eq!(reference.status, status, "{what}: {reference:?}");
            for framing in [Framing::Whole, Framing::Pieces] {
                let a = call(&server.grpc, PICK_CPU, &body, framing).await;
                assert_eq!(
                    (&a.status, &a.message),
                    (&reference.status, &reference.message),
                    "{what}, {framing:?}"
                );
                if a.status == "0" {
                    let d = decision(&a);
                    assert_eq!(d, decision(&reference), "{what}, {framing:?}");
                    assert_eq!(d.node_id, "n1", "{what}");
                    assert!(d.cpu < 8 && d.state_version > 0, "{what}: {d:?}");
                }
            }
        }
    });
}

#[test]
fn malformed_unary_bodies_get_tonics_errors() {
    let server = Server::start(&[]);
    let pick = framed(&pb::PickCpuRequest {
        node_id: "ghost".into(),
        ..Default::default()
    });
    let mut two = pick.clone();
    two.extend_from_slice(&framed(&pb::PickCpuRequest {
        node_id: "n1".into(),
        ..Default::default()
    }));
    let mut compressed = pick.clone();
    compressed[0] = 1;
    // tonic's own messages; a call cut short reads differently to tonic
    // when trailers end it, so the reference is held to the code only.
    let cases: [(&str, &str, Vec<u8>, &str, &str); 7] = [
        ("no message", PING, vec![], "13", "Missing request message"),
        (
            "compressed flag, no grpc-encoding",
            PING,
            vec![1, 0, 0, 0, 0],
            "13",
            "compressed-flag",
        ),
        (
            "compressed flag",
            PICK_CPU,
            compressed,
            "13",
            "compressed-flag",
        ),
        (
            "cut short",
            PICK_CPU,
            pick[..pick.len() - 2].to_vec(),
            "13",
            "EOF",
        ),
        // Field 1 with wire type 7: no such wire type.
        (
            "undecodable",
            PICK_CPU,
            vec![0, 0, 0, 0, 1, 0x0f],
            "3",
            "wire type",
        ),
        (
            "undecodable ping",
            PING,
            vec![0, 0, 0, 0, 1, 0x0f],
            "3",
            "wire type",
        ),
        // tonic answers the first of several messages.
        ("two messages", PICK_CPU, two, "5", "ghost"),
    ];
    rt().block_on(async {
        for (what, path, body, status, says) in cases {
            let reference = call(&server.grpc, path, &body, Framing::WithTrailers).await;
            assert_eq!(reference.status, status, "{what}: {reference:?}");
            let a = call(&server.grpc, path, &body, Framing::Whole).await;
            assert_eq!(a.status, status, "{what}: {a:?}");
            let msg = a.message.unwrap_or_default().replace("%20", " ");
            assert!(msg.contains(says), "{what}: {msg}");
            assert!(a.data.is_empty(), "{what}");
        }
    });
}

#[test]
fn a_ping_answers_one_empty_message_then_status_ok() {
    let server = Server::start(&[]);
    rt().block_on(async {
        for framing in [Framing::Whole, Framing::Pieces, Framing::WithTrailers] {
            let a = call(&server.grpc, PING, &[0, 0, 0, 0, 0], framing).await;
            assert_eq!(
                a,
                Answer {
                    status: "0".into(),
                    message: None,
                    data: vec![0, 0, 0, 0, 0],
                },
                "{framing:?}"
            );
        }
    });
}
