//! Claims: a placement's chosen CPU counted as running one more task until
//! the agent's next report shows it (or the claim's TTL passes), so callers
//! deciding at the same time spread out instead of piling on one CPU.

use std::sync::{Arc, PoisonError};
use std::time::Instant;

use super::Nodes;
use crate::store::{ClaimSlot, Node, Snapshot, Writer, base_cpus};

impl Nodes {
    /// Commits a claim on `cpu` if the node is still at `version`; returns
    /// false if another writer got there first (decide again).
    pub fn try_claim(&self, node: &Node, version: u64, cpu: usize, now: Instant) -> bool {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        if cur.version != version {
            return false;
        }
        self.add_claim(node, &mut w, &cur, cpu, now);
        true
    }

    /// Counts one more task on `cpu` until its TTL, and publishes.
    fn add_claim(&self, node: &Node, w: &mut Writer, cur: &Snapshot, cpu: usize, now: Instant) {
        // A leased CPU's state without the lease (the lease stays counted).
        let base = w.leases.base_of(cpu as u32).unwrap_or(cur.state.cpus[cpu]);
        w.claims
            .entry(cpu as u32)
            .or_insert_with(|| ClaimSlot {
                base,
                expires: Vec::new(),
            })
            .expires
            .push(now + self.claim_ttl);
        if !w.listed {
            w.listed = true;
            self.claimed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .insert(node.id.clone());
        }
        let cpus = base_cpus(cur, w);
        let topo = Arc::clone(&cur.topo);
        self.table
            .publish(node, w, cpus, topo, cur.features, None, cur);
    }

    /// Decides and claims under the node's writer lock: the fallback when
    /// optimistic claims keep losing to other writers. `decide` returns the
    /// CPU to claim, or None to claim nothing.
    pub fn claim_locked<T>(
        &self,
        node: &Node,
        now: Instant,
        decide: impl FnOnce(&Snapshot) -> (T, Option<usize>),
    ) -> T {
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        let (out, cpu) = decide(&cur);
        if let Some(cpu) = cpu {
            self.add_claim(node, &mut w, &cur, cpu, now);
        }
        out
    }

    /// Drops claims whose TTL ended; returns how many expired.
    pub fn expire_claims(&self, now: Instant) -> usize {
        let mut expired = 0;
        // The nodes that took claims since; a node keeps its place in the
        // set while it still has some.
        let ids = std::mem::take(&mut *self.claimed.lock().unwrap_or_else(PoisonError::into_inner));
        let mut keep = Vec::new();
        for id in ids {
            // A forgotten or replaced node's claims no longer count.
            let Some(node) = self.table.get(&id) else {
                continue;
            };
            let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
            if w.claims.is_empty() {
                w.listed = false;
                continue;
            }
            let before: usize = w.claims.values().map(|s| s.expires.len()).sum();
            let cur = node.snapshot();
            let cpus = base_cpus(&cur, &w);
            for slot in w.claims.values_mut() {
                slot.expires.retain(|&t| t > now);
            }
            w.claims.retain(|_, s| !s.expires.is_empty());
            let after: usize = w.claims.values().map(|s| s.expires.len()).sum();
            if after != before {
                expired += before - after;
                let topo = Arc::clone(&cur.topo);
                self.table
                    .publish(&node, &mut w, cpus, topo, cur.features, None, &cur);
            }
            if w.claims.is_empty() {
                w.listed = false;
            } else {
                keep.push(id);
            }
        }
        if !keep.is_empty() {
            self.claimed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .extend(keep);
        }
        expired
    }

    /// Claims outstanding across all nodes.
    pub fn claims_outstanding(&self) -> usize {
        self.table
            .unsorted_nodes()
            .iter()
            .map(|n| {
                n.snapshot()
                    .claims
                    .iter()
                    .map(|(_, k)| *k as usize)
                    .sum::<usize>()
            })
            .sum()
    }

    /// Claims one task on each CPU listed (repeats count), publishing once.
    pub fn claim_cpus(&self, node: &Node, cpus: &[usize], now: Instant) -> u32 {
        if cpus.is_empty() {
            return 0;
        }
        let mut w = node.writer.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = node.snapshot();
        let mut n = 0;
        for &cpu in cpus {
            if cpu >= cur.state.cpus.len() || !cur.topo.online.test(cpu) {
                continue;
            }
            let base = w
                .claims
                .get(&(cpu as u32))
                .map_or(cur.state.cpus[cpu], |s| s.base);
            w.claims
                .entry(cpu as u32)
                .or_insert_with(|| ClaimSlot {
                    base,
                    expires: Vec::new(),
                })
                .expires
                .push(now + self.claim_ttl);
            n += 1;
        }
        if n == 0 {
            return 0;
        }
        let cpus = base_cpus(&cur, &w);
        let topo = std::sync::Arc::clone(&cur.topo);
        self.table
            .publish(node, &mut w, cpus, topo, cur.features, None, &cur);
        n
    }
}
