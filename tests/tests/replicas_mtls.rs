//! Replicas under mutual TLS: a forwarded call is authorized at the node's
//! owner as the caller who made it, and nobody but a replica certificate can
//! claim to forward for someone (a real etcd, real certificates from the
//! test PKI, the real binaries).

use std::time::Duration;

use fairplace_e2e::etcd::{EtcdCluster, etcd_or_skip};
use fairplace_e2e::tls::{TestPki, TlsOptions, channel};
use fairplace_e2e::{Reporter, Server, free_port, rt, states, topology};
use fairplace_proto::v1 as pb;
use fairplace_proto::v1::placement_service_client::PlacementServiceClient;
use tonic::Code;
use tonic::transport::Channel;

/// Two replicas serving mutual TLS with the test PKI, each with its peer
/// certificate `spiffe://fairplace/replica/rN`.
fn replicas(pki: &TestPki, etcd: &EtcdCluster, addrs: &[String]) -> Vec<Server> {
    let peers = (0..addrs.len())
        .map(|i| pki.client("replica", &format!("r{i}")))
        .collect();
    replicas_with(pki, etcd, addrs, peers)
}

/// Replicas presenting the given peer certificates.
fn replicas_with(
    pki: &TestPki,
    etcd: &EtcdCluster,
    addrs: &[String],
    peers: Vec<TlsOptions>,
) -> Vec<Server> {
    addrs
        .iter()
        .zip(peers)
        .enumerate()
        .map(|(i, (addr, peer))| {
            let id = format!("r{i}");
            let mut args = pki.server_args();
            args.extend(
                [
                    "--grpc-addr",
                    addr,
                    "--etcd-endpoints",
                    &etcd.endpoints(),
                    "--replica-id",
                    &id,
                    "--etcd-lease-ttl-s",
                    "2",
                    "--replica-tls-cert",
                    peer.cert.as_ref().unwrap().to_str().unwrap(),
                    "--replica-tls-key",
                    peer.key.as_ref().unwrap().to_str().unwrap(),
                ]
                .map(String::from),
            );
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Server::start(&args)
        })
        .collect()
}

/// A one-member etcd, healthy, and two free loopback addresses for
/// replicas.
async fn one_etcd_two_addrs(bin: &str) -> (EtcdCluster, Vec<String>) {
    let etcd = EtcdCluster::start(bin, 1);
    etcd.wait_healthy(Duration::from_secs(20)).await;
    let addrs = (0..2)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    (etcd, addrs)
}

async fn placement(addr: &str, tls: &TlsOptions) -> PlacementServiceClient<Channel> {
    PlacementServiceClient::new(channel(addr, tls).await.expect("TLS channel"))
}

/// `msg` with a `fairplace-forwarded-for` header of the caller's making.
fn claiming<T>(msg: T, who: &str) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut()
        .insert("fairplace-forwarded-for", who.parse().unwrap());
    r
}

#[test]
fn a_forward_is_authorized_as_its_caller_and_nobody_else_can_claim_to_forward() {
    let Some(bin) = etcd_or_skip("a_forward_is_authorized_as_its_caller") else {
        return;
    };
    rt().block_on(async {
        let pki = TestPki::new();
        let (etcd, addrs) = one_etcd_two_addrs(&bin).await;
        let _servers = replicas(&pki, &etcd, &addrs);
        tokio::time::sleep(Duration::from_millis(500)).await;
        // A node registered at its owner (rendezvous hashing over r0, r1),
        // with its own node certificate; the other replica forwards.
        let node = "m-1";
        let owner = fairplace::replica::hrw::owner(["r0", "r1"], node).unwrap();
        let (at_owner, at_other) = if owner == "r0" {
            (&addrs[0], &addrs[1])
        } else {
            (&addrs[1], &addrs[0])
        };
        let node_tls = pki.client("node", node);
        let ch = channel(at_owner, &node_tls).await.unwrap();
        let mut rep = Reporter::register_on(ch, node, topology(1, 1, 2, 2), &[])
            .await
            .expect("the owner takes its node's registration");
        rep.update(1, true, states(4, &[]), node).await.unwrap();
        // o1 takes a lease through the replica that does not own the node:
        // the owner records o1, not the forwarding replica, as its owner.
        let o1 = pki.client("orchestrator", "o1");
        let o2 = pki.client("orchestrator", "o2");
        let lease = placement(at_other, &o1)
            .await
            .allocate_cpus(pb::AllocateCpusRequest {
                node_id: node.into(),
                count: 1,
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await
            .expect("AllocateCpus forwarded over mutual TLS")
            .into_inner();
        let g = fairplace_proto::v1::admin_service_client::AdminServiceClient::new(
            channel(at_other, &o1).await.unwrap(),
        )
        .get_node(pb::GetNodeRequest {
            node_id: node.into(),
        })
        .await
        .unwrap()
        .into_inner();
        let l = g
            .leases
            .iter()
            .find(|l| l.lease_id == lease.lease_id)
            .unwrap();
        assert_eq!(l.owner, "spiffe://fairplace/orchestrator/o1");
        // o2 may not end o1's lease, whichever replica it asks.
        for addr in [at_other, at_owner] {
            let e = placement(addr, &o2)
                .await
                .release_cpus(pb::ReleaseCpusRequest {
                    lease_id: lease.lease_id,
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::PermissionDenied, "{addr}: {e}");
            assert!(e.message().contains("orchestrator/o1"), "{e}");
        }
        // An orchestrator cannot claim to forward for an admin.
        let e = placement(at_owner, &o2)
            .await
            .release_cpus(claiming(
                pb::ReleaseCpusRequest {
                    lease_id: lease.lease_id,
                },
                "spiffe://fairplace/admin/ops",
            ))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
        assert!(e.message().contains("only a replica certificate"), "{e}");
        // A replica certificate alone is no orchestrator, and may not
        // forward for another replica.
        let r9 = pki.client("replica", "r9");
        let pick = pb::PickCpuRequest {
            node_id: node.into(),
            kind: pb::RequestKind::Fork as i32,
            ..Default::default()
        };
        let e = placement(at_owner, &r9)
            .await
            .pick_cpu(pick.clone())
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
        let e = placement(at_owner, &r9)
            .await
            .pick_cpu(claiming(pick.clone(), "spiffe://fairplace/replica/r0"))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::PermissionDenied, "{e}");
        // Forwarding for an orchestrator, it is that orchestrator.
        placement(at_owner, &r9)
            .await
            .pick_cpu(claiming(pick, "spiffe://fairplace/orchestrator/o2"))
            .await
            .expect("a replica forwarding for an orchestrator");
        // o1 releases it through the other replica.
        placement(at_other, &o1)
            .await
            .release_cpus(pb::ReleaseCpusRequest {
                lease_id: lease.lease_id,
            })
            .await
            .expect("the lease's owner releases it through either replica");
    });
}

#[test]
fn a_replica_presents_its_renewed_peer_certificate_without_a_restart() {
    let Some(bin) = etcd_or_skip("a_replica_presents_its_renewed_peer_certificate") else {
        return;
    };
    rt().block_on(async {
        let pki = TestPki::new();
        let (etcd, addrs) = one_etcd_two_addrs(&bin).await;
        // r0 starts with a certificate that is not a replica's (as if the
        // wrong one had been issued), in files of its own.
        let wrong = pki.client("orchestrator", "not-a-replica");
        let right = pki.client("replica", "r0");
        let (cert, key) = (pki.path("r0-peer.crt"), pki.path("r0-peer.key"));
        let read =
            |p: &Option<std::path::PathBuf>| std::fs::read_to_string(p.as_ref().unwrap()).unwrap();
        std::fs::write(&cert, read(&wrong.cert)).unwrap();
        std::fs::write(&key, read(&wrong.key)).unwrap();
        let r0_peer = TlsOptions {
            cert: Some(cert.clone()),
            key: Some(key.clone()),
            ..wrong.clone()
        };
        let _servers = replicas_with(
            &pki,
            &etcd,
            &addrs,
            vec![r0_peer, pki.client("replica", "r1")],
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        // A node r1 owns, registered there; r0 forwards calls for it.
        let node = (0..64)
            .map(|k| format!("n-{k}"))
            .find(|n| fairplace::replica::hrw::owner(["r0", "r1"], n) == Some("r1"))
            .unwrap();
        let ch = channel(&addrs[1], &pki.client("node", &node))
            .await
            .unwrap();
        let mut rep = Reporter::register_on(ch, &node, topology(1, 1, 2, 2), &[])
            .await
            .expect("r1 takes its node");
        rep.update(1, true, states(4, &[]), &node).await.unwrap();
        let o1 = pki.client("orchestrator", "o1");
        let pick = pb::PickCpuRequest {
            node_id: node.clone(),
            kind: pb::RequestKind::Fork as i32,
            ..Default::default()
        };
        let e = placement(&addrs[0], &o1)
            .await
            .pick_cpu(pick.clone())
            .await
            .unwrap_err();
        assert_eq!(
            e.code(),
            Code::PermissionDenied,
            "forwarded with the wrong certificate: {e}"
        );
        // The right certificate is swapped in (atomically, as cert-manager
        // does): r0 forwards with it within a few seconds, still running.
        fairplace_e2e::tls::replace_file(&key, &read(&right.key));
        fairplace_e2e::tls::replace_file(&cert, &read(&right.cert));
        let t0 = std::time::Instant::now();
        loop {
            rep.update(
                2 + t0.elapsed().as_millis() as u64,
                true,
                states(4, &[]),
                &node,
            )
            .await
            .unwrap();
            match placement(&addrs[0], &o1).await.pick_cpu(pick.clone()).await {
                Ok(_) => break,
                Err(e) => assert!(
                    t0.elapsed() < Duration::from_secs(15),
                    "r0 still forwards with the old certificate: {e}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        eprintln!(
            "r0 forwards with its renewed certificate after {:?}",
            t0.elapsed()
        );
    });
}

/// A gauge's value in a server's /metrics (absent: `None`).
fn gauge(server: &Server, name: &str) -> Option<f64> {
    fairplace_e2e::http_get(&server.metrics)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
}

async fn wait_gauge(
    server: &Server,
    name: &str,
    want: f64,
    limit: Duration,
    why: &str,
) -> Duration {
    let t0 = std::time::Instant::now();
    loop {
        if gauge(server, name) == Some(want) {
            return t0.elapsed();
        }
        assert!(
            t0.elapsed() < limit,
            "{why}: {name} is {:?}, not {want}, after {limit:?}",
            gauge(server, name)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn a_replica_reaches_etcd_over_mutual_tls_and_rereads_its_client_certificate() {
    let Some(bin) = etcd_or_skip("a_replica_reaches_etcd_over_mutual_tls") else {
        return;
    };
    rt().block_on(async {
        let pki = TestPki::new();
        let test_client = pki.client("admin", "etcd-test");
        let etcd = EtcdCluster::start_tls(
            &bin,
            1,
            fairplace_e2e::etcd::EtcdTls {
                ca: pki.path("ca.crt"),
                cert: pki.path("server.crt"),
                key: pki.path("server.key"),
                client_cert: test_client.cert.clone().unwrap(),
                client_key: test_client.key.clone().unwrap(),
            },
        );
        etcd.wait_healthy(Duration::from_secs(20)).await;
        // The replica's etcd client certificate, in files of its own.
        let good = pki.client("replica", "r0");
        let (cert, key) = (pki.path("r0-etcd.crt"), pki.path("r0-etcd.key"));
        let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap();
        std::fs::write(&cert, read(good.cert.as_ref().unwrap())).unwrap();
        std::fs::write(&key, read(good.key.as_ref().unwrap())).unwrap();
        let addr = format!("127.0.0.1:{}", free_port());
        let args: Vec<String> = [
            "--grpc-addr", &addr,
            "--etcd-endpoints", &etcd.endpoints(),
            "--etcd-tls-ca", pki.path("ca.crt").to_str().unwrap(),
            "--etcd-tls-cert", cert.to_str().unwrap(),
            "--etcd-tls-key", key.to_str().unwrap(),
            "--replica-id", "r0",
            "--etcd-lease-ttl-s", "2",
        ]
        .map(String::from)
        .to_vec();
        let server = Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(etcd.endpoints().starts_with("https://"));
        wait_gauge(&server, "fairplace_replica_etcd_up", 1.0, Duration::from_secs(10), "joined over TLS").await;
        wait_gauge(&server, "fairplace_replica_members", 1.0, Duration::from_secs(10), "joined over TLS").await;
        // A certificate etcd refuses (server auth only, no client auth) is
        // swapped in: the replica presents it on its next connections and
        // loses etcd, which proves it read the files again.
        let refused = fairplace::offline::pki::Leaf {
            server: true,
            client: false,
            ..fairplace::offline::pki::Leaf::client("fairplace", "replica", "r0")
        };
        let bad = pki.write_leaf("r0-serveronly", &refused);
        fairplace_e2e::tls::replace_file(&key, &bad.key);
        fairplace_e2e::tls::replace_file(&cert, &bad.cert);
        let lost = wait_gauge(&server, "fairplace_replica_etcd_up", 0.0, Duration::from_secs(20), "refused by etcd").await;
        // A good certificate again: it joins again, without a restart.
        fairplace_e2e::tls::replace_file(&key, &read(good.key.as_ref().unwrap()));
        fairplace_e2e::tls::replace_file(&cert, &read(good.cert.as_ref().unwrap()));
        let back = wait_gauge(&server, "fairplace_replica_etcd_up", 1.0, Duration::from_secs(20), "a good certificate again").await;
        eprintln!("etcd client certificate swapped: lost etcd after {lost:?}, back {back:?} after the good one");
        assert_eq!(gauge(&server, "fairplace_replica_members"), Some(1.0));
    });
}
