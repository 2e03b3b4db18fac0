//! Sched features: the global set and per-node overrides, and the node
//! snapshots republished when they change.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use crate::engine::features::{Features, Kernel};
use crate::engine::topology::FieldError;

use super::claims::base_cpus;
use super::{Node, Store};

/// Every name in `set` is a feature: the field of the first that is not.
pub fn check_features(set: &[(String, bool)]) -> Result<(), FieldError> {
    let mut check = Features::default();
    for (k, v) in set {
        if !check.set(k, *v) {
            // A long name is quoted and cut, never echoed whole.
            let name = crate::quote::field_key(k);
            return Err(FieldError::new(format!("set.{name}"), "unknown feature"));
        }
    }
    Ok(())
}

impl Store {
    pub fn global_features(&self) -> Features {
        **self.global.load()
    }

    /// The node's overrides of the global features.
    pub fn overrides(&self, node: &Node) -> HashMap<String, bool> {
        node.writer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .overrides
            .clone()
    }

    /// Sets global features (`node = None`) or a node's overrides, and
    /// republishes the affected snapshots with the new effective features.
    pub fn set_features(
        &self,
        node: Option<&Node>,
        set: &[(String, bool)],
        clear_overrides: bool,
    ) -> Result<(), FieldError> {
        check_features(set)?;
        match node {
            None => {
                let _serial = self
                    .global_lock
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let mut g = self.global_features();
                for (k, v) in set {
                    g.set(k, *v);
                }
                self.global.store(Arc::new(g));
                for n in self.nodes() {
                    self.refresh_features(&n, None, false);
                }
            }
            Some(n) => self.refresh_features(n, Some(set), clear_overrides),
        }
        Ok(())
    }

    pub(super) fn refresh_features(
        &self,
        node: &Node,
        set: Option<&[(String, bool)]>,
        clear: bool,
    ) {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if clear {
            w.overrides.clear();
        }
        if let Some(set) = set {
            for (k, v) in set {
                w.overrides.insert(k.clone(), *v);
            }
        }
        let mut f = self.global_features();
        for (k, v) in &w.overrides {
            f.set(k, *v);
        }
        let f = kernel_features(f, w.kernel, &w.overrides);
        let cur = node.snapshot();
        let cpus = base_cpus(&cur, &w);
        let topo = Arc::clone(&cur.topo);
        self.publish(node, &mut w, cpus, topo, f, None, &cur);
    }

    /// Sets a node's kernel profile (from its registration) and republishes
    /// its state with the profile's features.
    pub fn set_kernel(&self, node: &Node, kernel: Kernel) {
        {
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.kernel == kernel && node.snapshot().features.kernel == kernel {
                return;
            }
            w.kernel = kernel;
        }
        self.refresh_features(node, None, false);
    }
}

/// The features of a node under its kernel profile: under "6.12" the two
/// switches whose default differs are off unless the node overrides them.
fn kernel_features(
    global: Features,
    kernel: Kernel,
    overrides: &HashMap<String, bool>,
) -> Features {
    let mut f = global;
    f.kernel = kernel;
    if kernel == Kernel::V6_12 {
        let d = Features::for_kernel(kernel);
        for name in ["SKIP_SCHED_IDLE_FOR_IDLE_TASK", "EXEC_BOUND_FAST_PATH"] {
            if !overrides.contains_key(name) {
                f.set(name, d.get(name).unwrap_or(false));
            }
        }
    }
    f
}
