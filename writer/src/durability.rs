//! When a commit may be acknowledged (docs/architecture.md, "Acknowledged means replicated").
//!
//! On a layout with a synchronous standby, COMMIT returning proves nothing by itself: a wait for
//! the standby that is cancelled returns success with only a WARNING (which sqlx logs and drops),
//! one that is terminated closes the connection after the local commit, a crash restart replays
//! commits no standby has, and a transaction that wrote no WAL (an answer from
//! `applied_messages`) never waits at all. So after every commit, and before every answer, the
//! writer reads on the same connection the primary's flushed WAL position and waits, bounded,
//! until a synchronous standby reports it flushed. That position covers every commit the session
//! has seen, its own included. The same connection means the same server: a commit lost in a
//! failover cannot be vouched for by the new primary's standby.
//!
//! A COMMIT that waits for a standby past the bound (strict synchronous mode with no standby
//! left waits for ever) has its wait cancelled from a connection of its own: PostgreSQL then
//! commits locally and releases the transaction's locks, the workspace's advisory lock among
//! them, instead of holding them, and a connection slot, for as long as the standby is gone.
//! Both ends are outages: no answer, and a retry that checks the same way.

use prometheus_client::metrics::counter::Counter;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::{Postgres, Transaction};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// What a commit must have reached before the writer answers for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AckWhen {
    /// `replicated` while the server names synchronous standbys
    /// (`synchronous_standby_names`), else `flushed`.
    Auto,
    /// A synchronous (or quorum) standby has flushed it: with none, nothing is acknowledged.
    Replicated,
    /// The server flushed it to its own disk (PostgreSQL's `synchronous_commit`): one node.
    Flushed,
}

/// The writer's settings of [`Durability`], shared by `run` and the operator commands that write.
#[derive(Debug, Clone, clap::Args)]
pub struct DurabilityArgs {
    /// When a commit may be acknowledged: replicated (a synchronous standby flushed it, checked
    /// by its position), flushed (on this server's disk), or auto (replicated whenever the
    /// server names synchronous standbys). The HA layout runs replicated, the single node
    /// flushed.
    #[arg(long, env = "INTAKE_WRITER_ACK_WHEN", value_enum, default_value_t = AckWhen::Auto)]
    pub ack_when: AckWhen,
    /// How long a commit may wait for a synchronous standby, and a write's answer for the
    /// standby's confirmation, before it is an outage (retried, unanswered meanwhile).
    #[arg(long, env = "INTAKE_WRITER_REPLICATION_WAIT_MS", default_value_t = 5_000)]
    pub replication_wait_ms: u64,
}

/// What [`Durability`] counts, for the writer's metrics.
#[derive(Clone, Default)]
pub struct DurabilityCounters {
    pub unconfirmed: Counter,
    pub rechecked: Counter,
}

/// How long a COMMIT has to return once its wait for the standby was cancelled.
const CANCEL_GRACE: Duration = Duration::from_secs(2);
/// The shortest and the longest pause between two looks at the standbys' positions.
const MIN_POLL: Duration = Duration::from_millis(1);
const MAX_POLL: Duration = Duration::from_millis(20);

#[derive(Clone)]
pub struct Durability {
    when: AckWhen,
    wait: Duration,
    /// A connection of its own, to cancel a COMMIT's wait (sqlx cannot send PostgreSQL's cancel
    /// request itself).
    control: PgPool,
    /// Commits whose wait was cancelled, and answers held back, for want of a standby's flush.
    unconfirmed: Counter,
    /// Confirmations that had to look at the standbys' positions again.
    rechecked: Counter,
    /// Warned once that this role cannot read the standbys' positions.
    told_blind: Arc<AtomicBool>,
}

/// The flushed position and whether a synchronous standby has it, in one round trip after the
/// commit. For a role that is neither superuser nor `pg_read_all_stats` (`pg_monitor`), the
/// walsenders show with every column but the pid null.
/// A server in recovery (a primary demoted under the connection) has no flushed position of
/// its own to give: the target is then null.
///
/// The walsenders are read from `pg_stat_get_wal_senders()`, the function under the view
/// `pg_stat_replication`, with the same rows and columns: the view also joins every backend's
/// status (`pg_stat_get_activity`), which copies all `max_connections` slots on each call,
/// 0.15 to 0.25 ms of the backend's CPU at 300 connections, after every commit.
const CONFIRM: &str = "
    SELECT target::text,
           current_setting('synchronous_standby_names') <> '' AS named,
           EXISTS (SELECT FROM pg_stat_get_wal_senders()
                    WHERE sync_state IN ('sync', 'quorum') AND flush_lsn >= target) AS flushed,
           EXISTS (SELECT FROM pg_stat_get_wal_senders() WHERE sync_state IS NULL) AS blind
      FROM (SELECT CASE WHEN pg_is_in_recovery() THEN NULL ELSE pg_current_wal_flush_lsn() END) AS t(target)";

const FLUSHED: &str = "SELECT EXISTS (SELECT FROM pg_stat_get_wal_senders()
                                       WHERE sync_state IN ('sync', 'quorum') AND flush_lsn >= $1::pg_lsn)";

/// Only a backend still waiting for the standby is cancelled: a cancel that arrives once the
/// commit is done would cancel that connection's next statement instead.
const CANCEL_WAIT: &str =
    "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid = $1 AND wait_event = 'SyncRep'";

impl Durability {
    /// `node`: the database the commits go to; its control connection is made when first needed.
    pub fn new(node: PgConnectOptions, args: &DurabilityArgs, counters: DurabilityCounters) -> Durability {
        let control = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(Durability::control_options(node));
        Durability {
            when: args.ack_when,
            wait: Duration::from_millis(args.replication_wait_ms),
            control,
            unconfirmed: counters.unconfirmed,
            rechecked: counters.rechecked,
            told_blind: Arc::default(),
        }
    }

    /// The control connection's options on `node`: its statements are short, or something is
    /// wrong.
    pub fn control_options(node: PgConnectOptions) -> PgConnectOptions {
        node.options([("statement_timeout", "2000")])
    }

    /// The control connection's pool, for [`crate::primary::Primary::follow`].
    pub fn control(&self) -> &PgPool {
        &self.control
    }

    /// Commits `tx`, whose session is backend `pid`, within the bound; a wait for the standby
    /// past it is cancelled. Success says the commit is done on this server, no more: then
    /// [`Durability::confirm`] on the same connection.
    pub async fn commit(&self, tx: Transaction<'_, Postgres>, pid: i32) -> Result<(), sqlx::Error> {
        let commit = tx.commit();
        tokio::pin!(commit);
        if let Ok(committed) = tokio::time::timeout(self.wait, &mut commit).await {
            return committed;
        }
        self.unconfirmed.inc();
        tracing::warn!(
            pid,
            wait_ms = self.wait.as_millis(),
            "a commit waited for a synchronous standby past the bound; cancelling its wait"
        );
        if let Err(error) = sqlx::query(CANCEL_WAIT).bind(pid).execute(&self.control).await {
            tracing::warn!(%error, pid, "could not cancel a commit's wait for the standby");
        }
        match tokio::time::timeout(CANCEL_GRACE, commit).await {
            Ok(committed) => committed,
            Err(_) => Err(unconfirmed("a commit still waited after its wait for the standby was cancelled")),
        }
    }

    /// Returns once every commit this connection's session has seen is as durable as the
    /// setting asks; an outage error (the connection is then to be closed) if it is not within
    /// the bound.
    pub async fn confirm(&self, connection: &mut PgConnection) -> Result<(), sqlx::Error> {
        if self.when == AckWhen::Flushed {
            return Ok(());
        }
        let (target, named, flushed, blind): (Option<String>, bool, bool, bool) =
            sqlx::query_as(CONFIRM).fetch_one(&mut *connection).await?;
        let Some(target) = target else {
            return Err(unconfirmed("the connection's server is in recovery, no longer the primary"));
        };
        if flushed || (self.when == AckWhen::Auto && !named) {
            return Ok(());
        }
        if blind && !self.told_blind.swap(true, Ordering::Relaxed) {
            tracing::error!(
                "pg_stat_replication hides the standbys' positions from this role, so no commit can be \
                 confirmed replicated: grant it pg_monitor (docs/operations.md, \"Acknowledged means replicated\")"
            );
        }
        self.rechecked.inc();
        let deadline = Instant::now() + self.wait;
        // The usual miss: a later commit of another session moved the flushed position on, and
        // the standby's report of it is a round trip away, so the first look again is at once.
        // Then pauses, from the timer's resolution (tokio's: 1 ms) up.
        let mut pause = Duration::ZERO;
        loop {
            if !pause.is_zero() {
                tokio::time::sleep(pause.min(deadline.saturating_duration_since(Instant::now()))).await;
            }
            let flushed: bool = sqlx::query_scalar(FLUSHED).bind(&target).fetch_one(&mut *connection).await?;
            if flushed {
                return Ok(());
            }
            if Instant::now() >= deadline {
                self.unconfirmed.inc();
                return Err(unconfirmed("no synchronous standby has flushed the commit"));
            }
            pause = (pause * 2).clamp(MIN_POLL, MAX_POLL);
        }
    }
}

/// An outage (`retry::Failure::Outage`): the write is not answered, and its retry is.
fn unconfirmed(what: &str) -> sqlx::Error {
    sqlx::Error::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("{what}: not acknowledged")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::retry::{Classify, Failure};

    #[test]
    fn an_unconfirmed_commit_is_an_outage() {
        assert_eq!(unconfirmed("x").failure(), Failure::Outage);
    }
}
