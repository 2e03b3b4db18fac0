//! Topology: from a node's CPU description to the kernel's sched-domain tree.
//!
//! The tree is built once per registration (and again when the set of online
//! CPUs changes, as the kernel rebuilds on hotplug). It follows the kernel's
//! `build_sched_domains()`: domains per CPU bottom-up, groups on the full tree,
//! the NUMA imbalance allowance and the shared objects, then degeneration in
//! `cpu_attach_domain()` and the per-CPU shortcuts of `update_top_cache_domain()`.
//!
//! The build costs O(CPUs x levels) steps of O(mask words), as the kernel's
//! does: every span is computed and interned once per distinct span (the
//! kernel's per-level masks), the groups of a span are built once and shared
//! by its CPUs (the kernel's shared `sched_group` rings), and the NUMA levels
//! are worked out node by node (`sched_init_numa()`). The limits below bound
//! the levels, so the 4,096-CPU, 256-node worst case builds in milliseconds.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::Deref;
use std::sync::Arc;

use crate::engine::cpumask::{CpuMask, MAX_CPUS};

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

pub use fairplace_types::FieldError;

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
fn validate_numa_distance(d: &[Vec<u32>], f: &str, size: usize) -> Result<(), FieldError> {
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
    pub groups: Groups,
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

/// The group ring of a domain, entered at the domain's local group: a view
/// of a ring shared by every domain with the same groups, as the kernel's
/// CPUs of a span share one `sched_group` ring (each enters it at its own
/// group). Reads as a slice of group spans.
#[derive(Clone)]
pub struct Groups {
    ring: Arc<Ring>,
    start: u32,
}

/// A shared ring: its groups twice over (less the last), so every rotation
/// is one contiguous slice.
struct Ring {
    id: u32,
    len: u32,
    spans: Box<[SpanId]>,
}

impl Groups {
    /// The placeholder of a domain whose groups are not built yet.
    fn none(empty: &Arc<Ring>) -> Groups {
        Groups {
            ring: Arc::clone(empty),
            start: 0,
        }
    }

    fn ring_id(&self) -> u32 {
        self.ring.id
    }
}

impl Deref for Groups {
    type Target = [SpanId];
    #[inline]
    fn deref(&self) -> &[SpanId] {
        let s = self.start as usize;
        &self.ring.spans[s..s + self.ring.len as usize]
    }
}

impl<'a> IntoIterator for &'a Groups {
    type Item = &'a SpanId;
    type IntoIter = std::slice::Iter<'a, SpanId>;
    fn into_iter(self) -> Self::IntoIter {
        self.deref().iter()
    }
}

impl fmt::Debug for Groups {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
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

impl Topology {
    /// Builds the domain tree for the given online CPUs, as the kernel's
    /// `build_sched_domains()` does, step by step in the kernel's order.
    pub fn build(
        spec: &TopologySpec,
        online: &CpuMask,
        node_reclaim_distance: u32,
    ) -> Result<Topology, FieldError> {
        spec.validate("topology")?;
        let n = spec.cpus.len();
        let mut online = *online;
        online.and_assign(&CpuMask::first_n(n));

        let mut b = Builder::new(spec, online, node_reclaim_distance);
        let mut chains = b.build_sched_domains();
        b.build_sched_groups(&mut chains);
        b.build_overlap_sched_groups(&mut chains);
        let mut group_flags = b.init_group_flags(&chains);
        let asym_active = chains
            .iter()
            .any(|chain| chain.iter().any(|d| d.has(sd::ASYM_CPUCAPACITY)));
        numa_imbalance_allowance(&mut chains);
        let mut shared = claim_allocations(spec, &mut chains, asym_active);
        let smt = b.smt_siblings();
        let mut cpu = cpu_attach_domain(chains, &mut group_flags);
        let cluster_active = update_top_cache_domain(&mut cpu, &b.spans, &group_flags, &mut shared);

        let empty = b.intern(CpuMask::new());
        let mut smt_span = smt.span;
        for (c, span) in smt_span.iter_mut().enumerate() {
            if !online.test(c) {
                *span = empty;
            }
        }
        let span_weight: Vec<u32> = b.spans.iter().map(|s| s.weight() as u32).collect();
        let (sum_groups, sum_index, cpu_sum_groups) =
            sum_groups(&cpu, &b.spans, &span_weight, &smt_span, b.rings.len());
        let node_cpus = {
            let max_node = spec.cpus.iter().map(|c| c.node).max().unwrap_or(0);
            let mut v = vec![CpuMask::new(); max_node as usize + 1];
            for (i, c) in spec.cpus.iter().enumerate() {
                v[c.node as usize].set(i);
            }
            v
        };
        Ok(Topology {
            spec: spec.clone(),
            nr_cpus: n,
            online,
            node_reclaim_distance,
            spans: b.spans,
            span_weight,
            cpu,
            shared,
            smt_first: smt.first,
            smt_len: smt.len,
            smt_cpus: smt.cpus,
            smt_span,
            node_cpus,
            smt_active: smt.active,
            asym_active,
            cluster_active,
            distances: b.numa.distances,
            levels: b.levels,
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

/// A fast hasher for the build's maps (spans' hashes, small integer keys):
/// FxHash's rounds with a final mix. Inputs are the node's own topology, so
/// no flooding defence is needed.
#[derive(Default)]
struct FastHasher(u64);

const FX_K: u64 = 0x517c_c1b7_2722_0a95;

impl FastHasher {
    #[inline]
    fn add(&mut self, w: u64) {
        self.0 = (self.0.rotate_left(5) ^ w).wrapping_mul(FX_K);
    }
}

impl Hasher for FastHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            self.add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
        }
        for &b in chunks.remainder() {
            self.add(b as u64);
        }
    }
    fn write_u8(&mut self, i: u8) {
        self.add(i as u64);
    }
    fn write_u16(&mut self, i: u16) {
        self.add(i as u64);
    }
    fn write_u32(&mut self, i: u32) {
        self.add(i as u64);
    }
    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }
    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }
    fn finish(&self) -> u64 {
        fmix64(self.0)
    }
}

/// MurmurHash3's finaliser.
fn fmix64(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;

/// A mask's hash from its non-zero words only, so a sparse 4,096-bit mask
/// costs a scan and a few rounds.
fn mask_hash(m: &CpuMask) -> u64 {
    let mut h = FastHasher::default();
    for (i, &w) in m.words().iter().enumerate() {
        if w != 0 {
            h.add(i as u64);
            h.add(w);
        }
    }
    h.finish()
}

/// The highest CPU of a mask (`cpumask_last()`).
fn last_cpu(m: &CpuMask) -> Option<usize> {
    let words = m.words();
    let i = words.iter().rposition(|&w| w != 0)?;
    Some(i * 64 + 63 - words[i].leading_zeros() as usize)
}

/// A set of online nodes by dense index (at most `MAX_NODES`).
type NodeSet = [u64; (MAX_NODES as usize).div_ceil(64)];

#[inline]
fn ns_test(s: &NodeSet, x: usize) -> bool {
    s[x / 64] & (1 << (x % 64)) != 0
}

#[inline]
fn ns_subset(a: &NodeSet, b: &NodeSet) -> bool {
    a.iter().zip(b).all(|(x, y)| x & !y == 0)
}

/// The members of `a` that are not in `b`, ascending.
fn ns_andnot(a: &NodeSet, b: &NodeSet) -> impl Iterator<Item = usize> {
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

/// A set of capacities, 0..=1024.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
struct CapSet([u64; 17]);

impl CapSet {
    fn add(&mut self, cap: u32) {
        self.0[cap as usize / 64] |= 1 << (cap % 64);
    }
    fn or_assign(&mut self, o: &CapSet) {
        for (a, b) in self.0.iter_mut().zip(o.0.iter()) {
            *a |= *b;
        }
    }
    fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// The units of one topology level (cores, clusters, LLCs or nodes): a dense
/// unit id per CPU and each unit's online CPUs, ascending. These are the
/// arch masks the kernel's topology table reads (`cpu_smt_mask()`,
/// `cpu_clustergroup_mask()`, `cpu_coregroup_mask()`, `cpu_node_mask()`).
struct Partition {
    of_cpu: Vec<u32>,
    start: Vec<u32>,
    cpus: Vec<u16>,
}

impl Partition {
    fn new(n: usize, online: &CpuMask, key: impl Fn(usize) -> u32) -> Partition {
        let mut ids: FastMap<u32, u32> = FastMap::default();
        let of_cpu: Vec<u32> = (0..n)
            .map(|c| {
                let next = ids.len() as u32;
                *ids.entry(key(c)).or_insert(next)
            })
            .collect();
        let mut start = vec![0u32; ids.len() + 1];
        for c in online.iter() {
            start[of_cpu[c] as usize + 1] += 1;
        }
        for k in 1..start.len() {
            start[k] += start[k - 1];
        }
        let mut fill = start.clone();
        let mut cpus = vec![0u16; start[ids.len()] as usize];
        for c in online.iter() {
            let u = of_cpu[c] as usize;
            cpus[fill[u] as usize] = c as u16;
            fill[u] += 1;
        }
        Partition {
            of_cpu,
            start,
            cpus,
        }
    }

    fn len(&self) -> usize {
        self.start.len() - 1
    }

    fn members(&self, u: u32) -> &[u16] {
        &self.cpus[self.start[u as usize] as usize..self.start[u as usize + 1] as usize]
    }

    fn mask(&self, u: u32) -> CpuMask {
        CpuMask::from_cpus(self.members(u).iter().map(|&c| c as usize))
    }
}

/// What `sched_init_numa()` derives from the distance table, for the nodes
/// with online CPUs (dense indices, ascending node ids).
struct Numa {
    /// Dense index of each node id; `u32::MAX` for a node with no online CPU.
    index: Vec<u32>,
    /// Distinct distances among online nodes, ascending, the local 10 first
    /// (`sched_domains_numa_distance`).
    distances: Vec<u32>,
    /// `sets[m * distances.len() + j]`: the nodes within `distances[j]` of
    /// node `m` (`sched_domains_numa_masks[j][m]`, as nodes).
    sets: Vec<NodeSet>,
    /// Online CPUs of each node, their capacities (when capacities differ),
    /// and the lowest of them.
    cpus: Vec<CpuMask>,
    caps: Vec<CapSet>,
    first_cpu: Vec<u32>,
}

/// `sched_init_numa()`: the distinct distances and, per node and distance,
/// the nodes within it: O(nodes^2) lookups and O(nodes x levels) sets.
fn sched_init_numa(spec: &TopologySpec, online: &CpuMask, caps_differ: bool) -> Numa {
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

/// A level's domain for one span, before groups: what `build_sched_domain()`
/// and `sd_init()` make, the same for every CPU of the span.
#[derive(Clone, Copy)]
struct Tmpl {
    span: SpanId,
    weight: u32,
    flags: u32,
    imbalance_pct: u32,
    cache_nice_tries: u32,
}

/// The online SMT siblings of every CPU (`cpu_smt_mask()`).
struct Smt {
    first: Vec<u32>,
    len: Vec<u8>,
    cpus: Vec<u16>,
    span: Vec<SpanId>,
    active: bool,
}

/// The build's working state: the spans interned so far, the units of every
/// topology level, the NUMA masks, the domains made per distinct span and
/// the shared group rings.
struct Builder<'a> {
    spec: &'a TopologySpec,
    n: usize,
    online: CpuMask,
    online_weight: u32,
    node_reclaim_distance: u32,
    spans: Vec<CpuMask>,
    /// Interning by hash: the newest span of each hash, and for each span
    /// the next older one with the same hash.
    span_ids: FastMap<u64, SpanId>,
    span_next: Vec<SpanId>,
    levels: Vec<Level>,
    /// Index of NODE in `levels`; the NUMA levels follow it.
    node_level: usize,
    core: Partition,
    cluster: Option<Partition>,
    llc: Partition,
    node: Partition,
    numa: Numa,
    /// Whether the topology's CPUs differ in capacity (asym detection runs),
    /// and the capacities of the online CPUs.
    caps_differ: bool,
    online_caps: CapSet,
    /// Per level, per unit: its domain, made when the first CPU meets it.
    tmpl: Vec<Vec<Option<Tmpl>>>,
    rings: Vec<Arc<Ring>>,
    /// Each ring's groups' initial flags (the child domain's).
    ring_flags: Vec<Vec<u32>>,
    empty_ring: Arc<Ring>,
}

impl<'a> Builder<'a> {
    /// The per-level units, `sched_init_numa()` and the level list (the
    /// default topology table, CLS only with clusters, then NUMA1..).
    fn new(spec: &'a TopologySpec, online: CpuMask, node_reclaim_distance: u32) -> Self {
        let n = spec.cpus.len();
        let cpus = &spec.cpus;
        let first = cpus[0].capacity;
        let caps_differ = cpus.iter().any(|c| c.capacity != first);
        let mut online_caps = CapSet::default();
        for c in online.iter() {
            online_caps.add(cpus[c].capacity);
        }
        let has_cluster = cpus[0].cluster.is_some();
        let numa = sched_init_numa(spec, &online, caps_differ);
        let mut levels = vec![Level::Smt];
        if has_cluster {
            levels.push(Level::Cls);
        }
        levels.extend([Level::Mc, Level::Pkg, Level::Node]);
        let node_level = levels.len() - 1;
        levels.extend((1..numa.distances.len()).map(|j| Level::Numa(j as u8)));
        let mut b = Builder {
            spec,
            n,
            online,
            online_weight: online.weight() as u32,
            node_reclaim_distance,
            spans: Vec::new(),
            span_ids: FastMap::default(),
            span_next: Vec::new(),
            levels,
            node_level,
            core: Partition::new(n, &online, |c| cpus[c].core),
            cluster: has_cluster
                .then(|| Partition::new(n, &online, |c| cpus[c].cluster.expect("validated"))),
            llc: Partition::new(n, &online, |c| cpus[c].llc),
            node: Partition::new(n, &online, |c| cpus[c].node),
            numa,
            caps_differ,
            online_caps,
            tmpl: Vec::new(),
            rings: Vec::new(),
            ring_flags: Vec::new(),
            empty_ring: Arc::new(Ring {
                id: u32::MAX,
                len: 0,
                spans: Box::new([]),
            }),
        };
        b.tmpl = (0..b.levels.len())
            .map(|li| vec![None; b.units(li)])
            .collect();
        b
    }

    /// The interned id of a span.
    fn intern(&mut self, m: CpuMask) -> SpanId {
        let h = mask_hash(&m);
        let head = self.span_ids.get(&h).copied().unwrap_or(SpanId::MAX);
        let mut id = head;
        while id != SpanId::MAX {
            if self.spans[id as usize] == m {
                return id;
            }
            id = self.span_next[id as usize];
        }
        let id = self.spans.len() as SpanId;
        self.spans.push(m);
        self.span_next.push(head);
        self.span_ids.insert(h, id);
        id
    }

    fn partition(&self, level: Level) -> &Partition {
        match level {
            Level::Smt => &self.core,
            Level::Cls => self.cluster.as_ref().expect("CLS only with clusters"),
            Level::Mc => &self.llc,
            Level::Pkg | Level::Node => &self.node,
            Level::Numa(_) => unreachable!("NUMA spans are per node"),
        }
    }

    /// Number of distinct spans level `li` can have: its units.
    fn units(&self, li: usize) -> usize {
        match self.levels[li] {
            Level::Numa(_) => self.numa.first_cpu.len(),
            l => self.partition(l).len(),
        }
    }

    /// The unit of CPU `c` at level `li`.
    #[inline]
    fn unit(&self, li: usize, c: usize) -> u32 {
        match self.levels[li] {
            Level::Numa(_) => self.numa.index[self.spec.cpus[c].node as usize],
            l => self.partition(l).of_cpu[c],
        }
    }

    /// `build_sched_domains()`, first loop: every online CPU's domains
    /// bottom-up (`build_sched_domain()` per level), up to the first that
    /// spans every online CPU. Each level's domain is made once per
    /// distinct span, by the first CPU that meets it, so spans are interned
    /// in the order the CPUs meet them; the others copy it.
    fn build_sched_domains(&mut self) -> Vec<Vec<Domain>> {
        let mut chains: Vec<Vec<Domain>> = (0..self.n).map(|_| Vec::new()).collect();
        let online = self.online;
        for c in online.iter() {
            let mut chain: Vec<Domain> = Vec::with_capacity(self.levels.len());
            // The span just made at the level below, when this CPU made it.
            let mut below: Option<(CpuMask, CapSet)> = None;
            for li in 0..self.levels.len() {
                let unit = self.unit(li, c) as usize;
                let t = match self.tmpl[li][unit] {
                    Some(t) => {
                        below = None;
                        t
                    }
                    None => {
                        let (t, made) = self.sd_init(li, unit as u32, below.take());
                        below = Some(made);
                        self.tmpl[li][unit] = Some(t);
                        t
                    }
                };
                // sd_init: do not spread across CPUs of different capacities.
                if t.flags & sd::ASYM_CPUCAPACITY != 0
                    && let Some(child) = chain.last_mut()
                {
                    child.flags &= !sd::PREFER_SIBLING;
                }
                chain.push(Domain {
                    level: self.levels[li],
                    level_idx: li as u8,
                    span: t.span,
                    weight: t.weight,
                    flags: t.flags,
                    imbalance_pct: t.imbalance_pct,
                    cache_nice_tries: t.cache_nice_tries,
                    imb_numa_nr: 0,
                    groups: Groups::none(&self.empty_ring),
                    first_group_flags: 0,
                    shared: None,
                });
                if t.weight == self.online_weight {
                    break;
                }
            }
            chains[c] = chain;
        }
        chains
    }

    /// `build_sched_domain()` and `sd_init()` for one unit of level `li`:
    /// its span (online CPUs only), interned, and the level's flags, with
    /// `asym_cpu_capacity_classify()` of the span. Returns the span and its
    /// capacities too, which the NUMA level above grows from.
    fn sd_init(
        &mut self,
        li: usize,
        unit: u32,
        below: Option<(CpuMask, CapSet)>,
    ) -> (Tmpl, (CpuMask, CapSet)) {
        let level = self.levels[li];
        let (mask, caps) = match level {
            Level::Numa(j) => self.numa_span(unit, j as usize, below),
            l => {
                let p = self.partition(l);
                let mut caps = CapSet::default();
                if self.caps_differ {
                    for &c in p.members(unit) {
                        caps.add(self.spec.cpus[c as usize].capacity);
                    }
                }
                (p.mask(unit), caps)
            }
        };
        let weight = mask.weight() as u32;
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
        // asym_cpu_capacity_classify(): several capacities in the span, and
        // all of the online ones.
        if self.caps_differ && caps.count() >= 2 {
            flags |= sd::ASYM_CPUCAPACITY;
            if caps == self.online_caps {
                flags |= sd::ASYM_CPUCAPACITY_FULL;
            }
        }
        let (imbalance_pct, cache_nice_tries) = if flags & sd::SHARE_CPUCAPACITY != 0 {
            (110, 0)
        } else if flags & sd::SHARE_LLC != 0 {
            (117, 1)
        } else if flags & sd::NUMA != 0 {
            flags &= !sd::PREFER_SIBLING;
            flags |= sd::SERIALIZE;
            if let Level::Numa(j) = level
                && self.numa.distances[j as usize] > self.node_reclaim_distance
            {
                flags &= !(sd::BALANCE_EXEC | sd::BALANCE_FORK | sd::WAKE_AFFINE);
            }
            (117, 2)
        } else {
            (117, 1)
        };
        let span = self.intern(mask);
        let t = Tmpl {
            span,
            weight,
            flags,
            imbalance_pct,
            cache_nice_tries,
        };
        (t, (mask, caps))
    }

    /// The span of NUMA level `j` for online node `x`: the online CPUs of
    /// the nodes within `distances[j]`, grown from the level below when the
    /// same CPU just made it (the nodes within `distances[j - 1]`).
    fn numa_span(&self, x: u32, j: usize, below: Option<(CpuMask, CapSet)>) -> (CpuMask, CapSet) {
        let nl = self.numa.distances.len();
        let set = &self.numa.sets[x as usize * nl + j];
        let (mut mask, mut caps, have) = match below {
            Some((m, c)) => (m, c, self.numa.sets[x as usize * nl + j - 1]),
            None => (CpuMask::new(), CapSet::default(), [0; 4]),
        };
        for y in ns_andnot(set, &have) {
            mask.or_assign(&self.numa.cpus[y]);
            if self.caps_differ {
                caps.or_assign(&self.numa.caps[y]);
            }
        }
        (mask, caps)
    }

    /// A new shared ring; `rotated` when CPUs enter it at different groups.
    fn new_ring(&mut self, groups: Vec<SpanId>, flags: Vec<u32>, rotated: bool) -> u32 {
        let id = self.rings.len() as u32;
        let len = groups.len();
        let mut spans = groups;
        if rotated && len > 1 {
            spans.extend_from_within(..len - 1);
        }
        self.rings.push(Arc::new(Ring {
            id,
            len: len as u32,
            spans: spans.into_boxed_slice(),
        }));
        self.ring_flags.push(flags);
        id
    }

    /// `build_sched_groups()` for the levels up to NODE. The groups of a
    /// span are its CPUs' child domains (single CPUs at the lowest level),
    /// each with the child's flags (`get_group()`), in one ring shared by
    /// the span's CPUs and made once. In the kernel every CPU's build
    /// rewrites that shared ring, the CPUs building in ascending order, so
    /// the ring that stays is the one the span's highest CPU built (groups
    /// in the order of wrap(span, max)); each CPU enters it at its own
    /// group. The scenario format walks wrap(span, c) instead; the two
    /// differ only for numberings where those walks are not rotations of
    /// each other, and the kernel wins.
    fn build_sched_groups(&mut self, chains: &mut [Vec<Domain>]) {
        let mut pos = vec![0u32; self.n];
        let online = self.online;
        for li in 0..=self.node_level {
            let mut ring_of = vec![u32::MAX; self.tmpl[li].len()];
            for c in online.iter() {
                if chains[c].len() <= li {
                    continue;
                }
                let unit = self.unit(li, c) as usize;
                if ring_of[unit] == u32::MAX {
                    ring_of[unit] = self.sched_group_ring(li, chains[c][li].span, chains, &mut pos);
                }
                chains[c][li].groups = Groups {
                    ring: Arc::clone(&self.rings[ring_of[unit] as usize]),
                    start: pos[c],
                };
            }
        }
    }

    /// The ring of one span at level `li`, walking it from its highest CPU
    /// and then up from its lowest, one group per CPU not yet covered;
    /// records each CPU's position in it. O(groups x mask words).
    fn sched_group_ring(
        &mut self,
        li: usize,
        span: SpanId,
        chains: &[Vec<Domain>],
        pos: &mut [u32],
    ) -> u32 {
        let mut rest = self.spans[span as usize];
        let mut i = last_cpu(&rest).expect("a domain spans its CPU");
        let mut groups = Vec::new();
        let mut flags = Vec::new();
        loop {
            let k = groups.len() as u32;
            let g = if li == 0 {
                let g = self.intern(CpuMask::from_cpus([i]));
                pos[i] = k;
                flags.push(0);
                g
            } else {
                let child = &chains[i][li - 1];
                for j in self.spans[child.span as usize].iter() {
                    pos[j] = k;
                }
                flags.push(child.flags);
                child.span
            };
            rest.andnot_assign(&self.spans[g as usize]);
            groups.push(g);
            match rest.first() {
                Some(next) => i = next,
                None => break,
            }
        }
        self.new_ring(groups, flags, true)
    }

    /// `build_overlap_sched_groups()` for the NUMA levels. Each CPU walks
    /// its domain's span from itself, wrapping, and every CPU not yet
    /// covered whose own tree reaches this level adds a group: the span of
    /// its highest domain below this level that fits in the span
    /// (`find_descended_sibling()`, `build_group_from_child_sched_domain()`),
    /// with that domain's flags; the local group comes first. Every CPU of
    /// a node has the same domains from NODE up, so the walk goes node by
    /// node in the order the CPU's walk first meets the nodes, and CPUs that
    /// meet them in the same order get the same ring, made once (the kernel
    /// makes a copy per CPU; this tree's rings are read-only).
    fn build_overlap_sched_groups(&mut self, chains: &mut [Vec<Domain>]) {
        let first_numa = self.node_level + 1;
        let nn = self.levels.len() - first_numa;
        if nn == 0 {
            return;
        }
        let (order_of_cpu, orders) = self.numa_walk_orders();
        let mut memo = vec![u32::MAX; orders.len() * nn];
        let online = self.online;
        for c in online.iter() {
            let o = order_of_cpu[c] as usize;
            for li in first_numa..chains[c].len() {
                let slot = o * nn + li - first_numa;
                if memo[slot] == u32::MAX {
                    memo[slot] = self.overlap_ring(li, &orders[o], chains);
                }
                chains[c][li].groups = Groups {
                    ring: Arc::clone(&self.rings[memo[slot] as usize]),
                    start: 0,
                };
            }
        }
    }

    /// For every online CPU, the order in which `for_each_cpu_wrap()` from
    /// it first meets the online nodes: nodes by their first CPU at or after
    /// it, then the others by their first CPU. A sweep from the highest CPU
    /// down moves each CPU's node to the front of a list; the CPUs of one
    /// run of a node's consecutive CPUs share an order, and equal orders are
    /// kept once. O(CPUs + runs x nodes).
    fn numa_walk_orders(&self) -> (Vec<u32>, Vec<Vec<u16>>) {
        let m = self.numa.first_cpu.len();
        let head = m;
        let node_of = |c: usize| self.numa.index[self.spec.cpus[c].node as usize] as usize;
        let mut by_first: Vec<usize> = (0..m).collect();
        by_first.sort_unstable_by_key(|&x| self.numa.first_cpu[x]);
        // A circular doubly linked list through `head`.
        let mut next = vec![head; m + 1];
        let mut prev = vec![head; m + 1];
        let mut last = head;
        for &x in &by_first {
            next[last] = x;
            prev[x] = last;
            last = x;
        }
        next[last] = head;
        prev[head] = last;

        let cpus: Vec<usize> = self.online.iter().collect();
        let mut order_of_cpu = vec![u32::MAX; self.n];
        let mut ids: FastMap<Vec<u16>, u32> = FastMap::default();
        let mut orders: Vec<Vec<u16>> = Vec::new();
        let mut buf: Vec<u16> = Vec::with_capacity(m);
        let mut run_end = cpus.len();
        for k in (0..cpus.len()).rev() {
            let x = node_of(cpus[k]);
            next[prev[x]] = next[x];
            prev[next[x]] = prev[x];
            next[x] = next[head];
            prev[x] = head;
            prev[next[head]] = x;
            next[head] = x;
            if k > 0 && node_of(cpus[k - 1]) == x {
                continue;
            }
            buf.clear();
            let mut y = next[head];
            while y != head {
                buf.push(y as u16);
                y = next[y];
            }
            let id = match ids.get(&buf[..]) {
                Some(&id) => id,
                None => {
                    let id = orders.len() as u32;
                    orders.push(buf.clone());
                    ids.insert(buf.clone(), id);
                    id
                }
            };
            for &c in &cpus[k..run_end] {
                order_of_cpu[c] = id;
            }
            run_end = k;
        }
        (order_of_cpu, orders)
    }

    /// The overlap ring of NUMA level `li` for the CPUs whose walk meets
    /// the nodes in `order` (the first being their own). O(nodes + groups x
    /// levels).
    fn overlap_ring(&mut self, li: usize, order: &[u16], chains: &[Vec<Domain>]) -> u32 {
        let nl = self.numa.distances.len();
        let nlev = self.node_level;
        let sets = &self.numa.sets;
        let span = sets[order[0] as usize * nl + li - nlev];
        let mut covered: NodeSet = [0; 4];
        let mut groups = Vec::new();
        let mut flags = Vec::new();
        for &x in order {
            let x = x as usize;
            if !ns_test(&span, x) || ns_test(&covered, x) {
                continue;
            }
            // The node's own tree must reach this level.
            let sibling = &chains[self.numa.first_cpu[x] as usize];
            if sibling.len() <= li {
                continue;
            }
            // find_descended_sibling(): NODE always fits.
            let mut k = li - 1;
            while k > nlev && !ns_subset(&sets[x * nl + k - nlev], &span) {
                k -= 1;
            }
            groups.push(sibling[k].span);
            flags.push(sibling[k].flags);
            for (w, s) in covered.iter_mut().zip(sets[x * nl + k - nlev]) {
                *w |= s;
            }
        }
        self.new_ring(groups, flags, false)
    }

    /// The group flags after every CPU's build, before degeneration: set
    /// from the child domain (`sg->flags = child->flags`). This tree keys a
    /// group by level and span, so where CPUs' rings share a key the last
    /// CPU's build wins: CPUs are taken from the highest down keeping the
    /// first value met, and a ring already met adds nothing new.
    fn init_group_flags(&self, chains: &[Vec<Domain>]) -> FastMap<(u8, SpanId), u32> {
        let mut flags: FastMap<(u8, SpanId), u32> = FastMap::default();
        let mut seen = vec![false; self.rings.len()];
        for chain in chains.iter().rev() {
            for d in chain {
                let id = d.groups.ring_id() as usize;
                if std::mem::replace(&mut seen[id], true) {
                    continue;
                }
                let ring = &self.rings[id];
                for (g, f) in ring.spans[..ring.len as usize]
                    .iter()
                    .zip(&self.ring_flags[id])
                {
                    flags.entry((d.level_idx, *g)).or_insert(*f);
                }
            }
        }
        flags
    }

    /// The online SMT siblings of each CPU (`cpu_smt_mask()`), the SMT
    /// level's spans.
    fn smt_siblings(&self) -> Smt {
        let mut smt = Smt {
            first: vec![0; self.n],
            len: vec![0; self.n],
            cpus: Vec::new(),
            span: vec![0; self.n],
            active: false,
        };
        for c in self.online.iter() {
            let core = self.core.of_cpu[c];
            let sib = self.core.members(core);
            smt.first[c] = smt.cpus.len() as u32;
            smt.len[c] = sib.len().min(255) as u8;
            smt.cpus.extend_from_slice(sib);
            smt.span[c] = self.tmpl[0][core as usize]
                .expect("every online CPU has SMT")
                .span;
            smt.active |= sib.len() >= 2;
        }
        smt
    }
}

/// `build_sched_domains()`: the allowance for NUMA imbalance, on the
/// undegenerated tree. The first domain above the LLC gets the number of
/// LLCs it spans (or an eighth of its CPUs with one LLC); the NUMA levels
/// above get that times their size in units of the first NUMA domain.
fn numa_imbalance_allowance(chains: &mut [Vec<Domain>]) {
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

/// The shared objects (`struct sched_domain_shared`) that `sd_init()`
/// attaches and `claim_allocations()` keeps, before degeneration: one per
/// LLC span on the highest SHARE_LLC domain, and with asymmetric capacities
/// one per span on the lowest ASYM_CPUCAPACITY_FULL domain below NUMA.
fn claim_allocations(
    spec: &TopologySpec,
    chains: &mut [Vec<Domain>],
    asym_active: bool,
) -> Vec<SharedObj> {
    let mut shared: Vec<SharedObj> = Vec::new();
    let mut shared_ids: FastMap<(SharedKind, SpanId), u32> = FastMap::default();
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
    for (c, chain) in chains.iter_mut().enumerate() {
        let llc = spec.cpus[c].llc;
        if asym_active
            && let Some(p) = chain.iter_mut().find(|p| p.has(sd::ASYM_CPUCAPACITY_FULL))
            && !p.has(sd::NUMA)
        {
            p.shared = Some(get_shared(SharedKind::Asym, p.span, llc));
        }
        if let Some(p) = chain.iter_mut().rev().find(|p| p.has(sd::SHARE_LLC)) {
            p.shared = Some(get_shared(SharedKind::Llc, p.span, llc));
        }
    }
    shared
}

/// `cpu_attach_domain()` for every CPU in ascending order: a parent that
/// adds nothing (`sd_parent_degenerate()`) is dropped, its grandparent's
/// first group taking the child's flags; then a base domain that balances
/// nothing (`sd_degenerate()`) is dropped and its parent's first group loses
/// its flags. O(levels) per CPU. Offline CPUs have no domains; as in the
/// kernel, they share nothing.
fn cpu_attach_domain(
    chains: Vec<Vec<Domain>>,
    group_flags: &mut FastMap<(u8, SpanId), u32>,
) -> Vec<CpuDomains> {
    let mut cpu = Vec::with_capacity(chains.len());
    for (c, chain) in chains.into_iter().enumerate() {
        let mut out: Vec<Domain> = Vec::with_capacity(chain.len());
        let mut rest = chain.into_iter().peekable();
        while let Some(p) = rest.next() {
            if out.is_empty() {
                out.push(p);
                continue;
            }
            let top = out.last_mut().expect("not empty");
            if sd_parent_degenerate(top, &p) {
                if let Some(gp) = rest.peek() {
                    group_flags.insert((gp.level_idx, gp.groups[0]), top.flags);
                }
                if p.has(sd::PREFER_SIBLING) {
                    top.flags |= sd::PREFER_SIBLING;
                }
                if p.shared.is_some() {
                    top.shared = p.shared;
                }
            } else {
                out.push(p);
            }
        }
        if !out.is_empty() && sd_degenerate(&out[0]) {
            out.remove(0);
            if let Some(first) = out.first() {
                group_flags.insert((first.level_idx, first.groups[0]), 0);
            }
        }
        out.shrink_to_fit();
        cpu.push(CpuDomains {
            chain: out,
            llc_size: 1,
            share_id: c as u32,
            ..CpuDomains::default()
        });
    }
    cpu
}

/// `update_top_cache_domain()` and the static keys: each CPU's `sd_llc`,
/// `sd_llc_size`, `sd_share_id` and `sd_asym_cpucapacity`, the shared
/// objects' owners, and whether some CPU has a cluster domain.
fn update_top_cache_domain(
    cpu: &mut [CpuDomains],
    spans: &[CpuMask],
    group_flags: &FastMap<(u8, SpanId), u32>,
    shared: &mut [SharedObj],
) -> bool {
    let mut cluster_active = false;
    for (c, cd) in cpu.iter_mut().enumerate() {
        if cd.chain.is_empty() {
            continue;
        }
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
        let first_of = |d: &Domain| spans[d.span as usize].first().expect("spans are not empty");
        cd.share_id = match cd.chain.iter().find(|d| d.has(sd::CLUSTER)) {
            Some(d) => first_of(d) as u32,
            None => match llc {
                Some(k) => first_of(&cd.chain[k as usize]) as u32,
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
    cluster_active
}

/// The groups wider than a core (LLCs, clusters, NUMA nodes, ...), whose
/// sums each snapshot keeps for the slow path, in the order the CPUs' trees
/// first name them; the position of each by span; and the kept groups of
/// each CPU. A shared ring is read once, at the first CPU that has it.
fn sum_groups(
    cpu: &[CpuDomains],
    spans: &[CpuMask],
    span_weight: &[u32],
    smt_span: &[SpanId],
    nr_rings: usize,
) -> (Vec<SpanId>, Vec<u32>, Vec<Vec<u16>>) {
    let mut sum_index = vec![u32::MAX; spans.len()];
    let mut sum_groups: Vec<SpanId> = Vec::new();
    let mut seen = vec![false; nr_rings];
    for cd in cpu {
        for d in &cd.chain {
            if std::mem::replace(&mut seen[d.groups.ring_id() as usize], true) {
                continue;
            }
            for &g in &d.groups {
                let first = spans[g as usize].first().unwrap_or(0);
                if sum_index[g as usize] == u32::MAX
                    && span_weight[g as usize] > 1
                    && g != smt_span[first]
                {
                    sum_index[g as usize] = sum_groups.len() as u32;
                    sum_groups.push(g);
                }
            }
        }
    }
    // Each CPU's list, sized first, then filled 64 CPUs at a time (a mask
    // word of every kept group), so the writes stay in a few lists.
    let words = cpu.len().div_ceil(64);
    let mut count = vec![0u32; cpu.len()];
    for &g in &sum_groups {
        for (i, &w) in spans[g as usize].words()[..words].iter().enumerate() {
            for_each_bit(w, |b| count[i * 64 + b] += 1);
        }
    }
    let mut cpu_sum_groups: Vec<Vec<u16>> = count
        .iter()
        .map(|&k| Vec::with_capacity(k as usize))
        .collect();
    for i in 0..words {
        for (k, &g) in sum_groups.iter().enumerate() {
            let w = spans[g as usize].words()[i];
            for_each_bit(w, |b| cpu_sum_groups[i * 64 + b].push(k as u16));
        }
    }
    (sum_groups, sum_index, cpu_sum_groups)
}

#[inline]
fn for_each_bit(mut w: u64, mut f: impl FnMut(usize)) {
    while w != 0 {
        f(w.trailing_zeros() as usize);
        w &= w - 1;
    }
}

/// `sd_degenerate()`.
fn sd_degenerate(d: &Domain) -> bool {
    if d.weight == 1 {
        return true;
    }
    if d.flags & sd::DEGENERATE_GROUPS_MASK != 0 && d.groups.len() > 1 {
        return false;
    }
    !d.has(sd::WAKE_AFFINE)
}

/// `sd_parent_degenerate()`. Spans are interned: equal spans, equal ids.
fn sd_parent_degenerate(d: &Domain, p: &Domain) -> bool {
    if sd_degenerate(p) {
        return true;
    }
    if d.span != p.span {
        return false;
    }
    let mut pflags = p.flags;
    if p.groups.len() == 1 {
        pflags &= !sd::DEGENERATE_GROUPS_MASK;
    }
    pflags & !d.flags == 0
}
