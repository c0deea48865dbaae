//! `intake-writer key`.

use crate::admin;
use crate::durability::DurabilityArgs;
use crate::store::{self, Database};
use intake_common::config::DatabaseArgs;
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: KeyCommand,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
}

#[derive(clap::Subcommand)]
pub enum KeyCommand {
    /// Prints {"id": "key_...", "secret": "svc_live_...", "scopes": [...]}; the secret is shown only here.
    Create {
        #[arg(long)]
        workspace: String,
        #[arg(long, value_delimiter = ',', default_value = "workspace:read,conversions:write")]
        scopes: Vec<String>,
    },
    /// Revokes the key: refused with 401 invalid_api_key from then on (within the gateways' key
    /// cache time); prints {"id", "revoked": true}.
    Revoke {
        /// The key's id (key_...).
        id: String,
    },
    /// Prints {"keys": [{id, scopes, created_at, revoked}]}; never a secret.
    List {
        #[arg(long)]
        workspace: String,
    },
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { command, database, durability } = args;
    let pool = store::connect(&database.url, 1).await?;
    let db = Database::for_command(pool, &durability);
    match command {
        KeyCommand::Create { workspace, scopes } => admin::create_key(&db, &workspace, &scopes).await,
        KeyCommand::Revoke { id } => admin::revoke_key(&db, &id).await,
        KeyCommand::List { workspace } => admin::list_keys(&db.pool, &workspace).await,
    }
}
