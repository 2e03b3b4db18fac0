//! Places where the scenario format and the kernel's source disagree, and the
//! engine follows the kernel (see the README's "Kernel over spec" list).

use fairplace::offline::scenario::{Answer, parse};
use serde_json::json;

/// 16 single-thread CPUs in one LLC; the waker on CPU 2 is busy, the wakee's
/// prev CPU 9 is busy and CPU 2's LLC is the same: with want_affine the wake
/// goes through wake_affine; without it the target is prev.
fn wakeup(waker_flips: i64, wakee_flips: i64) -> serde_json::Value {
    let cpus: Vec<_> = (0..16)
        .map(|i| json!({"id": i, "core": i, "llc": 0}))
        .collect();
    json!({
        "topology": {"cpus": cpus},
        "cpus": [{"id": 2, "nr_running": 1}, {"id": 9, "nr_running": 1}],
        "task": {"prev_cpu": 9, "wakee_flips": wakee_flips},
        "request": {"kind": "wakeup", "this_cpu": 2, "waker_wakee_flips": waker_flips}
    })
}

#[test]
fn wake_wide_multiplies_in_32_bits_like_the_kernel() {
    // slave = 2^28, factor = llc_size 16: slave * factor = 2^32 wraps to 0 in
    // the kernel's unsigned int, so master >= 0 holds and the wakeup is wide
    // (want_affine false). With unbounded arithmetic 2^28 >= 2^32 is false.
    let s = parse(&wakeup(1 << 28, 1 << 28)).unwrap();
    let Answer::Place(p) = s.decide() else {
        panic!()
    };
    assert!(!p.detail.want_affine);
    assert_eq!(p.detail.affine, None);
    // Without the wrap (slave * factor = 2^31 < 2^32), master 2^27 < 2^31:
    // not wide, so wake_affine runs.
    let s = parse(&wakeup(1 << 27, 1 << 27)).unwrap();
    let Answer::Place(p) = s.decide() else {
        panic!()
    };
    assert!(p.detail.want_affine);
    assert!(p.detail.affine.is_some());
}
