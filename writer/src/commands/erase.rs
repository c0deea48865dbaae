//! `intake-writer erase`.

use crate::durability::DurabilityArgs;
use crate::erase;
use crate::store::{self, Database};
use intake_common::config::{DatabaseArgs, KafkaArgs};
use serde_json::Value;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    pub workspace: String,
    #[command(flatten)]
    pub kind: EraseKind,
    /// Default region of --phone.
    #[arg(long, requires = "phone")]
    pub country: Option<String>,
    /// A file whose first line is the identifier's value (default: standard input).
    #[arg(long)]
    pub from: Option<std::path::PathBuf>,
    /// The erasure is recorded in the requests topic once applied, so that a rewind or a
    /// replay that applies the person's data again erases it again.
    #[command(flatten)]
    pub kafka: KafkaArgs,
    #[command(flatten)]
    pub database: DatabaseArgs,
    #[command(flatten)]
    pub durability: DurabilityArgs,
}

/// Which identifier the value on standard input is.
#[derive(clap::Args)]
#[group(required = true, multiple = false)]
pub struct EraseKind {
    #[arg(long)]
    email: bool,
    #[arg(long)]
    phone: bool,
    #[arg(long)]
    contact_id: bool,
    #[arg(long)]
    visitor_id: bool,
}

pub async fn execute(args: Args) -> anyhow::Result<Value> {
    let Args { workspace, kind, country, from, kafka, database, durability } = args;
    let value = erase::read_value(from.as_deref())?;
    let identifier = match kind {
        EraseKind { email: true, .. } => erase::Identifier::Email(value),
        EraseKind { phone: true, .. } => erase::Identifier::Phone { number: value, country },
        EraseKind { contact_id: true, .. } => erase::Identifier::ContactId(value),
        EraseKind { visitor_id: true, .. } => erase::Identifier::VisitorId(value),
        _ => anyhow::bail!("give one of --email, --phone, --contact-id, --visitor-id"),
    };
    let pool = store::connect_with(&database.url, 1, store::OPERATOR_TIMEOUTS).await?;
    let db = Database::for_command(pool, &durability);
    let (erased, record) = erase::erase(&db, &workspace, identifier).await?;
    erase::record(&kafka, &record).await.map_err(|error| {
        error.context(
            "the erasure is applied, but not recorded in the requests topic, so a promotion or a restore could \
             undo it: run the command again (erasing again is harmless)",
        )
    })?;
    Ok(erased)
}
