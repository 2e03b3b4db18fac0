//! The processes a fault run drives, and the faults it injects into them.
//!
//! With replicas: a three-member etcd, three `fairplace-server` replicas,
//! each reaching every etcd member through a link of the run's own (to cut
//! or slow), simulated nodes reaching each replica through links of their
//! own, and the real agent. Single server: one `fairplace-server` with its
//! lease store in redb, on a small tmpfs of its own when the run may mount
//! one (root), so the disk can fill.

use std::sync::Arc;
use std::time::Duration;

use super::record::Rng;
use crate::etcd::EtcdCluster;
use crate::partition::Link;
use crate::{Agent, Server, StateDir, free_port, send_signal};

/// The fault kinds of each mode.
pub const REPLICA_FAULTS: &[&str] = &[
    "kill_replica",
    "stop_replica",
    "stop_etcd_member",
    "stop_etcd_majority",
    "cut_replica_etcd",
    "cut_agent",
    "slow_etcd",
    "skew_clock",
];
pub const SINGLE_FAULTS: &[&str] = &[
    "kill_server",
    "stop_server",
    "cut_agent",
    "full_disk",
    "skew_clock",
];

/// The etcd lease TTL of the replicas (s).
const TTL_S: &str = "2";
/// The tmpfs mounts the rigs of this process made: a run stopped by a
/// signal unmounts them before it ends ([`unmount_all`]).
static MOUNTS: std::sync::Mutex<Vec<std::path::PathBuf>> = std::sync::Mutex::new(Vec::new());

/// Unmounts every tmpfs a rig of this process mounted.
pub fn unmount_all() {
    let mut m = MOUNTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for dir in m.drain(..) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&dir)
            .status();
    }
}

/// Where Debian's libfaketime is.
pub const FAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

pub struct Rig {
    pub etcd: Option<EtcdCluster>,
    /// Each replica's links to the etcd members.
    etcd_links: Vec<Vec<Link>>,
    /// Each server's gRPC address.
    pub addrs: Vec<String>,
    servers: Vec<Option<Server>>,
    /// Each simulated node's links to the servers.
    pub node_links: Vec<Vec<Arc<Link>>>,
    state: Option<StateDir>,
    /// The tmpfs the single server's store lives on, when mounted.
    tmpfs: bool,
    _real: Option<Agent>,
}

impl Rig {
    /// Three replicas on a three-member etcd (`etcd`: the binary), or one
    /// server on redb; `nodes` simulated nodes' links.
    pub async fn start(etcd: Option<&str>, nodes: usize) -> Rig {
        let mut rig = Rig {
            etcd: None,
            etcd_links: Vec::new(),
            addrs: Vec::new(),
            servers: Vec::new(),
            node_links: Vec::new(),
            state: None,
            tmpfs: false,
            _real: None,
        };
        match etcd {
            Some(bin) => rig.start_replicas(bin).await,
            None => rig.start_single(),
        }
        for _ in 0..nodes {
            let mut links = Vec::new();
            for a in &rig.addrs {
                links.push(Arc::new(Link::open(a).await));
            }
            rig.node_links.push(links);
        }
        rig._real = Some(Agent::start(
            &rig.addrs.join(","),
            &[
                "--node-id",
                "real",
                "--interval-ms",
                "300",
                "--label",
                "zone=z1",
            ],
        ));
        rig
    }

    async fn start_replicas(&mut self, bin: &str) {
        let etcd = EtcdCluster::start(bin, 3);
        etcd.wait_healthy(Duration::from_secs(30)).await;
        for _ in 0..3 {
            let mut links = Vec::new();
            for m in etcd.client_addrs() {
                links.push(Link::open(&m).await);
            }
            self.etcd_links.push(links);
            self.addrs.push(format!("127.0.0.1:{}", free_port()));
        }
        self.etcd = Some(etcd);
        for i in 0..3 {
            let s = self.spawn(i, None);
            self.servers.push(Some(s));
        }
    }

    fn start_single(&mut self) {
        let dir = StateDir::new("faults-redb");
        // A small disk of its own that can fill up; without the right to
        // mount one, the full-disk fault is left out (and said so).
        self.tmpfs = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs", dir.path()])
            .status()
            .is_ok_and(|s| s.success());
        if self.tmpfs {
            MOUNTS
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(dir.0.clone());
        }
        self.addrs.push(format!("127.0.0.1:{}", free_port()));
        self.state = Some(dir);
        let s = self.spawn(0, None);
        self.servers.push(Some(s));
    }

    /// The fault kinds this rig can inject.
    pub fn kinds(&self) -> Vec<&'static str> {
        let all = if self.etcd.is_some() {
            REPLICA_FAULTS
        } else {
            SINGLE_FAULTS
        };
        all.iter()
            .copied()
            .filter(|k| *k != "full_disk" || self.tmpfs)
            .filter(|k| *k != "skew_clock" || std::path::Path::new(FAKETIME).exists())
            .collect()
    }

    /// Server `i`, its wall clock moved by `skew_s` seconds when given
    /// (libfaketime; its monotonic clock is left alone).
    fn spawn(&self, i: usize, skew_s: Option<i64>) -> Server {
        let faketime = skew_s.map(|s| format!("{s:+}s"));
        let env: Vec<(&str, &str)> = match &faketime {
            Some(f) => vec![
                ("LD_PRELOAD", FAKETIME),
                ("FAKETIME", f.as_str()),
                ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
            ],
            None => Vec::new(),
        };
        let Some(state) = &self.state else {
            let eps = self.etcd_links[i]
                .iter()
                .map(|l| format!("http://{}", l.addr))
                .collect::<Vec<_>>()
                .join(",");
            let id = format!("r{i}");
            let args = [
                "--grpc-addr",
                &self.addrs[i],
                "--etcd-endpoints",
                &eps,
                "--replica-id",
                &id,
                "--etcd-lease-ttl-s",
                TTL_S,
                "--stale-after-ms",
                "3000",
            ];
            return Server::start_env(&args, &env);
        };
        let args = [
            "--grpc-addr",
            &self.addrs[i],
            "--state-dir",
            state.path(),
            "--stale-after-ms",
            "3000",
        ];
        Server::start_env(&args, &env)
    }

    fn pid(&self, i: usize) -> Option<u32> {
        self.servers[i].as_ref().map(Server::pid)
    }

    /// Injects one fault of `kind`, holds it, and heals it (a skewed
    /// clock stays until the server is restarted by a later fault).
    /// Returns what was done, for the log.
    pub async fn inject(&mut self, kind: &str, rng: &mut Rng) -> String {
        let n = self.servers.len() as u64;
        let i = rng.below(n) as usize;
        match kind {
            "kill_replica" | "kill_server" => {
                self.servers[i] = None; // SIGKILL and reap
                let down = rng.ms(300, 2_000);
                tokio::time::sleep(down).await;
                self.servers[i] = Some(self.spawn(i, None));
                format!("server {i} killed -9, back after {down:?}")
            }
            "stop_replica" | "stop_server" => {
                let d = rng.ms(1_000, 4_000);
                self.hold_stopped(self.pid(i).into_iter().collect(), d)
                    .await;
                format!("server {i} stopped {d:?}")
            }
            "stop_etcd_member" | "stop_etcd_majority" => {
                let etcd = self.etcd.as_ref().expect("etcd");
                let first = rng.below(3) as usize;
                let count = if kind == "stop_etcd_member" { 1 } else { 2 };
                let pids = (0..count)
                    .filter_map(|k| etcd.pid((first + k) % 3))
                    .collect();
                let d = rng.ms(1_000, 3_000);
                self.hold_stopped(pids, d).await;
                format!("{count} etcd member(s) from {first} stopped {d:?}")
            }
            "cut_replica_etcd" => {
                let d = rng.ms(1_000, 4_000);
                self.etcd_links[i].iter().for_each(Link::cut);
                tokio::time::sleep(d).await;
                self.etcd_links[i].iter().for_each(Link::heal);
                format!("replica {i} cut from etcd {d:?}")
            }
            "slow_etcd" => {
                let delay = rng.ms(100, 800);
                let d = rng.ms(2_000, 5_000);
                self.etcd_links[i].iter().for_each(|l| l.slow(delay));
                tokio::time::sleep(d).await;
                self.etcd_links[i]
                    .iter()
                    .for_each(|l| l.slow(Duration::ZERO));
                format!("replica {i}'s etcd slowed by {delay:?} for {d:?}")
            }
            "cut_agent" => {
                let a = rng.below(self.node_links.len() as u64) as usize;
                let d = rng.ms(1_000, 3_000);
                self.node_links[a].iter().for_each(|l| l.cut());
                tokio::time::sleep(d).await;
                self.node_links[a].iter().for_each(|l| l.heal());
                format!("node {a} cut from the servers {d:?}")
            }
            "skew_clock" => {
                let s = (3 + rng.below(13)) as i64 * if rng.below(2) == 0 { 1 } else { -1 };
                self.servers[i] = None;
                self.servers[i] = Some(self.spawn(i, Some(s)));
                format!("server {i} restarted with its wall clock {s:+} s off")
            }
            "full_disk" => self.fill_disk(rng).await,
            other => format!("unknown fault kind {other}: nothing done"),
        }
    }

    /// SIGSTOP to `pids` for `d`, then SIGCONT.
    async fn hold_stopped(&self, pids: Vec<u32>, d: Duration) {
        for &p in &pids {
            send_signal(p, libc::SIGSTOP);
        }
        tokio::time::sleep(d).await;
        for &p in &pids {
            send_signal(p, libc::SIGCONT);
        }
    }

    /// Fills the single server's tmpfs for a while, then frees it.
    async fn fill_disk(&self, rng: &mut Rng) -> String {
        let Some(state) = &self.state else {
            return "no store directory".into();
        };
        let filler = state.0.join("filler");
        let wrote = fill(&filler);
        let d = rng.ms(1_000, 3_000);
        tokio::time::sleep(d).await;
        let _ = std::fs::remove_file(&filler);
        format!("store's disk full ({wrote} bytes of filler) for {d:?}")
    }

    /// Every stopped process continued, every link healed: the end of a run.
    pub fn heal_all(&self) {
        for i in 0..self.servers.len() {
            if let Some(p) = self.pid(i) {
                send_signal(p, libc::SIGCONT);
            }
        }
        if let Some(e) = &self.etcd {
            (0..e.len())
                .filter_map(|m| e.pid(m))
                .for_each(|p| send_signal(p, libc::SIGCONT));
        }
        for l in self.etcd_links.iter().flatten() {
            l.heal();
            l.slow(Duration::ZERO);
        }
        self.node_links.iter().flatten().for_each(|l| l.heal());
    }
}

/// Writes zeros to `path` until the disk is full; the bytes written.
fn fill(path: &std::path::Path) -> u64 {
    use std::io::Write;
    let Ok(mut f) = std::fs::File::create(path) else {
        return 0;
    };
    let chunk = vec![0u8; 64 * 1024];
    let mut n = 0u64;
    // Bounded: the tmpfs is 8 MiB; a disk that never fills stops at 64 MiB.
    while n < 64 << 20 {
        match f.write(&chunk) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k as u64,
        }
    }
    let _ = f.sync_all();
    n
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.heal_all();
        self.servers.clear();
        if self.tmpfs
            && let Some(s) = &self.state
        {
            let _ = std::process::Command::new("umount")
                .args(["-l", s.path()])
                .status();
            MOUNTS
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .retain(|d| d != &s.0);
        }
    }
}
