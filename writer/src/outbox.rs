//! What the writer sends back: a reply per request message on its gateway's reply partition,
//! and a copy of a message it gives up on in the dead-letter topic. Both go through the one
//! retry policy of `retry.rs`, and through a [`Sender`]: the Kafka producer in the writer, a
//! recording (or failing) double in the tests.

use crate::inbox::{Body, BoxFuture, Inbound};
use crate::metrics::{self, Metrics};
use crate::retry::{shutdown_asked, Classify, Failure, Interrupted, Policy, Stop};
use intake_common::kafka_errors::QuietContext;
use intake_model::message::{ChunkOutcome, WriteReply, WriteReplyV1, WriteRequest, WriteRequestV1, WriterTiming};
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// How long one look at the replies topic's partitions may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(5);

/// One record to produce.
pub struct Record<'a> {
    pub topic: &'a str,
    /// None: the partitioner's choice (by key).
    pub partition: Option<i32>,
    pub key: &'a [u8],
    pub payload: &'a [u8],
    pub headers: &'a [(&'a str, String)],
}

/// Resolves once the brokers took the record, or with why not.
pub type Delivery = BoxFuture<'static, Result<(), KafkaError>>;

/// The producer's side of the outbox.
pub trait Sender: Send + Sync {
    /// Queues the record at once (so that records sent one after another travel together).
    fn send(&self, record: &Record<'_>) -> Delivery;

    /// How many partitions `topic` has now.
    fn partitions(&self, topic: &str) -> BoxFuture<'static, Result<i32, KafkaError>>;
}

impl Sender for FutureProducer<QuietContext> {
    fn send(&self, record: &Record<'_>) -> Delivery {
        let mut future = FutureRecord::to(record.topic).key(record.key).payload(record.payload);
        if let Some(partition) = record.partition {
            future = future.partition(partition);
        }
        if !record.headers.is_empty() {
            let headers = record.headers.iter().fold(OwnedHeaders::new(), |headers, (key, value)| {
                headers.insert(Header { key, value: Some(value.as_str()) })
            });
            future = future.headers(headers);
        }
        match self.send_result(future) {
            Ok(delivery) => Box::pin(async move {
                match delivery.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((error, _))) => Err(error),
                    Err(_) => Err(KafkaError::Canceled),
                }
            }),
            Err((error, _)) => Box::pin(std::future::ready(Err(error))),
        }
    }

    fn partitions(&self, topic: &str) -> BoxFuture<'static, Result<i32, KafkaError>> {
        let (producer, topic) = (self.clone(), topic.to_owned());
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
        Box::pin(async move { counted.await.unwrap_or(Err(KafkaError::Canceled)) })
    }
}

pub struct Outbox {
    pub sender: Arc<dyn Sender>,
    /// Named in a dead letter's `source_topic`.
    pub requests_topic: String,
    pub replies_topic: String,
    pub dlq_topic: String,
    pub policy: Policy,
    pub metrics: Arc<Metrics>,
    /// How many partitions the replies topic had when last asked (0: not asked yet). A topic's
    /// partitions are only ever added, so a partition below this count exists.
    reply_partitions: AtomicI32,
    /// The partitions the brokers confirmed missing, and when: within [`MISSING_KNOWN_FOR`] the
    /// next message naming the same one is answered from that, so that a stream of such
    /// messages does not hold the workers in retries.
    missing_confirmed: std::sync::Mutex<HashMap<i32, Instant>>,
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

/// One answer to send.
pub struct Reply<'a> {
    pub correlation_id: &'a str,
    pub partition: i32,
    /// Epoch ms after which nobody waits for it (none: tried through outages until sent).
    pub deadline_ms: Option<i64>,
    pub outcome: ChunkOutcome,
    pub timing: Option<WriterTiming>,
}

/// What a dead letter says about why (its Kafka headers).
pub struct DeadLetter<'a> {
    pub reason: &'static str,
    pub error: String,
    pub attempts: u32,
    pub message: &'a Inbound,
}

/// A request serialized as the gateway did, from a reference.
#[derive(Serialize)]
#[serde(tag = "v")]
enum RequestRef<'a> {
    #[serde(rename = "1")]
    V1(&'a WriteRequestV1),
}

impl Outbox {
    pub fn new(
        sender: Arc<dyn Sender>,
        kafka: &intake_common::config::KafkaArgs,
        policy: Policy,
        metrics: Arc<Metrics>,
    ) -> Self {
        Outbox {
            sender,
            requests_topic: kafka.requests_topic.clone(),
            replies_topic: kafka.replies_topic.clone(),
            dlq_topic: kafka.dlq_topic.clone(),
            policy,
            metrics,
            reply_partitions: AtomicI32::new(0),
            missing_confirmed: std::sync::Mutex::default(),
        }
    }

    /// Sends every reply at once (one round trip for all of them); a reply that fails is tried
    /// again through the policy until its deadline, after which nobody waits for it (the
    /// gateway answered 500 and the client's re-send reads the stored result).
    pub async fn reply_all(
        &self,
        replies: Vec<Reply<'_>>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let deliveries: Vec<Delivery> = replies
            .iter()
            .map(|reply| {
                let payload = reply_payload(reply.correlation_id, &reply.outcome, reply.timing);
                self.sender.send(&self.reply_record(reply.correlation_id, reply.partition, &payload))
            })
            .collect();
        for (reply, delivery) in replies.into_iter().zip(deliveries) {
            let delivered = tokio::select! {
                delivered = delivery => delivered.is_ok(),
                () = shutdown_asked(shutdown) => return Err(Interrupted),
            };
            if !delivered {
                self.reply(reply, shutdown).await?;
            }
        }
        Ok(())
    }

    async fn reply(&self, reply: Reply<'_>, shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
        let Reply { correlation_id, partition, deadline_ms, outcome, timing } = reply;
        let payload = reply_payload(correlation_id, &outcome, timing);
        let send = || self.sender.send(&self.reply_record(correlation_id, partition, &payload));
        // A permanent failure (a reply partition that does not exist) is given up on too.
        match self.policy.run("reply", &self.metrics, deadline_ms.map(deadline_instant), shutdown, send).await {
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

    /// Whether the reply partition is among those the brokers last said exist, without asking.
    pub fn reply_partition_known(&self, partition: i32) -> bool {
        (0..self.reply_partitions.load(Ordering::Relaxed)).contains(&partition)
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
        if self.reply_partition_known(partition) {
            return Ok(Ok(()));
        }
        let known = self.reply_partitions.load(Ordering::Relaxed);
        let recently = self.missing_confirmed.lock().ok().and_then(|missing| missing.get(&partition).copied());
        if recently.is_some_and(|at| at.elapsed() < MISSING_KNOWN_FOR) {
            let reason = PartitionCheck::Missing { partitions: known }.to_string();
            return Ok(Err(Unanswerable { reason, attempts: 0 }));
        }
        let check = || async {
            let partitions = self.sender.partitions(&self.replies_topic).await.map_err(PartitionCheck::Unasked)?;
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

    fn reply_record<'a>(&'a self, correlation_id: &'a str, partition: i32, payload: &'a [u8]) -> Record<'a> {
        Record {
            topic: &self.replies_topic,
            partition: Some(partition),
            key: correlation_id.as_bytes(),
            payload,
            headers: &[],
        }
    }

    /// A copy of the message in the dead-letter topic with headers naming why: the request as
    /// the gateway wrote it (serialized again from its parsed form), or an unreadable message's
    /// own bytes. Through an outage it is retried for as long as it lasts (the message is not
    /// skipped without its copy); if the dead-letter topic refuses it for good, the message is
    /// skipped and logged with its partition and offset: it stays in the requests topic for
    /// `intake-writer replay`.
    pub async fn dead_letter(
        &self,
        letter: DeadLetter<'_>,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<(), Interrupted> {
        let message = letter.message;
        let (key, payload): (&[u8], Vec<u8>) = match &message.body {
            Body::Request(request) | Body::Expired(request) => {
                (request.workspace_id.as_bytes(), serde_json::to_vec(&RequestRef::V1(request)).unwrap_or_default())
            }
            Body::Unreadable(unreadable) => (unreadable.key.as_deref().unwrap_or_default(), unreadable.payload.clone()),
            Body::Erasure(erasure) => (
                erasure.workspace_id.as_bytes(),
                serde_json::to_vec(&WriteRequest::Erasure(erasure.clone())).unwrap_or_default(),
            ),
        };
        let mut headers = vec![
            ("reason", letter.reason.to_owned()),
            ("error", letter.error.clone()),
            ("source_topic", self.requests_topic.clone()),
            ("source_partition", message.partition.to_string()),
            ("source_offset", message.offset.to_string()),
            ("attempts", letter.attempts.to_string()),
            ("dead_lettered_at_ms", intake_common::config::now_ms().to_string()),
        ];
        if let Some(request_id) = &message.request_id {
            headers.push(("request_id", request_id.clone()));
        }
        let record = Record { topic: &self.dlq_topic, partition: None, key, payload: &payload, headers: &headers };
        match self.policy.run("dead_letter", &self.metrics, None, shutdown, || self.sender.send(&record)).await {
            Ok(()) => {
                self.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: letter.reason }).inc();
                tracing::error!(reason = letter.reason, error = %letter.error, partition = message.partition, offset = message.offset, "message dead-lettered");
                Ok(())
            }
            Err(Stop::GaveUp { error, .. } | Stop::Busy { error }) => {
                self.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: "dead_letter_refused" }).inc();
                tracing::error!(%error, partition = message.partition, offset = message.offset, "dead-letter topic refused the message; skipped, replay it from the requests topic");
                Ok(())
            }
            Err(Stop::Interrupted) => Err(Interrupted),
        }
    }
}

fn deadline_instant(deadline_ms: i64) -> Instant {
    let left = deadline_ms.saturating_sub(intake_common::config::now_ms()).max(0);
    Instant::now() + Duration::from_millis(u64::try_from(left).unwrap_or(0))
}

fn reply_payload(correlation_id: &str, outcome: &ChunkOutcome, timing: Option<WriterTiming>) -> Vec<u8> {
    let correlation_id = correlation_id.to_owned();
    let reply = WriteReply::V1(WriteReplyV1 { correlation_id, outcome: outcome.clone(), timing });
    serde_json::to_vec(&reply).unwrap_or_default()
}

#[cfg(test)]
pub mod testing {
    //! A producer double: it records what it was given and fails as it is told.

    use super::{Delivery, Outbox, Record, Sender};
    use crate::inbox::BoxFuture;
    use crate::metrics::Metrics;
    use crate::retry::Policy;
    use rdkafka::error::KafkaError;
    use std::collections::VecDeque;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Two attempts, a millisecond apart.
    pub fn policy() -> Policy {
        Policy { max_attempts: 2, first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(2) }
    }

    /// An outbox on `sender`, with the topics `requests`, `replies` and `dlq`.
    pub fn outbox(sender: Arc<MemorySender>, metrics: Arc<Metrics>) -> Outbox {
        let kafka = intake_common::config::KafkaArgs {
            brokers: String::new(),
            options: Vec::new(),
            requests_topic: "requests".into(),
            replies_topic: "replies".into(),
            dlq_topic: "dlq".into(),
        };
        Outbox::new(sender, &kafka, policy(), metrics)
    }

    /// A record as the brokers took it.
    #[derive(Debug, Clone)]
    pub struct Sent {
        pub topic: String,
        pub partition: Option<i32>,
        pub key: Vec<u8>,
        pub payload: Vec<u8>,
        pub headers: Vec<(String, String)>,
    }

    impl Sent {
        pub fn header(&self, key: &str) -> Option<&str> {
            self.headers.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
        }

        pub fn json(&self) -> serde_json::Value {
            serde_json::from_slice(&self.payload).unwrap_or_default()
        }
    }

    pub struct MemorySender {
        pub sent: Mutex<Vec<Sent>>,
        /// The next sends fail with these, one each, before any succeeds.
        pub failures: Mutex<VecDeque<KafkaError>>,
        pub reply_partitions: i32,
    }

    impl MemorySender {
        pub fn new(reply_partitions: i32) -> Self {
            MemorySender { sent: Mutex::default(), failures: Mutex::default(), reply_partitions }
        }

        pub fn fail_next(&self, errors: impl IntoIterator<Item = KafkaError>) {
            self.failures.lock().unwrap_or_else(|e| e.into_inner()).extend(errors);
        }

        pub fn sent_to(&self, topic: &str) -> Vec<Sent> {
            let sent = self.sent.lock().unwrap_or_else(|e| e.into_inner());
            sent.iter().filter(|s| s.topic == topic).cloned().collect()
        }
    }

    impl Sender for MemorySender {
        fn send(&self, record: &Record<'_>) -> Delivery {
            if let Some(error) = self.failures.lock().unwrap_or_else(|e| e.into_inner()).pop_front() {
                return Box::pin(std::future::ready(Err(error)));
            }
            self.sent.lock().unwrap_or_else(|e| e.into_inner()).push(Sent {
                topic: record.topic.to_owned(),
                partition: record.partition,
                key: record.key.to_vec(),
                payload: record.payload.to_vec(),
                headers: record.headers.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect(),
            });
            Box::pin(std::future::ready(Ok(())))
        }

        fn partitions(&self, _topic: &str) -> BoxFuture<'static, Result<i32, KafkaError>> {
            Box::pin(std::future::ready(Ok(self.reply_partitions)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::MemorySender;
    use super::*;
    use crate::inbox::testing::{message, raw, request};
    use intake_model::message::WriteRequest;
    use rdkafka::types::RDKafkaErrorCode;

    fn outbox(sender: Arc<MemorySender>) -> Outbox {
        super::testing::outbox(sender, Arc::new(Metrics::new()))
    }

    /// A shutdown that is never asked (its sender kept: a dropped one reads as asked).
    fn never() -> (watch::Sender<bool>, watch::Receiver<bool>) {
        watch::channel(false)
    }

    #[tokio::test]
    async fn replies_go_to_their_gateways_partition_and_a_failed_one_is_sent_again() {
        let sender = Arc::new(MemorySender::new(4));
        let outbox = outbox(sender.clone());
        sender.fail_next([KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut)]);
        let replies = vec![
            Reply {
                correlation_id: "c1",
                partition: 2,
                deadline_ms: Some(i64::MAX),
                outcome: ChunkOutcome::Failed,
                timing: None,
            },
            Reply {
                correlation_id: "c2",
                partition: 3,
                deadline_ms: None,
                outcome: ChunkOutcome::Expired,
                timing: None,
            },
        ];
        assert!(outbox.reply_all(replies, &mut never().1).await.is_ok());
        let sent = sender.sent_to("replies");
        let answered: Vec<_> =
            sent.iter().map(|s| (s.partition, s.key.clone(), s.json()["outcome"]["status"].clone())).collect();
        assert_eq!(
            answered,
            vec![(Some(3), b"c2".to_vec(), "expired".into()), (Some(2), b"c1".to_vec(), "failed".into())],
            "the first send failed (an outage) and was sent again"
        );
        assert_eq!(sent[0].json()["correlation_id"], "c2");
    }

    #[tokio::test]
    async fn a_reply_past_its_deadline_is_given_up_and_counted() {
        let sender = Arc::new(MemorySender::new(4));
        let outbox = outbox(sender.clone());
        sender.fail_next(vec![KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut); 2]);
        let late = Reply {
            correlation_id: "c",
            partition: 1,
            deadline_ms: Some(0),
            outcome: ChunkOutcome::Failed,
            timing: None,
        };
        assert!(outbox.reply_all(vec![late], &mut never().1).await.is_ok());
        assert!(sender.sent_to("replies").is_empty());
        assert_eq!(outbox.metrics.replies_dropped.get(), 1);
    }

    #[tokio::test]
    async fn a_dead_letter_is_the_request_as_the_gateway_wrote_it_with_headers_naming_why() {
        let sender = Arc::new(MemorySender::new(4));
        let outbox = outbox(sender.clone());
        let chunk = request("ws_a", "c1", 3);
        let (read, _) = Inbound::read(&message(&chunk, 5, 77, 0));
        let letter = DeadLetter { reason: "apply_failed", error: "boom".into(), attempts: 3, message: &read };
        assert!(outbox.dead_letter(letter, &mut never().1).await.is_ok());
        let letters = sender.sent_to("dlq");
        assert_eq!(letters.len(), 1);
        let letter = &letters[0];
        // What `intake-writer dlq inspect` and `replay --topic` read back.
        assert!(matches!(WriteRequest::from_slice(&letter.payload), Ok(WriteRequest::V1(back)) if back == chunk));
        assert_eq!(letter.key, b"ws_a");
        let headers: Vec<_> =
            ["reason", "error", "source_topic", "source_partition", "source_offset", "attempts", "request_id"]
                .iter()
                .map(|key| letter.header(key).unwrap_or("-"))
                .collect();
        assert_eq!(headers, ["apply_failed", "boom", "requests", "5", "77", "3", "rid-1"]);
        assert_eq!(outbox.metrics.dead_lettered.get_or_create(&metrics::Reason { reason: "apply_failed" }).get(), 1);
    }

    #[tokio::test]
    async fn an_unreadable_message_is_dead_lettered_as_it_came() {
        let sender = Arc::new(MemorySender::new(4));
        let outbox = outbox(sender.clone());
        let (read, _) = Inbound::read(&raw(b"ws_k", b"not json".to_vec(), 0, 1, 0));
        let letter = DeadLetter { reason: "unreadable", error: "x".into(), attempts: 1, message: &read };
        assert!(outbox.dead_letter(letter, &mut never().1).await.is_ok());
        let letters = sender.sent_to("dlq");
        assert_eq!((letters[0].key.as_slice(), letters[0].payload.as_slice()), (&b"ws_k"[..], &b"not json"[..]));
    }

    #[tokio::test]
    async fn a_missing_reply_partition_is_confirmed_once_and_then_known_for_a_while() {
        let sender = Arc::new(MemorySender::new(2));
        let outbox = outbox(sender.clone());
        assert!(matches!(outbox.reply_partition_exists(1, &mut never().1).await, Ok(Ok(()))));
        let missing = outbox.reply_partition_exists(5, &mut never().1).await;
        assert!(matches!(missing, Ok(Err(Unanswerable { attempts: 2, .. }))), "asked through the attempts");
        let again = outbox.reply_partition_exists(5, &mut never().1).await;
        assert!(matches!(again, Ok(Err(Unanswerable { attempts: 0, .. }))), "answered from the brokers' last word");
    }
}
