//! Driving a scenario and recording it: closed loop (N clients, each sending its next request
//! when the last is answered) and open loop (a fixed rate, each latency counted from the time
//! the request was due, so a stall shows as latency instead of as fewer requests). Latencies go
//! into HDR histograms in microseconds, and where each answered write's time went (its
//! `Server-Timing` header) into a tally by latency (timing.rs).

use crate::bodies::BATCH_ITEMS;
use crate::client::{Answer, Connection, Planned};
use crate::timing::Tally;
use hdrhistogram::Histogram;
use intake_tests::serde_json::{self, json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// What a right answer is.
#[derive(Clone, Copy, Debug)]
pub enum Expect {
    /// This status; one item if it is a write.
    Status(u16, u64),
    /// 200 with every item of the batch having this result.
    Batch(&'static str),
}

#[derive(serde::Deserialize)]
struct BatchReply {
    summary: Summary,
}

#[derive(serde::Deserialize)]
struct Summary {
    created: u64,
    updated: u64,
    unchanged: u64,
    failed: u64,
}

impl Expect {
    /// Items acknowledged by a right answer, or why the answer is wrong.
    fn judge(self, answer: &Answer) -> Result<u64, String> {
        let wrong =
            || format!("{} {}", answer.status, String::from_utf8_lossy(&answer.body[..answer.body.len().min(300)]));
        match self {
            Expect::Status(status, items) if answer.status == status => Ok(items),
            Expect::Status(..) => Err(wrong()),
            Expect::Batch(result) => {
                let reply: BatchReply = serde_json::from_slice(&answer.body).map_err(|_| wrong())?;
                let s = reply.summary;
                let expected = match result {
                    "created" => s.created,
                    "unchanged" => s.unchanged,
                    _ => s.updated,
                };
                if answer.status == 200 && s.failed == 0 && expected == BATCH_ITEMS as u64 {
                    Ok(s.created + s.updated + s.unchanged)
                } else {
                    Err(wrong())
                }
            }
        }
    }
}

pub struct Recorder {
    /// Microseconds.
    pub latency: Histogram<u64>,
    pub requests: u64,
    pub items: u64,
    pub errors: u64,
    /// The first wrong answer, for the report (a benchmark with errors must say which).
    pub first_error: Option<String>,
    /// When the slowest request recorded by [`Recorder::record_now`] started (or was due), so
    /// that a stall can be laid against the logs of the other processes.
    pub slowest_started: Option<std::time::SystemTime>,
    /// The first [`SLOW_KEPT`] requests recorded by [`Recorder::record_now`] that took longer
    /// than [`SLOW`], with when each started: the shape of a stall.
    pub slow: Vec<(std::time::SystemTime, Duration)>,
    /// The stages of every answered write, by latency, and the slowest writes whole.
    pub stages: Tally,
}

pub const SLOW: Duration = Duration::from_millis(50);
const SLOW_KEPT: usize = 200;

impl Recorder {
    pub fn new() -> Recorder {
        // Up to 10 minutes at 3 significant digits.
        let latency = Histogram::new_with_bounds(1, 600_000_000, 3).unwrap_or_else(|e| panic!("histogram: {e}"));
        Recorder {
            latency,
            requests: 0,
            items: 0,
            errors: 0,
            first_error: None,
            slowest_started: None,
            slow: Vec::new(),
            stages: Tally::default(),
        }
    }

    /// Where an answered request's time went, as its `Server-Timing` header says; nothing for
    /// an answer without one (a refusal, a read, a failed write).
    pub fn place(&mut self, took: Duration, answer: &Answer) {
        fn text(value: &Option<http::HeaderValue>) -> Option<&str> {
            value.as_ref().and_then(|v| v.to_str().ok())
        }
        if let Some(server_timing) = text(&answer.server_timing) {
            self.stages.add_answer(took, server_timing, text(&answer.request_id));
        }
    }

    /// [`Recorder::record`] of a request that has just ended, keeping when the slowest started.
    pub fn record_now(&mut self, took: Duration, outcome: Result<u64, String>) {
        let started = std::time::SystemTime::now().checked_sub(took);
        if self.requests == 0 || u64::try_from(took.as_micros()).unwrap_or(u64::MAX) >= self.latency.max() {
            self.slowest_started = started;
        }
        if let Some(started) = started.filter(|_| took > SLOW && self.slow.len() < SLOW_KEPT) {
            self.slow.push((started, took));
        }
        self.record(took, outcome);
    }

    /// A request answered after its run's end: its latency and a wrong answer are recorded,
    /// but neither it nor its items count towards the run's rate.
    pub fn record_late(&mut self, took: Duration, outcome: Result<u64, String>) {
        let (requests, items) = (self.requests, self.items);
        self.record_now(took, outcome);
        (self.requests, self.items) = (requests, items);
    }

    pub fn record(&mut self, took: Duration, outcome: Result<u64, String>) {
        self.latency.saturating_record(u64::try_from(took.as_micros()).unwrap_or(u64::MAX).max(1));
        self.requests += 1;
        match outcome {
            Ok(items) => self.items += items,
            Err(error) => {
                self.errors += 1;
                self.first_error.get_or_insert(error);
            }
        }
    }

    pub fn merge(&mut self, other: Recorder) {
        if other.requests > 0 && (self.requests == 0 || other.latency.max() > self.latency.max()) {
            self.slowest_started = other.slowest_started;
        }
        let _ = self.latency.add(&other.latency);
        self.slow.extend(other.slow);
        self.slow.sort();
        self.slow.truncate(SLOW_KEPT);
        self.stages.merge(other.stages);
        self.requests += other.requests;
        self.items += other.items;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error = other.first_error;
        }
    }
}

/// A finished scenario.
pub struct Measured {
    pub recorder: Recorder,
    pub elapsed: Duration,
    pub concurrency: String,
}

/// What a scenario's throughput counts.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    Items,
    Requests,
}

impl Measured {
    /// This scenario and a later turn of it, as one: every request of both, over both times.
    pub fn followed_by(mut self, turn: Measured) -> Measured {
        self.recorder.merge(turn.recorder);
        self.elapsed += turn.elapsed;
        self
    }

    pub fn rate(&self, counted: Counted) -> f64 {
        let count = match counted {
            Counted::Items => self.recorder.items,
            Counted::Requests => self.recorder.requests,
        };
        count as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The scenario's object in report.json: exactly the keys the benchmark's contract names.
    pub fn to_json(&self, counted: Counted) -> Value {
        let ms = |q: f64| round2(self.recorder.latency.value_at_quantile(q) as f64 / 1000.0);
        let key = match counted {
            Counted::Items => "items_per_s",
            Counted::Requests => "requests_per_s",
        };
        json!({
            key: round1(self.rate(counted)),
            "p50_ms": ms(0.50),
            "p90_ms": ms(0.90),
            "p99_ms": ms(0.99),
            "max_ms": round2(self.recorder.latency.max() as f64 / 1000.0),
            "errors": self.recorder.errors,
        })
    }
}

pub fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

pub fn round2(x: f64) -> f64 {
    (x * 100.0).round() / 100.0
}

/// Client `c`'s request number `k`: what to send, to which gateway (an index into the
/// targets), and what a right answer is.
pub type ClosedPlan = Arc<dyn Fn(usize, u64) -> (Planned, Expect) + Send + Sync>;

/// `clients` clients, client c sending to gateway c % targets, until `duration` is over. The
/// rate counts what was answered within `duration`, as wrk does: the requests in flight then
/// are finished, and their latency and errors recorded, but dividing them by the time the
/// slowest of them took would make the rate of a slow run a measure of its last straggler.
pub async fn closed_loop(targets: &[String], clients: usize, duration: Duration, plan: ClosedPlan) -> Measured {
    let started = Instant::now();
    let deadline = started + duration;
    let tasks: Vec<_> = (0..clients)
        .map(|c| {
            let plan = plan.clone();
            let mut connection = Connection::new(&targets[c % targets.len()]);
            tokio::spawn(async move {
                let mut recorder = Recorder::new();
                let mut k = 0;
                while Instant::now() < deadline {
                    let (planned, expect) = plan(c, k);
                    k += 1;
                    let sent = Instant::now();
                    let answer = connection.send(&planned).await;
                    let outcome = match &answer {
                        Ok(answer) => expect.judge(answer),
                        Err(error) => Err(format!("transport: {error}")),
                    };
                    let took = sent.elapsed();
                    if Instant::now() <= deadline {
                        recorder.record_now(took, outcome);
                    } else {
                        recorder.record_late(took, outcome);
                    }
                    if let Ok(answer) = &answer {
                        recorder.place(took, answer);
                    }
                }
                recorder
            })
        })
        .collect();
    let mut recorder = Recorder::new();
    for task in tasks {
        if let Ok(own) = task.await {
            recorder.merge(own);
        }
    }
    Measured { recorder, elapsed: deadline - started, concurrency: format!("{clients} clients") }
}

/// Request number `k` of an open-loop run.
pub type OpenPlan = Arc<dyn Fn(u64) -> (Planned, Expect) + Send + Sync>;

/// `rate` requests a second for `duration`, whatever the answers take: request k is due at
/// start + k / rate and its latency runs from then. A dedicated thread keeps the schedule
/// (`std::thread::sleep` is finer than the runtime's 1 ms timer); each due request takes an
/// idle connection, or opens one (that time counts too).
pub async fn open_loop(targets: &[String], rate: f64, duration: Duration, plan: OpenPlan) -> Measured {
    open_loop_observed(targets, rate, duration, plan, Arc::new(|_, _| ())).await
}

/// Told of request k's answer: its status and whether it was right (`None`: no answer came).
pub type Observer = Arc<dyn Fn(u64, Option<(u16, bool)>) + Send + Sync>;

/// [`open_loop`], telling `observe` of every answer as it comes.
pub async fn open_loop_observed(
    targets: &[String],
    rate: f64,
    duration: Duration,
    plan: OpenPlan,
    observe: Observer,
) -> Measured {
    let (due_tx, mut due_rx) = tokio::sync::mpsc::unbounded_channel::<(u64, Instant)>();
    let started = Instant::now() + Duration::from_millis(20);
    let total = (duration.as_secs_f64() * rate) as u64;
    let pacer = std::thread::spawn(move || {
        for k in 0..total {
            let due = started + Duration::from_secs_f64(k as f64 / rate);
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if due_tx.send((k, due)).is_err() {
                break;
            }
        }
    });
    let idle: Arc<Vec<Mutex<Vec<Connection>>>> = Arc::new(targets.iter().map(|_| Mutex::new(Vec::new())).collect());
    let recorder = Arc::new(Mutex::new(Recorder::new()));
    let mut in_flight = Vec::new();
    let opened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    while let Some((k, due)) = due_rx.recv().await {
        let (plan, idle, recorder, targets, opened, observe) =
            (plan.clone(), idle.clone(), recorder.clone(), targets.to_vec(), opened.clone(), observe.clone());
        in_flight.push(tokio::spawn(async move {
            let (planned, expect) = plan(k);
            let target = k as usize % targets.len();
            let taken = idle[target].lock().unwrap_or_else(|p| p.into_inner()).pop();
            let mut connection = taken.unwrap_or_else(|| {
                opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Connection::new(&targets[target])
            });
            let answer = connection.send(&planned).await;
            let outcome = match &answer {
                Ok(answer) => {
                    let outcome = expect.judge(answer);
                    observe(k, Some((answer.status, outcome.is_ok())));
                    outcome
                }
                Err(error) => {
                    observe(k, None);
                    Err(format!("transport: {error}"))
                }
            };
            let took = due.elapsed();
            idle[target].lock().unwrap_or_else(|p| p.into_inner()).push(connection);
            let mut recorder = recorder.lock().unwrap_or_else(|p| p.into_inner());
            recorder.record_now(took, outcome);
            if let Ok(answer) = &answer {
                recorder.place(took, answer);
            }
        }));
        in_flight.retain(|task| !task.is_finished());
    }
    for task in in_flight {
        let _ = task.await;
    }
    let _ = pacer.join();
    let recorder = Arc::try_unwrap(recorder)
        .map(|m| m.into_inner().unwrap_or_else(|p| p.into_inner()))
        .unwrap_or_else(|_| Recorder::new());
    let connections = opened.load(std::sync::atomic::Ordering::Relaxed);
    Measured {
        recorder,
        elapsed: started.elapsed(),
        concurrency: format!("{rate} requests/s open loop ({connections} connections)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: &str) -> Answer {
        Answer { status, body: bytes::Bytes::from(body.to_owned()), server_timing: None, request_id: None }
    }

    fn summary(created: usize, unchanged: usize, failed: usize) -> String {
        format!(
            r#"{{"results":[],"summary":{{"created":{created},"updated":0,"unchanged":{unchanged},"failed":{failed}}}}}"#
        )
    }

    #[test]
    fn a_batch_is_right_only_when_every_item_has_the_expected_result() {
        assert_eq!(Expect::Batch("created").judge(&answer(200, &summary(BATCH_ITEMS, 0, 0))), Ok(BATCH_ITEMS as u64));
        assert!(Expect::Batch("created").judge(&answer(200, &summary(BATCH_ITEMS - 1, 0, 1))).is_err());
        assert!(Expect::Batch("created").judge(&answer(200, &summary(0, BATCH_ITEMS, 0))).is_err());
        assert_eq!(Expect::Batch("unchanged").judge(&answer(200, &summary(0, BATCH_ITEMS, 0))), Ok(BATCH_ITEMS as u64));
        assert!(Expect::Batch("created").judge(&answer(500, r#"{"error":{}}"#)).is_err());
    }

    #[test]
    fn a_status_is_right_only_when_it_is_the_expected_one() {
        assert_eq!(Expect::Status(401, 0).judge(&answer(401, "{}")), Ok(0));
        assert!(Expect::Status(201, 1).judge(&answer(200, "{}")).is_err());
    }

    #[test]
    fn turns_of_a_scenario_add_up_to_one_measurement() {
        let turn = |items: u64, ms: u64| {
            let mut recorder = Recorder::new();
            recorder.record(Duration::from_millis(ms), Ok(items));
            Measured { recorder, elapsed: Duration::from_secs(10), concurrency: String::new() }
        };
        let both = turn(300, 10).followed_by(turn(100, 500));
        assert_eq!(both.rate(Counted::Items), 20.0);
        assert_eq!(both.recorder.requests, 2);
        let max = both.to_json(Counted::Items)["max_ms"].as_f64().unwrap_or(0.0);
        assert!((max - 500.0).abs() < 1.0, "{max}");
    }

    #[test]
    fn an_answer_after_the_run_counts_its_latency_and_error_not_its_items() {
        let mut recorder = Recorder::new();
        recorder.record_now(Duration::from_millis(10), Ok(500));
        recorder.record_late(Duration::from_millis(900), Ok(500));
        recorder.record_late(Duration::from_millis(20), Err("500 internal_error".into()));
        assert_eq!((recorder.requests, recorder.items, recorder.errors), (1, 500, 1));
        assert_eq!(recorder.latency.len(), 3);
        assert!(recorder.latency.max() >= 900_000, "the straggler's latency is kept");
    }

    #[test]
    fn the_start_of_the_slowest_request_is_kept() {
        let started = |recorder: &Recorder| recorder.slowest_started.unwrap_or(std::time::UNIX_EPOCH);
        let mut fast = Recorder::new();
        fast.record_now(Duration::from_millis(10), Ok(1));
        let mut slow = Recorder::new();
        slow.record_now(Duration::from_millis(20), Ok(1));
        slow.record_now(Duration::from_secs(3600), Ok(1));
        let an_hour_ago = started(&slow);
        slow.record_now(Duration::from_millis(30), Ok(1));
        assert_eq!(started(&slow), an_hour_ago, "a faster request later leaves it");
        let age = std::time::SystemTime::now().duration_since(an_hour_ago).unwrap_or_default();
        assert!(age >= Duration::from_secs(3600) && age < Duration::from_secs(3660), "{age:?}");
        fast.merge(slow);
        assert_eq!(started(&fast), an_hour_ago, "merged, the slower one's");
    }

    #[test]
    fn percentiles_come_from_the_histogram_in_milliseconds() {
        let mut recorder = Recorder::new();
        for ms in 1..=100 {
            recorder.record(Duration::from_millis(ms), Ok(1));
        }
        recorder.record(Duration::from_millis(5), Err("boom".into()));
        let measured = Measured { recorder, elapsed: Duration::from_secs(10), concurrency: String::new() };
        let json = measured.to_json(Counted::Items);
        assert_eq!(json["items_per_s"], json!(10.0));
        assert_eq!(json["errors"], json!(1));
        assert!((json["p50_ms"].as_f64().unwrap_or(0.0) - 50.0).abs() < 1.0, "{json}");
        assert!((json["max_ms"].as_f64().unwrap_or(0.0) - 100.0).abs() < 0.2, "{json}");
    }
}
