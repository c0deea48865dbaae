//! Erasure of one person's data (DESIGN section 8): their visits and matches are deleted, the
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
}

pub async fn erase(pool: &PgPool, workspace_id: &str, identifier: Identifier) -> anyhow::Result<Value> {
    let (condition, value) = identifier.condition()?;
    let mut tx = pool.begin().await?;
    // The same lock as a chunk write: an erasure never interleaves with a write of the workspace.
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))").bind(workspace_id).execute(&mut *tx).await?;
    let exists: Option<String> = sqlx::query_scalar("SELECT id FROM workspaces WHERE id = $1").bind(workspace_id).fetch_optional(&mut *tx).await?;
    if exists.is_none() {
        bail!("no workspace {workspace_id}");
    }
    // The person's conversions, and every visitor, click and contact id they carry.
    let people: Vec<Person> = sqlx::query_as(&format!(
        "SELECT id, left(visitor_id, 16) AS visitor_id, click_id, contact_id
           FROM conversions WHERE workspace_id = $1 AND {condition}"
    ))
    .bind(workspace_id)
    .bind(&value)
    .fetch_all(&mut *tx)
    .await?;
    let conversion_ids: Vec<&str> = people.iter().map(|p| p.id.as_str()).collect();
    let mut visitor_ids: Vec<&str> = people.iter().filter_map(|p| p.visitor_id.as_deref()).collect();
    let click_ids: Vec<&str> = people.iter().filter_map(|p| p.click_id.as_deref()).collect();
    let mut contact_ids: Vec<&str> = people.iter().filter_map(|p| p.contact_id.as_deref()).collect();
    let short_visitor: String;
    match &identifier {
        Identifier::VisitorId(id) => {
            short_visitor = id.chars().take(16).collect();
            visitor_ids.push(&short_visitor);
        }
        Identifier::ContactId(id) => contact_ids.push(id),
        _ => {}
    }

    let visits = sqlx::query(
        "DELETE FROM visits WHERE workspace_id = $1
            AND (visitor_id = ANY($2) OR click_id = ANY($3) OR recipient_id = ANY($4)
                 OR id IN (SELECT visit_id FROM conversion_matches WHERE conversion_id = ANY($5)))",
    )
    .bind(workspace_id)
    .bind(&visitor_ids)
    .bind(&click_ids)
    .bind(&contact_ids)
    .bind(&conversion_ids)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    sqlx::query("DELETE FROM conversion_matches WHERE conversion_id = ANY($1)").bind(&conversion_ids).execute(&mut *tx).await?;
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
