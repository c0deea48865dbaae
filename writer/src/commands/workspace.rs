//! `intake-writer workspace`.

use crate::admin;
use crate::durability::DurabilityArgs;
use crate::store::{self, Database};
use intake_common::config::DatabaseArgs;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: WorkspaceCommand,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
}

#[derive(clap::Subcommand)]
pub enum WorkspaceCommand {
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
    /// Suspends the workspace: its keys are refused with 403 workspace_suspended (within the
    /// gateways' key cache time) until it is resumed; prints {"id", "status"}.
    Suspend {
        /// The workspace's id (ws_...).
        id: String,
    },
    /// Ends the workspace's suspension; prints {"id", "status"}.
    Resume {
        /// The workspace's id (ws_...).
        id: String,
    },
    /// Marks the workspace deleted: its data stays, its keys answer 404 workspace_not_found;
    /// prints {"id", "deleted": true}.
    Delete {
        /// The workspace's id (ws_...).
        id: String,
    },
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { command, database, durability } = args;
    let pool = store::connect(&database.url, 1).await?;
    let db = Database::for_command(pool, &durability);
    match command {
        WorkspaceCommand::Create { name, project_id, site_restriction, sites } => {
            admin::create_workspace(&db, admin::NewWorkspace { name, project_id, site_restriction, sites }).await
        }
        WorkspaceCommand::List => admin::list_workspaces(&db.pool).await,
        WorkspaceCommand::Suspend { id } => admin::change_workspace(&db, &id, admin::WorkspaceChange::Suspend).await,
        WorkspaceCommand::Resume { id } => admin::change_workspace(&db, &id, admin::WorkspaceChange::Resume).await,
        WorkspaceCommand::Delete { id } => admin::change_workspace(&db, &id, admin::WorkspaceChange::Delete).await,
    }
}
