//! Erasure of one person's data (docs/api.md, "Erasure"): their visits and matches are deleted, the
//! identifiers on their conversions cleared; the conversions stay, so counts stay. The
//! identifier is normalized and hashed exactly as on receipt, and never stored or logged.

use crate::lookups;
use crate::store::Database;
use anyhow::bail;
use intake_common::conversion::Conversion;
use intake_common::normalize;
use serde_json::{json, Value};
use sqlx::Connection;

pub enum Identifier {
    Email(String),
    Phone { number: String, country: Option<String> },
    ContactId(String),
    VisitorId(String),
}

impl Identifier {
    fn kind(&self) -> &'static str {
        match self {
            Identifier::Email(_) => "email",
            Identifier::Phone { .. } => "phone",
            Identifier::ContactId(_) => "contact_id",
            Identifier::VisitorId(_) => "visitor_id",
        }
    }

    /// The statement that finds the conversions carrying the identifier, and the value it
    /// compares with.
    fn lookup(&self) -> anyhow::Result<(&'static str, String)> {
        Ok(match self {
            Identifier::Email(email) => match normalize::email_hash(email) {
                Some(hash) => (lookups::PERSON_BY_EMAIL, hash.as_str().to_owned()),
                None => bail!("--email is not a usable email address"),
            },
            Identifier::Phone { number, country } => {
                let country = country.as_deref().map(str::to_ascii_uppercase);
                match normalize::phone_hash(number, country.as_deref()) {
                    Some(hash) => (lookups::PERSON_BY_PHONE, hash.as_str().to_owned()),
                    None => bail!("--phone cannot be parsed (give --country, or a leading +)"),
                }
            }
            Identifier::ContactId(id) => (lookups::PERSON_BY_CONTACT, id.clone()),
            Identifier::VisitorId(id) => (lookups::PERSON_BY_VISITOR, id.clone()),
        })
    }
}

/// One of the person's conversions and the identifiers it carries (visitor id: its 16 characters).
struct Person {
    id: String,
    visitor_id: Option<String>,
    click_id: Option<String>,
    contact_id: Option<String>,
    email_sha256: Option<String>,
    phone_sha256: Option<String>,
}

/// Read by column name, as sqlx's derive would (the writer builds without sqlx's macros).
impl sqlx::FromRow<'_, sqlx::postgres::PgRow> for Person {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        use sqlx::Row;
        Ok(Person {
            id: row.try_get("id")?,
            visitor_id: row.try_get("visitor_id")?,
            click_id: row.try_get("click_id")?,
            contact_id: row.try_get("contact_id")?,
            email_sha256: row.try_get("email_sha256")?,
            phone_sha256: row.try_get("phone_sha256")?,
        })
    }
}

/// The identifiers of a set of conversions, as arrays to bind.
#[derive(Default)]
struct Identifiers {
    visitor_ids: Vec<String>,
    click_ids: Vec<String>,
    contact_ids: Vec<String>,
    email_hashes: Vec<String>,
    phone_hashes: Vec<String>,
}

impl Identifiers {
    fn of(people: &[Person]) -> Self {
        let collect = |field: fn(&Person) -> &Option<String>| {
            let mut values: Vec<String> = people.iter().filter_map(|p| field(p).clone()).collect();
            values.sort_unstable();
            values.dedup();
            values
        };
        Identifiers {
            visitor_ids: collect(|p| &p.visitor_id),
            click_ids: collect(|p| &p.click_id),
            contact_ids: collect(|p| &p.contact_id),
            email_hashes: collect(|p| &p.email_sha256),
            phone_hashes: collect(|p| &p.phone_sha256),
        }
    }

    /// The digests an erasure's tombstone keeps: the identifiers that put a conversion among
    /// the person's (docs/architecture.md, "Privacy": contact and visitor ids, email and phone hashes).
    fn digests(&self) -> Vec<String> {
        let mut digests: Vec<String> = [
            (Kind::VisitorId, &self.visitor_ids),
            (Kind::ContactId, &self.contact_ids),
            (Kind::Email, &self.email_hashes),
            (Kind::Phone, &self.phone_hashes),
        ]
        .into_iter()
        .flat_map(|(kind, values)| values.iter().map(move |value| digest(kind, value)))
        .collect();
        digests.sort_unstable();
        digests.dedup();
        digests
    }
}

/// The kinds of identifier a tombstone holds.
#[derive(Clone, Copy)]
enum Kind {
    VisitorId,
    ContactId,
    Email,
    Phone,
}

/// SHA-256 of `kind:value`, hex: what a tombstone keeps instead of the identifier.
fn digest(kind: Kind, value: &str) -> String {
    use sha2::{Digest, Sha256};
    let kind = match kind {
        Kind::VisitorId => "visitor_id",
        Kind::ContactId => "contact_id",
        Kind::Email => "email_sha256",
        Kind::Phone => "phone_sha256",
    };
    let hash = Sha256::new().chain_update(kind).chain_update(":").chain_update(value).finalize();
    hash.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// Erases the person in one transaction under the workspace's write lock. Every lookup is
/// answered by an index (crate::lookups), so the lock is held for milliseconds whatever the
/// workspace's size. What was sent before the erasure but is applied after it (in Kafka still,
/// or replayed, or redriven from the dead letters) is covered by the tombstone written here:
/// see [`Tombstones`].
pub async fn erase(db: &Database, workspace_id: &str, identifier: Identifier) -> anyhow::Result<Value> {
    let (lookup, value) = identifier.lookup()?;
    let started = std::time::Instant::now();
    let mut connection = db.pool.acquire().await?;
    let mut tx = connection.begin().await?;
    // The same lock as a chunk write: an erasure never interleaves with a write of the
    // workspace. With the backend's id, for a commit whose wait for the standby is cancelled.
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid() FROM pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(workspace_id)
        .fetch_one(&mut *tx)
        .await?;
    let locked = std::time::Instant::now();
    // Every statement below is a union of indexed lookups; the planner is held to them even on
    // a table whose statistics lag behind a bulk load (a stale estimate must not turn a lookup
    // into a scan of the workspace under its lock).
    sqlx::query("SET LOCAL enable_seqscan = off").execute(&mut *tx).await?;
    // The erasure's instant: items received before it are the person's data, erased here if
    // applied already, by the tombstone if applied later; items received after it are a later
    // send (docs/api.md, "Erasure"), and cannot have been applied yet, since applying takes the lock held here.
    let erased_at: Option<(String, time::OffsetDateTime)> =
        sqlx::query_as("SELECT id, clock_timestamp() FROM workspaces WHERE id = $1")
            .bind(workspace_id)
            .fetch_optional(&mut *tx)
            .await?;
    let Some((_, erased_at)) = erased_at else { bail!("no workspace {workspace_id}") };
    // The conversions that carry the identifier...
    let direct: Vec<Person> = sqlx::query_as(lookup).bind(workspace_id).bind(&value).fetch_all(&mut *tx).await?;
    // ...and, one step out, those that carry any identifier found on them (docs/architecture.md, "Privacy").
    let found = Identifiers::of(&direct);
    let people: Vec<Person> = sqlx::query_as(lookups::PERSON_ONE_STEP)
        .bind(workspace_id)
        .bind(direct.iter().map(|p| p.id.as_str()).collect::<Vec<_>>())
        .bind(&found.visitor_ids)
        .bind(&found.contact_ids)
        .bind(&found.email_hashes)
        .bind(&found.phone_hashes)
        .fetch_all(&mut *tx)
        .await?;
    let conversion_ids: Vec<&str> = people.iter().map(|p| p.id.as_str()).collect();
    let mut all = Identifiers::of(&people);
    match &identifier {
        Identifier::VisitorId(id) => all.visitor_ids.push(id.chars().take(16).collect()),
        Identifier::ContactId(id) => all.contact_ids.push(id.clone()),
        Identifier::Email(_) => all.email_hashes.push(value.clone()),
        Identifier::Phone { .. } => all.phone_hashes.push(value.clone()),
    }

    let visits = sqlx::query(lookups::DELETE_PERSON_VISITS)
        .bind(workspace_id)
        .bind(&all.visitor_ids)
        .bind(&all.click_ids)
        .bind(&all.contact_ids)
        .bind(&conversion_ids)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    sqlx::query(lookups::DELETE_PERSON_MATCHES).bind(&conversion_ids).execute(&mut *tx).await?;
    let conversions =
        sqlx::query(lookups::CLEAR_PERSON_CONVERSIONS).bind(&conversion_ids).execute(&mut *tx).await?.rows_affected();
    let erasure_id: i64 = sqlx::query_scalar(
        "INSERT INTO erasures (workspace_id, identifier_kind, conversions, visits) VALUES ($1, $2, $3, $4)
         RETURNING id",
    )
    .bind(workspace_id)
    .bind(identifier.kind())
    .bind(i32::try_from(conversions).unwrap_or(i32::MAX))
    .bind(i32::try_from(visits).unwrap_or(i32::MAX))
    .fetch_one(&mut *tx)
    .await?;
    sqlx::query(
        "INSERT INTO erasure_tombstones (erasure_id, workspace_id, erased_at, digests) VALUES ($1, $2, $3, $4)",
    )
    .bind(erasure_id)
    .bind(workspace_id)
    .bind(erased_at)
    .bind(all.digests())
    .execute(&mut *tx)
    .await?;
    // Bounded, so that the workspace's lock is not held while no standby takes the commit.
    db.durability.commit(tx, pid).await?;
    let done = std::time::Instant::now();
    db.durability.confirm(&mut connection).await?;
    // Read by deploy/bench.sh (erase_10m); the identifier's kind only, never its value.
    tracing::info!(
        kind = identifier.kind(),
        conversions,
        visits,
        lock_wait_ms = millis(locked - started),
        lock_held_ms = millis(done - locked),
        "erased"
    );
    Ok(json!({ "conversions": conversions, "visits": visits }))
}

fn millis(duration: std::time::Duration) -> f64 {
    (duration.as_secs_f64() * 1e6).round() / 1e3
}

/// The erasures of a workspace that cover items received before them and applied after them.
/// An item is covered when it was received (the gateway's `received_at_ms`) before an erasure
/// and carries one of the identifiers it erased; the writer then stores it with its
/// identifiers cleared, as the erasure would have left it had the item been applied first.
/// Items received after an erasure are a later send and kept as sent (docs/api.md, "Erasure").
pub struct Tombstones(Vec<(i64, Vec<String>)>);

impl Tombstones {
    /// Those of `workspace_id` newer than the oldest of `received_at_ms`: one indexed lookup,
    /// empty unless an erasure happened within the last moments that a message can come back.
    pub async fn load(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        workspace_id: &str,
        received_at_ms: impl Iterator<Item = i64>,
    ) -> Result<Tombstones, sqlx::Error> {
        let Some(oldest) = received_at_ms.min() else { return Ok(Tombstones(Vec::new())) };
        let rows: Vec<(i64, Vec<String>)> = sqlx::query_as(
            "SELECT (extract(epoch FROM erased_at) * 1000)::int8, digests FROM erasure_tombstones
              WHERE workspace_id = $1 AND erased_at > 'epoch'::timestamptz + $2 * interval '1 millisecond'",
        )
        .bind(workspace_id)
        .bind(oldest)
        .fetch_all(&mut **tx)
        .await?;
        Ok(Tombstones(rows))
    }

    /// The item as it is to be stored, when an erasure covers it; `None` when it is stored as sent.
    pub fn clear(&self, conversion: &Conversion, received_at_ms: i64) -> Option<Conversion> {
        if self.0.is_empty() {
            return None;
        }
        let carried: Vec<String> = [
            (Kind::VisitorId, conversion.visitor_id.as_deref().map(|v| v.chars().take(16).collect::<String>())),
            (Kind::ContactId, conversion.contact_id.clone()),
            (Kind::Email, conversion.email_sha256.as_ref().map(|h| h.as_str().to_owned())),
            (Kind::Phone, conversion.phone_sha256.as_ref().map(|h| h.as_str().to_owned())),
        ]
        .into_iter()
        .filter_map(|(kind, value)| value.map(|value| digest(kind, &value)))
        .collect();
        let covered = self.0.iter().any(|(erased_at_ms, digests)| {
            received_at_ms < *erased_at_ms && carried.iter().any(|d| digests.contains(d))
        });
        covered.then(|| Conversion {
            visitor_id: None,
            click_id: None,
            contact_id: None,
            email_sha256: None,
            phone_sha256: None,
            address_sha256: None,
            hdyhau: None,
            ..conversion.clone()
        })
    }
}

/// The identifier's value: the first line of `file`, or of standard input. Never an argument:
/// argv is visible to every user of the machine (docs/architecture.md, "Privacy").
pub fn read_value(file: Option<&std::path::Path>) -> anyhow::Result<String> {
    use std::io::BufRead;
    let mut line = String::new();
    match file {
        Some(path) => {
            let file = std::fs::File::open(path).map_err(|e| anyhow::anyhow!("--from {}: {e}", path.display()))?;
            std::io::BufReader::new(file).read_line(&mut line)?;
        }
        None => {
            std::io::stdin().lock().read_line(&mut line)?;
        }
    }
    let value = line.trim_end_matches(['\n', '\r']);
    if value.trim().is_empty() {
        bail!("no identifier: give its value on standard input or in --from FILE, one line");
    }
    Ok(value.to_owned())
}
