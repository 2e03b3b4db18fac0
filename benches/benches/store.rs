//! The store's design choice, measured: a decision reads an immutable
//! snapshot (one atomic load, no lock across the scan), against the
//! alternative of one mutex per node held for the scan. Each is measured
//! alone and while another thread applies 128-CPU updates to the same node
//! as fast as it can.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::features::Features;
use fairplace::engine::state::{CpuState, NodeState, Task};
use fairplace::engine::{View, select_task_rq};
use fairplace::store::{Store, StoreConfig, Update};
use fairplace_benches::{Lcg, busy_cpu, spec, system};

fn cpus(seed: u64, n: usize) -> Vec<CpuState> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|i| {
            if i % 2 == 0 {
                busy_cpu(&mut rng)
            } else {
                CpuState::idle(1024)
            }
        })
        .collect()
}

fn store_vs_mutex(c: &mut Criterion) {
    // 2 nodes x 2 LLCs x 16 cores x SMT2 = 128 CPUs.
    let spec = spec(16, 2);
    let n = spec.cpus.len();
    let sys = system();
    let mut task = Task::new(n, 10);
    task.load_avg = 300;
    let req = PlaceRequest::new(Kind::Wakeup, 3);
    let updates: Vec<Update> = (0..2)
        .map(|k| Update {
            seq: 0,
            full: true,
            cpus: cpus(k + 1, n)
                .into_iter()
                .enumerate()
                .map(|(i, c)| (i as u32, c))
                .collect(),
            ..Update::default()
        })
        .collect();

    let store = Arc::new(Store::new(StoreConfig::default()));
    let (node, generation) = store
        .nodes
        .register("n", vec![], "bench".into(), spec.clone())
        .unwrap();
    store
        .nodes
        .apply(&node, generation, &updates[0], Instant::now())
        .unwrap();

    let topo = node.snapshot().topo.clone();
    let features = Features::default();
    let locked = Arc::new(Mutex::new(NodeState::new(
        &topo,
        cpus(1, n),
        &[],
        &features,
    )));

    let mut g = c.benchmark_group("store_pick_128cpu");
    for writer in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        // The writer: full updates back to back, through the store.
        let w = writer.then(|| {
            let (store, node, updates, stop) =
                (store.clone(), node.clone(), updates.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut u = updates[k % 2].clone();
                    u.seq = k as u64 + 2;
                    store
                        .nodes
                        .apply(&node, generation, &u, Instant::now())
                        .unwrap();
                    k += 1;
                }
            })
        });
        let name = if writer {
            "snapshot_with_writer"
        } else {
            "snapshot"
        };
        g.bench_function(name, |b| {
            b.iter(|| {
                let s = node.snapshot();
                let view = View {
                    topo: &s.topo,
                    state: &s.state,
                    features: &s.features,
                    system: &sys,
                };
                black_box(select_task_rq(view, &task, &req))
            })
        });
        stop.store(true, Ordering::Relaxed);
        if let Some(w) = w {
            w.join().unwrap();
        }

        let stop = Arc::new(AtomicBool::new(false));
        // The alternative's writer: the same updates, in place under the lock.
        let w = writer.then(|| {
            let (locked, stop, topo) = (locked.clone(), stop.clone(), topo.clone());
            let states = [cpus(1, n), cpus(2, n)];
            std::thread::spawn(move || {
                let mut k = 0;
                while !stop.load(Ordering::Relaxed) {
                    let mut st = locked.lock().unwrap();
                    st.cpus.copy_from_slice(&states[k % 2]);
                    *st = NodeState::new(
                        &topo,
                        std::mem::take(&mut st.cpus),
                        &[],
                        &Features::default(),
                    );
                    k += 1;
                }
            })
        });
        let name = if writer { "mutex_with_writer" } else { "mutex" };
        g.bench_function(name, |b| {
            b.iter(|| {
                let st = locked.lock().unwrap();
                let view = View {
                    topo: &topo,
                    state: &st,
                    features: &features,
                    system: &sys,
                };
                black_box(select_task_rq(view, &task, &req))
            })
        });
        stop.store(true, Ordering::Relaxed);
        if let Some(w) = w {
            w.join().unwrap();
        }
    }
    g.finish();
}

criterion_group!(benches, store_vs_mutex);
criterion_main!(benches);
