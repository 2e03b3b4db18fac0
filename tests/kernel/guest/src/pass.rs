//! Whole load-balance passes from the live kernel: one `sched_balance_rq()`
//! call each, recorded from inside.
//!
//! Entry probes (one event per runqueue, `fpb/bqK`) read what the pass's
//! search reads of every CPU (`nr_running`, the root cfs_rq's counts and
//! averages, `cpu_capacity`, the current task, a pending remote wakeup),
//! and the call's arguments: the balancing CPU, the domain (its span, its
//! `nr_balance_failed`, and each group's span, `sgc->capacity` and
//! `sgc->imbalance`) and the idle type. The `can_migrate_task()` probes of
//! `migrate` fire inside the pass for every task `detach_tasks()` looks at:
//! they give the busiest runqueue (`env->src_cpu`), the migration type and
//! imbalance the search set, and each task the walk read, in the order it
//! read them, with what the walk decides on (`task_h_load()`'s inputs, the
//! utilisation, the verdict's inputs). `sched_migrate_task` names the
//! tasks detached. Return probes (`fpb/bqrK`) read every runqueue again.
//!
//! The search reads the other CPUs without their locks, so a pass is
//! evidence of a race when a CPU of the domain that the pass itself did
//! not touch ended it with other values than it started with, when the
//! balancing CPU or a source gained or lost a task the pass did not move,
//! when the busiest runqueue's task count changed before it was locked, or
//! when a task migrated during the call other than by its walk (an
//! interrupt's wakeup on the balancing CPU).
//! Such a pass is still printed, with the reasons under
//! `generator.raced`; the comparison sets it aside.
//!
//! Each pass becomes a `balance` scenario line `LB {json}` with the
//! kernel's outcome under `expected`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::fs;

use crate::migrate::{
    self, Enums, Fields, WORKLOADS, enum_name, level_of, mask_list, take_spread, task_fields,
};
use crate::probe::{Btf, add_event, event_fields, kallsym, rq_fields, trace_cpu};
use crate::{Lcg, TRACE};

/// Groups read per domain (the largest domain here has eight).
const MAX_GROUPS: usize = 8;
/// `LBF_ACTIVE_LB`: a call made by the stopper, outside any pass.
const LBF_ACTIVE_LB: i64 = 0x10;
/// `UTIL_AVG_UNCHANGED`, the flag in `util_est`'s top bit.
const UTIL_AVG_UNCHANGED: i64 = 0x8000_0000;
/// The runqueue fields the comparison of entry and return looks at.
const RQ_KEYS: [&str; 10] = ["nr", "tp", "q", "i", "d", "l", "r", "u", "e", "cp"];

/// Defines the entry and return probes on `sched_balance_rq`.
fn define(nr: usize) -> Result<(), String> {
    let btf = Btf::load().ok_or("no BTF")?;
    let syms = fs::read_to_string("/proc/kallsyms").map_err(|e| e.to_string())?;
    if !syms.lines().any(|l| l.ends_with(" sched_balance_rq")) {
        return Err("sched_balance_rq is not a symbol of this kernel (inlined)".into());
    }
    let rq = kallsym(&syms, "runqueues").ok_or("no runqueues symbol")?;
    let o = |s: &str, m: &str| btf.off(s, m).ok_or(format!("no {s}.{m} in BTF"));
    let mut fields = rq_fields(&btf)?;
    fields.push(("cap", o("rq", "cpu_capacity")?, "u64"));
    let (curr, pid) = (o("rq", "curr")?, o("task_struct", "pid")?);
    let (span, nbf, groups) = (
        o("sched_domain", "span")?,
        o("sched_domain", "nr_balance_failed")?,
        o("sched_domain", "groups")?,
    );
    let (next, mask, sgc) = (
        o("sched_group", "next")?,
        o("sched_group", "cpumask")?,
        o("sched_group", "sgc")?,
    );
    let (cap, imb) = (
        o("sched_group_capacity", "capacity")?,
        o("sched_group_capacity", "imbalance")?,
    );
    for k in 0..nr {
        let pc = format!("@__per_cpu_offset+{}", 8 * k);
        let at = |off: usize| format!("+{}({pc})", rq + off as u64);
        let mut rqf = String::new();
        for (n, off, ty) in &fields {
            let _ = write!(rqf, " {n}={}:{ty}", at(*off));
        }
        let _ = write!(rqf, " cp=+{pid}({}):s32", at(curr));
        let mut entry = format!("p:fpb/bq{k} sched_balance_rq");
        let mut ret = format!("r:fpb/bqr{k} sched_balance_rq");
        if k == 0 {
            let _ = write!(
                entry,
                " cpu=$arg1:s32 idle=$arg4:s32 sp=+{span}($arg3):u64 nbf=+{nbf}($arg3):u32"
            );
            // The group ring, from the local group on.
            let mut g = format!("+{groups}($arg3)");
            for j in 0..MAX_GROUPS {
                let _ = write!(
                    entry,
                    " gp{j}={g}:x64 gm{j}=+{mask}({g}):u64 gc{j}=+{cap}(+{sgc}({g})):u64 gi{j}=+{imb}(+{sgc}({g})):s32"
                );
                g = format!("+{next}({g})");
            }
            ret += " ret=$retval:s32";
        }
        add_event(TRACE, &(entry + &rqf))?;
        add_event(TRACE, &(ret + &rqf))?;
    }
    Ok(())
}

/// Records `quota` passes (an equal share per seed) over rounds of the
/// balancing workloads; prints `LB` lines, `DROP balance` lines for passes
/// that cannot be recorded and `LBDONE n`.
pub fn run(topo: &str, nr: usize, seeds: &[u64], quota: usize) {
    let _ = fs::write(format!("{TRACE}/events/enable"), "0");
    let en = match migrate::define().and_then(|en| define(nr).map(|()| en)) {
        Ok(en) => en,
        Err(e) => {
            println!("FAIL no load-balance probes: {e}");
            println!("LBDONE 0");
            return;
        }
    };
    // Every pass writes two events per CPU. A round keeps its first 32 MiB
    // of events (new ones are dropped when a CPU's buffer fills: the start
    // of a round, when the pile is spread, is the part worth keeping), and
    // reading more under TCG costs more than it gives.
    let _ = fs::write(format!("{TRACE}/options/overwrite"), "0");
    let _ = fs::write(
        format!("{TRACE}/buffer_size_kb"),
        (32768 / nr.max(1)).max(512).to_string(),
    );
    for ev in ["fpm", "fpb", "sched/sched_migrate_task"] {
        let _ = fs::write(format!("{TRACE}/events/{ev}/enable"), "1");
    }
    let mut made = 0;
    let mut id = 0;
    for (k, &seed) in seeds.iter().enumerate() {
        let share = quota / seeds.len() + (k < quota % seeds.len()) as usize;
        let mut rng = Lcg(seed
            .wrapping_mul(1181783497276652981)
            .wrapping_add(2654435769));
        let (mut got, mut rounds) = (0, 0);
        while got < share && rounds < 200 {
            rounds += 1;
            let w = WORKLOADS[rng.below(WORKLOADS.len())];
            let text = migrate::round(&mut rng, nr, w);
            let cost = fs::read_to_string(migrate::MIGRATION_COST)
                .ok()
                .and_then(|s| s.trim().parse::<i64>().ok())
                .unwrap_or(500_000);
            let mut by_kind: BTreeMap<String, Vec<String>> = BTreeMap::new();
            for p in passes(&text, nr) {
                match scenario(topo, nr, &en, &p, cost) {
                    Ok((kind, body)) => by_kind.entry(kind).or_default().push(body),
                    Err(why) => println!("DROP balance {why}"),
                }
            }
            // At most a fifth of the share from one round, in turn from
            // each kind of pass (most passes find nothing to do).
            let want = (share - got).min(share.div_ceil(5));
            let by_kind: BTreeMap<&str, Vec<String>> = by_kind
                .iter()
                .map(|(k, v)| (k.as_str(), v.clone()))
                .collect();
            for body in take_spread(by_kind, want) {
                id += 1;
                println!(
                    "LB {{\"name\":\"b{id}\",\"kernel\":\"6.12\",\"generator\":{{\"seed\":{seed},\"workload\":\"{}\",\"source\":\"kprobe\",{body}}}",
                    w.name()
                );
                got += 1;
            }
        }
        made += got;
    }
    for ev in ["fpm", "fpb", "sched/sched_migrate_task"] {
        let _ = fs::write(format!("{TRACE}/events/{ev}/enable"), "0");
    }
    let _ = fs::write(migrate::MIGRATION_COST, "500000");
    println!("LBDONE {made}");
}

/// One `sched_balance_rq()` call as the trace shows it.
#[derive(Default)]
struct Pass {
    /// Per runqueue, the entry and the return probe's reading.
    at: Vec<Option<Fields>>,
    end: Vec<Option<Fields>>,
    /// The `can_migrate_task()` calls inside the pass (entry, return).
    calls: Vec<(Fields, Fields)>,
    open_call: Option<Fields>,
    /// `sched_migrate_task` inside the pass: (pid, from, to).
    moved: Vec<(i64, i64, i64)>,
}

/// The event name of a trace line (`bq3`, `cmr`, `sched_migrate_task`).
fn event_name(l: &str) -> Option<&str> {
    let rest = &l[l.find(']')?..];
    let after = &rest[rest.find(": ")? + 2..];
    after.split(':').next()
}

/// The complete passes of a trace: every call whose entry and return
/// events were all written. A call runs with preemption off and is never
/// nested, so a CPU's events between its entry and return are its own.
fn passes(t: &str, nr: usize) -> Vec<Pass> {
    let mut open: BTreeMap<i64, Pass> = BTreeMap::new();
    let mut out = Vec::new();
    for l in t.lines() {
        let (Some(cpu), Some(name)) = (trace_cpu(l), event_name(l)) else {
            continue;
        };
        let index = |p: &str| {
            name.strip_prefix(p)?
                .parse::<usize>()
                .ok()
                .filter(|&k| k < nr)
        };
        if let Some(k) = index("bqr") {
            if let Some(p) = open.get_mut(&cpu) {
                p.end[k] = Some(event_fields(l));
                if p.end.iter().all(Option::is_some) {
                    out.push(open.remove(&cpu).expect("open"));
                }
            }
        } else if let Some(k) = index("bq") {
            // The entry events of one call come together, in an order of
            // the kprobes layer's choosing: one already read starts a call.
            let p = open.entry(cpu).or_default();
            if p.at.len() != nr || p.at[k].is_some() || p.open_call.is_some() || !p.calls.is_empty()
            {
                *p = Pass {
                    at: vec![None; nr],
                    end: vec![None; nr],
                    ..Pass::default()
                };
            }
            p.at[k] = Some(event_fields(l));
        } else if let Some(p) = open.get_mut(&cpu) {
            match name {
                "cm" => p.open_call = Some(event_fields(l)),
                "cmr" => {
                    if let Some(a) = p.open_call.take() {
                        p.calls.push((a, event_fields(l)));
                    }
                }
                "sched_migrate_task" => {
                    let f = event_fields(l);
                    if let (Some(&pid), Some(&from), Some(&to)) =
                        (f.get("pid"), f.get("orig_cpu"), f.get("dest_cpu"))
                    {
                        p.moved.push((pid, from, to));
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// The kind of a pass (for the sampling) and its scenario body (from
/// `generator`'s race fields on).
fn scenario(
    topo: &str,
    nr: usize,
    en: &Enums,
    p: &Pass,
    cost: i64,
) -> Result<(String, String), String> {
    let at: Vec<&Fields> =
        p.at.iter()
            .map(|f| f.as_ref().ok_or("an entry event is missing"))
            .collect::<Result<_, _>>()?;
    let end: Vec<&Fields> = p
        .end
        .iter()
        .map(|f| f.as_ref().ok_or("a return event is missing"))
        .collect::<Result<_, _>>()?;
    let g = |m: &Fields, k: &str| m.get(k).copied().ok_or(format!("no field {k}"));
    let a0 = at[0];
    let cpu = g(a0, "cpu")? as usize;
    if cpu >= nr {
        return Err(format!("balancing CPU {cpu}"));
    }
    let sp = g(a0, "sp")? as u64 & (u64::MAX >> (64 - nr.min(64)));
    let level =
        level_of(cpu, sp as i64, nr).ok_or("the domain's span is none of the CPU's domains")?;
    let idle = enum_name(&en.idle, g(a0, "idle")?)?;

    // The walk: the calls of this pass (not the stopper's), the sources in
    // order, each source's tasks in the order first read.
    let calls: Vec<&(Fields, Fields)> = p
        .calls
        .iter()
        .filter(|(a, _)| a.get("fl").is_some_and(|f| f & LBF_ACTIVE_LB == 0))
        .collect();
    let mut busiest: Vec<i64> = Vec::new();
    let mut lists: BTreeMap<i64, (i64, Vec<(i64, String)>)> = BTreeMap::new();
    let mut raced: Vec<String> = Vec::new();
    for (a, _) in &calls {
        let src = g(a, "src")?;
        if busiest.last() != Some(&src) {
            busiest.push(src);
            // The search read the source unlocked; the walk reads it locked.
            let before = at.get(src as usize).ok_or("source CPU")?;
            if !lists.contains_key(&src) && g(a, "sn")? != g(before, "nr")? {
                raced.push(format!("busiest CPU {src} changed before it was locked"));
            }
        }
        let pid = g(a, "pid")?;
        let (_, list) = lists.entry(src).or_insert((g(a, "now")?, Vec::new()));
        if list.iter().any(|(id, _)| *id == pid) {
            continue;
        }
        let (facts, _) = task_fields(en, a, nr)?;
        let load = task_h_load(en, a)?;
        list.push((
            pid,
            format!(
                "{{\"id\":{pid},{facts},\"load_avg\":{load},\"util_avg\":{},\"util_est\":{},\"runnable_avg\":{}}}",
                g(a, "tu")?,
                g(a, "tue")? & !UTIL_AVG_UNCHANGED,
                g(a, "tr")?
            ),
        ));
    }
    // The walk's detaches move tasks off the sources it walked; any other
    // migration written on this CPU during the call is an interrupt's
    // wakeup placing a task elsewhere: concurrent work, as is a count of
    // detaches the call's return value does not confirm.
    let (walked, other): (Vec<_>, Vec<_>) = p.moved.iter().partition(|m| busiest.contains(&m.1));
    let detached: Vec<String> = walked
        .iter()
        .map(|(pid, from, to)| format!("{{\"id\":{pid},\"src_cpu\":{from},\"dst_cpu\":{to}}}"))
        .collect();
    let ret = g(end[0], "ret")?;
    if !other.is_empty() || ret != walked.len() as i64 {
        raced.push("a task migrated during the pass outside its walk".into());
    }
    raced.extend(changed_cpus(nr, cpu, sp, &at, &end, p, &busiest));

    let mut cpus = String::new();
    for (k, f) in at.iter().enumerate() {
        let n = g(f, "nr")?;
        let _ = write!(
            cpus,
            "{}{{\"id\":{k},\"nr_running\":{n},\"h_nr_idle\":{},\"nr_delayed\":{},\"cfs_h_nr_queued\":{},\"curr_is_idle\":{},\"ttwu_pending\":{},\"load_avg\":{},\"runnable_avg\":{},\"util_avg\":{},\"util_est\":{},\"capacity\":{}}}",
            if k > 0 { "," } else { "" },
            g(f, "i")?.min(n),
            g(f, "d")?.min(n),
            g(f, "q")?,
            g(f, "cp")? == 0,
            g(f, "tp")? != 0,
            g(f, "l")?,
            g(f, "r")?,
            g(f, "u")?,
            g(f, "e")?,
            g(f, "cap")?.clamp(1, 1024),
        );
    }
    let (marked, capacity_note) = groups(a0, &at, nr)?;
    let sgc = if marked.is_empty() {
        String::new()
    } else {
        format!(",\"sgc_imbalance\":{{\"{level}\":[{}]}}", marked.join(","))
    };
    let mut rq_tasks = Vec::new();
    for (src, (clock, list)) in &lists {
        // Most recently run first: the walk reads from the tail.
        let tasks: Vec<&str> = list.iter().rev().map(|(_, t)| t.as_str()).collect();
        rq_tasks.push(format!(
            "\"{src}\":{{\"clock_task\":{clock},\"tasks\":[{}]}}",
            tasks.join(",")
        ));
    }
    let first = calls.first().map(|(a, _)| a);
    let (mt, imb) = match first {
        Some(a) => (
            format!("\"{}\"", enum_name(&en.migration, g(a, "mt")?)?),
            g(a, "im")?.to_string(),
        ),
        None => ("null".into(), "null".into()),
    };
    let kind = match (walked.is_empty(), calls.is_empty()) {
        (false, _) => format!("detached/{}/{idle}", mt.trim_matches('"')),
        (true, false) => format!("refused/{idle}"),
        (true, true) => format!("balanced/{idle}"),
    };
    let raced_json: Vec<String> = raced.iter().map(|r| format!("\"{r}\"")).collect();
    // The walk as the kernel made it, for reading a disagreement: each
    // call's task, source, destination, verdict and imbalance left.
    let walk: Vec<String> = calls
        .iter()
        .map(|(a, b)| {
            let v = |m: &Fields, k: &str| m.get(k).copied().unwrap_or(-1);
            format!(
                "[{},{},{},{},{}]",
                v(a, "pid"),
                v(a, "src"),
                v(a, "dst"),
                v(b, "ret"),
                v(a, "im")
            )
        })
        .collect();
    let body = format!(
        "\"raced\":[{}],\"sgc_capacity\":[{}],\"walk\":[{}]}},\"topology\":{topo},\"system\":{{\"migration_cost_ns\":{cost}}},\"cpus\":[{cpus}]{sgc},\"rq_tasks\":{{{}}},\"request\":{{\"kind\":\"balance\",\"cpu\":{cpu},\"sd_level\":\"{level}\",\"idle\":\"{idle}\",\"nr_balance_failed\":{}}},\"expected\":{{\"busiest\":[{}],\"migration_type\":{mt},\"imbalance\":{imb},\"detached\":[{}]}}",
        raced_json.join(","),
        capacity_note.join(","),
        walk.join(","),
        rq_tasks.join(","),
        g(a0, "nbf")?,
        busiest
            .iter()
            .map(i64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        detached.join(","),
    );
    Ok((kind, body))
}

/// `task_h_load()` as the walk computes it right after the call: the
/// task's load scaled by its cfs_rq's `h_load`, which is recomputed (for
/// the root group: the cfs_rq's own load) unless it was already computed
/// in this jiffy.
fn task_h_load(en: &Enums, a: &Fields) -> Result<i64, String> {
    let g = |k: &str| a.get(k).copied().ok_or(format!("no field {k}"));
    let root = g("cq")? as u64 == (g("srq")? as u64).wrapping_add(en.rq_cfs);
    let fresh = g("hu")? == g("jf")?;
    let h = match (fresh, root) {
        (true, _) => g("hl")?,
        (false, true) => g("cl")?,
        (false, false) => return Err("a task of a child group with a stale h_load".into()),
    };
    Ok(g("tl")? * h / (g("cl")? + 1))
}

/// The CPUs whose state changed during the pass other than by the pass:
/// every field of a CPU of the domain the pass did not touch, the task
/// count of the balancing CPU and of each source.
fn changed_cpus(
    nr: usize,
    cpu: usize,
    span: u64,
    at: &[&Fields],
    end: &[&Fields],
    p: &Pass,
    busiest: &[i64],
) -> Vec<String> {
    let mut touched: BTreeSet<usize> = busiest.iter().map(|&c| c as usize).collect();
    touched.insert(cpu);
    for &(_, from, to) in &p.moved {
        touched.insert(from as usize);
        touched.insert(to as usize);
    }
    let mut out = Vec::new();
    for x in (0..nr).filter(|&x| span >> x & 1 == 1) {
        let (a, b) = (at[x], end[x]);
        if !touched.contains(&x) {
            if RQ_KEYS.iter().any(|k| a.get(*k) != b.get(*k)) {
                out.push(format!("rq {x} changed during the pass"));
            }
            continue;
        }
        let gained = p.moved.iter().filter(|m| m.2 as usize == x).count() as i64;
        let lost = p.moved.iter().filter(|m| m.1 as usize == x).count() as i64;
        let (na, nb) = (a.get("nr").copied(), b.get("nr").copied());
        if na.zip(nb).is_none_or(|(na, nb)| na + gained - lost != nb) {
            out.push(format!(
                "rq {x} gained or lost a task the pass did not move"
            ));
        }
    }
    out
}

/// The domain's groups from the local one on: the spans whose
/// `sgc->imbalance` is set (as cpulist strings) and, for each group whose
/// `sgc->capacity` is not the sum of its CPUs' capacities, a note.
fn groups(a0: &Fields, at: &[&Fields], nr: usize) -> Result<(Vec<String>, Vec<String>), String> {
    let g = |k: String| a0.get(&k).copied().ok_or(format!("no field {k}"));
    let first = g("gp0".into())?;
    let (mut marked, mut notes) = (Vec::new(), Vec::new());
    for j in 0..MAX_GROUPS {
        if j > 0 && g(format!("gp{j}"))? == first {
            break;
        }
        let m = g(format!("gm{j}"))?;
        let list = mask_list(m, nr);
        if g(format!("gi{j}"))? != 0 {
            marked.push(format!("\"{list}\""));
        }
        let sum: i64 = (0..nr)
            .filter(|&c| (m as u64) >> c & 1 == 1)
            .map(|c| at[c].get("cap").copied().unwrap_or(0))
            .sum();
        let sgc = g(format!("gc{j}"))?;
        if sgc != sum {
            notes.push(format!(
                "{{\"group\":\"{list}\",\"sgc\":{sgc},\"sum\":{sum}}}"
            ));
        }
    }
    Ok((marked, notes))
}
