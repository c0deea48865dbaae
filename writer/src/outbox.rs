//! What the writer sends back: a reply per request message on its gateway's reply partition,
//! and a copy of a message it gives up on in the dead-letter topic. Both go through the one
//! retry policy of `retry.rs`.

use crate::metrics::{self, Metrics};
use crate::retry::{shutdown_asked, Classify, Failure, Interrupted, Policy, Stop};
use intake_common::message::{ChunkOutcome, WriteReply, WriteReplyV1, WriteRequestV1};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long one look at the replies topic's partitions may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);

pub struct Outbox {
    pub producer: FutureProducer,
    pub replies_topic: String,
    pub dlq_topic: String,
    pub policy: Policy,
    pub metrics: Arc<Metrics>,
    /// How many partitions the replies topic had when last asked (0: not asked yet). A topic's
    /// partitions are only ever added, so a partition below this count exists.
    pub reply_partitions: AtomicI32,
    /// The partitions the brokers confirmed missing, and when: within [`MISSING_KNOWN_FOR`] the
    /// next message naming the same one is answered from that, so that a stream of such
    /// messages does not hold the reader (and every other workspace) in retries.
    pub missing_confirmed: std::sync::Mutex<HashMap<i32, Instant>>,
}

/// A reply partition that cannot be answered on, and how many times the brokers were asked
/// (0: a recent answer of theirs was used).
pub struct Unanswerable {
    pub reason: String,
    pub attempts: u32,
}

/// See [`Outbox::missing_confirmed`].
const MISSING_KNOWN_FOR: Duration = Duration::from_secs(10);

/// Why a reply partition could not be confirmed.
#[derive(Debug)]
enum PartitionCheck {
    /// The brokers answered, and the topic has no such partition.
    Missing { partitions: i32 },
    /// The brokers could not be asked: an outage, waited out.
    Unasked(KafkaError),
}

impl std::fmt::Display for PartitionCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PartitionCheck::Missing { partitions } => write!(f, "the replies topic has {partitions} partitions"),
            PartitionCheck::Unasked(error) => write!(f, "the replies topic's partitions: {error}"),
        }
    }
}

impl Classify for PartitionCheck {
    fn failure(&self) -> Failure {
        match self {
            PartitionCheck::Missing { .. } => Failure::Permanent,
            PartitionCheck::Unasked(_) => Failure::Outage,
        }
    }
}

/// What a dead letter says about why (its Kafka headers).
pub struct DeadLetter<'a> {
    pub reason: &'static str,
    pub error: String,
    pub attempts: u32,
    pub message: &'a OwnedMessage,
}

impl Outbox {
    /// Sends every reply at once; a reply that fails is tried again through the policy until
    /// its request's deadline, after which nobody waits for it (the gateway answered 500 and the
    /// client's re-send reads the stored result).
    pub async fn reply_all(
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

    pub async fn reply(
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
        match self.policy.run("reply", &self.metrics, until, shutdown, send).await {
            Ok(()) => Ok(()),
            Err(Stop::GaveUp { error, attempts }) => {
                self.metrics.replies_dropped.inc();
                tracing::warn!(%error, correlation_id, partition, attempts, "reply given up; the gateway answered 500");
                Ok(())
            }
            // Kafka raises no lock wait.
            Err(Stop::Busy { .. }) => Ok(()),
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }

    /// Whether the request's reply partition exists, asking the brokers when the last count
    /// says no: a partition just added is found; one still missing after the policy's attempts
    /// is `Err` with the reason, and the message cannot be answered (docs/architecture.md,
    /// "Failure classes": dead-lettered).
    pub async fn reply_partition_exists(
        &self,
        partition: i32,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Result<(), Unanswerable>, Interrupted> {
        let known = self.reply_partitions.load(Ordering::Relaxed);
        if (0..known).contains(&partition) {
            return Ok(Ok(()));
        }
        let recently = self.missing_confirmed.lock().ok().and_then(|missing| missing.get(&partition).copied());
        if recently.is_some_and(|at| at.elapsed() < MISSING_KNOWN_FOR) {
            let reason = PartitionCheck::Missing { partitions: known }.to_string();
            return Ok(Err(Unanswerable { reason, attempts: 0 }));
        }
        let check = || async {
            let partitions = self.count_reply_partitions().await.map_err(PartitionCheck::Unasked)?;
            self.reply_partitions.fetch_max(partitions, Ordering::Relaxed);
            if (0..partitions).contains(&partition) {
                Ok(())
            } else {
                Err(PartitionCheck::Missing { partitions })
            }
        };
        match self.policy.run("reply_partition", &self.metrics, None, shutdown, check).await {
            Ok(()) => Ok(Ok(())),
            Err(Stop::GaveUp { error, attempts }) => {
                if let Ok(mut missing) = self.missing_confirmed.lock() {
                    missing.retain(|_, at| at.elapsed() < MISSING_KNOWN_FOR);
                    missing.insert(partition, Instant::now());
                }
                Ok(Err(Unanswerable { reason: error.to_string(), attempts }))
            }
            // Neither a lock wait nor an outage ends here: outages are waited out.
            Err(Stop::Busy { error }) => Ok(Err(Unanswerable { reason: error.to_string(), attempts: 1 })),
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }

    async fn count_reply_partitions(&self) -> Result<i32, KafkaError> {
        let (producer, topic) = (self.producer.clone(), self.replies_topic.clone());
        // rdkafka's metadata call blocks its thread.
        let counted = tokio::task::spawn_blocking(move || {
            let metadata = producer.client().fetch_metadata(Some(&topic), METADATA_TIMEOUT)?;
            let described = metadata.topics().iter().find(|t| t.name() == topic);
            // A replies topic that is not there (yet) is the deployment's fault, not the
            // message's: waited out like an outage rather than dead-lettering every message.
            match described {
                None => Err(KafkaError::MetadataFetch(rdkafka::types::RDKafkaErrorCode::UnknownTopic)),
                Some(described) => match described.error() {
                    Some(error) => Err(KafkaError::MetadataFetch(error.into())),
                    None => Ok(i32::try_from(described.partitions().len()).unwrap_or(i32::MAX)),
                },
            }
        });
        counted.await.unwrap_or(Err(KafkaError::Canceled))
    }

    fn reply_record<'a>(
        &'a self,
        correlation_id: &'a str,
        partition: i32,
        payload: &'a [u8],
    ) -> FutureRecord<'a, str, [u8]> {
        FutureRecord::to(&self.replies_topic).partition(partition).key(correlation_id).payload(payload)
    }

    /// A copy of the message in the dead-letter topic with headers naming why. Through an outage
    /// it is retried for as long as it lasts (the message is not skipped without its copy); if
    /// the dead-letter topic refuses it for good, the message is skipped and logged with its
    /// partition and offset: it stays in the requests topic for `intake-writer replay`.
    pub async fn dead_letter(
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
            let record = FutureRecord::to(&self.dlq_topic)
                .key(message.key().unwrap_or_default())
                .payload(message.payload().unwrap_or_default())
                .headers(headers.clone());
            self.producer.send(record, Duration::ZERO).await.map(|_| ()).map_err(|(error, _)| error)
        };
        match self.policy.run("dead_letter", &self.metrics, None, shutdown, send).await {
            Ok(()) => {
                self.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: letter.reason }).inc();
                tracing::error!(reason = letter.reason, error = %letter.error, partition = message.partition(), offset = message.offset(), "message dead-lettered");
                Ok(())
            }
            Err(Stop::GaveUp { error, .. } | Stop::Busy { error }) => {
                self.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: "dead_letter_refused" }).inc();
                tracing::error!(%error, partition = message.partition(), offset = message.offset(), "dead-letter topic refused the message; skipped, replay it from the requests topic");
                Ok(())
            }
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }
}

/// The gateway's request id, carried in the `request_id` header.
pub fn request_id(message: &OwnedMessage) -> Option<&str> {
    let headers = message.headers()?;
    headers.iter().find(|h| h.key == "request_id").and_then(|h| h.value).and_then(|v| std::str::from_utf8(v).ok())
}

fn deadline_instant(deadline_ms: i64) -> Instant {
    let left = deadline_ms.saturating_sub(intake_common::config::now_ms()).max(0);
    Instant::now() + Duration::from_millis(u64::try_from(left).unwrap_or(0))
}

fn reply_payload(correlation_id: &str, outcome: ChunkOutcome) -> Vec<u8> {
    let reply = WriteReply::V1(WriteReplyV1 { correlation_id: correlation_id.to_owned(), outcome });
    serde_json::to_vec(&reply).unwrap_or_default()
}
