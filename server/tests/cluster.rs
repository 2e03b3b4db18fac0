//! Cluster placement: hand-worked hierarchy cases, and a differential test
//! of the incremental group sums against recomputation from per-CPU state.

use std::time::{Duration, Instant};

use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::group::GroupType;
use fairplace::engine::group::NodeAgg;
use fairplace::engine::state::CpuState;
use fairplace::engine::topology::{CpuTopo, TopologySpec};
use fairplace::store::hierarchy::ClusterRequest;
use fairplace::store::{Store, StoreConfig, Update};
use proptest::prelude::*;

fn spec(cpus: u32) -> TopologySpec {
    TopologySpec {
        cpus: (0..cpus)
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

fn busy(load: u32) -> CpuState {
    let mut c = CpuState::idle(1024);
    c.nr_running = 1;
    c.cfs_h_nr_queued = 1;
    c.curr_is_idle = false;
    c.load_avg = load;
    c.runnable_avg = load;
    c.util_avg = load.min(1024);
    c
}

/// Registers `id` under zone/rack with `cpus` CPUs of which the first `nbusy` run one task.
fn node(s: &Store, id: &str, zone: &str, rack: &str, cpus: u32, nbusy: u32) {
    let mut labels = vec![];
    if !zone.is_empty() {
        labels.push(("zone".to_string(), zone.to_string()));
    }
    if !rack.is_empty() {
        labels.push(("rack".to_string(), rack.to_string()));
    }
    let (n, g) = s
        .nodes
        .register(id, labels, "t".into(), spec(cpus))
        .unwrap();
    let u = Update {
        seq: 1,
        full: true,
        cpus: (0..cpus)
            .map(|i| {
                (
                    i,
                    if i < nbusy {
                        busy(900)
                    } else {
                        CpuState::idle(1024)
                    },
                )
            })
            .collect(),
        ..Update::default()
    };
    s.nodes.apply(&n, g, &u, Instant::now()).unwrap();
}

fn pick(s: &Store, req: &ClusterRequest) -> Option<String> {
    let all = CpuMask::first_n(4096);
    let a = s.cluster.pick(req, &all).map(|c| c.node);
    let b = s.cluster.naive_pick(req, &all).map(|c| c.node);
    assert_eq!(a, b, "incremental and naive disagree");
    a
}

#[test]
fn the_idlest_zone_wins() {
    let s = Store::new(StoreConfig::default());
    // Zone a: 8 CPUs, 6 busy. Zone b: 8 CPUs, 2 busy -> more idle CPUs.
    node(&s, "a1", "a", "r1", 8, 6);
    node(&s, "b1", "b", "r1", 8, 2);
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("b1"));
    // Within zone b, rack r2 is idler than r1.
    node(&s, "b2", "b", "r2", 8, 0);
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("b2"));
}

#[test]
fn spare_capacity_beats_an_overloaded_group() {
    let s = Store::new(StoreConfig::default());
    // Zone a has fewer idle CPUs but spare capacity; zone b has idle CPUs
    // on paper after its overload is counted... b runs 3 tasks per CPU.
    node(&s, "a1", "a", "", 4, 3);
    let (n, g) = s
        .nodes
        .register("b1", vec![("zone".into(), "b".into())], "t".into(), spec(4))
        .unwrap();
    let mut over = busy(3000);
    over.nr_running = 3;
    over.util_avg = 1024;
    let u = Update {
        seq: 1,
        full: true,
        cpus: (0..4).map(|i| (i, over)).collect(),
        ..Update::default()
    };
    s.nodes.apply(&n, g, &u, Instant::now()).unwrap();
    let b = n.snapshot().agg;
    assert_eq!(b.stats(125).group_type, GroupType::Overloaded);
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("a1"));
}

#[test]
fn ties_go_to_the_first_group_in_name_order() {
    let s = Store::new(StoreConfig::default());
    node(&s, "n2", "z2", "r", 4, 1);
    node(&s, "n1", "z1", "r", 4, 1);
    node(&s, "n3", "z1", "r", 4, 1);
    // z1 has 6 idle CPUs against z2's 3: z1; inside, n1 and n3 tie: n1.
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("n1"));
}

#[test]
fn the_numa_style_allowance_keeps_a_fork_near_its_parent() {
    let s = Store::new(StoreConfig::default());
    // The parent's zone a: one 16-CPU node, 1 busy (15 idle); zone b: one
    // 16-CPU node, none busy (16 idle). The idle difference is 1 <= 2, and
    // zone a would run 2 tasks with this one, within its allowance of
    // 16 >> 3 = 2: the task stays in zone a.
    node(&s, "a1", "a", "r", 16, 1);
    node(&s, "b1", "b", "r", 16, 0);
    let from_a = ClusterRequest {
        origin: Some((vec!["a".into(), "r".into()], "a1".into())),
        ..ClusterRequest::default()
    };
    assert_eq!(pick(&s, &from_a).as_deref(), Some("a1"));
    let c = s.cluster.pick(&from_a, &CpuMask::first_n(4096)).unwrap();
    assert_eq!(c.level, "none");
    // Without an origin there is no local group: the idlest, b1.
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("b1"));
    // With 2 busy, zone a would run 3 tasks, over its allowance: the idle
    // difference (14 against 16) sends the task to zone b.
    node(&s, "a1", "a", "r", 16, 2);
    assert_eq!(pick(&s, &from_a).as_deref(), Some("b1"));
    let c = s.cluster.pick(&from_a, &CpuMask::first_n(4096)).unwrap();
    assert_eq!(c.level, "zone");
}

#[test]
fn affinity_only_one_node_can_satisfy() {
    let s = Store::new(StoreConfig::default());
    node(&s, "small", "a", "r", 4, 0);
    node(&s, "big", "b", "r", 32, 30);
    // CPU 20 exists only on the big node: it is chosen however busy.
    let req = ClusterRequest {
        first_allowed_cpu: 20,
        ..ClusterRequest::default()
    };
    let allowed = CpuMask::from_cpus([20]);
    assert_eq!(
        s.cluster.pick(&req, &allowed).map(|c| c.node).as_deref(),
        Some("big")
    );
    assert_eq!(
        s.cluster
            .naive_pick(&req, &allowed)
            .map(|c| c.node)
            .as_deref(),
        Some("big")
    );
    // No node has CPU 40.
    let req = ClusterRequest {
        first_allowed_cpu: 40,
        ..ClusterRequest::default()
    };
    assert_eq!(s.cluster.pick(&req, &CpuMask::from_cpus([40])), None);
}

#[test]
fn a_selector_restricts_the_zone() {
    let s = Store::new(StoreConfig::default());
    node(&s, "a1", "a", "r", 8, 6);
    node(&s, "b1", "b", "r", 8, 0);
    let req = ClusterRequest {
        selector: vec![("zone".into(), "a".into())],
        ..ClusterRequest::default()
    };
    assert_eq!(pick(&s, &req).as_deref(), Some("a1"));
}

#[test]
fn stale_nodes_are_never_chosen_and_leave_the_sums() {
    let cfg = StoreConfig {
        stale_after: Duration::from_millis(50),
        ..StoreConfig::default()
    };
    let s = Store::new(cfg);
    node(&s, "old", "a", "r", 8, 0);
    std::thread::sleep(Duration::from_millis(80));
    node(&s, "new", "b", "r", 8, 7);
    // "old" is idler but stale: its agent stopped reporting.
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("new"));
    assert_eq!(s.nodes.uncount_stale(Instant::now()), 1);
    assert_eq!(s.cluster.hierarchy.total().nodes, 1);
    assert_eq!(pick(&s, &ClusterRequest::default()).as_deref(), Some("new"));
}

#[test]
fn a_node_leaving_mid_run_leaves_its_groups() {
    let cfg = StoreConfig {
        forget_after: Duration::ZERO,
        stale_after: Duration::ZERO,
        ..StoreConfig::default()
    };
    let s = Store::new(cfg);
    node(&s, "n1", "a", "r", 8, 0);
    let n1 = s.nodes.get("n1").unwrap();
    s.nodes
        .disconnect(&n1, n1.generation.load(std::sync::atomic::Ordering::SeqCst));
    std::thread::sleep(Duration::from_millis(5));
    assert_eq!(s.nodes.forget_stale(Instant::now()), 1);
    assert_eq!(s.cluster.hierarchy.total().nodes, 0);
    assert_eq!(
        s.cluster
            .pick(&ClusterRequest::default(), &CpuMask::first_n(64)),
        None
    );
}

#[test]
fn node_aggregates_sum_the_online_cpus() {
    let s = Store::new(StoreConfig::default());
    node(&s, "n", "a", "r", 4, 2);
    let a: NodeAgg = s.nodes.get("n").unwrap().snapshot().agg;
    assert_eq!(
        (
            a.sum.cpus,
            a.sum.idle_cpus,
            a.sum.nr_running,
            a.sum.load,
            a.sum.capacity,
            a.nr_cpus
        ),
        (4, 2, 2, 1800, 4096, 4)
    );
    assert_eq!(s.cluster.hierarchy.total().agg(), a);
}

/// A generated node: id, labels, CPU count.
type Named = (String, Vec<(String, String)>, u32);

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Random clusters and report sequences: after every report the
    /// incremental sums pick the same node as a recomputation from scratch.
    #[test]
    fn incremental_sums_pick_like_a_full_recomputation(
        nodes in prop::collection::vec((0u8..3, 0u8..3, prop::sample::select(vec![4u32, 8, 16]), 0u64..1000), 1..14),
        reports in prop::collection::vec((any::<prop::sample::Index>(), 0u64..1000), 1..30),
        reqs in prop::collection::vec((0usize..12, any::<Option<prop::sample::Index>>(), any::<bool>()), 1..6),
    ) {
        let s = Store::new(StoreConfig::default());
        let names: Vec<Named> = nodes.iter().enumerate().map(|(i, (z, r, cpus, _))| {
            let mut labels = vec![];
            if *z > 0 { labels.push(("zone".to_string(), format!("z{z}"))); }
            if *r > 0 { labels.push(("rack".to_string(), format!("r{r}"))); }
            (format!("n{i:02}"), labels, *cpus)
        }).collect();
        let state = |cpus: u32, seed: u64| -> Vec<(u32, CpuState)> {
            let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407) | 1;
            (0..cpus).map(|i| {
                x ^= x << 13; x ^= x >> 7; x ^= x << 17;
                (i, if x.is_multiple_of(3) { busy(200 + (x % 3000) as u32) } else { CpuState::idle(1024) })
            }).collect()
        };
        let mut gens = vec![];
        for ((id, labels, cpus), (_, _, _, seed)) in names.iter().zip(&nodes) {
            let (n, g) = s.nodes.register(id, labels.clone(), "t".into(), spec(*cpus)).unwrap();
            s.nodes.apply(&n, g, &Update { seq: 1, full: true, cpus: state(*cpus, *seed), ..Update::default() }, Instant::now()).unwrap();
            gens.push((n, g, 1u64));
        }
        for (which, seed) in reports {
            let k = which.index(gens.len());
            let (n, g, seq) = &mut gens[k];
            *seq += 1;
            let cpus = names[k].2;
            s.nodes.apply(n, *g, &Update { seq: *seq, full: true, cpus: state(cpus, seed), ..Update::default() }, Instant::now()).unwrap();
            for (first, origin, select) in &reqs {
                let origin = origin.as_ref().map(|o| {
                    let (id, labels, _) = &names[o.index(names.len())];
                    (s.cluster.hierarchy.path(labels), id.clone())
                });
                let selector = if *select { vec![("zone".to_string(), "z1".to_string())] } else { vec![] };
                let req = ClusterRequest { first_allowed_cpu: *first, origin, selector };
                let allowed = CpuMask::from_cpus(*first..64);
                let a = s.cluster.pick(&req, &allowed);
                let b = s.cluster.naive_pick(&req, &allowed);
                prop_assert_eq!(a, b);
            }
        }
    }
}
