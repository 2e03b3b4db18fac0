//! Cluster placement over 10,000 nodes of 128 CPUs (10 zones x 20 racks x
//! 50 nodes), in process: the incremental group sums against the naive
//! recomputation from every node's per-CPU state, in the same run.

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::state::{CpuState, Task};
use fairplace::engine::{View, select_task_rq};
use fairplace::store::hierarchy::ClusterRequest;
use fairplace::store::{Store, StoreConfig, Update};
use fairplace_benches::{Lcg, busy_cpu, spec, system};

fn cluster(c: &mut Criterion) {
    let store = Store::new(StoreConfig {
        stale_after: std::time::Duration::from_secs(3600),
        ..StoreConfig::default()
    });
    let spec = spec(16, 2); // 128 CPUs
    let n = spec.cpus.len();
    let mut rng = Lcg(5);
    let t0 = Instant::now();
    for z in 0..10 {
        for r in 0..20 {
            for k in 0..50 {
                let id = format!("z{z}-r{r}-n{k}");
                let labels = vec![
                    ("zone".into(), format!("z{z}")),
                    ("rack".into(), format!("r{r}")),
                ];
                let (node, g) = store
                    .nodes
                    .register(&id, labels, "bench".into(), spec.clone())
                    .unwrap();
                let busy = 20 + (rng.next_u64() % 100) as usize;
                let cpus: Vec<(u32, CpuState)> = (0..n)
                    .map(|i| {
                        (
                            i as u32,
                            if i < busy {
                                busy_cpu(&mut rng)
                            } else {
                                CpuState::idle(1024)
                            },
                        )
                    })
                    .collect();
                store
                    .nodes
                    .apply(
                        &node,
                        g,
                        &Update {
                            seq: 1,
                            full: true,
                            cpus,
                            ..Update::default()
                        },
                        Instant::now(),
                    )
                    .unwrap();
            }
        }
    }
    eprintln!(
        "registered {} nodes in {:.1} s",
        store.nodes.len(),
        t0.elapsed().as_secs_f64()
    );
    let req = ClusterRequest::default();
    let all = CpuMask::first_n(n);
    let a = store.cluster.pick(&req, &all).unwrap();
    let b = store.cluster.naive_pick(&req, &all).unwrap();
    assert_eq!(a, b, "incremental and naive agree");
    eprintln!(
        "chosen {} after comparing {} groups and nodes",
        a.node, a.compared
    );

    let sys = system();
    let task = Task::new(n, 0);
    let mut g = c.benchmark_group("cluster_10000x128");
    g.bench_function("incremental_pick", |b| {
        b.iter(|| store.cluster.pick(black_box(&req), &all))
    });
    g.bench_function("incremental_pick_and_node_slow_path", |b| {
        b.iter(|| {
            let ch = store.cluster.pick(black_box(&req), &all).unwrap();
            let node = store.nodes.get(&ch.node).unwrap();
            let s = node.snapshot();
            let this = all.first_and(&s.topo.online).unwrap();
            let view = View {
                topo: &s.topo,
                state: &s.state,
                features: &s.features,
                system: &sys,
            };
            select_task_rq(view, &task, &PlaceRequest::new(Kind::Fork, this))
        })
    });
    g.sample_size(10);
    g.bench_function("naive_recompute_pick", |b| {
        b.iter(|| store.cluster.naive_pick(black_box(&req), &all))
    });
    g.finish();
}

criterion_group!(benches, cluster);
criterion_main!(benches);
