//! What the writer sends back: a reply per request message on its gateway's reply partition,
//! and a copy of a message it gives up on in the dead-letter topic. Both go through the one
//! retry policy of `retry.rs`.

use crate::metrics::{self, Metrics};
use crate::retry::{shutdown_asked, Interrupted, Policy, Stop};
use intake_common::message::{ChunkOutcome, WriteReply, WriteReplyV1, WriteRequestV1};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

pub struct Outbox {
    pub producer: FutureProducer,
    pub replies_topic: String,
    pub dlq_topic: String,
    pub policy: Policy,
    pub metrics: Arc<Metrics>,
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
