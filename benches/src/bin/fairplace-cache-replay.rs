//! A replay of cache-aware balancing: how much of a multi-threaded
//! process's runtime lands on its preferred LLC, with cache-aware load
//! balancing on and off (the same workload, seeds and accounting).
//!
//! The node: 64 CPUs, 2 NUMA nodes x 2 LLCs x 8 cores x SMT2. The workload,
//! hackbench-like: `processes` x `threads` threads, each round (one 10 ms
//! epoch) every thread runs its share of its CPU, a quarter of them sleep
//! and are woken by a sibling thread through the kernel's wakeup path
//! (select_task_rq, which ignores LLC preferences), then the node's
//! periodic balance runs from every CPU and its proposals are applied.
//! Accounting (account_mm_sched, task_cache_work) runs in both modes, so
//! "preferred LLC" means the same; only the balancer's use of it differs.

use clap::Parser;
use fairplace::engine::balance::{BalanceOpts, Balancer};
use fairplace::engine::cache::{CacheParams, CacheState, LlcMap, ScanStrategy};
use fairplace::engine::decision::{Kind, PlaceRequest};
use fairplace::engine::features::Features;
use fairplace::engine::rq::{RqTask, TaskTable};
use fairplace::engine::state::{CpuState, NodeState, Task};
use fairplace::engine::topology::Topology;
use fairplace::engine::{View, select_task_rq};
use fairplace_benches::{Lcg, spec, system};

#[derive(Parser)]
#[command(name = "fairplace-cache-replay")]
struct Args {
    #[arg(long, default_value_t = 4)]
    processes: u32,
    #[arg(long, default_value_t = 6)]
    threads: u32,
    #[arg(long, default_value_t = 500)]
    rounds: u32,
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

const EPOCH_MS: u64 = 10;
const EPOCH_NS: u64 = 10_000_000;

struct Sim {
    topo: Topology,
    llc: LlcMap,
    /// CPU of each thread; thread t belongs to process t / threads.
    cpu: Vec<usize>,
    threads: u32,
}

impl Sim {
    fn group(&self, t: usize) -> u64 {
        1 + (t as u32 / self.threads) as u64
    }

    fn per_cpu(&self) -> Vec<Vec<usize>> {
        let mut v = vec![Vec::new(); self.topo.nr_cpus];
        for (t, &c) in self.cpu.iter().enumerate() {
            v[c].push(t);
        }
        v
    }

    /// The node's runqueues and task lists for the current placement.
    fn state(&self, clock: i64) -> (NodeState, TaskTable) {
        let n = self.topo.nr_cpus;
        let mut table = TaskTable::empty(n);
        let mut cpus = Vec::with_capacity(n);
        for (c, ts) in self.per_cpu().into_iter().enumerate() {
            let k = ts.len() as u32;
            let mut s = CpuState::idle(1024);
            s.nr_running = k;
            s.cfs_h_nr_queued = k;
            s.curr_is_idle = k == 0;
            s.load_avg = 600 * k;
            s.runnable_avg = 600 * k;
            s.util_avg = (600 * k).min(1024);
            s.util_est = s.util_avg;
            cpus.push(s);
            let list: Vec<RqTask> = ts
                .iter()
                .enumerate()
                .map(|(j, &t)| {
                    let mut x = RqTask::new(t as u64 + 1, self.group(t), 600);
                    x.util_avg = 600;
                    x.running = j == 0;
                    x.exec_start = clock - 5_000_000 - j as i64 * 1_000_000;
                    x.nr_threads = self.threads;
                    x
                })
                .collect();
            table.cpus[c] = list.into();
            table.clock[c] = clock;
        }
        (
            NodeState::new(&self.topo, cpus, &[], &Features::default()),
            table,
        )
    }
}

/// One mode of the replay; returns (share of runtime on the preferred
/// LLC, share of runtime with a preference, migrations per round).
fn replay(a: &Args, cache_aware: bool) -> (f64, f64, f64) {
    let s = spec(8, 2);
    let topo =
        Topology::build(&s, &fairplace::engine::cpumask::CpuMask::first_n(64), 30).expect("valid");
    let llc = LlcMap::new(&topo);
    let nthreads = (a.processes * a.threads) as usize;
    let mut rng = Lcg(a.seed);
    let mut sim = Sim {
        cpu: (0..nthreads)
            .map(|_| (rng.next_u64() as usize) % topo.nr_cpus)
            .collect(),
        topo,
        llc,
        threads: a.threads,
    };
    let params = CacheParams::default();
    let mut cache = CacheState::new(64, params, 0);
    let mut bal = Balancer::new(&sim.topo);
    let features = Features::default();
    let sys = system();
    let (mut on_pref, mut with_pref, mut total, mut moves) = (0u64, 0u64, 0u64, 0u64);
    for round in 1..=a.rounds as u64 {
        let now = round * EPOCH_MS;
        let clock = (now * 1_000_000) as i64;
        // 1. Everyone runs its share of its CPU; account it.
        let per_cpu = sim.per_cpu();
        for (c, ts) in per_cpu.iter().enumerate() {
            for &t in ts {
                let g = sim.group(t);
                let ran = EPOCH_NS / ts.len() as u64;
                total += ran;
                if let Some(p) = cache.pref_llc(&sim.llc, g) {
                    with_pref += ran;
                    if p == sim.llc.llc(c) {
                        on_pref += ran;
                    }
                }
                if cache.account_mm_sched(&sim.llc, c, g, a.threads, ran, now) {
                    let running = |i: usize| per_cpu[i].first().is_some_and(|&x| sim.group(x) == g);
                    cache.task_cache_work(
                        &sim.topo,
                        &sim.llc,
                        g,
                        c,
                        ScanStrategy::Full,
                        false,
                        now,
                        running,
                    );
                }
            }
        }
        // 2. A quarter of the threads sleep and are woken by a sibling.
        for t in 0..nthreads {
            if !rng.next_u64().is_multiple_of(4) {
                continue;
            }
            let first = (t as u32 / a.threads * a.threads) as usize;
            let waker = first + (rng.next_u64() as usize) % a.threads as usize;
            let (state, _) = sim.state(clock);
            let view = View {
                topo: &sim.topo,
                state: &state,
                features: &features,
                system: &sys,
            };
            let mut task = Task::new(64, sim.cpu[t]);
            task.util_avg = 600;
            task.load_avg = 600;
            let req = PlaceRequest::new(Kind::Wakeup, sim.cpu[waker]);
            sim.cpu[t] = select_task_rq(view, &task, &req).cpu;
        }
        // 3. The periodic balance from every CPU; proposals are applied.
        let (state, table) = sim.state(clock);
        let view = View {
            topo: &sim.topo,
            state: &state,
            features: &features,
            system: &sys,
        };
        let lv = cache.view(&sim.llc, &params);
        let opts = BalanceOpts {
            dst_cpus: sim.topo.online,
            now_ms: now,
            honor_intervals: true,
            max_proposals: 0,
        };
        let mut out = Vec::new();
        bal.run(
            view,
            &table,
            if cache_aware { Some(&lv) } else { None },
            &opts,
            &mut out,
        );
        for p in &out {
            sim.cpu[(p.task - 1) as usize] = p.dst_cpu;
        }
        moves += out.len() as u64;
    }
    (
        on_pref as f64 / with_pref.max(1) as f64,
        with_pref as f64 / total.max(1) as f64,
        moves as f64 / a.rounds as f64,
    )
}

fn main() {
    let a = Args::parse();
    println!(
        "# fairplace-cache-replay: {} processes x {} threads on 64 CPUs (4 LLCs of 16), {} rounds of one epoch, seed {}",
        a.processes, a.threads, a.rounds, a.seed
    );
    println!(
        "mode                 runtime on preferred LLC  runtime with a preference  migrations/round"
    );
    let mut shares = Vec::new();
    for (name, on) in [("cache-aware off", false), ("cache-aware on", true)] {
        let (share, pref, moves) = replay(&a, on);
        println!(
            "{name:<20} {:>23.1} % {:>25.1} % {:>17.2}",
            share * 100.0,
            pref * 100.0,
            moves
        );
        shares.push(share);
    }
    println!(
        "on / off share on the preferred LLC: {:.2}",
        shares[1] / shares[0].max(1e-9)
    );
}
