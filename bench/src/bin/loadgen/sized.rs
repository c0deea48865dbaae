//! The runs at size: a database of their own preloaded to each of the sizes asked for
//! (INTAKE_BENCH_SIZES, stored conversions, in increasing order: the data grows in place), then
//! at each size `batch_ingest` and `pg_upsert` in turns, `single_200rps` and `direct_apply` on it, and the
//! erasure of one person in the largest workspace with the write latency of that workspace
//! meanwhile.
//!
//! The data looks like a year of it: 1,000 workspaces of Zipf-distributed sizes (the largest
//! holds 13 % of all rows), one conversion in three a purchase whose parent is the lead before
//! it (same chain), about one visit per conversion, on the visitor id (and click id, contact id)
//! of its conversion. It is loaded with COPY, foreign-key triggers off, and the secondary indexes
//! of `conversions` and `visits` dropped before and built once after (faster than maintaining
//! them row by row); then VACUUM (FREEZE, ANALYZE) and a CHECKPOINT, as a year's tables would
//! stand. The traffic goes to these workspaces in proportion to their size, the largest
//! included; `pg_upsert` upserts into the same `conversions` on 50 workspaces of its own. Before
//! each load the free disk of PostgreSQL's data directory is checked.

use crate::baselines;
use crate::capped::Cluster;
use crate::machine::Roles;
use crate::measure::{closed_loop, open_loop, round1, round2, Counted, Measured};
use crate::{start_stack_on, Plans, Scenario};
use intake_tests::serde_json::{json, Value};
use intake_tests::{Stack, TestKey};
use sqlx::postgres::PgPoolOptions;
use sqlx::{Connection, PgConnection, PgPool};
use std::fmt::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const WORKSPACES: usize = 1_000;
/// Workspaces of pg_upsert, apart from the traffic's.
pub const UPSERT_WORKSPACES: usize = 50;
/// Bytes on disk per stored conversion with its visit, chains, its row in the old shape's table
/// and every index: 16.8 GiB at 10 M, about 1.8 kB.
const BYTES_PER_CONVERSION: u64 = 1_800;

/// "1m", "10m", "50k", "0".
pub fn label(size: u64) -> String {
    match size {
        s if s >= 1_000_000 && s % 1_000_000 == 0 => format!("{}m", s / 1_000_000),
        s if s >= 1_000 && s % 1_000 == 0 => format!("{}k", s / 1_000),
        s => s.to_string(),
    }
}

/// The rows of workspace i of `WORKSPACES`, for `total` rows in all: in proportion to 1 / (i + 1).
fn shares(total: u64) -> Vec<u64> {
    let harmonic: f64 = (1..=WORKSPACES).map(|i| 1.0 / i as f64).sum();
    let mut counts: Vec<u64> =
        (0..WORKSPACES).map(|i| (total as f64 / ((i + 1) as f64 * harmonic)).floor() as u64).collect();
    let short = total - counts.iter().sum::<u64>();
    counts[0] += short;
    counts
}

/// A hex string of `len` characters, a pure function of its inputs (splitmix64).
fn hex(seed: u64, salt: u64, len: usize) -> String {
    let mut out = String::with_capacity(len);
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ salt;
    while out.len() < len {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let _ = write!(out, "{:016x}", z ^ (z >> 31));
    }
    out.truncate(len);
    out
}

fn keys_index(workspace_id: &str) -> u64 {
    workspace_id.trim_start_matches("ws_sized_").parse().unwrap_or(0)
}

pub fn workspace_id(i: usize) -> String {
    format!("ws_sized_{i:04}")
}

/// The preloaded database: its pool, and one key per workspace, weighted: workspace i appears in
/// `keys` about in proportion to its size (at least once), so that traffic spread evenly over
/// `keys` goes to the workspaces as their data does.
pub struct Preloaded {
    pub url: String,
    pub db: PgPool,
    pub keys: Vec<TestKey>,
    /// Conversions per workspace, as loaded so far.
    pub loaded: Vec<u64>,
    /// The servers on this disk that each hold a copy of what is loaded (the HA layout's nodes).
    copies: u64,
}

impl Preloaded {
    /// A fresh database `name` with the schema, the workspaces and their keys, on a server
    /// whose data `copies` servers on this disk hold.
    pub async fn create(
        admin: &PgPool,
        server: &str,
        name: &str,
        bin_dir: &str,
        copies: u64,
    ) -> anyhow::Result<Preloaded> {
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(admin).await?;
        sqlx::query(&format!("CREATE DATABASE {name}")).execute(admin).await?;
        let url = format!("{server}/{name}");
        let status = std::process::Command::new(format!("{bin_dir}/intake-writer"))
            .args(["migrate", "--contract"])
            .env("DATABASE_URL", &url)
            .stdout(std::process::Stdio::null())
            .status()?;
        anyhow::ensure!(status.success(), "intake-writer migrate failed on {name}");
        let db = PgPoolOptions::new().max_connections(4).connect(&url).await?;
        sqlx::raw_sql(&baselines::v1_table(baselines::V1_TABLE)).execute(&db).await?;
        let ids: Vec<String> = (0..WORKSPACES).map(workspace_id).collect();
        let upsert_ids: Vec<String> = (0..UPSERT_WORKSPACES).map(|w| format!("ws_pgu_{w}")).collect();
        sqlx::query(
            "INSERT INTO workspaces (id, name, project_id)
             SELECT id, id, 'bench' FROM unnest($1::text[] || $2::text[]) AS id",
        )
        .bind(&ids)
        .bind(&upsert_ids)
        .execute(&db)
        .await?;
        let secrets: Vec<String> =
            (0..WORKSPACES).map(|i| format!("svc_live_sized{i:04}{}", hex(i as u64, 7, 26))).collect();
        sqlx::query(
            "INSERT INTO api_keys (id, workspace_id, secret_sha256, scopes)
             SELECT 'key_' || ws, ws, sha256(convert_to(secret, 'UTF8')), '{workspace:read,conversions:write}'
               FROM unnest($1::text[], $2::text[]) AS k(ws, secret)",
        )
        .bind(&ids)
        .bind(&secrets)
        .execute(&db)
        .await?;
        let weights = shares(100 * WORKSPACES as u64);
        let mut keys = Vec::new();
        for (i, weight) in weights.iter().enumerate() {
            for _ in 0..(*weight / 100).max(1) {
                keys.push(TestKey {
                    workspace_id: ids[i].clone(),
                    key_id: format!("key_{}", ids[i]),
                    secret: secrets[i].clone(),
                });
            }
        }
        // Each workspace's entries spread over the list (a fixed shuffle), so that consecutive
        // requests go to different workspaces.
        keys.sort_by_cached_key(|k| hex(k.secret.len() as u64 ^ keys_index(&k.workspace_id), 9, 16));
        let mut counter = 0u64;
        let mut spread: Vec<(String, TestKey)> = keys
            .into_iter()
            .map(|k| {
                counter += 1;
                (hex(counter, 11, 16), k)
            })
            .collect();
        spread.sort_by(|a, b| a.0.cmp(&b.0));
        let spread: Vec<TestKey> = spread.into_iter().map(|(_, k)| k).collect();
        Ok(Preloaded { url, db, keys: spread, loaded: vec![0; WORKSPACES], copies })
    }

    /// Grows the data to `total` conversions (and as many visits).
    pub async fn grow_to(&mut self, total: u64) -> anyhow::Result<Value> {
        let target = shares(total);
        let rows: u64 = target.iter().zip(&self.loaded).map(|(t, l)| t.saturating_sub(*l)).sum();
        check_disk(&self.db, rows, self.copies).await?;
        let started = Instant::now();
        let mut conn = PgConnection::connect(&self.url).await?;
        // COPY into tables without their secondary indexes, foreign-key triggers off.
        sqlx::query("SET session_replication_role = replica").execute(&mut conn).await?;
        let indexes: Vec<(String, String)> = sqlx::query_as(
            "SELECT indexname::text, indexdef FROM pg_indexes
              WHERE schemaname = 'public' AND tablename IN ('conversions', 'visits', $1)
                AND indexname NOT IN (SELECT conname FROM pg_constraint)",
        )
        .bind(baselines::V1_TABLE)
        .fetch_all(&mut conn)
        .await?;
        for (name, _) in &indexes {
            sqlx::query(&format!("DROP INDEX {name}")).execute(&mut conn).await?;
        }
        let now_s = intake_tests::now_ms() / 1000;
        for (table, columns) in [
            ("chains", "id, workspace_id, created_at"),
            (
                "conversions",
                "id, workspace_id, event, external_id, parent_external_id, chain_id, occurred_at, visitor_id, click_id, \
                 contact_id, email_digest, phone_digest, country, value, currency, created_at",
            ),
            ("visits", "workspace_id, visitor_id, click_id, recipient_id, visited_at, page"),
            (
                baselines::V1_TABLE,
                "id, workspace_id, event, external_id, parent_external_id, chain_id, occurred_at, visitor_id, click_id, \
                 contact_id, email_sha256, phone_sha256, country, value, currency, created_at",
            ),
        ] {
            let mut copy = conn.copy_in_raw(&format!("COPY {table} ({columns}) FROM STDIN")).await?;
            let mut buffer = String::with_capacity(1 << 20);
            for (i, (&want, &have)) in target.iter().zip(&self.loaded).enumerate() {
                let ws = workspace_id(i);
                for j in have..want {
                    row(&mut buffer, table, &ws, i as u64, j, now_s);
                    if buffer.len() >= 1 << 20 {
                        copy.send(std::mem::take(&mut buffer).into_bytes()).await?;
                        buffer.reserve(1 << 20);
                    }
                }
            }
            if !buffer.is_empty() {
                copy.send(buffer.into_bytes()).await?;
            }
            copy.finish().await?;
        }
        let loaded_s = started.elapsed().as_secs_f64();
        for (_, definition) in &indexes {
            sqlx::query(definition).execute(&mut conn).await?;
        }
        let indexed_s = started.elapsed().as_secs_f64() - loaded_s;
        // A year-old table has long been vacuumed and frozen; a table just loaded has not, and
        // autovacuum would read all of it (minutes at 10 M) during the scenarios, which then
        // measure the load's aftermath instead of the size. So: vacuumed, frozen, analyzed, and
        // checkpointed (the load's dirty pages written before the clock runs).
        // One statement a query: several in one simple query are one transaction block, where
        // VACUUM cannot run.
        sqlx::raw_sql("VACUUM (FREEZE, ANALYZE)").execute(&mut conn).await?;
        sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await?;
        let vacuumed_s = started.elapsed().as_secs_f64() - loaded_s - indexed_s;
        conn.close().await?;
        self.loaded = target;
        let bytes: i64 = sqlx::query_scalar("SELECT pg_database_size(current_database())").fetch_one(&self.db).await?;
        Ok(json!({
            "conversions": total,
            "rows_added": rows,
            "largest_workspace": self.loaded[0],
            "copy_s": round1(loaded_s),
            "indexes_s": round1(indexed_s),
            "vacuum_s": round1(vacuumed_s),
            "total_s": round1(started.elapsed().as_secs_f64()),
            "database_gib": round2(bytes as f64 / (1u64 << 30) as f64),
        }))
    }
}

/// One COPY line (text format) of `table` for conversion `j` of workspace `i`.
fn row(out: &mut String, table: &str, ws: &str, i: u64, j: u64, now_s: i64) {
    let chain = if j % 3 == 2 { j - 1 } else { j };
    // Spread over the last year, oldest first: occurred and stored then, as a year of traffic.
    let at = now_s - 365 * 86_400 + i64::try_from((j * 7_919) % (365 * 86_400)).unwrap_or(0);
    let visitor = hex(i * 1_000_003 + j, 1, 16);
    match table {
        "chains" => {
            if j % 3 != 2 {
                let _ = writeln!(out, "chn_s{i}_{j}\t{ws}\t2025-01-01 00:00:00+00");
            }
        }
        "conversions" | baselines::V1_TABLE => {
            let (event, parent) =
                if j % 3 == 2 { ("purchase", format!("ext-{}", j - 1)) } else { ("lead", "\\N".to_owned()) };
            let click = if j.is_multiple_of(4) { hex(i * 31 + j, 2, 12) } else { "\\N".to_owned() };
            let contact = if j.is_multiple_of(5) { format!("contact-{i}-{j}") } else { "\\N".to_owned() };
            // Digests: bytes in `conversions` (bytea's hex input, its backslash escaped for
            // COPY), hex text in the old shape's table.
            let bytes = if table == "conversions" { "\\\\x" } else { "" };
            let phone =
                if j.is_multiple_of(2) { format!("{bytes}{}", hex(i * 17 + j, 4, 64)) } else { "\\N".to_owned() };
            let _ = writeln!(
                out,
                "cnv_s{i}_{j}\t{ws}\t{event}\text-{j}\t{parent}\tchn_s{i}_{chain}\t{at}\t{visitor}.1700000000\t{click}\t\
                 {contact}\t{bytes}{email}\t{phone}\tUS\t129.90\tUSD\t{at}",
                at = timestamp(at),
                email = hex(i * 13 + j, 3, 64),
            );
        }
        _ => {
            let click = if j.is_multiple_of(4) { hex(i * 31 + j, 2, 12) } else { "\\N".to_owned() };
            let recipient = if j.is_multiple_of(5) { format!("contact-{i}-{j}") } else { "\\N".to_owned() };
            let _ = writeln!(out, "{ws}\t{visitor}\t{click}\t{recipient}\t{}\t/pricing", timestamp(at - 3_600));
        }
    }
}

fn timestamp(epoch_s: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(epoch_s)
        .ok()
        .and_then(|t| t.format(&time::format_description::well_known::Rfc3339).ok())
        .unwrap_or_else(|| "2025-01-01T00:00:00Z".to_owned())
}

/// Refuses to load `rows` conversions when PostgreSQL's data directory has not room for them on
/// each of the `copies` servers that share its disk.
async fn check_disk(db: &PgPool, rows: u64, copies: u64) -> anyhow::Result<()> {
    let directory: String = sqlx::query_scalar("SELECT current_setting('data_directory')").fetch_one(db).await?;
    let output = std::process::Command::new("df").args(["--output=avail", "-B1", &directory]).output()?;
    let free: u64 =
        String::from_utf8_lossy(&output.stdout).lines().nth(1).and_then(|l| l.trim().parse().ok()).unwrap_or(0);
    let needed = rows * BYTES_PER_CONVERSION * copies;
    anyhow::ensure!(
        free > needed + (2 << 30),
        "{rows} conversions on {copies} server(s) need about {:.1} GiB and 2 GiB to spare; {directory} has {:.1} GiB free",
        needed as f64 / (1u64 << 30) as f64,
        free as f64 / (1u64 << 30) as f64
    );
    Ok(())
}

/// Erases one person (five conversions of the largest workspace with one email address, and
/// their visits) while two clients write to that workspace: the erasure's time, the lock it
/// held (its own log line), and the writes' latency meanwhile.
pub async fn erase_in_largest(stack: &Stack, preloaded: &Preloaded) -> anyhow::Result<Value> {
    let email = "erase.me@example.com";
    let hash = intake_model::normalize::email_hash(email).ok_or_else(|| anyhow::anyhow!("email hash"))?;
    let ws = workspace_id(0);
    let ids: Vec<String> = (0..5).map(|k| format!("cnv_s0_{}", 1 + k * (preloaded.loaded[0] / 5).max(1))).collect();
    sqlx::query("UPDATE conversions SET email_digest = decode($1, 'hex') WHERE id = ANY($2)")
        .bind(hash.as_str())
        .bind(&ids)
        .execute(&preloaded.db)
        .await?;
    let key = preloaded.keys.iter().find(|k| k.workspace_id == ws).cloned().ok_or_else(|| anyhow::anyhow!("no key"))?;
    let plans = Plans { keys: Arc::new(vec![key]) };
    let generator = Arc::new(crate::bodies::Generator::new("erase"));
    let targets = vec![stack.base_url.clone()];
    let plan = plans.single(generator);
    let writes = tokio::spawn(async move { closed_loop(&targets, 2, Duration::from_secs(4), plan).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = Instant::now();
    let mut command = tokio::process::Command::from(stack.writer_command());
    command
        .args(["erase", "--workspace", &ws, "--email"])
        .env("DATABASE_URL", &preloaded.url)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        use tokio::io::AsyncWriteExt;
        stdin.write_all(format!("{email}\n").as_bytes()).await?;
    }
    let output = child.wait_with_output().await?;
    let took = started.elapsed();
    let measured = writes.await?;
    anyhow::ensure!(output.status.success(), "erase: {}", String::from_utf8_lossy(&output.stderr));
    let erased: Value = intake_tests::serde_json::from_slice(&output.stdout)?;
    let log = String::from_utf8_lossy(&output.stderr);
    let number = |key: &str| {
        log.split(&format!("{key}="))
            .nth(1)
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let writes = measured.to_json(Counted::Requests);
    Ok(json!({
        "workspace_conversions": preloaded.loaded[0],
        "erased": erased,
        "erase_command_ms": round1(took.as_secs_f64() * 1000.0),
        "lock_wait_ms": number("lock_wait_ms"),
        "lock_held_ms": number("lock_held_ms"),
        "same_workspace_writes_meanwhile": {
            "p50_ms": writes["p50_ms"], "p99_ms": writes["p99_ms"], "max_ms": writes["max_ms"], "errors": writes["errors"],
        },
    }))
}

/// What a scenario under a memory budget read and held: the group's memory meanwhile, and the
/// reads of PostgreSQL and of the disk.
struct Proof<'a> {
    cluster: &'a Cluster,
    db: &'a PgPool,
    sampler: crate::capped::Sampler,
    io: crate::capped::Io,
    started: Instant,
}

impl<'a> Proof<'a> {
    async fn start(cluster: Option<&'a Cluster>, db: &'a PgPool) -> anyhow::Result<Option<Proof<'a>>> {
        let Some(cluster) = cluster else { return Ok(None) };
        let io = crate::capped::io(db, &cluster.data_dir()).await?;
        Ok(Some(Proof {
            cluster,
            db,
            sampler: crate::capped::Sampler::start(&cluster.group),
            io,
            started: Instant::now(),
        }))
    }

    async fn finish(proof: Option<Proof<'a>>) -> anyhow::Result<Value> {
        let Some(proof) = proof else { return Ok(Value::Null) };
        let seconds = proof.started.elapsed().as_secs_f64();
        let io = proof.io.until(&crate::capped::io(proof.db, &proof.cluster.data_dir()).await?, seconds);
        Ok(json!({ "memory": proof.sampler.finish(&proof.cluster.group).await, "reads": io }))
    }
}

/// Where the scenarios at a size run.
#[derive(Clone, Copy)]
pub enum Setting<'a> {
    /// The single node as it is.
    Uncapped,
    /// The single node's cluster under its memory budget: the scenarios' names end in
    /// `_capped`, and each says what it read and held.
    Capped(&'a Cluster),
    /// The HA layout (ha.rs): the names end in `_ha`, and the standbys' servers (their URLs)
    /// are checkpointed whenever the primary is settled.
    Ha { standbys: &'a [String] },
}

impl<'a> Setting<'a> {
    fn suffix(self) -> &'static str {
        match self {
            Setting::Uncapped => "",
            Setting::Capped(_) => "_capped",
            Setting::Ha { .. } => "_ha",
        }
    }

    fn cluster(self) -> Option<&'a Cluster> {
        match self {
            Setting::Capped(cluster) => Some(cluster),
            _ => None,
        }
    }

    fn standbys(self) -> &'a [String] {
        match self {
            Setting::Ha { standbys } => standbys,
            _ => &[],
        }
    }
}

/// Every scenario at one size, on a stack of its own over the preloaded database, in `setting`.
/// Returns the scenarios, and the erasure, the WAL written per item and what the capped
/// scenarios read.
pub async fn scenarios_at(
    config: &crate::Config,
    preloaded: &Preloaded,
    infrastructure: &Roles,
    size: u64,
    setting: Setting<'_>,
) -> anyhow::Result<(Vec<(&'static str, Scenario)>, Value)> {
    let suffix = setting.suffix();
    let capped = setting.cluster();
    let name =
        |scenario: &str| -> &'static str { Box::leak(format!("{scenario}_{}{suffix}", label(size)).into_boxed_str()) };
    let tag = format!("{}{}", label(size), suffix.replace('_', ", "));
    let duration = Duration::from_secs(config.seconds);
    let stack = start_stack_on(config.gateways, config.writers, Some(preloaded.url.clone()), None, "flushed").await;
    let roles = crate::roles_of(&stack, infrastructure);
    let plans = Plans { keys: Arc::new(preloaded.keys.clone()) };
    crate::warm_up(&stack, &plans, config.warmup_seconds).await;
    let mut scenarios = Vec::new();
    let mut proofs = intake_tests::serde_json::Map::new();
    crate::say(&format!("batch_ingest, pg_upsert and pg_upsert_v1 at {tag}, in turns"));
    let proof = Proof::start(capped, &preloaded.db).await?;
    let (ingest, upsert, v1, wal) = ingest_and_upsert_in_turns(config, &stack, &roles, &plans, preloaded).await?;
    proofs.insert(
        format!("batch_ingest, pg_upsert, pg_upsert_v1 at {}{suffix}", label(size)),
        Proof::finish(proof).await?,
    );
    scenarios.push((name("batch_ingest"), ingest));
    scenarios.push((name("pg_upsert"), upsert));
    scenarios.push((name("pg_upsert_v1"), v1));
    crate::settle(&preloaded.url).await?;
    crate::ha::checkpoint_standbys(&preloaded.url, setting.standbys()).await?;
    crate::warm_singles(
        &crate::targets(&stack),
        config.rate,
        plans.single_open(Arc::new(crate::bodies::Generator::new("sized-paced-warm"))),
    )
    .await;
    crate::say(&format!("single_200rps at {tag}"));
    let proof = Proof::start(capped, &preloaded.db).await?;
    let cores = tokio::spawn(roles.clone().cores_during(duration));
    let before = crate::stages::read(&stack).await;
    let measured = open_loop(
        &crate::targets(&stack),
        config.rate,
        duration,
        plans.single_open(Arc::new(crate::bodies::Generator::new("sized-paced"))),
    )
    .await;
    scenarios.push((
        name("single_200rps"),
        Scenario {
            writer: Some(crate::stages::between(
                &before,
                &crate::stages::read(&stack).await,
                measured.elapsed,
                stack.writer_ops_urls.len(),
            )),
            measured,
            counted: Counted::Requests,
            cores: cores.await.unwrap_or_default(),
        },
    ));
    proofs.insert(name("single_200rps").to_owned(), Proof::finish(proof).await?);
    crate::say(&format!("direct_apply at {tag}"));
    let proof = Proof::start(capped, &preloaded.db).await?;
    let (measured, cores) = baselines::direct_apply(
        &stack,
        &preloaded.keys,
        &roles,
        duration,
        config.direct_concurrency,
        config.direct_batches,
        &config.out_dir,
    )
    .await?;
    scenarios.push((name("direct_apply"), Scenario { measured, counted: Counted::Items, cores, writer: None }));
    proofs.insert(name("direct_apply").to_owned(), Proof::finish(proof).await?);
    crate::say(&format!("erase at {tag}: one person in the largest workspace"));
    let erase = erase_in_largest(&stack, preloaded).await?;
    let mut extra = json!({ "erase": erase, "wal_per_item": wal });
    if capped.is_some() {
        extra["under_budget"] = Value::Object(proofs);
    }
    Ok((scenarios, extra))
}

/// `batch_ingest`, its ceiling `pg_upsert` (into the preloaded conversions) and the fixed
/// yardstick `pg_upsert_v1` (into the preloaded table of the old shape), measured in
/// alternating turns that add up to the scenario's time each, so that their ratio compares the
/// same stretch of the run: on a shared machine, and with the tables growing and checkpoints
/// falling where they will, two 30-second runs one after the other differ by a fifth.
async fn ingest_and_upsert_in_turns(
    config: &crate::Config,
    stack: &Stack,
    roles: &Roles,
    plans: &Plans,
    preloaded: &Preloaded,
) -> anyhow::Result<(Scenario, Scenario, Scenario, Value)> {
    let database_url = preloaded.url.as_str();
    // The WAL written during each kind of turn, for the bytes per item it costs; the cluster's
    // other WAL meanwhile (autovacuum, a checkpoint's) counts too, as it would in service.
    let (mut ingest_wal, mut upsert_wal) = (0i64, 0i64);
    let (mut v1_turns, mut v1_cores) = (Vec::new(), Vec::new());
    let turns = if config.seconds >= 15 { 3 } else { 1 };
    let turn = Duration::from_secs(config.seconds / turns);
    let plan = plans.batch_ingest(
        config.batch_clients,
        Arc::new(crate::bodies::Generator::new("sized")),
        Arc::new(Mutex::new(Vec::new())),
    );
    let before = crate::stages::read(stack).await;
    let (mut ingest_turns, mut upsert_turns) = (Vec::new(), Vec::new());
    let (mut ingest_cores, mut upsert_cores) = (Vec::new(), Vec::new());
    for _ in 0..turns {
        let cores = tokio::spawn(roles.clone().cores_during(turn));
        let wal = crate::capped::wal_lsn(&preloaded.db).await?;
        let measured = closed_loop(&crate::targets(stack), config.batch_clients, turn, plan.clone()).await;
        let wal_after = crate::capped::wal_lsn(&preloaded.db).await?;
        ingest_wal += wal_after - wal;
        ingest_cores.push(cores.await.unwrap_or_default());
        ingest_turns.push(measured);
        let (measured, cores) =
            baselines::pg_upsert_into_preloaded(database_url, roles, turn, config.pg_clients, &config.out_dir).await?;
        upsert_wal += crate::capped::wal_lsn(&preloaded.db).await? - wal_after;
        upsert_cores.push(cores);
        upsert_turns.push(measured);
        let (measured, cores) =
            baselines::pg_upsert_v1_into_preloaded(database_url, roles, turn, config.pg_clients, &config.out_dir)
                .await?;
        v1_cores.push(cores);
        v1_turns.push(measured);
    }
    let joined = |turns: Vec<Measured>| turns.into_iter().reduce(Measured::followed_by);
    let (Some(mut ingest), Some(mut upsert), Some(mut v1)) =
        (joined(ingest_turns), joined(upsert_turns), joined(v1_turns))
    else {
        anyhow::bail!("no turn was run")
    };
    let writer =
        crate::stages::between(&before, &crate::stages::read(stack).await, ingest.elapsed, stack.writer_ops_urls.len());
    for measured in [&mut ingest, &mut upsert, &mut v1] {
        measured.concurrency = format!("{}, in {turns} turns of {} s", measured.concurrency, turn.as_secs());
    }
    let per_item = |bytes: i64, items: u64| round1(bytes as f64 / items.max(1) as f64);
    let wal = json!({
        "batch_ingest_bytes": per_item(ingest_wal, ingest.recorder.items),
        "pg_upsert_bytes": per_item(upsert_wal, upsert.recorder.items),
    });
    Ok((
        Scenario {
            measured: ingest,
            counted: Counted::Items,
            cores: crate::machine::mean_cores(&ingest_cores),
            writer: Some(writer),
        },
        Scenario {
            measured: upsert,
            counted: Counted::Items,
            cores: crate::machine::mean_cores(&upsert_cores),
            writer: None,
        },
        Scenario { measured: v1, counted: Counted::Items, cores: crate::machine::mean_cores(&v1_cores), writer: None },
        wal,
    ))
}
