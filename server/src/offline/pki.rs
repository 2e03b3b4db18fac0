//! A small PKI for development, the compose demo and the tests: a CA and
//! leaf certificates carrying SPIFFE IDs, made with rcgen (ECDSA P-256).
//!
//! `fairplace-server pki --dir DIR ...` writes it as PEM files; production
//! certificates come from cert-manager (deploy/kubernetes) or any CA that
//! can put a URI SAN `spiffe://TRUST_DOMAIN/ROLE/NAME` in a client
//! certificate (openssl can).

use std::net::IpAddr;
use std::path::Path;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use time::{Duration, OffsetDateTime};

/// A certificate and its private key, both PEM.
#[derive(Debug, Clone)]
pub struct Pem {
    pub cert: String,
    pub key: String,
}

impl Pem {
    /// Writes `NAME.crt` and `NAME.key` (mode 0600) into `dir`.
    pub fn write(&self, dir: &Path, name: &str) -> std::io::Result<()> {
        std::fs::write(dir.join(format!("{name}.crt")), &self.cert)?;
        write_private(&dir.join(format!("{name}.key")), &self.key)
    }
}

/// Writes a file readable by its owner only (where the platform has modes).
pub fn write_private(path: &Path, contents: &str) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))?;
    }
    std::fs::rename(&tmp, path)
}

/// What a leaf certificate says.
#[derive(Debug, Clone, Default)]
pub struct Leaf {
    pub common_name: String,
    /// URI SANs, e.g. `spiffe://fairplace/node/n1`.
    pub uris: Vec<String>,
    pub dns_names: Vec<String>,
    pub ips: Vec<IpAddr>,
    /// serverAuth in the extended key usage.
    pub server: bool,
    /// clientAuth in the extended key usage.
    pub client: bool,
    /// Valid for this many days from an hour ago (0: 365).
    pub days: i64,
}

impl Leaf {
    /// A client certificate for `spiffe://TRUST_DOMAIN/ROLE/NAME`.
    pub fn client(trust_domain: &str, role: &str, name: &str) -> Leaf {
        Leaf {
            common_name: format!("{role}/{name}"),
            uris: vec![format!("spiffe://{trust_domain}/{role}/{name}")],
            client: true,
            ..Leaf::default()
        }
    }

    /// A server certificate for these DNS names and IP addresses, with
    /// the SPIFFE ID `spiffe://TRUST_DOMAIN/server/NAME` (NAME: the first
    /// DNS name) that agents require of the server they obey.
    pub fn server(trust_domain: &str, dns_names: &[&str], ips: &[IpAddr]) -> Leaf {
        let name = dns_names.first().copied().unwrap_or("fairplace-server");
        Leaf {
            common_name: name.into(),
            uris: vec![format!("spiffe://{trust_domain}/server/{name}")],
            dns_names: dns_names.iter().map(|s| s.to_string()).collect(),
            ips: ips.to_vec(),
            server: true,
            ..Leaf::default()
        }
    }
}

fn validity(p: &mut CertificateParams, days: i64) {
    let now = OffsetDateTime::now_utc();
    p.not_before = now - Duration::hours(1);
    p.not_after = now + Duration::days(if days == 0 { 365 } else { days });
}

/// A certificate authority that signs leaves.
pub struct Ca {
    issuer: Issuer<'static, KeyPair>,
    pub pem: Pem,
}

impl Ca {
    /// A new self-signed CA.
    pub fn new(common_name: &str) -> Result<Ca, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(DnType::CommonName, common_name);
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut p, 3650);
        let cert = p.self_signed(&key)?;
        let pem = Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        };
        Ok(Ca {
            issuer: Issuer::new(p, key),
            pem,
        })
    }

    /// A CA from its PEM certificate and key (to issue more leaves later).
    pub fn load(cert_pem: &str, key_pem: &str) -> Result<Ca, rcgen::Error> {
        let key = KeyPair::from_pem(key_pem)?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key)?;
        Ok(Ca {
            issuer,
            pem: Pem {
                cert: cert_pem.to_string(),
                key: key_pem.to_string(),
            },
        })
    }

    /// Signs a new leaf with a fresh key.
    pub fn issue(&self, leaf: &Leaf) -> Result<Pem, rcgen::Error> {
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name
            .push(DnType::CommonName, leaf.common_name.as_str());
        for u in &leaf.uris {
            p.subject_alt_names
                .push(SanType::URI(u.as_str().try_into()?));
        }
        for d in &leaf.dns_names {
            p.subject_alt_names
                .push(SanType::DnsName(d.as_str().try_into()?));
        }
        for ip in &leaf.ips {
            p.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        p.is_ca = IsCa::ExplicitNoCa;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        if leaf.server {
            p.extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth);
        }
        if leaf.client {
            p.extended_key_usages
                .push(ExtendedKeyUsagePurpose::ClientAuth);
        }
        p.use_authority_key_identifier_extension = true;
        validity(&mut p, leaf.days);
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok(Pem {
            cert: cert.pem(),
            key: key.serialize_pem(),
        })
    }
}
