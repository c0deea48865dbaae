//! The writer's one retry policy (docs/architecture.md, "Failure classes"). A failure is either an
//! outage (PostgreSQL or Kafka unreachable, a read-only primary during a failover), retried with
//! backoff for as long as it lasts, or anything else (a bug, data a constraint refuses, a reply
//! partition that does not exist, a statement that always times out), retried a bounded number of
//! times and then given up on, so that no single message can stop a writer.

use crate::inbox::BoxFuture;
use crate::metrics::Metrics;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The other side is away (unreachable, shutting down, out of connections): retrying cures
    /// it once it is back.
    Outage,
    /// The connection reached a node that takes no writes: a primary demoted by a failover
    /// (25006). An outage, retried without counting an attempt and never decided by the probe,
    /// which would reach the new primary and succeed; the connection is closed (`store.rs`).
    Standby,
    /// Of a class that can be an outage (out of memory, disk full, a crashed backend, a
    /// failover, a deadlock) or this message's own doing: an outage only while PostgreSQL
    /// refuses other writes too (see `store::probe_writes`); else it takes the bounded way.
    MaybeOutage,
    /// Another session holds a lock the chunk needs (55P03 lock_not_available): the workspace
    /// waits and is tried again, without counting an attempt.
    Busy,
    /// Retrying cannot be expected to cure it (including 57014, a statement that timed out:
    /// the same chunk would time out again).
    Permanent,
}

pub trait Classify: Display {
    fn failure(&self) -> Failure;
}

impl Classify for sqlx::Error {
    fn failure(&self) -> Failure {
        match self {
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => {
                Failure::Outage
            }
            sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => Failure::MaybeOutage,
            sqlx::Error::Database(db) => db.code().map_or(Failure::Permanent, |code| sqlstate_failure(&code)),
            _ => Failure::Permanent,
        }
    }
}

/// Class 08 (connection), 53300 (too many connections) and 57P01-57P03 (shutdown, crash,
/// cannot connect now) are a server that is away; 25006 (read-only transaction) is a node that
/// is no longer the primary. The rest of class 53 (disk full, out of memory), 57P04-57P05 and
/// 40001/40P01 (serialization failure, deadlock) may be one message's own doing as well. So may
/// an undefined column, table or function (42703, 42P01, 42883): a schema behind this version's,
/// which the probe finds (`Store::takes_writes`), is waited out, never dead-lettered.
fn sqlstate_failure(code: &str) -> Failure {
    match code {
        "53300" | "57P01" | "57P02" | "57P03" => Failure::Outage,
        "25006" => Failure::Standby,
        "55P03" => Failure::Busy,
        "40001" | "40P01" | "57P04" | "57P05" | "42703" | "42P01" | "42883" => Failure::MaybeOutage,
        _ if code.starts_with("08") => Failure::Outage,
        _ if code.starts_with("53") => Failure::MaybeOutage,
        _ => Failure::Permanent,
    }
}

impl Classify for KafkaError {
    fn failure(&self) -> Failure {
        let code = match self {
            KafkaError::MessageProduction(code) | KafkaError::Flush(code) => *code,
            KafkaError::Canceled => return Failure::Outage,
            _ => return Failure::Permanent,
        };
        // The broker is away or changing leaders; anything else (an unknown partition or topic,
        // a message too large, an authorization failure) is this message's own problem.
        let outage = matches!(
            code,
            RDKafkaErrorCode::MessageTimedOut
                | RDKafkaErrorCode::AllBrokersDown
                | RDKafkaErrorCode::BrokerTransportFailure
                | RDKafkaErrorCode::QueueFull
                | RDKafkaErrorCode::RequestTimedOut
                | RDKafkaErrorCode::NetworkException
                | RDKafkaErrorCode::NotLeaderForPartition
                | RDKafkaErrorCode::LeaderNotAvailable
                | RDKafkaErrorCode::NotEnoughReplicas
                | RDKafkaErrorCode::NotEnoughReplicasAfterAppend
                | RDKafkaErrorCode::BrokerNotAvailable
                | RDKafkaErrorCode::NotCoordinator
                | RDKafkaErrorCode::CoordinatorNotAvailable
        );
        if outage {
            Failure::Outage
        } else {
            Failure::Permanent
        }
    }
}

/// Why a retried operation stopped without succeeding.
pub enum Stop<E> {
    /// The writer is shutting down.
    Interrupted,
    /// A permanent failure persisted for every attempt, or an outage outlasted `until`.
    GaveUp { error: E, attempts: u32 },
    /// A lock the operation needs is held elsewhere ([`Failure::Busy`]): its caller waits.
    Busy { error: E },
}

#[derive(Clone, Copy)]
pub struct Policy {
    /// Attempts at an operation that fails permanently.
    pub max_attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
}

/// What a retried database operation asks of the database besides the operation itself.
pub trait Probe: Send + Sync {
    /// Whether PostgreSQL takes writes at all: a [`Failure::MaybeOutage`] is the operation's own
    /// failure when it does, an outage when it does not.
    fn takes_writes(&self) -> BoxFuture<'_, bool>;

    /// Resolves once the primary moves after this call (`primary::Moves::next_move`): a retry
    /// waiting out an outage on the old node goes to the new one at once, rather than after a
    /// backoff grown meanwhile.
    fn moved(&self) -> BoxFuture<'static, ()>;
}

/// For what is not a database operation: nothing is probed, nothing moves.
struct Unprobed;

impl Probe for Unprobed {
    fn takes_writes(&self) -> BoxFuture<'_, bool> {
        Box::pin(std::future::ready(false))
    }

    fn moved(&self) -> BoxFuture<'static, ()> {
        Box::pin(std::future::pending())
    }
}

impl Policy {
    /// Runs `operation` until it succeeds, retrying outages with backoff (until `until`, if
    /// given: e.g. a reply nobody waits for after its deadline) and permanent failures up to
    /// `max_attempts` times in all. Shutdown interrupts an attempt too: a send to brokers that
    /// are away waits out the producer's timeouts, longer than a bounded shutdown allows, and
    /// what is interrupted stays uncommitted for the writer that takes the partition over.
    pub async fn run<T, E, F, Fut>(
        &self,
        what: &'static str,
        metrics: &Metrics,
        until: Option<Instant>,
        shutdown: &mut watch::Receiver<bool>,
        operation: F,
    ) -> Result<T, Stop<E>>
    where
        E: Classify,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.run_probed(what, metrics, until, shutdown, operation, &Unprobed).await
    }

    /// [`Policy::run`] of a database operation: `database` says whether a
    /// [`Failure::MaybeOutage`] is an outage, and ends a pause between attempts when the primary
    /// moves ([`Probe`]).
    pub async fn run_probed<T, E, F, Fut>(
        &self,
        what: &'static str,
        metrics: &Metrics,
        until: Option<Instant>,
        shutdown: &mut watch::Receiver<bool>,
        mut operation: F,
        database: &dyn Probe,
    ) -> Result<T, Stop<E>>
    where
        E: Classify,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let (mut attempts, mut permanent) = (0u32, 0u32);
        let mut backoff = self.first_backoff;
        loop {
            attempts += 1;
            let next_move = database.moved();
            let outcome = tokio::select! {
                outcome = operation() => outcome,
                () = shutdown_asked(shutdown) => return Err(Stop::Interrupted),
            };
            let error = match outcome {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            let failure = match error.failure() {
                Failure::MaybeOutage if database.takes_writes().await => Failure::Permanent,
                Failure::MaybeOutage => Failure::Outage,
                other => other,
            };
            match failure {
                Failure::Busy => return Err(Stop::Busy { error }),
                Failure::Outage | Failure::MaybeOutage | Failure::Standby => {
                    metrics.transient_retries.get_or_create(&crate::metrics::What { what }).inc();
                    metrics.last_outage_retry.set(crate::metrics::unix_seconds());
                    tracing::warn!(%error, what, attempts, "unavailable; retrying");
                    if until.is_some_and(|until| Instant::now() + backoff > until) {
                        return Err(Stop::GaveUp { error, attempts });
                    }
                }
                Failure::Permanent => {
                    permanent += 1;
                    tracing::error!(%error, what, attempts, "failed");
                    if permanent >= self.max_attempts {
                        return Err(Stop::GaveUp { error, attempts });
                    }
                }
            }
            tokio::select! {
                paused = pause(backoff, shutdown) => {
                    paused.map_err(|Interrupted| Stop::Interrupted)?;
                    backoff = (backoff * 2).min(self.max_backoff);
                }
                () = next_move => backoff = self.first_backoff,
            }
        }
    }
}

/// The writer is shutting down.
pub struct Interrupted;

pub async fn pause(duration: Duration, shutdown: &mut watch::Receiver<bool>) -> Result<(), Interrupted> {
    tokio::select! {
        () = shutdown_asked(shutdown) => Err(Interrupted),
        () = tokio::time::sleep(duration) => Ok(()),
    }
}

/// Resolves once shutdown is asked, at once if it already was (unlike `changed`, which misses
/// a change another wait has already seen).
pub async fn shutdown_asked(shutdown: &mut watch::Receiver<bool>) {
    // An error means the sender is gone, which happens only as the process ends.
    let _ = shutdown.wait_for(|stop| *stop).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_of_sqlstate() {
        assert_eq!(sqlstate_failure("08006"), Failure::Outage);
        assert_eq!(sqlstate_failure("53300"), Failure::Outage, "too many connections");
        assert_eq!(sqlstate_failure("57P01"), Failure::Outage, "admin shutdown");
        assert_eq!(sqlstate_failure("53200"), Failure::MaybeOutage, "out of memory");
        assert_eq!(sqlstate_failure("53100"), Failure::MaybeOutage, "disk full");
        assert_eq!(sqlstate_failure("25006"), Failure::Standby, "a primary demoted by a failover");
        assert_eq!(sqlstate_failure("40P01"), Failure::MaybeOutage);
        assert_eq!(sqlstate_failure("55P03"), Failure::Busy, "a lock held elsewhere");
        assert_eq!(sqlstate_failure("57014"), Failure::Permanent, "a statement timeout recurs for the same chunk");
        assert_eq!(sqlstate_failure("23505"), Failure::Permanent);
        assert_eq!(sqlstate_failure("22P05"), Failure::Permanent, "untranslatable character");
        for undefined in ["42703", "42P01", "42883"] {
            assert_eq!(sqlstate_failure(undefined), Failure::MaybeOutage, "a schema behind, if the probe finds one");
        }
    }

    /// An error of a chosen class.
    struct Failing(Failure);

    impl Display for Failing {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "{:?}", self.0)
        }
    }

    impl Classify for Failing {
        fn failure(&self) -> Failure {
            self.0
        }
    }

    const ONCE: Policy =
        Policy { max_attempts: 1, first_backoff: Duration::from_millis(1), max_backoff: Duration::from_millis(1) };

    /// Runs an operation that fails with `failures` in turn and then succeeds; returns whether it
    /// succeeded and how many times the probe was asked.
    async fn run_through(failures: Vec<Failure>) -> (bool, usize) {
        let metrics = Metrics::new();
        let (_stop, mut shutdown) = watch::channel(false);
        let failures = std::sync::Mutex::new(failures.into_iter());
        let (_moves, probe) = Database::new();
        let outcome = ONCE
            .run_probed(
                "test",
                &metrics,
                None,
                &mut shutdown,
                || {
                    let next = failures.lock().unwrap_or_else(|p| p.into_inner()).next();
                    std::future::ready(next.map_or(Ok(()), |failure| Err(Failing(failure))))
                },
                &probe,
            )
            .await;
        (outcome.is_ok(), probe.probes.into_inner())
    }

    /// A database whose probe write succeeds, as it would on a new primary, and whose primary
    /// moves when `moves` says so.
    struct Database {
        probes: std::sync::atomic::AtomicUsize,
        moves: watch::Receiver<u64>,
    }

    impl Database {
        fn new() -> (watch::Sender<u64>, Database) {
            let (moves, moved) = watch::channel(0);
            (moves, Database { probes: Default::default(), moves: moved })
        }
    }

    impl Probe for Database {
        fn takes_writes(&self) -> BoxFuture<'_, bool> {
            self.probes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Box::pin(std::future::ready(true))
        }

        fn moved(&self) -> BoxFuture<'static, ()> {
            let mut moves = self.moves.clone();
            moves.mark_unchanged();
            Box::pin(async move {
                let _ = moves.changed().await;
            })
        }
    }

    #[tokio::test]
    async fn a_demoted_primary_is_waited_out_without_the_probe_or_an_attempt() {
        let (succeeded, probes) = run_through(vec![Failure::Standby; 5]).await;
        assert!(succeeded, "five 25006 in a row, with one attempt allowed, still end in success");
        assert_eq!(probes, 0, "the probe, reaching the new primary, would call the chunk permanent");
    }

    #[tokio::test]
    async fn a_maybe_outage_while_writes_succeed_elsewhere_is_given_up_on() {
        let (succeeded, probes) = run_through(vec![Failure::MaybeOutage]).await;
        assert!(!succeeded);
        assert_eq!(probes, 1);
    }

    #[tokio::test]
    async fn outages_do_not_use_up_attempts() {
        assert_eq!(run_through(vec![Failure::Outage; 4]).await, (true, 0));
    }

    #[tokio::test]
    async fn a_move_of_the_primary_ends_the_pause_before_the_next_attempt() {
        let metrics = Metrics::new();
        let (_stop, mut shutdown) = watch::channel(false);
        let (moves, database) = Database::new();
        let slow =
            Policy { max_attempts: 1, first_backoff: Duration::from_secs(60), max_backoff: Duration::from_secs(60) };
        let attempts = std::sync::atomic::AtomicUsize::new(0);
        let started = Instant::now();
        let running = slow.run_probed(
            "test",
            &metrics,
            None,
            &mut shutdown,
            || {
                let first = attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed) == 0;
                std::future::ready(if first { Err(Failing(Failure::Outage)) } else { Ok(()) })
            },
            &database,
        );
        let moving = async {
            tokio::time::sleep(Duration::from_millis(50)).await;
            moves.send_modify(|n| *n += 1);
        };
        let (outcome, ()) = tokio::join!(tokio::time::timeout(Duration::from_secs(5), running), moving);
        assert!(matches!(outcome, Ok(Ok(()))), "the second attempt succeeds right after the move");
        assert!(started.elapsed() < Duration::from_secs(5), "not after the minute's backoff");
        assert_eq!(attempts.into_inner(), 2);
    }

    #[test]
    fn an_unknown_partition_is_permanent_and_a_timed_out_message_an_outage() {
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition).failure(), Failure::Permanent);
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge).failure(), Failure::Permanent);
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut).failure(), Failure::Outage);
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::AllBrokersDown).failure(), Failure::Outage);
    }
}
