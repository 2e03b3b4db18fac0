//! fairplace-agent: reads a machine's CPU state and streams it to the server.
//! A crate of its own, so the client library and the CLI do not carry it;
//! what it shares with `fairplace run` (reading /sys and /proc, applying CPU
//! sets) is the `fairplace-host` crate, and its connection to the server
//! (TLS, the server's role verified) is the client library's.
//!
//! A [`Source`] produces the topology once and per-CPU states on every tick:
//! [`Machine`] reads this machine's sysfs and procfs, [`Simulated`] makes up
//! a node for load tests. [`stream`] keeps one Report stream per node alive:
//! register, a full snapshot, then deltas of the CPUs that changed (an empty
//! delta is the heartbeat that keeps the node fresh), and on any error a
//! reconnect with jittered exponential backoff and a full snapshot again.
//! Updates are cut to the server's limits before they are sent; a part the
//! server refuses anyway is left out of the next update and cut further
//! after that ([`limits`]), so a refusal never stops the reports.
//!
//! The stream also carries the node's leases: the agent applies those
//! naming a target inside its apply roots ([`apply`]) and keeps them all,
//! across reconnects and, with a state file, restarts ([`checkpoint`]).

#[cfg(feature = "bpf")]
pub mod bpf;
pub mod checkpoint;
pub mod exact;
pub mod leases;
pub mod limits;
mod report;
pub mod sched_debug;
pub mod signal;

// What the agent shares with `fairplace run`: reading this machine and
// applying CPU sets to it.
pub use fairplace_host::{apply, cgroupfs, pelt, procfs, sysfs, tasks};

use std::path::PathBuf;
use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use tokio::sync::watch;

/// Runnable tasks per CPU and runtime per process, from one sample.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TaskReport {
    /// One entry per CPU, in CPU order.
    pub cpus: Vec<pb::CpuTasks>,
    pub runtime: Vec<pb::ProcessRuntime>,
}

/// What a source that reads the kernel's own signals reports: its own
/// name, or procfs once it fell back to reading /proc.
pub(crate) fn source_or_procfs(failed: bool, own: pb::SignalSource) -> pb::SignalSource {
    if failed {
        pb::SignalSource::Procfs
    } else {
        own
    }
}

/// Where a node's state comes from.
pub trait Source: Send + 'static {
    fn topology(&self) -> pb::Topology;
    /// The current state of every CPU.
    fn sample(&mut self) -> Vec<pb::CpuState>;
    /// The tasks of the sample just taken; `None`: this source reports none.
    fn sample_tasks(&mut self) -> Option<TaskReport> {
        None
    }
    /// Where the signals come from, sent with the registration.
    fn signal_source(&self) -> pb::SignalSource {
        pb::SignalSource::Unspecified
    }
}

/// A reader chosen at run time ([`signal::open`]).
impl Source for Box<dyn Source> {
    fn topology(&self) -> pb::Topology {
        (**self).topology()
    }
    fn sample(&mut self) -> Vec<pb::CpuState> {
        (**self).sample()
    }
    fn sample_tasks(&mut self) -> Option<TaskReport> {
        (**self).sample_tasks()
    }
    fn signal_source(&self) -> pb::SignalSource {
        (**self).signal_source()
    }
}

/// CLOCK_MONOTONIC in ns: the agent's stand-in for `rq_clock_task()` (both
/// count from boot; they differ by IRQ time and suspend).
fn monotonic_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

use fairplace_types::limits::{MAX_CLOCK, MAX_SIGNAL};

/// A thread's affinity as the server takes it: only CPUs of the topology
/// (procfs lists possible CPUs, which may be more), empty for all of them.
fn allowed_in_topology(list: &str, nr_cpus: usize) -> String {
    use fairplace_types::cpumask::{CpuMask, MAX_CPUS};
    let Ok(m) = CpuMask::parse_cpulist(list, MAX_CPUS) else {
        return String::new();
    };
    let m = m.and(&CpuMask::first_n(nr_cpus));
    if m.is_empty() || m.weight() == nr_cpus {
        String::new()
    } else {
        m.to_string()
    }
}

/// A sampled thread as the protocol carries it.
fn task_to_pb(t: &tasks::TaskSample, nr_cpus: usize) -> pb::RunnableTask {
    let policy = match t.policy {
        3 => pb::Policy::Batch,
        5 => pb::Policy::Idle,
        _ => pb::Policy::Normal,
    };
    let clamp = |v: i64| v.clamp(0, MAX_SIGNAL);
    pb::RunnableTask {
        id: t.tid as u64,
        group: if t.kernel_thread { 0 } else { t.pid as u64 },
        policy: policy as i32,
        nice: t.nice.clamp(-20, 19),
        cpus_allowed: allowed_in_topology(&t.cpus_allowed, nr_cpus),
        load_avg: clamp(t.load_avg),
        util_avg: clamp(t.util_avg),
        util_est: clamp(t.util_est),
        runnable_avg: clamp(t.runnable_avg),
        running: t.running,
        exec_start: t.exec_start_ns.min(MAX_CLOCK as u64) as i64,
        migration_disabled: false,
        per_cpu_kthread: t.kernel_thread && t.nr_cpus_allowed == 1,
        sched_delayed: false,
        nr_threads: t.nr_threads,
    }
}

/// This machine, read from sysfs and procfs.
pub struct Machine {
    sys: PathBuf,
    proc: PathBuf,
    topo: sysfs::Topology,
    pelt: Vec<pelt::Pelt>,
    prev: Vec<Option<procfs::CpuTimes>>,
    /// Nanoseconds per /proc/stat tick (USER_HZ is 100 on Linux).
    tick_ns: u64,
    pub last_read: Duration,
    /// Tasks reported per CPU, biggest first; 0 = no task lists.
    task_cap: usize,
    tracker: tasks::RuntimeTracker,
    /// Per CPU, when a sample first showed it idle (monotonic ns); 0 while
    /// it is busy.
    idle_since: Vec<i64>,
}

impl Machine {
    pub fn new(sys: PathBuf, proc: PathBuf) -> std::io::Result<Machine> {
        let topo = sysfs::read_topology(&sys)?;
        let n = topo.cpus.len();
        Ok(Machine {
            sys,
            proc,
            topo,
            pelt: (0..n).map(|_| pelt::Pelt::new()).collect(),
            prev: vec![None; n],
            tick_ns: 10_000_000,
            last_read: Duration::ZERO,
            task_cap: 0,
            tracker: tasks::RuntimeTracker::new(),
            idle_since: vec![0; n],
        })
    }

    /// Reports up to `cap` runnable tasks per CPU (0: none) and per-process
    /// runtime.
    pub fn with_task_cap(mut self, cap: usize) -> Machine {
        self.task_cap = cap;
        self
    }

    /// The real machine.
    pub fn local() -> std::io::Result<Machine> {
        Machine::new(PathBuf::from("/sys/devices/system"), PathBuf::from("/proc"))
    }

    pub fn nr_cpus(&self) -> usize {
        self.topo.cpus.len()
    }
}

impl Source for Machine {
    fn signal_source(&self) -> pb::SignalSource {
        pb::SignalSource::Procfs
    }

    fn topology(&self) -> pb::Topology {
        pb::Topology {
            cpus: self
                .topo
                .cpus
                .iter()
                .map(|c| pb::CpuTopology {
                    id: c.id,
                    core: c.core,
                    cluster: c.cluster,
                    llc: c.llc,
                    node: c.node,
                    capacity: c.capacity,
                })
                .collect(),
            numa_distance: pb::distance_rows(self.topo.numa_distance.as_ref()),
        }
    }

    fn sample(&mut self) -> Vec<pb::CpuState> {
        let t0 = Instant::now();
        let n = self.nr_cpus();
        let online: Vec<u32> =
            sysfs::read_online(&self.sys).unwrap_or_else(|_| (0..n as u32).collect());
        let times = std::fs::read_to_string(self.proc.join("stat"))
            .map(|s| procfs::parse_proc_stat(&s))
            .unwrap_or_default();
        let rq = procfs::read_runqueues(&self.proc, n).unwrap_or(procfs::RunqueueCounts {
            nr_running: vec![0; n],
            h_nr_idle: vec![0; n],
        });
        for t in times {
            let i = t.cpu as usize;
            if i >= n {
                continue;
            }
            if let Some(p) = self.prev[i] {
                let busy = t.busy.saturating_sub(p.busy) * self.tick_ns;
                let total = t.total.saturating_sub(p.total) * self.tick_ns;
                self.pelt[i].update(busy, total);
            }
            self.prev[i] = Some(t);
        }
        let me = procfs_self_cpu(&self.proc);
        let now = monotonic_ns().max(1);
        let out = (0..n)
            .map(|i| {
                let util = self.pelt[i].util() as i64;
                // The agent's own reading thread is runnable where it ran;
                // it is not part of the workload.
                let mut nr = rq.nr_running[i];
                if Some(i as u32) == me {
                    nr = nr.saturating_sub(1);
                }
                let idle = rq.h_nr_idle[i].min(nr);
                // A nice-0 task's load and runnable averages track its
                // runnable time: approximate them from util and queue depth.
                let runnable = (util * nr.max(1) as i64).min(MAX_SIGNAL);
                let is_online = online.contains(&(i as u32));
                // rq->idle_stamp: the kernel stamps a CPU going idle with its
                // runqueue clock, and the slow path prefers the most recently
                // idle CPU. The kernel's own is not readable (neither
                // /proc/schedstat nor sched/debug shows it), so it is when a
                // sample first showed the CPU idle, on the clock that stands
                // in for the runqueue clock; never 0 for an idle CPU (0 would
                // make it lose to every stamped one, and with all 0 the slow
                // path would keep this_cpu).
                let idle_stamp = if is_online && nr == 0 {
                    if self.idle_since[i] == 0 {
                        self.idle_since[i] = now;
                    }
                    self.idle_since[i]
                } else {
                    self.idle_since[i] = 0;
                    0
                };
                pb::CpuState {
                    id: i as u32,
                    online: is_online,
                    nr_running: nr,
                    h_nr_idle: idle,
                    nr_delayed: 0,
                    cfs_h_nr_queued: None,
                    curr_is_idle: None,
                    ttwu_pending: false,
                    vcpu_preempted: false,
                    load_avg: runnable,
                    runnable_avg: runnable,
                    util_avg: util,
                    util_est: util,
                    capacity: None,
                    actual_capacity: None,
                    idle_exit_latency: sysfs::idle_exit_latency(&self.sys, i as u32),
                    idle_stamp,
                    curr_is_per_cpu_kthread: false,
                    core_cookie: 0,
                }
            })
            .collect();
        self.last_read = t0.elapsed();
        out
    }

    fn sample_tasks(&mut self) -> Option<TaskReport> {
        if self.task_cap == 0 {
            return None;
        }
        let n = self.nr_cpus();
        let me = std::process::id();
        // The agent's own threads are not part of the workload.
        let threads: Vec<tasks::TaskSample> = tasks::read_threads(&self.proc, self.tick_ns)
            .ok()?
            .into_iter()
            .filter(|t| t.pid != me)
            .collect();
        // A CPU id beyond the topology would have the whole update refused.
        // Over 1,000 s on one CPU since the last sample (a long gap) is
        // more than the server takes: such a delta is capped.
        let runtime = self
            .tracker
            .update(&threads)
            .into_iter()
            .filter(|d| (d.cpu as usize) < n)
            .map(|d| pb::ProcessRuntime {
                group: d.pid as u64,
                cpu: d.cpu,
                runtime_ns: d.runtime_ns.min(1_000_000_000_000),
                nr_threads: d.nr_threads,
            })
            .collect();
        let mut per_cpu = tasks::runnable_fair(&threads, n);
        tasks::cap_biggest_first(&mut per_cpu, self.task_cap);
        let clock = monotonic_ns();
        let cpus = per_cpu
            .iter()
            .enumerate()
            .map(|(i, l)| pb::CpuTasks {
                cpu: i as u32,
                tasks: l.iter().map(|t| task_to_pb(t, n)).collect(),
                clock_task: clock,
            })
            .collect();
        Some(TaskReport { cpus, runtime })
    }
}

/// The CPU this process's current thread last ran on (field 39 of its stat).
fn procfs_self_cpu(proc: &std::path::Path) -> Option<u32> {
    let s = std::fs::read_to_string(proc.join("thread-self/stat")).ok()?;
    procfs::parse_task_stat(&s).map(|t| t.processor)
}

/// A synthetic node: `sockets` x `cores` x `smt` CPUs whose load wanders.
pub struct Simulated {
    nodes: u32,
    cores_per_node: u32,
    smt: u32,
    rng: u64,
    state: Vec<pb::CpuState>,
    /// Share of CPUs that change per sample, in percent.
    pub churn_pct: u32,
    /// Report a task list consistent with each CPU's nr_running.
    pub tasks: bool,
    /// CPUs per LLC; `None` = one LLC per NUMA node.
    pub llc_cpus: Option<u32>,
    last_sample: Option<i64>,
}

impl Simulated {
    pub fn new(nr_cpus: u32, seed: u64) -> Simulated {
        let nr_cpus = nr_cpus.max(2);
        let smt = if nr_cpus.is_multiple_of(2) { 2 } else { 1 };
        let nodes = if nr_cpus >= 64 { 2 } else { 1 };
        let mut s = Simulated {
            nodes,
            cores_per_node: nr_cpus / smt / nodes,
            smt,
            rng: seed | 1,
            state: Vec::new(),
            churn_pct: 10,
            tasks: false,
            llc_cpus: None,
            last_sample: None,
        };
        s.state = (0..s.nr_cpus()).map(|i| s.random_cpu(i)).collect();
        s
    }

    pub fn nr_cpus(&self) -> u32 {
        self.nodes * self.cores_per_node * self.smt
    }

    fn next(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    fn random_cpu(&mut self, id: u32) -> pb::CpuState {
        let busy = self.next() % 100 < 50;
        let util = if busy {
            300 + (self.next() % 700) as i64
        } else {
            (self.next() % 50) as i64
        };
        let nr = if busy {
            1 + (self.next() % 3) as u32
        } else {
            0
        };
        pb::CpuState {
            id,
            online: true,
            nr_running: nr,
            h_nr_idle: if nr > 0 && self.next().is_multiple_of(10) {
                nr
            } else {
                0
            },
            load_avg: util * nr.max(1) as i64,
            runnable_avg: util * nr.max(1) as i64,
            util_avg: util,
            util_est: util,
            idle_exit_latency: if busy {
                None
            } else {
                Some((self.next() % 3) as u32 * 10)
            },
            // Idle since this sample, as the kernel stamps a CPU going idle.
            idle_stamp: if nr == 0 { monotonic_ns().max(1) } else { 0 },
            ..Default::default()
        }
    }
}

impl Source for Simulated {
    fn signal_source(&self) -> pb::SignalSource {
        pb::SignalSource::Simulated
    }

    fn topology(&self) -> pb::Topology {
        let per_node = self.cores_per_node * self.smt;
        pb::Topology {
            cpus: (0..self.nr_cpus())
                .map(|i| pb::CpuTopology {
                    id: i,
                    core: i / self.smt,
                    cluster: None,
                    llc: self.llc_cpus.map_or(i / per_node, |k| i / k.max(1)),
                    node: i / per_node,
                    capacity: 1024,
                })
                .collect(),
            numa_distance: vec![],
        }
    }

    fn sample(&mut self) -> Vec<pb::CpuState> {
        let n = self.nr_cpus();
        let changes = (n * self.churn_pct / 100).max(1);
        for _ in 0..changes {
            let i = (self.next() % n as u64) as u32;
            self.state[i as usize] = self.random_cpu(i);
        }
        self.state.clone()
    }

    /// Tasks matching each CPU's state: `nr_running` nice-0 tasks sharing
    /// its load, the first running, the others queued 1 ms apart; threads
    /// of a process spread over four neighbouring CPUs. Runtime is the
    /// CPU's utilisation of the time since the last sample.
    fn sample_tasks(&mut self) -> Option<TaskReport> {
        if !self.tasks {
            return None;
        }
        let clock = monotonic_ns();
        let elapsed = self.last_sample.map_or(0, |t| (clock - t).max(0));
        self.last_sample = Some(clock);
        let mut cpus = Vec::with_capacity(self.state.len());
        let mut runtime = Vec::new();
        for c in &self.state {
            let k = c.nr_running as i64;
            let group = 1 + (c.id as u64 / 4) % 5;
            let list = (0..k)
                .map(|j| pb::RunnableTask {
                    id: c.id as u64 * 64 + j as u64 + 1,
                    group,
                    policy: if c.h_nr_idle > 0 {
                        pb::Policy::Idle as i32
                    } else {
                        pb::Policy::Normal as i32
                    },
                    load_avg: c.load_avg / k,
                    util_avg: c.util_avg / k,
                    util_est: c.util_est / k,
                    runnable_avg: c.runnable_avg / k,
                    running: j == 0,
                    exec_start: (clock - j * 1_000_000).max(0),
                    nr_threads: 8,
                    ..Default::default()
                })
                .collect();
            if k > 0 && elapsed > 0 {
                runtime.push(pb::ProcessRuntime {
                    group,
                    cpu: c.id,
                    runtime_ns: ((elapsed as u64).saturating_mul(c.util_avg.max(0) as u64) / 1024)
                        .min(1_000_000_000_000),
                    nr_threads: 8,
                });
            }
            cpus.push(pb::CpuTasks {
                cpu: c.id,
                tasks: list,
                clock_task: clock,
            });
        }
        Some(TaskReport { cpus, runtime })
    }
}

/// How one node's stream is run.
#[derive(Debug, Clone)]
pub struct StreamConfig {
    pub server: String,
    pub node_id: String,
    pub labels: Vec<(String, String)>,
    pub interval: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    /// The server's largest accepted message: an update that would be
    /// bigger goes without its task lists.
    pub max_message_bytes: usize,
    /// TLS towards the server (a node certificate for mutual TLS); read
    /// again at every reconnect.
    pub tls: fairplace_client::TlsOptions,
    /// With TLS, the server's certificate must carry
    /// `spiffe://TRUST_DOMAIN/server/NAME` ([`fairplace_client::verified`]).
    pub trust_domain: String,
    /// Where the node's leases are kept and what they may be applied to.
    pub leases: LeaseSettings,
}

/// The agent's leases: its checkpoint file and its apply roots. The
/// default keeps them in memory only (a restarted agent starts with none)
/// and applies under the default roots ([`apply::default_roots`]).
#[derive(Debug, Clone, Default)]
pub struct LeaseSettings {
    /// The checkpoint ([`checkpoint::state_file`]); `None`: in memory.
    pub state_file: Option<PathBuf>,
    pub roots: apply::Roots,
    /// Whether grants naming a target are applied at all: only when the
    /// server was verified over TLS, or the operator said
    /// `--insecure-apply`. Otherwise every such grant is refused (the
    /// leases are still recorded as the node's witness).
    pub may_apply: bool,
    /// Why grants naming a target are refused when they are, if not for
    /// want of trust ([`APPLY_NEEDS_TRUST`]): e.g. an agent outside the
    /// machine's pid namespace ([`cgroupfs::same_pid_namespace`]).
    pub refusal: Option<String>,
}

/// Why a grant naming a target was not applied by an agent that does not
/// trust its server enough to act on it.
pub const APPLY_NEEDS_TRUST: &str = "this agent applies leases only from a server it verified over TLS \
     (--tls-ca), or when started with --insecure-apply";

/// What a stream reports about itself, for logs, metrics and tests.
#[derive(Debug, Default, Clone)]
pub struct StreamStats {
    pub connects: u64,
    pub updates_sent: u64,
    pub cpus_sent: u64,
    pub rejections: u64,
    pub last_ack_seq: u64,
}

/// Keeps the node's Report stream alive until `stop` turns true.
pub async fn stream<S: Source>(
    cfg: StreamConfig,
    mut source: S,
    mut stop: watch::Receiver<bool>,
    stats: watch::Sender<StreamStats>,
) {
    let floor = cfg.backoff_min.max(Duration::from_millis(10));
    let mut backoff = floor;
    let mut seq: u64 = 0;
    let mut jitter = seed_from(&cfg.node_id);
    // What the server refused stays cut across reconnects.
    let mut shed = limits::Shedding::new();
    // Leases outlive a connection: the server may restart, they stay.
    let mut applier = leases::Applier::new(&cfg.node_id, &cfg.leases);
    let mut to = Servers::new(&cfg.server);
    loop {
        if *stop.borrow() {
            return;
        }
        let connects = stats.borrow().connects;
        let server = to.current().to_string();
        match report::run_once(
            &cfg,
            &server,
            &mut source,
            &mut seq,
            (&mut shed, &mut applier),
            &mut stop,
            &stats,
        )
        .await
        {
            Ok(()) => return,
            Err(e) => {
                metrics::counter!("fairplace_agent_reconnects_total").increment(1);
                if let Some(owner) = e.redirect.clone().filter(|_| to.may_follow()) {
                    tracing::info!(node = %cfg.node_id, from = %server, to = %owner, why = %e, "sent to the node's owner");
                    to.follow(owner);
                    // Straight there: this is a handover, not a failure.
                    continue;
                }
                tracing::warn!(node = %cfg.node_id, server = %server, error = %e, "stream failed; reconnecting");
                // An owner a replica named that does not answer has just
                // died: the replicas name the next one within their etcd
                // lease, so ask again soon rather than back off.
                let soon = e.retry_soon || to.following();
                to.fall_back();
                if soon {
                    backoff = floor;
                }
            }
        }
        // A stream that got registered was healthy: start the backoff over.
        if stats.borrow().connects > connects {
            backoff = floor;
        }
        // Jitter in [backoff/2, backoff) so many agents do not reconnect in step.
        jitter ^= jitter << 13;
        jitter ^= jitter >> 7;
        jitter ^= jitter << 17;
        let half = backoff / 2;
        let wait = half + Duration::from_nanos(jitter % (half.as_nanos().max(1) as u64));
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            changed = stop.changed() => if changed.is_err() { return },
        }
        backoff = (backoff * 2).min(cfg.backoff_max.max(floor));
    }
}

/// Where the next connection goes: the owner a replica named (at most
/// [`Servers::MAX_HOPS`] in a row), else the configured servers in turn
/// (`--server` may list several, comma-separated, or be one Service
/// address that reaches any replica).
struct Servers {
    configured: Vec<String>,
    next: usize,
    redirect: Option<String>,
    hops: usize,
}

impl Servers {
    const MAX_HOPS: usize = 3;

    fn new(list: &str) -> Servers {
        let configured: Vec<String> = list
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect();
        Servers {
            configured: if configured.is_empty() {
                vec![list.to_string()]
            } else {
                configured
            },
            next: 0,
            redirect: None,
            hops: 0,
        }
    }

    fn current(&self) -> &str {
        self.redirect
            .as_deref()
            .unwrap_or(&self.configured[self.next % self.configured.len()])
    }

    /// The last connection went where a replica sent it.
    fn following(&self) -> bool {
        self.redirect.is_some()
    }

    fn may_follow(&self) -> bool {
        self.hops < Self::MAX_HOPS
    }

    fn follow(&mut self, owner: String) {
        self.hops += 1;
        self.redirect = Some(owner);
    }

    /// After a failure: the next configured server, hops forgotten.
    fn fall_back(&mut self) {
        if self.redirect.take().is_none() {
            self.next += 1;
        }
        self.hops = 0;
    }
}

fn seed_from(s: &str) -> u64 {
    s.bytes().fold(0x9e3779b97f4a7c15u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    }) | 1
}

#[cfg(test)]
mod tests {
    use super::*;

    use pb::agent_service_server::{AgentService, AgentServiceServer};
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::ReceiverStream;
    use tonic::{Request, Response, Status, Streaming};

    /// A server that records each registration's held leases and the
    /// outcomes it is sent; on the first connection it pushes a grant
    /// without target and one that cannot be applied, then drops the
    /// stream (a server restart, to the agent).
    struct Fake {
        seen: mpsc::UnboundedSender<pb::agent_message::Body>,
        conns: std::sync::atomic::AtomicU32,
    }

    #[tonic::async_trait]
    impl AgentService for Fake {
        type ReportStream = ReceiverStream<Result<pb::Ack, Status>>;

        async fn report(
            &self,
            req: Request<Streaming<pb::AgentMessage>>,
        ) -> Result<Response<Self::ReportStream>, Status> {
            let mut inbound = req.into_inner();
            let first = inbound.message().await?.and_then(|m| m.body);
            let _ = self
                .seen
                .send(first.ok_or(Status::invalid_argument("empty"))?);
            let n = self.conns.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let (tx, rx) = mpsc::channel(8);
            let _ = tx.send(Ok(pb::Ack::default())).await;
            if n == 0 {
                let grant = |id, target| pb::LeaseGrant {
                    lease_id: id,
                    cpus: "0".into(),
                    target,
                    owner: "anonymous".into(),
                    expires_at_unix_ms: checkpoint::now_unix_ms() + 60_000,
                    ..Default::default()
                };
                let missing = pb::ApplyTarget {
                    target: Some(pb::apply_target::Target::Pid(u32::MAX - 1)),
                };
                let push = pb::Ack {
                    grants: vec![grant(11, None), grant(12, Some(missing))],
                    ..Default::default()
                };
                let _ = tx.send(Ok(push)).await;
            }
            let seen = self.seen.clone();
            tokio::spawn(async move {
                let until = tokio::time::Instant::now() + Duration::from_millis(300);
                while let Ok(Ok(Some(m))) = tokio::time::timeout_at(until, inbound.message()).await
                {
                    if let Some(b @ pb::agent_message::Body::Applied(_)) = m.body {
                        let _ = seen.send(b);
                    }
                }
                // The first stream ends here; later ones stay open.
                if n > 0 {
                    std::future::pending::<()>().await;
                }
                drop(tx);
            });
            Ok(Response::new(ReceiverStream::new(rx)))
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn leases_outlive_a_reconnect_and_are_reported_at_registration() {
        let (seen_tx, mut seen) = mpsc::unbounded_channel();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let fake = Fake {
            seen: seen_tx,
            conns: Default::default(),
        };
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(AgentServiceServer::new(fake))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
        );
        let cfg = StreamConfig {
            server: addr.to_string(),
            node_id: "fake".into(),
            labels: vec![],
            interval: Duration::from_millis(50),
            backoff_min: Duration::from_millis(20),
            backoff_max: Duration::from_millis(50),
            max_message_bytes: 4 << 20,
            tls: Default::default(),
            trust_domain: "fairplace".into(),
            // As --insecure-apply: this fake server is plaintext.
            leases: LeaseSettings {
                may_apply: true,
                ..LeaseSettings::default()
            },
        };
        let (stop_tx, stop) = watch::channel(false);
        let (stats, _) = watch::channel(StreamStats::default());
        let task = tokio::spawn(stream(cfg, Simulated::new(4, 1), stop, stats));
        let mut next = async || {
            tokio::time::timeout(Duration::from_secs(10), seen.recv())
                .await
                .expect("the fake server hears from the agent")
                .unwrap()
        };
        let held = |b| match b {
            pb::agent_message::Body::Register(r) => {
                r.held_leases.iter().map(|g| g.lease_id).collect::<Vec<_>>()
            }
            other => panic!("{other:?}"),
        };
        assert_eq!(held(next().await), Vec::<u64>::new());
        // Only the grant with a target is answered (and, failed, not kept).
        match next().await {
            pb::agent_message::Body::Applied(o) => {
                assert_eq!(
                    (o.lease_id, o.ok, o.reason.as_str()),
                    (12, false, "not_found")
                )
            }
            other => panic!("{other:?}"),
        }
        // The reconnect's registration reports the lease recorded before.
        assert_eq!(held(next().await), vec![11]);
        stop_tx.send(true).unwrap();
        task.await.unwrap();
    }

    #[test]
    fn idle_cpus_carry_the_time_they_were_first_seen_idle() {
        let Ok(mut m) = Machine::local() else {
            return;
        };
        let t0 = monotonic_ns();
        let a = m.sample();
        let b = m.sample();
        for (x, y) in a.iter().zip(&b) {
            for s in [x, y] {
                assert_eq!(s.idle_stamp > 0, s.online && s.nr_running == 0, "{s:?}");
                assert!(s.idle_stamp == 0 || s.idle_stamp >= t0, "{s:?}");
            }
            if x.idle_stamp > 0 && y.idle_stamp > 0 {
                assert_eq!(
                    x.idle_stamp, y.idle_stamp,
                    "still idle since the first sample"
                );
            }
        }
    }
}
