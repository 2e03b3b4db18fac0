//! The etcd that replicated runs need, and the replicas on it: a
//! one-member etcd on free loopback ports in a temporary directory, and
//! `fairplace-server` replicas joined to it.
//!
//! `replicas`, `leases` (its etcd lease store) and `memory --replicas`
//! measure a server that shares its state through etcd; they start the
//! same etcd the same way, so their figures are of one setup.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::shared::Server;

/// An etcd of one or more members on free loopback ports, each in a
/// temporary directory.
pub struct Etcd {
    children: Vec<Child>,
    dirs: Vec<std::path::PathBuf>,
    /// The client URLs, comma-separated (`--etcd-endpoints`).
    url: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for d in &self.dirs {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Starts a one-member etcd (`etcd` on the PATH, or FAIRPLACE_ETCD) and
/// gives it two seconds to come up.
pub fn etcd() -> Etcd {
    etcd_cluster(1)
}

/// Starts an etcd of `n` members on loopback and gives it a few seconds
/// to elect a leader.
pub fn etcd_cluster(n: usize) -> Etcd {
    let bin = std::env::var("FAIRPLACE_ETCD").unwrap_or_else(|_| "etcd".into());
    let ports: Vec<(u16, u16)> = (0..n).map(|_| (free_port(), free_port())).collect();
    let initial: Vec<String> = ports
        .iter()
        .enumerate()
        .map(|(i, (_, p))| format!("e{i}=http://127.0.0.1:{p}"))
        .collect();
    let mut e = Etcd {
        children: Vec::new(),
        dirs: Vec::new(),
        url: String::new(),
    };
    let mut urls = Vec::new();
    for (i, (c, p)) in ports.iter().enumerate() {
        let dir =
            std::env::temp_dir().join(format!("fairplace-load-etcd-{}-{i}", std::process::id()));
        let url = format!("http://127.0.0.1:{c}");
        let peer = format!("http://127.0.0.1:{p}");
        let child = Command::new(&bin)
            .args(["--name", &format!("e{i}"), "--data-dir"])
            .arg(&dir)
            .args([
                "--listen-client-urls",
                &url,
                "--advertise-client-urls",
                &url,
            ])
            .args([
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
            ])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", "new"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start etcd (apt-get install etcd-server, or set FAIRPLACE_ETCD)");
        e.children.push(child);
        e.dirs.push(dir);
        urls.push(url);
    }
    e.url = urls.join(",");
    std::thread::sleep(Duration::from_secs(if n > 1 { 4 } else { 2 }));
    e
}

/// A replica `id` of this build's server on `etcd`.
pub fn replica(cpus: &str, threads: usize, etcd: &Etcd, id: &str) -> Server {
    let exe = std::env::current_exe().expect("own path");
    replica_bin(
        &exe.with_file_name("fairplace-server"),
        cpus,
        threads,
        etcd,
        id,
    )
}

/// [`replica`] of the server binary `bin`.
pub fn replica_bin(
    bin: &std::path::Path,
    cpus: &str,
    threads: usize,
    etcd: &Etcd,
    id: &str,
) -> Server {
    let addr = format!("127.0.0.1:{}", free_port());
    Server::start_bin(
        bin,
        cpus,
        threads,
        &[
            "--grpc-addr".into(),
            addr,
            "--etcd-endpoints".into(),
            etcd.url.clone(),
            "--replica-id".into(),
            id.into(),
            // Registrations (topology builds) wait rather than shed.
            "--heavy-queue".into(),
            "256".into(),
        ],
    )
}
