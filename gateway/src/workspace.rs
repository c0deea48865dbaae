//! GET /v1/workspace: the key's workspace, its install snippet and sites.

use crate::api_error::ApiError;
use crate::auth::Principal;
use crate::context;
use crate::response::{json, Response};
use crate::state::AppState;
use serde_json::json;
use time::format_description::well_known::Rfc3339;
use time::OffsetDateTime;

pub async fn get<B>(state: &AppState, request: &http::Request<B>) -> Result<Response, ApiError> {
    let principal = context::required::<Principal, _>(request)?;
    let (pool, script_base_url) = (&state.pool, &state.script_base_url);
    let internal = |error: sqlx::Error| ApiError::Internal(format!("workspace read: {error}"));
    let (id, name, project_id, status, site_restriction): (String, String, String, String, String) =
        sqlx::query_as("SELECT id, name, project_id, status, site_restriction FROM workspaces WHERE id = $1")
            .bind(&*principal.workspace_id)
            .fetch_one(pool)
            .await
            .map_err(internal)?;
    let sites: Vec<(String, Option<OffsetDateTime>)> =
        sqlx::query_as("SELECT host, last_seen_at FROM sites WHERE workspace_id = $1 ORDER BY host")
            .bind(&*principal.workspace_id)
            .fetch_all(pool)
            .await
            .map_err(internal)?;

    let src = format!("{}/s/{id}.js", script_base_url.trim_end_matches('/'));
    let snippet = format!("<script async src=\"{src}\"></script>");
    let sites: Vec<_> = sites
        .into_iter()
        .map(|(host, last_seen_at)| json!({ "host": host, "lastSeenAt": last_seen_at.and_then(|t| t.format(&Rfc3339).ok()) }))
        .collect();
    Ok(json(
        200,
        &json!({
            "workspace": { "id": id, "name": name, "projectId": project_id, "status": status, "siteRestriction": site_restriction },
            "script": { "src": src, "snippet": snippet },
            "sites": sites,
            "key": { "id": principal.key_id, "scopes": principal.scopes },
        }),
    ))
}
