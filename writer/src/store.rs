//! Applies chunks to PostgreSQL with a fixed number of statements per workspace, whatever the
//! number of chunks and items: lock and look up the message ids, fetch the related rows, then
//! (only where there is something to do) insert chains, relabel merged chains, upsert the
//! conversions, recompute their visit matches, and record the message ids. The messages a writer
//! has at hand share one transaction; the chunks of one workspace among them are planned as one
//! run of items, in order, so 16 single sends cost the statements of one.

use crate::durability::Durability;
use crate::erase::Tombstones;
use crate::lookups;
use crate::plan::{self, Fields, Plan, StoredConversion};
use crate::primary::{Moves, Primary};
use crate::retry::{Classify, Failure};
use intake_common::config::now_us;
use intake_model::conversion::Conversion;
use intake_model::ids::Seed;
use intake_model::message::{ChainMerge, ItemResult, LogPosition, RequestPart, WriteRequestV1};
use prometheus_client::metrics::gauge::Gauge;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgConnectOptions, PgConnection, PgPool, PgPoolOptions};
use sqlx::query::QueryScalar;
use sqlx::types::Json;
use sqlx::{Connection, Postgres, Transaction};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// A pool for an operator command, on the primary among the nodes `url` names.
pub async fn connect(url: &str, pool_size: u32) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(pool_size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(crate::primary::resolve(url).await?)
        .await
}

/// Bounds on every statement of a connection, so that no statement hangs a worker: a statement
/// of the chunk's own that runs too long is cancelled (57014, bounded retries, then a dead
/// letter), and a wait for a row lock another session holds ends (55P03, the workspace waits).
/// A session left idle inside a transaction is ended after `idle_in_transaction`: it could hold
/// a workspace's lock, and so stop that workspace, for as long as it lived.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub statement: Duration,
    pub lock: Duration,
    pub idle_in_transaction: Duration,
}

/// What the operator commands that rewrite data (erasure, replay) allow a statement: longer
/// than a chunk's, since an erasure in a large workspace or a replay of many messages may
/// wait behind the writers' locks and touch many rows.
pub const OPERATOR_TIMEOUTS: Timeouts = Timeouts {
    statement: Duration::from_secs(600),
    lock: Duration::from_secs(60),
    idle_in_transaction: Duration::from_secs(60),
};

/// The bounds on a statement, and on a wait for a row lock, in a transaction that applies
/// several workspaces (see [`apply_runs`]): far above what their small runs take, far below a
/// gateway's deadline.
const TOGETHER_STATEMENT_TIMEOUT: Duration = Duration::from_millis(1_000);
const TOGETHER_LOCK_TIMEOUT: Duration = Duration::from_millis(200);

/// A pool for an operator command, with `timeouts` on every connection, on the primary among
/// the nodes `url` names.
pub async fn connect_with(url: &str, pool_size: u32, timeouts: Timeouts) -> Result<PgPool, sqlx::Error> {
    PgPoolOptions::new()
        .max_connections(pool_size)
        .acquire_timeout(Duration::from_secs(5))
        .connect_with(with_timeouts(crate::primary::resolve(url).await?, timeouts))
        .await
}

fn with_timeouts(options: PgConnectOptions, timeouts: Timeouts) -> PgConnectOptions {
    options.options([
        ("statement_timeout", timeouts.statement.as_millis().to_string()),
        ("lock_timeout", timeouts.lock.as_millis().to_string()),
        ("idle_in_transaction_session_timeout", timeouts.idle_in_transaction.as_millis().to_string()),
        // Each statement is prepared once per connection (sqlx caches them); left to choose,
        // PostgreSQL planned the look-ups of every transaction afresh, because a plan for the
        // values at hand (one id in the arrays) always looked cheaper than the generic one:
        // 0.4 ms of planning a transaction for the look-up over applied_messages' ranges, 0.2 ms
        // for conversions', more than their execution. The generic plans use the same indexes
        // (tests/tests/indexed_lookups.rs checks the statements of matching and erasure on
        // them).
        ("plan_cache_mode", "force_generic_plan".to_owned()),
    ])
}

/// Told the lineage of each database a new connection reaches: its system identifier and
/// timeline, which a promotion or a restore changes (`health::Health::connected_to`).
pub type LineageObserver = Arc<dyn Fn(&str) + Send + Sync>;

/// A pool that connects when first used, so that a writer can start while PostgreSQL is away,
/// to the node `primary` has in use and then to wherever it follows the primary; every
/// connection carries `timeouts`, and none is kept that reached a standby. `observer` is told
/// each new connection's lineage before the connection is used.
pub fn connect_lazy(
    primary: &Arc<Primary>,
    pool_size: u32,
    timeouts: Timeouts,
    observer: Option<LineageObserver>,
    rehearsals: Rehearsals,
) -> PgPool {
    let options = with_timeouts(primary.options(), timeouts);
    let (follower, moved) = (primary.clone(), primary.clone());
    let pool = PgPoolOptions::new()
        .max_connections(pool_size)
        .acquire_timeout(Duration::from_secs(5))
        .after_connect(move |connection, _| {
            let observer = observer.clone();
            let rehearsals = rehearsals.clone();
            let primary = follower.clone();
            Box::pin(async move {
                let lineage = primary_lineage(connection).await.inspect_err(|_| primary.suspect())?;
                if let Some(observer) = observer {
                    observer(&lineage);
                }
                match rehearse(connection).await {
                    Ok(()) => rehearsals.done.inc(),
                    Err(error) => {
                        tracing::warn!(%error, "a new connection's rehearsal of a write failed; its first write prepares");
                        rehearsals.failed.inc()
                    }
                };
                Ok(())
            })
        })
        // A connection closed (one that met an outage, one past its lifetime) is replaced, and
        // rehearsed, in the background, not by the write that next needs it.
        .min_connections(READY_CONNECTIONS.min(pool_size))
        // sqlx pings every connection it hands out, a round trip before each transaction. Only
        // one idle for a while is asked (as HikariCP does), which is when the server may have
        // gone away meanwhile; one that fails later is an outage like any other, retried.
        .test_before_acquire(false)
        .before_acquire(move |connection, meta| {
            let on_old_node = moved.opened_before_move(meta.age);
            Box::pin(async move {
                Ok(!on_old_node && (meta.idle_for < PING_WHEN_IDLE || connection.ping().await.is_ok()))
            })
        })
        .connect_lazy_with(options);
    primary.follow(&pool, move |node| with_timeouts(node, timeouts));
    pool
}

/// The connections a writer keeps open and rehearsed for its next writes.
const READY_CONNECTIONS: u32 = 2;

/// Opens [`READY_CONNECTIONS`] connections of `pool`, each rehearsed as it connects, and gives
/// them back, so that the first sends after a writer's start find them ready. sqlx's
/// `min_connections` opens none at the start of a lazy pool, only after one is closed. A
/// database away at the start leaves them to the first writes.
pub async fn open_ready_connections(pool: PgPool) {
    let count = READY_CONNECTIONS.min(pool.options().get_max_connections()) as usize;
    let mut opened = Vec::with_capacity(count);
    // Each held while the next is asked for, so that the pool opens another.
    while opened.len() < count {
        match pool.acquire().await {
            Ok(connection) => opened.push(connection),
            Err(error) => {
                tracing::debug!(%error, "no connection opened ahead of the first writes");
                return;
            }
        }
    }
}

/// How long a connection may lie idle in the pool and still be handed out unasked.
const PING_WHEN_IDLE: Duration = Duration::from_millis(500);

/// New connections rehearsed ([`rehearse`]), and those whose rehearsal failed.
#[derive(Clone, Default)]
pub struct Rehearsals {
    pub done: prometheus_client::metrics::counter::Counter,
    pub failed: prometheus_client::metrics::counter::Counter,
}

/// The prefix of the workspace and message id of [`rehearse`], made and dropped inside its
/// transaction; each rehearsal's own, so that no two wait for each other's rows.
const REHEARSAL: &str = "ws_rehearsal_";

/// Applies a made-up conversion on a new connection in a transaction that is rolled back, so
/// that the connection has prepared and planned a write's statements before its first real
/// one. On a fresh backend the first write takes 10 to 20 ms more than the next ones (the
/// catalog caches it loads, each statement's parse and generic plan), which the first sends
/// after a start, a failover or a connection's renewal would otherwise wait for.
pub async fn rehearse(connection: &mut PgConnection) -> Result<(), sqlx::Error> {
    let now_ms = intake_common::config::now_ms();
    // Recent and with a visitor id, so that the matching to visits is rehearsed too.
    let occurred_at = time::OffsetDateTime::now_utc().replace_nanosecond(0).unwrap_or(time::OffsetDateTime::UNIX_EPOCH);
    let item = serde_json::json!({
        "event": "lead",
        "external_id": "rehearsal",
        "occurred_at": occurred_at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default(),
        "email": "rehearsal@example.com",
        "visitor_id": "rehearsalvisitor",
    });
    let conversion = intake_model::validate::validate_conversion(&(&item).into(), now_ms)
        .map_err(|invalid| sqlx::Error::Protocol(format!("the rehearsal's conversion is invalid: {invalid:?}")))?
        .conversion;
    let workspace_id = format!("{REHEARSAL}{}", now_us());
    let request = WriteRequestV1 {
        correlation_id: workspace_id.clone(),
        reply_partition: 0,
        deadline_ms: now_ms,
        received_at_ms: now_ms,
        workspace_id: workspace_id.clone(),
        items: vec![conversion],
        request: None,
        position: Some(LogPosition { partition: 0, offset: 0, appended_ms: now_ms }),
    };
    let mut tx = connection.begin().await?;
    sqlx::query("INSERT INTO workspaces (id, name, project_id) VALUES ($1, $1, $1)")
        .bind(&workspace_id)
        .execute(&mut *tx)
        .await?;
    apply_workspace(&mut tx, &workspace_id, &[&request], Lock::Try).await?;
    tx.rollback().await
}

/// The lineage of the primary a connection reached: system identifier and the timeline of the
/// WAL it writes now (`pg_control_checkpoint()`'s timeline would trail a promotion until the
/// next checkpoint). During a failover the primary's address can lead for a moment to a node
/// in recovery (the old primary before it is marked down, or a standby): such a connection is
/// refused as an outage, so that writes wait for the new primary.
async fn primary_lineage(connection: &mut PgConnection) -> Result<String, sqlx::Error> {
    let lineage: Option<String> = sqlx::query_scalar(
        "SELECT CASE WHEN NOT pg_is_in_recovery()
                     THEN (SELECT system_identifier FROM pg_control_system())::text || '/'
                          || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8) END",
    )
    .fetch_one(connection)
    .await?;
    lineage.ok_or_else(|| sqlx::Error::Io(std::io::Error::other("connected to a node in recovery, not the primary")))
}

/// A connection that met a node taking no writes keeps meeting it, and one that met an outage
/// may be cut off in the middle of a statement (a commit still waiting for the standby): it is
/// closed, not returned to the pool.
fn close_if_unusable<T>(connection: &mut PoolConnection<Postgres>, outcome: &Result<T, sqlx::Error>) {
    if outcome.as_ref().is_err_and(|error| matches!(error.failure(), Failure::Standby | Failure::Outage)) {
        connection.close_on_drop();
    }
}

/// Inserts workspace `$1`'s new chains, their ids the array parameter named.
/// A chain's id derives from the item that started it (`ids::Seed`): one already stored is
/// that chain, started when the message was first applied, and is kept.
macro_rules! insert_chains {
    ($ids:literal) => {
        concat!(
            "INSERT INTO chains (id, workspace_id) SELECT id, $1 FROM unnest(",
            $ids,
            "::text[]) AS new(id) ON CONFLICT (id) DO NOTHING"
        )
    };
}

/// A chunk's write, as one statement: the plan's new chains (`$19`), its rows (`$2` to `$18`, in
/// the workspace `$1`) and the message ids applied with their results (`$20`, `$21`), each a
/// data-modifying `WITH` of one round trip. A row's chain may be one inserted beside it: the
/// foreign key is checked at the statement's end.
macro_rules! write_chunk {
    () => {
        concat!(
            "WITH new_chains AS (",
            insert_chains!("$19"),
            "),
             recorded AS (
                 INSERT INTO applied_messages (correlation_id, workspace_id, results)
                 SELECT id, $1, results::jsonb FROM unnest($20::text[], $21::text[]) AS m(id, results)),
             written AS (
                 INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id,
                                          occurred_at, visitor_id, click_id, contact_id, email_digest,
                                          phone_digest, address_digest, country, value, currency, hdyhau, tags)
                 SELECT u.id, $1, u.event, u.external_id, u.chain_id, u.parent_external_id,
                        'epoch'::timestamptz + u.occurred_at_ms * interval '1 millisecond',
                        u.visitor_id, u.click_id, u.contact_id, decode(u.email_sha256, 'hex'), decode(u.phone_sha256, 'hex'),
                        decode(u.address_sha256, 'hex'),
                        u.country, u.value::numeric, u.currency, u.hdyhau, u.tags::jsonb
                   FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int8[], $8::text[],
                               $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::text[],
                               $15::text[], $16::text[], $17::text[], $18::text[])
                     AS u(id, event, external_id, chain_id, parent_external_id, occurred_at_ms, visitor_id, click_id,
                          contact_id, email_sha256, phone_sha256, address_sha256, country, value, currency, hdyhau,
                          tags)
                 ",
            intake_model::conversions_on_conflict!(),
            ")
             SELECT 1"
        )
    };
}

pub struct Applied {
    pub results: Vec<ItemResult>,
    /// The chains merged by the end of the message (none for one applied before).
    pub merged: Vec<ChainMerge>,
    /// False when the message had been applied before and these are its first results.
    pub first_time: bool,
    /// Its transaction's commit, once made.
    pub commit: Option<Commit>,
}

/// When a transaction's commit was asked for and when it was done (on the HA layout: and
/// confirmed on a synchronous standby), in epoch µs, for the replies' `WriterTiming`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Commit {
    pub started_us: i64,
    pub done_us: i64,
}

/// What became of one chunk of a workspace's run.
pub enum Chunk {
    Applied(Applied),
    /// An earlier chunk of its request failed for good: this one is not applied, so that the
    /// request leaves a prefix committed (docs/architecture.md, "Order within a request").
    RequestFailed,
}

/// A workspace's run of chunks, or the news that another session holds its lock.
pub enum Run {
    Done(Vec<Chunk>),
    /// The workspace's lock is held elsewhere (a long erasure, another writer): nothing was
    /// applied, and no connection waits for it.
    Busy,
    /// The messages were read before a rebalance or a change of the database's lineage (see
    /// [`Fence`]): nothing was applied; they are read again.
    Superseded,
}

/// Whether the messages about to be applied are still to be applied by this writer, asked once
/// the connection is at hand: a new connection that found another primary lineage has made
/// every message read before it due only after a rewind (`rewind.rs`).
pub type Fence<'a> = &'a (dyn Fn() -> bool + Sync);

/// How a workspace's lock is taken.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    /// Wait for it (operator commands).
    Wait,
    /// Take it if it is free, else answer [`Run::Busy`] at once (the consumer).
    Try,
}

/// The database the writer applies to, and when what it commits may be acknowledged.
#[derive(Clone)]
pub struct Database {
    pub pool: PgPool,
    pub durability: Durability,
    /// 1 while the database lacks migrations this build uses (`metrics.rs`).
    pub schema_behind: Gauge,
    /// Ends a transaction in flight on a node that is no longer the primary.
    pub moves: Moves,
}

impl Database {
    /// The database of an operator command: its own pool, and commits acknowledged as the
    /// writers' are (`--ack-when`), with no metrics to count into.
    pub fn for_command(pool: PgPool, durability: &crate::durability::DurabilityArgs) -> Database {
        let node = pool.connect_options().as_ref().clone();
        Database {
            durability: Durability::new(node, durability, crate::durability::DurabilityCounters::default()),
            pool,
            schema_behind: Gauge::default(),
            moves: Moves::default(),
        }
    }

    /// Applies the chunk, waiting for its workspace's lock, or returns the results it had when
    /// it was first applied.
    pub async fn apply_chunk(&self, request: &WriteRequestV1) -> Result<Chunk, sqlx::Error> {
        match self.apply_run(&request.workspace_id, &[request], Lock::Wait).await? {
            Run::Done(mut chunks) => chunks.pop().ok_or(sqlx::Error::RowNotFound),
            Run::Busy | Run::Superseded => Err(sqlx::Error::RowNotFound),
        }
    }

    /// What [`Database::apply_chunk`] would do with the chunk, changing nothing: applied before
    /// (`first_time` false), after its request failed, or applied now (`first_time` true, no
    /// results: none were computed).
    pub async fn would_apply(&self, request: &WriteRequestV1) -> Result<Chunk, sqlx::Error> {
        let part = request.request.as_ref();
        let (applied, failed_at): (bool, Option<i32>) = sqlx::query_as(
            "SELECT EXISTS (SELECT FROM applied_messages WHERE correlation_id = $1),
                    (SELECT chunk_index FROM failed_requests WHERE request_id = $2)",
        )
        .bind(&request.correlation_id)
        .bind(part.map(|p| p.id.as_str()))
        .fetch_one(&self.pool)
        .await?;
        let first_time = !applied;
        if first_time && failed_at.zip(part).is_some_and(|(at, part)| i64::from(part.index) > i64::from(at)) {
            return Ok(Chunk::RequestFailed);
        }
        Ok(Chunk::Applied(Applied { results: Vec::new(), merged: Vec::new(), first_time, commit: None }))
    }

    /// Applies one workspace's chunks in order in one transaction: one commit (one WAL flush)
    /// for all the messages of the workspace at hand. If any fails, none is applied. One
    /// outcome per request, in order.
    pub async fn apply_run(
        &self,
        workspace_id: &str,
        requests: &[&WriteRequestV1],
        lock: Lock,
    ) -> Result<Run, sqlx::Error> {
        let mut runs = self.apply_runs(&[(workspace_id, requests)], lock).await?;
        runs.pop().ok_or(sqlx::Error::RowNotFound)
    }

    /// Applies several workspaces' runs (see [`Database::apply_run`]) in one transaction, each
    /// under its own lock: single sends of many workspaces share one commit. A workspace whose
    /// lock is held elsewhere is [`Run::Busy`] and the others are applied; if any statement
    /// fails, nothing is. Returns once what it answers for is durable (`durability.rs`).
    pub async fn apply_runs(&self, runs: &[WorkspaceRun<'_>], lock: Lock) -> Result<Vec<Run>, sqlx::Error> {
        self.apply_runs_fenced(runs, lock, &|| true).await
    }

    /// [`Database::apply_runs`], unless `fence` says the runs were superseded once the
    /// connection is at hand.
    pub async fn apply_runs_fenced(
        &self,
        runs: &[WorkspaceRun<'_>],
        lock: Lock,
        fence: Fence<'_>,
    ) -> Result<Vec<Run>, sqlx::Error> {
        let mut connection = self.pool.acquire().await?;
        if !fence() {
            return Ok(runs.iter().map(|_| Run::Superseded).collect());
        }
        let outcome = self.moves.unless_moved(self.apply_runs_on(&mut connection, runs, lock)).await;
        close_if_unusable(&mut connection, &outcome);
        if outcome.is_ok() && self.schema_behind.get() > 0 {
            tracing::info!("the database has the migrations this version uses again; applying");
            self.schema_behind.set(0);
        }
        outcome
    }

    /// Whether the database lacks migrations this build's statements use: a statement that
    /// failed on a missing column or table is then an outage that `migrate` ends, not the
    /// message's fault. Unknown (the database unreadable) is not behind.
    pub async fn schema_is_behind(&self) -> bool {
        match crate::migrations::missing(&self.pool).await {
            Ok(missing) if !missing.is_empty() => {
                if self.schema_behind.get() == 0 {
                    tracing::error!(
                        ?missing,
                        "a statement failed on a schema behind this version's: nothing is applied until `intake-writer migrate`"
                    );
                }
                self.schema_behind.set(1);
                true
            }
            _ => false,
        }
    }

    async fn apply_runs_on(
        &self,
        connection: &mut PgConnection,
        runs: &[WorkspaceRun<'_>],
        lock: Lock,
    ) -> Result<Vec<Run>, sqlx::Error> {
        let mut tx = if runs.len() > 1 {
            // Workspaces applied together wait for each other: a statement or a row lock that
            // takes long ends the transaction soon, and the caller applies each workspace
            // alone, with the connection's own bounds. Set with BEGIN, in its round trip.
            connection
                .begin_with(format!(
                    "BEGIN; SET LOCAL statement_timeout = {}; SET LOCAL lock_timeout = {}",
                    TOGETHER_STATEMENT_TIMEOUT.as_millis(),
                    TOGETHER_LOCK_TIMEOUT.as_millis()
                ))
                .await?
        } else {
            connection.begin().await?
        };
        let mut outcomes = Vec::with_capacity(runs.len());
        let mut pid = 0;
        for &(workspace_id, requests) in runs {
            let (run, backend) = apply_workspace(&mut tx, workspace_id, requests, lock).await?;
            pid = backend;
            outcomes.push(run);
        }
        if outcomes.iter().any(|run| matches!(run, Run::Done(_))) {
            // Also when every message had been applied before and nothing was written: their
            // first commit may be on this server alone.
            let started_us = now_us();
            self.durability.commit(tx, pid).await?;
            self.durability.confirm(connection).await?;
            let commit = Commit { started_us, done_us: now_us() };
            for run in &mut outcomes {
                if let Run::Done(chunks) = run {
                    for chunk in chunks {
                        if let Chunk::Applied(applied) = chunk {
                            applied.commit = Some(commit);
                        }
                    }
                }
            }
        } else {
            tx.rollback().await?;
        }
        Ok(outcomes)
    }

    /// Marks the requests whose chunks failed for good (or expired), so that no later chunk of
    /// them is applied, by this writer or another one after a rebalance or a restart.
    pub async fn mark_requests_failed(&self, workspace_id: &str, parts: &[&RequestPart]) -> Result<(), sqlx::Error> {
        // One row per request, at its lowest failed chunk: a statement may not update a row twice.
        let mut lowest: BTreeMap<&str, u32> = BTreeMap::new();
        for part in parts {
            lowest.entry(&part.id).and_modify(|index| *index = (*index).min(part.index)).or_insert(part.index);
        }
        let ids: Vec<&str> = lowest.keys().copied().collect();
        let indexes: Vec<i32> = lowest.values().map(|index| i32::try_from(*index).unwrap_or(i32::MAX)).collect();
        let marking = sqlx::query_scalar(
            "WITH marked AS (
                 INSERT INTO failed_requests (request_id, workspace_id, chunk_index)
                 SELECT id, $2, chunk_index FROM unnest($1::text[], $3::int4[]) AS failed(id, chunk_index)
                 ON CONFLICT (request_id) DO UPDATE
                    SET chunk_index = least(failed_requests.chunk_index, excluded.chunk_index))
             SELECT pg_backend_pid()",
        )
        .bind(&ids)
        .bind(workspace_id)
        .bind(&indexes);
        self.write_alone(marking).await
    }

    /// A small write, committed and confirmed as a chunk's is: whether PostgreSQL takes writes
    /// at all. An error of a class that could be an outage (out of memory, disk full) is one
    /// only while this fails too.
    pub async fn probe_writes(&self) -> Result<(), sqlx::Error> {
        self.write_alone(sqlx::query_scalar(
            "WITH probed AS (
                 INSERT INTO writer_probe (id, at) VALUES (1, now()) ON CONFLICT (id) DO UPDATE SET at = now())
             SELECT pg_backend_pid()",
        ))
        .await
    }

    /// `statement`, a write whose result is the session's backend id, in a transaction of its
    /// own, committed and confirmed (`durability.rs`).
    async fn write_alone(&self, statement: QueryScalar<'_, Postgres, i32, PgArguments>) -> Result<(), sqlx::Error> {
        let mut connection = self.pool.acquire().await?;
        let written = self
            .moves
            .unless_moved(async {
                let mut tx = connection.begin().await?;
                let pid = statement.fetch_one(&mut *tx).await?;
                self.durability.commit(tx, pid).await?;
                self.durability.confirm(&mut connection).await
            })
            .await;
        close_if_unusable(&mut connection, &written);
        written
    }
}

/// One workspace's chunks, in order.
pub type WorkspaceRun<'a> = (&'a str, &'a [&'a WriteRequestV1]);

/// A message id already applied and its results; both null when none of the ids is (the row of
/// the lock alone).
type LookedUp = (Option<String>, Option<Json<Vec<ItemResult>>>);
/// Whether the lock was taken, the session's backend id, and a [`LookedUp`].
type Locked = (bool, i32, Option<String>, Option<Json<Vec<ItemResult>>>);

/// One workspace's requests, in order; with the session's backend id.
async fn apply_workspace(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    requests: &[&WriteRequestV1],
    lock: Lock,
) -> Result<(Run, i32), sqlx::Error> {
    // One workspace's chunks are applied one at a time, across writers and replays: the chain
    // rules read, then write, rows of the whole workspace. The lock and the look-up of the
    // message ids are one round trip. After a wait for the lock, the look-up reads a snapshot
    // from before it was granted; a message applied meanwhile by another writer is still caught,
    // by the primary key of applied_messages at the insert below. The backend's id comes along,
    // for a commit whose wait for the standby is to be cancelled (`durability.rs`).
    let sql = match lock {
        Lock::Wait => {
            "SELECT true AS locked, pg_backend_pid() AS pid, m.correlation_id, m.results
               FROM (SELECT pg_advisory_xact_lock(hashtextextended($1, 0))) AS l
               LEFT JOIN applied_messages m ON m.correlation_id = ANY($2)"
        }
        Lock::Try => {
            "SELECT l.locked, pg_backend_pid() AS pid, m.correlation_id, m.results
               FROM (SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0)) AS locked) AS l
               LEFT JOIN applied_messages m ON l.locked AND m.correlation_id = ANY($2)"
        }
    };
    let ids: Vec<&str> = requests.iter().map(|r| r.correlation_id.as_str()).collect();
    let looked_up: Vec<Locked> = sqlx::query_as(sql).bind(workspace_id).bind(&ids).fetch_all(&mut **tx).await?;
    let Some(&(locked, pid, _, _)) = looked_up.first() else {
        return Err(sqlx::Error::RowNotFound);
    };
    if !locked {
        return Ok((Run::Busy, pid));
    }
    let previous: Vec<LookedUp> = looked_up.into_iter().map(|(_, _, id, results)| (id, results)).collect();
    let mut previous: HashMap<String, Vec<ItemResult>> =
        previous.into_iter().filter_map(|(id, results)| Some((id?, results?.0))).collect();
    let failed = failed_requests(tx, requests).await?;

    let fresh: Vec<&WriteRequestV1> = requests
        .iter()
        .copied()
        .filter(|r| !previous.contains_key(&r.correlation_id) && !in_failed_request(r, &failed))
        .collect();
    let mut fresh_results = HashMap::new();
    if !fresh.is_empty() {
        let sent: Vec<(&Conversion, i64, Option<Seed<'_>>)> = fresh
            .iter()
            .flat_map(|r| {
                r.items.iter().enumerate().map(|(index, c)| {
                    let seed = r.position.map(|position| Seed {
                        correlation_id: &r.correlation_id,
                        position,
                        received_at_ms: r.received_at_ms,
                        index,
                    });
                    (c, r.received_at_ms, seed)
                })
            })
            .collect();
        let oldest_received_ms = fresh.iter().map(|r| r.received_at_ms).min().unwrap_or_default();
        let (tombstones, related) = fetch_related(tx, workspace_id, &sent, oldest_received_ms).await?;
        // Items sent before an erasure that covers them are stored as it left the person's data.
        let cleared: Vec<Option<Conversion>> = sent.iter().map(|&(c, at, _)| tombstones.clear(c, at)).collect();
        let items: Vec<plan::Item<'_>> = sent
            .iter()
            .zip(&cleared)
            .map(|(&(conversion, received_at_ms, seed), cleared)| plan::Item {
                conversion: cleared.as_ref().unwrap_or(conversion),
                received_at_ms,
                seed,
            })
            .collect();
        let sizes: Vec<usize> = fresh.iter().map(|r| r.items.len()).collect();
        let plan = plan::plan_chunk(&items, &sizes, related);
        // Each message's results, recorded with the write, as they are also replied.
        let mut results = plan.results.as_slice();
        let texts: Vec<String> = sizes
            .iter()
            .map(|&size| {
                let (own, rest) = results.split_at(size.min(results.len()));
                results = rest;
                serde_json::to_string(own).unwrap_or_else(|_| "[]".to_owned())
            })
            .collect();
        let recorded = Recorded { ids: fresh.iter().map(|r| r.correlation_id.as_str()).collect(), results: texts };
        let matching = Matching::of(&plan.writes);
        matching.forget_stale(tx).await?;
        write_plan(tx, workspace_id, &plan, &recorded).await?;
        matching.match_visits(tx, workspace_id).await?;
        let mut results = plan.results.into_iter();
        let mut merged = plan.merged_by_message.into_iter();
        for request in &fresh {
            let own: Vec<ItemResult> = results.by_ref().take(request.items.len()).collect();
            fresh_results.insert(request.correlation_id.as_str(), (own, merged.next().unwrap_or_default()));
        }
    }
    let run = Run::Done(
        requests
            .iter()
            .map(|r| match (previous.remove(&r.correlation_id), fresh_results.remove(r.correlation_id.as_str())) {
                (Some(results), _) => {
                    Chunk::Applied(Applied { results, merged: Vec::new(), first_time: false, commit: None })
                }
                (None, Some((results, merged))) => {
                    Chunk::Applied(Applied { results, merged, first_time: true, commit: None })
                }
                (None, None) => Chunk::RequestFailed,
            })
            .collect(),
    );
    Ok((run, pid))
}

/// The requests among these (by the gateway's request id) of which a chunk failed for good,
/// with that chunk's index. Only a request's later chunks can meet their request's failure, so
/// the first ones cost no query.
async fn failed_requests(
    tx: &mut Transaction<'_, Postgres>,
    requests: &[&WriteRequestV1],
) -> Result<HashMap<String, i32>, sqlx::Error> {
    let ids: Vec<&str> = requests
        .iter()
        .filter_map(|r| r.request.as_ref().filter(|part| part.index > 0))
        .map(|p| p.id.as_str())
        .collect();
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let failed: Vec<(String, i32)> =
        sqlx::query_as("SELECT request_id, chunk_index FROM failed_requests WHERE request_id = ANY($1)")
            .bind(&ids)
            .fetch_all(&mut **tx)
            .await?;
    Ok(failed.into_iter().collect())
}

/// A chunk after the one of its request that failed.
fn in_failed_request(request: &WriteRequestV1, failed: &HashMap<String, i32>) -> bool {
    request
        .request
        .as_ref()
        .is_some_and(|part| failed.get(&part.id).is_some_and(|&at| i64::from(part.index) > i64::from(at)))
}

/// Every stored row the chunk's items can touch or link to (see [`plan::plan_chunk`]), and the
/// erasures that cover items received since `oldest_received_ms`: one round trip. An erasure
/// changes no external id, so the rows are those of the items as sent.
async fn fetch_related(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    sent: &[(&Conversion, i64, Option<Seed<'_>>)],
    oldest_received_ms: i64,
) -> Result<(Tombstones, Vec<StoredConversion>), sqlx::Error> {
    let external_ids: Vec<&str> = sent.iter().map(|(c, _, _)| c.external_id.as_str()).collect();
    let mut ids_and_parents = external_ids.clone();
    ids_and_parents.extend(sent.iter().filter_map(|(c, _, _)| c.parent_external_id.as_ref().map(|p| p.as_str())));
    let mut rows: Vec<RelatedRow> = sqlx::query_as(lookups::RELATED_CONVERSIONS)
        .bind(workspace_id)
        .bind(&ids_and_parents)
        .bind(&external_ids)
        .bind(oldest_received_ms)
        .fetch_all(&mut **tx)
        .await?;
    let erasures = rows.first_mut().map(|row| std::mem::take(&mut row.tombstones.0)).unwrap_or_default();
    Ok((Tombstones::new(erasures), rows.into_iter().filter_map(|row| row.conversion).collect()))
}

/// A row of [`lookups::RELATED_CONVERSIONS`]: the erasures, and a related row unless none is.
struct RelatedRow {
    tombstones: Json<Vec<(i64, Vec<String>)>>,
    conversion: Option<StoredConversion>,
}

impl sqlx::FromRow<'_, sqlx::postgres::PgRow> for RelatedRow {
    fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
        let related = sqlx::Row::try_get::<Option<String>, _>(row, "id")?.is_some();
        Ok(RelatedRow {
            tombstones: sqlx::Row::try_get(row, "tombstones")?,
            conversion: if related { Some(sqlx::FromRow::from_row(row)?) } else { None },
        })
    }
}

/// Implements `sqlx::FromRow` for a struct, each field read from the column of its name, as
/// sqlx's `#[derive(FromRow)]` would. Written by hand because the writer builds sqlx without its
/// `macros` feature, which would bring its proc-macro crates into the build for a few structs.
/// A field written `name: json` is read from a nullable JSON column into an `Option`, one written
/// `name: flatten` from the same row by its own type's `FromRow`.
macro_rules! from_row {
    ($name:ident { $($field:ident $(: $how:ident)?),* $(,)? }) => {
        impl sqlx::FromRow<'_, sqlx::postgres::PgRow> for $name {
            fn from_row(row: &sqlx::postgres::PgRow) -> Result<Self, sqlx::Error> {
                Ok($name { $($field: $crate::store::column!(row, $field $(, $how)?),)* })
            }
        }
    };
}

macro_rules! column {
    ($row:ident, $field:ident) => {
        sqlx::Row::try_get($row, stringify!($field))?
    };
    ($row:ident, $field:ident, json) => {
        sqlx::Row::try_get::<Option<sqlx::types::Json<_>>, _>($row, stringify!($field))?
            .map(|sqlx::types::Json(value)| value)
    };
    ($row:ident, $field:ident, flatten) => {
        sqlx::FromRow::from_row($row)?
    };
}

pub(crate) use {column, from_row};

from_row!(StoredConversion { id, event, external_id, chain_id, fields: flatten });

from_row!(Fields {
    parent_external_id,
    occurred_at_ms,
    visitor_id,
    click_id,
    contact_id,
    email_sha256,
    phone_sha256,
    address_sha256,
    country,
    value,
    currency,
    hdyhau,
    tags: json,
});

/// The message ids of a workspace's fresh chunks and their results, recorded with their write.
struct Recorded<'a> {
    ids: Vec<&'a str>,
    results: Vec<String>,
}

/// Writes the plan: its merges first, then the chunk's write of one round trip ([`write_chunk`]).
async fn write_plan(
    tx: &mut Transaction<'_, Postgres>,
    workspace_id: &str,
    plan: &Plan,
    recorded: &Recorded<'_>,
) -> Result<(), sqlx::Error> {
    let mut new_chains: &[String] = &plan.new_chains;
    if !plan.merges.is_empty() {
        // A merge can name a chain this chunk creates, which must be stored before it.
        if !new_chains.is_empty() {
            sqlx::query(insert_chains!("$2")).bind(workspace_id).bind(new_chains).execute(&mut **tx).await?;
            new_chains = &[];
        }
        let (from, into): (Vec<&str>, Vec<&str>) = plan.merges.iter().map(|(f, i)| (f.as_str(), i.as_str())).unzip();
        sqlx::query(lookups::MERGE_CHAINS).bind(workspace_id).bind(&from).bind(&into).execute(&mut **tx).await?;
        // Chains merged earlier into a chain merged now point straight at the survivor, so an old
        // chain id resolves in one step.
        sqlx::query(
            "UPDATE chains c SET merged_into = m.into_chain, merged_at = now()
               FROM unnest($1::text[], $2::text[]) AS m(from_chain, into_chain)
              WHERE c.id = m.from_chain OR c.merged_into = m.from_chain",
        )
        .bind(&from)
        .bind(&into)
        .execute(&mut **tx)
        .await?;
    }
    fn column<'a, T>(rows: &'a [plan::Write], f: impl Fn(&'a StoredConversion) -> T) -> Vec<T> {
        rows.iter().map(|write| f(&write.row)).collect()
    }
    let rows = &plan.writes;
    let tags: Vec<Option<String>> = column(rows, |r| {
        r.fields.tags.as_ref().map(|tags| serde_json::to_string(tags).unwrap_or_else(|_| "{}".to_owned()))
    });
    sqlx::query(write_chunk!())
        .bind(workspace_id)
        .bind(column(rows, |r| r.id.as_str()))
        .bind(column(rows, |r| r.event.as_str()))
        .bind(column(rows, |r| r.external_id.as_str()))
        .bind(column(rows, |r| r.chain_id.as_str()))
        .bind(column(rows, |r| r.fields.parent_external_id.as_deref()))
        .bind(column(rows, |r| r.fields.occurred_at_ms))
        .bind(column(rows, |r| r.fields.visitor_id.as_deref()))
        .bind(column(rows, |r| r.fields.click_id.as_deref()))
        .bind(column(rows, |r| r.fields.contact_id.as_deref()))
        .bind(column(rows, |r| r.fields.email_sha256.as_deref()))
        .bind(column(rows, |r| r.fields.phone_sha256.as_deref()))
        .bind(column(rows, |r| r.fields.address_sha256.as_deref()))
        .bind(column(rows, |r| r.fields.country.as_deref()))
        .bind(column(rows, |r| r.fields.value.as_deref()))
        .bind(column(rows, |r| r.fields.currency.as_deref()))
        .bind(column(rows, |r| r.fields.hdyhau.as_deref()))
        .bind(tags)
        .bind(new_chains)
        .bind(&recorded.ids)
        .bind(&recorded.results)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Matching window (docs/api.md, "Matching to visits"): conversions older than this at receipt get no matches,
/// and visits older than this before a conversion do not match it.
const MATCH_WINDOW_MS: i64 = 90 * 24 * 60 * 60 * 1000;

/// The visit matches the written conversions need: by the 16-character visitor id, by click id,
/// and by contact id against the visit's recipient id; visits at or before `occurred_at` and
/// within 90 days of it. Only rows whose matching inputs changed: a new value or tag keeps the
/// matches it has.
struct Matching<'a> {
    /// Stored rows rewritten with other matching inputs: their matches go before the write.
    stale: Vec<&'a str>,
    /// The rows to match after the write; each lookup is answered by an index of `visits` (see
    /// [`lookups::MATCH_VISITS`]).
    matchable: Vec<&'a StoredConversion>,
}

impl<'a> Matching<'a> {
    fn of(writes: &'a [plan::Write]) -> Matching<'a> {
        let rematched = writes.iter().filter(|w| w.rematch);
        Matching {
            // A row created by this chunk has a new id, which no match names yet.
            stale: rematched.clone().filter(|w| !w.created).map(|w| w.row.id.as_str()).collect(),
            matchable: rematched
                .filter(|w| w.row.fields.occurred_at_ms >= w.received_at_ms - MATCH_WINDOW_MS)
                .map(|w| &w.row)
                .filter(|r| {
                    r.fields.visitor_id.is_some() || r.fields.click_id.is_some() || r.fields.contact_id.is_some()
                })
                .collect(),
        }
    }

    async fn forget_stale(&self, tx: &mut Transaction<'_, Postgres>) -> Result<(), sqlx::Error> {
        if !self.stale.is_empty() {
            sqlx::query("DELETE FROM conversion_matches WHERE conversion_id = ANY($1)")
                .bind(&self.stale)
                .execute(&mut **tx)
                .await?;
        }
        Ok(())
    }

    async fn match_visits(&self, tx: &mut Transaction<'_, Postgres>, workspace_id: &str) -> Result<(), sqlx::Error> {
        if self.matchable.is_empty() {
            return Ok(());
        }
        let rows = &self.matchable;
        sqlx::query(lookups::MATCH_VISITS)
            .bind(workspace_id)
            .bind(rows.iter().map(|r| r.id.as_str()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.fields.visitor_id.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.fields.click_id.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.fields.contact_id.as_deref()).collect::<Vec<_>>())
            .bind(rows.iter().map(|r| r.fields.occurred_at_ms).collect::<Vec<_>>())
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use intake_model::message::RequestPart;

    fn chunk(request: Option<(&str, u32)>) -> WriteRequestV1 {
        WriteRequestV1 {
            correlation_id: "c".to_owned(),
            reply_partition: 0,
            deadline_ms: 0,
            received_at_ms: 0,
            workspace_id: "ws_a".to_owned(),
            items: Vec::new(),
            request: request.map(|(id, index)| RequestPart { id: id.to_owned(), index }),
            position: None,
        }
    }

    #[test]
    fn only_the_chunks_after_their_requests_failed_one_are_skipped() {
        let failed = HashMap::from([("r1".to_owned(), 1)]);
        assert!(!in_failed_request(&chunk(Some(("r1", 0))), &failed), "before the failed chunk: applied");
        assert!(!in_failed_request(&chunk(Some(("r1", 1))), &failed), "the failed chunk is not one after it");
        assert!(in_failed_request(&chunk(Some(("r1", 2))), &failed));
        assert!(!in_failed_request(&chunk(Some(("r2", 3))), &failed), "another request");
        assert!(!in_failed_request(&chunk(None), &failed), "a chunk of a gateway that names no request");
    }

    #[test]
    fn every_connection_carries_the_timeouts_and_generic_plans() {
        let timeouts = Timeouts {
            statement: Duration::from_secs(30),
            lock: Duration::from_millis(250),
            idle_in_transaction: Duration::from_secs(60),
        };
        let options = with_timeouts(PgConnectOptions::new(), timeouts);
        let options = options.get_options().unwrap_or_default();
        for setting in [
            "statement_timeout=30000",
            "lock_timeout=250",
            "idle_in_transaction_session_timeout=60000",
            "plan_cache_mode=force_generic_plan",
        ] {
            assert!(options.contains(setting), "{setting} in {options}");
        }
    }
}
