//! Slurm loads a plugin only when its `plugin_version` names the Slurm
//! release it was built for (major and minor). The number is read from
//! libslurm-dev's `slurm/slurm_version.h` when it is installed (the
//! `SLURM_INCLUDE_DIR` directory, or the system's include directory), and
//! is Debian 12's Slurm 22.05 otherwise.

use std::path::PathBuf;

const DEBIAN_12_SLURM: u32 = 0x16_05_08;

fn main() {
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    let dir = std::env::var_os("SLURM_INCLUDE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/include"));
    let header = dir.join("slurm").join("slurm_version.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let version = std::fs::read_to_string(&header)
        .ok()
        .and_then(|text| version_number(&text))
        .unwrap_or(DEBIAN_12_SLURM);
    println!("cargo:rustc-env=FAIRPLACE_SLURM_VERSION_NUMBER={version}");
}

/// `#define SLURM_VERSION_NUMBER 0x160508` -> 0x160508.
fn version_number(header: &str) -> Option<u32> {
    header.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define")?.trim();
        let value = rest.strip_prefix("SLURM_VERSION_NUMBER")?.trim();
        u32::from_str_radix(value.strip_prefix("0x")?, 16).ok()
    })
}
