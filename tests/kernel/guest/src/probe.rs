//! The kernel's own inputs at the moment of each placement.
//!
//! `sched/debug` is read before the placement, and tracefs cannot show the
//! hidden state the fair class keeps (`rq->idle_stamp`, the LLC's
//! `nr_idle_scan` / `has_idle_cores`, `sgc->imbalance`), so a record built
//! from them alone may hold inputs the kernel did not decide on. Kprobe events
//! on `select_task_rq_fair()` read those fields of every CPU's runqueue when
//! the decision starts. The field offsets come from the kernel's BTF
//! (`/sys/kernel/btf/vmlinux`), a CPU's runqueue from `__per_cpu_offset[cpu]`
//! plus the per-CPU offset of `runqueues` (`/proc/kallsyms`): a fetch argument
//! `+OFFS(@__per_cpu_offset+8*cpu)` reads `per_cpu(runqueues, cpu)` + field.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write as _;

/// Enough of BTF to find a member's byte offset in a struct by name, and
/// an enumerator's value.
pub(crate) struct Btf {
    data: Vec<u8>,
    str_start: usize,
    /// Per type id (index), the byte position of its `struct btf_type`.
    types: Vec<usize>,
}

const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;

impl Btf {
    pub(crate) fn load() -> Option<Btf> {
        let data = fs::read("/sys/kernel/btf/vmlinux").ok()?;
        let u32_at = |p: usize| -> Option<usize> {
            Some(u32::from_le_bytes(data.get(p..p + 4)?.try_into().ok()?) as usize)
        };
        if data.get(..2)? != [0x9f, 0xeb] {
            return None;
        }
        let hdr = u32_at(4)?;
        let (type_off, type_len, str_off) = (u32_at(8)?, u32_at(12)?, u32_at(16)?);
        let mut types = vec![0usize]; // type id 0 is void
        let (mut p, end) = (hdr + type_off, hdr + type_off + type_len);
        while p + 12 <= end {
            types.push(p);
            let info = u32_at(p + 4)? as u32;
            let vlen = (info & 0xffff) as usize;
            let extra = match (info >> 24) & 0x1f {
                1 | 14 | 17 => 4,        // INT, VAR, DECL_TAG
                3 => 12,                 // ARRAY
                4 | 5 | 15 => 12 * vlen, // STRUCT, UNION, DATASEC
                6 | 13 => 8 * vlen,      // ENUM, FUNC_PROTO
                19 => 12 * vlen,         // ENUM64
                _ => 0,
            };
            p += 12 + extra;
        }
        Some(Btf {
            data,
            str_start: hdr + str_off,
            types,
        })
    }

    fn u32_at(&self, p: usize) -> u32 {
        u32::from_le_bytes(self.data[p..p + 4].try_into().unwrap())
    }

    fn name(&self, off: u32) -> &str {
        let s = &self.data[self.str_start + off as usize..];
        let n = s.iter().position(|&b| b == 0).unwrap_or(0);
        std::str::from_utf8(&s[..n]).unwrap_or("")
    }

    fn kind(&self, id: usize) -> u32 {
        (self.u32_at(self.types[id] + 4) >> 24) & 0x1f
    }

    fn find_struct(&self, name: &str) -> Option<usize> {
        (1..self.types.len()).find(|&id| {
            self.kind(id) == KIND_STRUCT
                && self.u32_at(self.types[id] + 4) & 0xffff != 0
                && self.name(self.u32_at(self.types[id])) == name
        })
    }

    /// The byte offset of `member` in the struct or union `id`, looking
    /// into anonymous members as C does.
    fn member(&self, id: usize, member: &str) -> Option<usize> {
        self.member_bits(id, member).map(|b| b / 8)
    }

    /// The bit offset of `member` (a bitfield's own bit) in `id`.
    fn member_bits(&self, id: usize, member: &str) -> Option<usize> {
        let p = self.types[id];
        let info = self.u32_at(p + 4);
        let bitfield = info >> 31 == 1;
        for m in 0..(info & 0xffff) as usize {
            let mp = p + 12 + 12 * m;
            let (name, ty, off) = (self.u32_at(mp), self.u32_at(mp + 4), self.u32_at(mp + 8));
            let bits = if bitfield { off & 0xff_ffff } else { off } as usize;
            if name == 0 {
                let inner = self.strip(ty as usize);
                if matches!(self.kind(inner), KIND_STRUCT | KIND_UNION)
                    && let Some(o) = self.member_bits(inner, member)
                {
                    return Some(bits + o);
                }
            } else if self.name(name) == member {
                return Some(bits);
            }
        }
        None
    }

    /// Follows typedefs and qualifiers (TYPEDEF, VOLATILE, CONST, RESTRICT, TYPE_TAG).
    fn strip(&self, mut id: usize) -> usize {
        while matches!(self.kind(id), 8..=11 | 18) {
            id = self.u32_at(self.types[id] + 8) as usize;
        }
        id
    }

    /// `struct s`'s member `m`'s byte offset; None when either is missing.
    pub(crate) fn off(&self, s: &str, m: &str) -> Option<usize> {
        self.member(self.find_struct(s)?, m)
    }

    /// `struct s`'s member `m`'s bit offset (for bitfields).
    pub(crate) fn bit_off(&self, s: &str, m: &str) -> Option<usize> {
        self.member_bits(self.find_struct(s)?, m)
    }

    /// The value of the enumerator `name` (of any enum).
    pub(crate) fn enum_value(&self, name: &str) -> Option<i64> {
        (1..self.types.len()).find_map(|id| {
            if self.kind(id) != KIND_ENUM {
                return None;
            }
            let p = self.types[id];
            (0..(self.u32_at(p + 4) & 0xffff) as usize).find_map(|e| {
                let ep = p + 12 + 8 * e;
                (self.name(self.u32_at(ep)) == name).then(|| self.u32_at(ep + 4) as i32 as i64)
            })
        })
    }
}

/// A per-CPU variable's offset, as `/proc/kallsyms` lists it.
pub(crate) fn kallsym(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut w = l.split_whitespace();
        let (a, _, n) = (w.next()?, w.next()?, w.next()?);
        (n == name)
            .then(|| u64::from_str_radix(a, 16).ok())
            .flatten()
    })
}

/// The runqueue fields every probe of a CPU's state reads, as (name,
/// offset in `struct rq`, fetch type): the task counts, a pending remote
/// wakeup, and the root cfs_rq's counts and PELT averages.
pub(crate) fn rq_fields(btf: &Btf) -> Result<Vec<(&'static str, usize, &'static str)>, String> {
    let o = |s: &str, m: &str| btf.off(s, m).ok_or(format!("no {s}.{m} in BTF"));
    let cfs = o("rq", "cfs")?;
    let avg = cfs + o("cfs_rq", "avg")?;
    Ok(vec![
        ("nr", o("rq", "nr_running")?, "u32"),
        ("tp", o("rq", "ttwu_pending")?, "u32"),
        ("q", cfs + o("cfs_rq", "h_nr_queued")?, "u32"),
        ("i", cfs + o("cfs_rq", "idle_h_nr_running")?, "u32"),
        ("d", cfs + o("cfs_rq", "h_nr_delayed")?, "u32"),
        ("l", avg + o("sched_avg", "load_avg")?, "u64"),
        ("r", avg + o("sched_avg", "runnable_avg")?, "u64"),
        ("u", avg + o("sched_avg", "util_avg")?, "u64"),
        ("e", avg + o("sched_avg", "util_est")?, "u32"),
    ])
}

/// Defines the probes: one event `fp/cN` per CPU N, on `select_task_rq_fair`
/// entry, with the placed task's pid. `levels[c]` is the number of sched
/// domains CPU c has. Returns a note when the probes cannot be defined.
pub fn define(trace: &str, nr: usize, levels: &[usize]) -> Result<(), String> {
    let _ = fs::write("/proc/sys/kernel/kptr_restrict", "0");
    let btf = Btf::load().ok_or("no readable BTF")?;
    let syms = fs::read_to_string("/proc/kallsyms").map_err(|e| e.to_string())?;
    let rq = kallsym(&syms, "runqueues").ok_or("no runqueues symbol")?;
    let llc_shared = kallsym(&syms, "sd_llc_shared").ok_or("no sd_llc_shared symbol")?;
    kallsym(&syms, "__per_cpu_offset").ok_or("no __per_cpu_offset symbol")?;
    if rq == 0 || rq >= 1 << 32 {
        return Err(format!("runqueues at {rq:#x} is not a per-CPU offset"));
    }
    let o = |s: &str, m: &str| btf.off(s, m).ok_or(format!("no {s}.{m} in BTF"));
    let cfs = o("rq", "cfs")?;
    let mut fields = rq_fields(&btf)?;
    fields.extend([
        ("st", o("rq", "idle_stamp")?, "u64"),
        // task_h_load()'s factor: cfs_rq->h_load, recomputed when
        // last_h_load_update is not the current jiffy.
        ("hl", cfs + o("cfs_rq", "h_load")?, "u64"),
        ("hu", cfs + o("cfs_rq", "last_h_load_update")?, "u64"),
    ]);
    let curr = o("rq", "curr")?;
    let sd = o("rq", "sd")?;
    let pid = o("task_struct", "pid")?;
    let ruc = o("task_struct", "recent_used_cpu")?;
    // wake_wide()'s inputs: the wakee's and the waker's (the current task of
    // this CPU) flips, the waker's last wakee and the jiffy of its last decay.
    let flips = o("task_struct", "wakee_flips")?;
    let decay = o("task_struct", "wakee_flip_decay_ts")?;
    let last_wakee = o("task_struct", "last_wakee")?;
    let se_avg = o("task_struct", "se")? + o("sched_entity", "avg")?;
    let se_load = se_avg + o("sched_avg", "load_avg")?;
    let se_runnable = se_avg + o("sched_avg", "runnable_avg")?;
    let se_util = se_avg + o("sched_avg", "util_avg")?;
    let se_util_est = se_avg + o("sched_avg", "util_est")?;
    let (parent, groups) = (o("sched_domain", "parent")?, o("sched_domain", "groups")?);
    let (sgc, imb) = (
        o("sched_group", "sgc")?,
        o("sched_group_capacity", "imbalance")?,
    );
    let (idle_cores, idle_scan) = (
        o("sched_domain_shared", "has_idle_cores")?,
        o("sched_domain_shared", "nr_idle_scan")?,
    );
    let mut defs = Vec::new();
    for c in 0..nr {
        let pc = format!("@__per_cpu_offset+{}", 8 * c);
        let at = |off: usize| format!("+{}({pc})", rq + off as u64);
        let mut a = format!("p:fp/c{c} select_task_rq_fair pid=+{pid}($arg1):s32");
        if c == 0 {
            a += &format!(
                " prev=$arg2:s32 wf=$arg3:s32 ruc=+{ruc}($arg1):s32 p=$arg1:x64 pf=+{flips}($arg1):u32 jf=@jiffies:u64 pl=+{se_load}($arg1):u64 pr=+{se_runnable}($arg1):u64 pu=+{se_util}($arg1):u64 pe=+{se_util_est}($arg1):u32"
            );
        }
        for (n, off, ty) in &fields {
            a += &format!(" {n}={}:{ty}", at(*off));
        }
        a += &format!(" cp=+{pid}({}):s32", at(curr));
        let cur = at(curr);
        a += &format!(
            " cf=+{flips}({cur}):u32 cd=+{decay}({cur}):u64 cl=+{last_wakee}({cur}):x64 sl=+{se_load}({cur}):u64"
        );
        // The LLC's shared object (every LLC here has two or more CPUs).
        let shared = format!("+{llc_shared}({pc})");
        a += &format!(" ic=+{idle_cores}({shared}):s32 ns=+{idle_scan}({shared}):s32");
        // sgc->imbalance of this CPU's local group at each parent level:
        // the balancer sets it on `sd_parent->groups->sgc`.
        let mut dom = at(sd);
        for lvl in 1..levels.get(c).copied().unwrap_or(1) {
            dom = format!("+{parent}({dom})");
            a += &format!(" im{lvl}=+{imb}(+{sgc}(+{groups}({dom}))):s32");
        }
        defs.push(a);
    }
    // Appended one line per write: a write replaces the other probes
    // otherwise, and the kernel parses at most 4 KiB per line.
    for d in &defs {
        add_event(trace, d)?;
    }
    // The decision's end: a return probe on the same function (the line
    // that follows the entry events on the deciding CPU).
    // The jiffy at the end tells whether a tick came during the decision
    // (task_h_load() then recomputes an h_load stored in the old jiffy).
    add_event(
        trace,
        "r:fp/fpret select_task_rq_fair ret=$retval:s32 jr=@jiffies:u64",
    )?;
    // Only decisions made by the harness's own tasks (the load's tasks are
    // named `fpload`): a decision runs in the waker's, parent's or exec'ing
    // task's context, and every placed task's is one of ours. The load's
    // own wakeups would fill the buffer with events nobody reads. The
    // return probe is not filtered: every other decision's answer is
    // evidence of a CPU being claimed during ours (`changed_during`).
    for c in 0..nr {
        let _ = fs::write(format!("{trace}/events/fp/c{c}/filter"), "comm == \"init\"");
        let _ = fs::write(format!("{trace}/events/fp/c{c}/enable"), "1");
    }
    let _ = fs::write(format!("{trace}/events/fp/fpret/enable"), "1");
    Ok(())
}

/// The values the probes read for the last decision about `pid` before the
/// line `is_answer` accepts whose wake flags include `flag` (`WF_EXEC`,
/// `WF_FORK`, `WF_TTWU`): per CPU, name -> value; CPU 0's map also has `on`,
/// the CPU the decision ran on (the kernel's `this_cpu`).
pub fn decision(
    t: &str,
    nr: usize,
    pid: i32,
    flag: i64,
    is_answer: impl Fn(&str) -> bool,
) -> Option<Vec<BTreeMap<String, i64>>> {
    let pat = format!(" pid={pid} ");
    let mut blocks: Vec<BTreeMap<usize, BTreeMap<String, i64>>> = vec![BTreeMap::new()];
    for (n, l) in t.lines().enumerate() {
        if is_answer(l) {
            break;
        }
        let Some(i) = l.find(": c") else { continue };
        if !l.contains("select_task_rq_fair") || !has_pid(l, &pat) {
            continue;
        }
        let Some(c) = l[i + 3..]
            .split(':')
            .next()
            .and_then(|s| s.parse::<usize>().ok())
        else {
            continue;
        };
        let on = trace_cpu(l);
        // The events of one decision come together, in no fixed order;
        // a CPU seen twice starts the next decision about the same task.
        if blocks.last().is_some_and(|b| b.contains_key(&c)) {
            blocks.push(BTreeMap::new());
        }
        let mut vals = event_fields(l);
        if let Some(on) = on {
            vals.insert("on".into(), on);
        }
        vals.insert("line".into(), n as i64);
        blocks.last_mut()?.insert(c, vals);
    }
    let last = blocks.into_iter().rev().find(|b| {
        b.len() == nr
            && b.get(&0)
                .and_then(|m| m.get("wf"))
                .is_some_and(|wf| wf & flag != 0)
    })?;
    let mut out: Vec<BTreeMap<String, i64>> = (0..nr).map(|c| last[&c].clone()).collect();
    let start = out
        .iter()
        .filter_map(|m| m.get("line"))
        .min()
        .copied()
        .unwrap_or(0) as usize;
    let on = out[0].get("on").copied().unwrap_or(-1);
    let (changed, kinds) = changed_during(t, start, on, pid);
    out[0].insert("changed".into(), changed);
    for (c, &k) in kinds.iter().enumerate().take(nr) {
        if k != 0 {
            out[c].insert("changedk".into(), k as i64);
        }
    }
    if let Some((ret, jr)) = returned(t, start, on) {
        out[0].insert("ret".into(), ret);
        out[0].insert("jr".into(), jr);
    }
    Some(out)
}

/// Appends one probe definition to `kprobe_events` (one line per write: a
/// plain write replaces the other probes, and the kernel parses at most
/// 4 KiB per line).
pub(crate) fn add_event(trace: &str, def: &str) -> Result<(), String> {
    let mut f = fs::OpenOptions::new()
        .append(true)
        .open(format!("{trace}/kprobe_events"))
        .map_err(|e| e.to_string())?;
    f.write_all(format!("{def}\n").as_bytes())
        .map_err(|e| format!("kprobe_events refused ({e}): {def}"))
}

/// The CPU a trace line was written on (`[003]`).
pub(crate) fn trace_cpu(l: &str) -> Option<i64> {
    l.find('[')
        .and_then(|b| l[b + 1..].split(']').next())
        .and_then(|n| n.parse::<i64>().ok())
}

/// A probe event's numeric `name=value` fields (pointers are printed in
/// hex; only their equality and offsets matter). A field whose read
/// faulted is absent.
pub(crate) fn event_fields(l: &str) -> BTreeMap<String, i64> {
    l.split_whitespace()
        .filter_map(|w| w.split_once('='))
        .filter_map(|(k, v)| {
            let v = match v.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16).ok()? as i64,
                None => v.parse::<i64>().ok()?,
            };
            Some((k.to_string(), v))
        })
        .collect()
}

/// Whether a trace line names the task: `pat` is `" pid=N "`, and the
/// field may end the line.
fn has_pid(l: &str, pat: &str) -> bool {
    l.contains(pat) || l.ends_with(pat.trim_end())
}

/// The value the return probe saw on the deciding CPU `on` after the entry
/// events that start at line `start` (the decision's own answer), and the
/// jiffy it ended in.
fn returned(t: &str, start: usize, on: i64) -> Option<(i64, i64)> {
    let l = t
        .lines()
        .skip(start)
        .find(|l| l.contains(" fpret: (") && trace_cpu(l) == Some(on))?;
    let field = |k: &str| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse::<i64>().ok())
    };
    Some((field("ret=")?, field("jr=").unwrap_or(-1)))
}

/// The CPUs (a bit mask) whose state changed in the trace after the probe
/// events that start at line `start` and before the decision ended (the
/// return probe on the deciding CPU `on`; failing that, the line that shows
/// the decision about `pid`): a CPU entering or leaving idle, the target of
/// another task's wakeup, either end of another task's migration. The
/// kernel reads the runqueues a little after the probes, and under TCG a
/// vCPU can stall in between, so such a CPU's state as recorded may not be
/// the one the kernel read.
fn changed_during(t: &str, start: usize, on: i64, pid: i32) -> (i64, [u8; 64]) {
    let mut kinds = [0u8; 64];
    let pat = format!(" pid={pid} ");
    let field = |l: &str, k: &str| {
        l.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse::<i64>().ok())
    };
    let mut mask = 0i64;
    for l in t.lines().skip(start) {
        if l.contains(" fpret: (") && trace_cpu(l) == Some(on) {
            break;
        }
        let ours = has_pid(l, &pat);
        let decided = [
            " sched_migrate_task: ",
            " sched_wakeup: ",
            " sched_wakeup_new: ",
            " sched_process_exec: ",
        ]
        .iter()
        .any(|e| l.contains(e));
        if decided && ours {
            break;
        }
        let mut cpus = Vec::new();
        let kind;
        if l.contains(" sched_switch: ")
            && (l.contains(" prev_pid=0 ") || l.contains(" next_pid=0 "))
        {
            kind = 0;
            cpus.extend(trace_cpu(l));
        } else if l.contains(" sched_wakeup") && !ours {
            kind = 1;
            cpus.extend(field(l, "target_cpu="));
        } else if l.contains(" fpret: (") && trace_cpu(l) != Some(on) {
            kind = 2;
            // Another task's placement ended on another CPU: the CPU it
            // chose gets a pending wakeup (`ttwu_pending`, or the task
            // queued) before its sched_wakeup event is written, maybe
            // while this decision reads it.
            cpus.extend(field(l, "ret="));
        } else if l.contains(" sched_migrate_task: ") && !ours {
            kind = 3;
            cpus.extend(field(l, "orig_cpu="));
            cpus.extend(field(l, "dest_cpu="));
        } else {
            continue;
        }
        for c in cpus.into_iter().filter(|c| (0..63).contains(c)) {
            mask |= 1 << c;
            kinds[c as usize] |= 1 << kind;
        }
    }
    (mask, kinds)
}
