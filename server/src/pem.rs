//! PEM files as every TLS end of the server reads them: the serving
//! certificate and client CA (`service::tls`) and the client certificates
//! a replica presents to etcd and to its peers (`replica::client_tls`).
//! One place checks that a file holds what it must, with an error that
//! names the file.

use std::path::Path;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Every certificate of a PEM bundle; an empty bundle is an error.
pub fn pem_certs(bytes: &[u8], what: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", what.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", what.display()));
    }
    Ok(certs)
}

/// The private key of a PEM file.
pub fn pem_key(bytes: &[u8], what: &Path) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(bytes)
        .map_err(|e| format!("{}: no usable PEM private key: {e}", what.display()))
}
