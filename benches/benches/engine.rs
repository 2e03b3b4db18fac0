//! Criterion benchmarks of the decision engine on the 256-CPU node.
//!
//! Every group has its baseline in the same run: the naive full scan (one
//! idleness test of every CPU of the node) for the wakeup and slow paths, the
//! slow path itself for the exec fast path, and the per-CPU loop for
//! `first_and_and`. `benches/report.py` turns the results into BENCHMARKS.md.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use fairplace::engine::balance::migrate::new_dst_cpu_loop;
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::features::Features;
use fairplace::engine::state::{CpuState, NodeState, SharedHint, Task};
use fairplace::engine::{View, select_task_rq};
use fairplace_benches::{Lcg, busy_cpu, node_256, state, system};

/// The baseline: test every CPU of the node once, as a scan with no
/// topology, no budget and no early exit would.
fn naive_full_scan(st: &NodeState) -> Option<usize> {
    let mut found = None;
    for (i, c) in st.cpus.iter().enumerate() {
        if black_box(c).available_idle() && found.is_none() {
            found = Some(i);
        }
    }
    found
}

fn wakeup(c: &mut Criterion) {
    let sys = system();
    let features = Features::default();
    for smt in [2u32, 8] {
        let topo = node_256(smt);
        let mut g = c.benchmark_group(format!("wakeup_smt{smt}"));
        for busy in [0u32, 50, 95, 100] {
            // The waker runs on CPU 3; the wakee last ran on CPU 10 (same LLC).
            let mut st = state(&topo, busy, &[]);
            st.cpus[3] = busy_cpu(&mut Lcg(7));
            if busy > 0 {
                st.cpus[10] = busy_cpu(&mut Lcg(9));
            }
            let st = NodeState::new(&topo, st.cpus, &[], &features);
            let view = View {
                topo: &topo,
                state: &st,
                features: &features,
                system: &sys,
            };
            let mut task = Task::new(topo.nr_cpus, 10);
            task.load_avg = 300;
            task.util_avg = 200;
            let mut req = PlaceRequest::new(Kind::Wakeup, 3);
            req.waker_load = 500;
            g.bench_with_input(BenchmarkId::new("select_task_rq", busy), &busy, |b, _| {
                b.iter(|| select_task_rq(black_box(view), black_box(&task), black_box(&req)))
            });
            g.bench_with_input(BenchmarkId::new("naive_full_scan", busy), &busy, |b, _| {
                b.iter(|| naive_full_scan(black_box(&st)))
            });
        }
        g.finish();
    }
}

fn slow_path(c: &mut Criterion) {
    let sys = system();
    let features = Features::default();
    let topo = node_256(2);
    let mut g = c.benchmark_group("slow_path_smt2");
    let mut st = state(&topo, 50, &[]);
    st.cpus[3] = busy_cpu(&mut Lcg(7));
    let st = NodeState::new(&topo, st.cpus, &[], &features);
    let view = View {
        topo: &topo,
        state: &st,
        features: &features,
        system: &sys,
    };
    let task = Task::new(topo.nr_cpus, 3);
    for kind in [Kind::Fork, Kind::Exec] {
        let req = PlaceRequest::new(kind, 3);
        g.bench_function(kind.as_str(), |b| {
            b.iter(|| select_task_rq(black_box(view), black_box(&task), black_box(&req)))
        });
    }
    g.bench_function("naive_full_scan", |b| {
        b.iter(|| naive_full_scan(black_box(&st)))
    });
    g.finish();
}

fn exec_bound(c: &mut Criterion) {
    let sys = system();
    let topo = node_256(2);
    let mut g = c.benchmark_group("exec_bound_one_cpu");
    let base = state(&topo, 50, &[]);
    let mut cpus = base.cpus.clone();
    cpus[3] = busy_cpu(&mut Lcg(7));
    let mut task = Task::new(topo.nr_cpus, 3);
    task.cpus_allowed = CpuMask::from_cpus([3]);
    let req = PlaceRequest::new(Kind::Exec, 3);
    for on in [true, false] {
        let features = Features {
            exec_bound_fast_path: on,
            ..Features::default()
        };
        let st = NodeState::new(&topo, cpus.clone(), &[], &features);
        let view = View {
            topo: &topo,
            state: &st,
            features: &features,
            system: &sys,
        };
        let name = if on { "fast_path_on" } else { "fast_path_off" };
        g.bench_function(name, |b| {
            b.iter(|| select_task_rq(black_box(view), black_box(&task), black_box(&req)))
        });
    }
    g.finish();
}

fn migrate_new_dst(c: &mut Criterion) {
    // dst group: an LLC of 64 CPUs; the task may run only on its last core.
    let dst_group = CpuMask::from_cpus(64..128);
    let env_cpus = CpuMask::from_cpus(0..256);
    let cpus_ptr = CpuMask::from_cpus([126, 127, 200]);
    assert_eq!(
        dst_group.first_and_and(&env_cpus, &cpus_ptr),
        new_dst_cpu_loop(&dst_group, &env_cpus, &cpus_ptr)
    );
    let mut g = c.benchmark_group("can_migrate_new_dst_cpu");
    g.bench_function("first_and_and", |b| {
        b.iter(|| black_box(&dst_group).first_and_and(black_box(&env_cpus), black_box(&cpus_ptr)))
    });
    g.bench_function("per_cpu_loop", |b| {
        b.iter(|| {
            new_dst_cpu_loop(
                black_box(&dst_group),
                black_box(&env_cpus),
                black_box(&cpus_ptr),
            )
        })
    });
    g.finish();
}

/// The select_idle_core rule on 8-thread cores: every core has one busy
/// thread (its last), so no core is idle and the scan records a fallback.
fn idle_core_first_vs_last(c: &mut Criterion) {
    let sys = system();
    let topo = node_256(8);
    let mut cpus: Vec<CpuState> = (0..topo.nr_cpus).map(|_| CpuState::idle(1024)).collect();
    let mut rng = Lcg(3);
    for core in 0..topo.nr_cpus / 8 {
        cpus[core * 8 + 7] = busy_cpu(&mut rng);
    }
    // The wakee's prev CPU, CPU 10, is busy; the waker on CPU 3 too.
    cpus[10] = busy_cpu(&mut rng);
    cpus[3] = busy_cpu(&mut rng);
    let hints = vec![
        SharedHint {
            nr_idle_scan: None,
            has_idle_cores: Some(true),
        };
        topo.shared.len()
    ];
    let mut task = Task::new(topo.nr_cpus, 10);
    task.load_avg = 300;
    let req = PlaceRequest::new(Kind::Wakeup, 3);
    let mut g = c.benchmark_group("select_idle_core_smt8");
    for last in [false, true] {
        let features = Features {
            prefer_last_idle_cpu: last,
            ..Features::default()
        };
        let st = NodeState::new(&topo, cpus.clone(), &hints, &features);
        let view = View {
            topo: &topo,
            state: &st,
            features: &features,
            system: &sys,
        };
        let p = select_task_rq(view, &task, &req);
        let name = if last { "last_idle" } else { "first_idle" };
        eprintln!(
            "select_idle_core {name}: cpu {} path {} scanned {}",
            p.cpu, p.path, p.scanned
        );
        g.bench_function(name, |b| {
            b.iter(|| select_task_rq(black_box(view), black_box(&task), black_box(&req)))
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    wakeup,
    slow_path,
    exec_bound,
    migrate_new_dst,
    idle_core_first_vs_last
);
criterion_main!(benches);
