//! The re-reader: reads a partition of the requests topic again for the workspaces the reader
//! passed over (docs/architecture.md, "Memory"). A workspace beyond its share of the read
//! budget (stuck behind a lock held elsewhere, or slower than its senders) has its further
//! messages left in Kafka while its partition reads on for its neighbours; once it is down to
//! half its share, this consumer, outside the group, reads its partition from its first message
//! left and hands the scheduler that workspace's messages, in order, until it has caught up with
//! the reader (then the reader queues them again) or is beyond its share again. So a stuck
//! workspace holds its share of memory and no partition, and Kafka keeps its backlog.

use crate::inbox::{Admission, Inbound, Partitions};
use crate::retry::shutdown_asked;
use crate::schedule::{Pushed, Queued, Scheduler};
use intake_common::kafka_errors::ConsumeErrors;
use rdkafka::consumer::{Consumer as _, ConsumerContext, StreamConsumer};
use rdkafka::error::KafkaResult;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How long a read waits for a message before the re-reader looks at what it is to read again.
const READ_WAIT: Duration = Duration::from_millis(500);
/// How often at most the re-reader asks where a partition starts, and how long it waits.
const START_ASKED_EVERY: Duration = Duration::from_secs(5);
const KAFKA_TIMEOUT: Duration = Duration::from_secs(2);
/// How often an idle re-reader looks at what it is to read again.
const IDLE_CHECK: Duration = Duration::from_millis(250);

pub struct Rereader<C: ConsumerContext + 'static> {
    pub cursor: Cursor<C>,
    pub partitions: Arc<dyn Partitions>,
    pub scheduler: Arc<Scheduler<Inbound>>,
}

/// Where the consumer reads: the generation it was decided in, and for each partition read
/// again the next offset it reads.
#[derive(Default)]
pub struct Reading {
    generation: u64,
    next: BTreeMap<i32, i64>,
    /// When the partitions' starts were last asked for (see [`Rereader::deleted_before`]).
    start_asked: Option<std::time::Instant>,
}

impl Reading {
    pub fn new(generation: u64, next: BTreeMap<i32, i64>) -> Self {
        Reading { generation, next, start_asked: None }
    }

    /// For each partition read, the next offset it reads.
    pub fn next(&self) -> &BTreeMap<i32, i64> {
        &self.next
    }

    /// Whether `wanted` needs the consumer moved: another generation or partitions, or a
    /// workspace to read from before where the consumer is.
    pub fn needs(&self, generation: u64, wanted: &BTreeMap<i32, i64>) -> bool {
        generation != self.generation
            || !wanted.keys().eq(self.next.keys())
            || wanted.iter().any(|(partition, from)| self.must_seek(generation, *partition, *from))
    }

    /// Whether reading `partition` from `from` needs a seek: it is not read now, or read past
    /// `from`, or read for another generation. A partition read before `from` reads on to it.
    fn must_seek(&self, generation: u64, partition: i32, from: i64) -> bool {
        generation != self.generation || self.next.get(&partition).is_none_or(|next| from < *next)
    }
}

/// The re-reader's consumer and its partitions. Each partition is added to the assignment once
/// and never taken out: one no longer read again is paused, and one to read from elsewhere is
/// sought. Reassigning on every change aborted the process under a flood of workspaces passed
/// over: the bundled librdkafka (2.12) asserts when an assignment takes out a partition whose
/// previous removal it is still stopping (confluentinc/librdkafka#5573).
pub struct Cursor<C: ConsumerContext + 'static> {
    consumer: StreamConsumer<C>,
    topic: String,
    assigned: BTreeSet<i32>,
    paused: BTreeSet<i32>,
}

impl<C: ConsumerContext + 'static> Cursor<C> {
    /// `consumer`, assigned nothing yet, reading `topic`.
    pub fn new(consumer: StreamConsumer<C>, topic: String) -> Self {
        Cursor { consumer, topic, assigned: BTreeSet::new(), paused: BTreeSet::new() }
    }

    pub fn consumer(&self) -> &StreamConsumer<C> {
        &self.consumer
    }

    /// Moves the consumer from `reading` to read `wanted` (each partition from its offset) and
    /// nothing else; the next offsets it then reads. Each step's bookkeeping follows its
    /// success, so a turn after a failure does what is left.
    pub fn read_from(
        &mut self,
        reading: &Reading,
        generation: u64,
        wanted: &BTreeMap<i32, i64>,
    ) -> KafkaResult<BTreeMap<i32, i64>> {
        let (mut add, mut added, mut seek) = (TopicPartitionList::new(), Vec::new(), TopicPartitionList::new());
        let mut next = BTreeMap::new();
        for (&partition, &from) in wanted {
            let must_seek = reading.must_seek(generation, partition, from);
            if !self.assigned.contains(&partition) {
                add.add_partition_offset(&self.topic, partition, Offset::Offset(from))?;
                added.push(partition);
            } else if must_seek {
                seek.add_partition_offset(&self.topic, partition, Offset::Offset(from))?;
            }
            let reads_on = reading.next.get(&partition).filter(|_| !must_seek);
            next.insert(partition, reads_on.copied().unwrap_or(from));
        }
        let to_pause: Vec<i32> = (self.assigned.iter().copied())
            .filter(|partition| !wanted.contains_key(partition) && !self.paused.contains(partition))
            .collect();
        let to_resume: Vec<i32> =
            self.paused.iter().copied().filter(|partition| wanted.contains_key(partition)).collect();

        if add.count() > 0 {
            self.consumer.incremental_assign(&add)?;
            self.assigned.extend(added);
        }
        if !to_pause.is_empty() {
            self.consumer.pause(&self.list(&to_pause))?;
            self.paused.extend(&to_pause);
        }
        if seek.count() > 0 {
            let sought = self.consumer.seek_partitions(seek, KAFKA_TIMEOUT)?;
            for partition in sought.elements() {
                partition.error()?;
            }
        }
        if !to_resume.is_empty() {
            self.consumer.resume(&self.list(&to_resume))?;
            self.paused.retain(|partition| !to_resume.contains(partition));
        }
        Ok(next)
    }

    fn list(&self, partitions: &[i32]) -> TopicPartitionList {
        let mut list = TopicPartitionList::new();
        for &partition in partitions {
            list.add_partition(&self.topic, partition);
        }
        list
    }
}

impl<C: ConsumerContext + 'static> Rereader<C> {
    /// Reads again what the scheduler asks for, until shutdown.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let mut reading = Reading::default();
        let mut errors = ConsumeErrors::new("reading requests again failed");
        loop {
            let (generation, wanted) = self.scheduler.to_read_again();
            if reading.needs(generation, &wanted) {
                // Each step waits for librdkafka's threads (the seek up to KAFKA_TIMEOUT).
                match tokio::task::block_in_place(|| self.cursor.read_from(&reading, generation, &wanted)) {
                    Ok(next) => reading = Reading { generation, next, start_asked: reading.start_asked },
                    Err(error) => {
                        // Cleared, so that the next turn seeks every partition again.
                        tracing::warn!(%error, from = ?wanted, "could not move to the messages to read again");
                        reading = Reading::default();
                        tokio::time::sleep(IDLE_CHECK).await;
                        continue;
                    }
                }
            }
            if reading.next.is_empty() {
                tokio::select! {
                    () = shutdown_asked(&mut shutdown) => return,
                    () = self.scheduler.read_again_changed() => {}
                    // A workspace that gave up what it held waits for a time, not an event.
                    () = tokio::time::sleep(IDLE_CHECK) => {}
                }
                continue;
            }
            let received = tokio::select! {
                biased;
                () = shutdown_asked(&mut shutdown) => return,
                () = self.scheduler.read_again_changed() => continue,
                received = tokio::time::timeout(READ_WAIT, self.cursor.consumer.recv()) => received,
            };
            match received {
                Ok(Ok(message)) => self.take(&mut reading, &message),
                Ok(Err(error)) => errors.record(&error).await,
                Err(_) => {}
            }
        }
    }

    /// Hands the scheduler a message read again if a workspace passed over wants it (the
    /// message's key, its workspace, is looked at before it is parsed: only a message keyed by
    /// its workspace is ever left in Kafka), and tells it how far the partition is read.
    fn take(&self, reading: &mut Reading, message: &impl Message) {
        let (partition, offset) = (message.partition(), message.offset());
        let Some(next) = reading.next.get_mut(&partition) else { return };
        if offset != *next && !self.deleted_before(&mut reading.start_asked, partition, *next, offset) {
            // Fetched before a seek (librdkafka may still hand over what it fetched before):
            // taken, it would skip the messages between. The requests topic has no
            // transactions and no compaction, so its offsets follow one another.
            return;
        }
        *next = offset + 1;
        let generation = reading.generation;
        let key = message.key().and_then(|key| std::str::from_utf8(key).ok());
        let wanted = key.is_some_and(|workspace_id| self.scheduler.wants_again(workspace_id, partition, offset));
        if let (true, Admission::Take { answered_before }) = (wanted, self.partitions.admit(partition, offset)) {
            let (mut inbound, bytes) = Inbound::read(message);
            inbound.answered_before = answered_before;
            let workspace_id = inbound.workspace_id().to_owned();
            let queued = Queued { partition, offset, bytes, message: inbound };
            match self.scheduler.push_again(generation, &workspace_id, queued) {
                Pushed::Queued { pause } if !pause.is_empty() => {
                    self.scheduler.apply_pauses(|p| self.partitions.pause(p), |p| self.partitions.resume(p));
                }
                Pushed::PassedOver => {
                    tracing::debug!(
                        workspace_id,
                        partition,
                        offset,
                        "a workspace read again is beyond its share again"
                    );
                }
                Pushed::Queued { .. } | Pushed::LeftInKafka => {}
            }
        }
        if let Some(store) = self.scheduler.read_again_to(generation, partition, offset + 1) {
            self.partitions.store(generation, &[store]);
        }
    }
}

impl<C: ConsumerContext + 'static> Rereader<C> {
    /// Whether the messages from `expected` up to `offset` are gone: below the partition's
    /// start, deleted by retention before they were read again. They were never answered (their
    /// senders had 5xx or a timeout), but they are lost: said at error level, as a rewind whose
    /// offsets Kafka no longer holds is (docs/operations.md, "Retention the log needs").
    /// Asked of the broker at most every [`START_ASKED_EVERY`], as a message fetched before an
    /// assignment leads here too.
    fn deleted_before(
        &self,
        asked: &mut Option<std::time::Instant>,
        partition: i32,
        expected: i64,
        offset: i64,
    ) -> bool {
        if offset < expected || asked.is_some_and(|at| at.elapsed() < START_ASKED_EVERY) {
            return false;
        }
        *asked = Some(std::time::Instant::now());
        let watermarks = tokio::task::block_in_place(|| {
            self.cursor.consumer.fetch_watermarks(&self.cursor.topic, partition, KAFKA_TIMEOUT)
        });
        let Ok((start, _)) = watermarks else { return false };
        // The consumer, reset to the partition's start, reads on from there; anything else is
        // a message fetched for an earlier assignment.
        let deleted = start > expected && offset == start;
        if deleted {
            tracing::error!(
                partition,
                from = expected,
                to = start,
                "messages of a workspace passed over were deleted by the requests topic's retention before they \
                 were read again"
            );
        }
        deleted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_consumer_moves_only_when_it_would_miss_something() {
        let reading = Reading::new(1, BTreeMap::from([(0, 10), (3, 5)]));
        assert!(!reading.needs(1, &BTreeMap::from([(0, 10), (3, 5)])));
        assert!(!reading.needs(1, &BTreeMap::from([(0, 12), (3, 5)])), "ahead: read on to it");
        assert!(reading.needs(1, &BTreeMap::from([(0, 9), (3, 5)])), "behind where it reads");
        assert!(reading.needs(1, &BTreeMap::from([(0, 10)])), "a partition no longer wanted");
        assert!(reading.needs(1, &BTreeMap::from([(0, 10), (3, 5), (4, 0)])), "a new one");
        assert!(reading.needs(2, &BTreeMap::from([(0, 10), (3, 5)])), "a rebalance");
    }

    #[test]
    fn only_a_partition_read_past_where_it_is_wanted_or_not_read_is_sought() {
        let reading = Reading::new(1, BTreeMap::from([(0, 10), (3, 5)]));
        assert!(!reading.must_seek(1, 0, 10));
        assert!(!reading.must_seek(1, 0, 12), "ahead: read on to it");
        assert!(reading.must_seek(1, 0, 9), "behind where it reads");
        assert!(reading.must_seek(1, 4, 0), "not read");
        assert!(reading.must_seek(2, 3, 5), "a rebalance");
    }
}
