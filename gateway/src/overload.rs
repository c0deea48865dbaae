//! Admission of writes (docs/architecture.md, "Admission"): a write the gateway cannot expect to
//! answer within its deadline is refused with 503 service_unavailable before its body is read,
//! instead of being accepted and timed out. It is decided per workspace, from that workspace's
//! own writes not yet answered by a writer, so that a workspace whose applies are stuck is
//! refused alone:
//! - the workspace's chunks wait and none of them has been answered for the stall time
//!   (its writer is stuck or far behind on it);
//! - the workspace holds its share of the cap on writes in flight, counting the writes whose
//!   body is still being read;
//! - the whole gateway holds the cap.
//!
//! Checked after the request rate limit and before the body (docs/api.md, "Error order"). A
//! write takes its place among the gateway's writes in flight only once its body is in
//! ([`Admission::write_permit`]): a body that comes slowly holds its own workspace's share for
//! up to the body read timeout, never the gateway's cap.

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
    /// Writes being read or not yet answered that one workspace may hold.
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

/// One workspace's writes whose body is being read or that no writer has answered yet.
struct Load {
    reading: usize,
    unanswered: usize,
    /// When `unanswered` last went from 0 to 1.
    busy_since: Instant,
    /// When a writer last answered a chunk of the workspace.
    last_answer: Instant,
}

impl Load {
    /// Only writes with the writers count: a body being read says nothing of them.
    fn behind(&self, stall: Duration, now: Instant) -> bool {
        self.unanswered > 0 && now.saturating_duration_since(self.busy_since.max(self.last_answer)) >= stall
    }

    fn held(&self) -> usize {
        self.reading + self.unanswered
    }
}

/// Drops a workspace's entry once it holds nothing.
fn release(workspaces: &mut HashMap<String, Load>, workspace_id: &str, done: impl FnOnce(&mut Load)) {
    if let Some(load) = workspaces.get_mut(workspace_id) {
        done(load);
        if load.held() == 0 {
            workspaces.remove(workspace_id);
        }
    }
}

/// A write admitted before its body: it holds a place in its workspace's share while its body
/// is read, and is turned into a [`WritePermit`] once the body is in. The endpoint finds it in
/// the request's extensions; dropped with the request (a body too large, too slow or broken),
/// its place is free again.
#[derive(Clone)]
pub struct AdmittedWrite(Arc<Mutex<Option<Reading>>>);

struct Reading {
    workspace_id: String,
    workspaces: Workspaces,
    gauge: Gauge,
    /// Whether dropping it frees its place: not once the place passed to a [`WritePermit`].
    holds: bool,
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.gauge.dec();
        if self.holds {
            release(&mut lock(&self.workspaces), &self.workspace_id, |load| {
                load.reading = load.reading.saturating_sub(1);
            });
        }
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
        release(&mut lock(&self.workspaces), &self.workspace_id, |load| {
            load.unanswered = load.unanswered.saturating_sub(1);
        });
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

    /// Before the body: the workspace is not behind, the gateway's cap has room now, and the
    /// workspace has room in its share, which the write then holds while its body is read.
    pub fn admit_write(&self, workspace_id: &str) -> Result<AdmittedWrite, ApiError> {
        let now = (self.clock)();
        let mut workspaces = lock(&self.workspaces);
        let load = workspaces.get(workspace_id);
        if load.is_some_and(|load| load.behind(self.stall, now)) {
            return Err(self.refuse(ShedReason::writers_behind, self.stall.as_secs().clamp(1, 60)));
        }
        // The gateway's cap first, so that a full gateway is reported as such.
        if self.writes.available_permits() == 0 {
            return Err(self.refuse(ShedReason::writes_in_flight, RETRY_AFTER_FULL_SECS));
        }
        if load.is_some_and(|load| load.held() >= self.per_workspace) {
            return Err(self.refuse(ShedReason::workspace_share, RETRY_AFTER_FULL_SECS));
        }
        let load = workspaces.entry(workspace_id.to_owned()).or_insert(Load {
            reading: 0,
            unanswered: 0,
            busy_since: now,
            last_answer: now,
        });
        load.reading += 1;
        drop(workspaces);
        self.metrics.writes_reading.inc();
        Ok(AdmittedWrite(Arc::new(Mutex::new(Some(Reading {
            workspace_id: workspace_id.to_owned(),
            workspaces: self.workspaces.clone(),
            gauge: self.metrics.writes_reading.clone(),
            holds: true,
        })))))
    }

    /// Once the body is in: the write's place among the gateway's writes in flight, refused
    /// when other writes took the last one while this body was read. The place the write held in
    /// its workspace's share passes to the permit.
    pub fn write_permit(&self, admitted: &AdmittedWrite) -> Result<WritePermit, ApiError> {
        let taken = admitted.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).take();
        let Some(mut reading) = taken else {
            return Err(ApiError::Internal("a write's permit was asked for twice".into()));
        };
        let permit = self
            .writes
            .clone()
            .try_acquire_owned()
            .map_err(|_| self.refuse(ShedReason::writes_in_flight, RETRY_AFTER_FULL_SECS))?;
        let now = (self.clock)();
        let mut workspaces = lock(&self.workspaces);
        let load = workspaces.entry(reading.workspace_id.clone()).or_insert(Load {
            reading: 1,
            unanswered: 0,
            busy_since: now,
            last_answer: now,
        });
        load.reading = load.reading.saturating_sub(1);
        if load.unanswered == 0 {
            load.busy_since = now;
        }
        load.unanswered += 1;
        reading.holds = false;
        drop(workspaces);
        self.metrics.writes_in_flight.inc();
        let ticket = WorkspaceTicket(Arc::new(Ticket {
            workspace_id: std::mem::take(&mut reading.workspace_id),
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

    /// Admitted before the body and given its permit once the body is in.
    fn admit(admission: &Admission, workspace_id: &str) -> Result<WritePermit, ApiError> {
        admission.admit_write(workspace_id).and_then(|admitted| admission.write_permit(&admitted))
    }

    fn overloaded<T>(result: &Result<T, ApiError>) -> Option<u64> {
        match result {
            Err(ApiError::Overloaded { retry_after_secs }) => Some(*retry_after_secs),
            _ => None,
        }
    }

    #[test]
    fn one_workspace_takes_at_most_its_share_and_the_others_still_get_in() {
        let admission = admission(8, 25, Duration::from_secs(60));
        let held: Vec<_> = (0..2).map(|_| admit(&admission, "stuck")).collect();
        assert!(held.iter().all(Result::is_ok));
        assert_eq!(overloaded(&admit(&admission, "stuck")), Some(1), "a quarter of 8 is 2");
        let others: Vec<_> = (0..6).map(|n| admit(&admission, &format!("other{n}"))).collect();
        assert!(others.iter().all(Result::is_ok), "the rest of the cap is left to the others");
        assert!(overloaded(&admit(&admission, "one_more")).is_some(), "the whole cap is taken");
    }

    #[test]
    fn a_chunk_still_waiting_after_its_request_gave_up_counts_until_answered() {
        let admission = admission(8, 25, Duration::from_secs(60));
        let permit = admit(&admission, "ws").ok();
        let waiting_chunk = permit.as_ref().map(|p| p.ticket.clone());
        drop(permit);
        let second = admit(&admission, "ws");
        assert!(second.is_ok());
        assert!(overloaded(&admit(&admission, "ws")).is_some(), "the unanswered chunk holds a place");
        drop(second);
        drop(waiting_chunk);
        assert!(admit(&admission, "ws").is_ok(), "answered: its place is free");
    }

    #[test]
    fn bodies_being_read_hold_their_workspaces_share_and_not_the_gateways_cap() {
        let admission = admission(8, 25, Duration::from_secs(60));
        // Four workspaces read two bodies each: their whole shares, as many as the cap.
        let reading: Vec<_> = (0..8)
            .map(|n| admission.admit_write(&format!("slow{}", n % 4)).unwrap_or_else(|_| panic!("{n}")))
            .collect();
        assert_eq!(overloaded(&admission.admit_write("slow0")), Some(1), "its share is taken by its reads");
        let other = admit(&admission, "other");
        assert!(other.is_ok(), "the cap holds no body being read");

        // Seven bodies come in and take the rest of the cap; the eighth finds it full.
        let permits: Vec<_> = reading[..7].iter().map(|r| admission.write_permit(r)).collect();
        assert!(permits.iter().all(Result::is_ok));
        assert_eq!(overloaded(&admission.write_permit(&reading[7])), Some(1));
        assert!(admission.write_permit(&reading[0]).is_err(), "one permit a write");
        drop(permits);
        drop(reading);
        assert!(admit(&admission, "slow3").is_ok(), "a refused write frees its place in its share");
        let metrics = &admission.metrics;
        assert_eq!((metrics.writes_reading.get(), metrics.writes_in_flight.get()), (0, 1));
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
        let stuck = admit(&admission, "stuck").ok();
        let moving = admit(&admission, "moving").ok();
        let slow_body = admission.admit_write("slow_body").ok();
        elapsed_ms.store(6_000, std::sync::atomic::Ordering::Relaxed);
        if let Some(permit) = &moving {
            permit.ticket.answered();
        }
        assert_eq!(overloaded(&admit(&admission, "stuck")), Some(5), "Retry-After is the stall time");
        assert!(admit(&admission, "moving").is_ok(), "answered a moment ago");
        assert!(admit(&admission, "idle").is_ok(), "nothing waiting is never behind");
        assert!(admit(&admission, "slow_body").is_ok(), "a body being read is not a write waiting for a writer");
        drop((stuck, slow_body));
        assert!(admit(&admission, "stuck").is_ok(), "once answered, admitted again");
    }
}
