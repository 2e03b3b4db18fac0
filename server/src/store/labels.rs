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

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;

/// The policy, fixed at start.
#[derive(Debug, Clone, Default)]
pub struct LabelPolicy {
    /// Reported labels are used as reported (no client authentication).
    trust_all: bool,
    nodes: HashMap<String, BTreeMap<String, String>>,
    /// Reported keys a node may set: by node id, and "*" for every node.
    reported: HashMap<String, BTreeSet<String>>,
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
    pub fn load(file: Option<&Path>, trusted_keys: &[String]) -> Result<LabelPolicy, String> {
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

    fn from_file(f: &Path) -> Result<LabelPolicy, String> {
        let bad = |why: String| format!("--node-labels {}: {why}", f.display());
        let len = std::fs::metadata(f).map_err(|e| bad(e.to_string()))?.len();
        if len > MAX_FILE_BYTES {
            return Err(bad(format!("{len} bytes, more than {MAX_FILE_BYTES}")));
        }
        let text = std::fs::read_to_string(f).map_err(|e| bad(e.to_string()))?;
        Self::parse(&text).map_err(bad)
    }

    /// The file's JSON: `nodes` (node id -> labels) and `reported` (node id
    /// or "*" -> keys), both optional; anything else is an error.
    pub fn parse(text: &str) -> Result<LabelPolicy, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let obj = v.as_object().ok_or("must be a JSON object")?;
        if let Some(k) = obj.keys().find(|k| *k != "nodes" && *k != "reported") {
            return Err(format!("unknown field {k:?} (nodes, reported)"));
        }
        let mut p = LabelPolicy::default();
        for (node, labels) in map_of(obj.get("nodes"), "nodes")? {
            let labels = labels
                .as_object()
                .ok_or_else(|| format!("nodes.{node}: must be an object of labels"))?;
            let mut m = BTreeMap::new();
            for (k, v) in labels {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("nodes.{node}.{k}: must be a string"))?;
                m.insert(k.clone(), v.to_string());
            }
            let pairs: Vec<_> = m.clone().into_iter().collect();
            crate::store::check_labels(&pairs).map_err(|e| format!("nodes.{node}: {}", e.msg))?;
            p.nodes.insert(node.clone(), m);
        }
        for (node, keys) in map_of(obj.get("reported"), "reported")? {
            let keys = keys
                .as_array()
                .ok_or_else(|| format!("reported.{node}: must be an array of label keys"))?;
            let mut set = BTreeSet::new();
            for k in keys {
                let k = k
                    .as_str()
                    .ok_or_else(|| format!("reported.{node}: keys must be strings"))?;
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
    field: &str,
) -> Result<Vec<(&'a String, &'a serde_json::Value)>, String> {
    match v {
        None => Ok(Vec::new()),
        Some(v) => Ok(v
            .as_object()
            .ok_or_else(|| format!("{field}: must be an object keyed by node id"))?
            .iter()
            .collect()),
    }
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
            let e = LabelPolicy::parse(text).unwrap_err();
            assert!(e.contains(what), "{text}: {e}");
        }
    }
}
