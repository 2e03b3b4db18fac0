//! `fairplace run`: run a command on CPUs the server leased.
//!
//! The launcher a batch job, a benchmark or a service manager uses: it asks
//! AllocateCpus for `count` CPUs of this node (the node id is the hostname,
//! as the agent's default), starts the command with its affinity set to the
//! leased CPUs before it executes (or inside a cgroup whose cpuset.cpus it
//! set), renews the lease every third of its lifetime while the command
//! runs, releases it when the command exits, and exits with the command's
//! status (128 + N for a signal N, as shells report it).
//!
//! The command runs in a process group of its own: the signals `fairplace
//! run` passes on reach every process of it (a `sh -c 'CMD'` and its CMD),
//! and when the command's first process ends, whatever else of the group
//! is left is ended (SIGTERM, then SIGKILL after a grace) before the lease
//! is released, so nothing of the command keeps running on CPUs that may be
//! granted to someone else. On a terminal, the group is given the terminal
//! while it runs (as a shell gives a job) and it is taken back after.
//!
//! The command keeps running whatever the server does: a renewal the
//! server cannot answer (restarting, unreachable) is retried with backoff
//! until the lease would have expired, and then the command goes on
//! without one; a renewal refused (NOT_FOUND, PERMISSION_DENIED) ends the
//! renewals. The release at the end is retried for a while too.
//!
//! When the server does not answer within the timeout (or cannot be
//! reached), the command still runs: on a local choice, the least busy
//! CPUs of this machine by its runqueues right now, with a warning that no
//! lease protects them (titus-isolate's local fallback, in spirit).

use std::ffi::{CString, OsString};
use std::path::PathBuf;
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Code, Status};

use fairplace_client::{Client, pb};
use fairplace_host::cgroupfs::CgroupFs;
use fairplace_host::{apply, procfs, sysfs};

/// What `fairplace run` was asked.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The node; `None`: this machine's hostname.
    pub node: Option<String>,
    pub count: u32,
    pub policy: String,
    /// Run inside this cgroup (its cpuset.cpus set to the lease) instead
    /// of setting the affinity.
    pub cgroup: Option<String>,
    pub holder: String,
    pub ttl_ms: u32,
    /// How long to wait for the server before the local fallback.
    pub timeout: Duration,
    pub cmd: Vec<OsString>,
    /// Where a fallback is counted for node_exporter's textfile collector
    /// (`None`: only the warning).
    pub textfile_dir: Option<PathBuf>,
}

/// Where the CPUs came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cpus {
    Lease {
        id: u64,
        node: String,
        cpus: String,
        ttl_ms: u32,
    },
    /// The server did not answer: a local choice, and why.
    Local { cpus: String, why: String },
}

impl Cpus {
    pub fn list(&self) -> &str {
        match self {
            Cpus::Lease { cpus, .. } | Cpus::Local { cpus, .. } => cpus,
        }
    }
}

/// This machine's node id, as the agent names it: the hostname.
pub fn this_node_id() -> String {
    fairplace_types::state_dir::hostname()
}

/// Asks the server for the lease, or falls back to a local choice when it
/// does not answer in time. A refusal (bad input, no room) is an error.
pub async fn obtain(client: Option<&Client>, o: &RunOptions) -> Result<Cpus, String> {
    let node = o.node.clone().unwrap_or_else(this_node_id);
    let Some(c) = client else {
        return local(o, "the server cannot be reached".into());
    };
    let req = pb::AllocateCpusRequest {
        node_id: node,
        count: o.count,
        policy: o.policy.clone(),
        holder: o.holder.clone(),
        ttl_ms: o.ttl_ms,
        ..Default::default()
    };
    match tokio::time::timeout(o.timeout, c.allocate_cpus(req)).await {
        Ok(Ok(r)) => Ok(Cpus::Lease {
            id: r.lease_id,
            node: r.node_id,
            cpus: r.cpus,
            ttl_ms: r.ttl_ms,
        }),
        Ok(Err(s)) if matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded) => {
            local(o, format!("the server failed: {}", s.message()))
        }
        Ok(Err(s)) => Err(format!("AllocateCpus: {:?}: {}", s.code(), s.message())),
        Err(_) => local(
            o,
            format!(
                "the server did not answer within {} ms",
                o.timeout.as_millis()
            ),
        ),
    }
}

/// The local fallback: the `count` least busy online CPUs of this machine
/// by their runqueues now (fewest runnable tasks, then lowest id).
fn local(o: &RunOptions, why: String) -> Result<Cpus, String> {
    let fail = |e: std::io::Error| format!("local fallback: {e}");
    let online = sysfs::read_online(std::path::Path::new("/sys/devices/system")).map_err(fail)?;
    let nr_cpus = online.iter().max().map_or(0, |&c| c as usize + 1);
    let rq = procfs::read_runqueues(std::path::Path::new("/proc"), nr_cpus).map_err(fail)?;
    let mut cpus: Vec<(u32, u32)> = online
        .iter()
        .map(|&c| (rq.nr_running[c as usize], c))
        .collect();
    if cpus.len() < o.count as usize {
        return Err(format!(
            "--cpus {}: this machine has {} online CPUs",
            o.count,
            cpus.len()
        ));
    }
    cpus.sort_unstable();
    let mut chosen: Vec<u32> = cpus.iter().take(o.count as usize).map(|c| c.1).collect();
    chosen.sort_unstable();
    let list = chosen
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    Ok(Cpus::Local { cpus: list, why })
}

/// Starts the command on `cpus` (affinity, or the cgroup), keeps the lease
/// alive while it runs, releases it, and returns the exit status.
pub async fn run_on(client: Option<&Client>, o: &RunOptions, cpus: &Cpus) -> Result<i32, String> {
    let outcome = launch(client, o, cpus).await;
    // The lease is released on every path: after the command, and when it
    // could not even start (a missing program, a cgroup that refused it).
    let left = match (&outcome, cpus) {
        (Ok((_, left)), _) => *left,
        (Err(_), Cpus::Lease { id, .. }) => Some((*id, false)),
        (Err(_), Cpus::Local { .. }) => None,
    };
    if let (Some(c), Some((id, expired))) = (client, left) {
        release(c, id, expired).await;
    }
    let (status, _) = outcome?;
    use std::os::unix::process::ExitStatusExt;
    Ok(status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1))
}

/// Sets the command up on `cpus`, starts it, and supervises it to its
/// end: its status, and the lease still to release.
async fn launch(
    client: Option<&Client>,
    o: &RunOptions,
    cpus: &Cpus,
) -> Result<(std::process::ExitStatus, Option<(u64, bool)>), String> {
    let list = apply::parse_cpulist(cpus.list()).map_err(|e| e.message)?;
    let (program, args) = o.cmd.split_first().ok_or("no command to run")?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args);
    let parent = std::process::id() as libc::pid_t;
    match &o.cgroup {
        Some(path) => {
            let dir = apply::set_cgroup_cpus(&CgroupFs::default(), path, cpus.list())
                .map_err(|e| e.message)?;
            let procs = CString::new(
                dir.join("cgroup.procs")
                    .into_os_string()
                    .into_encoded_bytes(),
            )
            .map_err(|e| format!("--cgroup: {e}"))?;
            // SAFETY: the closure runs in the child between fork and exec
            // and makes only async-signal-safe calls (prctl, getppid, open,
            // write, close) on memory prepared before the fork.
            unsafe {
                cmd.pre_exec(move || {
                    die_with_parent(parent)?;
                    join_cgroup(&procs)
                });
            }
        }
        None => {
            let set = apply::cpu_set(&list).map_err(|e| e.message)?;
            // SAFETY: as above; sched_setaffinity is a plain system call.
            unsafe {
                cmd.pre_exec(move || {
                    die_with_parent(parent)?;
                    if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
    }
    // Its own process group, given the terminal when this one has it.
    let terminal = foreground_terminal();
    cmd.process_group(0);
    if terminal {
        // SAFETY: as above; sigprocmask, tcsetpgrp and getpid are
        // async-signal-safe.
        unsafe { cmd.pre_exec(take_terminal) };
    }
    // Caught from before the command exists: a signal that arrives once it
    // does (the moment a caller can see its pid) is passed on, never lost
    // between the spawn and the first wait.
    let forward = Forwarded::install()?;
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{}: {e}", PathBuf::from(program).display()))?;
    let group = child.id().map(|p| p as libc::pid_t);
    let name = PathBuf::from(program).display().to_string();
    let out = supervise(client, cpus, &mut child, &name, forward).await;
    if let Some(g) = group {
        end_group(g).await;
    }
    if terminal {
        give_terminal_back();
    }
    out
}

/// Whether this process is in the foreground of a terminal on its standard
/// input: the command's group is then given the terminal while it runs.
fn foreground_terminal() -> bool {
    // SAFETY: isatty, tcgetpgrp and getpgrp take a descriptor or nothing.
    unsafe { libc::isatty(0) == 1 && libc::tcgetpgrp(0) == libc::getpgrp() }
}

/// In the child, in its new group: takes the terminal.
fn take_terminal() -> std::io::Result<()> {
    // SAFETY: getpid takes nothing; `foreground` is async-signal-safe.
    foreground(unsafe { libc::getpid() });
    Ok(())
}

/// Takes the terminal back for this process's group.
fn give_terminal_back() {
    // SAFETY: getpgrp takes nothing.
    foreground(unsafe { libc::getpgrp() });
}

/// Makes `group` the terminal's foreground group (SIGTTOU held off
/// meanwhile, as tcsetpgrp from a background group would raise it).
fn foreground(group: libc::pid_t) {
    // SAFETY: sigset operations on local sets, sigprocmask and tcsetpgrp
    // on descriptor 0; all async-signal-safe (this runs in the child
    // between fork and exec too).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTTOU);
        libc::sigprocmask(libc::SIG_BLOCK, &set, &mut old);
        libc::tcsetpgrp(0, group);
        libc::sigprocmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}

/// How long what is left of the command's group has after SIGTERM.
const GROUP_GRACE: Duration = Duration::from_secs(2);

/// Ends whatever is left of process group `g` once its first process
/// ended: SIGTERM, then SIGKILL after [`GROUP_GRACE`].
async fn end_group(g: libc::pid_t) {
    // SAFETY: kill(-g, ...) signals the command's own group (g is the pid
    // of the child that leads it, never 0 or 1).
    let alive = || unsafe { libc::kill(-g, 0) == 0 };
    if g <= 1 || !alive() {
        return;
    }
    eprintln!("fairplace run: the command's other processes are still running: ending them");
    // SAFETY: as above.
    unsafe { libc::kill(-g, libc::SIGTERM) };
    let give_up = Instant::now() + GROUP_GRACE;
    while alive() && Instant::now() < give_up {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if alive() {
        // SAFETY: as above.
        unsafe { libc::kill(-g, libc::SIGKILL) };
    }
}

/// In the child before it executes: the command dies (SIGKILL) with
/// `fairplace run`, so it never outlives the lease that placed it
/// (PR_SET_PDEATHSIG; a parent already gone is checked after it is set).
fn die_with_parent(parent: libc::pid_t) -> std::io::Result<()> {
    // SAFETY: prctl with PR_SET_PDEATHSIG takes a signal number; getppid
    // takes nothing. Both are async-signal-safe.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if libc::getppid() != parent {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
    }
    Ok(())
}

/// Writes "0" (the writer itself) to a cgroup's cgroup.procs: the child
/// joins the cgroup before it executes the command.
fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: open, write and close on a NUL-terminated path and a static
    // buffer; all three are async-signal-safe.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let rc = libc::write(fd, b"0".as_ptr().cast(), 1);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if rc != 1 {
            return Err(err);
        }
    }
    Ok(())
}

/// The first wait after a failed renewal or release; it doubles up to
/// [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// How long a release after the command is retried.
const RELEASE_BUDGET: Duration = Duration::from_secs(10);

/// A renewal or release failure a later attempt may not have: the server
/// is restarting, unreachable or overloaded. Anything else (NOT_FOUND,
/// PERMISSION_DENIED, a bad request) will not change.
fn transient(s: &Status) -> bool {
    !matches!(
        s.code(),
        Code::NotFound
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::InvalidArgument
            | Code::Unimplemented
    )
}

/// The lease `fairplace run` keeps alive, and when to renew it next. The
/// command runs whatever the server does: a renewal the server cannot
/// answer is retried (backing off) until the lease would have expired,
/// then the command goes on without a lease.
#[derive(Debug)]
struct Keeper {
    id: u64,
    ttl: Duration,
    /// The last successful grant or renewal plus the TTL.
    expires: Instant,
    next: Instant,
    backoff: Duration,
    /// Failed renewals since the last success.
    failures: u32,
    /// No more renewals: the lease expired or the server refused it.
    done: bool,
    /// The server refused a renewal: the lease is not its to release.
    refused: bool,
}

impl Keeper {
    fn new(id: u64, ttl_ms: u32, now: Instant) -> Keeper {
        let ttl = Duration::from_millis(ttl_ms as u64);
        Keeper {
            id,
            ttl,
            expires: now + ttl,
            next: now + Self::period(ttl),
            backoff: RETRY_MIN,
            failures: 0,
            done: false,
            refused: false,
        }
    }

    /// Renewals come every third of the lifetime.
    fn period(ttl: Duration) -> Duration {
        (ttl / 3).max(Duration::from_millis(100))
    }

    /// Takes a renewal's answer at `now`; returns the line to print, if any.
    fn after(
        &mut self,
        r: Result<pb::RenewLeaseResponse, Status>,
        now: Instant,
        cmd: &str,
    ) -> Option<String> {
        let id = self.id;
        match r {
            Ok(resp) => {
                if resp.ttl_ms > 0 {
                    self.ttl = Duration::from_millis(resp.ttl_ms as u64);
                }
                self.expires = now + self.ttl;
                self.next = now + Self::period(self.ttl);
                self.backoff = RETRY_MIN;
                let was = std::mem::take(&mut self.failures);
                (was > 0).then(|| format!("fairplace run: lease {id} renewed again"))
            }
            Err(s) if !transient(&s) => {
                self.done = true;
                self.refused = true;
                Some(format!(
                    "fairplace run: renewing lease {id}: {:?}: {}; no longer renewing it, {cmd} keeps running",
                    s.code(),
                    s.message()
                ))
            }
            Err(_) if now >= self.expires => {
                self.done = true;
                Some(format!(
                    "fairplace run: warning: lease {id} expired while the server was unreachable; \
                     {cmd} keeps running without a lease"
                ))
            }
            Err(s) => {
                self.failures += 1;
                self.next = (now + self.backoff).min(self.expires);
                self.backoff = (self.backoff * 2).min(RETRY_MAX);
                (self.failures == 1).then(|| {
                    format!(
                        "fairplace run: renewing lease {id}: {:?}: {}; retrying until it expires in {} ms",
                        s.code(),
                        s.message(),
                        self.expires.saturating_duration_since(now).as_millis()
                    )
                })
            }
        }
    }
}

/// Waits for the child, renewing the lease every third of its lifetime
/// (riding through a server restart, [`Keeper`]) and passing SIGTERM on
/// to the child. Returns its status, and the lease still to release (and
/// whether it expired meanwhile).
async fn supervise(
    client: Option<&Client>,
    cpus: &Cpus,
    child: &mut tokio::process::Child,
    cmd: &str,
    mut forward: Forwarded,
) -> Result<(std::process::ExitStatus, Option<(u64, bool)>), String> {
    let mut keeper = match (client, cpus) {
        (Some(_), Cpus::Lease { id, ttl_ms, .. }) => {
            Some(Keeper::new(*id, *ttl_ms, Instant::now()))
        }
        _ => None,
    };
    let renewing = |k: &Option<Keeper>| k.as_ref().is_some_and(|k| !k.done);
    loop {
        tokio::select! {
            st = child.wait() => {
                let st = st.map_err(|e| format!("waiting for the command: {e}"))?;
                // A lease the server refused is not released; one that
                // expired while it was unreachable may be known again.
                let left = keeper.filter(|k| !k.refused).map(|k| (k.id, k.done));
                return Ok((st, left));
            }
            // The renewal races the child: a command that exits does not
            // wait for a server that does not answer.
            r = renew_when_due(client, keeper.as_ref()), if renewing(&keeper) => {
                if let Some(k) = keeper.as_mut()
                    && let Some(line) = k.after(r, Instant::now(), cmd)
                {
                    eprintln!("{line}");
                }
            }
            sig = forward.recv() => {
                if let Some(pid) = child.id() {
                    // SAFETY: kill sends a signal to the process group our
                    // own child leads (its pid, above 1).
                    unsafe { libc::kill(-(pid as i32), sig) };
                }
            }
        }
    }
}

/// The signals `fairplace run` passes on to its command (a terminal's
/// Ctrl-C and Ctrl-\, a hang-up, a service manager's stop) instead of
/// dying of them and leaving the command behind.
struct Forwarded([(libc::c_int, tokio::signal::unix::Signal); 4]);

impl Forwarded {
    fn install() -> Result<Forwarded, String> {
        use tokio::signal::unix::{SignalKind, signal};
        let on = |sig: libc::c_int| {
            signal(SignalKind::from_raw(sig))
                .map(|s| (sig, s))
                .map_err(|e| format!("signal {sig} handler: {e}"))
        };
        Ok(Forwarded([
            on(libc::SIGINT)?,
            on(libc::SIGHUP)?,
            on(libc::SIGQUIT)?,
            on(libc::SIGTERM)?,
        ]))
    }

    /// The next signal received.
    async fn recv(&mut self) -> libc::c_int {
        let [(a, sa), (b, sb), (c, sc), (d, sd)] = &mut self.0;
        tokio::select! {
            _ = sa.recv() => *a,
            _ = sb.recv() => *b,
            _ = sc.recv() => *c,
            _ = sd.recv() => *d,
        }
    }
}

/// Sleeps until the keeper's next renewal, then renews.
async fn renew_when_due(
    client: Option<&Client>,
    k: Option<&Keeper>,
) -> Result<pb::RenewLeaseResponse, Status> {
    let (Some(c), Some(k)) = (client, k) else {
        return std::future::pending().await;
    };
    tokio::time::sleep_until(k.next).await;
    c.renew_lease(k.id, 0).await
}

/// Releases the lease, retrying a server that cannot answer (backing off)
/// for at most [`RELEASE_BUDGET`]. A lease that `expired` may be gone:
/// NOT_FOUND is then no news.
async fn release(c: &Client, id: u64, expired: bool) {
    let give_up = Instant::now() + RELEASE_BUDGET;
    let mut backoff = RETRY_MIN;
    loop {
        let r = tokio::time::timeout_at(give_up, c.release_cpus(id)).await;
        let s = match r {
            Ok(Ok(_)) => return,
            Ok(Err(s)) => s,
            Err(_) => Status::deadline_exceeded("no answer"),
        };
        if expired && s.code() == Code::NotFound {
            return;
        }
        let again = matches!(s.code(), Code::Unavailable | Code::DeadlineExceeded);
        if !again || Instant::now() + backoff >= give_up {
            eprintln!(
                "fairplace run: releasing lease {id}: {:?}: {}",
                s.code(),
                s.message()
            );
            return;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(RETRY_MAX);
    }
}

/// `fairplace run` whole: lease (or fallback), run, release; the exit
/// status. Says on stderr what it runs on.
pub async fn run(client: Option<&Client>, o: &RunOptions) -> Result<i32, String> {
    let cpus = obtain(client, o).await?;
    match &cpus {
        Cpus::Lease { id, node, cpus, .. } => {
            eprintln!("fairplace run: lease {id} on node {node}: CPUs {cpus}")
        }
        Cpus::Local { cpus, why } => {
            eprintln!(
                "fairplace run: warning: {why}; running on CPUs {cpus}, a local choice from this \
                 machine's runqueues, with no lease (other work may be placed there)"
            );
            if let Some(dir) = &o.textfile_dir
                && let Err(e) = count_fallback(dir)
            {
                eprintln!("fairplace run: warning: cannot count the fallback in {dir:?}: {e}");
            }
        }
    }
    run_on(client, o, &cpus).await
}

/// The metric file `fairplace run` keeps for node_exporter's textfile
/// collector (a short-lived command has no endpoint to scrape).
pub const FALLBACK_PROM: &str = "fairplace_run.prom";

/// Counts one local fallback in `dir/fairplace_run.prom`
/// (`fairplace_run_fallbacks_total`): read, increment and replace the file
/// under an exclusive lock, so concurrent runs on the node do not lose
/// counts, and rename it into place so the collector never reads half.
pub fn count_fallback(dir: &std::path::Path) -> std::io::Result<u64> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(".fairplace_run.lock"))?;
    // SAFETY: flock on a descriptor this function owns; released on close.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let path = dir.join(FALLBACK_PROM);
    let before = std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("fairplace_run_fallbacks_total "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    let n = before + 1;
    let tmp = dir.join(format!(".{FALLBACK_PROM}.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    writeln!(
        f,
        "# HELP fairplace_run_fallbacks_total fairplace run commands started on a local choice because the server did not answer."
    )?;
    writeln!(f, "# TYPE fairplace_run_fallbacks_total counter")?;
    writeln!(f, "fairplace_run_fallbacks_total {n}")?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn down() -> Result<pb::RenewLeaseResponse, Status> {
        Err(Status::unavailable("connection refused"))
    }

    #[test]
    fn renewals_back_off_while_the_server_is_down_and_stop_at_expiry() {
        let t0 = Instant::now();
        let mut k = Keeper::new(7, 30_000, t0);
        assert_eq!(k.next, t0 + Duration::from_secs(10));
        let t1 = t0 + Duration::from_secs(10);
        let line = k.after(down(), t1, "sleep").unwrap();
        assert!(
            line.contains("retrying until it expires in 20000 ms"),
            "{line}"
        );
        assert_eq!(k.next, t1 + RETRY_MIN);
        // Later failures back off (doubling, capped) and print nothing.
        let mut now = k.next;
        let mut waits = Vec::new();
        while !k.done {
            assert_eq!(k.after(down(), now, "sleep").is_some(), now >= k.expires);
            waits.push(k.next - now);
            now = k.next;
        }
        assert_eq!(
            waits[..5],
            [400, 800, 1600, 2000, 2000].map(Duration::from_millis)
        );
        assert_eq!(
            now,
            t0 + Duration::from_secs(30),
            "retried until the expiry"
        );
        assert!(!k.refused, "an expired lease is still released");
    }

    #[test]
    fn a_renewal_after_an_outage_resets_the_expiry_and_a_refusal_is_final() {
        let t0 = Instant::now();
        let mut k = Keeper::new(7, 3000, t0);
        k.after(down(), t0 + Duration::from_secs(1), "x");
        let t2 = t0 + Duration::from_secs(2);
        let line = k.after(Ok(pb::RenewLeaseResponse { ttl_ms: 6000 }), t2, "x");
        assert_eq!(
            line.as_deref(),
            Some("fairplace run: lease 7 renewed again")
        );
        assert_eq!(
            (k.expires, k.next, k.backoff),
            (
                t2 + Duration::from_secs(6),
                t2 + Duration::from_secs(2),
                RETRY_MIN
            )
        );
        let line = k
            .after(Err(Status::not_found("no lease 7")), t2, "x")
            .unwrap();
        assert!(line.contains("NotFound: no lease 7"), "{line}");
        assert!(k.done && k.refused);
    }
}
