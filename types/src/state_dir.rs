//! Where fairplace keeps what must survive a restart when no `--state-dir`
//! is given: the server's lease store and the agent's lease checkpoint.
//! One rule for both, so a server and an agent on one machine agree.

use std::path::PathBuf;

/// `/var/lib/fairplace` as root; else `$XDG_STATE_HOME/fairplace`, else
/// `$HOME/.local/state/fairplace` (the XDG base directory rule for state),
/// else `./fairplace-state`.
pub fn default_state_dir() -> PathBuf {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        return PathBuf::from("/var/lib/fairplace");
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(x) = env("XDG_STATE_HOME") {
        return PathBuf::from(x).join("fairplace");
    }
    if let Some(h) = env("HOME") {
        return PathBuf::from(h).join(".local/state/fairplace");
    }
    PathBuf::from("fairplace-state")
}

/// This machine's hostname (the default of a node id and a replica id).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".into())
}
