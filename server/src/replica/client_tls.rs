//! The client certificates a replica presents, to etcd (`--etcd-tls-*`)
//! and to its peers (`--replica-tls-*`, `--peer-ca`), read again while
//! it runs.
//!
//! Certificates in a cluster are short-lived and renewed in place
//! (cert-manager's csi-driver swaps the files in the pod's volume), and
//! a replica runs for longer than one of them lives. So the files are read
//! every [`RELOAD_EVERY`]. When their bytes change and the new set parses
//! (a CA and a certificate with a key, each a PEM block), the connections
//! made from then on use it. Calls and streams already open keep their
//! connections: a certificate is checked only at the handshake. A set that
//! does not parse is logged and the previous one is kept, so a renewal
//! caught half-written cannot cut a replica off.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Identity};

use crate::pem::{PemError, pem_certs, pem_key};

/// How often the files are read again.
pub const RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Where a client's TLS material lives.
#[derive(Debug, Clone)]
pub struct ClientFiles {
    /// The CA the servers' certificates chain to.
    pub ca: PathBuf,
    /// The client certificate and its key, when the client presents one.
    pub identity: Option<(PathBuf, PathBuf)>,
}

/// Why a client's TLS files cannot be used: one is unreadable, or does not
/// hold the PEM block it must. At start it stops the replica (its caller
/// says which flags the files came from); on a refresh it is logged and
/// the files in use are kept. Each names the file to fix.
#[derive(Debug)]
pub enum ClientTlsError {
    /// A file cannot be read.
    Read { path: PathBuf, source: io::Error },
    /// A file does not hold a PEM certificate, or key, that parses.
    Pem(PemError),
}

impl fmt::Display for ClientTlsError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClientTlsError::Read { path, source } => write!(f, "{}: {source}", path.display()),
            ClientTlsError::Pem(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl std::error::Error for ClientTlsError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ClientTlsError::Read { source, .. } => Some(source),
            // Transparent: its message is this one's.
            ClientTlsError::Pem(e) => std::error::Error::source(e),
        }
    }
}

impl From<PemError> for ClientTlsError {
    fn from(e: PemError) -> Self {
        ClientTlsError::Pem(e)
    }
}

/// The files' bytes, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientPem {
    ca: Vec<u8>,
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl ClientFiles {
    /// Reads and checks the files: each holds a PEM block of its kind.
    pub fn read(&self) -> Result<ClientPem, ClientTlsError> {
        let read = |p: &PathBuf| {
            std::fs::read(p).map_err(|source| ClientTlsError::Read {
                path: p.clone(),
                source,
            })
        };
        let ca = read(&self.ca)?;
        pem_certs(&ca, &self.ca)?;
        let identity = match &self.identity {
            None => None,
            Some((cert, key)) => {
                let (c, k) = (read(cert)?, read(key)?);
                pem_certs(&c, cert)?;
                pem_key(&k, key)?;
                Some((c, k))
            }
        };
        Ok(ClientPem { ca, identity })
    }
}

impl ClientPem {
    /// A TLS client configuration of these bytes.
    pub fn config(&self) -> ClientTlsConfig {
        let mut t = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(&self.ca));
        if let Some((c, k)) = &self.identity {
            t = t.identity(Identity::from_pem(c, k));
        }
        t
    }
}

/// The material in use and where it comes from.
#[derive(Debug)]
pub struct Reloading {
    files: ClientFiles,
    current: Mutex<Arc<ClientPem>>,
}

impl Reloading {
    /// The files as they are now; an error names the file that is wrong.
    pub fn load(files: ClientFiles) -> Result<Reloading, ClientTlsError> {
        let pem = files.read()?;
        Ok(Reloading {
            files,
            current: Mutex::new(Arc::new(pem)),
        })
    }

    pub fn current(&self) -> Arc<ClientPem> {
        Arc::clone(&self.current.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Reads the files again: `true` when they changed and the new set is
    /// in use now.
    pub fn refresh(&self, what: &str) -> bool {
        let pem = match self.files.read() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(what, error = %e, "TLS files unusable; keeping the ones in use");
                return false;
            }
        };
        let mut cur = self.current.lock().unwrap_or_else(PoisonError::into_inner);
        if **cur == pem {
            return false;
        }
        *cur = Arc::new(pem);
        tracing::info!(what, "TLS files changed; new connections use them");
        true
    }
}
