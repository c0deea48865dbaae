//! `intake-writer replay`: applies request messages again from a topic, outside the consumer
//! group, e.g. after a database restore or to re-apply dead-lettered messages once their cause is
//! fixed. A message that was already applied is recognised by its id and changes nothing.

use crate::expiry;
use crate::store::{self, Database};
use anyhow::{bail, Context};
use intake_common::config::KafkaArgs;
use intake_common::conversion::Conversion;
use intake_common::kafka;
use intake_common::message::{WriteRequest, WriteRequestV1};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use sqlx::PgPool;
use std::time::Duration;

pub enum Start {
    /// One partition, from an offset, to an offset (inclusive) or the current end.
    Offsets { partition: i32, from: i64, to: Option<i64> },
    /// Every partition, from the first message at or after this time (epoch ms) to the current end.
    Time { from_ms: i64 },
}

const TIMEOUT: Duration = Duration::from_secs(10);

/// A dead-lettered message is older than whatever was written since: replaying the dead-letter
/// topic leaves out the items whose conversion was stored after the message was received, so
/// that an old value never overwrites a newer one. (Not for the requests topic, whose messages
/// are replayed in their order and each overwrites the one before it.)
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Newer {
    Overwrite,
    Keep,
}

pub async fn replay(
    db: &Database,
    kafka: &KafkaArgs,
    topic: &str,
    start: Start,
    newer: Newer,
) -> anyhow::Result<Value> {
    let consumer: BaseConsumer = kafka::reader(kafka, "intake-replay").create()?;
    let ranges = ranges(&consumer, topic, start)?;
    let (mut applied, mut already, mut failed, mut messages, mut kept_newer) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut expired, mut request_failed) = (0u64, 0u64);
    for (partition, from, to) in ranges {
        if from > to {
            continue;
        }
        let mut assignment = TopicPartitionList::new();
        assignment.add_partition_offset(topic, partition, Offset::Offset(from))?;
        consumer.assign(&assignment)?;
        let mut next = from;
        while next <= to {
            let message = match consumer.poll(TIMEOUT) {
                Some(message) => message.context("reading the topic")?,
                None => bail!("no message at {topic}/{partition}@{next} within {TIMEOUT:?}"),
            };
            next = message.offset() + 1;
            messages += 1;
            match WriteRequest::from_slice(message.payload().unwrap_or_default()) {
                Ok(WriteRequest::V1(mut request)) => {
                    if newer == Newer::Keep {
                        let before = request.items.len();
                        request.items = without_newer(&db.pool, &request).await?;
                        kept_newer += (before - request.items.len()) as u64;
                        if request.items.is_empty() {
                            continue;
                        }
                    }
                    // A dead letter's own append time is its dead-lettering's; it reached the
                    // requests topic in time, or it would not have been applied and failed.
                    if newer == Newer::Overwrite && expiry::expired(&message, &request) {
                        expired += 1;
                        continue;
                    }
                    match db.apply_chunk(&request).await {
                        Ok(store::Chunk::Applied(outcome)) if outcome.first_time => applied += 1,
                        Ok(store::Chunk::Applied(_)) => already += 1,
                        Ok(store::Chunk::RequestFailed) => request_failed += 1,
                        Err(error) => {
                            failed += 1;
                            tracing::error!(%error, partition, offset = message.offset(), "replayed message failed");
                        }
                    }
                }
                Err(error) => {
                    failed += 1;
                    tracing::error!(%error, partition, offset = message.offset(), "unreadable message");
                }
            }
        }
    }
    let mut summary = json!({ "messages": messages, "applied": applied, "already_applied": already, "failed": failed,
        "expired": expired, "request_failed": request_failed });
    if newer == Newer::Keep {
        summary["kept_newer"] = json!(kept_newer);
    }
    Ok(summary)
}

/// (partition, first offset, last offset) to replay.
fn ranges(consumer: &BaseConsumer, topic: &str, start: Start) -> anyhow::Result<Vec<(i32, i64, i64)>> {
    match start {
        Start::Offsets { partition, from, to } => {
            let (low, high) = consumer.fetch_watermarks(topic, partition, TIMEOUT)?;
            Ok(vec![(partition, from.max(low), to.unwrap_or(high - 1).min(high - 1))])
        }
        Start::Time { from_ms } => {
            let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT)?;
            let partitions: Vec<i32> = metadata.topics().iter().flat_map(|t| t.partitions()).map(|p| p.id()).collect();
            if partitions.is_empty() {
                bail!("no topic {topic}");
            }
            let mut query = TopicPartitionList::new();
            for &partition in &partitions {
                query.add_partition_offset(topic, partition, Offset::Offset(from_ms))?;
            }
            let found = consumer.offsets_for_times(query, TIMEOUT)?;
            let mut ranges = Vec::new();
            for &partition in &partitions {
                let (_, high) = consumer.fetch_watermarks(topic, partition, TIMEOUT)?;
                let from = match found.find_partition(topic, partition).map(|p| p.offset()) {
                    Some(Offset::Offset(offset)) => offset,
                    _ => high, // nothing at or after that time
                };
                ranges.push((partition, from, high - 1));
            }
            Ok(ranges)
        }
    }
}

/// The items of a request whose conversion was not stored (created or updated) after the
/// request was received.
async fn without_newer(pool: &PgPool, request: &WriteRequestV1) -> anyhow::Result<Vec<Conversion>> {
    let events: Vec<&str> = request.items.iter().map(|c| c.event.as_str()).collect();
    let ids: Vec<&str> = request.items.iter().map(|c| c.external_id.as_str()).collect();
    let newer: Vec<(String, String)> = sqlx::query_as(concat!(
        "SELECT c.event, c.external_id FROM conversions c
           JOIN unnest($2::text[], $3::text[]) AS i(event, external_id) USING (event, external_id)
          WHERE ",
        intake_common::in_workspace!("c."),
        " AND c.updated_at > 'epoch'::timestamptz + $4 * interval '1 millisecond'"
    ))
    .bind(&request.workspace_id)
    .bind(&events)
    .bind(&ids)
    .bind(request.received_at_ms)
    .fetch_all(pool)
    .await?;
    Ok(request
        .items
        .iter()
        .filter(|c| !newer.iter().any(|(event, id)| event == c.event.as_str() && id == c.external_id.as_str()))
        .cloned()
        .collect())
}
