//! An agent's report as the store takes it: the [`Update`] (CPU states,
//! task lists, runtime per process), every check made of it before
//! anything is stored ([`check_update_cpus`], the task lists' and the
//! runtime entries'), and the merging of its task lists into the next
//! snapshot's [`TaskTable`]. One place checks a report: the node owner
//! applies only what passed here, and a peer's node state sent for a
//! cluster pass is checked by the same functions.

use std::collections::HashSet;
use std::sync::Arc;

use crate::engine::cache::ScanReport;
use crate::engine::cpumask::CpuMask;
use crate::engine::rq::{RqTask, TaskTable};
use crate::engine::state::{CpuState, MAX_CLOCK};
use crate::engine::topology::{FieldError, TopologySpec};

pub use fairplace_types::limits::{
    MAX_MASKS_PER_NODE, MAX_RUNTIME_NS, MAX_RUNTIME_PER_CPU, MAX_TASKS_PER_CPU, MAX_TASKS_PER_NODE,
};

/// Why an update was refused; the stored state is unchanged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reject {
    /// A delta whose sequence does not follow the last applied one, or a delta
    /// before the first full snapshot.
    OutOfSequence {
        expected: u64,
        got: u64,
    },
    Invalid(FieldError),
    /// Another registration took over this node, or it was forgotten.
    Superseded,
    /// The server had no room to do the work now (the heavy pool is full).
    Busy(String),
}

impl Reject {
    pub fn reason(&self) -> &'static str {
        match self {
            Reject::OutOfSequence { .. } => "out_of_sequence",
            Reject::Invalid(_) => "invalid",
            Reject::Superseded => "superseded",
            Reject::Busy(_) => "busy",
        }
    }
}

impl std::fmt::Display for Reject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reject::OutOfSequence { expected, got } => write!(
                f,
                "update.seq: {got} does not follow the last applied sequence (expected {expected}, or a full snapshot)"
            ),
            Reject::Invalid(e) => write!(f, "{e}"),
            Reject::Superseded => f.write_str("node_id: a newer registration took over this node"),
            Reject::Busy(m) => write!(f, "{m}"),
        }
    }
}

/// An update from an agent: complete states of some or all CPUs, their
/// task lists, and runtime per process.
#[derive(Debug, Clone, Default)]
pub struct Update {
    pub seq: u64,
    pub full: bool,
    pub cpus: Vec<(u32, CpuState)>,
    /// The core cookie of each CPU of `cpus`, in the same order; empty when
    /// all are 0 (then every listed CPU's cookie is 0).
    pub core_cookies: Vec<u64>,
    /// Each list replaces its CPU's; with `full`, unlisted CPUs have none.
    pub tasks: Vec<CpuTaskList>,
    pub runtime: Vec<RuntimeEntry>,
}

/// What an applied report changed, from the one call that applies it
/// ([`crate::store::Store::report`]): the caller records its metrics from
/// this, once.
#[derive(Debug, Clone)]
pub struct Applied {
    /// The snapshot version published.
    pub version: u64,
    pub seq: u64,
    pub full: bool,
    /// CPU states and tasks the report carried.
    pub cpus: usize,
    pub tasks: usize,
    /// The online CPUs changed: the domain tree was rebuilt.
    pub rebuilt: bool,
    /// The cache-aware scans the report's runtime made due.
    pub scans: Vec<ScanReport>,
}

/// The CPUs online once `u` is applied over `online`.
pub fn online_after(online: &CpuMask, u: &Update) -> CpuMask {
    let mut next = *online;
    for (id, c) in &u.cpus {
        if (*id as usize) < crate::engine::cpumask::MAX_CPUS {
            if c.online {
                next.set(*id as usize);
            } else {
                next.clear(*id as usize);
            }
        }
    }
    next
}

/// Whether `u` changes which CPUs are online (a hotplug): applying it
/// rebuilds the node's domain tree, heavy work the service runs off its
/// async workers.
pub fn changes_online(online: &CpuMask, u: &Update) -> bool {
    online_after(online, u) != *online
}

/// One CPU's runnable tasks as reported; each task's affinity as a mask
/// (`None` = every CPU).
#[derive(Debug, Clone, Default)]
pub struct CpuTaskList {
    pub cpu: u32,
    pub clock: i64,
    pub tasks: Vec<(RqTask, Option<CpuMask>)>,
}

/// Runtime a process accumulated on one CPU since the previous report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RuntimeEntry {
    pub group: u64,
    pub cpu: u32,
    pub runtime_ns: u64,
    pub nr_threads: u32,
}

pub fn check_runtime(entries: &[RuntimeEntry], n: usize) -> Result<(), FieldError> {
    if entries.len() > MAX_RUNTIME_PER_CPU * n {
        return Err(FieldError::new(
            "update.runtime",
            format!(
                "{} entries exceed the limit of {} ({MAX_RUNTIME_PER_CPU} per CPU)",
                entries.len(),
                MAX_RUNTIME_PER_CPU * n
            ),
        ));
    }
    for (k, e) in entries.iter().enumerate() {
        let f = |x: &str| format!("update.runtime[{k}].{x}");
        if e.cpu as usize >= n {
            return Err(FieldError::new(
                f("cpu"),
                format!("CPU {} is not in the topology ({n} CPUs)", e.cpu),
            ));
        }
        if e.group == 0 {
            return Err(FieldError::new(
                f("group"),
                "0 is a kernel thread's; kernel threads are never accounted",
            ));
        }
        if e.runtime_ns > MAX_RUNTIME_NS {
            return Err(FieldError::new(
                f("runtime_ns"),
                format!("{} exceeds {MAX_RUNTIME_NS}", e.runtime_ns),
            ));
        }
    }
    Ok(())
}

/// The task table after `u`: checked first, so a bad list changes nothing.
/// A full update replaces every list; a delta replaces the listed CPUs', and
/// a task it lists is removed from any other CPU (it moved).
pub fn merge(
    cur: &Arc<TaskTable>,
    u: &Update,
    n: usize,
    online: &CpuMask,
    empty: &Arc<TaskTable>,
) -> Result<Arc<TaskTable>, FieldError> {
    let on_offline = (0..n).any(|c| !online.test(c) && !cur.cpus[c].is_empty());
    if u.tasks.is_empty() && (u.full || !on_offline) {
        // Nothing listed: a delta keeps the lists, a full update empties them.
        return Ok(Arc::clone(if u.full { empty } else { cur }));
    }
    check_task_totals(u)?;
    let (listed_cpus, ids) = check_task_lists(u, n, online)?;
    let mut table = carry_over(cur, u.full, n, &listed_cpus, &ids);
    // CPUs offline after this update run nothing.
    for c in 0..n {
        if !online.test(c) && !table.cpus[c].is_empty() {
            table.cpus[c] = Vec::new().into();
        }
    }
    if table.masks.len() > table.compact_at {
        compact_masks(&mut table, n);
        // Compact again only once the table has doubled.
        table.compact_at = (2 * table.masks.len()).max(256);
    }
    for l in &u.tasks {
        install_list(&mut table, l);
    }
    Ok(Arc::new(table))
}

/// The node-wide bounds: tasks listed and distinct affinity masks.
fn check_task_totals(u: &Update) -> Result<(), FieldError> {
    let listed: usize = u.tasks.iter().map(|l| l.tasks.len()).sum();
    if listed > MAX_TASKS_PER_NODE {
        return Err(FieldError::new(
            "update.tasks",
            format!("{listed} tasks exceed the limit of {MAX_TASKS_PER_NODE} per node"),
        ));
    }
    let distinct: HashSet<&CpuMask> = u
        .tasks
        .iter()
        .flat_map(|l| l.tasks.iter().filter_map(|(_, m)| m.as_ref()))
        .collect();
    if distinct.len() > MAX_MASKS_PER_NODE {
        return Err(FieldError::new(
            "update.tasks",
            format!(
                "{} distinct affinity masks exceed the limit of {MAX_MASKS_PER_NODE}",
                distinct.len()
            ),
        ));
    }
    Ok(())
}

/// Each listed CPU's rules and its tasks'; returns the CPUs listed and the
/// ids of every listed task.
fn check_task_lists(
    u: &Update,
    n: usize,
    online: &CpuMask,
) -> Result<(CpuMask, HashSet<u64>), FieldError> {
    let mut seen_cpu = CpuMask::new();
    let mut ids: HashSet<u64> = HashSet::new();
    for (k, l) in u.tasks.iter().enumerate() {
        check_cpu_list(k, l, n, online, &seen_cpu)?;
        seen_cpu.set(l.cpu as usize);
        let mut running = 0;
        for (j, (t, mask)) in l.tasks.iter().enumerate() {
            let g = |x: &str| format!("update.tasks[{k}].tasks[{j}].{x}");
            if !ids.insert(t.id) {
                return Err(FieldError::new(
                    g("id"),
                    format!("task {} is listed twice", t.id),
                ));
            }
            if let Some(m) = mask
                && !m.intersects(online)
            {
                return Err(FieldError::new(
                    g("cpus_allowed"),
                    "allows no online CPU of the node",
                ));
            }
            running += t.running as u32;
            if running > 1 {
                return Err(FieldError::new(
                    g("running"),
                    format!("a second running task on CPU {}", l.cpu),
                ));
            }
        }
    }
    Ok((seen_cpu, ids))
}

/// One listed CPU: in the topology, listed once, online if it has tasks,
/// within the per-CPU bound, with a clock in range.
fn check_cpu_list(
    k: usize,
    l: &CpuTaskList,
    n: usize,
    online: &CpuMask,
    seen: &CpuMask,
) -> Result<(), FieldError> {
    let f = |x: &str| format!("update.tasks[{k}].{x}");
    let cpu = l.cpu as usize;
    if cpu >= n {
        return Err(FieldError::new(
            f("cpu"),
            format!("CPU {cpu} is not in the topology ({n} CPUs)"),
        ));
    }
    if seen.test(cpu) {
        return Err(FieldError::new(
            f("cpu"),
            format!("CPU {cpu} is listed twice"),
        ));
    }
    if !online.test(cpu) && !l.tasks.is_empty() {
        return Err(FieldError::new(
            f("cpu"),
            format!("CPU {cpu} is offline and cannot run tasks"),
        ));
    }
    if l.tasks.len() > MAX_TASKS_PER_CPU {
        return Err(FieldError::new(
            f("tasks"),
            format!(
                "{} tasks exceed the limit of {MAX_TASKS_PER_CPU}",
                l.tasks.len()
            ),
        ));
    }
    if !(0..=MAX_CLOCK).contains(&l.clock) {
        return Err(FieldError::new(
            f("clock_task"),
            format!("{} is out of range 0..2^62", l.clock),
        ));
    }
    Ok(())
}

/// The table a report starts from: empty for a full one; for a delta the
/// current lists, less the listed tasks on CPUs the delta does not list
/// (they moved).
fn carry_over(
    cur: &Arc<TaskTable>,
    full: bool,
    n: usize,
    listed_cpus: &CpuMask,
    ids: &HashSet<u64>,
) -> TaskTable {
    if full {
        return TaskTable::empty(n);
    }
    let mut t = (**cur).clone();
    for c in 0..n {
        if !listed_cpus.test(c) && t.cpus[c].iter().any(|x| ids.contains(&x.id)) {
            let rest: Vec<RqTask> = t.cpus[c]
                .iter()
                .filter(|x| !ids.contains(&x.id))
                .cloned()
                .collect();
            t.cpus[c] = rest.into();
        }
    }
    t
}

/// Puts one CPU's reported list in the table, masks interned, head first.
fn install_list(table: &mut TaskTable, l: &CpuTaskList) {
    let cpu = l.cpu as usize;
    let mut list: Vec<RqTask> = Vec::with_capacity(l.tasks.len());
    for (t, mask) in &l.tasks {
        let mut t = t.clone();
        t.allowed = match mask {
            None => 0,
            Some(m) if *m == table.masks[0] => 0,
            Some(m) => table.intern_mask(*m),
        };
        list.push(t);
    }
    // Head = ran most recently, as cfs_tasks is kept.
    list.sort_by(|a, b| b.exec_start.cmp(&a.exec_start).then(a.id.cmp(&b.id)));
    table.cpus[cpu] = list.into();
    table.clock[cpu] = l.clock;
}

/// Drops masks no task uses any more, renumbering the rest.
fn compact_masks(t: &mut TaskTable, n: usize) {
    let mut keep = vec![CpuMask::first_n(n)];
    let mut map = vec![u32::MAX; t.masks.len()];
    map[0] = 0;
    for list in &mut t.cpus {
        let mut v = list.to_vec();
        for task in v.iter_mut() {
            let i = task.allowed as usize;
            if map[i] == u32::MAX {
                map[i] = keep.len() as u32;
                keep.push(t.masks[i]);
            }
            task.allowed = map[i];
        }
        *list = v.into();
    }
    t.masks = keep;
    t.reindex_masks();
}

/// A node's core cookies after `u` (by CPU); `None` when neither the node
/// nor the update has any, so nodes without core scheduling copy nothing.
pub fn next_core_cookies(cur: &[u64], u: &Update, n: usize) -> Option<Vec<u64>> {
    if cur.is_empty() && u.core_cookies.is_empty() {
        return None;
    }
    let mut next = if cur.is_empty() {
        vec![0; n]
    } else {
        cur.to_vec()
    };
    for (k, (id, _)) in u.cpus.iter().enumerate() {
        next[*id as usize] = u.core_cookies.get(k).copied().unwrap_or(0);
    }
    Some(next)
}

/// An update's CPU states checked against the node's hardware: each CPU
/// in the topology, listed once, in range, and every CPU in a full
/// snapshot. Returns the CPUs listed.
pub fn check_update_cpus(spec: &TopologySpec, u: &Update) -> Result<CpuMask, FieldError> {
    let n = spec.cpus.len();
    let mut seen = CpuMask::new();
    for (k, (id, c)) in u.cpus.iter().enumerate() {
        let field = |f: &str| format!("update.cpus[{k}].{f}");
        let id = *id as usize;
        if id >= n {
            return Err(FieldError::new(
                field("id"),
                format!("CPU {id} is not in the topology ({n} CPUs)"),
            ));
        }
        if seen.test(id) {
            return Err(FieldError::new(
                field("id"),
                format!("CPU {id} is listed twice"),
            ));
        }
        seen.set(id);
        c.check(spec.cpus[id].capacity)
            .map_err(|(f, msg)| FieldError::new(field(f), msg))?;
    }
    if u.full && seen.weight() != n {
        let missing = CpuMask::first_n(n).andnot(&seen);
        return Err(FieldError::new(
            "update.cpus",
            format!("a full snapshot must list every CPU; missing {missing}"),
        ));
    }
    Ok(seen)
}

/// A reported CPU, with an `idle_stamp` if it is idle and came without one.
///
/// The kernel sets `rq->idle_stamp` (its runqueue clock) whenever a CPU goes
/// idle, so an idle CPU has a non-zero one; `sched_balance_find_dst_group_cpu`
/// takes, among idle CPUs of equal exit latency (or none), the one with the
/// latest stamp *above 0*. With every stamp 0, as a reporter without
/// cpuidle information sends, it takes none and falls back to `this_cpu`:
/// concurrent claimed forks would all land there. So an idle CPU reported
/// with 0 gets the time of the report that first showed it idle (the store's
/// clock, ns since it started), kept while later reports show it still idle
/// and dropped once one shows it running. Stamps a reporter sends are kept
/// as they are; a reporter that sends some and leaves others 0 mixes two
/// clocks, as unsynchronised runqueue clocks would.
pub fn fill_idle_stamp(mut c: CpuState, prev: &CpuState, now: i64) -> CpuState {
    if c.idle_stamp == 0 && c.online && c.idle_cpu() {
        c.idle_stamp = if prev.online && prev.idle_cpu() && prev.idle_stamp != 0 {
            prev.idle_stamp
        } else {
            now
        };
    }
    c
}
