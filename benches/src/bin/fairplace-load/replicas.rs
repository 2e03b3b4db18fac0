//! `fairplace-load replicas`: replicas on etcd against one server, same
//! run: PickCpu at the node's owner, through another replica (forwarded),
//! and on a single server; AllocateCpus+ReleaseCpus with leases in etcd
//! against the embedded store. Starts its own one-member etcd.
//!
//! Why: what replication costs a call. A replica answers for every node,
//! forwarding to the node's owner; a lease in etcd is a consensus write
//! where the single server commits to a local file. Each is measured
//! against the single server's Ping in the same run.

use std::time::Duration;

use fairplace_client::Client;

use fairplace_benches::load::wakeup_on_load;

use crate::etcd::{etcd, replica};
use crate::shared::{
    Launch, Server, allocate_release, clients, load_node, ping_or_pick, print_phase, run_phase,
};

#[derive(clap::Args)]
pub struct Opts {
    #[arg(long, default_value_t = 8)]
    pub seconds: u64,
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
}

/// Two replica ids of which rendezvous hashing gives node `load` to the
/// first: the owner, and the one that forwards.
fn ids() -> (String, String) {
    for i in 0.. {
        let (a, b) = (format!("ra{i}"), format!("rb{i}"));
        if fairplace::replica::hrw::owner([a.as_str(), b.as_str()], "load") == Some(a.as_str()) {
            return (a, b);
        }
    }
    unreachable!()
}

/// Ping, or PickCpu for node `load`, from `clients`; its throughput.
async fn phase(
    name: &str,
    clients: &[Client],
    (seconds, concurrency): (u64, usize),
    pick: bool,
) -> f64 {
    let (all, errors, secs) = run_phase(clients, concurrency, seconds, move |c, i| {
        ping_or_pick(c, if pick { "pick_cpu" } else { "ping" }, wakeup_on_load(i))
    })
    .await;
    print_phase(name, &all, errors, secs)
}

/// A lease's life (one CPU, policy kernel) from `clients`; its
/// throughput.
async fn lease_phase(name: &str, clients: &[Client], (seconds, concurrency): (u64, usize)) -> f64 {
    let (all, errors, secs) = run_phase(clients, concurrency, seconds, |c, _| async move {
        allocate_release(&c, 1, "kernel".into()).await
    })
    .await;
    print_phase(name, &all, errors, secs)
}

/// Runs the phases on an etcd, two replicas and a single server of its
/// own (not `server`).
pub async fn run(server: Server, launch: &Launch, o: Opts) {
    drop(server);
    let (cpus, threads) = (launch.cpus.as_str(), launch.threads);
    let Opts {
        seconds,
        connections,
        concurrency,
    } = o;
    println!(
        "# fairplace-load replicas: {connections} connections, {concurrency} callers, {seconds} s per phase"
    );
    let e = etcd();
    let (a, b) = ids();
    let owner = replica(cpus, threads, &e, &a);
    let other = replica(cpus, threads, &e, &b);
    // Both joined: the node goes to its owner.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _node = load_node(owner.node_channel().await).await;
    let single = Server::start_with(cpus, threads, &[]);
    let _node1 = load_node(single.node_channel().await).await;
    let k = (seconds, concurrency);
    let at_single = clients(&single, connections).await;
    let at_owner = clients(&owner, connections).await;
    let at_other = clients(&other, connections).await;
    let ping = phase("ping (single server)", &at_single, k, false).await;
    let pick_single = phase("pick_cpu (single server)", &at_single, k, true).await;
    let ping_owner = phase("ping (replica)", &at_owner, k, false).await;
    let pick_owner = phase("pick_cpu (at the owner)", &at_owner, k, true).await;
    let pick_fwd = phase(
        "pick_cpu (forwarded by the other replica)",
        &at_other,
        k,
        true,
    )
    .await;
    let lease_redb = lease_phase("allocate+release (single server, redb)", &at_single, k).await;
    let lease_etcd = lease_phase("allocate+release (at the owner, etcd)", &at_owner, k).await;
    println!("# same run, per second and as a share of the single server's ping");
    for (what, v) in [
        ("ping, single server", ping),
        ("pick_cpu, single server", pick_single),
        ("ping, replica", ping_owner),
        ("pick_cpu at the owner", pick_owner),
        ("pick_cpu through another replica", pick_fwd),
        ("allocate+release, redb", lease_redb),
        ("allocate+release, etcd", lease_etcd),
    ] {
        println!("{what}: {v:.0}/s ({:.2} of ping)", v / ping);
    }
    println!(
        "forwarded/owner pick_cpu {:.2}; etcd/redb allocate+release {:.2}",
        pick_fwd / pick_owner,
        lease_etcd / lease_redb
    );
}
