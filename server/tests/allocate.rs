//! AllocateCpus through the service on nodes registered in a store with a
//! synthetic topology: every policy worked by hand on an SMT2 and an SMT8
//! node, leases counted in later decisions (PickCpu, other allocations),
//! expiry, renewal and release, and every bad input refused with its field
//! named and nothing leased.
//!
//! The hand-working follows the kernel's fork slow path
//! (`sched_balance_find_dst_cpu()`): a placement starts from the lowest
//! allowed CPU; at each level the local group is left only for a group with
//! more idle allowed CPUs (`update_sg_wakeup_stats()` counts allowed CPUs
//! only), and inside the chosen group the first idle CPU wins (all idle
//! stamps equal: one report stamped them all). CPUs granted earlier in the
//! same allocation count as running one more task and are not allowed again.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace::engine::state::CpuState;
use fairplace::engine::topology::{CpuTopo, TopologySpec};
use fairplace::service::cpu_pool::CpuPool;
use fairplace::service::lease_hub::LeaseHub;
use fairplace::service::placement::Placement;
use fairplace::store::leases::settle;
use fairplace::store::{Node, Store, StoreConfig, Update};
use fairplace_proto::v1 as pb;
use fairplace_proto::v1::placement_service_server::PlacementService;
use tonic::{Code, Request};

/// `llcs` LLCs of `cores` cores of `smt` threads; core k has CPUs
/// k*smt..(k+1)*smt.
fn spec(llcs: u32, cores: u32, smt: u32) -> TopologySpec {
    let n = llcs * cores * smt;
    TopologySpec {
        cpus: (0..n)
            .map(|i| CpuTopo {
                core: i / smt,
                cluster: None,
                llc: i / (cores * smt),
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    }
}

fn placement() -> Placement {
    let store = Arc::new(Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        ..StoreConfig::default()
    }));
    Placement {
        recorder: fairplace::record::Hub::new(&store),
        store,
        heavy: CpuPool::new(1, 4),
        hub: Arc::new(LeaseHub::default()),
        replicated: None,
        stopping: tokio::sync::watch::channel(false).1,
    }
}

/// Registers `id` and reports it with `busy` CPUs running one task.
fn node(p: &Placement, id: &str, sp: TopologySpec, busy: &[u32]) -> Arc<Node> {
    let n = sp.cpus.len() as u32;
    let (node, g) = p.store.nodes.register(id, vec![], "t".into(), sp).unwrap();
    let cpus = (0..n)
        .map(|i| {
            let mut c = CpuState::idle(1024);
            if busy.contains(&i) {
                c.nr_running = 1;
                c.cfs_h_nr_queued = 1;
                c.curr_is_idle = false;
                c.load_avg = 1024;
                c.util_avg = 800;
            }
            (i, c)
        })
        .collect();
    let u = Update {
        seq: 1,
        full: true,
        cpus,
        ..Update::default()
    };
    p.store.nodes.apply(&node, g, &u, Instant::now()).unwrap();
    node
}

fn req(node: &str, count: u32, policy: &str) -> pb::AllocateCpusRequest {
    pb::AllocateCpusRequest {
        node_id: node.into(),
        count,
        policy: policy.into(),
        holder: "test".into(),
        ..Default::default()
    }
}

async fn alloc(
    p: &Placement,
    r: pb::AllocateCpusRequest,
) -> Result<pb::AllocateCpusResponse, tonic::Status> {
    p.allocate_cpus(Request::new(r))
        .await
        .map(|r| r.into_inner())
}

/// The CPUs granted, in the order chosen.
async fn cpus(p: &Placement, node: &str, count: u32, policy: &str) -> Vec<u32> {
    let r = alloc(p, req(node, count, policy)).await.unwrap();
    r.per_cpu.iter().map(|c| c.cpu).collect()
}

// SMT2: two LLCs {0-3} {4-7}, cores {0,1} {2,3} {4,5} {6,7}.

#[tokio::test]
async fn kernel_on_smt2_alternates_llcs_then_fills_cores_like_forks() {
    let p = placement();
    node(&p, "a", spec(2, 2, 2), &[]);
    // 0: every level ties, stay on this_cpu 0. 4: from 1, LLC0 has 3
    // allowed idle CPUs and LLC1 4: move, first idle. 2: from 1, LLCs tie
    // (3 and 3), core {0,1} has 1 allowed idle and {2,3} 2: move. 6: from
    // 1, LLC1 has 3 to LLC0's 2; then core {6,7} 2 to {5}'s 1. 1: from 1,
    // everything ties.
    assert_eq!(cpus(&p, "a", 5, "kernel").await, vec![0, 4, 2, 6, 1]);
}

#[tokio::test]
async fn the_default_policy_is_kernel_and_answers_paths_and_explanation() {
    let p = placement();
    node(&p, "a", spec(2, 2, 2), &[]);
    let r = alloc(&p, req("a", 2, "")).await.unwrap();
    assert_eq!(r.policy, "kernel");
    assert_eq!(r.cpus, "0,4");
    assert_eq!(r.node_id, "a");
    assert!(r.lease_id > 0);
    assert!(r.per_cpu.iter().all(|c| c.path == "slow_path"), "{r:?}");
    assert!(
        r.explanation.contains("fork placements"),
        "{}",
        r.explanation
    );
    assert_eq!(r.ttl_ms, 30_000);
}

#[tokio::test]
async fn cores_on_smt2_takes_whole_idle_cores_and_skips_a_half_busy_one() {
    let p = placement();
    node(&p, "a", spec(2, 2, 2), &[]);
    // Core {0,1} (the slow path stays on 0), then from 2: LLC1 has 4 idle
    // allowed CPUs to LLC0's 2: core {4,5}.
    assert_eq!(cpus(&p, "a", 4, "cores").await, vec![0, 1, 4, 5]);
    let p = placement();
    node(&p, "b", spec(2, 2, 2), &[1]);
    // Core {0,1} is not idle: the idle cores are {2,3} {4,5} {6,7}; from 2,
    // LLC1 (4 idle) beats LLC0 (2).
    assert_eq!(cpus(&p, "b", 2, "cores").await, vec![4, 5]);
    // Three: one whole core, and the rest (1 < a core) inside another idle
    // core: {2,3} and {6,7} are left; from 2 the LLCs tie, stay: 2.
    assert_eq!(cpus(&p, "b", 3, "cores").await, vec![2, 3, 6]);
}

#[tokio::test]
async fn llc_on_smt2_stays_in_the_slow_paths_llc_and_refuses_without_room() {
    let p = placement();
    node(&p, "a", spec(2, 2, 2), &[1]);
    // From 0: LLC0 has 3 idle allowed CPUs, LLC1 4: LLC1, CPU 4; then
    // inside it from 5: core {6,7} (2 idle) beats {5} (1).
    let r = alloc(&p, req("a", 2, "llc")).await.unwrap();
    assert_eq!(r.cpus, "4,6");
    assert!(r.explanation.contains("LLC 1"), "{}", r.explanation);
    // No LLC has 5 CPUs: RESOURCE_EXHAUSTED, nothing leased.
    let e = alloc(&p, req("a", 5, "llc")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(e.message().starts_with("count:"), "{}", e.message());
    // LLC1 has 2 free CPUs left, LLC0 4 (CPU 1 is busy, not leased): 3 go
    // to LLC0.
    let r = alloc(&p, req("a", 3, "llc")).await.unwrap();
    let m: Vec<u32> = r.per_cpu.iter().map(|c| c.cpu).collect();
    assert!(m.iter().all(|&c| c < 4), "{m:?}");
}

#[tokio::test]
async fn llc_exclusive_on_smt2_takes_whole_llcs_until_none_is_free() {
    let p = placement();
    node(&p, "a", spec(2, 2, 2), &[]);
    let r = alloc(&p, req("a", 3, "llc-exclusive")).await.unwrap();
    assert_eq!(r.cpus, "0-3", "the whole LLC, more than count");
    let r = alloc(&p, req("a", 1, "llc-exclusive")).await.unwrap();
    assert_eq!(r.cpus, "4-7");
    let e = alloc(&p, req("a", 1, "llc-exclusive")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    // An LLC with a leased CPU is not whole: after releasing the first
    // lease, only LLC0 qualifies.
    let p = placement();
    node(&p, "b", spec(2, 2, 2), &[]);
    alloc(&p, req("b", 1, "kernel")).await.unwrap(); // CPU 0
    let r = alloc(&p, req("b", 4, "llc-exclusive")).await.unwrap();
    assert_eq!(r.cpus, "4-7");
}

#[tokio::test]
async fn spread_on_smt2_takes_one_cpu_per_core() {
    let p = placement();
    node(&p, "a", spec(2, 2, 2), &[]);
    // 0; from 2, LLC1 has 4 to LLC0's 2: 4; from 2, LLCs tie, core {2,3}
    // stays: 2; only core {6,7} is left: 6.
    assert_eq!(cpus(&p, "a", 4, "spread").await, vec![0, 4, 2, 6]);
    // Five CPUs, one per core, on four cores: refused.
    let p = placement();
    node(&p, "b", spec(2, 2, 2), &[]);
    let e = alloc(&p, req("b", 5, "spread")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(e.message().contains("only 4 cores"), "{}", e.message());
}

// SMT8: two LLCs of two cores of eight threads: cores {0-7} {8-15} |
// {16-23} {24-31}.

#[tokio::test]
async fn every_policy_on_smt8() {
    let p = placement();
    node(&p, "a", spec(2, 2, 8), &[]);
    // cores, 8: one whole idle core; the slow path stays on 0.
    let r = alloc(&p, req("a", 8, "cores")).await.unwrap();
    assert_eq!(r.cpus, "0-7");
    // cores, 3: no idle core fits 3; inside one idle core: from 8, LLC1
    // (16 idle) beats LLC0 (8): core {16-23}, its first three.
    let r = alloc(&p, req("a", 3, "cores")).await.unwrap();
    assert_eq!(r.cpus, "16-18");
    // spread, 2: from 8, LLC0 has 8 free idle CPUs and LLC1 13: LLC1 (19),
    // where core {24-31} has 8 to {19-23}'s 5: 24. Core 3 leaves the pool;
    // from 8, LLC0's 8 beat LLC1's 5: stay, 8.
    assert_eq!(cpus(&p, "a", 2, "spread").await, vec![24, 8]);
    let p = placement();
    node(&p, "b", spec(2, 2, 8), &[]);
    // kernel, 2: 0, then from 1: LLC1's 16 idle beat LLC0's 15: 16.
    assert_eq!(cpus(&p, "b", 2, "kernel").await, vec![0, 16]);
    // llc, 4: both LLCs have 15 free CPUs: from 1 they tie, stay in LLC0,
    // where core {8-15} (8) beats {1-7} (7): 8. Inside LLC0 from 1: cores
    // tie 7 to 7, stay: 1; from 2, {9-15} (7) beats {2-7} (6): 9; from 2,
    // 6 to 6: 2.
    assert_eq!(cpus(&p, "b", 4, "llc").await, vec![8, 1, 9, 2]);
    // llc-exclusive, 16: LLC0 is wholly free only if nothing in it is
    // leased: CPU 0 is. LLC1 neither: refused.
    let e = alloc(&p, req("b", 16, "llc-exclusive")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    let p = placement();
    node(&p, "c", spec(2, 2, 8), &[]);
    let r = alloc(&p, req("c", 16, "llc-exclusive")).await.unwrap();
    assert_eq!(r.cpus, "0-15");
    // spread on SMT8: 4 cores, so 5 is refused; 4 is one per core.
    let e = alloc(&p, req("c", 3, "spread")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "2 free cores left");
    let r = alloc(&p, req("c", 2, "spread")).await.unwrap();
    assert_eq!(r.cpus, "16,24");
}

#[tokio::test]
async fn leases_count_as_busy_in_pick_cpu_and_end_on_release() {
    let p = placement();
    let n = node(&p, "a", spec(1, 2, 1), &[]);
    let r = alloc(&p, req("a", 1, "kernel")).await.unwrap();
    assert_eq!(r.cpus, "0");
    let s = n.snapshot();
    assert_eq!(s.state.cpus[0].nr_running, 1);
    assert!(!s.state.cpus[0].idle_cpu());
    // A fork from CPU 0 now goes to the idle CPU 1.
    let pick = p
        .pick_cpu(Request::new(pb::PickCpuRequest {
            node_id: "a".into(),
            kind: pb::RequestKind::Fork as i32,
            this_cpu: 0,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(pick.cpu, 1);
    // A report of CPU 0 does not end the lease: it replaces the state under it.
    let g = n.generation.load(std::sync::atomic::Ordering::SeqCst);
    let mut c = CpuState::idle(1024);
    c.util_avg = 7;
    let u = Update {
        seq: 2,
        full: false,
        cpus: vec![(0, c)],
        ..Update::default()
    };
    p.store.nodes.apply(&n, g, &u, Instant::now()).unwrap();
    let s = n.snapshot();
    assert_eq!(s.state.cpus[0].nr_running, 1, "still leased");
    assert_eq!(s.state.cpus[0].util_avg, 7, "the new report underneath");
    // Release: the agent's state comes back as it is.
    let rel = p
        .release_cpus(Request::new(pb::ReleaseCpusRequest {
            lease_id: r.lease_id,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((rel.node_id.as_str(), rel.cpus.as_str()), ("a", "0"));
    let s = n.snapshot();
    assert_eq!(s.state.cpus[0], {
        let mut c = c;
        c.idle_stamp = s.state.cpus[0].idle_stamp;
        c
    });
    assert!(s.state.cpus[0].idle_cpu());
    // Released twice: NOT_FOUND naming lease_id.
    let e = p
        .release_cpus(Request::new(pb::ReleaseCpusRequest {
            lease_id: r.lease_id,
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().starts_with("lease_id:"), "{}", e.message());
}

#[tokio::test]
async fn two_single_cpu_leases_get_different_cpus_and_a_third_is_refused() {
    let p = placement();
    node(&p, "a", spec(1, 2, 1), &[]);
    let a = alloc(&p, req("a", 1, "kernel")).await.unwrap();
    let b = alloc(&p, req("a", 1, "kernel")).await.unwrap();
    assert_ne!(a.cpus, b.cpus);
    let e = alloc(&p, req("a", 1, "kernel")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.message().contains("held by other leases"),
        "{}",
        e.message()
    );
}

#[tokio::test]
async fn leases_expire_and_renewal_keeps_them() {
    let p = placement();
    let n = node(&p, "a", spec(1, 4, 1), &[]);
    let mut r = req("a", 1, "kernel");
    r.ttl_ms = 1000;
    let short = alloc(&p, r.clone()).await.unwrap();
    let kept = alloc(&p, r).await.unwrap();
    let t0 = Instant::now();
    assert!(settle::expire(&p.store.leases, t0).await.is_empty());
    let renewed = p
        .renew_lease(Request::new(pb::RenewLeaseRequest {
            lease_id: kept.lease_id,
            ttl_ms: 5000,
        }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(renewed.ttl_ms, 5000);
    let ended = settle::expire(&p.store.leases, t0 + Duration::from_millis(1500)).await;
    assert_eq!(ended.len(), 1);
    assert_eq!(ended[0].1.id, short.lease_id);
    let left = p.store.leases.leases_of(&n);
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].id, kept.lease_id);
    assert_eq!(p.store.leases.leases_outstanding(), (1, 1));
    // The expired lease's CPU is idle again; the renewed one's is not.
    let s = n.snapshot();
    let short_cpu: usize = short.cpus.parse().unwrap();
    let kept_cpu: usize = kept.cpus.parse().unwrap();
    assert!(s.state.cpus[short_cpu].idle_cpu());
    assert!(!s.state.cpus[kept_cpu].idle_cpu());
    // Renewing an expired lease: NOT_FOUND.
    let e = p
        .renew_lease(Request::new(pb::RenewLeaseRequest {
            lease_id: short.lease_id,
            ttl_ms: 0,
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test]
async fn a_forgotten_nodes_leases_wait_for_it_and_stay_releasable() {
    let p = placement();
    node(&p, "a", spec(1, 2, 1), &[]);
    let r = alloc(&p, req("a", 1, "kernel")).await.unwrap();
    let kept = alloc(&p, req("a", 1, "kernel")).await.unwrap();
    assert_eq!(p.store.leases.leases_outstanding(), (2, 2));
    p.store
        .nodes
        .forget_stale(Instant::now() + Duration::from_secs(100_000));
    assert!(p.store.nodes.get("a").is_none());
    // Parked, not ended: still outstanding, and the owner can release one.
    assert_eq!(p.store.leases.leases_outstanding(), (2, 2));
    p.release_cpus(Request::new(pb::ReleaseCpusRequest {
        lease_id: r.lease_id,
    }))
    .await
    .unwrap();
    assert_eq!(p.store.leases.leases_outstanding(), (1, 1));
    // The node comes back: the other lease counts on it again, on its CPU.
    node(&p, "a", spec(1, 2, 1), &[]);
    let n = p.store.nodes.get("a").unwrap();
    let leases = p.store.leases.leases_of(&n);
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].id, kept.lease_id);
    assert_eq!(leases[0].cpus.to_string(), kept.cpus);
    let cpu: usize = kept.cpus.parse().unwrap();
    assert_eq!(n.snapshot().state.cpus[cpu].nr_running, 1);
    // A released id is gone for good.
    let e = p
        .release_cpus(Request::new(pb::ReleaseCpusRequest {
            lease_id: r.lease_id,
        }))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
}

#[tokio::test]
async fn without_a_node_the_cluster_chooses_one() {
    let p = placement();
    node(&p, "busy", spec(1, 2, 1), &[0, 1]);
    node(&p, "idle", spec(1, 2, 1), &[]);
    let r = alloc(&p, req("", 2, "kernel")).await.unwrap();
    assert_eq!(r.node_id, "idle");
}

#[tokio::test]
async fn every_bad_input_is_refused_naming_its_field_and_nothing_is_leased() {
    let p = placement();
    let n = node(&p, "a", spec(1, 4, 1), &[]);
    let before = n.snapshot().version;
    let cases: Vec<(pb::AllocateCpusRequest, &str, Code)> = vec![
        (req("a", 1, "fastest"), "policy:", Code::InvalidArgument),
        (req("a", 0, "kernel"), "count:", Code::InvalidArgument),
        (req("a", 5, "kernel"), "count:", Code::InvalidArgument),
        (
            req("a", u32::MAX, "kernel"),
            "count:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                task: Some(pb::Task {
                    cpus_allowed: "0-1".into(),
                    ..Default::default()
                }),
                ..req("a", 3, "kernel")
            },
            "count:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                task: Some(pb::Task {
                    cpus_allowed: "9".into(),
                    ..Default::default()
                }),
                ..req("a", 1, "kernel")
            },
            "task.cpus_allowed:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                task: Some(pb::Task {
                    cpus_allowed: "x".into(),
                    ..Default::default()
                }),
                ..req("a", 1, "kernel")
            },
            "task.cpus_allowed:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                holder: "h".repeat(300),
                ..req("a", 1, "kernel")
            },
            "holder:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                ttl_ms: u32::MAX,
                ..req("a", 1, "kernel")
            },
            "ttl_ms:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                apply: Some(pb::ApplyTarget { target: None }),
                ..req("a", 1, "kernel")
            },
            "apply:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                apply: Some(pb::ApplyTarget {
                    target: Some(pb::apply_target::Target::Pid(0)),
                }),
                ..req("a", 1, "kernel")
            },
            "apply.pid:",
            Code::InvalidArgument,
        ),
        (
            pb::AllocateCpusRequest {
                apply: Some(pb::ApplyTarget {
                    target: Some(pb::apply_target::Target::Cgroup("a/../../etc".into())),
                }),
                ..req("a", 1, "kernel")
            },
            "apply.cgroup:",
            Code::InvalidArgument,
        ),
        (req("nope", 1, "kernel"), "node_id:", Code::NotFound),
        // A valid target but no agent connected: UNAVAILABLE, lease undone.
        (
            pb::AllocateCpusRequest {
                apply: Some(pb::ApplyTarget {
                    target: Some(pb::apply_target::Target::Pid(1)),
                }),
                ..req("a", 1, "kernel")
            },
            "apply:",
            Code::Unavailable,
        ),
    ];
    for (r, field, code) in cases {
        let e = alloc(&p, r.clone()).await.unwrap_err();
        assert_eq!(e.code(), code, "{r:?}: {e:?}");
        assert!(e.message().starts_with(field), "{field}: {}", e.message());
        assert!(e.message().len() < 400, "{}", e.message());
    }
    assert_eq!(p.store.leases.leases_outstanding(), (0, 0));
    let s = n.snapshot();
    assert!(s.state.cpus.iter().all(|c| c.idle_cpu()));
    // The failed apply granted and released a lease: two publishes; every
    // other refusal changed nothing.
    assert_eq!(s.version, before + 2);
    for (id, ttl) in [(0u64, 0u32), (1, u32::MAX)] {
        let e = p
            .renew_lease(Request::new(pb::RenewLeaseRequest {
                lease_id: id,
                ttl_ms: ttl,
            }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
    }
    let e = p
        .release_cpus(Request::new(pb::ReleaseCpusRequest { lease_id: 0 }))
        .await
        .unwrap_err();
    assert!(e.message().starts_with("lease_id:"));
}
