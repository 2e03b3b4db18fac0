//! Rendezvous (highest random weight) hashing: which live replica owns a
//! node. Every replica computes it alone from the same member list and gets
//! the same answer; when a member joins or leaves, only the nodes whose
//! highest weight was (or becomes) that member move, about 1/N of them.
//!
//! Shared by the server and the client library: a client given the member
//! list (WatchMembers) computes each node's owner as the replicas do and
//! calls it directly.

/// The name of this hash in the WatchMembers answer (`owner_hash`).
pub const NAME: &str = "rendezvous-fnv1a-fmix64";

/// FNV-1a over `parts` with a separator, then a 64-bit finaliser (so that
/// ids differing in one byte land far apart). Stable across processes and
/// builds: the weight is part of the replicas' protocol.
fn weight(replica: &str, node: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in replica.bytes().chain([0u8]).chain(node.bytes()) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // murmur3's fmix64.
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

/// The member of `members` with the highest weight for `node` (ties, which
/// need equal hashes, go to the smaller id); `None` when there is none.
pub fn owner<'a>(members: impl IntoIterator<Item = &'a str>, node: &str) -> Option<&'a str> {
    members
        .into_iter()
        .map(|m| (weight(m, node), m))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, m)| m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("node-{i}")).collect()
    }

    /// The weight is part of the protocol clients compute owners with
    /// (WatchMembers): these values come from an implementation written
    /// apart from this one (the Python peer's, tests/python/test_grpc.py).
    #[test]
    fn the_weight_is_the_one_other_languages_compute() {
        assert_eq!(weight("r0", "node-0"), 0xfcb4_ada2_29a6_710e);
        assert_eq!(weight("r1", "node-0"), 0xad7b_9253_2f1d_145e);
        assert_eq!(weight("r2", "scale-17"), 0xf35f_0ab6_5737_2a13);
        assert_eq!(weight("replica-a", "vm"), 0xde4b_5bd9_0f81_8a72);
    }

    #[test]
    fn every_replica_gets_a_fair_share() {
        let members = ["r0", "r1", "r2"];
        let mut count = [0usize; 3];
        for n in nodes(30_000) {
            let o = owner(members, &n).unwrap();
            count[members.iter().position(|m| *m == o).unwrap()] += 1;
        }
        for c in count {
            // 10,000 expected; binomial sd is about 82.
            assert!((9_500..10_500).contains(&c), "{count:?}");
        }
    }

    #[test]
    fn a_member_leaving_moves_only_its_own_nodes() {
        let all = ["r0", "r1", "r2", "r3"];
        let without = ["r0", "r1", "r3"];
        let mut moved = 0;
        for n in nodes(20_000) {
            let before = owner(all, &n).unwrap();
            let after = owner(without, &n).unwrap();
            if before != "r2" {
                assert_eq!(before, after, "{n} moved though its owner stayed");
            } else {
                moved += 1;
            }
        }
        // About a quarter of the nodes were r2's.
        assert!((4_500..5_500).contains(&moved), "{moved}");
    }

    #[test]
    fn a_member_joining_takes_about_one_share() {
        let before = ["r0", "r1"];
        let after = ["r0", "r1", "r2"];
        let moved = nodes(30_000)
            .iter()
            .filter(|n| owner(before, n) != owner(after, n))
            .inspect(|n| assert_eq!(owner(after, n), Some("r2")))
            .count();
        assert!((9_500..10_500).contains(&moved), "{moved}");
    }

    #[test]
    fn no_members_no_owner_and_order_does_not_matter() {
        assert_eq!(owner([], "n"), None);
        for n in nodes(100) {
            assert_eq!(owner(["a", "b", "c"], &n), owner(["c", "a", "b"], &n));
        }
    }
}
