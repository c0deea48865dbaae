//! The rate limits as a seam: the request limit's layer and the conversion limit in the write
//! endpoints count through [`RateLimit`]; the gateway counts in Redis
//! ([`crate::ratelimit::RateLimiter`]), the fast tests in memory.

use crate::api_error::ApiError;
use crate::ratelimit::{Counter, Quota, RateLimiter};
use crate::sink::BoxFuture;

pub trait RateLimit: Send + Sync {
    /// Counts `cost` against the key's window: the window's state for the RateLimit-* headers,
    /// `None` when the count could not be made (the request passes), or 429 rate_limited.
    fn check<'a>(
        &'a self,
        key_id: &'a str,
        counter: Counter,
        cost: u64,
    ) -> BoxFuture<'a, Result<Option<Quota>, ApiError>>;

    /// Counts like `check`, for a request that another refusal answers: a refusal here is not
    /// its answer, so the limit's refusal metric does not count it.
    fn count<'a>(
        &'a self,
        key_id: &'a str,
        counter: Counter,
        cost: u64,
    ) -> BoxFuture<'a, Result<Option<Quota>, ApiError>>;
}

impl RateLimit for RateLimiter {
    fn check<'a>(
        &'a self,
        key_id: &'a str,
        counter: Counter,
        cost: u64,
    ) -> BoxFuture<'a, Result<Option<Quota>, ApiError>> {
        // The inherent method, which counts in Redis.
        Box::pin(RateLimiter::check(self, key_id, counter, cost))
    }

    fn count<'a>(
        &'a self,
        key_id: &'a str,
        counter: Counter,
        cost: u64,
    ) -> BoxFuture<'a, Result<Option<Quota>, ApiError>> {
        Box::pin(RateLimiter::count(self, key_id, counter, cost))
    }
}

/// Limits counted in memory for the fast tests, in one window that never ends.
#[cfg(test)]
pub struct MemoryLimits {
    pub requests: u64,
    pub conversions: u64,
    counts: std::sync::Mutex<std::collections::HashMap<(String, bool), u64>>,
}

#[cfg(test)]
impl MemoryLimits {
    /// The reset and Retry-After these limits answer with.
    pub const RESET_SECS: u64 = 42;

    pub fn new(requests: u64, conversions: u64) -> Self {
        MemoryLimits { requests, conversions, counts: Default::default() }
    }
}

#[cfg(test)]
impl RateLimit for MemoryLimits {
    fn check<'a>(
        &'a self,
        key_id: &'a str,
        counter: Counter,
        cost: u64,
    ) -> BoxFuture<'a, Result<Option<Quota>, ApiError>> {
        let limit = match counter {
            Counter::Requests => self.requests,
            Counter::Conversions => self.conversions,
        };
        let mut counts = self.counts.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let count = counts.entry((key_id.to_owned(), counter == Counter::Requests)).or_default();
        // As in Redis: a refused request counts nothing.
        let answer = if *count + cost > limit {
            Err(ApiError::RateLimited { retry_after_secs: Self::RESET_SECS })
        } else {
            *count += cost;
            Ok(Some(Quota { limit, remaining: limit - *count, reset_secs: Self::RESET_SECS }))
        };
        Box::pin(std::future::ready(answer))
    }

    /// These limits keep no metrics: the same as a check.
    fn count<'a>(
        &'a self,
        key_id: &'a str,
        counter: Counter,
        cost: u64,
    ) -> BoxFuture<'a, Result<Option<Quota>, ApiError>> {
        self.check(key_id, counter, cost)
    }
}
