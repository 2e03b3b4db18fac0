//! The group sums a snapshot keeps for the slow path (groups wider than a
//! core: LLCs, clusters, NUMA nodes), updated per report only for the CPUs
//! that changed, against a recomputation from the per-CPU state; and the
//! slow path reading them choosing the same CPU as the slow path walking
//! every CPU.

use std::time::Instant;

use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::features::{Features, System};
use fairplace::engine::state::{CpuState, NodeState, Task};
use fairplace::engine::topology::{CpuTopo, Topology, TopologySpec};
use fairplace::engine::{View, select_task_rq};
use fairplace::store::{Store, StoreConfig, Update};
use proptest::prelude::*;

/// `nodes` NUMA nodes x `llcs` LLCs x `cores` cores x `smt` threads.
fn spec(nodes: u32, llcs: u32, cores: u32, smt: u32, clusters: bool) -> TopologySpec {
    let mut cpus = vec![];
    for node in 0..nodes {
        for l in 0..llcs {
            let llc = node * llcs + l;
            for c in 0..cores {
                for _ in 0..smt {
                    cpus.push(CpuTopo {
                        core: llc * cores + c,
                        cluster: clusters.then_some(llc * 2 + c % 2),
                        llc,
                        node,
                        capacity: 1024,
                    });
                }
            }
        }
    }
    TopologySpec {
        cpus,
        numa_distance: None,
    }
}

fn cpu_state(seed: u64) -> CpuState {
    let mut c = CpuState::idle(1024);
    match seed % 5 {
        0 | 1 => {}
        2 => {
            c.ttwu_pending = true;
        }
        k => {
            c.nr_running = (k as u32) - 2;
            c.cfs_h_nr_queued = c.nr_running;
            c.curr_is_idle = false;
            c.load_avg = (seed % 1500) as u32;
            c.runnable_avg = c.load_avg + 10;
            c.util_avg = (seed % 1100) as u32;
            c.util_est = (seed % 900) as u32;
            c.capacity = 1024 - (seed % 3) as u16 * 100;
        }
    }
    c
}

fn lcg(x: &mut u64) -> u64 {
    *x = x
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *x >> 33
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn kept_sums_equal_a_recomputation_and_the_slow_path_agrees(
        shape in 0usize..4,
        seed in any::<u64>(),
        reports in 1usize..12,
    ) {
        let spec = match shape {
            0 => spec(2, 2, 4, 2, false),
            1 => spec(1, 2, 4, 1, false),
            2 => spec(2, 1, 4, 4, true),
            _ => spec(4, 1, 2, 2, false),
        };
        let n = spec.cpus.len() as u32;
        let store = Store::new(StoreConfig::default());
        let (node, g) = store.nodes.register("n", vec![], "t".into(), spec).unwrap();
        let mut x = seed | 1;
        let full = Update {
            seq: 1,
            full: true,
            cpus: (0..n).map(|i| (i, cpu_state(lcg(&mut x)))).collect(),
            ..Update::default()
        };
        store.nodes.apply(&node, g, &full, Instant::now()).unwrap();
        for r in 0..reports {
            // A delta of a few CPUs; sometimes one goes offline or back.
            let k = 1 + lcg(&mut x) % 4;
            let mut cpus = Vec::new();
            let mut seen = CpuMask::new();
            for _ in 0..k {
                let i = (lcg(&mut x) % n as u64) as u32;
                if seen.test(i as usize) {
                    continue;
                }
                seen.set(i as usize);
                let mut c = cpu_state(lcg(&mut x));
                c.online = i != 0 && !lcg(&mut x).is_multiple_of(9);
                cpus.push((i, c));
            }
            let u = Update { seq: 2 + r as u64, full: false, cpus, ..Update::default() };
            let _ = store.nodes.apply(&node, g, &u, Instant::now());
            if lcg(&mut x).is_multiple_of(3) {
                let v = node.snapshot().version;
                store.nodes.try_claim(&node, v, (lcg(&mut x) % n as u64) as usize, Instant::now());
            }
            let snap = node.snapshot();
            let f = Features { util_est: !lcg(&mut x).is_multiple_of(4), ..snap.features };
            let again = NodeState::new(&snap.topo, snap.state.cpus.clone(), &[], &snap.features);
            prop_assert_eq!(&snap.state.groups, &again.groups);
            prop_assert!(!snap.state.groups.is_empty() || snap.topo.sum_groups.is_empty());
            // Fork placements with the sums and with every CPU read.
            let mut walk = snap.state.clone();
            walk.groups.clear();
            let sys = System::default();
            for t in 0..3 {
                let this = (lcg(&mut x) % n as u64) as usize;
                if !snap.topo.online.test(this) {
                    continue;
                }
                let mut task = Task::new(n as usize, this);
                task.util_avg = (lcg(&mut x) % 600) as i64;
                task.load_avg = (lcg(&mut x) % 800) as i64;
                if t == 2 {
                    // An affinity that cuts groups: the walk must be used.
                    task.cpus_allowed = CpuMask::from_cpus((0..n as usize).filter(|c| c % 3 != 1));
                }
                let kind = if t == 1 { Kind::Exec } else { Kind::Fork };
                let req = PlaceRequest::new(kind, this);
                let a = select_task_rq(
                    View { topo: &snap.topo, state: &snap.state, features: &snap.features, system: &sys },
                    &task,
                    &req,
                );
                let b = select_task_rq(
                    View { topo: &snap.topo, state: &walk, features: &snap.features, system: &sys },
                    &task,
                    &req,
                );
                prop_assert_eq!(a.cpu, b.cpu);
                prop_assert_eq!(a.path, b.path);
                prop_assert_eq!(a.detail, b.detail);
                // Sums made without UTIL_EST are not used with it (and the
                // reverse): the walk decides then.
                let other = NodeState::new(&snap.topo, snap.state.cpus.clone(), &[], &f);
                let c = select_task_rq(
                    View { topo: &snap.topo, state: &other, features: &snap.features, system: &sys },
                    &task,
                    &req,
                );
                prop_assert_eq!(a.cpu, c.cpu);
            }
        }
    }
}

#[test]
fn the_slow_path_reads_the_kept_sums_when_the_task_may_use_the_whole_group() {
    // 2 NUMA nodes x 1 LLC x 4 cores x SMT2; node 0 (CPUs 0-7) busy, node 1
    // idle: a fork on CPU 0 goes to node 1. Sums that claim node 0 is idle
    // and node 1 busy send it to node 0 instead, which shows the sums, not
    // the CPUs, were read; a task that may use neither node whole reads the
    // CPUs and is not fooled.
    let spec = spec(2, 1, 4, 2, false);
    let topo = Topology::build(&spec, &CpuMask::first_n(16), 30).unwrap();
    let mut cpus = vec![CpuState::idle(1024); 16];
    // Idle since different times (with no stamp at all, the idlest CPU
    // search keeps this_cpu).
    for (i, c) in cpus.iter_mut().enumerate() {
        c.idle_stamp = 1000 + i as i64;
    }
    for c in cpus.iter_mut().take(8) {
        *c = cpu_state(3);
        c.load_avg = 1000;
        c.util_avg = 1000;
    }
    let f = Features::default();
    let st = NodeState::new(&topo, cpus, &[], &f);
    let sys = System::default();
    let task = Task::new(16, 0);
    let req = PlaceRequest::new(Kind::Fork, 0);
    fn view<'a>(t: &'a Topology, st: &'a NodeState, f: &'a Features, s: &'a System) -> View<'a> {
        View {
            topo: t,
            state: st,
            features: f,
            system: s,
        }
    }
    let p = select_task_rq(view(&topo, &st, &f, &sys), &task, &req);
    assert!(p.cpu >= 8, "{p:?}");
    let mut lie = st.clone();
    let node = |first: usize| {
        topo.sum_groups
            .iter()
            .position(|&g| *topo.span(g) == CpuMask::from_cpus(first..first + 8))
            .unwrap()
    };
    let (n0, n1) = (node(0), node(8));
    lie.groups.swap(n0, n1);
    let q = select_task_rq(view(&topo, &lie, &f, &sys), &task, &req);
    assert!(q.cpu < 8, "{q:?}");
    let mut pinned = task.clone();
    pinned.cpus_allowed = CpuMask::from_cpus((0..16).filter(|&c| c != 7 && c != 15));
    let r = select_task_rq(view(&topo, &lie, &f, &sys), &pinned, &req);
    assert!(r.cpu >= 8, "{r:?}");
}
