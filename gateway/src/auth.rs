//! API key authentication (SPEC section 5, DESIGN section 3). Lookups are cached for a short
//! time so that a hot key costs no database round trip, while a revoked key, a suspended or
//! deleted workspace is refused within the cache's lifetime (2 s by default, under the 5 s
//! the design allows).

use crate::api_error::ApiError;
use intake_common::error::ErrorCode;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const KEY_PREFIX: &str = "svc_live_";

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Principal {
    pub key_id: String,
    pub workspace_id: String,
    pub scopes: Vec<String>,
}

#[derive(Debug, Clone)]
enum Lookup {
    Unknown,
    Revoked,
    WorkspaceDeleted,
    WorkspaceSuspended,
    Active(Principal),
}

/// A small time-to-live cache, written by hand because it needs only get, insert and a sweep;
/// a general cache crate would cost more build time than these lines.
pub struct Authenticator {
    pool: PgPool,
    ttl: Duration,
    cache: Mutex<HashMap<[u8; 32], (Instant, Lookup)>>,
}

const CACHE_SWEEP_AT: usize = 10_000;

impl Authenticator {
    pub fn new(pool: PgPool, ttl: Duration) -> Self {
        Authenticator { pool, ttl, cache: Mutex::new(HashMap::new()) }
    }

    /// The caller behind the Authorization header, in the design's error order:
    /// missing_api_key, invalid_api_key, workspace_not_found, workspace_suspended.
    pub async fn authenticate(&self, authorization: Option<&http::HeaderValue>) -> Result<Principal, ApiError> {
        let key = authorization
            .and_then(|value| value.to_str().ok())
            .and_then(presented_key)
            .ok_or(ApiError::Code(ErrorCode::MissingApiKey))?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        let lookup = match self.cached(&digest) {
            Some(lookup) => lookup,
            None => {
                let lookup = self.fetch(&digest).await?;
                self.remember(digest, lookup.clone());
                lookup
            }
        };
        match lookup {
            Lookup::Active(principal) => Ok(principal),
            Lookup::Unknown | Lookup::Revoked => Err(ApiError::Code(ErrorCode::InvalidApiKey)),
            Lookup::WorkspaceDeleted => Err(ApiError::Code(ErrorCode::WorkspaceNotFound)),
            Lookup::WorkspaceSuspended => Err(ApiError::Code(ErrorCode::WorkspaceSuspended)),
        }
    }

    fn cached(&self, digest: &[u8; 32]) -> Option<Lookup> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.get(digest).filter(|(at, _)| at.elapsed() < self.ttl).map(|(_, lookup)| lookup.clone())
    }

    fn remember(&self, digest: [u8; 32], lookup: Lookup) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if cache.len() >= CACHE_SWEEP_AT {
            cache.retain(|_, (at, _)| at.elapsed() < self.ttl);
        }
        cache.insert(digest, (Instant::now(), lookup));
    }

    async fn fetch(&self, digest: &[u8; 32]) -> Result<Lookup, ApiError> {
        let row: Option<(String, Vec<String>, bool, String, String, bool)> = sqlx::query_as(
            "SELECT k.id, k.scopes, k.revoked_at IS NOT NULL, w.id, w.status, w.deleted_at IS NOT NULL
               FROM api_keys k JOIN workspaces w ON w.id = k.workspace_id
              WHERE k.secret_sha256 = $1",
        )
        .bind(digest.as_slice())
        .fetch_optional(&self.pool)
        .await
        .map_err(|error| ApiError::Internal(format!("key lookup: {error}")))?;
        Ok(match row {
            None => Lookup::Unknown,
            Some((_, _, true, ..)) => Lookup::Revoked,
            Some((_, _, _, _, _, true)) => Lookup::WorkspaceDeleted,
            Some((_, _, _, _, status, _)) if status == "suspended" => Lookup::WorkspaceSuspended,
            Some((key_id, scopes, _, workspace_id, ..)) => Lookup::Active(Principal { key_id, workspace_id, scopes }),
        })
    }
}

/// The key in `Bearer <key>` (scheme case-insensitive) or a bare key; `None` unless it is a
/// live-prefixed key.
fn presented_key(header: &str) -> Option<&str> {
    let header = header.trim();
    let key = match header.split_once(char::is_whitespace) {
        Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
        Some(_) => return None,
        None => header,
    };
    key.starts_with(KEY_PREFIX).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::presented_key;

    #[test]
    fn bearer_and_bare_keys() {
        assert_eq!(presented_key("Bearer svc_live_abc"), Some("svc_live_abc"));
        assert_eq!(presented_key("bearer   svc_live_abc "), Some("svc_live_abc"));
        assert_eq!(presented_key("BEARER svc_live_abc"), Some("svc_live_abc"));
        assert_eq!(presented_key("svc_live_abc"), Some("svc_live_abc"));
    }

    #[test]
    fn anything_else_is_missing() {
        for header in ["", "Bearer", "Bearer ", "Bearer sk_test_abc", "Basic svc_live_abc", "svc_test_abc", "Token svc_live_x"] {
            assert_eq!(presented_key(header), None, "{header:?}");
        }
    }
}
