//! ReplicaService: what a replica serves its peers, the aggregates of the
//! nodes it holds ([`crate::replica::aggregates`]). Only `replica` (and
//! admin) certificates reach it under mutual TLS (the role table).

use std::pin::Pin;
use std::sync::Arc;

use fairplace_proto::v1 as pb;
use fairplace_proto::v1::replica_service_server::ReplicaService;
use tokio::sync::broadcast::error::RecvError;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::replica::aggregates::Publisher;

pub struct Peers {
    pub publisher: Arc<Publisher>,
}

type Aggregates = Pin<Box<dyn Stream<Item = Result<pb::NodeAggregates, Status>> + Send>>;

#[tonic::async_trait]
impl ReplicaService for Peers {
    type WatchAggregatesStream = Aggregates;

    async fn watch_aggregates(
        &self,
        req: Request<pb::WatchAggregatesRequest>,
    ) -> Result<Response<Aggregates>, Status> {
        let who = req.into_inner().replica_id;
        // Subscribed before the full list is read: no change falls between.
        let mut rx = self.publisher.subscribe();
        let first = self.publisher.full();
        tracing::info!(replica = %who, nodes = first.nodes.len(), "a replica subscribed to this one's aggregates");
        let (tx, out) = mpsc::channel(4);
        let publisher = Arc::clone(&self.publisher);
        tokio::spawn(async move {
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            loop {
                let msg = match rx.recv().await {
                    Ok(m) => (*m).clone(),
                    // Too slow to keep up: the whole list again.
                    Err(RecvError::Lagged(_)) => publisher.full(),
                    Err(RecvError::Closed) => return,
                };
                if tx.send(Ok(msg)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}
