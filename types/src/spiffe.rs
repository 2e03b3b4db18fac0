//! SPIFFE IDs as fairplace uses them: `spiffe://TRUST_DOMAIN/ROLE/NAME`,
//! one per certificate, as a URI SAN. The server reads its clients' roles
//! from them; an agent checks that the server it obeys has the `server`
//! role. One parser for both, so they agree on what an ID is.

use std::fmt;

use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// A caller's role, the first segment of its SPIFFE ID's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Node,
    Orchestrator,
    Admin,
    /// A fairplace server: what an agent requires of the server it
    /// obeys. As a client it may call only what every identity may.
    Server,
    /// Another replica of the server, forwarding a call for the caller
    /// it names (`fairplace-forwarded-for`): it is authorized as that
    /// caller.
    Replica,
}

impl Role {
    pub const ALL: [Role; 5] = [
        Role::Node,
        Role::Orchestrator,
        Role::Admin,
        Role::Server,
        Role::Replica,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Node => "node",
            Role::Orchestrator => "orchestrator",
            Role::Admin => "admin",
            Role::Server => "server",
            Role::Replica => "replica",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

/// An identified caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    pub role: Role,
    pub name: String,
    /// The full SPIFFE ID, for messages and logs.
    pub id: String,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

/// The SPIFFE ID of a DER certificate: its one `spiffe://` URI SAN.
pub fn identity_from_cert(der: &[u8], trust_domain: &str) -> Result<Identity, String> {
    let (_, cert) =
        X509Certificate::from_der(der).map_err(|e| format!("certificate: cannot parse it: {e}"))?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| format!("certificate: bad subjectAltName: {e}"))?;
    let uris: Vec<&str> = san
        .iter()
        .flat_map(|s| s.value.general_names.iter())
        .filter_map(|g| match g {
            GeneralName::URI(u) if u.to_ascii_lowercase().starts_with("spiffe:") => Some(*u),
            _ => None,
        })
        .collect();
    match uris.as_slice() {
        [] => Err(format!(
            "certificate: no URI SAN spiffe://{trust_domain}/ROLE/NAME"
        )),
        [one] => parse_spiffe_id(one, trust_domain),
        _ => Err(format!(
            "certificate: {} SPIFFE IDs ({}); exactly one is allowed",
            uris.len(),
            uris.join(", ")
        )),
    }
}

/// SPIFFE ID characters: trust domains are lowercase letters, digits, `.`,
/// `-` and `_`; path segments may have uppercase letters too.
fn td_char(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-' | '_')
}

fn segment_ok(s: &str) -> bool {
    !s.is_empty()
        && s != "."
        && s != ".."
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_'))
}

/// Parses `spiffe://TRUST_DOMAIN/ROLE/NAME` (the SPIFFE ID rules: no port,
/// user info, query, fragment or percent-encoding) for this trust domain.
pub fn parse_spiffe_id(uri: &str, trust_domain: &str) -> Result<Identity, String> {
    let bad = |why: &str| format!("certificate: SPIFFE ID {uri:?}: {why}");
    let rest = uri
        .strip_prefix("spiffe://")
        .ok_or_else(|| bad("the scheme must be spiffe:// in lowercase"))?;
    let (td, path) = rest.split_once('/').unwrap_or((rest, ""));
    if td.is_empty() || !td.chars().all(td_char) {
        return Err(bad("malformed trust domain"));
    }
    if td != trust_domain {
        return Err(bad(&format!(
            "trust domain {td:?} is not this server's ({trust_domain:?})"
        )));
    }
    let segs: Vec<&str> = path.split('/').collect();
    if segs.iter().any(|s| !segment_ok(s)) {
        return Err(bad("malformed path (expected /ROLE/NAME)"));
    }
    let [role, name] = segs.as_slice() else {
        return Err(bad("the path must be /ROLE/NAME"));
    };
    let role = Role::parse(role).ok_or_else(|| {
        bad(&format!(
            "unknown role {role:?} (node, orchestrator, admin or server)"
        ))
    })?;
    Ok(Identity {
        role,
        name: name.to_string(),
        id: uri.to_string(),
    })
}
