//! The writer's one retry policy (DESIGN 2.5). A failure is either an outage (PostgreSQL or
//! Kafka unreachable, a read-only primary during a failover), retried with backoff for as long
//! as it lasts, or anything else (a bug, data a constraint refuses, a reply partition that does
//! not exist, a statement that always times out), retried a bounded number of times and then
//! given up on, so that no single message can stop a writer.

use crate::metrics::Metrics;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::fmt::Display;
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Retrying cures it once the other side is back.
    Outage,
    /// Retrying cannot be expected to cure it.
    Permanent,
}

pub trait Classify: Display {
    fn failure(&self) -> Failure;
}

impl Classify for sqlx::Error {
    fn failure(&self) -> Failure {
        let outage = match self {
            sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Tls(_) => true,
            sqlx::Error::Protocol(_) | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|code| is_outage_sqlstate(&code)),
            _ => false,
        };
        if outage {
            Failure::Outage
        } else {
            Failure::Permanent
        }
    }
}

/// SQLSTATEs of a server that is away or cannot take writes now, as opposed to one that refuses
/// this statement: class 08 (connection), 53 (insufficient resources), 57P01-57P05 (shutdown,
/// crash, cannot connect now, idle session timeout), 25006 (read-only transaction: a standby,
/// as during a failover), 40001/40P01 (serialization failure, deadlock: the next try succeeds).
/// Not 57014 (statement timeout, query cancelled): a chunk that always times out would retry
/// forever.
fn is_outage_sqlstate(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("57P")
        || matches!(code, "25006" | "40001" | "40P01")
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
}

#[derive(Clone, Copy)]
pub struct Policy {
    /// Attempts at an operation that fails permanently.
    pub max_attempts: u32,
    pub first_backoff: Duration,
    pub max_backoff: Duration,
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
        mut operation: F,
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
            let outcome = tokio::select! {
                outcome = operation() => outcome,
                () = shutdown_asked(shutdown) => return Err(Stop::Interrupted),
            };
            let error = match outcome {
                Ok(value) => return Ok(value),
                Err(error) => error,
            };
            match error.failure() {
                Failure::Outage => {
                    metrics.transient_retries.get_or_create(&crate::metrics::What { what }).inc();
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
            pause(backoff, shutdown).await.map_err(|Interrupted| Stop::Interrupted)?;
            backoff = (backoff * 2).min(self.max_backoff);
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
    fn a_failover_is_an_outage_and_a_statement_timeout_is_not() {
        assert!(is_outage_sqlstate("25006"), "read-only transaction during a failover");
        assert!(is_outage_sqlstate("08006"));
        assert!(is_outage_sqlstate("57P01"), "admin shutdown");
        assert!(is_outage_sqlstate("53300"), "too many connections");
        assert!(!is_outage_sqlstate("57014"), "statement timeout always recurs for the same chunk");
        assert!(!is_outage_sqlstate("23505"));
        assert!(!is_outage_sqlstate("22P05"), "untranslatable character");
    }

    #[test]
    fn an_unknown_partition_is_permanent_and_a_timed_out_message_an_outage() {
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::UnknownPartition).failure(), Failure::Permanent);
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge).failure(), Failure::Permanent);
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut).failure(), Failure::Outage);
        assert_eq!(KafkaError::MessageProduction(RDKafkaErrorCode::AllBrokersDown).failure(), Failure::Outage);
    }
}
