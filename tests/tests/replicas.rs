//! Replicas on a real etcd: three `fairplace-server serve --etcd-endpoints`
//! on a three-member etcd cluster (Debian's `etcd`), simulated agents and
//! orchestrator clients, and the failures the replicas exist for: a replica
//! killed under load, an etcd member lost, a quorum lost, a replica frozen
//! past its etcd lease.
//!
//! What every test reads back is real: the keys in etcd (owners, leases),
//! each replica's /metrics, and what the agents' nodes answer.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use fairplace_e2e::etcd::{EtcdCluster, etcd_or_skip};
use fairplace_e2e::{Agent, Server, free_port, http_get, rt, send_signal};
use fairplace_proto::v1 as pb;
use fairplace_proto::v1::admin_service_client::AdminServiceClient;
use fairplace_proto::v1::placement_service_client::PlacementServiceClient;
use tonic::transport::Channel;

/// The etcd lease TTL the replicas run with (s): a killed replica's nodes
/// move within it.
const TTL_S: &str = "2";

struct Rig {
    etcd: EtcdCluster,
    addrs: Vec<String>,
    /// Flags every replica gets on top of the rig's own.
    extra: Vec<String>,
    /// Replicas that reach etcd through links of the test's own, by index:
    /// their `--etcd-endpoints`.
    via: HashMap<usize, String>,
    replicas: Vec<Option<Server>>,
    agents: Vec<Agent>,
}

impl Rig {
    async fn start(bin: &str, replicas: usize) -> Rig {
        Rig::start_with(bin, replicas, &[]).await
    }

    async fn start_with(bin: &str, replicas: usize, extra: &[&str]) -> Rig {
        let etcd = EtcdCluster::start(bin, 3);
        etcd.wait_healthy(Duration::from_secs(20)).await;
        let addrs: Vec<String> = (0..replicas)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
        let mut rig = Rig {
            etcd,
            addrs,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            via: HashMap::new(),
            replicas: Vec::new(),
            agents: Vec::new(),
        };
        for i in 0..replicas {
            let s = rig.spawn_replica(i);
            rig.replicas.push(Some(s));
        }
        rig
    }

    fn spawn_replica(&self, i: usize) -> Server {
        let eps = self
            .via
            .get(&i)
            .cloned()
            .unwrap_or_else(|| self.etcd.endpoints());
        let id = format!("r{i}");
        let mut args = vec![
            "--grpc-addr",
            &self.addrs[i],
            "--etcd-endpoints",
            &eps,
            "--replica-id",
            &id,
            "--etcd-lease-ttl-s",
            TTL_S,
            "--stale-after-ms",
            "2000",
        ];
        args.extend(self.extra.iter().map(String::as_str));
        Server::start(&args)
    }

    /// `n` simulated nodes of `cpus` CPUs, reporting every 200 ms, told
    /// every replica's address.
    fn simulate(&mut self, name: &str, n: u32, cpus: u32) {
        let servers = self.addrs.join(",");
        let (n, cpus) = (n.to_string(), cpus.to_string());
        self.agents.push(Agent::start(
            &servers,
            &[
                "--node-id",
                name,
                "--simulate",
                &n,
                "--simulate-cpus",
                &cpus,
                "--interval-ms",
                "200",
                "--label",
                "zone=z1",
            ],
        ));
    }

    /// The real agent, reading this machine as node `real` (zone z1),
    /// told every replica; it may apply pid leases to any process here
    /// (the test's own).
    fn real_agent(&mut self) {
        let servers = self.addrs.join(",");
        self.agents.push(Agent::start(
            &servers,
            &[
                "--node-id",
                "real",
                "--interval-ms",
                "200",
                "--label",
                "zone=z1",
                "--apply-cgroup-root",
                "/sys/fs/cgroup",
            ],
        ));
    }

    fn channel(&self, i: usize) -> Channel {
        tonic::transport::Endpoint::from_shared(format!("http://{}", self.addrs[i]))
            .unwrap()
            .connect_timeout(Duration::from_millis(500))
            .timeout(Duration::from_secs(3))
            .connect_lazy()
    }

    fn placement(&self, i: usize) -> PlacementServiceClient<Channel> {
        PlacementServiceClient::new(self.channel(i))
    }

    fn admin(&self, i: usize) -> AdminServiceClient<Channel> {
        AdminServiceClient::new(self.channel(i))
    }

    fn metrics(&self, i: usize) -> String {
        let s = self.replicas[i].as_ref().expect("replica running");
        http_get(&s.metrics)
    }

    /// A gauge's value at replica `i`.
    fn gauge(&self, i: usize, name: &str) -> f64 {
        let text = self.metrics(i);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| {
                let ours: Vec<&str> = text.lines().filter(|l| l.contains("replica")).collect();
                panic!("no {name} at replica {i}: {ours:#?}")
            })
    }

    /// grpc.health.v1 status of `service` at replica `i` (1 SERVING,
    /// 2 NOT_SERVING).
    async fn health(&self, i: usize, service: &str) -> i32 {
        tonic_health::pb::health_client::HealthClient::new(self.channel(i))
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("health check of {service:?} at r{i}: {e}"))
            .into_inner()
            .status
    }

    /// The nodes ListNodes at replica `i` shows fresh.
    async fn fresh_nodes(&self, i: usize) -> usize {
        match self.admin(i).list_nodes(pb::ListNodesRequest {}).await {
            Ok(r) => r.into_inner().nodes.iter().filter(|n| n.fresh).count(),
            Err(_) => 0,
        }
    }

    async fn wait_fresh(&self, i: usize, n: usize, limit: Duration) -> Duration {
        let t0 = Instant::now();
        loop {
            let f = self.fresh_nodes(i).await;
            if f >= n {
                return t0.elapsed();
            }
            assert!(
                t0.elapsed() < limit,
                "only {f} of {n} nodes fresh at replica r{i} after {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The owner keys in etcd: node -> replica.
    async fn owners(&self) -> BTreeMap<String, String> {
        self.etcd
            .range_prefix("/fairplace/owners/")
            .await
            .into_iter()
            .map(|(k, v)| (k.trim_start_matches("/fairplace/owners/").to_string(), v))
            .collect()
    }

    /// The lease records in etcd.
    async fn leases(&self) -> Vec<serde_json::Value> {
        self.etcd
            .range_prefix("/fairplace/leases/")
            .await
            .into_iter()
            .map(|(_, v)| serde_json::from_str(&v).expect("a lease record is JSON"))
            .collect()
    }
}

/// No CPU is in two live leases of one node (from etcd's records).
fn assert_no_cpu_twice(leases: &[serde_json::Value]) {
    let mut held: HashMap<(String, u32), u64> = HashMap::new();
    for l in leases {
        let node = l["node"].as_str().unwrap().to_string();
        let id = l["id"].as_u64().unwrap();
        for cpu in fairplace::engine::cpumask::CpuMask::parse_cpulist(
            l["cpus"].as_str().unwrap(),
            fairplace::engine::cpumask::MAX_CPUS,
        )
        .unwrap()
        .iter()
        {
            if let Some(other) = held.insert((node.clone(), cpu as u32), id) {
                panic!("CPU {cpu} of {node} is in leases {other} and {id}");
            }
        }
    }
}

fn node(name: &str, i: u32) -> String {
    format!("{name}-sim-{i}")
}

#[test]
fn three_replicas_share_the_nodes_and_answer_for_each_other() {
    let Some(bin) = etcd_or_skip("three_replicas_share_the_nodes_and_answer_for_each_other") else {
        return;
    };
    rt().block_on(async {
        let mut rig = Rig::start(&bin, 3).await;
        rig.simulate("share", 60, 8);
        rig.wait_fresh(0, 60, Duration::from_secs(20)).await;
        let owners = every_replica_owns_a_share(&rig).await;
        each_replica_places_on_every_node(&rig).await;
        cluster_placement_reaches_every_replicas_nodes(&rig, &owners).await;
        a_lease_is_routed_between_replicas(&rig, &owners).await;
        forwards_are_counted_and_one_replica_leads(&rig).await;
        a_cluster_balance_runs_on_the_leader(&rig).await;
        a_routing_client_calls_each_owner_and_nothing_is_forwarded(&rig, &owners).await;
    });
}

/// A counter's total over its series at replica `i`.
fn counter_sum(rig: &Rig, i: usize, name: &str) -> f64 {
    rig.metrics(i)
        .lines()
        .filter(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} ")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A client given the three addresses learns the set (WatchMembers) and
/// sends every node call to the node's owner: PickCpu, GetNode and a
/// lease's life on every node, and not one call is forwarded; a routed
/// call that reaches another replica is answered with the owner's address
/// instead of a forward.
async fn a_routing_client_calls_each_owner_and_nothing_is_forwarded(
    rig: &Rig,
    owners: &BTreeMap<String, String>,
) {
    let addrs: Vec<String> = rig.addrs.clone();
    let c = fairplace_client::Client::connect_routed(&addrs, &Default::default())
        .await
        .expect("a routing client");
    assert_eq!(c.members(), ["r0", "r1", "r2"]);
    let forwards_before: f64 = (0..3)
        .map(|i| counter_sum(rig, i, "fairplace_replica_forwards_total"))
        .sum();
    let decisions_before: Vec<f64> = (0..3)
        .map(|i| counter_sum(rig, i, "fairplace_decisions_total"))
        .collect();
    let mut per_owner: HashMap<String, f64> = HashMap::new();
    for k in 0..60 {
        let n = node("share", k);
        let r = c
            .pick_cpu(pb::PickCpuRequest {
                node_id: n.clone(),
                kind: pb::RequestKind::Fork as i32,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("routed PickCpu {n}: {e}"));
        assert_eq!(r.node_id, n);
        *per_owner.entry(owners[&n].clone()).or_default() += 1.0;
        c.get_node(&n)
            .await
            .unwrap_or_else(|e| panic!("routed GetNode {n}: {e}"));
        if k % 6 == 0 {
            let g = c
                .allocate_cpus(pb::AllocateCpusRequest {
                    node_id: n.clone(),
                    count: 1,
                    holder: "routed".into(),
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("routed AllocateCpus {n}: {e}"));
            c.renew_lease(g.lease_id, 0)
                .await
                .expect("routed RenewLease");
            c.release_cpus(g.lease_id)
                .await
                .expect("routed ReleaseCpus");
        }
    }
    // PickCpus: one stream per owner, the answers in the order asked.
    let batch: Vec<pb::PickCpuRequest> = (0..60)
        .map(|k| pb::PickCpuRequest {
            node_id: node("share", k),
            kind: pb::RequestKind::Fork as i32,
            ..Default::default()
        })
        .collect();
    let answers = c.pick_cpus(batch).await.expect("routed PickCpus");
    for (k, a) in answers.iter().enumerate() {
        let a = a
            .as_ref()
            .unwrap_or_else(|e| panic!("PickCpus answer {k}: {e}"));
        assert_eq!(
            a.node_id,
            node("share", k as u32),
            "answers in the order asked"
        );
    }
    let forwards_after: f64 = (0..3)
        .map(|i| counter_sum(rig, i, "fairplace_replica_forwards_total"))
        .sum();
    assert_eq!(
        forwards_after, forwards_before,
        "a routing client's call went through a forward"
    );
    for (i, before) in decisions_before.iter().enumerate() {
        let placed = counter_sum(rig, i, "fairplace_decisions_total") - before;
        let owned = per_owner.get(&format!("r{i}")).copied().unwrap_or(0.0);
        assert!(
            placed >= owned,
            "r{i} decided {placed}, owns nodes asked {owned} times"
        );
    }
    // The protocol under it: a routed call at a replica that does not own
    // the node names the owner, and is not forwarded.
    let (n, owner) = owners.iter().next().unwrap();
    let other = (0..3).find(|i| format!("r{i}") != *owner).unwrap();
    let mut req = tonic::Request::new(pb::PickCpuRequest {
        node_id: n.clone(),
        kind: pb::RequestKind::Fork as i32,
        ..Default::default()
    });
    req.metadata_mut()
        .insert("fairplace-routed", "1".parse().unwrap());
    let e = rig
        .placement(other)
        .pick_cpu(req)
        .await
        .expect_err("answered by a non-owner");
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
    let i: usize = owner[1..].parse().unwrap();
    assert_eq!(
        e.metadata()
            .get("fairplace-owner")
            .and_then(|v| v.to_str().ok()),
        Some(rig.addrs[i].as_str()),
        "the redirect names the owner: {e}"
    );
    assert_eq!(
        (0..3)
            .map(|i| counter_sum(rig, i, "fairplace_replica_forwards_total"))
            .sum::<f64>(),
        forwards_after
    );
    a_routing_client_outlives_a_member(rig, owners, &c).await;
}

/// A member killed (-9): the client finds it unreachable, sends its nodes'
/// calls to their next owners, and its member set shrinks.
async fn a_routing_client_outlives_a_member(
    rig: &Rig,
    owners: &BTreeMap<String, String>,
    c: &fairplace_client::Client,
) {
    send_signal(rig.replicas[2].as_ref().unwrap().pid(), 9);
    let t0 = Instant::now();
    for n in owners.iter().filter(|(_, o)| *o == "r2").map(|(n, _)| n) {
        loop {
            let r = c
                .pick_cpu(pb::PickCpuRequest {
                    node_id: n.clone(),
                    kind: pb::RequestKind::Fork as i32,
                    ..Default::default()
                })
                .await;
            match r {
                Ok(r) => {
                    assert_eq!(&r.node_id, n);
                    break;
                }
                Err(e) => {
                    assert!(
                        t0.elapsed() < Duration::from_secs(30),
                        "{n} never placed after r2 died: {e}"
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
    while c.members() != ["r0", "r1"] {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the client still routes over {:?}",
            c.members()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "r2 killed: its nodes placed at their next owners, the set shrunk, in {:?}",
        t0.elapsed()
    );
}

/// Every node has one owner key (once the start-up hand-overs, as the
/// replicas joined one after the other, are over), and every replica owns
/// a share, as its gauges say; the owners by node.
async fn every_replica_owns_a_share(rig: &Rig) -> BTreeMap<String, String> {
    let t0 = Instant::now();
    let owners = loop {
        let o = rig.owners().await;
        if o.len() == 60 || t0.elapsed() > Duration::from_secs(10) {
            break o;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(owners.len(), 60, "{owners:?}");
    let mut per: HashMap<&str, usize> = HashMap::new();
    for r in owners.values() {
        *per.entry(r.as_str()).or_default() += 1;
    }
    for r in ["r0", "r1", "r2"] {
        let n = per.get(r).copied().unwrap_or(0);
        assert!((8..=35).contains(&n), "{r} owns {n} of 60: {per:?}");
        let i: usize = r[1..].parse().unwrap();
        assert_eq!(rig.gauge(i, "fairplace_replica_owned_nodes") as usize, n);
        assert_eq!(rig.gauge(i, "fairplace_replica_members"), 3.0);
    }
    owners
}

/// Each replica answers PickCpu for every node: its own, and the others'
/// through their owners.
async fn each_replica_places_on_every_node(rig: &Rig) {
    for i in 0..3 {
        let mut p = rig.placement(i);
        for k in 0..60 {
            let r = p
                .pick_cpu(pb::PickCpuRequest {
                    node_id: node("share", k),
                    kind: pb::RequestKind::Fork as i32,
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("r{i} PickCpu {}: {e}", node("share", k)))
                .into_inner();
            assert_eq!(r.node_id, node("share", k));
        }
    }
}

/// With no node, each replica chooses among every replica's nodes (their
/// owners publish their aggregates) and the owner places: PickCpu and
/// AllocateCpus.
async fn cluster_placement_reaches_every_replicas_nodes(
    rig: &Rig,
    owners: &BTreeMap<String, String>,
) {
    tokio::time::sleep(Duration::from_millis(500)).await;
    for i in 0..3 {
        let me = format!("r{i}");
        let mut elsewhere = 0;
        for _ in 0..30 {
            let r = rig
                .placement(i)
                .pick_cpu(pb::PickCpuRequest {
                    kind: pb::RequestKind::Fork as i32,
                    claim: true,
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("r{i} PickCpu with no node: {e}"))
                .into_inner();
            let owner = owners.get(&r.node_id).expect("a known node");
            if *owner != me {
                elsewhere += 1;
            }
        }
        assert!(elsewhere > 0, "{me} chose only its own nodes");
        let a = rig
            .placement(i)
            .allocate_cpus(pb::AllocateCpusRequest {
                count: 1,
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("r{i} AllocateCpus with no node: {e}"))
            .into_inner();
        assert!(owners.contains_key(&a.node_id));
    }
}

/// A lease taken at one replica for a node another owns, seen at a third,
/// renewed and released at others; in etcd while it lives.
async fn a_lease_is_routed_between_replicas(rig: &Rig, owners: &BTreeMap<String, String>) {
    let (n, owner) = owners.iter().find(|(_, o)| *o == "r2").unwrap();
    let l = rig
        .placement(0)
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: n.clone(),
            count: 2,
            holder: "t".into(),
            ..Default::default()
        })
        .await
        .expect("AllocateCpus forwarded to the owner")
        .into_inner();
    assert_eq!(owner, "r2");
    let g = rig
        .admin(1)
        .get_node(pb::GetNodeRequest { node_id: n.clone() })
        .await
        .unwrap()
        .into_inner();
    assert!(
        g.leases
            .iter()
            .any(|x| x.lease_id == l.lease_id && x.cpus == l.cpus),
        "GetNode at r1 shows the lease: {:?}",
        g.leases
    );
    let in_etcd = rig.leases().await;
    assert!(in_etcd.iter().any(|r| r["id"].as_u64() == Some(l.lease_id)));
    rig.placement(1)
        .renew_lease(pb::RenewLeaseRequest {
            lease_id: l.lease_id,
            ttl_ms: 60_000,
        })
        .await
        .expect("RenewLease routed by lease id");
    rig.placement(0)
        .release_cpus(pb::ReleaseCpusRequest {
            lease_id: l.lease_id,
        })
        .await
        .expect("ReleaseCpus routed by lease id");
    assert!(
        !rig.leases()
            .await
            .iter()
            .any(|r| r["id"].as_u64() == Some(l.lease_id)),
        "the released lease left etcd"
    );
}

/// The forwards so far were counted, and exactly one replica leads.
async fn forwards_are_counted_and_one_replica_leads(rig: &Rig) {
    let forwards: usize = (0..3)
        .map(|i| {
            rig.metrics(i)
                .lines()
                .filter(|l| l.starts_with("fairplace_replica_forwards_total{"))
                .count()
        })
        .sum();
    assert!(forwards > 0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leaders: f64 = (0..3)
        .map(|i| rig.gauge(i, "fairplace_replica_leader"))
        .sum();
    assert_eq!(leaders, 1.0, "one balancer leader");
}

/// A cluster Balance that acts runs on the leader, wherever it is asked:
/// the others forward it.
async fn a_cluster_balance_runs_on_the_leader(rig: &Rig) {
    let leader = (0..3)
        .find(|&i| rig.gauge(i, "fairplace_replica_leader") == 1.0)
        .unwrap();
    for i in 0..3 {
        rig.placement(i)
            .balance(pb::BalanceRequest {
                cluster_level: "zone".into(),
                cluster_group: "z1".into(),
                apply: true,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("r{i} cluster Balance with apply: {e}"));
        let forwarded = rig
            .metrics(i)
            .contains("fairplace_replica_forwards_total{method=\"Balance\",outcome=\"ok\"} 1");
        assert_eq!(forwarded, i != leader, "r{i} (leader r{leader})");
    }
}

/// Registers `node` (zone z1, rack r1) with a hand-driven stream at its
/// owner, following the redirect of the replica asked first; returns the
/// stream and the owner's index.
async fn register_at_owner(rig: &Rig, node: &str, ncpus: u32) -> (fairplace_e2e::Reporter, usize) {
    let labels = [("zone", "z1"), ("rack", "r1")];
    let mut at = 0;
    for _ in 0..10 {
        let topo = fairplace_e2e::topology(1, 1, ncpus, 1);
        match fairplace_e2e::Reporter::register_labelled(&rig.addrs[at], node, topo, &labels).await
        {
            Ok(r) => return (r, at),
            Err(e) => {
                if let Some(owner) = e.metadata().get("fairplace-owner") {
                    let owner = owner.to_str().unwrap();
                    at = rig
                        .addrs
                        .iter()
                        .position(|a| a == owner)
                        .expect("an owner of the set");
                } else {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
    panic!("{node}: no replica took its registration");
}

#[test]
fn a_cluster_balance_sees_every_replicas_nodes_and_claims_at_their_owners() {
    let Some(bin) =
        etcd_or_skip("a_cluster_balance_sees_every_replicas_nodes_and_claims_at_their_owners")
    else {
        return;
    };
    rt().block_on(async {
        let rig = Rig::start(&bin, 3).await;
        tokio::time::sleep(Duration::from_secs(1)).await;
        // A busy node and an idle one, owned by two different replicas.
        let (mut hot, hot_at) = register_at_owner(&rig, "hot", 8).await;
        let mut cold_name = String::new();
        let mut cold = None;
        for k in 0..64 {
            let name = format!("cold-{k}");
            let (r, at) = register_at_owner(&rig, &name, 8).await;
            if at != hot_at {
                cold_name = name;
                cold = Some((r, at));
                break;
            }
        }
        let (mut cold, cold_at) = cold.expect("a node owned by another replica than hot's");
        let leader = (0..3)
            .find(|&i| rig.gauge(i, "fairplace_replica_leader") == 1.0)
            .expect("a leader");
        // Three tasks on each of hot's CPUs; cold idle. Sent twice: the
        // aggregates reach every replica within 100 ms, and the pass then
        // reads states under a second old.
        let busy: Vec<(u32, u32)> = (0..8).map(|c| (c, 3)).collect();
        for seq in 1..=2 {
            hot.send(pb::Update {
                node_id: "hot".into(),
                ..fairplace_e2e::tasks_update(seq, 8, &busy)
            })
            .await
            .expect("hot's update");
            cold.send(pb::Update {
                node_id: cold_name.clone(),
                ..fairplace_e2e::tasks_update(seq, 8, &[])
            })
            .await
            .expect("cold's update");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        // Asked where neither node is held (or at hot's owner): the pass
        // must fetch the other replicas' nodes to see both.
        let ask = (0..3)
            .find(|&i| i != hot_at && i != cold_at)
            .unwrap_or(hot_at);
        let resp = rig
            .placement(ask)
            .balance(pb::BalanceRequest {
                cluster_level: "rack".into(),
                cluster_group: "z1/r1".into(),
                apply: true,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("cluster Balance at r{ask} (leader r{leader}): {e}"))
            .into_inner();
        assert!(
            !resp.proposals.is_empty(),
            "hot (r{hot_at}) to {cold_name} (r{cold_at}): no proposal"
        );
        for p in &resp.proposals {
            assert_eq!(
                (p.src_node.as_str(), p.dst_node.as_str()),
                ("hot", cold_name.as_str()),
                "{p:?}"
            );
        }
        // Every destination claimed, at the destination's owner.
        assert_eq!(
            resp.claimed as usize,
            resp.proposals.len(),
            "claims: {resp:?}"
        );
        let node = rig
            .admin(cold_at)
            .get_node(pb::GetNodeRequest {
                node_id: cold_name.clone(),
            })
            .await
            .expect("GetNode at the owner")
            .into_inner();
        let held: u32 = node.claims.values().sum();
        assert!(
            held as usize >= resp.proposals.len(),
            "claims at {cold_name}'s owner: {:?}",
            node.claims
        );
        // The balancer fetched the state of the nodes it does not hold.
        let fetched = rig.metrics(leader).lines().any(|l| {
            l.starts_with("fairplace_replica_forwards_total{method=\"NodeStates\",outcome=\"ok\"}")
        });
        assert!(fetched, "r{leader} fetched no node state");
    });
}

/// The features GetFeatures answers at replica `i` (`node` empty: the
/// global ones): effective values and the names overridden.
async fn features_at(rig: &Rig, i: usize, node: &str) -> (HashMap<String, bool>, Vec<String>) {
    let f = rig
        .admin(i)
        .get_features(pb::GetFeaturesRequest {
            node_id: node.into(),
        })
        .await
        .unwrap_or_else(|e| panic!("GetFeatures({node:?}) at r{i}: {e}"))
        .into_inner();
    (f.features.into_iter().collect(), f.overridden)
}

fn set_features(
    node: &str,
    name: &str,
    on: bool,
    token: &str,
) -> tonic::Request<pb::SetFeaturesRequest> {
    let mut req = tonic::Request::new(pb::SetFeaturesRequest {
        node_id: node.into(),
        set: [(name.to_string(), on)].into(),
        clear_overrides: false,
    });
    req.metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    req
}

#[test]
fn feature_switches_hold_on_every_replica_and_follow_a_node_to_its_next_owner() {
    let Some(bin) = etcd_or_skip("feature_switches_hold_on_every_replica") else {
        return;
    };
    rt().block_on(async {
        let mut rig = Rig::start_with(&bin, 3, &["--admin-token", "s3cret"]).await;
        rig.simulate("feat", 30, 8);
        rig.wait_fresh(0, 30, Duration::from_secs(30)).await;
        // A global switch set at r0 holds on every replica, and on the
        // nodes each one holds.
        rig.admin(0)
            .set_features(set_features("", "SIS_UTIL", false, "s3cret"))
            .await
            .expect("global SetFeatures at r0");
        let owners = rig.owners().await;
        wait_for_async(
            Duration::from_secs(5),
            "SIS_UTIL off everywhere",
            || async {
                for i in 0..3 {
                    if features_at(&rig, i, "").await.0["SIS_UTIL"] {
                        return false;
                    }
                }
                for (node, owner) in owners.iter().take(6) {
                    let i: usize = owner[1..].parse().unwrap();
                    if features_at(&rig, i, node).await.0["SIS_UTIL"] {
                        return false;
                    }
                }
                true
            },
        )
        .await;
        // A node's override, set at a replica that does not own it (the
        // token travels with the forwarded call; a wrong one is refused).
        let (node, owner) = owners.iter().find(|(_, o)| *o != "r0").unwrap();
        let owner: usize = owner[1..].parse().unwrap();
        let denied = rig
            .admin(0)
            .set_features(set_features(node, "WA_IDLE", false, "wrong"))
            .await
            .expect_err("a wrong token");
        assert_eq!(denied.code(), tonic::Code::PermissionDenied, "{denied}");
        rig.admin(0)
            .set_features(set_features(node, "WA_IDLE", false, "s3cret"))
            .await
            .expect("node SetFeatures at r0, forwarded");
        for i in 0..3 {
            let (f, over) = features_at(&rig, i, node).await;
            assert!(!f["WA_IDLE"] && over == ["WA_IDLE"], "r{i}: {f:?} {over:?}");
        }
        // The owner dies: the override is in force at the node's next owner.
        let pid = rig.replicas[owner].as_ref().unwrap().pid();
        send_signal(pid, 9);
        rig.replicas[owner] = None;
        let other = (0..3).find(|&i| i != owner).unwrap();
        wait_for_async(
            Duration::from_secs(15),
            "the node at its next owner",
            || async {
                rig.owners()
                    .await
                    .get(node)
                    .is_some_and(|o| o != &format!("r{owner}"))
                    && rig.fresh_nodes(other).await >= 30
            },
        )
        .await;
        let next = rig.owners().await[node].clone();
        let next: usize = next[1..].parse().unwrap();
        let (f, over) = features_at(&rig, next, node).await;
        assert!(
            !f["WA_IDLE"] && over == ["WA_IDLE"],
            "at r{next}: {f:?} {over:?}"
        );
        assert!(!f["SIS_UTIL"], "the global switch at r{next}: {f:?}");
    });
}

/// Polls `f` every 100 ms until it holds; panics after `limit`.
async fn wait_for_async<F, Fut>(limit: Duration, what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let t0 = Instant::now();
    while !f().await {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One AllocateCpus of one CPU on `node` at replica `i`, released at once
/// when granted (the release may fail while cut off: the lease then stays).
async fn grant_once(rig: &Rig, i: usize, node: &str) -> Result<u64, tonic::Status> {
    let g = rig
        .placement(i)
        .allocate_cpus(pb::AllocateCpusRequest {
            node_id: node.into(),
            count: 1,
            holder: "partition".into(),
            ttl_ms: 60_000,
            ..Default::default()
        })
        .await?
        .into_inner();
    let _ = rig
        .placement(i)
        .release_cpus(pb::ReleaseCpusRequest {
            lease_id: g.lease_id,
        })
        .await;
    Ok(g.lease_id)
}

#[test]
fn a_replica_cut_off_from_etcd_stops_granting_within_its_ttl_and_rejoins_after_the_heal() {
    let Some(bin) = etcd_or_skip("a_replica_cut_off_from_etcd") else {
        return;
    };
    rt().block_on(async {
        let mut rig = Rig::start(&bin, 3).await;
        // r1 again, reaching etcd only through links the test can cut.
        let mut links = Vec::new();
        for a in rig.etcd.client_addrs() {
            links.push(fairplace_e2e::partition::Link::open(&a).await);
        }
        let via: Vec<String> = links.iter().map(|l| format!("http://{}", l.addr)).collect();
        rig.replicas[1].take().unwrap().stop();
        rig.via.insert(1, via.join(","));
        rig.replicas[1] = Some(rig.spawn_replica(1));
        rig.simulate("cut", 60, 8);
        rig.wait_fresh(0, 60, Duration::from_secs(30)).await;
        let owners = rig.owners().await;
        let node = owners
            .iter()
            .find(|(_, o)| *o == "r1")
            .map(|(n, _)| n.clone())
            .expect("r1 owns a node");
        grant_once(&rig, 1, &node).await.expect("a grant at r1 before the cut");

        // Cut: r1 keeps answering, and stops granting within its TTL.
        let ttl = Duration::from_secs(TTL_S.parse().unwrap());
        let cut = Instant::now();
        for l in &links {
            l.cut();
        }
        let mut last_grant_sent = None;
        let mut refused = None;
        while cut.elapsed() < ttl + Duration::from_secs(4) {
            let sent = cut.elapsed();
            match grant_once(&rig, 1, &node).await {
                Ok(_) => last_grant_sent = Some(sent),
                Err(e) => {
                    assert_eq!(e.code(), tonic::Code::Unavailable, "refused as: {e}");
                    refused.get_or_insert(sent);
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        eprintln!("cut off: last grant sent at {last_grant_sent:?}, first refusal sent at {refused:?} (TTL {ttl:?})");
        assert!(refused.is_some(), "r1 never refused a grant while cut off");
        if let Some(t) = last_grant_sent {
            assert!(t < ttl, "r1 granted {t:?} after the cut, beyond its TTL {ttl:?}");
        }
        // Degraded, not silent: PickCpu is still answered there.
        rig.placement(1)
            .pick_cpu(pb::PickCpuRequest {
                node_id: node.clone(),
                kind: pb::RequestKind::Fork as i32,
                ..Default::default()
            })
            .await
            .expect("PickCpu at r1 while cut off");
        assert_eq!(rig.gauge(1, "fairplace_replica_etcd_up"), 0.0);
        assert_eq!(rig.gauge(0, "fairplace_replica_members"), 2.0, "r0 sees r1 gone");
        // Health says so: leases NOT_SERVING, the server itself SERVING.
        assert_eq!(rig.health(1, "fairplace.leases").await, 2, "fairplace.leases while cut off");
        assert_eq!(rig.health(1, "").await, 1, "the server while cut off");

        // Heal: r1 joins again and grants again.
        for l in &links {
            l.heal();
        }
        let healed = Instant::now();
        wait_for_async(Duration::from_secs(20), "r1 back in the set and granting", || async {
            rig.gauge(0, "fairplace_replica_members") == 3.0
                && rig.gauge(1, "fairplace_replica_etcd_up") == 1.0
                && grant_once(&rig, 1, &node).await.is_ok()
        })
        .await;
        eprintln!("healed: r1 grants again after {:.2} s", healed.elapsed().as_secs_f64());
        wait_for_async(Duration::from_secs(5), "fairplace.leases SERVING again", || async {
            rig.health(1, "fairplace.leases").await == 1
        })
        .await;
        let leases = rig.leases().await;
        assert_no_cpu_twice(&leases);
        let ids: Vec<u64> = leases.iter().map(|l| l["id"].as_u64().unwrap()).collect();
        let distinct: HashSet<u64> = ids.iter().copied().collect();
        assert_eq!(ids.len(), distinct.len(), "a lease id repeats");
    });
}

/// The kernel's view of a process's allowed CPUs.
fn cpus_allowed(pid: u32) -> String {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .unwrap()
        .trim()
        .to_string()
}

#[test]
fn the_real_agent_follows_its_node_to_the_next_owner_and_its_pinned_process_stays_pinned() {
    let Some(bin) = etcd_or_skip("the_real_agent_follows_its_node") else {
        return;
    };
    rt().block_on(async {
        let mut rig = Rig::start(&bin, 3).await;
        rig.real_agent();
        rig.wait_fresh(0, 1, Duration::from_secs(30)).await;
        let owner: usize = rig.owners().await["real"][1..].parse().unwrap();
        let ask = (owner + 1) % 3;
        // A real process pinned through a lease granted at another replica.
        let mut p = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .unwrap();
        let pid = p.id();
        let g = rig
            .placement(ask)
            .allocate_cpus(pb::AllocateCpusRequest {
                node_id: "real".into(),
                count: 1,
                holder: "handover".into(),
                ttl_ms: 120_000,
                apply: Some(pb::ApplyTarget {
                    target: Some(pb::apply_target::Target::Pid(pid)),
                }),
                ..Default::default()
            })
            .await
            .expect("AllocateCpus for the real node, forwarded to its owner")
            .into_inner();
        assert!(g.applied, "{g:?}");
        assert_eq!(cpus_allowed(pid), g.cpus, "pinned before the handover");

        // kill -9 the owner: the agent lands on the next owner.
        let killed = Instant::now();
        send_signal(rig.replicas[owner].as_ref().unwrap().pid(), 9);
        rig.replicas[owner] = None;
        let survivor = (0..3).find(|&i| i != owner).unwrap();
        wait_for_async(
            Duration::from_secs(15),
            "the real node at its next owner",
            || async {
                rig.owners()
                    .await
                    .get("real")
                    .is_some_and(|o| o != &format!("r{owner}"))
                    && rig.fresh_nodes(survivor).await == 1
            },
        )
        .await;
        let next = rig.owners().await["real"].clone();
        eprintln!(
            "the real node moved from r{owner} to {next} in {:.2} s",
            killed.elapsed().as_secs_f64()
        );
        // The lease came along from etcd, still applied; the process is
        // still pinned; renew and release work at any survivor.
        let node = rig
            .admin(survivor)
            .get_node(pb::GetNodeRequest {
                node_id: "real".into(),
            })
            .await
            .expect("GetNode after the handover")
            .into_inner();
        let l: Vec<_> = node
            .leases
            .iter()
            .map(|l| (l.lease_id, l.cpus.clone(), l.applied))
            .collect();
        assert_eq!(
            l,
            vec![(g.lease_id, g.cpus.clone(), true)],
            "the leases at {next}"
        );
        assert_eq!(cpus_allowed(pid), g.cpus, "pinned after the handover");
        rig.placement(survivor)
            .renew_lease(pb::RenewLeaseRequest {
                lease_id: g.lease_id,
                ttl_ms: 120_000,
            })
            .await
            .expect("RenewLease after the handover");
        rig.placement(survivor)
            .release_cpus(pb::ReleaseCpusRequest {
                lease_id: g.lease_id,
            })
            .await
            .expect("ReleaseCpus after the handover");
        assert!(rig.leases().await.is_empty(), "the lease is gone from etcd");
        let _ = p.kill();
        let _ = p.wait();
    });
}

/// What the orchestrator clients saw.
#[derive(Default)]
struct Tally {
    calls: AtomicU64,
    retried: AtomicU64,
    failed: std::sync::Mutex<Vec<String>>,
    granted: std::sync::Mutex<Vec<u64>>,
    /// Leases granted and never released: must all be in etcd at the end.
    held: std::sync::Mutex<HashSet<u64>>,
}

/// UNAVAILABLE, or the client's own broken connection to a replica that
/// died under the call (tonic reports that as UNKNOWN "transport error";
/// gRPC's own clients call it UNAVAILABLE).
fn unavailable(e: &tonic::Status) -> bool {
    e.code() == tonic::Code::Unavailable
        || (e.code() == tonic::Code::Unknown && e.message().contains("transport error"))
}

/// One call with one retry on UNAVAILABLE (after `wait`, at the next
/// replica); a failure after the retry is recorded.
async fn with_retry<T, F, Fut>(
    rig: &Rig,
    live: &std::sync::Mutex<Vec<usize>>,
    start: usize,
    tally: &Tally,
    what: &str,
    wait: Duration,
    mut call: F,
) -> Option<T>
where
    F: FnMut(PlacementServiceClient<Channel>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    tally.calls.fetch_add(1, Ordering::Relaxed);
    let at = live.lock().unwrap().clone();
    let first = at[start % at.len()];
    match call(rig.placement(first)).await {
        Ok(r) => return Some(r.into_inner()),
        Err(e) if unavailable(&e) => {
            tally.retried.fetch_add(1, Ordering::Relaxed);
        }
        Err(e) => {
            tally.failed.lock().unwrap().push(format!("{what}: {e}"));
            return None;
        }
    }
    tokio::time::sleep(wait).await;
    // Another replica, among those alive now.
    let at: Vec<usize> = live
        .lock()
        .unwrap()
        .iter()
        .copied()
        .filter(|&r| r != first)
        .collect();
    let second = at[start % at.len()];
    match call(rig.placement(second)).await {
        Ok(r) => Some(r.into_inner()),
        Err(e) => {
            tally
                .failed
                .lock()
                .unwrap()
                .push(format!("{what} (retried): {e}"));
            None
        }
    }
}

/// One orchestrator: PickCpu, then AllocateCpus / RenewLease / ReleaseCpus
/// on random nodes, until `stop`.
async fn orchestrator(
    rig: Arc<Rig>,
    live: Arc<std::sync::Mutex<Vec<usize>>>,
    who: usize,
    nodes: u32,
    tally: Arc<Tally>,
    stop: Arc<AtomicBool>,
) {
    let mut x = who as u64 * 7919 + 17;
    // The retry waits out the dead replica's etcd lease and its agents'
    // reconnection.
    let wait = Duration::from_secs(4);
    while !stop.load(Ordering::Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let k = (x % nodes as u64) as u32;
        let n = node("load", k);
        let at = &*live;
        let start = (x >> 20) as usize;
        let pick = n.clone();
        with_retry(&rig, at, start, &tally, "PickCpu", wait, |mut c| {
            let req = pb::PickCpuRequest {
                node_id: pick.clone(),
                kind: pb::RequestKind::Fork as i32,
                ..Default::default()
            };
            async move { c.pick_cpu(req).await }
        })
        .await;
        if !x.is_multiple_of(4) {
            continue;
        }
        let alloc = n.clone();
        let granted = with_retry(
            &rig,
            at,
            start + 1,
            &tally,
            "AllocateCpus",
            wait,
            |mut c| {
                let req = pb::AllocateCpusRequest {
                    node_id: alloc.clone(),
                    count: 1,
                    holder: format!("o{who}"),
                    ttl_ms: 120_000,
                    ..Default::default()
                };
                async move {
                    match c.allocate_cpus(req).await {
                        // No room on a node is an answer, not a failure.
                        Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                            Ok(tonic::Response::new(pb::AllocateCpusResponse::default()))
                        }
                        r => r,
                    }
                }
            },
        )
        .await;
        let Some(g) = granted.filter(|g| g.lease_id != 0) else {
            continue;
        };
        tally.granted.lock().unwrap().push(g.lease_id);
        let id = g.lease_id;
        with_retry(
            &rig,
            at,
            start + 2,
            &tally,
            "RenewLease",
            wait,
            |mut c| async move {
                c.renew_lease(pb::RenewLeaseRequest {
                    lease_id: id,
                    ttl_ms: 120_000,
                })
                .await
            },
        )
        .await;
        if x.is_multiple_of(3) {
            tally.held.lock().unwrap().insert(id);
            continue;
        }
        let tried = AtomicBool::new(false);
        let released = with_retry(&rig, at, start + 3, &tally, "ReleaseCpus", wait, |mut c| {
            // A retried release that finds no lease: the first try,
            // cut off, released it.
            let retry = tried.swap(true, Ordering::Relaxed);
            async move {
                match c
                    .release_cpus(pb::ReleaseCpusRequest { lease_id: id })
                    .await
                {
                    Err(e) if retry && e.code() == tonic::Code::NotFound => {
                        Ok(tonic::Response::new(pb::ReleaseCpusResponse::default()))
                    }
                    r => r,
                }
            }
        })
        .await;
        if released.is_none() {
            tally.held.lock().unwrap().insert(id);
        }
    }
}

#[test]
fn a_replica_killed_under_load_loses_no_call_no_lease_and_grants_nothing_twice() {
    let Some(bin) = etcd_or_skip("a_replica_killed_under_load") else {
        return;
    };
    rt().block_on(async {
        const NODES: u32 = 200;
        // The simulated nodes and this machine's own, read by the real agent.
        const ALL: usize = NODES as usize + 1;
        let mut rig = Rig::start(&bin, 3).await;
        rig.simulate("load", NODES, 8);
        rig.real_agent();
        rig.wait_fresh(0, ALL, Duration::from_secs(30)).await;
        let rig = Arc::new(rig);
        let live = Arc::new(std::sync::Mutex::new(vec![0usize, 1, 2]));
        let tally = Arc::new(Tally::default());
        let stop = Arc::new(AtomicBool::new(false));
        let mut clients = Vec::new();
        for who in 0..16 {
            clients.push(tokio::spawn(orchestrator(
                Arc::clone(&rig),
                Arc::clone(&live),
                who,
                NODES,
                Arc::clone(&tally),
                Arc::clone(&stop),
            )));
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        // kill -9 r1 under load.
        let before = rig.owners().await;
        let r1_nodes = before.values().filter(|o| *o == "r1").count();
        assert!(r1_nodes > 0);
        let pid = rig.replicas[1].as_ref().unwrap().pid();
        *live.lock().unwrap() = vec![0, 2];
        let killed = Instant::now();
        send_signal(pid, 9);
        let fresh_in = rig.wait_fresh(0, ALL, Duration::from_secs(20)).await;
        eprintln!(
            "r1 (owner of {r1_nodes} nodes) killed: all {NODES} nodes fresh again after {:.2} s",
            killed.elapsed().as_secs_f64()
        );
        let _ = fresh_in;
        let moved = killed.elapsed();
        tokio::time::sleep(Duration::from_secs(6)).await;
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            c.await.unwrap();
        }
        let failed = tally.failed.lock().unwrap().clone();
        eprintln!(
            "{} calls, {} retried, {} failed after their retry",
            tally.calls.load(Ordering::Relaxed),
            tally.retried.load(Ordering::Relaxed),
            failed.len()
        );
        assert!(
            failed.is_empty(),
            "calls failed after their retry: {failed:?}"
        );
        assert!(
            moved < Duration::from_secs(5),
            "nodes fresh again only after {moved:?}"
        );
        // Every node owned by a live replica; none by r1.
        let after = rig.owners().await;
        assert_eq!(after.len(), ALL);
        assert!(after.values().all(|o| o != "r1"), "{after:?}");
        // No lease lost, no CPU twice, no id twice.
        let leases = rig.leases().await;
        assert_no_cpu_twice(&leases);
        let in_etcd: HashSet<u64> = leases.iter().map(|l| l["id"].as_u64().unwrap()).collect();
        let held = tally.held.lock().unwrap().clone();
        let lost: Vec<&u64> = held.difference(&in_etcd).collect();
        assert!(lost.is_empty(), "leases lost: {lost:?}");
        let granted = tally.granted.lock().unwrap().clone();
        let unique: HashSet<&u64> = granted.iter().collect();
        assert_eq!(unique.len(), granted.len(), "a lease id repeated");
        assert!(granted.len() > 50, "only {} grants", granted.len());
        // r1 comes back: ownership moves back to it.
        let mut rig = Arc::try_unwrap(rig).ok().expect("clients done");
        rig.replicas[1] = Some(rig.spawn_replica(1));
        let t0 = Instant::now();
        loop {
            let owners = rig.owners().await;
            let back = owners.values().filter(|o| *o == "r1").count();
            if back * 4 >= r1_nodes * 3 && owners.len() == ALL {
                eprintln!("r1 back: owns {back} nodes again after {:?}", t0.elapsed());
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "r1 owns {back} of its {r1_nodes} again"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        rig.wait_fresh(1, ALL, Duration::from_secs(10)).await;
        assert_no_cpu_twice(&rig.leases().await);
    });
}

#[test]
fn losing_etcd_members_one_is_invisible_two_refuse_grants_but_not_placements() {
    let Some(bin) = etcd_or_skip("losing_etcd_members") else {
        return;
    };
    rt().block_on(async {
        let mut rig = Rig::start(&bin, 2).await;
        rig.simulate("quorum", 20, 8);
        rig.wait_fresh(0, 20, Duration::from_secs(20)).await;
        let clients = [rig.placement(0), rig.placement(1)];
        let alloc = |i: usize, n: u32| {
            let mut p = clients[i].clone();
            async move {
                p.allocate_cpus(pb::AllocateCpusRequest {
                    node_id: node("quorum", n),
                    count: 1,
                    ttl_ms: 60_000,
                    ..Default::default()
                })
                .await
            }
        };
        // One member down: grants and placements as before. (If it was
        // etcd's leader, commits wait for the next one, about a second: as
        // everywhere here, a call may be retried once on UNAVAILABLE.)
        rig.etcd.kill(2);
        for n in 0..6 {
            let i = (n % 2) as usize;
            match alloc(i, n).await {
                Ok(_) => {}
                Err(e) if e.code() == tonic::Code::Unavailable => {
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    alloc(i, n).await.unwrap_or_else(|e| {
                        panic!("grant with one etcd member down, retried: {e}")
                    });
                }
                Err(e) => panic!("grant with one etcd member down: {e}"),
            }
        }
        // Two down: no quorum. Grants are refused UNAVAILABLE; PickCpu is
        // answered from live state, at the owner and through the other.
        rig.etcd.kill(1);
        tokio::time::sleep(Duration::from_secs(3)).await;
        for n in 6..10 {
            let e = alloc((n % 2) as usize, n).await.unwrap_err();
            assert_eq!(e.code(), tonic::Code::Unavailable, "{e}");
        }
        for n in 0..20 {
            rig.placement((n % 2) as usize)
                .pick_cpu(pb::PickCpuRequest {
                    node_id: node("quorum", n),
                    kind: pb::RequestKind::Fork as i32,
                    ..Default::default()
                })
                .await
                .unwrap_or_else(|e| panic!("PickCpu without an etcd quorum: {e}"));
        }
        // Health says so within a keep-alive round.
        let t0 = Instant::now();
        while rig.gauge(0, "fairplace_replica_etcd_up") != 0.0 {
            assert!(t0.elapsed() < Duration::from_secs(5), "etcd_up still 1");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Quorum back: grants again, and nothing granted twice.
        rig.etcd.restart(1);
        rig.etcd.wait_healthy(Duration::from_secs(20)).await;
        let t0 = Instant::now();
        loop {
            match alloc(0, 12).await {
                Ok(_) => break,
                Err(e) => assert!(
                    t0.elapsed() < Duration::from_secs(15),
                    "grants not back after the quorum: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        assert_no_cpu_twice(&rig.leases().await);
    });
}

#[test]
fn a_replica_frozen_past_its_etcd_lease_stops_granting_and_rejoins() {
    let Some(bin) = etcd_or_skip("a_replica_frozen_past_its_etcd_lease") else {
        return;
    };
    rt().block_on(async {
        let mut rig = Rig::start(&bin, 2).await;
        rig.simulate("frozen", 20, 4);
        rig.wait_fresh(0, 20, Duration::from_secs(20)).await;
        let owners = rig.owners().await;
        let (n, _) = owners
            .iter()
            .find(|(_, o)| *o == "r1")
            .expect("r1 owns a node");
        let n = n.clone();
        // SIGSTOP r1 past its lease: r0 takes its nodes over (their agents
        // reconnect to r0) and grants on them.
        let pid = rig.replicas[1].as_ref().unwrap().pid();
        send_signal(pid, 19);
        rig.wait_fresh(0, 20, Duration::from_secs(15)).await;
        let mut p0 = rig.placement(0);
        let l = p0
            .allocate_cpus(pb::AllocateCpusRequest {
                node_id: n.clone(),
                count: 4,
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await
            .expect("r0 grants on the node it took over")
            .into_inner();
        assert_eq!(l.cpus, "0-3");
        // r1 wakes up believing nothing happened: it may not grant on the
        // node it lost (it is fenced), and it rejoins.
        send_signal(pid, 18);
        let e = rig
            .placement(1)
            .allocate_cpus(pb::AllocateCpusRequest {
                node_id: n.clone(),
                count: 1,
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await;
        match e {
            // Forwarded to r0, where every CPU is leased.
            Err(e) => assert!(
                matches!(
                    e.code(),
                    tonic::Code::Unavailable | tonic::Code::ResourceExhausted
                ),
                "{e}"
            ),
            Ok(r) => panic!("a fenced replica granted {:?}", r.into_inner()),
        }
        let t0 = Instant::now();
        while rig.gauge(1, "fairplace_replica_members") < 2.0
            || rig.gauge(1, "fairplace_replica_etcd_up") < 1.0
        {
            assert!(t0.elapsed() < Duration::from_secs(15), "r1 did not rejoin");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        rig.wait_fresh(1, 20, Duration::from_secs(15)).await;
        assert_no_cpu_twice(&rig.leases().await);
    });
}
