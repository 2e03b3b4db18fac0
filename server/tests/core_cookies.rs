//! Core-scheduling cookies through the store: agents of machines without
//! core scheduling report none and the node holds no table for them; a
//! report that sets one keeps it per CPU until a report clears it; GetNode's
//! conversion gives them back; an out-of-range one is refused with its
//! field named and nothing stored.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace::convert;
use fairplace::engine::topology::{CpuTopo, TopologySpec};
use fairplace::store::{Node, Reject, Store, StoreConfig};
use fairplace_proto::v1 as pb;

/// Two cores of two SMT siblings.
fn spec() -> TopologySpec {
    TopologySpec {
        cpus: (0..4)
            .map(|i| CpuTopo {
                core: i / 2,
                cluster: None,
                llc: 0,
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    }
}

fn node(s: &Store) -> (Arc<Node>, u64) {
    s.nodes
        .register("n", Vec::new(), "test".into(), spec())
        .unwrap()
}

fn cpu(id: u32, cookie: u64) -> pb::CpuState {
    pb::CpuState {
        id,
        online: true,
        nr_running: (cookie != 0) as u32,
        core_cookie: cookie,
        ..Default::default()
    }
}

fn apply(
    s: &Store,
    n: &Node,
    g: u64,
    seq: u64,
    full: bool,
    cpus: Vec<pb::CpuState>,
) -> Result<u64, Reject> {
    let u = pb::Update {
        seq,
        full,
        cpus,
        ..Default::default()
    };
    let u = convert::update(&u, &n.spec).map_err(Reject::Invalid)?;
    s.nodes.apply(n, g, &u, Instant::now())
}

fn cookies(n: &Node) -> Vec<u64> {
    let snap = n.snapshot();
    (0..4).map(|i| snap.state.core_cookie(i)).collect()
}

fn store() -> Store {
    Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        ..StoreConfig::default()
    })
}

/// A store with node "n" registered and its first full report, cookies
/// `first` by CPU, applied.
fn reported(first: [u64; 4]) -> (Store, Arc<Node>, u64) {
    let s = store();
    let (n, g) = node(&s);
    let cpus = (0..4).map(|i| cpu(i, first[i as usize])).collect();
    apply(&s, &n, g, 1, true, cpus).unwrap();
    (s, n, g)
}

#[test]
fn a_node_without_core_scheduling_holds_no_cookie_table() {
    let (_s, n, _) = reported([0; 4]);
    assert!(n.snapshot().state.core_cookies.is_empty());
    assert_eq!(cookies(&n), [0, 0, 0, 0]);
}

#[test]
fn cookies_are_kept_per_cpu_until_a_report_clears_them() {
    let (s, n, g) = reported([7, 0, 9, 0]);
    assert_eq!(cookies(&n), [7, 0, 9, 0]);
    // A delta without cookies clears only the CPUs it lists.
    apply(&s, &n, g, 2, false, vec![cpu(0, 0)]).unwrap();
    assert_eq!(cookies(&n), [0, 0, 9, 0]);
    // A delta setting one keeps the others.
    apply(&s, &n, g, 3, false, vec![cpu(3, 11)]).unwrap();
    assert_eq!(cookies(&n), [0, 0, 9, 11]);
    // GetNode and a replica's state transfer carry them back.
    let back: Vec<u64> = convert::cpu_states_to_pb(&n.snapshot().state)
        .iter()
        .map(|c| c.core_cookie)
        .collect();
    assert_eq!(back, [0, 0, 9, 11]);
    // Clearing the last ones leaves no table.
    apply(&s, &n, g, 4, false, vec![cpu(2, 0), cpu(3, 0)]).unwrap();
    assert!(n.snapshot().state.core_cookies.is_empty());
}

#[test]
fn an_offline_cpu_has_no_cookie() {
    let (s, n, g) = reported([7, 7, 9, 9]);
    let mut off = cpu(3, 0);
    off.online = false;
    off.nr_running = 0;
    apply(&s, &n, g, 2, false, vec![off]).unwrap();
    assert_eq!(cookies(&n), [7, 7, 9, 0]);
}

#[test]
fn an_out_of_range_cookie_is_refused_by_name_and_changes_nothing() {
    let (s, n, g) = reported([7, 0, 0, 0]);
    let before = n.snapshot().version;
    let Err(Reject::Invalid(e)) = apply(&s, &n, g, 2, false, vec![cpu(1, 3), cpu(2, u64::MAX)])
    else {
        panic!("accepted");
    };
    assert_eq!(e.field, "update.cpus[1].core_cookie", "{e}");
    assert!(e.msg.contains("out of range"), "{e}");
    assert_eq!(n.snapshot().version, before);
    assert_eq!(cookies(&n), [7, 0, 0, 0]);
}
