//! The nodes owner: registration, agent reports, claims, staleness and the
//! node lifecycle, and the per-node feature overrides.
//!
//! It is the one writer of the node table's membership: a node enters at
//! its registration (`ingest`) and leaves when it is forgotten, replaced or
//! let go (here); its snapshot is republished on each report, claim
//! (`claims`) and feature change. It keeps a node counted in the cluster
//! sums while it is fresh, and parks the node's leases with the lease
//! component when the node leaves (a lease outlives its registration).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::features::{Switches, kernel_features};
use super::leases::Leases;
use super::{LabelPolicy, Node, Snapshot, StoreConfig, Table};
use crate::engine::features::{Features, Kernel};
use crate::engine::topology::FieldError;

mod claims;
mod ingest;

pub use ingest::{MAX_AGENT_VERSION_BYTES, RegisterError};

/// The registered nodes and what changes them.
pub struct Nodes {
    table: Arc<Table>,
    switches: Arc<Switches>,
    leases: Arc<Leases>,
    /// Held while a new node id is checked against `max_nodes` and inserted.
    admit: Mutex<()>,
    /// Ids of the nodes that may hold claims: claim expiry visits only
    /// these, so an idle store does no per-node work for it.
    claimed: Mutex<HashSet<String>>,
    next_generation: AtomicU64,
    claim_ttl: Duration,
    forget_after: Duration,
    max_nodes: usize,
    max_node_id_bytes: usize,
    label_policy: LabelPolicy,
}

impl Nodes {
    pub(super) fn new(
        config: &StoreConfig,
        table: Arc<Table>,
        switches: Arc<Switches>,
        leases: Arc<Leases>,
    ) -> Self {
        Self {
            table,
            switches,
            leases,
            admit: Mutex::new(()),
            claimed: Mutex::new(HashSet::new()),
            next_generation: AtomicU64::new(1),
            claim_ttl: config.claim_ttl,
            forget_after: config.forget_after,
            max_nodes: config.max_nodes,
            max_node_id_bytes: config.max_node_id_bytes,
            label_policy: config.label_policy.clone(),
        }
    }

    pub fn get(&self, id: &str) -> Option<Arc<Node>> {
        self.table.get(id)
    }

    /// Every node, in no particular order (cheaper than [`Nodes::all`]).
    pub fn unsorted(&self) -> Vec<Arc<Node>> {
        self.table.unsorted_nodes()
    }

    /// Every node, by id.
    pub fn all(&self) -> Vec<Arc<Node>> {
        self.table.nodes()
    }

    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Whether `snap` is recent enough to decide on.
    pub fn is_fresh(&self, snap: &Snapshot, now: Instant) -> bool {
        self.table.is_fresh(snap, now)
    }

    /// The store's millisecond clock (balancing and cache epochs).
    pub fn now_ms(&self, now: Instant) -> u64 {
        self.table.now_ms(now)
    }

    /// Stops counting nodes that went stale; returns how many.
    pub fn uncount_stale(&self, now: Instant) -> usize {
        let mut n = 0;
        for node in self.table.unsorted_nodes() {
            // A fresh node stays counted: no lock needed to know.
            if self.table.is_fresh(&node.snapshot(), now) {
                continue;
            }
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.counted.is_some() && !self.table.is_fresh(&node.snapshot(), now) {
                self.table.recount(&node, &mut w, None);
                n += 1;
            }
        }
        n
    }

    /// Forgets nodes that have not reported for `forget_after`, whether or
    /// not a stream is still open for them: an open but silent stream does
    /// not keep its node (its next update is refused and the stream ends).
    pub fn forget_stale(&self, now: Instant) -> usize {
        let limit = self.forget_after;
        let before = self.table.nodes.len();
        self.table.nodes.retain(|_, n| {
            let s = n.snapshot();
            let since = s.reported_at.unwrap_or(n.registered_at);
            let keep = now.saturating_duration_since(since) <= limit;
            if !keep {
                self.retire(n);
            }
            keep
        });
        before - self.table.nodes.len()
    }

    /// Forgets `node` if `generation` is still its registration.
    pub fn forget(&self, node: &Node, generation: u64) {
        let removed = self.table.nodes.remove_if(&node.id, |_, n| {
            std::ptr::eq(Arc::as_ptr(n), node) && n.generation.load(Ordering::SeqCst) == generation
        });
        if let Some((_, n)) = removed {
            self.retire(&n);
        }
    }

    /// A replica handing `node` over to another (or losing its claim on
    /// it): the node leaves the store, and its leases leave memory without
    /// ending; the replicated log keeps them for the next owner. Returns
    /// how many leases were let go.
    pub fn let_go(&self, node: &str) -> usize {
        if let Some((_, n)) = self.table.nodes.remove(node) {
            self.retire(&n);
        }
        self.leases.let_go_leases(node)
    }

    /// A node leaving the store: out of the cluster sums, and its stream's
    /// registration void, so a late update is refused.
    fn retire(&self, n: &Node) {
        let mut w = n.writer.lock().unwrap_or_else(PoisonError::into_inner);
        self.table.recount(n, &mut w, None);
        // Its leases outlive the registration: parked until the node is
        // back or they expire.
        self.leases.park_leases(&n.id, &mut w);
        let g = self.next_generation.fetch_add(1, Ordering::Relaxed);
        n.generation.store(g, Ordering::SeqCst);
        n.connected.store(false, Ordering::SeqCst);
    }

    /// The stream of registration `generation` ended.
    pub fn disconnect(&self, node: &Node, generation: u64) {
        if node.generation.load(Ordering::SeqCst) == generation {
            node.connected.store(false, Ordering::SeqCst);
        }
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
        super::features::check_features(set)?;
        match node {
            None => self.switches.update(set, || {
                for n in self.table.nodes() {
                    self.refresh_features(&n, None, false);
                }
            }),
            Some(n) => self.refresh_features(n, Some(set), clear_overrides),
        }
        Ok(())
    }

    /// Republishes `node` with its effective features: the global set, its
    /// overrides after `set` (cleared first with `clear`), its kernel's.
    fn refresh_features(&self, node: &Node, set: Option<&[(String, bool)]>, clear: bool) {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        if clear {
            w.overrides.clear();
        }
        if let Some(set) = set {
            for (k, v) in set {
                w.overrides.insert(k.clone(), *v);
            }
        }
        let f = self.effective_features(&w.overrides, w.kernel);
        let cur = node.snapshot();
        self.table.republish(node, &mut w, &cur, f);
    }

    /// The global features with `overrides` and the kernel profile's.
    fn effective_features(&self, overrides: &HashMap<String, bool>, kernel: Kernel) -> Features {
        let mut f = self.switches.global();
        for (k, v) in overrides {
            f.set(k, *v);
        }
        kernel_features(f, kernel, overrides)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::decision::Kind;
    use crate::engine::state::CpuState;
    use crate::engine::topology::CpuTopo;
    use crate::engine::topology::TopologySpec;
    use crate::store::{DEFAULT_MAX_NODE_ID_BYTES, Reject, Store, StoreConfig, Update};

    fn spec(n: u32) -> TopologySpec {
        TopologySpec {
            cpus: (0..n)
                .map(|i| CpuTopo {
                    core: i / 2,
                    cluster: None,
                    llc: 0,
                    node: 0,
                    capacity: 1024,
                })
                .collect(),
            numa_distance: None,
        }
    }

    fn full(n: u32, seq: u64, busy: &[u32]) -> Update {
        Update {
            seq,
            full: true,
            cpus: (0..n)
                .map(|i| {
                    let mut c = CpuState::idle(1024);
                    if busy.contains(&i) {
                        c.nr_running = 1;
                        c.curr_is_idle = false;
                    }
                    (i, c)
                })
                .collect(),
            ..Update::default()
        }
    }

    #[test]
    fn deltas_must_follow_a_full_snapshot_in_sequence() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        let delta = |seq| Update {
            seq,
            full: false,
            cpus: vec![(1, CpuState::idle(1024))],
            ..Update::default()
        };
        assert!(matches!(
            s.nodes.apply(&n, g, &delta(1), now),
            Err(Reject::OutOfSequence { .. })
        ));
        assert_eq!(s.nodes.apply(&n, g, &full(4, 7, &[0]), now), Ok(2));
        assert!(matches!(
            s.nodes.apply(&n, g, &delta(9), now),
            Err(Reject::OutOfSequence {
                expected: 8,
                got: 9
            })
        ));
        assert!(s.nodes.apply(&n, g, &delta(8), now).is_ok());
        assert_eq!(n.last_seq(), 8);
    }

    #[test]
    fn a_rejected_update_leaves_the_state_unchanged() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        s.nodes.apply(&n, g, &full(4, 1, &[2]), now).unwrap();
        let before = n.snapshot();
        let mut bad = CpuState::idle(1024);
        bad.h_nr_idle = 3;
        let u = Update {
            seq: 2,
            full: false,
            cpus: vec![(0, CpuState::idle(1024)), (3, bad)],
            ..Update::default()
        };
        match s.nodes.apply(&n, g, &u, now) {
            Err(Reject::Invalid(e)) => assert_eq!(e.field, "update.cpus[1].h_nr_idle"),
            other => panic!("{other:?}"),
        }
        let after = n.snapshot();
        assert_eq!(before.version, after.version);
        assert_eq!(before.state.cpus, after.state.cpus);
        // A full snapshot that misses a CPU is refused too.
        let mut u = full(4, 2, &[]);
        u.cpus.pop();
        assert!(matches!(
            s.nodes.apply(&n, g, &u, now),
            Err(Reject::Invalid(_))
        ));
        assert_eq!(n.last_seq(), 1);
    }

    #[test]
    fn claims_count_until_a_report_or_the_ttl() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        s.nodes.apply(&n, g, &full(4, 1, &[]), now).unwrap();
        let v = n.snapshot().version;
        assert!(s.nodes.try_claim(&n, v, 2, now));
        assert!(
            !s.nodes.try_claim(&n, v, 3, now),
            "a stale version must decide again"
        );
        let snap = n.snapshot();
        assert_eq!(snap.state.cpus[2].nr_running, 1);
        assert!(!snap.state.cpus[2].idle_cpu());
        assert_eq!(snap.claims, vec![(2, 1)]);
        // A report of another CPU keeps the claim; a report of CPU 2 ends it.
        s.nodes
            .apply(
                &n,
                g,
                &Update {
                    seq: 2,
                    full: false,
                    cpus: vec![(1, CpuState::idle(1024))],
                    ..Update::default()
                },
                now,
            )
            .unwrap();
        assert_eq!(n.snapshot().state.cpus[2].nr_running, 1);
        s.nodes
            .apply(
                &n,
                g,
                &Update {
                    seq: 3,
                    full: false,
                    cpus: vec![(2, CpuState::idle(1024))],
                    ..Update::default()
                },
                now,
            )
            .unwrap();
        assert_eq!(n.snapshot().state.cpus[2].nr_running, 0);
        // Expiry.
        let v = n.snapshot().version;
        assert!(s.nodes.try_claim(&n, v, 0, now));
        assert_eq!(s.nodes.expire_claims(now), 0);
        assert_eq!(s.nodes.expire_claims(now + Duration::from_secs(1)), 1);
        assert!(n.snapshot().state.cpus[0].idle_cpu());
    }

    #[test]
    fn a_claim_decided_under_the_writer_counts_like_an_optimistic_one() {
        let s = Store::new(StoreConfig::default());
        let (n, g) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        s.nodes.apply(&n, g, &full(4, 1, &[]), now).unwrap();
        let seen = s.nodes.claim_locked(&n, now, |cur| (cur.version, Some(3)));
        let snap = n.snapshot();
        assert_eq!(snap.version, seen + 1);
        assert_eq!(snap.claims, vec![(3, 1)]);
        assert!(!snap.state.cpus[3].idle_cpu());
        // Claiming nothing publishes nothing.
        s.nodes.claim_locked(&n, now, |_| ((), None));
        assert_eq!(n.snapshot().version, snap.version);
    }

    #[test]
    fn nodes_of_one_machine_type_share_the_domain_tree() {
        let s = Store::new(StoreConfig::default());
        let (a, _) = s.nodes.register("a", vec![], "t".into(), spec(8)).unwrap();
        let (b, _) = s.nodes.register("b", vec![], "t".into(), spec(8)).unwrap();
        assert!(Arc::ptr_eq(&a.snapshot().topo, &b.snapshot().topo));
    }

    #[test]
    fn a_new_registration_supersedes_the_old_stream() {
        let s = Store::new(StoreConfig::default());
        let (n, g1) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let (_, g2) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let now = Instant::now();
        assert_eq!(
            s.nodes.apply(&n, g1, &full(4, 1, &[]), now),
            Err(Reject::Superseded)
        );
        assert!(s.nodes.apply(&n, g2, &full(4, 1, &[]), now).is_ok());
    }

    #[test]
    fn new_ids_beyond_max_nodes_are_refused_but_re_registration_works() {
        let s = Store::new(StoreConfig {
            max_nodes: 2,
            ..StoreConfig::default()
        });
        s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let (b, _) = s.nodes.register("b", vec![], "t".into(), spec(4)).unwrap();
        b.count_decision(Kind::Fork);
        let full_err = s
            .nodes
            .register("c", vec![], "t".into(), spec(4))
            .err()
            .expect("refused");
        assert_eq!(full_err, RegisterError::Full { max: 2 });
        assert_eq!(full_err.reason(), "too_many_nodes");
        assert!(full_err.to_string().contains("--max-nodes"), "{full_err}");
        // The same topology, and a new one: both are the same node id.
        s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        let (b2, _) = s.nodes.register("b", vec![], "t".into(), spec(8)).unwrap();
        assert_eq!(b2.decisions()[1], (Kind::Fork, 1), "counts carry over");
        assert_eq!(s.nodes.len(), 2);
        // A forgotten node makes room.
        s.nodes
            .forget_stale(Instant::now() + Duration::from_secs(3600));
        s.nodes.register("c", vec![], "t".into(), spec(4)).unwrap();
    }

    #[test]
    fn node_ids_are_bounded_and_refusals_quote_a_short_prefix() {
        let s = Store::new(StoreConfig::default());
        let ok = "n".repeat(DEFAULT_MAX_NODE_ID_BYTES);
        s.nodes.register(&ok, vec![], "t".into(), spec(2)).unwrap();
        let long = "n".repeat(1 << 20);
        match s.nodes.register(&long, vec![], "t".into(), spec(2)).err() {
            Some(RegisterError::Invalid(e)) => {
                assert_eq!(e.field, "register.node_id");
                assert!(e.msg.len() < 200, "{}", e.msg);
                assert!(e.msg.contains("(1048576 bytes)"), "{}", e.msg);
            }
            other => panic!("{other:?}"),
        }
        for bad in ["", "a\nb", "tab\there"] {
            assert!(
                matches!(
                    s.nodes.register(bad, vec![], "t".into(), spec(2)).err(),
                    Some(RegisterError::Invalid(_))
                ),
                "{bad:?}"
            );
        }
        assert_eq!(s.nodes.len(), 1);
    }

    #[test]
    fn claim_expiry_visits_only_nodes_with_claims() {
        let s = Store::new(StoreConfig::default());
        let now = Instant::now();
        let (a, g) = s.nodes.register("a", vec![], "t".into(), spec(4)).unwrap();
        s.nodes.apply(&a, g, &full(4, 1, &[]), now).unwrap();
        s.nodes.register("b", vec![], "t".into(), spec(4)).unwrap();
        assert!(s.nodes.claimed.lock().unwrap().is_empty());
        assert!(s.nodes.try_claim(&a, a.snapshot().version, 1, now));
        assert_eq!(s.nodes.claimed.lock().unwrap().len(), 1);
        assert_eq!(s.nodes.expire_claims(now), 0);
        assert_eq!(
            s.nodes.claimed.lock().unwrap().len(),
            1,
            "still has a claim"
        );
        assert_eq!(s.nodes.expire_claims(now + Duration::from_secs(1)), 1);
        assert!(s.nodes.claimed.lock().unwrap().is_empty());
        // A claim taken again after expiry is listed again.
        assert!(s.nodes.try_claim(&a, a.snapshot().version, 2, now));
        assert_eq!(s.nodes.claims_outstanding(), 1);
        assert_eq!(s.nodes.expire_claims(now + Duration::from_secs(1)), 1);
        assert_eq!(s.nodes.claims_outstanding(), 0);
    }
}
