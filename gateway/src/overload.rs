//! Admission of writes (DESIGN 2.6): a write the gateway cannot expect to answer within its
//! deadline is refused with 503 service_unavailable before its body is read, instead of being
//! accepted and timed out. Two signs: too many writes in flight (a cap), or writers behind
//! (chunks wait and no reply has answered one for the stall time). Checked after the request
//! rate limit and before the body (DESIGN 2.2).

use crate::api_error::ApiError;
use crate::metrics::{Metrics, ShedReason};
use crate::writes::WriteClient;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Retry-After of a refusal by the cap: a write in flight takes milliseconds to a deadline.
const RETRY_AFTER_FULL_SECS: u64 = 1;

pub struct Admission {
    writes: Arc<Semaphore>,
    stall: Duration,
    metrics: Metrics,
}

/// A write's place among the writes in flight, held until its response is made.
pub struct WritePermit {
    _permit: OwnedSemaphorePermit,
    in_flight: Gauge,
}

impl Drop for WritePermit {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

impl Admission {
    pub fn new(max_writes_in_flight: usize, stall: Duration, metrics: Metrics) -> Self {
        Admission { writes: Arc::new(Semaphore::new(max_writes_in_flight)), stall, metrics }
    }

    pub fn admit_write(&self, writes: &WriteClient) -> Result<WritePermit, ApiError> {
        if writes.writers_behind(self.stall) {
            return Err(self.refuse(ShedReason::writers_behind, self.stall.as_secs().clamp(1, 60)));
        }
        let permit = self
            .writes
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.refuse(ShedReason::writes_in_flight, RETRY_AFTER_FULL_SECS))?;
        self.metrics.writes_in_flight.inc();
        Ok(WritePermit { _permit: permit, in_flight: self.metrics.writes_in_flight.clone() })
    }

    fn refuse(&self, reason: ShedReason, retry_after_secs: u64) -> ApiError {
        self.metrics.shed(reason);
        ApiError::Overloaded { retry_after_secs }
    }
}
