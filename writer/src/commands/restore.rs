//! `intake-writer restore`.

use crate::durability::DurabilityArgs;
use crate::restore;
use crate::store::{self, Database};
use intake_common::config::DatabaseArgs;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: RestoreCommand,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
}

#[derive(clap::Subcommand)]
pub enum RestoreCommand {
    /// Before the restore: saves workspaces, keys and erasures' tombstones to a new file (mode
    /// 0600; key secrets only as their hashes). Prints {"exported_to", "exported_at",
    /// "workspaces", "keys", "erasures"}.
    Export {
        #[arg(long)]
        to: std::path::PathBuf,
    },
    /// After the restore, before the replay: puts them back. Prints {"workspaces": {"created",
    /// "updated"}, "sites_added", "keys": {"created", "revoked"}, "erasures": {"applied",
    /// "present", "to_run_again"}}; a second run changes nothing. Refuses an export that lacks a
    /// workspace the database has.
    Apply {
        #[arg(long)]
        from: std::path::PathBuf,
    },
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { command, database, durability } = args;
    let pool = store::connect_with(&database.url, 1, store::OPERATOR_TIMEOUTS).await?;
    match command {
        RestoreCommand::Export { to } => restore::save(&restore::export(&pool).await?, &to),
        RestoreCommand::Apply { from } => {
            let export = restore::load(&from)?;
            let db = Database::for_command(pool, &durability);
            restore::apply(&db, &export).await
        }
    }
}
