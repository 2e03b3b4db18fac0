use prost::Message;

const PROTOS: [&str; 6] = [
    "fairplace/v1/types.proto",
    "fairplace/v1/agent.proto",
    "fairplace/v1/placement.proto",
    "fairplace/v1/admin.proto",
    "fairplace/v1/replica.proto",
    "fairplace/v1/record.proto",
];

/// The subset of etcd's v3 API the replicas speak (`fairplace::replica`):
/// keys, leases and watches, and the election service.
const ETCD: [&str; 2] = ["etcd/etcdserverpb.proto", "etcd/v3election.proto"];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for p in PROTOS {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    // prost-build ignores file_descriptor_set_path with compile_fds: write it
    // ourselves, for server reflection.
    std::fs::write(out.join("fairplace_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .codec_path("crate::codec::LeanCodec")
        // A selector is read in key order, so an error names the same bad
        // key every time; and an empty BTreeMap is made without a hasher's
        // seed, on every PickCpu.
        .btree_map(".fairplace.v1.PickCpuRequest.selector")
        .build_server(true)
        .build_client(true)
        .compile_fds(fds)?;
    // etcd's v3 API, as far as the replicas use it: clients only, with
    // tonic's own prost codec.
    for p in ETCD {
        println!("cargo:rerun-if-changed={p}");
    }
    let etcd = protox::compile(ETCD.map(|p| p.trim_start_matches("etcd/")), ["etcd"])?;
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_fds(etcd)?;
    Ok(())
}
