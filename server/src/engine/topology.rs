//! Topology: from a node's CPU description to the kernel's sched-domain tree.
//!
//! The tree is built once per registration (and again when the set of online
//! CPUs changes, as the kernel rebuilds on hotplug). It follows the kernel's
//! `build_sched_domains()`: domains per CPU bottom-up, groups on the full tree,
//! the NUMA imbalance allowance and the shared objects, then degeneration in
//! `cpu_attach_domain()` and the per-CPU shortcuts of `update_top_cache_domain()`.
//! Spans are interned, so a node of N CPUs keeps one mask per distinct span.

use std::collections::HashMap;
use std::fmt;

use super::cpumask::{CpuMask, MAX_CPUS};

/// Sched-domain flags (the subset these algorithms read).
pub mod sd {
    pub const BALANCE_NEWIDLE: u32 = 1 << 0;
    pub const BALANCE_EXEC: u32 = 1 << 1;
    pub const BALANCE_FORK: u32 = 1 << 2;
    pub const BALANCE_WAKE: u32 = 1 << 3;
    pub const WAKE_AFFINE: u32 = 1 << 4;
    pub const ASYM_CPUCAPACITY: u32 = 1 << 5;
    pub const ASYM_CPUCAPACITY_FULL: u32 = 1 << 6;
    pub const SHARE_CPUCAPACITY: u32 = 1 << 7;
    pub const CLUSTER: u32 = 1 << 8;
    pub const SHARE_LLC: u32 = 1 << 9;
    pub const SERIALIZE: u32 = 1 << 10;
    pub const PREFER_SIBLING: u32 = 1 << 11;
    pub const NUMA: u32 = 1 << 12;

    /// Every flag but WAKE_AFFINE needs at least two groups to mean anything.
    pub const DEGENERATE_GROUPS_MASK: u32 = !WAKE_AFFINE;

    pub const NAMES: [(u32, &str); 13] = [
        (BALANCE_NEWIDLE, "BALANCE_NEWIDLE"),
        (BALANCE_EXEC, "BALANCE_EXEC"),
        (BALANCE_FORK, "BALANCE_FORK"),
        (BALANCE_WAKE, "BALANCE_WAKE"),
        (WAKE_AFFINE, "WAKE_AFFINE"),
        (ASYM_CPUCAPACITY, "ASYM_CPUCAPACITY"),
        (ASYM_CPUCAPACITY_FULL, "ASYM_CPUCAPACITY_FULL"),
        (SHARE_CPUCAPACITY, "SHARE_CPUCAPACITY"),
        (CLUSTER, "CLUSTER"),
        (SHARE_LLC, "SHARE_LLC"),
        (SERIALIZE, "SERIALIZE"),
        (PREFER_SIBLING, "PREFER_SIBLING"),
        (NUMA, "NUMA"),
    ];
}

/// An error in an input, naming the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub field: String,
    pub msg: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, msg: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            msg: msg.into(),
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.msg)
    }
}

impl std::error::Error for FieldError {}

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

pub const MAX_NODES: u32 = 256;

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
            let f = format!("{prefix}.numa_distance");
            let size = max_node as usize + 1;
            if d.len() != size {
                return Err(FieldError::new(
                    f,
                    format!("has {} rows, the topology has {size} nodes", d.len()),
                ));
            }
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
                }
            }
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

/// A level of the default topology table plus the NUMA levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Level {
    Smt,
    Cls,
    Mc,
    Pkg,
    Node,
    /// `NUMAj`, j >= 1, with the distance that defines it.
    Numa(u8),
}

impl fmt::Display for Level {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Level::Smt => f.write_str("SMT"),
            Level::Cls => f.write_str("CLS"),
            Level::Mc => f.write_str("MC"),
            Level::Pkg => f.write_str("PKG"),
            Level::Node => f.write_str("NODE"),
            Level::Numa(j) => write!(f, "NUMA{j}"),
        }
    }
}

/// Index of an interned span.
pub type SpanId = u32;

/// One sched domain of one CPU.
#[derive(Debug, Clone)]
pub struct Domain {
    pub level: Level,
    /// Position of the level in the full (undegenerated) level list.
    pub level_idx: u8,
    pub span: SpanId,
    pub weight: u32,
    pub flags: u32,
    pub imbalance_pct: u32,
    pub cache_nice_tries: u32,
    pub imb_numa_nr: u32,
    /// The group ring, local group first.
    pub groups: Vec<SpanId>,
    /// Flags of the first (local) group after degeneration.
    pub first_group_flags: u32,
    /// Shared object (`struct sched_domain_shared`), if this domain owns one.
    pub shared: Option<u32>,
}

impl Domain {
    #[inline]
    pub fn has(&self, flag: u32) -> bool {
        self.flags & flag != 0
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SharedKind {
    Llc,
    Asym,
}

/// A shared object: the holder of `nr_idle_scan` and `has_idle_cores`.
#[derive(Debug, Clone)]
pub struct SharedObj {
    pub kind: SharedKind,
    pub span: SpanId,
    /// Weight and imbalance_pct of the domain owning it after degeneration
    /// (what `update_idle_cpu_scan` reads).
    pub weight: u32,
    pub imbalance_pct: u32,
    /// Still owned by some domain after degeneration.
    pub live: bool,
    /// CPUs whose `balance_shared` is this object (for the idle-core truth).
    pub balance_members: CpuMask,
    /// Topology LLC id, for `llc` objects.
    pub llc: u32,
}

/// The per-CPU results of `update_top_cache_domain()`.
#[derive(Debug, Clone, Default)]
pub struct CpuDomains {
    /// Domains after degeneration, bottom-up. Empty for offline CPUs.
    pub chain: Vec<Domain>,
    /// Index in `chain` of `sd_llc`.
    pub sd_llc: Option<u8>,
    pub llc_size: u32,
    pub share_id: u32,
    /// Index in `chain` of `sd_asym_cpucapacity`.
    pub sd_asym: Option<u8>,
    pub llc_shared: Option<u32>,
    pub balance_shared: Option<u32>,
}

/// A node's built sched-domain tree and everything derived from it.
#[derive(Debug, Clone)]
pub struct Topology {
    pub spec: TopologySpec,
    pub nr_cpus: usize,
    pub online: CpuMask,
    pub node_reclaim_distance: u32,
    pub spans: Vec<CpuMask>,
    pub span_weight: Vec<u32>,
    pub cpu: Vec<CpuDomains>,
    pub shared: Vec<SharedObj>,
    /// Online SMT siblings of each CPU (empty for offline CPUs), ascending.
    smt_first: Vec<u32>,
    smt_len: Vec<u8>,
    smt_cpus: Vec<u16>,
    pub smt_span: Vec<SpanId>,
    /// All topology CPUs of each node, by node id.
    pub node_cpus: Vec<CpuMask>,
    pub smt_active: bool,
    pub asym_active: bool,
    pub cluster_active: bool,
    /// Distinct distances among nodes with online CPUs, ascending.
    pub distances: Vec<u32>,
    pub levels: Vec<Level>,
    /// Groups wider than a core, whose statistics each snapshot keeps.
    pub sum_groups: Vec<SpanId>,
    /// Position in `sum_groups` by span id; `u32::MAX` = not kept.
    pub sum_index: Vec<u32>,
    /// The kept groups each CPU belongs to.
    pub cpu_sum_groups: Vec<Vec<u16>>,
}

/// A domain under construction, before degeneration.
struct Proto {
    d: Domain,
}

impl Topology {
    /// Builds the domain tree for the given online CPUs, as the kernel does.
    pub fn build(
        spec: &TopologySpec,
        online: &CpuMask,
        node_reclaim_distance: u32,
    ) -> Result<Topology, FieldError> {
        spec.validate("topology")?;
        let n = spec.cpus.len();
        let mut online = *online;
        online.and_assign(&CpuMask::first_n(n));
        let mut b = Builder {
            spec,
            online,
            spans: Vec::new(),
            span_ids: HashMap::new(),
            by_core: HashMap::new(),
            by_cluster: HashMap::new(),
            by_llc: HashMap::new(),
            by_node: HashMap::new(),
        };
        for (i, c) in spec.cpus.iter().enumerate() {
            b.by_core.entry(c.core).or_default().set(i);
            if let Some(cl) = c.cluster {
                b.by_cluster.entry(cl).or_default().set(i);
            }
            b.by_llc.entry(c.llc).or_default().set(i);
            b.by_node.entry(c.node).or_default().set(i);
        }

        let max_node = spec.cpus.iter().map(|c| c.node).max().unwrap_or(0);
        let mut node_cpus = vec![CpuMask::new(); max_node as usize + 1];
        for (i, c) in spec.cpus.iter().enumerate() {
            node_cpus[c.node as usize].set(i);
        }
        let online_nodes: Vec<u32> = (0..=max_node)
            .filter(|&nd| node_cpus[nd as usize].intersects(&online))
            .collect();
        let mut distances: Vec<u32> = online_nodes
            .iter()
            .flat_map(|&a| online_nodes.iter().map(move |&bb| (a, bb)))
            .map(|(a, bb)| spec.distance(a, bb))
            .collect();
        distances.push(10);
        distances.sort_unstable();
        distances.dedup();

        let has_cluster = spec.cpus[0].cluster.is_some();
        let mut levels = vec![Level::Smt];
        if has_cluster {
            levels.push(Level::Cls);
        }
        levels.extend([Level::Mc, Level::Pkg, Level::Node]);
        for j in 1..distances.len() {
            levels.push(Level::Numa(j as u8));
        }

        let mut all_caps: Vec<u32> = spec.cpus.iter().map(|c| c.capacity).collect();
        all_caps.sort_unstable();
        all_caps.dedup();
        let online_caps: Vec<u32> = {
            let mut v: Vec<u32> = online.iter().map(|i| spec.cpus[i].capacity).collect();
            v.sort_unstable();
            v.dedup();
            v
        };

        // build_sched_domain() for every level of every online CPU.
        let mut chains: Vec<Vec<Proto>> = (0..n).map(|_| Vec::new()).collect();
        for c in online.iter() {
            let mut chain: Vec<Proto> = Vec::new();
            for (li, &level) in levels.iter().enumerate() {
                let span = b.level_span(level, c, &distances);
                let weight = span.weight() as u32;
                let mut flags = sd::BALANCE_NEWIDLE
                    | sd::BALANCE_EXEC
                    | sd::BALANCE_FORK
                    | sd::WAKE_AFFINE
                    | sd::PREFER_SIBLING;
                flags |= match level {
                    Level::Smt => sd::SHARE_CPUCAPACITY | sd::SHARE_LLC,
                    Level::Cls => sd::CLUSTER | sd::SHARE_LLC,
                    Level::Mc => sd::SHARE_LLC,
                    Level::Pkg | Level::Node => 0,
                    Level::Numa(_) => sd::NUMA,
                };
                if all_caps.len() >= 2 {
                    let mut in_span: Vec<u32> =
                        span.iter().map(|i| spec.cpus[i].capacity).collect();
                    in_span.sort_unstable();
                    in_span.dedup();
                    let miss = online_caps
                        .iter()
                        .filter(|v| in_span.binary_search(v).is_err())
                        .count();
                    if in_span.len() >= 2 {
                        flags |= sd::ASYM_CPUCAPACITY;
                        if miss == 0 {
                            flags |= sd::ASYM_CPUCAPACITY_FULL;
                        }
                    }
                }
                // sd_init: do not spread across CPUs of different capacities.
                if flags & sd::ASYM_CPUCAPACITY != 0
                    && let Some(child) = chain.last_mut()
                {
                    child.d.flags &= !sd::PREFER_SIBLING;
                }
                let (imbalance_pct, cache_nice_tries) = if flags & sd::SHARE_CPUCAPACITY != 0 {
                    (110, 0)
                } else if flags & sd::SHARE_LLC != 0 {
                    (117, 1)
                } else if flags & sd::NUMA != 0 {
                    flags &= !sd::PREFER_SIBLING;
                    flags |= sd::SERIALIZE;
                    if let Level::Numa(j) = level
                        && distances[j as usize] > node_reclaim_distance
                    {
                        flags &= !(sd::BALANCE_EXEC | sd::BALANCE_FORK | sd::WAKE_AFFINE);
                    }
                    (117, 2)
                } else {
                    (117, 1)
                };
                let span_id = b.intern(span);
                chain.push(Proto {
                    d: Domain {
                        level,
                        level_idx: li as u8,
                        span: span_id,
                        weight,
                        flags,
                        imbalance_pct,
                        cache_nice_tries,
                        imb_numa_nr: 0,
                        groups: Vec::new(),
                        first_group_flags: 0,
                        shared: None,
                    },
                });
                if span == online {
                    break;
                }
            }
            chains[c] = chain;
        }

        // build_sched_groups() / build_overlap_sched_groups() on the full tree.
        // The initial flags of each group object are those of the child domain
        // it was made from.
        //
        // Non-NUMA groups are objects shared by the CPUs of a span, and every
        // CPU's build rewrites their ring; the CPUs build in ascending order,
        // so the ring that stays is the one the span's highest CPU built
        // (groups in the order of wrap(span, max)), entered at each CPU's own
        // group. The scenario format walks wrap(span, c) instead; the two
        // differ only for numberings where those walks are not rotations of
        // each other, and the kernel wins. NUMA groups are per-CPU copies.
        let mut group_flags: HashMap<(u8, SpanId), u32> = HashMap::new();
        for c in online.iter() {
            for li in 0..chains[c].len() {
                let span_id = chains[c][li].d.span;
                let span = b.spans[span_id as usize];
                let is_numa = matches!(chains[c][li].d.level, Level::Numa(_));
                let mut covered = CpuMask::new();
                let mut groups = Vec::new();
                let start = if is_numa {
                    c
                } else {
                    span.iter().last().expect("a domain spans its CPU")
                };
                let mut walk = super::cpumask::WrapWalk::new(start, n);
                while let Some(i) = walk.next(&span) {
                    if covered.test(i) {
                        continue;
                    }
                    let (gspan, gflags) = if is_numa {
                        // The sibling is CPU i's own domain at this level; skip
                        // it when i's tree stopped below this level.
                        let Some(sib) = chains[i].get(li) else {
                            continue;
                        };
                        if !b.spans[sib.d.span as usize].test(i) {
                            continue;
                        }
                        let mut s = li;
                        while s > 0 && !b.spans[chains[i][s - 1].d.span as usize].is_subset(&span) {
                            s -= 1;
                        }
                        if s > 0 {
                            (chains[i][s - 1].d.span, chains[i][s - 1].d.flags)
                        } else {
                            (chains[i][0].d.span, 0)
                        }
                    } else if li == 0 {
                        (b.intern(CpuMask::from_cpus([i])), 0)
                    } else {
                        (chains[i][li - 1].d.span, chains[i][li - 1].d.flags)
                    };
                    covered.or_assign(&b.spans[gspan as usize]);
                    group_flags.insert((li as u8, gspan), gflags);
                    groups.push(gspan);
                }
                // The ring is entered at the CPU's own (local) group.
                let local = groups
                    .iter()
                    .position(|g| b.spans[*g as usize].test(c))
                    .expect("some group holds the CPU");
                groups.rotate_left(local);
                chains[c][li].d.groups = groups;
            }
        }

        let asym_active = online
            .iter()
            .any(|c| chains[c].iter().any(|p| p.d.has(sd::ASYM_CPUCAPACITY)));

        // The NUMA imbalance allowance, on the undegenerated tree.
        for c in online.iter() {
            let chain = &mut chains[c];
            let mut imb = 0u32;
            let mut imb_span = 1u32;
            for k in 0..chain.len() {
                let is_p =
                    !chain[k].d.has(sd::SHARE_LLC) && k > 0 && chain[k - 1].d.has(sd::SHARE_LLC);
                if is_p {
                    let nr_llcs = chain[k].d.weight / chain[k - 1].d.weight;
                    imb = if nr_llcs == 1 {
                        chain[k].d.weight >> 3
                    } else {
                        nr_llcs
                    };
                    imb = imb.max(1);
                    chain[k].d.imb_numa_nr = imb;
                    imb_span = chain[k + 1..]
                        .iter()
                        .find(|p| p.d.has(sd::NUMA))
                        .map_or(chain[k].d.weight, |p| p.d.weight);
                } else {
                    let factor = (chain[k].d.weight / imb_span).max(1);
                    chain[k].d.imb_numa_nr = imb * factor;
                }
            }
        }

        // Shared objects, attached before degeneration.
        let mut shared: Vec<SharedObj> = Vec::new();
        let mut shared_ids: HashMap<(SharedKind, SpanId), u32> = HashMap::new();
        let mut get_shared = |kind: SharedKind, span: SpanId, llc: u32| -> u32 {
            *shared_ids.entry((kind, span)).or_insert_with(|| {
                shared.push(SharedObj {
                    kind,
                    span,
                    weight: 0,
                    imbalance_pct: 0,
                    live: false,
                    balance_members: CpuMask::new(),
                    llc,
                });
                (shared.len() - 1) as u32
            })
        };
        for c in online.iter() {
            let chain = &mut chains[c];
            let llc = spec.cpus[c].llc;
            if asym_active
                && let Some(p) = chain
                    .iter_mut()
                    .find(|p| p.d.has(sd::ASYM_CPUCAPACITY_FULL))
                && !p.d.has(sd::NUMA)
            {
                p.d.shared = Some(get_shared(SharedKind::Asym, p.d.span, llc));
            }
            if let Some(p) = chain.iter_mut().rev().find(|p| p.d.has(sd::SHARE_LLC)) {
                p.d.shared = Some(get_shared(SharedKind::Llc, p.d.span, llc));
            }
        }

        // cpu_attach_domain(): degeneration, CPUs in ascending order.
        // Offline CPUs have no domains; as in the kernel, they share nothing.
        let mut cpu: Vec<CpuDomains> = (0..n)
            .map(|c| CpuDomains {
                llc_size: 1,
                share_id: c as u32,
                ..CpuDomains::default()
            })
            .collect();
        for c in online.iter() {
            let mut chain: Vec<Domain> = std::mem::take(&mut chains[c])
                .into_iter()
                .map(|p| p.d)
                .collect();
            let mut i = 0;
            while i + 1 < chain.len() {
                if parent_degenerate(&b.spans, &chain[i], &chain[i + 1]) {
                    if let Some(gp) = chain.get(i + 2) {
                        group_flags.insert((gp.level_idx, gp.groups[0]), chain[i].flags);
                    }
                    let p = chain.remove(i + 1);
                    if p.has(sd::PREFER_SIBLING) {
                        chain[i].flags |= sd::PREFER_SIBLING;
                    }
                    if p.shared.is_some() {
                        chain[i].shared = p.shared;
                    }
                } else {
                    i += 1;
                }
            }
            if !chain.is_empty() && degenerate(&chain[0]) {
                chain.remove(0);
                if let Some(first) = chain.first() {
                    group_flags.insert((first.level_idx, first.groups[0]), 0);
                }
            }
            cpu[c].chain = chain;
        }

        // update_top_cache_domain() and the static keys.
        let mut cluster_active = false;
        for c in online.iter() {
            let cd = &mut cpu[c];
            for d in cd.chain.iter_mut() {
                d.first_group_flags = group_flags[&(d.level_idx, d.groups[0])];
            }
            let mut llc = None;
            for (k, d) in cd.chain.iter().enumerate() {
                if !d.has(sd::SHARE_LLC) {
                    break;
                }
                llc = Some(k as u8);
            }
            cd.sd_llc = llc;
            cd.llc_size = llc.map_or(1, |k| cd.chain[k as usize].weight);
            cd.share_id = match cd.chain.iter().find(|d| d.has(sd::CLUSTER)) {
                Some(d) => b.spans[d.span as usize].first().unwrap() as u32,
                None => match llc {
                    Some(k) => b.spans[cd.chain[k as usize].span as usize].first().unwrap() as u32,
                    None => c as u32,
                },
            };
            if cd.chain.iter().any(|d| d.has(sd::CLUSTER)) {
                cluster_active = true;
            }
            cd.sd_asym = cd
                .chain
                .iter()
                .position(|d| d.has(sd::ASYM_CPUCAPACITY_FULL))
                .map(|k| k as u8);
            cd.llc_shared = llc.and_then(|k| cd.chain[k as usize].shared);
            cd.balance_shared = cd
                .sd_asym
                .and_then(|k| cd.chain[k as usize].shared)
                .or(cd.llc_shared);
            for d in &cd.chain {
                if let Some(s) = d.shared {
                    let obj = &mut shared[s as usize];
                    if !obj.live {
                        obj.live = true;
                        obj.weight = d.weight;
                        obj.imbalance_pct = d.imbalance_pct;
                    }
                }
            }
            if let Some(s) = cd.balance_shared {
                shared[s as usize].balance_members.set(c);
            }
        }

        // Online SMT siblings per CPU.
        let mut smt_first = vec![0u32; n];
        let mut smt_len = vec![0u8; n];
        let mut smt_cpus: Vec<u16> = Vec::new();
        let mut smt_span = vec![0 as SpanId; n];
        let mut smt_active = false;
        let mut by_core: HashMap<u32, CpuMask> = HashMap::new();
        for c in online.iter() {
            by_core.entry(spec.cpus[c].core).or_default().set(c);
        }
        for c in online.iter() {
            let m = by_core[&spec.cpus[c].core];
            smt_first[c] = smt_cpus.len() as u32;
            smt_len[c] = m.weight().min(255) as u8;
            smt_cpus.extend(m.iter().map(|s| s as u16));
            smt_span[c] = b.intern(m);
            if m.weight() >= 2 {
                smt_active = true;
            }
        }
        let empty = b.intern(CpuMask::new());
        for (c, span) in smt_span.iter_mut().enumerate() {
            if !online.test(c) {
                *span = empty;
            }
        }

        let span_weight: Vec<u32> = b.spans.iter().map(|s| s.weight() as u32).collect();
        // The groups wider than a core (LLCs, clusters, NUMA nodes, ...):
        // their sums are kept per snapshot for the slow path.
        let mut sum_index = vec![u32::MAX; b.spans.len()];
        let mut sum_groups: Vec<SpanId> = Vec::new();
        for c in online.iter() {
            for d in &cpu[c].chain {
                for &g in &d.groups {
                    let m = &b.spans[g as usize];
                    let first = m.first().unwrap_or(0);
                    if sum_index[g as usize] == u32::MAX
                        && span_weight[g as usize] > 1
                        && *m != b.spans[smt_span[first] as usize]
                    {
                        sum_index[g as usize] = sum_groups.len() as u32;
                        sum_groups.push(g);
                    }
                }
            }
        }
        let mut cpu_sum_groups: Vec<Vec<u16>> = vec![Vec::new(); n];
        for (k, &g) in sum_groups.iter().enumerate() {
            for c in b.spans[g as usize].iter() {
                cpu_sum_groups[c].push(k as u16);
            }
        }
        Ok(Topology {
            spec: spec.clone(),
            nr_cpus: n,
            online,
            node_reclaim_distance,
            spans: b.spans,
            span_weight,
            cpu,
            shared,
            smt_first,
            smt_len,
            smt_cpus,
            smt_span,
            node_cpus,
            smt_active,
            asym_active,
            cluster_active,
            distances,
            levels,
            sum_groups,
            sum_index,
            cpu_sum_groups,
        })
    }

    #[inline]
    pub fn span(&self, id: SpanId) -> &CpuMask {
        &self.spans[id as usize]
    }

    /// Online SMT siblings of `cpu` (itself included), ascending.
    #[inline]
    pub fn smt_siblings(&self, cpu: usize) -> &[u16] {
        let f = self.smt_first[cpu] as usize;
        &self.smt_cpus[f..f + self.smt_len[cpu] as usize]
    }

    #[inline]
    pub fn smt_mask(&self, cpu: usize) -> &CpuMask {
        self.span(self.smt_span[cpu])
    }

    #[inline]
    pub fn domains(&self, cpu: usize) -> &[Domain] {
        &self.cpu[cpu].chain
    }

    #[inline]
    pub fn sd_llc(&self, cpu: usize) -> Option<&Domain> {
        let cd = &self.cpu[cpu];
        cd.sd_llc.map(|k| &cd.chain[k as usize])
    }

    #[inline]
    pub fn sd_asym(&self, cpu: usize) -> Option<&Domain> {
        let cd = &self.cpu[cpu];
        cd.sd_asym.map(|k| &cd.chain[k as usize])
    }

    #[inline]
    pub fn llc_size(&self, cpu: usize) -> u32 {
        self.cpu[cpu].llc_size
    }

    /// `cpus_share_cache()`: the same LLC among online CPUs; offline CPUs all
    /// carry the kernel's id -1.
    #[inline]
    pub fn cpus_share_cache(&self, a: usize, b: usize) -> bool {
        if a == b {
            return true;
        }
        match (self.online.test(a), self.online.test(b)) {
            (true, true) => self.spec.cpus[a].llc == self.spec.cpus[b].llc,
            (false, false) => true,
            _ => false,
        }
    }

    /// `cpus_share_resources()`: the same cluster, or the same LLC without clusters.
    #[inline]
    pub fn cpus_share_resources(&self, a: usize, b: usize) -> bool {
        a == b || self.cpu[a].share_id == self.cpu[b].share_id
    }

    #[inline]
    pub fn node_of(&self, cpu: usize) -> u32 {
        self.spec.cpus[cpu].node
    }

    /// `arch_scale_cpu_capacity()`.
    #[inline]
    pub fn capacity_orig(&self, cpu: usize) -> u32 {
        self.spec.cpus[cpu].capacity
    }

    /// The domain of `cpu` named `level` (after degeneration), if it survived.
    pub fn domain_by_name(&self, cpu: usize, level: &str) -> Option<usize> {
        self.cpu[cpu]
            .chain
            .iter()
            .position(|d| d.level.to_string() == level)
    }

    /// A readable dump of one CPU's domain tree, to compare trees when two
    /// implementations disagree.
    pub fn describe(&self, cpu: usize) -> String {
        let mut s = String::new();
        for d in self.domains(cpu) {
            let flags: Vec<&str> = sd::NAMES
                .iter()
                .filter(|(f, _)| d.flags & f != 0)
                .map(|(_, n)| *n)
                .collect();
            let groups: Vec<String> = d
                .groups
                .iter()
                .map(|g| format!("{{{}}}", self.span(*g)))
                .collect();
            s.push_str(&format!(
                "{} span={} pct={} cnt={} imb_numa_nr={} shared={:?} groups={} first_group_flags={:#x} flags={}\n",
                d.level,
                self.span(d.span),
                d.imbalance_pct,
                d.cache_nice_tries,
                d.imb_numa_nr,
                d.shared,
                groups.join(""),
                d.first_group_flags,
                flags.join("|")
            ));
        }
        s
    }
}

struct Builder<'a> {
    spec: &'a TopologySpec,
    online: CpuMask,
    spans: Vec<CpuMask>,
    span_ids: HashMap<CpuMask, SpanId>,
    by_core: HashMap<u32, CpuMask>,
    by_cluster: HashMap<u32, CpuMask>,
    by_llc: HashMap<u32, CpuMask>,
    by_node: HashMap<u32, CpuMask>,
}

impl Builder<'_> {
    fn intern(&mut self, m: CpuMask) -> SpanId {
        if let Some(&id) = self.span_ids.get(&m) {
            return id;
        }
        self.spans.push(m);
        let id = (self.spans.len() - 1) as SpanId;
        self.span_ids.insert(m, id);
        id
    }

    /// The span of `level` for CPU `c`, restricted to online CPUs.
    fn level_span(&self, level: Level, c: usize, distances: &[u32]) -> CpuMask {
        let me = &self.spec.cpus[c];
        let m = match level {
            Level::Smt => self.by_core[&me.core],
            Level::Cls => self.by_cluster[&me.cluster.expect("CLS only with clusters")],
            Level::Mc => self.by_llc[&me.llc],
            Level::Pkg | Level::Node => self.by_node[&me.node],
            Level::Numa(j) => {
                let mut m = CpuMask::new();
                for (&node, cpus) in &self.by_node {
                    if self.spec.distance(me.node, node) <= distances[j as usize] {
                        m.or_assign(cpus);
                    }
                }
                m
            }
        };
        m.and(&self.online)
    }
}

/// `sd_degenerate()`.
fn degenerate(d: &Domain) -> bool {
    if d.weight == 1 {
        return true;
    }
    if d.flags & sd::DEGENERATE_GROUPS_MASK != 0 && d.groups.len() > 1 {
        return false;
    }
    !d.has(sd::WAKE_AFFINE)
}

/// `sd_parent_degenerate()`.
fn parent_degenerate(spans: &[CpuMask], d: &Domain, p: &Domain) -> bool {
    if degenerate(p) {
        return true;
    }
    if spans[d.span as usize] != spans[p.span as usize] {
        return false;
    }
    let mut pflags = p.flags;
    if p.groups.len() == 1 {
        pflags &= !sd::DEGENERATE_GROUPS_MASK;
    }
    pflags & !d.flags == 0
}
