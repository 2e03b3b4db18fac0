//! AllocateCpus's decision and commit against a fork PickCpu on the same
//! node, in process (no gRPC): what a lease costs beyond one placement.
//!
//! The node is 128 CPUs (2 NUMA nodes x 2 LLCs x 16 cores x SMT2), every
//! even CPU busy. One allocation is `count` fork placements on a copy of
//! the state, each followed by a state rebuild, then the lease's commit
//! (one snapshot publish); the lease is released after each iteration (one
//! more publish, inside the measured time, as a caller would pay it).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use fairplace::engine::alloc::{self, Policy};
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::state::{CpuState, Task};
use fairplace::engine::{View, select_task_rq};
use fairplace::store::{NewLease, Store, StoreConfig, Update};
use fairplace_benches::{Lcg, busy_cpu, spec, system};

fn allocate(c: &mut Criterion) {
    let spec = spec(16, 2);
    let n = spec.cpus.len();
    let sys = system();
    let mut rng = Lcg(7);
    let cpus = (0..n)
        .map(|i| {
            let s = if i % 2 == 0 {
                busy_cpu(&mut rng)
            } else {
                CpuState::idle(1024)
            };
            (i as u32, s)
        })
        .collect();
    let store = Arc::new(Store::new(StoreConfig::default()));
    let (node, g) = store
        .nodes
        .register("n", vec![], "bench".into(), spec)
        .unwrap();
    let u = Update {
        seq: 1,
        full: true,
        cpus,
        ..Update::default()
    };
    store.nodes.apply(&node, g, &u, Instant::now()).unwrap();
    let task = Task::new(n, 0);

    let mut group = c.benchmark_group("allocate_128cpu_half_busy");
    group.bench_function("pick_cpu_fork", |b| {
        let snap = node.snapshot();
        let view = View {
            topo: &snap.topo,
            state: &snap.state,
            features: &snap.features,
            system: &sys,
        };
        let req = PlaceRequest::new(Kind::Fork, 3);
        b.iter(|| black_box(select_task_rq(view, black_box(&task), &req)));
    });
    for policy in [Policy::Kernel, Policy::Cores, Policy::Spread, Policy::Llc] {
        for count in [1usize, 4, 16] {
            group.bench_function(format!("{}_count_{count}", policy.as_str()), |b| {
                b.iter(|| {
                    let (_, lease, _commit) = store
                        .leases
                        .allocate_locked(&node, Instant::now(), |snap, leased| {
                            let req = alloc::Request {
                                topo: &snap.topo,
                                state: &snap.state,
                                features: &snap.features,
                                system: &sys,
                                task: &task,
                                count,
                                policy,
                                leased,
                            };
                            let g = alloc::allocate(&req)?;
                            let new = NewLease {
                                cpus: g.mask(),
                                policy: policy.as_str().into(),
                                holder: String::new(),
                                owner: "anonymous".into(),
                                ttl: std::time::Duration::from_secs(30),
                                target: None,
                                request_id: String::new(),
                            };
                            Ok::<_, alloc::NoRoom>((g, new))
                        })
                        .unwrap();
                    // The whole life in memory, each commit acknowledged
                    // (the memory log's commits are done at once).
                    store.leases.grant_settled(lease.id, true);
                    let (_, _, _commit) = store
                        .leases
                        .begin_end(lease.id, |_| Ok::<(), ()>(()))
                        .unwrap();
                    black_box(
                        store
                            .leases
                            .end_settled(lease.id, true, &|_, _| {})
                            .is_some(),
                    )
                });
            });
        }
    }
    group.finish();
}

criterion_group!(benches, allocate);
criterion_main!(benches);
