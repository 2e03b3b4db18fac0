//! Task lists through the store, balance passes against stored state
//! (node and rack), proposals applied as claims, and every bad task input
//! refused with its field named and the stored state unchanged.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace::engine::balance::migrate::MigrationType;
use fairplace::engine::cpumask::CpuMask;
use fairplace::engine::rq::RqTask;
use fairplace::engine::state::CpuState;
use fairplace::engine::topology::{CpuTopo, TopologySpec};
use fairplace::store::cluster::ClusterBalanceRequest;
use fairplace::store::passes::BalanceRequest;
use fairplace::store::{
    CpuTaskList, MAX_RUNTIME_PER_CPU, Node, Reject, RuntimeEntry, Store, StoreConfig, Update,
};
use fairplace_proto::v1 as pb;

const CLOCK: i64 = 10_000_000_000;

/// `n` CPUs, one core each, one LLC.
fn spec(n: u32) -> TopologySpec {
    TopologySpec {
        cpus: (0..n)
            .map(|i| CpuTopo {
                core: i,
                cluster: None,
                llc: 0,
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    }
}

fn store() -> Store {
    Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        ..StoreConfig::default()
    })
}

/// A task of process 5: load 1024, util 500; `age_ns` since it last ran.
fn task(id: u64, age_ns: i64, running: bool) -> RqTask {
    let mut t = RqTask::new(id, 5, 1024);
    t.util_avg = 500;
    t.exec_start = CLOCK - age_ns;
    t.running = running;
    t.nr_threads = 8;
    t
}

/// Each `(cpu, tasks)` runs those tasks (the first running); other CPUs idle.
fn full(n: u32, seq: u64, lists: Vec<(u32, Vec<RqTask>)>) -> Update {
    let mut cpus = Vec::new();
    for i in 0..n {
        let k = lists
            .iter()
            .find(|(c, _)| *c == i)
            .map_or(0, |(_, l)| l.len() as u32);
        let mut c = CpuState::idle(1024);
        if k > 0 {
            c.nr_running = k;
            c.cfs_h_nr_queued = k;
            c.curr_is_idle = false;
            c.load_avg = 1024 * k;
            c.runnable_avg = 1024 * k;
            c.util_avg = 1000;
            c.util_est = 1000;
        }
        cpus.push((i, c));
    }
    Update {
        seq,
        full: true,
        cpus,
        core_cookies: Vec::new(),
        tasks: lists
            .into_iter()
            .map(|(cpu, l)| CpuTaskList {
                cpu,
                clock: CLOCK,
                tasks: l.into_iter().map(|t| (t, None)).collect(),
            })
            .collect(),
        runtime: vec![],
    }
}

fn node(s: &Store, id: &str, labels: &[(&str, &str)], n: u32) -> (Arc<Node>, u64) {
    let labels = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    s.nodes.register(id, labels, "t".into(), spec(n)).unwrap()
}

fn ids(n: &Node, cpu: usize) -> Vec<u64> {
    n.snapshot().tasks.cpus[cpu].iter().map(|t| t.id).collect()
}

#[test]
fn task_lists_are_kept_most_recently_run_first_and_deltas_replace_them() {
    let s = store();
    let (n, g) = node(&s, "a", &[], 4);
    // Reported out of order; stored by exec_start, most recent first.
    let u = full(
        4,
        1,
        vec![(
            0,
            vec![
                task(3, 30_000_000, false),
                task(1, 0, true),
                task(2, 20_000_000, false),
            ],
        )],
    );
    s.nodes.apply(&n, g, &u, Instant::now()).unwrap();
    assert_eq!(ids(&n, 0), vec![1, 2, 3]);
    // A delta lists CPU 1 with task 3: it moved, so CPU 0 loses it.
    let mut d = Update {
        seq: 2,
        full: false,
        ..Update::default()
    };
    d.tasks.push(CpuTaskList {
        cpu: 1,
        clock: CLOCK,
        tasks: vec![(task(3, 0, true), None)],
    });
    s.nodes.apply(&n, g, &d, Instant::now()).unwrap();
    assert_eq!(ids(&n, 0), vec![1, 2]);
    assert_eq!(ids(&n, 1), vec![3]);
    // A delta without task lists keeps them (the same table is shared).
    let before = Arc::clone(&n.snapshot().tasks);
    let d = Update {
        seq: 3,
        full: false,
        cpus: vec![(2, CpuState::idle(1024))],
        ..Update::default()
    };
    s.nodes.apply(&n, g, &d, Instant::now()).unwrap();
    assert!(Arc::ptr_eq(&before, &n.snapshot().tasks));
    // A full update without lists clears them.
    s.nodes
        .apply(&n, g, &full(4, 9, vec![]), Instant::now())
        .unwrap();
    assert!(n.snapshot().tasks.is_empty());
}

#[test]
fn every_bad_task_list_is_refused_with_its_field_and_changes_nothing() {
    let s = store();
    let (n, g) = node(&s, "a", &[], 4);
    s.nodes
        .apply(
            &n,
            g,
            &full(4, 1, vec![(0, vec![task(1, 0, true)])]),
            Instant::now(),
        )
        .unwrap();
    let before = n.snapshot();
    let bad = |f: &dyn Fn(&mut Update)| {
        let mut u = full(
            4,
            2,
            vec![(0, vec![task(1, 0, true)]), (1, vec![task(2, 0, true)])],
        );
        f(&mut u);
        u
    };
    let offline = |u: &mut Update| u.cpus[3].1.online = false;
    let cases: Vec<(&str, Update)> = vec![
        ("update.tasks[1].cpu", bad(&|u| u.tasks[1].cpu = 9)),
        ("update.tasks[1].cpu", bad(&|u| u.tasks[1].cpu = 0)),
        (
            "update.tasks[1].cpu",
            bad(&|u| {
                offline(u);
                u.tasks[1].cpu = 3;
            }),
        ),
        (
            "update.tasks[1].tasks[0].id",
            bad(&|u| u.tasks[1].tasks[0].0.id = 1),
        ),
        (
            "update.tasks[0].tasks[1].running",
            bad(&|u| u.tasks[0].tasks.push((task(7, 0, true), None))),
        ),
        (
            "update.tasks[0].tasks[0].cpus_allowed",
            bad(&|u| {
                offline(u);
                u.tasks[0].tasks[0].1 = Some(CpuMask::from_cpus([3]));
            }),
        ),
        (
            "update.tasks[0].clock_task",
            bad(&|u| u.tasks[0].clock = -1),
        ),
        (
            "update.tasks[0].tasks",
            bad(&|u| {
                u.tasks[0].tasks = (0..1025).map(|i| (task(100 + i, 5, false), None)).collect()
            }),
        ),
        (
            "update.runtime[0].group",
            bad(&|u| {
                u.runtime.push(RuntimeEntry {
                    group: 0,
                    cpu: 0,
                    runtime_ns: 1,
                    nr_threads: 1,
                })
            }),
        ),
        (
            "update.runtime[0].cpu",
            bad(&|u| {
                u.runtime.push(RuntimeEntry {
                    group: 5,
                    cpu: 4,
                    runtime_ns: 1,
                    nr_threads: 1,
                })
            }),
        ),
        (
            "update.runtime",
            bad(&|u| {
                // One more than the limit of the node's 4 CPUs.
                u.runtime = (0..(4 * MAX_RUNTIME_PER_CPU + 1) as u64)
                    .map(|i| RuntimeEntry {
                        group: 5 + i,
                        cpu: 0,
                        runtime_ns: 1,
                        nr_threads: 2,
                    })
                    .collect()
            }),
        ),
        (
            "update.runtime[0].runtime_ns",
            bad(&|u| {
                u.runtime.push(RuntimeEntry {
                    group: 5,
                    cpu: 0,
                    runtime_ns: u64::MAX,
                    nr_threads: 1,
                })
            }),
        ),
    ];
    for (field, u) in cases {
        match s.nodes.apply(&n, g, &u, Instant::now()) {
            Err(Reject::Invalid(e)) => assert_eq!(e.field, field, "{e}"),
            other => panic!("{field}: {other:?}"),
        }
        let after = n.snapshot();
        assert_eq!(after.version, before.version, "{field}");
        assert!(Arc::ptr_eq(&after.tasks, &before.tasks), "{field}");
        assert_eq!(after.state.cpus, before.state.cpus, "{field}");
    }
    assert_eq!(n.last_seq(), 1);
}

#[test]
fn bad_task_fields_from_the_wire_name_their_field() {
    let spec = spec(4);
    let mk = |f: &dyn Fn(&mut pb::RunnableTask)| {
        let mut t = pb::RunnableTask {
            id: 1,
            group: 5,
            ..Default::default()
        };
        f(&mut t);
        pb::Update {
            seq: 1,
            full: false,
            tasks: vec![pb::CpuTasks {
                cpu: 0,
                tasks: vec![pb::RunnableTask::default(), t],
                clock_task: 0,
            }],
            ..Default::default()
        }
    };
    let cases: Vec<(&str, pb::Update)> = vec![
        ("update.tasks[0].tasks[1].nice", mk(&|t| t.nice = 20)),
        ("update.tasks[0].tasks[1].policy", mk(&|t| t.policy = 9)),
        (
            "update.tasks[0].tasks[1].load_avg",
            mk(&|t| t.load_avg = -1),
        ),
        (
            "update.tasks[0].tasks[1].util_avg",
            mk(&|t| t.util_avg = 1 << 31),
        ),
        (
            "update.tasks[0].tasks[1].cpus_allowed",
            mk(&|t| t.cpus_allowed = "0-9".into()),
        ),
        (
            "update.tasks[0].tasks[1].cpus_allowed",
            mk(&|t| t.cpus_allowed = "x".into()),
        ),
        (
            "update.tasks[0].tasks[1].exec_start",
            mk(&|t| t.exec_start = -5),
        ),
    ];
    for (field, u) in cases {
        let e = fairplace::convert::update(&u, &spec).unwrap_err();
        assert_eq!(e.field, field, "{e}");
    }
    // A valid one converts, with its mask.
    let ok = mk(&|t| t.cpus_allowed = "1-2".into());
    let u = fairplace::convert::update(&ok, &spec).unwrap();
    assert_eq!(u.tasks[0].tasks[1].1, Some(CpuMask::from_cpus([1, 2])));
}

#[test]
fn a_node_balance_proposes_the_coldest_task_and_apply_claims_its_destination() {
    // 4 CPUs, one LLC: only the MC domain, each CPU its own group. CPU 0
    // runs tasks 1 (running), 2 and 3 (cold). Destinations in order:
    // CPU 0: busy, no other group has tasks: balanced.
    // CPU 1: busiest {0} overloaded (3 > 1 tasks, util 1000 * 117 >
    //   1024 * 100); local {1} has spare; MC shares the LLC, so type task;
    //   a one-CPU busiest: sibling_imbalance 3 - 0 = 3, >> 1 = 1: the tail,
    //   task 3, moves to CPU 1.
    // CPU 2: {0} now 2 tasks, runnable 2048 * 100 > 1024 * 117: overloaded;
    //   imbalance (2 - 0) >> 1 = 1: task 2 moves to CPU 2.
    // CPU 3: {0}, {1}, {2} each run one task with room: has_spare; the
    //   busiest not overloaded has one task: balanced.
    let s = store();
    let (n, g) = node(&s, "a", &[], 4);
    let u = full(
        4,
        1,
        vec![(
            0,
            vec![
                task(1, 0, true),
                task(2, 20_000_000, false),
                task(3, 30_000_000, false),
            ],
        )],
    );
    s.nodes.apply(&n, g, &u, Instant::now()).unwrap();
    let out = s
        .passes
        .balance(&n, &BalanceRequest::default(), Instant::now());
    let got: Vec<(u64, usize, usize, MigrationType)> = out
        .proposals
        .iter()
        .map(|p| (p.task, p.src_cpu, p.dst_cpu, p.migration_type))
        .collect();
    assert_eq!(
        got,
        vec![
            (3, 0, 1, MigrationType::Task),
            (2, 0, 2, MigrationType::Task)
        ]
    );
    assert_eq!(out.stats.domains_balanced, 4);
    assert_eq!(out.stats.rejections.iter().sum::<u64>(), 0);
    // max_proposals ends the pass after the first.
    let one = s.passes.balance(
        &n,
        &BalanceRequest {
            max_proposals: 1,
            ..BalanceRequest::default()
        },
        Instant::now(),
    );
    assert_eq!(one.proposals.len(), 1);
    assert_eq!(one.proposals[0].task, 3);
    // Nothing stored changed.
    assert_eq!(n.snapshot().state.cpus[1].nr_running, 0);
    assert_eq!(ids(&n, 0), vec![1, 2, 3]);
    // With apply, each destination gets a claim.
    let out = s.passes.balance(
        &n,
        &BalanceRequest {
            apply: true,
            ..BalanceRequest::default()
        },
        Instant::now(),
    );
    assert_eq!(out.claimed, 2);
    let snap = n.snapshot();
    assert_eq!(snap.claims, vec![(1, 1), (2, 1)]);
    assert_eq!(snap.state.cpus[1].nr_running, 1);
}

/// Rack z1/r1 with nodes a (4 CPUs x 2 tasks) and b (idle).
fn rack(s: &Store, hot: bool, pinned: bool) -> (Arc<Node>, Arc<Node>) {
    let l = [("zone", "z1"), ("rack", "r1")];
    let (a, ga) = node(s, "a", &l, 4);
    let (b, gb) = node(s, "b", &l, 4);
    let age = if hot { 100_000 } else { 30_000_000 };
    let lists = (0..4)
        .map(|c| {
            (
                c,
                vec![
                    task(10 * c as u64 + 1, 0, true),
                    task(10 * c as u64 + 2, age, false),
                ],
            )
        })
        .collect();
    let mut u = full(4, 1, lists);
    if pinned {
        for l in &mut u.tasks {
            let cpu = l.cpu as usize;
            for t in &mut l.tasks {
                t.1 = Some(CpuMask::from_cpus([cpu]));
            }
        }
    }
    s.nodes.apply(&a, ga, &u, Instant::now()).unwrap();
    s.nodes
        .apply(&b, gb, &full(4, 1, vec![]), Instant::now())
        .unwrap();
    (a, b)
}

fn rack_req() -> ClusterBalanceRequest {
    ClusterBalanceRequest {
        level: "rack".into(),
        group: "z1/r1".into(),
        ..ClusterBalanceRequest::default()
    }
}

#[test]
fn a_rack_balance_pulls_one_cold_task_to_the_idle_node() {
    // Children of the rack: nodes a and b. Destination a: it has no idle
    // CPU, it is the only node of its group and balances; no other group
    // has tasks: nothing. Destination b (idle, has_spare) against busiest
    // a: 8 tasks on 4 CPUs, util 4000 * 117 > 4096 * 100: overloaded.
    // Cluster levels are NUMA-like (no prefer_sibling); busiest overloaded,
    // local has spare, the level does not share an LLC: util type,
    // imbalance = max(4096, 0) - 0 = 4096. Busiest node a; its busiest CPU
    // for util: each reads max(1000, 2048) capped at 1024: the first, CPU
    // 0. Destination CPU: b's first idle CPU, 0. detach: loop_max =
    // min(32, 2) = 2; the tail task 2 (cold, util 500 <= 4096) moves; then
    // the source has one task and the destination is idle: stop.
    let s = store();
    let (_a, b) = rack(&s, false, false);
    let out = s
        .cluster
        .balance(&rack_req(), Default::default(), Instant::now())
        .unwrap();
    assert_eq!(out.proposals.len(), 1, "{:?}", out.proposals);
    let p = &out.proposals[0];
    assert_eq!(
        (
            p.task,
            p.src_node.as_str(),
            p.src_cpu,
            p.dst_node.as_str(),
            p.dst_cpu
        ),
        (2, "a", 0, "b", 0)
    );
    assert_eq!(p.migration_type, MigrationType::Util);
    assert_eq!(p.imbalance, 4096);
    assert_eq!(out.stats.domains_balanced, 2);
    // Applied: b's CPU 0 is claimed.
    let out = s
        .cluster
        .balance(
            &ClusterBalanceRequest {
                apply: true,
                ..rack_req()
            },
            Default::default(),
            Instant::now(),
        )
        .unwrap();
    assert_eq!(out.claimed, 1);
    assert_eq!(b.snapshot().claims, vec![(0, 1)]);
}

#[test]
fn tasks_bound_to_their_cpus_never_leave_their_node() {
    // The same rack with every task pinned to its CPU: both tasks of the
    // source CPU are refused for affinity (tested before running, as in
    // can_migrate_task); nothing moves.
    let s = store();
    rack(&s, false, true);
    let out = s
        .cluster
        .balance(&rack_req(), Default::default(), Instant::now())
        .unwrap();
    assert!(out.proposals.is_empty());
    let named: Vec<(&str, u64)> = out.stats.rejection_counts().collect();
    assert_eq!(named, vec![("affinity", 2)]);
}

#[test]
fn a_cache_hot_task_crosses_nodes_only_after_three_failed_passes() {
    // Task 2 ran 100 µs ago (< 500 µs): hot. cache_nice_tries of the cluster
    // levels is 2: passes with nr_balance_failed 0, 1, 2 refuse it (and
    // count a failure each); the fourth (3 > 2) moves it, forced hot.
    let s = store();
    rack(&s, true, false);
    for pass in 0..3 {
        let out = s
            .cluster
            .balance(&rack_req(), Default::default(), Instant::now())
            .unwrap();
        assert!(out.proposals.is_empty(), "pass {pass}");
        assert!(
            out.stats
                .rejection_counts()
                .any(|(r, n)| r == "hot" && n == 1),
            "pass {pass}"
        );
    }
    let out = s
        .cluster
        .balance(&rack_req(), Default::default(), Instant::now())
        .unwrap();
    assert_eq!(out.proposals.len(), 1);
    assert!(out.proposals[0].forced_hot);
    assert_eq!(out.proposals[0].nr_balance_failed, 3);
    // Success resets the counter: the next pass refuses it again.
    let out = s
        .cluster
        .balance(&rack_req(), Default::default(), Instant::now())
        .unwrap();
    assert!(out.proposals.is_empty());
}

#[test]
fn a_bad_cluster_group_names_its_field() {
    let s = store();
    rack(&s, false, false);
    let err = |level: &str, group: &str| {
        s.cluster
            .balance(
                &ClusterBalanceRequest {
                    level: level.into(),
                    group: group.into(),
                    ..ClusterBalanceRequest::default()
                },
                Default::default(),
                Instant::now(),
            )
            .unwrap_err()
            .field
    };
    assert_eq!(err("row", "z1"), "cluster_level");
    assert_eq!(err("rack", "r1"), "cluster_group");
    assert_eq!(err("rack", "z9/r1"), "cluster_group");
    // A zone balance of z1: its one rack is its only child, holding both
    // nodes; b (idle) balances for it, a declines; no other group.
    let out = s
        .cluster
        .balance(
            &ClusterBalanceRequest {
                level: "zone".into(),
                group: "z1".into(),
                ..ClusterBalanceRequest::default()
            },
            Default::default(),
            Instant::now(),
        )
        .unwrap();
    assert!(out.proposals.is_empty());
    assert_eq!(
        (out.stats.domains_balanced, out.stats.domains_declined),
        (1, 1)
    );
}

/// 8 CPUs, two LLCs of four (no SMT): MC then PKG.
fn two_llcs() -> TopologySpec {
    TopologySpec {
        cpus: (0..8)
            .map(|i| CpuTopo {
                core: i,
                cluster: None,
                llc: i / 4,
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    }
}

/// Process 5 (4 threads) runs tasks 51+52 on CPU 4, 53 on CPU 5 and 54 on
/// CPU 6 (LLC 1); CPUs 0-3 (LLC 0) are idle. Its recent runtime was on
/// `history` CPUs, which decides its preferred LLC.
fn cache_node(history: &[u32]) -> (Store, Arc<Node>) {
    let s = store();
    let (n, g) = s
        .nodes
        .register("c", vec![], "t".into(), two_llcs())
        .unwrap();
    let t = |id, running| {
        let mut x = task(id, if running { 0 } else { 30_000_000 }, running);
        x.nr_threads = 4;
        x.util_avg = 300;
        x
    };
    let mut u = full(
        8,
        1,
        vec![
            (4, vec![t(51, true), t(52, false)]),
            (5, vec![t(53, true)]),
            (6, vec![t(54, true)]),
        ],
    );
    for (_, c) in &mut u.cpus {
        c.util_avg = c.util_avg.min(600);
        c.util_est = c.util_avg;
    }
    u.runtime = history
        .iter()
        .map(|&cpu| RuntimeEntry {
            group: 5,
            cpu,
            runtime_ns: 5_000_000,
            nr_threads: 4,
        })
        .collect();
    let later = Instant::now() + Duration::from_millis(50);
    s.nodes.apply(&n, g, &u, later).unwrap();
    let scans = s.passes.account(&n, &u.runtime, later);
    assert_eq!(scans.len(), 1, "one task_cache_work pass for process 5");
    (s, n)
}

#[test]
fn cache_aware_balancing_pulls_a_thread_toward_its_preferred_llc() {
    // The runtime was on LLC 0: process 5 prefers LLC 0 (scan: occupancy of
    // LLC 0 > 2 x 0). From idle CPU 0: nothing at MC (CPUs 0-3 idle); at
    // PKG the LLC 1 group holds 4 tasks preferring LLC 0 and LLC 0 fits
    // (util 0 < 50 %): group_llc_balance, which prefer_sibling forces;
    // migrate_llc_task, imbalance 1; the source is the CPU with most such
    // tasks (CPU 4, 2); its tail task 52 prefers CPU 0's LLC: moves.
    let (s, n) = cache_node(&[0, 1, 2, 3]);
    let c = s.passes.cache_summary(&n, Instant::now());
    assert!(c.enabled);
    let p5 = c.procs.iter().find(|p| p.group == 5).unwrap();
    assert_eq!(p5.preferred_llc, Some(0));
    let req = BalanceRequest {
        dst_cpus: Some(CpuMask::from_cpus([0])),
        ..BalanceRequest::default()
    };
    let out = s.passes.balance(&n, &req, Instant::now());
    assert!(out.cache_aware);
    let got: Vec<_> = out
        .proposals
        .iter()
        .map(|p| {
            (
                p.task,
                p.src_cpu,
                p.dst_cpu,
                p.migration_type,
                p.llc_preference,
            )
        })
        .collect();
    assert_eq!(got, vec![(52, 4, 0, MigrationType::LlcTask, true)]);
    // With SCHED_CACHE off the same pass is ordinary balancing: sibling
    // imbalance 4 - 0 = 4, >> 1 = 2 tasks; CPU 4 gives its tail, then keeps
    // its last task (the destination is idle).
    s.nodes
        .set_features(Some(&n), &[("SCHED_CACHE".into(), false)], false)
        .unwrap();
    let out = s.passes.balance(&n, &req, Instant::now());
    assert!(!out.cache_aware);
    let got: Vec<_> = out
        .proposals
        .iter()
        .map(|p| {
            (
                p.task,
                p.src_cpu,
                p.dst_cpu,
                p.migration_type,
                p.llc_preference,
            )
        })
        .collect();
    assert_eq!(got, vec![(52, 4, 0, MigrationType::Task, false)]);
}

#[test]
fn a_thread_is_not_pulled_off_its_preferred_llc_and_the_pass_is_not_a_failure() {
    // The runtime was on LLC 1 (where the threads are): process 5 prefers
    // LLC 1. The PKG pass from CPU 0 asks for 2 tasks (sibling imbalance);
    // each candidate would leave its preferred LLC while that LLC still
    // fits (util 1800 * 100 < 4096 * 50): migrate_degrades_llc refuses it
    // (LLC_PINNED, reason llc_pinned), the running ones are refused for
    // running. Nothing moves, and an LLC-pinned pass does not count as a
    // failed balance: nr_balance_failed of CPU 0's PKG stays 0.
    let (s, n) = cache_node(&[4, 5, 6, 7]);
    let req = BalanceRequest {
        dst_cpus: Some(CpuMask::from_cpus([0])),
        ..BalanceRequest::default()
    };
    let out = s.passes.balance(&n, &req, Instant::now());
    assert!(out.proposals.is_empty(), "{:?}", out.proposals);
    let named: Vec<(&str, u64)> = out.stats.rejection_counts().collect();
    assert!(named.contains(&("llc_pinned", 1)), "{named:?}");
    assert!(named.contains(&("running", 1)), "{named:?}");
    // The same pass repeated keeps refusing: no failure was counted, so the
    // cache-hot-style forgiveness (nr_balance_failed > cache_nice_tries)
    // never lets it through.
    for _ in 0..3 {
        let out = s.passes.balance(&n, &req, Instant::now());
        assert!(out.proposals.is_empty());
    }
}

#[test]
fn a_cpu_going_offline_drops_its_task_list() {
    // A delta that only marks CPU 1 offline: the tasks it listed are gone
    // (an offline CPU runs nothing), the other CPUs' lists stay.
    let s = store();
    let (n, g) = node(&s, "a", &[], 4);
    let u = full(
        4,
        1,
        vec![(0, vec![task(1, 0, true)]), (1, vec![task(2, 0, true)])],
    );
    s.nodes.apply(&n, g, &u, Instant::now()).unwrap();
    let mut off = CpuState::idle(1024);
    off.online = false;
    let d = Update {
        seq: 2,
        full: false,
        cpus: vec![(1, off)],
        ..Update::default()
    };
    s.nodes.apply(&n, g, &d, Instant::now()).unwrap();
    assert_eq!(ids(&n, 0), vec![1]);
    assert!(ids(&n, 1).is_empty());
}

#[test]
fn a_second_balance_of_the_same_node_does_not_wait() {
    // While a pass holds the node's balancer, try_balance answers None at
    // once (the service's ABORTED) and balance waits its turn.
    let s = Arc::new(store());
    let (n, g) = node(&s, "a", &[], 4);
    s.nodes
        .apply(
            &n,
            g,
            &full(4, 1, vec![(0, vec![task(1, 0, true)])]),
            Instant::now(),
        )
        .unwrap();
    assert!(
        s.passes
            .try_balance(&n, &BalanceRequest::default(), Instant::now())
            .is_some()
    );
    let held = n.hold_balancer_for_test();
    assert!(
        s.passes
            .try_balance(&n, &BalanceRequest::default(), Instant::now())
            .is_none()
    );
    drop(held);
    assert!(
        s.passes
            .try_balance(&n, &BalanceRequest::default(), Instant::now())
            .is_some()
    );
}
