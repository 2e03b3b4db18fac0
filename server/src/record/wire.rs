//! The two entries written by hand, the bulk of a recording: a node's
//! state as the CPUs that changed (every report of every node), written
//! straight from the engine's `CpuState`s without a message per CPU; and a
//! PickCpu with its answer, encoded where it is decided into one buffer
//! (the request as it is, no copy of it first), so the writer only appends
//! it. Both are protobuf's wire format, byte for byte what prost writes
//! for the same [`pb::RecordEntry`] (the tests compare them).

use fairplace_proto::v1 as pb;
use prost::Message;

use crate::engine::state::CpuState;

fn varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// A varint field, left out at 0 (proto3) unless `present` (optional).
fn field(buf: &mut Vec<u8>, number: u32, v: u64, present: bool) {
    if v != 0 || present {
        varint(buf, (number as u64) << 3);
        varint(buf, v);
    }
}

/// A length-delimited field whose bytes `body` writes.
fn nested(buf: &mut Vec<u8>, number: u32, scratch: &mut Vec<u8>, body: impl FnOnce(&mut Vec<u8>)) {
    scratch.clear();
    body(scratch);
    varint(buf, ((number as u64) << 3) | 2);
    varint(buf, scratch.len() as u64);
    buf.extend_from_slice(scratch);
}

/// `pb::CpuState` of CPU `id` as `convert::cpu_state_to_pb` makes it.
fn cpu_state(buf: &mut Vec<u8>, id: usize, c: &CpuState, cookie: u64) {
    field(buf, 1, id as u64, false);
    field(buf, 2, c.online as u64, false);
    field(buf, 3, c.nr_running as u64, false);
    field(buf, 4, c.h_nr_idle as u64, false);
    field(buf, 5, c.nr_delayed as u64, false);
    field(buf, 6, c.cfs_h_nr_queued as u64, true);
    field(buf, 7, c.curr_is_idle as u64, true);
    field(buf, 8, c.ttwu_pending as u64, false);
    field(buf, 9, c.vcpu_preempted as u64, false);
    field(buf, 10, c.load_avg as u64, false);
    field(buf, 11, c.runnable_avg as u64, false);
    field(buf, 12, c.util_avg as u64, false);
    field(buf, 13, c.util_est as u64, false);
    field(buf, 14, c.capacity as u64, true);
    field(buf, 15, c.actual_capacity as u64, true);
    if let Some(l) = c.exit_latency() {
        field(buf, 16, l as u64, true);
    }
    // int64: negative values are ten-byte varints, as prost writes them.
    field(buf, 17, c.idle_stamp as u64, false);
    field(buf, 18, c.curr_is_per_cpu_kthread as u64, false);
    field(buf, 19, cookie, false);
}

fn string(buf: &mut Vec<u8>, number: u32, v: &str) {
    if !v.is_empty() {
        varint(buf, ((number as u64) << 3) | 2);
        varint(buf, v.len() as u64);
        buf.extend_from_slice(v.as_bytes());
    }
}

/// `RecordEntry { decision: RecordDecision { node_id, version, unix_ms,
/// pick: req, picked: answer (no node), cluster } }`, length-delimited.
pub fn pick_entry(
    node: &str,
    version: u64,
    unix_ms: u64,
    req: &pb::PickCpuRequest,
    a: &crate::convert::PickAnswer,
    cluster: bool,
) -> Vec<u8> {
    let mut d = Vec::with_capacity(96 + req.encoded_len());
    string(&mut d, 1, node);
    field(&mut d, 2, version, false);
    field(&mut d, 3, unix_ms, false);
    varint(&mut d, (4 << 3) | 2);
    let _ = req.encode_length_delimited(&mut d);
    let mut r = Vec::with_capacity(48);
    field(&mut r, 1, a.cpu as u64, false);
    string(&mut r, 2, a.path);
    field(&mut r, 3, a.scanned as u64, false);
    field(&mut r, 4, a.state_version, false);
    if a.state_age_seconds != 0.0 {
        varint(&mut r, (5 << 3) | 1);
        r.extend_from_slice(&a.state_age_seconds.to_le_bytes());
    }
    string(&mut r, 6, a.affine);
    if let Some(n) = a.nr_idle_scan {
        field(&mut r, 7, n as u64, true);
    }
    varint(&mut d, (8 << 3) | 2);
    varint(&mut d, r.len() as u64);
    d.extend_from_slice(&r);
    field(&mut d, 13, cluster as u64, false);
    let mut out = Vec::with_capacity(d.len() + 8);
    let entry_len = 1 + varint_len(d.len() as u64) + d.len();
    varint(&mut out, entry_len as u64);
    varint(&mut out, (4 << 3) | 2);
    varint(&mut out, d.len() as u64);
    out.extend_from_slice(&d);
    out
}

fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// What a state entry says besides its CPUs.
pub struct StateHead<'a> {
    pub node: &'a str,
    pub version: u64,
    pub unix_ms: u64,
    pub report: bool,
    pub full: bool,
    pub features: Option<pb::RecordFeatures>,
}

/// Appends `RecordEntry { state }` length-delimited to `raw`: the CPUs of
/// `cpus` (id, state, core cookie) in order.
pub fn push_state<'c>(
    raw: &mut Vec<u8>,
    head: &StateHead<'_>,
    cpus: impl Iterator<Item = (usize, &'c CpuState, u64)>,
    scratch: &mut [Vec<u8>; 3],
) {
    let [entry, state, cpu] = scratch;
    state.clear();
    if !head.node.is_empty() {
        varint(state, (1 << 3) | 2);
        varint(state, head.node.len() as u64);
        state.extend_from_slice(head.node.as_bytes());
    }
    field(state, 2, head.version, false);
    field(state, 3, head.unix_ms, false);
    field(state, 4, head.report as u64, false);
    field(state, 5, head.full as u64, false);
    for (id, c, cookie) in cpus {
        nested(state, 6, cpu, |b| cpu_state(b, id, c, cookie));
    }
    if let Some(f) = &head.features {
        nested(state, 7, cpu, |b| {
            let _ = f.encode(b);
        });
    }
    entry.clear();
    varint(entry, (3 << 3) | 2);
    varint(entry, state.len() as u64);
    entry.extend_from_slice(state);
    varint(raw, entry.len() as u64);
    raw.extend_from_slice(entry);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::convert;

    #[test]
    fn a_pick_entry_is_what_prost_writes() {
        let req = pb::PickCpuRequest {
            node_id: "n".into(),
            kind: pb::RequestKind::Exec as i32,
            this_cpu: 3,
            claim: true,
            task: Some(pb::Task {
                cpus_allowed: "0-7".into(),
                prev_cpu: Some(0),
                util_avg: 300,
                ..Default::default()
            }),
            ..Default::default()
        };
        for (age, affine, scan, cluster, version) in [
            (0.0, "", None, false, 1),
            (0.125, "wake_affine_idle", Some(0), true, 1u64 << 40),
            (3.5, "", Some(17), false, 300),
        ] {
            let a = crate::convert::PickAnswer {
                cpu: 5,
                path: "idle_cpu",
                scanned: 9,
                state_version: version,
                state_age_seconds: age,
                affine,
                nr_idle_scan: scan,
            };
            let want = pb::RecordEntry {
                entry: Some(pb::record_entry::Entry::Decision(pb::RecordDecision {
                    node_id: "node-a".into(),
                    version,
                    unix_ms: 1_790_000_000_123,
                    request: Some(pb::record_decision::Request::Pick(req.clone())),
                    picked: Some(a.into_response(String::new())),
                    cluster,
                    ..Default::default()
                })),
            };
            let mut theirs = Vec::new();
            want.encode_length_delimited(&mut theirs).unwrap();
            let ours = pick_entry("node-a", version, 1_790_000_000_123, &req, &a, cluster);
            assert_eq!(ours, theirs, "age {age} cluster {cluster}");
        }
    }

    fn cpu(seed: u32) -> CpuState {
        let mut c = CpuState::idle(1024 - seed % 3);
        c.online = !seed.is_multiple_of(5);
        c.nr_running = seed % 4;
        c.h_nr_idle = seed % 2;
        c.cfs_h_nr_queued = seed % 3;
        c.curr_is_idle = seed.is_multiple_of(2);
        c.ttwu_pending = seed.is_multiple_of(7);
        c.load_avg = seed * 977;
        c.util_avg = seed * 13 % 1024;
        c.util_est = seed * 7 % 1024;
        c.runnable_avg = seed * 31;
        c.actual_capacity = (seed % 900) as u16;
        c.idle_exit_latency = if seed.is_multiple_of(3) { 0 } else { seed };
        c.idle_stamp = seed as i64 * 1_000_003;
        c.curr_is_per_cpu_kthread = seed.is_multiple_of(11);
        c
    }

    #[test]
    fn a_state_entry_is_what_prost_writes() {
        let cpus: Vec<CpuState> = (0..40).map(cpu).collect();
        for (full, features, node) in [
            (false, None, "n1"),
            (
                true,
                Some(pb::RecordFeatures {
                    on: vec!["SIS_UTIL".into()],
                    kernel: "6.12".into(),
                }),
                "a-much-longer-node-name.example",
            ),
            (false, None, ""),
        ] {
            let picked: Vec<usize> = (0..40).filter(|i| full || i % 3 != 1).collect();
            let cookie = |i: usize| {
                if i.is_multiple_of(4) {
                    0
                } else {
                    1u64 << (i % 60)
                }
            };
            let want = pb::RecordEntry {
                entry: Some(pb::record_entry::Entry::State(pb::RecordState {
                    node_id: node.into(),
                    version: 12345,
                    unix_ms: 1_790_000_000_000,
                    report: !full,
                    full,
                    cpus: picked
                        .iter()
                        .map(|&i| convert::cpu_state_to_pb(i, &cpus[i], cookie(i)))
                        .collect(),
                    features: features.clone(),
                })),
            };
            let mut theirs = Vec::new();
            want.encode_length_delimited(&mut theirs).unwrap();
            let mut ours = Vec::new();
            let head = StateHead {
                node,
                version: 12345,
                unix_ms: 1_790_000_000_000,
                report: !full,
                full,
                features,
            };
            let mut scratch = Default::default();
            push_state(
                &mut ours,
                &head,
                picked.iter().map(|&i| (i, &cpus[i], cookie(i))),
                &mut scratch,
            );
            assert_eq!(ours, theirs, "node {node:?} full {full}");
        }
    }
}
