//! The gRPC port's accept loop: connections reach tonic only once they have
//! proved themselves, and accept errors never spin.
//!
//! - A connection is screened before tonic sees it: a plaintext one must send
//!   the HTTP/2 client preface (a TLS one must finish its handshake) within
//!   `screen_timeout`, else it is closed. An idle TCP connection would
//!   otherwise hold a socket and a hyper task forever.
//! - At most `max_screening` connections are screened at once; beyond that,
//!   new ones are closed at once (their peers retry), so a flood of silent
//!   connections costs bounded memory.
//! - An accept error (EMFILE, ENFILE, ENOBUFS: out of descriptors or memory)
//!   backs off, from 5 ms doubling to 1 s, and is logged once per 10 s with a
//!   count, instead of retrying in a busy loop that logs every attempt.
//! - Connections are capped in total and per peer address, from accept to
//!   close (screening included): one client cannot hold every socket and
//!   the HTTP/2 state behind them. A connection over a cap is closed at
//!   once and counted by the cap it hit.
//! - The loop ends when tonic stops taking connections (shutdown).

use std::collections::HashMap;
use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

use crate::metrics as m;

/// The HTTP/2 client connection preface (RFC 9113 section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How the accept loop treats new connections.
#[derive(Debug, Clone, Copy)]
pub struct ListenOpts {
    /// Time a new connection has to send its preface (or finish TLS).
    pub screen_timeout: Duration,
    /// Connections screened at once.
    pub max_screening: usize,
    /// Connections open at once, screening included.
    pub max_connections: usize,
    /// Connections open at once from one peer address.
    pub max_connections_per_peer: usize,
}

impl Default for ListenOpts {
    fn default() -> Self {
        Self {
            screen_timeout: Duration::from_secs(10),
            max_screening: 4096,
            // An agent holds one connection: room for the default node
            // limit's worth of agents and their orchestrators.
            max_connections: 16_384,
            // Enough for a load generator or a proxy, far from what it
            // takes to exhaust the server (each connection's HTTP/2 state
            // is bounded by max_concurrent_streams and the windows).
            max_connections_per_peer: 512,
        }
    }
}

/// The connections open on one listener, in total and per peer address.
struct ConnLimits {
    total: Arc<Semaphore>,
    per_peer: Mutex<HashMap<IpAddr, usize>>,
    max_per_peer: usize,
}

impl ConnLimits {
    fn new(opts: &ListenOpts) -> Arc<Self> {
        Arc::new(Self {
            total: Arc::new(Semaphore::new(opts.max_connections.max(1))),
            per_peer: Mutex::new(HashMap::new()),
            max_per_peer: opts.max_connections_per_peer.max(1),
        })
    }

    /// A slot for a new connection from `peer`, or the cap it hits.
    fn admit(self: &Arc<Self>, peer: IpAddr) -> Result<ConnSlot, &'static str> {
        let Ok(total) = Arc::clone(&self.total).try_acquire_owned() else {
            return Err("total");
        };
        let mut per_peer = self.per_peer.lock().unwrap_or_else(|e| e.into_inner());
        let n = per_peer.entry(peer).or_insert(0);
        if *n >= self.max_per_peer {
            return Err("per_peer");
        }
        *n += 1;
        metrics::gauge!(m::CONNECTIONS_OPEN).increment(1.0);
        Ok(ConnSlot {
            limits: Arc::clone(self),
            peer,
            _total: total,
        })
    }
}

/// One admitted connection's place under the caps, given back on drop.
struct ConnSlot {
    limits: Arc<ConnLimits>,
    peer: IpAddr,
    _total: OwnedSemaphorePermit,
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        metrics::gauge!(m::CONNECTIONS_OPEN).decrement(1.0);
        let mut per_peer = self
            .limits
            .per_peer
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = per_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                per_peer.remove(&self.peer);
            }
        }
    }
}

/// A screened connection: its stream, what tonic tells each request about
/// it (the client's address, or its TLS identity), and its slot under the
/// caps, held until tonic drops it.
pub struct Conn<S, I> {
    stream: S,
    info: I,
    _slot: ConnSlot,
}

impl<S, I: Clone + Send + Sync + 'static> Connected for Conn<S, I> {
    type ConnectInfo = I;

    fn connect_info(&self) -> I {
        self.info.clone()
    }
}

impl<S: AsyncRead + Unpin, I: Unpin> AsyncRead for Conn<S, I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin, I: Unpin> AsyncWrite for Conn<S, I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

fn refused(limit: &'static str) {
    metrics::counter!(m::CONNECTIONS_REFUSED, "limit" => limit).increment(1);
}

/// Accepts connections on `listener` and yields those that `screen` passes
/// within the timeout (it returns the stream and what requests are told of
/// the connection), screening them concurrently, each holding its place
/// under the connection caps until it closes.
pub fn incoming<S, I, F, Fut>(
    listener: TcpListener,
    opts: ListenOpts,
    screen: F,
) -> ReceiverStream<io::Result<Conn<S, I>>>
where
    S: Send + 'static,
    I: Send + 'static,
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = io::Result<(S, I)>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(listener, opts, screen, tx));
    ReceiverStream::new(rx)
}

/// Plaintext screening: the peer's first bytes must be the HTTP/2 preface.
/// The bytes are only peeked, so hyper still reads them.
pub async fn http2_preface(s: TcpStream) -> io::Result<(TcpStream, TcpConnectInfo)> {
    let mut buf = [0u8; PREFACE.len()];
    loop {
        s.readable().await?;
        let n = s.peek(&mut buf).await?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        if buf[..n] != PREFACE[..n] {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not an HTTP/2 client preface",
            ));
        }
        if n == PREFACE.len() {
            let info = s.connect_info();
            return Ok((s, info));
        }
        // Part of the preface is here: peek again shortly (readable() stays
        // ready while those bytes are unread).
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn accept_loop<S, I, F, Fut>(
    listener: TcpListener,
    opts: ListenOpts,
    screen: F,
    tx: mpsc::Sender<io::Result<Conn<S, I>>>,
) where
    S: Send + 'static,
    I: Send + 'static,
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = io::Result<(S, I)>> + Send + 'static,
{
    let screening = Arc::new(Semaphore::new(opts.max_screening.max(1)));
    let limits = ConnLimits::new(&opts);
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = tx.closed() => return,
        };
        let (stream, peer) = match accepted {
            Ok((s, peer)) => {
                backoff.reset();
                (s, peer)
            }
            Err(e) => {
                backoff.failed(&e).await;
                continue;
            }
        };
        let slot = match limits.admit(peer.ip()) {
            Ok(slot) => slot,
            Err(limit) => {
                // Over a cap: closed at once, before any work is done for it.
                refused(limit);
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&screening).try_acquire_owned() else {
            // Too many connections still proving themselves: close this one.
            refused("screening");
            continue;
        };
        let _ = stream.set_nodelay(true);
        let fut = screen(stream);
        let tx = tx.clone();
        let timeout = opts.screen_timeout;
        tokio::spawn(async move {
            let r = tokio::time::timeout(timeout, fut).await;
            drop(permit);
            if let Ok(Ok((stream, info))) = r {
                let conn = Conn {
                    stream,
                    info,
                    _slot: slot,
                };
                let _ = tx.send(Ok(conn)).await;
            }
        });
    }
}

/// Exponential backoff after accept errors, with a rate-limited log line.
struct AcceptBackoff {
    delay: Duration,
    failures: u64,
    last_log: Option<Instant>,
}

impl Default for AcceptBackoff {
    fn default() -> Self {
        Self {
            delay: Duration::from_millis(5),
            failures: 0,
            last_log: None,
        }
    }
}

impl AcceptBackoff {
    const MAX: Duration = Duration::from_secs(1);
    const LOG_EVERY: Duration = Duration::from_secs(10);

    fn reset(&mut self) {
        self.delay = Duration::from_millis(5);
    }

    async fn failed(&mut self, e: &io::Error) {
        self.failures += 1;
        let now = Instant::now();
        if self
            .last_log
            .is_none_or(|t| now.duration_since(t) >= Self::LOG_EVERY)
        {
            tracing::warn!(
                error = %e,
                failures = self.failures,
                "accept failed; backing off (logged at most once per 10 s)"
            );
            self.last_log = Some(now);
            self.failures = 0;
        }
        tokio::time::sleep(self.delay).await;
        self.delay = (self.delay * 2).min(Self::MAX);
    }
}
