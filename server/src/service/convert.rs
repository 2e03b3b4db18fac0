//! The edge between protobuf and the engine: messages become engine types
//! here, with errors that name the field, so the engine never sees protobuf.

use fairplace_proto::v1 as pb;
use tonic::Status;

use crate::engine::balance::cluster::ClusterBalanceOutcome;
use crate::engine::balance::migrate::{IdleType, MigrateDecision, MigrateEnv, MigrationType, lbf};
use crate::engine::balance::{PassStats, Proposal};
use crate::engine::cpumask::CpuMask;
use crate::engine::decision::{Kind, PlaceRequest, Placement};
use crate::engine::group::GroupType;
use crate::engine::rq::{RqTask, TaskTable};
use crate::engine::state::{CpuState, MAX_CLOCK, MAX_SIGNAL, Policy, Task};
use crate::engine::topology::{CpuTopo, FieldError, Topology, TopologySpec};
use crate::store::{BalanceOutcome, CpuTaskList, RuntimeEntry, Snapshot, Update};

pub fn invalid(e: FieldError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// Quoting client strings in errors (kept here for the service's callers).
pub use crate::quote::{QUOTE_BYTES, field_key, quote};

fn err(field: impl Into<String>, msg: impl Into<String>) -> FieldError {
    FieldError::new(field, msg)
}

pub fn topology_spec(t: Option<&pb::Topology>, prefix: &str) -> Result<TopologySpec, FieldError> {
    let t = t.ok_or_else(|| err(prefix, "is required"))?;
    let mut cpus = Vec::with_capacity(t.cpus.len());
    for (i, c) in t.cpus.iter().enumerate() {
        if c.id as usize != i {
            return Err(err(
                format!("{prefix}.cpus[{i}].id"),
                format!("{} must equal the list position {i}", c.id),
            ));
        }
        cpus.push(CpuTopo {
            core: c.core,
            cluster: c.cluster,
            llc: c.llc,
            node: c.node,
            capacity: if c.capacity == 0 { 1024 } else { c.capacity },
        });
    }
    let numa_distance = if t.numa_distance.is_empty() {
        None
    } else {
        Some(t.numa_distance.iter().map(|r| r.distance.clone()).collect())
    };
    let spec = TopologySpec {
        cpus,
        numa_distance,
    };
    spec.validate(prefix)?;
    Ok(spec)
}

pub fn topology_to_pb(spec: &TopologySpec) -> pb::Topology {
    pb::Topology {
        cpus: spec
            .cpus
            .iter()
            .enumerate()
            .map(|(i, c)| pb::CpuTopology {
                id: i as u32,
                core: c.core,
                cluster: c.cluster,
                llc: c.llc,
                node: c.node,
                capacity: c.capacity,
            })
            .collect(),
        numa_distance: spec
            .numa_distance
            .as_ref()
            .map(|d| {
                d.iter()
                    .map(|r| pb::DistanceRow {
                        distance: r.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
    }
}

/// One reported CPU; range rules are checked by the store with the topology.
pub fn cpu_state(c: &pb::CpuState, capacity_orig: u32) -> CpuState {
    CpuState {
        online: c.online,
        nr_running: c.nr_running,
        h_nr_idle: c.h_nr_idle,
        nr_delayed: c.nr_delayed,
        cfs_h_nr_queued: c.cfs_h_nr_queued.unwrap_or(c.nr_running),
        curr_is_idle: c.curr_is_idle.unwrap_or(c.nr_running == 0),
        ttwu_pending: c.ttwu_pending,
        vcpu_preempted: c.vcpu_preempted,
        load_avg: c.load_avg,
        runnable_avg: c.runnable_avg,
        util_avg: c.util_avg,
        util_est: c.util_est,
        capacity: c.capacity.unwrap_or(capacity_orig),
        actual_capacity: c.actual_capacity.unwrap_or(capacity_orig),
        idle_exit_latency: c.idle_exit_latency,
        idle_stamp: c.idle_stamp,
        curr_is_per_cpu_kthread: c.curr_is_per_cpu_kthread,
        core_cookie: c.core_cookie,
    }
}

pub fn cpu_state_to_pb(id: usize, c: &CpuState) -> pb::CpuState {
    pb::CpuState {
        id: id as u32,
        online: c.online,
        nr_running: c.nr_running,
        h_nr_idle: c.h_nr_idle,
        nr_delayed: c.nr_delayed,
        cfs_h_nr_queued: Some(c.cfs_h_nr_queued),
        curr_is_idle: Some(c.curr_is_idle),
        ttwu_pending: c.ttwu_pending,
        vcpu_preempted: c.vcpu_preempted,
        load_avg: c.load_avg,
        runnable_avg: c.runnable_avg,
        util_avg: c.util_avg,
        util_est: c.util_est,
        capacity: Some(c.capacity),
        actual_capacity: Some(c.actual_capacity),
        idle_exit_latency: c.idle_exit_latency,
        idle_stamp: c.idle_stamp,
        curr_is_per_cpu_kthread: c.curr_is_per_cpu_kthread,
        core_cookie: c.core_cookie,
    }
}

/// The one mapping between the wire's scheduling policy and the engine's.
fn policy(v: i32, field: &str) -> Result<Policy, FieldError> {
    match pb::Policy::try_from(v) {
        Ok(pb::Policy::Normal) => Ok(Policy::Normal),
        Ok(pb::Policy::Batch) => Ok(Policy::Batch),
        Ok(pb::Policy::Idle) => Ok(Policy::Idle),
        Err(_) => Err(err(field, format!("{v} is not a policy"))),
    }
}

fn policy_to_pb(p: Policy) -> pb::Policy {
    match p {
        Policy::Normal => pb::Policy::Normal,
        Policy::Batch => pb::Policy::Batch,
        Policy::Idle => pb::Policy::Idle,
    }
}

fn signal(v: i64, field: &str) -> Result<i64, FieldError> {
    if (0..=MAX_SIGNAL).contains(&v) {
        Ok(v)
    } else {
        Err(err(field, format!("{v} is out of range 0..{MAX_SIGNAL}")))
    }
}

fn cpu_in(topo: &Topology, cpu: u32, field: &str) -> Result<usize, FieldError> {
    if (cpu as usize) < topo.nr_cpus {
        Ok(cpu as usize)
    } else {
        Err(err(
            field,
            format!("CPU {cpu} is not in the topology ({} CPUs)", topo.nr_cpus),
        ))
    }
}

fn cpulist(s: &str, topo: &Topology, field: &str) -> Result<Option<CpuMask>, FieldError> {
    if s.trim().is_empty() {
        return Ok(None);
    }
    CpuMask::parse_cpulist(s, topo.nr_cpus)
        .map(Some)
        .map_err(|e| err(field, e))
}

/// A task for a placement or a migration check; `task_cpu` stands in for
/// prev_cpu where the request fixes it.
pub fn task(
    t: Option<&pb::Task>,
    topo: &Topology,
    wakeup: bool,
    task_cpu: usize,
) -> Result<Task, FieldError> {
    let default = pb::Task::default();
    let t = t.unwrap_or(&default);
    let prev_cpu = if wakeup {
        let p = t
            .prev_cpu
            .ok_or_else(|| err("task.prev_cpu", "is required for a wakeup"))?;
        cpu_in(topo, p, "task.prev_cpu")?
    } else {
        task_cpu
    };
    let mut task = Task::new(topo.nr_cpus, prev_cpu);
    task.policy = policy(t.policy, "task.policy")?;
    if let Some(m) = cpulist(&t.cpus_allowed, topo, "task.cpus_allowed")? {
        task.cpus_allowed = m;
    }
    task.recent_used_cpu = if t.no_recent_used_cpu {
        None
    } else {
        match t.recent_used_cpu {
            Some(r) => Some(cpu_in(topo, r, "task.recent_used_cpu")?),
            None => Some(prev_cpu),
        }
    };
    task.util_avg = t.util_avg;
    task.util_est = t.util_est;
    task.runnable_avg = t.runnable_avg;
    task.load_avg = t.load_avg;
    task.wakee_flips = t.wakee_flips;
    task.uclamp_min = t.uclamp_min;
    task.uclamp_max = t.uclamp_max.unwrap_or(1024);
    task.migration_disabled = t.migration_disabled;
    task.core_cookie = t.core_cookie;
    task.numa_preferred_nid = t.numa_preferred_nid.unwrap_or(-1);
    task.per_cpu_kthread = t.per_cpu_kthread;
    task.running = t.running;
    task.sched_delayed = t.sched_delayed;
    task.eligible = t.eligible.unwrap_or(true);
    task.next_buddy = t.next_buddy;
    task.blocked = t.blocked;
    task.exec_start = t.exec_start;
    task.hot = t.hot;
    task.check()
        .map_err(|(f, msg)| err(format!("task.{f}"), msg))?;
    Ok(task)
}

/// A PickCpu request against a snapshot.
pub fn pick_request(
    r: &pb::PickCpuRequest,
    snap: &Snapshot,
) -> Result<(Task, PlaceRequest), FieldError> {
    let topo = &snap.topo;
    let kind = match pb::RequestKind::try_from(r.kind) {
        Ok(pb::RequestKind::Wakeup) => Kind::Wakeup,
        Ok(pb::RequestKind::Fork) => Kind::Fork,
        Ok(pb::RequestKind::Exec) => Kind::Exec,
        Err(_) => return Err(err("kind", format!("{} is not a request kind", r.kind))),
    };
    let this_cpu = cpu_in(topo, r.this_cpu, "this_cpu")?;
    if !topo.online.test(this_cpu) {
        return Err(err("this_cpu", format!("CPU {this_cpu} is offline")));
    }
    let rq = &snap.state.cpus[this_cpu];
    if kind == Kind::Exec && (rq.nr_running < 1 || rq.curr_is_idle) {
        return Err(err(
            "this_cpu",
            format!("CPU {this_cpu} runs no task in the reported state, so no task can exec there"),
        ));
    }
    let mut req = PlaceRequest::new(kind, this_cpu);
    let w = r.waker.unwrap_or_default();
    req.sync = r.sync;
    req.wf_current_cpu = r.current_cpu;
    req.in_task = r.in_task.unwrap_or(true);
    req.waker_exiting = w.exiting;
    req.waker_wakee_flips = signal(w.wakee_flips, "waker.wakee_flips")?;
    req.waker_last_wakee_is_task = w.last_wakee_is_task.unwrap_or(true);
    req.waker_flip_decay_expired = w.flip_decay_expired;
    req.waker_load = signal(w.load, "waker.load")?;
    req.waker_is_per_cpu_kthread = w
        .is_per_cpu_kthread
        .unwrap_or(snap.state.cpus[this_cpu].curr_is_per_cpu_kthread);
    let task = task(r.task.as_ref(), topo, kind == Kind::Wakeup, this_cpu)?;
    Ok((task, req))
}

pub fn pick_response(p: &Placement, snap: &Snapshot, age_seconds: f64) -> pb::PickCpuResponse {
    pb::PickCpuResponse {
        cpu: p.cpu as u32,
        path: p.path.as_str().to_string(),
        scanned: p.scanned,
        state_version: snap.version,
        state_age_seconds: age_seconds,
        affine: p
            .detail
            .affine
            .map(|a| a.as_str().to_string())
            .unwrap_or_default(),
        nr_idle_scan: p.detail.nr_idle_scan,
        node_id: String::new(),
        cluster_level: String::new(),
        groups_compared: 0,
    }
}

pub fn migrate_request(
    r: &pb::CanMigrateRequest,
    snap: &Snapshot,
) -> Result<(Task, MigrateEnv), FieldError> {
    let topo = &snap.topo;
    let src = cpu_in(topo, r.src_cpu, "src_cpu")?;
    let dst = cpu_in(topo, r.dst_cpu, "dst_cpu")?;
    for (f, c) in [("src_cpu", src), ("dst_cpu", dst)] {
        if !topo.online.test(c) {
            return Err(err(f, format!("CPU {c} is offline")));
        }
    }
    if src == dst {
        return Err(err("dst_cpu", "must differ from src_cpu"));
    }
    let chain = topo.domains(dst);
    let sd = if r.sd_level.is_empty() {
        chain
            .iter()
            .position(|d| topo.span(d.span).test(src))
            .ok_or_else(|| {
                err(
                    "src_cpu",
                    format!("no domain of CPU {dst} contains CPU {src}"),
                )
            })?
    } else {
        topo.domain_by_name(dst, &r.sd_level).ok_or_else(|| {
            let names: Vec<String> = chain.iter().map(|d| d.level.to_string()).collect();
            err(
                "sd_level",
                format!(
                    "{} is not a domain of CPU {dst} (it has {})",
                    quote(&r.sd_level),
                    names.join(", ")
                ),
            )
        })?
    };
    let dom = &chain[sd];
    let flags = if r.flags.is_empty() && !r.flags_given {
        lbf::ALL_PINNED
    } else {
        let mut f = 0;
        for (i, name) in r.flags.iter().enumerate() {
            f |= lbf::NAMES
                .iter()
                .find(|(_, n)| n == name)
                .map(|(b, _)| *b)
                .ok_or_else(|| {
                    err(
                        format!("flags[{i}]"),
                        format!("{} is not a balance flag", quote(name)),
                    )
                })?;
        }
        f
    };
    let env = MigrateEnv {
        src_cpu: src,
        dst_cpu: dst,
        sd_cpu: dst,
        sd,
        dst_group: cpulist(&r.dst_group, topo, "dst_group")?.unwrap_or(*topo.span(dom.groups[0])),
        env_cpus: cpulist(&r.env_cpus, topo, "env_cpus")?.unwrap_or(*topo.span(dom.span)),
        idle: match pb::IdleType::try_from(r.idle) {
            Ok(pb::IdleType::Idle) => IdleType::Idle,
            Ok(pb::IdleType::NotIdle) => IdleType::NotIdle,
            Ok(pb::IdleType::NewlyIdle) => IdleType::NewlyIdle,
            Err(_) => return Err(err("idle", format!("{} is not an idle type", r.idle))),
        },
        migration_type: match pb::MigrationType::try_from(r.migration_type) {
            Ok(pb::MigrationType::Load) => MigrationType::Load,
            Ok(pb::MigrationType::Util) => MigrationType::Util,
            Ok(pb::MigrationType::Task) => MigrationType::Task,
            Ok(pb::MigrationType::Misfit) => MigrationType::Misfit,
            Ok(pb::MigrationType::LlcTask) => MigrationType::LlcTask,
            Err(_) => {
                return Err(err(
                    "migration_type",
                    format!("{} is not a migration type", r.migration_type),
                ));
            }
        },
        flags,
        nr_balance_failed: r.nr_balance_failed,
        cache_nice_tries: r.cache_nice_tries,
        throttled: r.throttled,
        dst_cfs_nr_queued: match r.dst_cfs_nr_queued {
            Some(q) if q as i64 > MAX_SIGNAL => {
                return Err(err(
                    "dst_cfs_nr_queued",
                    format!("{q} is out of range 0..{MAX_SIGNAL}"),
                ));
            }
            Some(q) => q,
            None => snap.state.cpus[dst].cfs_h_nr_queued,
        },
        now: if (0..=MAX_CLOCK).contains(&r.now) {
            r.now
        } else {
            return Err(err("now", format!("{} is out of range 0..2^62", r.now)));
        },
    };
    let task = task(r.task.as_ref(), topo, false, src)?;
    Ok((task, env))
}

pub fn migrate_response(m: &MigrateDecision, snap: &Snapshot) -> pb::CanMigrateResponse {
    pb::CanMigrateResponse {
        allowed: m.allowed,
        new_dst_cpu: m.new_dst_cpu.map(|c| c as u32),
        flags: lbf::NAMES
            .iter()
            .filter(|(f, _)| m.flags & f != 0)
            .map(|(_, n)| n.to_string())
            .collect(),
        reason: m.reason.as_str().to_string(),
        task_hot: m.task_hot,
        state_version: snap.version,
    }
}

/// An agent's update: CPU states as reported (the store checks them against
/// the topology), task lists and runtime with their fields checked here.
pub fn update(u: &pb::Update, spec: &TopologySpec) -> Result<Update, FieldError> {
    let n = spec.cpus.len();
    let cpus = u
        .cpus
        .iter()
        .map(|c| {
            let cap = spec.cpus.get(c.id as usize).map_or(1024, |t| t.capacity);
            (c.id, cpu_state(c, cap))
        })
        .collect();
    let mut tasks = Vec::with_capacity(u.tasks.len());
    for (k, l) in u.tasks.iter().enumerate() {
        let mut list = CpuTaskList {
            cpu: l.cpu,
            clock: l.clock_task,
            tasks: Vec::with_capacity(l.tasks.len()),
        };
        for (j, t) in l.tasks.iter().enumerate() {
            list.tasks.push(runnable_task(
                t,
                n,
                &format!("update.tasks[{k}].tasks[{j}]"),
            )?);
        }
        tasks.push(list);
    }
    let runtime = u
        .runtime
        .iter()
        .map(|r| RuntimeEntry {
            group: r.group,
            cpu: r.cpu,
            runtime_ns: r.runtime_ns,
            nr_threads: r.nr_threads,
        })
        .collect();
    Ok(Update {
        seq: u.seq,
        full: u.full,
        cpus,
        tasks,
        runtime,
    })
}

/// One reported task, with its affinity (`None` = every CPU).
fn runnable_task(
    t: &pb::RunnableTask,
    n: usize,
    path: &str,
) -> Result<(RqTask, Option<CpuMask>), FieldError> {
    let f = |x: &str| format!("{path}.{x}");
    let policy = policy(t.policy, &f("policy"))?;
    if !(-20..=19).contains(&t.nice) {
        return Err(err(
            f("nice"),
            format!("{} is out of range -20..19", t.nice),
        ));
    }
    let mask = if t.cpus_allowed.trim().is_empty() {
        None
    } else {
        let m =
            CpuMask::parse_cpulist(&t.cpus_allowed, n).map_err(|e| err(f("cpus_allowed"), e))?;
        if m.is_empty() {
            return Err(err(f("cpus_allowed"), "must not be empty"));
        }
        Some(m)
    };
    if !(0..=MAX_CLOCK).contains(&t.exec_start) {
        return Err(err(
            f("exec_start"),
            format!("{} is out of range 0..2^62", t.exec_start),
        ));
    }
    let task = RqTask {
        id: t.id,
        group: t.group,
        policy,
        nice: t.nice as i8,
        allowed: 0,
        load_avg: signal(t.load_avg, &f("load_avg"))?,
        util_avg: signal(t.util_avg, &f("util_avg"))?,
        util_est: signal(t.util_est, &f("util_est"))?,
        runnable_avg: signal(t.runnable_avg, &f("runnable_avg"))?,
        running: t.running,
        exec_start: t.exec_start,
        migration_disabled: t.migration_disabled,
        per_cpu_kthread: t.per_cpu_kthread,
        sched_delayed: t.sched_delayed,
        nr_threads: t.nr_threads,
    };
    Ok((task, mask))
}

pub fn migration_type_to_pb(m: MigrationType) -> pb::MigrationType {
    match m {
        MigrationType::Load => pb::MigrationType::Load,
        MigrationType::Util => pb::MigrationType::Util,
        MigrationType::Task => pb::MigrationType::Task,
        MigrationType::Misfit => pb::MigrationType::Misfit,
        MigrationType::LlcTask => pb::MigrationType::LlcTask,
    }
}

/// A proposal of the node balancer.
pub fn proposal_to_pb(p: &Proposal, node: &str) -> pb::Proposal {
    let kind = if p.active { "active" } else { "detach" };
    let reason = proposal_reason(
        &p.level.to_string(),
        kind,
        p.busiest,
        p.local,
        p.imbalance,
        p.migration_type,
        p.forced_hot.then_some(p.nr_balance_failed),
        p.llc_preference,
    );
    pb::Proposal {
        task: p.task,
        group: p.group,
        src_node: node.to_string(),
        src_cpu: p.src_cpu as u32,
        dst_node: node.to_string(),
        dst_cpu: p.dst_cpu as u32,
        migration_type: migration_type_to_pb(p.migration_type) as i32,
        kind: kind.to_string(),
        level: p.level.to_string(),
        busiest_group: p.busiest.as_str().to_string(),
        local_group: p.local.as_str().to_string(),
        imbalance: p.imbalance,
        forced_hot: p.forced_hot,
        nr_balance_failed: p.nr_balance_failed,
        llc_preference: p.llc_preference,
        reason,
    }
}

pub fn balance_response(o: &BalanceOutcome, node: &str) -> pb::BalanceResponse {
    pb::BalanceResponse {
        proposals: o
            .proposals
            .iter()
            .map(|p| proposal_to_pb(p, node))
            .collect(),
        domains_balanced: o.stats.domains_balanced,
        domains_declined: o.stats.domains_declined,
        rejections: rejections_pb(&o.stats),
        state_version: o.version,
        claimed: o.claimed,
    }
}

/// The destination CPUs of a balance request.
pub fn balance_cpus(s: &str, topo: &Topology) -> Result<Option<CpuMask>, FieldError> {
    let m = cpulist(s, topo, "cpus")?;
    if let Some(m) = &m
        && !m.intersects(&topo.online)
    {
        return Err(err("cpus", "names no online CPU"));
    }
    Ok(m)
}

pub fn cluster_balance_response(o: &ClusterBalanceOutcome) -> pb::BalanceResponse {
    pb::BalanceResponse {
        proposals: o
            .proposals
            .iter()
            .map(|p| {
                let reason = proposal_reason(
                    &p.level,
                    "detach",
                    p.busiest,
                    p.local,
                    p.imbalance,
                    p.migration_type,
                    p.forced_hot.then_some(p.nr_balance_failed),
                    false,
                );
                pb::Proposal {
                    task: p.task,
                    group: p.group,
                    src_node: p.src_node.clone(),
                    src_cpu: p.src_cpu as u32,
                    dst_node: p.dst_node.clone(),
                    dst_cpu: p.dst_cpu as u32,
                    migration_type: migration_type_to_pb(p.migration_type) as i32,
                    kind: "detach".into(),
                    level: p.level.clone(),
                    busiest_group: p.busiest.as_str().to_string(),
                    local_group: p.local.as_str().to_string(),
                    imbalance: p.imbalance,
                    forced_hot: p.forced_hot,
                    nr_balance_failed: p.nr_balance_failed,
                    llc_preference: false,
                    reason,
                }
            })
            .collect(),
        domains_balanced: o.stats.domains_balanced,
        domains_declined: o.stats.domains_declined,
        rejections: rejections_pb(&o.stats),
        state_version: 0,
        claimed: o.claimed,
    }
}

fn rejections_pb(stats: &PassStats) -> Vec<pb::RejectionCount> {
    stats
        .rejection_counts()
        .map(|(r, c)| pb::RejectionCount {
            reason: r.to_string(),
            count: c,
        })
        .collect()
}

/// The human-readable why of a proposal.
#[allow(clippy::too_many_arguments)]
fn proposal_reason(
    level: &str,
    kind: &str,
    busiest: GroupType,
    local: GroupType,
    imbalance: i64,
    ty: MigrationType,
    forced_hot: Option<u32>,
    llc: bool,
) -> String {
    let mut r = format!(
        "{level} {kind}: busiest group {} vs local {}, imbalance {imbalance} ({})",
        busiest.as_str(),
        local.as_str(),
        ty.as_str()
    );
    if let Some(n) = forced_hot {
        r.push_str(&format!("; cache-hot, moved after {n} failed balances"));
    }
    if llc {
        r.push_str("; toward the process's preferred LLC");
    }
    r
}

/// The stored task lists as the protocol carries them.
pub fn task_lists_to_pb(t: &TaskTable) -> Vec<pb::CpuTasks> {
    t.cpus
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.is_empty())
        .map(|(cpu, l)| pb::CpuTasks {
            cpu: cpu as u32,
            clock_task: t.clock[cpu],
            tasks: l
                .iter()
                .map(|x| pb::RunnableTask {
                    id: x.id,
                    group: x.group,
                    policy: policy_to_pb(x.policy) as i32,
                    nice: x.nice as i32,
                    cpus_allowed: if x.allowed == 0 {
                        String::new()
                    } else {
                        t.masks[x.allowed as usize].to_string()
                    },
                    load_avg: x.load_avg,
                    util_avg: x.util_avg,
                    util_est: x.util_est,
                    runnable_avg: x.runnable_avg,
                    running: x.running,
                    exec_start: x.exec_start,
                    migration_disabled: x.migration_disabled,
                    per_cpu_kthread: x.per_cpu_kthread,
                    sched_delayed: x.sched_delayed,
                    nr_threads: x.nr_threads,
                })
                .collect(),
        })
        .collect()
}
