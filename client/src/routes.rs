//! Calls that go straight to each node's owner in a replica set.
//!
//! A replica answers a call for any node by forwarding it to the node's
//! owner: a second hop, at about 0.4 of the owner's rate. A client that
//! knows the owners calls them directly. The server tells it who the
//! members are (AdminService/WatchMembers: the set now, then each
//! change); a node's owner is the member rendezvous hashing gives it
//! ([`fairplace_types::hrw`]), computed here as every replica computes it.
//!
//! A guess can be stale (a member joined, a node is moving): the replica
//! that is not the owner answers a routed call (`fairplace-routed`)
//! UNAVAILABLE with the owner's address in the trailer `fairplace-owner`
//! instead of forwarding it, and the call is made once more there. A
//! member that cannot be reached is dropped from the table until the next
//! member set, and the call is made at the node's next owner.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use fairplace_proto::v1 as pb;
use fairplace_types::hrw;
use pb::admin_service_client::AdminServiceClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

use crate::TlsOptions;

/// The metadata key that marks a routed call (the server's `ROUTED`).
pub const ROUTED: &str = "fairplace-routed";
/// The trailer naming a node's owner (the server's `OWNER_HEADER`).
pub const OWNER: &str = "fairplace-owner";

/// Lease ids remembered with their node (from AllocateCpus answers), so a
/// renewal or release goes to the node's owner; beyond this many the
/// oldest half is forgotten (those calls are forwarded, as without routes).
const LEASES_KEPT: usize = 65_536;

/// A member of the set and the channel to it.
#[derive(Clone)]
struct Member {
    id: String,
    addr: String,
    channel: Channel,
}

#[derive(Default)]
struct Table {
    members: Vec<Member>,
    /// Members that could not be reached since the last member set.
    dead: HashSet<String>,
    /// Owners learned from redirects, until the next member set.
    learned: HashMap<String, String>,
}

/// The routing table of one client.
pub struct Routes {
    tls: TlsOptions,
    table: RwLock<Table>,
    leases: Mutex<HashMap<u64, String>>,
    /// Round-robin over the members for calls that name no node.
    next: AtomicUsize,
}

/// Where one call goes.
pub struct Target {
    pub channel: Channel,
    /// The member's id (to drop it if it cannot be reached).
    pub member: Option<String>,
}

impl Routes {
    /// The table from the first member set; a task keeps it fresh from
    /// the same stream (and reconnects through `seeds` and the members).
    pub fn start(
        tls: TlsOptions,
        first: pb::ReplicaSet,
        stream: tonic::Streaming<pb::ReplicaSet>,
        seeds: Vec<String>,
    ) -> Result<Arc<Routes>, String> {
        let routes = Arc::new(Routes {
            tls,
            table: RwLock::new(Table::default()),
            leases: Mutex::new(HashMap::new()),
            next: AtomicUsize::new(0),
        });
        routes.set_members(&first)?;
        tokio::spawn(watch(Arc::downgrade(&routes), stream, seeds));
        Ok(routes)
    }

    /// Replaces the member set; channels to members that stay are kept.
    fn set_members(&self, set: &pb::ReplicaSet) -> Result<(), String> {
        if set.owner_hash != hrw::NAME {
            return Err(format!(
                "the server computes owners with {:?}, this client with {:?}",
                set.owner_hash,
                hrw::NAME
            ));
        }
        let old: HashMap<String, Channel> = self
            .read()
            .members
            .iter()
            .map(|m| (m.addr.clone(), m.channel.clone()))
            .collect();
        let mut members = Vec::with_capacity(set.members.len());
        for m in &set.members {
            let channel = match old.get(&m.addr) {
                Some(c) => c.clone(),
                None => self.connect(&m.addr)?,
            };
            members.push(Member {
                id: m.id.clone(),
                addr: m.addr.clone(),
                channel,
            });
        }
        let mut t = self.table.write().unwrap_or_else(|p| p.into_inner());
        *t = Table {
            members,
            ..Table::default()
        };
        Ok(())
    }

    fn connect(&self, addr: &str) -> Result<Channel, String> {
        Ok(self
            .tls
            .endpoint(addr)?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .connect_lazy())
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    /// The member ids, for the tests and the CLI.
    pub fn member_ids(&self) -> Vec<String> {
        self.read().members.iter().map(|m| m.id.clone()).collect()
    }

    /// Where a call for `node` goes: its owner among the members not found
    /// dead (a learned owner first); any member, in turn, for no node.
    pub fn target(&self, node: &str) -> Option<Target> {
        let t = self.read();
        // Iterated, not collected: a routed call allocates nothing here.
        let live = || t.members.iter().filter(|m| !t.dead.contains(&m.id));
        let m = if node.is_empty() {
            let n = live().count();
            live().nth(self.next.fetch_add(1, Ordering::Relaxed) % n.max(1))?
        } else if let Some(m) = t
            .learned
            .get(node)
            .and_then(|addr| t.members.iter().find(|m| &m.addr == addr))
        {
            m
        } else {
            let id = hrw::owner(live().map(|m| m.id.as_str()), node)?;
            live().find(|m| m.id == id)?
        };
        Some(Target {
            channel: m.channel.clone(),
            member: Some(m.id.clone()),
        })
    }

    /// A redirect named `addr` as `node`'s owner: the channel to it, kept
    /// for the node's later calls.
    pub fn redirected(&self, node: &str, addr: &str) -> Result<Channel, String> {
        let known = self
            .read()
            .members
            .iter()
            .find(|m| m.addr == addr)
            .map(|m| m.channel.clone());
        let channel = match known {
            Some(c) => c,
            None => self.connect(addr)?,
        };
        if !node.is_empty() {
            let mut t = self.table.write().unwrap_or_else(|p| p.into_inner());
            t.learned.insert(node.to_string(), addr.to_string());
        }
        Ok(channel)
    }

    /// Member `id` could not be reached: left out until the next member set.
    pub fn unreachable(&self, id: &str) {
        let mut t = self.table.write().unwrap_or_else(|p| p.into_inner());
        t.dead.insert(id.to_string());
        let gone: Vec<String> = t
            .members
            .iter()
            .filter(|m| m.id == id)
            .map(|m| m.addr.clone())
            .collect();
        t.learned.retain(|_, addr| !gone.contains(addr));
    }

    /// Remembers lease `id`'s node.
    pub fn lease_on(&self, id: u64, node: &str) {
        let mut l = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        if l.len() >= LEASES_KEPT {
            let drop: Vec<u64> = l.keys().take(LEASES_KEPT / 2).copied().collect();
            for k in drop {
                l.remove(&k);
            }
        }
        l.insert(id, node.to_string());
    }

    /// Lease `id`'s node, if this client granted it; forgotten when `end`.
    pub fn lease_node(&self, id: u64, end: bool) -> String {
        let mut l = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let node = l.get(&id).cloned().unwrap_or_default();
        if end {
            l.remove(&id);
        }
        node
    }
}

/// The owner's address a redirect names, if `s` is one.
pub fn owner_in(s: &Status) -> Option<String> {
    if s.code() != Code::Unavailable {
        return None;
    }
    let v = s.metadata().get(OWNER)?.to_str().ok()?;
    (!v.is_empty()).then(|| v.to_string())
}

/// Whether `s` says the member could not be reached at all.
pub fn unreachable(s: &Status) -> bool {
    let m = s.message();
    matches!(s.code(), Code::Unavailable | Code::Unknown)
        && owner_in(s).is_none()
        && (m.contains("connect error")
            || m.contains("Connection refused")
            || m.contains("transport error"))
}

/// Keeps the table fresh from the member-set stream; when it ends, opens
/// it again at a seed or a member, until the client is gone.
async fn watch(
    routes: Weak<Routes>,
    mut stream: tonic::Streaming<pb::ReplicaSet>,
    seeds: Vec<String>,
) {
    loop {
        while let Ok(Some(set)) = stream.message().await {
            let Some(r) = routes.upgrade() else { return };
            // A set this client cannot use (another hash, an address it
            // cannot parse) leaves the last table in place.
            let _ = r.set_members(&set);
        }
        stream = loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let Some(r) = routes.upgrade() else { return };
            let mut addrs: Vec<String> = r.read().members.iter().map(|m| m.addr.clone()).collect();
            addrs.extend(seeds.iter().cloned());
            if let Some(s) = open_any(&r.tls, &addrs).await {
                break s;
            }
        };
    }
}

/// The member-set stream at the first of `addrs` that answers.
async fn open_any(tls: &TlsOptions, addrs: &[String]) -> Option<tonic::Streaming<pb::ReplicaSet>> {
    for a in addrs {
        let Ok(ep) = tls.endpoint(a) else { continue };
        let Ok(Ok(ch)) = tokio::time::timeout(Duration::from_secs(2), ep.connect()).await else {
            continue;
        };
        if let Ok(s) = open(ch).await {
            return Some(s);
        }
    }
    None
}

/// WatchMembers on `channel`.
pub async fn open(channel: Channel) -> Result<tonic::Streaming<pb::ReplicaSet>, Status> {
    let mut c = AdminServiceClient::new(channel);
    let r = tokio::time::timeout(
        Duration::from_secs(3),
        c.watch_members(pb::WatchMembersRequest {}),
    )
    .await
    .map_err(|_| Status::deadline_exceeded("WatchMembers: no answer within 3 s"))??;
    Ok(r.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> pb::ReplicaSet {
        pb::ReplicaSet {
            replicated: true,
            members: ids
                .iter()
                .enumerate()
                .map(|(i, id)| pb::ReplicaMember {
                    id: id.to_string(),
                    addr: format!("127.0.0.1:{}", 1000 + i),
                })
                .collect(),
            owner_hash: hrw::NAME.into(),
            replica_id: ids[0].into(),
        }
    }

    fn routes(ids: &[&str]) -> Routes {
        let r = Routes {
            tls: TlsOptions::default(),
            table: RwLock::new(Table::default()),
            leases: Mutex::new(HashMap::new()),
            next: AtomicUsize::new(0),
        };
        r.set_members(&set(ids)).unwrap();
        r
    }

    #[tokio::test]
    async fn a_node_goes_to_its_rendezvous_owner_then_to_the_next_when_that_one_is_unreachable() {
        let r = routes(&["r0", "r1", "r2"]);
        for k in 0..50 {
            let node = format!("n{k}");
            let owner = hrw::owner(["r0", "r1", "r2"], &node).unwrap();
            assert_eq!(r.target(&node).unwrap().member.as_deref(), Some(owner));
        }
        let node = "n7";
        let first = r.target(node).unwrap().member.unwrap();
        r.unreachable(&first);
        let rest: Vec<&str> = ["r0", "r1", "r2"]
            .into_iter()
            .filter(|m| *m != first)
            .collect();
        assert_eq!(
            r.target(node).unwrap().member.as_deref(),
            hrw::owner(rest, node),
            "the next owner once the first cannot be reached"
        );
        // A new member set forgets what was found dead.
        r.set_members(&set(&["r0", "r1", "r2"])).unwrap();
        assert_eq!(r.target(node).unwrap().member.unwrap(), first);
    }

    #[tokio::test]
    async fn a_redirect_is_kept_for_the_node_and_calls_without_a_node_rotate() {
        let r = routes(&["r0", "r1", "r2"]);
        let owner = r.target("n1").unwrap().member.unwrap();
        let other = ["r0", "r1", "r2"]
            .into_iter()
            .find(|m| *m != owner)
            .unwrap();
        let addr = format!("127.0.0.1:{}", 1000 + other[1..].parse::<u16>().unwrap());
        r.redirected("n1", &addr).unwrap();
        assert_eq!(r.target("n1").unwrap().member.as_deref(), Some(other));
        let seen: HashSet<String> = (0..3)
            .map(|_| r.target("").unwrap().member.unwrap())
            .collect();
        assert_eq!(seen.len(), 3, "{seen:?}");
    }

    #[tokio::test]
    async fn another_hash_is_refused() {
        let r = routes(&["r0"]);
        let mut s = set(&["r0", "r1"]);
        s.owner_hash = "consistent-ring".into();
        let e = r.set_members(&s).unwrap_err();
        assert!(e.contains("consistent-ring"), "{e}");
        assert_eq!(r.member_ids(), ["r0"], "the last table stays");
    }

    #[test]
    fn only_an_unavailable_answer_with_the_trailer_is_a_redirect() {
        let mut s = Status::unavailable("node n is owned by replica r1");
        s.metadata_mut()
            .insert(OWNER, "10.0.0.2:50051".parse().unwrap());
        assert_eq!(owner_in(&s).as_deref(), Some("10.0.0.2:50051"));
        assert!(!unreachable(&s));
        let mut other = Status::not_found("no such node");
        other
            .metadata_mut()
            .insert(OWNER, "10.0.0.2:50051".parse().unwrap());
        assert_eq!(owner_in(&other), None);
        assert!(unreachable(&Status::unavailable(
            "tcp connect error: Connection refused"
        )));
    }
}
