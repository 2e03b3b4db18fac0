//! The fairplace gRPC API, `fairplace.v1`, generated at build time.

#![allow(clippy::all)]

pub mod codec;

pub mod v1 {
    tonic::include_proto!("fairplace.v1");
}

/// The encoded file descriptor set of every fairplace .proto, for reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/fairplace_descriptor.bin"));
