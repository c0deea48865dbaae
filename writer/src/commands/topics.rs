//! `intake-writer topics`.

use crate::{partitions, topics};
use intake_common::config::KafkaArgs;
use serde_json::Value;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// The writers' consumer group, whose progress a growth of the requests topic checks.
    #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
    pub group_id: String,
    /// How long the requests topic must stay unwritten before it is grown.
    #[arg(long, default_value_t = 5_000)]
    pub quiet_ms: u64,
    #[arg(long, env = "INTAKE_REQUEST_PARTITIONS", default_value_t = 8)]
    pub request_partitions: i32,
    /// One per gateway instance.
    #[arg(long, env = "INTAKE_REPLY_PARTITIONS", default_value_t = 8)]
    pub reply_partitions: i32,
    #[arg(long, env = "INTAKE_TOPIC_REPLICATION", default_value_t = 1)]
    pub replication: i32,
    /// Default: 2 at replication 3 or more, else 1.
    #[arg(long, env = "INTAKE_TOPIC_MIN_INSYNC_REPLICAS")]
    pub min_insync_replicas: Option<i32>,
    /// Of the requests and replies topics; also how long the writer remembers applied
    /// message ids (this plus the segment length and --retention-margin-ms).
    #[arg(long, env = "INTAKE_TOPIC_RETENTION_MS", default_value_t = 86_400_000, value_parser = clap::value_parser!(i64).range(10_000..))]
    pub retention_ms: i64,
    /// Of the dead-letter topic (default 14 days).
    #[arg(long, env = "INTAKE_DLQ_RETENTION_MS", default_value_t = 1_209_600_000, value_parser = clap::value_parser!(i64).range(10_000..))]
    pub dlq_retention_ms: i64,
    /// Also lowers the retention of a topic that has a longer one (raised by an operator,
    /// during an incident): without it, a longer retention is kept and reported.
    #[arg(long)]
    pub lower_retention: bool,
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args {
        kafka,
        group_id,
        quiet_ms,
        request_partitions,
        reply_partitions,
        replication,
        min_insync_replicas,
        retention_ms,
        dlq_retention_ms,
        lower_retention,
    } = args;
    let counts = topics::TopicCounts {
        request_partitions,
        reply_partitions,
        replication,
        min_insync_replicas,
        retention_ms,
        dlq_retention_ms,
    };
    let mut output = topics::create_topics(&kafka, &counts, lower_retention).await?;
    let growth = partitions::Growth {
        kafka: &kafka,
        group_id: &group_id,
        partitions: request_partitions,
        quiet: Duration::from_millis(quiet_ms),
    };
    if let Some(grown) = partitions::grow_requests_topic(growth).await? {
        output["grown"] = grown;
    }
    Ok(output)
}
