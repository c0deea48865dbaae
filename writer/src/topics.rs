//! Creates the three topics through the plain Kafka protocol (CreateTopics), so the same command
//! serves the one broker of a laptop and any Kafka cluster in production, and sets the settings
//! below on topics that exist already (AlterConfigs): running the command again applies changed
//! retentions. Partition counts of existing topics are left alone, and so is a retention longer
//! than the one asked for (raised by an operator during an incident, say) unless
//! `--lower-retention` says to lower it.

use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication};
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
    /// Of the requests and replies topics. Short, so that erased data does not outlive an
    /// erasure in Kafka (docs/architecture.md, "Retention"); it also sets how long applied message ids are kept
    /// (writer/src/retention.rs), which reads it back from the topic.
    pub retention_ms: i64,
    /// Of the dead-letter topic: long enough for an incident over a weekend to find its letters.
    pub dlq_retention_ms: i64,
}

/// A topic's segment length: Kafka deletes whole closed segments, so a message stays readable
/// up to `retention.ms + segment.ms`; a segment of a quarter of the retention (at most an hour,
/// at least ten seconds) keeps that overshoot small. The default of seven days would keep a
/// message of a 24-hour topic for eight.
pub fn segment_ms(retention_ms: i64) -> i64 {
    (retention_ms / 4).clamp(10_000, 3_600_000)
}

/// Every setting the command manages, per topic. AlterConfigs replaces a topic's whole set of
/// dynamic settings, so this is the complete map, the same for a new and an existing topic.
fn settings(kafka: &KafkaArgs, counts: &TopicCounts) -> Vec<(String, Vec<(&'static str, String)>)> {
    let min_insync = counts.min_insync_replicas.unwrap_or(if counts.replication >= 3 { 2 } else { 1 }).to_string();
    let common = |retention_ms: i64| {
        vec![
            ("retention.ms", retention_ms.to_string()),
            ("segment.ms", segment_ms(retention_ms).to_string()),
            ("min.insync.replicas", min_insync.clone()),
        ]
    };
    let mut requests = common(counts.retention_ms);
    // The broker's append time is the time of a request message, not the sender's: a writer
    // refuses a chunk appended after its deadline (writer/src/expiry.rs).
    requests.push(("message.timestamp.type", "LogAppendTime".to_owned()));
    // A reply's append time splits its way into the reply's produce and its read, in the
    // gateway's Server-Timing.
    let mut replies = common(counts.retention_ms);
    replies.push(("message.timestamp.type", "LogAppendTime".to_owned()));
    vec![
        (kafka.requests_topic.clone(), requests),
        (kafka.replies_topic.clone(), replies),
        (kafka.dlq_topic.clone(), common(counts.dlq_retention_ms)),
    ]
}

pub async fn create_topics(kafka: &KafkaArgs, counts: &TopicCounts, lower_retention: bool) -> anyhow::Result<Value> {
    let admin: AdminClient<QuietContext> = kafka::admin(kafka).create_with_context(QuietContext::default())?;
    let mut settings = settings(kafka, counts);
    let partitions = [counts.request_partitions, counts.reply_partitions, 1];
    let topics: Vec<NewTopic<'_>> = settings
        .iter()
        .zip(partitions)
        .map(|((name, entries), partitions)| {
            entries.iter().fold(
                NewTopic::new(name, partitions, TopicReplication::Fixed(counts.replication)),
                |topic, (key, value)| topic.set(key, value),
            )
        })
        .collect();
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
    let names: Vec<String> = topics.iter().map(|t| t.name.to_owned()).collect();
    drop(topics);
    wait_until_led(&admin, &names.iter().map(String::as_str).collect::<Vec<_>>()).await?;
    // A longer retention than this run's stays, with its segment length (AlterConfigs replaces
    // a topic's whole configuration, so it is set again as it is).
    let mut kept = serde_json::Map::new();
    if !lower_retention && !existing.is_empty() {
        for (name, current) in retentions(&admin, &existing, &options).await? {
            let Some((_, entries)) = settings.iter_mut().find(|(topic, _)| *topic == name) else { continue };
            let asked: i64 =
                entries.iter().find(|(key, _)| *key == "retention.ms").and_then(|(_, v)| v.parse().ok()).unwrap_or(0);
            if current == -1 || current > asked {
                for (key, value) in entries.iter_mut() {
                    match *key {
                        "retention.ms" => *value = current.to_string(),
                        "segment.ms" => *value = segment_ms(if current == -1 { i64::MAX } else { current }).to_string(),
                        _ => {}
                    }
                }
                tracing::warn!(topic = %name, current, asked, "kept the topic's longer retention (--lower-retention lowers it)");
                kept.insert(name, json!(current));
            }
        }
    }
    // Existing topics get the settings of this run: a changed retention takes effect.
    let alter: Vec<AlterConfig<'_>> = settings
        .iter()
        .filter(|(name, _)| existing.contains(name))
        .map(|(name, entries)| {
            entries
                .iter()
                .fold(AlterConfig::new(ResourceSpecifier::Topic(name)), |alter, (key, value)| alter.set(key, value))
        })
        .collect();
    if !alter.is_empty() {
        for result in admin.alter_configs(&alter, &options).await? {
            if let Err((resource, code)) = result {
                anyhow::bail!("setting the configuration of {resource:?}: {code}");
            }
        }
    }
    let mut output = json!({ "created": created, "existing": existing, "configured": existing });
    if !kept.is_empty() {
        output["kept_longer_retention"] = Value::Object(kept);
    }
    Ok(output)
}

/// The `retention.ms` each of `names` has now.
async fn retentions(
    admin: &AdminClient<QuietContext>,
    names: &[String],
    options: &AdminOptions,
) -> anyhow::Result<Vec<(String, i64)>> {
    let specifiers: Vec<ResourceSpecifier<'_>> = names.iter().map(|name| ResourceSpecifier::Topic(name)).collect();
    let described = admin.describe_configs(&specifiers, options).await?;
    let mut retentions = Vec::new();
    for (name, result) in names.iter().zip(described) {
        let resource = result.map_err(|code| anyhow::anyhow!("describing topic {name}: {code}"))?;
        if let Some(ms) = resource.get("retention.ms").and_then(|e| e.value.as_deref()).and_then(|v| v.parse().ok()) {
            retentions.push((name.clone(), ms));
        }
    }
    Ok(retentions)
}

/// Kafka answers CreateTopics once the controller knows the topics; a broker may learn of them a
/// moment later. Returns when every partition of every topic has a leader, so that programs
/// started right after this command find their partitions.
async fn wait_until_led(admin: &AdminClient<QuietContext>, names: &[&str]) -> anyhow::Result<()> {
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
