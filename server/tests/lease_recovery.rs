//! Durable leases through the service on stores with synthetic nodes and a
//! real lease store (redb in a temporary directory): a grant outlives the
//! store that made it, expired leases end at load, only the owner (or an
//! admin) renews or releases, ids are random, and the leases an agent
//! reports at registration are reconciled case by case (kept, adopted,
//! the later of two conflicting ones released, expired, foreign and
//! impossible ones released).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace::engine::state::CpuState;
use fairplace::engine::topology::{CpuTopo, TopologySpec};
use fairplace::identity::{Caller, Identity, Role};
use fairplace::service::cpu_pool::CpuPool;
use fairplace::service::lease_hub::LeaseHub;
use fairplace::service::placement::Placement;
use fairplace::store::leases::log::redb::RedbLog;
use fairplace::store::leases::log::unix_ms_now;
use fairplace::store::{LeaseRecord, Store, StoreConfig, Update};
use fairplace_proto::v1 as pb;
use fairplace_proto::v1::placement_service_server::PlacementService;
use tonic::{Code, Request};

/// Two LLCs of two SMT2 cores: CPUs 0-7, core k = {2k, 2k+1}.
fn spec() -> TopologySpec {
    TopologySpec {
        cpus: (0..8)
            .map(|i| CpuTopo {
                core: i / 2,
                cluster: None,
                llc: i / 4,
                node: 0,
                capacity: 1024,
            })
            .collect(),
        numa_distance: None,
    }
}

struct Dir(PathBuf);
impl Dir {
    fn new(tag: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("fp-lease-rec-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        Dir(d)
    }
}
impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A placement service over a store whose leases live in `dir`, loaded.
fn open(dir: &Dir) -> Placement {
    open_with(dir, StoreConfig::default())
}

fn open_with(dir: &Dir, config: StoreConfig) -> Placement {
    let log = Arc::new(RedbLog::open(&dir.0).unwrap());
    let store = Arc::new(Store::with_log(
        StoreConfig {
            stale_after: Duration::from_secs(3600),
            ..config
        },
        log,
    ));
    store.leases.load_leases(Instant::now()).unwrap();
    Placement {
        recorder: fairplace::record::Hub::new(&store),
        store,
        heavy: CpuPool::new(1, 4),
        hub: Arc::new(LeaseHub::default()),
        replicated: None,
        stopping: tokio::sync::watch::channel(false).1,
    }
}

fn register(p: &Placement, id: &str) {
    let (node, g) = p
        .store
        .nodes
        .register(id, vec![], "t".into(), spec())
        .unwrap();
    let u = Update {
        seq: 1,
        full: true,
        cpus: (0..8).map(|i| (i, CpuState::idle(1024))).collect(),
        ..Update::default()
    };
    p.store.nodes.apply(&node, g, &u, Instant::now()).unwrap();
}

fn who(role: Role, name: &str) -> Caller {
    Caller::Authenticated(Arc::new(Identity {
        role,
        name: name.into(),
        id: format!("spiffe://fairplace/{}/{name}", role.as_str()),
    }))
}

fn as_caller<T>(msg: T, c: &Caller) -> Request<T> {
    let mut r = Request::new(msg);
    r.extensions_mut().insert(c.clone());
    r
}

async fn alloc(p: &Placement, c: &Caller, count: u32, ttl_ms: u32) -> pb::AllocateCpusResponse {
    try_alloc(p, c, count, ttl_ms).await.unwrap()
}

fn mask(list: &str) -> Vec<u32> {
    let mut v = Vec::new();
    for part in list.split(',').filter(|s| !s.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => v.extend(a.parse::<u32>().unwrap()..=b.parse::<u32>().unwrap()),
            None => v.push(part.parse().unwrap()),
        }
    }
    v
}

#[tokio::test]
async fn a_grant_outlives_its_store_with_its_id_owner_holder_and_cpus() {
    let dir = Dir::new("outlive");
    let o = who(Role::Orchestrator, "o");
    let (a, b) = {
        let p = open(&dir);
        register(&p, "a");
        (
            alloc(&p, &o, 2, 60_000).await,
            alloc(&p, &o, 1, 60_000).await,
        )
    };
    // A new store on the same directory: the leases are parked until the
    // node registers, and their owner can renew them meanwhile.
    let p = open(&dir);
    assert_eq!(p.store.leases.leases_outstanding(), (2, 3));
    let renewed = p
        .renew_lease(as_caller(
            pb::RenewLeaseRequest {
                lease_id: a.lease_id,
                ttl_ms: 90_000,
            },
            &o,
        ))
        .await
        .unwrap();
    assert_eq!(renewed.into_inner().ttl_ms, 90_000);
    register(&p, "a");
    let node = p.store.nodes.get("a").unwrap();
    let mut got: Vec<(u64, String, String, String)> = p
        .store
        .leases
        .leases_of(&node)
        .iter()
        .map(|l| (l.id, l.cpus.to_string(), l.holder.clone(), l.owner.clone()))
        .collect();
    got.sort();
    let mut want = vec![
        (
            a.lease_id,
            a.cpus.clone(),
            "job-2".to_string(),
            "spiffe://fairplace/orchestrator/o".to_string(),
        ),
        (
            b.lease_id,
            b.cpus.clone(),
            "job-1".to_string(),
            "spiffe://fairplace/orchestrator/o".to_string(),
        ),
    ];
    want.sort();
    assert_eq!(got, want);
    // They count as busy again, and a new grant takes only the other CPUs.
    let snap = node.snapshot();
    for cpu in mask(&a.cpus).into_iter().chain(mask(&b.cpus)) {
        assert_eq!(snap.state.cpus[cpu as usize].nr_running, 1, "CPU {cpu}");
    }
    let rest = alloc(&p, &o, 5, 60_000).await;
    let mut all: Vec<u32> = [mask(&a.cpus), mask(&b.cpus), mask(&rest.cpus)].concat();
    all.sort();
    assert_eq!(all, (0..8).collect::<Vec<u32>>(), "every CPU leased once");
    // The renewal was durable too: a third store sees 90 s.
    drop(p);
    let p = open(&dir);
    register(&p, "a");
    let node = p.store.nodes.get("a").unwrap();
    let l = p
        .store
        .leases
        .leases_of(&node)
        .into_iter()
        .find(|l| l.id == a.lease_id)
        .unwrap();
    assert_eq!(l.ttl, Duration::from_secs(90));
    assert!(l.expires > Instant::now() + Duration::from_secs(80));
}

#[tokio::test]
async fn leases_loaded_at_start_get_their_whole_ttl_again_whatever_the_wall_clock_says() {
    let dir = Dir::new("expired");
    let o = who(Role::Orchestrator, "o");
    {
        let p = open(&dir);
        register(&p, "a");
        alloc(&p, &o, 1, 50).await;
        alloc(&p, &o, 1, 60_000).await;
    }
    // Past the short lease's stored expiry: a restart does not judge it by
    // a wall clock (which may have moved), it gives it its TTL again.
    std::thread::sleep(Duration::from_millis(120));
    let log = RedbLog::open(&dir.0).unwrap();
    let store = Arc::new(Store::with_log(StoreConfig::default(), Arc::new(log)));
    let t0 = Instant::now();
    let loaded = store.leases.load_leases(t0).unwrap();
    assert_eq!(loaded.loaded, 2);
    assert!(
        fairplace::store::leases::settle::expire(&store.leases, t0)
            .await
            .is_empty(),
        "nothing ends at load"
    );
    // Its TTL from the load on: then it expires, and is deleted from the log.
    let ended =
        fairplace::store::leases::settle::expire(&store.leases, t0 + Duration::from_millis(60))
            .await;
    assert_eq!(ended.len(), 1);
    drop(store);
    let log = RedbLog::open(&dir.0).unwrap();
    let store = Store::with_log(StoreConfig::default(), Arc::new(log));
    assert_eq!(store.leases.load_leases(Instant::now()).unwrap().loaded, 1);
}

#[tokio::test]
async fn only_the_owner_or_an_admin_renews_or_releases() {
    let dir = Dir::new("owner");
    let p = open(&dir);
    register(&p, "a");
    let o = who(Role::Orchestrator, "o");
    let mallory = who(Role::Orchestrator, "mallory");
    let admin = who(Role::Admin, "ops");
    let l = alloc(&p, &o, 2, 60_000).await;
    let e = p
        .release_cpus(as_caller(
            pb::ReleaseCpusRequest {
                lease_id: l.lease_id,
            },
            &mallory,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    assert!(
        e.message().contains("spiffe://fairplace/orchestrator/o"),
        "{}",
        e.message()
    );
    assert!(
        e.message()
            .contains("spiffe://fairplace/orchestrator/mallory"),
        "{}",
        e.message()
    );
    let e = p
        .renew_lease(as_caller(
            pb::RenewLeaseRequest {
                lease_id: l.lease_id,
                ttl_ms: 1,
            },
            &mallory,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied);
    let node = p.store.nodes.get("a").unwrap();
    let kept = p.store.leases.leases_of(&node);
    assert_eq!(kept.len(), 1);
    assert_eq!(
        kept[0].ttl,
        Duration::from_secs(60),
        "the refused renewal changed nothing"
    );
    // The owner renews; an admin releases.
    p.renew_lease(as_caller(
        pb::RenewLeaseRequest {
            lease_id: l.lease_id,
            ttl_ms: 0,
        },
        &o,
    ))
    .await
    .unwrap();
    release(&p, &admin, l.lease_id).await;
    assert_eq!(p.store.leases.leases_outstanding(), (0, 0));
}

#[tokio::test]
async fn ids_are_random_and_a_guessed_id_is_not_found_and_changes_nothing() {
    let dir = Dir::new("ids");
    let p = open(&dir);
    register(&p, "a");
    let o = who(Role::Orchestrator, "o");
    let mut ids = Vec::new();
    for _ in 0..200 {
        let l = alloc(&p, &o, 1, 60_000).await;
        ids.push(l.lease_id);
        release(&p, &o, l.lease_id).await;
    }
    let mut sorted = ids.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 200, "no id repeats");
    // 64 random bits: none of 200 falls below 2^32 but with odds of 2^-24.
    assert!(ids.iter().all(|&i| i > u32::MAX as u64), "{ids:?}");
    let held = alloc(&p, &o, 2, 60_000).await;
    for guess in [1, 2, held.lease_id + 1, held.lease_id - 1, ids[0]] {
        let e = p
            .release_cpus(as_caller(pb::ReleaseCpusRequest { lease_id: guess }, &o))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{guess}");
        let e = p
            .renew_lease(as_caller(
                pb::RenewLeaseRequest {
                    lease_id: guess,
                    ttl_ms: 0,
                },
                &o,
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{guess}");
    }
    assert_eq!(p.store.leases.leases_outstanding(), (1, 2));
}

/// A lease as an agent's checkpoint reports it.
fn held(id: u64, cpus: &str, granted_at_ms: u64, expires_at_ms: u64) -> LeaseRecord {
    LeaseRecord {
        id,
        node: "a".into(),
        cpus: cpus.into(),
        policy: "kernel".into(),
        holder: format!("held-{id}"),
        owner: "spiffe://fairplace/orchestrator/o".into(),
        target: None,
        ttl_ms: 30_000,
        expires_at_ms,
        granted_at_ms,
        applied: false,
        request_id: String::new(),
    }
}

#[tokio::test]
async fn an_agents_lease_the_server_lost_is_adopted_durably_when_it_conflicts_with_nothing() {
    let dir = Dir::new("adopt");
    let now = unix_ms_now();
    {
        let p = open(&dir);
        register(&p, "a");
        let node = p.store.nodes.get("a").unwrap();
        let r = p.store.leases.reconcile_leases(
            &node,
            &[held(77_000_000_001, "3", now - 5_000, now + 60_000)],
        );
        assert_eq!((r.kept, r.adopted, r.conflicts), (0, 1, 0));
        assert!(r.release_on_node.is_empty());
        // Pending until its commit is acknowledged: its CPU held, not shown.
        assert_eq!(node.snapshot().state.cpus[3].nr_running, 1);
        assert!(p.store.leases.leases_of(&node).is_empty());
        r.commit.unwrap().wait().await.unwrap();
        assert!(p.store.leases.grant_settled(77_000_000_001, true).is_some());
        assert_eq!(p.store.leases.leases_of(&node).len(), 1);
        // Reported again (the agent restarted): kept.
        let r = p.store.leases.reconcile_leases(
            &node,
            &[held(77_000_000_001, "3", now - 5_000, now + 60_000)],
        );
        assert_eq!((r.kept, r.adopted), (1, 0));
        // A new grant of all the free CPUs leaves CPU 3 out.
        let rest = alloc(&p, &who(Role::Orchestrator, "o"), 7, 60_000).await;
        assert!(!mask(&rest.cpus).contains(&3), "{}", rest.cpus);
    }
    // Adopted durably: the next store has it.
    let p = open(&dir);
    register(&p, "a");
    let node = p.store.nodes.get("a").unwrap();
    assert!(
        p.store
            .leases
            .leases_of(&node)
            .iter()
            .any(|l| l.id == 77_000_000_001)
    );
}

#[tokio::test]
async fn of_two_conflicting_leases_the_servers_committed_one_wins_whichever_was_granted_first() {
    let dir = Dir::new("conflict");
    let p = open(&dir);
    register(&p, "a");
    let o = who(Role::Orchestrator, "o");
    let server = alloc(&p, &o, 2, 60_000).await;
    let node = p.store.nodes.get("a").unwrap();
    let granted = p.store.leases.leases_of(&node)[0].granted_at_ms;
    let cpu = mask(&server.cpus)[0].to_string();
    // The agent's lease on the same CPU, granted after the server's and
    // before it: either way the server's lease is the committed one (the
    // agent's was ended, or never acknowledged), and the agent's loses.
    for (i, at) in [granted + 1_000, granted - 1_000].into_iter().enumerate() {
        let id = 88_000_000_001 + i as u64;
        let r = p
            .store
            .leases
            .reconcile_leases(&node, &[held(id, &cpu, at, granted + 60_000)]);
        assert_eq!((r.adopted, r.conflicts), (0, 1), "granted at {at}");
        assert_eq!(r.release_on_node, vec![id]);
        let ids: Vec<u64> = p
            .store
            .leases
            .leases_of(&node)
            .iter()
            .map(|l| l.id)
            .collect();
        assert_eq!(ids, vec![server.lease_id]);
    }
    p.release_cpus(as_caller(
        pb::ReleaseCpusRequest {
            lease_id: server.lease_id,
        },
        &o,
    ))
    .await
    .unwrap();
}

#[tokio::test]
async fn expired_foreign_and_impossible_reports_are_released_on_the_node() {
    let dir = Dir::new("refuse");
    let p = open(&dir);
    register(&p, "a");
    register(&p, "b");
    let now = unix_ms_now();
    let o = who(Role::Orchestrator, "o");
    // A lease of node b.
    let on_b = p
        .allocate_cpus(as_caller(
            pb::AllocateCpusRequest {
                node_id: "b".into(),
                count: 1,
                ..Default::default()
            },
            &o,
        ))
        .await
        .unwrap()
        .into_inner();
    let node = p.store.nodes.get("a").unwrap();
    let r = p.store.leases.reconcile_leases(
        &node,
        &[
            held(1_000_000_001, "0", now - 90_000, now - 1),
            held(on_b.lease_id, "1", now - 1_000, now + 60_000),
            held(1_000_000_003, "99", now - 1_000, now + 60_000),
            held(1_000_000_004, "", now - 1_000, now + 60_000),
        ],
    );
    assert_eq!((r.adopted, r.expired, r.conflicts), (0, 1, 3));
    let mut dropped = r.release_on_node.clone();
    dropped.sort();
    let mut want = vec![1_000_000_001, on_b.lease_id, 1_000_000_003, 1_000_000_004];
    want.sort();
    assert_eq!(dropped, want);
    assert!(p.store.leases.leases_of(&node).is_empty());
    // Node b's lease is untouched.
    let b = p.store.nodes.get("b").unwrap();
    assert_eq!(p.store.leases.leases_of(&b).len(), 1);
}

#[tokio::test]
async fn a_reported_lease_with_fields_no_grant_carries_is_released_not_stored() {
    let dir = Dir::new("unfit");
    let p = open(&dir);
    register(&p, "a");
    let node = p.store.nodes.get("a").unwrap();
    let now = unix_ms_now();
    let grant = |id: u64, holder: usize, cgroup: &str| pb::LeaseGrant {
        lease_id: id,
        cpus: "1".into(),
        holder: "h".repeat(holder),
        owner: "spiffe://fairplace/orchestrator/o".into(),
        policy: "kernel".into(),
        ttl_ms: 30_000,
        expires_at_unix_ms: now + 30_000,
        granted_at_unix_ms: now - 1_000,
        target: (!cgroup.is_empty()).then(|| pb::ApplyTarget {
            target: Some(pb::apply_target::Target::Cgroup(cgroup.into())),
        }),
    };
    let held = [
        grant(5_000_000_001, 10_000, ""),
        grant(5_000_000_002, 10, "a/../../etc"),
        grant(5_000_000_003, 10, "fairplace/job"),
    ];
    let sink: Arc<dyn fairplace::store::leases::settle::AgentSink> =
        Arc::new(fairplace::store::leases::settle::NoAgents);
    let mut dropped = fairplace::service::allocate::reconcile(&p.store, &sink, &node, &held).await;
    dropped.sort();
    assert_eq!(dropped, vec![5_000_000_001, 5_000_000_002]);
    let kept: Vec<u64> = p
        .store
        .leases
        .leases_of(&node)
        .iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(kept, vec![5_000_000_003], "the well-formed one is adopted");
}

#[tokio::test]
async fn a_node_replaced_by_another_topology_keeps_its_leases_and_its_old_object_grants_nothing() {
    let dir = Dir::new("retired");
    let p = open(&dir);
    register(&p, "a");
    let old = p.store.nodes.get("a").unwrap();
    let o = who(Role::Orchestrator, "o");
    let kept = alloc(&p, &o, 1, 60_000).await;
    // The agent comes back with another topology: four CPUs, one LLC.
    let four = TopologySpec {
        cpus: spec().cpus.into_iter().take(4).collect(),
        numa_distance: None,
    };
    p.store
        .nodes
        .register("a", vec![], "t".into(), four)
        .unwrap();
    let new = p.store.nodes.get("a").unwrap();
    assert!(!Arc::ptr_eq(&old, &new));
    let ids: Vec<u64> = p
        .store
        .leases
        .leases_of(&new)
        .iter()
        .map(|l| l.id)
        .collect();
    assert_eq!(
        ids,
        vec![kept.lease_id],
        "the lease moved to the new node (CPU {} fits)",
        kept.cpus
    );
    // A caller still holding the old node object gets nothing from it.
    let r = p
        .store
        .leases
        .allocate_locked(&old, Instant::now(), |_, _| {
            Ok::<_, fairplace::engine::alloc::NoRoom>((
                (),
                fairplace::store::NewLease {
                    cpus: fairplace::engine::cpumask::CpuMask::first_n(1),
                    policy: "kernel".into(),
                    holder: "stale".into(),
                    owner: "anonymous".into(),
                    ttl: Duration::from_secs(60),
                    target: None,
                    request_id: String::new(),
                },
            ))
        });
    let e = r.err().expect("the retired node granted a lease");
    assert_eq!(e.reason, "node");
    assert!(e.message.starts_with("node_id:"), "{}", e.message);
    assert_eq!(p.store.leases.leases_outstanding(), (1, 1));
}

/// ReleaseCpus by `c`, which must succeed.
async fn release(p: &Placement, c: &Caller, lease_id: u64) {
    p.release_cpus(as_caller(pb::ReleaseCpusRequest { lease_id }, c))
        .await
        .unwrap();
}

async fn try_alloc(
    p: &Placement,
    c: &Caller,
    count: u32,
    ttl_ms: u32,
) -> Result<pb::AllocateCpusResponse, tonic::Status> {
    p.allocate_cpus(as_caller(
        pb::AllocateCpusRequest {
            node_id: "a".into(),
            count,
            holder: format!("job-{count}"),
            ttl_ms,
            ..Default::default()
        },
        c,
    ))
    .await
    .map(|r| r.into_inner())
}

#[tokio::test]
async fn a_caller_at_its_lease_limit_is_refused_by_name_even_after_a_restart() {
    let dir = Dir::new("limit-leases");
    let config = || StoreConfig {
        lease_limits: fairplace::store::OwnerLimits {
            leases: Some(2),
            cpus: None,
        },
        ..StoreConfig::default()
    };
    let o = who(Role::Orchestrator, "o");
    let mallory = who(Role::Orchestrator, "mallory");
    let first = {
        let p = open_with(&dir, config());
        register(&p, "a");
        let first = try_alloc(&p, &o, 1, 60_000).await.unwrap();
        try_alloc(&p, &o, 1, 60_000).await.unwrap();
        let e = try_alloc(&p, &o, 1, 60_000).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted);
        assert!(
            e.message().contains("--max-leases-per-caller 2"),
            "{}",
            e.message()
        );
        assert!(
            e.message().contains("spiffe://fairplace/orchestrator/o"),
            "{}",
            e.message()
        );
        // Another caller is not held back by o.
        try_alloc(&p, &mallory, 1, 60_000).await.unwrap();
        first
    };
    // The count is rebuilt from the lease store.
    let p = open_with(&dir, config());
    register(&p, "a");
    assert_eq!(
        try_alloc(&p, &o, 1, 60_000).await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    release(&p, &o, first.lease_id).await;
    try_alloc(&p, &o, 1, 60_000).await.unwrap();
}

#[tokio::test]
async fn a_caller_is_held_to_its_leased_cpus_and_to_the_longest_ttl() {
    let dir = Dir::new("limit-cpus");
    let p = open_with(
        &dir,
        StoreConfig {
            lease_limits: fairplace::store::OwnerLimits {
                leases: None,
                cpus: Some(3),
            },
            max_lease_ttl: Duration::from_secs(10),
            ..StoreConfig::default()
        },
    );
    register(&p, "a");
    let o = who(Role::Orchestrator, "o");
    let held = try_alloc(&p, &o, 2, 10_000).await.unwrap();
    let e = try_alloc(&p, &o, 2, 10_000).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.message().contains("--max-leased-cpus-per-caller 3"),
        "{}",
        e.message()
    );
    try_alloc(&p, &o, 1, 10_000).await.unwrap();
    // Longer than --max-lease-ttl-ms: refused, for a grant and a renewal.
    let e = try_alloc(&p, &who(Role::Orchestrator, "b"), 1, 10_001)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().starts_with("ttl_ms:") && e.message().contains("--max-lease-ttl-ms"),
        "{}",
        e.message()
    );
    let e = p
        .renew_lease(as_caller(
            pb::RenewLeaseRequest {
                lease_id: held.lease_id,
                ttl_ms: 20_000,
            },
            &o,
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    // The default lifetime (30 s) is cut to the longest allowed.
    let d = try_alloc(&p, &who(Role::Orchestrator, "c"), 1, 0)
        .await
        .unwrap();
    assert_eq!(d.ttl_ms, 10_000);
    assert_eq!(p.store.leases.leases_outstanding(), (3, 4));
}

#[tokio::test]
async fn a_lease_released_while_its_agent_was_away_is_not_brought_back_by_it() {
    let dir = Dir::new("tombstone");
    let o = who(Role::Orchestrator, "o");
    let held_copy = {
        let p = open(&dir);
        register(&p, "a");
        let l = alloc(&p, &o, 1, 60_000).await;
        let node = p.store.nodes.get("a").unwrap();
        let copy = p.store.leases.leases_of(&node)[0].record("a");
        release(&p, &o, l.lease_id).await;
        // The agent missed the release and reports the lease it still holds.
        let r = p
            .store
            .leases
            .reconcile_leases(&node, std::slice::from_ref(&copy));
        assert_eq!((r.adopted, r.conflicts), (0, 1));
        assert_eq!(r.release_on_node, vec![l.lease_id]);
        assert!(p.store.leases.leases_of(&node).is_empty());
        copy
    };
    // The tombstone is durable: a restarted server refuses it too.
    let p = open(&dir);
    register(&p, "a");
    let node = p.store.nodes.get("a").unwrap();
    let r = p
        .store
        .leases
        .reconcile_leases(&node, std::slice::from_ref(&held_copy));
    assert_eq!(r.adopted, 0);
    assert_eq!(r.release_on_node, vec![held_copy.id]);
    assert_eq!(p.store.leases.leases_outstanding(), (0, 0));
}

#[tokio::test]
async fn tombstones_leave_the_lease_store_once_past_the_expiry_they_kept() {
    use fairplace::store::LeaseLog;
    let dir = Dir::new("prune");
    let o = who(Role::Orchestrator, "o");
    let kept = {
        let p = open_with(
            &dir,
            StoreConfig {
                tombstone_min_keep: Duration::from_millis(500),
                ..StoreConfig::default()
            },
        );
        register(&p, "a");
        let short = alloc(&p, &o, 1, 300).await;
        let long = alloc(&p, &o, 1, 60_000).await;
        for id in [short.lease_id, long.lease_id] {
            release(&p, &o, id).await;
        }
        // Past the short lease's expiry and the pruning interval.
        std::thread::sleep(Duration::from_millis(1_300));
        fairplace::store::leases::settle::expire(&p.store.leases, Instant::now()).await;
        long.lease_id
    };
    let stored = RedbLog::open(&dir.0).unwrap().load().unwrap();
    let ids: Vec<u64> = stored.ended.iter().map(|e| e.0).collect();
    assert_eq!(
        ids,
        vec![kept],
        "only the tombstone still in its time: {stored:?}"
    );
    assert!(stored.leases.is_empty());
}

/// Two stored leases on one CPU (a store written by a version that freed
/// CPUs before the end was committed): neither is ended on a guess at
/// load, both keep their CPUs, and nothing else is granted on them.
#[tokio::test]
async fn two_stored_leases_on_one_cpu_are_both_kept_and_their_cpu_granted_to_nobody_else() {
    use fairplace::store::{LeaseLog, LeaseOp};
    let dir = Dir::new("overlap");
    let now = unix_ms_now();
    {
        let log = RedbLog::open(&dir.0).unwrap();
        for id in [91_000_000_001u64, 91_000_000_002] {
            let r = held(id, "0-7", now - 1_000, now + 60_000);
            log.submit(0, vec![LeaseOp::Grant(r)]).wait().await.unwrap();
        }
    }
    let p = open(&dir);
    register(&p, "a");
    let node = p.store.nodes.get("a").unwrap();
    let mut ids: Vec<u64> = p
        .store
        .leases
        .leases_of(&node)
        .iter()
        .map(|l| l.id)
        .collect();
    ids.sort();
    assert_eq!(ids, vec![91_000_000_001, 91_000_000_002]);
    let e = p
        .allocate_cpus(as_caller(
            pb::AllocateCpusRequest {
                node_id: "a".into(),
                count: 1,
                ..Default::default()
            },
            &who(Role::Orchestrator, "o"),
        ))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
}
