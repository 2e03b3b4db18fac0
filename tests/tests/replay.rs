//! Recordings and their replay (docs/replay.md), with the real binaries: a
//! server recording (`--record`, and `fairplace record` over mutual TLS)
//! the real agent of this machine, simulated nodes with task lists and
//! hand-made nodes, under a load of every placement request; then
//! `fairplace-server replay` deciding it all again, under each switch, and
//! reading damaged segments.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fairplace_client::{Client, pb};
use fairplace_e2e::tls::TestPki;
use fairplace_e2e::{Agent, Reporter, Server, StateDir, bin, cli, rt, topology, wait_for};
use serde_json::Value;

/// `fairplace-server replay ARGS`: (exit code, stdout, stderr).
fn replay(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(bin("fairplace-server"))
        .arg("replay")
        .args(args)
        .output()
        .expect("run replay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn replay_json(dir: &Path, extra: &[&str]) -> Value {
    let mut args = vec![dir.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let (code, out, err) = replay(&args);
    assert!(code == 0 || code == 1, "replay failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn setting<'a>(report: &'a Value, label: &str) -> &'a Value {
    report["settings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["setting"] == label)
        .unwrap_or_else(|| panic!("no row for {label}: {report}"))
}

/// A small deterministic generator (the load differs by seed, never by run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: u32) -> u32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 33) % n as u64) as u32
    }
}

fn pick(node: &str, kind: pb::RequestKind, this: u32, task: pb::Task) -> pb::PickCpuRequest {
    pb::PickCpuRequest {
        node_id: node.into(),
        kind: kind as i32,
        this_cpu: this,
        task: Some(task),
        ..Default::default()
    }
}

/// Hand-made nodes where a seed switch decides otherwise, reported again
/// every half second so they stay fresh:
/// - `smt`: 4 SMT2 cores, CPUs 1, 3 and 5 busy, the idle core 6-7 outside
///   the task's CPUs: `select_idle_core` falls back to a thread, the
///   first met (2) or with PREFER_LAST_IDLE_CPU the last (0);
/// - `sidle`: CPU 0 runs only SCHED_IDLE work, CPU 2 is idle: a SCHED_IDLE
///   wakee of CPU 0 skips it (SKIP_SCHED_IDLE_FOR_IDLE_TASK) or takes it.
async fn hand_made_nodes(addr: String, stop: tokio::sync::watch::Receiver<bool>) {
    let mut smt = register(&addr, "smt", topology(1, 1, 4, 2)).await;
    let mut sidle = register(&addr, "sidle", topology(1, 1, 4, 1)).await;
    let smt_state = fairplace_e2e::states(8, &[1, 3, 5]);
    let mut sidle_state = fairplace_e2e::states(4, &[0, 1, 3]);
    sidle_state[0].h_nr_idle = 1;
    for seq in 1.. {
        if *stop.borrow() {
            return;
        }
        let full = seq == 1;
        let a = smt.update(seq, full, smt_state.clone(), "smt").await;
        let b = sidle.update(seq, full, sidle_state.clone(), "sidle").await;
        if a.is_err() || b.is_err() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Registers `id`, again while the server is busy registering the
/// simulated nodes.
async fn register(addr: &str, id: &str, t: pb::Topology) -> Reporter {
    for _ in 0..100 {
        match Reporter::register(addr, id, t.clone()).await {
            Ok(r) => return r,
            Err(s) if s.code() == tonic::Code::ResourceExhausted => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("{id}: {s}"),
        }
    }
    panic!("{id}: the server stayed busy")
}

/// Every kind of request, from a few callers, for `secs`: picks of every
/// kind and policy (claimed or not, some bound to one CPU), PickCpus
/// batches, CanMigrate, AllocateCpus and its release, Balance; and on the
/// hand-made nodes the requests their switches change.
async fn load(addr: &str, nodes: &[String], secs: u64, seed: u64) -> usize {
    let c = Client::connect(addr).await.unwrap();
    let mut r = Lcg(seed);
    let mut sent = 0;
    let t0 = Instant::now();
    let task = |r: &mut Lcg, n: u32| pb::Task {
        policy: r.next(3) as i32,
        prev_cpu: Some(r.next(n)),
        util_avg: r.next(900) as i64,
        load_avg: r.next(900) as i64,
        ..Default::default()
    };
    while t0.elapsed() < Duration::from_secs(secs) {
        for node in nodes {
            let n = if node.starts_with("sim") { 64 } else { 2 };
            let mut t = task(&mut r, n);
            if r.next(4) == 0 {
                let lo = r.next(n);
                t.cpus_allowed = format!("{lo}-{}", (lo + r.next(n - lo)).min(n - 1));
            }
            let kind = match r.next(3) {
                0 => pb::RequestKind::Wakeup,
                1 => pb::RequestKind::Fork,
                _ => pb::RequestKind::Exec,
            };
            let mut q = pick(node, kind, r.next(n), t);
            q.claim = r.next(3) == 0;
            q.sync = r.next(2) == 0;
            sent += c.pick_cpu(q).await.is_ok() as usize;
            // Exec of a task bound to one CPU: the fast path's case.
            let mut bound = task(&mut r, n);
            bound.cpus_allowed = r.next(n).to_string();
            sent += c
                .pick_cpu(pick(node, pb::RequestKind::Exec, 0, bound))
                .await
                .is_ok() as usize;
            let batch: Vec<_> = (0..8)
                .map(|_| pick(node, pb::RequestKind::Wakeup, r.next(n), task(&mut r, n)))
                .collect();
            sent += c
                .pick_cpus(batch)
                .await
                .map_or(0, |a| a.iter().filter(|x| x.is_ok()).count());
            let m = pb::CanMigrateRequest {
                node_id: node.clone(),
                src_cpu: r.next(n),
                dst_cpu: r.next(n),
                task: Some(task(&mut r, n)),
                ..Default::default()
            };
            sent += c.can_migrate(m).await.is_ok() as usize;
            if node.starts_with("sim") && r.next(4) == 0 {
                let a = c
                    .allocate_cpus(pb::AllocateCpusRequest {
                        node_id: node.clone(),
                        count: 1 + r.next(4),
                        policy: ["kernel", "cores", "llc", "spread"][r.next(4) as usize].into(),
                        holder: "replay test".into(),
                        ..Default::default()
                    })
                    .await;
                if let Ok(a) = a {
                    sent += 1;
                    let _ = c.release_cpus(a.lease_id).await;
                }
                let b = pb::BalanceRequest {
                    node_id: node.clone(),
                    ..Default::default()
                };
                let _ = c.balance(b).await;
            }
        }
        let mut smt = pick(
            "smt",
            pb::RequestKind::Wakeup,
            1,
            pb::Task {
                prev_cpu: Some(1),
                cpus_allowed: "0-5".into(),
                ..Default::default()
            },
        );
        smt.sync = r.next(2) == 0;
        sent += c.pick_cpu(smt).await.is_ok() as usize;
        let idle = pick(
            "sidle",
            pb::RequestKind::Wakeup,
            0,
            pb::Task {
                policy: pb::Policy::Idle as i32,
                prev_cpu: Some(0),
                ..Default::default()
            },
        );
        sent += c.pick_cpu(idle).await.is_ok() as usize;
    }
    sent
}

/// Starts a recording server with the real agent, simulated nodes with
/// task lists and the hand-made nodes; runs the load; stops the server
/// (its recording ends on a whole block). Returns how many requests were
/// answered.
fn record_cluster(dir: &Path, extra: &[&str], sims: &[&str], secs: u64) -> usize {
    let mut args = vec!["--lease-store", "memory", "--record", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    let mut server = Server::start(&args);
    let _real = Agent::start(&server.grpc, &["--node-id", "real", "--interval-ms", "200"]);
    let mut sim_args = vec!["--node-id", "sim", "--simulate-tasks"];
    sim_args.extend_from_slice(sims);
    if !sims.contains(&"--interval-ms") {
        sim_args.extend(["--interval-ms", "200"]);
    }
    let _sims = Agent::start(&server.grpc, &sim_args);
    let addr = server.grpc.clone();
    let sent = rt().block_on(async {
        let (stop_tx, stop) = tokio::sync::watch::channel(false);
        let hand = tokio::spawn(hand_made_nodes(addr.clone(), stop));
        let c = Client::connect(&addr).await.unwrap();
        let n_sims: usize = sims
            .windows(2)
            .find(|w| w[0] == "--simulate")
            .map_or(0, |w| w[1].parse().unwrap());
        let want = n_sims + 3;
        let mut tries = 0;
        let nodes = loop {
            let listed = c.list_nodes().await.unwrap();
            if listed.iter().filter(|n| n.fresh).count() >= want || tries > 300 {
                break listed;
            }
            tries += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let mut ids: Vec<String> = nodes
            .iter()
            .map(|n| n.id.clone())
            .filter(|id| id != "smt" && id != "sidle")
            .collect();
        ids.sort();
        assert!(ids.len() > n_sims, "nodes: {ids:?}");
        let callers: Vec<_> = (0..3)
            .map(|k| {
                let (addr, ids) = (addr.clone(), ids.clone());
                tokio::spawn(async move { load(&addr, &ids, secs, 7 + k).await })
            })
            .collect();
        let mut sent = 0;
        for c in callers {
            sent += c.await.unwrap();
        }
        let _ = stop_tx.send(true);
        let _ = hand.await;
        sent
    });
    assert!(server.stop().success(), "the server exits cleanly");
    sent
}

/// Each line of the text report the issue names, checked for its form.
fn check_line_forms(text: &str) {
    let reproduced = text
        .lines()
        .find(|l| l.starts_with("replay: ") && l.ends_with(" answers reproduced"))
        .unwrap_or_else(|| panic!("no reproduced line:\n{text}"));
    let frac = reproduced
        .trim_start_matches("replay: ")
        .trim_end_matches(" answers reproduced");
    let (a, n) = frac.split_once('/').unwrap();
    assert_eq!(a, n, "{reproduced}");
    let switches: Vec<&str> = text.lines().filter(|l| l.starts_with("switch ")).collect();
    assert!(!switches.is_empty(), "{text}");
    for l in switches {
        // switch NAME=on|off: D of N decisions changed, scanned S -> S', next-report idle I % -> I' %
        let (head, rest) = l.split_once(": ").unwrap();
        for part in head.trim_start_matches("switch ").split(',') {
            let (name, value) = part.split_once('=').unwrap();
            assert!(
                name.chars().all(|c| c.is_ascii_uppercase() || c == '_'),
                "{l}"
            );
            assert!(value == "on" || value == "off", "{l}");
        }
        let w: Vec<&str> = rest.split(' ').collect();
        assert_eq!(w[1], "of", "{l}");
        assert_eq!(&w[3..6], &["decisions", "changed,", "scanned"], "{l}");
        assert_eq!(w[7], "->", "{l}");
        assert_eq!(&w[9..11], &["next-report", "idle"], "{l}");
        assert_eq!((w[12], w[13], w[15]), ("%", "->", "%"), "{l}");
        for num in [w[0], w[2]] {
            num.parse::<u64>().unwrap();
        }
        for num in [w[6], w[8].trim_end_matches(','), w[11], w[14]] {
            num.parse::<f64>().unwrap();
        }
    }
}

#[test]
fn a_recorded_cluster_replays_whole_and_each_switch_has_its_row() {
    let dir = StateDir::new("recording");
    let rec = dir.0.join("rec");
    let sent = record_cluster(&rec, &[], &["--simulate", "4", "--simulate-cpus", "64"], 4);
    assert!(sent > 300, "{sent} requests answered");
    let chart = dir.0.join("chart.svg");
    let report = replay_json(&rec, &["--each-switch", "--chart", chart.to_str().unwrap()]);

    // Every answer the same under the recorded features.
    let decisions = report["decisions"].as_u64().unwrap();
    assert_eq!(
        report["reproduced"].as_u64().unwrap(),
        decisions,
        "{}",
        report["mismatches"]
    );
    assert!(
        decisions as usize >= sent * 9 / 10,
        "{decisions} of {sent} replayed"
    );
    assert_eq!(report["no_state"], 0);
    assert_eq!(report["bad_states"], 0, "{}", report["bad_state_reasons"]);
    assert!(
        report["balances"].as_u64().unwrap() > 0,
        "balance passes are recorded"
    );

    // Each seed switch has its row, over every decision.
    for label in [
        "PREFER_LAST_IDLE_CPU=on",
        "SKIP_SCHED_IDLE_FOR_IDLE_TASK=off",
        "EXEC_BOUND_FAST_PATH=off",
        "SC_VISIT=on",
        "SIS_UTIL=off",
        "WA_IDLE=off",
        "WA_WEIGHT=off",
        "WA_BIAS=off",
    ] {
        assert_eq!(
            setting(&report, label)["decisions"].as_u64().unwrap(),
            decisions
        );
    }
    // The hand-made nodes' switches change their requests.
    let last = setting(&report, "PREFER_LAST_IDLE_CPU=on");
    assert!(last["changed"].as_u64().unwrap() > 0, "{last}");
    let sidle = setting(&report, "SKIP_SCHED_IDLE_FOR_IDLE_TASK=off");
    assert!(sidle["changed"].as_u64().unwrap() > 0, "{sidle}");
    // Taking CPU 0 (SCHED_IDLE-only) shows at the next report.
    assert!(
        sidle["after"]["sched_idle_only"].as_u64() > sidle["before"]["sched_idle_only"].as_u64(),
        "{sidle}"
    );
    // A one-CPU exec lands where it must either way; without the fast
    // path it takes the slow path there, and only execs change path.
    let exec = setting(&report, "EXEC_BOUND_FAST_PATH=off");
    assert_eq!(exec["changed"], 0, "{exec}");
    let bound = &exec["by_path"]["exec bound"];
    assert!(bound["decisions"].as_u64().unwrap() > 0, "{exec}");
    assert_eq!(bound["path_changed"], bound["decisions"], "{exec}");
    assert_eq!(exec["path_changed"], bound["path_changed"], "{exec}");
    // task_cache_work's scan is no placement: nothing can change.
    for label in ["SC_VISIT=on", "SC_NODE=on"] {
        let s = setting(&report, label);
        assert_eq!(s["changed"], 0, "{s}");
        assert_eq!(s["path_changed"], 0, "{s}");
        assert_eq!(s["scanned_mean_after"], s["scanned_mean_before"], "{s}");
        assert_eq!(s["after"]["idle"], s["before"]["idle"], "{s}");
    }
    // Placements were judged against later reports.
    assert!(last["before"]["judged"].as_u64().unwrap() > 0, "{last}");

    // The text report's lines, and the chart.
    let (code, text, _) = replay(&[
        rec.to_str().unwrap(),
        "--switch",
        "PREFER_LAST_IDLE_CPU=on",
        "--switch",
        "SIS_UTIL=off,WA_WEIGHT=off",
    ]);
    assert_eq!(code, 0, "{text}");
    check_line_forms(&text);
    assert!(
        text.contains("switch SIS_UTIL=off,WA_WEIGHT=off: "),
        "{text}"
    );
    let svg = std::fs::read_to_string(&chart).unwrap();
    assert!(svg.starts_with("<svg"), "{svg}");
    assert!(svg.contains("PREFER_LAST_IDLE_CPU=on") && svg.trim_end().ends_with("</svg>"));
}

/// The blocks of a segment as the format describes them: (offset, whole
/// length), read independently of the server's reader.
fn blocks(bytes: &[u8]) -> Vec<(usize, usize)> {
    let mut out = vec![];
    let mut at = 12;
    while at + 13 <= bytes.len() {
        let stored = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        out.push((at, 13 + stored));
        at += 13 + stored;
    }
    out
}

fn segment_names(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "fprec"))
        .collect();
    v.sort();
    v
}

#[test]
fn segments_rotate_within_the_budget_and_damage_is_named_by_segment_and_offset() {
    let dir = StateDir::new("recording");
    let rec = dir.0.join("rec");
    let budget = 1u64 << 20;
    record_cluster(
        &rec,
        &["--record-max-bytes", &budget.to_string()],
        &[
            "--simulate",
            "8",
            "--simulate-cpus",
            "256",
            "--simulate-churn-pct",
            "60",
            "--interval-ms",
            "100",
        ],
        8,
    );
    let segs = segment_names(&rec);
    assert!(segs.len() >= 3, "segments: {segs:?}");
    let total: u64 = segs.iter().map(|p| p.metadata().unwrap().len()).sum();
    // Within the budget but for the last block written (a block holds
    // about 64 KiB of entries before compression).
    assert!(total <= budget + (64 << 10), "{total} bytes in {segs:?}");
    let first = segs[0].file_name().unwrap().to_str().unwrap().to_string();
    assert_ne!(first, "00000001.fprec", "the oldest segments were deleted");

    // What is left replays whole: each segment starts from a keyframe.
    let whole = replay_json(&rec, &[]);
    let all = whole["decisions"].as_u64().unwrap();
    assert!(all > 0);
    assert_eq!(
        whole["reproduced"].as_u64().unwrap(),
        all,
        "{}",
        whole["mismatches"]
    );
    assert_eq!(whole["no_state"], 0);

    // A flipped byte inside the second block of the second segment, and the
    // last segment cut short in its last block.
    let mid = &segs[1];
    let mut bytes = std::fs::read(mid).unwrap();
    let b = blocks(&bytes);
    assert!(b.len() >= 3, "{} blocks", b.len());
    let (flip_at, len) = b[1];
    bytes[flip_at + 13 + (len - 13) / 2] ^= 0x5a;
    std::fs::write(mid, &bytes).unwrap();
    let last = segs.last().unwrap();
    let last_bytes = std::fs::read(last).unwrap();
    let lb = blocks(&last_bytes);
    let (cut_at, _) = *lb.last().unwrap();
    std::fs::write(last, &last_bytes[..last_bytes.len() - 5]).unwrap();

    let (code, text, err) = replay(&[rec.to_str().unwrap()]);
    assert_eq!(code, 0, "{text}{err}");
    let mid_name = mid.file_name().unwrap().to_str().unwrap();
    let last_name = last.file_name().unwrap().to_str().unwrap();
    assert!(
        text.contains(&format!(
            "replay: damaged: {mid_name} at offset {flip_at}: block checksum mismatch"
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "replay: damaged: {last_name} at offset {cut_at}: truncated block"
        )),
        "{text}"
    );
    // The rest replays, and agrees.
    let damaged = replay_json(&rec, &[]);
    let n = damaged["decisions"].as_u64().unwrap();
    assert!(n > 0 && n < all, "{n} of {all}");
    assert_eq!(damaged["reproduced"].as_u64().unwrap(), n);
    assert_eq!(damaged["damaged"].as_array().unwrap().len(), 2);
}

#[test]
fn an_admin_records_a_running_server_over_mutual_tls() {
    let pki = TestPki::new();
    let mut args: Vec<String> = pki.server_args();
    args.extend(["--lease-store", "memory"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let server = Server::start(&args);
    let node = pki.client("node", "sim-sim-0");
    let mut agent_args = TestPki::cli_args(&node);
    agent_args.extend(
        [
            "--simulate",
            "1",
            "--simulate-cpus",
            "16",
            "--node-id",
            "sim",
            "--interval-ms",
            "200",
        ]
        .map(String::from),
    );
    let agent_args: Vec<&str> = agent_args.iter().map(String::as_str).collect();
    let _agent = Agent::spawn(&server.grpc, &agent_args);
    let as_role = |role: &str| TestPki::cli_args(&pki.client(role, "cli"));
    let with = |role: &str, rest: &[&str]| {
        let mut a = as_role(role);
        a.extend(rest.iter().map(|s| s.to_string()));
        a
    };
    let run = |args: Vec<String>| {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        cli(&server.grpc, &a)
    };
    wait_for(Duration::from_secs(10), "the node", || {
        let (code, out, _) = run(with("orchestrator", &["nodes"]));
        (code == 0 && out.contains("fresh")).then_some(())
    });
    let dir = StateDir::new("recording");
    let rec = dir.0.join("admin");
    let recorder = {
        let a = with(
            "admin",
            &["record", rec.to_str().unwrap(), "--seconds", "3"],
        );
        let server = server.grpc.clone();
        std::thread::spawn(move || {
            let a: Vec<&str> = a.iter().map(String::as_str).collect();
            cli(&server, &a)
        })
    };
    std::thread::sleep(Duration::from_millis(500));
    for k in 0..20 {
        let this = (k % 16).to_string();
        let (code, out, err) = run(with(
            "orchestrator",
            &[
                "pick",
                "sim-sim-0",
                "--this-cpu",
                &this,
                "--prev-cpu",
                &this,
            ],
        ));
        assert_eq!(code, 0, "{out}{err}");
    }
    let (code, out, err) = recorder.join().unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.starts_with("recorded "), "{out}");
    let report = replay_json(&rec, &[]);
    let n = report["decisions"].as_u64().unwrap();
    assert!(n >= 20, "{report}");
    assert_eq!(report["reproduced"].as_u64().unwrap(), n);

    // At most four recordings stream at once; a slot comes back when one ends.
    let streams: Vec<_> = (0..4)
        .map(|k| {
            let dir = dir.0.join(format!("many-{k}"));
            let a = with(
                "admin",
                &["record", dir.to_str().unwrap(), "--seconds", "3"],
            );
            let server = server.grpc.clone();
            std::thread::spawn(move || {
                let a: Vec<&str> = a.iter().map(String::as_str).collect();
                cli(&server, &a)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1500));
    let fifth = dir.0.join("fifth");
    let (code, _, err) = run(with(
        "admin",
        &["record", fifth.to_str().unwrap(), "--seconds", "1"],
    ));
    assert_ne!(code, 0);
    assert!(err.contains("ResourceExhausted"), "{err}");
    for t in streams {
        let (code, out, err) = t.join().unwrap();
        assert_eq!(code, 0, "{out}{err}");
    }
    let (code, out, err) = run(with(
        "admin",
        &["record", fifth.to_str().unwrap(), "--seconds", "1"],
    ));
    assert_eq!(code, 0, "{out}{err}");

    // Only admins record; a bad duration is refused by name.
    let (code, _, err) = run(with(
        "orchestrator",
        &["record", rec.to_str().unwrap(), "--seconds", "1"],
    ));
    assert_ne!(code, 0);
    assert!(err.contains("PermissionDenied"), "{err}");
    let (code, _, err) = run(with(
        "admin",
        &["record", rec.to_str().unwrap(), "--seconds", "0"],
    ));
    assert_ne!(code, 0);
    assert!(
        err.contains("InvalidArgument") && err.contains("seconds"),
        "{err}"
    );
}

#[test]
fn replay_refuses_what_is_not_a_recording_by_name() {
    let dir = StateDir::new("recording");
    let (code, _, err) = replay(&[dir.0.join("missing").to_str().unwrap()]);
    assert_eq!(code, 2);
    assert!(err.contains("missing"), "{err}");
    let (code, _, err) = replay(&[dir.path()]);
    assert_eq!(code, 2);
    assert!(err.contains("no recording segments"), "{err}");
    let (code, _, err) = replay(&[dir.path(), "--switch", "NO_SUCH=on"]);
    assert_eq!(code, 2);
    assert!(err.contains("NO_SUCH") && err.contains("--switch"), "{err}");
    let (code, _, err) = replay(&[dir.path(), "--switch", "SIS_UTIL=maybe"]);
    assert_eq!(code, 2);
    assert!(err.contains("SIS_UTIL=maybe"), "{err}");
    std::fs::write(dir.0.join("00000001.fprec"), b"not a recording at all").unwrap();
    let (code, out, _) = replay(&[dir.path()]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("replay: damaged: 00000001.fprec at offset 0: not a fairplace recording"),
        "{out}"
    );
    assert!(out.contains("replay: 0/0 answers reproduced"), "{out}");
}
