//! The benchmark of `deploy/bench.sh`: starts gateways and writers (release build) on
//! topics of their own against the local PostgreSQL, Redis and Kafka, drives every scenario over
//! real HTTP, measures the two baselines in the same run, and writes `report.json` and
//! `report.md`. Settings are environment variables (see [`Config`]); `loadgen sample batch`
//! (or `single`, `invalid`) prints a request body of the scenarios, for an independent client;
//! `loadgen singles 1 16` measures single sends, closed loop, at each number of clients given
//! (BENCHMARKS.md, "A single send against the quick start") and prints a table.
//!
//! Scenarios, in this order (the gateway's and writer's peak memory is read after the first):
//! `batch_ingest`, `batch_resend`, `single_32`, `single_200rps`, `reject_401`, `reject_422`,
//! `workspace_read`, then the baselines `direct_apply`, `pg_upsert` and `pg_upsert_v1` (all of
//! them, or those INTAKE_BENCH_SCENARIOS names); then, unless turned off, `batch_ingest` again
//! under a CPU profile, and `batch_ingest` with 1 and 2 gateways and writers; then, with
//! INTAKE_BENCH_HA_DIR, `batch_ingest`, `single_32` and `single_200rps` again on the HA layout
//! of PostgreSQL (ha.rs).

mod baselines;
mod bodies;
mod capped;
mod client;
mod ha;
mod machine;
mod measure;
mod plot;
mod profile;
mod quota;
mod report;
mod sized;
mod soak;
mod stages;
mod timing;
mod wrk;

use bodies::{Generator, BATCH_ITEMS};
use client::Planned;
use intake_tests::serde_json::{self, json, Value};
use intake_tests::{Stack, StackOptions, TestKey};
use machine::Roles;
use measure::{closed_loop, open_loop, ClosedPlan, Counted, Expect, Measured, OpenPlan};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Every setting, from the environment.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Config {
    /// INTAKE_BENCH_SECONDS: length of each scenario (at least 30 for a run to quote).
    seconds: u64,
    /// INTAKE_BENCH_WARMUP_SECONDS: before the first scenario of each stack (group join,
    /// connections, caches).
    warmup_seconds: u64,
    /// INTAKE_BENCH_BROKER_WARMUP_SECONDS: added to the first warm-up of the run. A Kafka broker
    /// just started compiles its hot code (HotSpot's JIT) during its first 40 s or so of this
    /// traffic, at up to half a core; measured, the broker took 0.34 cores in batch_ingest
    /// right after a 5 s warm-up and 0.12 after a 40 s one. A broker in service has long done
    /// that, so the run measures it warm.
    broker_warmup_seconds: u64,
    /// INTAKE_BENCH_GATEWAYS, INTAKE_BENCH_WRITERS: the stack of the main run.
    gateways: usize,
    writers: usize,
    /// INTAKE_BENCH_WORKSPACES: one key each.
    workspaces: usize,
    /// INTAKE_BENCH_BATCH_CLIENTS (batch_ingest, batch_resend), INTAKE_BENCH_SINGLE_CLIENTS
    /// (single_32), INTAKE_BENCH_REJECT_CLIENTS (reject_401, reject_422, workspace_read).
    batch_clients: usize,
    single_clients: usize,
    reject_clients: usize,
    /// INTAKE_BENCH_REJECT_TOOL: `wrk` (default, when installed) measures reject_401 and
    /// reject_422 with wrk; `loadgen` with this program's own client.
    reject_tool: String,
    /// INTAKE_BENCH_RATE: requests a second of single_200rps.
    rate: f64,
    /// INTAKE_BENCH_DIRECT_CONCURRENCY: batches direct_apply applies at a time; by default a
    /// writer's apply lanes, so that the baseline has the parallelism the writer has;
    /// INTAKE_BENCH_DIRECT_BATCHES: distinct batches it goes round (fresh ids each round).
    direct_concurrency: usize,
    direct_batches: usize,
    /// INTAKE_BENCH_PG_CLIENTS: pgbench clients of pg_upsert.
    pg_clients: usize,
    /// INTAKE_BENCH_PROFILE_SECONDS: 0 turns the profile off.
    profile_seconds: u64,
    /// INTAKE_BENCH_SCALE: 0 turns off batch_ingest with 1 and 2 gateways and writers.
    scale: bool,
    /// INTAKE_BENCH_OUT: where report.json, report.md and profile/ go.
    out_dir: PathBuf,
    /// INTAKE_BENCH_SIZES: stored conversions of the runs at size, comma-separated ("" or "0":
    /// none); INTAKE_BENCH_KEEP_SIZED=1 keeps their database (INTAKE_BENCH_SIZED_DATABASE,
    /// default intake_bench_sized) afterwards.
    sizes: Vec<u64>,
    keep_sized: bool,
    sized_database: String,
    /// INTAKE_BENCH_MEMORY_MIB: the memory budget of PostgreSQL in the capped runs at size (0:
    /// none). With a budget, the runs at size go to a cluster of their own
    /// (INTAKE_BENCH_CLUSTER_DIR), whose `shared_buffers` is a quarter of it, capped or not;
    /// INTAKE_BENCH_CAPPED_SIZES (default: the largest size) says at which sizes the scenarios
    /// run a second time, capped.
    memory_mib: u64,
    cluster_dir: PathBuf,
    capped_sizes: Vec<u64>,
    /// INTAKE_BENCH_SCENARIOS: the scenarios of the main stack to run, comma-separated (unset,
    /// "" or "all": every one; see [`SCENARIOS`]). batch_resend sends batch_ingest's batches.
    scenarios: Vec<String>,
    /// INTAKE_BENCH_HA_DIR: where the HA layout of the synchronous replication runs lives
    /// (none: no such runs); INTAKE_BENCH_HA_BASE_PORT (default 31400) and
    /// INTAKE_BENCH_HA_PRIMARY_PORT (default the base + 55) its ports (deploy/ha.sh ha_port);
    /// INTAKE_BENCH_HA_SHARED_BUFFERS each node's `shared_buffers` (default: the single node's);
    /// INTAKE_BENCH_HA_ASYNC=0 leaves out the runs on the layout with asynchronous replication;
    /// INTAKE_BENCH_HA_VIA_HAPROXY=1 has the layout's writers connect through HAProxy, as the
    /// gateways do, instead of to the nodes (following the primary, as deployed), to see what
    /// the proxy costs (ha.rs).
    ha_dir: Option<PathBuf>,
    ha_base_port: u16,
    ha_primary_port: u16,
    ha_shared_buffers: String,
    ha_async: bool,
}

/// The scenarios of the main stack, in the order they run.
const SCENARIOS: [&str; 10] = [
    "batch_ingest",
    "batch_resend",
    "single_32",
    "single_200rps",
    "reject_401",
    "reject_422",
    "workspace_read",
    "direct_apply",
    "pg_upsert",
    "pg_upsert_v1",
];

fn setting<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Sizes, comma-separated, in increasing order ("" or "0": none).
fn sizes_setting(name: &str, default: &str) -> Vec<u64> {
    let mut sizes: Vec<u64> = setting(name, default.to_owned())
        .split(',')
        .filter_map(|s| s.trim().replace('_', "").parse().ok())
        .filter(|&s| s > 0)
        .collect();
    sizes.sort_unstable();
    sizes.dedup();
    sizes
}

impl Config {
    fn from_env() -> Config {
        Config {
            seconds: setting("INTAKE_BENCH_SECONDS", 30),
            warmup_seconds: setting("INTAKE_BENCH_WARMUP_SECONDS", 5),
            broker_warmup_seconds: setting("INTAKE_BENCH_BROKER_WARMUP_SECONDS", 35),
            gateways: setting("INTAKE_BENCH_GATEWAYS", 1),
            writers: setting("INTAKE_BENCH_WRITERS", 1),
            workspaces: setting("INTAKE_BENCH_WORKSPACES", 50),
            batch_clients: setting("INTAKE_BENCH_BATCH_CLIENTS", 16),
            single_clients: setting("INTAKE_BENCH_SINGLE_CLIENTS", 32),
            reject_clients: setting("INTAKE_BENCH_REJECT_CLIENTS", 16),
            reject_tool: setting("INTAKE_BENCH_REJECT_TOOL", "wrk".to_owned()),
            rate: setting("INTAKE_BENCH_RATE", 200.0),
            direct_concurrency: setting("INTAKE_BENCH_DIRECT_CONCURRENCY", report::writer_lanes()),
            direct_batches: setting("INTAKE_BENCH_DIRECT_BATCHES", 100),
            pg_clients: setting("INTAKE_BENCH_PG_CLIENTS", 2),
            profile_seconds: setting("INTAKE_BENCH_PROFILE_SECONDS", 10),
            scale: setting("INTAKE_BENCH_SCALE", 1u8) != 0,
            out_dir: PathBuf::from(setting("INTAKE_BENCH_OUT", "bench".to_owned())),
            sizes: sizes_setting("INTAKE_BENCH_SIZES", "1000000,10000000"),
            keep_sized: setting("INTAKE_BENCH_KEEP_SIZED", 0u8) != 0,
            sized_database: setting("INTAKE_BENCH_SIZED_DATABASE", "intake_bench_sized".to_owned()),
            memory_mib: setting("INTAKE_BENCH_MEMORY_MIB", 2048),
            cluster_dir: PathBuf::from(setting(
                "INTAKE_BENCH_CLUSTER_DIR",
                std::env::temp_dir().join("intake-bench-cluster").display().to_string(),
            )),
            capped_sizes: sizes_setting("INTAKE_BENCH_CAPPED_SIZES", ""),
            scenarios: setting("INTAKE_BENCH_SCENARIOS", String::new())
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty() && *s != "all")
                .map(str::to_owned)
                .collect(),
            ha_dir: std::env::var("INTAKE_BENCH_HA_DIR").ok().filter(|d| !d.is_empty()).map(PathBuf::from),
            ha_base_port: setting("INTAKE_BENCH_HA_BASE_PORT", 31400),
            ha_primary_port: setting(
                "INTAKE_BENCH_HA_PRIMARY_PORT",
                setting("INTAKE_BENCH_HA_BASE_PORT", 31400u16) + 55,
            ),
            ha_shared_buffers: setting("INTAKE_BENCH_HA_SHARED_BUFFERS", String::new()),
            ha_async: setting("INTAKE_BENCH_HA_ASYNC", 1u8) != 0,
        }
    }

    /// Whether the main stack runs `scenario` (INTAKE_BENCH_SCENARIOS).
    fn runs(&self, scenario: &str) -> bool {
        self.scenarios.is_empty() || self.scenarios.iter().any(|s| s == scenario)
    }
}

/// One scenario's result and what was observed meanwhile.
pub struct Scenario {
    pub measured: Measured,
    pub counted: Counted,
    /// Cores used per role over the scenario's middle.
    pub cores: Value,
    /// The stages' own timers over the scenario (Kafka path only; `stages.rs`).
    pub writer: Option<Value>,
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("sample") {
        print_sample(args.get(1).map(String::as_str).unwrap_or("batch"));
        return;
    }
    if args.first().map(String::as_str) == Some("plot") {
        // The plot of a report.json again, beside it (after a change to the plot alone).
        if let Err(error) = redraw(Path::new(args.get(1).map_or("bench/report.json", String::as_str))) {
            eprintln!("loadgen plot: {error:#}");
            std::process::exit(1);
        }
        return;
    }
    let work = async {
        match args.first().map(String::as_str) {
            Some("singles") => singles(Config::from_env(), &args[1..]).await,
            Some("soak") => soak::run().await,
            _ => run(Config::from_env()).await,
        }
    };
    // Stopped by a signal, the run is dropped, and with it what it started: the stacks stop
    // their gateways and writers and delete their topics, the CPU quota groups are removed.
    let outcome = tokio::select! {
        outcome = work => outcome,
        signal = stop_signal() => Err(anyhow::anyhow!("stopped by {signal}")),
    };
    if let Err(error) = outcome {
        eprintln!("loadgen: {error:#}");
        std::process::exit(1);
    }
}

async fn stop_signal() -> &'static str {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut terminate), Ok(mut interrupt)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = terminate.recv() => "SIGTERM",
        _ = interrupt.recv() => "SIGINT",
    }
}

fn redraw(report_json: &Path) -> anyhow::Result<()> {
    let report: Value = intake_tests::serde_json::from_str(&std::fs::read_to_string(report_json)?)?;
    let sized = report["sized"].as_array().cloned().unwrap_or_default();
    let out = report_json.with_file_name("throughput_by_size.svg");
    plot::draw(&report, &sized, &out)?;
    say(&format!("drew {}", out.display()));
    Ok(())
}

fn print_sample(kind: &str) {
    let generator = Generator::new("sample");
    let body = match kind {
        "single" => generator.single(0, 0),
        "invalid" => bodies::invalid_single(),
        _ => generator.batch(0, BATCH_ITEMS),
    };
    println!("{}", String::from_utf8_lossy(&body));
}

fn say(message: &str) {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let elapsed = START.get_or_init(std::time::Instant::now).elapsed().as_secs();
    eprintln!("==> [{:02}:{:02}] {message}", elapsed / 60, elapsed % 60);
}

async fn start_stack(gateways: usize, writers: usize) -> Stack {
    start_stack_on(gateways, writers, None, None, "flushed").await
}

/// A stack on a database other than DATABASE_URL's (the runs at size, the HA layout), its
/// writers on `writers_url` when given (the HA layout's nodes), acknowledging as `ack_when`
/// says (`INTAKE_WRITER_ACK_WHEN`): as deployed, `flushed` on a single node (deploy/up.sh),
/// `replicated` on the HA layout (deploy/up.sh --ha).
async fn start_stack_on(
    gateways: usize,
    writers: usize,
    database_url: Option<String>,
    writers_url: Option<String>,
    ack_when: &str,
) -> Stack {
    let mut writer_env = vec![("INTAKE_WRITER_ACK_WHEN".to_owned(), ack_when.to_owned())];
    writer_env.extend(writers_url.map(|url| ("DATABASE_URL".to_owned(), url)));
    Stack::start_with(StackOptions {
        database_url,
        writer_env,
        // Limits out of the way: the benchmark measures the write path, not the limiter's refusals.
        requests_per_minute: 1_000_000_000,
        conversions_per_minute: 1_000_000_000,
        write_timeout_ms: 60_000,
        gateways,
        writers,
        ..Default::default()
    })
    .await
}

fn targets(stack: &Stack) -> Vec<String> {
    std::iter::once(stack.base_url.clone()).chain(stack.more_base_urls.iter().cloned()).collect()
}

/// The shared infrastructure's processes, found by their ports.
fn infrastructure_roles() -> Roles {
    let port = |name: &str, default: u16| setting(name, default);
    let broker_port = std::env::var("INTAKE_KAFKA_BROKERS")
        .ok()
        .and_then(|b| b.split(',').next().and_then(|a| a.rsplit(':').next()).and_then(|p| p.parse().ok()))
        .unwrap_or(59092);
    let redis_port = std::env::var("INTAKE_REDIS_URL")
        .ok()
        .and_then(|u| u.rsplit(':').next().and_then(|p| p.trim_end_matches('/').parse().ok()))
        .unwrap_or(56379);
    // The run's databases: the main one and the one preloaded for the runs at size; on a
    // shared server, the backends of the others are other work.
    let mut databases: Vec<String> = std::env::var("DATABASE_URL")
        .ok()
        .and_then(|url| url.rsplit_once('/').map(|(_, database)| database.split('?').next().unwrap_or("").to_owned()))
        .into_iter()
        .collect();
    databases.push(setting("INTAKE_BENCH_SIZED_DATABASE", "intake_bench_sized".to_owned()));
    Roles {
        postmaster: machine::pid_listening_on(port("INTAKE_PG_PORT", 55432)),
        kafka: machine::pid_listening_on(broker_port),
        redis: machine::pid_listening_on(redis_port),
        databases,
        ..Roles::default()
    }
}

fn roles_of(stack: &Stack, infrastructure: &Roles) -> Roles {
    let (gateways, writers) = stack.pids();
    Roles { gateways, writers, ..infrastructure.clone() }
}

/// A closed-loop scenario on the stack, with the cores and writer timers meanwhile.
async fn closed(
    stack: &Stack,
    roles: &Roles,
    clients: usize,
    duration: Duration,
    counted: Counted,
    plan: ClosedPlan,
) -> Scenario {
    let cores = tokio::spawn(roles.clone().cores_during(duration));
    let before = stages::read(stack).await;
    let measured = closed_loop(&targets(stack), clients, duration, plan).await;
    let writer = stages::between(&before, &stages::read(stack).await, measured.elapsed, stack.writer_ops_urls.len());
    Scenario { measured, counted, cores: cores.await.unwrap_or_default(), writer: Some(writer) }
}

struct Plans {
    keys: Arc<Vec<TestKey>>,
}

impl Plans {
    /// batch_ingest: client c's request k goes to workspace (c + clients·k) mod workspaces; every
    /// batch sent is remembered for batch_resend.
    fn batch_ingest(
        &self,
        clients: usize,
        generator: Arc<Generator>,
        sent: Arc<Mutex<Vec<(usize, u64)>>>,
    ) -> ClosedPlan {
        let (keys, next) = (self.keys.clone(), Arc::new(AtomicU64::new(0)));
        Arc::new(move |c, k| {
            let workspace = (c + clients * k as usize) % keys.len();
            let first = next.fetch_add(BATCH_ITEMS as u64, Ordering::Relaxed);
            sent.lock().unwrap_or_else(|p| p.into_inner()).push((workspace, first));
            (
                post("/v1/conversions/batch", &keys[workspace], generator.batch(first, BATCH_ITEMS)),
                Expect::Batch("created"),
            )
        })
    }

    /// batch_resend: the batches of batch_ingest again, round and round, byte for byte.
    fn batch_resend(&self, generator: Arc<Generator>, sent: Arc<Vec<(usize, u64)>>) -> ClosedPlan {
        let (keys, next) = (self.keys.clone(), Arc::new(AtomicU64::new(0)));
        Arc::new(move |_, _| {
            let (workspace, first) = sent[next.fetch_add(1, Ordering::Relaxed) as usize % sent.len().max(1)];
            (
                post("/v1/conversions/batch", &keys[workspace], generator.batch(first, BATCH_ITEMS)),
                Expect::Batch("unchanged"),
            )
        })
    }

    /// single_32: client c sends its own sequence to workspace c mod workspaces.
    fn single(&self, generator: Arc<Generator>) -> ClosedPlan {
        let keys = self.keys.clone();
        Arc::new(move |c, k| {
            (
                post("/v1/conversions", &keys[c % keys.len()], generator.single(c as u64 * 1_000_000_000, k)),
                Expect::Status(201, 1),
            )
        })
    }

    /// single_200rps: request k to workspace (k / 3) mod workspaces, so that a parent and its
    /// child go to the same workspace.
    fn single_open(&self, generator: Arc<Generator>) -> OpenPlan {
        let keys = self.keys.clone();
        Arc::new(move |k| {
            (
                post("/v1/conversions", &keys[(k / 3) as usize % keys.len()], generator.single(0, k)),
                Expect::Status(201, 1),
            )
        })
    }

    fn reject_401(&self) -> ClosedPlan {
        let body = Generator::new("reject").single(0, 0);
        Arc::new(move |_, _| {
            let planned = Planned {
                method: http::Method::POST,
                path: "/v1/conversions",
                authorization: Some(bodies::UNKNOWN_KEY.to_owned()),
                body: Some(body.clone()),
            };
            (planned, Expect::Status(401, 0))
        })
    }

    fn reject_422(&self) -> ClosedPlan {
        let keys = self.keys.clone();
        Arc::new(move |c, _| {
            (post("/v1/conversions", &keys[c % keys.len()], bodies::invalid_single()), Expect::Status(422, 0))
        })
    }

    fn workspace_read(&self) -> ClosedPlan {
        let keys = self.keys.clone();
        Arc::new(move |c, _| {
            let planned = Planned {
                method: http::Method::GET,
                path: "/v1/workspace",
                authorization: Some(keys[c % keys.len()].bearer()),
                body: None,
            };
            (planned, Expect::Status(200, 0))
        })
    }
}

fn post(path: &'static str, key: &TestKey, body: bytes::Bytes) -> Planned {
    Planned { method: http::Method::POST, path, authorization: Some(key.bearer()), body: Some(body) }
}

/// Has PostgreSQL finish what the scenario before left to do: the vacuum that its inserts call
/// for, and the write-back of its dirty pages. A throughput run adds hundreds of thousands of
/// rows and writes gigabytes of WAL; autovacuum and the checkpoint they trigger would otherwise
/// run during the next scenario, and a latency scenario measured them (p99 from 10 to 130 ms at
/// 10 M, by where that checkpoint fell), not its own traffic. Both are real costs of a busy
/// database, but of the run before, not of 200 single sends a second.
async fn settle(database_url: &str) -> anyhow::Result<()> {
    use sqlx::Connection;
    let mut conn = sqlx::PgConnection::connect(database_url).await?;
    sqlx::raw_sql("VACUUM (ANALYZE)").execute(&mut conn).await?;
    sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await?;
    conn.close().await?;
    // The same for the OS: the broker's log is written without fsync, so what a throughput run
    // sent through Kafka can sit dirty in the page cache until the kernel writes it back, up to
    // 30 s later, in the next scenario, where every commit's WAL fsync would queue behind it.
    // The line says how much there was (21 MiB after batch_ingest_10m in one run).
    let dirty = dirty_mib();
    let started = std::time::Instant::now();
    let synced = tokio::task::spawn_blocking(|| std::process::Command::new("sync").status()).await?;
    say(&format!(
        "settled: VACUUM (ANALYZE), CHECKPOINT, and {dirty} MiB of dirty pages written out in {:.1} s{}",
        started.elapsed().as_secs_f64(),
        if synced.is_ok_and(|status| status.success()) { "" } else { " (sync failed)" }
    ));
    Ok(())
}

/// Statistics for the planner once the warm-up has written the first rows. The benchmark's
/// database is new, and the writer's statements are planned without statistics until
/// autovacuum first visits it, which can take a minute or more (naptime 1 min): meanwhile the
/// look-up of a chunk's related conversions ran as a sequential scan of `conversions`, 1.5 ms
/// a statement, and whichever server autovacuum reached later measured that instead of its
/// own cost (on the HA layout, never within its runs). A database in service has statistics.
async fn analyze(database_url: &str) -> anyhow::Result<()> {
    use sqlx::Connection;
    let started = std::time::Instant::now();
    let mut conn = sqlx::PgConnection::connect(database_url).await?;
    sqlx::raw_sql("ANALYZE").execute(&mut conn).await?;
    conn.close().await?;
    say(&format!("analyzed the warmed-up database in {:.1} s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// The fixed-rate traffic for a few seconds, not measured, right after [`settle`]: its forced
/// CHECKPOINT makes the first write to every page log the whole page, and its pause lets every
/// key's cache entry expire. Traffic that never paused would not meet that cold start all at
/// once; the measured run is the steady state after it.
async fn warm_singles(targets: &[String], rate: f64, plan: OpenPlan) {
    let warm = open_loop(targets, rate, Duration::from_secs(3), plan).await;
    say(&format!(
        "warmed: {} requests, p99 {:.1} ms",
        warm.recorder.requests,
        warm.recorder.latency.value_at_quantile(0.99) as f64 / 1000.0
    ));
}

/// The page cache's dirty data, from /proc/meminfo (0 where there is none).
fn dirty_mib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("Dirty:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0);
    kib / 1024
}

/// The consumer group's first join, connections, caches, and the first pages of the tables.
async fn warm_up(stack: &Stack, plans: &Plans, seconds: u64) {
    let half = Duration::from_secs(seconds.div_ceil(2));
    let sent = Arc::new(Mutex::new(Vec::new()));
    closed_loop(&targets(stack), 4, half, plans.batch_ingest(4, Arc::new(Generator::new("warm")), sent)).await;
    closed_loop(&targets(stack), 8, half, plans.single(Arc::new(Generator::new("warm")))).await;
}

/// batch_ingest (or its run on another database, `name`): 500-item batches from
/// `config.batch_clients` clients, closed loop; also returns the batches sent, for batch_resend.
async fn batch_ingest(
    stack: &Stack,
    roles: &Roles,
    plans: &Plans,
    config: &Config,
    name: &str,
    generator: Arc<Generator>,
) -> (Scenario, Vec<(usize, u64)>) {
    say(&format!("{name}: {} clients, {} s", config.batch_clients, config.seconds));
    let sent = Arc::new(Mutex::new(Vec::new()));
    let plan = plans.batch_ingest(config.batch_clients, generator, sent.clone());
    let duration = Duration::from_secs(config.seconds);
    let scenario = closed(stack, roles, config.batch_clients, duration, Counted::Items, plan).await;
    let sent = std::mem::take(&mut *sent.lock().unwrap_or_else(|p| p.into_inner()));
    (scenario, sent)
}

/// single_32 (or its run on another database, `name`): single sends from
/// `config.single_clients` clients, closed loop.
async fn single_32(stack: &Stack, roles: &Roles, plans: &Plans, config: &Config, name: &str) -> Scenario {
    say(&format!("{name}: {} clients", config.single_clients));
    let plan = plans.single(Arc::new(Generator::new("single")));
    closed(stack, roles, config.single_clients, Duration::from_secs(config.seconds), Counted::Requests, plan).await
}

/// single_200rps (or its run on another database, `name`): PostgreSQL settled (and the
/// standbys' servers at `standbys` checkpointed likewise) and the traffic warmed, then
/// `config.rate` single sends a second, open loop.
async fn single_200rps(
    stack: &Stack,
    roles: &Roles,
    plans: &Plans,
    config: &Config,
    name: &str,
    database_url: &str,
    standbys: &[String],
) -> anyhow::Result<Scenario> {
    let duration = Duration::from_secs(config.seconds);
    settle(database_url).await?;
    ha::checkpoint_standbys(database_url, standbys).await?;
    warm_singles(&targets(stack), config.rate, plans.single_open(Arc::new(Generator::new("paced-warm")))).await;
    say(&format!("{name}: {} requests/s, open loop", config.rate));
    let cores = tokio::spawn(roles.clone().cores_during(duration));
    let before = stages::read(stack).await;
    let measured =
        open_loop(&targets(stack), config.rate, duration, plans.single_open(Arc::new(Generator::new("paced")))).await;
    let writer = stages::between(&before, &stages::read(stack).await, measured.elapsed, stack.writer_ops_urls.len());
    let cores = cores.await.unwrap_or_default();
    Ok(Scenario { measured, counted: Counted::Requests, cores, writer: Some(writer) })
}

async fn run(config: Config) -> anyhow::Result<()> {
    if let Some(unknown) = config.scenarios.iter().find(|s| !SCENARIOS.contains(&s.as_str())) {
        anyhow::bail!("INTAKE_BENCH_SCENARIOS: no scenario {unknown} (there are {})", SCENARIOS.join(", "));
    }
    let duration = Duration::from_secs(config.seconds);
    let profile_dir = config.out_dir.join("profile");
    std::fs::create_dir_all(&profile_dir)?;
    let database_url = intake_tests::env("DATABASE_URL");
    let db = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&database_url).await?;
    say("measuring how busy the machine is before the run (3 s)");
    let started_at = time::OffsetDateTime::now_utc().format(&time::format_description::well_known::Rfc3339)?;
    let machine = machine::describe(Duration::from_secs(3)).await;
    let versions = machine::versions(&db, &intake_tests::env("INTAKE_REDIS_URL")).await;
    let (commit, dirty) = machine::git();
    let infrastructure = infrastructure_roles();

    say(&format!("starting {} gateway(s) and {} writer(s)", config.gateways, config.writers));
    let stack = start_stack(config.gateways, config.writers).await;
    say(&format!("creating {} workspaces with a key each", config.workspaces));
    let keys: Vec<TestKey> = (0..config.workspaces).map(|_| stack.workspace()).collect();
    let plans = Plans { keys: Arc::new(keys.clone()) };
    let roles = roles_of(&stack, &infrastructure);
    let first_warmup = config.warmup_seconds + config.broker_warmup_seconds;
    say(&format!("warming up for {first_warmup} s (the broker's JIT compiler included)"));
    warm_up(&stack, &plans, first_warmup).await;
    analyze(&database_url).await?;

    let mut scenarios: Vec<(&'static str, Scenario)> = Vec::new();
    let ingest_generator = Arc::new(Generator::new("ingest"));
    let mut sent = Vec::new();
    if config.runs("batch_ingest") {
        let (scenario, batches) =
            batch_ingest(&stack, &roles, &plans, &config, "batch_ingest", ingest_generator.clone()).await;
        scenarios.push(("batch_ingest", scenario));
        sent = batches;
    }
    let (gateway_pids, writer_pids) = stack.pids();
    let gateway_peak_rss_mib = measure::round1(Roles::peak_rss_mib(&gateway_pids));
    let writer_peak_rss_mib = measure::round1(Roles::peak_rss_mib(&writer_pids));

    if config.runs("batch_resend") && sent.is_empty() {
        say("batch_resend skipped: it sends batch_ingest's batches again, and batch_ingest did not run");
    } else if config.runs("batch_resend") {
        say("batch_resend");
        let plan = plans.batch_resend(ingest_generator, Arc::new(sent));
        scenarios
            .push(("batch_resend", closed(&stack, &roles, config.batch_clients, duration, Counted::Items, plan).await));
    }

    if config.runs("single_32") {
        scenarios.push(("single_32", single_32(&stack, &roles, &plans, &config, "single_32").await));
    }
    if config.runs("single_200rps") {
        let scenario = single_200rps(&stack, &roles, &plans, &config, "single_200rps", &database_url, &[]).await?;
        scenarios.push(("single_200rps", scenario));
    }

    // The reject paths by wrk when it is there: this client would be the bottleneck.
    let use_wrk = config.reject_tool == "wrk" && wrk::available();
    let (valid_body, invalid_body) = (Generator::new("reject").single(0, 0), bodies::invalid_single());
    let key_header = keys[0].bearer();
    let wrk_requests = [
        (
            "reject_401",
            wrk::Request {
                path: "/v1/conversions",
                authorization: bodies::UNKNOWN_KEY,
                body: &valid_body,
                status: 401,
            },
        ),
        (
            "reject_422",
            wrk::Request { path: "/v1/conversions", authorization: &key_header, body: &invalid_body, status: 422 },
        ),
    ];
    for (name, plan) in [
        ("reject_401", plans.reject_401()),
        ("reject_422", plans.reject_422()),
        ("workspace_read", plans.workspace_read()),
    ] {
        if !config.runs(name) {
            continue;
        }
        let by_wrk = wrk_requests.iter().find(|(n, _)| *n == name).filter(|_| use_wrk);
        let scenario = match by_wrk {
            Some((_, request)) => {
                say(&format!("{name}: wrk, {} connections", config.reject_clients * 4));
                let cores = tokio::spawn(roles.clone().cores_during(duration));
                let measured =
                    wrk::measure(&stack.base_url, request, config.reject_clients * 4, duration, &config.out_dir)
                        .await?;
                Scenario { measured, counted: Counted::Requests, cores: cores.await.unwrap_or_default(), writer: None }
            }
            None => {
                say(&format!("{name}: {} clients", config.reject_clients));
                let mut scenario =
                    closed(&stack, &roles, config.reject_clients, duration, Counted::Requests, plan).await;
                scenario.writer = None;
                scenario
            }
        };
        scenarios.push((name, scenario));
    }

    if config.runs("direct_apply") {
        say("direct_apply: the writer's apply code on the same batches, no HTTP, no Kafka");
        let (measured, cores) = baselines::direct_apply(
            &stack,
            &keys,
            &roles,
            duration,
            config.direct_concurrency,
            config.direct_batches,
            &config.out_dir,
        )
        .await?;
        scenarios.push(("direct_apply", Scenario { measured, counted: Counted::Items, cores, writer: None }));
    }

    if config.runs("pg_upsert") {
        say(&format!("pg_upsert: pgbench, {} clients", config.pg_clients));
        let (measured, cores) =
            baselines::pg_upsert(&db, &database_url, &roles, duration, config.pg_clients, &config.out_dir).await?;
        scenarios.push(("pg_upsert", Scenario { measured, counted: Counted::Items, cores, writer: None }));
    }
    if config.runs("pg_upsert_v1") {
        say(&format!("pg_upsert_v1: pgbench, {} clients, into the old shape", config.pg_clients));
        let (measured, cores) =
            baselines::pg_upsert_v1(&db, &database_url, &roles, duration, config.pg_clients, &config.out_dir).await?;
        scenarios.push(("pg_upsert_v1", Scenario { measured, counted: Counted::Items, cores, writer: None }));
    }

    let profiles = if config.profile_seconds > 0 {
        profiles(&stack, &plans, &roles, &config, &profile_dir).await
    } else {
        json!("turned off")
    };

    // The main stack's work is done: its processes would otherwise idle beside the runs below.
    drop(stack);
    let (ha_scenarios, ha) = match &config.ha_dir {
        Some(dir) => ha::scenarios(&config, dir, &db, &database_url, &infrastructure, &scenarios).await?,
        None => (Vec::new(), Value::Null),
    };
    scenarios.extend(ha_scenarios);

    let mut scale = Vec::new();
    let (mut scale_writers, mut scale_gateways) = (Value::Null, Value::Null);
    let main_ingest = scenarios.iter().find(|(n, _)| *n == "batch_ingest").map(|(_, s)| s);
    if config.scale && main_ingest.is_none() {
        say("no scale runs: their quotas come from batch_ingest, which did not run");
    }
    if let Some(main_ingest) = main_ingest.filter(|_| config.scale) {
        scale.push(scale_row(config.gateways, config.writers, main_ingest));
        let direct = scenarios.iter().find(|(n, _)| *n == "direct_apply").map(|(_, s)| s.measured.rate(Counted::Items));
        match quota::Cgroups::detect() {
            Some(cgroups) => {
                let ingest = main_ingest.measured.rate(Counted::Items).max(1.0);
                // CPU a tier spends per item, from the main batch_ingest; the quota lets 4 capped
                // processes together apply at most 60 % of what PostgreSQL takes, so that the
                // capped tier, not PostgreSQL or the machine, bounds every run. What PostgreSQL
                // takes is direct_apply, or batch_ingest when that is lower: on a machine whose
                // cores PostgreSQL shares with the rest, that is its share with everything
                // running. The margin is wide because a capped process spends more per item than
                // an uncapped one (smaller groups): with less, 4 capped writers keep a 2-core
                // machine busy and the machine bounds the last step.
                let per_item = |role: &str| main_ingest.cores[role].as_f64().unwrap_or(0.5) / ingest;
                let budget = 0.6 * direct.unwrap_or(ingest).min(ingest) / 4.0;
                let cap = |role: &str| (budget * per_item(role)).clamp(0.03, 0.45);
                for (tier, quota) in [("writers", cap("writer")), ("gateways", cap("gateway"))] {
                    let rows = scale_capped(&config, &plans, &infrastructure, &cgroups, tier, quota).await;
                    let value = scale_summary(&cgroups, tier, quota, rows);
                    if tier == "writers" {
                        scale_writers = value;
                    } else {
                        scale_gateways = value;
                    }
                }
            }
            None => {
                let reason =
                    "no writable cgroup CPU controller (v1 /sys/fs/cgroup/cpu, v2 cpu.max): no capped scale runs";
                say(reason);
                scale_writers = json!({ "skipped": reason });
                scale_gateways = json!({ "skipped": reason });
            }
        }
    }

    let (sized, sized_cluster) = if config.sizes.is_empty() {
        (Vec::new(), Value::Null)
    } else {
        at_size(&config, &db, &database_url, &infrastructure, &mut scenarios).await?
    };

    let run = report::Run {
        config: &config,
        started_at,
        machine,
        versions,
        commit,
        dirty,
        scenarios,
        gateway_peak_rss_mib,
        writer_peak_rss_mib,
        scale,
        scale_writers,
        scale_gateways,
        profiles,
        sized,
        sized_cluster,
        ha,
    };
    let (json, markdown) = report::render(&run);
    std::fs::write(config.out_dir.join("report.json"), format!("{json:#}\n"))?;
    std::fs::write(config.out_dir.join("report.md"), markdown)?;
    if !run.sized.is_empty() {
        plot::draw(&json, &run.sized, &config.out_dir.join("throughput_by_size.svg"))?;
    }
    say(&format!("wrote {}/report.json and report.md", config.out_dir.display()));
    Ok(())
}

/// The runs at size (sized.rs): their scenarios join the others; returns per size the load, the
/// erasure, the bytes per stored conversion and the WAL per item, and what the capped runs read
/// and held. With a memory budget they run on a cluster of their own in a memory cgroup
/// (capped.rs), removed afterwards; else on DATABASE_URL's server. The database is dropped
/// afterwards unless asked to keep it.
async fn at_size(
    config: &Config,
    db: &sqlx::PgPool,
    database_url: &str,
    infrastructure: &Roles,
    scenarios: &mut Vec<(&'static str, Scenario)>,
) -> anyhow::Result<(Vec<Value>, Value)> {
    let cluster = if config.memory_mib > 0 {
        let budget = config.memory_mib << 20;
        match capped::Cluster::start(&config.cluster_dir, budget) {
            Ok(cluster) => Some(cluster),
            Err(error) => {
                say(&format!("no capped runs: {error:#}"));
                None
            }
        }
    } else {
        None
    };
    let own_server = cluster.as_ref().map(capped::Cluster::server_url);
    let (server, _) = database_url.rsplit_once('/').ok_or_else(|| anyhow::anyhow!("DATABASE_URL has no database"))?;
    let server = own_server.as_deref().unwrap_or(server);
    let admin = match &cluster {
        Some(_) => {
            sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&format!("{server}/postgres")).await?
        }
        None => db.clone(),
    };
    let infrastructure = Roles {
        postmaster: cluster.as_ref().map(|c| c.postmaster).or(infrastructure.postmaster),
        ..infrastructure.clone()
    };
    let largest = config.sizes.last().copied().unwrap_or(0);
    let capped_at = |size: u64| {
        cluster.is_some()
            && if config.capped_sizes.is_empty() { size == largest } else { config.capped_sizes.contains(&size) }
    };
    let name = &config.sized_database;
    say(&format!(
        "runs at size {:?}: database {name}{}",
        config.sizes,
        cluster.as_ref().map_or(String::new(), |c| format!(
            " on a cluster of its own (port {}, shared_buffers {} MiB; capped at {} MiB at {:?})",
            c.port,
            c.shared_buffers_mib,
            c.budget_bytes >> 20,
            config.sizes.iter().filter(|&&s| capped_at(s)).collect::<Vec<_>>()
        ))
    ));
    let mut preloaded = sized::Preloaded::create(&admin, server, name, &intake_tests::env("INTAKE_BIN_DIR"), 1).await?;
    let mut rows = Vec::new();
    let mut outcome = Ok(());
    for &size in &config.sizes {
        say(&format!("loading to {size} conversions (COPY, indexes after)"));
        let load = match preloaded.grow_to(size).await {
            Ok(load) => load,
            Err(error) => {
                outcome = Err(error);
                break;
            }
        };
        say(&format!("loaded: {load}"));
        let bytes = |table: &'static str| {
            let db = preloaded.db.clone();
            async move {
                capped::bytes_per_conversion(&db, table).await.unwrap_or_else(|e| json!({ "failed": e.to_string() }))
            }
        };
        let (stored, stored_v1) = (bytes("conversions").await, bytes(baselines::V1_TABLE).await);
        let mut runs = vec![None];
        if capped_at(size) {
            runs.push(cluster.as_ref());
        }
        let mut row = json!({ "size": size, "label": sized::label(size), "load": load, "bytes_per_conversion": stored, "bytes_per_conversion_v1": stored_v1 });
        for capped in runs {
            if let Some(cluster) = capped {
                if let Err(error) = cluster.cap() {
                    outcome = Err(error);
                    break;
                }
                say(&format!("PostgreSQL capped at {} MiB (page cache included)", cluster.budget_bytes >> 20));
            }
            let setting = capped.map_or(sized::Setting::Uncapped, sized::Setting::Capped);
            let measured = sized::scenarios_at(config, &preloaded, &infrastructure, size, setting).await;
            if let Some(cluster) = capped {
                let _ = cluster.uncap();
            }
            match measured {
                Ok((measured, extra)) => {
                    scenarios.extend(measured);
                    let key = if capped.is_some() { "capped" } else { "uncapped" };
                    row[key] = extra.clone();
                    if capped.is_none() {
                        // Where the reports of a run at size have always looked.
                        row["erase"] = extra["erase"].clone();
                    }
                }
                Err(error) => {
                    outcome = Err(error);
                    break;
                }
            }
        }
        rows.push(row);
        if outcome.is_err() {
            break;
        }
    }
    preloaded.db.close().await;
    if config.keep_sized && cluster.is_none() {
        say(&format!("kept the database {name} (INTAKE_BENCH_KEEP_SIZED)"));
    } else if cluster.is_none() {
        sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)")).execute(db).await?;
    }
    let described = cluster.as_ref().map_or(Value::Null, capped::Cluster::describe);
    // Dropped here: the cluster stopped and its directory removed, then the group.
    drop(admin);
    drop(cluster);
    outcome.map(|()| (rows, described))
}

/// Single sends, closed loop, at each number of clients: a markdown table on stdout.
async fn singles(config: Config, clients: &[String]) -> anyhow::Result<()> {
    let stack = start_stack(config.gateways, config.writers).await;
    let keys: Vec<TestKey> = (0..config.workspaces).map(|_| stack.workspace()).collect();
    let plans = Plans { keys: Arc::new(keys) };
    warm_up(&stack, &plans, config.warmup_seconds).await;
    println!("| clients | requests/s | p50 ms | p90 ms | p99 ms | max ms | errors |\n|---|---|---|---|---|---|---|");
    for n in clients.iter().filter_map(|c| c.parse::<usize>().ok()) {
        let duration = Duration::from_secs(config.seconds);
        let measured =
            closed_loop(&targets(&stack), n, duration, plans.single(Arc::new(Generator::new("singles")))).await;
        let r = measured.to_json(Counted::Requests);
        println!(
            "| {n} | {} | {} | {} | {} | {} | {} |",
            r["requests_per_s"], r["p50_ms"], r["p90_ms"], r["p99_ms"], r["max_ms"], r["errors"]
        );
    }
    Ok(())
}

/// batch_ingest with 1, 2 and 4 of the tier (`writers` or `gateways`), each process of the
/// tier capped at `quota` cores; one of the other tier, uncapped.
async fn scale_capped(
    config: &Config,
    plans: &Plans,
    infrastructure: &Roles,
    cgroups: &quota::Cgroups,
    tier: &str,
    quota: f64,
) -> Vec<Value> {
    let duration = Duration::from_secs(config.seconds);
    let mut rows = Vec::new();
    for n in [1usize, 2, 4] {
        let (gateways, writers) = if tier == "writers" { (1, n) } else { (n, 1) };
        say(&format!("scale_{tier}: {n}, each capped at {quota:.2} cores"));
        let stack = start_stack(gateways, writers).await;
        let (gateway_pids, writer_pids) = stack.pids();
        let capped = if tier == "writers" { writer_pids } else { gateway_pids };
        let groups: Vec<quota::Group> = capped
            .iter()
            .enumerate()
            .filter_map(|(i, &pid)| match cgroups.cap(&format!("intake-bench-{tier}-{i}"), quota, pid) {
                Ok(group) => Some(group),
                Err(error) => {
                    say(&format!("could not cap {pid}: {error}"));
                    None
                }
            })
            .collect();
        let plans = &balanced(&stack, plans);
        let roles = roles_of(&stack, infrastructure);
        warm_up(&stack, plans, config.warmup_seconds).await;
        let per_process: Vec<_> = capped
            .iter()
            .map(|&pid| {
                let only = Roles { gateways: vec![pid], ..Roles::default() };
                tokio::spawn(only.cores_during(duration))
            })
            .collect();
        let plan = plans.batch_ingest(
            config.batch_clients,
            Arc::new(Generator::new("scale")),
            Arc::new(Mutex::new(Vec::new())),
        );
        let scenario = closed(&stack, &roles, config.batch_clients, duration, Counted::Items, plan).await;
        let mut cores = Vec::new();
        for handle in per_process {
            cores.push(handle.await.unwrap_or_default()["gateway"].as_f64().unwrap_or(0.0));
        }
        rows.push(json!({
            "processes": n,
            "batch_ingest": scenario.measured.to_json(Counted::Items),
            "capped_process_cores": cores,
            "throttled_periods": groups.iter().map(quota::Group::throttled_periods).collect::<Vec<_>>(),
            "cores": scenario.cores,
        }));
        drop(stack);
        drop(groups);
    }
    rows
}

/// The plans on the keys whose workspaces fall evenly on the requests topic's partitions: a
/// writer's share of the load is its share of the partitions, whichever of 1, 2 or 4 writers
/// own them. Fifty random workspaces fall unevenly on four partitions (13, 12, 10 and 15 in one
/// run): a scale run then measured the luck of the hash (one writer busy, another with its cores
/// to spare).
fn balanced(stack: &Stack, plans: &Plans) -> Plans {
    let mut by_partition: std::collections::BTreeMap<u32, Vec<TestKey>> = Default::default();
    for key in plans.keys.iter() {
        by_partition.entry(stack.request_partition(&key.workspace_id)).or_default().push(key.clone());
    }
    let each = by_partition.values().map(Vec::len).min().unwrap_or(0);
    if by_partition.len() < stack.request_partitions() as usize || each == 0 {
        return Plans { keys: plans.keys.clone() };
    }
    // Interleaved, so that consecutive requests go to different partitions.
    let keys = (0..each).flat_map(|i| by_partition.values().map(move |keys| keys[i].clone())).collect();
    Plans { keys: Arc::new(keys) }
}

fn scale_summary(cgroups: &quota::Cgroups, tier: &str, quota: f64, rows: Vec<Value>) -> Value {
    let rate = |n: u64| {
        rows.iter()
            .find(|r| r["processes"].as_u64() == Some(n))
            .and_then(|r| r["batch_ingest"]["items_per_s"].as_f64())
            .unwrap_or(0.0)
    };
    let factor = |n| if rate(1) > 0.0 { measure::round2(rate(n) / rate(1)) } else { 0.0 };
    let throttled = rows.iter().all(|r| {
        r["capped_process_cores"].as_array().is_some_and(|c| c.iter().all(|v| v.as_f64().unwrap_or(0.0) <= quota * 1.1))
    });
    json!({
        "tier": tier,
        "cgroup": cgroups.version(),
        "quota_cores_per_process": measure::round2(quota),
        "items_per_s": { "1": rate(1), "2": rate(2), "4": rate(4) },
        "factor_2": factor(2),
        "factor_4": factor(4),
        "every_capped_process_within_its_quota": throttled,
        "runs": rows,
    })
}

fn scale_row(gateways: usize, writers: usize, scenario: &Scenario) -> Value {
    json!({
        "gateways": gateways,
        "writers": writers,
        "batch_ingest": scenario.measured.to_json(Counted::Items),
        "cores": scenario.cores,
        "writer_stage": scenario.writer,
    })
}

/// batch_ingest and reject_401 again, each under `perf record` of the run's processes.
async fn profiles(stack: &Stack, plans: &Plans, roles: &Roles, config: &Config, dir: &std::path::Path) -> Value {
    if let Some(reason) = profile::unavailable() {
        say(&format!("no profile: {reason}"));
        return json!({ "skipped": reason });
    }
    let mut names: HashMap<u32, &'static str> = HashMap::new();
    names.extend(roles.gateways.iter().map(|&p| (p, "intake-gateway")));
    names.extend(roles.writers.iter().map(|&p| (p, "intake-writer")));
    names.insert(std::process::id(), "load generator");
    names.extend(roles.kafka.map(|p| (p, "kafka")));
    names.extend(roles.redis.map(|p| (p, "redis")));
    let duration = Duration::from_secs(config.profile_seconds);
    let mut result = serde_json::Map::new();
    let scenarios: [(&str, usize, ClosedPlan); 2] = [
        (
            "batch_ingest",
            config.batch_clients,
            plans.batch_ingest(
                config.batch_clients,
                Arc::new(Generator::new("profile")),
                Arc::new(Mutex::new(Vec::new())),
            ),
        ),
        ("reject_401", config.reject_clients, plans.reject_401()),
    ];
    for (name, clients, plan) in scenarios {
        say(&format!("profiling {name} for {} s", config.profile_seconds));
        let data = dir.join(format!("{name}.perf.data"));
        // The pools' backends live as long as the stack: those there now are the ones working.
        names.extend(roles.postgres_processes().into_iter().map(|p| (p, "postgresql")));
        let pids: Vec<u32> = names.keys().copied().collect();
        let recording = profile::record(&data, &pids, duration);
        closed_loop(&targets(stack), clients, duration, plan).await;
        let outcome = match recording {
            Ok(mut child) => {
                let _ = tokio::task::spawn_blocking(move || child.wait()).await;
                let title = format!("{name}: this run's processes while it runs (role;thread;frames)");
                let data_path = data.clone();
                let (names, dir, name_owned) = (names.clone(), dir.to_path_buf(), name.to_owned());
                tokio::task::spawn_blocking(move || profile::summarize(&data_path, &names, &dir, &name_owned, &title))
                    .await
                    .unwrap_or_else(|e| Err(anyhow::anyhow!("{e}")))
                    .unwrap_or_else(|e| json!({ "failed": e.to_string() }))
            }
            Err(error) => json!({ "failed": error.to_string() }),
        };
        let _ = std::fs::remove_file(&data);
        result.insert(name.to_owned(), outcome);
    }
    Value::Object(result)
}
