//! `build_sched_domains()`: the domains per CPU bottom-up, the groups on
//! the full tree, the shared objects, degeneration in
//! `cpu_attach_domain()` and the per-CPU shortcuts of
//! `update_top_cache_domain()`.

use super::*;

/// The highest CPU of a mask (`cpumask_last()`).
pub(super) fn last_cpu(m: &CpuMask) -> Option<usize> {
    let words = m.words();
    let i = words.iter().rposition(|&w| w != 0)?;
    Some(i * 64 + 63 - words[i].leading_zeros() as usize)
}

/// A set of capacities, 0..=1024.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct CapSet([u64; 17]);

impl CapSet {
    pub(super) fn add(&mut self, cap: u32) {
        self.0[cap as usize / 64] |= 1 << (cap % 64);
    }
    pub(super) fn or_assign(&mut self, o: &CapSet) {
        for (a, b) in self.0.iter_mut().zip(o.0.iter()) {
            *a |= *b;
        }
    }
    pub(super) fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

/// The units of one topology level (cores, clusters, LLCs or nodes): a dense
/// unit id per CPU and each unit's online CPUs, ascending. These are the
/// arch masks the kernel's topology table reads (`cpu_smt_mask()`,
/// `cpu_clustergroup_mask()`, `cpu_coregroup_mask()`, `cpu_node_mask()`).
pub(super) struct Partition {
    pub(super) of_cpu: Vec<u32>,
    pub(super) start: Vec<u32>,
    pub(super) cpus: Vec<u16>,
}

impl Partition {
    pub(super) fn new(n: usize, online: &CpuMask, key: impl Fn(usize) -> u32) -> Partition {
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

    pub(super) fn len(&self) -> usize {
        self.start.len() - 1
    }

    pub(super) fn members(&self, u: u32) -> &[u16] {
        &self.cpus[self.start[u as usize] as usize..self.start[u as usize + 1] as usize]
    }

    pub(super) fn mask(&self, u: u32) -> CpuMask {
        CpuMask::from_cpus(self.members(u).iter().map(|&c| c as usize))
    }
}

/// A level's domain for one span, before groups: what `build_sched_domain()`
/// and `sd_init()` make, the same for every CPU of the span.
#[derive(Clone, Copy)]
pub(super) struct Tmpl {
    pub(super) span: SpanId,
    pub(super) weight: u32,
    pub(super) flags: u32,
    pub(super) imbalance_pct: u32,
    pub(super) cache_nice_tries: u32,
}

/// The online SMT siblings of every CPU (`cpu_smt_mask()`).
pub(super) struct Smt {
    pub(super) first: Vec<u32>,
    pub(super) len: Vec<u8>,
    pub(super) cpus: Vec<u16>,
    pub(super) span: Vec<SpanId>,
    pub(super) active: bool,
}

/// The build's working state: the spans interned so far, the units of every
/// topology level, the NUMA masks, the domains made per distinct span and
/// the shared group rings.
pub(super) struct Builder<'a> {
    pub(super) spec: &'a TopologySpec,
    pub(super) n: usize,
    pub(super) online: CpuMask,
    pub(super) online_weight: u32,
    pub(super) node_reclaim_distance: u32,
    pub(super) spans: Vec<CpuMask>,
    /// Interning by hash: the newest span of each hash, and for each span
    /// the next older one with the same hash.
    pub(super) span_ids: FastMap<u64, SpanId>,
    pub(super) span_next: Vec<SpanId>,
    pub(super) levels: Vec<Level>,
    /// Index of NODE in `levels`; the NUMA levels follow it.
    pub(super) node_level: usize,
    pub(super) core: Partition,
    pub(super) cluster: Option<Partition>,
    pub(super) llc: Partition,
    pub(super) node: Partition,
    pub(super) numa: Numa,
    /// Whether the topology's CPUs differ in capacity (asym detection runs),
    /// and the capacities of the online CPUs.
    pub(super) caps_differ: bool,
    pub(super) online_caps: CapSet,
    /// Per level, per unit: its domain, made when the first CPU meets it.
    pub(super) tmpl: Vec<Vec<Option<Tmpl>>>,
    pub(super) rings: Vec<Arc<Ring>>,
    /// Each ring's groups' initial flags (the child domain's).
    pub(super) ring_flags: Vec<Vec<u32>>,
    pub(super) empty_ring: Arc<Ring>,
}

impl<'a> Builder<'a> {
    /// The per-level units, `sched_init_numa()` and the level list (the
    /// default topology table, CLS only with clusters, then NUMA1..).
    pub(super) fn new(spec: &'a TopologySpec, online: CpuMask, node_reclaim_distance: u32) -> Self {
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
                flags: Box::new([]),
                sgc_levels: Box::new([]),
            }),
        };
        b.tmpl = (0..b.levels.len())
            .map(|li| vec![None; b.units(li)])
            .collect();
        b
    }

    /// The interned id of a span.
    pub(super) fn intern(&mut self, m: CpuMask) -> SpanId {
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

    pub(super) fn partition(&self, level: Level) -> &Partition {
        match level {
            Level::Smt => &self.core,
            Level::Cls => self.cluster.as_ref().expect("CLS only with clusters"),
            Level::Mc => &self.llc,
            Level::Pkg | Level::Node => &self.node,
            Level::Numa(_) => unreachable!("NUMA spans are per node"),
        }
    }

    /// Number of distinct spans level `li` can have: its units.
    pub(super) fn units(&self, li: usize) -> usize {
        match self.levels[li] {
            Level::Numa(_) => self.numa.first_cpu.len(),
            l => self.partition(l).len(),
        }
    }

    /// The unit of CPU `c` at level `li`.
    #[inline]
    pub(super) fn unit(&self, li: usize, c: usize) -> u32 {
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
    pub(super) fn build_sched_domains(&mut self) -> Vec<Vec<Domain>> {
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
    pub(super) fn sd_init(
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
    pub(super) fn numa_span(
        &self,
        x: u32,
        j: usize,
        below: Option<(CpuMask, CapSet)>,
    ) -> (CpuMask, CapSet) {
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
    /// `sgc_levels[i]`: the level index whose `sched_group_capacity` the
    /// group shares (its own level, or for an overlapping group built from a
    /// descended sibling, that sibling's level).
    pub(super) fn new_ring(
        &mut self,
        groups: Vec<SpanId>,
        flags: Vec<u32>,
        sgc_levels: Vec<u8>,
        rotated: bool,
    ) -> u32 {
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
            flags: flags.clone().into_boxed_slice(),
            sgc_levels: sgc_levels.into_boxed_slice(),
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
    pub(super) fn build_sched_groups(&mut self, chains: &mut [Vec<Domain>]) {
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
    pub(super) fn sched_group_ring(
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
        let sgc_levels = vec![li as u8; groups.len()];
        self.new_ring(groups, flags, sgc_levels, true)
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
    pub(super) fn build_overlap_sched_groups(&mut self, chains: &mut [Vec<Domain>]) {
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
    pub(super) fn numa_walk_orders(&self) -> (Vec<u32>, Vec<Vec<u16>>) {
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
    pub(super) fn overlap_ring(&mut self, li: usize, order: &[u16], chains: &[Vec<Domain>]) -> u32 {
        let nl = self.numa.distances.len();
        let nlev = self.node_level;
        let sets = &self.numa.sets;
        let span = sets[order[0] as usize * nl + li - nlev];
        let mut covered: NodeSet = [0; 4];
        let mut groups = Vec::new();
        let mut flags = Vec::new();
        let mut sgc_levels = Vec::new();
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
            // init_overlap_sched_group() runs on the (descended) sibling:
            // the group shares the capacity object of that level.
            sgc_levels.push((k + 1) as u8);
            for (w, s) in covered.iter_mut().zip(sets[x * nl + k - nlev]) {
                *w |= s;
            }
        }
        self.new_ring(groups, flags, sgc_levels, false)
    }

    /// The group flags after every CPU's build, before degeneration: set
    /// from the child domain (`sg->flags = child->flags`). This tree keys a
    /// group by level and span, so where CPUs' rings share a key the last
    /// CPU's build wins: CPUs are taken from the highest down keeping the
    /// first value met, and a ring already met adds nothing new.
    pub(super) fn init_group_flags(&self, chains: &[Vec<Domain>]) -> FastMap<(u8, SpanId), u32> {
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
    pub(super) fn smt_siblings(&self) -> Smt {
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

/// The shared objects (`struct sched_domain_shared`) that `sd_init()`
/// attaches and `claim_allocations()` keeps, before degeneration: one per
/// LLC span on the highest SHARE_LLC domain, and with asymmetric capacities
/// one per span on the lowest ASYM_CPUCAPACITY_FULL domain below NUMA.
pub(super) fn claim_allocations(
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
pub(super) fn cpu_attach_domain(
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
pub(super) fn update_top_cache_domain(
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
pub(super) fn sum_groups(
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
pub(super) fn for_each_bit(mut w: u64, mut f: impl FnMut(usize)) {
    while w != 0 {
        f(w.trailing_zeros() as usize);
        w &= w - 1;
    }
}

/// `sd_degenerate()`.
pub(super) fn sd_degenerate(d: &Domain) -> bool {
    if d.weight == 1 {
        return true;
    }
    if d.flags & sd::DEGENERATE_GROUPS_MASK != 0 && d.groups.len() > 1 {
        return false;
    }
    !d.has(sd::WAKE_AFFINE)
}

/// `sd_parent_degenerate()`. Spans are interned: equal spans, equal ids.
pub(super) fn sd_parent_degenerate(d: &Domain, p: &Domain) -> bool {
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
