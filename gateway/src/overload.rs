//! Admission of writes (docs/architecture.md, "Admission"): a write the gateway cannot expect to
//! answer within its deadline is refused with 503 service_unavailable before its body is read,
//! instead of being accepted and timed out. It is decided per workspace, from that workspace's
//! own writes not yet answered by a writer, so that a workspace whose applies are stuck is
//! refused alone:
//! - the workspace's chunks wait and none of them has been answered for the stall time
//!   (its writer is stuck or far behind on it);
//! - the workspace holds its share of the cap on writes in flight;
//! - the whole gateway holds the cap.
//!
//! Checked after the request rate limit and before the body (docs/api.md, "Error order").

use crate::api_error::ApiError;
use crate::metrics::{Metrics, ShedReason};
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use std::time::Instant;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Retry-After of a refusal by a cap: a write in flight takes milliseconds to a deadline.
const RETRY_AFTER_FULL_SECS: u64 = 1;

pub struct Admission {
    writes: Arc<Semaphore>,
    /// Writes not yet answered that one workspace may hold.
    per_workspace: usize,
    stall: Duration,
    workspaces: Workspaces,
    clock: Clock,
    metrics: Metrics,
}

/// Where admission reads the time: the stall rule is tested on a clock the test moves (rather
/// than tokio's paused time, whose feature would make every tokio-based dependency build twice,
/// once for the binaries and once for the tests).
pub type Clock = Arc<dyn Fn() -> Instant + Send + Sync>;

type Workspaces = Arc<Mutex<HashMap<String, Load>>>;

fn lock(workspaces: &Workspaces) -> std::sync::MutexGuard<'_, HashMap<String, Load>> {
    workspaces.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// One workspace's writes that no writer has answered yet.
struct Load {
    unanswered: usize,
    /// When `unanswered` last went from 0 to 1.
    busy_since: Instant,
    /// When a writer last answered a chunk of the workspace.
    last_answer: Instant,
}

impl Load {
    fn behind(&self, stall: Duration, now: Instant) -> bool {
        self.unanswered > 0 && now.saturating_duration_since(self.busy_since.max(self.last_answer)) >= stall
    }
}

/// A write of one workspace that no writer has answered yet. The request holds it while it
/// runs, and so does each of its chunks still waiting for a reply, even after the request gave
/// up: a chunk queued behind a stuck workspace still counts against that workspace until a
/// writer answers it.
#[derive(Clone)]
pub struct WorkspaceTicket(Arc<Ticket>);

struct Ticket {
    workspace_id: String,
    workspaces: Workspaces,
    clock: Clock,
}

impl WorkspaceTicket {
    /// A writer answered one of the write's chunks: the workspace makes progress.
    pub fn answered(&self) {
        if let Some(load) = lock(&self.0.workspaces).get_mut(&self.0.workspace_id) {
            load.last_answer = (self.0.clock)();
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut workspaces = lock(&self.workspaces);
        if let Some(load) = workspaces.get_mut(&self.workspace_id) {
            load.unanswered = load.unanswered.saturating_sub(1);
            if load.unanswered == 0 {
                workspaces.remove(&self.workspace_id);
            }
        }
    }
}

/// A write's place among the writes in flight, held until its response is made.
pub struct WritePermit {
    _permit: OwnedSemaphorePermit,
    in_flight: Gauge,
    pub ticket: WorkspaceTicket,
}

impl Drop for WritePermit {
    fn drop(&mut self) {
        self.in_flight.dec();
    }
}

impl Admission {
    /// `workspace_share_percent` of `max_writes_in_flight` (at least one write) is what one
    /// workspace may hold.
    pub fn new(max_writes_in_flight: usize, workspace_share_percent: u8, stall: Duration, metrics: Metrics) -> Self {
        Self::with_clock(max_writes_in_flight, workspace_share_percent, stall, metrics, Arc::new(Instant::now))
    }

    pub fn with_clock(
        max_writes_in_flight: usize,
        workspace_share_percent: u8,
        stall: Duration,
        metrics: Metrics,
        clock: Clock,
    ) -> Self {
        let per_workspace = (max_writes_in_flight * usize::from(workspace_share_percent) / 100).max(1);
        Admission {
            writes: Arc::new(Semaphore::new(max_writes_in_flight)),
            per_workspace,
            stall,
            workspaces: Arc::default(),
            clock,
            metrics,
        }
    }

    pub fn admit_write(&self, workspace_id: &str) -> Result<WritePermit, ApiError> {
        let now = (self.clock)();
        let mut workspaces = lock(&self.workspaces);
        let load = workspaces.get(workspace_id);
        if load.is_some_and(|load| load.behind(self.stall, now)) {
            return Err(self.refuse(ShedReason::writers_behind, self.stall.as_secs().clamp(1, 60)));
        }
        // The gateway's cap first, so that a full gateway is reported as such.
        let permit = self
            .writes
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.refuse(ShedReason::writes_in_flight, RETRY_AFTER_FULL_SECS))?;
        if load.is_some_and(|load| load.unanswered >= self.per_workspace) {
            return Err(self.refuse(ShedReason::workspace_share, RETRY_AFTER_FULL_SECS));
        }
        let load = workspaces.entry(workspace_id.to_owned()).or_insert(Load {
            unanswered: 0,
            busy_since: now,
            last_answer: now,
        });
        if load.unanswered == 0 {
            load.busy_since = now;
        }
        load.unanswered += 1;
        drop(workspaces);
        self.metrics.writes_in_flight.inc();
        let ticket = WorkspaceTicket(Arc::new(Ticket {
            workspace_id: workspace_id.to_owned(),
            workspaces: self.workspaces.clone(),
            clock: self.clock.clone(),
        }));
        Ok(WritePermit { _permit: permit, in_flight: self.metrics.writes_in_flight.clone(), ticket })
    }

    fn refuse(&self, reason: ShedReason, retry_after_secs: u64) -> ApiError {
        self.metrics.shed(reason);
        ApiError::Overloaded { retry_after_secs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(cap: usize, share: u8, stall: Duration) -> Admission {
        Admission::new(cap, share, stall, Metrics::new())
    }

    fn overloaded(result: &Result<WritePermit, ApiError>) -> Option<u64> {
        match result {
            Err(ApiError::Overloaded { retry_after_secs }) => Some(*retry_after_secs),
            _ => None,
        }
    }

    #[test]
    fn one_workspace_takes_at_most_its_share_and_the_others_still_get_in() {
        let admission = admission(8, 25, Duration::from_secs(60));
        let held: Vec<_> = (0..2).map(|_| admission.admit_write("stuck")).collect();
        assert!(held.iter().all(Result::is_ok));
        assert_eq!(overloaded(&admission.admit_write("stuck")), Some(1), "a quarter of 8 is 2");
        let others: Vec<_> = (0..6).map(|n| admission.admit_write(&format!("other{n}"))).collect();
        assert!(others.iter().all(Result::is_ok), "the rest of the cap is left to the others");
        assert!(overloaded(&admission.admit_write("one_more")).is_some(), "the whole cap is taken");
    }

    #[test]
    fn a_chunk_still_waiting_after_its_request_gave_up_counts_until_answered() {
        let admission = admission(8, 25, Duration::from_secs(60));
        let permit = admission.admit_write("ws").ok();
        let waiting_chunk = permit.as_ref().map(|p| p.ticket.clone());
        drop(permit);
        let second = admission.admit_write("ws");
        assert!(second.is_ok());
        assert!(overloaded(&admission.admit_write("ws")).is_some(), "the unanswered chunk holds a place");
        drop(second);
        drop(waiting_chunk);
        assert!(admission.admit_write("ws").is_ok(), "answered: its place is free");
    }

    #[test]
    fn a_workspace_without_an_answer_for_the_stall_time_is_refused_alone() {
        let stall = Duration::from_secs(5);
        let start = Instant::now();
        let elapsed_ms = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let clock: Clock = {
            let elapsed_ms = elapsed_ms.clone();
            Arc::new(move || start + Duration::from_millis(elapsed_ms.load(std::sync::atomic::Ordering::Relaxed)))
        };
        let admission = Admission::with_clock(64, 25, stall, Metrics::new(), clock);
        let stuck = admission.admit_write("stuck").ok();
        let moving = admission.admit_write("moving").ok();
        elapsed_ms.store(6_000, std::sync::atomic::Ordering::Relaxed);
        if let Some(permit) = &moving {
            permit.ticket.answered();
        }
        assert_eq!(overloaded(&admission.admit_write("stuck")), Some(5), "Retry-After is the stall time");
        assert!(admission.admit_write("moving").is_ok(), "answered a moment ago");
        assert!(admission.admit_write("idle").is_ok(), "nothing waiting is never behind");
        drop(stuck);
        assert!(admission.admit_write("stuck").is_ok(), "once answered, admitted again");
    }
}
