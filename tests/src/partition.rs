//! A network partition of the test's own: a TCP relay between one process
//! and a service (a replica and an etcd member) that the test can cut and
//! heal. Cut, it forwards nothing and answers nothing, in either direction,
//! on open connections and on new ones: what a dropped link or a firewall
//! that drops packets looks like to both ends (no reset, no FIN: calls hang
//! until their own timeouts). Healed, every connection held during the cut
//! is closed, as a peer that timed out would find it, and new connections
//! are relayed again.

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Link {
    /// Where the process connects instead of the service (`host:port`).
    pub addr: String,
    cut: watch::Sender<bool>,
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
        let upstream = upstream.to_string();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                tokio::spawn(relay(down, upstream.clone(), rx.clone()));
            }
        });
        Link { addr, cut, task }
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
async fn relay(mut down: TcpStream, upstream: String, mut cut: watch::Receiver<bool>) {
    if !*cut.borrow_and_update() {
        let Ok(mut up) = TcpStream::connect(&upstream).await else {
            return;
        };
        tokio::select! {
            _ = copy_bidirectional(&mut down, &mut up) => return,
            _ = cut.wait_for(|c| *c) => {}
        }
        // `up` is held too: the service sees a silent client.
        let _ = cut.wait_for(|c| !*c).await;
        drop(up);
        return;
    }
    let _ = cut.wait_for(|c| !*c).await;
}
