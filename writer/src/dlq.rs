//! `intake-writer dlq inspect`: what the dead-letter topic holds, from its headers and the
//! message envelope (reason, error, source, age, workspace, item count), never the items
//! themselves: no hashes or other identifiers are printed.

use intake_common::config::{now_ms, KafkaArgs};
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use intake_model::message::WriteRequest;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Map, Value};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);
/// Headers printed as they are; any other header is left out.
const SHOWN_HEADERS: [&str; 7] =
    ["reason", "error", "source_topic", "source_partition", "source_offset", "attempts", "request_id"];

pub fn inspect(kafka_args: &KafkaArgs, limit: usize) -> anyhow::Result<Value> {
    let topic = &kafka_args.dlq_topic;
    let consumer: BaseConsumer<QuietContext> =
        kafka::reader(kafka_args, "intake-dlq-inspect").create_with_context(QuietContext::default())?;
    let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT)?;
    let mut assignment = TopicPartitionList::new();
    let mut remaining = 0i64;
    for partition in metadata.topics().iter().flat_map(|t| t.partitions()) {
        let (low, high) = consumer.fetch_watermarks(topic, partition.id(), TIMEOUT)?;
        remaining += high - low;
        assignment.add_partition_offset(topic, partition.id(), Offset::Offset(low))?;
    }
    let total = remaining;
    consumer.assign(&assignment)?;
    let mut messages = Vec::new();
    while remaining > 0 && messages.len() < limit {
        let Some(message) = consumer.poll(TIMEOUT) else { anyhow::bail!("{topic}: no message within {TIMEOUT:?}") };
        let message = message?;
        remaining -= 1;
        let mut entry = Map::new();
        entry.insert("partition".into(), json!(message.partition()));
        entry.insert("offset".into(), json!(message.offset()));
        if let Some(headers) = message.headers() {
            for header in headers.iter().filter(|h| SHOWN_HEADERS.contains(&h.key)) {
                entry.insert(header.key.to_owned(), json!(String::from_utf8_lossy(header.value.unwrap_or_default())));
            }
        }
        if let Some(at) = message.timestamp().to_millis() {
            entry.insert("age_seconds".into(), json!((now_ms() - at) / 1000));
        }
        match WriteRequest::from_slice(message.payload().unwrap_or_default()) {
            Ok(WriteRequest::V1(request)) => {
                entry.insert("workspace_id".into(), json!(request.workspace_id));
                entry.insert("correlation_id".into(), json!(request.correlation_id));
                entry.insert("items".into(), json!(request.items.len()));
            }
            Ok(WriteRequest::Erasure(erasure)) => {
                entry.insert("workspace_id".into(), json!(erasure.workspace_id));
                entry.insert("erasure".into(), json!(erasure.kind));
            }
            Err(_) => {
                entry.insert("readable".into(), json!(false));
            }
        }
        messages.push(Value::Object(entry));
    }
    Ok(json!({ "topic": topic, "total": total, "messages": messages }))
}
