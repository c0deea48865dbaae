//! What the writer knows of its own health: the partitions it holds, their lag (from
//! librdkafka's statistics), when each last made progress, and whether it is shutting down.
//! `/readyz` and `/healthz` on the ops port answer from here (docs/operations.md, "Ops ports").

use crate::metrics::{self, Metrics};
use intake_common::kafka_errors::QuietContext;
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::error::KafkaError;
use rdkafka::ClientContext;
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct Health {
    pub metrics: Arc<Metrics>,
    topic: String,
    stall_timeout: Duration,
    /// A first assignment (possibly empty) arrived: the writer is a member of the group.
    joined: AtomicBool,
    shutting_down: AtomicBool,
    partitions: Mutex<HashMap<i32, PartitionState>>,
    /// Bumped at every rebalance, and when the database turns out to be another node's lineage
    /// (a promotion, a restore). A message read before one may belong to a partition this
    /// writer no longer holds, or holds again from another offset, or be due after messages the
    /// database lost: its lane neither applies it nor stores its offset.
    assignment_generation: AtomicU64,
    /// The database's system identifier and timeline, as the last connection found them.
    lineage: Mutex<Option<String>>,
}

struct PartitionState {
    lag: i64,
    /// When the partition was assigned or a message of it was last applied.
    progressed_at: Instant,
    /// A workspace of it has waited for its lock, held by another session, past the bound, and
    /// nothing of the partition progressed since.
    held: bool,
    /// To be read again from the database's position before anything of it is applied
    /// (`rewind.rs`): set when it is assigned and when the database's lineage changes.
    rewind: bool,
}

#[derive(Debug, PartialEq, Eq)]
pub enum NotReady {
    ShuttingDown,
    /// Waiting for `intake-writer migrate` before reading a message.
    SchemaBehind,
    NotInGroup,
    /// Some partition waits for its rewind to the database's position (`rewind.rs`).
    Rewinding,
    Stalled,
    /// Stalled only behind workspaces whose locks other sessions hold.
    WorkspaceHeld,
}

impl Health {
    pub fn new(metrics: Arc<Metrics>, topic: String, stall_timeout: Duration) -> Arc<Self> {
        Arc::new(Health {
            metrics,
            topic,
            stall_timeout,
            joined: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            partitions: Mutex::default(),
            assignment_generation: AtomicU64::new(0),
            lineage: Mutex::default(),
        })
    }

    pub fn assignment_generation(&self) -> u64 {
        self.assignment_generation.load(Ordering::SeqCst)
    }

    pub fn ready(&self) -> Result<(), NotReady> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(NotReady::ShuttingDown);
        }
        if self.metrics.schema_behind.get() > 0 {
            return Err(NotReady::SchemaBehind);
        }
        if !self.joined.load(Ordering::Relaxed) {
            return Err(NotReady::NotInGroup);
        }
        match self.stall() {
            Stall::None if self.lock().values().any(|p| p.rewind) => Err(NotReady::Rewinding),
            Stall::None => Ok(()),
            Stall::Held => Err(NotReady::WorkspaceHeld),
            Stall::Own => Err(NotReady::Stalled),
        }
    }

    /// Holds a partition with lag that made no progress for the stall timeout.
    pub fn stalled(&self) -> bool {
        self.stall() != Stall::None
    }

    fn stall(&self) -> Stall {
        let held = self.lock();
        let mut stalled = held.values().filter(|p| p.lag > 0 && p.progressed_at.elapsed() > self.stall_timeout);
        let stall = match stalled.next() {
            None => Stall::None,
            Some(first) if first.held && stalled.all(|p| p.held) => Stall::Held,
            Some(_) => Stall::Own,
        };
        self.metrics.stalled.set(i64::from(stall != Stall::None));
        stall
    }

    /// Stalled, and neither because PostgreSQL or Kafka is away (an outage is waited out: its
    /// retries came within the stall timeout) nor only behind workspaces whose locks other
    /// sessions hold: restarting the writer would end neither.
    pub fn stuck(&self) -> bool {
        let since_outage = metrics::unix_seconds() - self.metrics.last_outage_retry.get();
        self.stall() == Stall::Own && since_outage >= self.stall_timeout.as_secs_f64()
    }

    /// The database lacks migrations this build's statements use (`migrations::missing`), or
    /// its schema could not be read yet.
    pub fn schema_behind(&self, behind: bool) {
        self.metrics.schema_behind.set(i64::from(behind));
    }

    pub fn shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// A message of `partition` was answered, or a workspace of it found busy for less than
    /// the bound.
    pub fn progressed(&self, partition: i32) {
        if let Some(state) = self.lock().get_mut(&partition) {
            state.progressed_at = Instant::now();
            state.held = false;
        }
    }

    /// A workspace of `partition` has waited for its lock past the bound: no progress.
    pub fn held(&self, partition: i32) {
        if let Some(state) = self.lock().get_mut(&partition) {
            state.held = true;
        }
    }

    /// A new connection reached the database `lineage` (`store::connect_lazy`). Another one
    /// than the last (a standby promoted, a backup restored) may lack commits that were
    /// answered: every partition is read again from the database's own positions before
    /// anything more is applied, and what was read before is dropped.
    pub fn connected_to(&self, lineage: &str) {
        let mut known = self.lineage.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match known.as_deref() {
            Some(previous) if previous != lineage => {
                tracing::warn!(previous, lineage, "the database is on another timeline: rewinding every partition");
                self.metrics.lineage_changes.inc();
                self.rewind_all();
            }
            _ => {}
        }
        *known = Some(lineage.to_owned());
    }

    /// The database's positions of `partitions` went back since this writer recorded them (a
    /// restore in place, on the same timeline): every partition is read again from the
    /// database's positions, as after a change of lineage.
    pub fn database_behind(&self, partitions: &[i32]) {
        tracing::warn!(?partitions, "the database's positions went back: rewinding every partition");
        self.metrics.lineage_changes.inc();
        self.rewind_all();
    }

    fn rewind_all(&self) {
        let mut held = self.lock();
        for state in held.values_mut() {
            state.rewind = true;
        }
        self.assignment_generation.fetch_add(1, Ordering::SeqCst);
    }

    /// The partitions waiting for a rewind.
    pub fn to_rewind(&self) -> Vec<i32> {
        let mut partitions: Vec<i32> = self.lock().iter().filter(|(_, s)| s.rewind).map(|(&p, _)| p).collect();
        partitions.sort_unstable();
        partitions
    }

    /// Whether `partition`'s messages are dropped as read: it waits for a rewind.
    pub fn rewinding(&self, partition: i32) -> bool {
        self.lock().get(&partition).is_some_and(|s| s.rewind)
    }

    /// `partition` reads from the database's position now, unless the generation moved on
    /// since `generation` (a rebalance, another lineage): then it waits for the next rewind.
    pub fn rewound(&self, partition: i32, generation: u64) {
        let mut held = self.lock();
        if self.assignment_generation() == generation {
            if let Some(state) = held.get_mut(&partition) {
                state.rewind = false;
                state.progressed_at = Instant::now();
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, PartitionState>> {
        self.partitions.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn assigned(&self, partitions: impl Iterator<Item = i32>) {
        let mut held = self.lock();
        for partition in partitions {
            let state = held.entry(partition).or_insert(PartitionState {
                lag: 0,
                progressed_at: Instant::now(),
                held: false,
                rewind: true,
            });
            // Reassigned: read from the committed offset, which may be ahead of the database.
            state.rewind = true;
        }
        self.metrics.assigned_partitions.set(i64::try_from(held.len()).unwrap_or(i64::MAX));
        self.joined.store(true, Ordering::Relaxed);
    }

    fn revoked(&self, partitions: impl Iterator<Item = i32>) {
        let mut held = self.lock();
        for partition in partitions {
            held.remove(&partition);
            self.metrics.consumer_lag.remove(&metrics::Partition { partition });
        }
        self.metrics.assigned_partitions.set(i64::try_from(held.len()).unwrap_or(i64::MAX));
    }

    fn lags(&self, lags: impl Iterator<Item = (i32, i64)>) {
        let mut held = self.lock();
        for (partition, lag) in lags {
            if let Some(state) = held.get_mut(&partition) {
                // Work arriving on an idle partition starts the clock; idle time is no stall.
                if state.lag <= 0 && lag > 0 {
                    state.progressed_at = Instant::now();
                }
                state.lag = lag;
                self.metrics.consumer_lag.get_or_create(&metrics::Partition { partition }).set(lag);
            }
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Stall {
    None,
    Held,
    Own,
}

/// The consumer's callbacks: rebalances and statistics feed [`Health`]; errors are logged as
/// by every other client ([`QuietContext`]).
pub struct WriterContext(pub Arc<Health>, pub QuietContext);

impl ClientContext for WriterContext {
    fn error(&self, error: KafkaError, reason: &str) {
        self.1.error(&error, reason);
    }

    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, message: &str) {
        QuietContext::log(level, facility, message);
    }

    // Read raw: of librdkafka's statistics (kilobytes of JSON a broker and a partition, every
    // interval) only the stored lags are wanted. rdkafka's typed `Statistics` would parse it
    // all, and its deserializer is a twentieth of the writer's compiled code.
    fn stats_raw(&self, statistics: &[u8]) {
        let statistics: LagStatistics = match serde_json::from_slice(statistics) {
            Ok(statistics) => statistics,
            Err(error) => return tracing::warn!(%error, "librdkafka's statistics not read"),
        };
        let Some(topic) = statistics.topics.get(&self.0.topic) else { return };
        // Lag against the offsets the writer stored (applied and answered), not the committed
        // ones, which trail by the auto-commit interval. -1 means not known yet.
        let lags = topic.partitions.values().filter(|p| p.partition >= 0 && p.consumer_lag_stored >= 0);
        self.0.lags(lags.map(|p| (p.partition, p.consumer_lag_stored)));
    }
}

/// The part of librdkafka's statistics (its STATISTICS.md) that the writer reads.
#[derive(Deserialize)]
struct LagStatistics {
    #[serde(default)]
    topics: HashMap<String, TopicLags>,
}

#[derive(Deserialize)]
struct TopicLags {
    partitions: HashMap<String, PartitionLag>,
}

#[derive(Deserialize)]
struct PartitionLag {
    partition: i32,
    consumer_lag_stored: i64,
}

impl ConsumerContext for WriterContext {
    // Before and after: a lane that checks while the assignment changes sees a new generation.
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, _rebalance: &Rebalance<'_>) {
        self.0.assignment_generation.fetch_add(1, Ordering::SeqCst);
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        self.0.assignment_generation.fetch_add(1, Ordering::SeqCst);
        match rebalance {
            Rebalance::Assign(list) => {
                let partitions: Vec<i32> = list.elements().iter().map(|e| e.partition()).collect();
                tracing::info!(?partitions, "partitions assigned");
                // An eager rebalance assigns the whole new set: forget what is not in it.
                let held: Vec<i32> = self.0.lock().keys().copied().filter(|p| !partitions.contains(p)).collect();
                self.0.revoked(held.into_iter());
                self.0.assigned(partitions.into_iter());
            }
            Rebalance::Revoke(list) => {
                let partitions: Vec<i32> = list.elements().iter().map(|e| e.partition()).collect();
                tracing::info!(?partitions, "partitions revoked");
                self.0.revoked(partitions.into_iter());
            }
            Rebalance::Error(error) => tracing::warn!(%error, "rebalance failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(stall: Duration) -> Arc<Health> {
        Health::new(Arc::new(Metrics::new()), "t".into(), stall)
    }

    /// `partitions` assigned, and each rewound.
    fn assign(health: &Health, partitions: &[i32]) {
        health.assigned(partitions.iter().copied());
        let generation = health.assignment_generation();
        for &partition in partitions {
            health.rewound(partition, generation);
        }
    }

    #[test]
    fn ready_once_in_the_group_and_not_while_shutting_down() {
        let health = health(Duration::from_secs(60));
        assert_eq!(health.ready(), Err(NotReady::NotInGroup));
        health.assigned(std::iter::empty());
        assert_eq!(health.ready(), Ok(()), "a member with no partitions is ready");
        health.assigned([0, 1].into_iter());
        assert_eq!(health.ready(), Err(NotReady::Rewinding), "not before its partitions are rewound");
        let generation = health.assignment_generation();
        health.rewound(0, generation);
        health.rewound(1, generation);
        assert_eq!(health.ready(), Ok(()));
        health.shutting_down();
        assert_eq!(health.ready(), Err(NotReady::ShuttingDown));
    }

    #[test]
    fn the_stored_lags_of_the_writers_topic_are_read_from_librdkafkas_statistics() {
        let health = health(Duration::from_secs(60));
        assign(&health, &[0, 1, 2]);
        let context = WriterContext(health.clone(), QuietContext::default());
        // Trimmed from a real statistics event: the fields around the lags are skipped.
        context.stats_raw(
            br#"{"name": "rdkafka#consumer-1", "ts": 1, "brokers": {"b": {"rtt": {"p99": 3}}},
                "topics": {
                  "other": {"partitions": {"0": {"partition": 0, "consumer_lag_stored": 9}}},
                  "t": {"topic": "t", "partitions": {
                    "0": {"partition": 0, "consumer_lag": 8, "consumer_lag_stored": 7, "fetchq_cnt": 0},
                    "1": {"partition": 1, "consumer_lag_stored": -1},
                    "-1": {"partition": -1, "consumer_lag_stored": 4}}}}}"#,
        );
        let lag = |partition| health.lock().get(&partition).map(|state| state.lag);
        assert_eq!((lag(0), lag(1), lag(2)), (Some(7), Some(0), Some(0)), "-1 (not known yet) is skipped");
        let gauge = health.metrics.consumer_lag.get_or_create(&metrics::Partition { partition: 0 }).get();
        assert_eq!(gauge, 7);
        context.stats_raw(b"not json");
        assert_eq!(lag(0), Some(7), "statistics that do not parse change nothing");
    }

    #[test]
    fn lag_without_progress_for_the_stall_timeout_is_a_stall() {
        let health = health(Duration::from_millis(30));
        assign(&health, &[0, 1]);
        health.lags([(0, 0), (1, 0)].into_iter());
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(health.ready(), Ok(()), "no lag: idle, not stalled");
        health.lags([(1, 5)].into_iter());
        assert_eq!(health.ready(), Ok(()), "work that just arrived on an idle partition is no stall");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(health.ready(), Err(NotReady::Stalled));
        health.metrics.last_outage_retry.set(metrics::unix_seconds());
        assert!(health.stalled() && !health.stuck(), "an outage being waited out is no reason to restart");
        health.metrics.last_outage_retry.set(metrics::unix_seconds() - 1.0);
        assert!(health.stuck(), "an outage over for longer than the stall timeout");
        health.progressed(1);
        assert_eq!(health.ready(), Ok(()), "progress clears the stall");
        health.revoked([1].into_iter());
        assert!(!health.stalled());
    }

    #[test]
    fn a_stall_only_behind_workspaces_held_elsewhere_is_unready_but_alive() {
        let health = health(Duration::from_millis(30));
        assign(&health, &[0, 1]);
        health.lags([(0, 3), (1, 3)].into_iter());
        health.held(0);
        health.progressed(1);
        std::thread::sleep(Duration::from_millis(50));
        health.progressed(1);
        assert_eq!(health.ready(), Err(NotReady::WorkspaceHeld));
        assert!(!health.stuck(), "a restart would not release another session's lock");
        health.held(1);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(health.ready(), Err(NotReady::WorkspaceHeld));
        health.progressed(0);
        assert_eq!(health.ready(), Err(NotReady::WorkspaceHeld), "partition 1 is still held");
        health.progressed(1);
        assert_eq!(health.ready(), Ok(()));
    }
}
