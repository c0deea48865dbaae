//! `intake-writer replay`: applies request messages again from a topic, outside the consumer
//! group, e.g. after a database restore or to re-apply dead-lettered messages once their cause is
//! fixed. A message that was already applied is recognised by its id and changes nothing.

use crate::expiry;
use crate::store::{self, Database};
use anyhow::{bail, Context};
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use intake_model::conversion::Conversion;
use intake_model::message::{WriteRequest, WriteRequestV1};
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

#[derive(Clone, Copy)]
pub struct Options {
    pub newer: Newer,
    /// Look, count, and change nothing.
    pub dry_run: bool,
    /// Go on when the topic no longer holds the start (see [`gaps`]).
    pub accept_loss: bool,
}

pub async fn replay(
    db: &Database,
    kafka: &KafkaArgs,
    topic: &str,
    start: Start,
    options: Options,
) -> anyhow::Result<Value> {
    let Options { newer, dry_run, accept_loss } = options;
    let consumer: BaseConsumer<QuietContext> =
        kafka::reader(kafka, "intake-replay").create_with_context(QuietContext::default())?;
    let ranges = ranges(&consumer, topic, start)?;
    let gaps = gaps(&consumer, topic, &ranges)?;
    if !gaps.is_empty() {
        let said: Vec<String> = gaps.iter().map(Gap::to_string).collect();
        if !accept_loss {
            bail!(
                "{topic} no longer holds the start asked for: {}; its retention deleted what a replay would need. \
                 Give --accept-loss to replay what it holds and record the gap (deploy/RUNBOOK.md, \"PostgreSQL restored from a backup: replay\")",
                said.join("; ")
            );
        }
        tracing::warn!(topic, gaps = ?said, "replaying with a gap the topic no longer holds (--accept-loss)");
    }
    let (mut applied, mut already, mut failed, mut messages, mut kept_newer) = (0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut expired, mut request_failed, mut erasures) = (0u64, 0u64, 0u64);
    for Range { partition, from, to, .. } in ranges {
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
                    // Its ids derive from where it stands, as when the writers applied it.
                    request.position = crate::inbox::position(&message);
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
                    let outcome = match dry_run {
                        true => db.would_apply(&request).await,
                        false => db.apply_chunk(&request).await,
                    };
                    match outcome {
                        Ok(store::Chunk::Applied(outcome)) if outcome.first_time => applied += 1,
                        Ok(store::Chunk::Applied(_)) => already += 1,
                        Ok(store::Chunk::RequestFailed) => request_failed += 1,
                        Err(error) => {
                            failed += 1;
                            tracing::error!(%error, partition, offset = message.offset(), "replayed message failed");
                        }
                    }
                }
                // An erasure recorded here is applied again where it stands, so that the person's
                // data replayed before it is erased again.
                Ok(WriteRequest::Erasure(_)) if dry_run => erasures += 1,
                Ok(WriteRequest::Erasure(erasure)) => match crate::erase::apply_record(db, &erasure).await {
                    Ok(_) => erasures += 1,
                    Err(error) => {
                        failed += 1;
                        tracing::error!(%error, partition, offset = message.offset(), "replayed erasure failed");
                    }
                },
                Err(error) => {
                    failed += 1;
                    tracing::error!(%error, partition, offset = message.offset(), "unreadable message");
                }
            }
        }
    }
    let mut summary = json!({ "messages": messages, "applied": applied, "already_applied": already, "failed": failed,
        "expired": expired, "request_failed": request_failed });
    if erasures > 0 {
        summary["erasures"] = json!(erasures);
    }
    if newer == Newer::Keep {
        summary["kept_newer"] = json!(kept_newer);
    }
    if dry_run {
        summary["dry_run"] = json!(true);
    }
    if !gaps.is_empty() {
        summary["lost_to_retention"] = gaps.iter().map(Gap::to_json).collect();
    }
    Ok(summary)
}

/// Where a replay's start lies before what the topic still holds: messages from `asked` to
/// `held` were deleted by the topic's retention (or never existed, which the topic cannot tell
/// apart).
struct Gap {
    partition: i32,
    /// The first offset the topic holds, and its message's time (epoch ms) when known.
    held: i64,
    held_ms: Option<i64>,
    /// The start asked for: an offset, or a time.
    asked: Asked,
}

enum Asked {
    Offset(i64),
    Time(i64),
}

impl Gap {
    fn to_json(&self) -> Value {
        let mut gap = json!({ "partition": self.partition, "first_offset_held": self.held });
        match self.asked {
            Asked::Offset(offset) => gap["messages_missing"] = json!(self.held - offset),
            Asked::Time(ms) => {
                gap["from_ms"] = json!(ms);
                if let Some(held_ms) = self.held_ms {
                    gap["missing_ms"] = json!(held_ms - ms);
                }
            }
        }
        gap
    }
}

impl std::fmt::Display for Gap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.asked {
            Asked::Offset(offset) => write!(
                f,
                "partition {} starts at offset {}, {} messages after the offset {offset} asked for",
                self.partition,
                self.held,
                self.held - offset
            ),
            Asked::Time(ms) => match self.held_ms {
                Some(held_ms) => write!(
                    f,
                    "partition {} holds messages from {:.0} s after the time asked for (offset {})",
                    self.partition,
                    (held_ms - ms) as f64 / 1000.0,
                    self.held
                ),
                None => write!(f, "partition {} holds messages from offset {} only", self.partition, self.held),
            },
        }
    }
}

/// The ranges whose start the topic no longer holds: a partition whose retention deleted
/// messages (its first offset above 0), asked for from before its first message.
fn gaps(consumer: &BaseConsumer<QuietContext>, topic: &str, ranges: &[Range]) -> anyhow::Result<Vec<Gap>> {
    let mut gaps = Vec::new();
    for range in ranges {
        let (low, _) = consumer.fetch_watermarks(topic, range.partition, TIMEOUT)?;
        if low == 0 {
            continue;
        }
        match range.asked {
            Asked::Offset(offset) if offset < low => {
                gaps.push(Gap { partition: range.partition, held: low, held_ms: None, asked: Asked::Offset(offset) })
            }
            Asked::Time(ms) => {
                let held_ms = first_time(consumer, topic, range.partition, low)?;
                if held_ms.is_none_or(|held_ms| held_ms > ms) {
                    gaps.push(Gap { partition: range.partition, held: low, held_ms, asked: Asked::Time(ms) });
                }
            }
            Asked::Offset(_) => {}
        }
    }
    Ok(gaps)
}

/// The time of the message at `offset` (the partition's first), if it can be read.
fn first_time(
    consumer: &BaseConsumer<QuietContext>,
    topic: &str,
    partition: i32,
    offset: i64,
) -> anyhow::Result<Option<i64>> {
    let mut assignment = TopicPartitionList::new();
    assignment.add_partition_offset(topic, partition, Offset::Offset(offset))?;
    consumer.assign(&assignment)?;
    let time = match consumer.poll(TIMEOUT) {
        Some(Ok(message)) => message.timestamp().to_millis(),
        _ => None,
    };
    Ok(time)
}

/// A partition's first and last offsets to replay, and the start asked for.
struct Range {
    partition: i32,
    from: i64,
    to: i64,
    asked: Asked,
}

fn ranges(consumer: &BaseConsumer<QuietContext>, topic: &str, start: Start) -> anyhow::Result<Vec<Range>> {
    match start {
        Start::Offsets { partition, from, to } => {
            let (low, high) = consumer.fetch_watermarks(topic, partition, TIMEOUT)?;
            let to = to.unwrap_or(high - 1).min(high - 1);
            Ok(vec![Range { partition, from: from.max(low), to, asked: Asked::Offset(from) }])
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
                ranges.push(Range { partition, from, to: high - 1, asked: Asked::Time(from_ms) });
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
        intake_model::in_workspace!("c."),
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
