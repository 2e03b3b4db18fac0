//! [`Etcd`]: the replicas' client of etcd's v3 API (keys, transactions,
//! leases, watches, and the election service) with one channel per member.
//!
//! Why our own thin client: the API is four RPCs and two streams, and the
//! crates that wrap it generate their code with a system `protoc` at build
//! time, which a fresh machine does not have; these stubs come from
//! `proto/etcd` through protox like the rest of fairplace's API.
//!
//! Every call is bounded by a deadline and made again on the next member
//! when the one it went to fails (a killed member is not an error the
//! caller should see). A transaction is made again only when it surely did
//! not apply: otherwise its outcome is unknown, and the caller decides.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use fairplace_proto::election::{self, election_client::ElectionClient};
use fairplace_proto::etcd as pb;
use fairplace_proto::etcd::compare::{CompareResult, CompareTarget, TargetUnion};
use pb::kv_client::KvClient;
use pb::lease_client::LeaseClient;
use pb::watch_client::WatchClient;
use tokio::sync::mpsc;
use tonic::transport::{Channel, Endpoint};

use super::client_tls::{ClientFiles, ClientPem, Reloading};

pub use pb::Compare;

/// How to reach etcd: `--etcd-endpoints` and its TLS files.
#[derive(Debug, Clone, Default)]
pub struct EtcdSettings {
    /// `http://host:port` or `https://host:port`, one per member.
    pub endpoints: Vec<String>,
    pub ca: Option<std::path::PathBuf>,
    pub cert: Option<std::path::PathBuf>,
    pub key: Option<std::path::PathBuf>,
    /// The key prefix every fairplace key lives under (ends in `/`).
    pub prefix: String,
}

/// Why an etcd call failed.
#[derive(Debug, Clone)]
pub struct EtcdError(pub String);

impl std::fmt::Display for EtcdError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "etcd: {}", self.0)
    }
}

impl std::error::Error for EtcdError {}

impl From<tonic::Status> for EtcdError {
    fn from(s: tonic::Status) -> Self {
        EtcdError(format!("{:?}: {}", s.code(), s.message()))
    }
}

/// One request's deadline: a replica that cannot reach a quorum within it
/// answers UNAVAILABLE rather than hang its caller.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);

/// Keys read per range request: a page of owners or leases stays well
/// under etcd's message limit.
const PAGE: i64 = 5_000;

/// A client of the etcd cluster: one lazily connected channel per member,
/// and the member calls go to until it fails.
///
/// Why not one balanced channel: a balancer keeps sending calls to a member
/// that was just killed (its connection fails only when used), so every
/// call would have to be retried anyway; here a failure moves the client to
/// the next member at once, and streams (watches, keep-alives) open on a
/// member that answers.
#[derive(Clone)]
pub struct Etcd {
    endpoints: Arc<[String]>,
    /// The TLS files, read again while the replica runs
    /// ([`super::client_tls`]); `None` over plaintext.
    tls: Option<Arc<Reloading>>,
    /// One channel per member, remade when the TLS files change.
    members: Arc<ArcSwap<Vec<Channel>>>,
    current: Arc<AtomicUsize>,
    pub prefix: String,
}

/// The exclusive end of the range of keys starting with `prefix`.
pub fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    // Every byte 0xff: the range runs to the end of the keyspace.
    vec![0]
}

/// Whether a failed call may be made again on another member: `any` for a
/// call that is safe to repeat whatever happened (reads, keep-alives), else
/// only when the request surely did not apply (never sent, or refused by a
/// member without a leader before it was proposed).
fn may_fail_over(s: &tonic::Status, any: bool) -> bool {
    let transport = matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Unknown);
    let not_applied = s.code() == tonic::Code::Unavailable
        && (s.message().contains("connect error") || s.message().contains("no leader"));
    (any && transport) || not_applied
}

impl Etcd {
    /// A client of the members `s.endpoints` (connections are made lazily,
    /// and remade when a member comes back).
    pub fn connect(s: &EtcdSettings) -> Result<Etcd, EtcdError> {
        if s.endpoints.is_empty() {
            return Err(EtcdError("--etcd-endpoints: no endpoint given".into()));
        }
        let tls = match tls_files(s)? {
            Some(f) => Some(Arc::new(
                Reloading::load(f).map_err(|e| EtcdError(format!("--etcd-tls-*: {e}")))?,
            )),
            None => None,
        };
        let pem = tls.as_ref().map(|t| t.current());
        let members = channels(&s.endpoints, pem.as_deref())?;
        Ok(Etcd {
            endpoints: s.endpoints.clone().into(),
            tls,
            members: Arc::new(ArcSwap::from_pointee(members)),
            current: Arc::new(AtomicUsize::new(0)),
            prefix: s.prefix.clone(),
        })
    }

    /// Reads the TLS files again; when they changed, the calls made from
    /// now on go over new connections that present them.
    pub fn refresh_tls(&self) {
        let Some(t) = &self.tls else { return };
        if !t.refresh("etcd") {
            return;
        }
        match channels(&self.endpoints, Some(&t.current())) {
            Ok(m) => self.members.store(Arc::new(m)),
            Err(e) => tracing::warn!(error = %e, "etcd channels with the new TLS files"),
        }
    }

    /// `PREFIX` + `rest`.
    pub fn key(&self, rest: &str) -> Vec<u8> {
        format!("{}{rest}", self.prefix).into_bytes()
    }

    /// Runs `call` on the current member, and on the next ones while it
    /// fails in a way [`may_fail_over`] allows (`any`: the call is safe to
    /// repeat); the member that answered becomes the current one.
    async fn on_members<T, F, Fut>(&self, any: bool, mut call: F) -> Result<T, EtcdError>
    where
        F: FnMut(Channel) -> Fut,
        Fut: Future<Output = Result<T, tonic::Status>>,
    {
        let members = self.members.load_full();
        let n = members.len();
        let first = self.current.load(Ordering::Relaxed);
        let mut last = None;
        for k in 0..n {
            let i = (first + k) % n;
            match call(members[i].clone()).await {
                Ok(v) => {
                    if k > 0 {
                        self.current.store(i, Ordering::Relaxed);
                    }
                    return Ok(v);
                }
                Err(s) if may_fail_over(&s, any) => last = Some(s),
                Err(s) => return Err(s.into()),
            }
        }
        Err(last.map_or_else(|| EtcdError("no member".into()), Into::into))
    }

    /// Every key under `prefix`, read in pages of `PAGE` keys at one
    /// revision, with that revision.
    pub async fn range_prefix(&self, prefix: &[u8]) -> Result<(Vec<pb::KeyValue>, i64), EtcdError> {
        let end = prefix_end(prefix);
        let mut out = Vec::new();
        let mut from = prefix.to_vec();
        let mut rev = 0;
        loop {
            let req = pb::RangeRequest {
                key: from.clone(),
                range_end: end.clone(),
                limit: PAGE,
                revision: rev,
                ..Default::default()
            };
            let r = self
                .on_members(true, |ch| {
                    let req = req.clone();
                    async move { KvClient::new(ch).range(req).await.map(|r| r.into_inner()) }
                })
                .await?;
            if rev == 0 {
                rev = r.header.map_or(0, |h| h.revision);
            }
            let more = r.more;
            out.extend(r.kvs);
            match out.last() {
                Some(last) if more => {
                    from = last.key.clone();
                    from.push(0);
                }
                _ => return Ok((out, rev)),
            }
        }
    }

    /// One key, if it exists.
    pub async fn get(&self, key: &[u8]) -> Result<Option<pb::KeyValue>, EtcdError> {
        let req = pb::RangeRequest {
            key: key.to_vec(),
            ..Default::default()
        };
        let r = self
            .on_members(true, |ch| {
                let req = req.clone();
                async move { KvClient::new(ch).range(req).await.map(|r| r.into_inner()) }
            })
            .await?;
        Ok(r.kvs.into_iter().next())
    }

    /// A transaction: `compare` all hold, then `success`, else `failure`.
    /// Made again on another member only when it surely did not apply; any
    /// other failure leaves its outcome unknown, and the caller decides.
    pub async fn txn(
        &self,
        compare: Vec<pb::Compare>,
        success: Vec<pb::RequestOp>,
        failure: Vec<pb::RequestOp>,
    ) -> Result<pb::TxnResponse, EtcdError> {
        let req = pb::TxnRequest {
            compare,
            success,
            failure,
        };
        self.on_members(false, |ch| {
            let req = req.clone();
            async move { KvClient::new(ch).txn(req).await.map(|r| r.into_inner()) }
        })
        .await
    }

    /// A new etcd lease of `ttl` seconds; its id. (A grant repeated after a
    /// lost answer only leaves an unused lease, which expires.)
    pub async fn grant(&self, ttl_s: i64) -> Result<i64, EtcdError> {
        let r = self
            .on_members(true, |ch| async move {
                LeaseClient::new(ch)
                    .lease_grant(pb::LeaseGrantRequest { ttl: ttl_s, id: 0 })
                    .await
                    .map(|r| r.into_inner())
            })
            .await?;
        if !r.error.is_empty() {
            return Err(EtcdError(format!("lease grant: {}", r.error)));
        }
        Ok(r.id)
    }

    /// Ends an etcd lease now (its keys go with it).
    pub async fn revoke(&self, id: i64) -> Result<(), EtcdError> {
        self.on_members(true, |ch| async move {
            LeaseClient::new(ch)
                .lease_revoke(pb::LeaseRevokeRequest { id })
                .await
                .map(|_| ())
        })
        .await
    }

    /// Refreshes lease `id` once; the TTL etcd now gives it (0: gone).
    /// Each member's attempt is bounded by [`CALL_TIMEOUT`]: a member
    /// without a leader may hold the stream open without answering.
    pub async fn keep_alive_once(&self, id: i64) -> Result<i64, EtcdError> {
        self.on_members(true, |ch| async move {
            let once = async {
                let (tx, rx) = mpsc::channel(1);
                let _ = tx.send(pb::LeaseKeepAliveRequest { id }).await;
                let mut stream = LeaseClient::new(ch)
                    .lease_keep_alive(tokio_stream::wrappers::ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                match stream.message().await? {
                    Some(r) => Ok(r.ttl),
                    None => Err(tonic::Status::unavailable("keep-alive stream closed")),
                }
            };
            tokio::time::timeout(CALL_TIMEOUT, once)
                .await
                .unwrap_or_else(|_| Err(tonic::Status::unavailable("keep-alive timed out")))
        })
        .await
    }

    /// Campaigns for election `name` with etcd lease `lease`, as `value`:
    /// the leader's key once this campaigner holds the election. A
    /// campaigner that waits behind a leader sees its call end at the
    /// deadline ([`CALL_TIMEOUT`]) and calls again: its key stays queued,
    /// bound to its lease, and a repeated campaign with the same lease is
    /// the same campaign.
    pub async fn campaign(
        &self,
        name: &[u8],
        lease: i64,
        value: &[u8],
    ) -> Result<election::LeaderKey, EtcdError> {
        let req = election::CampaignRequest {
            name: name.to_vec(),
            lease,
            value: value.to_vec(),
        };
        self.on_members(false, |ch| {
            let req = req.clone();
            async move {
                let r = ElectionClient::new(ch).campaign(req).await?.into_inner();
                r.leader
                    .ok_or_else(|| tonic::Status::internal("a campaign answered without a key"))
            }
        })
        .await
    }

    /// The leader of election `name`: its key/value, if any holds it.
    pub async fn leader(&self, name: &[u8]) -> Result<Option<pb::KeyValue>, EtcdError> {
        let req = election::LeaderRequest {
            name: name.to_vec(),
        };
        let r = self
            .on_members(true, |ch| {
                let req = req.clone();
                async move { ElectionClient::new(ch).leader(req).await }
            })
            .await;
        match r {
            Ok(r) => Ok(r.into_inner().kv),
            // etcd answers "election: no leader" as an error.
            Err(e) if e.0.contains("no leader") => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Watches every key under `prefix` from revision `from`; the events
    /// arrive on the returned receiver until the watch fails (the receiver
    /// then ends, and the caller reads the range again and watches anew).
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        from: i64,
    ) -> Result<mpsc::Receiver<Vec<pb::Event>>, EtcdError> {
        let create = pb::WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                pb::WatchCreateRequest {
                    key: prefix.to_vec(),
                    range_end: prefix_end(prefix),
                    start_revision: from,
                    progress_notify: true,
                    prev_kv: false,
                },
            )),
        };
        let (req_tx, mut stream) = self
            .on_members(true, |ch| {
                let create = create.clone();
                async move {
                    let (req_tx, req_rx) = mpsc::channel(1);
                    let _ = req_tx.send(create).await;
                    let mut client = WatchClient::new(ch);
                    let open = client.watch(tokio_stream::wrappers::ReceiverStream::new(req_rx));
                    let s = tokio::time::timeout(CALL_TIMEOUT, open)
                        .await
                        .map_err(|_| tonic::Status::unavailable("opening a watch timed out"))??;
                    Ok((req_tx, s.into_inner()))
                }
            })
            .await?;
        let (tx, rx) = mpsc::channel(64);
        tokio::spawn(async move {
            // Held so the request side stays open as long as the watch.
            let _req_tx = req_tx;
            while let Ok(Some(r)) = stream.message().await {
                if r.canceled || r.compact_revision != 0 {
                    break;
                }
                if !r.events.is_empty() && tx.send(r.events).await.is_err() {
                    break;
                }
            }
        });
        Ok(rx)
    }
}

fn tls_files(s: &EtcdSettings) -> Result<Option<ClientFiles>, EtcdError> {
    let Some(ca) = &s.ca else {
        if s.cert.is_some() || s.key.is_some() {
            return Err(EtcdError(
                "--etcd-tls-cert/--etcd-tls-key need --etcd-tls-ca".into(),
            ));
        }
        return Ok(None);
    };
    let identity = match (&s.cert, &s.key) {
        (Some(c), Some(k)) => Some((c.clone(), k.clone())),
        (None, None) => None,
        _ => {
            return Err(EtcdError(
                "--etcd-tls-cert and --etcd-tls-key go together".into(),
            ));
        }
    };
    Ok(Some(ClientFiles {
        ca: ca.clone(),
        identity,
    }))
}

/// One lazily connected channel per endpoint, over TLS with `pem` when
/// given (an https endpoint needs it).
fn channels(endpoints: &[String], pem: Option<&ClientPem>) -> Result<Vec<Channel>, EtcdError> {
    let mut members = Vec::with_capacity(endpoints.len());
    for url in endpoints {
        let mut e = Endpoint::from_shared(url.clone())
            .map_err(|e| EtcdError(format!("--etcd-endpoints: {url}: {e}")))?
            .connect_timeout(Duration::from_secs(1))
            .timeout(CALL_TIMEOUT)
            .http2_keep_alive_interval(Duration::from_secs(1))
            .keep_alive_timeout(Duration::from_secs(2))
            .keep_alive_while_idle(true);
        if url.starts_with("https://") {
            let t = pem.ok_or_else(|| {
                EtcdError(format!(
                    "--etcd-endpoints: {url} is https but no --etcd-tls-ca is given"
                ))
            })?;
            e = e
                .tls_config(t.config())
                .map_err(|e| EtcdError(format!("--etcd-tls-*: {e}")))?;
        }
        members.push(e.connect_lazy());
    }
    Ok(members)
}

/// `key` exists no more (or never did): its create revision is 0.
pub fn absent(key: Vec<u8>) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Create as i32,
        key,
        target_union: Some(TargetUnion::CreateRevision(0)),
    }
}

/// `key` exists.
pub fn present(key: Vec<u8>) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Greater as i32,
        target: CompareTarget::Version as i32,
        key,
        target_union: Some(TargetUnion::Version(0)),
    }
}

/// `key` exists and was created at revision `rev` (the same key, not one
/// deleted and made again since).
pub fn created_at(key: Vec<u8>, rev: i64) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Create as i32,
        key,
        target_union: Some(TargetUnion::CreateRevision(rev)),
    }
}

/// `key` was last written at revision `rev` (unchanged since it was read).
pub fn unchanged(key: Vec<u8>, rev: i64) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Mod as i32,
        key,
        target_union: Some(TargetUnion::ModRevision(rev)),
    }
}

/// `key` is bound to etcd lease `lease` (so it exists, and was written
/// under that lease: the fence of a node's owner).
pub fn bound_to(key: Vec<u8>, lease: i64) -> pb::Compare {
    pb::Compare {
        result: CompareResult::Equal as i32,
        target: CompareTarget::Lease as i32,
        key,
        target_union: Some(TargetUnion::Lease(lease)),
    }
}

pub fn put(key: Vec<u8>, value: Vec<u8>, lease: i64) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(pb::request_op::Request::RequestPut(pb::PutRequest {
            key,
            value,
            lease,
            prev_kv: false,
        })),
    }
}

pub fn delete(key: Vec<u8>) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(pb::request_op::Request::RequestDeleteRange(
            pb::DeleteRangeRequest {
                key,
                range_end: Vec::new(),
                prev_kv: false,
            },
        )),
    }
}

pub fn get_op(key: Vec<u8>) -> pb::RequestOp {
    pb::RequestOp {
        request: Some(pb::request_op::Request::RequestRange(pb::RangeRequest {
            key,
            ..Default::default()
        })),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_range_ends_after_its_last_key() {
        assert_eq!(prefix_end(b"/fp/a"), b"/fp/b".to_vec());
        assert_eq!(prefix_end(b"a\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff\xff"), vec![0]);
    }
}
