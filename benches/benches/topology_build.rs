//! `Topology::build` (the sched-domain tree of one node, what Register,
//! Decide and every hotplug delta pay) on the hardening issue's largest
//! node, 4,096 CPUs each its own core and LLC in 256 NUMA nodes of 16 CPUs,
//! and on the 256-CPU SMT2 node of the engine benchmarks (2 NUMA nodes x
//! 2 LLCs). A counting allocator prints the memory each build keeps (the
//! tree) and its peak beside the times.

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};

use criterion::{Criterion, criterion_group, criterion_main};
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::topology::{CpuTopo, Topology, TopologySpec};

struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        if n >= l.size() {
            grew(n - l.size());
        } else {
            LIVE.fetch_sub(l.size() - n, Ordering::Relaxed);
        }
        unsafe { System.realloc(p, l, n) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// 4,096 CPUs, each its own core and LLC, 16 per NUMA node (256 nodes).
/// The distances are a large machine's tiers: 10 local, 16 within a blade
/// of 4 nodes, 22 within a rack of 32 nodes, and 28 + 2 per rack hop
/// beyond (racks in a line), 11 distinct distances in all.
fn spec_4096() -> TopologySpec {
    let cpus = (0..4096u32)
        .map(|c| CpuTopo {
            core: c,
            cluster: None,
            llc: c,
            node: c / 16,
            capacity: 1024,
        })
        .collect();
    let dist = (0..256u32)
        .map(|a| {
            (0..256u32)
                .map(|b| {
                    if a == b {
                        10
                    } else if a / 4 == b / 4 {
                        16
                    } else if a / 32 == b / 32 {
                        22
                    } else {
                        28 + 2 * (a / 32).abs_diff(b / 32)
                    }
                })
                .collect()
        })
        .collect();
    TopologySpec {
        cpus,
        numa_distance: Some(dist),
    }
}

/// The same node with distances growing with the node ids' difference,
/// `10 + 2 * |a - b|` capped at 254: 122 distinct distances, more than any
/// real machine has, which the build refuses (the figure is the refusal's
/// cost; unbounded, it is half a million domains).
fn spec_4096_linear() -> TopologySpec {
    with_distances(|a, b| (10 + 2 * a.abs_diff(b)).min(254))
}

/// The costliest table the limit lets through: the 256 nodes on a ring,
/// distance `10 + 2 * ceil(hops / 8)`, 16 distinct distances, every level a
/// new span for every node.
fn spec_4096_ring16() -> TopologySpec {
    with_distances(|a, b| {
        let hops = a.abs_diff(b).min(256 - a.abs_diff(b));
        10 + 2 * hops.div_ceil(8)
    })
}

fn with_distances(d: impl Fn(u32, u32) -> u32) -> TopologySpec {
    let mut s = spec_4096();
    s.numa_distance = Some(
        (0..256u32)
            .map(|a| (0..256u32).map(|b| d(a, b)).collect())
            .collect(),
    );
    s
}

fn measure(name: &str, spec: &TopologySpec) {
    let online = CpuMask::first_n(spec.cpus.len());
    let before = LIVE.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let t0 = std::time::Instant::now();
    let r = Topology::build(spec, &online, 30);
    let took = t0.elapsed();
    let kept = LIVE.load(Ordering::SeqCst) - before;
    let peak = PEAK.load(Ordering::SeqCst) - before;
    match &r {
        Ok(t) => eprintln!(
            "{name}: built in {took:?}, {} spans, {} domains; keeps {:.2} MiB, peak {:.2} MiB",
            t.spans.len(),
            t.cpu.iter().map(|c| c.chain.len()).sum::<usize>(),
            kept as f64 / 1048576.0,
            peak as f64 / 1048576.0
        ),
        Err(e) => eprintln!(
            "{name}: refused in {took:?} ({e}); peak {:.2} MiB",
            peak as f64 / 1048576.0
        ),
    }
    drop(r);
}

fn topology_build(c: &mut Criterion) {
    let cases = [
        ("4096cpu_4096llc_256node", spec_4096()),
        (
            "4096cpu_256node_linear_distances_refused",
            spec_4096_linear(),
        ),
        ("4096cpu_256node_16_distances_ring", spec_4096_ring16()),
        ("256cpu_smt2_2node", fairplace_benches::spec(32, 2)),
    ];
    let mut g = c.benchmark_group("topology_build");
    g.sample_size(10);
    for (name, spec) in &cases {
        measure(name, spec);
        let online = CpuMask::first_n(spec.cpus.len());
        g.bench_function(*name, |b| {
            b.iter(|| black_box(Topology::build(black_box(spec), &online, 30)))
        });
    }
    g.finish();
}

criterion_group!(benches, topology_build);
criterion_main!(benches);
