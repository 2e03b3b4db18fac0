//! Why applying a lease failed, as the protocol names it (`reason`:
//! not_found, permission_denied, invalid, failed) with a message for the
//! caller. Its own module because both the mechanism (`apply.rs`)
//! and the cgroup lookup under it (`cgroupfs.rs`) produce it.

use std::io;

/// Why applying failed, as the protocol names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApplyError {
    pub reason: &'static str,
    pub message: String,
}

impl ApplyError {
    /// A system call's error, with what it was about.
    pub fn of(e: &io::Error, what: &str) -> ApplyError {
        let reason = match e.raw_os_error() {
            Some(libc::ESRCH) | Some(libc::ENOENT) => "not_found",
            Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => "permission_denied",
            Some(libc::EINVAL) => "invalid",
            _ => "failed",
        };
        ApplyError {
            reason,
            message: format!("{what}: {e}"),
        }
    }
}
