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
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::BTreeMap;
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
    pub consumer: StreamConsumer<C>,
    pub topic: String,
    pub partitions: Arc<dyn Partitions>,
    pub scheduler: Arc<Scheduler<Inbound>>,
}

/// What the consumer is assigned: the generation it was decided in, and for each partition
/// the next offset it reads.
#[derive(Default)]
struct Reading {
    generation: u64,
    next: BTreeMap<i32, i64>,
    /// When the partitions' starts were last asked for (see [`Rereader::deleted_before`]).
    start_asked: Option<std::time::Instant>,
}

impl Reading {
    /// Whether `wanted` needs another assignment: another generation or partitions, or a
    /// workspace to read from before where the consumer is.
    fn needs(&self, generation: u64, wanted: &BTreeMap<i32, i64>) -> bool {
        generation != self.generation
            || !wanted.keys().eq(self.next.keys())
            || wanted.iter().any(|(partition, from)| self.next.get(partition).is_some_and(|next| from < next))
    }
}

impl<C: ConsumerContext + 'static> Rereader<C> {
    /// Reads again what the scheduler asks for, until shutdown.
    pub async fn run(self, mut shutdown: watch::Receiver<bool>) {
        let mut reading = Reading::default();
        let mut errors = ConsumeErrors::new("reading requests again failed");
        loop {
            let (generation, wanted) = self.scheduler.to_read_again();
            if reading.needs(generation, &wanted) {
                if let Err(error) = self.assign(&wanted) {
                    // Cleared, so that the next turn assigns again.
                    tracing::warn!(%error, from = ?wanted, "could not assign the partitions to read again");
                    reading = Reading::default();
                    tokio::time::sleep(IDLE_CHECK).await;
                    continue;
                }
                reading = Reading { generation, next: wanted, start_asked: None };
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
                received = tokio::time::timeout(READ_WAIT, self.consumer.recv()) => received,
            };
            match received {
                Ok(Ok(message)) => self.take(&mut reading, &message),
                Ok(Err(error)) => errors.record(&error).await,
                Err(_) => {}
            }
        }
    }

    fn assign(&self, from: &BTreeMap<i32, i64>) -> rdkafka::error::KafkaResult<()> {
        let mut list = TopicPartitionList::new();
        for (&partition, &offset) in from {
            list.add_partition_offset(&self.topic, partition, Offset::Offset(offset))?;
        }
        self.consumer.assign(&list)
    }

    /// Hands the scheduler a message read again if a workspace passed over wants it (the
    /// message's key, its workspace, is looked at before it is parsed: only a message keyed by
    /// its workspace is ever left in Kafka), and tells it how far the partition is read.
    fn take(&self, reading: &mut Reading, message: &impl Message) {
        let (partition, offset) = (message.partition(), message.offset());
        let Some(next) = reading.next.get_mut(&partition) else { return };
        if offset != *next && !self.deleted_before(&mut reading.start_asked, partition, *next, offset) {
            // Fetched for an assignment since replaced (librdkafka may still hand over what it
            // fetched before): taken, it would skip the messages between. The requests topic
            // has no transactions and no compaction, so its offsets follow one another.
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
        let watermarks =
            tokio::task::block_in_place(|| self.consumer.fetch_watermarks(&self.topic, partition, KAFKA_TIMEOUT));
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
    fn the_consumer_is_assigned_again_only_when_it_would_miss_something() {
        let reading = Reading { generation: 1, next: BTreeMap::from([(0, 10), (3, 5)]), start_asked: None };
        assert!(!reading.needs(1, &BTreeMap::from([(0, 10), (3, 5)])));
        assert!(!reading.needs(1, &BTreeMap::from([(0, 12), (3, 5)])), "ahead: read on to it");
        assert!(reading.needs(1, &BTreeMap::from([(0, 9), (3, 5)])), "behind where it reads");
        assert!(reading.needs(1, &BTreeMap::from([(0, 10)])), "a partition no longer wanted");
        assert!(reading.needs(1, &BTreeMap::from([(0, 10), (3, 5), (4, 0)])), "a new one");
        assert!(reading.needs(2, &BTreeMap::from([(0, 10), (3, 5)])), "a rebalance");
    }
}
