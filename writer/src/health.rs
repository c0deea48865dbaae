//! What the writer knows of its own health: the partitions it holds, their lag (from
//! librdkafka's statistics), when each last made progress, and whether it is shutting down.
//! `/readyz` and `/healthz` on the ops port answer from here (docs/operations.md, "Ops ports").

use crate::metrics::{self, Metrics};
use rdkafka::consumer::{BaseConsumer, ConsumerContext, Rebalance};
use rdkafka::{ClientContext, Statistics};
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
    /// Bumped at every rebalance. A message read before one may belong to a partition this
    /// writer no longer holds, or holds again from a newer committed offset: its lane neither
    /// applies it nor stores its offset (which could move the group's offset back).
    assignment_generation: AtomicU64,
}

struct PartitionState {
    lag: i64,
    /// When the partition was assigned or a message of it was last applied.
    progressed_at: Instant,
}

#[derive(Debug, PartialEq, Eq)]
pub enum NotReady {
    ShuttingDown,
    NotInGroup,
    Stalled,
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
        })
    }

    pub fn assignment_generation(&self) -> u64 {
        self.assignment_generation.load(Ordering::SeqCst)
    }

    pub fn ready(&self) -> Result<(), NotReady> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(NotReady::ShuttingDown);
        }
        if !self.joined.load(Ordering::Relaxed) {
            return Err(NotReady::NotInGroup);
        }
        if self.stalled() {
            return Err(NotReady::Stalled);
        }
        Ok(())
    }

    /// Holds a partition with lag that made no progress for the stall timeout.
    pub fn stalled(&self) -> bool {
        let stalled = self.lock().values().any(|p| p.lag > 0 && p.progressed_at.elapsed() > self.stall_timeout);
        self.metrics.stalled.set(i64::from(stalled));
        stalled
    }

    /// Stalled, and not because PostgreSQL or Kafka is away: an outage is waited out (its
    /// retries came within the stall timeout), and restarting the writer would not end it.
    pub fn stuck(&self) -> bool {
        let since_outage = metrics::unix_seconds() - self.metrics.last_outage_retry.get();
        self.stalled() && since_outage >= self.stall_timeout.as_secs_f64()
    }

    pub fn shutting_down(&self) {
        self.shutting_down.store(true, Ordering::Relaxed);
    }

    /// A message of `partition` was applied and answered.
    pub fn progressed(&self, partition: i32) {
        if let Some(state) = self.lock().get_mut(&partition) {
            state.progressed_at = Instant::now();
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<i32, PartitionState>> {
        self.partitions.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn assigned(&self, partitions: impl Iterator<Item = i32>) {
        let mut held = self.lock();
        for partition in partitions {
            held.entry(partition).or_insert(PartitionState { lag: 0, progressed_at: Instant::now() });
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

/// The consumer's callbacks: rebalances and statistics feed [`Health`].
pub struct WriterContext(pub Arc<Health>);

impl ClientContext for WriterContext {
    fn stats(&self, statistics: Statistics) {
        let Some(topic) = statistics.topics.get(&self.0.topic) else { return };
        // Lag against the offsets the writer stored (applied and answered), not the committed
        // ones, which trail by the auto-commit interval. -1 means not known yet.
        let lags = topic.partitions.values().filter(|p| p.partition >= 0 && p.consumer_lag_stored >= 0);
        self.0.lags(lags.map(|p| (p.partition, p.consumer_lag_stored)));
    }
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

    #[test]
    fn ready_once_in_the_group_and_not_while_shutting_down() {
        let health = health(Duration::from_secs(60));
        assert_eq!(health.ready(), Err(NotReady::NotInGroup));
        health.assigned(std::iter::empty());
        assert_eq!(health.ready(), Ok(()), "a member with no partitions is ready");
        health.shutting_down();
        assert_eq!(health.ready(), Err(NotReady::ShuttingDown));
    }

    #[test]
    fn lag_without_progress_for_the_stall_timeout_is_a_stall() {
        let health = health(Duration::from_millis(30));
        health.assigned([0, 1].into_iter());
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
}
