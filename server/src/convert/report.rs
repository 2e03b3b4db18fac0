//! Agent reports and node views: topologies, per-CPU states, updates and
//! task lists, both ways.

use fairplace_proto::v1 as pb;

use crate::engine::cpumask::CpuMask;
use crate::engine::rq::{RqTask, TaskTable};
use crate::engine::state::{CpuState, MAX_CLOCK, NodeState};
use crate::engine::topology::{CpuTopo, FieldError, TopologySpec};
use crate::store::{CpuTaskList, RuntimeEntry, Update};

use super::fields::{err, policy, policy_to_pb, signal};

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
        numa_distance: pb::distance_rows(spec.numa_distance.as_ref()),
    }
}

/// One reported CPU, narrowed to the store's layout (a value that does not
/// fit is refused here, naming its field); the other range rules are checked
/// by the store with the topology.
pub fn cpu_state(c: &pb::CpuState, capacity_orig: u32) -> Result<CpuState, (&'static str, String)> {
    let signal = CpuState::signal_field;
    Ok(CpuState {
        online: c.online,
        nr_running: c.nr_running,
        h_nr_idle: c.h_nr_idle,
        nr_delayed: c.nr_delayed,
        cfs_h_nr_queued: c.cfs_h_nr_queued.unwrap_or(c.nr_running),
        curr_is_idle: c.curr_is_idle.unwrap_or(c.nr_running == 0),
        ttwu_pending: c.ttwu_pending,
        vcpu_preempted: c.vcpu_preempted,
        load_avg: signal("load_avg", c.load_avg)?,
        runnable_avg: signal("runnable_avg", c.runnable_avg)?,
        util_avg: signal("util_avg", c.util_avg)?,
        util_est: signal("util_est", c.util_est)?,
        capacity: CpuState::capacity_field("capacity", 1, c.capacity, capacity_orig)?,
        actual_capacity: CpuState::capacity_field(
            "actual_capacity",
            0,
            c.actual_capacity,
            capacity_orig,
        )?,
        idle_exit_latency: CpuState::exit_latency_field(c.idle_exit_latency)?,
        idle_stamp: c.idle_stamp,
        curr_is_per_cpu_kthread: c.curr_is_per_cpu_kthread,
    })
}

pub fn cpu_state_to_pb(id: usize, c: &CpuState, core_cookie: u64) -> pb::CpuState {
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
        load_avg: c.load_avg as i64,
        runnable_avg: c.runnable_avg as i64,
        util_avg: c.util_avg as i64,
        util_est: c.util_est as i64,
        capacity: Some(c.capacity as u32),
        actual_capacity: Some(c.actual_capacity as u32),
        idle_exit_latency: c.exit_latency(),
        idle_stamp: c.idle_stamp,
        curr_is_per_cpu_kthread: c.curr_is_per_cpu_kthread,
        core_cookie,
    }
}

/// Every CPU's state, in id order, as GetNode and a replica's NodeStates
/// carry them.
pub fn cpu_states_to_pb(st: &NodeState) -> Vec<pb::CpuState> {
    st.cpus
        .iter()
        .enumerate()
        .map(|(i, c)| cpu_state_to_pb(i, c, st.core_cookie(i)))
        .collect()
}

/// The update's core cookies, parallel to its CPUs; empty when all are 0.
fn core_cookies(u: &pb::Update) -> Result<Vec<u64>, FieldError> {
    if u.cpus.iter().all(|c| c.core_cookie == 0) {
        return Ok(Vec::new());
    }
    let mut cookies = Vec::with_capacity(u.cpus.len());
    for (k, c) in u.cpus.iter().enumerate() {
        let v = CpuState::core_cookie_field(c.core_cookie)
            .map_err(|(f, msg)| err(format!("update.cpus[{k}].{f}"), msg))?;
        cookies.push(v);
    }
    Ok(cookies)
}

/// An agent's update: CPU states as reported (the store checks them against
/// the topology), task lists and runtime with their fields checked here.
pub fn update(u: &pb::Update, spec: &TopologySpec) -> Result<Update, FieldError> {
    let n = spec.cpus.len();
    // Sized up front: collecting into a Result would grow the vector from
    // nothing, copying it at each doubling, on every report.
    let mut cpus = Vec::with_capacity(u.cpus.len());
    for (k, c) in u.cpus.iter().enumerate() {
        let cap = spec.cpus.get(c.id as usize).map_or(1024, |t| t.capacity);
        let s = cpu_state(c, cap).map_err(|(f, msg)| err(format!("update.cpus[{k}].{f}"), msg))?;
        cpus.push((c.id, s));
    }
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
        core_cookies: core_cookies(u)?,
        tasks,
        runtime,
    })
}

/// One reported task, with its affinity (`None` = every CPU).
pub(super) fn runnable_task(
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
        next_buddy: false,
        nr_threads: t.nr_threads,
    };
    Ok((task, mask))
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
