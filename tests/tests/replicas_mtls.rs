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
    addrs
        .iter()
        .enumerate()
        .map(|(i, addr)| {
            let id = format!("r{i}");
            let peer = pki.client("replica", &id);
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
        let etcd = EtcdCluster::start(&bin, 1);
        etcd.wait_healthy(Duration::from_secs(20)).await;
        let addrs: Vec<String> = (0..2)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect();
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
