//! The metrics port: `/metrics` and `/healthz` on a small HTTP/1 server
//! (hyper).
//!
//! `/metrics` is the recorder's series (counters and histograms whose label
//! values come from fixed sets) followed by the series rendered from the
//! store at scrape time: the node count by freshness, the claims
//! outstanding, and every per-node series. Those mirror the store exactly:
//! a forgotten node's series are gone from the next scrape, and nothing
//! touches them between scrapes. A scrape is O(nodes) (bounded by
//! `--max-nodes`), runs off the async workers, and one at a time.
//!
//! `/healthz` answers 200 while the server serves and 503 before it starts
//! and from the moment shutdown begins (for HTTP probes, such as the
//! kubelet's, that cannot speak gRPC or present a client certificate).

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode, header};
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::Semaphore;

use crate::metrics as m;
use crate::store::Store;

/// Connections served at once; more are closed at accept.
const MAX_CONNECTIONS: usize = 32;
/// A request's headers must arrive within this long.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection is closed (after the request in flight) after this long, so
/// idle keep-alive connections cannot hold every slot.
const CONNECTION_LIFETIME: Duration = Duration::from_secs(60);
/// What a closing connection's request in flight still gets.
const DRAIN: Duration = Duration::from_secs(15);
/// How often the recorder drains its histogram buffers between scrapes.
const UPKEEP: Duration = Duration::from_secs(5);

/// Whether the server serves: `/healthz` answers 200 while set. Shared by
/// the exposition (which reads it) and `serve` (which sets it when it
/// starts and clears it when shutdown begins).
#[derive(Debug, Clone, Default)]
pub struct Readiness(Arc<AtomicBool>);

impl Readiness {
    pub fn set(&self, serving: bool) {
        self.0.store(serving, Ordering::SeqCst);
    }

    pub fn get(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// What the metrics port serves: the recorder's series and one store's.
struct Exposition {
    handle: PrometheusHandle,
    store: Arc<Store>,
    ready: Readiness,
    /// One render at a time: concurrent scrapes wait rather than multiply
    /// the O(nodes) work.
    render: tokio::sync::Mutex<()>,
}

/// Why the metrics port cannot be served: its address cannot be bound
/// (in use, not this host's), the socket cannot be set up, or the metrics
/// recorder cannot be installed. The server stops at start rather than run
/// without its metrics and health endpoint.
#[derive(Debug)]
pub enum ExpositionError {
    /// `--metrics-addr` cannot be bound.
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    /// The bound socket's address cannot be read.
    LocalAddr(std::io::Error),
    /// The socket cannot be made non-blocking or handed to Tokio.
    Listener(std::io::Error),
    /// The metrics recorder cannot be installed.
    Recorder(m::RecorderError),
}

impl std::fmt::Display for ExpositionError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ExpositionError::Bind { addr, source } => write!(f, "metrics address {addr}: {source}"),
            ExpositionError::LocalAddr(e) => write!(f, "{e}"),
            ExpositionError::Listener(e) => write!(f, "metrics listener: {e}"),
            ExpositionError::Recorder(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for ExpositionError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ExpositionError::Bind { source: e, .. }
            | ExpositionError::LocalAddr(e)
            | ExpositionError::Listener(e) => Some(e),
            // Transparent: its message is this one's.
            ExpositionError::Recorder(e) => std::error::Error::source(e),
        }
    }
}

impl From<m::RecorderError> for ExpositionError {
    fn from(e: m::RecorderError) -> Self {
        ExpositionError::Recorder(e)
    }
}

/// Binds `addr`, installs the metrics recorder ([`m::install_recorder`])
/// and serves `/metrics` (the recorder's series, then `store`'s) and
/// `/healthz` (per `ready`) there; returns the bound address. Call once,
/// inside a Tokio runtime.
pub fn start(
    addr: SocketAddr,
    store: Arc<Store>,
    ready: Readiness,
) -> Result<SocketAddr, ExpositionError> {
    let listener = std::net::TcpListener::bind(addr)
        .map_err(|source| ExpositionError::Bind { addr, source })?;
    let addr = listener.local_addr().map_err(ExpositionError::LocalAddr)?;
    listener
        .set_nonblocking(true)
        .map_err(ExpositionError::Listener)?;
    let listener =
        tokio::net::TcpListener::from_std(listener).map_err(ExpositionError::Listener)?;
    let handle = m::install_recorder()?;
    let upkeep = handle.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(UPKEEP);
        loop {
            tick.tick().await;
            upkeep.run_upkeep();
        }
    });
    let exposition = Arc::new(Exposition {
        handle,
        store,
        ready,
        render: tokio::sync::Mutex::new(()),
    });
    tokio::spawn(accept_loop(listener, exposition));
    Ok(addr)
}

impl Exposition {
    /// The whole `/metrics` page.
    fn render(&self) -> String {
        let mut out = self.handle.render();
        m::render_decisions(&mut out);
        render_store(Some(&self.store), Instant::now(), &mut out);
        out
    }
}

async fn accept_loop(listener: tokio::net::TcpListener, exposition: Arc<Exposition>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of descriptors and the like: back off, do not spin.
                tracing::warn!(error = %e, "metrics endpoint: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            continue;
        };
        let exposition = Arc::clone(&exposition);
        tokio::spawn(async move {
            let answer = move |req| answer(Arc::clone(&exposition), req);
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(TokioIo::new(stream), hyper::service::service_fn(answer));
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = tokio::time::sleep(CONNECTION_LIFETIME) => {
                    conn.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(DRAIN, conn).await;
                }
            }
            drop(slot);
        });
    }
}

async fn answer(
    exposition: Arc<Exposition>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let get = matches!(*req.method(), Method::GET | Method::HEAD);
    Ok(match req.uri().path() {
        "/metrics" if get => {
            let _one = exposition.render.lock().await;
            let page = Arc::clone(&exposition);
            match tokio::task::spawn_blocking(move || page.render()).await {
                Ok(body) => text(
                    StatusCode::OK,
                    "text/plain; version=0.0.4; charset=utf-8",
                    body,
                ),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    format!("render failed: {e}\n"),
                ),
            }
        }
        "/healthz" if get => {
            if exposition.ready.get() {
                text(StatusCode::OK, "text/plain", "ok\n".into())
            } else {
                text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    "not serving\n".into(),
                )
            }
        }
        "/metrics" | "/healthz" => {
            let mut r = text(
                StatusCode::METHOD_NOT_ALLOWED,
                "text/plain",
                "GET only\n".into(),
            );
            r.headers_mut()
                .insert(header::ALLOW, header::HeaderValue::from_static("GET, HEAD"));
            r
        }
        _ => text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found; try /metrics or /healthz\n".into(),
        ),
    })
}

fn text(status: StatusCode, content_type: &'static str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static(content_type),
    );
    r
}

/// Appends the store's series (families with HELP and TYPE even without
/// samples; no store renders as an empty one).
pub fn render_store(store: Option<&Store>, now: Instant, out: &mut String) {
    // One buffer per family, filled in one pass over the nodes.
    let mut fam: [String; m::STORE_RENDERED.len()] = Default::default();
    let (mut fresh, mut stale, mut claims) = (0usize, 0usize, 0usize);
    let nodes = store.map(|s| (s, s.nodes.all())).into_iter();
    for (store, n) in nodes.flat_map(|(s, ns)| ns.into_iter().map(move |n| (s, n))) {
        let n = &n;
        let snap = n.snapshot();
        if store.nodes.is_fresh(&snap, now) {
            fresh += 1;
        } else {
            stale += 1;
        }
        claims += snap.claims.iter().map(|(_, k)| *k as usize).sum::<usize>();
        let node = escape(&n.id);
        let (mut idle, mut running, mut sched_idle) = (0u64, 0u64, 0u64);
        let mut llc: BTreeMap<u32, (i64, i64)> = BTreeMap::new();
        for (i, c) in snap.state.cpus.iter().enumerate() {
            if !c.online {
                continue;
            }
            idle += c.available_idle() as u64;
            running += c.nr_running as u64;
            sched_idle += c.sched_idle_rq() as u64;
            let e = llc.entry(snap.topo.spec.cpus[i].llc).or_default();
            e.0 += c.util_avg as i64;
            e.1 += 1;
        }
        let _ = writeln!(fam[4], "{}{{node=\"{node}\"}} {idle}", m::NODE_IDLE_CPUS);
        let _ = writeln!(
            fam[5],
            "{}{{node=\"{node}\"}} {running}",
            m::NODE_NR_RUNNING
        );
        let _ = writeln!(
            fam[6],
            "{}{{node=\"{node}\"}} {sched_idle}",
            m::NODE_SCHED_IDLE_CPUS
        );
        for (l, (sum, k)) in llc {
            let _ = writeln!(
                fam[7],
                "{}{{node=\"{node}\",llc=\"{l}\"}} {}",
                m::NODE_LLC_UTIL,
                sum / k.max(1)
            );
        }
        if let Some(age) = snap.age(now) {
            let _ = writeln!(
                fam[8],
                "{}{{node=\"{node}\"}} {}",
                m::NODE_STATE_AGE,
                age.as_secs_f64()
            );
        }
        for (kind, count) in n.decisions() {
            if count > 0 {
                let _ = writeln!(
                    fam[9],
                    "{}{{node=\"{node}\",kind=\"{}\"}} {count}",
                    m::NODE_DECISIONS,
                    kind.as_str()
                );
            }
        }
        let _ = writeln!(
            fam[13],
            "{}{{node=\"{node}\",source=\"{}\"}} 1",
            m::NODE_SIGNAL_SOURCE,
            signal_source_label(n.signal_source.load(std::sync::atomic::Ordering::Relaxed))
        );
        // Only nodes that report runtime have cache-aware series.
        if let Some((procs, with, on)) = store.passes.cache_gauges(n) {
            let _ = writeln!(
                fam[10],
                "{}{{node=\"{node}\"}} {procs}",
                m::NODE_CACHE_PROCESSES
            );
            let _ = writeln!(
                fam[11],
                "{}{{node=\"{node}\"}} {with}",
                m::NODE_CACHE_TASKS_PREF
            );
            let _ = writeln!(
                fam[12],
                "{}{{node=\"{node}\"}} {on}",
                m::NODE_CACHE_TASKS_ON_PREF
            );
        }
    }
    let _ = writeln!(fam[0], "{}{{freshness=\"fresh\"}} {fresh}", m::NODES);
    let _ = writeln!(fam[0], "{}{{freshness=\"stale\"}} {stale}", m::NODES);
    let _ = writeln!(fam[1], "{} {claims}", m::CLAIMS_OUTSTANDING);
    let (leases, leased) = store.map_or((0, 0), |s| s.leases.leases_outstanding());
    let _ = writeln!(fam[2], "{} {leases}", m::LEASES_OUTSTANDING);
    let _ = writeln!(fam[3], "{} {leased}", m::CPUS_LEASED);
    for (name, samples) in m::STORE_RENDERED.iter().zip(&fam) {
        m::write_family(out, name, samples);
    }
}

/// The `source` label of [`m::NODE_SIGNAL_SOURCE`].
fn signal_source_label(source: i32) -> &'static str {
    use fairplace_proto::v1::SignalSource as S;
    match S::try_from(source) {
        Ok(S::Procfs) => "procfs",
        Ok(S::SchedDebug) => "sched_debug",
        Ok(S::Bpf) => "bpf",
        Ok(S::Simulated) => "simulated",
        Ok(S::Unspecified) | Err(_) => "unspecified",
    }
}

/// A label value in the exposition format: backslash, double quote and
/// line feed escaped.
pub fn escape(v: &str) -> std::borrow::Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return v.into();
    }
    let mut s = String::with_capacity(v.len() + 8);
    for c in v.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s.into()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::decision::Kind;
    use crate::engine::topology::{CpuTopo, TopologySpec};
    use crate::store::{StoreConfig, Update};

    fn spec(n: u32, llcs: u32) -> TopologySpec {
        TopologySpec {
            cpus: (0..n)
                .map(|i| CpuTopo {
                    core: i,
                    cluster: None,
                    llc: i % llcs,
                    node: 0,
                    capacity: 1024,
                })
                .collect(),
            numa_distance: None,
        }
    }

    fn full(n: u32) -> Update {
        Update {
            seq: 1,
            full: true,
            cpus: (0..n)
                .map(|i| (i, crate::engine::state::CpuState::idle(1024)))
                .collect(),
            ..Update::default()
        }
    }

    fn samples(text: &str) -> Vec<&str> {
        text.lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect()
    }

    #[test]
    fn label_values_are_escaped() {
        assert_eq!(escape("plain-node.1"), "plain-node.1");
        assert_eq!(escape(r#"a"b\c"#), r#"a\"b\\c"#);
        assert_eq!(escape("a\nb"), "a\\nb");
    }

    #[test]
    fn the_store_section_mirrors_the_nodes() {
        let store = Store::new(StoreConfig::default());
        let now = Instant::now();
        let mut empty = String::new();
        render_store(Some(&store), now, &mut empty);
        for name in m::STORE_RENDERED {
            assert!(empty.contains(&format!("# TYPE {name} ")), "{name}");
        }
        assert_eq!(
            samples(&empty),
            [
                "fairplace_nodes{freshness=\"fresh\"} 0",
                "fairplace_nodes{freshness=\"stale\"} 0",
                "fairplace_claims_outstanding 0",
                "fairplace_leases_outstanding 0",
                "fairplace_cpus_leased 0",
            ]
        );
        let (a, g) = store
            .nodes
            .register("a\"1", vec![], "t".into(), spec(4, 2))
            .unwrap();
        store.nodes.apply(&a, g, &full(4), now).unwrap();
        a.count_decision(Kind::Wakeup);
        a.count_decision(Kind::Wakeup);
        let (b, _) = store
            .nodes
            .register("b", vec![], "t".into(), spec(2, 1))
            .unwrap();
        b.signal_source.store(
            fairplace_proto::v1::SignalSource::SchedDebug as i32,
            std::sync::atomic::Ordering::Relaxed,
        );
        let mut text = String::new();
        render_store(Some(&store), now, &mut text);
        let s = samples(&text);
        for want in [
            "fairplace_nodes{freshness=\"fresh\"} 1",
            "fairplace_nodes{freshness=\"stale\"} 1",
            "fairplace_node_idle_cpus{node=\"a\\\"1\"} 4",
            "fairplace_node_llc_util{node=\"a\\\"1\",llc=\"1\"} 0",
            "fairplace_node_decisions_total{node=\"a\\\"1\",kind=\"wakeup\"} 2",
            "fairplace_node_idle_cpus{node=\"b\"} 2",
            "fairplace_node_signal_source{node=\"a\\\"1\",source=\"unspecified\"} 1",
            "fairplace_node_signal_source{node=\"b\",source=\"sched_debug\"} 1",
        ] {
            assert!(s.contains(&want), "{want} missing:\n{text}");
        }
        // Only a reported node has an age; b never reported.
        assert!(text.contains("fairplace_node_state_age_seconds{node=\"a\\\"1\"} 0"));
        assert!(!text.contains("fairplace_node_state_age_seconds{node=\"b\"}"));
        // A forgotten node's series are gone at once.
        store.nodes.forget_stale(now + Duration::from_secs(3600));
        let mut after = String::new();
        render_store(Some(&store), now, &mut after);
        assert!(!after.contains("node=\""), "{after}");
    }
}
