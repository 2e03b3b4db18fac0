//! TLS on the gRPC port, with rustls (ring; no OpenSSL), reloaded in place.
//!
//! - The server's certificate chain and key (`--tls-cert`, `--tls-key`) and,
//!   with `--client-ca`, the CA bundle that client certificates must chain
//!   to, are read into one rustls `ServerConfig`. With a client CA every
//!   connection must present a certificate that chains to it (the handshake
//!   fails otherwise); without one the server authenticates only itself.
//! - The files are read again every `reload_interval` and, when their
//!   contents changed, a new `ServerConfig` is built and swapped in
//!   atomically: new connections use it, connections already open (agents'
//!   streams) keep theirs and are never dropped. A half-written rotation (a
//!   certificate whose key is not there yet, a truncated file) is refused
//!   with one warning and the old configuration stays until the files are
//!   consistent again, so cert-manager can rewrite them in any order.
//! - `accept` is the per-connection stage the listener runs (concurrently,
//!   under its handshake timeout): it completes the handshake and reads the
//!   client's identity from its certificate once, for every request on the
//!   connection (see `identity`).

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;

use crate::identity::Peer;
use crate::metrics as m;
use crate::pem::{PemError, pem_certs, pem_key};

/// Where the server's TLS material lives and how it is watched.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA bundle client certificates must chain to; None: no client
    /// authentication.
    pub client_ca: Option<PathBuf>,
    /// How often the files are checked for a rotation.
    pub reload_interval: Duration,
}

impl TlsSettings {
    pub fn new(cert: PathBuf, key: PathBuf, client_ca: Option<PathBuf>) -> Self {
        Self {
            cert,
            key,
            client_ca,
            reload_interval: Duration::from_secs(1),
        }
    }
}

/// The files' contents a configuration was built from.
#[derive(PartialEq, Eq)]
struct Material {
    cert: Vec<u8>,
    key: Vec<u8>,
    ca: Option<Vec<u8>>,
}

/// Why the server's TLS files cannot be made into a configuration: a file
/// unreadable, a PEM block missing or bad, a CA unusable, or a key that
/// does not fit its certificate. At start it stops the server; on a reload
/// it is logged once and the configuration in use is kept. Each names the
/// file (or the pair) to fix.
#[derive(Debug)]
pub enum TlsError {
    /// A file cannot be read (missing for a moment mid-rotation, or for good).
    Read { path: PathBuf, source: io::Error },
    /// A certificate or key file does not hold what it must.
    Pem(PemError),
    /// rustls has no safe protocol version with this crypto provider.
    Versions(rustls::Error),
    /// A certificate of the client CA bundle cannot be a trust anchor.
    CaCertificate {
        path: PathBuf,
        source: rustls::Error,
    },
    /// No client certificate verifier can be built on the client CA bundle.
    ClientVerifier {
        path: PathBuf,
        source: rustls::server::VerifierBuilderError,
    },
    /// The key does not fit the certificate, or rustls cannot use either.
    KeyMismatch {
        cert: PathBuf,
        key: PathBuf,
        source: rustls::Error,
    },
}

impl fmt::Display for TlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TlsError::Read { path, source } => write!(f, "{}: {source}", path.display()),
            TlsError::Pem(e) => fmt::Display::fmt(e, f),
            TlsError::Versions(e) => write!(f, "TLS versions: {e}"),
            TlsError::CaCertificate { path, source } => write!(
                f,
                "{}: not a usable CA certificate: {source}",
                path.display()
            ),
            TlsError::ClientVerifier { path, source } => write!(f, "{}: {source}", path.display()),
            TlsError::KeyMismatch { cert, key, source } => write!(
                f,
                "{} and {}: the key does not fit the certificate, or is unusable: {source}",
                cert.display(),
                key.display()
            ),
        }
    }
}

impl std::error::Error for TlsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TlsError::Read { source, .. } => Some(source),
            // Transparent: its message is this one's.
            TlsError::Pem(e) => std::error::Error::source(e),
            TlsError::Versions(e)
            | TlsError::CaCertificate { source: e, .. }
            | TlsError::KeyMismatch { source: e, .. } => Some(e),
            TlsError::ClientVerifier { source, .. } => Some(source),
        }
    }
}

impl From<PemError> for TlsError {
    fn from(e: PemError) -> Self {
        TlsError::Pem(e)
    }
}

fn read_file(p: &PathBuf) -> Result<Vec<u8>, TlsError> {
    std::fs::read(p).map_err(|source| TlsError::Read {
        path: p.clone(),
        source,
    })
}

impl Material {
    fn read(s: &TlsSettings) -> Result<Material, TlsError> {
        Ok(Material {
            cert: read_file(&s.cert)?,
            key: read_file(&s.key)?,
            ca: s.client_ca.as_ref().map(read_file).transpose()?,
        })
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn build(s: &TlsSettings, mat: &Material) -> Result<ServerConfig, TlsError> {
    let certs = pem_certs(&mat.cert, &s.cert)?;
    let key = pem_key(&mat.key, &s.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(TlsError::Versions)?;
    let builder = match (&s.client_ca, &mat.ca) {
        (Some(path), Some(ca)) => {
            let mut roots = RootCertStore::empty();
            for c in pem_certs(ca, path)? {
                roots.add(c).map_err(|source| TlsError::CaCertificate {
                    path: path.clone(),
                    source,
                })?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|source| TlsError::ClientVerifier {
                    path: path.clone(),
                    source,
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        _ => builder.with_no_client_auth(),
    };
    let mut cfg = builder
        .with_single_cert(certs, key)
        .map_err(|source| TlsError::KeyMismatch {
            cert: s.cert.clone(),
            key: s.key.clone(),
            source,
        })?;
    // gRPC is HTTP/2 only; clients that insist on ALPN (grpcio, Go) need it.
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// The live TLS configuration and what it was built from.
pub struct TlsReloader {
    settings: TlsSettings,
    config: ArcSwap<ServerConfig>,
    /// The contents now in use, and the last contents refused (so a broken
    /// rotation is reported once, not every interval).
    state: Mutex<(Material, Option<Material>)>,
    trust_domain: Arc<str>,
}

impl TlsReloader {
    /// Reads and checks the files; an error here stops the server.
    pub fn load(settings: TlsSettings, trust_domain: &str) -> Result<Arc<TlsReloader>, TlsError> {
        let mat = Material::read(&settings)?;
        let cfg = build(&settings, &mat)?;
        Ok(Arc::new(TlsReloader {
            settings,
            config: ArcSwap::from_pointee(cfg),
            state: Mutex::new((mat, None)),
            trust_domain: trust_domain.into(),
        }))
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_cert(&self) -> bool {
        self.settings.client_ca.is_some()
    }

    /// Reads the files again and swaps in a new configuration when they
    /// changed. Some(Ok) after a reload, Some(Err) the first time a given
    /// change is refused, None when nothing changed.
    pub fn check(&self) -> Option<Result<(), TlsError>> {
        let mat = match Material::read(&self.settings) {
            Ok(m) => m,
            // Mid-rotation a file can be missing for a moment: try again.
            Err(e) => return Some(Err(e)),
        };
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.0 == mat || state.1.as_ref() == Some(&mat) {
            return None;
        }
        match build(&self.settings, &mat) {
            Ok(cfg) => {
                self.config.store(Arc::new(cfg));
                *state = (mat, None);
                metrics::counter!(m::TLS_RELOADS).increment(1);
                Some(Ok(()))
            }
            Err(e) => {
                state.1 = Some(mat);
                metrics::counter!(m::TLS_RELOAD_ERRORS).increment(1);
                Some(Err(e))
            }
        }
    }

    /// Checks the files every `reload_interval` until the server stops.
    pub fn spawn_watch(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let me = Arc::clone(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(me.settings.reload_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            let mut last_err: Option<String> = None;
            loop {
                tick.tick().await;
                match me.check() {
                    Some(Ok(())) => {
                        last_err = None;
                        tracing::info!(
                            cert = %me.settings.cert.display(),
                            client_ca = ?me.settings.client_ca,
                            "TLS certificate, key and client CA reloaded; new connections use them"
                        );
                    }
                    Some(Err(e)) => {
                        let e = e.to_string();
                        if last_err.as_ref() != Some(&e) {
                            tracing::warn!(
                                error = %e,
                                "TLS files changed but cannot be used (yet); keeping the current ones"
                            );
                            last_err = Some(e);
                        }
                    }
                    None => {}
                }
            }
        })
    }

    /// The handshake stage for one accepted connection: the stream and the
    /// client's identity, read once (tonic puts it in every request's
    /// extensions).
    pub async fn accept(
        self: Arc<Self>,
        tcp: TcpStream,
    ) -> io::Result<(tokio_rustls::server::TlsStream<TcpStream>, Peer)> {
        let acceptor = TlsAcceptor::from(self.config.load_full());
        let stream = match acceptor.accept(tcp).await {
            Ok(s) => s,
            Err(e) => {
                metrics::counter!(m::TLS_HANDSHAKE_FAILURES).increment(1);
                tracing::debug!(error = %e, "TLS handshake failed");
                return Err(e);
            }
        };
        let peer = Peer::from_certs(stream.get_ref().1.peer_certificates(), &self.trust_domain);
        Ok((stream, peer))
    }
}
