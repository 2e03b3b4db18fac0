//! Fixtures for the engine benchmarks: the 256-CPU node of the issue (2 NUMA
//! nodes x 2 LLCs, SMT2 or SMT8) at a chosen share of busy CPUs.

pub mod load;

use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::features::{Features, System};
use fairplace::engine::state::{CpuState, NodeState};
use fairplace::engine::topology::{CpuTopo, Topology, TopologySpec};

/// 2 nodes x 2 LLCs x `cores` cores x `smt` threads, packed numbering.
pub fn spec(cores: u32, smt: u32) -> TopologySpec {
    let mut cpus = vec![];
    for node in 0..2 {
        for l in 0..2 {
            let llc = node * 2 + l;
            for c in 0..cores {
                for _ in 0..smt {
                    cpus.push(CpuTopo {
                        core: llc * cores + c,
                        cluster: None,
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
        numa_distance: Some(vec![vec![10, 21], vec![21, 10]]),
    }
}

/// The 256-CPU node with SMT2 (32 cores per LLC) or SMT8 (8 per LLC).
pub fn node_256(smt: u32) -> Topology {
    let s = spec(64 / smt, smt);
    let online = CpuMask::first_n(s.cpus.len());
    Topology::build(&s, &online, 30).expect("valid topology")
}

/// A small deterministic generator, so every run measures the same state.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

/// A state with `busy_pct` % of the CPUs running one task at high
/// utilisation, chosen at random with a fixed seed; `keep_idle` CPUs stay idle.
pub fn state(topo: &Topology, busy_pct: u32, keep_idle: &[usize]) -> NodeState {
    let n = topo.nr_cpus;
    let mut rng = Lcg(42);
    let mut cpus: Vec<CpuState> = (0..n).map(|_| CpuState::idle(1024)).collect();
    let want = n * busy_pct as usize / 100;
    let mut busy = 0;
    while busy < want {
        let c = (rng.next_u64() as usize) % n;
        if cpus[c].nr_running == 0 && !keep_idle.contains(&c) {
            cpus[c] = busy_cpu(&mut rng);
            busy += 1;
        }
    }
    NodeState::new(topo, cpus, &[], &Features::default())
}

pub fn busy_cpu(rng: &mut Lcg) -> CpuState {
    let mut c = CpuState::idle(1024);
    c.nr_running = 1 + (rng.next_u64() % 2) as u32;
    c.cfs_h_nr_queued = c.nr_running;
    c.curr_is_idle = false;
    c.load_avg = 800 + (rng.next_u64() % 400) as u32;
    c.runnable_avg = c.load_avg;
    c.util_avg = 900 + (rng.next_u64() % 124) as u32;
    c.util_est = c.util_avg;
    c
}

pub fn system() -> System {
    System::default()
}
