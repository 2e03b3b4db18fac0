//! Calls passed from one replica to another: channels to the peers, and
//! the header that carries the original caller.
//!
//! A replica forwards with its peer certificate (`spiffe://TD/replica/ID`,
//! `--replica-tls-cert`), and names the caller it forwards for in
//! [`FORWARDED_FOR`]. The receiving replica trusts that header only from a
//! `replica` certificate, and then authorizes the call as if the named
//! caller had made it (`service::identity`). Without mutual TLS every
//! caller is the same open one and the header only marks the call as
//! forwarded, so it is answered where it lands and never passed on again.

use std::path::PathBuf;
use std::time::Duration;

use dashmap::DashMap;
use tonic::Status;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::client_tls::{ClientFiles, ClientTlsError, Reloading};
use crate::identity::FORWARDED_FOR;

/// How a replica reaches its peers over TLS.
#[derive(Debug, Clone)]
pub struct PeerTls {
    /// The CA peers' server certificates chain to.
    pub ca: PathBuf,
    /// This replica's peer certificate and key (role `replica`).
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// One lazily connected channel per peer address.
pub struct Peers {
    /// The peer certificate and CA, read again while the replica runs
    /// ([`super::client_tls`]); `None` over plaintext.
    tls: Option<Reloading>,
    channels: DashMap<String, Channel>,
}

impl Peers {
    /// The peers' client; an error names the TLS file that is unusable.
    pub fn new(tls: Option<PeerTls>) -> Result<Peers, ClientTlsError> {
        let tls = match tls {
            Some(t) => Some(Reloading::load(ClientFiles {
                ca: t.ca,
                identity: Some((t.cert, t.key)),
            })?),
            None => None,
        };
        Ok(Peers {
            tls,
            channels: DashMap::new(),
        })
    }

    /// Reads the TLS files again; when they changed, the channels are
    /// remade as they are next used (calls in flight keep theirs).
    pub fn refresh_tls(&self) {
        if self
            .tls
            .as_ref()
            .is_some_and(|t| t.refresh("replica peers"))
        {
            self.channels.clear();
        }
    }

    /// The channel to the replica at `addr` (host:port).
    pub fn channel(&self, addr: &str) -> Result<Channel, Status> {
        if let Some(c) = self.channels.get(addr) {
            return Ok(c.clone());
        }
        let unavailable = |e: String| Status::unavailable(format!("replica {addr}: {e}"));
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut ep = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| unavailable(e.to_string()))?
            .connect_timeout(Duration::from_secs(1))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true);
        if let Some(t) = &self.tls {
            let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let cfg = t.current().config().domain_name(host.to_string());
            ep = ep.tls_config(cfg).map_err(|e| unavailable(e.to_string()))?;
        }
        let ch = ep.connect_lazy();
        self.channels.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }

    /// `msg` as a request made for `caller` (its SPIFFE ID or "anonymous").
    pub fn request<T>(msg: T, caller: &str) -> Result<tonic::Request<T>, Status> {
        let mut req = tonic::Request::new(msg);
        let v: MetadataValue<_> = caller
            .parse()
            .map_err(|_| Status::internal("the caller's identity is not a header value"))?;
        req.metadata_mut().insert(FORWARDED_FOR, v);
        req.set_timeout(Duration::from_secs(2));
        Ok(req)
    }
}

/// Counts one forwarded call by its outcome.
pub fn count(method: &'static str, r: &Result<impl Sized, Status>) {
    let outcome = match r {
        Ok(_) => "ok",
        Err(s) => code_name(s.code()),
    };
    metrics::counter!(crate::metrics::REPLICA_FORWARDS, "method" => method, "outcome" => outcome)
        .increment(1);
}

fn code_name(c: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match c {
        Ok => "ok",
        InvalidArgument => "invalid_argument",
        NotFound => "not_found",
        PermissionDenied => "permission_denied",
        FailedPrecondition => "failed_precondition",
        ResourceExhausted => "resource_exhausted",
        Unavailable => "unavailable",
        DeadlineExceeded => "deadline_exceeded",
        Unauthenticated => "unauthenticated",
        _ => "other",
    }
}
