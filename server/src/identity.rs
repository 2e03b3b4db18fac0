//! Who may call what: the caller's identity from its client certificate and
//! the one role table every request passes through.
//!
//! With `--client-ca`, every connection has presented a certificate that
//! chains to the CA (the TLS handshake refuses any other). Its leaf carries
//! the caller's SPIFFE ID as a URI SAN, `spiffe://TRUST_DOMAIN/ROLE/NAME`:
//!
//! | role | may call |
//! |---|---|
//! | `node/NAME` | AgentService/Report, for node NAME only |
//! | `orchestrator/NAME` | PickCpu and PickCpus (claims counted for NAME), AllocateCpus, ReleaseCpus, RenewLease, CanMigrate, Decide, Balance without apply, ListNodes, GetNode, GetFeatures, GetCache, Ping, WatchMembers |
//! | `admin/NAME` | everything, SetFeatures, Record and Balance with apply included |
//!
//! Health and reflection are open to every identified caller. A certificate
//! with no SPIFFE ID, more than one, another trust domain, an unknown role or
//! a malformed ID is refused with UNAUTHENTICATED; a call the role does not
//! allow with PERMISSION_DENIED naming the identity, the method and the roles
//! that may call it. A method the table does not know is for admins only.
//!
//! `AuthLayer` (a tower layer around every service) applies `RULES` and puts
//! the `Caller` into the request's extensions; the two checks that need a
//! request's body, the node id an agent stream names and Balance's `apply`,
//! are the functions below, called by those handlers.
//!
//! Without `--client-ca` (loopback, or `--allow-unauthenticated`) every
//! caller is `Caller::Open` and may call everything, as before identities.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

pub use fairplace_types::spiffe::{Identity, Role, identity_from_cert, parse_spiffe_id};
use tonic::Status;
use tower::{Layer, Service};

/// The metadata key naming the caller a forwarded call is made for: its
/// SPIFFE ID, or "anonymous". Trusted only from a replica's certificate.
pub const FORWARDED_FOR: &str = "fairplace-forwarded-for";

/// What a connection's TLS handshake established about the client; tonic
/// copies it into every request of the connection.
#[derive(Debug, Clone)]
pub enum Peer {
    /// A verified certificate with a valid SPIFFE ID of this trust domain.
    Identified(Arc<Identity>),
    /// A verified certificate whose identity is unusable, and why.
    Unidentified(Arc<str>),
    /// No client certificate (TLS without client authentication).
    Anonymous,
}

impl Peer {
    /// The identity in the leaf (first) certificate of a verified chain.
    pub fn from_certs(certs: Option<&[rustls::pki_types::CertificateDer<'_>]>, td: &str) -> Peer {
        match certs.and_then(|c| c.first()) {
            None => Peer::Anonymous,
            Some(leaf) => match identity_from_cert(leaf, td) {
                Ok(id) => Peer::Identified(Arc::new(id)),
                Err(e) => Peer::Unidentified(e.into()),
            },
        }
    }
}

/// One row of the role table: a full method path, or a service prefix
/// ending in `/`, and the roles that may call it.
pub struct Rule {
    pub path: &'static str,
    pub roles: &'static [Role],
}

const NODE_ADMIN: &[Role] = &[Role::Node, Role::Admin];
const ORCH_ADMIN: &[Role] = &[Role::Orchestrator, Role::Admin];
const ADMIN: &[Role] = &[Role::Admin];
const REPLICA_ADMIN: &[Role] = &[Role::Replica, Role::Admin];
const EVERYONE: &[Role] = &Role::ALL;

/// The role table. Report's node NAME and Balance's `apply` are checked by
/// `check_report_node` and `check_apply` on top of it.
pub const RULES: &[Rule] = &[
    Rule {
        path: "/fairplace.v1.AgentService/Report",
        roles: NODE_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/PickCpu",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/PickCpus",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/CanMigrate",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/Decide",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/Balance",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/AllocateCpus",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/ReleaseCpus",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.PlacementService/RenewLease",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/ListNodes",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/GetNode",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/GetFeatures",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/GetCache",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/Ping",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/WatchMembers",
        roles: ORCH_ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/SetFeatures",
        roles: ADMIN,
    },
    Rule {
        path: "/fairplace.v1.AdminService/Record",
        roles: ADMIN,
    },
    Rule {
        path: "/fairplace.v1.ReplicaService/",
        roles: REPLICA_ADMIN,
    },
    Rule {
        path: "/grpc.health.v1.Health/",
        roles: EVERYONE,
    },
    Rule {
        path: "/grpc.reflection.v1.ServerReflection/",
        roles: EVERYONE,
    },
    Rule {
        path: "/grpc.reflection.v1alpha.ServerReflection/",
        roles: EVERYONE,
    },
];

/// The roles that may call `path`: its rule, else its service's, else
/// admins only.
pub fn allowed_roles(path: &str) -> &'static [Role] {
    RULES
        .iter()
        .find(|r| r.path == path)
        .or_else(|| {
            RULES
                .iter()
                .find(|r| r.path.ends_with('/') && path.starts_with(r.path))
        })
        .map_or(ADMIN, |r| r.roles)
}

/// The caller of a request that passed `AuthLayer`.
#[derive(Debug, Clone)]
pub enum Caller {
    /// No client authentication is configured: everything is allowed.
    Open,
    Authenticated(Arc<Identity>),
}

impl Caller {
    /// The caller of a request (Open when no layer put one there, as when a
    /// handler is called directly in a test).
    pub fn of(ext: &http::Extensions) -> Caller {
        ext.get::<Caller>().cloned().unwrap_or(Caller::Open)
    }

    /// The name claims are attributed to in metrics.
    pub fn claimant(&self) -> String {
        match self {
            Caller::Open => "anonymous".to_string(),
            Caller::Authenticated(id) => id.name.clone(),
        }
    }
}

impl Caller {
    /// The identity a lease records as its owner: the SPIFFE ID, or
    /// "anonymous" without client authentication.
    pub fn owner(&self) -> String {
        match self {
            Caller::Open => ANONYMOUS.to_string(),
            Caller::Authenticated(id) => id.id.clone(),
        }
    }
}

/// The owner of leases taken without client authentication.
pub const ANONYMOUS: &str = "anonymous";

/// Only a lease's owner or an admin may renew or release it (without
/// client authentication every caller is the same anonymous one).
pub fn check_lease_owner(caller: &Caller, what: &str, id: u64, owner: &str) -> Result<(), Status> {
    match caller {
        Caller::Open => Ok(()),
        Caller::Authenticated(c) if c.role == Role::Admin || c.id == owner => Ok(()),
        Caller::Authenticated(c) => Err(Status::permission_denied(format!(
            "lease_id: lease {id} is held by {owner}; {c} may not {what} it (only its owner or an admin)"
        ))),
    }
}

/// A node certificate may register and update only its own node.
pub fn check_report_node(caller: &Caller, node_id: &str) -> Result<(), Status> {
    match caller {
        Caller::Authenticated(id) if id.role == Role::Node && id.name != node_id => {
            Err(Status::permission_denied(format!(
                "node_id: the certificate {id} is for node {:?}; it may not report node {}",
                id.name,
                crate::quote::quote(node_id)
            )))
        }
        _ => Ok(()),
    }
}

/// Balance with `apply` commits claims: admins only.
pub fn check_apply(caller: &Caller) -> Result<(), Status> {
    match caller {
        Caller::Authenticated(id) if id.role != Role::Admin => {
            Err(Status::permission_denied(format!(
                "apply: Balance with apply is for admin certificates; {id} may ask without apply"
            )))
        }
        _ => Ok(()),
    }
}

/// The decision for one request path and connection: the caller to put in
/// the request, or the refusal.
pub fn authorize(required: bool, peer: Option<&Peer>, path: &str) -> Result<Caller, Status> {
    if !required {
        return Ok(Caller::Open);
    }
    let id = match peer {
        Some(Peer::Identified(id)) => id,
        Some(Peer::Unidentified(why)) => return Err(Status::unauthenticated(why.to_string())),
        Some(Peer::Anonymous) | None => {
            return Err(Status::unauthenticated(
                "a client certificate chained to the server's --client-ca is required",
            ));
        }
    };
    let roles = allowed_roles(path);
    if roles.contains(&id.role) {
        return Ok(Caller::Authenticated(Arc::clone(id)));
    }
    let names: Vec<&str> = roles.iter().map(|r| r.as_str()).collect();
    Err(Status::permission_denied(format!(
        "{id} (role {}) may not call {path}: it is for {}",
        id.role.as_str(),
        names.join(", ")
    )))
}

/// The metadata key of a client that routes itself to each node's owner
/// (WatchMembers): a call for a node another replica owns is answered
/// with the owner's address, not passed on.
pub const ROUTED: &str = "fairplace-routed";

/// Marks a call from a client that routes itself ([`ROUTED`]).
#[derive(Debug, Clone, Copy)]
pub struct Routed;

/// Marks a call another replica passed on: it is answered here and
/// never forwarded again.
#[derive(Debug, Clone, Copy)]
pub struct Forwarded;

/// The decision for a call that may have been forwarded by another replica
/// for the caller `forwarded_for` names: only a `replica` certificate may
/// forward, and the call is then authorized as the named caller (never as
/// another replica, so a forward is never forwarded for a forward).
/// Without client authentication the header only marks the call.
pub fn authorize_call(
    required: bool,
    peer: Option<&Peer>,
    path: &str,
    forwarded_for: Option<&str>,
    trust_domain: &str,
) -> Result<(Caller, bool), Status> {
    let Some(who) = forwarded_for else {
        return authorize(required, peer, path).map(|c| (c, false));
    };
    if !required {
        return Ok((Caller::Open, true));
    }
    match peer {
        Some(Peer::Identified(id)) if id.role == Role::Replica => {}
        _ => {
            return Err(Status::permission_denied(format!(
                "{}: only a replica certificate may forward a call",
                FORWARDED_FOR
            )));
        }
    }
    let named = parse_spiffe_id(who, trust_domain)
        .map_err(|e| Status::unauthenticated(format!("{}: {e}", FORWARDED_FOR)))?;
    if named.role == Role::Replica {
        return Err(Status::permission_denied(format!(
            "{}: a replica may not forward for another replica",
            FORWARDED_FOR
        )));
    }
    authorize(true, Some(&Peer::Identified(Arc::new(named))), path).map(|c| (c, true))
}

/// Applies the role table to every request.
#[derive(Clone)]
pub struct AuthLayer {
    /// Client certificates are required (`--client-ca`).
    required: bool,
    trust_domain: Arc<str>,
}

impl AuthLayer {
    pub fn new(required: bool, trust_domain: &str) -> Self {
        Self {
            required,
            trust_domain: trust_domain.into(),
        }
    }
}

impl<S> Layer<S> for AuthLayer {
    type Service = Auth<S>;
    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            required: self.required,
            trust_domain: Arc::clone(&self.trust_domain),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    required: bool,
    trust_domain: Arc<str>,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> Service<http::Request<B>> for Auth<S>
where
    S: Service<http::Request<B>, Response = http::Response<RB>> + Send + 'static,
    S::Future: Send + 'static,
    RB: Default + Send + 'static,
{
    type Response = http::Response<RB>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let forwarded_for = req
            .headers()
            .get(FORWARDED_FOR)
            .map(|v| v.to_str().unwrap_or("\u{fffd}").to_string());
        match authorize_call(
            self.required,
            req.extensions().get::<Peer>(),
            req.uri().path(),
            forwarded_for.as_deref(),
            &self.trust_domain,
        ) {
            Ok((caller, forwarded)) => {
                req.extensions_mut().insert(caller);
                if forwarded {
                    req.extensions_mut().insert(Forwarded);
                } else if req.headers().contains_key(ROUTED) {
                    req.extensions_mut().insert(Routed);
                }
                Box::pin(self.inner.call(req))
            }
            Err(status) => {
                tracing::debug!(path = req.uri().path(), %status, "call refused");
                let resp = status.into_http::<RB>();
                Box::pin(async move { Ok(resp) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> Result<Identity, String> {
        parse_spiffe_id(s, "fairplace")
    }

    #[test]
    fn spiffe_ids_are_parsed_strictly() {
        let n = id("spiffe://fairplace/node/worker-1.eu").unwrap();
        assert_eq!((n.role, n.name.as_str()), (Role::Node, "worker-1.eu"));
        assert_eq!(
            id("spiffe://fairplace/admin/ops").unwrap().role,
            Role::Admin
        );
        for (bad, why) in [
            ("spiffe://other/node/a", "trust domain"),
            ("spiffe://fairplace/kubelet/a", "unknown role"),
            ("spiffe://fairplace/node", "/ROLE/NAME"),
            ("spiffe://fairplace/node/a/b", "/ROLE/NAME"),
            ("spiffe://fairplace/node/", "malformed path"),
            ("spiffe://fairplace/node/a%2Fb", "malformed path"),
            ("spiffe://fairplace/node/a?x=1", "malformed path"),
            ("spiffe://fairplace:443/node/a", "malformed trust domain"),
            ("spiffe://Fairplace/node/a", "malformed trust domain"),
            ("SPIFFE://fairplace/node/a", "scheme"),
            ("spiffe://fairplace/node/..", "malformed path"),
        ] {
            let e = id(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn the_table_refuses_what_a_role_may_not_call() {
        let peer = |s: &str| Peer::Identified(Arc::new(id(s).unwrap()));
        let node = peer("spiffe://fairplace/node/a");
        let orch = peer("spiffe://fairplace/orchestrator/o");
        let admin = peer("spiffe://fairplace/admin/x");
        let set = "/fairplace.v1.AdminService/SetFeatures";
        let pick = "/fairplace.v1.PlacementService/PickCpu";
        let report = "/fairplace.v1.AgentService/Report";
        let health = "/grpc.health.v1.Health/Check";
        assert!(authorize(true, Some(&admin), set).is_ok());
        let e = authorize(true, Some(&orch), set).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("orchestrator/o") && e.message().contains("admin"));
        assert!(authorize(true, Some(&orch), pick).is_ok());
        assert!(authorize(true, Some(&node), pick).is_err());
        assert!(authorize(true, Some(&node), report).is_ok());
        assert!(authorize(true, Some(&orch), report).is_err());
        for p in [&node, &orch, &admin] {
            assert!(authorize(true, Some(p), health).is_ok());
        }
        // Unknown methods: admins only; nothing without an identity.
        assert!(authorize(true, Some(&orch), "/x.Y/Z").is_err());
        assert!(authorize(true, Some(&admin), "/x.Y/Z").is_ok());
        let none = authorize(true, None, health).unwrap_err();
        assert_eq!(none.code(), tonic::Code::Unauthenticated);
        let anon = authorize(true, Some(&Peer::Anonymous), health).unwrap_err();
        assert_eq!(anon.code(), tonic::Code::Unauthenticated);
        let bad = Peer::Unidentified("no SAN".into());
        assert_eq!(
            authorize(true, Some(&bad), health).unwrap_err().code(),
            tonic::Code::Unauthenticated
        );
        // Without client authentication everything is open.
        assert!(matches!(authorize(false, None, set), Ok(Caller::Open)));
    }

    #[test]
    fn a_node_may_report_only_itself_and_only_admins_apply() {
        let c = |s: &str| Caller::Authenticated(Arc::new(id(s).unwrap()));
        let e = check_report_node(&c("spiffe://fairplace/node/a"), "b").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert!(e.message().contains("\"a\"") && e.message().contains("\"b\""));
        assert!(check_report_node(&c("spiffe://fairplace/node/a"), "a").is_ok());
        assert!(check_report_node(&c("spiffe://fairplace/admin/x"), "b").is_ok());
        assert!(check_apply(&c("spiffe://fairplace/orchestrator/o")).is_err());
        assert!(check_apply(&c("spiffe://fairplace/admin/x")).is_ok());
        assert!(check_apply(&Caller::Open).is_ok());
        assert_eq!(c("spiffe://fairplace/orchestrator/o").claimant(), "o");
    }
}
