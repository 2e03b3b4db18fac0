//! The NUMA levels: `sched_init_numa()`'s distances and node sets, and the
//! allowance for NUMA imbalance (`imb_numa_nr`) on the built tree.

use super::*;

/// A set of online nodes by dense index (at most `MAX_NODES`).
pub(super) type NodeSet = [u64; (MAX_NODES as usize).div_ceil(64)];

#[inline]
pub(super) fn ns_test(s: &NodeSet, x: usize) -> bool {
    s[x / 64] & (1 << (x % 64)) != 0
}

#[inline]
pub(super) fn ns_subset(a: &NodeSet, b: &NodeSet) -> bool {
    a.iter().zip(b).all(|(x, y)| x & !y == 0)
}

/// The members of `a` that are not in `b`, ascending.
pub(super) fn ns_andnot(a: &NodeSet, b: &NodeSet) -> impl Iterator<Item = usize> {
    let words: NodeSet = std::array::from_fn(|i| a[i] & !b[i]);
    (0..words.len()).flat_map(move |i| {
        let mut w = words[i];
        std::iter::from_fn(move || {
            (w != 0).then(|| {
                let bit = w.trailing_zeros() as usize;
                w &= w - 1;
                i * 64 + bit
            })
        })
    })
}

/// What `sched_init_numa()` derives from the distance table, for the nodes
/// with online CPUs (dense indices, ascending node ids).
pub(super) struct Numa {
    /// Dense index of each node id; `u32::MAX` for a node with no online CPU.
    pub(super) index: Vec<u32>,
    /// Distinct distances among online nodes, ascending, the local 10 first
    /// (`sched_domains_numa_distance`).
    pub(super) distances: Vec<u32>,
    /// `sets[m * distances.len() + j]`: the nodes within `distances[j]` of
    /// node `m` (`sched_domains_numa_masks[j][m]`, as nodes).
    pub(super) sets: Vec<NodeSet>,
    /// Online CPUs of each node, their capacities (when capacities differ),
    /// and the lowest of them.
    pub(super) cpus: Vec<CpuMask>,
    pub(super) caps: Vec<CapSet>,
    pub(super) first_cpu: Vec<u32>,
}

/// `sched_init_numa()`: the distinct distances and, per node and distance,
/// the nodes within it: O(nodes^2) lookups and O(nodes x levels) sets.
pub(super) fn sched_init_numa(spec: &TopologySpec, online: &CpuMask, caps_differ: bool) -> Numa {
    let max_node = spec.cpus.iter().map(|c| c.node).max().unwrap_or(0) as usize;
    let mut index = vec![u32::MAX; max_node + 1];
    for c in online.iter() {
        index[spec.cpus[c].node as usize] = 0;
    }
    let mut nodes = Vec::new();
    for (nd, ix) in index.iter_mut().enumerate() {
        if *ix == 0 {
            *ix = nodes.len() as u32;
            nodes.push(nd as u32);
        }
    }
    let m = nodes.len();
    let mut cpus = vec![CpuMask::new(); m];
    let mut caps = vec![CapSet::default(); if caps_differ { m } else { 0 }];
    let mut first_cpu = vec![u32::MAX; m];
    for c in online.iter() {
        let x = index[spec.cpus[c].node as usize] as usize;
        cpus[x].set(c);
        first_cpu[x] = first_cpu[x].min(c as u32);
        if caps_differ {
            caps[x].add(spec.cpus[c].capacity);
        }
    }
    // Distances are 10..=254: a bitmap of the values met, then each value's level.
    let mut seen = [false; 256];
    seen[10] = true;
    for &a in &nodes {
        for &b in &nodes {
            seen[spec.distance(a, b) as usize] = true;
        }
    }
    let distances: Vec<u32> = (0..256u32).filter(|&v| seen[v as usize]).collect();
    let mut level_of = [0u8; 256];
    for (j, &d) in distances.iter().enumerate() {
        level_of[d as usize] = j as u8;
    }
    let nl = distances.len();
    let mut sets = vec![[0u64; 4]; m * nl];
    for (x, &a) in nodes.iter().enumerate() {
        let row = &mut sets[x * nl..(x + 1) * nl];
        for (y, &b) in nodes.iter().enumerate() {
            row[level_of[spec.distance(a, b) as usize] as usize][y / 64] |= 1 << (y % 64);
        }
        for j in 1..nl {
            let below = row[j - 1];
            for (w, b) in row[j].iter_mut().zip(below) {
                *w |= b;
            }
        }
    }
    Numa {
        index,
        distances,
        sets,
        cpus,
        caps,
        first_cpu,
    }
}

/// `build_sched_domains()`: the allowance for NUMA imbalance, on the
/// undegenerated tree. The first domain above the LLC gets the number of
/// LLCs it spans (or an eighth of its CPUs with one LLC); the NUMA levels
/// above get that times their size in units of the first NUMA domain.
pub(super) fn numa_imbalance_allowance(chains: &mut [Vec<Domain>]) {
    for chain in chains.iter_mut() {
        let mut imb = 0u32;
        let mut imb_span = 1u32;
        for k in 0..chain.len() {
            let is_p = !chain[k].has(sd::SHARE_LLC) && k > 0 && chain[k - 1].has(sd::SHARE_LLC);
            if is_p {
                let nr_llcs = chain[k].weight / chain[k - 1].weight;
                imb = if nr_llcs == 1 {
                    chain[k].weight >> 3
                } else {
                    nr_llcs
                };
                imb = imb.max(1);
                chain[k].imb_numa_nr = imb;
                imb_span = chain[k + 1..]
                    .iter()
                    .find(|p| p.has(sd::NUMA))
                    .map_or(chain[k].weight, |p| p.weight);
            } else {
                let factor = (chain[k].weight / imb_span).max(1);
                chain[k].imb_numa_nr = imb * factor;
            }
        }
    }
}
