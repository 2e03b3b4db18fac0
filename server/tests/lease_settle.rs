//! The lease state machine against a lease store that misbehaves on cue:
//! a stall (every commit's answer lost, the write applied or not), a
//! refusal, and recovery. Each case is a sequence the fault suite met or
//! the lease-safety issue named, worked through step by step: nothing is
//! visible before it is committed, a release frees nothing until its end
//! is, an unknown outcome is settled by writing again, and a retry with a
//! request id gets the first grant.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fairplace::engine::state::CpuState;
use fairplace::engine::topology::{CpuTopo, TopologySpec};
use fairplace::service::cpu_pool::CpuPool;
use fairplace::service::lease_hub::LeaseHub;
use fairplace::service::placement::Placement;
use fairplace::store::{
    Commit, Epoch, LeaseLog, LeaseOp, LeaseRecord, LogError, Store, StoreConfig, Update,
};
use fairplace_proto::v1 as pb;
use fairplace_proto::v1::placement_service_server::PlacementService;
use tonic::{Code, Request};

/// How the scripted store answers the next commits.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    /// Applied and acknowledged.
    Ok,
    /// The answer is lost; the write applied (`true`) or not.
    Lost(bool),
    /// Refused: certainly not applied.
    Refuse,
}

/// A lease store whose answers the test scripts; it keeps what applied.
#[derive(Default)]
struct Scripted {
    mode: Mutex<Option<Mode>>,
    records: Mutex<BTreeMap<u64, LeaseRecord>>,
    tombstones: Mutex<BTreeMap<u64, u64>>,
}

impl Scripted {
    fn set(&self, m: Mode) {
        *self.mode.lock().unwrap() = Some(m);
    }

    fn holds(&self, id: u64) -> bool {
        self.records.lock().unwrap().contains_key(&id)
    }

    fn apply(&self, op: &LeaseOp) {
        let mut r = self.records.lock().unwrap();
        let mut t = self.tombstones.lock().unwrap();
        match op {
            LeaseOp::Grant(x) | LeaseOp::Settle(x) | LeaseOp::Put(x) => {
                if !t.contains_key(&x.id) {
                    r.insert(x.id, x.clone());
                }
            }
            LeaseOp::End { id, until_ms, .. } => {
                r.remove(id);
                t.insert(*id, *until_ms);
            }
            LeaseOp::Delete { id, .. } => {
                r.remove(id);
                t.remove(id);
            }
            LeaseOp::Forget(id) => {
                t.remove(id);
            }
        }
    }
}

struct Shared(Arc<Scripted>);

impl LeaseLog for Shared {
    fn load(&self) -> Result<fairplace::store::leases::log::Stored, LogError> {
        Ok(Default::default())
    }

    fn submit(&self, _epoch: Epoch, ops: Vec<LeaseOp>) -> Commit {
        let mode = self.0.mode.lock().unwrap().unwrap_or(Mode::Ok);
        match mode {
            Mode::Ok => {
                ops.iter().for_each(|o| self.0.apply(o));
                Commit::done(Ok(()))
            }
            Mode::Lost(applied) => {
                if applied {
                    ops.iter().for_each(|o| self.0.apply(o));
                }
                Commit::done(Err(LogError::unknown("stalled: no answer")))
            }
            Mode::Refuse => Commit::done(Err(LogError::refused("fenced"))),
        }
    }

    fn describe(&self) -> String {
        "scripted".into()
    }
}

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

/// A placement service over a store on the scripted log, with node "a"
/// of `n` idle CPUs.
fn rig(n: u32) -> (Placement, Arc<Scripted>) {
    let log = Arc::new(Scripted::default());
    let store = Arc::new(Store::with_log(
        StoreConfig {
            stale_after: Duration::from_secs(3600),
            ..StoreConfig::default()
        },
        Arc::new(Shared(Arc::clone(&log))),
    ));
    let (node, g) = store
        .nodes
        .register("a", vec![], "t".into(), spec(n))
        .unwrap();
    let u = Update {
        seq: 1,
        full: true,
        cpus: (0..n).map(|i| (i, CpuState::idle(1024))).collect(),
        ..Update::default()
    };
    store.nodes.apply(&node, g, &u, Instant::now()).unwrap();
    let p = Placement {
        recorder: fairplace::record::Hub::new(&store),
        store,
        heavy: CpuPool::new(1, 4),
        hub: Arc::new(LeaseHub::default()),
        replicated: None,
        stopping: tokio::sync::watch::channel(false).1,
    };
    (p, log)
}

fn all(n: u32, request_id: &str) -> pb::AllocateCpusRequest {
    pb::AllocateCpusRequest {
        node_id: "a".into(),
        count: n,
        holder: "t".into(),
        ttl_ms: 60_000,
        request_id: request_id.into(),
        ..Default::default()
    }
}

async fn allocate(
    p: &Placement,
    r: pb::AllocateCpusRequest,
) -> Result<pb::AllocateCpusResponse, tonic::Status> {
    p.allocate_cpus(Request::new(r))
        .await
        .map(|r| r.into_inner())
}

async fn release(p: &Placement, id: u64) -> Result<pb::ReleaseCpusResponse, tonic::Status> {
    p.release_cpus(Request::new(pb::ReleaseCpusRequest { lease_id: id }))
        .await
        .map(|r| r.into_inner())
}

async fn renew(
    p: &Placement,
    id: u64,
    ttl_ms: u32,
) -> Result<pb::RenewLeaseResponse, tonic::Status> {
    p.renew_lease(Request::new(pb::RenewLeaseRequest {
        lease_id: id,
        ttl_ms,
    }))
    .await
    .map(|r| r.into_inner())
}

/// The leases GetNode shows on node "a" (the committed ones).
async fn shown(p: &Placement) -> Vec<u64> {
    let node = p.store.nodes.get("a").unwrap();
    p.store
        .leases
        .leases_of(&node)
        .iter()
        .map(|l| l.id)
        .collect()
}

/// Polls until `f` holds (the settler runs on its own task), at most 5 s.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(5), "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The first story: a release during a stall answers UNAVAILABLE
/// and frees nothing; the same CPUs are not granted again until the end is
/// settled; then they are, and the released lease is gone for good.
#[tokio::test]
async fn a_release_whose_answer_is_lost_frees_nothing_until_its_end_is_settled() {
    let (p, log) = rig(4);
    let l3 = allocate(&p, all(4, "")).await.unwrap();
    log.set(Mode::Lost(false));
    let e = release(&p, l3.lease_id).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    // Still held: shown as it was, its CPUs not granted again.
    assert_eq!(shown(&p).await, vec![l3.lease_id]);
    let e = allocate(&p, all(4, "")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    // No renewal of a lease whose end is in flight.
    let e = renew(&p, l3.lease_id, 0).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(log.holds(l3.lease_id), "the store still holds it");
    // The store comes back: the settler writes the end again.
    log.set(Mode::Ok);
    until("the end settles", || {
        p.store.leases.lease_node(l3.lease_id).is_none()
    })
    .await;
    assert!(!log.holds(l3.lease_id));
    let l4 = allocate(&p, all(4, "")).await.unwrap();
    assert_ne!(l4.lease_id, l3.lease_id);
    assert_eq!(shown(&p).await, vec![l4.lease_id]);
}

/// A retried release of a lease whose end is in flight joins it, and
/// answers OK once the end is committed.
#[tokio::test]
async fn a_retried_release_of_an_ending_lease_answers_ok_once_committed() {
    let (p, log) = rig(2);
    let l = allocate(&p, all(2, "")).await.unwrap();
    log.set(Mode::Lost(true));
    assert_eq!(
        release(&p, l.lease_id).await.unwrap_err().code(),
        Code::Unavailable
    );
    log.set(Mode::Ok);
    let r = release(&p, l.lease_id).await;
    // Either the retry committed the end, or the settler did first and the
    // retry found it gone: never the lease alive again.
    match r {
        Ok(ok) => assert_eq!(ok.cpus, l.cpus),
        Err(e) => assert_eq!(e.code(), Code::NotFound, "{e:?}"),
    }
    until("the end settles", || {
        p.store.leases.lease_node(l.lease_id).is_none()
    })
    .await;
    assert!(shown(&p).await.is_empty());
}

/// A grant whose answer is lost, without a request id: nobody can know
/// its id, so it is settled back (ended for certain, with a tombstone so
/// the lost write can never land later); its CPUs stay held until then.
#[tokio::test]
async fn a_grant_whose_answer_is_lost_without_a_request_id_is_ended_for_certain() {
    let (p, log) = rig(2);
    log.set(Mode::Lost(true));
    let e = allocate(&p, all(2, "")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    assert!(
        shown(&p).await.is_empty(),
        "nothing shown before it is committed"
    );
    let e = allocate(&p, all(1, "")).await.unwrap_err();
    assert_eq!(
        e.code(),
        Code::ResourceExhausted,
        "its CPUs are held meanwhile"
    );
    log.set(Mode::Ok);
    until("the grant is settled back", || {
        p.store.leases.leases_outstanding() == (0, 0)
    })
    .await;
    assert!(log.records.lock().unwrap().is_empty());
    assert_eq!(log.tombstones.lock().unwrap().len(), 1, "ended for certain");
    allocate(&p, all(2, "")).await.unwrap();
}

/// A grant whose answer is lost, with a request id: a retry while the
/// outcome is unknown answers UNAVAILABLE; once settled forward, the retry
/// gets the first grant (the same lease and CPUs) and no second lease.
#[tokio::test]
async fn a_retried_grant_with_its_request_id_gets_the_first_grant_and_no_second_lease() {
    let (p, log) = rig(4);
    log.set(Mode::Lost(false));
    let e = allocate(&p, all(2, "job-7")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let e = allocate(&p, all(2, "job-7")).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "still unknown: {e:?}");
    log.set(Mode::Ok);
    until("the grant is settled forward", || {
        log.records.lock().unwrap().len() == 1
    })
    .await;
    let first = *log.records.lock().unwrap().keys().next().unwrap();
    let again = allocate(&p, all(2, "job-7")).await.unwrap();
    assert_eq!(again.lease_id, first);
    let twice = allocate(&p, all(2, "job-7")).await.unwrap();
    assert_eq!(
        (twice.lease_id, twice.cpus.clone()),
        (first, again.cpus.clone())
    );
    assert_eq!(
        p.store.leases.leases_outstanding(),
        (1, 2),
        "one lease, not two"
    );
    assert_eq!(shown(&p).await, vec![first]);
    // The same id asking for something else is refused by name.
    let e = allocate(&p, all(3, "job-7")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().starts_with("request_id:"), "{}", e.message());
    // Another request id is another lease.
    let other = allocate(&p, all(2, "job-8")).await.unwrap();
    assert_ne!(other.lease_id, first);
}

/// A renewal whose answer is lost extends nothing in memory until it is
/// settled; then the lease has the renewal, and it does not expire
/// meanwhile.
#[tokio::test]
async fn a_renewal_extends_nothing_until_committed() {
    let (p, log) = rig(1);
    let mut r = all(1, "");
    r.ttl_ms = 1_000;
    let l = allocate(&p, r).await.unwrap();
    log.set(Mode::Lost(false));
    let e = renew(&p, l.lease_id, 30_000).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    let (_, mem) = p.store.leases.lease(l.lease_id).unwrap();
    assert_eq!(
        mem.ttl,
        Duration::from_millis(1_000),
        "not extended in memory"
    );
    // Past its old expiry, with the renewal unsettled: it does not end.
    let later = Instant::now() + Duration::from_secs(2);
    assert!(
        fairplace::store::leases::settle::expire(&p.store.leases, later)
            .await
            .is_empty()
    );
    log.set(Mode::Ok);
    until("the renewal settles", || {
        p.store
            .leases
            .lease(l.lease_id)
            .is_some_and(|(_, x)| !x.busy)
    })
    .await;
    let (_, mem) = p.store.leases.lease(l.lease_id).unwrap();
    assert_eq!(mem.ttl, Duration::from_secs(30));
    assert_eq!(log.records.lock().unwrap()[&l.lease_id].ttl_ms, 30_000);
}

/// A refused commit (a fence that no longer holds) is certain: a grant is
/// gone at once, a release leaves the lease live.
#[tokio::test]
async fn a_refused_commit_is_certain_and_undone_at_once() {
    let (p, log) = rig(2);
    log.set(Mode::Refuse);
    assert_eq!(
        allocate(&p, all(2, "")).await.unwrap_err().code(),
        Code::Unavailable
    );
    assert_eq!(p.store.leases.leases_outstanding(), (0, 0));
    log.set(Mode::Ok);
    let l = allocate(&p, all(2, "")).await.unwrap();
    log.set(Mode::Refuse);
    assert_eq!(
        release(&p, l.lease_id).await.unwrap_err().code(),
        Code::Unavailable
    );
    log.set(Mode::Ok);
    renew(&p, l.lease_id, 0).await.unwrap();
    assert_eq!(shown(&p).await, vec![l.lease_id]);
}
