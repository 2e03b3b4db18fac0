//! PEM files as every TLS end of the server reads them: the serving
//! certificate and client CA (`service::tls`) and the client certificates
//! a replica presents to etcd and to its peers (`replica::client_tls`).
//! One place checks that a file holds what it must, with an error that
//! names the file.

use std::fmt;
use std::path::{Path, PathBuf};

use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why a PEM file does not hold what it must: a certificate bundle with no
/// certificate or a bad block, or no usable private key. Each names the
/// file, so the TLS ends that read it (at start or on a reload) can report
/// which of their files is wrong.
#[derive(Debug)]
pub enum PemError {
    /// A block of the certificate bundle does not parse.
    Certs { path: PathBuf, source: pem::Error },
    /// The bundle parses but holds no certificate.
    NoCertificate { path: PathBuf },
    /// No private key could be read from the file.
    Key { path: PathBuf, source: pem::Error },
}

impl fmt::Display for PemError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PemError::Certs { path, source } => write!(f, "{}: {source}", path.display()),
            PemError::NoCertificate { path } => {
                write!(f, "{}: no PEM certificate in it", path.display())
            }
            PemError::Key { path, source } => {
                write!(f, "{}: no usable PEM private key: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for PemError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PemError::Certs { source, .. } | PemError::Key { source, .. } => Some(source),
            PemError::NoCertificate { .. } => None,
        }
    }
}

/// Every certificate of a PEM bundle; an empty bundle is an error.
pub fn pem_certs(bytes: &[u8], what: &Path) -> Result<Vec<CertificateDer<'static>>, PemError> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| PemError::Certs {
            path: what.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(PemError::NoCertificate {
            path: what.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn pem_key(bytes: &[u8], what: &Path) -> Result<PrivateKeyDer<'static>, PemError> {
    PrivateKeyDer::from_pem_slice(bytes).map_err(|source| PemError::Key {
        path: what.to_path_buf(),
        source,
    })
}
