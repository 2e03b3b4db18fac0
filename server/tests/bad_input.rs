//! Every invalid-scenario rule of the format: the scenario is rejected and
//! the error names the offending field.

use fairplace::offline::scenario::parse;
use serde_json::{Value, json};

/// 2 nodes x 1 LLC x 2 cores x SMT2 = 8 CPUs, a wakeup.
fn base() -> Value {
    let cpus: Vec<Value> = (0..8)
        .map(|i| json!({"id": i, "core": i / 2, "llc": i / 4, "node": i / 4}))
        .collect();
    json!({
        "topology": {"cpus": cpus},
        "cpus": [{"id": 1, "nr_running": 2, "h_nr_idle": 1, "load_avg": 300}],
        "task": {"prev_cpu": 1, "cpus_allowed": "0-7"},
        "request": {"kind": "wakeup", "this_cpu": 2}
    })
}

fn migrate_base() -> Value {
    let mut v = base();
    v["request"] = json!({"kind": "can_migrate", "src_cpu": 1, "dst_cpu": 5});
    v["task"] = json!({"cpus_allowed": "0-7"});
    v
}

/// Applies `f` to a valid scenario and requires an error naming `field`.
fn rejects(start: fn() -> Value, f: impl FnOnce(&mut Value), field: &str) {
    let mut v = start();
    assert!(parse(&v).is_ok(), "the base scenario is valid");
    f(&mut v);
    match parse(&v) {
        Ok(_) => panic!("accepted an invalid scenario; expected an error on {field}"),
        Err(e) => assert!(
            e.field == field,
            "expected the error to name {field}, got {e}"
        ),
    }
}

#[test]
fn the_base_scenarios_are_valid() {
    assert!(parse(&base()).is_ok());
    assert!(parse(&migrate_base()).is_ok());
}

#[test]
fn top_level_rules() {
    rejects(base, |v| v["version"] = json!(2), "version");
    rejects(base, |v| v["bogus"] = json!(1), "bogus");
    rejects(
        base,
        |v| {
            v.as_object_mut().unwrap().remove("topology");
        },
        "topology",
    );
    rejects(
        base,
        |v| {
            v.as_object_mut().unwrap().remove("request");
        },
        "request",
    );
    rejects(base, |v| v["generator"] = json!("x"), "generator");
    rejects(base, |v| v["name"] = json!(3), "name");
}

#[test]
fn topology_rules() {
    rejects(
        base,
        |v| v["topology"]["cpus"][3]["id"] = json!(4),
        "topology.cpus[3].id",
    );
    rejects(
        base,
        |v| {
            v["topology"]["cpus"][3]
                .as_object_mut()
                .unwrap()
                .remove("core");
        },
        "topology.cpus[3].core",
    );
    rejects(
        base,
        |v| {
            v["topology"]["cpus"][0]
                .as_object_mut()
                .unwrap()
                .remove("llc");
        },
        "topology.cpus[0].llc",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][2]["capacity"] = json!(0),
        "topology.cpus[2].capacity",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][2]["capacity"] = json!(2048),
        "topology.cpus[2].capacity",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][2]["node"] = json!(256),
        "topology.cpus[2].node",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][3]["node"] = json!(1),
        "topology.cpus[3].node",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][1]["llc"] = json!(1),
        "topology.cpus[1].llc",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][1]["capacity"] = json!(512),
        "topology.cpus[1].capacity",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][1]["cluster"] = json!(0),
        "topology.cpus[1].cluster",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][1]["core"] = json!(1.5),
        "topology.cpus[1].core",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][1]["core"] = json!("1"),
        "topology.cpus[1].core",
    );
    rejects(
        base,
        |v| v["topology"]["cpus"][1]["smt"] = json!(2),
        "topology.cpus[1].smt",
    );
    rejects(base, |v| v["topology"]["cpus"] = json!([]), "topology.cpus");
    rejects(
        base,
        |v| v["topology"]["numa_distance"] = json!([[10, 20]]),
        "topology.numa_distance",
    );
    rejects(
        base,
        |v| v["topology"]["numa_distance"] = json!([[10, 20], [21, 10]]),
        "topology.numa_distance[0][1]",
    );
    rejects(
        base,
        |v| v["topology"]["numa_distance"] = json!([[10, 20], [20, 11]]),
        "topology.numa_distance[1][1]",
    );
    rejects(
        base,
        |v| v["topology"]["numa_distance"] = json!([[10, 255], [255, 10]]),
        "topology.numa_distance[0][1]",
    );
    rejects(
        base,
        |v| v["topology"]["numa_distance"] = json!([[10, 20], [20]]),
        "topology.numa_distance[1]",
    );
}

#[test]
fn cpu_state_rules() {
    rejects(base, |v| v["cpus"][0]["id"] = json!(8), "cpus[0].id");
    rejects(
        base,
        |v| v["cpus"] = json!([{"id": 1}, {"id": 1}]),
        "cpus[1].id",
    );
    rejects(
        base,
        |v| {
            v["cpus"][0].as_object_mut().unwrap().remove("id");
        },
        "cpus[0].id",
    );
    rejects(
        base,
        |v| v["cpus"][0]["h_nr_idle"] = json!(3),
        "cpus[0].h_nr_idle",
    );
    rejects(
        base,
        |v| v["cpus"][0]["nr_delayed"] = json!(3),
        "cpus[0].nr_delayed",
    );
    rejects(
        base,
        |v| v["cpus"][0]["nr_running"] = json!(-1),
        "cpus[0].nr_running",
    );
    rejects(
        base,
        |v| v["cpus"][0]["load_avg"] = json!(-5),
        "cpus[0].load_avg",
    );
    rejects(
        base,
        |v| v["cpus"][0]["util_avg"] = json!(1u64 << 31),
        "cpus[0].util_avg",
    );
    rejects(
        base,
        |v| v["cpus"][0]["capacity"] = json!(1025),
        "cpus[0].capacity",
    );
    rejects(
        base,
        |v| v["cpus"][0]["capacity"] = json!(0),
        "cpus[0].capacity",
    );
    rejects(
        base,
        |v| v["cpus"][0]["actual_capacity"] = json!(2000),
        "cpus[0].actual_capacity",
    );
    // Past 16 bits: refused where the compact layout narrows it.
    rejects(
        base,
        |v| v["cpus"][0]["capacity"] = json!(70000),
        "cpus[0].capacity",
    );
    rejects(
        base,
        |v| v["cpus"][0]["actual_capacity"] = json!(1u64 << 20),
        "cpus[0].actual_capacity",
    );
    rejects(
        base,
        |v| v["cpus"][0]["idle_exit_latency"] = json!(u32::MAX),
        "cpus[0].idle_exit_latency",
    );
    rejects(
        base,
        |v| v["cpus"][0]["online"] = json!(1),
        "cpus[0].online",
    );
    rejects(
        base,
        |v| v["cpus"][0]["idle_exit_latency"] = json!(-1),
        "cpus[0].idle_exit_latency",
    );
    rejects(
        base,
        |v| v["cpus"][0]["idle_stamp"] = json!(2.5),
        "cpus[0].idle_stamp",
    );
    rejects(
        base,
        |v| v["cpus"][0]["nr_runnning"] = json!(1),
        "cpus[0].nr_runnning",
    );
    rejects(base, |v| v["cpus"] = json!({"id": 0}), "cpus");
}

#[test]
fn hint_rules() {
    rejects(
        base,
        |v| v["llc"] = json!({"7": {"nr_idle_scan": 1}}),
        "llc.7",
    );
    rejects(
        base,
        |v| v["llc"] = json!({"0": {"nr_idle_scan": -1}}),
        "llc.0.nr_idle_scan",
    );
    rejects(
        base,
        |v| v["llc"] = json!({"0": {"has_idle_cores": 1}}),
        "llc.0.has_idle_cores",
    );
    rejects(
        base,
        |v| v["llc"] = json!({"0": {"nr_idle": 1}}),
        "llc.0.nr_idle",
    );
    rejects(
        base,
        |v| v["asym"] = json!({"0-7": {"nr_idle_scan": 1}}),
        "asym.0-7",
    );
    // An LLC with one online CPU has no object: its entry is accepted and ignored.
    let mut v = base();
    v["cpus"] =
        json!([{"id": 1, "online": false}, {"id": 2, "online": false}, {"id": 3, "online": false}]);
    v["request"]["this_cpu"] = json!(4);
    v["llc"] = json!({"0": {"nr_idle_scan": 0}});
    assert!(parse(&v).is_ok());
}

#[test]
fn feature_and_system_rules() {
    rejects(
        base,
        |v| v["features"] = json!({"SIS_PROP": true}),
        "features.SIS_PROP",
    );
    rejects(
        base,
        |v| v["features"] = json!({"SIS_UTIL": 1}),
        "features.SIS_UTIL",
    );
    rejects(
        base,
        |v| v["system"] = json!({"migration_cost_ns": -2}),
        "system.migration_cost_ns",
    );
    rejects(
        base,
        |v| v["system"] = json!({"core_sched": "yes"}),
        "system.core_sched",
    );
    rejects(
        base,
        |v| v["system"] = json!({"uclamp": true}),
        "system.uclamp",
    );
}

#[test]
fn task_rules() {
    rejects(
        base,
        |v| v["task"]["cpus_allowed"] = json!("0-300"),
        "task.cpus_allowed",
    );
    rejects(
        base,
        |v| v["task"]["cpus_allowed"] = json!(""),
        "task.cpus_allowed",
    );
    rejects(
        base,
        |v| v["task"]["cpus_allowed"] = json!("3-1"),
        "task.cpus_allowed",
    );
    rejects(
        base,
        |v| v["task"]["cpus_allowed"] = json!("0,x"),
        "task.cpus_allowed",
    );
    rejects(
        base,
        |v| v["task"]["cpus_allowed"] = json!([0, 1]),
        "task.cpus_allowed",
    );
    rejects(
        base,
        |v| {
            v["task"].as_object_mut().unwrap().remove("prev_cpu");
        },
        "task.prev_cpu",
    );
    rejects(
        base,
        |v| {
            v.as_object_mut().unwrap().remove("task");
        },
        "task.prev_cpu",
    );
    rejects(base, |v| v["task"]["prev_cpu"] = json!(8), "task.prev_cpu");
    rejects(
        base,
        |v| v["task"]["recent_used_cpu"] = json!(-1),
        "task.recent_used_cpu",
    );
    rejects(base, |v| v["task"]["policy"] = json!("fifo"), "task.policy");
    rejects(
        base,
        |v| v["task"]["uclamp_min"] = json!(1025),
        "task.uclamp_min",
    );
    rejects(
        base,
        |v| v["task"]["uclamp_max"] = json!(-1),
        "task.uclamp_max",
    );
    rejects(
        base,
        |v| v["task"]["numa_preferred_nid"] = json!(-2),
        "task.numa_preferred_nid",
    );
    rejects(base, |v| v["task"]["hot"] = json!(0), "task.hot");
    rejects(base, |v| v["task"]["load"] = json!(0), "task.load");
    let msg = {
        let mut v = base();
        v["task"]["cpus_allowed"] = json!("0-2,300");
        parse(&v).unwrap_err().to_string()
    };
    assert_eq!(msg, "task.cpus_allowed: CPU 300 is not in the topology");
}

#[test]
fn placement_request_rules() {
    rejects(
        base,
        |v| v["request"]["kind"] = json!("migrate"),
        "request.kind",
    );
    rejects(
        base,
        |v| {
            v["request"].as_object_mut().unwrap().remove("kind");
        },
        "request.kind",
    );
    rejects(
        base,
        |v| {
            v["request"].as_object_mut().unwrap().remove("this_cpu");
        },
        "request.this_cpu",
    );
    rejects(
        base,
        |v| v["request"]["this_cpu"] = json!(9),
        "request.this_cpu",
    );
    rejects(
        base,
        |v| v["cpus"] = json!([{"id": 2, "online": false}]),
        "request.this_cpu",
    );
    rejects(
        base,
        |v| v["request"]["sync"] = json!("true"),
        "request.sync",
    );
    rejects(
        base,
        |v| v["request"]["waker_load"] = json!(-1),
        "request.waker_load",
    );
    rejects(
        base,
        |v| v["request"]["src_cpu"] = json!(1),
        "request.src_cpu",
    );
    // exec: this_cpu must be running the exec'ing task.
    rejects(
        base,
        |v| v["request"]["kind"] = json!("exec"),
        "request.this_cpu",
    );
    rejects(
        base,
        |v| {
            v["request"]["kind"] = json!("exec");
            v["cpus"] = json!([{"id": 2, "nr_running": 1, "curr_is_idle": true}]);
        },
        "request.this_cpu",
    );
}

#[test]
fn migrate_request_rules() {
    rejects(
        migrate_base,
        |v| v["request"]["dst_cpu"] = json!(1),
        "request.dst_cpu",
    );
    rejects(
        migrate_base,
        |v| {
            v["request"].as_object_mut().unwrap().remove("src_cpu");
        },
        "request.src_cpu",
    );
    rejects(
        migrate_base,
        |v| v["cpus"] = json!([{"id": 5, "online": false}]),
        "request.dst_cpu",
    );
    rejects(
        migrate_base,
        |v| v["request"]["sd_level"] = json!("PKG"),
        "request.sd_level",
    );
    rejects(
        migrate_base,
        |v| v["request"]["idle"] = json!("busy"),
        "request.idle",
    );
    rejects(
        migrate_base,
        |v| v["request"]["migration_type"] = json!("llc"),
        "request.migration_type",
    );
    rejects(
        migrate_base,
        |v| v["request"]["flags"] = json!(["LLC_PINNED"]),
        "request.flags[0]",
    );
    rejects(
        migrate_base,
        |v| v["request"]["flags"] = json!("ALL_PINNED"),
        "request.flags",
    );
    rejects(
        migrate_base,
        |v| v["request"]["dst_group"] = json!("0-8"),
        "request.dst_group",
    );
    rejects(
        migrate_base,
        |v| v["request"]["nr_balance_failed"] = json!(-1),
        "request.nr_balance_failed",
    );
    rejects(
        migrate_base,
        |v| v["request"]["this_cpu"] = json!(1),
        "request.this_cpu",
    );
}
