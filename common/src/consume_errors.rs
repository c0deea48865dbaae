//! What a consumer does with the errors librdkafka hands it in place of messages.
//!
//! Client-wide errors (every broker down, a broker's connection failing) come through the
//! consumer's queue, in order with the rebalances queued behind them. They are taken as fast as
//! they come: waiting after each lets them pile up while the brokers are down (librdkafka raises
//! several a second while it bootstraps again), and the assignment that follows the brokers'
//! return then waits behind the pile, for minutes. The log gets the first error of a run and then
//! at most one line per interval, with how many came since the last line.

use rdkafka::error::KafkaError;
use std::time::{Duration, Instant};

/// At most one log line per this interval while errors keep coming.
const LOG_AT_MOST_EVERY: Duration = Duration::from_secs(5);

pub struct ConsumeErrors {
    what: &'static str,
    logged_at: Option<Instant>,
    not_logged: u64,
}

impl ConsumeErrors {
    /// `what` names the reading that failed, in the log line.
    pub fn new(what: &'static str) -> Self {
        Self { what, logged_at: None, not_logged: 0 }
    }

    /// Logs `error` unless a line went out less than the interval ago, then yields to the
    /// runtime's other tasks: the next error may already be waiting, and the loop must not
    /// hold its thread while it drains them.
    pub async fn record(&mut self, error: &KafkaError) {
        if let Some(not_logged) = self.count(Instant::now()) {
            tracing::warn!(%error, not_logged, "{}", self.what);
        }
        tokio::task::yield_now().await;
    }

    /// Whether an error seen at `now` is logged, and if so how many went unlogged before it.
    fn count(&mut self, now: Instant) -> Option<u64> {
        if self.logged_at.is_some_and(|at| now.duration_since(at) < LOG_AT_MOST_EVERY) {
            self.not_logged += 1;
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.not_logged))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_error_is_logged_then_one_line_per_interval_with_the_count_between() {
        let mut errors = ConsumeErrors::new("reading failed");
        let start = Instant::now();
        assert_eq!(errors.count(start), Some(0));
        for tenth in 1..50 {
            assert_eq!(errors.count(start + Duration::from_millis(100) * tenth), None);
        }
        assert_eq!(errors.count(start + LOG_AT_MOST_EVERY), Some(49));
        assert_eq!(errors.count(start + LOG_AT_MOST_EVERY + Duration::from_millis(1)), None);
    }
}
