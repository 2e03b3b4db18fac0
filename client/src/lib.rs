//! The fairplace client library for orchestrators: connect, then ask for
//! placements and migration checks, with a deadline on every call and
//! retries while the server is UNAVAILABLE.
//!
//! It owns the API side only: the connection (plaintext, TLS, or TLS with
//! the server's role verified, [`verified`]), the calls, and plain-text
//! tables of their answers ([`table`], for the CLI and the demo). What a
//! program links it for is the gRPC API and its transport: it parses no
//! command line (the CLI, `fairplace-cli`, and the agent turn their flags
//! into [`TlsOptions`]) and touches nothing of this machine (reading /sys
//! and /proc and applying CPU sets is `fairplace-host`).

pub mod routes;
pub mod table;
pub mod verified;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use fairplace_proto::v1 as pb;
use pb::admin_service_client::AdminServiceClient;
use pb::placement_service_client::PlacementServiceClient;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::{Code, Request, Status};

/// TLS towards the server: the CA its certificate chains to and, for mutual
/// TLS, this client's certificate and key (whose URI SAN
/// `spiffe://TRUST_DOMAIN/ROLE/NAME` says what it may call). The files are
/// read at every connect, so a reconnect picks up a rotated certificate.
#[derive(Debug, Clone, Default)]
pub struct TlsOptions {
    /// PEM CA bundle that signed the server's certificate.
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain (with `key`).
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert`.
    pub key: Option<PathBuf>,
    /// The name to check the server's certificate for (default: the host
    /// of the address).
    pub server_name: Option<String>,
}

impl TlsOptions {
    /// Whether TLS is on (any of the files given).
    pub fn enabled(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.key.is_some()
    }

    /// The rustls client configuration for tonic, from the files as they are
    /// now.
    pub fn client_config(&self) -> Result<ClientTlsConfig, String> {
        let read = |p: &PathBuf| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
        let ca = self
            .ca
            .as_ref()
            .ok_or("--tls-ca: the CA of the server's certificate is needed for TLS")?;
        let mut cfg = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?));
        match (&self.cert, &self.key) {
            (Some(c), Some(k)) => cfg = cfg.identity(Identity::from_pem(read(c)?, read(k)?)),
            (None, None) => {}
            _ => return Err("--tls-cert and --tls-key go together".into()),
        }
        if let Some(n) = &self.server_name {
            cfg = cfg.domain_name(n.clone());
        }
        Ok(cfg)
    }

    /// An endpoint for `addr` (`host:port`, `http://...` or `https://...`):
    /// https with this TLS configuration when TLS is on.
    pub fn endpoint(&self, addr: &str) -> Result<Endpoint, String> {
        let bare = addr
            .strip_prefix("http://")
            .or_else(|| addr.strip_prefix("https://"))
            .unwrap_or(addr);
        if !self.enabled() {
            let uri = if addr.contains("://") {
                addr.to_string()
            } else {
                format!("http://{addr}")
            };
            return Endpoint::from_shared(uri).map_err(|e| format!("{addr}: {e}"));
        }
        Endpoint::from_shared(format!("https://{bare}"))
            .map_err(|e| format!("{addr}: {e}"))?
            .tls_config(self.client_config()?)
            .map_err(|e| format!("TLS: {e}: {}", source_chain(&e)))
    }
}

/// A connection to a fairplace server.
#[derive(Clone)]
pub struct Client {
    channel: Channel,
    placement: PlacementServiceClient<Channel>,
    admin: AdminServiceClient<Channel>,
    /// With a replica set: who owns what ([`routes`]), so node calls go
    /// to the owner.
    routes: Option<Arc<routes::Routes>>,
    /// Per-attempt deadline.
    pub deadline: Duration,
    /// Attempts for a call that fails with UNAVAILABLE.
    pub attempts: u32,
    token: Option<String>,
}

impl Client {
    /// Connects to `addr` (`http://host:port` or `host:port`).
    pub async fn connect(addr: &str) -> Result<Client, tonic::transport::Error> {
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let channel = Endpoint::from_shared(uri)?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .connect()
            .await?;
        Ok(Self::from_channel(channel))
    }

    /// Connects to `addr` over TLS (mutual TLS with a client certificate),
    /// or plaintext when `tls` names no file.
    pub async fn connect_tls(addr: &str, tls: &TlsOptions) -> Result<Client, String> {
        let channel = tls
            .endpoint(addr)?
            .connect_timeout(Duration::from_secs(3))
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| format!("{e}: {}", source_chain(&e)))?;
        Ok(Self::from_channel(channel))
    }

    /// A client whose connection is made on first use (and remade after a
    /// failure), so calls made before the server is up fail UNAVAILABLE
    /// and are retried.
    pub fn connect_lazy(addr: &str) -> Result<Client, tonic::transport::Error> {
        let uri = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let channel = Endpoint::from_shared(uri)?
            .connect_timeout(Duration::from_millis(500))
            .tcp_nodelay(true)
            .connect_lazy();
        Ok(Self::from_channel(channel))
    }

    pub fn from_channel(channel: Channel) -> Client {
        Client {
            placement: PlacementServiceClient::new(channel.clone()),
            admin: AdminServiceClient::new(channel.clone()),
            channel,
            routes: None,
            deadline: Duration::from_secs(2),
            attempts: 4,
            token: None,
        }
    }

    /// Connects to the first of `addrs` that answers and asks it for the
    /// replica set (WatchMembers): with several replicas, node calls then
    /// go to each node's owner directly ([`routes`]); a single server (or
    /// one that predates WatchMembers) is called as [`Client::connect_tls`]
    /// would.
    pub async fn connect_routed(addrs: &[String], tls: &TlsOptions) -> Result<Client, String> {
        let mut why = Vec::new();
        for addr in addrs {
            let channel = match tls
                .endpoint(addr)?
                .connect_timeout(Duration::from_secs(3))
                .tcp_nodelay(true)
                .connect()
                .await
            {
                Ok(c) => c,
                Err(e) => {
                    why.push(format!("{addr}: {e}: {}", source_chain(&e)));
                    continue;
                }
            };
            let mut client = Self::from_channel(channel.clone());
            let mut stream = match routes::open(channel).await {
                Ok(s) => s,
                Err(s) if s.code() == Code::Unimplemented => return Ok(client),
                Err(s) => {
                    why.push(format!("{addr}: {s}"));
                    continue;
                }
            };
            let first = match stream.message().await {
                Ok(Some(set)) => set,
                Ok(None) => return Ok(client),
                Err(s) => {
                    why.push(format!("{addr}: {s}"));
                    continue;
                }
            };
            if first.replicated {
                client.routes = Some(routes::Routes::start(
                    tls.clone(),
                    first,
                    stream,
                    addrs.to_vec(),
                )?);
            }
            return Ok(client);
        }
        Err(format!("cannot connect: {}", why.join("; ")))
    }

    /// The replica set's member ids this client routes over (empty: one
    /// server).
    pub fn members(&self) -> Vec<String> {
        self.routes
            .as_ref()
            .map(|r| r.member_ids())
            .unwrap_or_default()
    }

    /// Sends `authorization: Bearer TOKEN` with admin calls.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    fn request<T>(&self, msg: T) -> Request<T> {
        let mut r = Request::new(msg);
        r.set_timeout(self.deadline);
        if self.routes.is_some() {
            r.metadata_mut().insert(
                routes::ROUTED,
                tonic::metadata::MetadataValue::from_static("1"),
            );
        }
        if let Some(t) = &self.token
            && let Ok(v) = format!("Bearer {t}").parse()
        {
            r.metadata_mut().insert("authorization", v);
        }
        r
    }

    /// Runs `call` until it succeeds, fails with something other than
    /// UNAVAILABLE, or runs out of attempts (backing off 20 ms, 40 ms, ...).
    async fn retry<T, F, Fut>(&self, mut call: F) -> Result<T, Status>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let mut backoff = Duration::from_millis(20);
        let mut left = self.attempts.max(1);
        loop {
            // grpc-timeout tells the server; this bounds the wait here too,
            // on a connection that hangs.
            let attempt = match tokio::time::timeout(self.deadline, call()).await {
                Ok(r) => r,
                Err(_) => Err(Status::deadline_exceeded(format!(
                    "no answer within {:?}",
                    self.deadline
                ))),
            };
            match attempt {
                Ok(r) => return Ok(r.into_inner()),
                // A redirect is answered where it points ([`Client::at`]).
                Err(s)
                    if s.code() == Code::Unavailable
                        && left > 1
                        && routes::owner_in(&s).is_none() =>
                {
                    left -= 1;
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                }
                Err(s) => return Err(s),
            }
        }
    }

    /// Runs `call` on the channel for `node`: its owner's with a replica
    /// set, else the one connection. A redirect (a stale guess) is
    /// followed once; a member that cannot be reached is left out and the
    /// call made at the node's next owner.
    async fn at<T, F, Fut>(&self, node: &str, call: F) -> Result<T, Status>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let Some(routes) = &self.routes else {
            return call(self.channel.clone()).await;
        };
        let Some(first) = routes.target(node) else {
            return call(self.channel.clone()).await;
        };
        let err = match call(first.channel).await {
            Ok(v) => return Ok(v),
            Err(s) => s,
        };
        if let Some(addr) = routes::owner_in(&err) {
            let ch = routes
                .redirected(node, &addr)
                .map_err(Status::unavailable)?;
            return call(ch).await;
        }
        if routes::unreachable(&err)
            && let Some(id) = first.member
        {
            routes.unreachable(&id);
            if let Some(next) = routes.target(node) {
                return call(next.channel).await;
            }
        }
        Err(err)
    }

    /// A claimed pick is not retried: the server may have committed the
    /// claim before the connection failed, and a retry would claim twice.
    pub async fn pick_cpu(&self, req: pb::PickCpuRequest) -> Result<pb::PickCpuResponse, Status> {
        let node = req.node_id.clone();
        self.at(&node, |ch| self.pick_cpu_on(ch, req.clone())).await
    }

    async fn pick_cpu_on(
        &self,
        ch: Channel,
        req: pb::PickCpuRequest,
    ) -> Result<pb::PickCpuResponse, Status> {
        if req.claim {
            let mut c = PlacementServiceClient::new(ch);
            let r = self.request(req);
            return match tokio::time::timeout(self.deadline, c.pick_cpu(r)).await {
                Ok(r) => r.map(|r| r.into_inner()),
                Err(_) => Err(Status::deadline_exceeded(format!(
                    "no answer within {:?}",
                    self.deadline
                ))),
            };
        }
        self.retry(|| {
            let mut c = PlacementServiceClient::new(ch.clone());
            let r = self.request(req.clone());
            async move { c.pick_cpu(r).await }
        })
        .await
    }

    pub async fn can_migrate(
        &self,
        req: pb::CanMigrateRequest,
    ) -> Result<pb::CanMigrateResponse, Status> {
        let req = &req;
        self.at(&req.node_id, |ch| {
            self.retry(move || {
                let mut c = PlacementServiceClient::new(ch.clone());
                let r = self.request(req.clone());
                async move { c.can_migrate(r).await }
            })
        })
        .await
    }

    /// Load-balance proposals for a node or a cluster group. A balance that
    /// applies its proposals as claims is not retried (it may have landed).
    pub async fn balance(&self, req: pb::BalanceRequest) -> Result<pb::BalanceResponse, Status> {
        self.at(&req.node_id, |ch| async {
            if req.apply {
                let mut c = PlacementServiceClient::new(ch);
                return c
                    .balance(self.request(req.clone()))
                    .await
                    .map(|r| r.into_inner());
            }
            self.retry(|| {
                let mut c = PlacementServiceClient::new(ch.clone());
                let r = self.request(req.clone());
                async move { c.balance(r).await }
            })
            .await
        })
        .await
    }

    /// A whole scenario (JSON) in, the decision (JSON) out.
    pub async fn decide(&self, scenario_json: &str) -> Result<String, Status> {
        let req = pb::DecideRequest {
            scenario_json: scenario_json.to_string(),
        };
        self.retry(|| {
            let mut c = self.placement.clone();
            let r = self.request(req.clone());
            async move { c.decide(r).await }
        })
        .await
        .map(|r| r.answer_json)
    }

    pub async fn list_nodes(&self) -> Result<Vec<pb::NodeSummary>, Status> {
        self.retry(|| {
            let mut c = self.admin.clone();
            let r = self.request(pb::ListNodesRequest {});
            async move { c.list_nodes(r).await }
        })
        .await
        .map(|r| r.nodes)
    }

    pub async fn get_node(&self, id: &str) -> Result<pb::GetNodeResponse, Status> {
        self.at(id, |ch| {
            self.retry(move || {
                let mut c = AdminServiceClient::new(ch.clone());
                let r = self.request(pb::GetNodeRequest {
                    node_id: id.to_string(),
                });
                async move { c.get_node(r).await }
            })
        })
        .await
    }

    pub async fn get_cache(&self, id: &str) -> Result<pb::GetCacheResponse, Status> {
        self.at(id, |ch| {
            self.retry(move || {
                let mut c = AdminServiceClient::new(ch.clone());
                let r = self.request(pb::GetCacheRequest {
                    node_id: id.to_string(),
                });
                async move { c.get_cache(r).await }
            })
        })
        .await
    }

    pub async fn get_features(&self, node: &str) -> Result<pb::Features, Status> {
        self.at(node, |ch| {
            self.retry(move || {
                let mut c = AdminServiceClient::new(ch.clone());
                let r = self.request(pb::GetFeaturesRequest {
                    node_id: node.to_string(),
                });
                async move { c.get_features(r).await }
            })
        })
        .await
    }

    pub async fn set_features(&self, req: pb::SetFeaturesRequest) -> Result<pb::Features, Status> {
        let req = &req;
        self.at(&req.node_id, |ch| {
            self.retry(move || {
                let mut c = AdminServiceClient::new(ch.clone());
                let r = self.request(req.clone());
                async move { c.set_features(r).await }
            })
        })
        .await
    }

    /// AdminService.Record: what the server sees and decides for `seconds`,
    /// as the bytes of one recording segment (`fairplace-server replay`
    /// reads a directory of them). With a replica set, the server first
    /// connected to records the nodes it holds.
    pub async fn record(
        &self,
        seconds: u32,
        max_bytes: u64,
    ) -> Result<tonic::Streaming<pb::RecordChunk>, Status> {
        let mut r = self.request(pb::RecordRequest { seconds, max_bytes });
        // The call lasts the recording: no per-call deadline.
        r.metadata_mut().remove("grpc-timeout");
        let mut c = AdminServiceClient::new(self.channel.clone());
        c.record(r).await.map(|r| r.into_inner())
    }

    /// PickCpus: every request of `requests` on one stream, answered in
    /// order (`seq` from 0), each as PickCpu would answer it. The stream
    /// has no deadline (it lasts as long as `requests`); the server ends
    /// one that stays silent for two minutes.
    pub async fn pick_cpus_stream<S>(
        &self,
        requests: S,
    ) -> Result<tonic::Streaming<pb::PickCpusAnswer>, Status>
    where
        S: tokio_stream::Stream<Item = pb::PickCpuRequest> + Send + 'static,
    {
        let mut r = self.request(requests);
        // The deadline is per call; this call is the whole stream.
        r.metadata_mut().remove("grpc-timeout");
        let mut c = self.placement.clone();
        c.pick_cpus(r).await.map(|r| r.into_inner())
    }

    /// PickCpus for a batch: each request's answer or error, in order.
    pub async fn pick_cpus(
        &self,
        requests: Vec<pb::PickCpuRequest>,
    ) -> Result<Vec<Result<pb::PickCpuResponse, Status>>, Status> {
        let Some(routes) = &self.routes else {
            return self.pick_cpus_on(self.channel.clone(), requests).await;
        };
        // With a replica set: one stream to each owner, the requests of its
        // nodes on it, the answers put back in the order asked.
        let n = requests.len();
        let asked = requests.clone();
        let mut by_member: Vec<(Channel, Vec<usize>, Vec<pb::PickCpuRequest>)> = Vec::new();
        let mut member_of: std::collections::HashMap<String, usize> = Default::default();
        for (i, r) in requests.into_iter().enumerate() {
            let Some(t) = routes.target(&r.node_id) else {
                return Err(Status::unavailable(
                    "no member of the replica set is reachable",
                ));
            };
            let k = *member_of
                .entry(t.member.unwrap_or_default())
                .or_insert_with(|| {
                    by_member.push((t.channel, Vec::new(), Vec::new()));
                    by_member.len() - 1
                });
            by_member[k].1.push(i);
            by_member[k].2.push(r);
        }
        let mut out: Vec<Option<Result<pb::PickCpuResponse, Status>>> =
            (0..n).map(|_| None).collect();
        let calls = by_member
            .into_iter()
            .map(|(ch, idx, reqs)| async move { (idx, self.pick_cpus_on(ch, reqs).await) });
        for (idx, answers) in futures_util::future::join_all(calls).await {
            let answers = answers?;
            for (i, a) in idx.into_iter().zip(answers) {
                out[i] = Some(a);
            }
        }
        // A stale guess answered in the stream (its answer names the owner
        // in words only): asked again on its own, which follows the
        // owner's address.
        let mut done = Vec::with_capacity(n);
        for (a, req) in out.into_iter().zip(asked) {
            done.push(match a {
                Some(Err(s))
                    if s.code() == Code::Unavailable && s.message().contains("reconnect to") =>
                {
                    self.pick_cpu(req).await
                }
                Some(a) => a,
                None => Err(Status::internal("no answer")),
            });
        }
        Ok(done)
    }

    /// PickCpus for a batch on `channel`: each request's answer or error,
    /// in order.
    async fn pick_cpus_on(
        &self,
        channel: Channel,
        requests: Vec<pb::PickCpuRequest>,
    ) -> Result<Vec<Result<pb::PickCpuResponse, Status>>, Status> {
        let n = requests.len();
        let mut r = self.request(tokio_stream::iter(requests));
        r.metadata_mut().remove("grpc-timeout");
        let mut c = PlacementServiceClient::new(channel);
        let mut answers = c.pick_cpus(r).await?.into_inner();
        let mut out = Vec::with_capacity(n);
        while let Some(a) = answers.message().await? {
            out.push(match a.result {
                Some(pb::pick_cpus_answer::Result::Ok(r)) => Ok(r),
                Some(pb::pick_cpus_answer::Result::Error(e)) => {
                    Err(Status::new(tonic::Code::from(e.code), e.message))
                }
                None => Err(Status::internal("an answer without a result")),
            });
        }
        if out.len() != n {
            return Err(Status::unavailable(format!(
                "the stream ended after {} of {n} answers",
                out.len()
            )));
        }
        Ok(out)
    }

    /// AllocateCpus, with a `request_id` (a random one when the request has
    /// none), retried with it while the outcome is unknown (UNAVAILABLE, or
    /// no answer in time): the server answers a retry with the first
    /// grant, so a lease granted before the connection failed is found,
    /// never taken twice.
    pub async fn allocate_cpus(
        &self,
        mut req: pb::AllocateCpusRequest,
    ) -> Result<pb::AllocateCpusResponse, Status> {
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        let node = req.node_id.clone();
        let granted = self
            .at(&node, |ch| self.allocate_on(ch, req.clone()))
            .await?;
        if let Some(r) = &self.routes {
            r.lease_on(granted.lease_id, &granted.node_id);
        }
        Ok(granted)
    }

    async fn allocate_on(
        &self,
        ch: Channel,
        req: pb::AllocateCpusRequest,
    ) -> Result<pb::AllocateCpusResponse, Status> {
        let mut backoff = Duration::from_millis(50);
        let mut left = self.attempts.max(1);
        loop {
            let mut c = PlacementServiceClient::new(ch.clone());
            let r = self.request(req.clone());
            let s = match tokio::time::timeout(self.deadline, c.allocate_cpus(r)).await {
                Ok(Ok(r)) => return Ok(r.into_inner()),
                Ok(Err(s)) => s,
                Err(_) => {
                    Status::deadline_exceeded(format!("no answer within {:?}", self.deadline))
                }
            };
            let unknown = matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded)
                && routes::owner_in(&s).is_none();
            if !unknown || left <= 1 {
                return Err(s);
            }
            left -= 1;
            tokio::time::sleep(backoff).await;
            backoff *= 2;
        }
    }

    pub async fn release_cpus(&self, lease_id: u64) -> Result<pb::ReleaseCpusResponse, Status> {
        let node = self.lease_node(lease_id, false);
        let r = self
            .at(&node, |ch| {
                self.retry(move || {
                    let mut c = PlacementServiceClient::new(ch.clone());
                    let r = self.request(pb::ReleaseCpusRequest { lease_id });
                    async move { c.release_cpus(r).await }
                })
            })
            .await;
        if r.is_ok() {
            self.lease_node(lease_id, true);
        }
        r
    }

    pub async fn renew_lease(
        &self,
        lease_id: u64,
        ttl_ms: u32,
    ) -> Result<pb::RenewLeaseResponse, Status> {
        let node = self.lease_node(lease_id, false);
        self.at(&node, |ch| {
            self.retry(move || {
                let mut c = PlacementServiceClient::new(ch.clone());
                let r = self.request(pb::RenewLeaseRequest { lease_id, ttl_ms });
                async move { c.renew_lease(r).await }
            })
        })
        .await
    }

    /// The node of a lease this client granted (empty: unknown, any
    /// replica takes the call); forgotten when `end`.
    fn lease_node(&self, id: u64, end: bool) -> String {
        self.routes
            .as_ref()
            .map(|r| r.lease_node(id, end))
            .unwrap_or_default()
    }

    /// The no-op call (the framework's own cost, for benchmarks).
    pub async fn ping(&self) -> Result<(), Status> {
        self.retry(|| {
            let mut c = self.admin.clone();
            let r = self.request(pb::PingRequest {});
            async move { c.ping(r).await }
        })
        .await
        .map(|_| ())
    }
}

/// The causes under a transport error (tonic's Display shows only the top).
pub fn source_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = Vec::new();
    let mut cur = e.source();
    while let Some(c) = cur {
        out.push(c.to_string());
        cur = c.source();
    }
    out.join(": ")
}

/// A request id no other call makes: 128 random bits, as hex.
pub fn new_request_id() -> String {
    let mut b = [0u8; 16];
    if getrandom::fill(&mut b).is_err() {
        // No generator: the time and the pid, unique enough for one
        // caller's retries.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        b = (t ^ (u128::from(std::process::id()) << 96)).to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}
