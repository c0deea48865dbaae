//! `intake-writer dlq`.

use crate::dlq;
use intake_common::config::KafkaArgs;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: DlqCommand,
    #[command(flatten)]
    pub kafka: KafkaArgs,
}

#[derive(clap::Subcommand)]
pub enum DlqCommand {
    /// Prints {"topic", "total", "messages": [{partition, offset, reason, error, source_topic,
    /// source_partition, source_offset, attempts, age_seconds, workspace_id, items}]}; never the items.
    Inspect {
        /// Messages printed at most.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
}

pub fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { command: DlqCommand::Inspect { limit }, kafka } = args;
    tokio::task::block_in_place(|| dlq::inspect(&kafka, limit))
}
