//! `can_migrate_task()` verdicts from the live kernel.
//!
//! The periodic, idle and newly idle balancers ask `can_migrate_task()`
//! about every task they consider pulling. An entry probe reads everything
//! the 6.12 verdict depends on, from the task (`cpus_ptr`, `on_cpu`, its
//! policy, `se.exec_start`, whether it is its cfs_rq's next buddy, whether it
//! is a per-CPU kthread) and from the balancer's `struct lb_env` (the
//! domain's span, `nr_balance_failed` and `cache_nice_tries`, the source and
//! destination CPUs, `dst_grpmask`, `cpus`, the idle type, the flags, the
//! migration type, the source runqueue's task clock, the destination's
//! `nr_running`); a return probe reads the verdict, the flags and
//! `new_dst_cpu` after the call, and the task's schedstats counters, whose
//! increments name the check that decided (`nr_failed_migrations_affine`,
//! `_running`, `_hot`), and `p->sched_task_hot`, which 6.12.118 sets when it
//! allows a hot task because the domain failed too often (the forced
//! migration is counted later, in `detach_task()`). Both run inside the call,
//! with the source runqueue locked and interrupts off, so the inputs are
//! the ones the verdict read (only the destination's `nr_running`, read
//! unlocked by `task_hot()`'s buddy test, can move in between).
//!
//! The parts of 6.12's verdict the format does not model are shown not to
//! apply: NUMA balancing is switched off (`migrate_degrades_locality()`
//! returns -1), no task group has a bandwidth limit (`throttled_lb_pair()`
//! is false), and core scheduling is never enabled (cookies match).
//!
//! Each verdict becomes a `can_migrate` scenario line `MIG {json}` with the
//! kernel's answer under `expected`.

use std::collections::BTreeMap;
use std::fs;
use std::time::Duration;

use crate::probe::{Btf, add_event, event_fields, kallsym, trace_cpu};
use crate::{Lcg, TRACE, cpulist_str, pin};

/// `env->flags` bits (`LBF_*` in kernel/sched/fair.c), in the format's order.
const FLAGS: [(u32, &str); 5] = [
    (0x01, "ALL_PINNED"),
    (0x02, "NEED_BREAK"),
    (0x04, "DST_PINNED"),
    (0x08, "SOME_PINNED"),
    (0x10, "ACTIVE_LB"),
];
const LBF_DST_PINNED: u32 = 0x04;
const LBF_ACTIVE_LB: u32 = 0x10;
/// `PF_KTHREAD`, and `KTHREAD_IS_PER_CPU`'s bit in `struct kthread`'s flags.
const PF_KTHREAD: u64 = 0x0020_0000;
const KTHREAD_IS_PER_CPU: u64 = 1 << 0;

/// The workloads a round of balancing runs, one per round by the seed.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Workload {
    /// More unpinned spinners than CPUs, all started on one CPU.
    Pile,
    /// Spinners started on one CPU, each allowed on two or three CPUs.
    Pinned,
    /// A pile with a third of the spinners SCHED_IDLE and mixed nice levels.
    IdleMix,
    /// Tasks that run 2 ms and sleep 1 ms (recently run: cache hot), piled.
    Sleepers,
}

pub(crate) const WORKLOADS: [Workload; 4] = [
    Workload::Pile,
    Workload::Pinned,
    Workload::IdleMix,
    Workload::Sleepers,
];

impl Workload {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Workload::Pile => "pile",
            Workload::Pinned => "pinned",
            Workload::IdleMix => "idle-mix",
            Workload::Sleepers => "sleepers",
        }
    }
}

/// What the records need besides the probes: the enums' values as this
/// kernel numbers them.
pub(crate) struct Enums {
    pub(crate) idle: [(i64, &'static str); 3],
    pub(crate) migration: [(i64, &'static str); 4],
    /// Byte offset of `se` in `task_struct` (the next-buddy test).
    se: u64,
    /// The bit of `sched_task_hot` in the byte the return probe reads.
    hot_bit: u32,
    /// Byte offset of the root `cfs_rq` in `struct rq` (a task's
    /// `se.cfs_rq` is it when the task is in the root group).
    pub(crate) rq_cfs: u64,
}

/// Defines the two probes (`fpm/cm`, `fpm/cmr`) and switches off what the
/// format does not model. Returns the enums the records are named by.
pub(crate) fn define() -> Result<Enums, String> {
    let btf = Btf::load().ok_or("no BTF")?;
    let syms = fs::read_to_string("/proc/kallsyms").map_err(|e| e.to_string())?;
    if !syms.lines().any(|l| l.ends_with(" can_migrate_task")) {
        return Err("can_migrate_task is not a symbol of this kernel (inlined)".into());
    }
    kallsym(&syms, "sysctl_sched_migration_cost").ok_or("no sysctl_sched_migration_cost")?;
    let o = |s: &str, m: &str| btf.off(s, m).ok_or(format!("no {s}.{m} in BTF"));
    let e = |n: &str| btf.enum_value(n).ok_or(format!("no enumerator {n} in BTF"));
    let (se, stats) = (o("task_struct", "se")?, o("task_struct", "stats")?);
    let st = |m: &str| Ok::<usize, String>(stats + o("sched_statistics", m)?);
    // 6.12.118 counts a forced migration in detach_task(): the call only
    // sets `p->sched_task_hot` (a bitfield) when it allows a hot task.
    let hot_bit = btf
        .bit_off("task_struct", "sched_task_hot")
        .ok_or("no task_struct.sched_task_hot in BTF")?;
    let counters = [
        ("fa", st("nr_failed_migrations_affine")?),
        ("fr", st("nr_failed_migrations_running")?),
        ("fh", st("nr_failed_migrations_hot")?),
    ];
    let (sd, src_rq, dst_rq) = (
        o("lb_env", "sd")?,
        o("lb_env", "src_rq")?,
        o("lb_env", "dst_rq")?,
    );
    let (fl, nd) = (o("lb_env", "flags")?, o("lb_env", "new_dst_cpu")?);
    let nr = o("rq", "nr_running")?;
    let mut entry = format!(
        "p:fpm/cm can_migrate_task p=$arg1:x64 pid=+{}($arg1):s32 pol=+{}($arg1):u32 pf=+{}($arg1):u32 kf=+{}(+{}($arg1)):u64 oc=+{}($arg1):s32 am=+0(+{}($arg1)):u64 es=+{}($arg1):u64 nx=+{}(+{}($arg1)):x64",
        o("task_struct", "pid")?,
        o("task_struct", "policy")?,
        o("task_struct", "flags")?,
        o("kthread", "flags")?,
        o("task_struct", "worker_private")?,
        o("task_struct", "on_cpu")?,
        o("task_struct", "cpus_ptr")?,
        se + o("sched_entity", "exec_start")?,
        o("cfs_rq", "next")?,
        se + o("sched_entity", "cfs_rq")?,
    );
    entry += &format!(
        " sp=+{}(+{sd}($arg2)):u64 nbf=+{}(+{sd}($arg2)):u32 cnt=+{}(+{sd}($arg2)):u32 src=+{}($arg2):s32 dst=+{}($arg2):s32 gm=+0(+{}($arg2)):u64 ec=+0(+{}($arg2)):u64 nd=+{nd}($arg2):s32 idle=+{}($arg2):s32 fl=+{fl}($arg2):u32 mt=+{}($arg2):s32 now=+{}(+{src_rq}($arg2)):u64 sn=+{nr}(+{src_rq}($arg2)):u32 dn=+{nr}(+{dst_rq}($arg2)):u32 mc=@sysctl_sched_migration_cost:u32",
        o("sched_domain", "span")?,
        o("sched_domain", "nr_balance_failed")?,
        o("sched_domain", "cache_nice_tries")?,
        o("lb_env", "src_cpu")?,
        o("lb_env", "dst_cpu")?,
        o("lb_env", "dst_grpmask")?,
        o("lb_env", "cpus")?,
        o("lb_env", "idle")?,
        o("lb_env", "migration_type")?,
        o("rq", "clock_task")?,
    );
    // What a whole pass's replay needs besides the verdict (`pass`): the
    // task's PELT averages, task_h_load()'s inputs (its cfs_rq, that
    // cfs_rq's h_load, the jiffy it was computed in, its load), the
    // env's imbalance and the source runqueue.
    let (avg, cfs_avg) = (se + o("sched_entity", "avg")?, o("cfs_rq", "avg")?);
    let sa = |m: &str| o("sched_avg", m);
    let cq = format!("+{}($arg1)", se + o("sched_entity", "cfs_rq")?);
    entry += &format!(
        " tl=+{}($arg1):u64 tu=+{}($arg1):u64 tue=+{}($arg1):u32 tr=+{}($arg1):u64 cq={cq}:x64 hl=+{}({cq}):u64 hu=+{}({cq}):u64 cl=+{}({cq}):u64 jf=@jiffies:u64 im=+{}($arg2):s64 srq=+{src_rq}($arg2):x64",
        avg + sa("load_avg")?,
        avg + sa("util_avg")?,
        avg + sa("util_est")?,
        avg + sa("runnable_avg")?,
        o("cfs_rq", "h_load")?,
        o("cfs_rq", "last_h_load_update")?,
        cfs_avg + sa("load_avg")?,
        o("lb_env", "imbalance")?,
    );
    let mut ret = format!(
        "r:fpm/cmr can_migrate_task ret=$retval:s32 fl=+{fl}($arg2):u32 nd=+{nd}($arg2):s32"
    );
    for (n, off) in counters {
        entry += &format!(" {n}=+{off}($arg1):u64");
        ret += &format!(" {n}=+{off}($arg1):u64");
    }
    ret += &format!(" th=+{}($arg1):u8", hot_bit / 8);
    // Defined once per boot: the verdicts and the passes both use them.
    if !std::path::Path::new(&format!("{TRACE}/events/fpm/cm")).exists() {
        add_event(TRACE, &entry)?;
        add_event(TRACE, &ret)?;
    }
    // The counters that name the refusing check count only with schedstats
    // on; NUMA balancing off makes migrate_degrades_locality() return -1.
    fs::write("/proc/sys/kernel/sched_schedstats", "1").map_err(|e| format!("schedstats: {e}"))?;
    let _ = fs::write("/proc/sys/kernel/numa_balancing", "0");
    Ok(Enums {
        idle: [
            (e("__CPU_NOT_IDLE")?, "not_idle"),
            (e("CPU_IDLE")?, "idle"),
            (e("CPU_NEWLY_IDLE")?, "newly_idle"),
        ],
        migration: [
            (e("migrate_load")?, "load"),
            (e("migrate_util")?, "util"),
            (e("migrate_task")?, "task"),
            (e("migrate_misfit")?, "misfit"),
        ],
        se: se as u64,
        hot_bit: (hot_bit % 8) as u32,
        rq_cfs: o("rq", "cfs")? as u64,
    })
}

/// Records `quota` verdicts (an equal share per seed) over rounds of the
/// workloads; prints `MIG` lines, `DROP` lines for verdicts that cannot be
/// recorded and `MIGDONE n`.
pub fn run(topo: &str, nr: usize, seeds: &[u64], quota: usize) {
    // Only these probes from here on: the placement events would fill the
    // buffer.
    let _ = fs::write(format!("{TRACE}/events/enable"), "0");
    let en = match define() {
        Ok(en) => en,
        Err(e) => {
            println!("FAIL no can_migrate_task probes: {e}");
            println!("MIGDONE 0");
            return;
        }
    };
    let _ = fs::write(format!("{TRACE}/events/fpm/enable"), "1");
    let mut made = 0;
    let mut id = 0;
    for (k, &seed) in seeds.iter().enumerate() {
        let share = quota / seeds.len() + (k < quota % seeds.len()) as usize;
        let mut rng = Lcg(seed
            .wrapping_mul(2862933555777941757)
            .wrapping_add(3037000493));
        let mut got = 0;
        let mut rounds = 0;
        while got < share && rounds < 200 {
            rounds += 1;
            let w = WORKLOADS[rng.below(WORKLOADS.len())];
            let text = round(&mut rng, nr, w);
            // Every call of the round, by the kernel's reason; a call the
            // format cannot carry is printed as a drop with its reason.
            let mut by_reason: BTreeMap<&str, Vec<String>> = BTreeMap::new();
            for (a, b) in verdicts(&text) {
                match scenario(topo, nr, &en, &a, &b) {
                    Ok((reason, body)) => by_reason.entry(reason).or_default().push(body),
                    Err(why) => println!("DROP can_migrate {why}"),
                }
            }
            // At most a fifth of the share from one round, taken in turn
            // from each reason (the balancer's calls are mostly affinity
            // refusals), each reason's records spread over the round.
            let want = (share - got).min(share.div_ceil(5));
            for body in take_spread(by_reason, want) {
                id += 1;
                println!(
                    "MIG {{\"name\":\"m{id}\",\"kernel\":\"6.12\",\"generator\":{{\"seed\":{seed},\"workload\":\"{}\",\"source\":\"kprobe\"}},{body}}}",
                    w.name()
                );
                got += 1;
            }
        }
        made += got;
    }
    let _ = fs::write(format!("{TRACE}/events/fpm/enable"), "0");
    let _ = fs::write(MIGRATION_COST, "500000");
    println!("MIGDONE {made}");
}

/// The tunable `task_hot()` compares against (`sysctl_sched_migration_cost`,
/// 500 us by default). Longer costs make recently run tasks hot far more
/// often, so the balancer's hot refusals, its repeated failures
/// (`nr_balance_failed` past `cache_nice_tries`: forced migrations) and
/// active balancing come up; 0 makes every task cold.
pub(crate) const MIGRATION_COST: &str = "/sys/kernel/debug/sched/migration_cost_ns";
const MIGRATION_COSTS: [u32; 5] = [500_000, 500_000, 5_000_000, 50_000_000, 0];

/// Up to `want` records, one from each reason in turn; within a reason,
/// spread evenly over the round.
pub(crate) fn take_spread(by_reason: BTreeMap<&str, Vec<String>>, want: usize) -> Vec<String> {
    let total: usize = by_reason.values().map(Vec::len).sum();
    let mut quota: BTreeMap<&str, usize> = by_reason.keys().map(|&k| (k, 0)).collect();
    let mut left = want.min(total);
    while left > 0 {
        for (k, v) in &by_reason {
            let q = quota.get_mut(k).expect("same keys");
            if left > 0 && *q < v.len() {
                *q += 1;
                left -= 1;
            }
        }
    }
    let mut out = Vec::new();
    for (k, v) in by_reason {
        let q = quota[k];
        out.extend((0..q).map(|i| v[i * v.len() / q].clone()));
    }
    out
}

/// Runs one workload for a while with the probes on; returns the trace.
pub(crate) fn round(rng: &mut Lcg, nr: usize, w: Workload) -> String {
    let cost = MIGRATION_COSTS[rng.below(MIGRATION_COSTS.len())];
    let _ = fs::write(MIGRATION_COST, cost.to_string());
    let _ = fs::write(format!("{TRACE}/trace"), "");
    let home = rng.below(nr);
    let n = nr + 1 + rng.below(nr + 1);
    let mut pids = Vec::new();
    for _ in 0..n {
        let allowed: Vec<usize> = match w {
            Workload::Pinned => {
                let k = 2 + rng.below(2);
                let mut v: Vec<usize> = (0..k).map(|_| rng.below(nr)).collect();
                v.sort_unstable();
                v.dedup();
                v
            }
            _ => (0..nr).collect(),
        };
        let idle = matches!(w, Workload::IdleMix) && rng.below(3) == 0;
        let nice = if matches!(w, Workload::IdleMix) {
            [-5, 0, 5, 10][rng.below(4)]
        } else {
            0
        };
        let sleeper = matches!(w, Workload::Sleepers) && rng.below(3) != 0;
        pids.push(spawn(home, &allowed, idle, nice, sleeper));
    }
    std::thread::sleep(Duration::from_millis(300));
    let _ = fs::write(format!("{TRACE}/tracing_on"), "0");
    crate::kill_all(&pids);
    let t = fs::read_to_string(format!("{TRACE}/trace")).unwrap_or_default();
    let _ = fs::write(format!("{TRACE}/trace"), "");
    let _ = fs::write(format!("{TRACE}/tracing_on"), "1");
    t
}

/// A task started on `home` (where it is forked), then allowed on
/// `allowed`: the balancer has to move it. A sleeper runs 2 ms and sleeps
/// 1 ms, so it is usually cache hot when the balancer looks at it.
fn spawn(home: usize, allowed: &[usize], idle: bool, nice: i32, sleeper: bool) -> i32 {
    let pid = unsafe { libc::fork() };
    if pid != 0 {
        return pid;
    }
    unsafe { libc::prctl(libc::PR_SET_NAME, c"fpload".as_ptr()) };
    pin(0, &[home]);
    if idle {
        let p = libc::sched_param { sched_priority: 0 };
        unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &p) };
    } else if nice != 0 {
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) };
    }
    pin(0, allowed);
    let mut x = 0u64;
    loop {
        if sleeper {
            let end = std::time::Instant::now() + Duration::from_millis(2);
            while std::time::Instant::now() < end {
                x = std::hint::black_box(x.wrapping_add(1));
            }
            std::thread::sleep(Duration::from_millis(1));
        } else {
            x = std::hint::black_box(x.wrapping_add(1));
        }
    }
}

pub(crate) type Fields = BTreeMap<String, i64>;

/// The entry and return events of each call, paired per CPU (a call runs
/// with interrupts off, so the return is the next event of its CPU).
fn verdicts(t: &str) -> Vec<(Fields, Fields)> {
    let mut open: BTreeMap<i64, Fields> = BTreeMap::new();
    let mut out = Vec::new();
    for l in t.lines() {
        let entry = l.contains(" cm: (");
        if !entry && !l.contains(" cmr: (") {
            continue;
        }
        let Some(cpu) = trace_cpu(l) else {
            continue;
        };
        let vals = event_fields(l);
        if entry {
            open.insert(cpu, vals);
        } else if let Some(a) = open.remove(&cpu) {
            out.push((a, vals));
        }
    }
    out
}

/// A cpumask's first word as a cpulist of the `nr` CPUs (the bits past
/// `nr_cpu_ids` in that word are not the mask's: the kernel never reads
/// them).
pub(crate) fn mask_list(m: i64, nr: usize) -> String {
    let v: Vec<usize> = (0..nr.min(64))
        .filter(|&c| (m as u64) >> c & 1 == 1)
        .collect();
    cpulist_str(&v)
}

fn flag_names(f: u32) -> String {
    let v: Vec<String> = FLAGS
        .iter()
        .filter(|(b, _)| f & b != 0)
        .map(|(_, n)| format!("\"{n}\""))
        .collect();
    format!("[{}]", v.join(","))
}

/// The kernel's reason and the scenario body (everything after
/// `generator`) of one verdict.
fn scenario(
    topo: &str,
    nr: usize,
    en: &Enums,
    a: &Fields,
    b: &Fields,
) -> Result<(&'static str, String), String> {
    let g = |m: &Fields, k: &str| m.get(k).copied().ok_or(format!("no field {k}"));
    let (src, dst) = (g(a, "src")?, g(a, "dst")?);
    let sp = g(a, "sp")?;
    let level =
        level_of(dst as usize, sp, nr).ok_or("the domain's span is none of dst_cpu's domains")?;
    let idle = enum_name(&en.idle, g(a, "idle")?)?;
    let mt = enum_name(&en.migration, g(a, "mt")?)?;
    let (task, per_cpu) = task_fields(en, a, nr)?;
    let (fl_in, fl_out) = (g(a, "fl")? as u32, g(b, "fl")? as u32);
    let allowed = g(b, "ret")? != 0;
    let d = |k: &str| Ok::<i64, String>(g(b, k)? - g(a, k)?);
    // The check that decided, from the schedstats counter it raised or the
    // hot mark it left (the two refusals with neither are the per-CPU
    // kthread and throttling).
    let hot = (g(b, "th")? as u32 >> en.hot_bit) & 1 == 1;
    let reason = match (allowed, d("fa")?, d("fr")?, d("fh")?, hot) {
        (true, 0, 0, 0, false) if fl_in & LBF_ACTIVE_LB != 0 => "active_lb",
        (true, 0, 0, 0, true) => "balance_failed",
        (true, 0, 0, 0, false) => "cold",
        (false, 1, 0, 0, false) => "affinity",
        (false, 0, 1, 0, false) => "running",
        (false, 0, 0, 1, false) => "hot",
        (false, 0, 0, 0, false) if per_cpu => "per_cpu_kthread",
        (false, 0, 0, 0, false) => "throttled",
        other => return Err(format!("schedstats moved as {other:?}")),
    };
    let new_dst = if fl_in & LBF_DST_PINNED == 0 && fl_out & LBF_DST_PINNED != 0 {
        g(b, "nd")?.to_string()
    } else {
        "null".into()
    };
    // Active balancing's env has neither mask (the call returns before
    // the affinity path reads them), so the probe's reads fault there.
    let masks = match (a.get("gm"), a.get("ec")) {
        (Some(&gm), Some(&ec)) => format!(
            ",\"dst_group\":\"{}\",\"env_cpus\":\"{}\"",
            mask_list(gm, nr),
            mask_list(ec, nr)
        ),
        _ if fl_in & LBF_ACTIVE_LB != 0 => String::new(),
        _ => return Err("dst_grpmask or cpus unreadable outside active balancing".into()),
    };
    let body = format!(
        "\"topology\":{topo},\"system\":{{\"migration_cost_ns\":{}}},\"cpus\":[{{\"id\":{src},\"nr_running\":{}}},{{\"id\":{dst},\"nr_running\":{}}}],\"task\":{{{task}}},\"request\":{{\"kind\":\"can_migrate\",\"src_cpu\":{src},\"dst_cpu\":{dst},\"sd_level\":\"{level}\"{masks},\"idle\":\"{idle}\",\"migration_type\":\"{mt}\",\"flags\":{},\"nr_balance_failed\":{},\"cache_nice_tries\":{},\"now\":{}}},\"expected\":{{\"allowed\":{allowed},\"new_dst_cpu\":{new_dst},\"flags\":{},\"reason\":\"{reason}\"}}",
        g(a, "mc")?,
        g(a, "sn")?,
        g(a, "dn")?,
        flag_names(fl_in),
        g(a, "nbf")?,
        g(a, "cnt")?,
        g(a, "now")?,
        flag_names(fl_out),
    );
    Ok((reason, body))
}

/// The task as a `can_migrate_task()` entry probe saw it, in the format's
/// task fields (policy, affinity, per-CPU kthread, running, next buddy,
/// `exec_start`), and whether it is a per-CPU kthread.
pub(crate) fn task_fields(en: &Enums, a: &Fields, nr: usize) -> Result<(String, bool), String> {
    let g = |k: &str| a.get(k).copied().ok_or(format!("no field {k}"));
    let policy = match g("pol")? {
        0 => "normal",
        3 => "batch",
        5 => "idle",
        p => return Err(format!("policy {p}")),
    };
    let kthread = g("pf")? as u64 & PF_KTHREAD != 0;
    let per_cpu = kthread && g("kf")? as u64 & KTHREAD_IS_PER_CPU != 0;
    let buddy = g("nx")? as u64 == (g("p")? as u64).wrapping_add(en.se);
    Ok((
        format!(
            "\"policy\":\"{policy}\",\"cpus_allowed\":\"{}\",\"per_cpu_kthread\":{per_cpu},\"running\":{},\"next_buddy\":{buddy},\"exec_start\":{}",
            mask_list(g("am")?, nr),
            g("oc")? != 0,
            g("es")?,
        ),
        per_cpu,
    ))
}

/// The guest's name of `cpu`'s domain whose span's first word (of `nr`
/// CPUs) is `span`.
pub(crate) fn level_of(cpu: usize, span: i64, nr: usize) -> Option<String> {
    let sp = span as u64 & (u64::MAX >> (64 - nr.min(64)));
    crate::DOMS.lock().unwrap().get(cpu).and_then(|doms| {
        doms.iter()
            .find(|(_, s)| s.iter().fold(0u64, |m, &c| m | 1 << c) == sp)
            .map(|(name, _)| name.clone())
    })
}

/// The name of a kernel enum's value, from a (value, name) table.
pub(crate) fn enum_name(table: &[(i64, &'static str)], v: i64) -> Result<&'static str, String> {
    table
        .iter()
        .find(|(x, _)| *x == v)
        .map(|(_, n)| *n)
        .ok_or(format!("enum value {v}"))
}
