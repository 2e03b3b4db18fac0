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

/// A one-member etcd on free ports in a temporary directory.
pub struct Etcd {
    child: Child,
    dir: std::path::PathBuf,
    url: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A loopback port nobody listens on now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Starts the etcd (`etcd` on the PATH, or FAIRPLACE_ETCD) and gives it
/// two seconds to come up.
pub fn etcd() -> Etcd {
    let bin = std::env::var("FAIRPLACE_ETCD").unwrap_or_else(|_| "etcd".into());
    let dir = std::env::temp_dir().join(format!("fairplace-load-etcd-{}", std::process::id()));
    let (c, p) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{c}");
    let peer = format!("http://127.0.0.1:{p}");
    let child = Command::new(bin)
        .args(["--name", "e0", "--data-dir"])
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
        .args(["--initial-cluster", &format!("e0={peer}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start etcd (apt-get install etcd-server, or set FAIRPLACE_ETCD)");
    std::thread::sleep(Duration::from_secs(2));
    Etcd { child, dir, url }
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
