//! `intake-writer`: the only program that writes PostgreSQL. `run` applies request messages;
//! the other subcommands are the operator commands. Every command prints one JSON object on
//! stdout, or exits non-zero with a message on stderr.

mod admin;
mod consume;
mod erase;
mod plan;
mod replay;
mod store;
mod topics;

use clap::{Parser, Subcommand};
use intake_common::config::{init_logging, DatabaseArgs, KafkaArgs, LogArgs};
use serde_json::{json, Value};
use std::process::ExitCode;
use tokio::sync::watch;

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
    /// Applies the database migrations.
    Migrate {
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Consumes write requests and applies them until SIGTERM or SIGINT.
    Run {
        #[command(flatten)]
        database: DatabaseArgs,
        #[command(flatten)]
        kafka: KafkaArgs,
        /// Consumer group shared by all writers.
        #[arg(long, env = "INTAKE_WRITER_GROUP", default_value = "intake-writer")]
        group_id: String,
        /// Attempts at a message failing for a non-transient reason before it is dead-lettered.
        #[arg(long, env = "INTAKE_WRITER_MAX_ATTEMPTS", default_value_t = 3)]
        max_attempts: u32,
        /// Hours an applied message id is remembered (at least the requests topic's retention).
        #[arg(long, env = "INTAKE_REMEMBER_APPLIED_HOURS", default_value_t = 168)]
        remember_applied_hours: u64,
    },
    /// Creates the requests, replies and dead-letter topics (existing ones are left alone).
    Topics {
        #[command(flatten)]
        kafka: KafkaArgs,
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
        #[arg(long, env = "INTAKE_TOPIC_RETENTION_MS", default_value_t = 86_400_000)]
        retention_ms: i64,
    },
    Workspace {
        #[command(subcommand)]
        command: WorkspaceCommand,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    Key {
        #[command(subcommand)]
        command: KeyCommand,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Applies request messages again from a topic (default: the requests topic). Messages
    /// already applied change nothing. Prints {"messages", "applied", "already_applied", "failed"}.
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
        #[command(flatten)]
        kafka: KafkaArgs,
        #[command(flatten)]
        database: DatabaseArgs,
    },
    /// Erases one person's data; prints {"conversions": N, "visits": M}.
    Erase {
        #[arg(long)]
        workspace: String,
        #[command(flatten)]
        identifier: EraseIdentifier,
        /// Default region of --phone.
        #[arg(long, requires = "phone")]
        country: Option<String>,
        #[command(flatten)]
        database: DatabaseArgs,
    },
}

#[derive(clap::Args)]
#[group(required = true, multiple = false)]
struct EraseIdentifier {
    #[arg(long)]
    email: Option<String>,
    #[arg(long)]
    phone: Option<String>,
    #[arg(long)]
    contact_id: Option<String>,
    #[arg(long)]
    visitor_id: Option<String>,
}

#[derive(Subcommand)]
enum WorkspaceCommand {
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
    Suspend { id: String },
    Resume { id: String },
    Delete { id: String },
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
    Revoke { id: String },
}

#[tokio::main]
async fn main() -> ExitCode {
    intake_common::reference::print_if_asked::<Cli>();
    let cli = Cli::parse();
    init_logging(&cli.log);
    match execute(cli.command).await {
        Ok(output) => {
            println!("{output}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("intake-writer: {error:#}");
            ExitCode::FAILURE
        }
    }
}

async fn execute(command: Command) -> anyhow::Result<Value> {
    match command {
        Command::Migrate { database } => {
            let pool = store::connect(&database.url, 1).await?;
            sqlx::migrate!("../migrations").run(&pool).await?;
            Ok(json!({ "migrated": true }))
        }
        Command::Run { database, kafka, group_id, max_attempts, remember_applied_hours } => {
            let pool = store::connect(&database.url, database.pool_size).await?;
            let (stop, shutdown) = watch::channel(false);
            tokio::spawn(async move {
                intake_common::service::shutdown_signal().await;
                tracing::info!("shutdown requested; finishing the message in hand");
                let _ = stop.send(true);
            });
            consume::run(pool, consume::Settings {
                kafka,
                group_id,
                max_attempts,
                remember_applied: std::time::Duration::from_secs(remember_applied_hours * 3600),
            }, shutdown).await?;
            Ok(json!({ "stopped": true }))
        }
        Command::Topics { kafka, request_partitions, reply_partitions, replication, min_insync_replicas, retention_ms } => {
            let counts = topics::TopicCounts { request_partitions, reply_partitions, replication, min_insync_replicas, retention_ms };
            topics::create_topics(&kafka, &counts).await
        }
        Command::Workspace { command, database } => {
            let pool = store::connect(&database.url, 1).await?;
            match command {
                WorkspaceCommand::Create { name, project_id, site_restriction, sites } => {
                    admin::create_workspace(&pool, admin::NewWorkspace { name, project_id, site_restriction, sites }).await
                }
                WorkspaceCommand::Suspend { id } => admin::change_workspace(&pool, &id, admin::WorkspaceChange::Suspend).await,
                WorkspaceCommand::Resume { id } => admin::change_workspace(&pool, &id, admin::WorkspaceChange::Resume).await,
                WorkspaceCommand::Delete { id } => admin::change_workspace(&pool, &id, admin::WorkspaceChange::Delete).await,
            }
        }
        Command::Replay { partition, from_offset, to_offset, from_time, topic, kafka, database } => {
            let pool = store::connect(&database.url, 2).await?;
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
            replay::replay(&pool, &kafka, &topic, start).await
        }
        Command::Erase { workspace, identifier, country, database } => {
            let pool = store::connect(&database.url, 1).await?;
            let identifier = match identifier {
                EraseIdentifier { email: Some(email), .. } => erase::Identifier::Email(email),
                EraseIdentifier { phone: Some(number), .. } => erase::Identifier::Phone { number, country },
                EraseIdentifier { contact_id: Some(id), .. } => erase::Identifier::ContactId(id),
                EraseIdentifier { visitor_id: Some(id), .. } => erase::Identifier::VisitorId(id),
                _ => anyhow::bail!("give one of --email, --phone, --contact-id, --visitor-id"),
            };
            erase::erase(&pool, &workspace, identifier).await
        }
        Command::Key { command, database } => {
            let pool = store::connect(&database.url, 1).await?;
            match command {
                KeyCommand::Create { workspace, scopes } => admin::create_key(&pool, &workspace, &scopes).await,
                KeyCommand::Revoke { id } => admin::revoke_key(&pool, &id).await,
            }
        }
    }
}
