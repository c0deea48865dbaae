//! API key authentication (docs/api.md, "Authentication"; docs/architecture.md, "Key cache").
//! Lookups are cached in a bounded cache (moka) so that a hot key costs no database round trip,
//! while a revoked key, a suspended or deleted workspace is refused within the cache's lifetime
//! (2 s by default, under the 5 s the API promises). Unknown keys are remembered too, for a
//! shorter time, so that a client sending a wrong key in a loop costs one query per that time.
//! Concurrent misses of one key wait for one query.

use crate::api_error::ApiError;
use crate::metrics::{CacheLabels, CacheResult, Metrics};
use crate::sink::BoxFuture;
use intake_model::error::ErrorCode;
use moka::future::Cache;
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const KEY_PREFIX: &str = "svc_live_";

/// Who sent a request, from its Authorization header: the seam between the authentication
/// layer and the key store (PostgreSQL behind a cache in the gateway, a fixed map in the fast
/// tests).
pub trait Authenticate: Send + Sync {
    /// The caller, in the design's error order: missing_api_key, invalid_api_key,
    /// workspace_not_found, workspace_suspended.
    fn authenticate<'a>(
        &'a self,
        authorization: Option<&'a http::HeaderValue>,
    ) -> BoxFuture<'a, Result<Principal, ApiError>>;
}

/// An authenticated caller. Shared, not copied: every request of a key clones it from the cache.
#[derive(Debug, Clone)]
pub struct Principal {
    pub key_id: Arc<str>,
    pub workspace_id: Arc<str>,
    pub scopes: Arc<[String]>,
}

#[derive(Debug, Clone)]
enum Lookup {
    Unknown,
    Revoked,
    WorkspaceDeleted,
    WorkspaceSuspended,
    Active(Principal),
}

/// How long the cache keeps what it learnt.
#[derive(Debug, Clone, Copy)]
pub struct CacheSettings {
    /// Known keys (active, revoked, or of a suspended or deleted workspace).
    pub ttl: Duration,
    /// Unknown keys: never longer than `ttl`.
    pub unknown_ttl: Duration,
    /// Entries at most; the least useful are evicted beyond it.
    pub capacity: u64,
    /// While PostgreSQL cannot be reached, a key it knew within this time keeps the answer it
    /// had (a revocation cannot be read from a database that does not answer either): a
    /// database outage then delays writes instead of refusing every key not in the cache.
    pub stale_ttl: Duration,
    /// How long a look-up may take, its connection included. A database that takes the query
    /// and does not answer (a lock, a stalled disk, a host gone without a reset) would hold it
    /// for as long as TCP waits; past this the look-up has failed and the last answer serves.
    pub lookup_timeout: Duration,
}

struct Expiry(CacheSettings);

impl moka::Expiry<[u8; 32], Lookup> for Expiry {
    fn expire_after_create(&self, _key: &[u8; 32], lookup: &Lookup, _created_at: Instant) -> Option<Duration> {
        Some(match lookup {
            Lookup::Unknown => self.0.unknown_ttl.min(self.0.ttl),
            _ => self.0.ttl,
        })
    }
}

pub struct Authenticator {
    pool: PgPool,
    cache: Cache<[u8; 32], Lookup>,
    /// The last answer PostgreSQL gave for each known key, for when it cannot be asked.
    last_known: Cache<[u8; 32], Lookup>,
    lookup_timeout: Duration,
    metrics: Metrics,
}

impl Authenticator {
    pub fn new(pool: PgPool, settings: CacheSettings, metrics: Metrics) -> Self {
        let cache = Cache::builder().max_capacity(settings.capacity).expire_after(Expiry(settings)).build();
        // A stale answer is cached for `ttl` once given (see `stale`): kept that much shorter
        // here, so that no answer outlives `stale_ttl` after the database gave it.
        let last_known = Cache::builder()
            .max_capacity(settings.capacity)
            .time_to_live(settings.stale_ttl.saturating_sub(settings.ttl))
            .build();
        Authenticator { pool, cache, last_known, lookup_timeout: settings.lookup_timeout, metrics }
    }

    async fn look_up(&self, authorization: Option<&http::HeaderValue>) -> Result<Principal, ApiError> {
        let key = authorization
            .and_then(|value| value.to_str().ok())
            .and_then(presented_key)
            .ok_or(ApiError::Code(ErrorCode::MissingApiKey))?;
        let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
        // One query per missing key however many requests wait for it; a failed query is not
        // cached (every waiter gets the error, the next request tries again).
        let entry = self
            .cache
            .entry(digest)
            .or_try_insert_with(self.fetch(&digest))
            .await
            .map_err(|error: Arc<sqlx::Error>| error);
        let entry = match entry {
            Ok(entry) => entry,
            Err(error) => return self.stale(&digest, &error).await,
        };
        let result = if entry.is_fresh() { CacheResult::miss } else { CacheResult::hit };
        self.metrics.key_cache.get_or_create(&CacheLabels { result }).inc();
        self.answer(entry.into_value())
    }

    fn answer(&self, lookup: Lookup) -> Result<Principal, ApiError> {
        match lookup {
            Lookup::Active(principal) => Ok(principal),
            Lookup::Unknown | Lookup::Revoked => Err(ApiError::Code(ErrorCode::InvalidApiKey)),
            Lookup::WorkspaceDeleted => Err(ApiError::Code(ErrorCode::WorkspaceNotFound)),
            Lookup::WorkspaceSuspended => Err(ApiError::Code(ErrorCode::WorkspaceSuspended)),
        }
    }

    /// PostgreSQL did not answer: the last answer it gave, if any, else 500.
    async fn stale(&self, digest: &[u8; 32], error: &sqlx::Error) -> Result<Principal, ApiError> {
        match self.last_known.get(digest).await {
            Some(lookup) => {
                self.metrics.key_cache.get_or_create(&CacheLabels { result: CacheResult::stale }).inc();
                tracing::warn!(%error, "key lookup failed; using the last known answer");
                // For the cache's lifetime, so that an outage does not cost every request the
                // pool's acquire timeout.
                self.cache.insert(*digest, lookup.clone()).await;
                self.answer(lookup)
            }
            None => Err(ApiError::Internal(format!("key lookup: {error}"))),
        }
    }

    async fn fetch(&self, digest: &[u8; 32]) -> Result<Lookup, sqlx::Error> {
        let lookup = tokio::time::timeout(self.lookup_timeout, self.query(digest)).await.map_err(|_| {
            sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, "the key look-up timed out"))
        })??;
        self.last_known.insert(*digest, lookup.clone()).await;
        Ok(lookup)
    }

    async fn query(&self, digest: &[u8; 32]) -> Result<Lookup, sqlx::Error> {
        let row: Option<(String, Vec<String>, bool, String, String, bool)> = sqlx::query_as(
            "SELECT k.id, k.scopes, k.revoked_at IS NOT NULL, w.id, w.status, w.deleted_at IS NOT NULL
               FROM api_keys k JOIN workspaces w ON w.id = k.workspace_id
              WHERE k.secret_sha256 = $1",
        )
        .bind(digest.as_slice())
        .fetch_optional(&self.pool)
        .await?;
        Ok(match row {
            None => Lookup::Unknown,
            Some((_, _, true, ..)) => Lookup::Revoked,
            Some((_, _, _, _, _, true)) => Lookup::WorkspaceDeleted,
            Some((_, _, _, _, status, _)) if status == "suspended" => Lookup::WorkspaceSuspended,
            Some((key_id, scopes, _, workspace_id, ..)) => Lookup::Active(Principal {
                key_id: key_id.into(),
                workspace_id: workspace_id.into(),
                scopes: scopes.into(),
            }),
        })
    }
}

impl Authenticate for Authenticator {
    fn authenticate<'a>(
        &'a self,
        authorization: Option<&'a http::HeaderValue>,
    ) -> BoxFuture<'a, Result<Principal, ApiError>> {
        Box::pin(self.look_up(authorization))
    }
}

/// A fixed set of keys, each with its answer, for the fast tests: the header is read as the
/// gateway reads it, and a key not in the set is invalid.
#[cfg(test)]
#[derive(Default)]
pub struct MemoryKeys(std::collections::HashMap<String, Result<Principal, ErrorCode>>);

#[cfg(test)]
impl MemoryKeys {
    pub fn with(mut self, key: &str, answer: Result<Principal, ErrorCode>) -> Self {
        self.0.insert(key.to_owned(), answer);
        self
    }
}

#[cfg(test)]
impl Authenticate for MemoryKeys {
    fn authenticate<'a>(
        &'a self,
        authorization: Option<&'a http::HeaderValue>,
    ) -> BoxFuture<'a, Result<Principal, ApiError>> {
        let key = authorization.and_then(|value| value.to_str().ok()).and_then(presented_key);
        let answer = match key {
            None => Err(ApiError::Code(ErrorCode::MissingApiKey)),
            Some(key) => match self.0.get(key) {
                Some(answer) => answer.clone().map_err(ApiError::Code),
                None => Err(ApiError::Code(ErrorCode::InvalidApiKey)),
            },
        };
        Box::pin(std::future::ready(answer))
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
    use super::*;
    use moka::Expiry as _;

    #[test]
    fn unknown_keys_are_remembered_for_the_shorter_time() {
        let settings = CacheSettings {
            ttl: Duration::from_secs(2),
            unknown_ttl: Duration::from_secs(1),
            capacity: 10,
            stale_ttl: Duration::from_secs(600),
            lookup_timeout: Duration::from_secs(3),
        };
        let expiry = Expiry(settings);
        let principal = Principal { key_id: "k".into(), workspace_id: "w".into(), scopes: Arc::new([]) };
        let ttl = |lookup: &Lookup| expiry.expire_after_create(&[0; 32], lookup, Instant::now());
        assert_eq!(ttl(&Lookup::Unknown), Some(Duration::from_secs(1)));
        for known in [Lookup::Revoked, Lookup::WorkspaceDeleted, Lookup::WorkspaceSuspended, Lookup::Active(principal)]
        {
            assert_eq!(ttl(&known), Some(Duration::from_secs(2)));
        }
        let longer_unknown = Expiry(CacheSettings { unknown_ttl: Duration::from_secs(9), ..settings });
        assert_eq!(
            longer_unknown.expire_after_create(&[0; 32], &Lookup::Unknown, Instant::now()),
            Some(Duration::from_secs(2))
        );
    }

    #[test]
    fn bearer_and_bare_keys() {
        assert_eq!(presented_key("Bearer svc_live_abc"), Some("svc_live_abc"));
        assert_eq!(presented_key("bearer   svc_live_abc "), Some("svc_live_abc"));
        assert_eq!(presented_key("BEARER svc_live_abc"), Some("svc_live_abc"));
        assert_eq!(presented_key("svc_live_abc"), Some("svc_live_abc"));
    }

    #[test]
    fn anything_else_is_missing() {
        for header in
            ["", "Bearer", "Bearer ", "Bearer sk_test_abc", "Basic svc_live_abc", "svc_test_abc", "Token svc_live_x"]
        {
            assert_eq!(presented_key(header), None, "{header:?}");
        }
    }
}
