//! The writer's command line (`intake-writer`): one module per command group, its flags and
//! what it does with them, returning the JSON object that [`main`] prints. The engine they drive
//! is the rest of the library.

pub mod dlq;
pub mod erase;
pub mod key;
pub mod migrate;
pub mod replay;
pub mod restore;
pub mod run;
pub mod topics;
pub mod workspace;

use clap::{Parser, Subcommand};
use intake_common::config::{init_logging, LogArgs};
use serde_json::Value;

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
    Migrate(migrate::Args),
    /// Consumes write requests and applies them until SIGTERM or SIGINT.
    Run(run::Args),
    /// Creates the requests, replies and dead-letter topics, and sets the retentions below on
    /// those that exist. An existing requests topic with fewer partitions than
    /// --request-partitions is grown, only when that cannot reorder a workspace's messages: the
    /// writers' group has applied everything and nothing was written for --quiet-ms
    /// (deploy/RUNBOOK.md, "More partitions").
    Topics(topics::Args),
    /// The dead-letter topic.
    Dlq(dlq::Args),
    /// Creates, lists, suspends, resumes and deletes workspaces.
    Workspace(workspace::Args),
    /// Creates, lists and revokes a workspace's API keys.
    Key(key::Args),
    /// Applies request messages again from a topic (default: the requests topic). Messages
    /// already applied change nothing, nor do chunks that reached the requests topic after their
    /// deadline or whose request failed at an earlier chunk. Prints {"messages", "applied",
    /// "already_applied", "failed", "expired", "request_failed"}.
    Replay(replay::Args),
    /// What a restore of the database undoes and a replay cannot give back: workspaces, keys
    /// and their revocations, erasures (deploy/RUNBOOK.md, "PostgreSQL restored from a backup: replay").
    Restore(restore::Args),
    /// Erases one person's data; prints {"conversions": N, "visits": M}. The identifier's value
    /// is read from standard input (one line) or --from FILE, never from the command line.
    Erase(erase::Args),
}

/// Parses the command line, runs the command, prints its output and exits.
///
/// Here in the library, not in the binary: rustc compiles a non-generic async fn's body in the
/// crate that polls it, so a binary that awaited the library's futures compiled all of the
/// writer's async code a second time, on one core at the end of the build (35 s of a fresh
/// build's 5 minutes).
#[tokio::main]
pub async fn main() {
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
        Command::Migrate(args) => migrate::execute(args).await,
        Command::Run(args) => run::execute(args).await,
        Command::Topics(args) => topics::execute(args).await,
        Command::Dlq(args) => dlq::execute(args),
        Command::Workspace(args) => workspace::execute(args).await,
        Command::Key(args) => key::execute(args).await,
        Command::Replay(args) => replay::execute(args).await,
        Command::Restore(args) => restore::execute(args).await,
        Command::Erase(args) => erase::execute(args).await,
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every command says what it does in its own words: one without a doc comment of its own
    /// shows, in --help and docs/configuration.md, that of a struct flattened into it.
    #[test]
    fn every_command_says_what_it_does() {
        fn check(command: &clap::Command, path: &str) {
            for sub in command.get_subcommands().filter(|sub| sub.get_name() != "help") {
                let path = format!("{path} {}", sub.get_name());
                let about = sub.get_about().map(ToString::to_string).unwrap_or_default();
                assert!(!about.is_empty() && !about.contains("[`"), "`{path}` says {about:?}");
                check(sub, &path);
            }
        }
        check(&Cli::command(), "intake-writer");
    }
}
