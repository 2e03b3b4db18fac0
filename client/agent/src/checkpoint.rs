//! The agent's checkpoint: the leases of its node in a small JSON file, so
//! they outlive the agent, as the kubelet's `cpu_manager_state` does.
//!
//! The node is the second witness of its leases. A restarted agent loads
//! them and reports them when it registers (`Register.held_leases`): a
//! server that lost its state gets them back, and one that kept it
//! releases the leases it no longer has. While the server is unreachable
//! the agent keeps them (an affinity or a cpuset is never undone).
//!
//! One file per node, `agent-<node id>.json` in the state directory,
//! replaced atomically on every change (a temp file in the same directory,
//! fsync, rename over, fsync the directory): a crash leaves the old file
//! or the new one, never half. Loading drops the leases already expired;
//! a file that cannot be read or parsed is set aside (`.corrupt`) and the
//! agent starts empty. The file also names the boot it was written in: a
//! target applied before a reboot is gone (its process died, its cgroup
//! was remade without the cpuset).

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use fairplace_proto::v1 as pb;
use serde_json::{Value, json};

use super::apply::Target;

/// The file format; a file of another version is set aside.
pub const VERSION: u64 = 1;

/// A lease of the node, as the agent keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HeldLease {
    pub id: u64,
    pub cpus: String,
    /// `None`: recorded, nothing applied.
    pub target: Option<Target>,
    /// The target process's start time when applied ([`super::apply::process_start`]):
    /// the same pid with another start time is another process.
    pub pid_start: Option<u64>,
    pub policy: String,
    pub holder: String,
    pub owner: String,
    pub ttl_ms: u32,
    pub expires_at_unix_ms: u64,
    pub granted_at_unix_ms: u64,
    /// The target was applied (a lease with a target is kept only then).
    pub applied: bool,
    /// The target's CPUs before the lease (a cpulist), put back when the
    /// lease ends; `None`: unknown (then a cgroup gets its parent's).
    pub before: Option<String>,
    /// Applied before this machine rebooted (not stored): its target is
    /// gone whatever has its name now.
    pub stale: bool,
}

impl HeldLease {
    pub fn from_grant(g: &pb::LeaseGrant, target: Option<Target>) -> HeldLease {
        HeldLease {
            id: g.lease_id,
            cpus: g.cpus.clone(),
            target,
            policy: g.policy.clone(),
            holder: g.holder.clone(),
            owner: g.owner.clone(),
            ttl_ms: g.ttl_ms,
            expires_at_unix_ms: g.expires_at_unix_ms,
            granted_at_unix_ms: g.granted_at_unix_ms,
            ..Default::default()
        }
    }

    /// The lease as the registration reports it.
    pub fn to_grant(&self) -> pb::LeaseGrant {
        let target = self.target.as_ref().map(|t| pb::ApplyTarget {
            target: Some(match t {
                Target::Pid(p) => pb::apply_target::Target::Pid(*p),
                Target::Cgroup(c) => pb::apply_target::Target::Cgroup(c.clone()),
            }),
        });
        pb::LeaseGrant {
            lease_id: self.id,
            cpus: self.cpus.clone(),
            target,
            policy: self.policy.clone(),
            holder: self.holder.clone(),
            owner: self.owner.clone(),
            ttl_ms: self.ttl_ms,
            expires_at_unix_ms: self.expires_at_unix_ms,
            granted_at_unix_ms: self.granted_at_unix_ms,
        }
    }

    fn to_json(&self) -> Value {
        let target = match &self.target {
            None => Value::Null,
            Some(Target::Pid(p)) => json!({"pid": p, "start": self.pid_start}),
            Some(Target::Cgroup(c)) => json!({"cgroup": c}),
        };
        json!({"lease_id": self.id, "cpus": self.cpus, "target": target,
            "policy": self.policy, "holder": self.holder, "owner": self.owner,
            "ttl_ms": self.ttl_ms, "expires_at_unix_ms": self.expires_at_unix_ms,
            "granted_at_unix_ms": self.granted_at_unix_ms, "applied": self.applied,
            "before": self.before})
    }

    fn from_json(v: &Value) -> Result<HeldLease, String> {
        let id = v["lease_id"].as_u64().ok_or("lease_id: not a number")?;
        let num = |k: &str| {
            v[k].as_u64()
                .ok_or_else(|| format!("lease {id}: {k}: not a number"))
        };
        let text = |k: &str| {
            v[k].as_str()
                .map(str::to_string)
                .ok_or_else(|| format!("lease {id}: {k}: not a string"))
        };
        let (target, pid_start) = match &v["target"] {
            Value::Null => (None, None),
            t if t["pid"].is_u64() => {
                let pid = u32::try_from(t["pid"].as_u64().unwrap_or(0))
                    .map_err(|_| format!("lease {id}: target.pid: too big"))?;
                (Some(Target::Pid(pid)), t["start"].as_u64())
            }
            t => match t["cgroup"].as_str() {
                Some(c) => (Some(Target::Cgroup(c.to_string())), None),
                None => return Err(format!("lease {id}: target: neither a pid nor a cgroup")),
            },
        };
        Ok(HeldLease {
            id,
            cpus: text("cpus")?,
            target,
            pid_start,
            policy: text("policy")?,
            holder: text("holder")?,
            owner: text("owner")?,
            ttl_ms: num("ttl_ms")?.min(u32::MAX as u64) as u32,
            expires_at_unix_ms: num("expires_at_unix_ms")?,
            granted_at_unix_ms: num("granted_at_unix_ms")?,
            applied: v["applied"]
                .as_bool()
                .ok_or_else(|| format!("lease {id}: applied: not a bool"))?,
            before: v["before"].as_str().map(str::to_string),
            stale: false,
        })
    }
}

/// Now, in milliseconds since the Unix epoch (the leases' clock).
pub fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`); empty if unreadable.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// The checkpoint of `node_id` in `dir`: `agent-<node id>.json`, every
/// character of the id outside `[A-Za-z0-9._-]` replaced by `_`.
pub fn state_file(dir: &Path, node_id: &str) -> PathBuf {
    let safe: String = node_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    dir.join(format!("agent-{safe}.json"))
}

/// Replaces `path` with the leases, atomically; creates its directory.
pub fn save<'a>(
    path: &Path,
    node_id: &str,
    leases: impl Iterator<Item = &'a HeldLease>,
) -> io::Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let leases: Vec<Value> = leases.map(HeldLease::to_json).collect();
    let doc = json!({"version": VERSION, "node_id": node_id, "boot_id": boot_id(),
        "leases": leases});
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(serde_json::to_string_pretty(&doc)?.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename is durable once the directory is.
    std::fs::File::open(dir)?.sync_all()
}

/// The leases of `node_id` kept in `path`, without those expired by
/// `now_ms`. A missing file is no lease; a bad one is logged, counted and
/// set aside, and the agent starts empty.
pub fn load(path: &Path, node_id: &str, now_ms: u64) -> Vec<HeldLease> {
    // Made now, so a directory the agent cannot write is said at start.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && let Err(e) = std::fs::create_dir_all(dir)
    {
        metrics::counter!("fairplace_agent_checkpoint_errors_total").increment(1);
        tracing::warn!(node = %node_id, dir = %dir.display(), error = %e, "cannot make the state directory; leases are kept in memory until it can be written");
    }
    let parsed = match std::fs::read_to_string(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => Err(e.to_string()),
        Ok(text) => parse(&text, node_id, &boot_id()),
    };
    match parsed {
        Ok(all) => {
            let total = all.len();
            let live: Vec<HeldLease> = all
                .into_iter()
                .filter(|l| l.expires_at_unix_ms > now_ms)
                .collect();
            tracing::info!(node = %node_id, file = %path.display(), leases = live.len(), expired = total - live.len(), "lease checkpoint loaded");
            live
        }
        Err(e) => {
            metrics::counter!("fairplace_agent_checkpoint_errors_total").increment(1);
            let aside = path.with_extension("json.corrupt");
            let moved = std::fs::rename(path, &aside);
            tracing::warn!(node = %node_id, file = %path.display(), error = %e,
                set_aside = %aside.display(), moved = moved.is_ok(),
                "lease checkpoint unreadable; starting without leases");
            Vec::new()
        }
    }
}

/// A checkpoint's leases; those of another boot are marked stale.
fn parse(text: &str, node_id: &str, boot: &str) -> Result<Vec<HeldLease>, String> {
    let doc: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    match doc["version"].as_u64() {
        Some(VERSION) => {}
        v => return Err(format!("version: {v:?}, this agent reads {VERSION}")),
    }
    let theirs = doc["node_id"].as_str().unwrap_or_default();
    if theirs != node_id {
        return Err(format!("node_id: {theirs:?}, not {node_id:?}"));
    }
    let rebooted = doc["boot_id"].as_str() != Some(boot);
    doc["leases"]
        .as_array()
        .ok_or("leases: not a list")?
        .iter()
        .map(|v| {
            let mut l = HeldLease::from_json(v)?;
            l.stale = rebooted && l.target.is_some();
            Ok(l)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "fairplace-checkpoint-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn lease(id: u64, target: Option<Target>, expires: u64) -> HeldLease {
        HeldLease {
            id,
            cpus: "0-1".into(),
            applied: target.is_some(),
            pid_start: matches!(target, Some(Target::Pid(_))).then_some(42),
            target,
            policy: "spread".into(),
            holder: "job".into(),
            owner: "spiffe://x/y".into(),
            ttl_ms: 30_000,
            expires_at_unix_ms: expires,
            granted_at_unix_ms: 1,
            stale: false,
            before: target_before(id),
        }
    }

    /// Some leases carry the CPUs they replaced, some do not: both survive
    /// a round trip.
    fn target_before(id: u64) -> Option<String> {
        id.is_multiple_of(2).then(|| "0-3".to_string())
    }

    #[test]
    fn a_checkpoint_is_written_atomically_and_read_back_without_the_expired() {
        let dir = scratch("roundtrip").join("nested");
        let path = state_file(&dir, "node/a b");
        assert_eq!(path.file_name().unwrap(), "agent-node_a_b.json");
        let now = now_unix_ms();
        let kept = [
            lease(u64::MAX - 3, Some(Target::Pid(1234)), now + 60_000),
            lease(2, Some(Target::Cgroup("fairplace/x".into())), now + 60_000),
            lease(3, None, now + 60_000),
        ];
        let expired = lease(4, None, now - 1);
        save(&path, "node/a b", kept.iter().chain([&expired])).unwrap();
        let files: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(
            files,
            vec![path.file_name().unwrap().to_owned()],
            "no temp file left"
        );
        let back = load(&path, "node/a b", now);
        assert_eq!(back, kept.to_vec());
        // The grants the registration sends carry every field.
        let g = back[0].to_grant();
        assert_eq!(
            (g.lease_id, g.owner.as_str(), g.ttl_ms),
            (u64::MAX - 3, "spiffe://x/y", 30_000)
        );
        assert_eq!(
            HeldLease::from_grant(&g, back[0].target.clone()).to_grant(),
            g
        );
        let _ = std::fs::remove_dir_all(dir.parent().unwrap());
    }

    #[test]
    fn a_corrupt_checkpoint_is_set_aside_and_the_agent_starts_empty() {
        let dir = scratch("corrupt");
        let path = state_file(&dir, "n1");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, "{\"version\": 1, \"leases\": [tru").unwrap();
        assert!(load(&path, "n1", now_unix_ms()).is_empty());
        assert!(!path.exists());
        let aside = dir.join("agent-n1.json.corrupt");
        assert!(aside.exists(), "set aside as {}", aside.display());
        // A missing file is simply no lease.
        assert!(load(&path, "n1", now_unix_ms()).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn targets_of_another_boot_are_stale_and_bad_fields_are_named() {
        let now = now_unix_ms();
        let doc = json!({"version": 1, "node_id": "n", "boot_id": "old",
            "leases": [lease(1, Some(Target::Pid(5)), now + 1000).to_json(),
                       lease(2, None, now + 1000).to_json()]});
        let l = parse(&doc.to_string(), "n", "new").unwrap();
        assert_eq!((l[0].stale, l[1].stale), (true, false));
        let l = parse(&doc.to_string(), "n", "old").unwrap();
        assert!(!l[0].stale);
        let mut bad = doc.clone();
        bad["leases"][0]["cpus"] = json!(3);
        let e = parse(&bad.to_string(), "n", "old").unwrap_err();
        assert_eq!(e, "lease 1: cpus: not a string");
        let e = parse(&doc.to_string(), "m", "old").unwrap_err();
        assert!(e.starts_with("node_id:"), "{e}");
    }
}
