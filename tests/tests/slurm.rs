//! The SPANK plugin with the real Slurm (Debian's 22.05): munged,
//! slurmctld and slurmd on this machine, the fairplace server and the real
//! agent beside them, `libfairplace_spank.so` in plugstack.conf. Each test
//! reads back what the tasks themselves saw (`/proc/self/status`) and what
//! the server holds (GetNode's leases).
//!
//! Skipped where Slurm is not installed, unless `FAIRPLACE_REQUIRE_SLURM`
//! is set (CI installs it and sets it).

use std::process::Child;
use std::time::{Duration, Instant};

use fairplace_client::Client;
use fairplace_e2e::slurm::{self, Slurm, busy_loop};
use fairplace_e2e::tls::{TestPki, TlsOptions};
use fairplace_e2e::{Agent, Server, pb, rt, send_signal, wait_for};

/// The server, the real agent for this machine, and Slurm with the plugin
/// (`args` after `server=`), the node registered.
struct Rig {
    server: Server,
    _agent: Agent,
    slurm: Slurm,
    node: String,
    rt: tokio::runtime::Runtime,
    /// With mutual TLS: the PKI, and the test's own orchestrator identity.
    tls: Option<(TestPki, TlsOptions)>,
}

fn rig(args: &str) -> Option<Rig> {
    rig_with(args, None)
}

/// With `pki`: the server serves mutual TLS only, the agent presents
/// `node/HOSTNAME`, the plugin `orchestrator/slurm` (its files in `args`
/// come from the caller).
fn rig_with(args: &str, pki: Option<TestPki>) -> Option<Rig> {
    if let Err(why) = slurm::available() {
        eprintln!("skipped: {why}");
        return None;
    }
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: the placements need two CPUs");
        return None;
    }
    let plugin = slurm::plugin();
    let node = fairplace_types::state_dir::hostname();
    let server_args = pki.as_ref().map(TestPki::server_args).unwrap_or_default();
    let server_args: Vec<&str> = server_args.iter().map(String::as_str).collect();
    let server = Server::start(&server_args);
    let agent_args = pki
        .as_ref()
        .map(|p| TestPki::cli_args(&p.client("node", &node)))
        .unwrap_or_default();
    let agent_args: Vec<&str> = agent_args.iter().map(String::as_str).collect();
    let agent = Agent::start(&server.grpc, &agent_args);
    let tls = pki.map(|p| {
        let me = p.client("orchestrator", "test");
        (p, me)
    });
    let plugstack = format!(
        "required {} server={} {args}\n",
        plugin.display(),
        server.grpc
    );
    let slurm = Slurm::start(&plugstack);
    let r = Rig {
        server,
        _agent: agent,
        slurm,
        node,
        rt: rt(),
        tls,
    };
    wait_for(
        Duration::from_secs(20),
        "the agent's node at the server",
        || r.try_node().ok(),
    );
    Some(r)
}

impl Rig {
    fn try_node(&self) -> Result<pb::GetNodeResponse, tonic::Status> {
        self.rt.block_on(async {
            let c = match &self.tls {
                None => Client::connect(&self.server.grpc)
                    .await
                    .map_err(|e| tonic::Status::unavailable(e.to_string()))?,
                Some((_, me)) => Client::connect_tls(&self.server.grpc, me)
                    .await
                    .map_err(tonic::Status::unavailable)?,
            };
            c.get_node(&self.node).await
        })
    }

    /// The node's leases held for Slurm tasks, by holder.
    fn slurm_leases(&self) -> Vec<pb::Lease> {
        let mut l: Vec<pb::Lease> = self
            .try_node()
            .expect("GetNode")
            .leases
            .into_iter()
            .filter(|l| l.holder.starts_with("slurm "))
            .collect();
        l.sort_by(|a, b| a.holder.cmp(&b.holder));
        l
    }

    /// Waits for the server to see CPU `cpu` running something.
    fn wait_busy(&self, cpu: u32) {
        wait_for(
            Duration::from_secs(20),
            "the busy CPU at the server",
            || {
                let n = self.try_node().ok()?;
                n.cpus
                    .iter()
                    .any(|c| c.id == cpu && c.nr_running >= 1)
                    .then_some(())
            },
        );
    }
}

/// The job id a Slurm lease's holder names (`slurm 17.0 task 1` -> 17).
fn job_of(lease: &pb::Lease) -> String {
    let step = lease.holder.split_whitespace().nth(1).unwrap_or_default();
    step.split('.').next().unwrap_or_default().to_string()
}

/// The CPU list in a `grep Cpus_allowed_list /proc/self/status` line.
fn cpus_of(line: &str) -> Option<String> {
    line.split_once("Cpus_allowed_list:")
        .map(|(_, c)| c.trim().to_string())
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

struct Killed(Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_steps_tasks_run_on_their_leases_listed_while_they_run_and_gone_after() {
    let Some(r) = rig("ttl_ms=10000") else { return };
    // Each task prints its job, task and CPUs, then stays a while.
    let script = "echo \"task $SLURM_JOB_ID $SLURM_LOCALID $(grep Cpus_allowed_list /proc/self/status)\"; sleep 4";
    let child = r
        .slurm
        .spawn("srun", &["-n2", "--fairplace=kernel", "sh", "-c", script]);
    let running = wait_for(Duration::from_secs(30), "two Slurm leases", || {
        let l = r.slurm_leases();
        (l.len() == 2).then_some(l)
    });
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "srun: {}", text(&out.stderr));
    let stdout = text(&out.stdout);
    let mut seen = Vec::new();
    for line in stdout.lines().filter(|l| l.starts_with("task ")) {
        let mut w = line.split_whitespace();
        let (job, task) = (w.nth(1).unwrap(), w.next().unwrap());
        let cpus = cpus_of(line).expect("the task's CPUs");
        let holder = format!("slurm {job}.0 task {task}");
        let lease = running
            .iter()
            .find(|l| l.holder == holder)
            .unwrap_or_else(|| panic!("no lease for {holder} among {running:?}"));
        assert_eq!(lease.cpus, cpus, "{holder} runs where its lease says");
        seen.push(cpus);
    }
    assert_eq!(seen.len(), 2, "both tasks printed: {stdout}");
    assert_ne!(seen[0], seen[1], "two tasks never share a leased CPU");
    // Released at each task's exit, before srun returned.
    assert!(
        r.slurm_leases().is_empty(),
        "leases outlived their tasks: {:?}",
        r.slurm_leases()
    );
}

#[test]
fn a_one_cpu_exclusive_step_lands_on_an_idle_cpu_where_slurm_alone_binds_it_to_a_busy_one() {
    let Some(r) = rig("") else { return };
    let probe = [
        "-n1",
        "--exclusive",
        "grep",
        "Cpus_allowed_list",
        "/proc/self/status",
    ];
    let alone = |policy: &str| {
        let mut args = vec![policy];
        args.extend(probe);
        let o = r.slurm.run("srun", &args);
        assert!(o.status.success(), "srun: {}", text(&o.stderr));
        cpus_of(&text(&o.stdout)).expect("the task's CPUs")
    };
    let slurms = alone("--fairplace=off");
    let _busy = Killed(busy_loop(&slurms));
    r.wait_busy(
        slurms
            .parse()
            .expect("Slurm binds a one-CPU task to one CPU"),
    );
    assert_eq!(
        alone("--fairplace=off"),
        slurms,
        "Slurm alone binds to the busy CPU again"
    );
    let placed = alone("--fairplace=kernel");
    assert_ne!(placed, slurms, "fairplace placed the task on the busy CPU");
    assert!(
        placed.parse::<u32>().is_ok(),
        "one CPU for a one-CPU task: {placed}"
    );
}

#[test]
fn a_batch_job_and_its_steps_are_placed_the_same_way() {
    let Some(r) = rig("") else { return };
    let slurms = r.slurm.own_binding();
    let _busy = Killed(busy_loop(&slurms));
    r.wait_busy(slurms.parse().unwrap());
    let out = r.slurm.path("batch.out");
    let script = "echo \"batch $(grep Cpus_allowed_list /proc/self/status)\"; sleep 3; \
                  srun -n1 sh -c 'echo \"step $(grep Cpus_allowed_list /proc/self/status)\"'";
    let o = r.slurm.run(
        "sbatch",
        &[
            "-n1",
            "--exclusive",
            "--fairplace=kernel",
            "-o",
            out.to_str().unwrap(),
            "--wrap",
            script,
        ],
    );
    assert!(o.status.success(), "sbatch: {}", text(&o.stderr));
    let job = text(&o.stdout)
        .split_whitespace()
        .last()
        .unwrap()
        .to_string();
    let batch = wait_for(Duration::from_secs(30), "the batch script's lease", || {
        r.slurm_leases()
            .into_iter()
            .find(|l| l.holder == format!("slurm {job}.batch task 0"))
    });
    let printed = wait_for(Duration::from_secs(60), "the job's output", || {
        let t = std::fs::read_to_string(&out).ok()?;
        t.contains("step ").then_some(t)
    });
    let line = |tag: &str| {
        printed
            .lines()
            .find(|l| l.starts_with(tag))
            .and_then(cpus_of)
            .unwrap_or_else(|| panic!("no {tag} line in {printed}"))
    };
    assert_eq!(
        line("batch "),
        batch.cpus,
        "the script runs where its lease says"
    );
    assert_ne!(batch.cpus, slurms, "the script was placed on the busy CPU");
    assert_ne!(
        line("step "),
        batch.cpus,
        "the job's step shares the script's leased CPU"
    );
    wait_for(Duration::from_secs(10), "the job's leases released", || {
        r.slurm_leases().is_empty().then_some(())
    });
}

#[test]
fn with_the_server_stopped_or_stalled_steps_run_on_slurms_binding() {
    let Some(mut r) = rig("timeout_ms=1000") else {
        return;
    };
    let step = |r: &Rig| {
        let o = r.slurm.run(
            "srun",
            &[
                "-n2",
                "--fairplace=kernel",
                "grep",
                "Cpus_allowed_list",
                "/proc/self/status",
            ],
        );
        assert!(o.status.success(), "the step failed: {}", text(&o.stderr));
        text(&o.stdout).lines().filter_map(cpus_of).count()
    };
    // Stalled: accepts, never answers.
    send_signal(r.server.pid(), libc::SIGSTOP);
    assert_eq!(step(&r), 2, "both tasks ran while the server was stalled");
    send_signal(r.server.pid(), libc::SIGCONT);
    // Gone.
    r.server.stop();
    assert_eq!(step(&r), 2, "both tasks ran with the server stopped");
    let log = r.slurm.slurmd_log();
    let kept: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("keeps Slurm's binding"))
        .collect();
    assert!(
        kept.iter()
            .any(|l| l.contains("no answer") || l.contains("Timeout")),
        "no line says the server was too slow: {kept:?}"
    );
    assert!(
        kept.iter().any(|l| l.contains("connect")),
        "no line says the server could not be reached: {kept:?}"
    );
}

#[test]
fn scancel_and_a_killed_slurmstepd_leave_no_lease_past_its_ttl() {
    let ttl = Duration::from_secs(3);
    let Some(r) = rig(&format!("ttl_ms={}", ttl.as_millis())) else {
        return;
    };
    let lease_of = |r: &Rig| {
        wait_for(Duration::from_secs(30), "the task's lease", || {
            r.slurm_leases().into_iter().next()
        })
    };
    // Renewed while the task runs: the same lease lives past twice its TTL.
    let mut srun = Killed(
        r.slurm
            .spawn("srun", &["-n1", "--fairplace=kernel", "sleep", "300"]),
    );
    let first = lease_of(&r);
    std::thread::sleep(ttl * 2);
    let later = r.slurm_leases();
    assert!(
        later.iter().any(|l| l.lease_id == first.lease_id),
        "the lease of a running task was not renewed: {later:?}"
    );
    let job = job_of(&first);
    let o = r.slurm.run("scancel", &[&job]);
    assert!(o.status.success());
    wait_for(
        ttl + Duration::from_secs(5),
        "the cancelled task's lease gone",
        || r.slurm_leases().is_empty().then_some(()),
    );
    let _ = srun.0.wait();

    // slurmstepd killed: nothing renews or releases; the TTL ends it.
    let _srun = Killed(
        r.slurm
            .spawn("srun", &["-n1", "--fairplace=kernel", "sleep", "300"]),
    );
    let lease = lease_of(&r);
    let job = job_of(&lease);
    let stepds = r.slurm.stepds(&job);
    assert!(!stepds.is_empty(), "no slurmstepd for job {job}");
    let killed = Instant::now();
    for pid in stepds {
        send_signal(pid, libc::SIGKILL);
    }
    wait_for(
        ttl + Duration::from_secs(5),
        "the dead step's lease expired",
        || r.slurm_leases().is_empty().then_some(()),
    );
    eprintln!(
        "the dead step's lease ended {:?} after the kill (TTL {ttl:?})",
        killed.elapsed()
    );
    let _ = r.slurm.run("scancel", &[&job]);
}

#[test]
fn bad_arguments_are_refused_by_name_and_an_optional_plugin_never_stops_a_step() {
    let Some(r) = rig("") else { return };
    let o = r.slurm.run("srun", &["-n1", "--fairplace=fastest", "true"]);
    assert!(!o.status.success(), "srun took --fairplace=fastest");
    assert!(text(&o.stderr).contains("fastest"), "{}", text(&o.stderr));

    let plugin = slurm::plugin();
    let bad = format!(
        "{} server={} polcy=kernel\n",
        plugin.display(),
        r.server.grpc
    );
    r.slurm.set_plugstack(&format!("required {bad}"));
    let o = r.slurm.run("srun", &["-n1", "true"]);
    assert!(
        !o.status.success(),
        "a required plugin with a bad argument let the step run"
    );
    assert!(
        text(&o.stderr).contains("polcy=kernel"),
        "the error does not name the argument: {}",
        text(&o.stderr)
    );

    r.slurm.set_plugstack(&format!("optional {bad}"));
    let o = r.slurm.run("srun", &["-n1", "true"]);
    assert!(
        o.status.success(),
        "an optional plugin stopped the step: {}",
        text(&o.stderr)
    );
}

#[test]
fn over_mutual_tls_the_plugin_leases_as_its_orchestrator_identity() {
    let pki = TestPki::new();
    let plugin = pki.client("orchestrator", "slurm");
    let files = |o: &Option<std::path::PathBuf>| o.as_ref().unwrap().display().to_string();
    let args = format!(
        "tls_ca={} tls_cert={} tls_key={}",
        files(&plugin.ca),
        files(&plugin.cert),
        files(&plugin.key)
    );
    let Some(r) = rig_with(&args, Some(pki)) else {
        return;
    };
    let child = r.slurm.spawn(
        "srun",
        &[
            "-n1",
            "--fairplace=kernel",
            "sh",
            "-c",
            "grep Cpus_allowed_list /proc/self/status; sleep 3",
        ],
    );
    let lease = wait_for(Duration::from_secs(30), "the task's lease", || {
        r.slurm_leases().into_iter().next()
    });
    assert_eq!(
        lease.owner, "spiffe://fairplace/orchestrator/slurm",
        "{lease:?}"
    );
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "srun: {}", text(&out.stderr));
    assert_eq!(
        cpus_of(&text(&out.stdout)).as_deref(),
        Some(lease.cpus.as_str())
    );
    assert!(
        r.slurm_leases().is_empty(),
        "released by its owner at the task's exit"
    );
}
