//! A real Slurm on this machine for the SPANK plugin's tests: munged with
//! its own key and socket, slurmctld and slurmd on ports of their own, all
//! in a temporary directory (`SLURM_CONF`), with the plugin in its
//! `plugstack.conf`. Debian's Slurm 22.05 (`slurmctld slurmd slurm-client
//! munge`); where it is not installed the tests skip, unless
//! `FAIRPLACE_REQUIRE_SLURM` is set (CI), when they fail.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::{StateDir, free_port, send_signal, wait_for};

/// One Slurm at a time on a machine: the tests take turns.
static TURN: Mutex<()> = Mutex::new(());

/// Whether Slurm and munge are installed; if not, why (and a panic when
/// CI requires them).
pub fn available() -> Result<(), String> {
    for prog in [
        "munged",
        "slurmctld",
        "slurmd",
        "srun",
        "sbatch",
        "scontrol",
    ] {
        if which(prog).is_none() {
            let why = format!(
                "{prog} is not installed (apt-get install slurmctld slurmd slurm-client munge)"
            );
            assert!(
                std::env::var_os("FAIRPLACE_REQUIRE_SLURM").is_none(),
                "{why}"
            );
            return Err(why);
        }
    }
    Ok(())
}

fn which(prog: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

/// The SPANK plugin of this build (`libfairplace_spank.so` beside the
/// binaries, or in `FAIRPLACE_BIN_DIR`), built once.
pub fn plugin() -> PathBuf {
    let p = crate::bin("libfairplace_spank.so");
    assert!(p.is_file(), "{} was not built", p.display());
    p
}

/// A loop pinned to `cpu` outside Slurm (a busy neighbour).
pub fn busy_loop(cpu: &str) -> std::process::Child {
    Command::new("taskset")
        .args(["-c", cpu, "sh", "-c", "while :; do :; done"])
        .stdout(Stdio::null())
        .spawn()
        .expect("taskset")
}

/// A running Slurm: controller, node daemon and munge.
pub struct Slurm {
    pub dir: StateDir,
    pub conf: PathBuf,
    pub node: String,
    daemons: Vec<std::process::Child>,
    _turn: MutexGuard<'static, ()>,
}

impl Slurm {
    /// Starts munged, slurmctld and slurmd with `plugstack` as the whole of
    /// plugstack.conf, and waits for the node to be idle.
    pub fn start(plugstack: &str) -> Slurm {
        let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        let dir = StateDir::new("slurm");
        let d = dir.0.clone();
        // munged wants its socket's directory reachable by every user.
        set_mode(&d, 0o755);
        for sub in ["state", "spool", "log"] {
            std::fs::create_dir_all(d.join(sub)).unwrap();
        }
        let key = d.join("munge.key");
        let mut bytes = [0u8; 1024];
        getrandom(&mut bytes);
        std::fs::write(&key, bytes).unwrap();
        set_mode(&key, 0o600);
        let mut daemons = Vec::new();
        daemons.push(
            Command::new(which("munged").unwrap())
                .args(["-F", "-f"])
                .arg(format!("--key-file={}", key.display()))
                .arg(format!("--socket={}", d.join("munge.sock").display()))
                .arg(format!("--pid-file={}", d.join("munged.pid").display()))
                .arg(format!("--seed-file={}", d.join("munge.seed").display()))
                .arg(format!("--log-file={}", d.join("log/munged.log").display()))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start munged"),
        );
        wait_for(Duration::from_secs(10), "munged's socket", || {
            d.join("munge.sock").exists().then_some(())
        });
        let node = hostname();
        let conf = d.join("slurm.conf");
        std::fs::write(&conf, slurm_conf(&d, &node)).unwrap();
        std::fs::write(d.join("plugstack.conf"), plugstack).unwrap();
        let mut s = Slurm {
            dir,
            conf,
            node,
            daemons,
            _turn: turn,
        };
        let daemons: [(&str, &[&str]); 2] = [("slurmctld", &["-D", "-i"]), ("slurmd", &["-D"])];
        for (prog, args) in daemons {
            let child = Command::new(which(prog).unwrap())
                .args(args)
                .env("SLURM_CONF", &s.conf)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {prog}: {e}"));
            s.daemons.push(child);
        }
        wait_for(Duration::from_secs(30), "the Slurm node idle", || {
            let o = s.run("sinfo", &["-h", "-o", "%T"]);
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .starts_with("idle")
                .then_some(())
        });
        s
    }

    /// A Slurm command (srun, sbatch, scontrol, ...) with this Slurm's
    /// configuration, waited for (at most 120 s).
    pub fn run(&self, prog: &str, args: &[&str]) -> Output {
        Command::new("timeout")
            .arg("120")
            .arg(which(prog).unwrap_or_else(|| PathBuf::from(prog)))
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .output()
            .unwrap_or_else(|e| panic!("run {prog}: {e}"))
    }

    /// A Slurm command started in the background.
    pub fn spawn(&self, prog: &str, args: &[&str]) -> std::process::Child {
        Command::new(which(prog).unwrap_or_else(|| PathBuf::from(prog)))
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("start {prog}: {e}"))
    }

    /// The CPUs Slurm alone (`--fairplace=off`) binds a one-task
    /// `--exclusive` step to.
    pub fn own_binding(&self) -> String {
        let o = self.run(
            "srun",
            &[
                "-n1",
                "--exclusive",
                "--fairplace=off",
                "grep",
                "Cpus_allowed_list",
                "/proc/self/status",
            ],
        );
        assert!(
            o.status.success(),
            "srun: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout)
            .split_once(':')
            .map(|(_, c)| c.trim().to_string())
            .expect("the task's CPUs")
    }

    /// slurmd's log (the plugin's lines in slurmstepd land there).
    pub fn slurmd_log(&self) -> String {
        std::fs::read_to_string(self.dir.0.join("log/slurmd.log")).unwrap_or_default()
    }

    /// Rewrites plugstack.conf; read by the next step.
    pub fn set_plugstack(&self, plugstack: &str) {
        std::fs::write(self.dir.0.join("plugstack.conf"), plugstack).unwrap();
    }

    /// A file in the Slurm directory (job output, say).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.0.join(name)
    }

    /// The pids of this Slurm's slurmstepd processes for job `job`.
    pub fn stepds(&self, job: &str) -> Vec<u32> {
        let want = format!("[{job}.");
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let cmd = String::from_utf8_lossy(&cmd);
                cmd.starts_with("slurmstepd:") && cmd.contains(&want)
            })
            .collect()
    }
}

impl Drop for Slurm {
    fn drop(&mut self) {
        let _ = self.run("scancel", &["--full", "--user", "root"]);
        std::thread::sleep(Duration::from_millis(300));
        for d in self.daemons.iter_mut().rev() {
            send_signal(d.id(), 15);
            let _ = d.wait();
        }
    }
}

/// slurm.conf for one node (this machine as `slurmd -C` sees it), one
/// partition, task/affinity binding, every path and port its own.
fn slurm_conf(d: &Path, node: &str) -> String {
    let hw = Command::new(which("slurmd").unwrap())
        .arg("-C")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let layout = hw
        .lines()
        .next()
        .and_then(|l| l.strip_prefix(&format!("NodeName={node} ")))
        .map(str::to_string)
        .unwrap_or_else(|| {
            format!(
                "CPUs={}",
                std::thread::available_parallelism().map_or(1, |n| n.get())
            )
        });
    let p = |s: &str| d.join(s).display().to_string();
    format!(
        "ClusterName=fairplace\n\
         SlurmctldHost={node}(127.0.0.1)\n\
         SlurmctldPort={ctld}\n\
         SlurmdPort={slurmd}\n\
         SlurmUser=root\n\
         SlurmdUser=root\n\
         AuthType=auth/munge\n\
         CredType=cred/munge\n\
         AuthInfo=socket={sock}\n\
         StateSaveLocation={state}\n\
         SlurmdSpoolDir={spool}\n\
         SlurmctldPidFile={ctldpid}\n\
         SlurmdPidFile={slurmdpid}\n\
         SlurmctldLogFile={ctldlog}\n\
         SlurmdLogFile={slurmdlog}\n\
         SlurmdDebug=verbose\n\
         ProctrackType=proctrack/linuxproc\n\
         TaskPlugin=task/affinity\n\
         SelectType=select/cons_tres\n\
         SelectTypeParameters=CR_Core\n\
         SchedulerType=sched/builtin\n\
         MpiDefault=none\n\
         ReturnToService=2\n\
         JobCompType=jobcomp/none\n\
         AccountingStorageType=accounting_storage/none\n\
         SwitchType=switch/none\n\
         KillWait=2\n\
         PlugStackConfig={plugstack}\n\
         NodeName={node} NodeAddr=127.0.0.1 {layout} State=UNKNOWN\n\
         PartitionName=fp Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n",
        ctld = free_port(),
        slurmd = free_port(),
        sock = p("munge.sock"),
        state = p("state"),
        spool = p("spool"),
        ctldpid = p("slurmctld.pid"),
        slurmdpid = p("slurmd.pid"),
        ctldlog = p("log/slurmctld.log"),
        slurmdlog = p("log/slurmd.log"),
        plugstack = p("plugstack.conf"),
    )
}

/// The short hostname, as slurmd names its node.
pub fn hostname() -> String {
    let h = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    h.trim()
        .split('.')
        .next()
        .unwrap_or("localhost")
        .to_string()
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn getrandom(buf: &mut [u8]) {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .expect("/dev/urandom");
}
