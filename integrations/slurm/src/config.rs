//! The plugin's settings: its plugstack.conf arguments, and the policy a
//! step asks for with `--fairplace=POLICY`.
//!
//! ```text
//! required /usr/lib/slurm/libfairplace_spank.so server=ADDR [tls_ca=F tls_cert=F tls_key=F]
//!     [policy=kernel] [node_id=ID] [timeout_ms=2000] [ttl_ms=30000]
//! ```
//!
//! Every argument is `key=value`; an unknown key, a bad value or a missing
//! `server` is an error naming the argument, so Slurm refuses the plugin at
//! its init instead of running steps with settings nobody meant.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use fairplace_client::TlsOptions;

/// How a step's tasks get their CPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The kernel's own exec placement for each CPU (the server's default).
    Kernel,
    /// Whole cores first.
    Cores,
    /// Within one last-level cache.
    Llc,
    /// Across LLCs and cores.
    Spread,
    /// No lease: Slurm's own binding.
    Off,
}

impl Policy {
    /// The name AllocateCpus takes (`None` for `off`).
    pub fn server_name(self) -> Option<&'static str> {
        match self {
            Policy::Kernel => Some("kernel"),
            Policy::Cores => Some("cores"),
            Policy::Llc => Some("llc"),
            Policy::Spread => Some("spread"),
            Policy::Off => None,
        }
    }
}

impl FromStr for Policy {
    type Err = String;

    fn from_str(s: &str) -> Result<Policy, String> {
        match s {
            "kernel" => Ok(Policy::Kernel),
            "cores" => Ok(Policy::Cores),
            "llc" => Ok(Policy::Llc),
            "spread" => Ok(Policy::Spread),
            "off" => Ok(Policy::Off),
            _ => Err(format!(
                "unknown policy {s:?} (kernel, cores, llc, spread or off)"
            )),
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.server_name().unwrap_or("off"))
    }
}

/// The plugstack.conf arguments, checked.
#[derive(Debug, Clone)]
pub struct Config {
    /// The fairplace server (`host:port`, `http://...`, `https://...`).
    pub server: String,
    pub tls: TlsOptions,
    /// The default policy of a step that gives no `--fairplace`.
    pub policy: Policy,
    /// This node's id at the server; `None`: the hostname, as the agent's
    /// default.
    pub node_id: Option<String>,
    /// How long a task's start may wait for the server before it keeps
    /// Slurm's binding.
    pub timeout: Duration,
    /// The lease's lifetime: renewed every third of it while the task runs,
    /// and the longest a lease outlives a slurmstepd killed with -9.
    pub ttl_ms: u32,
}

/// A plugstack argument that cannot be used, named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The argument as written (or the key that is missing).
    pub argument: String,
    pub why: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "plugstack argument {:?}: {}", self.argument, self.why)
    }
}

impl std::error::Error for ConfigError {}

const DEFAULT_TIMEOUT_MS: u64 = 2_000;
const DEFAULT_TTL_MS: u32 = 30_000;
/// A lease renewed every third of its TTL needs a TTL the renewals can
/// keep up with; a day is a bound on what a typo can ask for.
const TTL_MS_RANGE: std::ops::RangeInclusive<u32> = 3_000..=86_400_000;
const TIMEOUT_MS_RANGE: std::ops::RangeInclusive<u64> = 100..=60_000;

impl Config {
    /// Parses `key=value` arguments in plugstack.conf's order.
    pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Config, ConfigError> {
        let mut server = None;
        let mut tls = TlsOptions::default();
        let mut policy = Policy::Kernel;
        let mut node_id = None;
        let mut timeout = Duration::from_millis(DEFAULT_TIMEOUT_MS);
        let mut ttl_ms = DEFAULT_TTL_MS;
        for arg in args {
            let arg = arg.as_ref();
            let bad = |why: String| ConfigError {
                argument: arg.to_string(),
                why,
            };
            let (key, value) = arg
                .split_once('=')
                .ok_or_else(|| bad("expected key=value".into()))?;
            if value.is_empty() {
                return Err(bad("empty value".into()));
            }
            match key {
                "server" => server = Some(value.to_string()),
                "tls_ca" => tls.ca = Some(readable(value).map_err(bad)?),
                "tls_cert" => tls.cert = Some(readable(value).map_err(bad)?),
                "tls_key" => tls.key = Some(readable(value).map_err(bad)?),
                "tls_server_name" => tls.server_name = Some(value.to_string()),
                "policy" => policy = value.parse().map_err(bad)?,
                "node_id" => node_id = Some(value.to_string()),
                "timeout_ms" => {
                    timeout = Duration::from_millis(in_range(value, TIMEOUT_MS_RANGE).map_err(bad)?)
                }
                "ttl_ms" => ttl_ms = in_range(value, TTL_MS_RANGE).map_err(bad)?,
                _ => {
                    return Err(bad(
                        "unknown key (server, tls_ca, tls_cert, tls_key, tls_server_name, \
                         policy, node_id, timeout_ms, ttl_ms)"
                            .into(),
                    ));
                }
            }
        }
        let server = server.ok_or_else(|| ConfigError {
            argument: "server".into(),
            why: "missing: server=HOST:PORT names the fairplace server".into(),
        })?;
        if tls.cert.is_some() != tls.key.is_some() {
            return Err(ConfigError {
                argument: if tls.cert.is_some() {
                    "tls_key"
                } else {
                    "tls_cert"
                }
                .into(),
                why: "missing: tls_cert and tls_key go together".into(),
            });
        }
        if (tls.cert.is_some() || tls.server_name.is_some()) && tls.ca.is_none() {
            return Err(ConfigError {
                argument: "tls_ca".into(),
                why: "missing: TLS needs the CA of the server's certificate".into(),
            });
        }
        Ok(Config {
            server,
            tls,
            policy,
            node_id,
            timeout,
            ttl_ms,
        })
    }
}

/// A file the plugin will read at each task's start: checked once here, so
/// a typo fails the plugin's init rather than every task quietly.
fn readable(path: &str) -> Result<PathBuf, String> {
    std::fs::File::open(path)
        .map(|_| PathBuf::from(path))
        .map_err(|e| format!("cannot read {path}: {e}"))
}

fn in_range<T>(value: &str, range: std::ops::RangeInclusive<T>) -> Result<T, String>
where
    T: FromStr + PartialOrd + fmt::Display,
{
    let v: T = value
        .parse()
        .map_err(|_| format!("{value:?} is not a whole number"))?;
    if !range.contains(&v) {
        return Err(format!(
            "{v} is outside {}..={}",
            range.start(),
            range.end()
        ));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_alone_takes_every_default() {
        let c = Config::parse(&["server=127.0.0.1:50051"]).unwrap();
        assert_eq!(c.server, "127.0.0.1:50051");
        assert_eq!(c.policy, Policy::Kernel);
        assert_eq!(c.timeout, Duration::from_secs(2));
        assert_eq!(c.ttl_ms, 30_000);
        assert!(c.node_id.is_none());
        assert!(!c.tls.enabled());
    }

    #[test]
    fn every_key_is_read() {
        let ca = std::env::current_exe().unwrap();
        let ca = ca.to_str().unwrap();
        let c = Config::parse(&[
            "server=https://fp:7000".to_string(),
            format!("tls_ca={ca}"),
            format!("tls_cert={ca}"),
            format!("tls_key={ca}"),
            "policy=spread".into(),
            "node_id=n7".into(),
            "timeout_ms=500".into(),
            "ttl_ms=9000".into(),
        ])
        .unwrap();
        assert_eq!(c.policy, Policy::Spread);
        assert_eq!(c.node_id.as_deref(), Some("n7"));
        assert_eq!(c.timeout, Duration::from_millis(500));
        assert_eq!(c.ttl_ms, 9000);
        assert!(c.tls.enabled());
    }

    #[test]
    fn each_bad_argument_is_named() {
        let cases: &[(&[&str], &str)] = &[
            (&["policy=kernel"], "server"),
            (&["server=a:1", "polcy=kernel"], "polcy=kernel"),
            (&["server=a:1", "policy=fast"], "policy=fast"),
            (&["server=a:1", "verbose"], "verbose"),
            (&["server=a:1", "node_id="], "node_id="),
            (&["server=a:1", "ttl_ms=10"], "ttl_ms=10"),
            (&["server=a:1", "timeout_ms=2s"], "timeout_ms=2s"),
            (
                &["server=a:1", "tls_ca=/nonexistent/ca.pem"],
                "tls_ca=/nonexistent/ca.pem",
            ),
        ];
        for (args, named) in cases {
            let e = Config::parse(args).expect_err(&format!("{args:?} accepted"));
            assert_eq!(e.argument, *named, "{args:?}: {e}");
            assert!(e.to_string().contains(named), "{e}");
        }
    }

    #[test]
    fn a_certificate_needs_its_key_and_a_ca() {
        let f = std::env::current_exe().unwrap();
        let f = f.to_str().unwrap();
        let e = Config::parse(&["server=a:1".to_string(), format!("tls_cert={f}")]).unwrap_err();
        assert_eq!(e.argument, "tls_key");
        let e = Config::parse(&[
            "server=a:1".to_string(),
            format!("tls_cert={f}"),
            format!("tls_key={f}"),
        ])
        .unwrap_err();
        assert_eq!(e.argument, "tls_ca");
    }

    #[test]
    fn policies_read_and_print_alike() {
        for name in ["kernel", "cores", "llc", "spread", "off"] {
            let p: Policy = name.parse().unwrap();
            assert_eq!(p.to_string(), name);
        }
        assert_eq!(Policy::Off.server_name(), None);
        assert!("KERNEL".parse::<Policy>().is_err());
    }
}
