//! A request body that is not a protobuf message of the method's type is
//! the caller's error: INVALID_ARGUMENT over real gRPC, and counted so in
//! the metrics (not as a server error).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use prost::bytes::{Buf, BufMut};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// Sends raw bytes as the message and hands back raw bytes.
#[derive(Clone, Copy, Default)]
struct RawCodec;

struct RawEncoder;
struct RawDecoder;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.put_slice(&item);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining()).to_vec()))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

struct Server {
    child: Child,
    grpc: String,
    metrics: String,
}

impl Server {
    fn start() -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fairplace-server"))
            .args([
                "serve",
                "--grpc-addr",
                "127.0.0.1:0",
                "--metrics-addr",
                "127.0.0.1:0",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("start fairplace-server");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("server prints its addresses");
        let field = |key: &str| {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .map(str::to_string)
                .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        };
        let grpc = field("grpc=");
        let metrics = field("metrics=");
        Server {
            child,
            grpc,
            metrics,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// GET of an `http://host:port/path` URL, body only.
fn http_get(url: &str) -> String {
    let rest = url.strip_prefix("http://").expect("http URL");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = std::net::TcpStream::connect(host).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET /{path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut resp = String::new();
    s.read_to_string(&mut resp).unwrap();
    resp.split_once("\r\n\r\n")
        .map_or(resp.clone(), |(_, b)| b.to_string())
}

#[test]
fn garbage_as_a_pick_cpu_request_is_invalid_argument_not_internal() {
    let server = Server::start();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let garbage: [&[u8]; 3] = [
        // A varint that never ends.
        &[0xff; 11],
        // Field 1 (node_id) says 5 bytes, 2 follow.
        b"\x0a\x05ab",
        // Field 1 is a string: not UTF-8.
        b"\x0a\x02\xff\xfe",
    ];
    rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.grpc))
            .unwrap()
            .connect()
            .await
            .expect("connect");
        let mut grpc = tonic::client::Grpc::new(channel);
        for body in garbage {
            grpc.ready().await.unwrap();
            let path =
                http::uri::PathAndQuery::from_static("/fairplace.v1.PlacementService/PickCpu");
            let r = grpc
                .unary(tonic::Request::new(body.to_vec()), path, RawCodec)
                .await;
            let status = r.expect_err("garbage is refused");
            assert_eq!(
                status.code(),
                tonic::Code::InvalidArgument,
                "{body:?}: {status:?}"
            );
            assert!(!status.message().is_empty());
            assert!(status.message().len() < 200, "{}", status.message());
        }
    });
    let metrics = http_get(&server.metrics);
    let counted: Vec<&str> = metrics
        .lines()
        .filter(|l| l.starts_with("fairplace_rpc_requests_total") && l.contains("PickCpu"))
        .collect();
    assert!(
        counted
            .iter()
            .any(|l| l.contains(r#"code="InvalidArgument""#) && l.ends_with(" 3")),
        "{counted:?}"
    );
    assert!(
        !counted.iter().any(|l| l.contains(r#"code="Internal""#)),
        "{counted:?}"
    );
}
