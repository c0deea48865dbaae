//! `intake-writer run`: the service itself.

use crate::durability::{Durability, DurabilityArgs, DurabilityCounters};
use crate::primary::Primary;
use crate::store::{self, Database};
use crate::{consume, health, metrics, migrations, ops, retry};
use intake_common::config::{DatabaseArgs, KafkaArgs};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// Consumer group shared by all writers.
    #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
    pub group_id: String,
    /// Attempts at a message failing for a non-transient reason before it is dead-lettered.
    #[arg(long, env = "INTAKE_WRITER_MAX_ATTEMPTS", default_value_t = 3)]
    pub max_attempts: u32,
    /// How long applied message ids are kept beyond the last moment a message can be read
    /// from the requests topic (its retention.ms + segment.ms, read from Kafka), and erasure
    /// tombstones beyond that of the requests and dead-letter topics.
    #[arg(long, env = "INTAKE_RETENTION_MARGIN_MS", default_value_t = 3_600_000)]
    pub retention_margin_ms: u64,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, env = "INTAKE_WRITER_OPS_LISTEN", default_value = "127.0.0.1:8091")]
    pub ops_listen: std::net::SocketAddr,
    /// A writer holding partitions with lag and no progress for this long is stalled: not
    /// ready, intake_writer_stalled = 1, and not healthy (an orchestrator restarts it)
    /// unless it retried an outage of PostgreSQL or Kafka within this time.
    #[arg(long, env = "INTAKE_WRITER_STALL_TIMEOUT_MS", default_value_t = 60_000)]
    pub stall_timeout_ms: u64,
    /// Workspaces applied at once (lanes), each on a database connection of its own while it
    /// applies; a workspace's messages stay in order, one lane at a time. More lanes than
    /// the pool's connections less two add nothing.
    #[arg(long, env = "INTAKE_WRITER_APPLY_LANES", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub apply_lanes: u16,
    /// Memory for request messages read and not yet answered, across all workspaces and
    /// partitions (their parsed size, estimated), in MiB. At the budget the writer pauses
    /// reading, and Kafka keeps the backlog, until three quarters are left; past half of it
    /// each workspace may hold its fair share (the budget over the workspaces holding
    /// messages, plus one), beyond which its messages are left in Kafka and read again once it
    /// is down to half of it, while its partition reads on. librdkafka's prefetch comes on top
    /// (docs/operations.md, "Writer memory").
    #[arg(long, env = "INTAKE_WRITER_READ_BUDGET_MIB", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub read_budget_mib: u32,
    /// A workspace found busy (its lock held by another session) counts as progress of its
    /// partition for /readyz while it has waited less than this; past it, it no longer
    /// does (intake_writer_workspace_waiting_seconds shows the wait).
    #[arg(long, env = "INTAKE_WRITER_WORKSPACE_WAIT_BOUND_MS", default_value_t = 300_000)]
    pub workspace_wait_bound_ms: u64,
    /// statement_timeout of every connection that applies chunks: a statement of a chunk's
    /// own that runs longer is cancelled, retried a bounded number of times, then the chunk
    /// is dead-lettered.
    #[arg(long, env = "INTAKE_WRITER_STATEMENT_TIMEOUT_MS", default_value_t = 15_000)]
    pub statement_timeout_ms: u64,
    /// lock_timeout of every connection that applies chunks: a wait this long for a row
    /// lock another session holds ends, and the workspace is tried again later (never
    /// dead-lettered for it).
    #[arg(long, env = "INTAKE_WRITER_LOCK_TIMEOUT_MS", default_value_t = 2_000)]
    pub lock_timeout_ms: u64,
    /// At SIGTERM, how long the final offset commit and leaving the group may wait for Kafka.
    #[arg(long, env = "INTAKE_WRITER_SHUTDOWN_TIMEOUT_MS", default_value_t = 10_000)]
    pub shutdown_timeout_ms: u64,
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args {
        database,
        durability,
        kafka,
        group_id,
        max_attempts,
        retention_margin_ms,
        ops_listen,
        stall_timeout_ms,
        apply_lanes,
        read_budget_mib,
        workspace_wait_bound_ms,
        statement_timeout_ms,
        lock_timeout_ms,
        shutdown_timeout_ms,
    } = args;
    // Lazy: a writer started while PostgreSQL is down waits for it (the retry policy).
    let timeouts = store::Timeouts {
        statement: Duration::from_millis(statement_timeout_ms),
        lock: Duration::from_millis(lock_timeout_ms),
        // A worker's transaction never waits between statements on anything but them.
        idle_in_transaction: Duration::from_millis(statement_timeout_ms),
    };
    let metrics = Arc::new(metrics::Metrics::new());
    let rehearsals = metrics.connection_rehearsals.clone();
    // The nodes DATABASE_URL names, and the primary among them followed (a single node: itself).
    let primary = Primary::new(&database.url)?;
    let durability = Durability::new(
        primary.options(),
        &durability,
        DurabilityCounters {
            unconfirmed: metrics.unreplicated_commits.clone(),
            rechecked: metrics.confirmations_rechecked.clone(),
        },
    );
    primary.follow(durability.control(), Durability::control_options);
    let health = health::Health::new(metrics, kafka.requests_topic.clone(), Duration::from_millis(stall_timeout_ms));
    let connected = health.clone();
    let observer: store::LineageObserver = Arc::new(move |lineage| connected.connected_to(lineage));
    let pool = store::connect_lazy(&primary, database.pool_size, timeouts, Some(observer), rehearsals);
    tokio::spawn(store::open_ready_connections(pool.clone()));
    tokio::spawn(ops::serve(tokio::net::TcpListener::bind(ops_listen).await?, health.clone()));
    let (stop, shutdown) = watch::channel(false);
    tokio::spawn(primary.clone().follow_changes(shutdown.clone()));
    let signalled = health.clone();
    tokio::spawn(async move {
        intake_common::service::shutdown_signal().await;
        tracing::info!("shutdown requested; finishing the messages in hand");
        signalled.shutting_down();
        let _ = stop.send(true);
    });
    let settings = consume::Settings {
        kafka,
        group_id,
        remember_applied: Duration::from_millis(retention_margin_ms),
        policy: retry::Policy {
            max_attempts,
            first_backoff: Duration::from_millis(50),
            // Part of every outage's length: a database back (or a new primary
            // promoted) is found within 2 s. A retry is one connection attempt per
            // worker, no load worth spacing out further.
            max_backoff: Duration::from_secs(2),
        },
        workers: usize::from(apply_lanes),
        read_budget: usize::try_from(read_budget_mib).unwrap_or(usize::MAX) << 20,
        wait_bound: Duration::from_millis(workspace_wait_bound_ms),
        shutdown_timeout: Duration::from_millis(shutdown_timeout_ms),
    };
    if wait_for_schema(&pool, &health, shutdown.clone()).await? {
        let schema_behind = health.metrics.schema_behind.clone();
        let moves = primary.moves();
        consume::run(Database { pool, durability, schema_behind, moves }, settings, health, shutdown).await?;
    }
    Ok(json!({ "stopped": true }))
}

/// Waits, not ready and reading no message, until the database answers that it has every
/// migration this build's statements use (a writer rolled out before `migrate` waits for it):
/// applying then would fail every chunk. A database that does not answer (a failover, an
/// outage) is asked again until it does: the check is never skipped. False if shutdown came
/// first; an error, and no start, if an applied migration differs from this build's file.
async fn wait_for_schema(
    pool: &sqlx::PgPool,
    health: &health::Health,
    mut shutdown: watch::Receiver<bool>,
) -> anyhow::Result<bool> {
    let mut told = None;
    health.schema_behind(true);
    loop {
        if let Ok(drifted) = migrations::drifted(pool).await {
            anyhow::ensure!(
                drifted.is_empty(),
                "the database's applied migrations differ from this build's: {}; see deploy/RUNBOOK.md, \"Schema migrations\"",
                drifted.join("; ")
            );
        }
        let state = match migrations::missing(pool).await {
            Ok(missing) if missing.is_empty() => break,
            Ok(missing) => format!(
                "the database lacks migrations this version uses ({missing:?}); waiting for `intake-writer migrate`"
            ),
            Err(error) => format!("the database's migrations could not be read ({error}); asking again"),
        };
        if told.as_ref() != Some(&state) {
            tracing::error!("{state}");
            told = Some(state);
        }
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = shutdown.changed() => return Ok(false),
        }
    }
    if told.is_some() {
        tracing::info!("the database has every migration this version uses; starting");
    }
    health.schema_behind(false);
    Ok(true)
}
