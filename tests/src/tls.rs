//! A test PKI (rcgen, through `fairplace::offline::pki`) in a temporary directory,
//! and TLS channels to a server started with it.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

use fairplace::offline::pki::{Ca, Leaf, Pem};
pub use fairplace_client::TlsOptions;
use tonic::transport::Channel;

/// A CA, a server certificate for 127.0.0.1 and localhost, and client
/// certificates made on demand; the directory goes when this is dropped.
pub struct TestPki {
    pub dir: PathBuf,
    pub ca: Ca,
    pub trust_domain: String,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl TestPki {
    pub fn new() -> TestPki {
        let dir = std::env::temp_dir().join(format!(
            "fairplace-pki-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = Ca::new("fairplace test CA").unwrap();
        ca.pem.write(&dir, "ca").unwrap();
        let pki = TestPki {
            dir,
            ca,
            trust_domain: "fairplace".into(),
        };
        pki.write_leaf("server", &server_leaf());
        pki
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }

    /// Signs `leaf` and writes it as NAME.crt and NAME.key.
    pub fn write_leaf(&self, name: &str, leaf: &Leaf) -> Pem {
        let pem = self.ca.issue(leaf).unwrap();
        pem.write(&self.dir, name).unwrap();
        pem
    }

    /// The flags that make the server serve mutual TLS with this PKI.
    pub fn server_args(&self) -> Vec<String> {
        [
            ("--tls-cert", "server.crt"),
            ("--tls-key", "server.key"),
            ("--client-ca", "ca.crt"),
        ]
        .iter()
        .flat_map(|(f, p)| [f.to_string(), self.path(p).display().to_string()])
        .collect()
    }

    /// TLS that trusts this CA and presents no client certificate.
    pub fn ca_only(&self) -> TlsOptions {
        TlsOptions {
            ca: Some(self.path("ca.crt")),
            ..TlsOptions::default()
        }
    }

    /// A client certificate for spiffe://fairplace/ROLE/NAME.
    pub fn client(&self, role: &str, name: &str) -> TlsOptions {
        self.client_leaf(
            &format!("{role}-{name}"),
            &Leaf::client(&self.trust_domain, role, name),
        )
    }

    /// A client certificate saying whatever `leaf` says.
    pub fn client_leaf(&self, file: &str, leaf: &Leaf) -> TlsOptions {
        self.write_leaf(file, leaf);
        TlsOptions {
            ca: Some(self.path("ca.crt")),
            cert: Some(self.path(&format!("{file}.crt"))),
            key: Some(self.path(&format!("{file}.key"))),
            server_name: None,
        }
    }

    /// CLI flags for a client certificate made by `client`.
    pub fn cli_args(tls: &TlsOptions) -> Vec<String> {
        let mut v = vec![];
        for (flag, p) in [
            ("--tls-ca", &tls.ca),
            ("--tls-cert", &tls.cert),
            ("--tls-key", &tls.key),
        ] {
            if let Some(p) = p {
                v.push(flag.to_string());
                v.push(p.display().to_string());
            }
        }
        v
    }
}

impl Default for TestPki {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The server certificate every test server uses.
pub fn server_leaf() -> Leaf {
    Leaf::server(
        "fairplace",
        &["localhost"],
        &[IpAddr::V4(Ipv4Addr::LOCALHOST)],
    )
}

/// Replaces `path` atomically (a rename, as cert-manager's volumes do).
pub fn replace_file(path: &Path, contents: &str) {
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, contents).unwrap();
    std::fs::rename(&tmp, path).unwrap();
}

/// A connected channel to `addr` with `tls`.
pub async fn channel(addr: &str, tls: &TlsOptions) -> Result<Channel, String> {
    tls.endpoint(addr)?
        .connect()
        .await
        .map_err(|e| format!("{e}: {}", fairplace_client::source_chain(&e)))
}

/// How a method streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Unary,
    ServerStreaming,
    /// Client or bidirectional streaming.
    ClientStreaming,
}

/// Calls `path` with an empty request message (every request message of
/// the API has defaults for all its fields) and returns the status: OK, or
/// the refusal. Streaming methods get an empty request stream; for
/// streaming answers only the response headers are awaited.
pub async fn call_empty(ch: Channel, path: &str, kind: Kind) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(ch);
    if let Err(e) = grpc.ready().await {
        return tonic::Status::unavailable(e.to_string());
    }
    let path = tonic::codegen::http::uri::PathAndQuery::try_from(path).expect("method path");
    let codec = tonic_prost::ProstCodec::<(), ()>::default();
    let call = async {
        match kind {
            Kind::Unary => grpc
                .unary(tonic::Request::new(()), path, codec)
                .await
                .map(|_| ()),
            Kind::ServerStreaming => grpc
                .server_streaming(tonic::Request::new(()), path, codec)
                .await
                .map(|_| ()),
            Kind::ClientStreaming => grpc
                .streaming(
                    tonic::Request::new(tokio_stream::iter(Vec::<()>::new())),
                    path,
                    codec,
                )
                .await
                .map(|_| ()),
        }
    };
    match tokio::time::timeout(std::time::Duration::from_secs(10), call).await {
        Ok(Ok(())) => tonic::Status::ok(""),
        Ok(Err(s)) => s,
        Err(_) => tonic::Status::deadline_exceeded("no answer in 10 s"),
    }
}
