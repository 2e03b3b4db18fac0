//! Whose word places a node: the labels the cluster hierarchy and the
//! selectors use (zone, rack, any other) are the server's, not the node's.
//!
//! A node certificate proves which node is talking, not where that node
//! stands: a node that could name its own zone could draw every placement
//! aimed at that zone (Kubernetes' NodeRestriction keeps kubelets from
//! setting the labels its scheduler trusts, for the same reason). So:
//!
//! - `--node-labels FILE` (JSON) gives each node its labels, and says
//!   which reported keys a node may still set itself:
//!   `{"nodes": {"n1": {"zone": "eu-1", "rack": "r7"}},
//!     "reported": {"*": ["team"], "n2": ["zone"]}}`
//!   (`"*"`: every node). The file's labels win over a reported one.
//! - `--trust-reported-labels KEY,...`: those keys as reported by every
//!   node (a development setup whose agents are trusted).
//! - Without client authentication every caller is trusted anyway (anyone
//!   may register any node), so reported labels are used as they are.
//!
//! What the agent reported is kept apart and shown (`reported_labels`).
//! The file is read at start; a bad file stops the server, naming it.

use crate::engine::topology::FieldError;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// The policy, fixed at start.
#[derive(Debug, Clone, Default)]
pub struct LabelPolicy {
    /// Reported labels are used as reported (no client authentication).
    trust_all: bool,
    nodes: HashMap<String, BTreeMap<String, String>>,
    /// Reported keys a node may set: by node id, and "*" for every node.
    reported: HashMap<String, BTreeSet<String>>,
}

/// Why `--node-labels` cannot be used: the file is unreadable, too large,
/// or not a valid policy. It stops the server at start (placement must not
/// run on labels other than the admin's), naming the file and, for a bad
/// policy, the field.
#[derive(Debug)]
pub enum LabelPolicyError {
    /// The file's size or contents cannot be read.
    Read { path: PathBuf, source: io::Error },
    /// The file is larger than [`MAX_FILE_BYTES`].
    TooLarge { path: PathBuf, len: u64 },
    /// The file's contents are not a policy.
    Invalid {
        path: PathBuf,
        source: LabelPolicyParseError,
    },
}

impl fmt::Display for LabelPolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LabelPolicyError::Read { path, source } => {
                write!(f, "--node-labels {}: {source}", path.display())
            }
            LabelPolicyError::TooLarge { path, len } => write!(
                f,
                "--node-labels {}: {len} bytes, more than {MAX_FILE_BYTES}",
                path.display()
            ),
            LabelPolicyError::Invalid { path, source } => {
                write!(f, "--node-labels {}: {source}", path.display())
            }
        }
    }
}

impl std::error::Error for LabelPolicyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LabelPolicyError::Read { source, .. } => Some(source),
            LabelPolicyError::TooLarge { .. } => None,
            LabelPolicyError::Invalid { source, .. } => Some(source),
        }
    }
}

/// Why a label policy's JSON is refused ([`LabelPolicy::parse`]): not JSON,
/// or not the shape the policy has. Each names the field that is wrong, so
/// an admin can fix the file the server refused to start with.
#[derive(Debug)]
pub enum LabelPolicyParseError {
    /// Not JSON at all.
    Json(serde_json::Error),
    /// The top level is not an object.
    NotAnObject,
    /// A top-level field other than `nodes` and `reported`.
    UnknownField { field: String },
    /// `nodes` or `reported` is not an object keyed by node id.
    NotKeyedByNode { field: &'static str },
    /// `nodes.NODE` is not an object of labels.
    NodeLabelsNotObject { node: String },
    /// `nodes.NODE.KEY` is not a string.
    LabelNotString { node: String, key: String },
    /// `nodes.NODE`'s labels break a label limit ([`check_labels`]).
    BadLabels { node: String, source: FieldError },
    /// `reported.NODE` is not an array of label keys.
    ReportedNotArray { node: String },
    /// A key of `reported.NODE` is not a string.
    ReportedKeyNotString { node: String },
}

impl fmt::Display for LabelPolicyParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use LabelPolicyParseError::*;
        match self {
            Json(e) => write!(f, "{e}"),
            NotAnObject => f.write_str("must be a JSON object"),
            UnknownField { field } => write!(f, "unknown field {field:?} (nodes, reported)"),
            NotKeyedByNode { field } => write!(f, "{field}: must be an object keyed by node id"),
            NodeLabelsNotObject { node } => write!(f, "nodes.{node}: must be an object of labels"),
            LabelNotString { node, key } => write!(f, "nodes.{node}.{key}: must be a string"),
            BadLabels { node, source } => write!(f, "nodes.{node}: {}", source.msg),
            ReportedNotArray { node } => {
                write!(f, "reported.{node}: must be an array of label keys")
            }
            ReportedKeyNotString { node } => write!(f, "reported.{node}: keys must be strings"),
        }
    }
}

impl std::error::Error for LabelPolicyParseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LabelPolicyParseError::Json(e) => Some(e),
            LabelPolicyParseError::BadLabels { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// Labels larger than this file would be refused anyway (32 labels of 253
/// bytes per node, for the store's node limit) .
const MAX_FILE_BYTES: u64 = 64 << 20;

impl LabelPolicy {
    /// Every reported label is used (no client authentication).
    pub fn trust_all() -> LabelPolicy {
        LabelPolicy {
            trust_all: true,
            ..LabelPolicy::default()
        }
    }

    /// The policy of `--node-labels` (if any) and `--trust-reported-labels`.
    pub fn load(
        file: Option<&Path>,
        trusted_keys: &[String],
    ) -> Result<LabelPolicy, LabelPolicyError> {
        let mut p = match file {
            Some(f) => Self::from_file(f)?,
            None => LabelPolicy::default(),
        };
        if !trusted_keys.is_empty() {
            p.reported
                .entry("*".into())
                .or_default()
                .extend(trusted_keys.iter().cloned());
        }
        Ok(p)
    }

    fn from_file(f: &Path) -> Result<LabelPolicy, LabelPolicyError> {
        let read = |source| LabelPolicyError::Read {
            path: f.to_path_buf(),
            source,
        };
        let len = std::fs::metadata(f).map_err(read)?.len();
        if len > MAX_FILE_BYTES {
            return Err(LabelPolicyError::TooLarge {
                path: f.to_path_buf(),
                len,
            });
        }
        let text = std::fs::read_to_string(f).map_err(read)?;
        Self::parse(&text).map_err(|source| LabelPolicyError::Invalid {
            path: f.to_path_buf(),
            source,
        })
    }

    /// The file's JSON: `nodes` (node id -> labels) and `reported` (node id
    /// or "*" -> keys), both optional; anything else is an error.
    pub fn parse(text: &str) -> Result<LabelPolicy, LabelPolicyParseError> {
        use LabelPolicyParseError as E;
        let v: serde_json::Value = serde_json::from_str(text).map_err(E::Json)?;
        let obj = v.as_object().ok_or(E::NotAnObject)?;
        if let Some(k) = obj.keys().find(|k| *k != "nodes" && *k != "reported") {
            return Err(E::UnknownField { field: k.clone() });
        }
        let mut p = LabelPolicy::default();
        for (node, labels) in map_of(obj.get("nodes"), "nodes")? {
            let labels = labels
                .as_object()
                .ok_or_else(|| E::NodeLabelsNotObject { node: node.clone() })?;
            let mut m = BTreeMap::new();
            for (k, v) in labels {
                let v = v.as_str().ok_or_else(|| E::LabelNotString {
                    node: node.clone(),
                    key: k.clone(),
                })?;
                m.insert(k.clone(), v.to_string());
            }
            let pairs: Vec<_> = m.clone().into_iter().collect();
            check_labels(&pairs).map_err(|source| E::BadLabels {
                node: node.clone(),
                source,
            })?;
            p.nodes.insert(node.clone(), m);
        }
        for (node, keys) in map_of(obj.get("reported"), "reported")? {
            let keys = keys
                .as_array()
                .ok_or_else(|| E::ReportedNotArray { node: node.clone() })?;
            let mut set = BTreeSet::new();
            for k in keys {
                let k = k
                    .as_str()
                    .ok_or_else(|| E::ReportedKeyNotString { node: node.clone() })?;
                set.insert(k.to_string());
            }
            p.reported.insert(node.clone(), set);
        }
        Ok(p)
    }

    /// The labels placement uses for `node`, from what its agent reported.
    pub fn effective(&self, node: &str, reported: &[(String, String)]) -> Vec<(String, String)> {
        if self.trust_all {
            return reported.to_vec();
        }
        let allowed = |k: &str| {
            ["*", node]
                .iter()
                .any(|n| self.reported.get(*n).is_some_and(|s| s.contains(k)))
        };
        let mut out: BTreeMap<String, String> = reported
            .iter()
            .filter(|(k, _)| allowed(k))
            .cloned()
            .collect();
        if let Some(own) = self.nodes.get(node) {
            out.extend(own.iter().map(|(k, v)| (k.clone(), v.clone())));
        }
        out.into_iter().collect()
    }
}

fn map_of<'a>(
    v: Option<&'a serde_json::Value>,
    field: &'static str,
) -> Result<Vec<(&'a String, &'a serde_json::Value)>, LabelPolicyParseError> {
    match v {
        None => Ok(Vec::new()),
        Some(v) => Ok(v
            .as_object()
            .ok_or(LabelPolicyParseError::NotKeyedByNode { field })?
            .iter()
            .collect()),
    }
}

/// Labels a node may carry at most.
pub const MAX_LABELS: usize = 32;
/// Longest label key or value, in bytes (a DNS subdomain, as Kubernetes'
/// label prefixes).
pub const MAX_LABEL_BYTES: usize = 253;
/// Why a client's string is not fit to store and show: too long, or with a
/// control character (a newline or an escape sequence would forge a row or
/// reach a terminal); `None` when fit.
pub(super) fn unfit(s: &str, max: usize) -> Option<String> {
    let q = crate::quote::quote(s);
    if s.len() > max {
        Some(format!("{q} is longer than {max} bytes"))
    } else if s.chars().any(char::is_control) {
        Some(format!("{q} contains a control character"))
    } else {
        None
    }
}

/// A registration's labels: at most [`MAX_LABELS`], keys non-empty, keys
/// and values short and printable.
pub fn check_labels(labels: &[(String, String)]) -> Result<(), FieldError> {
    if labels.len() > MAX_LABELS {
        return Err(FieldError::new(
            "register.labels",
            format!("{} labels is more than {MAX_LABELS}", labels.len()),
        ));
    }
    for (k, v) in labels {
        let field = || format!("register.labels[{}]", crate::quote::quote(k));
        if k.is_empty() {
            return Err(FieldError::new("register.labels", "a key is empty"));
        }
        if let Some(why) = unfit(k, MAX_LABEL_BYTES) {
            return Err(FieldError::new(field(), format!("key {why}")));
        }
        if let Some(why) = unfit(v, MAX_LABEL_BYTES) {
            return Err(FieldError::new(field(), format!("value {why}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn l(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_node_sets_only_the_keys_it_is_trusted_with_and_the_file_wins() {
        let p = LabelPolicy::parse(
            r#"{"nodes": {"a": {"zone": "eu-1", "rack": "r1"}},
                "reported": {"*": ["team"], "b": ["zone"]}}"#,
        )
        .unwrap();
        let claims = l(&[("zone", "us-9"), ("team", "x"), ("gpu", "yes")]);
        // a: its zone is the file's; team is trusted from everyone.
        assert_eq!(
            p.effective("a", &claims),
            l(&[("rack", "r1"), ("team", "x"), ("zone", "eu-1")])
        );
        // b may set its zone; gpu is nobody's to set.
        assert_eq!(
            p.effective("b", &claims),
            l(&[("team", "x"), ("zone", "us-9")])
        );
        // c: only what everyone may set.
        assert_eq!(p.effective("c", &claims), l(&[("team", "x")]));
        assert_eq!(LabelPolicy::default().effective("c", &claims), l(&[]));
        assert_eq!(LabelPolicy::trust_all().effective("c", &claims), claims);
    }

    #[test]
    fn bad_files_are_refused_naming_the_field() {
        for (text, what) in [
            ("[]", "object"),
            (r#"{"nodez": {}}"#, "nodez"),
            (r#"{"nodes": {"a": {"zone": 1}}}"#, "nodes.a.zone"),
            (r#"{"nodes": {"a": "eu"}}"#, "nodes.a"),
            (r#"{"reported": {"*": "zone"}}"#, "reported.*"),
            (r#"{"nodes": {"a": {"zone": "x\ny"}}}"#, "nodes.a"),
        ] {
            let e = LabelPolicy::parse(text).unwrap_err().to_string();
            assert!(e.contains(what), "{text}: {e}");
        }
    }
}
