//! The replicas' keys in etcd, under `--etcd-prefix` (default
//! `/fairplace/`). One definition of the layout, read by every part:
//!
//! | key | value | bound to |
//! |---|---|---|
//! | `members/REPLICA` | the member as JSON (id, advertise address) | the replica's etcd lease |
//! | `owners/NODE` | the owning replica's id | the owner's etcd lease |
//! | `leader/LEASE` | a campaigner's replica id (etcd's election API: the lowest create revision leads) | the campaigner's etcd lease |
//! | `leases/NODE/ID` | the lease record as JSON | nothing (durable) |
//! | `lease-ids/ID` | the lease's node | nothing |
//! | `ended/NODE/ID` | until when the tombstone is kept (ms) | nothing |
//! | `features/global` | every global switch set, JSON name -> on | nothing |
//! | `features/nodes/NODE` | the node's overrides, JSON name -> on | nothing |
//!
//! A node id may hold any printable character, `/` included, so it is
//! escaped in keys (`%` as `%25`, `/` as `%2F`): one node's prefix never
//! holds another's keys. Lease ids are 16 hex digits.

/// A node id as one key segment.
pub fn segment(node: &str) -> String {
    let mut s = String::with_capacity(node.len());
    for c in node.chars() {
        match c {
            '%' => s.push_str("%25"),
            '/' => s.push_str("%2F"),
            c => s.push(c),
        }
    }
    s
}

/// The node id a key segment names.
pub fn unsegment(seg: &str) -> String {
    seg.replace("%2F", "/").replace("%25", "%")
}

/// The layout under one prefix.
#[derive(Debug, Clone)]
pub struct Keys {
    pub prefix: String,
}

impl Keys {
    fn k(&self, rest: std::fmt::Arguments<'_>) -> Vec<u8> {
        format!("{}{rest}", self.prefix).into_bytes()
    }

    pub fn members(&self) -> Vec<u8> {
        self.k(format_args!("members/"))
    }

    pub fn member(&self, id: &str) -> Vec<u8> {
        self.k(format_args!("members/{}", segment(id)))
    }

    pub fn owners(&self) -> Vec<u8> {
        self.k(format_args!("owners/"))
    }

    pub fn owner(&self, node: &str) -> Vec<u8> {
        self.k(format_args!("owners/{}", segment(node)))
    }

    pub fn leader(&self) -> Vec<u8> {
        self.k(format_args!("leader"))
    }

    pub fn leases_of(&self, node: &str) -> Vec<u8> {
        self.k(format_args!("leases/{}/", segment(node)))
    }

    pub fn all_leases(&self) -> Vec<u8> {
        self.k(format_args!("leases/"))
    }

    pub fn lease(&self, node: &str, id: u64) -> Vec<u8> {
        self.k(format_args!("leases/{}/{id:016x}", segment(node)))
    }

    pub fn lease_id(&self, id: u64) -> Vec<u8> {
        self.k(format_args!("lease-ids/{id:016x}"))
    }

    pub fn ended_of(&self, node: &str) -> Vec<u8> {
        self.k(format_args!("ended/{}/", segment(node)))
    }

    pub fn ended(&self, node: &str, id: u64) -> Vec<u8> {
        self.k(format_args!("ended/{}/{id:016x}", segment(node)))
    }

    pub fn features(&self) -> Vec<u8> {
        self.k(format_args!("features/"))
    }

    pub fn global_features(&self) -> Vec<u8> {
        self.k(format_args!("features/global"))
    }

    pub fn nodes_features(&self) -> Vec<u8> {
        self.k(format_args!("features/nodes/"))
    }

    pub fn node_features(&self, node: &str) -> Vec<u8> {
        self.k(format_args!("features/nodes/{}", segment(node)))
    }

    /// The last segment of `key` under `dir` (a member's or node's id).
    pub fn name_in(&self, dir: &[u8], key: &[u8]) -> Option<String> {
        let rest = key.strip_prefix(dir)?;
        std::str::from_utf8(rest).ok().map(unsegment)
    }

    /// The lease id at the end of a `leases/NODE/ID` or `ended/NODE/ID` key.
    pub fn id_at_end(key: &[u8]) -> Option<u64> {
        let s = std::str::from_utf8(key).ok()?;
        u64::from_str_radix(s.rsplit('/').next()?, 16).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_prefix_holds_only_that_nodes_keys() {
        let k = Keys {
            prefix: "/fp/".into(),
        };
        let a = k.leases_of("a");
        assert!(k.lease("a", 7).starts_with(&a));
        assert!(!k.lease("a/b", 7).starts_with(&a));
        assert_eq!(unsegment(&segment("a/%2F/b")), "a/%2F/b");
        assert_eq!(Keys::id_at_end(&k.lease("x/y", 0xabc)), Some(0xabc));
        assert_eq!(
            k.name_in(&k.owners(), &k.owner("n/1")),
            Some("n/1".to_string())
        );
    }
}
