//! CPU allocation policies for AllocateCpus: which `count` CPUs of a node
//! a lease gets.
//!
//! The kernel places one task per wakeup; an orchestrator needs a set of
//! CPUs. Every policy here is built from the kernel's own fork placement
//! (`select_task_rq()` with a fork, so `sched_balance_find_dst_cpu()`): each
//! step places one more "thread" on a copy of the node's state in which the
//! CPUs already granted count as running one more task, exactly as a claim
//! counts them. The policies differ in which CPUs each step may take:
//!
//! - `kernel`: any free CPU not yet granted: where the kernel would put
//!   `count` new threads (one per CPU).
//! - `cores`: whole idle cores first (SMT siblings together), the kernel's
//!   idle-core preference (`select_idle_core()` takes a core only when all
//!   its siblings are idle); a rest smaller than a core goes inside one
//!   idle core; with no idle core left, the kernel policy finishes.
//! - `llc`: the kernel policy confined to one LLC: the one the slow path
//!   prefers among the LLCs with `count` free CPUs.
//! - `llc-exclusive`: a whole LLC (all its online CPUs, at least `count`),
//!   every CPU of it free: the one the slow path prefers among those.
//! - `spread`: one CPU per core, across cores (the kubelet's
//!   distribute-across-cores spirit): after each step the chosen CPU's
//!   siblings leave the allowed set.
//!
//! "Free" means allowed by the request's task, online, and held by no other
//! lease: leases are exclusive. Everything here is pure: the caller passes
//! the node's snapshot and the CPUs other leases hold. Each step costs one
//! state rebuild (O(CPUs)) and one slow-path placement, so a request costs
//! O(count x CPUs), bounded by the node's size.

use crate::engine::cpumask::CpuMask;
use crate::engine::decision::{Kind, Path, PlaceRequest};
use crate::engine::features::{Features, System};
use crate::engine::state::{NodeState, Task};
use crate::engine::topology::Topology;
use crate::engine::{View, select_task_rq};

/// The policies, by the names the API takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    Kernel,
    Cores,
    Llc,
    LlcExclusive,
    Spread,
}

impl Policy {
    pub const ALL: [Policy; 5] = [
        Policy::Kernel,
        Policy::Cores,
        Policy::Llc,
        Policy::LlcExclusive,
        Policy::Spread,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Kernel => "kernel",
            Policy::Cores => "cores",
            Policy::Llc => "llc",
            Policy::LlcExclusive => "llc-exclusive",
            Policy::Spread => "spread",
        }
    }

    /// The policy named `s`; empty is `kernel`.
    pub fn parse(s: &str) -> Option<Policy> {
        if s.is_empty() {
            return Some(Policy::Kernel);
        }
        Policy::ALL.into_iter().find(|p| p.as_str() == s)
    }
}

/// Why an allocation cannot be made now (RESOURCE_EXHAUSTED): the request
/// is valid, the node has no room for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NoRoom {
    /// Machine-readable, for the refusal metric.
    pub reason: &'static str,
    pub message: String,
}

/// The CPUs chosen, in order, each with the step that chose it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    pub cpus: Vec<(usize, &'static str)>,
    pub scanned: u32,
    pub explanation: String,
}

impl Grant {
    pub fn mask(&self) -> CpuMask {
        CpuMask::from_cpus(self.cpus.iter().map(|(c, _)| *c))
    }
}

/// One allocation's inputs.
pub struct Request<'a> {
    pub topo: &'a Topology,
    pub state: &'a NodeState,
    pub features: &'a Features,
    pub system: &'a System,
    /// The task the CPUs are for; its `cpus_allowed` restricts them.
    pub task: &'a Task,
    pub count: usize,
    pub policy: Policy,
    /// CPUs other leases hold.
    pub leased: &'a CpuMask,
}

/// The allocation's scratch: the node's state with the CPUs granted so far
/// counted, and what was granted.
struct Alloc<'a> {
    req: &'a Request<'a>,
    state: NodeState,
    granted: CpuMask,
    grant: Grant,
}

impl<'a> Alloc<'a> {
    fn new(req: &'a Request<'a>) -> Self {
        Alloc {
            req,
            state: req.state.clone(),
            granted: CpuMask::new(),
            grant: Grant::default(),
        }
    }

    fn remaining(&self) -> usize {
        self.req.count.saturating_sub(self.grant.cpus.len())
    }

    /// One fork placement whose task may use only `allowed` (non-empty):
    /// `select_task_rq()` from the lowest allowed CPU, as the cluster path
    /// places a task with no parent on the node.
    fn place_fork(&mut self, allowed: &CpuMask) -> (usize, &'static str) {
        let mut task = self.req.task.clone();
        task.cpus_allowed = *allowed;
        let this_cpu = allowed.first().expect("a non-empty mask");
        task.prev_cpu = this_cpu;
        task.recent_used_cpu = Some(this_cpu);
        let view = View {
            topo: self.req.topo,
            state: &self.state,
            features: self.req.features,
            system: self.req.system,
        };
        let p = select_task_rq(view, &task, &PlaceRequest::new(Kind::Fork, this_cpu));
        self.grant.scanned += p.scanned;
        if allowed.test(p.cpu) {
            (p.cpu, p.path.as_str())
        } else {
            // The engine always answers inside the mask; stay safe anyway.
            (this_cpu, Path::FallbackRq.as_str())
        }
    }

    /// Grants `cpu` and counts it as running one more task from now on.
    fn take(&mut self, cpu: usize, path: &'static str) {
        self.granted.set(cpu);
        self.grant.cpus.push((cpu, path));
        let mut cpus = self.state.cpus.clone();
        let c = &mut cpus[cpu];
        c.nr_running = c.nr_running.saturating_add(1);
        c.cfs_h_nr_queued = c.cfs_h_nr_queued.saturating_add(1);
        c.curr_is_idle = false;
        self.state = NodeState::next(
            self.req.topo,
            &self.state,
            true,
            cpus,
            &[],
            self.req.features,
        );
    }

    /// The kernel policy over `pool`: until `count` are granted, place a
    /// fork on the pool's CPUs not yet granted.
    fn kernel_steps(&mut self, pool: &CpuMask) {
        while self.remaining() > 0 {
            let allowed = pool.andnot(&self.granted);
            if allowed.is_empty() {
                return;
            }
            let (cpu, path) = self.place_fork(&allowed);
            self.take(cpu, path);
        }
    }

    /// Cores of `pool` whose every online CPU is in `pool` and idle
    /// (`available_idle_cpu()`), not yet granted: the cores
    /// `select_idle_core()` would call idle.
    fn idle_cores(&self, pool: &CpuMask) -> Vec<CpuMask> {
        let topo = self.req.topo;
        let mut out: Vec<CpuMask> = Vec::new();
        let mut seen = CpuMask::new();
        for cpu in pool.andnot(&self.granted).iter() {
            if seen.test(cpu) {
                continue;
            }
            let core = *topo.smt_mask(cpu);
            seen.or_assign(&core);
            let whole = core.is_subset(pool) && !core.intersects(&self.granted);
            if whole && core.iter().all(|c| self.state.cpus[c].available_idle()) {
                out.push(core);
            }
        }
        out
    }

    /// `cores`: whole idle cores while a whole one fits the rest, then the
    /// rest inside one idle core, then the kernel policy.
    fn cores_steps(&mut self, free: &CpuMask) {
        while self.remaining() > 0 {
            let idle = self.idle_cores(free);
            let rem = self.remaining();
            let fitting = union(idle.iter().filter(|c| c.weight() <= rem));
            if !fitting.is_empty() {
                let (cpu, path) = self.place_fork(&fitting);
                let core = *self.req.topo.smt_mask(cpu);
                self.take(cpu, path);
                for s in core.iter().filter(|&s| s != cpu) {
                    self.take(s, "core_sibling");
                }
                continue;
            }
            let bigger = union(idle.iter());
            if bigger.is_empty() {
                break;
            }
            // Fewer CPUs left than a core has: keep them together inside
            // one idle core, breaking no other.
            let (cpu, path) = self.place_fork(&bigger);
            let core = *self.req.topo.smt_mask(cpu);
            self.take(cpu, path);
            for s in core.iter().filter(|&s| s != cpu) {
                if self.remaining() == 0 {
                    break;
                }
                self.take(s, "core_sibling");
            }
        }
        self.kernel_steps(free);
    }

    /// `spread`: one CPU per core; each step's core leaves the pool.
    fn spread_steps(&mut self, free: &CpuMask) {
        let mut pool = *free;
        while self.remaining() > 0 && !pool.is_empty() {
            let (cpu, path) = self.place_fork(&pool);
            self.take(cpu, path);
            pool.andnot_assign(self.req.topo.smt_mask(cpu));
        }
    }
}

/// The union of some masks.
fn union<'m>(masks: impl Iterator<Item = &'m CpuMask>) -> CpuMask {
    let mut u = CpuMask::new();
    for m in masks {
        u.or_assign(m);
    }
    u
}

/// The online CPUs of each LLC, by the topology's LLC ids, ascending.
pub fn llcs(topo: &Topology) -> Vec<(u32, CpuMask)> {
    let mut out: Vec<(u32, CpuMask)> = Vec::new();
    for cpu in topo.online.iter() {
        let id = topo.spec.cpus[cpu].llc;
        match out.iter_mut().find(|(l, _)| *l == id) {
            Some((_, m)) => m.set(cpu),
            None => out.push((id, CpuMask::from_cpus([cpu]))),
        }
    }
    out.sort_by_key(|(l, _)| *l);
    out
}

/// Cores with at least one CPU in `mask`.
fn cores_in(topo: &Topology, mask: &CpuMask) -> usize {
    let mut seen = CpuMask::new();
    let mut n = 0;
    for cpu in mask.iter() {
        if !seen.test(cpu) {
            seen.or_assign(topo.smt_mask(cpu));
            n += 1;
        }
    }
    n
}

/// The free CPUs of a request: allowed, online, held by no other lease.
pub fn free_cpus(req: &Request<'_>) -> CpuMask {
    req.task
        .cpus_allowed
        .and(&req.topo.online)
        .andnot(req.leased)
}

/// Allocates `count` CPUs by the request's policy. The caller has checked
/// that `count` is at least 1 and at most the allowed online CPUs.
pub fn allocate(req: &Request<'_>) -> Result<Grant, NoRoom> {
    let free = free_cpus(req);
    let count = req.count;
    if free.weight() < count {
        return Err(NoRoom {
            reason: "leased",
            message: format!(
                "count: {count} CPUs asked, {} of the allowed online CPUs are free ({} held by other leases)",
                free.weight(),
                req.task
                    .cpus_allowed
                    .and(&req.topo.online)
                    .and(req.leased)
                    .weight()
            ),
        });
    }
    let mut a = Alloc::new(req);
    let what = match req.policy {
        Policy::Kernel => {
            a.kernel_steps(&free);
            format!(
                "{count} successive fork placements (sched_balance_find_dst_cpu), each counting the CPUs granted before it as busy"
            )
        }
        Policy::Cores => {
            a.cores_steps(&free);
            "whole idle cores first (SMT siblings together), then fork placements".to_string()
        }
        Policy::Spread => {
            let cores = cores_in(req.topo, &free);
            if cores < count {
                return Err(NoRoom {
                    reason: "cores",
                    message: format!(
                        "count: spread takes one CPU per core; only {cores} cores have a free CPU"
                    ),
                });
            }
            a.spread_steps(&free);
            "one CPU per core: fork placements, each core leaving the pool once used".to_string()
        }
        Policy::Llc => return llc(a, &free),
        Policy::LlcExclusive => return llc_exclusive(a, &free),
    };
    a.grant.explanation = what;
    Ok(a.grant)
}

/// `llc`: the kernel policy inside the LLC the slow path prefers among
/// those with room.
fn llc(mut a: Alloc<'_>, free: &CpuMask) -> Result<Grant, NoRoom> {
    let count = a.req.count;
    let roomy: Vec<(u32, CpuMask)> = llcs(a.req.topo)
        .into_iter()
        .map(|(id, m)| (id, m.and(free)))
        .filter(|(_, m)| m.weight() >= count)
        .collect();
    if roomy.is_empty() {
        return Err(NoRoom {
            reason: "llc",
            message: format!("count: no LLC has {count} free allowed CPUs"),
        });
    }
    let (first, path) = a.place_fork(&union(roomy.iter().map(|(_, m)| m)));
    let (id, pool) = *roomy
        .iter()
        .find(|(_, m)| m.test(first))
        .expect("the placement is inside the pool");
    a.take(first, path);
    a.kernel_steps(&pool);
    a.grant.explanation = format!(
        "LLC {id}, the slow path's choice among the LLCs with {count} free CPUs; fork placements inside it"
    );
    Ok(a.grant)
}

/// `llc-exclusive`: a whole, wholly free LLC of at least `count` CPUs.
fn llc_exclusive(mut a: Alloc<'_>, free: &CpuMask) -> Result<Grant, NoRoom> {
    let count = a.req.count;
    let whole: Vec<(u32, CpuMask)> = llcs(a.req.topo)
        .into_iter()
        .filter(|(_, m)| m.weight() >= count && m.is_subset(free))
        .collect();
    if whole.is_empty() {
        return Err(NoRoom {
            reason: "llc",
            message: format!(
                "count: no LLC of {count} CPUs or more is wholly free (allowed, online, unleased)"
            ),
        });
    }
    let (first, path) = a.place_fork(&union(whole.iter().map(|(_, m)| m)));
    let (id, llc) = *whole
        .iter()
        .find(|(_, m)| m.test(first))
        .expect("the placement is inside the pool");
    a.take(first, path);
    for cpu in llc.iter().filter(|&c| c != first) {
        a.take(cpu, "llc_exclusive");
    }
    a.grant.explanation = format!(
        "the whole of LLC {id} ({} CPUs), the slow path's choice among the wholly free LLCs",
        llc.weight()
    );
    Ok(a.grant)
}
