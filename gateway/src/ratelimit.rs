//! Fixed windows per API key in Redis (docs/architecture.md, "Rate limits"): one minute unless the gateway is
//! started with a shorter one (tests use a few seconds, so that a fresh window comes soon),
//! aligned to multiples of their length since the Unix epoch. A check is one atomic round trip:
//! a Lua script that adds the cost only if it fits under the limit, so a refused request or write
//! counts nothing. Redis unreachable or slow: the request passes (fail open).
//!
//! Checks of one counter that arrive while its round trip is out wait for the next and share
//! it: the script takes their costs in arrival order and answers each as if it had been checked
//! alone, one after the other. Counting stays exact; a busy key costs one round trip per burst
//! instead of one per request. (Written here: the redis crate pipelines commands but does not
//! merge them.)

use crate::api_error::ApiError;
use crate::metrics::{Limit, LimitLabels, Metrics};
use redis::aio::ConnectionManager;
use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, OnceCell};

/// Counters outlive their window a little, for clock skew between gateways.
const KEY_TTL_MARGIN_MS: u64 = 30_000;
const WARN_INTERVAL_SECS: i64 = 10;
/// Checks one round trip carries at most, so that a burst does not make one long script.
const MAX_CHECKS_PER_ROUND: usize = 512;

/// KEYS[1]: the window's counter. ARGV: limit, ttl (ms), then the costs of the checks in the
/// order they came. Each cost is added if it fits under the limit on top of those before it.
/// Returns, per check, the count after it, or -1 when it was refused (and counted nothing).
const SCRIPT: &str = r"
local limit = tonumber(ARGV[1])
local before = tonumber(redis.call('GET', KEYS[1]) or '0')
local count = before
local answers = {}
for i = 3, #ARGV do
  local cost = tonumber(ARGV[i])
  if count + cost <= limit then
    count = count + cost
    answers[#answers + 1] = count
  else
    answers[#answers + 1] = -1
  end
end
if count > before then
  redis.call('INCRBY', KEYS[1], count - before)
  if before == 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
end
return answers
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
    rounds: Arc<Rounds>,
    timeout: Duration,
    window: Window,
    requests_per_window: u64,
    conversions_per_window: u64,
    last_warning: AtomicI64,
    metrics: Metrics,
}

/// A check's answer from Redis: the count after it, or `None` when refused; or why Redis gave
/// none.
type Answer = Result<Option<u64>, String>;

struct Waiter {
    cost: u64,
    /// When the request stops waiting for Redis and passes (fail open).
    deadline: Instant,
    answer: oneshot::Sender<Answer>,
}

/// The checks of one counter waiting for its next round trip.
struct Queue {
    limit: u64,
    waiters: Vec<Waiter>,
}

/// The checks one round trip carries, and when it must be over: the first's deadline.
struct Round {
    limit: u64,
    deadline: Instant,
    waiters: Vec<Waiter>,
}

/// The round trips to Redis; a counter has a queue while a round of it is out.
struct Rounds {
    client: redis::Client,
    connection: OnceCell<ConnectionManager>,
    script: redis::Script,
    ttl_ms: u64,
    queues: std::sync::Mutex<HashMap<String, Queue>>,
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
        let rounds = Rounds {
            client: redis::Client::open(url)?,
            connection: OnceCell::new(),
            script: redis::Script::new(SCRIPT),
            ttl_ms: window.millis + KEY_TTL_MARGIN_MS,
            queues: Default::default(),
        };
        Ok(RateLimiter {
            rounds: Arc::new(rounds),
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
        let answer = self.count(key_id, counter, cost).await;
        if let Err(ApiError::RateLimited { .. }) = answer {
            let label = match counter {
                Counter::Requests => Limit::requests,
                Counter::Conversions => Limit::conversions,
            };
            self.metrics.ratelimit_refused.get_or_create(&LimitLabels { limit: label }).inc();
        }
        answer
    }

    /// Counts `cost` against the key's window like `check`, without counting a refusal in the
    /// metrics (see [`crate::limits::RateLimit::count`]).
    pub async fn count(&self, key_id: &str, counter: Counter, cost: u64) -> Result<Option<Quota>, ApiError> {
        let (index, reset_secs) = self.window.at(unix_millis());
        let (name, limit) = match counter {
            Counter::Requests => ("req", self.requests_per_window),
            Counter::Conversions => ("cnv", self.conversions_per_window),
        };
        // The window's length is part of the key: gateways started with different lengths count
        // in windows of their own instead of in each other's counters.
        let key = format!("intake:rl:{key_id}:{name}:{}ms:{index}", self.window.millis);
        // The round that carries this check ends by the check's deadline, so the wait needs no
        // timer of its own.
        let deadline = Instant::now() + self.timeout;
        let count = match Rounds::check(&self.rounds, key, limit, cost, deadline).await {
            Ok(Ok(count)) => count,
            Ok(Err(error)) => return Ok(self.fail_open(&error)),
            Err(_) => return Ok(self.fail_open("the round trip was dropped")),
        };
        let Some(count) = count else {
            return Err(ApiError::RateLimited { retry_after_secs: reset_secs });
        };
        Ok(Some(Quota { limit, remaining: limit.saturating_sub(count), reset_secs }))
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

impl Rounds {
    /// Queues the check for the counter's next round; the first check of an idle counter starts
    /// the task that sends the rounds (a task, not the request, so that a client going away
    /// cannot strand the checks queued behind it).
    fn check(rounds: &Arc<Rounds>, key: String, limit: u64, cost: u64, deadline: Instant) -> oneshot::Receiver<Answer> {
        let (answer, receiver) = oneshot::channel();
        let waiter = Waiter { cost, deadline, answer };
        let mut queues = rounds.queues.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match queues.get_mut(&key) {
            Some(queue) => queue.waiters.push(waiter),
            None => {
                queues.insert(key.clone(), Queue { limit, waiters: vec![waiter] });
                tokio::spawn(rounds.clone().send_rounds(key));
            }
        }
        receiver
    }

    /// One round at a time until the counter's queue is empty, then the queue goes. A round
    /// ends by the deadline of its first check, the earliest: a round still out then answers
    /// every check of it "timed out". A check queued behind it was queued later, so its own
    /// round still starts before its deadline.
    async fn send_rounds(self: Arc<Self>, key: String) {
        while let Some(Round { limit, deadline, waiters }) = self.next_round(&key) {
            let costs: Vec<u64> = waiters.iter().map(|waiter| waiter.cost).collect();
            let round = tokio::time::timeout_at(deadline.into(), self.round_trip(&key, limit, &costs));
            let answers = match round.await {
                Ok(Ok(answers)) if answers.len() == costs.len() => Ok(answers),
                Ok(Ok(answers)) => Err(format!("{} answers to {} checks", answers.len(), costs.len())),
                Ok(Err(error)) => Err(error.to_string()),
                Err(_) => Err("timed out".to_owned()),
            };
            match answers {
                Ok(answers) => {
                    for (waiter, count) in waiters.into_iter().zip(answers) {
                        let _gone = waiter.answer.send(Ok(u64::try_from(count).ok()));
                    }
                }
                Err(error) => {
                    for waiter in waiters {
                        let _gone = waiter.answer.send(Err(error.clone()));
                    }
                }
            }
        }
    }

    /// The checks queued for the counter's next round, or `None` (and the queue removed) when
    /// there are none.
    fn next_round(&self, key: &str) -> Option<Round> {
        let mut queues = self.queues.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let queue = queues.get_mut(key)?;
        let Some(first) = queue.waiters.first() else {
            queues.remove(key);
            return None;
        };
        let deadline = first.deadline;
        let taken = queue.waiters.len().min(MAX_CHECKS_PER_ROUND);
        Some(Round { limit: queue.limit, deadline, waiters: queue.waiters.drain(..taken).collect() })
    }

    async fn round_trip(&self, key: &str, limit: u64, costs: &[u64]) -> redis::RedisResult<Vec<i64>> {
        let mut connection =
            self.connection.get_or_try_init(|| ConnectionManager::new(self.client.clone())).await?.clone();
        let mut invocation = self.script.key(key);
        invocation.arg(limit).arg(self.ttl_ms);
        for cost in costs {
            invocation.arg(cost);
        }
        invocation.invoke_async(&mut connection).await
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
