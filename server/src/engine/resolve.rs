//! Request fields into the engine's inputs, with one set of rules for both
//! formats that carry them: the JSON scenarios (`offline/scenario/`) and the
//! protobuf requests (`service/convert/request.rs`). A format only
//! extracts its fields (types, ranges of the numbers it parses, CPU ids
//! within the node) and names them; what a field means against the node
//! (prev_cpu required for a wakeup, CPUs online, the domain that holds
//! `src`, flag names, defaults taken from the state) is decided here once,
//! and every error names the field as the format spells it.

use crate::engine::balance::migrate::{IdleType, MigrateEnv, MigrationType, lbf};
use crate::engine::cpumask::CpuMask;
use crate::engine::decision::Kind;
use crate::engine::state::{MAX_CLOCK, MAX_SIGNAL, NodeState, Task};
use crate::engine::topology::{FieldError, Topology};
use fairplace_types::quote::quote;

/// `recent_used_cpu` as a request gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recent {
    /// Not given: the task's previous CPU.
    Unset,
    /// Given as none.
    NoCpu,
    Cpu(usize),
}

/// A task's CPUs as a request gives them (ids already within the node).
#[derive(Debug, Clone, Copy)]
pub struct TaskCpus {
    pub prev_cpu: Option<usize>,
    pub recent_used_cpu: Recent,
}

/// The task: `t` carries every other field as extracted; a wakeup needs
/// its `prev_cpu`, any other request puts the task on `task_cpu` (the
/// forking or exec'ing CPU, or a migration's source). Field names are
/// `task.NAME`.
pub fn task(t: &mut Task, cpus: TaskCpus, wakeup: bool, task_cpu: usize) -> Result<(), FieldError> {
    t.prev_cpu = match (wakeup, cpus.prev_cpu) {
        (true, Some(p)) => p,
        (true, None) => return Err(FieldError::new("task.prev_cpu", "is required for a wakeup")),
        (false, _) => task_cpu,
    };
    t.recent_used_cpu = match cpus.recent_used_cpu {
        Recent::Unset => Some(t.prev_cpu),
        Recent::NoCpu => None,
        Recent::Cpu(c) => Some(c),
    };
    t.check()
        .map_err(|(f, msg)| FieldError::new(format!("task.{f}"), msg))
}

/// The CPU a placement is asked on (`field` names it): online, and for an
/// exec running the task that execs.
pub fn this_cpu(
    kind: Kind,
    cpu: usize,
    field: &str,
    topo: &Topology,
    st: &NodeState,
) -> Result<usize, FieldError> {
    if !topo.online.test(cpu) {
        return Err(FieldError::new(field, format!("CPU {cpu} is offline")));
    }
    let rq = &st.cpus[cpu];
    if kind == Kind::Exec && (rq.nr_running < 1 || rq.curr_is_idle) {
        return Err(FieldError::new(
            field,
            format!("CPU {cpu} runs no task in the reported state, so no task can exec there"),
        ));
    }
    Ok(cpu)
}

/// The two CPUs of a migration check: both online, and not the same.
/// `field` spells a bare field name as the format does.
pub fn migrate_cpus(
    src: usize,
    dst: usize,
    field: impl Fn(&str) -> String,
    topo: &Topology,
) -> Result<(), FieldError> {
    for (f, c) in [("src_cpu", src), ("dst_cpu", dst)] {
        if !topo.online.test(c) {
            return Err(FieldError::new(field(f), format!("CPU {c} is offline")));
        }
    }
    if src == dst {
        return Err(FieldError::new(
            field("dst_cpu"),
            "must differ from src_cpu",
        ));
    }
    Ok(())
}

/// A migration check's fields as a request gives them (CPU ids and masks
/// already within the node).
#[derive(Debug, Clone)]
pub struct MigrateFields<'a> {
    pub src_cpu: usize,
    pub dst_cpu: usize,
    /// The balancing domain's level name; `None`: the lowest of `dst`'s
    /// domains that holds `src`.
    pub sd_level: Option<&'a str>,
    /// Flag names; `None` when not given (`ALL_PINNED`, as a pass starts).
    pub flags: Option<Vec<&'a str>>,
    pub dst_group: Option<CpuMask>,
    pub env_cpus: Option<CpuMask>,
    pub idle: IdleType,
    pub migration_type: MigrationType,
    pub nr_balance_failed: u32,
    pub cache_nice_tries: Option<u32>,
    pub throttled: bool,
    /// `None`: the destination's as reported.
    pub dst_cfs_nr_queued: Option<i64>,
    pub now: i64,
}

/// The engine's migration environment; `field` spells a bare field name as
/// the format does.
pub fn migrate_env(
    f: MigrateFields<'_>,
    field: impl Fn(&str) -> String,
    topo: &Topology,
    st: &NodeState,
) -> Result<MigrateEnv, FieldError> {
    let (src, dst) = (f.src_cpu, f.dst_cpu);
    migrate_cpus(src, dst, &field, topo)?;
    let chain = topo.domains(dst);
    let sd = match f.sd_level {
        Some(name) => topo.domain_by_name(dst, name).ok_or_else(|| {
            let names: Vec<String> = chain.iter().map(|d| d.level.to_string()).collect();
            FieldError::new(
                field("sd_level"),
                format!(
                    "{} is not a domain of CPU {dst} (it has {})",
                    quote(name),
                    names.join(", ")
                ),
            )
        })?,
        None => chain
            .iter()
            .position(|d| topo.span(d.span).test(src))
            .ok_or_else(|| {
                FieldError::new(
                    field("src_cpu"),
                    format!("no domain of CPU {dst} contains CPU {src}"),
                )
            })?,
    };
    let dom = &chain[sd];
    let dst_cfs_nr_queued = match f.dst_cfs_nr_queued {
        None => st.cpus[dst].cfs_h_nr_queued,
        Some(q) if (0..=MAX_SIGNAL).contains(&q) => q as u32,
        Some(q) => {
            return Err(FieldError::new(
                field("dst_cfs_nr_queued"),
                format!("{q} is out of range 0..{MAX_SIGNAL}"),
            ));
        }
    };
    if !(0..=MAX_CLOCK).contains(&f.now) {
        return Err(FieldError::new(
            field("now"),
            format!("{} is out of range 0..2^62", f.now),
        ));
    }
    Ok(MigrateEnv {
        src_cpu: src,
        dst_cpu: dst,
        sd_cpu: dst,
        sd,
        dst_group: f.dst_group.unwrap_or(*topo.span(dom.groups[0])),
        env_cpus: f.env_cpus.unwrap_or(*topo.span(dom.span)),
        idle: f.idle,
        migration_type: f.migration_type,
        flags: flag_bits(f.flags.as_deref(), &field)?,
        nr_balance_failed: f.nr_balance_failed,
        cache_nice_tries: f.cache_nice_tries,
        throttled: f.throttled,
        dst_cfs_nr_queued,
        now: f.now,
    })
}

/// `env->flags` from their names (`flags[i]` names a bad one).
fn flag_bits(names: Option<&[&str]>, field: impl Fn(&str) -> String) -> Result<u32, FieldError> {
    let Some(names) = names else {
        return Ok(lbf::ALL_PINNED);
    };
    let mut bits = 0;
    for (i, name) in names.iter().enumerate() {
        bits |= lbf::NAMES
            .iter()
            .find(|(_, n)| n == name)
            .map(|(b, _)| *b)
            .ok_or_else(|| {
                FieldError::new(
                    field(&format!("flags[{i}]")),
                    format!("{} is not a balance flag", quote(name)),
                )
            })?;
    }
    Ok(bits)
}
