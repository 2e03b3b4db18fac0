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
//! - The loop ends when tonic stops taking connections (shutdown).

use std::io;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;

/// The HTTP/2 client connection preface (RFC 9113 section 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// How the accept loop treats new connections.
#[derive(Debug, Clone, Copy)]
pub struct ListenOpts {
    /// Time a new connection has to send its preface (or finish TLS).
    pub screen_timeout: Duration,
    /// Connections screened at once.
    pub max_screening: usize,
}

impl Default for ListenOpts {
    fn default() -> Self {
        Self {
            screen_timeout: Duration::from_secs(10),
            max_screening: 4096,
        }
    }
}

/// Accepts connections on `listener` and yields those that `screen` passes
/// within the timeout, screening them concurrently.
pub fn incoming<T, F, Fut>(
    listener: TcpListener,
    opts: ListenOpts,
    screen: F,
) -> ReceiverStream<io::Result<T>>
where
    T: Send + 'static,
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = io::Result<T>> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(accept_loop(listener, opts, screen, tx));
    ReceiverStream::new(rx)
}

/// Plaintext screening: the peer's first bytes must be the HTTP/2 preface.
/// The bytes are only peeked, so hyper still reads them.
pub async fn http2_preface(s: TcpStream) -> io::Result<TcpStream> {
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
            return Ok(s);
        }
        // Part of the preface is here: peek again shortly (readable() stays
        // ready while those bytes are unread).
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn accept_loop<T, F, Fut>(
    listener: TcpListener,
    opts: ListenOpts,
    screen: F,
    tx: mpsc::Sender<io::Result<T>>,
) where
    T: Send + 'static,
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = io::Result<T>> + Send + 'static,
{
    let screening = std::sync::Arc::new(Semaphore::new(opts.max_screening.max(1)));
    let mut backoff = AcceptBackoff::default();
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = tx.closed() => return,
        };
        let stream = match accepted {
            Ok((s, _)) => {
                backoff.reset();
                s
            }
            Err(e) => {
                backoff.failed(&e).await;
                continue;
            }
        };
        let Ok(permit) = std::sync::Arc::clone(&screening).try_acquire_owned() else {
            // Too many connections still proving themselves: close this one.
            continue;
        };
        let _ = stream.set_nodelay(true);
        let fut = screen(stream);
        let tx = tx.clone();
        let timeout = opts.screen_timeout;
        tokio::spawn(async move {
            let r = tokio::time::timeout(timeout, fut).await;
            drop(permit);
            if let Ok(Ok(conn)) = r {
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
