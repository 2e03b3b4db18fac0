//! Task lists and runtime reports: validation and merging into the next
//! snapshot's [`TaskTable`].

use std::collections::HashSet;
use std::sync::Arc;

use crate::engine::cpumask::CpuMask;
use crate::engine::rq::{RqTask, TaskTable};
use crate::engine::state::MAX_CLOCK;
use crate::engine::topology::FieldError;

use super::Update;

pub use fairplace_types::limits::{
    MAX_MASKS_PER_NODE, MAX_RUNTIME_NS, MAX_RUNTIME_PER_CPU, MAX_TASKS_PER_CPU, MAX_TASKS_PER_NODE,
};

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

pub(super) fn check_runtime(entries: &[RuntimeEntry], n: usize) -> Result<(), FieldError> {
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
pub(super) fn merge(
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
