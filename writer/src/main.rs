//! `intake-writer`: the only program that writes PostgreSQL. `run` applies request messages;
//! the other subcommands are the operator commands. Every command prints one JSON object on
//! stdout, or exits non-zero with a message on stderr.

mod commands;

use clap::{Parser, Subcommand};
use intake_common::config::{init_logging, LogArgs};
use serde_json::Value;

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
    Migrate(commands::migrate::Args),
    /// Consumes write requests and applies them until SIGTERM or SIGINT.
    Run(commands::run::Args),
    /// Creates the requests, replies and dead-letter topics, and sets the retentions below on
    /// those that exist. An existing requests topic with fewer partitions than
    /// --request-partitions is grown, only when that cannot reorder a workspace's messages: the
    /// writers' group has applied everything and nothing was written for --quiet-ms
    /// (deploy/RUNBOOK.md, "More partitions").
    Topics(commands::topics::Args),
    /// The dead-letter topic.
    Dlq(commands::dlq::Args),
    Workspace(commands::workspace::Args),
    Key(commands::key::Args),
    /// Applies request messages again from a topic (default: the requests topic). Messages
    /// already applied change nothing, nor do chunks that reached the requests topic after their
    /// deadline or whose request failed at an earlier chunk. Prints {"messages", "applied",
    /// "already_applied", "failed", "expired", "request_failed"}.
    Replay(commands::replay::Args),
    /// What a restore of the database undoes and a replay cannot give back: workspaces, keys
    /// and their revocations, erasures (deploy/RUNBOOK.md, "PostgreSQL restored from a backup: replay").
    Restore(commands::restore::Args),
    /// Erases one person's data; prints {"conversions": N, "visits": M}. The identifier's value
    /// is read from standard input (one line) or --from FILE, never from the command line.
    Erase(commands::erase::Args),
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

async fn execute(command: Command) -> anyhow::Result<Value> {
    match command {
        Command::Migrate(args) => commands::migrate::execute(args).await,
        Command::Run(args) => commands::run::execute(args).await,
        Command::Topics(args) => commands::topics::execute(args).await,
        Command::Dlq(args) => commands::dlq::execute(args),
        Command::Workspace(args) => commands::workspace::execute(args).await,
        Command::Key(args) => commands::key::execute(args).await,
        Command::Replay(args) => commands::replay::execute(args).await,
        Command::Restore(args) => commands::restore::execute(args).await,
        Command::Erase(args) => commands::erase::execute(args).await,
    }
}
