//! What an agent says of its machine ([`TopologySpec`]: CPUs, cores,
//! clusters, LLCs, nodes, capacities, the NUMA distance table) and the
//! rules it must meet before a tree is built from it, each refusal naming
//! its field.

use std::collections::HashMap;

use crate::engine::cpumask::MAX_CPUS;

use super::*;

/// One CPU as the agent describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CpuTopo {
    pub core: u32,
    pub cluster: Option<u32>,
    pub llc: u32,
    pub node: u32,
    /// `arch_scale_cpu_capacity()`, 1..=1024.
    pub capacity: u32,
}

/// A node's hardware: every CPU that exists, online or not, in id order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TopologySpec {
    pub cpus: Vec<CpuTopo>,
    /// Square matrix indexed by node id; `None` = 10 on the diagonal, 20 elsewhere.
    pub numa_distance: Option<Vec<Vec<u32>>>,
}

/// Largest number of NUMA nodes (node ids `0..MAX_NODES`); the kernel's
/// x86-64 default is 1,024, the largest machines built have 256 or fewer.
pub const MAX_NODES: u32 = 256;

/// Largest number of distinct distances between two different nodes in
/// `numa_distance`. Each one is a NUMA sched-domain level of every CPU, so
/// this bounds the depth of the trees (SMT..NODE plus this many levels) and
/// what the build and each snapshot's group sums cost. Real machines have a
/// handful: 1 to 3 on two- to eight-socket servers (with sub-NUMA
/// clustering), fewer than 10 on the largest fabric-connected ones. The
/// kernel itself stops only at 256 (`NR_DISTANCE_VALUES`); a 4,096-CPU node
/// with ~250 levels is a million domains, seconds to build. At this limit
/// the costliest table (256 nodes on a ring, every level a new span for
/// every node) builds in well under 100 ms.
pub const MAX_NUMA_DISTANCES: usize = 16;

impl TopologySpec {
    /// Checks the rules of a consistent topology. `prefix` names the topology
    /// object in error messages (for example `topology`).
    pub fn validate(&self, prefix: &str) -> Result<(), FieldError> {
        let n = self.cpus.len();
        if n == 0 {
            return Err(FieldError::new(
                format!("{prefix}.cpus"),
                "at least one CPU is required",
            ));
        }
        if n > MAX_CPUS {
            return Err(FieldError::new(
                format!("{prefix}.cpus"),
                format!("{n} CPUs exceed the limit of {MAX_CPUS}"),
            ));
        }
        let has_cluster = self.cpus[0].cluster.is_some();
        let mut core_of: HashMap<u32, (usize, Option<u32>, u32, u32, u32)> = HashMap::new();
        let mut cluster_llc: HashMap<u32, (usize, u32)> = HashMap::new();
        let mut llc_node: HashMap<u32, (usize, u32)> = HashMap::new();
        let mut max_node = 0;
        for (i, c) in self.cpus.iter().enumerate() {
            let f = |name: &str| format!("{prefix}.cpus[{i}].{name}");
            if c.cluster.is_some() != has_cluster {
                return Err(FieldError::new(
                    f("cluster"),
                    "either every CPU has a cluster or none does",
                ));
            }
            if c.capacity == 0 || c.capacity > 1024 {
                return Err(FieldError::new(
                    f("capacity"),
                    format!("{} is outside 1..1024", c.capacity),
                ));
            }
            if c.node >= MAX_NODES {
                return Err(FieldError::new(
                    f("node"),
                    format!("{} is outside 0..{}", c.node, MAX_NODES - 1),
                ));
            }
            max_node = max_node.max(c.node);
            match core_of.get(&c.core) {
                Some(&(j, cl, llc, node, cap)) => {
                    if cl != c.cluster {
                        return Err(FieldError::new(
                            f("cluster"),
                            format!("core {} lies in two clusters (see CPU {j})", c.core),
                        ));
                    }
                    if llc != c.llc {
                        return Err(FieldError::new(
                            f("llc"),
                            format!("core {} lies in two LLCs (see CPU {j})", c.core),
                        ));
                    }
                    if node != c.node {
                        return Err(FieldError::new(
                            f("node"),
                            format!("core {} lies in two nodes (see CPU {j})", c.core),
                        ));
                    }
                    if cap != c.capacity {
                        return Err(FieldError::new(
                            f("capacity"),
                            format!(
                                "SMT siblings of core {} differ in capacity (see CPU {j})",
                                c.core
                            ),
                        ));
                    }
                }
                None => {
                    core_of.insert(c.core, (i, c.cluster, c.llc, c.node, c.capacity));
                }
            }
            if let Some(cl) = c.cluster {
                match cluster_llc.get(&cl) {
                    Some(&(j, llc)) if llc != c.llc => {
                        return Err(FieldError::new(
                            f("llc"),
                            format!("cluster {cl} lies in two LLCs (see CPU {j})"),
                        ));
                    }
                    Some(_) => {}
                    None => {
                        cluster_llc.insert(cl, (i, c.llc));
                    }
                }
            }
            match llc_node.get(&c.llc) {
                Some(&(j, node)) if node != c.node => {
                    return Err(FieldError::new(
                        f("node"),
                        format!("LLC {} lies in two nodes (see CPU {j})", c.llc),
                    ));
                }
                Some(_) => {}
                None => {
                    llc_node.insert(c.llc, (i, c.node));
                }
            }
        }
        if let Some(d) = &self.numa_distance {
            validate_numa_distance(d, &format!("{prefix}.numa_distance"), max_node as usize + 1)?;
        }
        Ok(())
    }

    pub fn distance(&self, a: u32, b: u32) -> u32 {
        match &self.numa_distance {
            Some(d) => d[a as usize][b as usize],
            None if a == b => 10,
            None => 20,
        }
    }
}

/// The distance table's rules: square over the topology's nodes, 10 on the
/// diagonal, 11..254 elsewhere, symmetric, and at most
/// `MAX_NUMA_DISTANCES` distinct values off the diagonal.
pub(super) fn validate_numa_distance(
    d: &[Vec<u32>],
    f: &str,
    size: usize,
) -> Result<(), FieldError> {
    if d.len() != size {
        return Err(FieldError::new(
            f,
            format!("has {} rows, the topology has {size} nodes", d.len()),
        ));
    }
    // The values met off the diagonal, as a bitmap of 0..256.
    let mut seen = [0u64; 4];
    for (a, row) in d.iter().enumerate() {
        if row.len() != size {
            return Err(FieldError::new(
                format!("{f}[{a}]"),
                format!("has {} entries, expected {size}", row.len()),
            ));
        }
        for (b, &v) in row.iter().enumerate() {
            let ok = if a == b {
                v == 10
            } else {
                (11..=254).contains(&v)
            };
            if !ok {
                let want = if a == b { "10" } else { "11..254" };
                return Err(FieldError::new(
                    format!("{f}[{a}][{b}]"),
                    format!("{v} must be {want}"),
                ));
            }
            if d[b].get(a) != Some(&v) {
                return Err(FieldError::new(
                    format!("{f}[{a}][{b}]"),
                    "the matrix is not symmetric",
                ));
            }
            if a != b {
                seen[v as usize / 64] |= 1 << (v % 64);
            }
        }
    }
    let distinct: usize = seen.iter().map(|w| w.count_ones() as usize).sum();
    if distinct > MAX_NUMA_DISTANCES {
        return Err(FieldError::new(
            f,
            format!(
                "{distinct} distinct distances between nodes exceed the limit of \
                 {MAX_NUMA_DISTANCES} (each is a NUMA level of every CPU's sched domains)"
            ),
        ));
    }
    Ok(())
}
