//! The synchronous write path over Kafka: each chunk is one request message keyed by workspace
//! id; the writer answers on this gateway's own reply partition, which the gateway reads by
//! assignment (no consumer group), and a map of pending correlation ids hands each reply to the
//! request waiting for it.

use intake_common::config::{now_ms, KafkaArgs};
use intake_common::conversion::Conversion;
use intake_common::ids;
use intake_common::message::{ChunkOutcome, ItemResult, WriteReply, WriteRequest, WriteRequestV1};
use intake_common::kafka;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

type Pending = Arc<Mutex<HashMap<String, oneshot::Sender<ChunkOutcome>>>>;

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("the request could not be sent to Kafka: {0}")]
    Produce(String),
    #[error("no reply from a writer before the deadline")]
    Timeout,
    #[error("a writer could not apply a chunk")]
    Failed,
}

pub struct WriteClient {
    producer: FutureProducer,
    pending: Pending,
    requests_topic: String,
    reply_partition: i32,
    timeout: Duration,
}

impl WriteClient {
    /// Connects and starts reading replies from the current end of the reply partition, so
    /// that a reply to any request sent after this returns is seen.
    pub async fn start(kafka: &KafkaArgs, reply_partition: i32, timeout: Duration) -> anyhow::Result<Arc<Self>> {
        let producer: FutureProducer = kafka::request_producer(kafka, timeout).create()?;
        let consumer: StreamConsumer = kafka::reply_reader(kafka).create()?;
        let consumer = Arc::new(consumer);
        let topic = kafka.replies_topic.clone();
        let high = reply_partition_end(&consumer, &topic, reply_partition).await;
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(&topic, reply_partition, Offset::Offset(high))?;
        consumer.assign(&assignment)?;
        tracing::info!(%topic, reply_partition, offset = high, "reading replies");

        let pending: Pending = Arc::default();
        tokio::spawn(dispatch_replies(consumer, pending.clone()));
        Ok(Arc::new(WriteClient { producer, pending, requests_topic: kafka.requests_topic.clone(), reply_partition, timeout }))
    }

    /// Sends the chunks in order and waits for every reply. Each chunk is sent only after the
    /// broker acknowledged the one before, so chunks of one request cannot be reordered by a
    /// producer retry. On an error, earlier chunks may be committed (SPEC 4.3).
    pub async fn write(
        &self,
        workspace_id: &str,
        chunks: Vec<Vec<Conversion>>,
        received_at_ms: i64,
    ) -> Result<Vec<Vec<ItemResult>>, WriteError> {
        let deadline = Instant::now() + self.timeout;
        let deadline_ms = now_ms() + i64::try_from(self.timeout.as_millis()).unwrap_or(i64::MAX);
        let mut waiting = Vec::with_capacity(chunks.len());
        for items in chunks {
            let correlation_id = ids::correlation_id();
            let (sender, receiver) = oneshot::channel();
            let guard = PendingGuard::new(&self.pending, correlation_id.clone(), sender);
            let request = WriteRequest::V1(WriteRequestV1 {
                correlation_id,
                reply_partition: self.reply_partition,
                deadline_ms,
                received_at_ms,
                workspace_id: workspace_id.to_owned(),
                items,
            });
            let payload = serde_json::to_vec(&request).map_err(|e| WriteError::Produce(e.to_string()))?;
            let record = FutureRecord::to(&self.requests_topic).key(workspace_id).payload(&payload);
            let queue_timeout = deadline.saturating_duration_since(Instant::now());
            self.producer.send(record, queue_timeout).await.map_err(|(error, _)| WriteError::Produce(error.to_string()))?;
            waiting.push((receiver, guard));
        }
        let mut results = Vec::with_capacity(waiting.len());
        for (receiver, _guard) in waiting {
            match tokio::time::timeout_at(deadline, receiver).await {
                Ok(Ok(ChunkOutcome::Applied { results: chunk })) => results.push(chunk),
                Ok(Ok(ChunkOutcome::Failed)) => return Err(WriteError::Failed),
                Ok(Err(_)) | Err(_) => return Err(WriteError::Timeout),
            }
        }
        Ok(results)
    }

    /// Requests waiting for a reply now.
    pub fn in_flight(&self) -> usize {
        self.pending.lock().map(|p| p.len()).unwrap_or(0)
    }
}

/// The current end of the reply partition; waits (and says so) while Kafka cannot be reached or
/// does not know the partition yet, instead of exiting into a crash loop.
async fn reply_partition_end(consumer: &Arc<StreamConsumer>, topic: &str, partition: i32) -> i64 {
    let mut backoff = Duration::from_millis(100);
    loop {
        let (consumer, owned_topic) = (consumer.clone(), topic.to_owned());
        let fetched =
            tokio::task::spawn_blocking(move || consumer.fetch_watermarks(&owned_topic, partition, Duration::from_secs(5))).await;
        match fetched {
            Ok(Ok((_, high))) => return high,
            Ok(Err(error)) => tracing::warn!(%error, topic, partition, "cannot read the reply partition yet; retrying"),
            Err(error) => tracing::warn!(%error, "watermark task failed; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Removes a correlation id from the pending map when its request stops waiting, whether it
/// got its reply, timed out, or its client went away.
struct PendingGuard {
    pending: Pending,
    correlation_id: String,
}

impl PendingGuard {
    fn new(pending: &Pending, correlation_id: String, sender: oneshot::Sender<ChunkOutcome>) -> Self {
        pending.lock().unwrap_or_else(|p| p.into_inner()).insert(correlation_id.clone(), sender);
        PendingGuard { pending: pending.clone(), correlation_id }
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.correlation_id);
    }
}

async fn dispatch_replies(consumer: Arc<StreamConsumer>, pending: Pending) {
    loop {
        let message = match consumer.recv().await {
            Ok(message) => message,
            Err(error) => {
                tracing::warn!(%error, "reading replies failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let reply = match serde_json::from_slice::<WriteReply>(message.payload().unwrap_or_default()) {
            Ok(reply) => reply,
            Err(error) => {
                tracing::warn!(%error, offset = message.offset(), "unreadable reply");
                continue;
            }
        };
        let sender = pending.lock().unwrap_or_else(|p| p.into_inner()).remove(reply.correlation_id());
        // No sender: a reply to a request that gave up waiting, or a redelivered reply.
        if let Some(sender) = sender {
            let WriteReply::V1(reply) = reply;
            let _ = sender.send(reply.outcome);
        }
    }
}
