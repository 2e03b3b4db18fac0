//! One task's lease: asked for in the task's own process, after Slurm's
//! binding and before the task executes, and the task bound to it.
//!
//! The request restricts the lease to the CPUs Slurm allocated to the step
//! on this node (its cores, not the narrower binding Slurm chose for the
//! task), names the task as its holder and carries a request id made from
//! the job, step and task, so a retried call finds the first grant. Every
//! failure leaves the task on Slurm's own binding, with one log line.

use fairplace_client::pb;
use fairplace_host::apply;
use fairplace_host::sysfs::{self, Topology};
use fairplace_types::cpumask::CpuMask;

use crate::config::Policy;

/// Slurm's names for the step ids that are not numbers (slurm.h).
pub const SLURM_BATCH_SCRIPT: u32 = 0xffff_fffb;
pub const SLURM_EXTERN_CONT: u32 = 0xffff_fffc;
const SLURM_INTERACTIVE_STEP: u32 = 0xffff_fffa;

/// A task of a step, as its lease names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskRef {
    pub job: u32,
    pub step: u32,
    /// The local task id on this node.
    pub task: u32,
    /// The slurmstepd running the step: two steps that share a job and
    /// step id (a controller that began again from empty state) never
    /// share a request id.
    pub stepd: u32,
}

impl TaskRef {
    /// The step as Slurm prints it: `12.0`, `12.batch`.
    pub fn step_name(&self) -> String {
        let step = match self.step {
            SLURM_BATCH_SCRIPT => "batch".to_string(),
            SLURM_EXTERN_CONT => "extern".to_string(),
            SLURM_INTERACTIVE_STEP => "interactive".to_string(),
            n => n.to_string(),
        };
        format!("{}.{step}", self.job)
    }

    /// The lease's holder, as GetNode shows it.
    pub fn holder(&self) -> String {
        format!("slurm {} task {}", self.step_name(), self.task)
    }

    /// The idempotency key: one per task of one slurmstepd.
    pub fn request_id(&self) -> String {
        format!(
            "slurm-{}-task-{}-stepd-{}",
            self.step_name(),
            self.task,
            self.stepd
        )
    }
}

/// What a task's lease is asked for with.
#[derive(Debug, Clone)]
pub struct Ask {
    pub task: TaskRef,
    pub node: String,
    pub policy: Policy,
    /// CPUs per task (at least 1).
    pub count: u32,
    /// The step's CPUs on this node, as a cpulist.
    pub allowed: String,
    pub ttl_ms: u32,
}

impl Ask {
    /// The AllocateCpus request; the same for the task and for slurmstepd
    /// settling an unknown outcome.
    pub fn request(&self) -> pb::AllocateCpusRequest {
        pb::AllocateCpusRequest {
            node_id: self.node.clone(),
            count: self.count.max(1),
            policy: self.policy.server_name().unwrap_or("kernel").to_string(),
            holder: self.task.holder(),
            ttl_ms: self.ttl_ms,
            task: Some(pb::Task {
                cpus_allowed: self.allowed.clone(),
                ..Default::default()
            }),
            apply: None,
            request_id: self.task.request_id(),
        }
    }
}

/// Why a task keeps Slurm's binding.
#[derive(Debug)]
pub struct Failure {
    pub why: String,
    /// Whether a lease may exist anyway (the call timed out or the server
    /// was unavailable after it may have committed).
    pub unknown: bool,
}

/// Binds task process `pid` (forked, not yet executing) to `cpus`, which
/// must lie in `allowed`.
pub fn bind(pid: i32, cpus: &str, allowed: &str) -> Result<(), String> {
    let want = apply::parse_cpulist(cpus).map_err(|e| e.message)?;
    let may = apply::parse_cpulist(allowed).map_err(|e| e.message)?;
    if want.is_empty() || want.iter().any(|c| !may.contains(c)) {
        return Err(format!(
            "CPUs {cpus} are not within the step's CPUs {allowed}"
        ));
    }
    let pid = u32::try_from(pid).map_err(|_| format!("no task pid ({pid})"))?;
    apply::set_process_affinity(pid, &want).map_err(|e| e.message)?;
    Ok(())
}

/// The OS CPUs of Slurm's core indices (`S_STEP_ALLOC_CORES`, "0-2,7").
///
/// Slurm numbers a node's cores socket-major and each core's threads
/// after it (its `block_map`, from hwloc's order): core `k` is the `k`-th
/// core of the machine in that order, and stands for all its threads. On
/// the machines Slurm runs on, the kernel numbers the first thread of
/// each core socket-major too, so the `k`-th core is the `k`-th distinct
/// lowest-sibling id.
pub fn cpus_of_cores(cores: &str, topo: &Topology) -> Result<Vec<u32>, String> {
    let wanted = sysfs::parse_cpulist(cores).map_err(|e| format!("core list {cores:?}: {e}"))?;
    let mut firsts: Vec<u32> = topo
        .cpus
        .iter()
        .filter(|c| c.online)
        .map(|c| c.core)
        .collect();
    firsts.sort_unstable();
    firsts.dedup();
    let mut out = Vec::new();
    for k in wanted {
        let first = *firsts.get(k as usize).ok_or_else(|| {
            format!(
                "core {k} of {cores:?}: the machine has {} cores",
                firsts.len()
            )
        })?;
        out.extend(
            topo.cpus
                .iter()
                .filter(|c| c.online && c.core == first)
                .map(|c| c.id),
        );
    }
    out.sort_unstable();
    Ok(out)
}

/// Checks the core map against Slurm's own binding of task `pid` (made
/// before post_fork): a binding narrower than the machine must lie within
/// the job's CPUs as mapped, or the map is not Slurm's and no lease is
/// asked for on its word.
pub fn check_map(pid: i32, job_cpus: &str) -> Result<(), String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("reading task {pid}'s status: {e}"))?;
    let bound = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .map(str::trim)
        .ok_or_else(|| format!("task {pid} shows no Cpus_allowed_list"))?;
    let online = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap_or_default();
    consistent(bound, online.trim(), job_cpus)
}

/// Whether Slurm's binding `bound` agrees with `job_cpus`; a binding to
/// every `online` CPU (no task plugin) says nothing.
fn consistent(bound: &str, online: &str, job_cpus: &str) -> Result<(), String> {
    let parse = |s: &str| sysfs::parse_cpulist(s).map_err(|e| format!("cpulist {s:?}: {e}"));
    let (b, on, job) = (parse(bound)?, parse(online)?, parse(job_cpus)?);
    if on.iter().all(|c| b.contains(c)) || b.iter().all(|c| job.contains(c)) {
        return Ok(());
    }
    Err(format!(
        "Slurm bound the task to CPUs {bound}, outside the job's CPUs {job_cpus} as this plugin maps \
         Slurm's cores: the machine numbers its cores otherwise"
    ))
}

/// A cpulist ("0-3,8") of CPU ids.
pub fn cpulist(ids: &[u32]) -> String {
    CpuMask::from_cpus(ids.iter().map(|&c| c as usize)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(step: u32) -> TaskRef {
        TaskRef {
            job: 42,
            step,
            task: 3,
            stepd: 777,
        }
    }

    #[test]
    fn the_holder_names_job_step_and_task_as_slurm_prints_them() {
        assert_eq!(task(0).holder(), "slurm 42.0 task 3");
        assert_eq!(task(SLURM_BATCH_SCRIPT).holder(), "slurm 42.batch task 3");
        assert_eq!(task(SLURM_EXTERN_CONT).step_name(), "42.extern");
        assert_eq!(task(SLURM_INTERACTIVE_STEP).step_name(), "42.interactive");
    }

    #[test]
    fn request_ids_differ_by_task_and_by_slurmstepd() {
        let a = task(0);
        let b = TaskRef { task: 4, ..a };
        let c = TaskRef { stepd: 778, ..a };
        assert_ne!(a.request_id(), b.request_id());
        assert_ne!(a.request_id(), c.request_id());
        assert!(a.request_id().len() <= 128);
    }

    #[test]
    fn the_request_carries_the_steps_cpus_and_the_policy() {
        let ask = Ask {
            task: task(1),
            node: "n1".into(),
            policy: Policy::Cores,
            count: 0,
            allowed: "2-5".into(),
            ttl_ms: 9000,
        };
        let r = ask.request();
        assert_eq!(r.count, 1, "a task has at least one CPU");
        assert_eq!(r.policy, "cores");
        assert_eq!(r.task.unwrap().cpus_allowed, "2-5");
        assert_eq!(r.holder, "slurm 42.1 task 3");
        assert_eq!(r.ttl_ms, 9000);
    }

    #[test]
    fn a_lease_outside_the_steps_cpus_is_not_bound() {
        let me = std::process::id() as i32;
        let e = bind(me, "3", "0-1").unwrap_err();
        assert!(e.contains("not within"), "{e}");
        assert!(bind(me, "", "0-1").is_err());
    }

    fn topo(cpus: &[(u32, u32)]) -> Topology {
        Topology {
            cpus: cpus
                .iter()
                .map(|&(id, core)| sysfs::CpuTopo {
                    id,
                    online: true,
                    core,
                    cluster: None,
                    llc: 0,
                    node: 0,
                    capacity: 1024,
                })
                .collect(),
            numa_distance: None,
        }
    }

    #[test]
    fn a_slurm_core_is_every_thread_of_the_kth_core() {
        // 4 cores, SMT2, siblings numbered n and n+4 as x86 does.
        let t = topo(&[
            (0, 0),
            (1, 1),
            (2, 2),
            (3, 3),
            (4, 0),
            (5, 1),
            (6, 2),
            (7, 3),
        ]);
        assert_eq!(cpus_of_cores("0", &t).unwrap(), vec![0, 4]);
        assert_eq!(cpus_of_cores("1-2", &t).unwrap(), vec![1, 2, 5, 6]);
        assert_eq!(cpulist(&cpus_of_cores("0-3", &t).unwrap()), "0-7");
        let e = cpus_of_cores("4", &t).unwrap_err();
        assert!(e.contains("4 cores"), "{e}");
        // Without SMT a core is a CPU.
        let t = topo(&[(0, 0), (1, 1)]);
        assert_eq!(cpus_of_cores("1", &t).unwrap(), vec![1]);
    }

    #[test]
    fn slurms_binding_must_lie_in_the_mapped_cpus() {
        assert!(consistent("2", "0-3", "2-3").is_ok());
        assert!(
            consistent("0-3", "0-3", "2").is_ok(),
            "no task plugin: no word on the map"
        );
        let e = consistent("1", "0-3", "2-3").unwrap_err();
        assert!(e.contains("outside the job's CPUs 2-3"), "{e}");
    }

    #[test]
    fn cpulists_fold_runs() {
        assert_eq!(cpulist(&[]), "");
        assert_eq!(cpulist(&[3]), "3");
        assert_eq!(cpulist(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
    }
}
