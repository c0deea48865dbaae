//! Operator commands on workspaces and keys (docs/operations.md, "Operator commands"). Each returns the JSON object
//! the command prints.

use crate::store::Database;
use anyhow::{bail, Context};
use rand::distributions::{Alphanumeric, DistString};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use sqlx::{Connection, PgPool};

pub const SCOPES: [&str; 2] = ["workspace:read", "conversions:write"];
const KEY_PREFIX: &str = "svc_live_";
const KEY_RANDOM_CHARS: usize = 40;

pub struct NewWorkspace {
    pub name: String,
    pub project_id: Option<String>,
    pub site_restriction: String,
    pub sites: Vec<String>,
}

pub async fn create_workspace(db: &Database, new: NewWorkspace) -> anyhow::Result<Value> {
    if !["any", "listed"].contains(&new.site_restriction.as_str()) {
        bail!("--site-restriction must be any or listed");
    }
    let id = intake_model::ids::workspace_id();
    let project_id = new.project_id.unwrap_or_else(|| intake_model::ids::new_id("prj_"));
    let mut connection = db.pool.acquire().await?;
    let mut tx = connection.begin().await?;
    sqlx::query("INSERT INTO workspaces (id, name, project_id, site_restriction) VALUES ($1, $2, $3, $4)")
        .bind(&id)
        .bind(&new.name)
        .bind(&project_id)
        .bind(&new.site_restriction)
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO sites (workspace_id, host) SELECT $1, unnest($2::text[]) ON CONFLICT DO NOTHING")
        .bind(&id)
        .bind(&new.sites)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    db.durability.confirm(&mut connection).await?;
    Ok(json!({ "id": id }))
}

#[derive(Clone, Copy, Debug)]
pub enum WorkspaceChange {
    Suspend,
    Resume,
    Delete,
}

pub async fn change_workspace(db: &Database, id: &str, change: WorkspaceChange) -> anyhow::Result<Value> {
    let sql = match change {
        WorkspaceChange::Suspend => "UPDATE workspaces SET status = 'suspended' WHERE id = $1 AND deleted_at IS NULL",
        WorkspaceChange::Resume => "UPDATE workspaces SET status = 'active' WHERE id = $1 AND deleted_at IS NULL",
        WorkspaceChange::Delete => "UPDATE workspaces SET deleted_at = now() WHERE id = $1 AND deleted_at IS NULL",
    };
    let mut connection = db.pool.acquire().await?;
    let updated = sqlx::query(sql).bind(id).execute(&mut *connection).await?.rows_affected();
    if updated == 0 {
        bail!("no workspace {id} (or it is deleted)");
    }
    db.durability.confirm(&mut connection).await?;
    Ok(match change {
        WorkspaceChange::Suspend => json!({ "id": id, "status": "suspended" }),
        WorkspaceChange::Resume => json!({ "id": id, "status": "active" }),
        WorkspaceChange::Delete => json!({ "id": id, "deleted": true }),
    })
}

pub async fn create_key(db: &Database, workspace_id: &str, scopes: &[String]) -> anyhow::Result<Value> {
    if scopes.is_empty() {
        bail!("--scopes needs at least one of {}", SCOPES.join(", "));
    }
    if let Some(unknown) = scopes.iter().find(|scope| !SCOPES.contains(&scope.as_str())) {
        bail!("unknown scope {unknown:?}; scopes are {}", SCOPES.join(", "));
    }
    let id = intake_model::ids::key_id();
    let secret = format!("{KEY_PREFIX}{}", Alphanumeric.sample_string(&mut rand::rngs::OsRng, KEY_RANDOM_CHARS));
    let mut connection = db.pool.acquire().await?;
    let inserted = sqlx::query(
        "INSERT INTO api_keys (id, workspace_id, secret_sha256, scopes)
         SELECT $1, id, $3, $4 FROM workspaces WHERE id = $2 AND deleted_at IS NULL",
    )
    .bind(&id)
    .bind(workspace_id)
    .bind(Sha256::digest(secret.as_bytes()).to_vec())
    .bind(scopes)
    .execute(&mut *connection)
    .await?
    .rows_affected();
    if inserted == 0 {
        bail!("no workspace {workspace_id} (or it is deleted)");
    }
    db.durability.confirm(&mut connection).await?;
    Ok(json!({ "id": id, "secret": secret, "scopes": scopes }))
}

pub async fn revoke_key(db: &Database, id: &str) -> anyhow::Result<Value> {
    let mut connection = db.pool.acquire().await?;
    let updated = sqlx::query("UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1")
        .bind(id)
        .execute(&mut *connection)
        .await
        .context("revoking the key")?
        .rows_affected();
    if updated == 0 {
        bail!("no key {id}");
    }
    db.durability.confirm(&mut connection).await?;
    Ok(json!({ "id": id, "revoked": true }))
}

/// Every workspace, oldest first: `{"workspaces": [{id, name, project_id, status, site_restriction, sites, created_at, deleted}]}`.
pub async fn list_workspaces(pool: &PgPool) -> anyhow::Result<Value> {
    let rows: Vec<(Value,)> = sqlx::query_as(
        "SELECT json_build_object(
                    'id', w.id, 'name', w.name, 'project_id', w.project_id, 'status', w.status,
                    'site_restriction', w.site_restriction,
                    'sites', COALESCE((SELECT json_agg(s.host ORDER BY s.host) FROM sites s WHERE s.workspace_id = w.id), '[]'),
                    'created_at', w.created_at, 'deleted', w.deleted_at IS NOT NULL)
           FROM workspaces w ORDER BY w.created_at, w.id",
    )
    .fetch_all(pool)
    .await?;
    Ok(json!({ "workspaces": rows.into_iter().map(|(row,)| row).collect::<Vec<_>>() }))
}

/// A workspace's keys, never their secrets (only a hash is stored anyway):
/// `{"keys": [{id, scopes, created_at, revoked}]}`.
pub async fn list_keys(pool: &PgPool, workspace_id: &str) -> anyhow::Result<Value> {
    let exists: Option<String> =
        sqlx::query_scalar("SELECT id FROM workspaces WHERE id = $1").bind(workspace_id).fetch_optional(pool).await?;
    if exists.is_none() {
        bail!("no workspace {workspace_id}");
    }
    let rows: Vec<(Value,)> = sqlx::query_as(
        "SELECT json_build_object('id', id, 'scopes', scopes, 'created_at', created_at, 'revoked', revoked_at IS NOT NULL)
           FROM api_keys WHERE workspace_id = $1 ORDER BY created_at, id",
    )
    .bind(workspace_id)
    .fetch_all(pool)
    .await?;
    Ok(json!({ "keys": rows.into_iter().map(|(row,)| row).collect::<Vec<_>>() }))
}
