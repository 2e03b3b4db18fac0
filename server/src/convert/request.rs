//! Placement and migration requests: the task and the request become the
//! engine's, the decision becomes the answer.

use fairplace_proto::codec::PREFIX;
use fairplace_proto::v1 as pb;
use prost::encoding as wire;
use tonic::Status;

use crate::engine::balance::migrate::{IdleType, MigrateDecision, MigrateEnv, MigrationType, lbf};
use crate::engine::decision::{Kind, PlaceRequest, Placement};
use crate::engine::resolve;
use crate::engine::state::Task;
use crate::engine::topology::{FieldError, Topology};
use crate::store::Snapshot;

use super::fields::{cpu_in, cpulist, err, signal};

/// A task for a placement or a migration check; `task_cpu` stands in for
/// prev_cpu where the request fixes it.
pub fn task(
    t: Option<&pb::Task>,
    topo: &Topology,
    wakeup: bool,
    task_cpu: usize,
) -> Result<Task, FieldError> {
    let mut task = Task::new(topo.nr_cpus, task_cpu);
    task_into(t, topo, wakeup, task_cpu, &mut task)?;
    Ok(task)
}

/// [`task`], written into `task` in place: a task carries a 512-byte CPU
/// mask, and a placement builds one per request, so neither the task nor
/// its mask is built apart and moved in. Every field is written (the
/// destructuring below names them all, so a new field cannot be missed).
pub fn task_into(
    t: Option<&pb::Task>,
    topo: &Topology,
    wakeup: bool,
    task_cpu: usize,
    task: &mut Task,
) -> Result<(), FieldError> {
    let default = pb::Task::default();
    let t = t.unwrap_or(&default);
    let cpus = resolve::TaskCpus {
        prev_cpu: t
            .prev_cpu
            .map(|p| cpu_in(topo, p, "task.prev_cpu"))
            .transpose()?,
        recent_used_cpu: match (t.no_recent_used_cpu, t.recent_used_cpu) {
            (true, _) => resolve::Recent::NoCpu,
            (false, None) => resolve::Recent::Unset,
            (false, Some(r)) => resolve::Recent::Cpu(cpu_in(topo, r, "task.recent_used_cpu")?),
        },
    };
    let Task {
        policy,
        cpus_allowed,
        prev_cpu: _,        // resolve::task
        recent_used_cpu: _, // resolve::task
        util_avg,
        util_est,
        runnable_avg,
        load_avg,
        uclamp_min,
        uclamp_max,
        wakee_flips,
        migration_disabled,
        core_cookie,
        numa_preferred_nid,
        per_cpu_kthread,
        running,
        sched_delayed,
        eligible,
        next_buddy,
        blocked,
        exec_start,
        hot,
    } = task;
    *policy = super::fields::policy(t.policy, "task.policy")?;
    // Most tasks may run anywhere: their mask is filled in place, and a
    // given list is parsed only when there is one.
    if t.cpus_allowed.trim().is_empty() {
        cpus_allowed.assign_first_n(topo.nr_cpus);
    } else if let Some(m) = cpulist(&t.cpus_allowed, topo, "task.cpus_allowed")? {
        *cpus_allowed = m;
    }
    *util_avg = t.util_avg;
    *util_est = t.util_est;
    *runnable_avg = t.runnable_avg;
    *load_avg = t.load_avg;
    *wakee_flips = t.wakee_flips;
    *uclamp_min = t.uclamp_min;
    *uclamp_max = t.uclamp_max.unwrap_or(1024);
    *migration_disabled = t.migration_disabled;
    *core_cookie = t.core_cookie;
    *numa_preferred_nid = t.numa_preferred_nid.unwrap_or(-1);
    *per_cpu_kthread = t.per_cpu_kthread;
    *running = t.running;
    *sched_delayed = t.sched_delayed;
    *eligible = t.eligible.unwrap_or(true);
    *next_buddy = t.next_buddy;
    *blocked = t.blocked;
    *exec_start = t.exec_start;
    *hot = t.hot;
    resolve::task(task, cpus, wakeup, task_cpu)
}

/// A PickCpu request against a snapshot; its task is written into `task`
/// (see [`task_into`]).
pub fn pick_request(
    r: &pb::PickCpuRequest,
    snap: &Snapshot,
    task: &mut Task,
) -> Result<PlaceRequest, FieldError> {
    let topo = &snap.topo;
    let kind = match pb::RequestKind::try_from(r.kind) {
        Ok(pb::RequestKind::Wakeup) => Kind::Wakeup,
        Ok(pb::RequestKind::Fork) => Kind::Fork,
        Ok(pb::RequestKind::Exec) => Kind::Exec,
        Err(_) => return Err(err("kind", format!("{} is not a request kind", r.kind))),
    };
    let this_cpu = cpu_in(topo, r.this_cpu, "this_cpu")?;
    let this_cpu = resolve::this_cpu(kind, this_cpu, "this_cpu", topo, &snap.state)?;
    let mut req = PlaceRequest::new(kind, this_cpu);
    let w = r.waker.unwrap_or_default();
    req.sync = r.sync;
    req.wf_current_cpu = r.current_cpu;
    req.in_task = r.in_task.unwrap_or(true);
    req.waker_exiting = w.exiting;
    req.waker_wakee_flips = signal(w.wakee_flips, "waker.wakee_flips")?;
    req.waker_last_wakee_is_task = w.last_wakee_is_task.unwrap_or(true);
    req.waker_flip_decay_expired = w.flip_decay_expired;
    req.waker_load = signal(w.load, "waker.load")?;
    req.waker_is_per_cpu_kthread = w
        .is_per_cpu_kthread
        .unwrap_or(snap.state.cpus[this_cpu].curr_is_per_cpu_kthread);
    task_into(r.task.as_ref(), topo, kind == Kind::Wakeup, this_cpu, task)?;
    Ok(req)
}

/// A placement's answer on a named node, before it becomes a
/// `PickCpuResponse`: the path and the wake-affine reason stay the engine's
/// static names, and the node id stays the request's. The fast unary path (`transport::fast_unary`)
/// encodes it straight into the answer's frame ([`PickAnswer::framed`]), so
/// a decision allocates no strings and builds no response message; every
/// other path turns it into the message ([`PickAnswer::into_response`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PickAnswer {
    pub cpu: u32,
    pub path: &'static str,
    pub scanned: u32,
    pub state_version: u64,
    pub state_age_seconds: f64,
    pub affine: &'static str,
    pub nr_idle_scan: Option<u32>,
}

pub fn pick_response(p: &Placement, snap: &Snapshot, age_seconds: f64) -> PickAnswer {
    PickAnswer {
        cpu: p.cpu as u32,
        path: p.path.as_str(),
        scanned: p.scanned,
        state_version: snap.version,
        state_age_seconds: age_seconds,
        affine: p.detail.affine.map_or("", |a| a.as_str()),
        nr_idle_scan: p.detail.nr_idle_scan,
    }
}

impl PickAnswer {
    /// The answer as the message, on node `node_id`.
    pub fn into_response(self, node_id: String) -> pb::PickCpuResponse {
        pb::PickCpuResponse {
            cpu: self.cpu,
            path: self.path.to_string(),
            scanned: self.scanned,
            state_version: self.state_version,
            state_age_seconds: self.state_age_seconds,
            affine: self.affine.to_string(),
            nr_idle_scan: self.nr_idle_scan,
            node_id,
            cluster_level: String::new(),
            groups_compared: 0,
        }
    }

    /// The bytes of [`Self::into_response`]`(node_id)` in gRPC's framing,
    /// written as prost writes them: fields in number order, a proto3
    /// scalar or string only when not its default, an `optional` one
    /// whenever set.
    pub fn framed(&self, node_id: &str) -> bytes::Bytes {
        use bytes::BufMut;
        let len = self.encoded_len(node_id);
        let mut out = bytes::BytesMut::with_capacity(PREFIX + len);
        out.put_u8(0);
        out.put_u32(len as u32);
        self.encode_raw(node_id, &mut out);
        out.freeze()
    }

    fn encoded_len(&self, node_id: &str) -> usize {
        let varint = |tag: u32, v: u64| wire::key_len(tag) + wire::encoded_len_varint(v);
        let string = |tag: u32, s: &str| varint(tag, s.len() as u64) + s.len();
        let mut n = 0;
        n += if self.cpu != 0 {
            varint(1, self.cpu.into())
        } else {
            0
        };
        n += if !self.path.is_empty() {
            string(2, self.path)
        } else {
            0
        };
        n += if self.scanned != 0 {
            varint(3, self.scanned.into())
        } else {
            0
        };
        n += if self.state_version != 0 {
            varint(4, self.state_version)
        } else {
            0
        };
        n += if self.state_age_seconds != 0.0 {
            wire::key_len(5) + 8
        } else {
            0
        };
        n += if !self.affine.is_empty() {
            string(6, self.affine)
        } else {
            0
        };
        n += self.nr_idle_scan.map_or(0, |v| varint(7, v.into()));
        n += if !node_id.is_empty() {
            string(8, node_id)
        } else {
            0
        };
        n
    }

    fn encode_raw(&self, node_id: &str, buf: &mut bytes::BytesMut) {
        use bytes::BufMut;
        use wire::WireType::{LengthDelimited, SixtyFourBit, Varint};
        let varint = |tag: u32, v: u64, buf: &mut bytes::BytesMut| {
            wire::encode_key(tag, Varint, buf);
            wire::encode_varint(v, buf);
        };
        let string = |tag: u32, s: &str, buf: &mut bytes::BytesMut| {
            wire::encode_key(tag, LengthDelimited, buf);
            wire::encode_varint(s.len() as u64, buf);
            buf.put_slice(s.as_bytes());
        };
        if self.cpu != 0 {
            varint(1, self.cpu.into(), buf);
        }
        if !self.path.is_empty() {
            string(2, self.path, buf);
        }
        if self.scanned != 0 {
            varint(3, self.scanned.into(), buf);
        }
        if self.state_version != 0 {
            varint(4, self.state_version, buf);
        }
        if self.state_age_seconds != 0.0 {
            wire::encode_key(5, SixtyFourBit, buf);
            buf.put_f64_le(self.state_age_seconds);
        }
        if !self.affine.is_empty() {
            string(6, self.affine, buf);
        }
        if let Some(v) = self.nr_idle_scan {
            varint(7, v.into(), buf);
        }
        if !node_id.is_empty() {
            string(8, node_id, buf);
        }
    }
}

pub fn migrate_request(
    r: &pb::CanMigrateRequest,
    snap: &Snapshot,
) -> Result<(Task, MigrateEnv), FieldError> {
    let topo = &snap.topo;
    let src = cpu_in(topo, r.src_cpu, "src_cpu")?;
    let dst = cpu_in(topo, r.dst_cpu, "dst_cpu")?;
    let given = !r.flags.is_empty() || r.flags_given;
    let fields = resolve::MigrateFields {
        src_cpu: src,
        dst_cpu: dst,
        sd_level: (!r.sd_level.is_empty()).then_some(r.sd_level.as_str()),
        flags: given.then(|| r.flags.iter().map(String::as_str).collect()),
        dst_group: cpulist(&r.dst_group, topo, "dst_group")?,
        env_cpus: cpulist(&r.env_cpus, topo, "env_cpus")?,
        idle: match pb::IdleType::try_from(r.idle) {
            Ok(pb::IdleType::Idle) => IdleType::Idle,
            Ok(pb::IdleType::NotIdle) => IdleType::NotIdle,
            Ok(pb::IdleType::NewlyIdle) => IdleType::NewlyIdle,
            Err(_) => return Err(err("idle", format!("{} is not an idle type", r.idle))),
        },
        migration_type: match pb::MigrationType::try_from(r.migration_type) {
            Ok(pb::MigrationType::Load) => MigrationType::Load,
            Ok(pb::MigrationType::Util) => MigrationType::Util,
            Ok(pb::MigrationType::Task) => MigrationType::Task,
            Ok(pb::MigrationType::Misfit) => MigrationType::Misfit,
            Ok(pb::MigrationType::LlcTask) => MigrationType::LlcTask,
            Err(_) => {
                return Err(err(
                    "migration_type",
                    format!("{} is not a migration type", r.migration_type),
                ));
            }
        },
        nr_balance_failed: r.nr_balance_failed,
        cache_nice_tries: r.cache_nice_tries,
        throttled: r.throttled,
        dst_cfs_nr_queued: r.dst_cfs_nr_queued.map(i64::from),
        now: r.now,
    };
    let env = resolve::migrate_env(fields, str::to_string, topo, &snap.state)?;
    let task = task(r.task.as_ref(), topo, false, src)?;
    Ok((task, env))
}

pub fn migrate_response(m: &MigrateDecision, snap: &Snapshot) -> pb::CanMigrateResponse {
    pb::CanMigrateResponse {
        allowed: m.allowed,
        new_dst_cpu: m.new_dst_cpu.map(|c| c as u32),
        flags: lbf::NAMES
            .iter()
            .filter(|(f, _)| m.flags & f != 0)
            .map(|(_, n)| n.to_string())
            .collect(),
        reason: m.reason.as_str().to_string(),
        task_hot: m.task_hot,
        state_version: snap.version,
    }
}

/// A cluster pick's selector: only the hierarchy's own labels select
/// (INVALID_ARGUMENT naming the first other `selector.KEY` otherwise), in
/// key order.
pub fn selector(
    given: &std::collections::BTreeMap<String, String>,
    cluster: &crate::store::hierarchy::ClusterConfig,
) -> Result<Vec<(String, String)>, tonic::Status> {
    let levels: Vec<&str> = cluster.levels.iter().map(|l| l.label.as_str()).collect();
    let mut out = Vec::with_capacity(given.len());
    for (k, v) in given {
        if !levels.contains(&k.as_str()) {
            return Err(tonic::Status::invalid_argument(format!(
                "selector.{}: only the hierarchy's labels ({}) can select",
                crate::quote::field_key(k),
                levels.join(", ")
            )));
        }
        out.push((k.clone(), v.clone()));
    }
    Ok(out)
}

/// A PickCpu's answer: decided at once, or a boxed wait for it (a forward
/// to the node's owner, the cluster path). The placement handler gives it;
/// the tonic route and the fast path (`transport::fast_unary`) each turn it
/// into their answer.
pub enum Picked<'a> {
    /// Decided here, on the request's named node.
    Now(PickAnswer),
    Later(std::pin::Pin<Box<dyn Future<Output = Result<pb::PickCpuResponse, Status>> + Send + 'a>>),
}

impl Picked<'_> {
    /// The answer as the message; `node_id`, the request's, names the
    /// node of an answer decided here.
    pub async fn into_response(self, node_id: String) -> Result<pb::PickCpuResponse, Status> {
        match self {
            Picked::Now(answer) => Ok(answer.into_response(node_id)),
            Picked::Later(wait) => wait.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::decision::{Affine, Path};
    use fairplace_proto::codec::frame;
    use proptest::prelude::*;

    fn answers() -> impl Strategy<Value = (PickAnswer, String)> {
        (
            (
                prop_oneof![Just(0u32), any::<u32>()],
                prop::sample::select(Path::ALL.to_vec()),
                prop_oneof![Just(0u32), 0u32..300, any::<u32>()],
                prop_oneof![Just(0u64), any::<u64>()],
            ),
            (
                prop_oneof![Just(0.0f64), Just(-0.0), any::<f64>()],
                prop::option::of(prop::sample::select(Affine::ALL.to_vec())),
                prop::option::of(prop_oneof![Just(0u32), any::<u32>()]),
                prop_oneof![Just(String::new()), "\\PC{0,40}"],
            ),
        )
            .prop_map(|((cpu, path, scanned, version), (age, affine, nr, node))| {
                let answer = PickAnswer {
                    cpu,
                    path: path.as_str(),
                    scanned,
                    state_version: version,
                    state_age_seconds: age,
                    affine: affine.map_or("", |a| a.as_str()),
                    nr_idle_scan: nr,
                };
                (answer, node)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, .. ProptestConfig::default() })]

        /// The fast path's frame is byte for byte prost's frame of the
        /// message the other paths answer with.
        #[test]
        fn a_framed_answer_is_the_framed_response_message((a, node) in answers()) {
            let expected = frame(&a.into_response(node.clone()));
            prop_assert_eq!(a.framed(&node), expected);
        }
    }

    #[test]
    fn an_answer_of_defaults_is_an_empty_message_and_an_optional_zero_is_sent() {
        let mut a = PickAnswer {
            cpu: 0,
            path: "",
            scanned: 0,
            state_version: 0,
            state_age_seconds: -0.0,
            affine: "",
            nr_idle_scan: None,
        };
        assert_eq!(&a.framed("")[..], &[0, 0, 0, 0, 0]);
        a.nr_idle_scan = Some(0);
        // Field 7, varint 0: an `optional` field set to its default is sent.
        assert_eq!(&a.framed("")[..], &[0, 0, 0, 0, 2, 7 << 3, 0]);
    }
}
