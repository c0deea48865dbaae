//! The reader: one task reads the requests topic and hands each message, parsed once, to the
//! scheduler under its workspace. It answers nothing itself and waits on neither PostgreSQL nor
//! a produce: what a message needs (an apply, an expired or failed answer, a dead letter) a
//! worker does, in its workspace's order. When the scheduler says the budget is reached, the
//! reader pauses the partitions, and it keeps polling while they are; a workspace beyond its
//! share is passed over, and its messages are read again later (`reread.rs`).

use crate::inbox::{Admission, Inbound, Partitions};
use crate::retry::shutdown_asked;
use crate::schedule::{Pushed, Queued, Scheduler};
use intake_common::kafka_errors::ConsumeErrors;
use rdkafka::consumer::{ConsumerContext, StreamConsumer};
use rdkafka::message::Message;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// librdkafka takes a group consumer that has not polled for `max.poll.interval.ms` for dead
/// and leaves the group. rdkafka's `StreamConsumer` polls librdkafka only when something arrives
/// in its queue; with every partition paused only the statistics events would, so the reader
/// also polls on this timer, whatever the consumer's settings.
const POLL_AT_LEAST_EVERY: Duration = Duration::from_secs(1);

pub struct Reader {
    pub partitions: Arc<dyn Partitions>,
    pub scheduler: Arc<Scheduler<Inbound>>,
}

impl Reader {
    /// Reads until shutdown.
    pub async fn read<C: ConsumerContext + 'static>(
        &self,
        consumer: &StreamConsumer<C>,
        shutdown: &mut watch::Receiver<bool>,
    ) {
        let mut poll = tokio::time::interval(POLL_AT_LEAST_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut errors = ConsumeErrors::new("reading requests failed");
        loop {
            // `recv` is cancel-safe: a message leaves librdkafka's queue only when it returns.
            let received = tokio::select! {
                biased;
                () = shutdown_asked(shutdown) => return,
                _ = poll.tick() => {
                    self.rebalanced();
                    continue;
                }
                received = consumer.recv() => received,
            };
            match received {
                Ok(message) => self.take(&message),
                Err(error) => errors.record(&error).await,
            }
        }
    }

    /// After a rebalance, drops what was read before it and resumes what was paused; checked
    /// also while no message arrives, so that a pause kept across the partitions' revocation and
    /// assignment does not wait for a message to end.
    fn rebalanced(&self) {
        self.scheduler.rebalanced(self.partitions.generation());
        self.apply_pauses();
    }

    fn apply_pauses(&self) {
        self.scheduler.apply_pauses(|p| self.partitions.pause(p), |p| self.partitions.resume(p));
    }

    /// Queues one message for its workspace (after a rebalance, the messages read before it are
    /// dropped first; one of a partition waiting for a rewind is dropped itself) and pauses
    /// what the scheduler says to pause.
    pub fn take(&self, message: &impl Message) {
        self.rebalanced();
        let Admission::Take { answered_before } = self.partitions.admit(message.partition(), message.offset()) else {
            return;
        };
        let (mut inbound, bytes) = Inbound::read(message);
        inbound.answered_before = answered_before;
        let workspace_id = inbound.workspace_id().to_owned();
        let queued = Queued { partition: inbound.partition, offset: inbound.offset, bytes, message: inbound };
        let keyed = message.key() == Some(workspace_id.as_bytes());
        match self.scheduler.push(&workspace_id, queued, keyed) {
            Pushed::Queued { pause } if !pause.is_empty() => {
                let held_bytes = self.scheduler.held_bytes();
                tracing::warn!(?pause, held_bytes, "read budget reached; partitions paused");
                self.apply_pauses();
            }
            Pushed::PassedOver => {
                let held_bytes = self.scheduler.held_bytes();
                tracing::warn!(
                    workspace_id,
                    partition = message.partition(),
                    offset = message.offset(),
                    held_bytes,
                    "a workspace is beyond its share of the read budget: its messages are left in Kafka and read again once it has caught up"
                );
            }
            Pushed::Queued { .. } | Pushed::LeftInKafka => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::testing::{message, raw, request, RecordedPartitions};
    use crate::inbox::Body;

    fn reader(budget: usize) -> (Reader, Arc<RecordedPartitions>) {
        let partitions = Arc::new(RecordedPartitions::default());
        let reader = Reader { partitions: partitions.clone(), scheduler: Arc::new(Scheduler::new(budget, 64)) };
        (reader, partitions)
    }

    #[tokio::test]
    async fn each_message_goes_to_its_workspaces_queue_in_order_expired_or_unreadable_alike() {
        let (reader, _) = reader(usize::MAX);
        let mut late = request("ws_a", "a2", 1);
        late.deadline_ms = 10;
        reader.take(&message(&request("ws_a", "a1", 2), 0, 0, 0));
        reader.take(&message(&request("ws_b", "b1", 1), 0, 1, 0));
        reader.take(&message(&late, 0, 2, 11));
        reader.take(&raw(b"ws_a", b"{".to_vec(), 0, 3, 0));
        let first = reader.scheduler.take().await;
        let kinds: Vec<(&str, i64)> = first
            .group()
            .messages
            .iter()
            .map(|q| match &q.message.body {
                Body::Request(_) => ("request", q.offset),
                Body::Expired(_) => ("expired", q.offset),
                Body::Unreadable(_) => ("unreadable", q.offset),
                Body::Erasure(_) => ("erasure", q.offset),
            })
            .collect();
        assert_eq!(first.group().workspace_id, "ws_a");
        assert_eq!(kinds, [("request", 0), ("expired", 2), ("unreadable", 3)]);
        assert_eq!(reader.scheduler.take().await.group().workspace_id, "ws_b");
        assert!(reader.scheduler.held_bytes() > 4 * 512, "each message charged");
    }

    #[test]
    fn past_the_budget_the_reader_pauses_the_partitions_read_and_a_rebalance_resumes_them() {
        let small = |workspace: &str, partition: i32| message(&request(workspace, "c", 10), partition, 0, 0);
        let big = message(&request("ws_c", "c", 40), 2, 0, 0);
        let budget = 2 * Inbound::read(&small("ws_a", 0)).1 + Inbound::read(&big).1;
        let (reader, partitions) = reader(budget);
        reader.take(&small("ws_a", 0));
        reader.take(&small("ws_b", 1));
        assert!(RecordedPartitions::take(&partitions.paused).is_empty(), "under half the budget");
        reader.take(&big);
        assert_eq!(RecordedPartitions::take(&partitions.paused), vec![0, 1, 2]);
        partitions.generation.store(1, std::sync::atomic::Ordering::SeqCst);
        reader.take(&message(&request("ws_d", "d", 1), 3, 0, 0));
        assert_eq!(RecordedPartitions::take(&partitions.resumed), vec![0, 1, 2], "after a rebalance");
        assert_eq!(reader.scheduler.backlog(), 1, "what was read before it is read again by the partitions' owners");
    }
}
