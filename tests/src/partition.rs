//! A network partition of the test's own: a TCP relay between one process
//! and a service (a replica and an etcd member) that the test can cut and
//! heal. Cut, it forwards nothing and answers nothing, in either direction,
//! on open connections and on new ones: what a dropped link or a firewall
//! that drops packets looks like to both ends (no reset, no FIN: calls hang
//! until their own timeouts). Healed, every connection held during the cut
//! is closed, as a peer that timed out would find it, and new connections
//! are relayed again. Slowed ([`Link::slow`]), every chunk read is held
//! that long before it is passed on, both ways: a slow disk or a congested
//! network, as the process sees it.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Link {
    /// Where the process connects instead of the service (`host:port`).
    pub addr: String,
    cut: watch::Sender<bool>,
    delay: watch::Sender<Duration>,
    task: tokio::task::JoinHandle<()>,
}

impl Link {
    /// A link to `upstream` (`host:port`), open; runs on the current
    /// tokio runtime.
    pub async fn open(upstream: &str) -> Link {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a relay");
        let addr = listener.local_addr().unwrap().to_string();
        let (cut, rx) = watch::channel(false);
        let (delay, slow) = watch::channel(Duration::ZERO);
        let upstream = upstream.to_string();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                tokio::spawn(relay(down, upstream.clone(), rx.clone(), slow.clone()));
            }
        });
        Link {
            addr,
            cut,
            delay,
            task,
        }
    }

    /// Holds every chunk `d` before passing it on (zero: at once).
    pub fn slow(&self, d: Duration) {
        self.delay.send_replace(d);
    }

    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One connection: relayed while the link is up; held silent from a cut
/// until the heal, then closed.
async fn relay(
    down: TcpStream,
    upstream: String,
    mut cut: watch::Receiver<bool>,
    slow: watch::Receiver<Duration>,
) {
    if !*cut.borrow_and_update() {
        let Ok(up) = TcpStream::connect(&upstream).await else {
            return;
        };
        let (down_r, down_w) = down.into_split();
        let (up_r, up_w) = up.into_split();
        let both =
            async { tokio::join!(pipe(down_r, up_w, slow.clone()), pipe(up_r, down_w, slow)) };
        tokio::select! {
            _ = both => return,
            _ = cut.wait_for(|c| *c) => {}
        }
        // Both halves were dropped with the select: held silent, the
        // service sees a client that stopped answering only once the link
        // heals and the connection closes.
        let _ = cut.wait_for(|c| !*c).await;
        return;
    }
    let _ = cut.wait_for(|c| !*c).await;
}

/// One direction of a connection, each chunk held for the link's delay.
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    slow: watch::Receiver<Duration>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let d = *slow.borrow();
        if !d.is_zero() {
            tokio::time::sleep(d).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
