//! A load-balance pass on the 256-CPU node (2 NUMA nodes x 2 LLCs, SMT2)
//! with 2,000 runnable tasks, against one fork placement on the same node
//! in the same run (the engine's costliest single decision).

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use fairplace::engine::balance::{BalanceOpts, Balancer};
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::features::Features;
use fairplace::engine::rq::{RqTask, TaskTable};
use fairplace::engine::state::{CpuState, NodeState, Task, pelt};
use fairplace::engine::topology::Topology;
use fairplace::engine::{View, select_task_rq};
use fairplace_benches::{Lcg, node_256, system};

/// 2,000 tasks over the node, skewed: a quarter of the CPUs hold most of
/// them, some CPUs are idle; a tenth are pinned to their LLC, a third ran
/// within the migration cost (cache-hot).
fn workload(topo: &Topology, n_tasks: usize) -> (NodeState, TaskTable) {
    let n = topo.nr_cpus;
    let mut rng = Lcg(11);
    let mut table = TaskTable::empty(n);
    let clock = 1_000_000_000_000i64;
    let mut lists: Vec<Vec<RqTask>> = vec![Vec::new(); n];
    for id in 0..n_tasks {
        let cpu = if rng.next_u64().is_multiple_of(4) {
            (rng.next_u64() as usize) % n
        } else {
            (rng.next_u64() as usize) % (n / 4)
        };
        let mut t = RqTask::new(id as u64 + 1, 1 + (id as u64 % 40), 0);
        t.load_avg = 200 + (rng.next_u64() % 900) as i64;
        t.util_avg = t.load_avg.min(1024) / 2;
        t.runnable_avg = t.load_avg;
        t.exec_start = if rng.next_u64().is_multiple_of(3) {
            clock - 100_000
        } else {
            clock - 50_000_000
        };
        t.nr_threads = 50;
        if rng.next_u64().is_multiple_of(10) {
            let llc = topo.spec.cpus[cpu].llc;
            let mask = fairplace::engine::cpumask::CpuMask::from_cpus(
                (0..n).filter(|&c| topo.spec.cpus[c].llc == llc),
            );
            t.allowed = table.intern_mask(mask);
        }
        lists[cpu].push(t);
    }
    let mut cpus = Vec::with_capacity(n);
    for (c, l) in lists.iter_mut().enumerate() {
        l.sort_by(|a, b| b.exec_start.cmp(&a.exec_start).then(a.id.cmp(&b.id)));
        if let Some(first) = l.first_mut() {
            first.running = true;
        }
        let mut s = CpuState::idle(1024);
        s.nr_running = l.len() as u32;
        s.cfs_h_nr_queued = s.nr_running;
        s.curr_is_idle = l.is_empty();
        s.load_avg = pelt(l.iter().map(|t| t.load_avg).sum());
        s.runnable_avg = s.load_avg;
        s.util_avg = pelt(l.iter().map(|t| t.util_avg).sum::<i64>().min(1024));
        s.util_est = s.util_avg;
        cpus.push(s);
        table.cpus[c] = std::mem::take(l).into();
        table.clock[c] = clock;
    }
    (NodeState::new(topo, cpus, &[], &Features::default()), table)
}

fn balance(c: &mut Criterion) {
    let topo = node_256(2);
    let (state, table) = workload(&topo, 2000);
    let features = Features::default();
    let sys = system();
    let view = View {
        topo: &topo,
        state: &state,
        features: &features,
        system: &sys,
    };
    let opts = BalanceOpts {
        dst_cpus: topo.online,
        now_ms: 0,
        honor_intervals: false,
        max_proposals: 0,
    };
    // Warm the per-domain state with a few passes, as a running balancer's.
    let mut warm = Balancer::new(&topo);
    let mut out = Vec::new();
    for _ in 0..3 {
        out.clear();
        warm.run(view, &table, None, &opts, &mut out);
    }
    out.clear();
    let stats = warm.clone().run(view, &table, None, &opts, &mut out);
    eprintln!(
        "balance pass: {} tasks, {} proposals, {} domains balanced, {} declined, {} refusals",
        table.len(),
        out.len(),
        stats.domains_balanced,
        stats.domains_declined,
        stats.rejections.iter().sum::<u64>()
    );
    let mut g = c.benchmark_group("balance_256cpu_2000tasks");
    g.bench_function("pass_all_cpus", |b| {
        b.iter_batched(
            || (warm.clone(), Vec::with_capacity(256)),
            |(mut bal, mut out)| {
                black_box(bal.run(view, &table, None, &opts, &mut out));
                out
            },
            BatchSize::LargeInput,
        )
    });
    let one = BalanceOpts {
        dst_cpus: fairplace::engine::cpumask::CpuMask::from_cpus([200]),
        ..opts.clone()
    };
    g.bench_function("pass_one_idle_cpu", |b| {
        b.iter_batched(
            || (warm.clone(), Vec::with_capacity(64)),
            |(mut bal, mut out)| {
                black_box(bal.run(view, &table, None, &one, &mut out));
                out
            },
            BatchSize::LargeInput,
        )
    });
    // Baseline: one fork placement (the slow path) on the same node.
    let task = Task::new(topo.nr_cpus, 0);
    let req = PlaceRequest::new(Kind::Fork, 0);
    g.bench_function("baseline_fork_slow_path", |b| {
        b.iter(|| black_box(select_task_rq(view, black_box(&task), &req)))
    });
    g.finish();
}

criterion_group!(benches, balance);
criterion_main!(benches);
