//! A PickCpu's own work on the server, apart from HTTP/2: the request's
//! decoding, the handler (`Placement::pick_one`: node lookup, freshness,
//! the request's conversion and checks, the engine, the decision metrics,
//! the answer's fields) and the answer's encoding, as the server's unary
//! path runs them. The baseline in the same run is Ping's share of the same
//! path (decode the empty request, encode the empty answer): the
//! end-to-end ratio PickCpu/Ping is set by how much the first exceeds it.
//!
//! The node, its state and the requests are the load generator's
//! (`fairplace_benches::load`): 128 CPUs, about half of them busy, and
//! wakeups from 32 callers.

use std::hint::black_box;

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use fairplace::convert::Picked;
use fairplace::identity::Caller;
use fairplace_benches::load::{self, pick_cpu, ping_answer};
use fairplace_proto::codec::{PREFIX, frame};
use fairplace_proto::v1 as pb;
use prost::Message;
use prost::bytes::Bytes;

fn handler(c: &mut Criterion) {
    let p = load::placement();
    let caller = Caller::Open;
    let ext = http::Extensions::new();
    let requests: Vec<Bytes> = (0..32).map(|i| frame(&load::wakeup_on_load(i))).collect();
    let ping = frame(&pb::PingRequest {});
    // Every request must decide, or the figures measure an error path.
    for m in &requests {
        let out = pick_cpu(&p, &caller, &ext, m);
        let resp = pb::PickCpuResponse::decode(&out[PREFIX..]).unwrap();
        assert!(resp.state_version > 0 && resp.cpu < 128, "{resp:?}");
    }

    let mut g = c.benchmark_group("unary_handler_128cpu");
    g.bench_function("ping_decode_encode", |b| {
        b.iter(|| black_box(ping_answer(black_box(&ping))))
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
    let mut decoded: Vec<pb::PickCpuRequest> = requests
        .iter()
        .map(|m| pb::PickCpuRequest::decode(m.slice(PREFIX..)).unwrap())
        .collect();
    g.bench_function("pick_one_only", |b| {
        b.iter(|| {
            i = (i + 1) % decoded.len();
            match p.pick_one(&caller, &ext, black_box(&mut decoded[i])) {
                Ok(Picked::Now(answer)) => black_box(answer),
                Ok(Picked::Later(_)) => unreachable!("a local node answers at once"),
                Err(e) => panic!("{e}"),
            }
        })
    });
    // The same with the caches emptied before each call (a buffer larger
    // than the level written through), as on the server, where each call's
    // HTTP/2 and kernel work comes between two decisions.
    for (name, bytes) in [("l2", 1usize << 20), ("l3", 48 << 20)] {
        let mut junk = vec![0u8; bytes];
        let mut evict = move || {
            for b in junk.iter_mut().step_by(64) {
                *b = b.wrapping_add(1);
            }
            black_box(&junk);
        };
        g.bench_function(format!("ping_decode_encode_{name}_cold"), |b| {
            b.iter_batched(
                &mut evict,
                |_| black_box(ping_answer(black_box(&ping))),
                BatchSize::PerIteration,
            )
        });
        g.bench_function(format!("pick_cpu_decode_handler_encode_{name}_cold"), |b| {
            b.iter_batched(
                &mut evict,
                |_| {
                    i = (i + 1) % requests.len();
                    black_box(pick_cpu(&p, &caller, &ext, black_box(&requests[i])))
                },
                BatchSize::PerIteration,
            )
        });
    }
    g.finish();
}

criterion_group!(benches, handler);
criterion_main!(benches);
