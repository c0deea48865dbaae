//! `bench-apply`: the `direct_apply` baseline of `deploy/bench.sh`. The writer's own apply code
//! ([`store::Database::apply_run`], from the writer's library) called on prepared batches, with
//! no HTTP and no Kafka, so that the end-to-end throughput can be compared with what the apply
//! stage alone does on the same machine. Its flags are the writer's database and durability
//! settings, and the three below; it prints one JSON object.
//!
//! The input file has one line per batch: a JSON array of the batch's chunks (request messages
//! as the gateway would produce them, validated and hashed). A line is applied as one
//! `apply_run` call (one transaction; a batch's chunks are one workspace's), timed from the call to its commit. The file is read
//! once; when the run outlasts it, the batches go round again with fresh message ids, external
//! ids and parent links (a suffix per round), so that every round writes new conversions.

use clap::Parser;
use intake_common::config::{init_logging, DatabaseArgs, LogArgs};
use intake_model::conversion::{Conversion, ExternalId};
use intake_model::message::WriteRequestV1;
use intake_writer::durability::DurabilityArgs;
use intake_writer::store::{self, Database};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// See the workspace Cargo.toml: the writer runs with this allocator, and so does its apply here.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "bench-apply",
    about = "The direct_apply baseline of deploy/bench.sh: the writer's apply path on prepared batches, without HTTP or Kafka"
)]
struct Cli {
    /// One batch a line: a JSON array of its request messages.
    #[arg(long)]
    from: std::path::PathBuf,
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    #[arg(long, default_value_t = 1)]
    concurrency: usize,
    #[command(flatten)]
    database: DatabaseArgs,
    #[command(flatten)]
    durability: DurabilityArgs,
    #[command(flatten)]
    log: LogArgs,
}

#[tokio::main]
async fn main() {
    let Cli { from, seconds, concurrency, database, durability, log } = Cli::parse();
    let log = init_logging(&log);
    let outcome = async {
        let pool = store::connect(&database.url, u32::try_from(concurrency).unwrap_or(1).max(1)).await?;
        let db = Database::for_command(pool, &durability);
        apply_batches(&db, &Settings { from, duration: Duration::from_secs(seconds), concurrency }).await
    }
    .await;
    drop(log);
    match outcome {
        Ok(output) => println!("{output}"),
        Err(error) => {
            eprintln!("bench-apply: {error:#}");
            std::process::exit(1)
        }
    }
}

pub struct Settings {
    pub from: std::path::PathBuf,
    pub duration: Duration,
    /// Batches applied at the same time (one writer applies one group at a time: 1).
    pub concurrency: usize,
}

/// Applies batches until the duration is over; prints `{"batches", "items", "seconds",
/// "latencies_us"}` with the time of each batch's transaction.
pub async fn apply_batches(db: &Database, settings: &Settings) -> anyhow::Result<Value> {
    let text = std::fs::read_to_string(&settings.from)?;
    let batches: Vec<Vec<WriteRequestV1>> =
        text.lines().filter(|l| !l.trim().is_empty()).map(serde_json::from_str).collect::<Result<_, _>>()?;
    anyhow::ensure!(!batches.is_empty(), "{} holds no batch", settings.from.display());
    let batches = Arc::new(batches);
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let deadline = started + settings.duration;
    let tasks: Vec<_> = (0..settings.concurrency.max(1))
        .map(|_| {
            let (db, batches, next) = (db.clone(), batches.clone(), next.clone());
            tokio::spawn(async move {
                let mut latencies_us = Vec::new();
                let mut items = 0usize;
                while Instant::now() < deadline {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let batch = in_round(&batches[n % batches.len()], n / batches.len());
                    let requests: Vec<&WriteRequestV1> = batch.iter().collect();
                    let applying = Instant::now();
                    let workspace_id = requests.first().map(|r| r.workspace_id.as_str()).unwrap_or_default();
                    db.apply_run(workspace_id, &requests, store::Lock::Wait).await?;
                    latencies_us.push(u64::try_from(applying.elapsed().as_micros()).unwrap_or(u64::MAX));
                    items += batch.iter().map(|r| r.items.len()).sum::<usize>();
                }
                Ok::<_, sqlx::Error>((latencies_us, items))
            })
        })
        .collect();
    let (mut latencies_us, mut items) = (Vec::new(), 0);
    for task in tasks {
        let (own, own_items) = task.await??;
        latencies_us.extend(own);
        items += own_items;
    }
    Ok(json!({
        "batches": latencies_us.len(),
        "items": items,
        "seconds": started.elapsed().as_secs_f64(),
        "latencies_us": latencies_us,
    }))
}

/// The batch as it is sent in round `round`: round 0 as read, later rounds with every id suffixed.
fn in_round(batch: &[WriteRequestV1], round: usize) -> Vec<WriteRequestV1> {
    if round == 0 {
        return batch.to_vec();
    }
    let suffix = format!("-r{round}");
    let renamed = |id: &ExternalId| -> ExternalId {
        // ExternalId is built only by validation; its serde form is the plain string.
        serde_json::from_value(Value::String(format!("{}{suffix}", id.as_str()))).unwrap_or_else(|_| id.clone())
    };
    batch
        .iter()
        .map(|request| WriteRequestV1 {
            correlation_id: format!("{}{suffix}", request.correlation_id),
            items: request
                .items
                .iter()
                .map(|item| Conversion {
                    external_id: renamed(&item.external_id),
                    parent_external_id: item.parent_external_id.as_ref().map(renamed),
                    ..item.clone()
                })
                .collect(),
            ..request.clone()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: &str, items: &[Value]) -> WriteRequestV1 {
        let items = items
            .iter()
            .map(|i| {
                intake_model::validate::validate_conversion(&i.into(), intake_common::config::now_ms())
                    .map(|v| v.conversion)
            })
            .collect::<Result<Vec<_>, _>>()
            .unwrap_or_default();
        WriteRequestV1 {
            correlation_id: id.into(),
            reply_partition: 0,
            deadline_ms: 0,
            received_at_ms: 0,
            workspace_id: "ws".into(),
            items,
            request: None,
            position: None,
        }
    }

    #[test]
    fn later_rounds_rename_every_id_and_link_alike() {
        let batch = vec![request(
            "m1",
            &[
                json!({"event": "lead", "external_id": "a", "occurred_at": 1_700_000_000_000_i64}),
                json!({"event": "purchase", "external_id": "b", "parent_external_id": "a", "occurred_at": 1_700_000_000_000_i64}),
            ],
        )];
        assert_eq!(in_round(&batch, 0), batch);
        let again = in_round(&batch, 2);
        assert_eq!(again[0].correlation_id, "m1-r2");
        assert_eq!(again[0].items[0].external_id.as_str(), "a-r2");
        assert_eq!(again[0].items[1].external_id.as_str(), "b-r2");
        assert_eq!(again[0].items[1].parent_external_id.as_ref().map(|p| p.as_str()), Some("a-r2"));
        assert_eq!(again[0].items[1].event, batch[0].items[1].event);
    }
}
