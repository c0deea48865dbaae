//! What a restore of the database undoes that the requests topic cannot give back
//! (deploy/RUNBOOK.md, "PostgreSQL restored from a backup: replay"): workspaces and their sites, keys
//! and their revocations, and erasures older than the topic's retention. `export` saves them
//! from the database before it is restored; `apply` puts them back into the restored one, before
//! the replay: a workspace keeps its id (its replayed writes need it), a revoked key stays
//! revoked, an erasure is applied again at its instant. Running `apply` twice changes nothing.

use crate::erase::{self, Tombstone};
use crate::store::Database;
use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use sqlx::PgPool;

/// The file's format, checked by `apply`.
const FORMAT: &str = "intake-restore-export-1";

/// What `export` writes. Secrets are kept only as their SHA-256, as in the database; erasures
/// only as their tombstones' digests.
#[derive(Debug, Serialize, Deserialize)]
pub struct Export {
    format: String,
    #[serde(with = "time::serde::rfc3339")]
    exported_at: time::OffsetDateTime,
    workspaces: Vec<Workspace>,
    keys: Vec<Key>,
    erasures: Vec<Tombstone>,
    /// Erasures whose tombstones are pruned already (older than the dead letters' retention plus
    /// the margin): they cannot be applied again, only named, for running again from their tickets.
    #[serde(default)]
    erasures_without_tombstone: Vec<PastErasure>,
}

#[derive(Debug, Serialize, Deserialize)]
struct PastErasure {
    workspace_id: String,
    kind: String,
    #[serde(with = "time::serde::rfc3339")]
    erased_at: time::OffsetDateTime,
}

#[derive(Debug, Serialize, Deserialize)]
struct Workspace {
    id: String,
    name: String,
    project_id: String,
    status: String,
    site_restriction: String,
    sites: Vec<String>,
    #[serde(with = "time::serde::rfc3339")]
    created_at: time::OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    deleted_at: Option<time::OffsetDateTime>,
}

#[derive(Debug, Serialize, Deserialize)]
struct Key {
    id: String,
    workspace_id: String,
    /// Hex.
    secret_sha256: String,
    scopes: Vec<String>,
    #[serde(with = "time::serde::rfc3339")]
    created_at: time::OffsetDateTime,
    #[serde(with = "time::serde::rfc3339::option")]
    revoked_at: Option<time::OffsetDateTime>,
}

/// Reads what a restore would undo, in one snapshot of the database. Every erasure whose
/// tombstone is still kept (the dead letters' retention plus the margin: longer than the
/// backups a restore goes back to) is included.
pub async fn export(pool: &PgPool) -> anyhow::Result<Export> {
    let mut tx = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY").execute(&mut *tx).await?;
    let rows = |sql| sqlx::query_scalar::<_, Value>(sql);
    let workspaces = rows(
        "SELECT json_build_object('id', w.id, 'name', w.name, 'project_id', w.project_id, 'status', w.status,
                'site_restriction', w.site_restriction,
                'sites', COALESCE((SELECT json_agg(s.host ORDER BY s.host) FROM sites s WHERE s.workspace_id = w.id), '[]'),
                'created_at', w.created_at, 'deleted_at', w.deleted_at)
           FROM workspaces w ORDER BY w.created_at, w.id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let keys = rows(
        "SELECT json_build_object('id', id, 'workspace_id', workspace_id, 'secret_sha256', encode(secret_sha256, 'hex'),
                'scopes', scopes, 'created_at', created_at, 'revoked_at', revoked_at)
           FROM api_keys ORDER BY created_at, id",
    )
    .fetch_all(&mut *tx)
    .await?;
    let erasures = rows(
        "SELECT json_build_object('workspace_id', t.workspace_id, 'kind', e.identifier_kind,
                'erased_at', t.erased_at, 'digests', t.digests)
           FROM erasure_tombstones t JOIN erasures e ON e.id = t.erasure_id ORDER BY t.erased_at",
    )
    .fetch_all(&mut *tx)
    .await?;
    let past = rows(
        "SELECT json_build_object('workspace_id', e.workspace_id, 'kind', e.identifier_kind, 'erased_at', e.erased_at)
           FROM erasures e WHERE NOT EXISTS (SELECT FROM erasure_tombstones t WHERE t.erasure_id = e.id)
          ORDER BY e.erased_at",
    )
    .fetch_all(&mut *tx)
    .await?;
    let exported_at: time::OffsetDateTime = sqlx::query_scalar("SELECT now()").fetch_one(&mut *tx).await?;
    tx.commit().await?;
    Ok(Export {
        format: FORMAT.to_owned(),
        exported_at,
        workspaces: serde_json::from_value(Value::Array(workspaces)).context("reading the workspaces")?,
        keys: serde_json::from_value(Value::Array(keys)).context("reading the keys")?,
        erasures: serde_json::from_value(Value::Array(erasures)).context("reading the erasures")?,
        erasures_without_tombstone: serde_json::from_value(Value::Array(past)).context("reading the erasures")?,
    })
}

/// Writes the export to `path`, readable by its owner only (it holds key hashes), and returns
/// the summary the command prints.
pub fn save(export: &Export, path: &std::path::Path) -> anyhow::Result<Value> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("--to {} (an export is never overwritten)", path.display()))?;
    file.write_all(&serde_json::to_vec_pretty(export)?)?;
    file.sync_all()?;
    Ok(json!({
        "exported_to": path.display().to_string(),
        "exported_at": export.exported_at.format(&time::format_description::well_known::Rfc3339)?,
        "workspaces": export.workspaces.len(),
        "keys": export.keys.len(),
        "erasures": export.erasures.len(),
    }))
}

pub fn load(path: &std::path::Path) -> anyhow::Result<Export> {
    let text = std::fs::read(path).with_context(|| format!("--from {}", path.display()))?;
    let export: Export = serde_json::from_slice(&text)
        .with_context(|| format!("--from {}: not an export of `restore export`", path.display()))?;
    if export.format != FORMAT {
        bail!("--from {}: format {:?}, this version reads {FORMAT:?}", path.display(), export.format);
    }
    Ok(export)
}

/// Puts the export back into the (restored) database: workspaces missing from it created with
/// their ids and the others given the exported state (a deletion is never undone), sites
/// added, keys missing created and revocations applied (a revocation is never undone), and
/// each erasure applied again unless the database has it. Prints what changed.
pub async fn apply(db: &Database, export: &Export) -> anyhow::Result<Value> {
    let mut connection = db.pool.acquire().await?;
    let mut tx = sqlx::Connection::begin(&mut *connection).await?;
    // Workspaces are never removed, so a restore of the database the export was taken from has
    // none the export lacks: one more is another database's export, whose keys would work here.
    let ids: Vec<&str> = export.workspaces.iter().map(|w| w.id.as_str()).collect();
    let unknown: Vec<String> =
        sqlx::query_scalar("SELECT id FROM workspaces WHERE NOT (id = ANY($1)) ORDER BY created_at LIMIT 5")
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await?;
    if !unknown.is_empty() {
        bail!(
            "the database has workspaces the export does not ({}): not an export of this database, or taken \
             before they were created; nothing applied",
            unknown.join(", ")
        );
    }
    let workspaces: Vec<bool> = sqlx::query_scalar(
        "INSERT INTO workspaces AS w (id, name, project_id, status, site_restriction, created_at, deleted_at)
         SELECT id, name, project_id, status, site_restriction, created_at, deleted_at
           FROM jsonb_to_recordset($1) AS x(id text, name text, project_id text, status text, site_restriction text,
                                            created_at timestamptz, deleted_at timestamptz)
         ON CONFLICT (id) DO UPDATE
            SET name = excluded.name, project_id = excluded.project_id, status = excluded.status,
                site_restriction = excluded.site_restriction, deleted_at = coalesce(w.deleted_at, excluded.deleted_at)
          WHERE (w.name, w.project_id, w.status, w.site_restriction, w.deleted_at IS NOT NULL)
                IS DISTINCT FROM (excluded.name, excluded.project_id, excluded.status, excluded.site_restriction,
                                  w.deleted_at IS NOT NULL OR excluded.deleted_at IS NOT NULL)
         RETURNING xmax = 0",
    )
    .bind(serde_json::to_value(&export.workspaces)?)
    .fetch_all(&mut *tx)
    .await?;
    let sites = sqlx::query(
        "INSERT INTO sites (workspace_id, host)
         SELECT x.id, unnest(x.sites) FROM jsonb_to_recordset($1) AS x(id text, sites text[])
         ON CONFLICT DO NOTHING",
    )
    .bind(serde_json::to_value(&export.workspaces)?)
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let keys: Vec<bool> = sqlx::query_scalar(
        "INSERT INTO api_keys AS k (id, workspace_id, secret_sha256, scopes, created_at, revoked_at)
         SELECT id, workspace_id, decode(secret_sha256, 'hex'), scopes, created_at, revoked_at
           FROM jsonb_to_recordset($1) AS x(id text, workspace_id text, secret_sha256 text, scopes text[],
                                            created_at timestamptz, revoked_at timestamptz)
         ON CONFLICT (id) DO UPDATE SET revoked_at = excluded.revoked_at
          WHERE k.revoked_at IS NULL AND excluded.revoked_at IS NOT NULL
         RETURNING xmax = 0",
    )
    .bind(serde_json::to_value(&export.keys)?)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    db.durability.confirm(&mut connection).await?;
    drop(connection);

    // Those the restored database lacks: undone by the restore, and only their tickets can
    // bring them back (the identifier is kept nowhere).
    let lost: Vec<Value> = sqlx::query_scalar(
        "SELECT json_build_object('workspace_id', x.workspace_id, 'kind', x.kind, 'erased_at', x.erased_at)
           FROM jsonb_to_recordset($1) AS x(workspace_id text, kind text, erased_at timestamptz)
          WHERE NOT EXISTS (SELECT FROM erasures e WHERE e.workspace_id = x.workspace_id
                               AND e.identifier_kind = x.kind AND e.erased_at = x.erased_at)",
    )
    .bind(serde_json::to_value(&export.erasures_without_tombstone)?)
    .fetch_all(&db.pool)
    .await?;
    let (mut applied, mut present) = (0, 0);
    for tombstone in &export.erasures {
        match erase::apply_tombstone(db, tombstone).await? {
            Some(_) => applied += 1,
            None => present += 1,
        }
    }
    let count = |rows: &[bool], created: bool| rows.iter().filter(|&&row| row == created).count();
    Ok(json!({
        "workspaces": { "created": count(&workspaces, true), "updated": count(&workspaces, false) },
        "sites_added": sites,
        "keys": { "created": count(&keys, true), "revoked": count(&keys, false) },
        "erasures": { "applied": applied, "present": present, "to_run_again": lost },
    }))
}
