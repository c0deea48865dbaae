//! Prometheus metrics of the writer, served on its ops port (`ops.rs`).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
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
    /// Partitions paused by the read budget or by a workspace beyond its share of it.
    pub paused_partitions: Gauge,
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
}

impl Metrics {
    pub fn new() -> Self {
        // The process metrics keep their standard names; the writer's own go under its prefix.
        let mut root = Registry::default();
        intake_common::process::register(&mut root);
        let registry = root.sub_registry_with_prefix("intake_writer");
        let metrics = Metrics {
            consumer_lag: Family::default(),
            assigned_partitions: Gauge::default(),
            group_members: Gauge::default(),
            stalled: Gauge::default(),
            messages: Family::default(),
            items: Family::default(),
            // 1 ms to 65.5 s: well past the statement timeout (--statement-timeout-ms, 15 s), so
            // that transactions near it are told apart instead of all landing in +Inf.
            apply_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 17)),
            transient_retries: Family::default(),
            last_outage_retry: Gauge::default(),
            dead_lettered: Family::default(),
            replies_dropped: Counter::default(),
            applied_messages_rows: Gauge::default(),
            workspace_waiting_seconds: Family::default(),
            backlog: Gauge::default(),
            paused_partitions: Gauge::default(),
            backlog_bytes: Gauge::default(),
            backlog_budget_bytes: Gauge::default(),
            worker_restarts: Counter::default(),
            shared_transactions_failed: Counter::default(),
            unreplicated_commits: Counter::default(),
            schema_behind: Gauge::default(),
            lineage_changes: Counter::default(),
            rewound_messages: Counter::default(),
            reapplied_messages: Counter::default(),
            rewind_lost_messages: Counter::default(),
            registry: Registry::default(),
        };
        registry.register(
            "consumer_lag",
            "Messages not yet applied, per assigned partition",
            metrics.consumer_lag.clone(),
        );
        registry.register(
            "assigned_partitions",
            "Partitions of the requests topic this writer holds",
            metrics.assigned_partitions.clone(),
        );
        registry.register("group_members", "Writers in the consumer group", metrics.group_members.clone());
        registry.register("stalled", "1 while partitions with lag make no progress", metrics.stalled.clone());
        registry.register(
            "last_outage_retry_seconds",
            "Unix time of the last retry of an outage (PostgreSQL or Kafka away)",
            metrics.last_outage_retry.clone(),
        );
        registry.register("messages", "Request messages answered, by outcome", metrics.messages.clone());
        registry.register("items", "Conversions applied, by result", metrics.items.clone());
        registry.register("apply_seconds", "Time to apply one group of messages", metrics.apply_seconds.clone());
        registry.register(
            "transient_retries",
            "Retries through an outage, by operation",
            metrics.transient_retries.clone(),
        );
        registry.register(
            "dead_lettered",
            "Messages copied to the dead-letter topic, by reason",
            metrics.dead_lettered.clone(),
        );
        registry.register(
            "replies_dropped",
            "Replies given up on after their deadline",
            metrics.replies_dropped.clone(),
        );
        registry.register(
            "applied_messages_rows",
            "Rows of applied_messages (estimate)",
            metrics.applied_messages_rows.clone(),
        );
        registry.register(
            "workspace_waiting_seconds",
            "How long a workspace whose lock is held elsewhere has waited",
            metrics.workspace_waiting_seconds.clone(),
        );
        registry.register("backlog", "Messages read and not yet answered", metrics.backlog.clone());
        registry.register(
            "paused_partitions",
            "Partitions paused by the read budget or a workspace beyond its share",
            metrics.paused_partitions.clone(),
        );
        registry.register(
            "backlog_bytes",
            "Bytes of the messages read and not yet answered",
            metrics.backlog_bytes.clone(),
        );
        registry.register(
            "backlog_budget_bytes",
            "The read budget: bytes of messages read and not yet answered at most",
            metrics.backlog_budget_bytes.clone(),
        );
        registry.register(
            "worker_restarts",
            "Apply workers that died and were started again",
            metrics.worker_restarts.clone(),
        );
        registry.register(
            "shared_transactions_failed",
            "Transactions of several workspaces that failed; their workspaces were set apart",
            metrics.shared_transactions_failed.clone(),
        );
        registry.register(
            "unreplicated_commits",
            "Commits not confirmed flushed by a synchronous standby within the bound; retried, unanswered",
            metrics.unreplicated_commits.clone(),
        );
        // Which version each process runs, for rollouts one instance at a time.
        registry.register(
            "build",
            "The program's version",
            prometheus_client::metrics::info::Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        registry.register(
            "schema_behind",
            "1 while the database lacks migrations this version uses (waiting for intake-writer migrate)",
            metrics.schema_behind.clone(),
        );
        registry.register(
            "lineage_changes",
            "Connections that found the database on another timeline or system, or its positions gone back; each rewinds every partition",
            metrics.lineage_changes.clone(),
        );
        registry.register(
            "rewound_messages",
            "Messages read again by rewinds to the database's positions",
            metrics.rewound_messages.clone(),
        );
        registry.register(
            "reapplied_messages",
            "Messages a rewind read again that the database lacked, applied again",
            metrics.reapplied_messages.clone(),
        );
        registry.register(
            "rewind_lost_messages",
            "Messages a rewind needed that the requests topic no longer holds",
            metrics.rewind_lost_messages.clone(),
        );
        Metrics { registry: root, ..metrics }
    }

    pub fn render(&self) -> String {
        let mut text = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// Now, in seconds since the Unix epoch.
pub fn unix_seconds() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |since| since.as_secs_f64())
}
