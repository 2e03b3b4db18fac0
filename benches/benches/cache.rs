//! task_cache_work on a 512-CPU node with 8 LLCs (2 NUMA nodes x 4 LLCs x
//! 32 cores x SMT2): the kernel's full scan against the visited-CPU scan
//! (SC_VISIT), for a 16-thread process confined to one LLC and for a
//! 64-thread process spread over every LLC. The CPUs each pass reads are
//! printed beside the times.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use fairplace::engine::cache::{CacheParams, CacheState, LlcMap, ScanStrategy};
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::topology::{CpuTopo, Topology, TopologySpec};

fn node_512() -> Topology {
    let mut cpus = Vec::new();
    for node in 0..2u32 {
        for l in 0..4u32 {
            let llc = node * 4 + l;
            for c in 0..32u32 {
                for _ in 0..2 {
                    cpus.push(CpuTopo {
                        core: llc * 32 + c,
                        cluster: None,
                        llc,
                        node,
                        capacity: 1024,
                    });
                }
            }
        }
    }
    let spec = TopologySpec {
        cpus,
        numa_distance: None,
    };
    Topology::build(&spec, &CpuMask::first_n(512), 30).expect("valid")
}

/// A process of `threads` threads that ran on `cpus` for the last epochs,
/// with other processes keeping every CPU busy.
fn history(topo: &Topology, llc: &LlcMap, threads: u32, cpus: &[usize]) -> (CacheState, u64) {
    let mut st = CacheState::new(topo.nr_cpus, CacheParams::default(), 0);
    let mut now = 0;
    for _ in 0..4 {
        now += 10;
        for c in 0..topo.nr_cpus {
            st.account_mm_sched(llc, c, 1000 + (c as u64 % 7), 4, 2_000_000, now);
        }
        for &c in cpus {
            st.account_mm_sched(llc, c, 7, threads, 8_000_000, now);
        }
    }
    (st, now + 10)
}

fn cache(c: &mut Criterion) {
    let topo = node_512();
    let llc = LlcMap::new(&topo);
    let cases: [(&str, u32, Vec<usize>); 2] = [
        // 16 threads on the first 16 CPUs of LLC 3.
        ("one_llc_16_threads", 16, (192..208).collect()),
        // 64 threads, 8 on each LLC.
        (
            "all_llcs_64_threads",
            64,
            (0..8)
                .flat_map(|l| (0..8).map(move |k| l * 64 + k * 8))
                .collect(),
        ),
    ];
    let mut g = c.benchmark_group("task_cache_work_512cpu_8llc");
    for (name, threads, cpus) in &cases {
        let (st, now) = history(&topo, &llc, *threads, cpus);
        for strategy in [ScanStrategy::Full, ScanStrategy::Visit] {
            let r = st
                .clone()
                .task_cache_work(&topo, &llc, 7, cpus[0], strategy, false, now, |_| false)
                .expect("the scan runs");
            eprintln!(
                "{name} {}: {} CPUs scanned, preferred CPU {:?}",
                strategy.as_str(),
                r.scanned,
                r.preferred_cpu
            );
            g.bench_function(format!("{name}/{}", strategy.as_str()), |b| {
                b.iter_batched(
                    || st.clone(),
                    |mut s| {
                        black_box(s.task_cache_work(
                            &topo,
                            &llc,
                            7,
                            cpus[0],
                            strategy,
                            false,
                            now,
                            |_| false,
                        ))
                    },
                    BatchSize::LargeInput,
                )
            });
        }
    }
    g.finish();
}

criterion_group!(benches, cache);
criterion_main!(benches);
