//! The `kernel: "6.12"` profile (scenario format section 13): one
//! hand-worked case per difference from mainline, each decided under both
//! profiles so the test shows the difference and that mainline is unchanged.

use fairplace::offline::scenario::{decide_value, parse};
use serde_json::{Value, json};

/// Decides `s` with `kernel` set (None = field absent) and returns
/// (cpu, path, scanned).
fn place(mut s: Value, kernel: Option<&str>) -> (u64, String, u64) {
    if let Some(k) = kernel {
        s["kernel"] = json!(k);
    }
    let out = decide_value(&s).unwrap_or_else(|e| panic!("{e}"));
    (
        out["cpu"].as_u64().unwrap(),
        out["path"].as_str().unwrap().to_string(),
        out["scanned"].as_u64().unwrap(),
    )
}

fn migrate(mut s: Value, kernel: &str) -> (bool, String) {
    s["kernel"] = json!(kernel);
    let out = decide_value(&s).unwrap_or_else(|e| panic!("{e}"));
    (
        out["allowed"].as_bool().unwrap(),
        out["reason"].as_str().unwrap().to_string(),
    )
}

/// Four single-thread CPUs in one LLC.
fn flat4() -> Value {
    json!({"cpus": (0..4).map(|i| json!({"id": i, "core": i, "llc": 0})).collect::<Vec<_>>()})
}

#[test]
fn a_sched_idle_wakee_takes_a_sched_idle_only_cpu_under_6_12() {
    // CPUs 0-2 run one normal task each; CPU 3 runs only a SCHED_IDLE task.
    // A SCHED_IDLE wakee (prev 1, woken from 0): wake_affine finds neither
    // CPU idle and all loads 0 (te = 0 is not < pe = 0), so target = prev 1.
    // 1 is busy; recent = prev. select_idle_cpu walks 2, 3, 0, 1 (budget:
    // utils 0 -> nr_idle_scan 4, +1).
    // 6.12: sched_idle_cpu(3) is true for any wakee -> 3 after 2 tests.
    // mainline: choose_sched_idle_rq(3) is false for a SCHED_IDLE wakee, so
    // all four are tested and nothing is found -> fallback to target 1.
    let s = json!({
        "topology": flat4(),
        "cpus": [{"id": 0, "nr_running": 1}, {"id": 1, "nr_running": 1},
                 {"id": 2, "nr_running": 1}, {"id": 3, "nr_running": 1, "h_nr_idle": 1}],
        "task": {"prev_cpu": 1, "policy": "idle"},
        "request": {"kind": "wakeup", "this_cpu": 0}
    });
    assert_eq!(place(s.clone(), Some("6.12")), (3, "idle_cpu".into(), 2));
    assert_eq!(place(s.clone(), None), (1, "fallback_target".into(), 4));
    assert_eq!(
        place(s.clone(), Some("mainline")),
        (1, "fallback_target".into(), 4)
    );
    // The feature can still be set explicitly under 6.12 and then acts as in mainline.
    let mut on = s;
    on["features"] = json!({"SKIP_SCHED_IDLE_FOR_IDLE_TASK": true});
    assert_eq!(place(on, Some("6.12")), (1, "fallback_target".into(), 4));
}

#[test]
fn exec_of_a_bound_task_goes_through_the_class_under_6_12() {
    // The exec'ing task may run on CPU 2 only. Mainline's sched_exec() goes
    // through select_task_rq(): one allowed CPU -> "bound". 6.12 calls
    // select_task_rq_fair() directly: BALANCE_EXEC on the MC domain starts
    // the slow path, whose only allowed group is the local one {2} -> 2.
    let s = json!({
        "topology": flat4(),
        "cpus": [{"id": 2, "nr_running": 1}],
        "task": {"cpus_allowed": "2"},
        "request": {"kind": "exec", "this_cpu": 2}
    });
    assert_eq!(place(s.clone(), None), (2, "bound".into(), 0));
    assert_eq!(place(s, Some("6.12")), (2, "slow_path".into(), 0));
}

/// One LLC, SMT2: big cores {0,1}, {2,3} (1024) and little cores {4,5},
/// {6,7} (512). The asym domain is the LLC domain.
fn asym_smt() -> Value {
    json!({"cpus": (0..8).map(|i| json!({"id": i, "core": i / 2, "llc": 0,
        "capacity": if i < 4 { 1024 } else { 512 }})).collect::<Vec<_>>()})
}

#[test]
fn asym_fits_cpu_needs_no_idle_core_under_6_12() {
    // Wakeup on CPU 0, prev 0: CPU 0 is idle, its sibling 1 is busy, the
    // task (util 100) fits everywhere. 6.12: asym_fits_cpu(0) is the fit
    // only -> target 0. Mainline also wants is_core_idle(0) (false), so
    // select_idle_capacity runs; has_idle_cores is true (core {2,3}); CPU 0
    // is tested first (idle, fits, not on an idle core: kept with fits -2),
    // CPU 1 is busy, CPU 2 is on an idle core and fits -> 2 after 3 tests.
    let s = json!({
        "topology": asym_smt(),
        "cpus": [{"id": 1, "nr_running": 1}, {"id": 4, "nr_running": 1},
                 {"id": 5, "nr_running": 1}, {"id": 6, "nr_running": 1}, {"id": 7, "nr_running": 1}],
        "task": {"prev_cpu": 0, "util_avg": 100},
        "request": {"kind": "wakeup", "this_cpu": 0}
    });
    assert_eq!(place(s.clone(), Some("6.12")), (0, "target".into(), 0));
    assert_eq!(place(s, None), (2, "capacity".into(), 3));
}

#[test]
fn select_idle_capacity_has_no_smt_preference_under_6_12() {
    // As above but CPU 0 is busy and CPU 1 idle (its sibling 0 busy).
    // 6.12: walk 0 (busy), 1 (idle, fits) -> 1 after 2 tests.
    // Mainline: 1 fits but its core is not idle (kept with -2, not
    // "preferred"), 2 sits on the idle core {2,3} and fits -> 2, 3 tests.
    let s = json!({
        "topology": asym_smt(),
        "cpus": [{"id": 0, "nr_running": 1}, {"id": 4, "nr_running": 1},
                 {"id": 5, "nr_running": 1}, {"id": 6, "nr_running": 1}, {"id": 7, "nr_running": 1}],
        "task": {"prev_cpu": 0, "util_avg": 100},
        "request": {"kind": "wakeup", "this_cpu": 0}
    });
    assert_eq!(place(s.clone(), Some("6.12")), (1, "capacity".into(), 2));
    assert_eq!(place(s, None), (2, "capacity".into(), 3));
}

#[test]
fn select_idle_capacity_spends_no_scan_budget_under_6_12() {
    // Every big CPU busy with util 1024 except CPU 3: the derived budget of
    // the 8-CPU LLC object is small, and an explicit nr_idle_scan 1 caps
    // mainline's walk (from target 0) at one CPU -> nothing, target 0.
    // 6.12 has no budget: it walks 0, 1, 2, 3 and takes 3.
    let busy = |i: u32| json!({"id": i, "nr_running": 1, "util_avg": 1024});
    let s = json!({
        "topology": {"cpus": (0..8).map(|i| json!({"id": i, "core": i, "llc": 0,
            "capacity": if i < 4 { 1024 } else { 512 }})).collect::<Vec<_>>()},
        "cpus": [busy(0), busy(1), busy(2), busy(4), busy(5), busy(6), busy(7)],
        "llc": {"0": {"nr_idle_scan": 1}},
        "task": {"prev_cpu": 0, "util_avg": 100},
        "request": {"kind": "wakeup", "this_cpu": 0}
    });
    assert_eq!(place(s.clone(), Some("6.12")), (3, "capacity".into(), 4));
    assert_eq!(place(s, None), (0, "capacity_none".into(), 1));
}

/// Two LLCs in one node: big SMT2 cores 0-3, little SMT2 cores 4-7. The
/// asym domain (PKG, 0-7) is above both LLC domains.
fn asym_two_llcs() -> Value {
    json!({"cpus": (0..8).map(|i| json!({"id": i, "core": i / 2, "llc": i / 4,
        "capacity": if i < 4 { 1024 } else { 512 }})).collect::<Vec<_>>()})
}

#[test]
fn there_is_no_asym_shared_object_under_6_12() {
    let s = json!({
        "topology": asym_two_llcs(),
        "asym": {"0-7": {"nr_idle_scan": 2}},
        "task": {"prev_cpu": 0},
        "request": {"kind": "wakeup", "this_cpu": 0}
    });
    assert!(parse(&s).is_ok(), "mainline has the asym object");
    let mut v = s;
    v["kernel"] = json!("6.12");
    let e = parse(&v).unwrap_err().to_string();
    assert!(e.contains("asym"), "{e}");
}

#[test]
fn the_llc_object_holds_the_idle_core_truth_under_6_12() {
    // All CPUs idle. Mainline: every CPU reads has_idle_cores from the asym
    // object, so the LLC objects' derived truth is false (no reader). 6.12:
    // the LLC objects are what test_idle_cores() reads -> true.
    let s = json!({
        "topology": asym_two_llcs(),
        "task": {"prev_cpu": 0},
        "request": {"kind": "wakeup", "this_cpu": 0}
    });
    let llc_truth = |v: &Value| {
        let sc = parse(v).unwrap();
        let t = &sc.topology;
        let obj = t.cpu[0].llc_shared.expect("LLC 0 has an object") as usize;
        sc.state.shared[obj].has_idle_cores
    };
    let mut v612 = s.clone();
    v612["kernel"] = json!("6.12");
    assert!(!llc_truth(&s));
    assert!(llc_truth(&v612));
}

/// A can_migrate scenario: pull from CPU 1 to CPU 0 (both allowed), cold.
fn pull(task: Value, extra: Value) -> Value {
    let mut req = json!({"kind": "can_migrate", "src_cpu": 1, "dst_cpu": 0});
    for (k, v) in extra.as_object().unwrap() {
        req[k] = v.clone();
    }
    let mut t = json!({"hot": false});
    for (k, v) in task.as_object().unwrap() {
        t[k] = v.clone();
    }
    json!({
        "topology": flat4(),
        "cpus": [{"id": 0, "nr_running": 1}, {"id": 1, "nr_running": 2}],
        "task": t,
        "request": req
    })
}

#[test]
fn can_migrate_has_no_delayed_ineligible_or_blocked_check_under_6_12() {
    let delayed = pull(
        json!({"sched_delayed": true}),
        json!({"migration_type": "util"}),
    );
    assert_eq!(
        migrate(delayed.clone(), "mainline"),
        (false, "delayed".into())
    );
    assert_eq!(migrate(delayed, "6.12"), (true, "cold".into()));

    // dst_cfs_nr_queued defaults to CPU 0's nr_running (1 > 0).
    let ineligible = pull(json!({"eligible": false}), json!({}));
    assert_eq!(
        migrate(ineligible.clone(), "mainline"),
        (false, "ineligible".into())
    );
    assert_eq!(migrate(ineligible, "6.12"), (true, "cold".into()));

    let blocked = pull(json!({"blocked": true}), json!({}));
    assert_eq!(
        migrate(blocked.clone(), "mainline"),
        (false, "blocked".into())
    );
    assert_eq!(migrate(blocked, "6.12"), (true, "cold".into()));

    // Throttled comes first in both (6.12 reads it as throttled_lb_pair).
    let throttled = pull(json!({"blocked": true}), json!({"throttled": true}));
    assert_eq!(
        migrate(throttled.clone(), "mainline"),
        (false, "throttled".into())
    );
    assert_eq!(migrate(throttled, "6.12"), (false, "throttled".into()));
}

#[test]
fn a_bad_kernel_name_is_refused_naming_the_field() {
    for bad in [json!("6.13"), json!(6.12), json!(""), json!(null)] {
        let mut s = json!({
            "topology": flat4(),
            "task": {"prev_cpu": 0},
            "request": {"kind": "wakeup", "this_cpu": 0}
        });
        s["kernel"] = bad.clone();
        let e = parse(&s).unwrap_err().to_string();
        assert!(e.starts_with("kernel"), "{bad}: {e}");
    }
}

#[test]
fn a_node_registered_with_6_12_decides_with_the_profile() {
    use fairplace::engine::features::Kernel;
    use fairplace::engine::topology::{CpuTopo, TopologySpec};
    use fairplace::store::{Store, StoreConfig};
    let spec = TopologySpec {
        cpus: (0..4)
            .map(|i| CpuTopo {
                core: i,
                cluster: None,
                llc: 0,
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    };
    let store = Store::new(StoreConfig::default());
    let (node, _) = store
        .nodes
        .register("n", vec![], "t".into(), spec.clone())
        .unwrap();
    assert_eq!(node.snapshot().features.kernel, Kernel::Mainline);
    store.nodes.set_kernel(&node, Kernel::V6_12);
    let f = node.snapshot().features;
    assert_eq!(f.kernel, Kernel::V6_12);
    assert!(!f.skip_sched_idle_for_idle_task && !f.exec_bound_fast_path);
    // A node override of a switch survives the profile's default.
    store
        .nodes
        .set_features(
            Some(&node),
            &[("EXEC_BOUND_FAST_PATH".to_string(), true)],
            false,
        )
        .unwrap();
    let f = node.snapshot().features;
    assert!(f.exec_bound_fast_path && !f.skip_sched_idle_for_idle_task);
    assert_eq!(f.kernel, Kernel::V6_12);
    // Back to mainline: the kernel's defaults again.
    store.nodes.set_kernel(&node, Kernel::Mainline);
    assert!(node.snapshot().features.skip_sched_idle_for_idle_task);
}
