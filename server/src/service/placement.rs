//! PlacementService: PickCpu and CanMigrate against the live state, and the
//! stateless Decide.

use std::sync::Arc;
use std::time::Instant;

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::placement_service_server::PlacementService;
use tonic::{Request, Response, Status};

use super::convert;
use crate::engine::{View, can_migrate_task, select_task_rq};
use crate::metrics as m;
use crate::scenario::decide_value;
use crate::store::{Node, Snapshot, Store};

/// How often a claimed placement is decided again when other claims keep
/// changing the node under it, before it decides under the node's writer.
const CLAIM_ATTEMPTS: usize = 64;

pub struct Placement {
    pub store: Arc<Store>,
}

impl Placement {
    fn node(&self, id: &str) -> Result<Arc<Node>, Status> {
        if id.is_empty() {
            return Err(Status::invalid_argument("node_id: must not be empty"));
        }
        self.store
            .get(id)
            .ok_or_else(|| Status::not_found(format!("node_id: no node {id:?} is registered")))
    }

    /// The node's current snapshot, refused when it is stale.
    fn fresh_snapshot(&self, node: &Node, now: Instant) -> Result<(Arc<Snapshot>, f64), Status> {
        let snap = node.snapshot();
        match snap.age(now) {
            None => Err(Status::failed_precondition(format!(
                "node {:?} has not reported its state yet",
                node.id
            ))),
            Some(age) if age > self.store.config.stale_after => {
                Err(Status::failed_precondition(format!(
                    "node {:?} is stale: last report {:.3} s ago (TTL {:.3} s)",
                    node.id,
                    age.as_secs_f64(),
                    self.store.config.stale_after.as_secs_f64()
                )))
            }
            Some(age) => Ok((snap, age.as_secs_f64())),
        }
    }
}

#[tonic::async_trait]
impl PlacementService for Placement {
    async fn pick_cpu(
        &self,
        req: Request<pb::PickCpuRequest>,
    ) -> Result<Response<pb::PickCpuResponse>, Status> {
        let r = req.into_inner();
        let node = self.node(&r.node_id)?;
        let mut attempt = 0;
        loop {
            let now = Instant::now();
            let (snap, age) = self.fresh_snapshot(&node, now)?;
            let (task, preq) = convert::pick_request(&r, &snap).map_err(convert::invalid)?;
            let view = View {
                topo: &snap.topo,
                state: &snap.state,
                features: &snap.features,
                system: &self.store.config.system,
            };
            let t0 = Instant::now();
            let p = select_task_rq(view, &task, &preq);
            let took = t0.elapsed().as_secs_f64();
            if r.claim && !self.store.try_claim(&node, snap.version, p.cpu, now) {
                attempt += 1;
                metrics::counter!(m::CLAIM_RETRIES).increment(1);
                if attempt < CLAIM_ATTEMPTS {
                    continue;
                }
                tokio::task::yield_now().await;
                continue;
            }
            let kind = preq.kind.as_str();
            let path = p.path.as_str();
            metrics::counter!(m::DECISIONS, "kind" => kind, "path" => path).increment(1);
            metrics::histogram!(m::DECISION_SCANNED, "kind" => kind, "path" => path)
                .record(p.scanned as f64);
            metrics::histogram!(m::DECISION_DURATION, "kind" => kind).record(took);
            metrics::histogram!(m::DECISION_STATE_AGE).record(age);
            metrics::counter!(m::NODE_DECISIONS, "node" => node.id.clone(), "kind" => kind)
                .increment(1);
            return Ok(Response::new(convert::pick_response(&p, &snap, age)));
        }
    }

    async fn can_migrate(
        &self,
        req: Request<pb::CanMigrateRequest>,
    ) -> Result<Response<pb::CanMigrateResponse>, Status> {
        let r = req.into_inner();
        let node = self.node(&r.node_id)?;
        let (snap, _) = self.fresh_snapshot(&node, Instant::now())?;
        let (task, env) = convert::migrate_request(&r, &snap).map_err(convert::invalid)?;
        let view = View {
            topo: &snap.topo,
            state: &snap.state,
            features: &snap.features,
            system: &self.store.config.system,
        };
        let d = can_migrate_task(view, &task, &env);
        let verdict = if d.allowed { "allowed" } else { "refused" };
        metrics::counter!(m::MIGRATE_CHECKS, "verdict" => verdict, "reason" => d.reason.as_str())
            .increment(1);
        Ok(Response::new(convert::migrate_response(&d, &snap)))
    }

    async fn decide(
        &self,
        req: Request<pb::DecideRequest>,
    ) -> Result<Response<pb::DecideResponse>, Status> {
        let r = req.into_inner();
        let v: serde_json::Value = serde_json::from_str(&r.scenario_json)
            .map_err(|e| Status::invalid_argument(format!("scenario_json: malformed JSON: {e}")))?;
        let answer = decide_value(&v).map_err(convert::invalid)?;
        Ok(Response::new(pb::DecideResponse {
            answer_json: answer.to_string(),
        }))
    }
}
