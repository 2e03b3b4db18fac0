//! Feature switches (`SetFeatures`) across the replica set: one answer
//! wherever it is asked, and a node's overrides that follow it to its next
//! owner.
//!
//! Both live in etcd, with no etcd lease (they outlive every replica):
//! - `features/global`: every global switch ever set, as a JSON object of
//!   name -> on. A change is a read-modify-write that commits only if the
//!   key is unchanged since it was read, so two SetFeatures on two
//!   replicas at once both land.
//! - `features/nodes/NODE`: the node's overrides, written by its owner.
//!
//! Every replica watches both and applies them to its store: the global set
//! to every node it holds, a node's overrides when it holds that node, and
//! again when the node registers here after a handover
//! ([`Replica::node_overrides`]). The replica that took the call has
//! already applied the change before it answers, so the caller reads its
//! own write there; the others follow within one watch event.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::etcd as pb;

use super::etcd::{self, EtcdError};
use super::{Replica, observe_etcd};
use crate::store::Store;

/// A set of switches, name -> on, in name order.
pub type Switches = BTreeMap<String, bool>;

/// Read-modify-write attempts of the global set before giving up.
const CAS_ATTEMPTS: usize = 8;

fn decode(value: &[u8]) -> Switches {
    serde_json::from_slice(value).unwrap_or_default()
}

fn as_list(s: &Switches) -> Vec<(String, bool)> {
    s.iter().map(|(k, v)| (k.clone(), *v)).collect()
}

impl Replica {
    /// Merges `set` into the global switches in etcd; the whole set after
    /// the change.
    pub async fn set_global_features(&self, set: &[(String, bool)]) -> Result<Switches, EtcdError> {
        let key = self.keys.global_features();
        for _ in 0..CAS_ATTEMPTS {
            let t0 = Instant::now();
            let cur = self.etcd.get(&key).await?;
            let (mut all, guard) = match &cur {
                Some(kv) => (
                    decode(&kv.value),
                    etcd::unchanged(key.clone(), kv.mod_revision),
                ),
                None => (Switches::new(), etcd::absent(key.clone())),
            };
            for (k, v) in set {
                all.insert(k.clone(), *v);
            }
            let value = serde_json::to_vec(&all).expect("a map of bools serialises");
            let r = self
                .etcd
                .txn(vec![guard], vec![etcd::put(key.clone(), value, 0)], vec![])
                .await?;
            observe_etcd("features", t0);
            if r.succeeded {
                return Ok(all);
            }
        }
        Err(EtcdError(
            "the global features changed under every attempt; retry".into(),
        ))
    }

    /// Writes `node`'s overrides to etcd (none: the key is deleted), for
    /// whichever replica holds the node next.
    pub async fn put_node_features(&self, node: &str, over: &Switches) -> Result<(), EtcdError> {
        let t0 = Instant::now();
        let key = self.keys.node_features(node);
        let op = if over.is_empty() {
            etcd::delete(key)
        } else {
            let value = serde_json::to_vec(over).expect("a map of bools serialises");
            etcd::put(key, value, 0)
        };
        self.etcd.txn(vec![], vec![op], vec![]).await?;
        observe_etcd("features", t0);
        self.node_features.insert(node.to_string(), over.clone());
        Ok(())
    }

    /// `node`'s overrides as etcd holds them (watched), if it has any.
    pub fn node_overrides(&self, node: &str) -> Option<Vec<(String, bool)>> {
        self.node_features.get(node).map(|s| as_list(&s))
    }

    /// Applies the switches in etcd to `store`, and every change after.
    pub(super) async fn follow_features(self: Arc<Self>, store: Arc<Store>) {
        let prefix = self.keys.features();
        loop {
            let rev = match self.etcd.range_prefix(&prefix).await {
                Ok((kvs, rev)) => {
                    for kv in kvs {
                        self.apply_features(&store, &kv.key, Some(&kv.value));
                    }
                    rev
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reading the feature switches failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            let Ok(mut events) = self.etcd.watch_prefix(&prefix, rev + 1).await else {
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            };
            while let Some(batch) = events.recv().await {
                for ev in batch {
                    let Some(kv) = ev.kv else { continue };
                    let deleted = ev.r#type == pb::event::EventType::Delete as i32;
                    self.apply_features(&store, &kv.key, (!deleted).then_some(&kv.value));
                }
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// One key of `features/`: the global set, or a node's overrides
    /// (`None`: deleted).
    fn apply_features(&self, store: &Store, key: &[u8], value: Option<&Vec<u8>>) {
        if key == self.keys.global_features().as_slice() {
            let all = value.map(|v| decode(v)).unwrap_or_default();
            // Names this build does not know (a newer replica's) are left
            // out rather than refusing the whole set.
            let known: Vec<(String, bool)> = as_list(&all)
                .into_iter()
                .filter(|(k, _)| {
                    crate::engine::features::Features::default()
                        .get(k)
                        .is_some()
                })
                .collect();
            if let Err(e) = store.nodes.set_features(None, &known, false) {
                tracing::warn!(error = %e, "the global features in etcd do not apply");
            }
            return;
        }
        let Some(node) = self.keys.name_in(&self.keys.nodes_features(), key) else {
            return;
        };
        let over = value.map(|v| decode(v)).unwrap_or_default();
        if over.is_empty() {
            self.node_features.remove(&node);
        } else {
            self.node_features.insert(node.clone(), over.clone());
        }
        if let Some(n) = store.nodes.get(&node) {
            let _ = store.nodes.set_features(Some(&n), &as_list(&over), true);
        }
    }
}
