//! The leases of this node as the agent holds them: every lease the
//! server sends (new grants, and all live ones again after the agent
//! registers), with its releases and renewals, kept across reconnects in
//! an [`Applier`] and across restarts in its [`checkpoint`].
//!
//! A grant naming a target is applied at once ([`apply`]) and answered with
//! an `ApplyOutcome`; a grant without one is only recorded (the node is the
//! lease's second witness: it reports every lease it holds when it
//! registers). Applied targets are watched: when a process exits or a
//! cgroup is removed, the agent says so (`gone`) and the server releases
//! the lease. A pid names a process for its life (pid and start time), so
//! a lease is never applied to another process that took the pid.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use fairplace_proto::v1 as pb;
use pb::agent_message::Body;

use super::LeaseSettings;
use super::apply::{ApplyError, Roots, Target, apply, current_cpus, parent_cpus, process_start};
use super::cgroupfs::CgroupFs;
use super::checkpoint::{self, HeldLease};

/// Whether an Ack is the server's push (grants, releases, renewals), not
/// the answer to an update.
pub fn is_push(a: &pb::Ack) -> bool {
    !a.grants.is_empty() || !a.released.is_empty() || !a.renewed.is_empty()
}

fn outcome(lease_id: u64, r: Result<(), ApplyError>) -> pb::AgentMessage {
    let (ok, reason, message) = match r {
        Ok(()) => (true, String::new(), String::new()),
        Err(e) => (false, e.reason.to_string(), e.message),
    };
    pb::AgentMessage {
        body: Some(Body::Applied(pb::ApplyOutcome {
            lease_id,
            ok,
            reason,
            message,
        })),
    }
}

fn gone(id: u64, t: &Target) -> pb::AgentMessage {
    tracing::info!(lease = id, target = ?t, "lease target gone");
    outcome(
        id,
        Err(ApplyError {
            reason: "gone",
            message: format!("{t:?} no longer exists"),
        }),
    )
}

/// The leases of this node, as the server sent them, and the targets the
/// agent watches. It lives as long as the agent's stream (across
/// reconnects: a lease outlives a connection) and, with a state file, the
/// agent itself ([`checkpoint`]).
#[derive(Debug)]
pub struct Applier {
    leases: BTreeMap<u64, HeldLease>,
    /// Leases reported gone this run: the same grant again (a re-push that
    /// crossed the report) is answered gone, not applied to whatever
    /// process has the pid now.
    gone: BTreeSet<u64>,
    roots: Roots,
    may_apply: bool,
    refusal: Option<String>,
    state_file: Option<PathBuf>,
    node_id: String,
    /// The count last added to the `leases_held` gauge (several streams
    /// of one process add theirs).
    published: usize,
}

impl Applier {
    /// The applier of `node_id`, with the leases of its checkpoint.
    pub fn new(node_id: &str, settings: &LeaseSettings) -> Applier {
        let leases = settings
            .state_file
            .as_deref()
            .map(|p| checkpoint::load(p, node_id, checkpoint::now_unix_ms()))
            .unwrap_or_default();
        let mut a = Applier {
            leases: leases.into_iter().map(|l| (l.id, l)).collect(),
            gone: BTreeSet::new(),
            roots: settings.roots.clone(),
            may_apply: settings.may_apply,
            refusal: settings.refusal.clone(),
            state_file: settings.state_file.clone(),
            node_id: node_id.to_string(),
            published: 0,
        };
        a.publish();
        a
    }

    /// An applier without a state file that applies under `roots`.
    pub fn in_memory(node_id: &str, roots: Roots) -> Applier {
        Applier::new(
            node_id,
            &LeaseSettings {
                state_file: None,
                roots,
                may_apply: true,
                refusal: None,
            },
        )
    }

    /// The held leases as the registration reports them.
    pub fn held_grants(&self) -> Vec<pb::LeaseGrant> {
        self.leases.values().map(HeldLease::to_grant).collect()
    }

    pub fn get(&self, lease_id: u64) -> Option<&HeldLease> {
        self.leases.get(&lease_id)
    }

    /// Forgets the push's releases, takes its renewals, records its
    /// grants and applies those with a target; returns the outcomes to
    /// send (one per grant with a target). Saves the checkpoint once.
    pub fn on_push(&mut self, a: &pb::Ack) -> Vec<pb::AgentMessage> {
        let mut changed = false;
        for id in &a.released {
            if let Some(h) = self.leases.remove(id) {
                self.undo(&h);
                changed = true;
            }
            self.gone.remove(id);
        }
        for r in &a.renewed {
            if let Some(l) = self.leases.get_mut(&r.lease_id) {
                l.ttl_ms = r.ttl_ms;
                l.expires_at_unix_ms = r.expires_at_unix_ms;
                changed = true;
            }
        }
        let mut out = Vec::new();
        for g in &a.grants {
            out.extend(self.on_grant(g));
            changed = true;
        }
        if changed {
            self.save();
        }
        out
    }

    /// One grant: recorded; applied and answered when it names a target.
    /// A grant that fails to apply is not kept (the server releases it).
    fn on_grant(&mut self, g: &pb::LeaseGrant) -> Option<pb::AgentMessage> {
        let Some(pt) = &g.target else {
            self.leases
                .insert(g.lease_id, HeldLease::from_grant(g, None));
            return None;
        };
        if !self.may_apply {
            self.leases.remove(&g.lease_id);
            return Some(outcome(
                g.lease_id,
                Err(ApplyError {
                    reason: "permission_denied",
                    message: self
                        .refusal
                        .clone()
                        .unwrap_or_else(|| super::APPLY_NEEDS_TRUST.into()),
                }),
            ));
        }
        let Some(t) = Target::from_pb(pt) else {
            self.leases.remove(&g.lease_id);
            return Some(outcome(
                g.lease_id,
                Err(ApplyError {
                    reason: "invalid",
                    message: "target: names neither a pid nor a cgroup".into(),
                }),
            ));
        };
        // The same lease again (the re-push after a registration) whose
        // process ended meanwhile, maybe while the agent was down: its pid
        // may be another process's now.
        let was_gone = self.gone.contains(&g.lease_id)
            || self.leases.get(&g.lease_id).is_some_and(|h| {
                h.applied && h.target.as_ref() == Some(&t) && !alive(self.roots.fs(), h)
            });
        if was_gone {
            self.leases.remove(&g.lease_id);
            self.gone.insert(g.lease_id);
            return Some(gone(g.lease_id, &t));
        }
        // What the lease replaces, to put back when it ends: read before
        // the first application only (a re-application keeps the first).
        let before = match self.leases.get(&g.lease_id) {
            Some(h) if h.applied => h.before.clone(),
            _ => current_cpus(self.roots.fs(), &t),
        };
        let r = apply(&self.roots, &t, &g.cpus);
        match &r {
            Ok(()) => {
                tracing::info!(lease = g.lease_id, cpus = %g.cpus, target = ?t, "lease applied");
                metrics::counter!("fairplace_agent_leases_applied_total", "outcome" => "ok")
                    .increment(1);
                let mut held = HeldLease::from_grant(g, Some(t.clone()));
                held.applied = true;
                held.before = before;
                if let Target::Pid(p) = t {
                    held.pid_start = process_start(p);
                }
                self.leases.insert(g.lease_id, held);
            }
            Err(e) => {
                tracing::warn!(lease = g.lease_id, cpus = %g.cpus, target = ?t, reason = e.reason, message = %e.message, "lease not applied");
                metrics::counter!("fairplace_agent_leases_applied_total", "outcome" => e.reason)
                    .increment(1);
                self.leases.remove(&g.lease_id);
            }
        }
        Some(outcome(g.lease_id, r))
    }

    /// A lease ended (released or expired): its target gets back the CPUs
    /// it had before (a cgroup whose earlier CPUs are unknown, its
    /// parent's), so the next lease of these CPUs has them alone. Not when
    /// another lease still holds the same target, nor when the target is no
    /// longer the one applied to (gone, or a reused pid), nor outside the
    /// roots.
    fn undo(&self, h: &HeldLease) {
        let Some(t) = h.target.as_ref().filter(|_| h.applied) else {
            return;
        };
        if !alive(self.roots.fs(), h)
            || self
                .leases
                .values()
                .any(|o| o.applied && o.target.as_ref() == Some(t))
        {
            return;
        }
        let back = h.before.clone().or_else(|| parent_cpus(self.roots.fs(), t));
        let Some(back) = back else {
            return;
        };
        match apply(&self.roots, t, &back) {
            Ok(()) => {
                tracing::info!(lease = h.id, target = ?t, cpus = %back, "lease ended: CPUs put back")
            }
            Err(e) => {
                tracing::warn!(lease = h.id, target = ?t, cpus = %back, reason = e.reason, message = %e.message, "lease ended: its CPUs could not be put back")
            }
        }
    }

    /// Applied leases whose target disappeared: each is reported `gone`
    /// (the server releases its lease) and forgotten.
    pub fn check_targets(&mut self) -> Vec<pb::AgentMessage> {
        let ended: Vec<(u64, Target)> = self
            .leases
            .values()
            .filter(|h| h.applied && !alive(self.roots.fs(), h))
            .filter_map(|h| Some((h.id, h.target.clone()?)))
            .collect();
        if ended.is_empty() {
            return Vec::new();
        }
        let out = ended
            .iter()
            .map(|(id, t)| {
                self.leases.remove(id);
                self.gone.insert(*id);
                gone(*id, t)
            })
            .collect();
        self.save();
        out
    }

    /// Writes the checkpoint (when there is a state file); a failure is
    /// logged and counted: the leases stay held in memory.
    fn save(&mut self) {
        self.publish();
        let Some(path) = &self.state_file else {
            return;
        };
        if let Err(e) = checkpoint::save(path, &self.node_id, self.leases.values()) {
            tracing::warn!(node = %self.node_id, file = %path.display(), error = %e, "cannot write the lease checkpoint");
            metrics::counter!("fairplace_agent_checkpoint_errors_total").increment(1);
        }
    }

    fn publish(&mut self) {
        let n = self.leases.len();
        metrics::gauge!("fairplace_agent_leases_held").increment(n as f64 - self.published as f64);
        self.published = n;
    }

    pub fn len(&self) -> usize {
        self.leases.len()
    }

    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }
}

/// Whether a held lease's target is still there: its cgroup, or the very
/// process it was applied to (same pid and start time), on this boot.
fn alive(fs: &CgroupFs, h: &HeldLease) -> bool {
    match &h.target {
        None => true,
        Some(_) if h.stale => false,
        Some(Target::Pid(p)) => match h.pid_start {
            Some(start) => process_start(*p) == Some(start),
            None => Target::Pid(*p).exists(fs),
        },
        Some(t) => t.exists(fs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::testing::{Sleeper, allowed, own_roots};

    fn grant(id: u64, target: Option<pb::apply_target::Target>) -> pb::LeaseGrant {
        pb::LeaseGrant {
            lease_id: id,
            cpus: "0".into(),
            target: target.map(|t| pb::ApplyTarget { target: Some(t) }),
            policy: "spread".into(),
            holder: "test".into(),
            owner: "anonymous".into(),
            ttl_ms: 30_000,
            expires_at_unix_ms: checkpoint::now_unix_ms() + 30_000,
            granted_at_unix_ms: checkpoint::now_unix_ms(),
        }
    }

    fn outcomes(out: &[pb::AgentMessage]) -> Vec<(u64, bool, String)> {
        out.iter()
            .map(|m| match &m.body {
                Some(Body::Applied(o)) => (o.lease_id, o.ok, o.reason.clone()),
                _ => panic!("{m:?}"),
            })
            .collect()
    }

    #[test]
    fn the_applier_answers_each_targeted_grant_records_the_others_and_reports_a_target_gone() {
        let mut child = Sleeper::start();
        let pid = child.pid();
        let mut a = Applier::in_memory("n", own_roots());
        let push = pb::Ack {
            grants: vec![
                grant(7, Some(pb::apply_target::Target::Pid(pid))),
                grant(8, None),
                grant(9, Some(pb::apply_target::Target::Pid(u32::MAX - 1))),
            ],
            ..Default::default()
        };
        assert!(is_push(&push));
        let out = a.on_push(&push);
        // No outcome for the targetless grant; the failed one is not kept.
        assert_eq!(
            outcomes(&out),
            vec![(7, true, String::new()), (9, false, "not_found".into())]
        );
        assert_eq!((a.len(), a.get(8).map(|l| l.applied)), (2, Some(false)));
        assert!(a.check_targets().is_empty());
        child.stop();
        let gone = a.check_targets();
        assert_eq!(outcomes(&gone), vec![(7, false, "gone".into())]);
        assert_eq!(a.len(), 1, "the targetless lease stays");
        // The same grant again (a re-push crossing the report) is gone too.
        let again = a.on_push(&pb::Ack {
            grants: vec![grant(7, Some(pb::apply_target::Target::Pid(pid)))],
            ..Default::default()
        });
        assert_eq!(outcomes(&again), vec![(7, false, "gone".into())]);
    }

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("fairplace-applier-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn an_agent_that_may_not_apply_refuses_a_target_and_touches_nothing() {
        let child = Sleeper::start();
        let pid = child.pid();
        let before = allowed(pid);
        let settings = LeaseSettings {
            state_file: None,
            roots: own_roots(),
            may_apply: false,
            refusal: None,
        };
        let mut a = Applier::new("n", &settings);
        let out = a.on_push(&pb::Ack {
            grants: vec![grant(9, Some(pb::apply_target::Target::Pid(pid)))],
            ..Default::default()
        });
        let [msg] = out.as_slice() else {
            panic!("one outcome: {out:?}")
        };
        let Some(Body::Applied(o)) = &msg.body else {
            panic!("{msg:?}")
        };
        assert!(!o.ok);
        assert_eq!(o.reason, "permission_denied");
        assert!(o.message.contains("--insecure-apply"), "{}", o.message);
        assert_eq!(allowed(pid), before, "the process was not pinned");
        assert!(a.get(9).is_none(), "a refused lease is not kept");
    }

    #[test]
    fn releases_and_renewals_reach_the_checkpoint_and_a_new_agent_reloads_it() {
        let dir = scratch("ckpt");
        let settings = LeaseSettings {
            state_file: Some(checkpoint::state_file(&dir, "n")),
            roots: own_roots(),
            may_apply: true,
            refusal: None,
        };
        let mut a = Applier::new("n", &settings);
        assert!(a.is_empty());
        a.on_push(&pb::Ack {
            grants: vec![grant(1, None), grant(2, None)],
            ..Default::default()
        });
        let later = checkpoint::now_unix_ms() + 90_000;
        let out = a.on_push(&pb::Ack {
            released: vec![2],
            renewed: vec![pb::LeaseRenewal {
                lease_id: 1,
                ttl_ms: 90_000,
                expires_at_unix_ms: later,
            }],
            ..Default::default()
        });
        assert!(out.is_empty());
        // A restarted agent: the checkpoint holds lease 1, renewed.
        let b = Applier::new("n", &settings);
        let held = b.held_grants();
        assert_eq!(held.len(), 1);
        assert_eq!(
            (held[0].lease_id, held[0].ttl_ms, held[0].expires_at_unix_ms),
            (1, 90_000, later)
        );
        assert_eq!(held[0].owner, "anonymous");
        assert!(held[0].target.is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_checkpointed_pid_now_another_process_is_gone_not_applied() {
        let dir = scratch("reuse");
        let child = Sleeper::start();
        let pid = child.pid();
        let before = allowed(pid);
        // As if the lease's process had ended while the agent was down and
        // the pid been given to this sleep: another start time.
        let mut held = HeldLease::from_grant(&grant(5, None), Some(Target::Pid(pid)));
        held.applied = true;
        held.pid_start = process_start(pid).map(|s| s + 1);
        let file = checkpoint::state_file(&dir, "n");
        checkpoint::save(&file, "n", [&held].into_iter()).unwrap();
        let settings = LeaseSettings {
            state_file: Some(file),
            roots: own_roots(),
            may_apply: true,
            refusal: None,
        };
        let mut a = Applier::new("n", &settings);
        assert_eq!(a.held_grants().len(), 1, "reported at registration");
        let out = a.on_push(&pb::Ack {
            grants: vec![grant(5, Some(pb::apply_target::Target::Pid(pid)))],
            ..Default::default()
        });
        assert_eq!(outcomes(&out), vec![(5, false, "gone".into())]);
        assert_eq!(allowed(pid), before);
        assert!(a.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_ended_lease_puts_the_cpus_back_and_cpus_this_machine_lacks_pin_nothing() {
        let child = Sleeper::start();
        let pid = child.pid();
        let before = allowed(pid);
        let mut a = Applier::in_memory("n", own_roots());
        // CPU 4095 is on no machine this runs on: refused whole, not a pin
        // to the CPUs that exist.
        let mut g = grant(31, Some(pb::apply_target::Target::Pid(pid)));
        g.cpus = "0,4095".into();
        let out = a.on_push(&pb::Ack {
            grants: vec![g],
            ..Default::default()
        });
        assert_eq!(outcomes(&out), vec![(31, false, "invalid".to_string())]);
        assert_eq!(allowed(pid), before);
        // A lease on CPU 0, then its end: the affinity it replaced is back.
        let out = a.on_push(&pb::Ack {
            grants: vec![grant(32, Some(pb::apply_target::Target::Pid(pid)))],
            ..Default::default()
        });
        assert_eq!(outcomes(&out), vec![(32, true, String::new())]);
        assert_eq!(allowed(pid), "0");
        a.on_push(&pb::Ack {
            released: vec![32],
            ..Default::default()
        });
        assert_eq!(allowed(pid), before, "released: the CPUs it had before");
    }
}
