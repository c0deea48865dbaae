//! The rewind (docs/architecture.md, "The log is the record"): before a partition's messages are
//! applied, the partition is read from the database's own position of it (`positions.rs`),
//! not from Kafka's committed offset, which is ahead of the database whenever the database lost
//! commits that were answered: a standby promoted before it had them, a restore from a backup.
//!
//! Every assignment starts one, and so does a connection that finds the database on another
//! lineage (`health::Health::connected_to`). Until it is done the partition stays paused and
//! what is read of it is dropped (`inbox::Admission::Drop`); what was read before it is dropped
//! by the new generation, and a group already in a worker's hands is not applied
//! (`store::Fence`). The messages between the two positions are then read again in order: those
//! the database has are recognised by `applied_messages`, the others applied again under the
//! ids their clients were told (`model/src/ids.rs`); none is replied to a second time.

use crate::health::Health;
use crate::inbox::Inbound;
use crate::metrics::{unix_seconds, Metrics};
use crate::positions::{self, Positions};
use crate::schedule::Scheduler;
use rdkafka::consumer::{Consumer, ConsumerContext, StreamConsumer};
use rdkafka::{Offset, TopicPartitionList};
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often partitions waiting for a rewind are looked at: a rewind waits for the database and
/// for the partition's fetch to have started, and is tried again until both are there.
const POLL: Duration = Duration::from_millis(100);
/// A bound on each of Kafka's answers a rewind waits for.
const KAFKA_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a partition's end must stay behind the database's position before the position is
/// taken for another log's: a new leader's end trails for a replica fetch (at most 500 ms).
const ANOTHER_LOG_RECHECK: Duration = Duration::from_secs(2);

/// Per partition: the offset below which messages were answered before the last rewind.
pub type AnsweredBelow = Arc<Mutex<HashMap<i32, i64>>>;

/// Where one partition's reading starts again.
#[derive(Debug, PartialEq, Eq)]
pub struct Start {
    /// The offset to seek to. Always sought, even where Kafka's committed offset is right: what
    /// was read while the partition waited for its rewind was dropped, and is read again.
    pub seek: Offset,
    /// Messages below this were answered before.
    pub answered_below: Option<i64>,
    /// Messages the database lacks that the topic no longer holds.
    pub lost: i64,
    /// Messages below what was answered that are read again.
    pub again: i64,
    /// The database's position lies past the end of the partition: it was read from another
    /// log, and is replaced by this start's.
    pub another_log: bool,
}

/// The offsets a partition holds: its oldest, and its end (the next message's).
#[derive(Clone, Copy, Debug)]
pub struct Held {
    pub oldest: i64,
    pub end: i64,
}

impl Held {
    /// Whether an offset read from this partition can be: at most its end. One past it was
    /// read from another log.
    fn reaches(&self, offset: i64) -> bool {
        offset <= self.end
    }
}

/// Decides a partition's start from the database's position, Kafka's committed offset, how far
/// this writer answered it, and the offsets the topic holds: the database's position when it
/// has one (below it every message was answered from the database, and the messages from it on
/// are applied again if the database lacks them), else Kafka's.
///
/// An offset past the partition's end was not read from this log: the topic was made again (a
/// new cluster, a topic deleted and created, the quick start's other layout) or lost its tail.
/// No message of this log was answered at it, so it is ignored: otherwise the messages below
/// it would be applied without an answer, or skipped.
pub fn start(database: Option<i64>, committed: Option<i64>, answered: Option<i64>, held: Held) -> Start {
    let of_this_log = |offset: Option<i64>| offset.filter(|&offset| held.reaches(offset));
    let another_log = database.is_some_and(|position| !held.reaches(position));
    let (database, committed, answered) = (of_this_log(database), of_this_log(committed), of_this_log(answered));
    let answered_below = [database, committed, answered].into_iter().flatten().max();
    let Some(position) = database.or(committed) else {
        return Start { seek: Offset::Beginning, answered_below, lost: 0, again: 0, another_log };
    };
    let lost = (held.oldest - position).max(0);
    let from = position.max(held.oldest);
    let again = answered_below.map_or(0, |below| (below - from).max(0));
    Start { seek: Offset::Offset(from), answered_below, lost, again, another_log }
}

pub struct Rewinder<C: ConsumerContext + 'static> {
    pub consumer: Arc<StreamConsumer<C>>,
    pub pool: PgPool,
    pub topic: String,
    pub health: Arc<Health>,
    pub positions: Arc<Positions>,
    pub answered_below: AnsweredBelow,
    pub scheduler: Arc<Scheduler<Inbound>>,
    pub metrics: Arc<Metrics>,
}

impl<C: ConsumerContext + 'static> Rewinder<C> {
    /// Rewinds the partitions that wait for it, for as long as the writer runs.
    pub async fn run(self) {
        loop {
            tokio::time::sleep(POLL).await;
            let partitions = self.health.to_rewind();
            if partitions.is_empty() {
                continue;
            }
            if let Err(error) = self.rewind(&partitions).await {
                // Most often PostgreSQL or Kafka away: waited out like any outage.
                self.metrics.last_outage_retry.set(unix_seconds());
                tracing::warn!(%error, ?partitions, "rewind not done yet; trying again");
            }
        }
    }

    async fn rewind(&self, partitions: &[i32]) -> anyhow::Result<()> {
        let generation = self.health.assignment_generation();
        // Whatever was read before is dropped, and nothing is held paused for it.
        self.scheduler.rebalanced(generation);
        let list = self.list(partitions, |_| Offset::Invalid)?;
        self.consumer.pause(&list)?;
        let started = std::time::Instant::now();
        let database = positions::load(&self.pool, &self.topic, partitions).await?;
        let committed = self
            .blocking({
                let list = list.clone();
                move |consumer| consumer.committed_offsets(list, KAFKA_TIMEOUT)
            })
            .await?;
        let committed: HashMap<i32, i64> = committed
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(offset) => Some((e.partition(), offset)),
                _ => None,
            })
            .collect();
        tracing::debug!(?partitions, ?database, ?committed, took = ?started.elapsed(), "rewind: positions read");
        // A partition the database has no position of starts where Kafka says, and that is
        // recorded before it is read: from then on the database has a position of its own.
        let unknown: Vec<(i32, i64)> = partitions
            .iter()
            .filter(|p| !database.contains_key(p))
            .map(|&p| (p, committed.get(&p).copied().unwrap_or(0)))
            .collect();
        if !unknown.is_empty() {
            tracing::info!(
                ?unknown,
                "no position of these partitions in the database: starting from Kafka's and recording it"
            );
            positions::seed(&self.pool, &self.topic, &unknown).await?;
        }
        let held = self.held(partitions, &database).await?;
        // Resumed together at the end (a seek waits for the partitions' broker thread, which a
        // partition resumed early keeps in its fetch's long poll), and on an error too: a
        // partition rewound stays rewound, and the next round looks only at those still waiting.
        let mut done = Vec::with_capacity(partitions.len());
        let mut rewound = Ok(());
        for (&partition, held) in partitions.iter().zip(held) {
            rewound = self.rewind_one(partition, database.get(&partition).copied(), &committed, held, generation).await;
            if rewound.is_err() {
                break;
            }
            if !self.health.rewinding(partition) {
                done.push(partition);
            }
        }
        if !done.is_empty() {
            if let Err(error) = self.consumer.resume(&self.list(&done, |_| Offset::Invalid)?) {
                tracing::warn!(%error, ?done, "could not resume rewound partitions");
            }
        }
        tracing::debug!(?done, took = ?started.elapsed(), "rewind: done");
        rewound
    }

    /// Seeks one partition to where it starts and records what was answered below it.
    async fn rewind_one(
        &self,
        partition: i32,
        position: Option<i64>,
        committed: &HashMap<i32, i64>,
        held: Held,
        generation: u64,
    ) -> anyhow::Result<()> {
        let answered = self.positions.furthest_answered(partition);
        let start = start(position, committed.get(&partition).copied(), answered, held);
        if start.another_log {
            let from = match start.seek {
                Offset::Offset(offset) => offset,
                _ => held.oldest,
            };
            tracing::warn!(
                partition,
                database_position = position,
                end = held.end,
                from,
                "the database's position is past the end of the requests topic, a log it never read \
                 (the topic made again, or its tail lost): reading this one from its start"
            );
            positions::replace(&self.pool, &self.topic, partition, from).await?;
        }
        let topic = self.topic.clone();
        // Refused until the partition's fetch has started (just after its assignment): the next
        // poll tries again.
        let seek = start.seek;
        self.blocking(move |consumer| consumer.seek(&topic, partition, seek, KAFKA_TIMEOUT)).await?;
        self.metrics.rewound_messages.inc_by(u64::try_from(start.again).unwrap_or(0));
        if start.lost > 0 {
            self.metrics.rewind_lost_messages.inc_by(u64::try_from(start.lost).unwrap_or(0));
            tracing::error!(
                partition,
                database_position = position,
                oldest_in_topic = held.oldest,
                lost = start.lost,
                "the requests topic no longer holds messages the database lacks: they are lost (deploy/RUNBOOK.md, \"A rewind found messages gone\")"
            );
        }
        if start.again > 0 {
            tracing::info!(partition, from = ?start.seek, answered_below = start.answered_below, again = start.again, "partition rewound to the database's position");
        }
        let mut below = self.answered_below.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match start.answered_below {
            Some(offset) => below.insert(partition, offset),
            None => below.remove(&partition),
        };
        drop(below);
        self.health.rewound(partition, generation);
        Ok(())
    }

    fn list(&self, partitions: &[i32], offset: impl Fn(i32) -> Offset) -> anyhow::Result<TopicPartitionList> {
        let mut list = TopicPartitionList::new();
        for &partition in partitions {
            list.add_partition_offset(&self.topic, partition, offset(partition))?;
        }
        Ok(list)
    }

    /// The offsets each partition holds. A partition's new leader can report an end behind its
    /// old leader's for a moment, until its followers fetch again: where the database's position
    /// is past a partition's end, the end is read again after [`ANOTHER_LOG_RECHECK`], so that
    /// only an end that stays behind makes the position another log's.
    async fn held(&self, partitions: &[i32], database: &HashMap<i32, i64>) -> anyhow::Result<Vec<Held>> {
        let mut held = Vec::with_capacity(partitions.len());
        for &partition in partitions {
            held.push(self.held_now(partition).await?);
        }
        let past_end =
            |partition: &i32, held: &Held| database.get(partition).is_some_and(|&position| !held.reaches(position));
        if partitions.iter().zip(&held).any(|(partition, held)| past_end(partition, held)) {
            tokio::time::sleep(ANOTHER_LOG_RECHECK).await;
            for (partition, held) in partitions.iter().zip(held.iter_mut()) {
                if past_end(partition, held) {
                    *held = self.held_now(*partition).await?;
                }
            }
        }
        Ok(held)
    }

    async fn held_now(&self, partition: i32) -> anyhow::Result<Held> {
        let topic = self.topic.clone();
        let (oldest, end) =
            self.blocking(move |consumer| consumer.fetch_watermarks(&topic, partition, KAFKA_TIMEOUT)).await?;
        Ok(Held { oldest, end })
    }

    /// One of librdkafka's blocking calls, off the runtime's threads.
    async fn blocking<T: Send + 'static>(
        &self,
        call: impl FnOnce(&StreamConsumer<C>) -> Result<T, rdkafka::error::KafkaError> + Send + 'static,
    ) -> anyhow::Result<T> {
        let consumer = self.consumer.clone();
        Ok(tokio::task::spawn_blocking(move || call(&consumer)).await??)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A partition that holds its offsets from `oldest` to 1,000.
    fn held(oldest: i64) -> Held {
        Held { oldest, end: 1_000 }
    }

    #[test]
    fn a_database_behind_the_committed_offset_is_read_again_from_its_own_position() {
        assert_eq!(
            start(Some(40), Some(100), Some(90), held(0)),
            Start { seek: Offset::Offset(40), answered_below: Some(100), lost: 0, again: 60, another_log: false }
        );
        assert_eq!(
            start(Some(40), Some(90), Some(100), held(0)),
            Start { seek: Offset::Offset(40), answered_below: Some(100), lost: 0, again: 60, another_log: false },
            "what this writer answered past the commit is not answered twice"
        );
    }

    #[test]
    fn a_database_at_or_past_the_committed_offset_is_read_from_its_position_all_the_same() {
        assert_eq!(
            start(Some(100), Some(100), None, held(0)),
            Start { seek: Offset::Offset(100), answered_below: Some(100), lost: 0, again: 0, another_log: false },
            "sought all the same: what was read while the rewind waited was dropped"
        );
        assert_eq!(
            start(Some(120), Some(100), None, held(0)),
            Start { seek: Offset::Offset(120), answered_below: Some(120), lost: 0, again: 0, another_log: false },
            "below the database's position everything was answered"
        );
    }

    #[test]
    fn without_a_position_in_the_database_reading_starts_at_kafkas_offset_or_the_beginning() {
        assert_eq!(
            start(None, Some(100), None, held(0)),
            Start { seek: Offset::Offset(100), answered_below: Some(100), lost: 0, again: 0, another_log: false }
        );
        assert_eq!(
            start(None, None, None, held(0)),
            Start { seek: Offset::Beginning, answered_below: None, lost: 0, again: 0, another_log: false }
        );
    }

    #[test]
    fn what_the_topic_no_longer_holds_is_counted_lost_and_reading_starts_at_its_oldest() {
        assert_eq!(
            start(Some(40), Some(100), None, held(55)),
            Start { seek: Offset::Offset(55), answered_below: Some(100), lost: 15, again: 45, another_log: false }
        );
    }

    #[test]
    fn a_position_past_the_end_of_the_partition_is_of_another_log_and_reading_starts_at_its_beginning() {
        let made_again = Held { oldest: 0, end: 3 };
        assert_eq!(
            start(Some(648), None, None, made_again),
            Start { seek: Offset::Beginning, answered_below: None, lost: 0, again: 0, another_log: true },
            "the three messages the new log holds are applied and answered"
        );
        assert_eq!(
            start(Some(648), Some(2), Some(700), made_again),
            Start { seek: Offset::Offset(2), answered_below: Some(2), lost: 0, again: 0, another_log: true },
            "Kafka's committed offset, of this log, still counts"
        );
        assert_eq!(
            start(Some(3), Some(3), None, made_again),
            Start { seek: Offset::Offset(3), answered_below: Some(3), lost: 0, again: 0, another_log: false },
            "a position at the end is of this log"
        );
    }
}
