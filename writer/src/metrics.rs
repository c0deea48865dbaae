//! Prometheus metrics of the writer, served on its ops port (`ops.rs`).

use intake_common::metrics::{seconds_histogram, Registrar};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Partition {
    pub partition: i32,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Outcome {
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ItemResult {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Reason {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Workspace {
    pub workspace_id: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct What {
    pub what: &'static str,
}

pub struct Metrics {
    pub registry: Registry,
    /// Messages of the requests topic not yet applied, per assigned partition.
    pub consumer_lag: Family<Partition, Gauge>,
    pub assigned_partitions: Gauge,
    pub group_members: Gauge,
    /// 1 while the writer holds partitions with lag and has made no progress for the stall
    /// timeout (docs/operations.md, "Ops ports": an orchestrator restarts it).
    pub stalled: Gauge,
    /// Messages answered: applied (first time), already_applied (redelivery), failed.
    pub messages: Family<Outcome, Counter>,
    pub items: Family<ItemResult, Counter>,
    /// Seconds to apply one group of messages (one transaction).
    pub apply_seconds: Histogram,
    pub transient_retries: Family<What, Counter>,
    /// Unix time in seconds of the last retry of an outage (PostgreSQL or Kafka away), 0 before
    /// any: a writer waiting one out is not stuck, and no restart would help it.
    pub last_outage_retry: Gauge<f64, AtomicU64>,
    pub dead_lettered: Family<Reason, Counter>,
    /// Replies that could not be delivered and were given up on (the gateway answered 500).
    pub replies_dropped: Counter,
    /// Rows of applied_messages (PostgreSQL's estimate).
    pub applied_messages_rows: Gauge,
    /// Seconds each workspace whose lock is held elsewhere has waited, while it waits (its
    /// messages are held; the others go on).
    pub workspace_waiting_seconds: Family<Workspace, Gauge>,
    /// Messages read and not yet answered, all workspaces together.
    pub backlog: Gauge,
    /// Partitions paused by the read budget.
    pub paused_partitions: Gauge,
    /// Workspaces beyond their share of the read budget, whose messages are left in Kafka to
    /// be read again.
    pub passed_over_workspaces: Gauge,
    /// Bytes of the messages read and not yet answered (their estimated parsed size), and the
    /// budget they are held within.
    pub backlog_bytes: Gauge,
    pub backlog_budget_bytes: Gauge,
    /// Apply workers that died (panicked) and were started again.
    pub worker_restarts: Counter,
    /// Transactions of several workspaces that failed: their groups went back, set apart to be
    /// applied alone (docs/architecture.md, "Isolation in the writer").
    pub shared_transactions_failed: Counter,
    /// Commits whose wait for a synchronous standby, or whose answer's wait for a standby's
    /// flush, passed the bound: an outage, retried, nothing answered (`durability.rs`).
    pub unreplicated_commits: Counter,
    /// Confirmations whose first look found no synchronous standby at the primary's flushed
    /// position yet (another session's later commit had moved it on), and looked again.
    pub confirmations_rechecked: Counter,
    /// 1 while the database lacks migrations this build's statements use (at the start, or
    /// found when a statement failed on a missing column or table): nothing is applied.
    pub schema_behind: Gauge,
    /// Connections that found the database on another lineage than the one before (a standby
    /// promoted, a backup restored), or positions that went back (a restore in place): each
    /// starts a rewind of every partition (`rewind.rs`).
    pub lineage_changes: Counter,
    /// Messages a rewind read again, below the offsets answered before it: those the database
    /// had are recognised, the others applied again.
    pub rewound_messages: Counter,
    /// Of those, the messages the database lacked, applied again under the ids their clients
    /// were told.
    pub reapplied_messages: Counter,
    /// Messages a rewind needed that the requests topic no longer holds (its retention passed):
    /// answered once and now in neither the database nor Kafka.
    pub rewind_lost_messages: Counter,
    /// New connections that applied a write in a rolled-back transaction before their first
    /// real one (`store::rehearse`), and those whose rehearsal failed (a schema this version
    /// does not know, the connection lost): their first write then prepares its statements.
    pub connection_rehearsals: crate::store::Rehearsals,
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registrar::new("intake_writer", env!("CARGO_PKG_VERSION"));
        Metrics {
            consumer_lag: r.register(
                "consumer_lag",
                "Messages not yet applied, per assigned partition",
                Family::default(),
            ),
            assigned_partitions: r.register(
                "assigned_partitions",
                "Partitions of the requests topic this writer holds",
                Gauge::default(),
            ),
            group_members: r.register("group_members", "Writers in the consumer group", Gauge::default()),
            stalled: r.register("stalled", "1 while partitions with lag make no progress", Gauge::default()),
            last_outage_retry: r.register(
                "last_outage_retry_seconds",
                "Unix time of the last retry of an outage (PostgreSQL or Kafka away)",
                Gauge::default(),
            ),
            messages: r.register("messages", "Request messages answered, by outcome", Family::default()),
            items: r.register("items", "Conversions applied, by result", Family::default()),
            // 1 ms to 65.5 s: well past the statement timeout (--statement-timeout-ms, 15 s), so
            // that transactions near it are told apart instead of all landing in +Inf.
            apply_seconds: r.register("apply_seconds", "Time to apply one group of messages", seconds_histogram(17)),
            transient_retries: r.register(
                "transient_retries",
                "Retries through an outage, by operation",
                Family::default(),
            ),
            dead_lettered: r.register(
                "dead_lettered",
                "Messages copied to the dead-letter topic, by reason",
                Family::default(),
            ),
            replies_dropped: r.register(
                "replies_dropped",
                "Replies given up on after their deadline",
                Counter::default(),
            ),
            applied_messages_rows: r.register(
                "applied_messages_rows",
                "Rows of applied_messages (estimate)",
                Gauge::default(),
            ),
            workspace_waiting_seconds: r.register(
                "workspace_waiting_seconds",
                "How long a workspace whose lock is held elsewhere has waited",
                Family::default(),
            ),
            backlog: r.register("backlog", "Messages read and not yet answered", Gauge::default()),
            paused_partitions: r.register(
                "paused_partitions",
                "Partitions paused by the read budget",
                Gauge::default(),
            ),
            passed_over_workspaces: r.register(
                "passed_over_workspaces",
                "Workspaces beyond their share of the read budget, their messages left in Kafka to read again",
                Gauge::default(),
            ),
            backlog_bytes: r.register(
                "backlog_bytes",
                "Bytes of the messages read and not yet answered",
                Gauge::default(),
            ),
            backlog_budget_bytes: r.register(
                "backlog_budget_bytes",
                "The read budget: bytes of messages read and not yet answered at most",
                Gauge::default(),
            ),
            worker_restarts: r.register(
                "worker_restarts",
                "Apply workers that died and were started again",
                Counter::default(),
            ),
            shared_transactions_failed: r.register(
                "shared_transactions_failed",
                "Transactions of several workspaces that failed; their workspaces were set apart",
                Counter::default(),
            ),
            unreplicated_commits: r.register(
                "unreplicated_commits",
                "Commits not confirmed flushed by a synchronous standby within the bound; retried, unanswered",
                Counter::default(),
            ),
            confirmations_rechecked: r.register(
                "confirmations_rechecked",
                "Confirmations of a commit's replication that had to read the standbys' positions again",
                Counter::default(),
            ),
            schema_behind: r.register(
                "schema_behind",
                "1 while the database lacks migrations this version uses (waiting for intake-writer migrate)",
                Gauge::default(),
            ),
            lineage_changes: r.register(
                "lineage_changes",
                "Connections that found the database on another timeline or system, or its positions gone back; each rewinds every partition",
                Counter::default(),
            ),
            rewound_messages: r.register(
                "rewound_messages",
                "Messages read again by rewinds to the database's positions",
                Counter::default(),
            ),
            reapplied_messages: r.register(
                "reapplied_messages",
                "Messages a rewind read again that the database lacked, applied again",
                Counter::default(),
            ),
            rewind_lost_messages: r.register(
                "rewind_lost_messages",
                "Messages a rewind needed that the requests topic no longer holds",
                Counter::default(),
            ),
            connection_rehearsals: crate::store::Rehearsals {
                done: r.register(
                    "connections_rehearsed",
                    "New PostgreSQL connections that applied a write in a rolled-back transaction before their first",
                    Counter::default(),
                ),
                failed: r.register(
                    "connection_rehearsals_failed",
                    "New PostgreSQL connections whose rehearsed write failed",
                    Counter::default(),
                ),
            },
            registry: r.finish(),
        }
    }

    pub fn render(&self) -> String {
        intake_common::metrics::encode(&self.registry)
    }
}

/// Now, in seconds since the Unix epoch.
pub fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |since| since.as_secs_f64())
}
