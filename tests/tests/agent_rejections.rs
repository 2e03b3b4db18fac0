//! The agent's stream against the real server when the server refuses part
//! of its updates: the part is left out, the node stays fresh, and the
//! rejections stop instead of looping.

use std::time::Duration;

use fairplace_agent::{Source, StreamConfig, StreamStats, TaskReport, stream};
use fairplace_client::Client;
use fairplace_e2e::{Server, pb, states, topology};
use tokio::sync::watch;

/// A 4-CPU node whose every CPU lists two tasks both marked running: the
/// server refuses such lists ("a second running task"), whatever their
/// size, until the agent's cut leaves one task per CPU. It also sends more
/// runtime entries than the server takes, all valid.
struct TwoRunning;

impl Source for TwoRunning {
    fn topology(&self) -> pb::Topology {
        topology(1, 1, 2, 2)
    }

    fn sample(&mut self) -> Vec<pb::CpuState> {
        let mut s = states(4, &[0, 1, 2, 3]);
        for c in &mut s {
            c.nr_running = 2;
        }
        s
    }

    fn sample_tasks(&mut self) -> Option<TaskReport> {
        let cpus = (0..4u32)
            .map(|cpu| pb::CpuTasks {
                cpu,
                tasks: (0..2u64)
                    .map(|j| pb::RunnableTask {
                        id: cpu as u64 * 10 + j + 1,
                        group: 5,
                        load_avg: 500 + j as i64,
                        util_avg: 300,
                        runnable_avg: 500,
                        running: true,
                        exec_start: 1_000,
                        nr_threads: 8,
                        ..Default::default()
                    })
                    .collect(),
                clock_task: 2_000,
            })
            .collect();
        // 1,000 processes on every CPU: far beyond the server's limit.
        let runtime = (1..=1_000u64)
            .flat_map(|g| {
                (0..4u32).map(move |cpu| pb::ProcessRuntime {
                    group: g,
                    cpu,
                    runtime_ns: g * 1_000,
                    nr_threads: 1,
                })
            })
            .collect();
        Some(TaskReport { cpus, runtime })
    }
}

#[test]
fn a_refused_part_is_left_out_the_node_stays_fresh_and_rejections_stop() {
    let server = Server::start(&["--stale-after-ms", "600"]);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (stop_tx, stop_rx) = watch::channel(false);
        let (stats_tx, stats) = watch::channel(StreamStats::default());
        let cfg = StreamConfig {
            server: server.grpc.clone(),
            node_id: "shed".into(),
            labels: vec![],
            interval: Duration::from_millis(40),
            backoff_min: Duration::from_millis(50),
            backoff_max: Duration::from_millis(200),
            max_message_bytes: 4 << 20,
            tls: Default::default(),
            trust_domain: "fairplace".into(),
            // In memory only (no state file), the default apply roots.
            leases: Default::default(),
        };
        let task = tokio::spawn(stream(cfg, TwoRunning, stop_rx, stats_tx));
        let c = Client::connect(&server.grpc).await.unwrap();
        // Every 100 ms for 3 s: the node is fresh all along (a rejected
        // update is followed by an applied one without the refused part).
        let mut ages = Vec::new();
        for i in 0..30 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let Ok(n) = c.get_node("shed").await else {
                assert!(i < 5, "the node registers");
                continue;
            };
            let s = n.summary.unwrap();
            if s.state_version > 1 {
                assert!(s.fresh, "fresh at {i}: age {}", s.age_seconds);
                ages.push(s.age_seconds);
            }
        }
        let before = stats.borrow().clone();
        tokio::time::sleep(Duration::from_millis(800)).await;
        let after = stats.borrow().clone();
        stop_tx.send(true).unwrap();
        task.await.unwrap();
        // One cut per rejection, from 1,024 tasks per CPU down to 1: about
        // ten, then none.
        assert!(
            (1..=12).contains(&before.rejections),
            "rejections: {before:?}"
        );
        assert_eq!(after.rejections, before.rejections, "no loop: {after:?}");
        assert!(after.updates_sent >= before.updates_sent + 10);
        assert_eq!(after.connects, 1, "rejections never end the stream");
        let max_age = ages.iter().cloned().fold(0.0f64, f64::max);
        assert!(max_age < 0.3, "state age at most {max_age} s");
        // What the server holds in the end: one task per CPU (the running
        // one, the bigger).
        let n = c.get_node("shed").await.unwrap();
        let listed: Vec<usize> = n.tasks.iter().map(|l| l.tasks.len()).collect();
        assert_eq!(listed, vec![1; 4], "{:?}", n.tasks);
        assert!(n.tasks.iter().all(|l| l.tasks[0].load_avg == 501));
    });
}
