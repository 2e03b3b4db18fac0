//! The lease fault suite, reduced: every fault kind at least once against
//! the real binaries, the whole history checked (`fairplace_e2e::faults`;
//! the long run is `fairplace-lease-faults`, docs/leases.md). Three
//! replicas on a three-member etcd (skipped with a message without etcd,
//! required under `FAIRPLACE_REQUIRE_ETCD=1`), then one server on redb (a
//! full disk only where the test may mount a tmpfs, as root).

use std::sync::Mutex;
use std::time::Duration;

use fairplace_e2e::etcd::etcd_or_skip;
use fairplace_e2e::faults::{self, Config, Report};
use fairplace_e2e::rt;

/// One rig at a time: two on two cores would measure each other.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn config(etcd: Option<String>, seconds: u64) -> Config {
    Config {
        seed: 11,
        duration: Duration::from_secs(seconds),
        etcd,
        clients: 6,
        nodes: 4,
        gap_ms: (500, 1_500),
    }
}

fn judge(r: &Report) {
    println!("{}: {}", r.mode, r.line());
    println!("  faults by kind: {:?}", r.faults);
    for v in &r.violations {
        println!("  VIOLATION {}: {}", v.rule, v.detail);
    }
    assert!(r.violations.is_empty(), "{} violations", r.violations.len());
    assert!(
        r.kinds_missing().is_empty(),
        "fault kinds never injected: {:?}",
        r.kinds_missing()
    );
    assert!(
        r.granted > 20,
        "too few grants to mean anything: {}",
        r.granted
    );
}

#[test]
fn replicas_on_etcd_keep_every_lease_true_under_every_fault_kind() {
    let Some(etcd) = etcd_or_skip("replicas_on_etcd_keep_every_lease_true_under_every_fault_kind")
    else {
        return;
    };
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let r = rt().block_on(faults::run(&config(Some(etcd), 60)));
    judge(&r);
}

#[test]
fn one_server_on_redb_keeps_every_lease_true_under_kills_a_full_disk_and_skewed_clocks() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let r = rt().block_on(faults::run(&config(None, 30)));
    judge(&r);
}
