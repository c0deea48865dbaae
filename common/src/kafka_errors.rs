//! What the programs do with the errors librdkafka raises while brokers are away: log the first
//! of a run, then at most one line per interval with how many came since, and never wait on
//! them.
//!
//! They reach a program two ways, both at librdkafka's own pace while every broker is down
//! (several a second, as it bootstraps again):
//! - a client's error callback ([`QuietContext`], the context of every client, the operator
//!   commands' included, which also takes librdkafka's own log lines);
//! - a consumer's queue, in place of messages ([`ConsumeErrors`]), in order with the rebalances
//!   queued behind them. Those are taken as fast as they come: waiting after each lets them pile
//!   up, and the assignment that follows the brokers' return then waits behind the pile, for
//!   minutes.

use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;
use rdkafka::error::KafkaError;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// At most one log line per this interval while errors keep coming.
const LOG_AT_MOST_EVERY: Duration = Duration::from_secs(5);

/// Whether an error is logged: the first of a run, then one per [`LOG_AT_MOST_EVERY`].
#[derive(Default)]
pub struct ErrorLog {
    logged_at: Option<Instant>,
    not_logged: u64,
}

impl ErrorLog {
    /// Whether an error seen at `now` is logged, and if so how many went unlogged before it.
    pub fn count(&mut self, now: Instant) -> Option<u64> {
        if self.logged_at.is_some_and(|at| now.duration_since(at) < LOG_AT_MOST_EVERY) {
            self.not_logged += 1;
            return None;
        }
        self.logged_at = Some(now);
        Some(std::mem::take(&mut self.not_logged))
    }
}

/// The errors a consumer's queue hands its reading loop.
pub struct ConsumeErrors {
    what: &'static str,
    log: ErrorLog,
}

impl ConsumeErrors {
    /// `what` names the reading that failed, in the log line.
    pub fn new(what: &'static str) -> Self {
        Self { what, log: ErrorLog::default() }
    }

    /// Logs `error` unless a line went out less than the interval ago, then yields to the
    /// runtime's other tasks: the next error may already be waiting, and the loop must not
    /// hold its thread while it drains them.
    pub async fn record(&mut self, error: &KafkaError) {
        if let Some(not_logged) = self.log.count(Instant::now()) {
            tracing::warn!(%error, not_logged, "{}", self.what);
        }
        tokio::task::yield_now().await;
    }
}

/// A client context whose error callback logs through an [`ErrorLog`]: rdkafka's default logs
/// every error at ERROR, and during an outage that is a line per bootstrap attempt.
#[derive(Default)]
pub struct QuietContext {
    log: Mutex<ErrorLog>,
}

impl QuietContext {
    /// The error callback's body, for contexts that have more to do than this one.
    pub fn error(&self, error: &KafkaError, reason: &str) {
        let counted = self.log.lock().unwrap_or_else(std::sync::PoisonError::into_inner).count(Instant::now());
        if let Some(not_logged) = counted {
            tracing::warn!(%error, reason, not_logged, "Kafka client error");
        }
    }
}

impl QuietContext {
    /// librdkafka's own log lines, through this program's log (target `librdkafka`, so that
    /// `INTAKE_LOG=info,librdkafka=debug` selects them) rather than through rdkafka's default,
    /// which goes by way of the `log` crate.
    pub fn log(level: RDKafkaLogLevel, facility: &str, message: &str) {
        match level {
            RDKafkaLogLevel::Emerg | RDKafkaLogLevel::Alert | RDKafkaLogLevel::Critical | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", facility, "{message}")
            }
            RDKafkaLogLevel::Warning => tracing::warn!(target: "librdkafka", facility, "{message}"),
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", facility, "{message}")
            }
            RDKafkaLogLevel::Debug => tracing::debug!(target: "librdkafka", facility, "{message}"),
        }
    }
}

impl ClientContext for QuietContext {
    fn error(&self, error: KafkaError, reason: &str) {
        QuietContext::error(self, &error, reason);
    }

    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        QuietContext::log(level, facility, message);
    }

    // These clients ask for no statistics; without this, each would compile rdkafka's
    // deserializer of them all the same.
    fn stats_raw(&self, _statistics: &[u8]) {}
}

impl ConsumerContext for QuietContext {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_error_is_logged_then_one_line_per_interval_with_the_count_between() {
        let mut log = ErrorLog::default();
        let start = Instant::now();
        assert_eq!(log.count(start), Some(0));
        for tenth in 1..50 {
            assert_eq!(log.count(start + Duration::from_millis(100) * tenth), None);
        }
        assert_eq!(log.count(start + LOG_AT_MOST_EVERY), Some(49));
        assert_eq!(log.count(start + LOG_AT_MOST_EVERY + Duration::from_millis(1)), None);
    }
}
