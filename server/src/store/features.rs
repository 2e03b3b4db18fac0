//! The feature switches: the global set every node starts from, changed
//! as one step (read, modify, store), and the check of a set's names. A
//! node's own overrides and kernel profile live with the node (`nodes/`),
//! which republishes the affected snapshots when either changes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;

use crate::engine::features::{Features, Kernel};
use crate::engine::topology::FieldError;

/// The global feature set.
#[derive(Default)]
pub struct Switches {
    global: ArcSwap<Features>,
    /// Serialises changes of the global set (read, modify, store, and the
    /// republishing that follows).
    lock: Mutex<()>,
}

impl Switches {
    /// The global set now.
    pub fn global(&self) -> Features {
        **self.global.load()
    }

    /// Applies `set` to the global set, then runs `republish` before the
    /// next change may start (so nodes see the changes in order).
    pub fn update(&self, set: &[(String, bool)], republish: impl FnOnce()) {
        let _serial = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let mut g = self.global();
        for (k, v) in set {
            g.set(k, *v);
        }
        self.global.store(Arc::new(g));
        republish();
    }
}

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

/// The features of a node under its kernel profile: under "6.12" the two
/// switches whose default differs are off unless the node overrides them.
pub fn kernel_features(
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
