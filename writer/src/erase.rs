//! Erasure of one person's data (docs/api.md, "Erasure"): their visits and matches are deleted, the
//! identifiers on their conversions cleared; the conversions stay, so counts stay. The
//! identifier is normalized and hashed exactly as on receipt, and never stored or logged.

use crate::lookups;
use crate::store::Database;
use anyhow::bail;
use intake_common::config::KafkaArgs;
use intake_common::kafka;
use intake_common::kafka_errors::QuietContext;
use intake_model::conversion::Conversion;
use intake_model::message::{ErasureV1, WriteRequest};
use intake_model::normalize;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{json, Value};
use sqlx::Connection;

pub enum Identifier {
    Email(String),
    Phone { number: String, country: Option<String> },
    ContactId(String),
    VisitorId(String),
}

impl Identifier {
    /// The value the look-up compares: the hash of a normalized email or phone, never the
    /// identifier itself.
    fn lookup_value(&self) -> anyhow::Result<String> {
        Ok(match self {
            Identifier::Email(email) => match normalize::email_hash(email) {
                Some(hash) => hash.as_str().to_owned(),
                None => bail!("--email is not a usable email address"),
            },
            Identifier::Phone { number, country } => {
                let country = country.as_deref().map(str::to_ascii_uppercase);
                match normalize::phone_hash(number, country.as_deref()) {
                    Some(hash) => hash.as_str().to_owned(),
                    None => bail!("--phone cannot be parsed (give --country, or a leading +)"),
                }
            }
            Identifier::ContactId(id) | Identifier::VisitorId(id) => id.clone(),
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

crate::store::from_row!(Person { id, visitor_id, click_id, contact_id, email_sha256, phone_sha256 });

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

/// The kinds of identifier an erasure looks people up by, and a tombstone holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    VisitorId,
    ContactId,
    Email,
    Phone,
}

impl Kind {
    fn of(identifier: &Identifier) -> Kind {
        match identifier {
            Identifier::Email(_) => Kind::Email,
            Identifier::Phone { .. } => Kind::Phone,
            Identifier::ContactId(_) => Kind::ContactId,
            Identifier::VisitorId(_) => Kind::VisitorId,
        }
    }

    /// As the `erasures` table and an erasure's record name it.
    fn name(self) -> &'static str {
        match self {
            Kind::Email => "email",
            Kind::Phone => "phone",
            Kind::ContactId => "contact_id",
            Kind::VisitorId => "visitor_id",
        }
    }

    fn parse(name: &str) -> Option<Kind> {
        [Kind::Email, Kind::Phone, Kind::ContactId, Kind::VisitorId].into_iter().find(|kind| kind.name() == name)
    }

    /// The statement that finds the conversions carrying the identifier.
    fn lookup(self) -> &'static str {
        match self {
            Kind::Email => lookups::PERSON_BY_EMAIL,
            Kind::Phone => lookups::PERSON_BY_PHONE,
            Kind::ContactId => lookups::PERSON_BY_CONTACT,
            Kind::VisitorId => lookups::PERSON_BY_VISITOR,
        }
    }
}

/// SHA-256 of `kind:value`, hex: what a tombstone keeps instead of the identifier. The database
/// computes the same for `restore apply` (`lookups::tombstone_digest`).
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

/// Erases the person (see [`erase_as`]) and returns the counts, with the erasure as it is to be
/// recorded in the requests topic (`record`).
pub async fn erase(db: &Database, workspace_id: &str, identifier: Identifier) -> anyhow::Result<(Value, ErasureV1)> {
    let value = identifier.lookup_value()?;
    let kind = Kind::of(&identifier);
    let Some((counts, erased_at)) = erase_as(db, workspace_id, kind, &value, None).await? else {
        bail!("the erasure was found applied already")
    };
    let erased_at_us = i64::try_from(erased_at.unix_timestamp_nanos() / 1_000).unwrap_or(i64::MAX);
    let record = ErasureV1 { workspace_id: workspace_id.to_owned(), kind: kind.name().to_owned(), value, erased_at_us };
    Ok((counts, record))
}

/// Applies an erasure read from the requests topic (a rewind, a replay): a no-op when the
/// database has it (its tombstone, at its instant), else the erasure again at its instant, so
/// that the person's data applied again before it is erased again and what comes after it is
/// covered by its tombstone as before. True when it was applied now.
pub async fn apply_record(db: &Database, record: &ErasureV1) -> anyhow::Result<bool> {
    let Some(kind) = Kind::parse(&record.kind) else { bail!("an erasure of an unknown kind: {}", record.kind) };
    let at = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(record.erased_at_us) * 1_000)?;
    Ok(erase_as(db, &record.workspace_id, kind, &record.value, Some(at)).await?.is_some())
}

/// Erases the person in one transaction under the workspace's write lock, at `at` (a recorded
/// erasure applied again; `None` when the database already has it) or now. Every lookup is
/// answered by an index (crate::lookups), so the lock is held for milliseconds whatever the
/// workspace's size. What was sent before the erasure but is applied after it (in Kafka still,
/// or replayed, or redriven from the dead letters) is covered by the tombstone written here:
/// see [`Tombstones`].
async fn erase_as(
    db: &Database,
    workspace_id: &str,
    kind: Kind,
    value: &str,
    at: Option<time::OffsetDateTime>,
) -> anyhow::Result<Option<(Value, time::OffsetDateTime)>> {
    let started = std::time::Instant::now();
    let mut connection = db.pool.acquire().await?;
    let (mut tx, pid) = lock_workspace(&mut connection, workspace_id).await?;
    let locked = std::time::Instant::now();
    // Every statement below is a union of indexed lookups; the planner is held to them even on
    // a table whose statistics lag behind a bulk load (a stale estimate must not turn a lookup
    // into a scan of the workspace under its lock).
    sqlx::query("SET LOCAL enable_seqscan = off").execute(&mut *tx).await?;
    // The erasure's instant: items received before it are the person's data, erased here if
    // applied already, by the tombstone if applied later; items received after it are a later
    // send (docs/api.md, "Erasure"), and cannot have been applied yet, since applying takes the lock held here.
    let erased_at: Option<(String, time::OffsetDateTime, bool)> = sqlx::query_as(
        "SELECT id, coalesce($2, clock_timestamp()),
                EXISTS (SELECT FROM erasure_tombstones WHERE workspace_id = $1 AND erased_at = $2)
           FROM workspaces WHERE id = $1",
    )
    .bind(workspace_id)
    .bind(at)
    .fetch_optional(&mut *tx)
    .await?;
    let Some((_, erased_at, applied)) = erased_at else { bail!("no workspace {workspace_id}") };
    if applied {
        return Ok(None);
    }
    // The conversions that carry the identifier...
    let direct: Vec<Person> = sqlx::query_as(kind.lookup()).bind(workspace_id).bind(value).fetch_all(&mut *tx).await?;
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
    let mut all = Identifiers::of(&people);
    match kind {
        Kind::VisitorId => all.visitor_ids.push(value.chars().take(16).collect()),
        Kind::ContactId => all.contact_ids.push(value.to_owned()),
        Kind::Email => all.email_hashes.push(value.to_owned()),
        Kind::Phone => all.phone_hashes.push(value.to_owned()),
    }
    let digests = all.digests();
    let (conversions, visits) = remove(&mut tx, workspace_id, kind, &people, &all, erased_at, &digests).await?;
    // Bounded, so that the workspace's lock is not held while no standby takes the commit.
    db.durability.commit(tx, pid).await?;
    let done = std::time::Instant::now();
    db.durability.confirm(&mut connection).await?;
    // Read by deploy/bench.sh (erase_10m); the identifier's kind only, never its value.
    tracing::info!(
        kind = kind.name(),
        conversions,
        visits,
        again = at.is_some(),
        lock_wait_ms = millis(locked - started),
        lock_held_ms = millis(done - locked),
        "erased"
    );
    Ok(Some((json!({ "conversions": conversions, "visits": visits }), erased_at)))
}

/// A transaction holding the workspace's write lock, the same as a chunk write takes: an
/// erasure never interleaves with a write of the workspace. With the backend's id, for a commit
/// whose wait for the standby is cancelled.
async fn lock_workspace<'c>(
    connection: &'c mut sqlx::PgConnection,
    workspace_id: &str,
) -> Result<(sqlx::Transaction<'c, sqlx::Postgres>, i32), sqlx::Error> {
    let mut tx = connection.begin().await?;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid() FROM pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(workspace_id)
        .fetch_one(&mut *tx)
        .await?;
    Ok((tx, pid))
}

/// An erasure as its tombstone keeps it: what `restore export` saves of each erasure, since
/// the identifier itself is kept nowhere.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct Tombstone {
    pub workspace_id: String,
    pub kind: String,
    #[serde(with = "time::serde::rfc3339")]
    pub erased_at: time::OffsetDateTime,
    pub digests: Vec<String>,
}

/// Applies an erasure again from its tombstone, at its instant (a database restored from before
/// it, `restore apply`): a no-op when the database has it. The person is found by the
/// tombstone's digests, on every conversion of the workspace last written before the erasure
/// and every visit of the workspace: a scan of the workspace, run while the writers are stopped.
/// The counts of conversions and visits when it was applied now.
pub async fn apply_tombstone(db: &Database, tombstone: &Tombstone) -> anyhow::Result<Option<(u64, u64)>> {
    let Some(kind) = Kind::parse(&tombstone.kind) else { bail!("an erasure of an unknown kind: {}", tombstone.kind) };
    let workspace_id = tombstone.workspace_id.as_str();
    let mut connection = db.pool.acquire().await?;
    let (mut tx, pid) = lock_workspace(&mut connection, workspace_id).await?;
    let present: Option<bool> = sqlx::query_scalar(
        "SELECT EXISTS (SELECT FROM erasure_tombstones WHERE workspace_id = $1 AND erased_at = $2)
           FROM workspaces WHERE id = $1",
    )
    .bind(workspace_id)
    .bind(tombstone.erased_at)
    .fetch_optional(&mut *tx)
    .await?;
    match present {
        None => bail!("no workspace {workspace_id}"),
        Some(true) => return Ok(None),
        Some(false) => {}
    }
    let people: Vec<Person> = sqlx::query_as(lookups::PEOPLE_BY_TOMBSTONE)
        .bind(workspace_id)
        .bind(&tombstone.digests)
        .bind(tombstone.erased_at)
        .fetch_all(&mut *tx)
        .await?;
    let mut all = Identifiers::of(&people);
    let visited: Vec<(Option<String>, Option<String>)> = sqlx::query_as(lookups::VISIT_IDS_BY_TOMBSTONE)
        .bind(workspace_id)
        .bind(&tombstone.digests)
        .fetch_all(&mut *tx)
        .await?;
    for (visitor_id, recipient_id) in visited {
        all.visitor_ids.extend(visitor_id);
        all.contact_ids.extend(recipient_id);
    }
    let counts = remove(&mut tx, workspace_id, kind, &people, &all, tombstone.erased_at, &tombstone.digests).await?;
    db.durability.commit(tx, pid).await?;
    db.durability.confirm(&mut connection).await?;
    tracing::info!(
        kind = kind.name(),
        conversions = counts.0,
        visits = counts.1,
        "erasure applied again from its tombstone"
    );
    Ok(Some(counts))
}

/// Removes the person found (`people`, carrying `identifiers`) under the workspace's lock held by
/// `tx`: their visits and matches deleted, the identifiers on their conversions cleared; and
/// records the erasure with its tombstone of `digests` at `erased_at`. The counts of conversions
/// and visits.
#[allow(clippy::too_many_arguments)]
async fn remove(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    workspace_id: &str,
    kind: Kind,
    people: &[Person],
    identifiers: &Identifiers,
    erased_at: time::OffsetDateTime,
    digests: &[String],
) -> Result<(u64, u64), sqlx::Error> {
    let conversion_ids: Vec<&str> = people.iter().map(|p| p.id.as_str()).collect();
    let visits = sqlx::query(lookups::DELETE_PERSON_VISITS)
        .bind(workspace_id)
        .bind(&identifiers.visitor_ids)
        .bind(&identifiers.click_ids)
        .bind(&identifiers.contact_ids)
        .bind(&conversion_ids)
        .execute(&mut **tx)
        .await?
        .rows_affected();
    sqlx::query(lookups::DELETE_PERSON_MATCHES).bind(&conversion_ids).execute(&mut **tx).await?;
    let conversions =
        sqlx::query(lookups::CLEAR_PERSON_CONVERSIONS).bind(&conversion_ids).execute(&mut **tx).await?.rows_affected();
    let erasure_id: i64 = sqlx::query_scalar(
        "INSERT INTO erasures (workspace_id, identifier_kind, conversions, visits, erased_at)
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
    )
    .bind(workspace_id)
    .bind(kind.name())
    .bind(i32::try_from(conversions).unwrap_or(i32::MAX))
    .bind(i32::try_from(visits).unwrap_or(i32::MAX))
    // Its own instant, also when applied again (a rewind, a replay, `restore apply`).
    .bind(erased_at)
    .fetch_one(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO erasure_tombstones (erasure_id, workspace_id, erased_at, digests) VALUES ($1, $2, $3, $4)",
    )
    .bind(erasure_id)
    .bind(workspace_id)
    .bind(erased_at)
    .bind(digests)
    .execute(&mut **tx)
    .await?;
    Ok((conversions, visits))
}

/// Records the erasure in the requests topic, in its workspace's partition (keyed as the
/// gateways key its writes), once the database has it: a standby promoted without it, or a
/// restore from before it, gets it again from there (`apply_record`).
pub async fn record(kafka_args: &KafkaArgs, record: &ErasureV1) -> anyhow::Result<()> {
    let producer: FutureProducer<QuietContext> =
        kafka::request_producer(kafka_args, std::time::Duration::from_secs(30))
            .create_with_context(QuietContext::default())?;
    let payload = serde_json::to_vec(&WriteRequest::Erasure(record.clone()))?;
    let message = FutureRecord::to(&kafka_args.requests_topic).key(&record.workspace_id).payload(&payload);
    producer
        .send(message, std::time::Duration::from_secs(30))
        .await
        .map_err(|(error, _)| anyhow::anyhow!("recording the erasure in {}: {error}", kafka_args.requests_topic))?;
    Ok(())
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
    /// The erasures read with a chunk's related rows (`lookups::RELATED_CONVERSIONS`): each
    /// one's time (epoch ms) and digests. Empty unless an erasure happened within the last
    /// moments that a message can come back.
    pub fn new(erasures: Vec<(i64, Vec<String>)>) -> Tombstones {
        Tombstones(erasures)
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
