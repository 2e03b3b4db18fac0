//! The SPANK API, as Slurm's `spank.h` declares it, found in the process
//! that loaded the plugin.
//!
//! srun, sbatch, slurmd and slurmstepd each carry the SPANK functions
//! (`spank_get_item`, `slurm_info`, ...) and load plugins into themselves.
//! The plugin does not link libslurm: it looks each function up in the
//! process at its first use (`dlsym(RTLD_DEFAULT)`), so the same code also
//! links into the tests, where no Slurm is loaded and logging goes to
//! stderr.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

/// `spank_t`: the handle every callback is given, passed back to Slurm
/// untouched.
#[repr(transparent)]
#[derive(Debug, Clone, Copy)]
pub struct Spank(*mut c_void);

/// `enum spank_item` values this plugin reads (spank.h order).
pub mod item {
    use std::ffi::c_int;
    pub const S_JOB_ID: c_int = 2;
    pub const S_JOB_STEPID: c_int = 3;
    pub const S_JOB_LOCAL_TASK_COUNT: c_int = 6;
    pub const S_TASK_ID: c_int = 11;
    pub const S_TASK_EXIT_STATUS: c_int = 13;
    pub const S_TASK_PID: c_int = 14;
    pub const S_STEP_CPUS_PER_TASK: c_int = 24;
    pub const S_JOB_ALLOC_CORES: c_int = 25;
    pub const S_STEP_ALLOC_CORES: c_int = 27;
}

/// `enum spank_context`: which program the plugin was loaded into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Context {
    /// srun on the submitting side.
    Local,
    /// slurmstepd, which runs the tasks: where the plugin does its work.
    Remote,
    /// sbatch or salloc.
    Allocator,
    Slurmd,
    JobScript,
    /// No SPANK in this process (the tests), or Slurm could not say.
    Unknown,
}

/// `struct spank_option`: one option srun and sbatch accept for the plugin.
#[repr(C)]
pub struct SpankOption {
    pub name: *const c_char,
    pub arginfo: *const c_char,
    pub usage: *const c_char,
    pub has_arg: c_int,
    pub val: c_int,
    pub cb: Option<unsafe extern "C" fn(c_int, *const c_char, c_int) -> c_int>,
}

// The table is constant: its pointers are to static C strings.
unsafe impl Sync for SpankOption {}

type GetItem = unsafe extern "C" fn(Spank, c_int, ...) -> c_int;
type GetContext = unsafe extern "C" fn() -> c_int;
type Log = unsafe extern "C" fn(*const c_char, ...);
type GetEnv = unsafe extern "C" fn(Spank, *const c_char, *mut c_char, c_int) -> c_int;
type OptionRegister = unsafe extern "C" fn(Spank, *const SpankOption) -> c_int;

struct Api {
    get_item: Option<GetItem>,
    context: Option<GetContext>,
    info: Option<Log>,
    error: Option<Log>,
    verbose: Option<Log>,
    option_register: Option<OptionRegister>,
    getenv: Option<GetEnv>,
}

fn api() -> &'static Api {
    static API: OnceLock<Api> = OnceLock::new();
    API.get_or_init(|| {
        fn find(name: &CStr) -> *mut c_void {
            // SAFETY: dlsym with RTLD_DEFAULT only reads the loaded objects'
            // symbol tables.
            unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) }
        }
        // SAFETY: each symbol, when present, is the function spank.h
        // declares with this signature.
        unsafe {
            let f = |name: &CStr| {
                let p = find(name);
                (!p.is_null()).then_some(p)
            };
            Api {
                get_item: f(c"spank_get_item")
                    .map(|p| std::mem::transmute::<*mut c_void, GetItem>(p)),
                context: f(c"spank_context")
                    .map(|p| std::mem::transmute::<*mut c_void, GetContext>(p)),
                info: f(c"slurm_info").map(|p| std::mem::transmute::<*mut c_void, Log>(p)),
                error: f(c"slurm_error").map(|p| std::mem::transmute::<*mut c_void, Log>(p)),
                verbose: f(c"slurm_verbose").map(|p| std::mem::transmute::<*mut c_void, Log>(p)),
                option_register: f(c"spank_option_register")
                    .map(|p| std::mem::transmute::<*mut c_void, OptionRegister>(p)),
                getenv: f(c"spank_getenv").map(|p| std::mem::transmute::<*mut c_void, GetEnv>(p)),
            }
        }
    })
}

/// Which program loaded the plugin.
pub fn context() -> Context {
    let Some(f) = api().context else {
        return Context::Unknown;
    };
    // SAFETY: spank_context takes nothing and returns the enum.
    match unsafe { f() } {
        1 => Context::Local,
        2 => Context::Remote,
        3 => Context::Allocator,
        4 => Context::Slurmd,
        5 => Context::JobScript,
        _ => Context::Unknown,
    }
}

/// Registers an option of srun, sbatch and salloc (Slurm copies it).
pub fn option_register(sp: Spank, opt: &'static SpankOption) {
    if let Some(f) = api().option_register {
        // SAFETY: a valid handle and a static option.
        let rc = unsafe { f(sp, opt) };
        if rc != 0 {
            log(
                Level::Error,
                &format!("registering --fairplace: SPANK error {rc}"),
            );
        }
    }
}

/// A variable of the job's environment (in slurmstepd).
pub fn getenv(sp: Spank, name: &CStr) -> Option<String> {
    let f = api().getenv?;
    let mut buf = [0u8; 256];
    // SAFETY: Slurm writes at most `len` bytes, NUL-terminated.
    let rc = unsafe {
        f(
            sp,
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len() as c_int,
        )
    };
    if rc != 0 {
        return None;
    }
    let s = CStr::from_bytes_until_nul(&buf).ok()?;
    Some(s.to_string_lossy().into_owned())
}

/// A `uint32_t` item (job id, step id, cpus per task, ...).
pub fn get_u32(sp: Spank, which: c_int) -> Option<u32> {
    let f = api().get_item?;
    let mut v: u32 = 0;
    // SAFETY: these items write one uint32_t through the pointer.
    (unsafe { f(sp, which, &mut v as *mut u32) } == 0).then_some(v)
}

/// An `int` or `pid_t` item (local task id, exit status, pid).
pub fn get_i32(sp: Spank, which: c_int) -> Option<i32> {
    let f = api().get_item?;
    let mut v: c_int = 0;
    // SAFETY: these items write one int (pid_t is an int) through the pointer.
    (unsafe { f(sp, which, &mut v as *mut c_int) } == 0).then_some(v)
}

/// A `char *` item (the allocated cores' list), copied.
pub fn get_string(sp: Spank, which: c_int) -> Option<String> {
    let f = api().get_item?;
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: these items store a pointer to a string Slurm owns.
    if unsafe { f(sp, which, &mut p as *mut *const c_char) } != 0 || p.is_null() {
        return None;
    }
    // SAFETY: a NUL-terminated string, alive for the call.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Log levels Slurm has for plugins.
#[derive(Debug, Clone, Copy)]
pub enum Level {
    /// Shown by slurmd's log at its default level, and by srun.
    Info,
    Error,
    /// Shown with `srun -v` and slurmd at verbose.
    Verbose,
}

/// One line in Slurm's log (stderr when no Slurm is loaded), prefixed with
/// the plugin's name.
pub fn log(level: Level, msg: &str) {
    let a = api();
    let f = match level {
        Level::Info => a.info,
        Level::Error => a.error,
        Level::Verbose => a.verbose,
    };
    let line = format!("fairplace: {msg}");
    match (f, CString::new(line.replace('\0', " "))) {
        // SAFETY: a printf-style call with one %s and one C string.
        (Some(f), Ok(c)) => unsafe { f(c"%s".as_ptr(), c.as_ptr()) },
        _ => eprintln!("{line}"),
    }
}
