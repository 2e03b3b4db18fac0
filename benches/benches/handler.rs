//! A PickCpu's own work on the server, apart from HTTP/2: the request's
//! decoding, the handler (`Placement::pick_one`: node lookup, freshness,
//! the request's conversion and checks, the engine, the decision metrics,
//! the answer's fields) and the answer's encoding, as the server's unary
//! path runs them. The baseline in the same run is Ping's share of the same
//! path (decode the empty request, encode the empty answer): the
//! end-to-end ratio PickCpu/Ping is set by how much the first exceeds it.
//!
//! The node is the load generator's: 128 CPUs (2 NUMA nodes x 2 LLCs x 16
//! cores x SMT2), half of them busy, and the request a wakeup as the
//! generator sends it.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use fairplace::engine::state::CpuState;
use fairplace::service::heavy::HeavyPool;
use fairplace::service::identity::Caller;
use fairplace::service::lease_hub::LeaseHub;
use fairplace::service::placement::{Picked, Placement};
use fairplace::store::{Store, StoreConfig, Update};
use fairplace_benches::{Lcg, busy_cpu, spec};
use fairplace_proto::codec::{PREFIX, frame};
use fairplace_proto::v1 as pb;
use prost::Message;
use prost::bytes::Bytes;

/// A placement service over one registered, reported 128-CPU node "load".
fn placement() -> Placement {
    // The state stays fresh for the whole run (the generator's server runs
    // with --stale-after-ms 3600000 too).
    let store = Arc::new(Store::new(StoreConfig {
        stale_after: Duration::from_secs(3600),
        forget_after: Duration::from_secs(7200),
        ..StoreConfig::default()
    }));
    let spec = spec(16, 2);
    let n = spec.cpus.len();
    let (node, generation) = store
        .register("load", vec![], "bench".into(), spec)
        .unwrap();
    let mut rng = Lcg(7);
    let cpus = (0..n)
        .map(|i| {
            let c = if i % 2 == 0 {
                busy_cpu(&mut rng)
            } else {
                CpuState::idle(1024)
            };
            (i as u32, c)
        })
        .collect();
    let update = Update {
        seq: 1,
        full: true,
        cpus,
        ..Update::default()
    };
    store
        .apply(&node, generation, &update, Instant::now())
        .unwrap();
    Placement {
        store,
        heavy: HeavyPool::new(1, 1),
        hub: Arc::new(LeaseHub::default()),
        replicated: None,
        stopping: tokio::sync::watch::channel(false).1,
    }
}

/// The generator's request for caller `i`, framed.
fn request(i: u32) -> Bytes {
    let this = i % 128;
    frame(&pb::PickCpuRequest {
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
    })
}

/// What the unary path does with a PickCpu's message: decode, decide,
/// encode.
fn pick_cpu(p: &Placement, caller: &Caller, ext: &http::Extensions, msg: &Bytes) -> Bytes {
    let r = pb::PickCpuRequest::decode(msg.slice(PREFIX..)).unwrap();
    match p.pick_one(caller, ext, r) {
        Ok(Picked::Now(resp)) => frame(&resp),
        Ok(Picked::Later(_)) => unreachable!("a local node answers at once"),
        Err(e) => panic!("{e}"),
    }
}

fn handler(c: &mut Criterion) {
    let p = placement();
    let caller = Caller::Open;
    let ext = http::Extensions::new();
    let requests: Vec<Bytes> = (0..32).map(request).collect();
    let ping = frame(&pb::PingRequest {});
    // Every request must decide, or the figures measure an error path.
    for m in &requests {
        let out = pick_cpu(&p, &caller, &ext, m);
        let resp = pb::PickCpuResponse::decode(&out[PREFIX..]).unwrap();
        assert!(resp.state_version > 0 && resp.cpu < 128, "{resp:?}");
    }

    let mut g = c.benchmark_group("unary_handler_128cpu");
    g.bench_function("ping_decode_encode", |b| {
        b.iter(|| {
            black_box(pb::PingRequest::decode(black_box(&ping).slice(PREFIX..)).unwrap());
            black_box(frame(&pb::PingResponse {}))
        })
    });
    let mut i = 0;
    g.bench_function("pick_cpu_decode_handler_encode", |b| {
        b.iter(|| {
            i = (i + 1) % requests.len();
            black_box(pick_cpu(&p, &caller, &ext, black_box(&requests[i])))
        })
    });
    g.bench_function("pick_cpu_decode_only", |b| {
        b.iter(|| {
            i = (i + 1) % requests.len();
            black_box(pb::PickCpuRequest::decode(black_box(&requests[i]).slice(PREFIX..)).unwrap())
        })
    });
    let decoded: Vec<pb::PickCpuRequest> = requests
        .iter()
        .map(|m| pb::PickCpuRequest::decode(m.slice(PREFIX..)).unwrap())
        .collect();
    // The request's clone (its node id's allocation) stands in for the
    // decoding's.
    g.bench_function("pick_one_only", |b| {
        b.iter(|| {
            i = (i + 1) % decoded.len();
            match p.pick_one(&caller, &ext, black_box(decoded[i].clone())) {
                Ok(Picked::Now(resp)) => black_box(resp),
                Ok(Picked::Later(_)) => unreachable!("a local node answers at once"),
                Err(e) => panic!("{e}"),
            }
        })
    });
    g.finish();
}

criterion_group!(benches, handler);
criterion_main!(benches);
