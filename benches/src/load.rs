//! The load generator's node and requests, shared by `fairplace-load` and
//! the handler benchmark so both measure the same decisions.

use fairplace_proto::v1 as pb;

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
