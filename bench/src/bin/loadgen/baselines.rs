//! The two baselines measured in the same run:
//!
//! - `direct_apply`: the writer's own apply code (`bench-apply`, which links the writer's
//!   library, `bench/src/bin/bench-apply.rs`) on the 500-item batches of `batch_ingest`, validated and hashed as
//!   the gateway does and split into chunks of 100; no HTTP, no Kafka. One batch per
//!   transaction, one batch at a time (one writer applies one group at a time).
//! - `pg_upsert`: pgbench upserting 100 generated rows per transaction into a copy of the
//!   `conversions` table (same columns and indexes, no foreign keys), 2 clients: the ceiling of
//!   the write stage on this machine.
//! - `pg_upsert_v1`: the same upsert into a table of the shape `conversions` had before its
//!   indexes were made lean (migrations 0001 to 0006): a fixed yardstick, which a leaner shape
//!   beats instead of moving with it.

use crate::bodies::{Generator, BATCH_ITEMS};
use crate::machine::Roles;
use crate::measure::{Measured, Recorder};
use intake_model::message::{WriteRequestV1, MAX_CHUNK_ITEMS};
use intake_model::validate::Json;
use intake_tests::serde_json::{self, Value};
use intake_tests::{Stack, TestKey};
use std::path::Path;
use std::time::Duration;

/// Writes `batches` batches of `batch_ingest`'s shape, as the writer receives them, one batch a
/// line; returns the file.
fn prepare_batches(keys: &[TestKey], batches: usize, dir: &Path) -> anyhow::Result<std::path::PathBuf> {
    let generator = Generator::new("direct");
    let now = intake_tests::now_ms();
    let mut text = String::new();
    for b in 0..batches {
        let body = generator.batch((b * BATCH_ITEMS) as u64, BATCH_ITEMS);
        let items =
            intake_model::validate::validate_batch(&Json::parse(&body)?, now).map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let conversions = items
            .into_iter()
            .map(|item| item.map(|v| v.conversion))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("generated item refused: {e:?}"))?;
        let workspace_id = &keys[b % keys.len()].workspace_id;
        let chunks: Vec<WriteRequestV1> = conversions
            .chunks(MAX_CHUNK_ITEMS)
            .enumerate()
            .map(|(c, items)| WriteRequestV1 {
                correlation_id: format!("bench-direct-{}-{b}-{c}", ulid::Ulid::new()),
                reply_partition: 0,
                deadline_ms: now + 60_000,
                received_at_ms: now,
                workspace_id: workspace_id.clone(),
                items: items.to_vec(),
                request: None,
                position: None,
            })
            .collect();
        text.push_str(&serde_json::to_string(&chunks)?);
        text.push('\n');
    }
    let path = dir.join("direct_apply_batches.jsonl");
    std::fs::write(&path, text)?;
    Ok(path)
}

#[derive(serde::Deserialize)]
struct BenchApplyOutput {
    items: u64,
    seconds: f64,
    latencies_us: Vec<u64>,
}

/// Returns the measurement and the cores used meanwhile (the applying process as "writer").
pub async fn direct_apply(
    stack: &Stack,
    keys: &[TestKey],
    roles: &Roles,
    duration: Duration,
    concurrency: usize,
    batches: usize,
    dir: &Path,
) -> anyhow::Result<(Measured, Value)> {
    let file = prepare_batches(keys, batches, dir)?;
    // The stack's writers' settings (database, topics), given to the apply program instead.
    let mut command = std::process::Command::new(Path::new(&intake_tests::env("INTAKE_BIN_DIR")).join("bench-apply"));
    stack.child_env(&mut command);
    let mut command = tokio::process::Command::from(command);
    command
        .arg("--from")
        .arg(&file)
        .args(["--seconds", &duration.as_secs().to_string(), "--concurrency", &concurrency.to_string()])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let child = command.spawn()?;
    let roles = Roles { writers: child.id().into_iter().collect(), ..roles.clone() };
    let cores = tokio::spawn(roles.cores_during(duration));
    let output = child.wait_with_output().await?;
    let _ = std::fs::remove_file(&file);
    anyhow::ensure!(output.status.success(), "bench-apply: {}", String::from_utf8_lossy(&output.stderr));
    let applied: BenchApplyOutput = serde_json::from_slice(&output.stdout)?;
    let mut recorder = Recorder::new();
    let per_batch = applied.items / (applied.latencies_us.len().max(1) as u64);
    for micros in &applied.latencies_us {
        recorder.record(Duration::from_micros(*micros), Ok(per_batch));
    }
    recorder.items = applied.items;
    let measured = Measured {
        recorder,
        elapsed: Duration::from_secs_f64(applied.seconds),
        concurrency: format!("{concurrency} applying at a time, 1 batch (5 chunks) per transaction"),
    };
    Ok((measured, cores.await.unwrap_or_default()))
}

const PG_UPSERT_TABLE: &str = "bench_pg_upsert";

/// A pgbench script of 100 new rows a transaction (the insert path, as in batch_ingest), each as
/// wide as a conversion with every identifier, one in three linked to the row before, into
/// `$table` in workspaces `$ws` 0 to 49: with the chain rows the foreign key needs when `chains`
/// is given, as the writer inserts them. Its digests are the columns `email_$digest` and so on,
/// each `$open` 64 hex characters `$close`; it ends as the writer's insert does, or as the old
/// shape's with `old_shape KEY`.
macro_rules! upsert_script {
    ($table:literal, $ws:literal, $chains:expr, $digest:literal, $open:literal, $close:literal, $($conflict:tt)*) => {
        concat!(
            "\\set w random(0, 49)
WITH generated AS (SELECT g, gen_random_uuid()::text AS u FROM generate_series(1, 100) AS g)",
            $chains,
            "
INSERT INTO ", $table, " AS conversions (id, workspace_id, event, external_id, chain_id, parent_external_id, occurred_at,
    visitor_id, click_id, contact_id, email_", $digest, ", phone_", $digest, ", address_", $digest, ",
    country, value, currency, tags)
SELECT 'cnv_' || u, ", $ws, ", CASE WHEN g % 3 = 1 THEN 'purchase' ELSE 'lead' END, u, 'chn_' || u,
       CASE WHEN g % 3 = 1 THEN lag(u) OVER (ORDER BY g) END, now() - interval '1 minute',
       'v' || left(md5(u), 15), left(md5(u || 'c'), 12), 'contact-' || u,
       ", $open, "md5(u || 'e') || md5(u || 'E')", $close, ", ", $open, "md5(u || 'p') || md5(u || 'P')", $close, ",
       ", $open, "md5(u || 'a') || md5(u || 'A')", $close, ", 'US', 129.90, 'USD', '{\"plan\": \"pro\"}'
  FROM generated
",
            intake_model::conversions_on_conflict!($($conflict)*),
            ";\n"
        )
    };
}

const PG_UPSERT_SCRIPT: &str =
    upsert_script!("bench_pg_upsert", "'ws_bench_' || :w", "", "digest", "decode(", ", 'hex')",);

/// The same rows into the old shape's table (`v1_table`): digests as hex text, the unique key
/// on the workspace id.
const PG_UPSERT_V1_SCRIPT: &str = upsert_script!(
    "bench_pg_upsert_v1", "'ws_bench_' || :w", "", "sha256", "", "",
    old_shape "(workspace_id, event, external_id)"
);

/// The chains of a preloaded run's rows, inserted beside them.
macro_rules! preloaded_chains {
    () => {
        ",
     chains AS (INSERT INTO chains (id, workspace_id) SELECT 'chn_' || u, 'ws_pgu_' || :w FROM generated)"
    };
}

pub const PG_UPSERT_ROWS: u64 = 100;

/// The table of the fixed yardstick at size, beside `conversions` in the preloaded database.
pub const V1_TABLE: &str = "bench_conversions_v1";

/// `conversions` as migrations 0001 to 0006 left it, without its foreign keys: nine indexes, the
/// unique key (workspace, event, external_id), identifiers and digests indexed as text after the
/// workspace id.
pub fn v1_table(name: &str) -> String {
    format!(
        "CREATE TABLE {name} (
            id text PRIMARY KEY, workspace_id text NOT NULL, event text NOT NULL, external_id text NOT NULL,
            parent_external_id text, chain_id text NOT NULL, occurred_at timestamptz NOT NULL,
            visitor_id text, click_id text, contact_id text, email_sha256 text, phone_sha256 text,
            address_sha256 text, country text, value numeric, currency text, hdyhau text, tags jsonb,
            created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now(),
            UNIQUE (workspace_id, event, external_id));
         CREATE INDEX {name}_by_external_id ON {name} (workspace_id, external_id);
         CREATE INDEX {name}_by_parent ON {name} (workspace_id, parent_external_id) WHERE parent_external_id IS NOT NULL;
         CREATE INDEX {name}_by_chain ON {name} (workspace_id, chain_id);
         CREATE INDEX {name}_by_email ON {name} (workspace_id, email_sha256) WHERE email_sha256 IS NOT NULL;
         CREATE INDEX {name}_by_phone ON {name} (workspace_id, phone_sha256) WHERE phone_sha256 IS NOT NULL;
         CREATE INDEX {name}_by_contact ON {name} (workspace_id, contact_id) WHERE contact_id IS NOT NULL;
         CREATE INDEX {name}_by_visitor ON {name} (workspace_id, left(visitor_id, 16)) WHERE visitor_id IS NOT NULL;"
    )
}

/// pg_upsert into a table of the old shape, empty at the start.
pub async fn pg_upsert_v1(
    db: &sqlx::PgPool,
    database_url: &str,
    roles: &Roles,
    duration: Duration,
    clients: usize,
    dir: &Path,
) -> anyhow::Result<(Measured, Value)> {
    let table = format!("{PG_UPSERT_TABLE}_v1");
    sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}")).execute(db).await?;
    sqlx::raw_sql(&v1_table(&table)).execute(db).await?;
    let measured = pgbench(database_url, PG_UPSERT_V1_SCRIPT, roles, duration, clients, dir).await;
    sqlx::raw_sql(&format!("DROP TABLE IF EXISTS {table}")).execute(db).await?;
    measured
}

pub async fn pg_upsert(
    db: &sqlx::PgPool,
    database_url: &str,
    roles: &Roles,
    duration: Duration,
    clients: usize,
    dir: &Path,
) -> anyhow::Result<(Measured, Value)> {
    // LIKE copies columns, defaults, NOT NULL, the primary key, the unique constraint and the
    // indexes; never foreign keys.
    sqlx::query(&format!("DROP TABLE IF EXISTS {PG_UPSERT_TABLE}")).execute(db).await?;
    sqlx::query(&format!("CREATE TABLE {PG_UPSERT_TABLE} (LIKE conversions INCLUDING ALL)")).execute(db).await?;
    let measured = pgbench(database_url, PG_UPSERT_SCRIPT, roles, duration, clients, dir).await;
    sqlx::query(&format!("DROP TABLE IF EXISTS {PG_UPSERT_TABLE}")).execute(db).await?;
    measured
}

/// The same upsert at size: into the preloaded `conversions` itself (its indexes as deep as the
/// data), on workspaces of its own (`ws_pgu_*`, see sized.rs).
const PG_UPSERT_PRELOADED_SCRIPT: &str =
    upsert_script!("conversions", "'ws_pgu_' || :w", preloaded_chains!(), "digest", "decode(", ", 'hex')",);

/// The same into the preloaded table of the old shape ([`V1_TABLE`]), as deep as `conversions`.
const PG_UPSERT_V1_PRELOADED_SCRIPT: &str = upsert_script!(
    "bench_conversions_v1", "'ws_pgu_' || :w", preloaded_chains!(), "sha256", "", "",
    old_shape "(workspace_id, event, external_id)"
);

pub async fn pg_upsert_into_preloaded(
    database_url: &str,
    roles: &Roles,
    duration: Duration,
    clients: usize,
    dir: &Path,
) -> anyhow::Result<(Measured, Value)> {
    pgbench(database_url, PG_UPSERT_PRELOADED_SCRIPT, roles, duration, clients, dir).await
}

/// pg_upsert_v1 at size: into [`V1_TABLE`], as deep as `conversions`.
pub async fn pg_upsert_v1_into_preloaded(
    database_url: &str,
    roles: &Roles,
    duration: Duration,
    clients: usize,
    dir: &Path,
) -> anyhow::Result<(Measured, Value)> {
    pgbench(database_url, PG_UPSERT_V1_PRELOADED_SCRIPT, roles, duration, clients, dir).await
}

async fn pgbench(
    database_url: &str,
    script_text: &str,
    roles: &Roles,
    duration: Duration,
    clients: usize,
    dir: &Path,
) -> anyhow::Result<(Measured, Value)> {
    let logs = dir.join("pgbench");
    let _ = std::fs::remove_dir_all(&logs);
    std::fs::create_dir_all(&logs)?;
    let script = logs.join("upsert.sql");
    std::fs::write(&script, script_text)?;
    let cores = tokio::spawn(roles.clone().cores_during(duration));
    let output = tokio::process::Command::new("pgbench")
        .args(["--no-vacuum", "--client", &clients.to_string(), "--jobs", &clients.to_string()])
        .args(["--time", &duration.as_secs().to_string(), "--log", "--log-prefix"])
        .arg(logs.join("tx"))
        .arg("--file")
        .arg(&script)
        .arg(database_url)
        .stdin(std::process::Stdio::null())
        .output()
        .await?;
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    anyhow::ensure!(output.status.success(), "pgbench: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    let failed: u64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("number of failed transactions: "))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);

    // One line per transaction: client, transaction number, latency in µs, script, epoch s, µs.
    let mut recorder = Recorder::new();
    for entry in std::fs::read_dir(&logs)?.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("tx")) {
        for line in std::fs::read_to_string(entry.path())?.lines() {
            if let Some(micros) = line.split_whitespace().nth(2).and_then(|v| v.parse::<u64>().ok()) {
                recorder.record(Duration::from_micros(micros), Ok(PG_UPSERT_ROWS));
            }
        }
    }
    recorder.errors = failed;
    let _ = std::fs::remove_dir_all(&logs);
    let measured = Measured {
        recorder,
        elapsed: duration,
        concurrency: format!("{clients} pgbench clients, {PG_UPSERT_ROWS} rows per transaction"),
    };
    Ok((measured, cores.await.unwrap_or_default()))
}
