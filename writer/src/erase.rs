//! Erasure of one person's data (docs/api.md, "Erasure"): their visits and matches are deleted, the
//! identifiers on their conversions cleared; the conversions stay, so counts stay. The
//! identifier is normalized and hashed exactly as on receipt, and never stored or logged.

use anyhow::bail;
use intake_common::normalize;
use serde_json::{json, Value};
use sqlx::PgPool;

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

    /// The SQL condition on `conversions` and the value it compares with.
    fn condition(&self) -> anyhow::Result<(&'static str, String)> {
        Ok(match self {
            Identifier::Email(email) => match normalize::email_hash(email) {
                Some(hash) => ("email_sha256 = $2", hash.as_str().to_owned()),
                None => bail!("--email is not a usable email address"),
            },
            Identifier::Phone { number, country } => {
                let country = country.as_deref().map(str::to_ascii_uppercase);
                match normalize::phone_hash(number, country.as_deref()) {
                    Some(hash) => ("phone_sha256 = $2", hash.as_str().to_owned()),
                    None => bail!("--phone cannot be parsed (give --country, or a leading +)"),
                }
            }
            Identifier::ContactId(id) => ("contact_id = $2", id.clone()),
            Identifier::VisitorId(id) => ("left(visitor_id, 16) = left($2, 16)", id.clone()),
        })
    }
}

/// One of the person's conversions and the identifiers it carries (visitor id: its 16 characters).
#[derive(sqlx::FromRow)]
struct Person {
    id: String,
    visitor_id: Option<String>,
    click_id: Option<String>,
    contact_id: Option<String>,
    email_sha256: Option<String>,
    phone_sha256: Option<String>,
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
}

const PERSON_COLUMNS: &str = "id, left(visitor_id, 16) AS visitor_id, click_id, contact_id, email_sha256, phone_sha256";

pub async fn erase(pool: &PgPool, workspace_id: &str, identifier: Identifier) -> anyhow::Result<Value> {
    let (condition, value) = identifier.condition()?;
    let mut tx = pool.begin().await?;
    // The same lock as a chunk write: an erasure never interleaves with a write of the workspace.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))").bind(workspace_id).execute(&mut *tx).await?;
    let exists: Option<String> = sqlx::query_scalar("SELECT id FROM workspaces WHERE id = $1")
        .bind(workspace_id)
        .fetch_optional(&mut *tx)
        .await?;
    if exists.is_none() {
        bail!("no workspace {workspace_id}");
    }
    // The conversions that carry the identifier...
    let direct: Vec<Person> =
        sqlx::query_as(&format!("SELECT {PERSON_COLUMNS} FROM conversions WHERE workspace_id = $1 AND {condition}"))
            .bind(workspace_id)
            .bind(&value)
            .fetch_all(&mut *tx)
            .await?;
    // ...and, one step out, those that carry any identifier found on them (docs/architecture.md, "Privacy").
    let found = Identifiers::of(&direct);
    let people: Vec<Person> = sqlx::query_as(&format!(
        "SELECT {PERSON_COLUMNS} FROM conversions
          WHERE workspace_id = $1
            AND (id = ANY($2) OR left(visitor_id, 16) = ANY($3) OR contact_id = ANY($4)
                 OR email_sha256 = ANY($5) OR phone_sha256 = ANY($6))"
    ))
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
        _ => {}
    }

    let visits = sqlx::query(
        "DELETE FROM visits WHERE workspace_id = $1
            AND (visitor_id = ANY($2) OR click_id = ANY($3) OR recipient_id = ANY($4)
                 OR id IN (SELECT visit_id FROM conversion_matches WHERE conversion_id = ANY($5)))",
    )
    .bind(workspace_id)
    .bind(&all.visitor_ids)
    .bind(&all.click_ids)
    .bind(&all.contact_ids)
    .bind(&conversion_ids)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query("DELETE FROM conversion_matches WHERE conversion_id = ANY($1)")
        .bind(&conversion_ids)
        .execute(&mut *tx)
        .await?;
    let conversions = sqlx::query(
        "UPDATE conversions SET visitor_id = NULL, click_id = NULL, contact_id = NULL, email_sha256 = NULL,
                phone_sha256 = NULL, address_sha256 = NULL, hdyhau = NULL, updated_at = now()
          WHERE id = ANY($1)",
    )
    .bind(&conversion_ids)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query("INSERT INTO erasures (workspace_id, identifier_kind, conversions, visits) VALUES ($1, $2, $3, $4)")
        .bind(workspace_id)
        .bind(identifier.kind())
        .bind(i32::try_from(conversions).unwrap_or(i32::MAX))
        .bind(i32::try_from(visits).unwrap_or(i32::MAX))
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(json!({ "conversions": conversions, "visits": visits }))
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
