//! The fairplace gRPC API, `fairplace.v1`, generated at build time.

#![allow(clippy::all)]

pub mod codec;

pub mod v1 {
    tonic::include_proto!("fairplace.v1");

    /// A NUMA distance matrix as `Topology.numa_distance` carries it (none:
    /// no rows), for every side that sends a topology.
    pub fn distance_rows(d: Option<&Vec<Vec<u32>>>) -> Vec<DistanceRow> {
        d.map(|d| {
            d.iter()
                .map(|r| DistanceRow {
                    distance: r.clone(),
                })
                .collect()
        })
        .unwrap_or_default()
    }
}

/// etcd's v3 API, as far as fairplace's replicas use it
/// (`proto/etcd/etcdserverpb.proto`): KV, Watch and Lease clients.
pub mod etcdserverpb {
    tonic::include_proto!("etcdserverpb");
}
pub use etcdserverpb as etcd;

/// etcd's election API (`proto/etcd/v3election.proto`): the balancer's
/// election.
pub mod v3electionpb {
    tonic::include_proto!("v3electionpb");
}
pub use v3electionpb as election;

/// The encoded file descriptor set of every fairplace .proto, for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/fairplace_descriptor.bin"));
