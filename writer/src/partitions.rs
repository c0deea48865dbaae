//! Growing the requests topic (`intake-writer topics --request-partitions N` on an existing
//! topic), to run more writers than it has partitions. A workspace's partition is chosen by
//! its key's hash modulo the count, so a new count moves most workspaces: a message of a
//! workspace still waiting on its old partition and a newer one on its new partition could be
//! applied in the wrong order. So the command refuses unless that cannot happen: the writers'
//! group has applied everything (its committed offsets are the partitions' ends) and nothing
//! was appended for a quiet period (the gateways are stopped or refuse writes). The procedure
//! is in deploy/RUNBOOK.md.

use anyhow::{bail, Context};
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use rdkafka::admin::{AdminClient, AdminOptions, NewPartitions};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(10);

pub struct Growth<'a> {
    pub kafka: &'a KafkaArgs,
    pub group_id: &'a str,
    pub partitions: i32,
    /// How long the topic's ends must stay still.
    pub quiet: Duration,
}

/// Adds partitions to the requests topic when it has fewer than asked and it is safe; `None`
/// when there is nothing to do.
pub async fn grow_requests_topic(growth: Growth<'_>) -> anyhow::Result<Option<Value>> {
    let kafka = growth.kafka;
    let topic = kafka.requests_topic.clone();
    let consumer: BaseConsumer<QuietContext> =
        kafka::reader(kafka, growth.group_id).create_with_context(QuietContext::default())?;
    let current = partition_count(&consumer, &topic)?;
    // Fewer asked than it has: it keeps them (Kafka cannot take partitions away, and running
    // the quick start again with the default count must not fail).
    if growth.partitions <= current {
        return Ok(None);
    }
    let ends = tokio::task::block_in_place(|| drained(&consumer, &topic, current, growth.group_id, growth.quiet))?;
    let admin: AdminClient<QuietContext> = kafka::admin(kafka).create_with_context(QuietContext::default())?;
    let count = usize::try_from(growth.partitions).context("partition count")?;
    let results = admin
        .create_partitions(&[NewPartitions::new(&topic, count)], &AdminOptions::new().request_timeout(Some(TIMEOUT)))
        .await?;
    for result in results {
        if let Err((name, code)) = result {
            bail!("adding partitions to {name}: {code}");
        }
    }
    Ok(Some(
        json!({ "topic": topic, "partitions_before": current, "partitions": growth.partitions, "drained_at": ends }),
    ))
}

fn partition_count(consumer: &BaseConsumer<QuietContext>, topic: &str) -> anyhow::Result<i32> {
    let metadata = consumer.fetch_metadata(Some(topic), TIMEOUT)?;
    let count = metadata.topics().first().map_or(0, |t| t.partitions().len());
    anyhow::ensure!(count > 0, "no topic {topic}");
    Ok(i32::try_from(count)?)
}

/// The partitions' ends, once the group has committed every one of them and they stayed
/// still for `quiet`; an error saying why not otherwise.
fn drained(
    consumer: &BaseConsumer<QuietContext>,
    topic: &str,
    partitions: i32,
    group_id: &str,
    quiet: Duration,
) -> anyhow::Result<Vec<i64>> {
    let ends = |consumer: &BaseConsumer<QuietContext>| -> anyhow::Result<Vec<i64>> {
        (0..partitions).map(|p| Ok(consumer.fetch_watermarks(topic, p, TIMEOUT)?.1)).collect()
    };
    let before = ends(consumer)?;
    let mut list = TopicPartitionList::new();
    for partition in 0..partitions {
        list.add_partition(topic, partition);
    }
    let committed = consumer.committed_offsets(list, TIMEOUT)?;
    for (partition, end) in (0..partitions).zip(&before) {
        let offset = match committed.find_partition(topic, partition).map(|e| e.offset()) {
            Some(Offset::Offset(offset)) => offset,
            _ => 0,
        };
        if offset < *end {
            bail!(
                "refused: the writers' group {group_id} has not applied partition {partition} of {topic} \
                 (committed {offset}, end {end}); stop the gateways, wait until the writers catch up, try again"
            );
        }
    }
    let started = Instant::now();
    while started.elapsed() < quiet {
        std::thread::sleep(Duration::from_millis(200));
        if ends(consumer)? != before {
            bail!("refused: {topic} is still being written to; stop the gateways (or make them refuse writes) first");
        }
    }
    Ok(before)
}
