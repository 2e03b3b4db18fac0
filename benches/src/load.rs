//! The load generator's node and requests, shared by `fairplace-load` and
//! the handler benchmark so both measure the same decisions.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace::convert;
use fairplace::identity::Caller;
use fairplace::service::cpu_pool::CpuPool;
use fairplace::service::lease_hub::LeaseHub;
use fairplace::service::placement::Placement;
use fairplace::store::{Store, StoreConfig};
use fairplace::transport::fast_unary::{Step, pick_cpu_here};
use fairplace_proto::codec::{PREFIX, frame};
use fairplace_proto::v1 as pb;
use prost::Message;
use prost::bytes::Bytes;

/// A node of `cpus` CPUs: 2 NUMA nodes x 1 LLC x (cpus/4) cores x SMT2.
pub fn topology(cpus: u32) -> pb::Topology {
    let per_node = cpus / 2;
    pb::Topology {
        cpus: (0..cpus)
            .map(|i| pb::CpuTopology {
                id: i,
                core: i / 2,
                cluster: None,
                llc: i / per_node,
                node: i / per_node,
                capacity: 1024,
            })
            .collect(),
        numa_distance: vec![],
    }
}

/// Every CPU's state, about half of them busy (chosen by `seed`) with a
/// utilisation of 400 to 1,000.
pub fn states(cpus: u32, seed: u64) -> Vec<pb::CpuState> {
    let mut x = seed | 1;
    (0..cpus)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let busy = x.is_multiple_of(2);
            let util = if busy { 400 + (x % 600) as i64 } else { 0 };
            pb::CpuState {
                id: i,
                online: true,
                nr_running: busy as u32,
                load_avg: util,
                runnable_avg: util,
                util_avg: util,
                util_est: util,
                ..Default::default()
            }
        })
        .collect()
}

/// Call `i`'s PickCpu: a wakeup on node `load` (128 CPUs) from CPU
/// `i % 128`, its previous CPU 17 further on.
pub fn wakeup_on_load(i: usize) -> pb::PickCpuRequest {
    let this = (i % 128) as u32;
    pb::PickCpuRequest {
        node_id: "load".into(),
        task: Some(pb::Task {
            prev_cpu: Some((this + 17) % 128),
            util_avg: 150,
            load_avg: 200,
            ..Default::default()
        }),
        kind: pb::RequestKind::Wakeup as i32,
        this_cpu: this,
        ..Default::default()
    }
}

/// A placement service over the load generator's node "load" (128 CPUs,
/// its state of seed 7), registered and reported as the server does it,
/// for measuring a PickCpu's handler in process.
pub fn placement() -> Placement {
    // The state stays fresh for the whole run (the generator's server runs
    // with --stale-after-ms 3600000 too).
    let store = Arc::new(Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        forget_after: Duration::from_secs(7200),
        ..StoreConfig::default()
    }));
    let spec = convert::topology_spec(Some(&topology(128)), "topology").unwrap();
    let (node, generation) = store
        .nodes
        .register("load", vec![], "bench".into(), spec.clone())
        .unwrap();
    let report = pb::Update {
        seq: 1,
        full: true,
        cpus: states(128, 7),
        ..Default::default()
    };
    let update = convert::update(&report, &spec).unwrap();
    store
        .nodes
        .apply(&node, generation, &update, Instant::now())
        .unwrap();
    Placement {
        recorder: fairplace::record::Hub::new(&store),
        store,
        heavy: CpuPool::new(1, 1),
        hub: Arc::new(LeaseHub::default()),
        replicated: None,
        stopping: tokio::sync::watch::channel(false).1,
    }
}

/// What the server's unary path does with a PickCpu's framed message:
/// decode (into the worker's reused message, as the server does), decide,
/// frame the answer.
pub fn pick_cpu(p: &Placement, caller: &Caller, ext: &http::Extensions, msg: &Bytes) -> Bytes {
    match pick_cpu_here(p, caller, ext, &msg[PREFIX..]) {
        Step::Framed(answer) => answer,
        Step::Later(_) => unreachable!("a local node answers at once"),
        Step::Refused(e) => panic!("{e}"),
        Step::Undecodable => panic!("the load generator's request does not decode"),
    }
}

/// What the server's unary path does with a Ping's framed message: decode,
/// encode.
pub fn ping_answer(msg: &Bytes) -> Bytes {
    black_box(pb::PingRequest::decode(&msg[PREFIX..]).unwrap());
    frame(&pb::PingResponse {})
}
