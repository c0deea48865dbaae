//! `intake-writer`: the only program that writes PostgreSQL. `run` applies request messages;
//! the other subcommands are the operator commands. Every command prints one JSON object on
//! stdout, or exits non-zero with a message on stderr.

mod admin;
mod apply;
mod bench;
mod consume;
mod dlq;
mod durability;
mod erase;
mod expiry;
mod health;
mod inbox;
mod lookups;
mod metrics;
mod migrations;
mod ops;
mod outbox;
mod partitions;
mod plan;
mod positions;
mod read;
mod replay;
mod restore;
mod retention;
mod retry;
mod rewind;
mod schedule;
mod store;
mod topics;

use clap::{Parser, Subcommand};
use durability::{Durability, DurabilityArgs};
use intake_common::config::{init_logging, DatabaseArgs, KafkaArgs, LogArgs};
use prometheus_client::metrics::counter::Counter;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use store::Database;
use tokio::sync::watch;

/// See the workspace Cargo.toml: the allocator showed in the profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "intake-writer", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    #[command(flatten)]
    log: LogArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Applies the database migrations, all but those that remove what the previous version's
    /// binaries use (printed as "waiting_for_contract").
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
        /// Also applies those: once no binary of the previous version runs, and on a new
        /// database. Refused while a member of the writers' consumer group runs a build older
        /// than one of them (its Kafka client.id names the newest migration it knows), and
        /// when Kafka does not answer.
        #[arg(long)]
        contract: bool,
        /// Applies none past this version: a rollout staged one migration at a time, or a
        /// database brought to an earlier version's schema.
        #[arg(long, value_name = "VERSION")]
        through: Option<i64>,
        /// The writers' consumer group, whose members --contract checks.
        #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
        group_id: String,
        /// --contract without asking Kafka which writers run: only for a database no writer
        /// reads Kafka for (a benchmark's, a copy).
        #[arg(long, requires = "contract")]
        skip_writer_check: bool,
        #[command(flatten)]
        kafka: KafkaArgs,
    },
    /// Consumes write requests and applies them until SIGTERM or SIGINT.
    Run {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
        #[command(flatten)]
        kafka: KafkaArgs,
        /// Consumer group shared by all writers.
        #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
        group_id: String,
        /// Attempts at a message failing for a non-transient reason before it is dead-lettered.
        #[arg(long, env = "INTAKE_WRITER_MAX_ATTEMPTS", default_value_t = 3)]
        max_attempts: u32,
        /// How long applied message ids are kept beyond the last moment a message can be read
        /// from the requests topic (its retention.ms + segment.ms, read from Kafka), and erasure
        /// tombstones beyond that of the requests and dead-letter topics.
        #[arg(long, env = "INTAKE_RETENTION_MARGIN_MS", default_value_t = 3_600_000)]
        retention_margin_ms: u64,
        /// Address of /healthz, /readyz and /metrics.
        #[arg(long, env = "INTAKE_WRITER_OPS_LISTEN", default_value = "127.0.0.1:8091")]
        ops_listen: std::net::SocketAddr,
        /// A writer holding partitions with lag and no progress for this long is stalled: not
        /// ready, intake_writer_stalled = 1, and not healthy (an orchestrator restarts it)
        /// unless it retried an outage of PostgreSQL or Kafka within this time.
        #[arg(long, env = "INTAKE_WRITER_STALL_TIMEOUT_MS", default_value_t = 60_000)]
        stall_timeout_ms: u64,
        /// Workspaces applied at once (lanes), each on a database connection of its own while it
        /// applies; a workspace's messages stay in order, one lane at a time. More lanes than
        /// the pool's connections less two add nothing.
        #[arg(long, env = "INTAKE_WRITER_APPLY_LANES", default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=64))]
        apply_lanes: u16,
        /// Memory for request messages read and not yet answered, across all workspaces and
        /// partitions (their parsed size, estimated), in MiB. At the budget the writer pauses
        /// reading, and Kafka keeps the backlog, until three quarters are left; past half of it
        /// each workspace may hold its fair share (the budget over the workspaces holding
        /// messages, plus one), beyond which it pauses its own partition. librdkafka's prefetch
        /// comes on top (docs/operations.md, "Writer memory").
        #[arg(long, env = "INTAKE_WRITER_READ_BUDGET_MIB", default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65_536))]
        read_budget_mib: u32,
        /// A workspace found busy (its lock held by another session) counts as progress of its
        /// partition for /readyz while it has waited less than this; past it, it no longer
        /// does (intake_writer_workspace_waiting_seconds shows the wait).
        #[arg(long, env = "INTAKE_WRITER_WORKSPACE_WAIT_BOUND_MS", default_value_t = 300_000)]
        workspace_wait_bound_ms: u64,
        /// statement_timeout of every connection that applies chunks: a statement of a chunk's
        /// own that runs longer is cancelled, retried a bounded number of times, then the chunk
        /// is dead-lettered.
        #[arg(long, env = "INTAKE_WRITER_STATEMENT_TIMEOUT_MS", default_value_t = 15_000)]
        statement_timeout_ms: u64,
        /// lock_timeout of every connection that applies chunks: a wait this long for a row
        /// lock another session holds ends, and the workspace is tried again later (never
        /// dead-lettered for it).
        #[arg(long, env = "INTAKE_WRITER_LOCK_TIMEOUT_MS", default_value_t = 2_000)]
        lock_timeout_ms: u64,
        /// At SIGTERM, how long the final offset commit and leaving the group may wait for Kafka.
        #[arg(long, env = "INTAKE_WRITER_SHUTDOWN_TIMEOUT_MS", default_value_t = 10_000)]
        shutdown_timeout_ms: u64,
    },
    /// Creates the requests, replies and dead-letter topics, and sets the retentions below on
    /// those that exist. An existing requests topic with fewer partitions than
    /// --request-partitions is grown, only when that cannot reorder a workspace's messages: the
    /// writers' group has applied everything and nothing was written for --quiet-ms
    /// (deploy/RUNBOOK.md, "More partitions").
    Topics {
        #[command(flatten)]
        kafka: KafkaArgs,
        /// The writers' consumer group, whose progress a growth of the requests topic checks.
        #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
        group_id: String,
        /// How long the requests topic must stay unwritten before it is grown.
        #[arg(long, default_value_t = 5_000)]
        quiet_ms: u64,
        #[arg(long, env = "INTAKE_REQUEST_PARTITIONS", default_value_t = 8)]
        request_partitions: i32,
        /// One per gateway instance.
        #[arg(long, env = "INTAKE_REPLY_PARTITIONS", default_value_t = 8)]
        reply_partitions: i32,
        #[arg(long, env = "INTAKE_TOPIC_REPLICATION", default_value_t = 1)]
        replication: i32,
        /// Default: 2 at replication 3 or more, else 1.
        #[arg(long, env = "INTAKE_TOPIC_MIN_INSYNC_REPLICAS")]
        min_insync_replicas: Option<i32>,
        /// Of the requests and replies topics; also how long the writer remembers applied
        /// message ids (this plus the segment length and --retention-margin-ms).
        #[arg(long, env = "INTAKE_TOPIC_RETENTION_MS", default_value_t = 86_400_000, value_parser = clap::value_parser!(i64).range(10_000..))]
        retention_ms: i64,
        /// Of the dead-letter topic (default 14 days).
        #[arg(long, env = "INTAKE_DLQ_RETENTION_MS", default_value_t = 1_209_600_000, value_parser = clap::value_parser!(i64).range(10_000..))]
        dlq_retention_ms: i64,
        /// Also lowers the retention of a topic that has a longer one (raised by an operator,
        /// during an incident): without it, a longer retention is kept and reported.
        #[arg(long)]
        lower_retention: bool,
    },
    /// The dead-letter topic.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
        #[command(flatten)]
        kafka: KafkaArgs,
    },
    Workspace {
        #[command(subcommand)]
        command: WorkspaceCommand,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
    },
    Key {
        #[command(subcommand)]
        command: KeyCommand,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
    },
    /// Applies request messages again from a topic (default: the requests topic). Messages
    /// already applied change nothing, nor do chunks that reached the requests topic after their
    /// deadline or whose request failed at an earlier chunk. Prints {"messages", "applied",
    /// "already_applied", "failed", "expired", "request_failed"}.
    Replay {
        #[arg(long, requires = "from_offset", conflicts_with = "from_time")]
        partition: Option<i32>,
        #[arg(long, requires = "partition")]
        from_offset: Option<i64>,
        /// Last offset to replay (inclusive); default: the current end.
        #[arg(long, requires = "from_offset")]
        to_offset: Option<i64>,
        /// RFC 3339 time; every partition from its first message at or after it.
        #[arg(long, required_unless_present = "partition")]
        from_time: Option<String>,
        /// Topic to read; e.g. the dead-letter topic once a failure's cause is fixed.
        #[arg(long)]
        topic: Option<String>,
        /// Says what would be applied, and changes nothing.
        #[arg(long)]
        dry_run: bool,
        /// Replays although the topic no longer holds the start asked for (its retention
        /// deleted the oldest messages): what was written in the gap is lost to the replay, and
        /// the summary and the log say how much.
        #[arg(long)]
        accept_loss: bool,
        #[command(flatten)]
        kafka: KafkaArgs,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
    },
    /// What a restore of the database undoes and a replay cannot give back: workspaces, keys
    /// and their revocations, erasures (deploy/RUNBOOK.md, "PostgreSQL restored from a backup: replay").
    Restore {
        #[command(subcommand)]
        command: RestoreCommand,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
    },
    /// The direct_apply baseline of deploy/bench.sh (writer/src/bench.rs); not an operator command.
    #[command(hide = true)]
    BenchApply {
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
    },
    /// Erases one person's data; prints {"conversions": N, "visits": M}. The identifier's value
    /// is read from standard input (one line) or --from FILE, never from the command line.
    Erase {
        #[arg(long)]
        workspace: String,
        #[command(flatten)]
        kind: EraseKind,
        /// Default region of --phone.
        #[arg(long, requires = "phone")]
        country: Option<String>,
        /// A file whose first line is the identifier's value (default: standard input).
        #[arg(long)]
        from: Option<std::path::PathBuf>,
        /// The erasure is recorded in the requests topic once applied, so that a rewind or a
        /// replay that applies the person's data again erases it again.
        #[command(flatten)]
        kafka: KafkaArgs,
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        durability: DurabilityArgs,
    },
}

/// Which identifier the value on standard input is.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct EraseKind {
    #[arg(long)]
    email: bool,
    #[arg(long)]
    phone: bool,
    #[arg(long)]
    contact_id: bool,
    #[arg(long)]
    visitor_id: bool,
}

#[derive(Subcommand)]
enum DlqCommand {
    /// Prints {"topic", "total", "messages": [{partition, offset, reason, error, source_topic,
    /// source_partition, source_offset, attempts, age_seconds, workspace_id, items}]}; never the items.
    Inspect {
        /// Messages printed at most.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
}

#[derive(Subcommand)]
enum RestoreCommand {
    /// Before the restore: saves workspaces, keys and erasures' tombstones to a new file (mode
    /// 0600; key secrets only as their hashes). Prints {"exported_to", "exported_at",
    /// "workspaces", "keys", "erasures"}.
    Export {
        #[arg(long)]
        to: std::path::PathBuf,
    },
    /// After the restore, before the replay: puts them back. Prints {"workspaces": {"created",
    /// "updated"}, "sites_added", "keys": {"created", "revoked"}, "erasures": {"applied",
    /// "present"}}; a second run changes nothing.
    Apply {
        #[arg(long)]
        from: std::path::PathBuf,
    },
}

#[derive(Subcommand)]
enum WorkspaceCommand {
    /// Prints {"workspaces": [...]}.
    List,
    /// Prints {"id": "ws_..."}.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        project_id: Option<String>,
        #[arg(long, default_value = "any")]
        site_restriction: String,
        #[arg(long = "site")]
        sites: Vec<String>,
    },
    Suspend {
        id: String,
    },
    Resume {
        id: String,
    },
    Delete {
        id: String,
    },
}

#[derive(Subcommand)]
enum KeyCommand {
    /// Prints {"id": "key_...", "secret": "svc_live_...", "scopes": [...]}; the secret is shown only here.
    Create {
        #[arg(long)]
        workspace: String,
        #[arg(long, value_delimiter = ',', default_value = "workspace:read,conversions:write")]
        scopes: Vec<String>,
    },
    Revoke {
        id: String,
    },
    /// Prints {"keys": [{id, scopes, created_at, revoked}]}; never a secret.
    List {
        #[arg(long)]
        workspace: String,
    },
}

#[tokio::main]
async fn main() {
    intake_common::reference::print_if_asked::<Cli>();
    let cli = Cli::parse();
    let log = init_logging(&cli.log);
    // An explicit exit: a blocking task still waiting for an unreachable broker at shutdown
    // must not hold the process (the writer's shutdown is bounded, docs/operations.md, "Shutdown").
    // The log is written out first.
    let outcome = execute(cli.command).await;
    drop(log);
    match outcome {
        Ok(output) => {
            println!("{output}");
            std::process::exit(0)
        }
        Err(error) => {
            eprintln!("intake-writer: {error:#}");
            std::process::exit(1)
        }
    }
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

async fn execute(command: Command) -> anyhow::Result<Value> {
    match command {
        Command::Migrate { database, durability, contract, through, group_id, skip_writer_check, kafka } => {
            let pool = store::connect(&database.url, 1).await?;
            if contract && !skip_writer_check {
                migrations::refuse_older_writers(&pool, &kafka, &group_id, through).await?;
            }
            let stage = if contract { migrations::Stage::Contract } else { migrations::Stage::Expand };
            let waiting = migrations::run(&pool, stage, through).await?;
            let durability = Durability::new(&database.url, &durability, Counter::default())?;
            durability.confirm(&mut *pool.acquire().await?).await?;
            Ok(json!({ "migrated": true, "waiting_for_contract": waiting }))
        }
        Command::Run {
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
        } => {
            // Lazy: a writer started while PostgreSQL is down waits for it (the retry policy).
            let timeouts = store::Timeouts {
                statement: Duration::from_millis(statement_timeout_ms),
                lock: Duration::from_millis(lock_timeout_ms),
                // A worker's transaction never waits between statements on anything but them.
                idle_in_transaction: Duration::from_millis(statement_timeout_ms),
            };
            let metrics = Arc::new(metrics::Metrics::new());
            let durability = Durability::new(&database.url, &durability, metrics.unreplicated_commits.clone())?;
            let health =
                health::Health::new(metrics, kafka.requests_topic.clone(), Duration::from_millis(stall_timeout_ms));
            let connected = health.clone();
            let observer: store::LineageObserver = Arc::new(move |lineage| connected.connected_to(lineage));
            let pool = store::connect_lazy(&database.url, database.pool_size, timeouts, Some(observer))?;
            tokio::spawn(ops::serve(tokio::net::TcpListener::bind(ops_listen).await?, health.clone()));
            let (stop, shutdown) = watch::channel(false);
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
                consume::run(Database { pool, durability, schema_behind }, settings, health, shutdown).await?;
            }
            Ok(json!({ "stopped": true }))
        }
        Command::Topics {
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
        } => {
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
        Command::Dlq { command: DlqCommand::Inspect { limit }, kafka } => {
            tokio::task::block_in_place(|| dlq::inspect(&kafka, limit))
        }
        Command::Workspace { command, database, durability } => {
            let pool = store::connect(&database.url, 1).await?;
            let db = Database {
                pool,
                durability: Durability::new(&database.url, &durability, Counter::default())?,
                schema_behind: Default::default(),
            };
            match command {
                WorkspaceCommand::Create { name, project_id, site_restriction, sites } => {
                    admin::create_workspace(&db, admin::NewWorkspace { name, project_id, site_restriction, sites })
                        .await
                }
                WorkspaceCommand::List => admin::list_workspaces(&db.pool).await,
                WorkspaceCommand::Suspend { id } => {
                    admin::change_workspace(&db, &id, admin::WorkspaceChange::Suspend).await
                }
                WorkspaceCommand::Resume { id } => {
                    admin::change_workspace(&db, &id, admin::WorkspaceChange::Resume).await
                }
                WorkspaceCommand::Delete { id } => {
                    admin::change_workspace(&db, &id, admin::WorkspaceChange::Delete).await
                }
            }
        }
        Command::Replay {
            partition,
            from_offset,
            to_offset,
            from_time,
            topic,
            dry_run,
            accept_loss,
            kafka,
            database,
            durability,
        } => {
            let pool = store::connect_with(&database.url, 2, store::OPERATOR_TIMEOUTS).await?;
            let db = Database {
                pool,
                durability: Durability::new(&database.url, &durability, Counter::default())?,
                schema_behind: Default::default(),
            };
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
        Command::Restore { command, database, durability } => {
            let pool = store::connect_with(&database.url, 1, store::OPERATOR_TIMEOUTS).await?;
            match command {
                RestoreCommand::Export { to } => restore::save(&restore::export(&pool).await?, &to),
                RestoreCommand::Apply { from } => {
                    let export = restore::load(&from)?;
                    let db = Database {
                        pool,
                        durability: Durability::new(&database.url, &durability, Counter::default())?,
                        schema_behind: Default::default(),
                    };
                    restore::apply(&db, &export).await
                }
            }
        }
        Command::BenchApply { from, seconds, concurrency, database, durability } => {
            let pool = store::connect(&database.url, u32::try_from(concurrency).unwrap_or(1).max(1)).await?;
            let db = Database {
                pool,
                durability: Durability::new(&database.url, &durability, Counter::default())?,
                schema_behind: Default::default(),
            };
            bench::apply_batches(&db, &bench::Settings { from, duration: Duration::from_secs(seconds), concurrency })
                .await
        }
        Command::Erase { workspace, kind, country, from, kafka, database, durability } => {
            let value = erase::read_value(from.as_deref())?;
            let identifier = match kind {
                EraseKind { email: true, .. } => erase::Identifier::Email(value),
                EraseKind { phone: true, .. } => erase::Identifier::Phone { number: value, country },
                EraseKind { contact_id: true, .. } => erase::Identifier::ContactId(value),
                EraseKind { visitor_id: true, .. } => erase::Identifier::VisitorId(value),
                _ => anyhow::bail!("give one of --email, --phone, --contact-id, --visitor-id"),
            };
            let pool = store::connect_with(&database.url, 1, store::OPERATOR_TIMEOUTS).await?;
            let db = Database {
                pool,
                durability: Durability::new(&database.url, &durability, Counter::default())?,
                schema_behind: Default::default(),
            };
            let (erased, record) = erase::erase(&db, &workspace, identifier).await?;
            erase::record(&kafka, &record).await.map_err(|error| {
                error.context(
                    "the erasure is applied, but not recorded in the requests topic, so a promotion or a restore could \
                     undo it: run the command again (erasing again is harmless)",
                )
            })?;
            Ok(erased)
        }
        Command::Key { command, database, durability } => {
            let pool = store::connect(&database.url, 1).await?;
            let db = Database {
                pool,
                durability: Durability::new(&database.url, &durability, Counter::default())?,
                schema_behind: Default::default(),
            };
            match command {
                KeyCommand::Create { workspace, scopes } => admin::create_key(&db, &workspace, &scopes).await,
                KeyCommand::Revoke { id } => admin::revoke_key(&db, &id).await,
                KeyCommand::List { workspace } => admin::list_keys(&db.pool, &workspace).await,
            }
        }
    }
}
