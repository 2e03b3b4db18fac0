//! A real etcd cluster for the replica tests: Debian's `etcd` binary
//! (package `etcd-server`), members on loopback with free ports and data
//! directories of their own, killed when dropped.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fairplace::replica::etcd::{Etcd, EtcdSettings};

use crate::{StateDir, free_port, send_signal};

/// The etcd binary, if installed: `FAIRPLACE_ETCD` or `etcd` on the PATH.
pub fn etcd_binary() -> Option<String> {
    if let Ok(p) = std::env::var("FAIRPLACE_ETCD") {
        return Some(p);
    }
    let ok = Command::new("etcd")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    ok.then(|| "etcd".to_string())
}

/// The etcd binary, or `None` after saying why the test does not run.
/// With `FAIRPLACE_REQUIRE_ETCD=1` (CI) a missing etcd fails the test.
pub fn etcd_or_skip(test: &str) -> Option<String> {
    match etcd_binary() {
        Some(b) => Some(b),
        None if std::env::var("FAIRPLACE_REQUIRE_ETCD").as_deref() == Ok("1") => {
            panic!("{test}: etcd is required (FAIRPLACE_REQUIRE_ETCD=1) but not installed")
        }
        None => {
            eprintln!(
                "{test}: SKIPPED: no etcd binary (apt-get install etcd-server, or set FAIRPLACE_ETCD)"
            );
            None
        }
    }
}

struct Member {
    name: String,
    client: u16,
    peer: u16,
    child: Option<Child>,
}

/// TLS on the members' client port, with client certificates required
/// (`--client-cert-auth`), and the client certificate the test's own
/// client presents.
#[derive(Debug, Clone)]
pub struct EtcdTls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

/// A running etcd cluster.
pub struct EtcdCluster {
    bin: String,
    members: Vec<Member>,
    dir: StateDir,
    tls: Option<EtcdTls>,
}

impl EtcdCluster {
    /// `n` members, started (wait for them with [`EtcdCluster::wait_healthy`]).
    pub fn start(bin: &str, n: usize) -> EtcdCluster {
        EtcdCluster::start_with(bin, n, None)
    }

    /// `n` members serving their clients over TLS with `tls`.
    pub fn start_tls(bin: &str, n: usize, tls: EtcdTls) -> EtcdCluster {
        EtcdCluster::start_with(bin, n, Some(tls))
    }

    fn start_with(bin: &str, n: usize, tls: Option<EtcdTls>) -> EtcdCluster {
        let dir = StateDir::new("etcd");
        let members: Vec<Member> = (0..n)
            .map(|i| Member {
                name: format!("e{i}"),
                client: free_port(),
                peer: free_port(),
                child: None,
            })
            .collect();
        let mut c = EtcdCluster {
            bin: bin.to_string(),
            members,
            dir,
            tls,
        };
        for i in 0..n {
            c.spawn(i);
        }
        c
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn spawn(&mut self, i: usize) {
        let ic = self.initial_cluster();
        let m = &mut self.members[i];
        let data = format!("{}/{}", self.dir.path(), m.name);
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let client = format!("{scheme}://127.0.0.1:{}", m.client);
        let peer = format!("http://127.0.0.1:{}", m.peer);
        let mut cmd = Command::new(&self.bin);
        if let Some(t) = &self.tls {
            cmd.arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&t.ca)
                .arg("--cert-file")
                .arg(&t.cert)
                .arg("--key-file")
                .arg(&t.key);
        }
        let child = cmd
            .args(["--name", &m.name, "--data-dir", &data])
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &ic])
            .args(["--initial-cluster-state", "new"])
            .args(["--heartbeat-interval", "100", "--election-timeout", "1000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd");
        m.child = Some(child);
    }

    /// The client URLs, comma-separated, for `--etcd-endpoints`.
    pub fn endpoints(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let scheme = if self.tls.is_some() { "https" } else { "http" };
                format!("{scheme}://127.0.0.1:{}", m.client)
            })
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Each member's client address (`host:port`).
    pub fn client_addrs(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("127.0.0.1:{}", m.client))
            .collect()
    }

    /// Member `i`'s process id, while it runs.
    pub fn pid(&self, i: usize) -> Option<u32> {
        self.members[i].child.as_ref().map(Child::id)
    }

    /// How many members the cluster has.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// SIGKILL to member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            send_signal(c.id(), 9);
            let _ = c.wait();
        }
    }

    /// Starts member `i` again on its data directory.
    pub fn restart(&mut self, i: usize) {
        if self.members[i].child.is_none() {
            self.spawn(i);
        }
    }

    /// A client of the cluster (fairplace's own).
    pub fn client(&self) -> Etcd {
        Etcd::connect(&EtcdSettings {
            endpoints: self.endpoints().split(',').map(str::to_string).collect(),
            prefix: "/".into(),
            ca: self.tls.as_ref().map(|t| t.ca.clone()),
            cert: self.tls.as_ref().map(|t| t.client_cert.clone()),
            key: self.tls.as_ref().map(|t| t.client_key.clone()),
        })
        .expect("etcd client")
    }

    /// Waits until a write commits (a quorum answers).
    pub async fn wait_healthy(&self, limit: Duration) {
        let t0 = Instant::now();
        while !self.put_works().await {
            assert!(t0.elapsed() < limit, "etcd did not become healthy");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A write commits within two seconds (a quorum is up).
    pub async fn put_works(&self) -> bool {
        let put = fairplace::replica::etcd::put(b"/health".to_vec(), b"1".to_vec(), 0);
        let c = self.client();
        matches!(
            tokio::time::timeout(Duration::from_secs(2), c.txn(vec![], vec![put], vec![])).await,
            Ok(Ok(r)) if r.succeeded
        )
    }

    /// Every key under `prefix` with its value.
    pub async fn range_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        let (kvs, _) = self
            .client()
            .range_prefix(prefix.as_bytes())
            .await
            .expect("etcd range read");
        kvs.into_iter()
            .map(|kv| {
                (
                    String::from_utf8_lossy(&kv.key).into_owned(),
                    String::from_utf8_lossy(&kv.value).into_owned(),
                )
            })
            .collect()
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.kill(i);
        }
    }
}
