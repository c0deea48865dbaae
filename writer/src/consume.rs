//! The writer's consumer, and the composition root of its stages (docs/architecture.md,
//! "Isolation in the writer"): a reader (`read.rs`) hands each message of the requests topic,
//! parsed once (`inbox.rs`), to the per-workspace scheduler (`schedule.rs`); workers
//! (`apply.rs`) take a workspace's next messages (with other small workspaces' beside them),
//! answer them (applied in one transaction, or expired, or failed and dead-lettered), reply (`outbox.rs`) and only then store the
//! partition's offset up to its lowest message not yet finished. A workspace's messages keep
//! their order; a workspace that is stuck or slow holds up only itself. What is read and not
//! yet answered is held within a byte budget; past it, reading pauses and Kafka keeps the
//! backlog, and a workspace beyond its share of it is passed over and read again later
//! (`reread.rs`). Delivery is at least once; `applied_messages` makes a redelivery harmless. Every
//! failure goes through the one retry policy of `retry.rs`.

use crate::apply::{Failpoint, Signals, Worker};
use crate::health::{Health, WriterContext};
use crate::inbox::{Admission, Inbound, Partitions};
use crate::metrics::{self, Metrics};
use crate::outbox::Outbox;
use crate::positions::Positions;
use crate::read::Reader;
use crate::reread::{Cursor, Rereader};
use crate::retry::Policy;
use crate::rewind::{AnsweredBelow, Rewinder};
use crate::schedule::Scheduler;
use crate::store::Database;
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use prometheus_client::metrics::counter::Counter;
use rdkafka::consumer::{CommitMode, Consumer as _, StreamConsumer};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;

/// Messages applied in one transaction at most, of one workspace or of several small ones
/// (`apply::Worker::gather`). Under load a group amortizes the commit and the reply round trip;
/// when idle a group is the one message that arrived.
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
    /// Bytes of messages read and not yet answered, across all workspaces and partitions.
    pub read_budget: usize,
    /// How long a busy workspace's wait counts as progress.
    pub wait_bound: Duration,
    /// How long the final offset commit and leaving the group may take at shutdown (they wait
    /// for the broker, which may be down).
    pub shutdown_timeout: Duration,
}

type WriterConsumer = StreamConsumer<WriterContext>;

/// The group consumer as the stages see it: offsets stored only for the assignment they were
/// read in, partitions paused and resumed, progress told to [`Health`].
struct KafkaPartitions {
    kafka: Arc<WriterConsumer>,
    health: Arc<Health>,
    topic: String,
    /// Held while offsets are stored: two workers that finish a partition's messages out of
    /// order never store its offset backwards.
    stored: Mutex<Stored>,
    /// The offsets stored, to be recorded in the database too.
    positions: Arc<Positions>,
    answered_below: AnsweredBelow,
}

/// The offset stored last for each partition of the current assignment.
#[derive(Default)]
struct Stored {
    generation: u64,
    next: HashMap<i32, i64>,
}

impl Stored {
    /// Those of `offsets` that move their partition forward, now remembered; an assignment of
    /// another generation starts afresh (its committed offsets are Kafka's).
    fn forward(&mut self, generation: u64, offsets: &[(i32, i64)]) -> Vec<(i32, i64)> {
        if generation != self.generation {
            self.generation = generation;
            self.next.clear();
        }
        offsets
            .iter()
            .copied()
            .filter(|&(partition, next)| {
                let stored = self.next.entry(partition).or_insert(i64::MIN);
                let forward = next > *stored;
                *stored = (*stored).max(next);
                forward
            })
            .collect()
    }
}

impl KafkaPartitions {
    fn list(&self, partitions: &[i32]) -> TopicPartitionList {
        let mut list = TopicPartitionList::new();
        for &partition in partitions {
            list.add_partition(&self.topic, partition);
        }
        list
    }
}

impl Partitions for KafkaPartitions {
    fn generation(&self) -> u64 {
        self.health.assignment_generation()
    }

    fn store(&self, generation: u64, offsets: &[(i32, i64)]) {
        if offsets.is_empty() || self.generation() != generation {
            return;
        }
        let mut stored = self.stored.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let forward = stored.forward(generation, offsets);
        if forward.is_empty() {
            return;
        }
        self.positions.answered(generation, &forward);
        let mut list = TopicPartitionList::new();
        for &(partition, next) in &forward {
            let _ = list.add_partition_offset(&self.topic, partition, Offset::Offset(next));
        }
        if let Err(error) = self.kafka.store_offsets(&list) {
            tracing::warn!(%error, "could not store offsets; the messages may be redelivered");
        }
    }

    fn pause(&self, partitions: &[i32]) {
        if let (false, Err(error)) = (partitions.is_empty(), self.kafka.pause(&self.list(partitions))) {
            tracing::warn!(%error, ?partitions, "could not pause partitions");
        }
    }

    fn resume(&self, partitions: &[i32]) {
        // One waiting for a rewind stays paused until the rewind is done.
        let partitions: Vec<i32> = partitions.iter().copied().filter(|&p| !self.health.rewinding(p)).collect();
        if let (false, Err(error)) = (partitions.is_empty(), self.kafka.resume(&self.list(&partitions))) {
            tracing::warn!(%error, ?partitions, "could not resume partitions");
        }
    }

    fn progressed(&self, partitions: &[i32]) {
        for &partition in partitions {
            self.health.progressed(partition);
        }
    }

    fn held(&self, partitions: &[i32]) {
        for &partition in partitions {
            self.health.held(partition);
        }
    }

    fn admit(&self, partition: i32, offset: i64) -> Admission {
        if self.health.rewinding(partition) {
            return Admission::Drop;
        }
        let below =
            self.answered_below.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).get(&partition).copied();
        Admission::Take { answered_before: below.is_some_and(|below| offset < below) }
    }
}

/// Runs until `shutdown` turns true; the groups in hand are finished (or, if one is stuck on an
/// outage, left uncommitted for the next writer), the offsets are committed and the group left.
pub async fn run(
    database: Database,
    settings: Settings,
    health: Arc<Health>,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<()> {
    let config = kafka::writer_consumer(&settings.kafka, &settings.group_id, &crate::migrations::writer_client_id())
        .map_err(anyhow::Error::msg)?;
    let kafka_consumer: WriterConsumer =
        config.create_with_context(WriterContext(health.clone(), QuietContext::default()))?;
    kafka_consumer.subscribe(&[&settings.kafka.requests_topic])?;
    let kafka_consumer = Arc::new(kafka_consumer);
    let topic = settings.kafka.requests_topic.clone();
    let positions = Arc::new(Positions::new(topic.clone()));
    let answered_below = AnsweredBelow::default();
    let partitions: Arc<dyn Partitions> = Arc::new(KafkaPartitions {
        kafka: kafka_consumer.clone(),
        health: health.clone(),
        topic: topic.clone(),
        stored: Mutex::default(),
        positions: positions.clone(),
        answered_below: answered_below.clone(),
    });
    let producer: FutureProducer<QuietContext> =
        kafka::writer_producer(&settings.kafka).create_with_context(QuietContext::default())?;
    let metrics = health.metrics.clone();
    let outbox = Arc::new(Outbox::new(Arc::new(producer), &settings.kafka, settings.policy, metrics.clone()));
    let scheduler = Arc::new(Scheduler::new(settings.read_budget, MAX_GROUP));
    metrics.backlog_budget_bytes.set(i64::try_from(settings.read_budget).unwrap_or(i64::MAX));
    let pool = database.pool.clone();
    tokio::spawn(crate::retention::run(pool.clone(), settings.kafka.clone(), settings.remember_applied));
    let observer =
        tokio::spawn(observe(pool.clone(), kafka_consumer.clone(), settings.group_id.clone(), metrics.clone()));
    let watcher = tokio::spawn(watch_scheduler(scheduler.clone(), metrics.clone()));
    let (generation, behind) = (health.clone(), health.clone());
    let recorder = tokio::spawn(positions.clone().run(
        pool.clone(),
        move || generation.assignment_generation(),
        move |partitions| behind.database_behind(partitions),
    ));
    let rewinder = tokio::spawn(
        Rewinder {
            consumer: kafka_consumer.clone(),
            pool: pool.clone(),
            topic,
            health: health.clone(),
            positions: positions.clone(),
            answered_below,
            scheduler: scheduler.clone(),
            metrics: metrics.clone(),
        }
        .run(),
    );
    let rereader: StreamConsumer<QuietContext> =
        kafka::writer_rereader(&settings.kafka).create_with_context(QuietContext::default())?;
    let rereader = tokio::spawn(
        Rereader {
            cursor: Cursor::new(rereader, settings.kafka.requests_topic.clone()),
            partitions: partitions.clone(),
            scheduler: scheduler.clone(),
        }
        .run(shutdown.clone()),
    );
    let worker_count = settings.workers.max(1);
    tracing::info!(
        topic = %settings.kafka.requests_topic,
        group = %settings.group_id,
        workers = worker_count,
        read_budget = settings.read_budget,
        "writer consuming"
    );

    // Shutdown stops the workers taking new groups; the groups in hand get FINISH_GRACE to
    // finish before their waits are cut short too (`abort`).
    let (abort, aborted) = watch::channel(false);
    let worker = Arc::new(Worker {
        store: Arc::new(database),
        outbox: outbox.clone(),
        scheduler: scheduler.clone(),
        partitions: partitions.clone(),
        metrics: metrics.clone(),
        policy: settings.policy,
        wait_bound: settings.wait_bound,
        failpoint: Failpoint::from_env(),
    });
    let signals = Signals { shutdown: shutdown.clone(), abort: aborted };
    let workers: Vec<_> = (0..worker_count)
        .map(|_| tokio::spawn(supervise(worker.clone(), signals.clone(), metrics.worker_restarts.clone())))
        .collect();
    let reader = Reader { partitions: partitions.clone(), scheduler };
    reader.read(&kafka_consumer, &mut shutdown).await;
    tokio::spawn(async move {
        tokio::time::sleep(FINISH_GRACE).await;
        let _ = abort.send(true);
    });
    for task in workers {
        let _ = task.await;
    }
    health.shutting_down();
    observer.abort();
    watcher.abort();
    rewinder.abort();
    // It holds the consumer too (through `partitions`): gone before the group is left below,
    // or the consumer would outlive `leave_group` and the group wait out the session timeout.
    rereader.abort();
    let _ = rereader.await;
    // What was answered last is recorded once more; a position missed only reads more again.
    recorder.abort();
    let _ = positions.record(&pool, || health.assignment_generation()).await;
    drop((worker, reader, partitions));
    leave_group(kafka_consumer, outbox, settings.shutdown_timeout).await;
    tracing::info!("writer stopped");
    Ok(())
}

/// How long the groups in hand get to finish at shutdown (applying and answering take
/// milliseconds when PostgreSQL and Kafka are up) before their waits are cut short: with the
/// brokers away a reply would wait out the producer's timeouts, longer than a bounded shutdown.
/// What is cut short stays uncommitted for the writer that takes the partition over.
const FINISH_GRACE: Duration = Duration::from_secs(2);

/// Runs a worker until shutdown. A worker that dies (panics) is started again at once and
/// counted; the group it held went back to its workspace's queue (`schedule::Taken`), so the
/// workspace is not left taken, and a message that workers keep dying on is given up on
/// (`apply.rs`).
async fn supervise(worker: Arc<Worker>, signals: Signals, restarts: Counter) {
    loop {
        match tokio::spawn(worker.clone().work(signals.clone())).await {
            Err(error) if error.is_panic() => {
                restarts.inc();
                tracing::error!("an apply worker died; started again");
            }
            _ => return,
        }
    }
}

/// Keeps the scheduler's gauges current: backlog, its bytes, paused partitions, workspaces
/// passed over, waiting workspaces.
async fn watch_scheduler(scheduler: Arc<Scheduler<Inbound>>, metrics: Arc<Metrics>) {
    loop {
        metrics.backlog.set(i64::try_from(scheduler.backlog()).unwrap_or(i64::MAX));
        metrics.backlog_bytes.set(i64::try_from(scheduler.held_bytes()).unwrap_or(i64::MAX));
        metrics.paused_partitions.set(i64::try_from(scheduler.paused_partitions()).unwrap_or(i64::MAX));
        metrics.passed_over_workspaces.set(i64::try_from(scheduler.passed_over()).unwrap_or(i64::MAX));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apply::testing::{rig, Rig};
    use crate::inbox::testing::{message, request};

    #[test]
    fn two_workers_finishing_one_partition_out_of_order_never_store_its_offset_backwards() {
        let mut stored = Stored::default();
        // A worker of a later workspace of partition 0 stores first; the one of an earlier
        // workspace, whose store the scheduler computed before, comes second.
        assert_eq!(stored.forward(1, &[(0, 8), (1, 3)]), [(0, 8), (1, 3)]);
        assert_eq!(stored.forward(1, &[(0, 5), (1, 4)]), [(1, 4)], "partition 0 stays at 8");
        assert_eq!(stored.forward(1, &[(0, 8)]), [], "nothing to store again");
        assert_eq!(stored.forward(1, &[(0, 9)]), [(0, 9)]);
        assert_eq!(stored.forward(2, &[(0, 2)]), [(0, 2)], "a new assignment starts from Kafka's offsets");
    }

    /// Runs `rig`'s worker under its supervisor until `replies` replies were sent.
    async fn supervised(rig: &Rig, replies: usize) -> Counter {
        let (stop, shutdown) = watch::channel(false);
        let (_abort, abort) = watch::channel(false);
        let restarts = Counter::default();
        let supervisor = tokio::spawn(supervise(rig.worker.clone(), Signals { shutdown, abort }, restarts.clone()));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while rig.replies().len() < replies {
            assert!(tokio::time::Instant::now() < deadline, "{:?}", rig.replies());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let _ = stop.send(true);
        assert!(supervisor.await.is_ok());
        restarts
    }

    #[tokio::test]
    async fn a_worker_that_dies_is_started_again_and_the_workspace_it_held_is_answered() {
        let rig = rig(Duration::from_secs(60), Some(("ws_a", 1)));
        rig.read(&message(&request("ws_a", "a1", 1), 0, 0, 0));
        rig.read(&message(&request("ws_a", "a2", 1), 0, 1, 0));
        rig.read(&message(&request("ws_b", "b1", 1), 1, 0, 0));
        let restarts = supervised(&rig, 3).await;
        assert_eq!(restarts.get(), 1);
        let mut applied: Vec<String> = rig.store.runs().concat();
        applied.sort();
        assert_eq!(applied, ["a1", "a2", "b1"]);
        assert!(rig.sender.sent_to("dlq").is_empty());
    }

    #[tokio::test]
    async fn a_message_that_workers_keep_dying_on_is_dead_lettered_and_its_workspace_goes_on() {
        // Deaths: on the group of both messages, then twice on the first alone (it is given
        // up on: the policy's 2 attempts), then once on the second alone, which then applies.
        let rig = rig(Duration::from_secs(60), Some(("ws_a", 3)));
        rig.read(&message(&request("ws_a", "a1", 1), 0, 0, 0));
        rig.read(&message(&request("ws_a", "a2", 1), 0, 1, 0));
        let restarts = supervised(&rig, 2).await;
        assert_eq!(restarts.get(), 3);
        assert_eq!(rig.replies().iter().map(|r| r.2.as_str()).collect::<Vec<_>>(), ["failed", "applied"]);
        let letters = rig.sender.sent_to("dlq");
        assert_eq!((letters.len(), letters[0].header("reason")), (1, Some("worker_died")));
        assert_eq!(rig.store.runs(), vec![vec!["a2"]]);
    }
}
