//! Creates the three topics through the plain Kafka protocol (CreateTopics), so the same command
//! serves the one broker of a laptop and any Kafka cluster in production.

use intake_common::config::KafkaArgs;
use intake_common::kafka;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::types::RDKafkaErrorCode;
use serde_json::{json, Value};
use std::time::Duration;

pub struct TopicCounts {
    pub request_partitions: i32,
    pub reply_partitions: i32,
    pub replication: i32,
    /// In-sync replicas an `acks=all` write needs; default 2 at replication 3 or more, so an
    /// acknowledged write survives the loss of one broker and writes go on while one is down.
    pub min_insync_replicas: Option<i32>,
    /// Short, so that erased data does not outlive an erasure in Kafka (docs/architecture.md, "Retention").
    pub retention_ms: i64,
}

pub async fn create_topics(kafka: &KafkaArgs, counts: &TopicCounts) -> anyhow::Result<Value> {
    let admin: AdminClient<DefaultClientContext> = kafka::admin(kafka).create()?;
    let retention = counts.retention_ms.to_string();
    let min_insync = counts.min_insync_replicas.unwrap_or(if counts.replication >= 3 { 2 } else { 1 }).to_string();
    let replication = || TopicReplication::Fixed(counts.replication);
    let topics = [
        // The broker's append time, against which a writer refuses a chunk that arrived after its
        // deadline (writer/src/expiry.rs).
        NewTopic::new(&kafka.requests_topic, counts.request_partitions, replication())
            .set("message.timestamp.type", "LogAppendTime"),
        NewTopic::new(&kafka.replies_topic, counts.reply_partitions, replication()),
        NewTopic::new(&kafka.dlq_topic, 1, replication()),
    ]
    .map(|topic| topic.set("retention.ms", &retention).set("min.insync.replicas", &min_insync));
    let options = AdminOptions::new()
        .request_timeout(Some(Duration::from_secs(30)))
        .operation_timeout(Some(Duration::from_secs(30)));
    let (mut created, mut existing) = (Vec::new(), Vec::new());
    // A controller that is slow (a cluster still electing, a loaded machine) times the request
    // out; asking again is safe: what was created meanwhile answers TopicAlreadyExists.
    // Brokers of a cluster that just started may not all be registered yet: too few for the
    // replication asked for is also asked again, for half a minute.
    let mut attempts = 0;
    let results = loop {
        attempts += 1;
        match admin.create_topics(&topics, &options).await {
            Err(error) if attempts < 4 => {
                tracing::warn!(%error, attempts, "creating the topics timed out; asking again")
            }
            Ok(results)
                if attempts < 30
                    && results.iter().any(|r| matches!(r, Err((_, RDKafkaErrorCode::InvalidReplicationFactor)))) =>
            {
                tracing::warn!(attempts, "not enough brokers registered yet for the replication; asking again");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            other => break other?,
        }
    };
    for result in results {
        match result {
            Ok(name) => created.push(name),
            Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => existing.push(name),
            Err((name, code)) => anyhow::bail!("creating topic {name}: {code}"),
        }
    }
    let names: Vec<&str> = topics.iter().map(|t| t.name).collect();
    wait_until_led(&admin, &names).await?;
    Ok(json!({ "created": created, "existing": existing }))
}

/// Kafka answers CreateTopics once the controller knows the topics; a broker may learn of them a
/// moment later. Returns when every partition of every topic has a leader, so that programs
/// started right after this command find their partitions.
async fn wait_until_led(admin: &AdminClient<DefaultClientContext>, names: &[&str]) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let led = names.iter().all(|name| {
            admin.inner().fetch_metadata(Some(name), Duration::from_secs(5)).is_ok_and(|metadata| {
                metadata.topics().iter().all(|topic| {
                    topic.error().is_none()
                        && !topic.partitions().is_empty()
                        && topic.partitions().iter().all(|p| p.leader() >= 0 && p.error().is_none())
                })
            })
        });
        if led {
            return Ok(());
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "the topics have no leader after 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
