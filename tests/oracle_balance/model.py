#!/usr/bin/env python3
"""An independent model of one periodic load-balance pass of the Linux fair class.

For each node (one JSON object per line, see gen.py for the shape) it runs what the
kernel's SCHED_SOFTIRQ does for a CPU, `sched_balance_domains()`, once for every
destination CPU asked for (ascending), on demand: every domain of the CPU's chain,
bottom-up, no balance intervals, per-domain memory fresh (`nr_balance_failed` = 0,
every `sgc->imbalance` = 0). It prints one JSON line per node:

    {"name": ..., "proposals": [...], "migrations": [...]}

"migrations" are the kernel's task moves in the order it makes them, each
{"task", "src", "dst", "migration_type", "kind", "level"}; "proposals" are the same
collapsed the way the Balance RPC reports a pass (one entry per task, from its first
source to its last destination; see collapse()).

Written from the kernel's kernel/sched/fair.c and kernel/sched/topology.c (the 6.12
long-term tree, with the few later mainline changes listed in NOTES.md), not from the
Rust engine. Every function below names the kernel function it models. The sched-domain
tree (levels, spans, flags, degeneration, group spans and their ring order) comes from
the independent scenario-format oracle in ../oracle/oracle.py.

Usage:
    python3 model.py FILE|-            one JSON line of proposals per node
    python3 model.py --trace FILE|-    also a step-by-step trace on stderr

Python 3.11, standard library only.
"""

import json
import os
import sys
from collections import Counter

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "oracle"))
import oracle  # noqa: E402  (the independent domain-tree builder)
from oracle import (  # noqa: E402
    SD_ASYM_CPUCAPACITY,
    SD_NUMA,
    SD_PREFER_SIBLING,
    SD_SHARE_CPUCAPACITY,
    SD_SHARE_LLC,
    bits,
    cpulist,
    lowest,
    weight,
)

# --------------------------------------------------------------------------------------
# Constants and enums (fair.c / sched.h / idle.h)
# --------------------------------------------------------------------------------------

SCHED_CAPACITY_SCALE = 1024
SYSCTL_SCHED_NR_MIGRATE = 32
SCHED_NR_MIGRATE_BREAK = 32
NUMA_IMBALANCE_MIN = 2

# enum cpu_idle_type: __CPU_NOT_IDLE is 0, so "if (env->idle)" means idle or newly idle.
CPU_NOT_IDLE, CPU_IDLE, CPU_NEWLY_IDLE = 0, 1, 2

# enum group_type, in the kernel's order (a larger value is busier).
GROUP_HAS_SPARE, GROUP_FULLY_BUSY, GROUP_MISFIT_TASK, GROUP_SMT_BALANCE, \
    GROUP_ASYM_PACKING, GROUP_IMBALANCED, GROUP_OVERLOADED = range(7)
GROUP_NAMES = ["has_spare", "fully_busy", "misfit_task", "smt_balance", "asym_packing",
               "imbalanced", "overloaded"]

# enum migration_type
MIGRATE_LOAD, MIGRATE_UTIL, MIGRATE_TASK, MIGRATE_MISFIT = range(4)
MIGRATION_NAMES = ["load", "util", "task", "misfit"]

# enum fbq_type
FBQ_REGULAR, FBQ_REMOTE, FBQ_ALL = range(3)

# lb_env flags
LBF_ALL_PINNED = 0x01
LBF_NEED_BREAK = 0x02
LBF_DST_PINNED = 0x04
LBF_SOME_PINNED = 0x08
LBF_ACTIVE_LB = 0x10

U32 = (1 << 32) - 1
U64 = (1 << 64) - 1
UINT_MAX = U32


def s64(x):
    """A C unsigned long stored into a long (two's complement, 64 bits)."""
    x &= U64
    return x - (1 << 64) if x >> 63 else x


def u64(x):
    return x & U64


def fmt_flags(f):
    names = [(LBF_ALL_PINNED, "ALL_PINNED"), (LBF_NEED_BREAK, "NEED_BREAK"),
             (LBF_DST_PINNED, "DST_PINNED"), (LBF_SOME_PINNED, "SOME_PINNED"),
             (LBF_ACTIVE_LB, "ACTIVE_LB")]
    return "|".join(n for b, n in names if f & b) or "0"


def parse_cpulist(s, n):
    """A cpulist ("0-3,8") as a mask; empty = every CPU of the node."""
    s = (s or "").strip()
    if not s:
        return (1 << n) - 1
    m = 0
    for part in s.split(","):
        part = part.strip()
        if "-" in part:
            a, b = part.split("-")
            for c in range(int(a), int(b) + 1):
                m |= 1 << c
        else:
            m |= 1 << int(part)
    return m


# --------------------------------------------------------------------------------------
# The node: topology, runqueues, task lists
# --------------------------------------------------------------------------------------


class _TopoInput:
    """What oracle.Topology reads from a scenario: the node's hardware, all CPUs online."""

    def __init__(self, topo_json):
        cl = topo_json["cpus"]
        n = len(cl)
        self.n = n
        self.online_mask = (1 << n) - 1
        self.topo = [{"core": e["core"], "cluster": None, "llc": e["llc"],
                      "node": e.get("node", 0), "capacity": e.get("capacity", 1024) or 1024}
                     for e in cl]
        self.has_clusters = False
        nn = max(t["node"] for t in self.topo) + 1
        md = topo_json.get("numa_distance")
        self.numa_distance = md if md else [[10 if a == b else 20 for b in range(nn)]
                                            for a in range(nn)]
        self.node_reclaim_distance = 30
        self.capacity = [t["capacity"] for t in self.topo]


class Task:
    __slots__ = ("id", "group", "load", "util", "util_est", "runnable", "allowed", "running",
                 "exec_start", "per_cpu_kthread")

    def __init__(self, t, n, cpu):
        self.id = t["id"]
        self.group = t.get("group", 0)
        self.load = t.get("load_avg", 0)            # task_h_load()
        self.util = t.get("util_avg", 0)
        self.util_est = t.get("util_est", 0)
        self.runnable = t.get("runnable_avg", 0)
        self.allowed = parse_cpulist(t.get("cpus_allowed", ""), n)   # p->cpus_ptr
        self.running = bool(t.get("running", False))                 # p->on_cpu
        self.exec_start = t.get("exec_start", 0)
        self.per_cpu_kthread = bool(t.get("per_cpu_kthread", False))
        if t.get("migration_disabled") and not self.running:
            # Preempted inside migrate_disable(): migrate_disable_switch() narrowed
            # cpus_ptr to the CPU it runs on.
            self.allowed = 1 << cpu


class Rq:
    """One CPU's runqueue as the load balancer reads it."""
    __slots__ = ("cpu", "nr_running", "h_nr_queued", "load", "util", "util_est", "runnable",
                 "capacity", "cap_orig", "tasks", "curr_idle", "active_balance", "push_cpu")

    def __init__(self, cpu, st, cap_orig):
        self.cpu = cpu
        self.nr_running = st.get("nr_running", 0)
        q = st.get("cfs_h_nr_queued")
        self.h_nr_queued = self.nr_running if q is None else q
        self.load = st.get("load_avg", 0)            # cfs_rq->avg.load_avg
        self.util = st.get("util_avg", 0)            # cfs_rq->avg.util_avg
        self.util_est = st.get("util_est", 0)        # cfs_rq->avg.util_est
        self.runnable = st.get("runnable_avg", 0)    # cfs_rq->avg.runnable_avg
        self.cap_orig = cap_orig                     # arch_scale_cpu_capacity()
        self.capacity = st.get("capacity") or cap_orig   # capacity_of()
        cii = st.get("curr_is_idle")
        self.curr_idle = (self.nr_running == 0) if cii is None else cii
        self.tasks = []            # cfs_tasks: head (ran most recently) .. tail (coldest)
        self.active_balance = 0
        self.push_cpu = None

    def curr(self):
        """rq->curr among the fair tasks (None: the idle task, or not reported)."""
        for p in self.tasks:
            if p.running:
                return p
        return None


class LbGroup:
    """A sched_group as one CPU's domain sees it."""
    __slots__ = ("span", "weight", "flags", "balance_mask", "sgc", "cores")

    def __init__(self, span, flags, balance_mask, sgc, cores):
        self.span = span
        self.weight = weight(span)     # sg->group_weight
        self.flags = flags             # sg->flags: the child domain's flags
        self.balance_mask = balance_mask
        self.sgc = sgc                 # key of the shared sched_group_capacity
        self.cores = cores             # sg->cores


class SgLbStats:
    """struct sg_lb_stats"""
    __slots__ = ("avg_load", "group_load", "group_capacity", "group_util", "group_runnable",
                 "sum_nr_running", "sum_h_nr_running", "idle_cpus", "group_weight",
                 "group_type", "group_asym_packing", "group_smt_balance",
                 "group_misfit_task_load")

    def __init__(self):
        for k in self.__slots__:
            setattr(self, k, 0)
        self.group_type = GROUP_HAS_SPARE


class SdLbStats:
    """struct sd_lb_stats (init_sd_lb_stats)"""

    def __init__(self):
        self.busiest = None
        self.local = None
        self.total_load = 0
        self.total_capacity = 0
        self.avg_load = 0
        self.prefer_sibling = False
        self.local_stat = SgLbStats()
        self.busiest_stat = SgLbStats()
        self.busiest_stat.idle_cpus = UINT_MAX
        self.busiest_stat.group_type = GROUP_HAS_SPARE


class Env:
    """struct lb_env"""

    def __init__(self, sd, dst_cpu, dst_grpmask, idle, cpus):
        self.sd = sd
        self.dst_cpu = dst_cpu
        self.dst_grpmask = dst_grpmask
        self.new_dst_cpu = None
        self.idle = idle
        self.imbalance = 0
        self.cpus = cpus
        self.flags = 0
        self.loop = 0
        self.loop_break = SCHED_NR_MIGRATE_BREAK
        self.loop_max = 0
        self.fbq_type = FBQ_ALL
        self.migration_type = MIGRATE_LOAD
        self.src_cpu = None
        self.dst_core_idle = True
        self.tasks = []              # env->tasks: detached, in list order (head first)


class Node:
    def __init__(self, obj, trace=None):
        self.name = obj.get("name", "")
        self.trace = trace
        tin = _TopoInput(obj["topology"])
        self.n = n = tin.n
        self.topo = oracle.Topology(tin)
        self.active_mask = (1 << n) - 1             # cpu_active_mask: all online
        self.core_of = [t["core"] for t in tin.topo]
        self.smt = [0] * n                           # cpu_smt_mask()
        for c in range(n):
            for d in range(n):
                if self.core_of[d] == self.core_of[c]:
                    self.smt[c] |= 1 << d
        # sched_smt_active(): some core has more than one online thread
        self.smt_active = any(weight(m) > 1 for m in self.smt)
        self.rq = [Rq(c, {}, tin.capacity[c]) for c in range(n)]
        for st in obj.get("cpus", []):
            c = st["id"]
            self.rq[c] = Rq(c, st, tin.capacity[c])
        for lst in obj.get("tasks", []):
            tl = [Task(t, n, lst["cpu"]) for t in lst["tasks"]]
            # cfs_tasks order: most recently run at the head (the API's convention:
            # by exec_start, latest first, ties by id)
            tl.sort(key=lambda p: (-p.exec_start, p.id))
            self.rq[lst["cpu"]].tasks = tl
        self.dst_cpus = parse_cpulist(obj.get("dst_cpus", ""), n) & self.active_mask
        # per (CPU, domain): sd->nr_balance_failed, fresh
        self.nr_balance_failed = {}
        # sched_group_capacity::imbalance, shared between the CPUs of a group
        self.sgc_imbalance = {}
        self._groups = {}
        self.proposals = []
        # which branches the pass took (gen.py --stats)
        self.stats = Counter()

    # ----------------------------------------------------------------------------------
    # Topology helpers
    # ----------------------------------------------------------------------------------

    def chain(self, cpu):
        """for_each_domain(cpu, sd): the CPU's attached domains, bottom-up."""
        return self.topo.sd[cpu] or []

    def groups(self, sd):
        """sd->groups as a ring starting at the local group (build_sched_groups /
        build_overlap_sched_groups), with the flags, balance masks, shared capacity and
        core counts the kernel gives them."""
        key = id(sd)
        g = self._groups.get(key)
        if g is not None:
            return g
        T = self.topo
        out = []
        spans = [x.span for x in T.groups(sd)]
        for idx, span in enumerate(spans):
            if sd.numa_j is None:
                # Shared group objects (get_group): flags = the child's flags at build,
                # then rewritten by cpu_attach_domain() of the CPUs whose first group it
                # is; oracle.Topology keeps exactly that, by (level, span).
                flags = T.group_flags[(sd.level, span)]
                bmask = span
                sgc = (sd.li, lowest(span))
            else:
                # Overlapping groups are allocated per CPU (build_overlap_sched_groups):
                # the local group's flags are rewritten by this CPU's cpu_attach_domain(),
                # every other group keeps the flags of the child it was built from.
                sib_li = sd.li
                if idx == 0:
                    flags = T.group_flags[(sd.level, span)]
                else:
                    flags, sib_li = self._overlap_build_flags(sd, span)
                # init_overlap_sched_group(sibling, sg) runs on the (possibly
                # descended) sibling: the balance mask and the shared capacity
                # are that sibling's level's.
                bmask = self._build_balance_mask(sib_li, span)
                sgc = (sib_li, lowest(bmask))
            out.append(LbGroup(span, flags, bmask, sgc, self._cores(span)))
        self._groups[key] = out
        return out

    def _overlap_build_flags(self, sd, gspan):
        """build_group_from_child_sched_domain(): sg->flags = sibling->child->flags, the
        sibling being the first CPU of the group's own domain at this level (descended
        with find_descended_sibling() when its child sticks out of the span). Returns the
        flags and the sibling's level index."""
        T = self.topo
        for i in oracle.wrap(sd.span, sd.cpu):
            chain_i = T.pre[i]
            if sd.li >= len(chain_i):
                continue
            sib = chain_i[sd.li]
            if sib.child0 is not None and (sib.child0.span & ~sd.span):
                while sib.child0 is not None and (sib.child0.span & ~sd.span):
                    sib = sib.child0
                while sib.child0 is not None and sib.child0.span == sib.span:
                    sib = sib.child0
            if sib.child0 is not None:
                if sib.child0.span == gspan:
                    return sib.child0.flags0, sib.li
            elif sib.span == gspan:
                return 0, sib.li
        return 0, sd.li

    def _build_balance_mask(self, li, gspan):
        """build_balance_mask(): the group's CPUs whose own domain at level `li` (the
        sibling's the group was built from) has the group as its child span."""
        m = 0
        for i in bits(gspan):
            chain_i = self.topo.pre[i]
            if li >= len(chain_i):
                continue
            sib = chain_i[li]
            if sib.child0 is None:
                continue
            if sib.child0.span != gspan:
                continue
            m |= 1 << i
        return m or gspan

    def _cores(self, span):
        """init_sched_groups_capacity(): count a core for each CPU of the group's span and
        drop that CPU's SMT siblings from what is left to visit."""
        mask = span
        cores = 0
        c = 0
        while True:
            rest = mask >> c
            if not rest:
                break
            c += lowest(rest)
            cores += 1
            mask &= ~self.smt[c]
            c += 1
        return cores

    def sgc_capacity(self, g):
        """sgc->capacity after update_group_capacity(): the sum of capacity_of()."""
        return sum(self.rq[i].capacity for i in bits(g.span))

    def failed(self, sd):
        return self.nr_balance_failed.get(id(sd), 0)

    def set_failed(self, sd, v):
        self.nr_balance_failed[id(sd)] = v

    # ----------------------------------------------------------------------------------
    # Per-CPU predicates and PELT readers (core.c / fair.c)
    # ----------------------------------------------------------------------------------

    def idle_cpu(self, c):
        """idle_cpu(): the idle task is current and nothing is queued (no wakeups pend)."""
        r = self.rq[c]
        return r.curr_idle and r.nr_running == 0

    def is_core_idle(self, c):
        """is_core_idle(): every SMT sibling but c is idle."""
        for s in bits(self.smt[c] & ~(1 << c)):
            if not self.idle_cpu(s):
                return False
        return True

    def cpu_load(self, c):
        return self.rq[c].load

    def cpu_runnable(self, c):
        return self.rq[c].runnable

    def cpu_util_cfs(self, c):
        """cpu_util(cpu, NULL, -1, 0) with UTIL_EST: max(util_avg, util_est), capped."""
        r = self.rq[c]
        return min(max(r.util, r.util_est), r.cap_orig)

    def cpu_util_cfs_boost(self, c):
        """cpu_util(cpu, NULL, -1, 1): raised to the runnable average too."""
        r = self.rq[c]
        return min(max(r.util, r.runnable, r.util_est), r.cap_orig)

    def h_nr_runnable(self, c):
        """rq->cfs.h_nr_runnable (mainline) = h_nr_queued without delayed entities."""
        return self.rq[c].h_nr_queued

    @staticmethod
    def check_cpu_capacity(r, sd):
        """check_cpu_capacity(): capacity noticeably reduced by other classes or IRQ."""
        return r.capacity * sd.imbalance_pct < r.cap_orig * 100

    # ----------------------------------------------------------------------------------
    # The pass
    # ----------------------------------------------------------------------------------

    def log(self, msg):
        if self.trace is not None:
            self.trace.write(f"[{self.name}] {msg}\n")

    def run(self):
        """One on-demand pass: sched_balance_domains() for each destination CPU."""
        for c in bits(self.dst_cpus):
            self.sched_balance_domains(c)
        return self.proposals

    def sched_balance_domains(self, cpu):
        """sched_balance_domains(rq, idle) with every domain due."""
        idle = CPU_IDLE if self.idle_cpu(cpu) else CPU_NOT_IDLE
        cont = [True]
        for sd in self.chain(cpu):
            if not cont[0]:
                break
            if self.sched_balance_rq(cpu, sd, idle, cont):
                # LBF_DST_PINNED may have moved the tasks elsewhere: re-read.
                idle = CPU_IDLE if self.idle_cpu(cpu) else CPU_NOT_IDLE

    def sched_balance_rq(self, this_cpu, sd, idle, cont):
        """sched_balance_rq(): balance this_cpu's domain sd. Returns the tasks moved."""
        sd_parent = sd.parent
        local = self.groups(sd)[0]
        env = Env(sd, this_cpu, local.balance_mask, idle, sd.span & self.active_mask)
        active_balance = False
        ld_moved = 0
        busiest = None
        self.log(f"cpu{this_cpu} {sd.level} span={cpulist(sd.span)} idle={idle}")

        def parent_sgc():
            return self.groups(sd_parent)[0].sgc

        outcome = None
        while True:  # redo:
            if not self.should_we_balance(env):
                cont[0] = False
                self.log("  should_we_balance: no")
                outcome = "balanced"
                break
            group = self.sched_balance_find_src_group(env)
            if group is None:
                outcome = "balanced"
                break
            busiest = self.sched_balance_find_src_rq(env, group)
            if busiest is None:
                self.log("  no busiest rq")
                outcome = "balanced"
                break
            env.src_cpu = busiest
            src = self.rq[busiest]
            self.log(f"  busiest group {cpulist(group.span)} rq {busiest} "
                     f"{MIGRATION_NAMES[env.migration_type]} imbalance {env.imbalance}")
            ld_moved = 0
            env.flags |= LBF_ALL_PINNED
            if src.nr_running > 1:
                env.loop_max = min(SYSCTL_SCHED_NR_MIGRATE, src.nr_running)
                while True:  # more_balance:
                    cur = self.detach_tasks(env)
                    if cur:
                        self.attach_tasks(env)
                        ld_moved += cur
                    if env.flags & LBF_NEED_BREAK:
                        env.flags &= ~LBF_NEED_BREAK
                        continue
                    if (env.flags & LBF_DST_PINNED) and env.imbalance > 0:
                        env.cpus &= ~(1 << env.dst_cpu)
                        self.log(f"  DST_PINNED: dst {env.dst_cpu} -> {env.new_dst_cpu}")
                        self.stats["dst_pinned retarget"] += 1
                        env.dst_cpu = env.new_dst_cpu
                        env.flags &= ~LBF_DST_PINNED
                        env.loop = 0
                        env.loop_break = SCHED_NR_MIGRATE_BREAK
                        continue
                    break
                if sd_parent is not None and (env.flags & LBF_SOME_PINNED) and env.imbalance > 0:
                    self.sgc_imbalance[parent_sgc()] = 1
                    self.stats["sgc imbalance set"] += 1
                    self.log(f"  parent group imbalance set {parent_sgc()}")
                if env.flags & LBF_ALL_PINNED:
                    env.cpus &= ~(1 << busiest)
                    if env.cpus & ~env.dst_grpmask:
                        env.loop = 0
                        env.loop_break = SCHED_NR_MIGRATE_BREAK
                        self.log("  ALL_PINNED: redo")
                        self.stats["all_pinned redo"] += 1
                        continue
                    outcome = "all_pinned"
                    self.stats["all_pinned stop"] += 1
                    break
            outcome = "moved_or_failed"
            break

        if outcome == "moved_or_failed":
            if not ld_moved:
                if idle != CPU_NEWLY_IDLE and env.migration_type != MIGRATE_MISFIT:
                    self.set_failed(sd, self.failed(sd) + 1)
                if self.need_active_balance(env):
                    self.stats["need_active_balance"] += 1
                    src = self.rq[busiest]
                    curr = src.curr()
                    # The stopper is not kicked when busiest's current task cannot run
                    # here (the idle task, when none is reported running, cannot).
                    if curr is None or not (curr.allowed >> this_cpu) & 1:
                        return 0          # out_one_pinned
                    env.flags &= ~LBF_ALL_PINNED
                    if not src.active_balance:
                        src.active_balance = 1
                        src.push_cpu = this_cpu
                        active_balance = True
                    if active_balance:
                        self.active_load_balance_cpu_stop(busiest)
            else:
                self.set_failed(sd, 0)
            return ld_moved
        if outcome == "balanced":
            if sd_parent is not None and not (env.flags & LBF_ALL_PINNED):
                if self.sgc_imbalance.get(parent_sgc()):
                    self.stats["sgc imbalance cleared"] += 1
                    self.log(f"  parent group imbalance cleared {parent_sgc()}")
                self.sgc_imbalance[parent_sgc()] = 0
        # out_all_pinned:
        self.set_failed(sd, 0)
        return 0

    def should_we_balance(self, env):
        """should_we_balance(): only one CPU of the local group balances the domain."""
        if not (env.cpus >> env.dst_cpu) & 1:
            return False
        if env.idle == CPU_NEWLY_IDLE:
            r = self.rq[env.dst_cpu]
            return r.nr_running == 0
        sg = self.groups(env.sd)[0]
        swb = sg.balance_mask
        idle_smt = -1
        c = 0
        while True:  # for_each_cpu_and(cpu, swb_cpus, env->cpus), swb read live
            rest = (swb & env.cpus) >> c
            if not rest:
                break
            c += lowest(rest)
            cpu = c
            c += 1
            if not self.idle_cpu(cpu):
                continue
            # mainline guards the idle-core test with sched_smt_active()
            if self.smt_active and not (env.sd.flags & SD_SHARE_CPUCAPACITY) \
                    and not self.is_core_idle(cpu):
                if idle_smt == -1:
                    idle_smt = cpu
                swb &= ~self.smt[cpu]
                continue
            return cpu == env.dst_cpu
        if idle_smt != -1:
            self.stats["should_we_balance idle_smt"] += 1
            return idle_smt == env.dst_cpu
        return lowest(sg.balance_mask) == env.dst_cpu      # group_balance_cpu(sg)

    # ----------------------------------------------------------------------------------
    # sched_balance_find_src_group() and its helpers
    # ----------------------------------------------------------------------------------

    def update_sg_lb_stats(self, env, sds, g, local_group):
        """update_sg_lb_stats() over the group's CPUs still in env->cpus."""
        sgs = SgLbStats()
        sd = env.sd
        for i in bits(g.span & env.cpus):
            r = self.rq[i]
            load = self.cpu_load(i)
            sgs.group_load += load
            sgs.group_util += self.cpu_util_cfs(i)
            sgs.group_runnable += self.cpu_runnable(i)
            sgs.sum_h_nr_running += self.h_nr_runnable(i)
            nr = r.nr_running
            sgs.sum_nr_running += nr
            if nr == 0 and self.idle_cpu(i):
                sgs.idle_cpus += 1
                continue
            if local_group:
                continue
            if sd.flags & SD_ASYM_CPUCAPACITY:
                pass  # misfit_task_load: symmetric capacity only, never set
            elif env.idle and r.h_nr_queued == 1 and self.check_cpu_capacity(r, sd):
                # sched_reduced_capacity(): a lone task on a CPU with reduced capacity
                if sgs.group_misfit_task_load < load:
                    sgs.group_misfit_task_load = load
        sgs.group_capacity = self.sgc_capacity(g)
        sgs.group_weight = g.weight
        # group_asym_packing: no SD_ASYM_PACKING domains are built
        if not local_group and self.smt_balance(env, sgs, g):
            sgs.group_smt_balance = 1
        sgs.group_type = self.group_classify(sd.imbalance_pct, g, sgs)
        if sgs.group_type == GROUP_OVERLOADED:
            sgs.avg_load = sgs.group_load * SCHED_CAPACITY_SCALE // sgs.group_capacity
        return sgs

    @staticmethod
    def smt_balance(env, sgs, g):
        """smt_balance(): an idle CPU pulls from an SMT group running more than one task."""
        if not env.idle:
            return False
        return bool(g.flags & SD_SHARE_CPUCAPACITY) and sgs.sum_h_nr_running > 1

    @staticmethod
    def group_has_capacity(pct, sgs):
        """group_has_capacity()"""
        if sgs.sum_nr_running < sgs.group_weight:
            return True
        if sgs.group_capacity * pct < sgs.group_runnable * 100:
            return False
        if sgs.group_capacity * 100 > sgs.group_util * pct:
            return True
        return False

    @staticmethod
    def group_is_overloaded(pct, sgs):
        """group_is_overloaded()"""
        if sgs.sum_nr_running <= sgs.group_weight:
            return False
        if sgs.group_capacity * 100 < sgs.group_util * pct:
            return True
        if sgs.group_capacity * pct < sgs.group_runnable * 100:
            return True
        return False

    def group_classify(self, pct, g, sgs):
        """group_classify()"""
        if self.group_is_overloaded(pct, sgs):
            return GROUP_OVERLOADED
        if self.sgc_imbalance.get(g.sgc):          # sg_imbalanced()
            self.stats["group imbalanced"] += 1
            return GROUP_IMBALANCED
        if sgs.group_asym_packing:
            return GROUP_ASYM_PACKING
        if sgs.group_smt_balance:
            return GROUP_SMT_BALANCE
        if sgs.group_misfit_task_load:
            return GROUP_MISFIT_TASK
        if not self.group_has_capacity(pct, sgs):
            return GROUP_FULLY_BUSY
        return GROUP_HAS_SPARE

    @staticmethod
    def smt_vs_nonsmt_groups(g1, g2):
        """smt_vs_nonsmt_groups(): one group is an SMT core, the other is not."""
        if g1 is None or g2 is None:
            return False
        return bool(g1.flags & SD_SHARE_CPUCAPACITY) != bool(g2.flags & SD_SHARE_CPUCAPACITY)

    def update_sd_pick_busiest(self, env, sds, sg, sgs):
        """update_sd_pick_busiest(): is sg busier than the busiest group so far?"""
        busiest = sds.busiest_stat
        if not sgs.sum_h_nr_running:
            return False
        # The two SD_ASYM_CPUCAPACITY tests cannot fire: symmetric capacity.
        if sgs.group_type > busiest.group_type:
            return True
        if sgs.group_type < busiest.group_type:
            return False
        t = sgs.group_type
        if t == GROUP_OVERLOADED:
            return sgs.avg_load > busiest.avg_load
        if t == GROUP_IMBALANCED:
            return False
        if t == GROUP_ASYM_PACKING:
            return False   # not reachable: no asym packing
        if t == GROUP_MISFIT_TASK:
            return sgs.group_misfit_task_load > busiest.group_misfit_task_load
        goto_has_spare = False
        if t == GROUP_SMT_BALANCE:
            if sgs.idle_cpus != 0 or busiest.idle_cpus != 0:
                goto_has_spare = True
            else:
                t = GROUP_FULLY_BUSY      # fallthrough
        if t == GROUP_FULLY_BUSY and not goto_has_spare:
            if sgs.avg_load < busiest.avg_load:
                return False
            if sgs.avg_load == busiest.avg_load:
                if sds.busiest.flags & SD_SHARE_CPUCAPACITY:
                    return False
            return True
        if t == GROUP_HAS_SPARE and not goto_has_spare:
            if self.smt_vs_nonsmt_groups(sds.busiest, sg):
                if (sg.flags & SD_SHARE_CPUCAPACITY) and sgs.sum_h_nr_running <= 1:
                    return False
                return True
        # has_spare:
        if sgs.idle_cpus > busiest.idle_cpus:
            return False
        if sgs.idle_cpus == busiest.idle_cpus and sgs.sum_nr_running <= busiest.sum_nr_running:
            return False
        return True

    def update_sd_lb_stats(self, env, sds):
        """update_sd_lb_stats(): statistics of every group, the busiest remote one."""
        env.dst_core_idle = (not self.smt_active) or self.is_core_idle(env.dst_cpu)
        for g in self.groups(env.sd):
            local_group = bool((g.span >> env.dst_cpu) & 1)
            if local_group:
                sds.local = g
                # update_group_capacity(): the sum of capacity_of(), read in sgc_capacity
            sgs = self.update_sg_lb_stats(env, sds, g, local_group)
            if local_group:
                sds.local_stat = sgs
            if not local_group and self.update_sd_pick_busiest(env, sds, g, sgs):
                sds.busiest = g
                sds.busiest_stat = sgs
            sds.total_load += sgs.group_load
            sds.total_capacity += sgs.group_capacity
        if sds.busiest is not None:
            sds.prefer_sibling = bool(sds.busiest.flags & SD_PREFER_SIBLING)
        if env.sd.flags & SD_NUMA:
            # fbq_classify_group(): no NUMA-balancing statistics are reported, so any
            # group with tasks is "regular", an empty one "all"
            env.fbq_type = FBQ_REGULAR if sds.busiest_stat.sum_h_nr_running > 0 else FBQ_ALL

    def sibling_imbalance(self, env, sds, busiest, local):
        """sibling_imbalance(): tasks to move so that nr_running per core evens out."""
        if not env.idle or not busiest.sum_nr_running:
            return 0
        ncores_busiest = sds.busiest.cores
        ncores_local = sds.local.cores
        if ncores_busiest != ncores_local:
            self.stats["sibling_imbalance unequal cores"] += 1
        if ncores_busiest == ncores_local:
            imb = busiest.sum_nr_running
            imb -= min(imb, local.sum_nr_running)
            return imb
        imb = (ncores_local * busiest.sum_nr_running) & U32
        imb -= min(imb, (ncores_busiest * local.sum_nr_running) & U32)
        imb = 2 * imb + ncores_local + ncores_busiest
        imb //= ncores_local + ncores_busiest
        if imb <= 1 and local.sum_nr_running == 0 and busiest.sum_nr_running > 1:
            imb = 2
        return imb

    @staticmethod
    def adjust_numa_imbalance(imbalance, dst_running, imb_numa_nr):
        """adjust_numa_imbalance()"""
        if dst_running > imb_numa_nr:
            return imbalance
        if imbalance <= NUMA_IMBALANCE_MIN:
            return 0
        return imbalance

    def calculate_imbalance(self, env, sds):
        """calculate_imbalance(): how much, and in which units, to move."""
        local = sds.local_stat
        busiest = sds.busiest_stat
        sd = env.sd
        if busiest.group_type == GROUP_MISFIT_TASK:
            if sd.flags & SD_ASYM_CPUCAPACITY:
                env.migration_type = MIGRATE_MISFIT
                env.imbalance = 1
            else:
                env.migration_type = MIGRATE_LOAD
                env.imbalance = busiest.group_misfit_task_load
            return
        if busiest.group_type == GROUP_ASYM_PACKING:
            env.migration_type = MIGRATE_TASK
            env.imbalance = busiest.sum_h_nr_running
            return
        if busiest.group_type == GROUP_SMT_BALANCE:
            env.migration_type = MIGRATE_TASK
            env.imbalance = 1
            return
        if busiest.group_type == GROUP_IMBALANCED:
            env.migration_type = MIGRATE_TASK
            env.imbalance = 1
            return
        if local.group_type == GROUP_HAS_SPARE:
            if busiest.group_type > GROUP_FULLY_BUSY and not (sd.flags & SD_SHARE_LLC):
                env.migration_type = MIGRATE_UTIL
                env.imbalance = max(local.group_capacity, local.group_util) - local.group_util
                if env.idle and env.imbalance == 0:
                    env.migration_type = MIGRATE_TASK
                    env.imbalance = 1
                return
            if busiest.group_weight == 1 or sds.prefer_sibling:
                env.migration_type = MIGRATE_TASK
                env.imbalance = self.sibling_imbalance(env, sds, busiest, local)
            else:
                env.migration_type = MIGRATE_TASK
                # unsigned int subtraction, then max_t(long, 0, ...)
                env.imbalance = max(0, (local.idle_cpus - busiest.idle_cpus) & U32)
            if sd.flags & SD_NUMA:
                env.imbalance = self.adjust_numa_imbalance(
                    env.imbalance, local.sum_nr_running + 1, sd.imb_numa_nr)
            env.imbalance >>= 1
            return
        if local.group_type < GROUP_OVERLOADED:
            local.avg_load = local.group_load * SCHED_CAPACITY_SCALE // local.group_capacity
            if local.avg_load >= busiest.avg_load:
                env.imbalance = 0
                return
            sds.avg_load = sds.total_load * SCHED_CAPACITY_SCALE // sds.total_capacity
            if local.avg_load >= sds.avg_load:
                env.imbalance = 0
                return
        env.migration_type = MIGRATE_LOAD
        a = u64(u64(busiest.avg_load - sds.avg_load) * busiest.group_capacity)
        b = u64(u64(sds.avg_load - local.avg_load) * local.group_capacity)
        env.imbalance = s64(min(a, b) // SCHED_CAPACITY_SCALE)

    def sched_balance_find_src_group(self, env):
        """sched_balance_find_src_group(): the busiest group, if the domain is unbalanced;
        sets env->migration_type and env->imbalance."""
        sds = SdLbStats()
        self.update_sd_lb_stats(env, sds)
        local = sds.local_stat
        busiest = sds.busiest_stat

        def trace(what):
            self.log(f"  find_src_group: {what}; local {GROUP_NAMES[local.group_type]}"
                     f" busiest {GROUP_NAMES[busiest.group_type] if sds.busiest else '-'}"
                     f" {cpulist(sds.busiest.span) if sds.busiest else ''}")

        if sds.busiest is None:
            trace("no busiest")
            env.imbalance = 0
            return None
        force = False
        if busiest.group_type == GROUP_MISFIT_TASK:
            force = True
        # EAS is off: the root domain has no perf domain, no "balanced" shortcut
        elif busiest.group_type == GROUP_ASYM_PACKING:
            force = True
        elif busiest.group_type == GROUP_IMBALANCED:
            force = True
        if not force:
            if local.group_type > busiest.group_type:
                trace("balanced (local busier)")
                env.imbalance = 0
                return None
            if local.group_type == GROUP_OVERLOADED:
                if local.avg_load >= busiest.avg_load:
                    trace("balanced (avg_load)")
                    env.imbalance = 0
                    return None
                sds.avg_load = sds.total_load * SCHED_CAPACITY_SCALE // sds.total_capacity
                if local.avg_load >= sds.avg_load:
                    trace("balanced (domain avg_load)")
                    env.imbalance = 0
                    return None
                if 100 * busiest.avg_load <= env.sd.imbalance_pct * local.avg_load:
                    trace("balanced (imbalance_pct)")
                    env.imbalance = 0
                    return None
            if sds.prefer_sibling and local.group_type == GROUP_HAS_SPARE and \
                    self.sibling_imbalance(env, sds, busiest, local) > 1:
                force = True
        if not force and busiest.group_type != GROUP_OVERLOADED:
            if not env.idle:
                trace("balanced (busy dst, busiest not overloaded)")
                env.imbalance = 0
                return None
            if busiest.group_type == GROUP_SMT_BALANCE and \
                    self.smt_vs_nonsmt_groups(sds.local, sds.busiest):
                force = True
            elif busiest.group_weight > 1 and local.idle_cpus <= busiest.idle_cpus + 1:
                trace("balanced (idle cpus)")
                env.imbalance = 0
                return None
            elif busiest.sum_h_nr_running == 1:
                trace("balanced (one task)")
                env.imbalance = 0
                return None
        # force_balance:
        self.calculate_imbalance(env, sds)
        self.stats[f"force {GROUP_NAMES[busiest.group_type]}->{GROUP_NAMES[local.group_type]}"
                   f" {MIGRATION_NAMES[env.migration_type]}"
                   f"{' numa' if env.sd.flags & SD_NUMA else ''}"] += 1
        trace(f"force {MIGRATION_NAMES[env.migration_type]} {env.imbalance}")
        return sds.busiest if env.imbalance else None

    def sched_balance_find_src_rq(self, env, g):
        """sched_balance_find_src_rq(): the busiest runqueue of the group, in the units of
        the migration type; the first maximum wins."""
        busiest = None
        busiest_util = 0
        busiest_load = 0
        busiest_capacity = 1
        busiest_nr = 0
        for i in bits(g.span & env.cpus):
            r = self.rq[i]
            # fbq_classify_rq(): "regular" with tasks, "all" when empty
            rt = FBQ_REGULAR if r.nr_running > 0 else FBQ_ALL
            if rt > env.fbq_type:
                continue
            nr = self.h_nr_runnable(i)
            if not nr:
                continue
            capacity = r.capacity
            # SD_ASYM_CPUCAPACITY and asym-packing skips: not reachable here
            mt = env.migration_type
            if mt == MIGRATE_LOAD:
                load = self.cpu_load(i)
                if nr == 1 and load > env.imbalance and not self.check_cpu_capacity(r, env.sd):
                    continue
                if load * busiest_capacity > busiest_load * capacity:
                    busiest_load = load
                    busiest_capacity = capacity
                    busiest = i
            elif mt == MIGRATE_UTIL:
                util = self.cpu_util_cfs_boost(i)
                if nr <= 1:
                    continue
                if busiest_util < util:
                    busiest_util = util
                    busiest = i
            elif mt == MIGRATE_TASK:
                if busiest_nr < nr:
                    busiest_nr = nr
                    busiest = i
            elif mt == MIGRATE_MISFIT:
                pass  # rq->misfit_task_load is 0 with symmetric capacity
        return busiest

    # ----------------------------------------------------------------------------------
    # Migration: can_migrate_task(), detach_tasks(), attach_tasks(), active balancing
    # ----------------------------------------------------------------------------------

    def can_migrate_task(self, p, env):
        """can_migrate_task(): may p leave env->src for env->dst?"""
        # Not reported, so never refused for: sched_delayed, a throttled hierarchy,
        # EEVDF ineligibility (PLACE_LAG soft rule), proxy-blocked.
        if p.per_cpu_kthread:                 # kthread_is_per_cpu()
            self.stats["refused per-cpu kthread"] += 1
            return False
        if not (p.allowed >> env.dst_cpu) & 1:
            env.flags |= LBF_SOME_PINNED
            if env.idle == CPU_NEWLY_IDLE or env.flags & (LBF_DST_PINNED | LBF_ACTIVE_LB):
                return False
            cand = env.dst_grpmask & env.cpus & p.allowed
            if cand:
                env.flags |= LBF_DST_PINNED
                env.new_dst_cpu = lowest(cand)
            return False
        env.flags &= ~LBF_ALL_PINNED
        if p.running:                         # task_on_cpu()
            return False
        if env.flags & LBF_ACTIVE_LB:
            return True
        # migrate_degrades_locality(): no NUMA faults, neutral; migrate_degrades_llc(): no
        # cache-aware preference; task_hot(): the source's clock is not known, so cold.
        return True

    def detach_tasks(self, env):
        """detach_tasks(): take tasks from the tail of busiest's cfs_tasks until the
        imbalance is covered."""
        src = self.rq[env.src_cpu]
        tasks = src.tasks
        detached = 0
        if src.nr_running <= 1:
            env.flags &= ~LBF_ALL_PINNED
            return 0
        if env.imbalance <= 0:
            return 0
        while tasks:
            if env.idle and src.nr_running <= 1:
                break
            env.loop += 1
            if env.loop > env.loop_max:
                self.stats["detach loop_max"] += 1
                break
            if env.loop > env.loop_break:
                env.loop_break += SCHED_NR_MIGRATE_BREAK
                env.flags |= LBF_NEED_BREAK
                break
            p = tasks[-1]
            ok = self.can_migrate_task(p, env)
            if ok:
                mt = env.migration_type
                nbf = min(self.failed(env.sd), 63)
                if mt == MIGRATE_LOAD:
                    load = max(p.load, 1)
                    # LB_MIN is off
                    if (load >> nbf) > env.imbalance:
                        ok = False
                    else:
                        env.imbalance -= load
                elif mt == MIGRATE_UTIL:
                    util = max(p.util, p.util_est)        # task_util_est()
                    if (util >> nbf) > env.imbalance:
                        ok = False
                    else:
                        env.imbalance -= util
                elif mt == MIGRATE_TASK:
                    env.imbalance -= 1
                elif mt == MIGRATE_MISFIT:
                    ok = False    # task_fits_cpu(): every task fits a full-capacity CPU
            if not ok:
                tasks.insert(0, tasks.pop())          # list_move() to the head
                continue
            self.detach_task(p, env, "detach")
            detached += 1
            if env.imbalance <= 0:
                break
        self.log(f"  detach_tasks src {env.src_cpu} dst {env.dst_cpu}: {detached} "
                 f"(flags {fmt_flags(env.flags)}, imbalance left {env.imbalance})")
        return detached

    def detach_task(self, p, env, kind):
        """detach_task() + dequeue: p leaves src (its PELT contribution with it)."""
        src = self.rq[env.src_cpu]
        src.tasks.remove(p)
        src.nr_running -= 1
        src.h_nr_queued -= 1
        src.load = max(src.load - p.load, 0)
        src.runnable = max(src.runnable - p.runnable, 0)
        src.util = max(src.util - p.util, 0)
        src.util_est = max(src.util_est - p.util_est, 0)
        if src.nr_running == 0:
            src.curr_idle = True
        env.tasks.insert(0, p)                        # list_add(&p->se.group_node, &env->tasks)
        self.proposals.append({
            "task": p.id, "src": env.src_cpu, "dst": env.dst_cpu,
            "migration_type": MIGRATION_NAMES[env.migration_type], "kind": kind,
            "level": env.sd.level,
        })

    def attach_tasks(self, env):
        """attach_tasks(): each detached task is enqueued on dst at the head of cfs_tasks."""
        dst = self.rq[env.dst_cpu]
        while env.tasks:
            p = env.tasks.pop(0)
            p.running = False
            dst.tasks.insert(0, p)
            dst.nr_running += 1
            dst.h_nr_queued += 1
            dst.load += p.load
            dst.runnable += p.runnable
            dst.util += p.util
            dst.util_est += p.util_est

    def need_active_balance(self, env):
        """need_active_balance()"""
        sd = env.sd
        # asym_active_balance(): no SD_ASYM_PACKING
        # imbalanced_active_balance()
        if env.migration_type == MIGRATE_TASK and self.failed(sd) > sd.cache_nice_tries + 2:
            return True
        src = self.rq[env.src_cpu]
        if env.idle and src.h_nr_queued == 1:
            if self.check_cpu_capacity(src, sd) and \
                    src.capacity * sd.imbalance_pct < self.rq[env.dst_cpu].capacity * 100:
                return True
        if env.migration_type == MIGRATE_MISFIT:
            return True
        return False

    def active_load_balance_cpu_stop(self, busiest_cpu):
        """active_load_balance_cpu_stop(): busiest's stopper pushes one task to push_cpu."""
        src = self.rq[busiest_cpu]
        target = src.push_cpu
        try:
            if src.nr_running <= 1:
                return
            sd = None
            for d in self.chain(target):
                if (d.span >> busiest_cpu) & 1:
                    sd = d
                    break
            if sd is None:
                return
            env = Env(sd, target, 0, CPU_IDLE, 0)
            env.src_cpu = busiest_cpu
            env.flags = LBF_ACTIVE_LB
            # detach_one_task(): from the tail, the first task that may go
            for p in reversed(list(src.tasks)):
                if not self.can_migrate_task(p, env):
                    continue
                self.detach_task(p, env, "active")
                self.set_failed(sd, 0)
                self.attach_tasks(env)
                return
        finally:
            src.active_balance = 0


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def balance(obj, trace=None):
    """The kernel's migrations of one pass, in order (every hop of every task)."""
    node = Node(obj, trace)
    return node.run()


def collapse(migrations):
    """How the Balance RPC reports a pass (the service's convention, not the kernel's):
    one proposal per task, from its first source to its last destination, with the
    type, kind and level of its first move; a task that came back is left out."""
    at = {}
    out = []
    for m in migrations:
        if m["task"] in at:
            out[at[m["task"]]]["dst"] = m["dst"]
        else:
            at[m["task"]] = len(out)
            out.append(dict(m))
    return [p for p in out if p["src"] != p["dst"]]


def main(argv):
    trace = None
    args = list(argv[1:])
    if args and args[0] == "--trace":
        trace = sys.stderr
        args = args[1:]
    if len(args) != 1:
        sys.stderr.write(__doc__)
        return 2
    text = sys.stdin.read() if args[0] == "-" else open(args[0]).read()
    out = sys.stdout
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        obj = json.loads(line)
        migrations = balance(obj, trace)
        out.write(json.dumps({"name": obj.get("name", ""), "proposals": collapse(migrations),
                              "migrations": migrations}, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
