//! The synchronous write path over Kafka: each chunk is one request message keyed by workspace
//! id; the writer answers on this gateway's own reply partition, which the gateway reads by
//! assignment (no consumer group), and a map of pending correlation ids hands each reply to the
//! request waiting for it.

use crate::metrics::Metrics;
use crate::overload::WorkspaceTicket;
use crate::sink::{BoxFuture, ChunkedWrite, WriteError, WriteSink, Written};
use crate::timing::{Received, Sent, Stages};
use intake_common::config::{now_ms, now_us, KafkaArgs};
use intake_common::kafka;
use intake_common::kafka_errors::{ConsumeErrors, QuietContext};
use intake_model::ids;
use intake_model::message::{
    ChainMerge, ChunkOutcome, ItemResult, RequestPart, WriteReply, WriteRequest, WriteRequestV1, WriterTiming,
};
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, Message, OwnedHeaders, Timestamp};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// The Kafka header that carries the request id to the writer, for its log lines.
pub const REQUEST_ID_HEADER: &str = "request_id";

/// How long one readiness probe of Kafka may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// The chunks waiting for their reply. A chunk whose request gave up stays until its reply comes
/// (or [`FORGET_AFTER`]), so that it keeps counting against its workspace's admission; one that
/// Kafka did not take is forgotten at once, as no reply can come to it.
struct Waiting {
    chunks: HashMap<String, Pending>,
}

struct Pending {
    /// None once the request stopped waiting.
    sender: Option<oneshot::Sender<Answered>>,
    sent_at: Instant,
    ticket: Option<WorkspaceTicket>,
}

/// How long a chunk whose request gave up is remembered without a reply: replies come even to
/// late chunks, so this only bounds what a lost reply holds (a writer that could not send it):
/// its workspace's writes are refused as behind until then.
const FORGET_AFTER: Duration = Duration::from_secs(60);
/// How often the chunks past [`FORGET_AFTER`] are let go: on a clock of its own, as a workspace
/// refused as behind sends nothing that could trigger it.
const SWEEP_INTERVAL: Duration = Duration::from_secs(1);

type Shared = Arc<Mutex<Waiting>>;

/// A chunk's reply as the request waiting for it gets it.
struct Answered {
    outcome: ChunkOutcome,
    /// None from a writer that predates it.
    timing: Option<WriterTiming>,
    received: Received,
}

fn lock(waiting: &Shared) -> std::sync::MutexGuard<'_, Waiting> {
    waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub struct WriteClient {
    producer: FutureProducer<QuietContext>,
    consumer: Arc<StreamConsumer<QuietContext>>,
    waiting: Shared,
    requests_topic: String,
    replies_topic: String,
    reply_partition: i32,
    timeout: Duration,
    /// Taken off the deadline a message carries, so that a writer that compares the broker's
    /// append time with it refuses every chunk appended after this gateway gave up, even with
    /// the broker's clock behind this one's by up to the margin (docs/architecture.md,
    /// "Stale values").
    clock_skew_margin: Duration,
}

impl WriteClient {
    /// Connects and starts reading replies from the current end of the reply partition, so
    /// that a reply to any request sent after this returns is seen.
    pub async fn start(
        kafka: &KafkaArgs,
        reply_partition: i32,
        timeout: Duration,
        clock_skew_margin: Duration,
        metrics: Metrics,
    ) -> anyhow::Result<Arc<Self>> {
        let producer = kafka::request_producer(kafka, timeout).create_with_context(QuietContext::default())?;
        let consumer: StreamConsumer<QuietContext> =
            kafka::reply_reader(kafka).create_with_context(QuietContext::default())?;
        let consumer = Arc::new(consumer);
        let topic = kafka.replies_topic.clone();
        let high = reply_partition_end(&consumer, &topic, reply_partition).await;
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(&topic, reply_partition, Offset::Offset(high))?;
        consumer.assign(&assignment)?;
        tracing::info!(%topic, reply_partition, offset = high, "reading replies");

        let waiting = Arc::new(Mutex::new(Waiting { chunks: HashMap::new() }));
        tokio::spawn(dispatch_replies(consumer.clone(), waiting.clone(), metrics));
        tokio::spawn(forget_lost_replies(Arc::downgrade(&waiting)));
        Ok(Arc::new(WriteClient {
            producer,
            consumer,
            waiting,
            requests_topic: kafka.requests_topic.clone(),
            replies_topic: topic,
            reply_partition,
            timeout,
            clock_skew_margin,
        }))
    }

    /// Sends the chunks and waits for every reply, all within one deadline for the whole
    /// request. The chunks are queued at once, in order: the producer keeps one request in flight
    /// per broker (common/src/kafka.rs), so chunks of one partition keep their order through
    /// retries, and a batch costs one round trip instead of one per chunk. On an error, earlier chunks may be committed
    /// (docs/api.md, "POST /v1/conversions/batch").
    async fn request_reply(&self, write: ChunkedWrite<'_>) -> Result<Written, WriteError> {
        let ChunkedWrite { request_id, workspace_id, chunks, received_at_ms, started, ticket } = write;
        let deadline = Instant::from_std(started) + self.timeout;
        let left = deadline.saturating_duration_since(Instant::now());
        let margin = self.clock_skew_margin.min(self.timeout / 2);
        let deadline_ms = now_ms() + i64::try_from(left.saturating_sub(margin).as_millis()).unwrap_or(i64::MAX);
        let mut deliveries = Vec::with_capacity(chunks.len());
        let mut replies = Vec::with_capacity(chunks.len());
        let mut last_sent = None;
        for (index, items) in (0u32..).zip(chunks) {
            let correlation_id = ids::correlation_id();
            let request = WriteRequest::V1(WriteRequestV1 {
                correlation_id: correlation_id.clone(),
                reply_partition: self.reply_partition,
                deadline_ms,
                received_at_ms,
                workspace_id: workspace_id.to_owned(),
                items,
                request: Some(RequestPart { id: request_id.to_owned(), index }),
                position: None,
            });
            let payload = serde_json::to_vec(&request).map_err(|e| WriteError::Produce(e.to_string()))?;
            let (receiver, guard) = PendingGuard::register(&self.waiting, correlation_id.clone(), ticket.cloned());
            let headers = OwnedHeaders::new().insert(Header { key: REQUEST_ID_HEADER, value: Some(request_id) });
            let record = FutureRecord::to(&self.requests_topic).key(workspace_id).payload(&payload).headers(headers);
            last_sent = Some(Sent { at: std::time::Instant::now(), wall_us: now_us() });
            let delivery = match self.producer.send_result(record) {
                Ok(delivery) => delivery,
                Err((error, _)) => {
                    lock(&self.waiting).chunks.remove(&correlation_id);
                    return Err(WriteError::Produce(error.to_string()));
                }
            };
            // Its own task: a chunk Kafka refuses after this request gave up is forgotten too.
            deliveries.push(tokio::spawn(delivered(delivery, self.waiting.clone(), correlation_id)));
            replies.push((receiver, guard));
        }
        let all = async {
            for delivery in deliveries {
                delivery.await.unwrap_or_else(|error| Err(WriteError::Produce(error.to_string())))?;
            }
            let mut results = Vec::with_capacity(replies.len());
            let mut last = None;
            for (receiver, _guard) in replies {
                let Ok(Answered { outcome, timing, received }) = receiver.await else {
                    return Err(WriteError::Timeout);
                };
                last = timing.map(|timing| (timing, received));
                match outcome {
                    ChunkOutcome::Applied { results: chunk, merged } => {
                        follow_merges(&mut results, &merged);
                        results.push(chunk);
                    }
                    ChunkOutcome::Failed => return Err(WriteError::Failed),
                    ChunkOutcome::Expired => return Err(WriteError::Expired),
                }
            }
            // The last chunk's way, against the last chunk's send.
            let stages =
                last.zip(last_sent).map(|((timing, received), sent)| Stages::of(started, sent, timing, received));
            Ok(Written { chunks: results, stages })
        };
        tokio::time::timeout_at(deadline, all).await.unwrap_or(Err(WriteError::Timeout))
    }

    /// For readiness: the reply partition is assigned to this gateway and its leader answers,
    /// and the broker knows the requests topic.
    async fn check_kafka(&self) -> Result<(), String> {
        let consumer = self.consumer.clone();
        let producer = self.producer.clone();
        let (replies, partition, requests) =
            (self.replies_topic.clone(), self.reply_partition, self.requests_topic.clone());
        let probe = move || -> Result<(), String> {
            let assignment = consumer.assignment().map_err(|e| e.to_string())?;
            if !assignment.elements_for_topic(&replies).iter().any(|e| e.partition() == partition) {
                return Err("the reply partition is not assigned".into());
            }
            consumer
                .fetch_watermarks(&replies, partition, PROBE_TIMEOUT)
                .map_err(|e| format!("reply partition: {e}"))?;
            let metadata =
                producer.client().fetch_metadata(Some(&requests), PROBE_TIMEOUT).map_err(|e| e.to_string())?;
            match metadata.topics().first() {
                Some(topic) if topic.error().is_none() && !topic.partitions().is_empty() => Ok(()),
                _ => Err("the requests topic is unknown to the broker".into()),
            }
        };
        tokio::task::spawn_blocking(probe).await.map_err(|e| e.to_string())?
    }
}

impl WriteSink for WriteClient {
    fn write<'a>(&'a self, write: ChunkedWrite<'a>) -> BoxFuture<'a, Result<Written, WriteError>> {
        Box::pin(self.request_reply(write))
    }

    fn probe(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(self.check_kafka())
    }
}

/// The current end of the reply partition; waits (and says so) while Kafka cannot be reached or
/// does not know the partition yet, instead of exiting into a crash loop.
async fn reply_partition_end(consumer: &Arc<StreamConsumer<QuietContext>>, topic: &str, partition: i32) -> i64 {
    let mut backoff = Duration::from_millis(100);
    loop {
        let (consumer, owned_topic) = (consumer.clone(), topic.to_owned());
        let fetched = tokio::task::spawn_blocking(move || {
            consumer.fetch_watermarks(&owned_topic, partition, Duration::from_secs(5))
        })
        .await;
        match fetched {
            Ok(Ok((_, high))) => return high,
            Ok(Err(error)) => tracing::warn!(%error, topic, partition, "cannot read the reply partition yet; retrying"),
            Err(error) => tracing::warn!(%error, "watermark task failed; retrying"),
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Stops a chunk's waiting when its request stops waiting, whether it got its reply, timed out,
/// or its client went away; the chunk itself stays in the map until its reply comes.
struct PendingGuard {
    waiting: Shared,
    correlation_id: String,
}

impl PendingGuard {
    fn register(
        waiting: &Shared,
        correlation_id: String,
        ticket: Option<WorkspaceTicket>,
    ) -> (oneshot::Receiver<Answered>, Self) {
        let (sender, receiver) = oneshot::channel();
        let pending = Pending { sender: Some(sender), sent_at: Instant::now(), ticket };
        lock(waiting).chunks.insert(correlation_id.clone(), pending);
        (receiver, PendingGuard { waiting: waiting.clone(), correlation_id })
    }
}

impl Drop for PendingGuard {
    fn drop(&mut self) {
        let mut map = lock(&self.waiting);
        match map.chunks.get_mut(&self.correlation_id) {
            // Answered, or never counted against a workspace: nothing to keep.
            Some(pending) if pending.ticket.is_none() => {
                map.chunks.remove(&self.correlation_id);
            }
            Some(pending) => pending.sender = None,
            None => {}
        }
    }
}

/// Lets go of the chunks whose request gave up and whose reply has not come within
/// [`FORGET_AFTER`], until the client is dropped.
async fn forget_lost_replies(waiting: std::sync::Weak<Mutex<Waiting>>) {
    let mut ticks = tokio::time::interval(SWEEP_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(waiting) = waiting.upgrade() else { return };
        lock(&waiting).chunks.retain(|_, pending| pending.sender.is_some() || pending.sent_at.elapsed() < FORGET_AFTER);
    }
}

/// Kafka's answer to one chunk. A chunk it did not take gets no reply, so it is forgotten at
/// once: it would otherwise hold its workspace's admission, and refuse its writes as behind,
/// long after Kafka is back.
async fn delivered(delivery: DeliveryFuture, waiting: Shared, correlation_id: String) -> Result<(), WriteError> {
    let error = match delivery.await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err((error, _))) => error.to_string(),
        Err(_) => "the producer dropped the message".to_owned(),
    };
    lock(&waiting).chunks.remove(&correlation_id);
    Err(WriteError::Produce(error))
}

async fn dispatch_replies(consumer: Arc<StreamConsumer<QuietContext>>, waiting: Shared, metrics: Metrics) {
    let mut errors = ConsumeErrors::new("reading replies failed");
    loop {
        let message = match consumer.recv().await {
            Ok(message) => message,
            Err(error) => {
                errors.record(&error).await;
                continue;
            }
        };
        let received = Received { appended_ms: log_append_time(&message), wall_us: now_us() };
        let reply = match WriteReply::from_slice(message.payload().unwrap_or_default()) {
            Ok(reply) => reply,
            Err(error) => {
                tracing::warn!(%error, offset = message.offset(), "unreadable reply");
                continue;
            }
        };
        let pending = lock(&waiting).chunks.remove(reply.correlation_id());
        // None: a redelivered reply, or one to a chunk forgotten long ago.
        let Some(pending) = pending else { continue };
        if let Some(ticket) = &pending.ticket {
            ticket.answered();
        }
        // No sender: a reply to a request that gave up waiting.
        if let Some(sender) = pending.sender {
            metrics.kafka_roundtrip.observe(pending.sent_at.elapsed().as_secs_f64());
            let WriteReply::V1(reply) = reply;
            let _ = sender.send(Answered { outcome: reply.outcome, timing: reply.timing, received });
        }
    }
}

/// The broker's append time of a reply, on a replies topic that stamps it.
fn log_append_time(message: &impl Message) -> Option<i64> {
    match message.timestamp() {
        Timestamp::LogAppendTime(ms) => Some(ms),
        Timestamp::CreateTime(_) | Timestamp::NotAvailable => None,
    }
}

/// A later chunk of a request may merge a chain that an earlier chunk's items were answered
/// with: the answers name each conversion's chain after the whole request.
fn follow_merges(earlier: &mut [Vec<ItemResult>], merged: &[ChainMerge]) {
    if merged.is_empty() {
        return;
    }
    let into: HashMap<&str, &str> = merged.iter().map(|m| (m.from.as_str(), m.into.as_str())).collect();
    for result in earlier.iter_mut().flatten() {
        if let Some(&chain) = into.get(result.chain_id.as_str()) {
            result.chain_id = chain.to_owned();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use intake_model::message::WriteResult;

    fn answered(chain: &str) -> ItemResult {
        ItemResult {
            id: "cnv".into(),
            event: "lead".into(),
            external_id: "1".into(),
            chain_id: chain.into(),
            result: WriteResult::Created,
        }
    }

    fn merge(from: &str, into: &str) -> ChainMerge {
        ChainMerge { from: from.into(), into: into.into() }
    }

    #[test]
    fn earlier_chunks_are_answered_with_the_chain_after_the_request() {
        let mut results = vec![vec![answered("chn_c"), answered("chn_d")]];
        follow_merges(&mut results, &[merge("chn_c", "chn_b")]);
        results.push(vec![answered("chn_b")]);
        // A third chunk merges the second's chain further; it knows nothing of chn_c, whose
        // rows the second relabelled.
        follow_merges(&mut results, &[merge("chn_b", "chn_a")]);
        let chains: Vec<Vec<&str>> =
            results.iter().map(|chunk| chunk.iter().map(|r| r.chain_id.as_str()).collect()).collect();
        assert_eq!(chains, vec![vec!["chn_a", "chn_d"], vec!["chn_a"]]);
    }
}
