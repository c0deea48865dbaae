//! Fixed windows per API key in Redis (docs/architecture.md, "Rate limits"): one minute unless the gateway is
//! started with a shorter one (tests use a few seconds, so that a fresh window comes soon),
//! aligned to multiples of their length since the Unix epoch. A check is one atomic round trip:
//! a Lua script that adds the cost only if it fits under the limit, so a refused request or write
//! counts nothing. Redis unreachable or slow: the request passes (fail open).

use crate::api_error::ApiError;
use crate::metrics::{Limit, LimitLabels, Metrics};
use redis::aio::ConnectionManager;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use tokio::sync::Mutex;

/// Counters outlive their window a little, for clock skew between gateways.
const KEY_TTL_MARGIN_MS: u64 = 30_000;
const WARN_INTERVAL_SECS: i64 = 10;

/// KEYS[1]: the window's counter. ARGV: cost, limit, ttl (ms). Returns {allowed (0/1), count}.
const SCRIPT: &str = r"
local count = tonumber(redis.call('GET', KEYS[1]) or '0')
local cost = tonumber(ARGV[1])
if count + cost > tonumber(ARGV[2]) then
  return {0, count}
end
count = redis.call('INCRBY', KEYS[1], cost)
if count == cost then
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
end
return {1, count}
";

/// The length of a rate-limit window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    millis: u64,
}

impl Window {
    /// Retry-After and RateLimit-Reset are whole seconds from 1 to 60, so a window is at most a
    /// minute; at least a second, so that a window is never over before its Retry-After.
    pub const MILLIS: std::ops::RangeInclusive<u64> = 1_000..=60_000;

    pub fn from_millis(millis: u64) -> Self {
        Window { millis: millis.clamp(*Self::MILLIS.start(), *Self::MILLIS.end()) }
    }

    /// The index of the window `now_ms` (milliseconds since the Unix epoch) falls in, and the
    /// whole seconds until it ends, rounded up (1 to 60).
    fn at(self, now_ms: u64) -> (u64, u64) {
        let left_ms = self.millis - now_ms % self.millis;
        (now_ms / self.millis, left_ms.div_ceil(1_000).clamp(1, 60))
    }
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
}

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
    window: Window,
    requests_per_window: u64,
    conversions_per_window: u64,
    last_warning: AtomicI64,
    metrics: Metrics,
}

impl RateLimiter {
    pub fn new(
        url: &str,
        timeout: Duration,
        window: Window,
        requests_per_window: u64,
        conversions_per_window: u64,
        metrics: Metrics,
    ) -> anyhow::Result<Self> {
        Ok(RateLimiter {
            client: redis::Client::open(url)?,
            connection: Mutex::new(None),
            script: redis::Script::new(SCRIPT),
            timeout,
            window,
            requests_per_window,
            conversions_per_window,
            last_warning: AtomicI64::new(0),
            metrics,
        })
    }

    /// Counts `cost` against the key's window. `Ok(None)` when Redis could not answer in time.
    pub async fn check(&self, key_id: &str, counter: Counter, cost: u64) -> Result<Option<Quota>, ApiError> {
        let (index, reset_secs) = self.window.at(unix_millis());
        let (name, limit, label) = match counter {
            Counter::Requests => ("req", self.requests_per_window, Limit::requests),
            Counter::Conversions => ("cnv", self.conversions_per_window, Limit::conversions),
        };
        // The window's length is part of the key: gateways started with different lengths count
        // in windows of their own instead of in each other's counters.
        let key = format!("intake:rl:{key_id}:{name}:{}ms:{index}", self.window.millis);
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
        self.script
            .key(key)
            .arg(cost)
            .arg(limit)
            .arg(self.window.millis + KEY_TTL_MARGIN_MS)
            .invoke_async(&mut connection)
            .await
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

#[cfg(test)]
mod tests {
    use super::Window;

    #[test]
    fn a_minute_window_is_aligned_to_the_unix_minute() {
        let minute = Window::from_millis(60_000);
        // 2026-01-01T00:00:00Z is a whole minute since the epoch.
        let start = 1_767_225_600_000;
        assert_eq!(minute.at(start), (start / 60_000, 60), "a window's first instant has all of it left");
        assert_eq!(minute.at(start + 1), (start / 60_000, 60), "59.999 s left round up to 60");
        assert_eq!(minute.at(start + 59_000), (start / 60_000, 1));
        assert_eq!(minute.at(start + 59_999), (start / 60_000, 1), "never 0");
        assert_eq!(minute.at(start + 60_000), (start / 60_000 + 1, 60), "the next window");
    }

    #[test]
    fn a_short_window_is_aligned_to_multiples_of_its_length() {
        let short = Window::from_millis(3_000);
        assert_eq!(short.at(9_000), (3, 3));
        assert_eq!(short.at(10_500), (3, 2), "1.5 s left round up to 2");
        assert_eq!(short.at(11_999), (3, 1));
        assert_eq!(short.at(12_000), (4, 3));
    }

    #[test]
    fn a_window_is_between_a_second_and_a_minute() {
        assert_eq!(Window::from_millis(10), Window::from_millis(1_000));
        assert_eq!(Window::from_millis(600_000), Window::from_millis(60_000));
    }
}
