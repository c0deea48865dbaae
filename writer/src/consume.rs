//! The writer's consumer (docs/architecture.md, "Isolation in the writer"): a reader
//! (`read.rs`) hands each message of the requests topic to the per-workspace scheduler
//! (`schedule.rs`); workers (`apply.rs`) take a workspace's next messages, apply them in one
//! transaction, answer them (`outbox.rs`) and only then store the partition's offset up to its
//! lowest message not yet finished. A workspace's messages keep their order; a workspace that is
//! stuck or slow holds up only itself. Delivery is at least once; `applied_messages` makes a
//! redelivery harmless. Every failure goes through the one retry policy of `retry.rs`.

use crate::apply::{Signals, Worker};
use crate::health::{Health, WriterContext};
use crate::metrics::{self, Metrics};
use crate::outbox::Outbox;
use crate::read::Reader;
use crate::retry::Policy;
use crate::schedule::Scheduler;
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::message::WriteRequestV1;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::message::OwnedMessage;
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Messages of one workspace applied in one transaction at most. Under load a group amortizes
/// the commit and the reply round trip; when idle a group is the one message that arrived.
const MAX_GROUP: usize = 64;

pub struct Settings {
    pub kafka: KafkaArgs,
    pub group_id: String,
    /// How long applied message ids are remembered beyond the requests topic's retention
    /// (which `retention.rs` reads from Kafka): any redelivery or replay is recognised.
    pub remember_applied: Duration,
    pub policy: Policy,
    /// Workspaces applied at once, each on a connection of its own while it applies.
    pub workers: usize,
    /// Messages one workspace may have read and not yet answered before its partition is
    /// paused.
    pub workspace_backlog: usize,
    /// How long the final offset commit and leaving the group may take at shutdown (they wait
    /// for the broker, which may be down).
    pub shutdown_timeout: Duration,
}

/// A request message, read once.
pub struct Request {
    pub message: OwnedMessage,
    pub request: WriteRequestV1,
}

type WriterConsumer = StreamConsumer<WriterContext>;

/// The group consumer with what the reader and the workers do with it: offsets stored only for
/// the assignment they were read in, partitions paused and resumed.
#[derive(Clone)]
pub struct Consumer {
    pub kafka: Arc<WriterConsumer>,
    health: Arc<Health>,
    topic: String,
}

impl Consumer {
    pub fn generation(&self) -> u64 {
        self.health.assignment_generation()
    }

    /// No rebalance since `generation`.
    pub fn current(&self, generation: u64) -> bool {
        self.generation() == generation
    }

    /// Stores (partition, next offset to read) for commit, unless a rebalance came since the
    /// messages were read (an offset stored then could move the group's offset back).
    pub fn store(&self, generation: u64, offsets: &[(i32, i64)]) {
        if offsets.is_empty() || !self.current(generation) {
            return;
        }
        let mut list = TopicPartitionList::new();
        for &(partition, next) in offsets {
            let _ = list.add_partition_offset(&self.topic, partition, Offset::Offset(next));
        }
        if let Err(error) = self.kafka.store_offsets(&list) {
            tracing::warn!(%error, "could not store offsets; the messages may be redelivered");
        }
    }

    pub fn progressed(&self, partitions: &[i32]) {
        for &partition in partitions {
            self.health.progressed(partition);
        }
    }

    pub fn pause(&self, partition: i32) {
        self.change_pause(&[partition], true);
    }

    pub fn resume(&self, partitions: Vec<i32>) {
        self.change_pause(&partitions, false);
    }

    fn change_pause(&self, partitions: &[i32], pause: bool) {
        if partitions.is_empty() {
            return;
        }
        let mut list = TopicPartitionList::new();
        for &partition in partitions {
            list.add_partition(&self.topic, partition);
        }
        let changed = if pause { self.kafka.pause(&list) } else { self.kafka.resume(&list) };
        if let Err(error) = changed {
            tracing::warn!(%error, ?partitions, pause, "could not pause or resume partitions");
        }
    }
}

/// Runs until `shutdown` turns true; the groups in hand are finished (or, if one is stuck on an
/// outage, left uncommitted for the next writer), the offsets are committed and the group left.
pub async fn run(
    pool: PgPool,
    settings: Settings,
    health: Arc<Health>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let kafka_consumer: WriterConsumer = kafka::writer_consumer(&settings.kafka, &settings.group_id)
        .create_with_context(WriterContext(health.clone()))?;
    kafka_consumer.subscribe(&[&settings.kafka.requests_topic])?;
    let consumer = Consumer {
        kafka: Arc::new(kafka_consumer),
        health: health.clone(),
        topic: settings.kafka.requests_topic.clone(),
    };
    let producer: FutureProducer = kafka::writer_producer(&settings.kafka).create()?;
    let metrics = health.metrics.clone();
    let outbox = Arc::new(Outbox {
        producer,
        replies_topic: settings.kafka.replies_topic.clone(),
        dlq_topic: settings.kafka.dlq_topic.clone(),
        policy: settings.policy,
        metrics: metrics.clone(),
        reply_partitions: std::sync::atomic::AtomicI32::new(0),
        missing_confirmed: std::sync::Mutex::default(),
    });
    let scheduler = Arc::new(Scheduler::new(settings.workspace_backlog, MAX_GROUP));
    tokio::spawn(crate::retention::run(pool.clone(), settings.kafka.clone(), settings.remember_applied));
    let observer = tokio::spawn(observe(pool.clone(), consumer.clone(), settings.group_id.clone(), metrics.clone()));
    let watcher = tokio::spawn(watch_scheduler(scheduler.clone(), metrics.clone()));
    let worker_count = settings.workers.max(1);
    tracing::info!(topic = %settings.kafka.requests_topic, group = %settings.group_id, workers = worker_count, "writer consuming");

    // Shutdown stops the workers taking new groups; the groups in hand get FINISH_GRACE to
    // finish before their waits are cut short too (`abort`).
    let (abort, aborted) = watch::channel(false);
    let worker = Arc::new(Worker {
        pool: pool.clone(),
        outbox: outbox.clone(),
        scheduler: scheduler.clone(),
        consumer: consumer.clone(),
        metrics: metrics.clone(),
        policy: settings.policy,
    });
    let workers: Vec<_> = (0..worker_count)
        .map(|_| {
            let signals = Signals { shutdown: shutdown.clone(), abort: aborted.clone() };
            tokio::spawn(worker.clone().work(signals))
        })
        .collect();
    let reader = Reader {
        pool,
        consumer: consumer.clone(),
        scheduler,
        outbox: outbox.clone(),
        metrics,
        policy: settings.policy,
    };
    let _ = reader.read(&mut shutdown).await;
    tokio::spawn(async move {
        tokio::time::sleep(FINISH_GRACE).await;
        let _ = abort.send(true);
    });
    let mut worker_lost = false;
    for task in workers {
        if let Err(error) = task.await {
            tracing::error!(%error, "an apply worker failed");
            worker_lost = true;
        }
    }
    health.shutting_down();
    observer.abort();
    watcher.abort();
    drop(worker);
    drop(reader);
    leave_group(consumer.kafka, outbox, settings.shutdown_timeout).await;
    // A worker that died is a failure, not a shutdown: exit non-zero so that it is restarted.
    anyhow::ensure!(!worker_lost, "an apply worker stopped; the writer stopped with it");
    tracing::info!("writer stopped");
    Ok(())
}

/// How long the groups in hand get to finish at shutdown (applying and answering take
/// milliseconds when PostgreSQL and Kafka are up) before their waits are cut short: with the
/// brokers away a reply would wait out the producer's timeouts, longer than a bounded shutdown.
/// What is cut short stays uncommitted for the writer that takes the partition over.
const FINISH_GRACE: Duration = Duration::from_secs(2);

/// Keeps the scheduler's gauges current: backlog, paused partitions, waiting workspaces.
async fn watch_scheduler(scheduler: Arc<Scheduler<Request>>, metrics: Arc<Metrics>) {
    loop {
        metrics.backlog.set(i64::try_from(scheduler.backlog()).unwrap_or(i64::MAX));
        metrics.paused_partitions.set(i64::try_from(scheduler.paused_partitions()).unwrap_or(i64::MAX));
        metrics.workspace_waiting_seconds.clear();
        for (workspace_id, waited) in scheduler.waiting() {
            let seconds = i64::try_from(waited.as_secs()).unwrap_or(i64::MAX);
            metrics.workspace_waiting_seconds.get_or_create(&metrics::Workspace { workspace_id }).set(seconds);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Commits the stored offsets and leaves the group, so that the partitions move at once; both
/// wait for the broker, so they are bounded: past the timeout the writer exits anyway and the
/// uncommitted messages are redelivered (and recognised) elsewhere.
async fn leave_group(consumer: Arc<WriterConsumer>, outbox: Arc<Outbox>, timeout: Duration) {
    let closing = tokio::task::spawn_blocking(move || {
        drop(outbox); // flushes the producer (bounded by message.timeout.ms)
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

/// Keeps the gauges that need a query up to date: group size and applied_messages rows.
async fn observe(pool: PgPool, consumer: Consumer, group_id: String, metrics: Arc<Metrics>) {
    loop {
        let (consumer_ref, group) = (consumer.kafka.clone(), group_id.clone());
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
        // The table is partitioned: its rows are its partitions' (estimates).
        let rows: Result<f32, _> = sqlx::query_scalar(
            "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::float4 FROM pg_inherits i
               JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'applied_messages'::regclass",
        )
        .fetch_one(&pool)
        .await;
        if let Ok(rows) = rows {
            metrics.applied_messages_rows.set(rows.max(0.0) as i64);
        }
        tokio::time::sleep(Duration::from_secs(15)).await;
    }
}
