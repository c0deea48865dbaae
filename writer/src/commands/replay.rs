//! `intake-writer replay`.

use crate::durability::DurabilityArgs;
use crate::replay;
use crate::store::{self, Database};
use intake_common::config::{DatabaseArgs, KafkaArgs};
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long, requires = "from_offset", conflicts_with = "from_time")]
    pub partition: Option<i32>,
    #[arg(long, requires = "partition")]
    pub from_offset: Option<i64>,
    /// Last offset to replay (inclusive); default: the current end.
    #[arg(long, requires = "from_offset")]
    pub to_offset: Option<i64>,
    /// RFC 3339 time; every partition from its first message at or after it.
    #[arg(long, required_unless_present = "partition")]
    pub from_time: Option<String>,
    /// Topic to read; e.g. the dead-letter topic once a failure's cause is fixed.
    #[arg(long)]
    pub topic: Option<String>,
    /// Says what would be applied, and changes nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Replays although the topic no longer holds the start asked for (its retention
    /// deleted the oldest messages): what was written in the gap is lost to the replay, and
    /// the summary and the log say how much.
    #[arg(long)]
    pub accept_loss: bool,
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { partition, from_offset, to_offset, from_time, topic, dry_run, accept_loss, kafka, database, durability } =
        args;
    let pool = store::connect_with(&database.url, 2, store::OPERATOR_TIMEOUTS).await?;
    let db = Database::for_command(pool, &durability);
    let start = match (partition, from_offset, from_time) {
        (Some(partition), Some(from), _) => replay::Start::Offsets { partition, from, to: to_offset },
        (_, _, Some(time)) => {
            let at = time::OffsetDateTime::parse(&time, &time::format_description::well_known::Rfc3339)
                .map_err(|e| anyhow::anyhow!("--from-time: {e}"))?;
            replay::Start::Time { from_ms: i64::try_from(at.unix_timestamp_nanos() / 1_000_000)? }
        }
        _ => anyhow::bail!("give --partition with --from-offset, or --from-time"),
    };
    let topic = topic.unwrap_or_else(|| kafka.requests_topic.clone());
    let newer = if topic == kafka.dlq_topic { replay::Newer::Keep } else { replay::Newer::Overwrite };
    replay::replay(&db, &kafka, &topic, start, replay::Options { newer, dry_run, accept_loss }).await
}
