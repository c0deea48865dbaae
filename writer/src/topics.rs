//! Creates the three topics through the plain Kafka protocol, so the same command serves Tansu
//! on a laptop and an Apache Kafka cluster in production.

use intake_common::config::KafkaArgs;
use intake_common::service::kafka_config;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use serde_json::{json, Value};
use std::time::Duration;

pub struct TopicCounts {
    pub request_partitions: i32,
    pub reply_partitions: i32,
    pub replication: i32,
    /// Short, so that erased data does not outlive an erasure in Kafka (DESIGN section 8).
    pub retention_ms: i64,
}

pub async fn create_topics(kafka: &KafkaArgs, counts: &TopicCounts) -> anyhow::Result<Value> {
    let admin: AdminClient<DefaultClientContext> = kafka_config(kafka, &[]).create()?;
    let retention = counts.retention_ms.to_string();
    let replication = || TopicReplication::Fixed(counts.replication);
    let topics = [
        NewTopic::new(&kafka.requests_topic, counts.request_partitions, replication()),
        NewTopic::new(&kafka.replies_topic, counts.reply_partitions, replication()),
        NewTopic::new(&kafka.dlq_topic, 1, replication()),
    ]
    .map(|topic| topic.set("retention.ms", &retention));
    let options = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let (mut created, mut existing) = (Vec::new(), Vec::new());
    for result in admin.create_topics(&topics, &options).await? {
        match result {
            Ok(name) => created.push(name),
            Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => existing.push(name),
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    Ok(json!({ "created": created, "existing": existing }))
}
