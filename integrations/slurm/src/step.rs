//! A step's leases on this node, held by its slurmstepd: taken as each task
//! is forked, renewed while the tasks run, released as each task exits.
//!
//! Slurm 22.05 binds a task from slurmstepd, on the forked task's pid,
//! after the fork and before `slurm_spank_task_post_fork`; the task waits
//! for slurmstepd to have run post_fork for every task before it executes.
//! So post_fork is where a lease can replace Slurm's binding and be sure
//! to stay: the lease is asked for there and the task's pid bound to it.
//!
//! One thread of slurmstepd, with a runtime and one connection of its own,
//! makes every call: the task's lease at post_fork (the callback waits for
//! its answer, at most the timeout), renewals every third of the TTL, and
//! the release at the task's exit. It owns the step's leases, so nothing
//! is shared but the command channel. A task whose lease call had no answer
//! in time is `Unknown`: at its exit the same request (same request id) is
//! made again, which answers with the lease if one was granted, and that
//! lease is released. A slurmstepd killed with -9 renews nothing more: its
//! leases end at their TTL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fairplace_client::{Client, pb};
use tokio::sync::mpsc;
use tonic::Code;

use crate::config::Config;
use crate::ffi::{Level, log};
use crate::task::{Ask, Failure};

/// A task's lease as the step holds it.
enum Held {
    Leased {
        id: u64,
    },
    /// The call's outcome is unknown: a lease may exist under the request
    /// id of this ask.
    Unknown(Box<Ask>),
}

enum Cmd {
    /// Lease for a forked task: the answer goes back on `reply`.
    Place {
        ask: Box<Ask>,
        reply: std_mpsc::Sender<Result<pb::AllocateCpusResponse, Failure>>,
    },
    /// The task was bound to its lease, or not (and the lease is given
    /// back).
    Bound { task: u32, kept: bool },
    /// Task `task` exited: release its lease, then say so.
    Release {
        task: u32,
        done: std_mpsc::Sender<()>,
    },
    /// The step ends: release what is left, then stop.
    Stop { done: std_mpsc::Sender<()> },
}

/// One step's leases in slurmstepd.
pub struct Step {
    cfg: Arc<Config>,
    tx: Mutex<Option<mpsc::UnboundedSender<Cmd>>>,
    /// Set once a call found the server slower than the timeout: the
    /// step's later tasks keep Slurm's binding at once, so a step's start
    /// waits for the server at most about once.
    slow: AtomicBool,
}

impl Step {
    pub fn new(cfg: Arc<Config>) -> Step {
        Step {
            cfg,
            tx: Mutex::new(None),
            slow: AtomicBool::new(false),
        }
    }

    /// Asks for task `ask`'s lease; waits at most the timeout.
    pub fn place(&self, ask: Ask) -> Result<pb::AllocateCpusResponse, Failure> {
        if self.slow.load(Ordering::Relaxed) {
            return Err(Failure {
                why: "the server did not answer in time for an earlier task of this step".into(),
                unknown: false,
            });
        }
        let (reply, answer) = std_mpsc::channel();
        let place = Cmd::Place {
            ask: Box::new(ask),
            reply,
        };
        if !self.send(place, true) {
            return Err(Failure {
                why: "no thread to call the server".into(),
                unknown: false,
            });
        }
        // The thread bounds the call by the timeout; the margin is for it
        // to say so.
        let r = answer
            .recv_timeout(self.cfg.timeout + Duration::from_millis(500))
            .unwrap_or_else(|_| {
                Err(Failure {
                    why: format!("no answer within {:?}", self.cfg.timeout),
                    unknown: true,
                })
            });
        if matches!(&r, Err(f) if f.unknown) {
            self.slow.store(true, Ordering::Relaxed);
        }
        r
    }

    /// Says whether the task was bound to its lease; one that was not is
    /// released.
    pub fn bound(&self, task: u32, kept: bool) {
        self.send(Cmd::Bound { task, kept }, false);
    }

    /// Task `task` exited: its lease is released before this returns (or
    /// the wait is given up after twice the timeout; the TTL ends it).
    pub fn task_exited(&self, task: u32) {
        let (done, wait) = std_mpsc::channel();
        if self.send(Cmd::Release { task, done }, false) {
            let _ = wait.recv_timeout(self.cfg.timeout * 2);
        }
    }

    /// The step ends: whatever is still leased is released, and the thread
    /// stops.
    pub fn stop(&self) {
        let (done, wait) = std_mpsc::channel();
        if self.send(Cmd::Stop { done }, false) {
            let _ = wait.recv_timeout(self.cfg.timeout * 2);
        }
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }

    /// Sends a command; `start`: starting the thread if it is not running
    /// (only a lease call does: a step that asked for none has nothing to
    /// renew or release, and never starts it).
    fn send(&self, cmd: Cmd, start: bool) -> bool {
        let mut tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        if tx.is_none() && start {
            let (t, rx) = mpsc::unbounded_channel();
            let cfg = Arc::clone(&self.cfg);
            match std::thread::Builder::new()
                .name("fairplace-leases".into())
                .spawn(move || Leases::run(cfg, rx))
            {
                Ok(_) => *tx = Some(t),
                Err(e) => {
                    log(Level::Error, &format!("no thread to call the server: {e}"));
                    return false;
                }
            }
        }
        tx.as_ref().is_some_and(|t| t.send(cmd).is_ok())
    }
}

/// The thread's side: the connection and the step's leases.
struct Leases {
    cfg: Arc<Config>,
    client: Client,
    held: HashMap<u32, Held>,
}

impl Leases {
    fn run(cfg: Arc<Config>, mut rx: mpsc::UnboundedReceiver<Cmd>) {
        let rt = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => return log(Level::Error, &format!("no runtime to call the server: {e}")),
        };
        rt.block_on(async move {
            // The channel's connection task needs the runtime.
            let client = match client(&cfg) {
                Ok(c) => c,
                Err(e) => return log(Level::Error, &format!("cannot call {}: {e}", cfg.server)),
            };
            let mut me = Leases {
                cfg,
                client,
                held: HashMap::new(),
            };
            let every = Duration::from_millis(u64::from(me.cfg.ttl_ms) / 3);
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tokio::select! {
                    _ = tick.tick() => me.renew_all().await,
                    cmd = rx.recv() => match cmd {
                        Some(Cmd::Place { ask, reply }) => {
                            let r = me.place(ask).await;
                            let _ = reply.send(r);
                        }
                        Some(Cmd::Bound { task, kept }) => me.bound(task, kept).await,
                        Some(Cmd::Release { task, done }) => {
                            me.release(task).await;
                            let _ = done.send(());
                        }
                        Some(Cmd::Stop { done }) => {
                            let tasks: Vec<u32> = me.held.keys().copied().collect();
                            for t in tasks {
                                me.release(t).await;
                            }
                            let _ = done.send(());
                            return;
                        }
                        None => return,
                    },
                }
            }
        });
    }

    /// One AllocateCpus, bounded by the timeout; an unknown outcome is
    /// held for the task's exit.
    async fn place(&mut self, ask: Box<Ask>) -> Result<pb::AllocateCpusResponse, Failure> {
        let task = ask.task.task;
        let call = self.client.allocate_cpus(ask.request());
        let r = match tokio::time::timeout(self.cfg.timeout, call).await {
            Ok(Ok(g)) => Ok(g),
            Ok(Err(s)) => Err(Failure {
                // The call may have reached the server and committed: a
                // deadline (tonic reports its own as Cancelled), a broken
                // connection.
                unknown: matches!(
                    s.code(),
                    Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
                ) && !unreachable(&s),
                why: format!("{}: {:?}: {}", self.cfg.server, s.code(), s.message()),
            }),
            Err(_) => Err(Failure {
                why: format!(
                    "{}: no answer within {:?}",
                    self.cfg.server, self.cfg.timeout
                ),
                unknown: true,
            }),
        };
        // Held from the answer on: a task that is never bound (its
        // post_fork gave up waiting) still has its lease released at exit.
        match &r {
            Ok(g) => {
                self.held.insert(task, Held::Leased { id: g.lease_id });
            }
            Err(f) if f.unknown => {
                self.held.insert(task, Held::Unknown(ask));
            }
            Err(_) => {}
        }
        r
    }

    async fn bound(&mut self, task: u32, kept: bool) {
        if !kept {
            self.release(task).await;
        }
    }

    /// Renews every lease; one the server no longer has is forgotten (its
    /// task keeps its CPUs, unprotected), with a line.
    async fn renew_all(&mut self) {
        let mut gone = Vec::new();
        for (&task, h) in &self.held {
            let Held::Leased { id } = h else { continue };
            match self.client.renew_lease(*id, self.cfg.ttl_ms).await {
                Ok(_) => {}
                Err(s) if s.code() == Code::NotFound => {
                    log(
                        Level::Error,
                        &format!(
                            "lease {id} of local task {task} is gone at the server: {}",
                            s.message()
                        ),
                    );
                    gone.push(task);
                }
                // Tried again at the next tick, while the TTL lasts.
                Err(s) => log(
                    Level::Verbose,
                    &format!(
                        "renewing lease {id} of local task {task}: {:?}: {}",
                        s.code(),
                        s.message()
                    ),
                ),
            }
        }
        for t in gone {
            self.held.remove(&t);
        }
    }

    /// Releases task `task`'s lease; an unknown outcome is asked again
    /// under the same request id first, and what it finds is released.
    async fn release(&mut self, task: u32) {
        let id = match self.held.remove(&task) {
            None => return,
            Some(Held::Leased { id }) => id,
            Some(Held::Unknown(ask)) => {
                let found = tokio::time::timeout(
                    self.cfg.timeout,
                    self.client.allocate_cpus(ask.request()),
                )
                .await;
                match found {
                    Ok(Ok(g)) => g.lease_id,
                    _ => {
                        return log(
                            Level::Error,
                            &format!(
                                "{}: the lease its start may have taken could not be found; it ends at its TTL",
                                ask.task.holder()
                            ),
                        );
                    }
                }
            }
        };
        let r = tokio::time::timeout(self.cfg.timeout, self.client.release_cpus(id)).await;
        match r {
            Ok(Ok(_)) => {}
            Ok(Err(s)) if s.code() == Code::NotFound => {}
            Ok(Err(s)) => log(
                Level::Error,
                &format!(
                    "releasing lease {id} of local task {task}: {:?}: {}; it ends at its TTL",
                    s.code(),
                    s.message()
                ),
            ),
            Err(_) => log(
                Level::Error,
                &format!(
                    "releasing lease {id} of local task {task}: no answer in time; it ends at its TTL"
                ),
            ),
        }
    }
}

/// A connection refused or never made: the call never reached a server,
/// so no lease can have been granted.
fn unreachable(s: &tonic::Status) -> bool {
    s.code() == Code::Unavailable
        && (s.message().contains("connect error") || s.message().contains("Connection refused"))
}

/// A client that connects on first use and again after a failure.
fn client(cfg: &Config) -> Result<Client, String> {
    let channel = cfg
        .tls
        .endpoint(&cfg.server)?
        .connect_timeout(cfg.timeout)
        .tcp_nodelay(true)
        .connect_lazy();
    let mut c = Client::from_channel(channel);
    c.deadline = cfg.timeout;
    c.attempts = 2;
    Ok(c)
}
