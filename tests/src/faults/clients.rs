//! Orchestrators under faults: each client allocates (with a request id,
//! retried with it when the outcome is unknown), renews, releases
//! (retried until the outcome is known) and reads nodes, against any
//! replica, and records every call with its outcome.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fairplace_proto::v1 as pb;
use pb::admin_service_client::AdminServiceClient;
use pb::placement_service_client::PlacementServiceClient;
use tonic::transport::Channel;

use super::record::{Recorder, Rng, cpus, failed, ok, timed_out};
use crate::history::{Answer, Call, Listed, Outcome};

/// A lease's lifetime as the clients ask for it.
pub const TTL_MS: u32 = 4_000;
/// A call's deadline: past it the outcome is unknown.
const CALL_TIMEOUT: Duration = Duration::from_secs(3);
/// Leases one client holds at most.
const HOLD: usize = 3;

/// What one client runs against.
pub struct Target {
    pub servers: Vec<String>,
    pub nodes: Vec<String>,
}

struct Held {
    id: u64,
}

struct Client {
    id: u32,
    rec: Arc<Recorder>,
    placement: Vec<PlacementServiceClient<Channel>>,
    admin: Vec<AdminServiceClient<Channel>>,
    nodes: Vec<String>,
    rng: Rng,
    held: Vec<Held>,
    requests: u64,
}

/// Runs client `id` until `until`.
pub async fn run(rec: Arc<Recorder>, id: u32, t: Arc<Target>, seed: u64, until: Instant) {
    let channels: Vec<Channel> = t
        .servers
        .iter()
        .map(|s| {
            tonic::transport::Endpoint::from_shared(format!("http://{s}"))
                .expect("server address")
                .connect_timeout(Duration::from_millis(500))
                .connect_lazy()
        })
        .collect();
    let mut c = Client {
        id,
        rec,
        placement: channels
            .iter()
            .cloned()
            .map(PlacementServiceClient::new)
            .collect(),
        admin: channels.into_iter().map(AdminServiceClient::new).collect(),
        nodes: t.nodes.clone(),
        rng: Rng::new(seed ^ u64::from(id).wrapping_mul(0x1000_0001)),
        held: Vec::new(),
        requests: 0,
    };
    while Instant::now() < until {
        c.step().await;
        let pause = c.rng.ms(10, 80);
        tokio::time::sleep(pause).await;
    }
}

/// Runs `f` within the call deadline: `None` when it gave no answer.
async fn within<T>(
    f: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Option<Result<T, tonic::Status>> {
    tokio::time::timeout(CALL_TIMEOUT, f)
        .await
        .ok()
        .map(|r| r.map(tonic::Response::into_inner))
}

impl Client {
    async fn step(&mut self) {
        let r = self.rng.below(100);
        if self.held.len() < HOLD && r < 40 {
            self.allocate().await;
        } else if r < 70 && !self.held.is_empty() {
            self.renew().await;
        } else if r < 88 && !self.held.is_empty() {
            self.release().await;
        } else {
            self.get().await;
        }
    }

    fn server(&mut self) -> usize {
        self.rng.below(self.placement.len() as u64) as usize
    }

    /// One AllocateCpus, retried with its request id while the outcome is
    /// unknown (each attempt is a call of the history).
    async fn allocate(&mut self) {
        self.requests += 1;
        let request_id = format!("c{}-{}", self.id, self.requests);
        let node = self.nodes[self.rng.below(self.nodes.len() as u64) as usize].clone();
        let count = 1 + self.rng.below(2) as u32;
        for _ in 0..4 {
            let s = self.server();
            let req = pb::AllocateCpusRequest {
                node_id: node.clone(),
                count,
                holder: format!("faults c{}", self.id),
                ttl_ms: TTL_MS,
                request_id: request_id.clone(),
                ..Default::default()
            };
            let call = Call::Allocate {
                node: node.clone(),
                count,
                ttl_ms: u64::from(TTL_MS),
                request_id: Some(request_id.clone()),
            };
            let t = self.rec.now();
            let out = match within(self.placement[s].allocate_cpus(req)).await {
                Some(Ok(a)) => {
                    self.held.push(Held { id: a.lease_id });
                    ok(Answer::Granted {
                        lease: a.lease_id,
                        node: a.node_id,
                        cpus: cpus(&a.cpus),
                        ttl_ms: u64::from(a.ttl_ms),
                    })
                }
                Some(Err(e)) => failed(&e),
                None => timed_out(),
            };
            let again = matches!(out, Outcome::Unknown { .. });
            self.rec.op(self.id, t, call, out);
            if !again {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn renew(&mut self) {
        let i = self.rng.below(self.held.len() as u64) as usize;
        let id = self.held[i].id;
        let s = self.server();
        let t = self.rec.now();
        let req = pb::RenewLeaseRequest {
            lease_id: id,
            ttl_ms: 0,
        };
        let out = match within(self.placement[s].renew_lease(req)).await {
            Some(Ok(r)) => ok(Answer::Renewed {
                ttl_ms: u64::from(r.ttl_ms),
            }),
            Some(Err(e)) => failed(&e),
            None => timed_out(),
        };
        if matches!(
            out,
            Outcome::Failed {
                not_found: true,
                ..
            }
        ) {
            self.held.swap_remove(i);
        }
        let call = Call::Renew {
            lease: id,
            ttl_ms: u64::from(TTL_MS),
        };
        self.rec.op(self.id, t, call, out);
    }

    /// One ReleaseCpus, retried while its outcome is unknown.
    async fn release(&mut self) {
        let i = self.rng.below(self.held.len() as u64) as usize;
        let id = self.held.swap_remove(i).id;
        for _ in 0..6 {
            let s = self.server();
            let t = self.rec.now();
            let req = pb::ReleaseCpusRequest { lease_id: id };
            let out = match within(self.placement[s].release_cpus(req)).await {
                Some(Ok(_)) => ok(Answer::Released),
                Some(Err(e)) => failed(&e),
                None => timed_out(),
            };
            let again = matches!(out, Outcome::Unknown { .. });
            self.rec.op(self.id, t, Call::Release { lease: id }, out);
            if !again {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    async fn get(&mut self) {
        let node = self.nodes[self.rng.below(self.nodes.len() as u64) as usize].clone();
        let s = self.server();
        let t = self.rec.now();
        let req = pb::GetNodeRequest {
            node_id: node.clone(),
        };
        let out = match within(self.admin[s].get_node(req)).await {
            Some(Ok(n)) => ok(Answer::Listed {
                leases: n
                    .leases
                    .iter()
                    .map(|l| Listed {
                        lease: l.lease_id,
                        cpus: cpus(&l.cpus),
                        expires_in_ms: l.expires_in_ms,
                    })
                    .collect(),
            }),
            Some(Err(e)) => failed(&e),
            None => timed_out(),
        };
        self.rec.op(self.id, t, Call::Get { node }, out);
    }
}
