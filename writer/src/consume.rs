//! The writer's loop. One task reads the requests topic and hands each message to a lane by its
//! partition; each lane takes the messages at hand (one, or as many as are waiting, up to
//! [`MAX_GROUP`]), applies them in order in one transaction, replies to each, and only then
//! marks their offsets for commit. A partition (a workspace's messages) always goes to the same
//! lane, so its chunks keep their order; lanes of different partitions touch different
//! workspaces and apply in parallel, each on its own connection, so that one writer is not
//! bounded by the round trips of one transaction at a time. Delivery is at least once;
//! `applied_messages` makes a redelivery harmless. Every failure goes through the one retry
//! policy of `retry.rs`.

use crate::health::{Health, WriterContext};
use crate::metrics::{self, Metrics};
use crate::retry::{shutdown_asked, Interrupted, Policy, Stop};
use crate::store;
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::message::{ChunkOutcome, WriteReply, WriteReplyV1, WriteRequest, WriteRequestV1};
use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Deserialize;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Messages applied in one transaction at most. Under load a group amortizes the commit and the
/// reply round trip; when idle a group is the one message that arrived.
const MAX_GROUP: usize = 64;

pub struct Settings {
    pub kafka: KafkaArgs,
    pub group_id: String,
    /// How long applied message ids are remembered beyond the requests topic's retention
    /// (which `retention.rs` reads from Kafka): any redelivery or replay is recognised.
    pub remember_applied: Duration,
    pub policy: Policy,
    /// Groups applied at once, each of its own partitions (see the module's comment).
    pub lanes: usize,
    /// How long the final offset commit and leaving the group may take at shutdown (they wait
    /// for the broker, which may be down).
    pub shutdown_timeout: Duration,
}

type WriterConsumer = StreamConsumer<WriterContext>;

/// Runs until `shutdown` turns true; the groups in hand are finished (or, if one is stuck on an
/// outage, left uncommitted for the next writer), the offsets are committed and the group left.
pub async fn run(
    pool: PgPool,
    settings: Settings,
    health: Arc<Health>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let consumer: WriterConsumer = kafka::writer_consumer(&settings.kafka, &settings.group_id)
        .create_with_context(WriterContext(health.clone()))?;
    consumer.subscribe(&[&settings.kafka.requests_topic])?;
    let consumer = Arc::new(consumer);
    let producer: FutureProducer = kafka::writer_producer(&settings.kafka).create()?;
    tokio::spawn(crate::retention::run(pool.clone(), settings.kafka.clone(), settings.remember_applied));
    let observer =
        tokio::spawn(observe(pool.clone(), consumer.clone(), settings.group_id.clone(), health.metrics.clone()));
    let lane_count = settings.lanes.max(1);
    let worker = Arc::new(Worker { pool, producer, metrics: health.metrics.clone(), settings });
    tracing::info!(topic = %worker.settings.kafka.requests_topic, group = %worker.settings.group_id, lanes = lane_count, "writer consuming");

    // Shutdown stops the lanes taking new groups; the group in hand gets FINISH_GRACE to finish
    // before its waits are cut short too (`abort`).
    let (abort, aborted) = watch::channel(false);
    let mut lanes = Vec::with_capacity(lane_count);
    let mut lane_tasks = Vec::with_capacity(lane_count);
    for _ in 0..lane_count {
        // Room for one full group waiting while the lane applies another.
        let (sender, receiver) = mpsc::channel(MAX_GROUP);
        lanes.push(sender);
        let signals = LaneSignals { shutdown: shutdown.clone(), abort: aborted.clone() };
        lane_tasks.push(tokio::spawn(lane(worker.clone(), consumer.clone(), health.clone(), receiver, signals)));
    }
    let mut lane_lost = false;
    loop {
        let received = tokio::select! {
            () = shutdown_asked(&mut shutdown) => break,
            message = consumer.recv() => message.map(|m| Received { generation: health.assignment_generation(), message: m.detach() }),
        };
        let received = match received {
            Ok(received) => received,
            Err(error) => {
                tracing::warn!(%error, "kafka consume error");
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
        };
        let lane = &lanes[usize::try_from(received.message.partition()).unwrap_or(0) % lane_count];
        // A full lane holds the reading back (backpressure), shutdown excepted.
        tokio::select! {
            () = shutdown_asked(&mut shutdown) => break,
            sent = lane.send(received) => if sent.is_err() { lane_lost = true; break },
        }
    }
    drop(lanes);
    tokio::spawn(async move {
        tokio::time::sleep(FINISH_GRACE).await;
        let _ = abort.send(true);
    });
    for task in lane_tasks {
        if let Err(error) = task.await {
            tracing::error!(%error, "an apply lane failed");
            lane_lost = true;
        }
    }
    health.shutting_down();
    observer.abort();
    let timeout = worker.settings.shutdown_timeout;
    leave_group(consumer, worker, timeout).await;
    // A lane that died is a failure, not a shutdown: exit non-zero so that it is restarted.
    anyhow::ensure!(!lane_lost, "an apply lane stopped; the writer stopped with it");
    tracing::info!("writer stopped");
    Ok(())
}

/// How long the groups in hand get to finish at shutdown (applying and answering take
/// milliseconds when PostgreSQL and Kafka are up) before their waits are cut short: with the
/// brokers away a reply would wait out the producer's timeouts, longer than a bounded shutdown.
/// What is cut short stays uncommitted for the writer that takes the partition over.
const FINISH_GRACE: Duration = Duration::from_secs(2);

/// A message with the assignment generation it was read in (see `Health`).
struct Received {
    generation: u64,
    message: OwnedMessage,
}

struct LaneSignals {
    /// Take no new group.
    shutdown: watch::Receiver<bool>,
    /// Stop waiting in the group in hand.
    abort: watch::Receiver<bool>,
}

/// One lane: groups what is waiting in it, applies, replies, and marks the offsets for commit.
/// At shutdown it finishes the group in hand and leaves the rest uncommitted. Messages read
/// before a rebalance are dropped unapplied: the partition's owner reads them again from the
/// committed offset.
async fn lane(
    worker: Arc<Worker>,
    consumer: Arc<WriterConsumer>,
    health: Arc<Health>,
    mut receiver: mpsc::Receiver<Received>,
    signals: LaneSignals,
) {
    let LaneSignals { mut shutdown, mut abort } = signals;
    loop {
        let first = tokio::select! {
            biased;
            () = shutdown_asked(&mut shutdown) => return,
            received = receiver.recv() => received,
        };
        let Some(first) = first else { return };
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match receiver.try_recv() {
                Ok(received) => group.push(received),
                Err(_) => break,
            }
        }
        let generation = health.assignment_generation();
        let messages: Vec<OwnedMessage> =
            group.into_iter().filter(|r| r.generation == generation).map(|r| r.message).collect();
        if messages.is_empty() {
            continue;
        }
        if worker.handle_group(&messages, &mut abort).await.is_err() {
            return; // shutting down with messages unfinished: they stay uncommitted
        }
        if health.assignment_generation() != generation {
            tracing::info!(
                messages = messages.len(),
                "a rebalance came while applying; offsets left to the partitions' owners"
            );
            continue;
        }
        for message in &messages {
            // librdkafka stores offset + 1: the next message to read.
            match consumer.store_offset(message.topic(), message.partition(), message.offset()) {
                Ok(()) => health.progressed(message.partition()),
                Err(error) => tracing::warn!(%error, "could not store offset; the message may be redelivered"),
            }
        }
    }
}

/// Commits the stored offsets and leaves the group, so that the partitions move at once; both
/// wait for the broker, so they are bounded: past the timeout the writer exits anyway and the
/// uncommitted messages are redelivered (and recognised) elsewhere.
async fn leave_group(consumer: Arc<WriterConsumer>, worker: Arc<Worker>, timeout: Duration) {
    let closing = tokio::task::spawn_blocking(move || {
        drop(worker); // flushes the producer (bounded by message.timeout.ms)
        if let Err(error) = consumer.commit_consumer_state(CommitMode::Sync) {
            tracing::warn!(%error, "final offset commit failed; the last messages may be redelivered");
        }
        // Leaves the group now (even if another handle of the consumer is still alive), so
        // that the partitions move without waiting for the session timeout.
        consumer.unsubscribe();
        drop(consumer);
    });
    if tokio::time::timeout(timeout, closing).await.is_err() {
        tracing::warn!(?timeout, "the broker did not answer in time; exiting without leaving the group");
    }
}

struct Worker {
    pool: PgPool,
    producer: FutureProducer,
    metrics: Arc<Metrics>,
    settings: Settings,
}

/// Enough of any message version to answer it when the rest cannot be read.
#[derive(Deserialize)]
struct Envelope {
    correlation_id: String,
    reply_partition: i32,
}

/// What a dead letter says about why (its Kafka headers).
struct DeadLetter<'a> {
    reason: &'static str,
    error: String,
    attempts: u32,
    message: &'a OwnedMessage,
}

impl Worker {
    async fn handle_group(
        &self,
        messages: &[OwnedMessage],
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let mut readable = Vec::with_capacity(messages.len());
        for message in messages {
            let payload = message.payload().unwrap_or_default();
            match WriteRequest::from_slice(payload) {
                Ok(WriteRequest::V1(request)) => readable.push((message, request)),
                Err(error) => {
                    tracing::error!(%error, partition = message.partition(), offset = message.offset(), "unreadable request message");
                    let letter = DeadLetter { reason: "unreadable", error: error.to_string(), attempts: 1, message };
                    self.dead_letter(letter, shutdown).await?;
                    if let Ok(envelope) = serde_json::from_slice::<Envelope>(payload) {
                        self.reply(
                            &envelope.correlation_id,
                            envelope.reply_partition,
                            None,
                            ChunkOutcome::Failed,
                            shutdown,
                        )
                        .await?;
                    }
                }
            }
        }
        if readable.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
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
        self.metrics.apply_seconds.observe(started.elapsed().as_secs_f64());
        for ((message, request), (outcome, first_time)) in readable.iter().zip(&outcomes) {
            self.record(message, request, outcome, *first_time);
        }
        let replies = readable.iter().zip(outcomes).map(|((_, request), (outcome, _))| (request, outcome));
        self.reply_all(replies.collect(), shutdown).await
    }

    /// The whole group in one transaction, retried through outages; `None` when it fails for any
    /// other reason (then each message is tried on its own).
    async fn apply_together(
        &self,
        group: &[(&OwnedMessage, WriteRequestV1)],
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<Vec<(ChunkOutcome, bool)>>, Interrupted> {
        let requests: Vec<&WriteRequestV1> = group.iter().map(|(_, request)| request).collect();
        let once = Policy { max_attempts: 1, ..self.settings.policy };
        match once.run("apply", &self.metrics, None, shutdown, || store::apply_chunks(&self.pool, &requests)).await {
            Ok(applied) => Ok(Some(
                applied.into_iter().map(|a| (ChunkOutcome::Applied { results: a.results }, a.first_time)).collect(),
            )),
            Err(Stop::GaveUp { .. }) => Ok(None),
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }

    /// One message; given up on after the policy's attempts, it is dead-lettered and answered
    /// as failed.
    async fn apply(
        &self,
        request: &WriteRequestV1,
        message: &OwnedMessage,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(ChunkOutcome, bool), Interrupted> {
        let applying = self
            .settings
            .policy
            .run("apply", &self.metrics, None, shutdown, || store::apply_chunk(&self.pool, request));
        match applying.await {
            Ok(applied) => Ok((ChunkOutcome::Applied { results: applied.results }, applied.first_time)),
            Err(Stop::GaveUp { error, attempts }) => {
                let letter = DeadLetter { reason: "apply_failed", error: error.to_string(), attempts, message };
                self.dead_letter(letter, shutdown).await?;
                Ok((ChunkOutcome::Failed, false))
            }
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }

    /// Metrics and the log line of one answered message, with the request id the gateway gave it.
    fn record(&self, message: &OwnedMessage, request: &WriteRequestV1, outcome: &ChunkOutcome, first_time: bool) {
        let label = match (outcome, first_time) {
            (ChunkOutcome::Failed, _) => "failed",
            (ChunkOutcome::Applied { .. }, true) => "applied",
            (ChunkOutcome::Applied { .. }, false) => "already_applied",
        };
        self.metrics.messages.get_or_create(&metrics::Outcome { outcome: label }).inc();
        if let (ChunkOutcome::Applied { results }, true) = (outcome, first_time) {
            for result in results {
                self.metrics.items.get_or_create(&metrics::ItemResult { result: result.result.as_str() }).inc();
            }
        }
        tracing::info!(
            request_id = request_id(message).unwrap_or("-"),
            correlation_id = %request.correlation_id,
            workspace_id = %request.workspace_id,
            partition = message.partition(),
            offset = message.offset(),
            items = request.items.len(),
            outcome = label,
            "chunk"
        );
    }

    /// Sends every reply at once; a reply that fails is tried again through the policy until
    /// its request's deadline, after which nobody waits for it (the gateway answered 500 and the
    /// client's re-send reads the stored result).
    async fn reply_all(
        &self,
        replies: Vec<(&WriteRequestV1, ChunkOutcome)>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let mut deliveries = Vec::with_capacity(replies.len());
        for (request, outcome) in &replies {
            let payload = reply_payload(&request.correlation_id, outcome.clone());
            let record = self.reply_record(&request.correlation_id, request.reply_partition, &payload);
            deliveries.push(self.producer.send_result(record).ok());
        }
        for ((request, outcome), delivery) in replies.into_iter().zip(deliveries) {
            let delivered = match delivery {
                Some(delivery) => tokio::select! {
                    delivered = delivery => matches!(delivered, Ok(Ok(_))),
                    () = shutdown_asked(shutdown) => return Err(Interrupted),
                },
                None => false,
            };
            if !delivered {
                let deadline = deadline_instant(request.deadline_ms);
                self.reply(&request.correlation_id, request.reply_partition, Some(deadline), outcome, shutdown).await?;
            }
        }
        Ok(())
    }

    async fn reply(
        &self,
        correlation_id: &str,
        partition: i32,
        until: Option<Instant>,
        outcome: ChunkOutcome,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let payload = reply_payload(correlation_id, outcome);
        let send = || async {
            let record = self.reply_record(correlation_id, partition, &payload);
            self.producer.send(record, Duration::ZERO).await.map(|_| ()).map_err(|(error, _)| error)
        };
        // A permanent failure (a reply partition that does not exist) is given up on too.
        match self.settings.policy.run("reply", &self.metrics, until, shutdown, send).await {
            Ok(()) => Ok(()),
            Err(Stop::GaveUp { error, attempts }) => {
                self.metrics.replies_dropped.inc();
                tracing::warn!(%error, correlation_id, partition, attempts, "reply given up; the gateway answered 500");
                Ok(())
            }
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }

    fn reply_record<'a>(
        &'a self,
        correlation_id: &'a str,
        partition: i32,
        payload: &'a [u8],
    ) -> FutureRecord<'a, str, [u8]> {
        FutureRecord::to(&self.settings.kafka.replies_topic).partition(partition).key(correlation_id).payload(payload)
    }

    /// A copy of the message in the dead-letter topic with headers naming why. Through an outage
    /// it is retried for as long as it lasts (the message is not skipped without its copy); if
    /// the dead-letter topic refuses it for good, the message is skipped and logged with its
    /// partition and offset: it stays in the requests topic for `intake-writer replay`.
    async fn dead_letter(
        &self,
        letter: DeadLetter<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let message = letter.message;
        let (partition, offset, attempts) =
            (message.partition().to_string(), message.offset().to_string(), letter.attempts.to_string());
        let mut headers = OwnedHeaders::new();
        for (key, value) in [
            ("reason", letter.reason),
            ("error", letter.error.as_str()),
            ("source_topic", message.topic()),
            ("source_partition", partition.as_str()),
            ("source_offset", offset.as_str()),
            ("attempts", attempts.as_str()),
            ("dead_lettered_at_ms", &intake_common::config::now_ms().to_string()),
        ] {
            headers = headers.insert(Header { key, value: Some(value) });
        }
        if let Some(request_id) = request_id(message) {
            headers = headers.insert(Header { key: "request_id", value: Some(request_id) });
        }
        let send = || async {
            let record = FutureRecord::to(&self.settings.kafka.dlq_topic)
                .key(message.key().unwrap_or_default())
                .payload(message.payload().unwrap_or_default())
                .headers(headers.clone());
            self.producer.send(record, Duration::ZERO).await.map(|_| ()).map_err(|(error, _)| error)
        };
        match self.settings.policy.run("dead_letter", &self.metrics, None, shutdown, send).await {
            Ok(()) => {
                self.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: letter.reason }).inc();
                tracing::error!(reason = letter.reason, error = %letter.error, partition = message.partition(), offset = message.offset(), "message dead-lettered");
                Ok(())
            }
            Err(Stop::GaveUp { error, .. }) => {
                self.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: "dead_letter_refused" }).inc();
                tracing::error!(%error, partition = message.partition(), offset = message.offset(), "dead-letter topic refused the message; skipped, replay it from the requests topic");
                Ok(())
            }
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }
}

/// The gateway's request id, carried in the `request_id` header.
fn request_id(message: &OwnedMessage) -> Option<&str> {
    let headers = message.headers()?;
    headers.iter().find(|h| h.key == "request_id").and_then(|h| h.value).and_then(|v| std::str::from_utf8(v).ok())
}

fn deadline_instant(deadline_ms: i64) -> Instant {
    let left = deadline_ms.saturating_sub(intake_common::config::now_ms()).max(0);
    Instant::now() + Duration::from_millis(u64::try_from(left).unwrap_or(0))
}

/// Keeps the gauges that need a query up to date: group size and applied_messages rows.
async fn observe(pool: PgPool, consumer: Arc<WriterConsumer>, group_id: String, metrics: Arc<Metrics>) {
    loop {
        let (consumer_ref, group) = (consumer.clone(), group_id.clone());
        let members = tokio::task::spawn_blocking(move || {
            consumer_ref
                .fetch_group_list(Some(&group), Duration::from_secs(5))
                .ok()
                .and_then(|list| list.groups().first().map(|g| g.members().len()))
        })
        .await;
        if let Ok(Some(members)) = members {
            metrics.group_members.set(i64::try_from(members).unwrap_or(i64::MAX));
        }
        let rows: Result<f32, _> =
            sqlx::query_scalar("SELECT reltuples FROM pg_class WHERE relname = 'applied_messages'")
                .fetch_one(&pool)
                .await;
        if let Ok(rows) = rows {
            metrics.applied_messages_rows.set(rows.max(0.0) as i64);
        }
        tokio::time::sleep(Duration::from_secs(15)).await;
    }
}

fn reply_payload(correlation_id: &str, outcome: ChunkOutcome) -> Vec<u8> {
    let reply = WriteReply::V1(WriteReplyV1 { correlation_id: correlation_id.to_owned(), outcome });
    serde_json::to_vec(&reply).unwrap_or_default()
}
