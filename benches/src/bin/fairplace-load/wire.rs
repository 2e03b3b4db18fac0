//! The rpc phases' own unary caller: HTTP/2 straight from hyper, requests
//! framed once, answers read only as far as the check needs.
//!
//! `rpc` measures what a call costs the *server*. The generator shares the
//! machine (one core each), and through tonic's client a call costs the
//! generator about what it costs the server: every request goes through
//! the channel's buffer task, is built and encoded, and the answer decoded
//! with its strings. With both cores saturated the generator was half the
//! bottleneck, and the ratio a measure of two programs. Here both Ping and
//! PickCpu go the same way, as h2load or ghz send a fixed payload: the
//! gRPC frame is encoded once per caller, sent on a cloned hyper HTTP/2
//! connection, and the answer collected and checked: its status, and for
//! PickCpu the CPU chosen (on the node) and the state version it read.
//! The server sees the same requests as from any gRPC client.

use std::sync::Arc;

pub use fairplace_proto::codec::frame;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo};
use prost::Message;
pub use prost::bytes::Bytes;

use fairplace_client::{TlsOptions, pb};

const PING: &str = "/fairplace.v1.AdminService/Ping";
const PICK_CPU: &str = "/fairplace.v1.PlacementService/PickCpu";

/// The fields of a PickCpuResponse the check reads; prost skips the rest
/// (its strings are not allocated).
#[derive(Clone, PartialEq, Message)]
struct PickCheck {
    #[prost(uint32, tag = "1")]
    cpu: u32,
    #[prost(uint64, tag = "4")]
    state_version: u64,
}

/// One HTTP/2 connection's caller.
#[derive(Clone)]
pub struct Caller {
    h2: SendRequest<Full<Bytes>>,
    ping: http::Uri,
    pick: http::Uri,
    empty: Bytes,
}

impl Caller {
    /// A connection to `addr` (`host:port`), over mutual TLS with `tls`'
    /// files when given.
    pub async fn connect(addr: &str, tls: Option<&TlsOptions>) -> Caller {
        let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
        tcp.set_nodelay(true).unwrap();
        let scheme = if tls.is_some() { "https" } else { "http" };
        let h2 = match tls {
            None => handshake(TokioIo::new(tcp)).await,
            Some(t) => {
                let cfg = fairplace_client::verified::client_config(t, "fairplace")
                    .expect("TLS configuration");
                let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_string();
                let name = rustls::pki_types::ServerName::try_from(host).expect("server name");
                let s = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                    .connect(name, tcp)
                    .await
                    .expect("TLS handshake");
                handshake(TokioIo::new(s)).await
            }
        };
        let uri = |p: &str| format!("{scheme}://{addr}{p}").parse().unwrap();
        Caller {
            h2,
            ping: uri(PING),
            pick: uri(PICK_CPU),
            empty: frame(&pb::PingRequest {}),
        }
    }

    /// One unary call of `body` (a framed message) to `uri`: the answer's
    /// message bytes when its status is OK.
    async fn unary(&mut self, uri: http::Uri, body: Bytes) -> Option<Bytes> {
        let req = http::Request::post(uri)
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(Full::new(body))
            .unwrap();
        self.h2.ready().await.ok()?;
        let resp = self.h2.send_request(req).await.ok()?;
        if !resp.status().is_success() || resp.headers().contains_key("grpc-status") {
            return None; // trailers-only: an error
        }
        let all = resp.into_body().collect().await.ok()?;
        let ok = all
            .trailers()
            .and_then(|t| t.get("grpc-status"))
            .is_some_and(|s| s == "0");
        let data = all.to_bytes();
        (ok && data.len() >= 5).then(|| data.slice(5..))
    }

    /// The no-op Ping; whether it answered OK.
    pub async fn ping(&mut self) -> bool {
        let (uri, body) = (self.ping.clone(), self.empty.clone());
        self.unary(uri, body).await.is_some()
    }

    /// A PickCpu of `req` (framed with [`frame`]); whether it answered OK
    /// with a CPU below `cpus` from a reported state.
    pub async fn pick_cpu(&mut self, req: Bytes, cpus: u32) -> bool {
        let uri = self.pick.clone();
        self.unary(uri, req)
            .await
            .is_some_and(|m| answered(&m, cpus))
    }
}

/// Whether a PickCpuResponse's bytes name a CPU below `cpus`, decided on a
/// reported state (version above 0).
fn answered(msg: &[u8], cpus: u32) -> bool {
    PickCheck::decode(msg).is_ok_and(|a| a.cpu < cpus && a.state_version > 0)
}

async fn handshake<T>(io: TokioIo<T>) -> SendRequest<Full<Bytes>>
where
    T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    send
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_is_the_uncompressed_flag_the_length_and_the_message() {
        let req = pb::PickCpuRequest {
            node_id: "load".into(),
            this_cpu: 3,
            ..Default::default()
        };
        let f = frame(&req);
        let len = req.encoded_len();
        assert_eq!(f[0], 0);
        assert_eq!(
            u32::from_be_bytes(f[1..5].try_into().unwrap()) as usize,
            len
        );
        assert_eq!(pb::PickCpuRequest::decode(&f[5..]).unwrap(), req);
        assert_eq!(&frame(&pb::PingRequest {})[..], &[0, 0, 0, 0, 0]);
    }

    #[test]
    fn an_answer_counts_only_with_a_cpu_on_the_node_from_a_reported_state() {
        let answer = pb::PickCpuResponse {
            cpu: 77,
            path: "select_idle_core".into(),
            scanned: 9,
            state_version: 41,
            affine: "this_idle".into(),
            node_id: "load".into(),
            ..Default::default()
        };
        let c = PickCheck::decode(answer.encode_to_vec().as_slice()).unwrap();
        assert_eq!((c.cpu, c.state_version), (77, 41), "read past the strings");
        assert!(answered(&answer.encode_to_vec(), 128));
        assert!(!answered(&answer.encode_to_vec(), 77), "CPU off the node");
        let unversioned = pb::PickCpuResponse {
            state_version: 0,
            ..answer
        };
        assert!(
            !answered(&unversioned.encode_to_vec(), 128),
            "no state read"
        );
        assert!(!answered(&[0xff, 0xff], 128), "not a message");
    }
}
