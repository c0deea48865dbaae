//! The writer's loop: take the request messages at hand (one, or as many as are waiting, up to
//! [`MAX_GROUP`]), apply them in order in one transaction, reply to each, and only then mark
//! their offsets for commit. Delivery is at least once; `applied_messages` makes a redelivery
//! harmless.

use crate::store;
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::message::{ChunkOutcome, WriteReply, WriteReplyV1, WriteRequest, WriteRequestV1};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Deserialize;
use sqlx::PgPool;
use std::time::Duration;
use tokio::sync::watch;

/// Messages applied in one transaction at most. Under load a group amortizes the commit and the
/// reply round trip; when idle a group is the one message that arrived.
const MAX_GROUP: usize = 64;

pub struct Settings {
    pub kafka: KafkaArgs,
    pub group_id: String,
    /// How long applied message ids are remembered; at least the requests topic's retention,
    /// so that any redelivery or replay from the topic is recognised.
    pub remember_applied: Duration,
    /// Attempts at a message that fails for a reason retrying cannot cure, before it goes to
    /// the dead-letter topic.
    pub max_attempts: u32,
}

/// Runs until `shutdown` turns true; the message in hand is finished (or, if it is stuck on
/// an outage, left uncommitted for the next writer) and the offsets are committed.
pub async fn run(pool: PgPool, settings: Settings, mut shutdown: watch::Receiver<bool>) -> anyhow::Result<()> {
    let consumer: StreamConsumer = kafka::writer_consumer(&settings.kafka, &settings.group_id).create()?;
    consumer.subscribe(&[&settings.kafka.requests_topic])?;
    let producer: FutureProducer = kafka::writer_producer(&settings.kafka).create()?;
    tokio::spawn(prune_applied_messages(pool.clone(), settings.remember_applied));
    let worker = Worker { pool, producer, settings };
    tracing::info!(topic = %worker.settings.kafka.requests_topic, group = %worker.settings.group_id, "writer consuming");

    loop {
        let first = tokio::select! {
            _ = shutdown.changed() => break,
            message = consumer.recv() => message,
        };
        let mut messages = match first {
            Ok(message) => vec![message],
            Err(error) => {
                tracing::warn!(%error, "kafka consume error");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        // Whatever else is already waiting (a zero timeout polls once).
        while messages.len() < MAX_GROUP {
            match tokio::time::timeout(Duration::ZERO, consumer.recv()).await {
                Ok(Ok(message)) => messages.push(message),
                _ => break,
            }
        }
        if worker.handle_group(&messages, &mut shutdown).await.is_err() {
            break; // shutting down with messages unfinished: they stay uncommitted
        }
        for message in &messages {
            if let Err(error) = consumer.store_offset_from_message(message) {
                tracing::warn!(%error, "could not store offset; the message may be redelivered");
            }
        }
    }
    if let Err(error) = consumer.commit_consumer_state(CommitMode::Sync) {
        tracing::warn!(%error, "final offset commit failed; the last messages may be redelivered");
    }
    tracing::info!("writer stopped");
    Ok(())
}

struct Worker {
    pool: PgPool,
    producer: FutureProducer,
    settings: Settings,
}

/// The message was not finished because the writer is shutting down.
struct Interrupted;

/// Enough of any message version to answer it when the rest cannot be read.
#[derive(Deserialize)]
struct Envelope {
    correlation_id: String,
    reply_partition: i32,
}

impl Worker {
    async fn handle_group(&self, messages: &[BorrowedMessage<'_>], shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
        let mut readable = Vec::with_capacity(messages.len());
        for message in messages {
            let payload = message.payload().unwrap_or_default();
            match serde_json::from_slice::<WriteRequest>(payload) {
                Ok(WriteRequest::V1(request)) => readable.push((message, request)),
                Err(error) => {
                    tracing::error!(%error, partition = message.partition(), offset = message.offset(), "unreadable request message");
                    self.dead_letter(message, "unreadable", shutdown).await?;
                    if let Ok(envelope) = serde_json::from_slice::<Envelope>(payload) {
                        self.reply(&envelope.correlation_id, envelope.reply_partition, ChunkOutcome::Failed, shutdown).await?;
                    }
                }
            }
        }
        if readable.is_empty() {
            return Ok(());
        }
        let outcomes = match self.apply_together(&readable, shutdown).await? {
            Some(outcomes) => outcomes,
            // Something in the group fails for good: apply one by one, so only that one fails.
            None => {
                let mut outcomes = Vec::with_capacity(readable.len());
                for (message, request) in &readable {
                    outcomes.push(self.apply(request, message, shutdown).await?);
                }
                outcomes
            }
        };
        let replies = readable.iter().zip(outcomes).map(|((_, request), outcome)| (request, outcome));
        self.reply_all(replies.collect(), shutdown).await
    }

    /// The whole group in one transaction, retried through outages; `None` when it fails for a
    /// reason retrying cannot cure.
    async fn apply_together(
        &self,
        group: &[(&BorrowedMessage<'_>, WriteRequestV1)],
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<Vec<ChunkOutcome>>, Interrupted> {
        let requests: Vec<&WriteRequestV1> = group.iter().map(|(_, request)| request).collect();
        let mut backoff = Duration::from_millis(50);
        loop {
            match store::apply_chunks(&self.pool, &requests).await {
                Ok(applied) => {
                    return Ok(Some(applied.into_iter().map(|a| ChunkOutcome::Applied { results: a.results }).collect()));
                }
                Err(error) if store::is_transient(&error) => {
                    tracing::warn!(%error, messages = requests.len(), "database unavailable; retrying");
                }
                Err(error) => {
                    tracing::warn!(%error, messages = requests.len(), "group failed; applying its messages one by one");
                    return Ok(None);
                }
            }
            pause(backoff, shutdown).await?;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Sends every reply at once and waits for the broker to take them all; a reply that fails
    /// is sent again until it is taken.
    async fn reply_all(&self, replies: Vec<(&WriteRequestV1, ChunkOutcome)>, shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
        let mut deliveries = Vec::with_capacity(replies.len());
        for (request, outcome) in &replies {
            let payload = reply_payload(&request.correlation_id, outcome.clone());
            let record = self.reply_record(&request.correlation_id, request.reply_partition, &payload);
            deliveries.push(self.producer.send_result(record).ok());
        }
        for ((request, outcome), delivery) in replies.into_iter().zip(deliveries) {
            let delivered = match delivery {
                Some(delivery) => matches!(delivery.await, Ok(Ok(_))),
                None => false,
            };
            if !delivered {
                self.reply(&request.correlation_id, request.reply_partition, outcome, shutdown).await?;
            }
        }
        Ok(())
    }

    /// Transient failures are retried with backoff for as long as they last; others a bounded
    /// number of times, then the message goes to the dead-letter topic and is answered as failed.
    async fn apply(
        &self,
        request: &WriteRequestV1,
        message: &BorrowedMessage<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<ChunkOutcome, Interrupted> {
        let mut failures = 0;
        let mut backoff = Duration::from_millis(50);
        loop {
            let error = match store::apply_chunk(&self.pool, request).await {
                Ok(applied) => return Ok(ChunkOutcome::Applied { results: applied.results }),
                Err(error) => error,
            };
            if store::is_transient(&error) {
                tracing::warn!(%error, correlation_id = %request.correlation_id, "database unavailable; retrying");
            } else {
                failures += 1;
                tracing::error!(%error, correlation_id = %request.correlation_id, failures, "chunk failed");
                if failures >= self.settings.max_attempts {
                    self.dead_letter(message, "apply_failed", shutdown).await?;
                    return Ok(ChunkOutcome::Failed);
                }
            }
            pause(backoff, shutdown).await?;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    async fn reply(
        &self,
        correlation_id: &str,
        partition: i32,
        outcome: ChunkOutcome,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let payload = reply_payload(correlation_id, outcome);
        self.produce(|| self.reply_record(correlation_id, partition, &payload), shutdown).await
    }

    fn reply_record<'a>(&'a self, correlation_id: &'a str, partition: i32, payload: &'a [u8]) -> FutureRecord<'a, str, [u8]> {
        FutureRecord::to(&self.settings.kafka.replies_topic).partition(partition).key(correlation_id).payload(payload)
    }

    async fn dead_letter(&self, message: &BorrowedMessage<'_>, reason: &str, shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
        let payload = message.payload().unwrap_or_default();
        let key = message.key().unwrap_or_default();
        let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header { key: "reason", value: Some(reason) });
        let record = || FutureRecord::to(&self.settings.kafka.dlq_topic).key(key).payload(payload).headers(headers.clone());
        self.produce(record, shutdown).await
    }

    /// Produces until the broker acknowledges, retrying with backoff through a broker outage.
    async fn produce<'a, K, P>(
        &self,
        record: impl Fn() -> FutureRecord<'a, K, P>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted>
    where
        K: rdkafka::message::ToBytes + ?Sized + 'a,
        P: rdkafka::message::ToBytes + ?Sized + 'a,
    {
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.producer.send(record(), Duration::from_secs(5)).await {
                Ok(_) => return Ok(()),
                Err((error, _)) => tracing::warn!(%error, "produce failed; retrying"),
            }
            pause(backoff, shutdown).await?;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

/// Forgets applied message ids older than `keep`, every few minutes, in small batches.
async fn prune_applied_messages(pool: PgPool, keep: Duration) {
    let keep_secs = keep.as_secs_f64();
    loop {
        let pruned = sqlx::query(
            "DELETE FROM applied_messages WHERE correlation_id IN (
                SELECT correlation_id FROM applied_messages
                 WHERE applied_at < now() - make_interval(secs => $1) LIMIT 10000)",
        )
        .bind(keep_secs)
        .execute(&pool)
        .await;
        match pruned {
            Ok(done) if done.rows_affected() == 10_000 => continue,
            Ok(_) => {}
            Err(error) => tracing::warn!(%error, "pruning applied_messages failed"),
        }
        tokio::time::sleep(Duration::from_secs(300)).await;
    }
}

fn reply_payload(correlation_id: &str, outcome: ChunkOutcome) -> Vec<u8> {
    let reply = WriteReply::V1(WriteReplyV1 { correlation_id: correlation_id.to_owned(), outcome });
    serde_json::to_vec(&reply).unwrap_or_default()
}

async fn pause(duration: Duration, shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
    if *shutdown.borrow() {
        return Err(Interrupted);
    }
    tokio::select! {
        _ = tokio::time::sleep(duration) => Ok(()),
        _ = shutdown.changed() => Err(Interrupted),
    }
}

