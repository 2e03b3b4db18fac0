//! Property tests over random topologies and states.

use fairplace::engine::balance::migrate::new_dst_cpu_loop;
use fairplace::engine::cpumask::CpuMask;
use fairplace::offline::scenario::{Answer, Request, Scenario, parse};
use proptest::prelude::*;
use serde_json::{Value, json};

/// A random machine and state, as scenario JSON.
#[derive(Debug, Clone)]
struct Gen {
    nodes: u32,
    llcs: u32,
    cores: u32,
    smt: u32,
    clusters: bool,
    asym: bool,
    cpu_seeds: Vec<(u8, u16, bool)>,
    kind: u8,
    this: usize,
    prev: usize,
    recent: usize,
    allowed: (usize, usize),
    policy_idle: bool,
    migration_disabled: bool,
    sync: bool,
    flips: (u32, u32),
    util: u16,
    uclamp_min: u16,
    features: u16,
}

fn machines() -> impl Strategy<Value = Gen> {
    (
        (
            1u32..=2,
            1u32..=3,
            1u32..=6,
            prop::sample::select(vec![1u32, 2, 4, 8]),
            any::<bool>(),
            any::<bool>(),
        ),
        prop::collection::vec((0u8..10, any::<u16>(), any::<bool>()), 384),
        (
            0u8..3,
            any::<usize>(),
            any::<usize>(),
            any::<usize>(),
            (any::<usize>(), any::<usize>()),
        ),
        (
            any::<bool>(),
            any::<bool>(),
            any::<bool>(),
            (0u32..64, 0u32..64),
            0u16..1100,
            0u16..1025,
            any::<u16>(),
        ),
    )
        .prop_map(|(m, cpu_seeds, r, t)| Gen {
            nodes: m.0,
            llcs: m.1,
            cores: m.2,
            smt: m.3,
            clusters: m.4,
            asym: m.5,
            cpu_seeds,
            kind: r.0,
            this: r.1,
            prev: r.2,
            recent: r.3,
            allowed: r.4,
            policy_idle: t.0,
            migration_disabled: t.1,
            sync: t.2,
            flips: t.3,
            util: t.4,
            uclamp_min: t.5,
            features: t.6,
        })
}

const SWITCHES: [&str; 8] = [
    "SIS_UTIL",
    "WA_IDLE",
    "WA_WEIGHT",
    "WA_BIAS",
    "UTIL_EST",
    "PREFER_LAST_IDLE_CPU",
    "SKIP_SCHED_IDLE_FOR_IDLE_TASK",
    "EXEC_BOUND_FAST_PATH",
];

impl Gen {
    fn scenario(&self) -> Value {
        let mut topo = vec![];
        let mut core = 0;
        for node in 0..self.nodes {
            for l in 0..self.llcs {
                let llc = node * self.llcs + l;
                for c in 0..self.cores {
                    let cap = if self.asym && c % 2 == 1 { 512 } else { 1024 };
                    for _ in 0..self.smt {
                        let mut e = json!({"id": topo.len(), "core": core, "llc": llc, "node": node, "capacity": cap});
                        if self.clusters {
                            e["cluster"] = json!(llc * 100 + c / 2);
                        }
                        topo.push(e);
                    }
                    core += 1;
                }
            }
        }
        let n = topo.len();
        let this = self.this % n;
        let mut cpus = vec![];
        for (i, &(kind, v, flag)) in self.cpu_seeds.iter().take(n).enumerate() {
            let load = (v % 2048) as i64;
            let mut c = match kind {
                0..=3 => json!({"id": i, "idle_exit_latency": (v % 4), "idle_stamp": v as i64}),
                4 | 5 => {
                    json!({"id": i, "nr_running": 1 + v % 3, "load_avg": load, "util_avg": load / 2, "runnable_avg": load})
                }
                6 => {
                    json!({"id": i, "nr_running": 1 + v % 2, "h_nr_idle": 1 + v % 2, "load_avg": load / 8})
                }
                7 => json!({"id": i, "ttwu_pending": true}),
                8 => json!({"id": i, "vcpu_preempted": flag}),
                _ => json!({"id": i, "online": i == this || !flag}),
            };
            if i == this && self.kind == 2 {
                // The exec'ing task is queued and running here.
                c = json!({"id": i, "nr_running": 1 + v % 2, "load_avg": load, "util_avg": 100, "curr_is_idle": false});
            }
            cpus.push(c);
        }
        let a = self.allowed.0 % n;
        let b = self.allowed.1 % n;
        let allowed = if a == b {
            format!("{a}")
        } else {
            format!("{}-{}", a.min(b), a.max(b))
        };
        let mut features = serde_json::Map::new();
        for (i, name) in SWITCHES.iter().enumerate() {
            if self.features & (1 << i) != 0 {
                features.insert(name.to_string(), json!(self.features & (1 << (i + 8)) != 0));
            }
        }
        json!({
            "topology": {"cpus": topo},
            "cpus": cpus,
            "features": features,
            "task": {
                "prev_cpu": self.prev % n,
                "recent_used_cpu": self.recent % n,
                "cpus_allowed": allowed,
                "policy": if self.policy_idle { "idle" } else { "normal" },
                "migration_disabled": self.migration_disabled && self.kind != 0 && self.util.is_multiple_of(7),
                "util_avg": self.util,
                "uclamp_min": self.uclamp_min,
                "load_avg": self.util as i64 * 2,
                "wakee_flips": self.flips.1,
            },
            "request": {
                "kind": (["wakeup", "fork", "exec"][self.kind as usize]),
                "this_cpu": this,
                "sync": self.sync,
                "waker_wakee_flips": self.flips.0,
                "waker_load": self.util,
            }
        })
    }
}

fn decide(v: &Value) -> Option<(Scenario, fairplace::engine::decision::Placement)> {
    let s = parse(v).expect("generated scenarios are valid");
    match s.decide() {
        Answer::Place(p) => Some((s, p)),
        Answer::Migrate(_) => None,
    }
}

fn with_feature(v: &Value, name: &str, on: bool) -> Value {
    let mut v = v.clone();
    v["features"][name] = json!(on);
    v
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    #[test]
    fn placement_is_online_and_allowed(g in machines()) {
        let (s, p) = decide(&g.scenario()).unwrap();
        let t = &s.topology;
        prop_assert!(t.online.test(p.cpu), "cpu {} offline ({})", p.cpu, p.path);
        let Request::Place(r) = &s.request else { unreachable!() };
        let task_cpu = if r.kind == fairplace::engine::decision::Kind::Wakeup { s.task.prev_cpu } else { r.this_cpu };
        let cpus_ptr = if s.task.migration_disabled { CpuMask::from_cpus([task_cpu]) } else { s.task.cpus_allowed };
        let unchecked_exec = r.kind == fairplace::engine::decision::Kind::Exec && !s.features.exec_bound_fast_path;
        if cpus_ptr.intersects(&t.online) && !unchecked_exec {
            prop_assert!(cpus_ptr.test(p.cpu), "cpu {} not allowed ({})", p.cpu, p.path);
        }
    }

    #[test]
    fn scanned_stays_within_what_the_path_may_scan(g in machines()) {
        let (s, p) = decide(&g.scenario()).unwrap();
        let Request::Place(r) = &s.request else { unreachable!() };
        if r.kind != fairplace::engine::decision::Kind::Wakeup {
            prop_assert_eq!(p.scanned, 0, "fork/exec never scan");
            return Ok(());
        }
        let t = &s.topology;
        let Some(target) = p.detail.sis_target else {
            prop_assert_eq!(p.scanned, 0);
            return Ok(());
        };
        if t.asym_active && t.sd_asym(target).is_some() {
            prop_assert!(p.scanned <= t.span(t.sd_asym(target).unwrap().span).weight() as u32);
            return Ok(());
        }
        let llc = t.sd_llc(target).map_or(0, |d| d.weight);
        let smt = t.smt_siblings(s.task.prev_cpu).len() as u32;
        prop_assert!(p.scanned <= llc + smt, "scanned {} > llc {} + smt {}", p.scanned, llc, smt);
        if p.detail.has_idle_core == Some(false)
            && let Some(nr) = p.detail.nr_idle_scan {
                prop_assert!(p.scanned <= nr + smt, "per-CPU mode spends at most the budget");
            }
    }

    #[test]
    fn switches_change_decisions_only_where_their_code_runs(g in machines()) {
        let v = g.scenario();
        for name in SWITCHES {
            let (s_on, on) = decide(&with_feature(&v, name, true)).unwrap();
            let (_, off) = decide(&with_feature(&v, name, false)).unwrap();
            let same = (on.cpu, on.path, on.scanned) == (off.cpu, off.path, off.scanned);
            if same {
                continue;
            }
            let Request::Place(r) = &s_on.request else { unreachable!() };
            let reached = match name {
                "PREFER_LAST_IDLE_CPU" => on.path == off.path && on.path.as_str() == "core_scan_cpu" && on.scanned == off.scanned,
                "SKIP_SCHED_IDLE_FOR_IDLE_TASK" => s_on.task.policy == fairplace::engine::state::Policy::Idle
                    && s_on.state.cpus.iter().any(|c| c.sched_idle_rq()),
                // The wrapper skips the class for bound tasks and applies
                // is_cpu_allowed() to whatever the class chose.
                "EXEC_BOUND_FAST_PATH" => r.kind == fairplace::engine::decision::Kind::Exec
                    && (s_on.task.cpus_allowed.weight() == 1
                        || s_on.task.migration_disabled
                        || on.path.as_str() == "fallback_rq"),
                "WA_IDLE" | "WA_WEIGHT" | "WA_BIAS" => on.detail.affine.is_some() && off.detail.affine.is_some(),
                "SIS_UTIL" => on.detail.nr_idle_scan.is_some(),
                // UTIL_EST feeds cpu_util (slow path) and the derived budget,
                // and only matters where some util_est exceeds util_avg.
                "UTIL_EST" => s_on.state.cpus.iter().any(|c| c.util_est > c.util_avg)
                    || s_on.task.util_est > s_on.task.util_avg,
                _ => unreachable!(),
            };
            prop_assert!(reached, "{} changed {:?} -> {:?} outside its code path", name, on, off);
        }
    }

    #[test]
    fn first_and_and_equals_the_loop_it_replaced(
        a in prop::collection::vec(0usize..300, 0..40),
        b in prop::collection::vec(0usize..300, 0..200),
        c in prop::collection::vec(0usize..300, 0..200),
    ) {
        let (a, b, c) = (CpuMask::from_cpus(a), CpuMask::from_cpus(b), CpuMask::from_cpus(c));
        prop_assert_eq!(a.first_and_and(&b, &c), new_dst_cpu_loop(&a, &b, &c));
    }
}
