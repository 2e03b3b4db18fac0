//! A TLS connection to a server that is verified twice: its certificate
//! chains to the CA and names the address (rustls' WebPKI checks), and its
//! one SPIFFE ID is `spiffe://TRUST_DOMAIN/server/NAME`. The second check
//! is what an agent needs before it lets a server pin processes: the CA
//! also signs node, orchestrator and admin certificates, and none of those
//! may act as the server.
//!
//! tonic's own TLS cannot run a custom check on the server's certificate,
//! so this makes the TLS connection itself (tokio-rustls, the same rustls
//! the server uses) and hands tonic the finished stream.

use std::sync::Arc;

use fairplace_types::spiffe::{Role, identity_from_cert};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tonic::transport::{Channel, Endpoint};

use crate::TlsOptions;

/// The WebPKI verifier, then the server role.
#[derive(Debug)]
struct ServerRoleVerifier {
    inner: Arc<WebPkiServerVerifier>,
    trust_domain: String,
}

impl ServerCertVerifier for ServerRoleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let verified = self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        )?;
        match identity_from_cert(end_entity, &self.trust_domain) {
            Ok(id) if id.role == Role::Server => Ok(verified),
            Ok(id) => Err(rustls::Error::General(format!(
                "server certificate: {id} is not a fairplace server (role {}, not server)",
                id.role.as_str()
            ))),
            Err(e) => Err(rustls::Error::General(format!("server {e}"))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// The rustls client configuration of `tls` (its files as they are now)
/// with the server-role check for `trust_domain`.
pub fn client_config(tls: &TlsOptions, trust_domain: &str) -> Result<ClientConfig, String> {
    let ca = tls
        .ca
        .as_ref()
        .ok_or("--tls-ca: the CA of the server's certificate is needed for TLS")?;
    let mut roots = RootCertStore::empty();
    let certs = CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))?;
    for c in certs {
        let c = c.map_err(|e| format!("{}: {e}", ca.display()))?;
        roots.add(c).map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    let inner = WebPkiServerVerifier::builder(Arc::new(roots))
        .build()
        .map_err(|e| format!("{}: {e}", ca.display()))?;
    let builder = ClientConfig::builder()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ServerRoleVerifier {
            inner,
            trust_domain: trust_domain.to_string(),
        }));
    let mut cfg = match (&tls.cert, &tls.key) {
        (Some(c), Some(k)) => {
            let chain = CertificateDer::pem_file_iter(c)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("{}: {e}", c.display()))?;
            let key =
                PrivateKeyDer::from_pem_file(k).map_err(|e| format!("{}: {e}", k.display()))?;
            builder
                .with_client_auth_cert(chain, key)
                .map_err(|e| format!("{}: {e}", c.display()))?
        }
        (None, None) => builder.with_no_client_auth(),
        _ => return Err("--tls-cert and --tls-key go together".into()),
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// Connects `endpoint` (its settings: timeouts, keepalive) to `addr` over
/// TLS with the server-role check.
pub async fn connect(
    endpoint: Endpoint,
    addr: &str,
    tls: &TlsOptions,
    trust_domain: &str,
) -> Result<Channel, String> {
    let bare = addr
        .strip_prefix("https://")
        .or_else(|| addr.strip_prefix("http://"))
        .unwrap_or(addr)
        .to_string();
    let host = match &tls.server_name {
        Some(n) => n.clone(),
        None => host_of(&bare).to_string(),
    };
    let name =
        ServerName::try_from(host.clone()).map_err(|e| format!("server name {host:?}: {e}"))?;
    let config = Arc::new(client_config(tls, trust_domain)?);
    let connector = tower::service_fn(move |_: http::Uri| {
        let (config, name, bare) = (Arc::clone(&config), name.clone(), bare.clone());
        async move {
            let tcp = tokio::net::TcpStream::connect(&bare).await?;
            tcp.set_nodelay(true)?;
            let stream = tokio_rustls::TlsConnector::from(config)
                .connect(name, tcp)
                .await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    endpoint
        .connect_with_connector(connector)
        .await
        .map_err(|e| format!("{e}: {}", crate::source_chain(&e)))
}

/// The host of `host:port` (an IPv6 address without its brackets).
fn host_of(bare: &str) -> &str {
    let h = match bare.rsplit_once(':') {
        Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
        _ => bare,
    };
    h.trim_start_matches('[').trim_end_matches(']')
}

#[cfg(test)]
mod tests {
    use super::host_of;

    #[test]
    fn hosts_of_addresses() {
        assert_eq!(host_of("localhost:50051"), "localhost");
        assert_eq!(host_of("[::1]:50051"), "::1");
        assert_eq!(host_of("10.0.0.1:1"), "10.0.0.1");
        assert_eq!(host_of("server"), "server");
    }
}
