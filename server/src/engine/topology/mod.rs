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

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use crate::engine::cpumask::CpuMask;

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

mod build;
mod hash;
mod numa;
mod spec;

use build::*;
use hash::*;
use numa::*;
pub use spec::*;

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
    /// Each group's `sg->flags` as built (the flags of the domain it was
    /// built from), in ring order from the first built.
    flags: Box<[u32]>,
    /// Each group's `sched_group_capacity` level (see `Builder::new_ring`).
    sgc_levels: Box<[u8]>,
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

    /// The level index whose `sched_group_capacity` (`sgc->imbalance`,
    /// `sgc->capacity`) the `i`th group shares: the domain's own level, but
    /// for an overlapping NUMA group built from a descended sibling
    /// (`find_descended_sibling()`), the sibling's lower level, where that
    /// same object serves the group of the same span.
    pub fn sgc_level(&self, i: usize) -> Option<usize> {
        let len = self.ring.len as usize;
        if len == 0 {
            return None;
        }
        self.ring
            .sgc_levels
            .get((self.start as usize + i) % len)
            .map(|&l| l as usize)
    }

    /// `sg->flags` of the `i`th group from this domain's first, as the
    /// build set it: the flags of the domain the group was built from
    /// (for an overlapping NUMA group, the child of the possibly descended
    /// sibling). 0 where the ring has none recorded.
    pub fn build_flags(&self, i: usize) -> u32 {
        let len = self.ring.len as usize;
        if len == 0 {
            return 0;
        }
        self.ring
            .flags
            .get((self.start as usize + i) % len)
            .copied()
            .unwrap_or(0)
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
