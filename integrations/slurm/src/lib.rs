//! `libfairplace_spank.so`: a Slurm SPANK plugin that binds each task of a
//! step to CPUs fairplace leased for it, for as long as the task runs.
//!
//! Slurm loads the plugin into srun, sbatch, slurmd and slurmstepd (a
//! `plugstack.conf` line, docs/slurm.md). Only slurmstepd, which runs a
//! step's tasks on a node, does anything beyond reading its settings:
//!
//! | callback | where | what |
//! |---|---|---|
//! | `slurm_spank_init` | everywhere | the plugstack arguments checked ([`config`]); `--fairplace=POLICY` registered |
//! | option callback | srun/sbatch, then slurmstepd | the step's policy checked, then kept |
//! | `slurm_spank_task_post_fork` | slurmstepd, per task | AllocateCpus for the task within the step's CPUs, the task's pid bound to the answer ([`task`], [`step`]) |
//! | `slurm_spank_task_exit` | slurmstepd, per task | the task's lease released |
//! | `slurm_spank_exit` | slurmstepd | whatever is left released |
//!
//! Written in Rust, exporting the SPANK symbols itself, so it speaks to the
//! server through the same client library (TLS, deadlines, retries with a
//! request id) as every other fairplace client; a C plugin would need a
//! gRPC stack of its own. It does not link libslurm: the SPANK functions
//! are the host process's ([`ffi`]).
//!
//! Slurm never fails because of fairplace: every callback but init
//! returns success whatever happens (a panic included), and a task the
//! server cannot serve in time keeps Slurm's own binding, with one line in
//! slurmd's log saying why.

pub mod config;
pub mod ffi;
pub mod step;
pub mod task;

use std::ffi::{CStr, c_char, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use config::{Config, Policy};
use ffi::{Context, Level, Spank, SpankOption, item, log};
use step::Step;
use task::{Ask, TaskRef};

/// The symbols Slurm reads to know a SPANK plugin and the release it was
/// built for (spank.h's `SPANK_PLUGIN`).
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static plugin_name: [u8; 10] = *b"fairplace\0";
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static plugin_type: [u8; 6] = *b"spank\0";
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static plugin_version: u32 = decimal(env!("FAIRPLACE_SLURM_VERSION_NUMBER"));
#[allow(non_upper_case_globals)]
#[unsafe(no_mangle)]
pub static spank_plugin_version: u32 = 1;

const fn decimal(s: &str) -> u32 {
    let b = s.as_bytes();
    let mut v = 0u32;
    let mut i = 0;
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as u32;
        i += 1;
    }
    v
}

/// `--fairplace=POLICY`, for srun, sbatch and salloc.
static OPTION: SpankOption = SpankOption {
    name: c"fairplace".as_ptr(),
    arginfo: c"POLICY".as_ptr(),
    usage: c"CPUs for each task from fairplace: kernel, cores, llc, spread, or off for Slurm's own binding"
        .as_ptr(),
    has_arg: 1,
    val: 0,
    cb: Some(on_option),
};

/// The plugin's state in this process.
struct Plugin {
    cfg: Arc<Config>,
    /// slurmstepd only.
    step: Option<Step>,
}

static PLUGIN: OnceLock<Plugin> = OnceLock::new();
/// The policy the step asked for with `--fairplace`.
static ASKED: Mutex<Option<Policy>> = Mutex::new(None);

/// Runs a callback body; a panic is logged and reported as `on_panic`.
fn guarded(name: &str, on_panic: c_int, f: impl FnOnce() -> c_int) -> c_int {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        log(
            Level::Error,
            &format!("{name}: internal error; Slurm's binding stands"),
        );
        on_panic
    })
}

/// The plugstack arguments as strings.
///
/// # Safety
/// `av` holds `ac` NUL-terminated strings (Slurm's argument vector).
unsafe fn args(ac: c_int, av: *const *const c_char) -> Vec<String> {
    (0..ac.max(0) as usize)
        .filter_map(|i| {
            // SAFETY: within the vector Slurm passed.
            let p = unsafe { *av.add(i) };
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}

/// # Safety
/// Called by Slurm with its handle and argument vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_init(sp: Spank, ac: c_int, av: *const *const c_char) -> c_int {
    // SAFETY: Slurm's argument vector.
    let argv = if av.is_null() {
        Vec::new()
    } else {
        unsafe { args(ac, av) }
    };
    guarded("init", -1, || {
        let cfg = match Config::parse(&argv) {
            Ok(c) => c,
            Err(e) => {
                log(Level::Error, &e.to_string());
                return -1;
            }
        };
        if ffi::context() != Context::Slurmd {
            ffi::option_register(sp, &OPTION);
        }
        let step = (ffi::context() == Context::Remote).then(|| Step::new(Arc::new(cfg.clone())));
        let _ = PLUGIN.set(Plugin {
            cfg: Arc::new(cfg),
            step,
        });
        0
    })
}

/// `--fairplace=POLICY`: checked where it is given (srun, sbatch), kept
/// where the tasks run (slurmstepd).
unsafe extern "C" fn on_option(_val: c_int, optarg: *const c_char, _remote: c_int) -> c_int {
    guarded("--fairplace", -1, || {
        let arg = if optarg.is_null() {
            String::new()
        } else {
            // SAFETY: Slurm passes the option's NUL-terminated argument.
            unsafe { CStr::from_ptr(optarg) }
                .to_string_lossy()
                .into_owned()
        };
        match arg.parse::<Policy>() {
            Ok(p) => {
                *ASKED.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
                0
            }
            Err(e) => {
                log(Level::Error, &format!("--fairplace={arg}: {e}"));
                -1
            }
        }
    })
}

/// # Safety
/// Called by Slurm in slurmstepd after each task's fork.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_task_post_fork(
    sp: Spank,
    _ac: c_int,
    _av: *const *const c_char,
) -> c_int {
    guarded("task_post_fork", 0, || {
        if let Some((plugin, step)) = in_step() {
            place_task(sp, plugin, step);
        }
        0
    })
}

/// # Safety
/// Called by Slurm in slurmstepd after each task exits.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_task_exit(
    sp: Spank,
    _ac: c_int,
    _av: *const *const c_char,
) -> c_int {
    guarded("task_exit", 0, || {
        if let Some((_, step)) = in_step()
            && let Some(task) = ffi::get_i32(sp, item::S_TASK_ID).filter(|t| *t >= 0)
        {
            step.task_exited(task as u32);
        }
        0
    })
}

/// # Safety
/// Called by Slurm as the plugin's host process ends.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn slurm_spank_exit(
    _sp: Spank,
    _ac: c_int,
    _av: *const *const c_char,
) -> c_int {
    guarded("exit", 0, || {
        if let Some((_, step)) = in_step() {
            step.stop();
        }
        0
    })
}

/// The plugin and its step, in slurmstepd.
fn in_step() -> Option<(&'static Plugin, &'static Step)> {
    let p = PLUGIN.get()?;
    Some((p, p.step.as_ref()?))
}

/// The policy in force for this step: its `--fairplace`, or plugstack's.
fn policy(cfg: &Config) -> Policy {
    ASKED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or(cfg.policy)
}

/// post_fork for one task: its lease, and its pid bound to it.
fn place_task(sp: Spank, plugin: &Plugin, step: &Step) {
    let cfg = &plugin.cfg;
    let policy = policy(cfg);
    let (Some(task), Some(pid), Some(job), Some(step_id)) = (
        ffi::get_i32(sp, item::S_TASK_ID).filter(|t| *t >= 0),
        ffi::get_i32(sp, item::S_TASK_PID).filter(|p| *p > 0),
        ffi::get_u32(sp, item::S_JOB_ID),
        ffi::get_u32(sp, item::S_JOB_STEPID),
    ) else {
        // The extern step's post_fork has no task.
        return;
    };
    if policy == Policy::Off || step_id == task::SLURM_EXTERN_CONT {
        return;
    }
    let who = TaskRef {
        job,
        step: step_id,
        task: task as u32,
        stepd: std::process::id(),
    };
    let allowed = match step_cpus(sp).and_then(|c| task::check_map(pid, &c).map(|()| c)) {
        Ok(c) => c,
        Err(why) => return keeps_slurms(&who, &why),
    };
    let ask = Ask {
        task: who,
        node: cfg
            .node_id
            .clone()
            .unwrap_or_else(fairplace_types::state_dir::hostname),
        policy,
        count: cpus_per_task(sp, step_id),
        allowed: allowed.clone(),
        ttl_ms: cfg.ttl_ms,
    };
    let granted = match step.place(ask) {
        Ok(g) => g,
        Err(f) => return keeps_slurms(&who, &f.why),
    };
    match task::bind(pid, &granted.cpus, &allowed) {
        Ok(()) => {
            step.bound(who.task, true);
            log(
                Level::Verbose,
                &format!(
                    "{}: CPUs {} (lease {}, policy {policy}, the job's CPUs here {allowed})",
                    who.holder(),
                    granted.cpus,
                    granted.lease_id
                ),
            );
        }
        Err(why) => {
            step.bound(who.task, false);
            keeps_slurms(&who, &why);
        }
    }
}

/// The CPUs a task asks for: the step's `--cpus-per-task`. A batch
/// script's step has every CPU of the job on the node; the script is one
/// task of the job's `--cpus-per-task` (default 1), so the job's steps
/// find the rest free.
fn cpus_per_task(sp: Spank, step_id: u32) -> u32 {
    let n = if step_id == task::SLURM_BATCH_SCRIPT {
        ffi::getenv(sp, c"SLURM_CPUS_PER_TASK").and_then(|v| v.trim().parse().ok())
    } else {
        ffi::get_u32(sp, item::S_STEP_CPUS_PER_TASK)
    };
    n.unwrap_or(1).max(1)
}

/// The one line a task that keeps Slurm's binding leaves.
fn keeps_slurms(who: &TaskRef, why: &str) {
    log(
        Level::Info,
        &format!("{} keeps Slurm's binding: {why}", who.holder()),
    );
}

/// The OS CPUs the step may use on this node: the job's cores here.
///
/// Slurm 22.05 gives a step only the cores its tasks asked for
/// (`S_STEP_ALLOC_CORES`: one core for `srun -n1`, even in a job that holds
/// the whole node with `--exclusive`), and binds each task within them. The
/// job's cores on this node (`S_JOB_ALLOC_CORES`) are what the job owns
/// here; fairplace's leases keep the tasks of its steps apart within them,
/// so a one-CPU task of an exclusive job may land on any CPU of the node.
fn step_cpus(sp: Spank) -> Result<String, String> {
    let cores = [item::S_JOB_ALLOC_CORES, item::S_STEP_ALLOC_CORES]
        .into_iter()
        .find_map(|i| ffi::get_string(sp, i).filter(|s| !s.is_empty()))
        .ok_or("Slurm did not say which cores the job has on this node")?;
    let topo = fairplace_host::sysfs::read_topology(std::path::Path::new("/sys/devices/system"))
        .map_err(|e| format!("reading this machine's topology: {e}"))?;
    let cpus = task::cpus_of_cores(&cores, &topo)?;
    Ok(task::cpulist(&cpus))
}
