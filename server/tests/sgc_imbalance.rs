//! The `sgc_imbalance` hint (scenario format section 6.1) in the fork/exec
//! slow path: `group_classify()` returns `group_imbalanced` for a marked
//! group unless it is overloaded, `update_pick_idlest()` never replaces the
//! idlest with an equal imbalanced group, and `sched_balance_find_dst_group()`
//! stays local when the local group and the idlest are both imbalanced.
//! Each case is worked by hand and decided with and without the hint, so the
//! test shows what the hint changes; files without the hint are unchanged
//! (the example and hand-case files run elsewhere).

use fairplace::offline::scenario::decide_value;
use serde_json::{Value, json};

/// (cpu, path) of a scenario, or the error text.
fn place(s: &Value) -> Result<(u64, String), String> {
    let out = decide_value(s).map_err(|e| e.to_string())?;
    Ok((
        out["cpu"].as_u64().unwrap(),
        out["path"].as_str().unwrap().to_string(),
    ))
}

fn with_hint(s: &Value, hint: Value) -> Value {
    let mut s = s.clone();
    s["sgc_imbalance"] = hint;
    s
}

/// `n_llc` LLCs of four single-thread CPUs on one node: each CPU has MC
/// (its LLC, groups of one CPU) and PKG (every CPU, groups = the LLCs).
fn llcs(n_llc: usize) -> Value {
    let cpus: Vec<Value> = (0..4 * n_llc)
        .map(|i| json!({"id": i, "core": i, "llc": i / 4}))
        .collect();
    json!({ "cpus": cpus })
}

/// A 6.12 fork on CPU 0 of `topology` with the per-CPU state `cpus`.
fn fork_on_cpu0(topology: Value, cpus: Vec<Value>) -> Value {
    json!({
        "kernel": "6.12",
        "topology": topology,
        "cpus": cpus,
        "task": {},
        "request": {"kind": "fork", "this_cpu": 0}
    })
}

/// Fork on CPU 0 of two LLCs: CPUs 0-2 busy (the parent on 0), 3 idle; the
/// other LLC all idle, CPU 6 idle most recently.
fn fork_two_llcs() -> Value {
    let mut cpus = vec![
        json!({"id": 0, "nr_running": 1}),
        json!({"id": 1, "nr_running": 1}),
        json!({"id": 2, "nr_running": 1}),
        json!({"id": 3, "idle_stamp": 100}),
    ];
    for (i, stamp) in [(4, 200), (5, 300), (6, 900), (7, 400)] {
        cpus.push(json!({"id": i, "idle_stamp": stamp}));
    }
    fork_on_cpu0(llcs(2), cpus)
}

#[test]
fn an_imbalanced_remote_group_is_not_left_for() {
    // PKG: local {0-3} has spare (1 idle), remote {4-7} has spare (4 idle).
    // Unmarked: same type, local has fewer idle CPUs -> leave for {4-7}; its
    // idlest CPU is the most recently idle, 6; MC of 6: all equal -> 6.
    // Marked: remote is group_imbalanced (5) > local has_spare (0) -> stay.
    // MC of 0: groups {0},{1},{2} none idle, {3} idle -> 3.
    let s = fork_two_llcs();
    assert_eq!(place(&s), Ok((6, "slow_path".into())));
    let marked = with_hint(&s, json!({"PKG": ["4-7"]}));
    assert_eq!(place(&marked), Ok((3, "slow_path".into())));
    // The same with an affinity that keeps the group from the snapshot's
    // sums (the CPU walk): CPU 7 not allowed.
    let mut walk = s.clone();
    walk["task"] = json!({"cpus_allowed": "0-6"});
    assert_eq!(place(&walk), Ok((6, "slow_path".into())));
    let mut walk_marked = marked;
    walk_marked["task"] = json!({"cpus_allowed": "0-6"});
    assert_eq!(place(&walk_marked), Ok((3, "slow_path".into())));
}

#[test]
fn an_imbalanced_local_group_is_left_unless_the_idlest_is_too() {
    // Local {0-3} marked: imbalanced (5) > remote has_spare (0) -> leave
    // for {4-7} -> 6 (as unmarked). Both marked: same type, "not used in
    // the slow wakeup path" -> stay local -> 3.
    let s = fork_two_llcs();
    // Make the local group the idlest one unmarked: everything stays local.
    let mut quiet = s.clone();
    quiet["cpus"] = json!([
        {"id": 0, "nr_running": 1}, {"id": 3, "idle_stamp": 100},
        {"id": 1, "idle_stamp": 50}, {"id": 2, "idle_stamp": 60},
        {"id": 4, "nr_running": 1}, {"id": 5, "nr_running": 1},
        {"id": 6, "nr_running": 1}, {"id": 7, "nr_running": 1}
    ]);
    // Unmarked: local 3 idle > remote 0 idle -> stay; MC of 0: {1},{2},{3}
    // idle, equal -> the first in the ring, {1}: 1 idle > {0}'s 0 -> 1.
    assert_eq!(place(&quiet), Ok((1, "slow_path".into())));
    // Local marked: imbalanced (5) > has_spare (0) -> leave for {4-7}: no
    // idle CPU there, all loads 0 -> the first, 4; MC of 4 -> 4 (all busy
    // and equal: stay).
    let local = with_hint(&quiet, json!({"PKG": ["0-3"]}));
    assert_eq!(place(&local), Ok((4, "slow_path".into())));
    // Both marked: equal types -> stay local -> 1 as unmarked.
    let both = with_hint(&quiet, json!({"PKG": ["0-3", "4-7"]}));
    assert_eq!(place(&both), Ok((1, "slow_path".into())));
    // And the first case with both marked: stay local -> 3.
    let both = with_hint(&s, json!({"PKG": ["0-3", "4-7"]}));
    assert_eq!(place(&both), Ok((3, "slow_path".into())));
}

#[test]
fn an_equal_imbalanced_group_does_not_replace_the_idlest() {
    // Three LLCs; local {0-3} fully busy; {4-7} and {8-11} both marked and
    // with spare. {8-11} has more idle CPUs, so unmarked it wins.
    // Marked: {4-7} is imbalanced (5) < WORST overloaded -> idlest; {8-11}
    // is also imbalanced: "not used in the slow path" -> not taken. Local
    // fully busy (1) < imbalanced (5) -> stay local -> MC of 0: every CPU
    // busy with equal load -> 0.
    let mut cpus: Vec<Value> = (0..4)
        .map(|i| json!({"id": i, "nr_running": 1, "util_avg": 1000}))
        .collect();
    cpus.push(json!({"id": 4, "nr_running": 1}));
    cpus.push(json!({"id": 5, "nr_running": 1}));
    cpus.push(json!({"id": 6, "idle_stamp": 10}));
    cpus.push(json!({"id": 7, "idle_stamp": 20}));
    for i in 8..12 {
        cpus.push(json!({"id": i, "idle_stamp": 30 + i}));
    }
    let s = fork_on_cpu0(llcs(3), cpus);
    // Unmarked: {8-11} (4 idle) beats {4-7} (2 idle); local fully busy ->
    // leave -> most recently idle of 8-11 = 11.
    assert_eq!(place(&s), Ok((11, "slow_path".into())));
    let marked = with_hint(&s, json!({"PKG": ["4-7", "8-11"]}));
    assert_eq!(place(&marked), Ok((0, "slow_path".into())));
    // Only {8-11} marked: {4-7} has spare (0) beats it -> {4-7}; local
    // fully busy (1) > has spare (0) -> leave -> most recent idle, 7.
    let one = with_hint(&s, json!({"PKG": ["8-11"]}));
    assert_eq!(place(&one), Ok((7, "slow_path".into())));
}

#[test]
fn an_overloaded_group_is_overloaded_even_when_marked() {
    // Three LLCs, every CPU runs two tasks with runnable 1500 (> 1024 x
    // 117 %): every group is overloaded. Loads per CPU: local 3000, {4-7}
    // 2000, {8-11} 1000. {4-7} is marked.
    // Overloaded first (the kernel's order): {8-11} has the lower avg_load
    // (1000 < 2000) -> idlest; local 3000 vs 1000 + 174: leave -> the least
    // loaded of 8-11 (all equal) = 8; MC of 8: all equal -> stay -> 8.
    // Were the mark tested first, {4-7} would be imbalanced (5) < overloaded
    // and chosen: CPU 4.
    let cpus: Vec<Value> = (0..12)
        .map(|i| {
            let load = [3000, 2000, 1000][i / 4];
            json!({"id": i, "nr_running": 2, "runnable_avg": 1500, "util_avg": 1000, "load_avg": load})
        })
        .collect();
    let s = fork_on_cpu0(llcs(3), cpus);
    assert_eq!(place(&s), Ok((8, "slow_path".into())));
    let marked = with_hint(&s, json!({"PKG": ["4-7"]}));
    assert_eq!(place(&marked), Ok((8, "slow_path".into())));
}

#[test]
fn numa_levels_are_named_as_the_kernel_and_the_format_do() {
    // Two nodes of two LLCs: MC {4 CPUs}, PKG {node, 8 CPUs}, NUMA1 (all).
    let cpus: Vec<Value> = (0..16)
        .map(|i| json!({"id": i, "core": i, "llc": i / 4, "node": i / 8}))
        .collect();
    let mut state: Vec<Value> = (0..8).map(|i| json!({"id": i, "nr_running": 1})).collect();
    state.extend((8..16).map(|i| json!({"id": i, "idle_stamp": i})));
    let s = fork_on_cpu0(
        json!({"cpus": cpus, "numa_distance": [[10, 20], [20, 10]]}),
        state,
    );
    // Unmarked: NUMA1 groups {0-7} (no idle) and {8-15} (8 idle) -> leave
    // (imbalance 8 is above adjust_numa_imbalance's allowance) -> 15, the
    // most recently idle; below it the PKG and MC levels keep it (an idle
    // local group of equal idle count is not left).
    assert_eq!(place(&s), Ok((15, "slow_path".into())));
    // "NUMA" and "NUMA1" name the same level. With the remote node marked
    // it is imbalanced (5); the local node is fully busy (1) < 5 -> stay.
    // PKG of 0: {0-3} and {4-7} fully busy and equal -> stay; MC: every
    // CPU busy and equal -> 0.
    for key in ["NUMA", "NUMA1"] {
        let marked = with_hint(&s, json!({ key: ["8-15"] }));
        assert_eq!(place(&marked), Ok((0, "slow_path".into())), "{key}");
    }
}

#[test]
fn a_hint_that_names_no_group_is_rejected_naming_the_field() {
    let s = fork_two_llcs();
    let err = |hint: Value| place(&with_hint(&s, hint)).unwrap_err();
    // Not a group of a PKG domain (a group of MC is a single CPU).
    let e = err(json!({"PKG": ["0-5"]}));
    assert!(e.contains("sgc_imbalance.PKG[0]"), "{e}");
    assert!(err(json!({"MC": ["0-3"]})).contains("sgc_imbalance.MC[0]"));
    // No such level in this topology (one node), or no such name at all.
    assert!(err(json!({"NUMA": ["0-7"]})).contains("sgc_imbalance.NUMA[0]"));
    let e = err(json!({"LLC": ["0-3"]}));
    assert!(
        e.contains("sgc_imbalance.LLC") && e.contains("domain name"),
        "{e}"
    );
    assert!(err(json!({"NUMA0": ["0-3"]})).contains("sgc_imbalance.NUMA0"));
    // Wrong shapes.
    assert!(err(json!(["0-3"])).contains("sgc_imbalance"));
    assert!(err(json!({"PKG": "0-3"})).contains("sgc_imbalance.PKG"));
    assert!(err(json!({"PKG": [3]})).contains("sgc_imbalance.PKG[0]"));
    assert!(err(json!({"PKG": ["0-99"]})).contains("sgc_imbalance.PKG[0]"));
    // An empty object or list is no mark at all.
    assert_eq!(place(&with_hint(&s, json!({}))), place(&s));
    assert_eq!(place(&with_hint(&s, json!({"PKG": []}))), place(&s));
}
