//! `intake-writer migrate`.

use crate::durability::{Durability, DurabilityArgs, DurabilityCounters};
use crate::{migrations, store};
use intake_common::config::{DatabaseArgs, KafkaArgs};
use serde_json::{json, Value};

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
    /// Also applies those: once no binary of the previous version runs, and on a new
    /// database. Refused while a member of the writers' consumer group runs a build older
    /// than one of them (its Kafka client.id names the newest migration it knows), and
    /// when Kafka does not answer.
    #[arg(long)]
    pub contract: bool,
    /// Applies none past this version: a rollout staged one migration at a time, or a
    /// database brought to an earlier version's schema.
    #[arg(long, value_name = "VERSION")]
    pub through: Option<i64>,
    /// The writers' consumer group, whose members --contract checks.
    #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
    pub group_id: String,
    /// --contract without asking Kafka which writers run: only for a database no writer
    /// reads Kafka for (a benchmark's, a copy).
    #[arg(long, requires = "contract")]
    pub skip_writer_check: bool,
    #[command(flatten)]
    pub kafka: KafkaArgs,
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { database, durability, contract, through, group_id, skip_writer_check, kafka } = args;
    let pool = store::connect(&database.url, 1).await?;
    if contract && !skip_writer_check {
        migrations::refuse_older_writers(&pool, &kafka, &group_id, through).await?;
    }
    let stage = if contract { migrations::Stage::Contract } else { migrations::Stage::Expand };
    let waiting = migrations::run(&pool, stage, through).await?;
    let durability =
        Durability::new(pool.connect_options().as_ref().clone(), &durability, DurabilityCounters::default());
    durability.confirm(&mut *pool.acquire().await?).await?;
    Ok(json!({ "migrated": true, "waiting_for_contract": waiting }))
}
