//! `fairplace-load cache`: a 512-CPU node with 8 LLCs reports a 16-thread
//! process's runtime on one LLC; task_cache_work runs with the full scan,
//! then with SC_VISIT, and the server's own `fairplace_cache_scan_cpus`
//! histogram gives the CPUs each pass read.
//!
//! Why: SC_VISIT is meant to make a pass read fewer CPUs than the full
//! scan for the same answer; the server's metric counts what it read, and
//! the process's preferred CPU and LLC show the answer.

use std::time::Duration;

use fairplace_client::{Client, pb};
use pb::agent_message::Body;

use crate::shared::{Launch, NodeStream, Server, channel, register_node};

#[derive(clap::Args)]
pub struct Opts {
    /// Reports (10 ms apart) per strategy.
    #[arg(long, default_value_t = 50)]
    pub reports: u32,
}

/// 2 NUMA nodes x 4 LLCs x 32 cores x SMT2.
fn topology_512() -> pb::Topology {
    pb::Topology {
        cpus: (0..512)
            .map(|i| pb::CpuTopology {
                id: i,
                core: i / 2,
                cluster: None,
                llc: i / 64,
                node: i / 256,
                capacity: 1024,
            })
            .collect(),
        numa_distance: vec![],
    }
}

/// The server's `fairplace_cache_scan_cpus` sum and count for a strategy.
fn scan_histogram(metrics: &str, strategy: &str) -> (f64, f64) {
    use std::io::{Read, Write};
    let mut c = std::net::TcpStream::connect(metrics).expect("metrics");
    write!(c, "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\n\r\n").unwrap();
    let mut body = String::new();
    c.read_to_string(&mut body).unwrap();
    let get = |suffix: &str| {
        body.lines()
            .find(|l| {
                l.starts_with(&format!("fairplace_cache_scan_cpus_{suffix}{{"))
                    && l.contains(&format!("strategy=\"{strategy}\""))
            })
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    };
    (get("sum"), get("count"))
}

/// Reports with SC_VISIT off, then on; prints the scans per pass.
pub async fn run(server: Server, _launch: &Launch, o: Opts) {
    let reports = o.reports;
    let ch = channel(&server.grpc).await;
    let NodeStream { tx, mut acks } =
        register_node(ch.clone(), "cache", topology_512(), Default::default()).await;
    let admin = Client::from_channel(ch);
    let cpus: Vec<pb::CpuState> = (0..512)
        .map(|i| pb::CpuState {
            id: i,
            online: true,
            ..Default::default()
        })
        .collect();
    println!(
        "# fairplace-load cache: 512 CPUs, 8 LLCs of 64; process 7 (16 threads) runs on CPUs 192-207 (LLC 3); {reports} reports 10 ms apart per strategy"
    );
    let mut seq = 0;
    for visit in [false, true] {
        admin
            .set_features(pb::SetFeaturesRequest {
                node_id: "cache".into(),
                set: [("SC_VISIT".to_string(), visit)].into_iter().collect(),
                clear_overrides: false,
            })
            .await
            .expect("set SC_VISIT");
        for _ in 0..reports {
            seq += 1;
            let u = pb::Update {
                seq,
                full: true,
                cpus: cpus.clone(),
                runtime: (192..208)
                    .map(|c| pb::ProcessRuntime {
                        group: 7,
                        cpu: c,
                        runtime_ns: 8_000_000,
                        nr_threads: 16,
                    })
                    .collect(),
                ..Default::default()
            };
            tx.send(pb::AgentMessage {
                body: Some(Body::Update(u)),
            })
            .await
            .unwrap();
            let a = acks.message().await.unwrap().unwrap();
            assert!(a.rejection.is_none(), "{a:?}");
            tokio::time::sleep(Duration::from_millis(11)).await;
        }
    }
    print_scans(&server, &admin).await;
}

/// The CPUs each strategy's passes scanned, from the server's metrics, and
/// the process's preferred CPU.
async fn print_scans(server: &Server, admin: &Client) {
    let mut avg = Vec::new();
    for strategy in ["full", "visit"] {
        let (sum, count) = scan_histogram(&server.metrics, strategy);
        println!(
            "{strategy}: {count:.0} task_cache_work passes, {:.1} CPUs scanned per pass (fairplace_cache_scan_cpus sum {sum:.0})",
            sum / count.max(1.0)
        );
        avg.push(sum / count.max(1.0));
    }
    println!(
        "full / visit CPUs scanned per pass: {:.1}x",
        avg[0] / avg[1].max(1e-9)
    );
    let c = admin.get_cache("cache").await.expect("GetCache");
    let p = c
        .processes
        .iter()
        .find(|p| p.group == 7)
        .expect("process 7");
    println!(
        "process 7 prefers CPU {:?} (LLC {:?})",
        p.preferred_cpu, p.preferred_llc
    );
}
