//! The reader: one task reads the requests topic and hands each message to the scheduler under
//! its workspace. What it can answer at once, it answers here: a chunk that reached the topic
//! after its deadline (expired, never applied) and a message it cannot read (dead-lettered).
//! When a workspace's backlog reaches its bound, the reader pauses that partition.

use crate::apply::{fail_request, record};
use crate::consume::{Consumer, Request};
use crate::expiry;
use crate::metrics::Metrics;
use crate::outbox::{DeadLetter, Outbox, Unanswerable};
use crate::retry::{shutdown_asked, Interrupted, Policy};
use crate::schedule::{Queued, Scheduler};
use intake_common::message::{ChunkOutcome, RequestPart, WriteRequest};
use rdkafka::message::{Message, OwnedMessage};
use serde::Deserialize;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

pub struct Reader {
    pub pool: PgPool,
    pub consumer: Consumer,
    pub scheduler: Arc<Scheduler<Request>>,
    pub outbox: Arc<Outbox>,
    pub metrics: Arc<Metrics>,
    pub policy: Policy,
}

/// Enough of any message version to answer it when the rest cannot be read.
#[derive(Deserialize)]
struct Envelope {
    correlation_id: String,
    reply_partition: i32,
    #[serde(default)]
    workspace_id: String,
    #[serde(default)]
    request: Option<RequestPart>,
}

impl Reader {
    /// Reads until shutdown.
    pub async fn read(&self, shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
        loop {
            let received = tokio::select! {
                () = shutdown_asked(shutdown) => return Ok(()),
                received = self.consumer.kafka.recv() => received.map(|m| m.detach()),
            };
            let message = match received {
                Ok(message) => message,
                Err(error) => {
                    tracing::warn!(%error, "kafka consume error");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            };
            let generation = self.consumer.generation();
            self.consumer.resume(self.scheduler.rebalanced(generation));
            self.take(message, generation, shutdown).await?;
            self.metrics.backlog.set(i64::try_from(self.scheduler.backlog()).unwrap_or(i64::MAX));
        }
    }

    async fn take(
        &self,
        message: OwnedMessage,
        generation: u64,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let (partition, offset) = (message.partition(), message.offset());
        let request = match WriteRequest::from_slice(message.payload().unwrap_or_default()) {
            Ok(WriteRequest::V1(request)) => request,
            Err(error) => {
                self.unreadable(&message, error, shutdown).await?;
                self.consumer.store(generation, &[self.scheduler.skipped(partition, offset)]);
                return Ok(());
            }
        };
        if expiry::expired(&message, &request) {
            record(&self.metrics, &message, &request, "expired", &ChunkOutcome::Expired);
            self.outbox.reply_all(vec![(&request, ChunkOutcome::Expired)], shutdown).await?;
            self.consumer.store(generation, &[self.scheduler.skipped(partition, offset)]);
            return Ok(());
        }
        if let Err(unanswerable) = self.outbox.reply_partition_exists(request.reply_partition, shutdown).await? {
            self.unanswerable(&message, &request, unanswerable, shutdown).await?;
            self.consumer.store(generation, &[self.scheduler.skipped(partition, offset)]);
            return Ok(());
        }
        let workspace_id = request.workspace_id.clone();
        let queued = Queued { partition, offset, message: Request { message, request } };
        if let Some(partition) = self.scheduler.push(&workspace_id, queued) {
            tracing::warn!(partition, workspace_id, "a workspace's backlog reached its bound; partition paused");
            self.consumer.pause(partition);
        }
        Ok(())
    }

    /// A message whose reply partition does not exist cannot be answered: no gateway waits on
    /// that partition, so no client was told anything of it. It is not applied (nor any later
    /// chunk of its request), and it is dead-lettered with the reason for an operator.
    async fn unanswerable(
        &self,
        message: &OwnedMessage,
        request: &intake_common::message::WriteRequestV1,
        unanswerable: Unanswerable,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let Unanswerable { reason: error, attempts } = unanswerable;
        tracing::error!(
            %error,
            reply_partition = request.reply_partition,
            partition = message.partition(),
            offset = message.offset(),
            "a request message names a reply partition that does not exist"
        );
        record(&self.metrics, message, request, "failed", &ChunkOutcome::Failed);
        let part = request.request.as_ref();
        fail_request(&self.pool, self.policy, &self.metrics, &request.workspace_id, part, shutdown).await?;
        let letter = DeadLetter { reason: "no_reply_partition", error, attempts, message };
        self.outbox.dead_letter(letter, shutdown).await
    }

    /// Dead-lettered and answered failed (its request too, so that no later chunk of it is
    /// applied), when enough of it can be read.
    async fn unreadable(
        &self,
        message: &OwnedMessage,
        error: serde_json::Error,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let payload = message.payload().unwrap_or_default();
        tracing::error!(%error, partition = message.partition(), offset = message.offset(), "unreadable request message");
        let envelope = serde_json::from_slice::<Envelope>(payload).ok();
        if let Some(envelope) = &envelope {
            let part = envelope.request.as_ref();
            fail_request(&self.pool, self.policy, &self.metrics, &envelope.workspace_id, part, shutdown).await?;
        }
        let letter = DeadLetter { reason: "unreadable", error: error.to_string(), attempts: 1, message };
        self.outbox.dead_letter(letter, shutdown).await?;
        if let Some(envelope) = envelope {
            self.outbox
                .reply(&envelope.correlation_id, envelope.reply_partition, None, ChunkOutcome::Failed, shutdown)
                .await?;
        }
        Ok(())
    }
}
