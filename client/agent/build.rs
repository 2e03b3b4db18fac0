//! Build script of fairplace-agent: with the `bpf` feature, compiles the
//! agent's BPF program (src/bpf/snapshot.bpf.c) into a CO-RE object
//! and generates its Rust skeleton in OUT_DIR. Without the feature it does
//! nothing, so the default build needs no clang and no libelf.

fn main() {
    #[cfg(feature = "bpf")]
    bpf::build();
}

#[cfg(feature = "bpf")]
mod bpf {
    use std::path::PathBuf;

    const SRC: &str = "src/bpf/snapshot.bpf.c";

    pub fn build() {
        let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
        println!("cargo:rerun-if-changed={SRC}");
        // The CPU and task records are one C struct each; the header is
        // shared with nothing else, so only the source is watched.
        let built = libbpf_cargo::SkeletonBuilder::new()
            .source(SRC)
            .obj(out.join("snapshot.bpf.o"))
            .clang_args(["-Wall", "-Wno-unused-function"])
            .build_and_generate(out.join("snapshot.skel.rs"));
        if let Err(e) = built {
            // The usual cause on a fresh machine: no clang with the BPF
            // target. Say what to install rather than only clang's error.
            panic!(
                "the `bpf` feature compiles {SRC} with clang -target bpf and links libbpf \
                 (libelf, zlib): install clang and libelf-dev (Debian) or build without \
                 `--features bpf`.\n{e:#}"
            );
        }
    }
}
