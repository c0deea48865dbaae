//! Fixed one-minute windows per API key in Redis (docs/architecture.md, "Rate limits"). A check is one atomic
//! round trip: a Lua script that adds the cost only if it fits under the limit, so a refused
//! request or write counts nothing. Redis unreachable or slow: the request passes (fail open).

use crate::api_error::ApiError;
use crate::metrics::{Limit, LimitLabels, Metrics};
use redis::aio::ConnectionManager;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use tokio::sync::Mutex;

const WINDOW_SECS: i64 = 60;
/// Counters outlive their window a little, for clock skew between gateways.
const KEY_TTL_SECS: i64 = WINDOW_SECS + 30;
const WARN_INTERVAL_SECS: i64 = 10;

/// KEYS[1]: the window's counter. ARGV: cost, limit, ttl. Returns {allowed (0/1), count}.
const SCRIPT: &str = r"
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
local cost = tonumber(ARGV[1])
if count + cost > tonumber(ARGV[2]) then
  return {0, count}
end
count = redis.call('INCRBY', KEYS[1], cost)
if count == cost then
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
return {1, count}
";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    Requests,
    Conversions,
}

/// The request window's state, for the RateLimit-* response headers.
#[derive(Debug, Clone, Copy)]
pub struct Quota {
    pub limit: u64,
    pub remaining: u64,
    pub reset_secs: u64,
}

pub struct RateLimiter {
    client: redis::Client,
    connection: Mutex<Option<ConnectionManager>>,
    script: redis::Script,
    timeout: Duration,
    requests_per_window: u64,
    conversions_per_window: u64,
    last_warning: AtomicI64,
    metrics: Metrics,
}

impl RateLimiter {
    pub fn new(
        url: &str,
        timeout: Duration,
        requests_per_window: u64,
        conversions_per_window: u64,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        Ok(RateLimiter {
            client: redis::Client::open(url)?,
            connection: Mutex::new(None),
            script: redis::Script::new(SCRIPT),
            timeout,
            requests_per_window,
            conversions_per_window,
            last_warning: AtomicI64::new(0),
            metrics,
        })
    }

    /// Counts `cost` against the key's window. `Ok(None)` when Redis could not answer in time.
    pub async fn check(&self, key_id: &str, counter: Counter, cost: u64) -> Result<Option<Quota>, ApiError> {
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let window = now.div_euclid(WINDOW_SECS);
        let reset_secs = u64::try_from(WINDOW_SECS - now.rem_euclid(WINDOW_SECS)).unwrap_or(60);
        let (name, limit, label) = match counter {
            Counter::Requests => ("req", self.requests_per_window, Limit::requests),
            Counter::Conversions => ("cnv", self.conversions_per_window, Limit::conversions),
        };
        let key = format!("intake:rl:{key_id}:{name}:{window}");
        let (allowed, count) = match tokio::time::timeout(self.timeout, self.invoke(&key, cost, limit)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(error)) => return Ok(self.fail_open(&error.to_string())),
            Err(_) => return Ok(self.fail_open("timed out")),
        };
        if allowed == 0 {
            self.metrics.ratelimit_refused.get_or_create(&LimitLabels { limit: label }).inc();
            return Err(ApiError::RateLimited { retry_after_secs: reset_secs });
        }
        Ok(Some(Quota { limit, remaining: limit.saturating_sub(count), reset_secs }))
    }

    async fn invoke(&self, key: &str, cost: u64, limit: u64) -> redis::RedisResult<(u64, u64)> {
        let mut connection = {
            let mut slot = self.connection.lock().await;
            match slot.as_ref() {
                Some(connection) => connection.clone(),
                None => {
                    let connection = ConnectionManager::new(self.client.clone()).await?;
                    *slot = Some(connection.clone());
                    connection
                }
            }
        };
        self.script.key(key).arg(cost).arg(limit).arg(KEY_TTL_SECS).invoke_async(&mut connection).await
    }

    fn fail_open(&self, reason: &str) -> Option<Quota> {
        self.metrics.redis_fail_open.inc();
        let now = time::OffsetDateTime::now_utc().unix_timestamp();
        let last = self.last_warning.load(Ordering::Relaxed);
        if now - last >= WARN_INTERVAL_SECS
            && self.last_warning.compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed).is_ok()
        {
            tracing::warn!(reason, "rate limiter unavailable; letting requests through");
        }
        None
    }
}
