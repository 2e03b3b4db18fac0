#!/usr/bin/env python3
"""fairplace oracle: an independent reference implementation, in Python, of the
placement scenario format (version 1).

Reads scenarios (a file path, or "-" for stdin; one JSON object, a JSON array of
objects, or JSON Lines) and prints one JSON line per scenario:

  wakeup / fork / exec : {"cpu", "path", "scanned", "detail"}
  can_migrate          : {"allowed", "new_dst_cpu", "flags", "reason", "task_hot", "detail"}
  invalid scenario     : {"error": "field.path: message"}

Exit status 1 if any scenario was invalid (or unparsable), else 0.

Structure (section numbers are those of scenario-format.md):
  - validation helpers and the scenario reader                     (1, 3-8, 12)
  - CPU masks as Python ints (bit i = CPU i)
  - Topology: the sched-domain build, groups, degeneration, shortcuts (2, 2.1)
  - Scenario: per-CPU state, hints, task, request                   (5, 6, 7, 8)
  - one function per kernel step                                     (11)
Python 3.11, standard library only.  Written from the format text, not from kernel source.
"""

import json
import sys

# ---------------------------------------------------------------------------
# Errors and validation helpers
# ---------------------------------------------------------------------------


class ScenarioError(Exception):
    """An invalid scenario; str() is "field.path: message"."""

    def __init__(self, path, msg):
        super().__init__(f"{path}: {msg}")


INT31 = (1 << 31) - 1   # loads, utils, flips: 0..2^31-1 (section 12)
CLOCK = 1 << 62         # clock values: 0..2^62
MAX_CPUS = 4096


def is_int(v):
    return type(v) is int


def is_bool(v):
    return type(v) is bool


def check_keys(obj, allowed, path):
    if not isinstance(obj, dict):
        raise ScenarioError(path, "must be an object")
    for k in obj:
        if k not in allowed:
            p = f"{path}.{k}" if path else k
            raise ScenarioError(p, "unknown field")


def get_int(obj, key, path, default=None, lo=None, hi=None, required=False):
    p = f"{path}.{key}" if path else key
    if key not in obj:
        if required:
            raise ScenarioError(p, "required")
        return default
    v = obj[key]
    if not is_int(v):
        raise ScenarioError(p, "must be an integer")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if lo is not None and hi is not None:
            raise ScenarioError(p, f"must be {lo}..{hi}")
        if lo is not None:
            raise ScenarioError(p, f"must be >= {lo}")
        raise ScenarioError(p, f"must be <= {hi}")
    return v


def get_bool(obj, key, path, default=None):
    p = f"{path}.{key}" if path else key
    if key not in obj:
        return default
    v = obj[key]
    if not is_bool(v):
        raise ScenarioError(p, "must be a boolean")
    return v


def get_enum(obj, key, path, choices, default=None, required=False):
    p = f"{path}.{key}" if path else key
    if key not in obj:
        if required:
            raise ScenarioError(p, "required")
        return default
    v = obj[key]
    if not isinstance(v, str):
        raise ScenarioError(p, "must be a string")
    if v not in choices:
        raise ScenarioError(p, f"unknown value {v!r} (expected one of {', '.join(choices)})")
    return v


def get_cpu(obj, key, path, n, default=None, required=False, nullable=False):
    p = f"{path}.{key}" if path else key
    if key not in obj:
        if required:
            raise ScenarioError(p, "required")
        return default
    v = obj[key]
    if v is None and nullable:
        return None
    if not is_int(v):
        raise ScenarioError(p, "must be an integer" + (" or null" if nullable else ""))
    if not 0 <= v < n:
        raise ScenarioError(p, f"CPU {v} is not in the topology")
    return v


def parse_cpulist(s, n, path, allow_empty=True):
    """Parse "0-3,8,10-11" into a mask; every id must be in 0..n-1."""
    if not isinstance(s, str):
        raise ScenarioError(path, "must be a cpulist string")
    m = 0
    if s.strip() == "":
        if not allow_empty:
            raise ScenarioError(path, "must not be empty")
        return 0
    for tok in s.split(","):
        tok = tok.strip()
        if tok == "":
            raise ScenarioError(path, f"malformed cpulist {s!r}")
        if "-" in tok:
            a, _, b = tok.partition("-")
            a, b = a.strip(), b.strip()
            if not (a.isdigit() and b.isdigit()):
                raise ScenarioError(path, f"malformed cpulist {s!r}")
            a, b = int(a), int(b)
            if a > b:
                raise ScenarioError(path, f"malformed range {tok!r}")
        else:
            if not tok.isdigit():
                raise ScenarioError(path, f"malformed cpulist {s!r}")
            a = b = int(tok)
        for c in (a, b):
            if c >= n:
                raise ScenarioError(path, f"CPU {c} is not in the topology")
        m |= ((1 << (b + 1)) - 1) ^ ((1 << a) - 1)
    if m == 0 and not allow_empty:
        raise ScenarioError(path, "must not be empty")
    return m


# ---------------------------------------------------------------------------
# CPU masks (Python ints)
# ---------------------------------------------------------------------------


def bits(m):
    """CPUs of mask m in ascending order."""
    while m:
        low = m & -m
        yield low.bit_length() - 1
        m ^= low


def lowest(m):
    return (m & -m).bit_length() - 1 if m else None


def weight(m):
    return m.bit_count()


def has(m, c):
    return (m >> c) & 1 == 1


def cpulist(m):
    """Canonical cpulist: ascending, maximal ranges."""
    out = []
    cpus = list(bits(m))
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        out.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(out)


class LiveMask:
    """A mutable mask that a wrap walk reads live."""
    __slots__ = ("m",)

    def __init__(self, m):
        self.m = m


def for_each_cpu_wrap(mask, start):
    """wrap(S, start): CPUs of S >= start ascending, then those < start.

    `mask` is a LiveMask, read at every step: a CPU removed before the walk
    reaches it is not visited.  start >= N gives plain ascending order.
    """
    pos = start
    while True:                      # first part: CPUs >= start
        m = mask.m >> pos
        if not m:
            break
        c = pos + lowest(m)
        yield c
        pos = c + 1
    below = (1 << start) - 1
    pos = 0
    while True:                      # second part: CPUs < start
        m = (mask.m & below) >> pos
        if not m:
            return
        c = pos + lowest(m)
        yield c
        pos = c + 1


def wrap(m, start):
    return for_each_cpu_wrap(LiveMask(m), start)


# ---------------------------------------------------------------------------
# Domain flags
# ---------------------------------------------------------------------------

SD_BALANCE_NEWIDLE = 1 << 0
SD_BALANCE_EXEC = 1 << 1
SD_BALANCE_FORK = 1 << 2
SD_BALANCE_WAKE = 1 << 3
SD_WAKE_AFFINE = 1 << 4
SD_ASYM_CPUCAPACITY = 1 << 5
SD_ASYM_CPUCAPACITY_FULL = 1 << 6
SD_SHARE_CPUCAPACITY = 1 << 7
SD_CLUSTER = 1 << 8
SD_SHARE_LLC = 1 << 9
SD_SERIALIZE = 1 << 10
SD_PREFER_SIBLING = 1 << 11
SD_NUMA = 1 << 12

FLAG_NAMES = [
    (SD_BALANCE_NEWIDLE, "BALANCE_NEWIDLE"), (SD_BALANCE_EXEC, "BALANCE_EXEC"),
    (SD_BALANCE_FORK, "BALANCE_FORK"), (SD_BALANCE_WAKE, "BALANCE_WAKE"),
    (SD_WAKE_AFFINE, "WAKE_AFFINE"), (SD_ASYM_CPUCAPACITY, "ASYM_CPUCAPACITY"),
    (SD_ASYM_CPUCAPACITY_FULL, "ASYM_CPUCAPACITY_FULL"),
    (SD_SHARE_CPUCAPACITY, "SHARE_CPUCAPACITY"), (SD_CLUSTER, "CLUSTER"),
    (SD_SHARE_LLC, "SHARE_LLC"), (SD_SERIALIZE, "SERIALIZE"),
    (SD_PREFER_SIBLING, "PREFER_SIBLING"), (SD_NUMA, "NUMA"),
]


def flag_names(f):
    return [n for b, n in FLAG_NAMES if f & b]


SD_BASE = (SD_BALANCE_NEWIDLE | SD_BALANCE_EXEC | SD_BALANCE_FORK | SD_WAKE_AFFINE
           | SD_PREFER_SIBLING)

# ---------------------------------------------------------------------------
# Topology: domains (section 2.1)
# ---------------------------------------------------------------------------


class Domain:
    """One CPU's sched domain at one level (the kernel allocates one per CPU per level)."""

    def __init__(self, cpu, li, level, span, numa_dist_idx):
        self.cpu = cpu
        self.li = li                  # index in the level list
        self.level = level            # "SMT", "CLS", "MC", "PKG", "NODE", "NUMAj"
        self.span = span
        self.weight = weight(span)
        self.numa_j = numa_dist_idx   # j for NUMAj levels, else None
        self.flags = 0
        self.flags0 = 0               # flags as built (before degeneration)
        self.imbalance_pct = 117
        self.cache_nice_tries = 1
        self.imb_numa_nr = 0
        self.shared = None            # key of the shared object: (kind, span)
        self.child0 = None            # child before degeneration
        self.parent = None            # after degeneration
        self.child = None             # after degeneration
        self._groups = None
        self._ngroups = None

    def __repr__(self):
        return f"<{self.level} cpu{self.cpu} {cpulist(self.span)}>"


class Group:
    __slots__ = ("key", "span", "weight", "capacity", "max_capacity")

    def __init__(self, key, span, capacity, max_capacity):
        self.key = key                # (level, span): identity of the shared group object
        self.span = span
        self.weight = weight(span)
        self.capacity = capacity
        self.max_capacity = max_capacity


class Topology:
    """The domain tree built from topology + online mask (section 2.1)."""

    def __init__(self, sc):
        self.sc = sc
        n = sc.n
        self.n = n
        online = sc.online_mask
        self.online = online
        tcpu = sc.topo
        has_clusters = sc.has_clusters
        # --- level list
        nodes_online = sorted({tcpu[c]["node"] for c in bits(online)})
        dist = sc.numa_distance
        dset = {dist[a][b] for a in nodes_online for b in nodes_online}
        D = sorted(dset)            # D[0] == 10
        self.D = D
        levels = ["SMT"] + (["CLS"] if has_clusters else []) + ["MC", "PKG", "NODE"]
        levels += [f"NUMA{j}" for j in range(1, len(D))]
        self.levels = levels
        # --- span masks per level, keyed by the attribute value
        by_core, by_cluster, by_llc, by_node = {}, {}, {}, {}
        for c in bits(online):
            t = tcpu[c]
            by_core[t["core"]] = by_core.get(t["core"], 0) | (1 << c)
            if has_clusters:
                by_cluster[t["cluster"]] = by_cluster.get(t["cluster"], 0) | (1 << c)
            by_llc[t["llc"]] = by_llc.get(t["llc"], 0) | (1 << c)
            by_node[t["node"]] = by_node.get(t["node"], 0) | (1 << c)
        self.by_core = by_core
        self.by_llc = by_llc

        def numa_span(node, dj):
            m = 0
            for nd in nodes_online:
                if dist[node][nd] <= dj:
                    m |= by_node[nd]
            return m

        numa_cache = {}

        def level_span(lvl, c):
            t = tcpu[c]
            if lvl == "SMT":
                return by_core[t["core"]]
            if lvl == "CLS":
                return by_cluster[t["cluster"]]
            if lvl == "MC":
                return by_llc[t["llc"]]
            if lvl == "PKG":
                return by_node[t["node"]]
            j = 0 if lvl == "NODE" else int(lvl[4:])
            key = (t["node"], j)
            if key not in numa_cache:
                numa_cache[key] = numa_span(t["node"], D[j])
            return numa_cache[key]

        # --- capacity classification inputs
        all_caps = {tcpu[c]["capacity"] for c in range(n)}
        self.asym_possible = len(all_caps) >= 2
        online_caps = {tcpu[c]["capacity"] for c in bits(online)}
        cap_span = {}
        for c in bits(online):
            cap_span[tcpu[c]["capacity"]] = cap_span.get(tcpu[c]["capacity"], 0) | (1 << c)
        reclaim = sc.node_reclaim_distance

        # --- build every online CPU's chain (before degeneration)
        self.pre = [None] * n          # pre[c] = list of Domain, bottom-up
        cache_flags = {}               # (level, span) -> (flags, pct, cnt)
        for c in bits(online):
            chain = []
            for li, lvl in enumerate(levels):
                span = level_span(lvl, c)
                numa_j = int(lvl[4:]) if lvl.startswith("NUMA") else None
                d = Domain(c, li, lvl, span, numa_j)
                key = (lvl, span)
                if key not in cache_flags:
                    cache_flags[key] = self.sd_init(lvl, span, numa_j, online_caps, cap_span,
                                                    reclaim)
                d.flags, d.imbalance_pct, d.cache_nice_tries = cache_flags[key]
                d.flags0 = d.flags
                if chain:
                    d.child0 = chain[-1]
                chain.append(d)
                if span == online:
                    break               # stop rule
            self.pre[c] = chain

        self.asym_active = any(d.flags & SD_ASYM_CPUCAPACITY
                               for c in bits(online) for d in self.pre[c])
        self.smt_active = any(weight(m) >= 2 for m in by_core.values())

        # --- imb_numa_nr (on the undegenerated tree)
        for c in bits(online):
            self.set_imb_numa_nr(self.pre[c])

        # --- shared objects (before degeneration)
        for c in bits(online):
            chain = self.pre[c]
            if self.asym_active:
                for d in chain:
                    if d.flags & SD_ASYM_CPUCAPACITY_FULL:
                        if not d.flags & SD_NUMA:
                            d.shared = ("asym", d.span)
                        break
            top_llc = None
            for d in chain:
                if d.flags & SD_SHARE_LLC:
                    top_llc = d
            if top_llc is not None:
                top_llc.shared = ("llc", top_llc.span)

        # --- groups' flags: (level, span) -> flags (only written/read for first groups)
        self.group_flags = {}
        self.group_cache = {}

        # --- degeneration, CPUs in ascending order
        self.sd = [None] * n           # sd[c] = list of attached domains, bottom-up
        for c in bits(online):
            self.sd[c] = self.cpu_attach_domain(c)

        # --- per-CPU shortcuts
        self.sd_llc = [None] * n
        self.llc_size = [1] * n
        self.share_id = list(range(n))
        self.sd_asym = [None] * n
        self.llc_shared = [None] * n
        self.balance_shared = [None] * n
        cluster_active = False
        for c in bits(online):
            chain = self.sd[c]
            llc = None
            for d in chain:
                if d.flags & SD_SHARE_LLC:
                    llc = d
                else:
                    break
            self.sd_llc[c] = llc
            if llc is not None:
                self.llc_size[c] = llc.weight
            cls = next((d for d in chain if d.flags & SD_CLUSTER), None)
            if cls is not None:
                cluster_active = True
                self.share_id[c] = lowest(cls.span)
            elif llc is not None:
                self.share_id[c] = lowest(llc.span)
            self.sd_asym[c] = next((d for d in chain if d.flags & SD_ASYM_CPUCAPACITY_FULL),
                                   None)
            self.llc_shared[c] = llc.shared if llc is not None else None
            a = self.sd_asym[c]
            self.balance_shared[c] = a.shared if (a is not None and a.shared is not None) \
                else self.llc_shared[c]
        self.cluster_active = cluster_active

        # --- shared objects alive after degeneration, with their owning domain
        self.objects = {}
        for c in bits(online):
            for d in self.sd[c]:
                if d.shared is not None and d.shared not in self.objects:
                    self.objects[d.shared] = d

    # -- sd_init: flags, imbalance_pct, cache_nice_tries (the table of 2.1)
    def sd_init(self, lvl, span, numa_j, online_caps, cap_span, reclaim):
        flags = SD_BASE
        if lvl == "SMT":
            flags |= SD_SHARE_CPUCAPACITY | SD_SHARE_LLC
        elif lvl == "CLS":
            flags |= SD_CLUSTER | SD_SHARE_LLC
        elif lvl == "MC":
            flags |= SD_SHARE_LLC
        elif numa_j is not None:
            flags |= SD_NUMA
        if self.asym_possible:
            count = sum(1 for cap in online_caps if cap_span[cap] & span)
            miss = len(online_caps) - count
            if count >= 2:
                flags |= SD_ASYM_CPUCAPACITY
                if miss == 0:
                    flags |= SD_ASYM_CPUCAPACITY_FULL
        if flags & SD_SHARE_CPUCAPACITY:
            pct, cnt = 110, 0
        elif flags & SD_SHARE_LLC:
            pct, cnt = 117, 1
        elif flags & SD_NUMA:
            pct, cnt = 117, 2
            flags &= ~SD_PREFER_SIBLING
            flags |= SD_SERIALIZE
            if self.D[numa_j] > reclaim:
                flags &= ~(SD_BALANCE_EXEC | SD_BALANCE_FORK | SD_WAKE_AFFINE)
        else:
            pct, cnt = 117, 1
        return flags, pct, cnt

    # -- imb_numa_nr
    @staticmethod
    def set_imb_numa_nr(chain):
        top = None
        for i, d in enumerate(chain):
            if d.flags & SD_SHARE_LLC:
                top = i
        if top is None or top + 1 >= len(chain):
            return
        L, P = chain[top], chain[top + 1]
        nr_llcs = P.weight // L.weight
        imb = (P.weight >> 3) if nr_llcs == 1 else nr_llcs
        imb = max(1, imb)
        imb_span = next((d.weight for d in chain[top + 2:] if d.flags & SD_NUMA), P.weight)
        for d in chain[top + 1:]:
            d.imb_numa_nr = imb * max(1, d.weight // imb_span)

    # -- groups
    def first_group_span(self, d):
        """Span of the group containing d.cpu (the list's first group)."""
        if d.child0 is None:
            return 1 << d.cpu
        return d.child0.span

    def first_group_key(self, d):
        key = (d.level, self.first_group_span(d))
        if key not in self.group_flags:
            self.group_flags[key] = d.child0.flags0 if d.child0 is not None else 0
        return key

    def groups(self, d):
        """The group list of domain d (built on the tree before degeneration)."""
        if d._groups is not None:
            return d._groups
        c, li, span = d.cpu, d.li, d.span
        out = []
        rest = LiveMask(span)
        if d.numa_j is None:
            # Kernel, not the format: these groups are shared objects whose
            # ring every CPU's build rewrites; the highest CPU of the span
            # builds last, so its wrap order stays, entered at c's group.
            for i in for_each_cpu_wrap(rest, span.bit_length() - 1):
                if li == 0:
                    gspan, gflags = 1 << i, 0
                else:
                    ch = self.pre[i][li - 1]
                    gspan, gflags = ch.span, ch.flags0
                out.append(self.make_group(d.level, gspan, gflags))
                rest.m &= ~gspan
            k = next(j for j, g in enumerate(out) if (g.span >> c) & 1)
            out = out[k:] + out[:k]
        else:
            # build_overlap_sched_groups
            for i in for_each_cpu_wrap(rest, c):
                chain_i = self.pre[i]
                if li >= len(chain_i):
                    continue          # i's chain stopped below this level: skipped
                sib = chain_i[li]
                while sib.child0 is not None and (sib.child0.span & ~span):
                    sib = sib.child0
                if sib.child0 is not None:
                    gspan, gflags = sib.child0.span, sib.child0.flags0
                else:
                    gspan, gflags = sib.span, 0
                out.append(self.make_group(d.level, gspan, gflags))
                rest.m &= ~gspan
        d._groups = out
        d._ngroups = len(out)
        return out

    def ngroups_gt1(self, d):
        if d._ngroups is not None:
            return d._ngroups > 1
        if d.numa_j is None:
            # non-overlapping groups partition the span into child spans
            if d.child0 is None:
                return d.weight > 1
            return d.child0.span != d.span
        return len(self.groups(d)) > 1

    def make_group(self, level, gspan, gflags):
        key = (level, gspan)
        if key not in self.group_flags:
            self.group_flags[key] = gflags
        g = self.group_cache.get(key)
        if g is None:
            caps = [self.sc.capacity[i] for i in bits(gspan)]
            g = Group(key, gspan, sum(caps), max(caps))
            self.group_cache[key] = g
        return g

    # -- degeneration (cpu_attach_domain)
    def sd_degenerate(self, d):
        if d.weight == 1:
            return True
        if self.ngroups_gt1(d) and (d.flags & ~SD_WAKE_AFFINE):
            return False
        if d.flags & SD_WAKE_AFFINE:
            return False
        return True

    def sd_parent_degenerate(self, d, p):
        if self.sd_degenerate(p):
            return True
        if d.span != p.span:
            return False
        pflags = p.flags
        if not self.ngroups_gt1(p):
            pflags &= SD_WAKE_AFFINE
        return (pflags & ~d.flags) == 0

    def cpu_attach_domain(self, c):
        chain = list(self.pre[c])
        i = 0
        while i + 1 < len(chain):
            d, p = chain[i], chain[i + 1]
            if self.sd_parent_degenerate(d, p):
                del chain[i + 1]
                if i + 1 < len(chain):
                    gp = chain[i + 1]
                    self.group_flags[self.first_group_key(gp)] = d.flags
                if p.shared is not None:
                    d.shared = p.shared
                if p.flags & SD_PREFER_SIBLING:
                    d.flags |= SD_PREFER_SIBLING
            else:
                i += 1
        if chain and self.sd_degenerate(chain[0]):
            chain.pop(0)
            if chain:
                self.group_flags[self.first_group_key(chain[0])] = 0
        for k, d in enumerate(chain):
            d.child = chain[k - 1] if k > 0 else None
            d.parent = chain[k + 1] if k + 1 < len(chain) else None
        return chain

    def dump(self, c):
        lines = [f"cpu{c}: sd_llc={self.sd_llc[c]} llc_size={self.llc_size[c]} "
                 f"share_id={self.share_id[c]} sd_asym={self.sd_asym[c]} "
                 f"llc_shared={fmt_obj(self.llc_shared[c])} "
                 f"balance_shared={fmt_obj(self.balance_shared[c])}"]
        attached = set(id(d) for d in (self.sd[c] or []))
        for d in self.pre[c] or []:
            mark = "  " if id(d) in attached else "x "
            gs = self.groups(d)
            fk = self.first_group_key(d)
            lines.append(
                f"  {mark}{d.level:6} span={cpulist(d.span)} w={d.weight} "
                f"pct={d.imbalance_pct} cnt={d.cache_nice_tries} imb_numa_nr={d.imb_numa_nr} "
                f"flags={'|'.join(flag_names(d.flags))} shared={fmt_obj(d.shared)} "
                f"groups=[{' '.join(cpulist(g.span) for g in gs)}] "
                f"first_group_flags={'|'.join(flag_names(self.group_flags[fk]))}")
        return "\n".join(lines)


def fmt_obj(o):
    return "-" if o is None else f"{o[0]}:{cpulist(o[1])}"


# ---------------------------------------------------------------------------
# Scenario: parse + validate (sections 1-8)
# ---------------------------------------------------------------------------

FEATURES = {
    "SIS_UTIL": True, "WA_IDLE": True, "WA_WEIGHT": True, "WA_BIAS": True,
    "UTIL_EST": True, "CACHE_HOT_BUDDY": True, "PLACE_LAG": True,
    "PREFER_LAST_IDLE_CPU": False, "SKIP_SCHED_IDLE_FOR_IDLE_TASK": True,
    "EXEC_BOUND_FAST_PATH": True,
}
TOP_KEYS = {"version", "name", "generator", "features", "system", "topology", "cpus", "llc",
            "asym", "task", "request", "expected"}
SYSTEM_KEYS = {"uclamp_used", "core_sched", "migration_cost_ns", "node_reclaim_distance"}
TOPO_KEYS = {"cpus", "numa_distance"}
TOPO_CPU_KEYS = {"id", "core", "cluster", "llc", "node", "capacity"}
CPU_KEYS = {"id", "online", "nr_running", "h_nr_idle", "nr_delayed", "cfs_h_nr_queued",
            "curr_is_idle", "ttwu_pending", "vcpu_preempted", "load_avg", "runnable_avg",
            "util_avg", "util_est", "capacity", "actual_capacity", "idle_exit_latency",
            "idle_stamp", "curr_is_per_cpu_kthread", "core_cookie"}
TASK_KEYS = {"policy", "cpus_allowed", "prev_cpu", "recent_used_cpu", "util_avg", "util_est",
             "runnable_avg", "load_avg", "uclamp_min", "uclamp_max", "wakee_flips",
             "migration_disabled", "core_cookie", "numa_preferred_nid", "per_cpu_kthread",
             "running", "sched_delayed", "eligible", "next_buddy", "blocked", "exec_start",
             "hot"}
PLACE_REQ_KEYS = {"kind", "this_cpu", "sync", "wf_current_cpu", "in_task", "waker_exiting",
                  "waker_wakee_flips", "waker_last_wakee_is_task", "waker_flip_decay_expired",
                  "waker_load", "waker_is_per_cpu_kthread"}
MIGRATE_REQ_KEYS = {"kind", "src_cpu", "dst_cpu", "sd_level", "dst_group", "env_cpus", "idle",
                    "migration_type", "flags", "nr_balance_failed", "cache_nice_tries",
                    "throttled", "dst_cfs_nr_queued", "now"}
LBF = ["ALL_PINNED", "NEED_BREAK", "DST_PINNED", "SOME_PINNED", "ACTIVE_LB"]
HINT_KEYS = {"nr_idle_scan", "has_idle_cores"}
U64 = (1 << 64) - 1


class Scenario:
    """All inputs of one decision, validated, with defaults applied."""

    def __init__(self, obj):
        if not isinstance(obj, dict):
            raise ScenarioError("scenario", "must be a JSON object")
        check_keys(obj, TOP_KEYS, "")
        get_int(obj, "version", "", default=1)
        if obj.get("version", 1) != 1:
            raise ScenarioError("version", "must be 1")
        if "name" in obj and not isinstance(obj["name"], str):
            raise ScenarioError("name", "must be a string")
        if "generator" in obj and not isinstance(obj["generator"], dict):
            raise ScenarioError("generator", "must be an object")
        self.parse_features(obj.get("features", {}))
        self.parse_system(obj.get("system", {}))
        if "topology" not in obj:
            raise ScenarioError("topology", "required")
        self.parse_topology(obj["topology"])
        self.parse_cpus(obj.get("cpus", []))
        if "request" not in obj:
            raise ScenarioError("request", "required")
        req = obj["request"]
        if not isinstance(req, dict):
            raise ScenarioError("request", "must be an object")
        self.kind = get_enum(req, "kind", "request", ["wakeup", "fork", "exec", "can_migrate"],
                             required=True)
        self.parse_task(obj.get("task", {}), req)
        self.parse_request(req)
        # domains need the online mask only
        self.topo_tree = Topology(self)
        self.parse_hints(obj.get("llc", {}), obj.get("asym", {}))
        if self.kind == "can_migrate":
            self.resolve_migrate_domain()

    # -- features / system
    def parse_features(self, f):
        if not isinstance(f, dict):
            raise ScenarioError("features", "must be an object")
        self.feat = dict(FEATURES)
        for k, v in f.items():
            if k not in FEATURES:
                raise ScenarioError(f"features.{k}", "unknown feature")
            if not is_bool(v):
                raise ScenarioError(f"features.{k}", "must be a boolean")
            self.feat[k] = v

    def parse_system(self, s):
        check_keys(s, SYSTEM_KEYS, "system")
        if "uclamp_used" in s and s["uclamp_used"] is not None and not is_bool(s["uclamp_used"]):
            raise ScenarioError("system.uclamp_used", "must be a boolean or null")
        self.uclamp_used_in = s.get("uclamp_used")
        self.core_sched = get_bool(s, "core_sched", "system", False)
        self.migration_cost_ns = get_int(s, "migration_cost_ns", "system", 500000, lo=-1)
        self.node_reclaim_distance = get_int(s, "node_reclaim_distance", "system", 30, lo=0)

    # -- topology (section 2)
    def parse_topology(self, t):
        check_keys(t, TOPO_KEYS, "topology")
        if "cpus" not in t:
            raise ScenarioError("topology.cpus", "required")
        cl = t["cpus"]
        if not isinstance(cl, list) or not cl:
            raise ScenarioError("topology.cpus", "must be a non-empty list")
        if len(cl) > MAX_CPUS:
            raise ScenarioError("topology.cpus", f"at most {MAX_CPUS} CPUs")
        n = len(cl)
        self.n = n
        topo = []
        n_cluster = 0
        for i, e in enumerate(cl):
            p = f"topology.cpus[{i}]"
            check_keys(e, TOPO_CPU_KEYS, p)
            cid = get_int(e, "id", p, required=True)
            if cid != i:
                raise ScenarioError(f"{p}.id", f"must equal its position {i} (got {cid})")
            core = get_int(e, "core", p, required=True, lo=0)
            cluster = get_int(e, "cluster", p, default=None, lo=0)
            llc = get_int(e, "llc", p, required=True, lo=0)
            node = get_int(e, "node", p, default=0, lo=0, hi=255)
            cap = get_int(e, "capacity", p, default=1024, lo=1, hi=1024)
            if cluster is not None:
                n_cluster += 1
            topo.append({"core": core, "cluster": cluster, "llc": llc, "node": node,
                         "capacity": cap})
        if 0 < n_cluster < n:
            first = topo[0]["cluster"] is None
            bad = next(i for i in range(n) if (topo[i]["cluster"] is None) != first)
            raise ScenarioError(f"topology.cpus[{bad}].cluster",
                                "clusters are given on some CPUs but not others")
        self.has_clusters = n_cluster == n
        # containment rules
        def contained(child, parent, cname, pname):
            seen = {}
            for i in range(n):
                a, b = topo[i][child], topo[i][parent]
                if a in seen and seen[a] != b:
                    raise ScenarioError(f"topology.cpus[{i}].{parent}",
                                        f"{cname} {a} lies in two {pname}s ({seen[a]} and {b})")
                seen.setdefault(a, b)
        if self.has_clusters:
            contained("core", "cluster", "core", "cluster")
            contained("cluster", "llc", "cluster", "LLC")
        contained("core", "llc", "core", "LLC")
        contained("llc", "node", "LLC", "node")
        caps = {}
        for i in range(n):
            k = topo[i]["core"]
            if k in caps and caps[k] != topo[i]["capacity"]:
                raise ScenarioError(f"topology.cpus[{i}].capacity",
                                    f"SMT siblings of core {k} have different capacities")
            caps.setdefault(k, topo[i]["capacity"])
        self.topo = topo
        # numa_distance
        nn = max(x["node"] for x in topo) + 1
        if "numa_distance" in t:
            md = t["numa_distance"]
            if not isinstance(md, list) or len(md) != nn:
                raise ScenarioError("topology.numa_distance",
                                    f"must be a {nn}x{nn} matrix (max node + 1)")
            for a, row in enumerate(md):
                if not isinstance(row, list) or len(row) != nn:
                    raise ScenarioError(f"topology.numa_distance[{a}]",
                                        f"must be a list of {nn} integers")
                for b, v in enumerate(row):
                    pp = f"topology.numa_distance[{a}][{b}]"
                    if not is_int(v):
                        raise ScenarioError(pp, "must be an integer")
                    if a == b and v != 10:
                        raise ScenarioError(pp, "diagonal must be 10")
                    if a != b and not 11 <= v <= 254:
                        raise ScenarioError(pp, "off-diagonal distances must be 11..254")
            for a in range(nn):
                for b in range(a + 1, nn):
                    if md[a][b] != md[b][a]:
                        raise ScenarioError(f"topology.numa_distance[{b}][{a}]",
                                            "matrix must be symmetric")
            self.numa_distance = md
        else:
            self.numa_distance = [[10 if a == b else 20 for b in range(nn)] for a in range(nn)]

    # -- per-CPU state (section 5)
    def parse_cpus(self, cl):
        if not isinstance(cl, list):
            raise ScenarioError("cpus", "must be a list")
        n = self.n
        given = [None] * n
        for i, e in enumerate(cl):
            p = f"cpus[{i}]"
            check_keys(e, CPU_KEYS, p)
            cid = get_int(e, "id", p, required=True)
            if not 0 <= cid < n:
                raise ScenarioError(f"{p}.id", f"CPU {cid} is not in the topology")
            if given[cid] is not None:
                raise ScenarioError(f"{p}.id", f"CPU {cid} listed twice")
            given[cid] = (i, e)
        self.online = [True] * n
        self.nr_running = [0] * n
        self.h_nr_idle = [0] * n
        self.nr_delayed = [0] * n
        self.cfs_h_nr_queued = [0] * n
        self.curr_is_idle = [True] * n
        self.ttwu_pending = [False] * n
        self.vcpu_preempted = [False] * n
        self.load = [0] * n
        self.runnable = [0] * n
        self.util = [0] * n
        self.util_est = [0] * n
        self.cap_orig = [t["capacity"] for t in self.topo]
        self.capacity = list(self.cap_orig)
        self.actual_capacity = list(self.cap_orig)
        self.exit_latency = [None] * n
        self.idle_stamp = [0] * n
        self.curr_pcpu_kthread = [False] * n
        self.core_cookie = [0] * n
        for c in range(n):
            if given[c] is None:
                continue
            i, e = given[c]
            p = f"cpus[{i}]"
            online = get_bool(e, "online", p, True)
            nr = get_int(e, "nr_running", p, 0, lo=0)
            hidle = get_int(e, "h_nr_idle", p, 0, lo=0)
            if hidle > nr:
                raise ScenarioError(f"{p}.h_nr_idle", "exceeds nr_running")
            ndel = get_int(e, "nr_delayed", p, 0, lo=0)
            if ndel > nr:
                raise ScenarioError(f"{p}.nr_delayed", "exceeds nr_running")
            q = get_int(e, "cfs_h_nr_queued", p, nr, lo=0)
            cii = get_bool(e, "curr_is_idle", p, nr == 0)
            ttwu = get_bool(e, "ttwu_pending", p, False)
            vp = get_bool(e, "vcpu_preempted", p, False)
            la = get_int(e, "load_avg", p, 0, lo=0, hi=INT31)
            ra = get_int(e, "runnable_avg", p, 0, lo=0, hi=INT31)
            ua = get_int(e, "util_avg", p, 0, lo=0, hi=INT31)
            ue = get_int(e, "util_est", p, 0, lo=0, hi=INT31)
            co = self.cap_orig[c]
            cap = get_int(e, "capacity", p, co, lo=1, hi=co)
            acap = get_int(e, "actual_capacity", p, co, lo=0, hi=co)
            if "idle_exit_latency" in e and e["idle_exit_latency"] is not None:
                lat = get_int(e, "idle_exit_latency", p, None, lo=0)
            else:
                lat = None
            stamp = get_int(e, "idle_stamp", p, 0, lo=0, hi=CLOCK)
            kth = get_bool(e, "curr_is_per_cpu_kthread", p, False)
            cookie = get_int(e, "core_cookie", p, 0, lo=0, hi=U64)
            self.capacity[c] = cap
            self.actual_capacity[c] = acap
            self.online[c] = online
            self.core_cookie[c] = cookie
            self.curr_pcpu_kthread[c] = kth
            if not online:
                continue               # an offline CPU: idle, empty runqueue
            self.nr_running[c] = nr
            self.h_nr_idle[c] = hidle
            self.nr_delayed[c] = ndel
            self.cfs_h_nr_queued[c] = q
            self.curr_is_idle[c] = cii
            self.ttwu_pending[c] = ttwu
            self.vcpu_preempted[c] = vp
            self.load[c], self.runnable[c], self.util[c], self.util_est[c] = la, ra, ua, ue
            self.exit_latency[c] = lat
            self.idle_stamp[c] = stamp
        self.online_mask = sum(1 << c for c in range(n) if self.online[c])
        if self.online_mask == 0:
            raise ScenarioError("cpus", "no CPU is online")

    # -- task (section 7)
    def parse_task(self, t, req):
        check_keys(t, TASK_KEYS, "task")
        n = self.n
        self.policy = get_enum(t, "policy", "task", ["normal", "batch", "idle"], "normal")
        if "cpus_allowed" in t:
            self.cpus_allowed = parse_cpulist(t["cpus_allowed"], n, "task.cpus_allowed",
                                              allow_empty=False)
        else:
            self.cpus_allowed = (1 << n) - 1
        if self.kind == "wakeup":
            self.prev_cpu = get_cpu(t, "prev_cpu", "task", n, required=True)
        else:
            get_cpu(t, "prev_cpu", "task", n)        # ignored, but must be well-formed
            self.prev_cpu = None
        self.recent_used_cpu = get_cpu(t, "recent_used_cpu", "task", n, default=self.prev_cpu,
                                       nullable=True)
        self.t_util = get_int(t, "util_avg", "task", 0, lo=0, hi=INT31)
        self.t_util_est = get_int(t, "util_est", "task", 0, lo=0, hi=INT31)
        self.t_runnable = get_int(t, "runnable_avg", "task", 0, lo=0, hi=INT31)
        self.t_load = get_int(t, "load_avg", "task", 0, lo=0, hi=INT31)
        self.uclamp_min = get_int(t, "uclamp_min", "task", 0, lo=0, hi=1024)
        self.uclamp_max = get_int(t, "uclamp_max", "task", 1024, lo=0, hi=1024)
        self.wakee_flips = get_int(t, "wakee_flips", "task", 0, lo=0, hi=INT31)
        self.migration_disabled = get_bool(t, "migration_disabled", "task", False)
        self.t_cookie = get_int(t, "core_cookie", "task", 0, lo=0, hi=U64)
        self.numa_preferred_nid = get_int(t, "numa_preferred_nid", "task", -1, lo=-1, hi=255)
        self.t_per_cpu_kthread = get_bool(t, "per_cpu_kthread", "task", False)
        self.t_running = get_bool(t, "running", "task", False)
        self.t_sched_delayed = get_bool(t, "sched_delayed", "task", False)
        self.t_eligible = get_bool(t, "eligible", "task", True)
        self.t_next_buddy = get_bool(t, "next_buddy", "task", False)
        self.t_blocked = get_bool(t, "blocked", "task", False)
        self.t_exec_start = get_int(t, "exec_start", "task", 0, lo=0, hi=CLOCK)
        if "hot" in t and t["hot"] is not None and not is_bool(t["hot"]):
            raise ScenarioError("task.hot", "must be a boolean or null")
        self.t_hot = t.get("hot")
        self.task_util_est = max(self.t_util, self.t_util_est)
        if self.uclamp_used_in is None:
            self.uclamp_used = self.uclamp_min != 0 or self.uclamp_max != 1024
        else:
            self.uclamp_used = self.uclamp_used_in

    # -- request (section 8)
    def parse_request(self, r):
        n = self.n
        if self.kind != "can_migrate":
            check_keys(r, PLACE_REQ_KEYS, "request")
            c = get_cpu(r, "this_cpu", "request", n, required=True)
            if not self.online[c]:
                raise ScenarioError("request.this_cpu", f"CPU {c} is offline")
            if self.kind == "exec":
                if self.nr_running[c] < 1:
                    raise ScenarioError("request.this_cpu",
                                        "exec requires nr_running >= 1 on this_cpu")
                if self.curr_is_idle[c]:
                    raise ScenarioError("request.this_cpu",
                                        "exec requires curr_is_idle false on this_cpu")
            self.this_cpu = c
            self.sync_req = get_bool(r, "sync", "request", False)
            self.wf_current_cpu = get_bool(r, "wf_current_cpu", "request", False)
            self.in_task = get_bool(r, "in_task", "request", True)
            self.waker_exiting = get_bool(r, "waker_exiting", "request", False)
            self.waker_wakee_flips = get_int(r, "waker_wakee_flips", "request", 0, lo=0,
                                             hi=INT31)
            self.waker_last_wakee_is_task = get_bool(r, "waker_last_wakee_is_task", "request",
                                                     True)
            self.waker_flip_decay_expired = get_bool(r, "waker_flip_decay_expired", "request",
                                                     False)
            self.waker_load = get_int(r, "waker_load", "request", 0, lo=0, hi=INT31)
            self.waker_is_per_cpu_kthread = get_bool(r, "waker_is_per_cpu_kthread", "request",
                                                     self.curr_pcpu_kthread[c])
            self.task_cpu = self.prev_cpu if self.kind == "wakeup" else c
            if self.kind != "wakeup":
                self.prev_cpu = c
                if self.kind == "fork":
                    self.recent_used_cpu = c
        else:
            check_keys(r, MIGRATE_REQ_KEYS, "request")
            s = get_cpu(r, "src_cpu", "request", n, required=True)
            d = get_cpu(r, "dst_cpu", "request", n, required=True)
            if not self.online[s]:
                raise ScenarioError("request.src_cpu", f"CPU {s} is offline")
            if not self.online[d]:
                raise ScenarioError("request.dst_cpu", f"CPU {d} is offline")
            if s == d:
                raise ScenarioError("request.dst_cpu", "must differ from src_cpu")
            self.src_cpu, self.dst_cpu = s, d
            self.task_cpu = s
            self.prev_cpu = s
            lvl = r.get("sd_level")
            if lvl is not None and not isinstance(lvl, str):
                raise ScenarioError("request.sd_level", "must be a string or null")
            self.sd_level = lvl
            self.dst_group_in = (parse_cpulist(r["dst_group"], n, "request.dst_group")
                                 if "dst_group" in r else None)
            self.env_cpus_in = (parse_cpulist(r["env_cpus"], n, "request.env_cpus")
                                if "env_cpus" in r else None)
            self.lb_idle = get_enum(r, "idle", "request", ["idle", "not_idle", "newly_idle"],
                                    "idle")
            self.migration_type = get_enum(r, "migration_type", "request",
                                           ["load", "util", "task", "misfit"], "load")
            fl = r.get("flags", ["ALL_PINNED"])
            if not isinstance(fl, list):
                raise ScenarioError("request.flags", "must be a list of flag names")
            self.lb_flags = set()
            for k, f in enumerate(fl):
                if not isinstance(f, str) or f not in LBF:
                    raise ScenarioError(f"request.flags[{k}]", f"unknown flag {f!r}")
                self.lb_flags.add(f)
            self.nr_balance_failed = get_int(r, "nr_balance_failed", "request", 0, lo=0)
            self.cache_nice_tries_in = get_int(r, "cache_nice_tries", "request", None, lo=0)
            self.throttled = get_bool(r, "throttled", "request", False)
            self.dst_cfs_nr_queued = get_int(r, "dst_cfs_nr_queued", "request",
                                             self.cfs_h_nr_queued[d], lo=0)
            self.now = get_int(r, "now", "request", 0, lo=0, hi=CLOCK)
        if self.migration_disabled:
            self.cpus_ptr = 1 << self.task_cpu
        else:
            self.cpus_ptr = self.cpus_allowed
        self.nr_cpus_allowed = weight(self.cpus_allowed)

    # -- hints (section 6)
    def parse_hints(self, llc, asym):
        tt = self.topo_tree
        self.hint = {}                 # object key -> dict
        if not isinstance(llc, dict):
            raise ScenarioError("llc", "must be an object")
        if not isinstance(asym, dict):
            raise ScenarioError("asym", "must be an object")
        llc_ids = {str(t["llc"]): t["llc"] for t in self.topo}
        for k, v in llc.items():
            p = f"llc.{k}"
            if k not in llc_ids:
                raise ScenarioError(p, "not a topology llc id")
            h = self.parse_hint(v, p)
            span = tt.by_llc.get(llc_ids[k], 0)
            key = ("llc", span)
            if weight(span) >= 2 and key in tt.objects:
                self.hint[key] = h
        seen = set()
        for k, v in asym.items():
            p = f"asym.{k}"
            try:
                span = parse_cpulist(k, self.n, p, allow_empty=False)
            except ScenarioError:
                raise ScenarioError(p, "not a cpulist")
            key = ("asym", span)
            if key not in tt.objects:
                raise ScenarioError(p, "no asymmetric-capacity shared object has this span")
            if key in seen:
                raise ScenarioError(p, "duplicate span")
            seen.add(key)
            self.hint[key] = self.parse_hint(v, p)

    @staticmethod
    def parse_hint(v, p):
        check_keys(v, HINT_KEYS, p)
        h = {}
        if "nr_idle_scan" in v:
            h["nr_idle_scan"] = get_int(v, "nr_idle_scan", p, lo=0)
        if "has_idle_cores" in v:
            h["has_idle_cores"] = get_bool(v, "has_idle_cores", p)
        return h

    # -- can_migrate domain (section 8.2)
    def resolve_migrate_domain(self):
        tt = self.topo_tree
        chain = tt.sd[self.dst_cpu]
        if self.sd_level is None:
            sd = next((d for d in chain if has(d.span, self.src_cpu)), None)
            if sd is None:
                raise ScenarioError("request.dst_cpu",
                                    "dst_cpu has no domain containing src_cpu")
        else:
            lv = self.sd_level
            known = lv in ("SMT", "CLS", "MC", "PKG", "NODE") or (
                lv.startswith("NUMA") and lv[4:].isdigit() and not lv[4:].startswith("0"))
            if not known:
                raise ScenarioError("request.sd_level", f"unknown level {self.sd_level!r}")
            sd = next((d for d in chain if d.level == self.sd_level), None)
            if sd is None:
                raise ScenarioError("request.sd_level",
                                    f"dst_cpu {self.dst_cpu} has no {self.sd_level} domain")
        self.lb_sd = sd


# ---------------------------------------------------------------------------
# The decision: one function per kernel step (section 11)
# ---------------------------------------------------------------------------

INF = float("inf")

# group types (numeric order of the kernel's enum group_type)
GROUP_HAS_SPARE = 0
GROUP_FULLY_BUSY = 1
GROUP_MISFIT_TASK = 2
GROUP_OVERLOADED = 7


class Decision:
    """Evaluates one scenario; holds the scan counter and the informative detail."""

    def __init__(self, sc):
        self.sc = sc
        self.tt = sc.topo_tree
        self.f = sc.feat
        self.scanned = 0
        self.detail = {"want_affine": False, "affine": None, "sis_target": None,
                       "has_idle_core": None, "nr_idle_scan": None}
        self._scan_cache = {}
        self._hic_cache = {}

    # ---- 11.1 predicates -------------------------------------------------
    def idle_cpu(self, c):
        s = self.sc
        return s.curr_is_idle[c] and s.nr_running[c] == 0 and not s.ttwu_pending[c]

    def available_idle_cpu(self, c):
        return self.idle_cpu(c) and not self.sc.vcpu_preempted[c]

    def sched_idle_rq(self, c):
        s = self.sc
        return s.nr_running[c] > 0 and s.nr_running[c] == s.h_nr_idle[c]

    def choose_sched_idle_rq(self, c):
        return self.sched_idle_rq(c) and not (
            self.f["SKIP_SCHED_IDLE_FOR_IDLE_TASK"] and self.sc.policy == "idle")

    def choose_idle_cpu(self, c):
        return self.available_idle_cpu(c) or self.choose_sched_idle_rq(c)

    def smt_mask(self, c):
        s = self.sc
        if not s.online[c]:
            return 0
        return self.tt.by_core[s.topo[c]["core"]]

    def is_core_idle(self, c):
        s = self.sc
        sib = self.tt.by_core.get(s.topo[c]["core"], 0) & ~(1 << c)
        return all(self.idle_cpu(x) for x in bits(sib))

    @staticmethod
    def fits_capacity(u, cap):
        return u * 1280 < cap * 1024

    def util_fits_cpu(self, u, umin, umax, c):
        s = self.sc
        fits = self.fits_capacity(u, s.capacity[c])
        if not s.uclamp_used:
            return 1 if fits else 0
        m = s.cap_orig[c] == 1024 and umax == 1024
        fits = fits or (not m and umax <= s.cap_orig[c])
        umin = min(umin, umax)
        if fits and u < umin and umin > s.actual_capacity[c]:
            return -1
        return 1 if fits else 0

    def task_fits_cpu(self, c):
        s = self.sc
        return self.util_fits_cpu(s.task_util_est, s.uclamp_min, s.uclamp_max, c) > 0

    def asym_fits_cpu(self, c):
        if not self.tt.asym_active:
            return True
        return (not self.tt.smt_active or self.is_core_idle(c)) and self.task_fits_cpu(c)

    def sched_cpu_cookie_match(self, c):
        s = self.sc
        return not s.core_sched or s.core_cookie[c] == s.t_cookie

    def sched_core_cookie_match(self, c):
        s = self.sc
        if not s.core_sched:
            return True
        if all(self.available_idle_cpu(x) for x in bits(self.smt_mask(c))):
            return True
        return s.core_cookie[c] == s.t_cookie

    def sched_group_cookie_match(self, gspan):
        if not self.sc.core_sched:
            return True
        return any(self.sched_core_cookie_match(c) for c in bits(gspan & self.sc.cpus_ptr))

    def is_cpu_allowed(self, c):
        return has(self.sc.cpus_ptr, c) and self.sc.online[c]

    def cpu_util(self, c, with_task):
        s = self.sc
        u = s.util[c]
        if with_task:
            u = max(0, u - s.t_util)
        if self.f["UTIL_EST"]:
            e = s.util_est[c]
            if with_task:
                e = max(0, e - s.t_util_est)
            u = max(u, e)
        return min(u, s.cap_orig[c])

    def cpus_share_cache(self, a, b):
        s = self.sc
        if a == b:
            return True
        if s.online[a] and s.online[b]:
            return s.topo[a]["llc"] == s.topo[b]["llc"]
        return not s.online[a] and not s.online[b]

    def cpus_share_resources(self, a, b):
        return a == b or self.tt.share_id[a] == self.tt.share_id[b]

    # ---- section 6: shared-object values ------------------------------------
    def nr_idle_scan(self, obj):
        if obj in self._scan_cache:
            return self._scan_cache[obj]
        h = self.sc.hint.get(obj, {})
        if "nr_idle_scan" in h:
            v = h["nr_idle_scan"]
        else:
            v = self.update_idle_cpu_scan(self.tt.objects[obj])
        self._scan_cache[obj] = v
        return v

    def update_idle_cpu_scan(self, d):
        s = self.sc
        w = d.weight
        pct = d.imbalance_pct
        ue = self.f["UTIL_EST"]
        sum_util = 0
        for i in bits(d.span & s.online_mask):
            sum_util += min(max(s.util[i], s.util_est[i] if ue else 0), s.cap_orig[i])
        x = sum_util // w
        tmp = min(x * x * pct * pct // (10000 * 1024), 1024)
        y = (1024 - tmp) * w // 1024
        return y

    def has_idle_cores(self, obj):
        if obj is None:
            return False
        if obj in self._hic_cache:
            return self._hic_cache[obj]
        h = self.sc.hint.get(obj, {})
        if "has_idle_cores" in h:
            v = h["has_idle_cores"]
        else:
            v = False
            s = self.sc
            for c in bits(s.online_mask):
                if self.tt.balance_shared[c] == obj and all(
                        self.available_idle_cpu(x) for x in bits(self.smt_mask(c))):
                    v = True
                    break
        self._hic_cache[obj] = v
        return v

    # ---- 11.2 entry ---------------------------------------------------------
    def decide_placement(self):
        s = self.sc
        if s.kind == "wakeup":
            cpu, path = self.select_task_rq(s.prev_cpu)
        elif s.kind == "fork":
            cpu, path = self.select_task_rq(s.this_cpu)
        else:
            cpu, path = self.sched_exec()
        return {"cpu": cpu, "path": path, "scanned": self.scanned, "detail": self.detail}

    def sched_exec(self):
        s = self.sc
        if self.f["EXEC_BOUND_FAST_PATH"]:
            dest, path = self.select_task_rq(s.this_cpu)
        else:
            dest, path = self.select_task_rq_fair(s.this_cpu)
        if not s.online[dest]:
            return s.this_cpu, "exec_stay_inactive"
        return dest, path

    def select_task_rq(self, c):
        """core_select(): the core wrapper."""
        s = self.sc
        if s.nr_cpus_allowed > 1 and not s.migration_disabled:
            c, path = self.select_task_rq_fair(c)
        else:
            c, path = lowest(s.cpus_ptr), "bound"
        if not self.is_cpu_allowed(c):
            c, path = self.select_fallback_rq(s.task_cpu), "fallback_rq"
        return c, path

    def select_fallback_rq(self, t):
        s = self.sc
        node = s.topo[t]["node"]
        for c in range(s.n):
            if s.topo[c]["node"] == node and self.is_cpu_allowed(c):
                return c
        for c in bits(s.cpus_ptr):
            if self.is_cpu_allowed(c):
                return c
        return lowest(s.online_mask)

    # ---- 11.3 select_task_rq_fair -------------------------------------------
    def select_task_rq_fair(self, prev_cpu):
        s = self.sc
        cpu = s.this_cpu
        new_cpu = prev_cpu
        want_affine = False
        sd_flag = {"wakeup": SD_BALANCE_WAKE, "fork": SD_BALANCE_FORK,
                   "exec": SD_BALANCE_EXEC}[s.kind]
        sync = s.kind == "wakeup" and s.sync_req and not s.waker_exiting
        if s.kind == "wakeup":
            flips = s.waker_wakee_flips
            if s.waker_flip_decay_expired:
                flips >>= 1
            if not s.waker_last_wakee_is_task:
                flips += 1
            if s.wf_current_cpu and has(s.cpus_ptr, cpu):
                return cpu, "current_cpu"
            want_affine = not self.wake_wide(flips) and has(s.cpus_ptr, cpu)
            self.detail["want_affine"] = want_affine
        sd = None
        for tmp in self.tt.sd[cpu]:
            if want_affine and tmp.flags & SD_WAKE_AFFINE and has(tmp.span, prev_cpu):
                if cpu != prev_cpu:
                    new_cpu = self.wake_affine(tmp, cpu, prev_cpu, sync)
                sd = None
                break
            if tmp.flags & sd_flag:
                sd = tmp
            elif not want_affine:
                break
        if sd is not None:
            return self.sched_balance_find_dst_cpu(sd, cpu, prev_cpu, sd_flag)
        if s.kind == "wakeup":
            self.detail["sis_target"] = new_cpu
            return self.select_idle_sibling(prev_cpu, new_cpu)
        return new_cpu, "no_domain"

    def wake_wide(self, master):
        s = self.sc
        slave = s.wakee_flips
        factor = self.tt.llc_size[s.this_cpu]
        if master < slave:
            master, slave = slave, master
        # Kernel, not the format: unsigned int arithmetic wraps at 2^32.
        return slave >= factor and master >= (slave * factor) & 0xFFFFFFFF

    def wake_affine(self, sd, this, prev, sync):
        t, tag = None, None
        if self.f["WA_IDLE"]:
            t, tag = self.wake_affine_idle(this, prev, sync)
        if self.f["WA_WEIGHT"] and t is None:
            t = self.wake_affine_weight(sd, this, prev, sync)
            tag = "this_weight" if t == this else None
        self.detail["affine"] = tag if t == this or tag == "prev_idle" else "prev"
        return this if t == this else prev

    def wake_affine_idle(self, this, prev, sync):
        """Returns (cpu or None, detail tag)."""
        s = self.sc
        if self.available_idle_cpu(this) and self.cpus_share_cache(this, prev):
            if self.available_idle_cpu(prev):
                return prev, "prev_idle"
            return this, "this_idle"
        if sync and s.nr_running[this] - s.nr_delayed[this] == 1:
            return this, "this_sync"
        if self.available_idle_cpu(prev):
            return prev, "prev_idle"
        return None, None

    def wake_affine_weight(self, sd, this, prev, sync):
        s = self.sc
        te = s.load[this]
        if sync:
            if s.waker_load > te:
                return this
            te -= s.waker_load
        te += s.t_load
        if self.f["WA_BIAS"]:
            te *= 100
        te *= s.capacity[prev]
        pe = s.load[prev] - s.t_load
        if self.f["WA_BIAS"]:
            pe *= 100 + (sd.imbalance_pct - 100) // 2
        pe *= s.capacity[this]
        if sync:
            pe += 1
        return this if te < pe else None

    # ---- 11.4 select_idle_sibling and the scans -----------------------------
    def select_idle_sibling(self, prev, target):
        s, tt = self.sc, self.tt
        if self.choose_idle_cpu(target) and self.asym_fits_cpu(target):
            return target, "target"
        prev_aff = None
        if (prev != target and self.cpus_share_cache(prev, target)
                and self.choose_idle_cpu(prev) and self.asym_fits_cpu(prev)):
            if not tt.cluster_active or self.cpus_share_resources(prev, target):
                return prev, "prev"
            prev_aff = prev
        if (s.waker_is_per_cpu_kthread and s.in_task and prev == s.this_cpu
                and s.nr_running[s.this_cpu] <= 1 and self.asym_fits_cpu(prev)):
            return prev, "per_cpu_kthread"
        r = s.recent_used_cpu
        if (r is not None and r != prev and r != target and self.cpus_share_cache(r, target)
                and self.choose_idle_cpu(r) and has(s.cpus_ptr, r) and self.asym_fits_cpu(r)):
            if not tt.cluster_active or self.cpus_share_resources(r, target):
                return r, "recent"
        else:
            r = None
        if tt.asym_active and tt.sd_asym[target] is not None:
            i = self.select_idle_capacity(tt.sd_asym[target], target)
            if i is not None:
                return i, "capacity"
            return target, "capacity_none"
        sd = tt.sd_llc[target]
        if sd is None:
            return target, "no_llc"
        has_idle_core = False
        if tt.smt_active:
            has_idle_core = self.has_idle_cores(tt.balance_shared[target])
            self.detail["has_idle_core"] = has_idle_core
            if not has_idle_core and self.cpus_share_cache(prev, target):
                i = self.select_idle_smt(sd, prev)
                if i is not None:
                    return i, "idle_smt"
        i, path = self.select_idle_cpu(sd, has_idle_core, target)
        if i is not None:
            return i, path
        if prev_aff is not None:
            return prev_aff, "prev_aff"
        if r is not None:
            return r, "recent_aff"
        return target, "fallback_target"

    def select_idle_smt(self, sd, t):
        s = self.sc
        for c in bits(self.smt_mask(t)):
            if not has(s.cpus_ptr, c) or c == t or not has(sd.span, c):
                continue
            self.scanned += 1
            if self.choose_idle_cpu(c):
                return c
        return None

    def select_idle_cpu(self, sd, has_idle_core, target):
        """Returns (cpu or None, path)."""
        s, tt = self.sc, self.tt
        nr = INF
        if self.f["SIS_UTIL"] and sd.shared is not None:
            scan = self.nr_idle_scan(sd.shared)
            self.detail["nr_idle_scan"] = scan
            nr = scan + 1
            if nr == 1:
                return None, None
        cpus = LiveMask(sd.span & s.cpus_ptr)
        if cpus.m == 0:
            return None, None
        idle_cpu = [None]
        if tt.cluster_active and tt.group_flags[tt.first_group_key(sd)] & SD_CLUSTER:
            g = tt.first_group_span(sd)
            for c in wrap(g, target + 1):
                if not has(cpus.m, c):
                    continue
                if has_idle_core:
                    i = self.select_idle_core(c, cpus, idle_cpu)
                    if i is not None:
                        return i, "idle_core"
                else:
                    nr -= 1
                    if nr <= 0:
                        return None, None
                    idle_cpu[0] = self.__select_idle_cpu(c)
                    if idle_cpu[0] is not None:
                        return idle_cpu[0], "idle_cpu"
            cpus.m &= ~g
        for c in for_each_cpu_wrap(cpus, target + 1):
            if has_idle_core:
                i = self.select_idle_core(c, cpus, idle_cpu)
                if i is not None:
                    return i, "idle_core"
            else:
                nr -= 1
                if nr <= 0:
                    return None, None
                idle_cpu[0] = self.__select_idle_cpu(c)
                if idle_cpu[0] is not None:
                    break
        if idle_cpu[0] is None:
            return None, None
        return idle_cpu[0], ("core_scan_cpu" if has_idle_core else "idle_cpu")

    def __select_idle_cpu(self, c):
        self.scanned += 1
        if self.choose_idle_cpu(c) and self.sched_cpu_cookie_match(c):
            return c
        return None

    def select_idle_core(self, core, cpus, idle_cpu):
        prefer_last = self.f["PREFER_LAST_IDLE_CPU"]
        idle = True
        smt = self.smt_mask(core)
        for c in bits(smt):
            self.scanned += 1
            if not self.available_idle_cpu(c):
                idle = False
                if idle_cpu[0] is None:
                    if self.choose_sched_idle_rq(c) and has(cpus.m, c):
                        idle_cpu[0] = c
                        break
                    continue
                break
            if has(cpus.m, c) and (prefer_last or idle_cpu[0] is None):
                idle_cpu[0] = c
        if idle:
            return core
        cpus.m &= ~smt
        return None

    def select_idle_capacity(self, sd, target):
        s, tt = self.sc, self.tt
        has_idle_core = tt.smt_active and self.has_idle_cores(tt.balance_shared[target])
        self.detail["has_idle_core"] = has_idle_core
        best_cap, best_fits, best = 0, 0, None
        nr = INF
        cpus = sd.span & s.cpus_ptr
        if self.f["SIS_UTIL"] and sd.shared is not None:
            scan = self.nr_idle_scan(sd.shared)
            self.detail["nr_idle_scan"] = scan
            nr = scan + 1
            if nr == 1:
                return None
        for c in wrap(cpus, target):
            preferred = not has_idle_core or self.is_core_idle(c)
            cap = s.capacity[c]
            if not has_idle_core:
                nr -= 1
                if nr <= 0:
                    return best
            self.scanned += 1
            if not self.choose_idle_cpu(c):
                continue
            fits = self.util_fits_cpu(s.task_util_est, s.uclamp_min, s.uclamp_max, c)
            if fits > 0 and preferred:
                return c
            elif fits < 0:
                cap = s.actual_capacity[c]
            elif fits > 0:
                fits = -2
            if preferred:
                fits += -3
            if fits < best_fits or (fits == best_fits and cap > best_cap):
                best_cap, best, best_fits = cap, c, fits
        return best

    # ---- 11.6 slow path -----------------------------------------------------
    def sched_balance_find_dst_cpu(self, sd, cpu, prev, flag):
        s, tt = self.sc, self.tt
        steps = []
        self.detail["slow_path_steps"] = steps
        if not sd.span & s.cpus_ptr:
            return prev, "slow_path_prev"
        new = cpu
        while sd is not None:
            if not sd.flags & flag:
                sd = sd.child
                continue
            g = self.sched_balance_find_dst_group(sd, cpu)
            if g is None:
                steps.append({"level": sd.level, "cpu": cpu, "group": None})
                sd = sd.child
                continue
            new = self.sched_balance_find_dst_group_cpu(g, cpu)
            steps.append({"level": sd.level, "cpu": cpu, "group": cpulist(g.span), "new": new})
            if new == cpu:
                sd = sd.child
                continue
            cpu = new
            w = sd.weight
            sd = None
            for t in tt.sd[cpu]:
                if w <= t.weight:
                    break
                if t.flags & flag:
                    sd = t
        return new, "slow_path"

    def update_sg_wakeup_stats(self, sd, g):
        s = self.sc
        exec_ = s.kind == "exec"
        asym = sd.flags & SD_ASYM_CPUCAPACITY
        load = util = runnable = sum_nr = idle_cpus = 0
        misfit = 1 if asym else 0
        for i in bits(g.span & s.cpus_ptr):
            wt = exec_ and i == s.this_cpu
            if wt:
                load += max(0, s.load[i] - s.t_load)
                runnable += max(0, s.runnable[i] - s.t_runnable)
                nr = s.nr_running[i] - 1
            else:
                load += s.load[i]
                runnable += s.runnable[i]
                nr = s.nr_running[i]
            util += self.cpu_util(i, wt)
            sum_nr += nr
            if nr == 0 and (s.curr_is_idle[i] or wt) and not s.ttwu_pending[i]:
                idle_cpus += 1
            if asym and misfit and self.task_fits_cpu(i):
                misfit = 0
        cap = g.capacity
        w = g.weight
        pct = sd.imbalance_pct
        if sum_nr > w and (cap * 100 < util * pct or cap * pct < runnable * 100):
            gtype = GROUP_OVERLOADED
        elif misfit:
            gtype = GROUP_MISFIT_TASK
        elif not (sum_nr < w or (cap * pct >= runnable * 100 and cap * 100 > util * pct)):
            gtype = GROUP_FULLY_BUSY
        else:
            gtype = GROUP_HAS_SPARE
        avg_load = 0
        if gtype in (GROUP_FULLY_BUSY, GROUP_OVERLOADED):
            avg_load = load * 1024 // cap
        return {"type": gtype, "avg_load": avg_load, "load": load, "util": util,
                "runnable": runnable, "sum_nr_running": sum_nr, "idle_cpus": idle_cpus}

    @staticmethod
    def update_pick_idlest(idlest, idlest_sgs, g, sgs):
        if sgs["type"] < idlest_sgs["type"]:
            return True
        if sgs["type"] > idlest_sgs["type"]:
            return False
        t = sgs["type"]
        if t in (GROUP_OVERLOADED, GROUP_FULLY_BUSY):
            return sgs["avg_load"] < idlest_sgs["avg_load"]
        if t == GROUP_MISFIT_TASK:
            return g.max_capacity > idlest.max_capacity
        # has_spare
        if sgs["idle_cpus"] > idlest_sgs["idle_cpus"]:
            return True
        return sgs["idle_cpus"] == idlest_sgs["idle_cpus"] and sgs["util"] < idlest_sgs["util"]

    def sched_balance_find_dst_group(self, sd, this):
        s, tt = self.sc, self.tt
        idlest = None
        idlest_sgs = {"type": GROUP_OVERLOADED, "avg_load": (1 << 32) - 1}
        local = local_sgs = None
        for g in tt.groups(sd):
            if not g.span & s.cpus_ptr:
                continue
            if not self.sched_group_cookie_match(g.span):
                continue
            sgs = self.update_sg_wakeup_stats(sd, g)
            if has(g.span, this):
                local, local_sgs = g, sgs
            elif self.update_pick_idlest(idlest, idlest_sgs, g, sgs):
                idlest, idlest_sgs = g, sgs
        if idlest is None:
            return None
        if local is None:
            return idlest
        if local_sgs["type"] < idlest_sgs["type"]:
            return None
        if local_sgs["type"] > idlest_sgs["type"]:
            return idlest
        t = local_sgs["type"]
        pct = sd.imbalance_pct
        if t in (GROUP_OVERLOADED, GROUP_FULLY_BUSY):
            imb = 1024 * (pct - 100) // 100
            if sd.flags & SD_NUMA and idlest_sgs["avg_load"] + imb >= local_sgs["avg_load"]:
                return None
            if idlest_sgs["avg_load"] >= local_sgs["avg_load"] + imb:
                return None
            if 100 * local_sgs["avg_load"] <= pct * idlest_sgs["avg_load"]:
                return None
            return idlest
        if t == GROUP_MISFIT_TASK:
            if local.max_capacity >= idlest.max_capacity:
                return None
            return idlest
        # has_spare
        if sd.flags & SD_NUMA:
            nid = s.numa_preferred_nid
            if s.topo[this]["node"] == nid:
                return None
            if s.topo[lowest(idlest.span)]["node"] == nid:
                return idlest
            imb_nr = min(weight(s.cpus_ptr & local.span), sd.imb_numa_nr)
            imb = abs(local_sgs["idle_cpus"] - idlest_sgs["idle_cpus"])
            if local_sgs["sum_nr_running"] + 1 <= imb_nr and imb <= 2:
                return None
        if local_sgs["idle_cpus"] >= idlest_sgs["idle_cpus"]:
            return None
        return idlest

    def sched_balance_find_dst_group_cpu(self, g, this):
        s = self.sc
        if g.weight == 1:
            return lowest(g.span)
        least = this
        min_load = U64
        min_lat = (1 << 32) - 1
        stamp = 0
        shallowest = None
        for i in bits(g.span & s.cpus_ptr):
            if not self.sched_core_cookie_match(i):
                continue
            if self.choose_sched_idle_rq(i):
                return i
            if self.available_idle_cpu(i):
                lat = s.exit_latency[i]
                if lat is not None and lat < min_lat:
                    min_lat = lat
                    stamp = s.idle_stamp[i]
                    shallowest = i
                elif (lat is None or lat == min_lat) and s.idle_stamp[i] > stamp:
                    stamp = s.idle_stamp[i]
                    shallowest = i
            elif shallowest is None and s.load[i] < min_load:
                min_load = s.load[i]
                least = i
        return shallowest if shallowest is not None else least

    # ---- 11.7 can_migrate_task ----------------------------------------------
    def can_migrate_task(self):
        s, tt = self.sc, self.tt
        sd = s.lb_sd
        cnt = s.cache_nice_tries_in if s.cache_nice_tries_in is not None else sd.cache_nice_tries
        dst_group = s.dst_group_in if s.dst_group_in is not None else tt.first_group_span(sd)
        env_cpus = s.env_cpus_in if s.env_cpus_in is not None else (sd.span & s.online_mask)
        flags = set(s.lb_flags)
        new_dst = None
        task_hot = None

        def out(allowed, reason):
            return {"allowed": allowed, "new_dst_cpu": new_dst,
                    "flags": [f for f in LBF if f in flags], "reason": reason,
                    "task_hot": task_hot,
                    "detail": {"sd_level": sd.level, "sd_span": cpulist(sd.span),
                               "cache_nice_tries": cnt, "dst_group": cpulist(dst_group),
                               "env_cpus": cpulist(env_cpus), "cpus_ptr": cpulist(s.cpus_ptr)}}

        if s.t_sched_delayed and s.migration_type != "load":
            return out(False, "delayed")
        if s.throttled:
            return out(False, "throttled")
        if (s.nr_balance_failed == 0 and self.f["PLACE_LAG"] and s.dst_cfs_nr_queued > 0
                and not s.t_eligible):
            return out(False, "ineligible")
        if s.t_per_cpu_kthread:
            return out(False, "per_cpu_kthread")
        if s.t_blocked:
            return out(False, "blocked")
        if not has(s.cpus_ptr, s.dst_cpu):
            flags.add("SOME_PINNED")
            if s.lb_idle == "newly_idle" or "DST_PINNED" in flags or "ACTIVE_LB" in flags:
                return out(False, "affinity")
            c = lowest(dst_group & env_cpus & s.cpus_ptr)
            if c is not None:
                flags.add("DST_PINNED")
                new_dst = c
            return out(False, "affinity")
        flags.discard("ALL_PINNED")
        if s.t_running:
            return out(False, "running")
        if "ACTIVE_LB" in flags:
            return out(True, "active_lb")
        task_hot = self.task_hot(sd)
        if not task_hot:
            return out(True, "cold")
        if s.nr_balance_failed > cnt:
            return out(True, "balance_failed")
        return out(False, "hot")

    def task_hot(self, sd):
        s = self.sc
        if s.policy == "idle":
            return False
        if sd.flags & SD_SHARE_CPUCAPACITY:
            return False
        if self.f["CACHE_HOT_BUDDY"] and s.nr_running[s.dst_cpu] > 0 and s.t_next_buddy:
            return True
        if s.migration_cost_ns == -1:
            return True
        if not self.sched_core_cookie_match(s.dst_cpu):
            return True
        if s.migration_cost_ns == 0:
            return False
        if s.t_hot is not None:
            return s.t_hot
        return s.now - s.t_exec_start < s.migration_cost_ns


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def decide(obj, dump_tree=None):
    """Evaluate one scenario object; returns the output dict (or {"error": ...})."""
    try:
        sc = Scenario(obj)
    except ScenarioError as e:
        return {"error": str(e)}
    if dump_tree is not None:
        tt = sc.topo_tree
        cpus = range(sc.n) if dump_tree == "all" else [int(dump_tree)]
        for c in cpus:
            if 0 <= c < sc.n and sc.online[c]:
                print(tt.dump(c), file=sys.stderr)
    d = Decision(sc)
    if sc.kind == "can_migrate":
        return d.can_migrate_task()
    return d.decide_placement()


def read_scenarios(text):
    """Yields (obj, parse_error) for one object, an array, or JSON Lines."""
    stripped = text.strip()
    if not stripped:
        return
    try:
        whole = json.loads(stripped)
    except json.JSONDecodeError:
        whole = None
        is_whole = False
    else:
        is_whole = True
    if is_whole:
        if isinstance(whole, list):
            for x in whole:
                yield x, None
        else:
            yield whole, None
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield json.loads(line), None
        except json.JSONDecodeError as e:
            yield None, f"line {lineno}: invalid JSON: {e.msg}"


def main(argv):
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", nargs="?", default="-", help="scenario file, or - for stdin")
    ap.add_argument("--tree", metavar="CPU|all", default=None,
                    help="print the domain tree of CPU (or all CPUs) to stderr")
    ap.add_argument("--check", action="store_true",
                    help="compare with each scenario's \"expected\" (the compared fields of "
                         "section 9) and print a summary instead of the answers")
    args = ap.parse_args(argv)
    if args.input == "-":
        text = sys.stdin.read()
    else:
        with open(args.input) as fh:
            text = fh.read()
    bad = False
    out = sys.stdout
    checked = matched = 0
    for k, (obj, err) in enumerate(read_scenarios(text)):
        if err is not None:
            res = {"error": f"json: {err}"}
        else:
            res = decide(obj, args.tree)
        if "error" in res:
            bad = True
        if not args.check:
            out.write(json.dumps(res) + "\n")
            continue
        exp = obj.get("expected") if isinstance(obj, dict) else None
        if exp is None:
            continue
        checked += 1
        if "error" in exp or "error" in res:
            keys = ["error"]
        elif "cpu" in exp:
            keys = ["cpu", "path", "scanned"]
        else:
            keys = ["allowed", "new_dst_cpu", "flags", "reason"]
        if all(res.get(x) == exp.get(x) for x in keys):
            matched += 1
        else:
            name = obj.get("name", f"#{k}")
            out.write(f"MISMATCH {name}: expected {({x: exp.get(x) for x in keys})} "
                      f"got {({x: res.get(x) for x in keys})}\n")
    if args.check:
        out.write(f"{matched}/{checked} match\n")
        return 0 if matched == checked else 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
