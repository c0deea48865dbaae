//! Schema changes rolled out while writes go on (deploy/RUNBOOK.md, "Schema migrations"):
//! `intake-writer migrate` adds what the new version uses beside what the previous one uses, so
//! that both versions' writers write to the same rows; `migrate --contract` then drops the old,
//! after which only the new version's statements run. Two rollouts: the keys on the workspace
//! id's hash (0024 to 0027), and the digests as bytes (0036 to 0042), the second on a populated
//! table while the previous version writes; a database several versions behind, which takes
//! every version's additions in one `migrate`; and the rows the release before 0036 wrote, erased
//! by this version's `erase` after the contract.

#[allow(dead_code)]
#[path = "../../writer/src/lookups.rs"]
mod lookups;

use intake_tests::serde_json::{json, Value};
use intake_tests::OwnDatabase;
use sqlx::PgPool;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The insert of the version before 0024: its ON CONFLICT names the unique key on the workspace id.
const PREVIOUS_INSERT: &str = concat!(
    "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id, occurred_at, value)
     VALUES ($1, 'ws_rollout', 'lead', $2, 'chn_rollout', $3, now(), $4::numeric) ",
    intake_model::conversions_on_conflict!(old_shape "(workspace_id, event, external_id)")
);

/// The key of migration 0024.
macro_rules! hash_key {
    () => {
        "((hashtextextended(workspace_id, 0)), event, external_id)"
    };
}

/// The insert of the versions from 0024 to 0035, on 0024's key.
const INSERT: &str = concat!(
    "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id, occurred_at, value)
     VALUES ($1, 'ws_rollout', 'lead', $2, 'chn_rollout', $3, now(), $4::numeric) ",
    intake_model::conversions_on_conflict!(old_shape hash_key!())
);

async fn insert(db: &PgPool, statement: &str, id: &str, external_id: &str, parent: Option<&str>, value: &str) {
    try_insert(db, statement, id, external_id, parent, value)
        .await
        .unwrap_or_else(|e| panic!("{external_id} = {value}: {e}"));
}

async fn try_insert(
    db: &PgPool,
    statement: &str,
    id: &str,
    external_id: &str,
    parent: Option<&str>,
    value: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(statement).bind(id).bind(external_id).bind(parent).bind(value).execute(db).await.map(|_| ())
}

/// (external id, parent, value) of the workspace's rows, as the look-up of a chunk's related
/// rows finds them since 0024 (through the keys on the workspace id's hash): by the external ids
/// `ids` and as children of `parents`.
async fn related(db: &PgPool, ids: &[&str], parents: &[&str]) -> Vec<(String, Option<String>, String)> {
    let rows: Vec<(String, Option<String>, String)> = sqlx::query_as(concat!(
        "SELECT external_id, parent_external_id, value::text FROM conversions WHERE ",
        intake_model::in_workspace!(),
        " AND (external_id = ANY($2) OR (parent_external_id IS NOT NULL AND parent_external_id = ANY($3)))
         ORDER BY external_id"
    ))
    .bind("ws_rollout")
    .bind(ids)
    .bind(parents)
    .fetch_all(db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    rows
}

fn row(external_id: &str, parent: Option<&str>, value: &str) -> (String, Option<String>, String) {
    (external_id.to_owned(), parent.map(str::to_owned), value.to_owned())
}

async fn indexes(db: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT indexname::text FROM pg_indexes WHERE tablename = 'conversions' ORDER BY 1")
        .fetch_all(db)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn the_previous_version_writes_until_the_contract_and_this_one_before_and_after_it() {
    let own = OwnDatabase::empty("rollout").await;
    let expanded = own.migrate(&["--through", "35"]);
    // A new database takes every addition; the drops wait.
    assert_eq!(expanded["waiting_for_contract"], json!([26, 27, 32, 33, 34, 35]), "{expanded}");
    let db = own.pool().await;
    for statement in [
        "INSERT INTO workspaces (id, name, project_id) VALUES ('ws_rollout', 'Rollout', 'prj_rollout')",
        "INSERT INTO chains (id, workspace_id) VALUES ('chn_rollout', 'ws_rollout')",
    ] {
        sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let before = indexes(&db).await;
    for index in [
        "conversions_by_workspace_external_id_event",
        "conversions_by_parent",
        "conversions_by_workspace_hash_external_id_event",
        "conversions_by_workspace_hash_parent",
    ] {
        assert!(before.contains(&index.to_owned()), "{index} after the expand: {before:?}");
    }

    // Both versions write during the rollout, and each sees the other's rows as the same key.
    insert(&db, PREVIOUS_INSERT, "cnv_1", "A1", None, "1").await;
    insert(&db, INSERT, "cnv_2", "A1", None, "2").await;
    insert(&db, INSERT, "cnv_3", "A2", Some("A1"), "3").await;
    insert(&db, PREVIOUS_INSERT, "cnv_4", "A2", Some("A1"), "4").await;
    assert_eq!(related(&db, &["A1"], &["A1"]).await, [row("A1", None, "2"), row("A2", Some("A1"), "4")]);

    // The contract: the keys on the workspace id go, and so does the previous version's insert.
    let contracted = own.migrate(&["--contract", "--through", "35"]);
    assert_eq!(contracted["waiting_for_contract"], json!([]), "{contracted}");
    let after = indexes(&db).await;
    for index in [
        "conversions_by_workspace_external_id_event",
        "conversions_by_parent",
        "conversions_by_email_hash",
        "conversions_by_phone_hash",
        "conversions_by_visitor_hash",
        "conversions_by_contact_hash",
    ] {
        assert!(!after.contains(&index.to_owned()), "{index} after the contract: {after:?}");
    }
    for index in ["email_hash", "phone_hash", "visitor_hash", "contact_hash"] {
        let index = format!("conversions_by_month_{index}");
        assert!(after.contains(&index), "{index} after the contract: {after:?}");
    }
    let refused = try_insert(&db, PREVIOUS_INSERT, "cnv_5", "A1", None, "5").await;
    let code = refused.as_ref().err().and_then(|e| e.as_database_error()).and_then(|e| e.code());
    assert_eq!(code.as_deref(), Some("42P10"), "no key matches the old ON CONFLICT: {refused:?}");
    insert(&db, INSERT, "cnv_6", "A1", None, "6").await;
    insert(&db, INSERT, "cnv_7", "A3", Some("A1"), "7").await;
    assert_eq!(
        related(&db, &["A1"], &["A1"]).await,
        [row("A1", None, "6"), row("A2", Some("A1"), "4"), row("A3", Some("A1"), "7")]
    );
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM conversions").fetch_one(&db).await.unwrap_or_default();
    assert_eq!(count, 3, "one row a key through both versions");

    // Migrating again changes nothing.
    let again: Value = own.migrate(&["--through", "35"]);
    assert_eq!(again["waiting_for_contract"], json!([]), "{again}");
    assert_eq!(indexes(&db).await, after);
    db.close().await;
}

/// This version's: the digest as its bytes (migration 0036).
const INSERT_WITH_EMAIL: &str = concat!(
    "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, occurred_at, email_digest)
     VALUES ($1, 'ws_rollout', 'lead', $2, 'chn_rollout', now(), decode($3, 'hex')) ",
    intake_model::conversions_on_conflict!()
);

const STORED: i64 = 30_000;

/// The rows of the version of 0005 as they stand: 20,000 conversions in 10,000 chains (a lead
/// and the purchase whose parent it is), one visit each and its match; every value a row has.
const POPULATE_AT_0005: [&str; 4] = [
    "INSERT INTO chains (id, workspace_id)
     SELECT 'chn_p' || lpad(g::text, 6, '0'), 'ws_rollout' FROM generate_series(1, 10000) AS g",
    "INSERT INTO conversions (id, workspace_id, event, external_id, parent_external_id, chain_id, occurred_at,
                              visitor_id, contact_id, email_sha256, phone_sha256, value, currency)
     SELECT 'cnv_p' || lpad(g::text, 6, '0'), 'ws_rollout', CASE WHEN g % 2 = 0 THEN 'purchase' ELSE 'lead' END,
            'P' || g, CASE WHEN g % 2 = 0 THEN 'P' || (g - 1) END, 'chn_p' || lpad(((g + 1) / 2)::text, 6, '0'),
            now() - make_interval(mins => g), 'v' || g, CASE WHEN g % 5 = 0 THEN 'crm-' || g END,
            encode(sha256(convert_to('person-' || g || '@example.com', 'UTF8')), 'hex'),
            CASE WHEN g % 2 = 0 THEN encode(sha256(convert_to('+4930' || g, 'UTF8')), 'hex') END, g, 'EUR'
       FROM generate_series(1, 20000) AS g",
    "INSERT INTO visits (workspace_id, visitor_id, visited_at)
     SELECT 'ws_rollout', 'v' || g, now() - make_interval(mins => g + 60) FROM generate_series(1, 20000) AS g",
    "INSERT INTO conversion_matches (conversion_id, visit_id, matched_by)
     SELECT 'cnv_p' || lpad(g::text, 6, '0'), v.id, 'visitor_id'
       FROM generate_series(1, 20000) AS g JOIN visits v ON v.visitor_id = 'v' || g",
];

/// Every value of the rows of [`POPULATE_AT_0005`], their chains and their matches, as one digest.
const POPULATED_VALUES: &str = "SELECT md5(
    (SELECT string_agg(concat_ws('|', id, workspace_id, event, external_id, parent_external_id, chain_id,
                                 occurred_at, visitor_id, contact_id, email_sha256, phone_sha256, value, currency),
                       ',' ORDER BY id)
       FROM conversions WHERE id LIKE 'cnv\\_p%')
    || (SELECT string_agg(id || workspace_id, ',' ORDER BY id) FROM chains WHERE id LIKE 'chn\\_p%')
    || (SELECT string_agg(conversion_id || visit_id || matched_by, ',' ORDER BY conversion_id)
          FROM conversion_matches WHERE conversion_id LIKE 'cnv\\_p%'))";

/// A populated database several versions behind (at 0005, the schema of a version before every
/// rollout here) takes every version's additions in one `migrate` while its own version writes:
/// no write fails or waits 5 s, every stored value, chain and match is kept, and the binaries
/// of its own version and this version's then both write, each to the same rows, until
/// `--contract`.
#[tokio::test(flavor = "multi_thread")]
async fn a_database_several_versions_behind_takes_every_version_s_additions_in_one_migrate() {
    let own = OwnDatabase::empty("jump").await;
    own.migrate(&["--contract", "--through", "5"]);
    let db = own.pool().await;
    for statement in [
        "INSERT INTO workspaces (id, name, project_id) VALUES ('ws_rollout', 'Rollout', 'prj_rollout')",
        "INSERT INTO chains (id, workspace_id) VALUES ('chn_rollout', 'ws_rollout')",
    ]
    .into_iter()
    .chain(POPULATE_AT_0005)
    {
        sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let before: String = sqlx::query_scalar(POPULATED_VALUES).fetch_one(&db).await.unwrap_or_else(|e| panic!("{e}"));
    insert(&db, PREVIOUS_INSERT, "cnv_1", "A1", None, "1").await;

    // The version of 0005 writes throughout the migration.
    let writes = Writes::start({
        let db = db.clone();
        move |n| {
            let db = db.clone();
            async move {
                insert(&db, PREVIOUS_INSERT, &format!("cnv_w{n}"), &format!("W{n}"), None, "7").await;
            }
        }
    });
    writes.until(20).await;
    let at_start = writes.count();
    let expanded = own.migrate(&[]);
    let during = writes.count() - at_start;
    let (written, slowest) = writes.stop().await;
    let written = i64::try_from(written).unwrap_or_default();
    assert_eq!(expanded["waiting_for_contract"], json!([26, 27, 32, 33, 34, 35, 40, 41, 42]), "{expanded}");
    assert!(during > 0, "the previous version wrote during the migration");
    assert!(slowest < Duration::from_secs(5), "a write waited {slowest:?} during the migration");
    assert_eq!(scalar(&db, "SELECT count(*) FROM conversions WHERE id LIKE 'cnv\\_w%'").await, written);
    let after: String = sqlx::query_scalar(POPULATED_VALUES).fetch_one(&db).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(after, before, "every stored value, chain and match kept");
    assert_eq!(by_email(&db, &email_hash(20_000)).await, ["cnv_p020000"], "this version's erasure finds a stored row");

    // The version of 0005 writes on its own key; this one with its digest as bytes, on its key.
    insert(&db, PREVIOUS_INSERT, "cnv_2", "A2", None, "2").await;
    let hash = email_hash(1_000_001);
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_3", "A1", &hash).await;
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_4", "A3", &hash).await;
    let ours = "SELECT count(*) FROM conversions WHERE id NOT LIKE 'cnv\\_p%' AND id NOT LIKE 'cnv\\_w%'";
    assert_eq!(scalar(&db, ours).await, 3, "A1 once, through both keys");
    assert_eq!(by_email(&db, &hash).await, ["cnv_1", "cnv_4"], "this version's erasure finds both rows");

    let contracted = own.migrate(&["--contract"]);
    assert_eq!(contracted["waiting_for_contract"], json!([]), "{contracted}");
    let refused = try_insert(&db, PREVIOUS_INSERT, "cnv_5", "A1", None, "5").await;
    assert!(refused.is_err(), "the old key is gone after the contract");
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_6", "A4", &hash).await;
    assert_eq!(by_email(&db, &hash).await, ["cnv_1", "cnv_4", "cnv_6"]);
    let contracted: String =
        sqlx::query_scalar(POPULATED_VALUES).fetch_one(&db).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(contracted, before, "and after the contract");
    db.close().await;
}

/// The previous version's writes in the background, one after another until stopped: `write(n)`
/// is the n-th, from 1, and panics should it fail.
struct Writes {
    done: Arc<AtomicBool>,
    written: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Duration>,
}

impl Writes {
    fn start<W, F>(write: W) -> Writes
    where
        W: Fn(u64) -> F + Send + 'static,
        F: std::future::Future<Output = ()> + Send,
    {
        let (done, written) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let task = tokio::spawn({
            let (done, written) = (done.clone(), written.clone());
            async move {
                let mut slowest = Duration::ZERO;
                while !done.load(Ordering::Relaxed) {
                    let n = written.load(Ordering::Relaxed) + 1;
                    let started = Instant::now();
                    write(n).await;
                    slowest = slowest.max(started.elapsed());
                    written.store(n, Ordering::Relaxed);
                }
                slowest
            }
        });
        Writes { done, written, task }
    }

    fn count(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    async fn until(&self, count: u64) {
        while self.count() < count {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Stops them: how many were written, and the slowest.
    async fn stop(self) -> (u64, Duration) {
        self.done.store(true, Ordering::Relaxed);
        let slowest = self.task.await.unwrap_or_else(|e| panic!("{e}"));
        (self.written.load(Ordering::Relaxed), slowest)
    }
}

fn email_hash(n: u64) -> String {
    let email = format!("person-{n}@example.com");
    intake_model::normalize::email_hash(&email).map(|h| h.as_str().to_owned()).unwrap_or_default()
}

async fn scalar(db: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql).fetch_one(db).await.unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The ids of the rows that this version's erasure finds by the email digest `hash`.
async fn by_email(db: &PgPool, hash: &str) -> Vec<String> {
    sqlx::query_scalar(&format!("SELECT id FROM ({}) AS person ORDER BY id", lookups::PERSON_BY_EMAIL))
        .bind("ws_rollout")
        .bind(hash)
        .fetch_all(db)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The statements of the release before migration 0036, which reads and writes the digests as
/// hex: taken verbatim from writer/src/store.rs of that release (a chunk's write, `write_chunk!`,
/// with the select list it has when it is not the transaction's last, and the
/// `conversions_on_conflict!` of model/src/conversion.rs it ends with) and from its
/// writer/src/lookups.rs (its erasure's look-up by email and its clearing of a person's rows).
/// Frozen here as data: the rollout of 0036 to 0042 must keep working for the binaries that run
/// exactly these, and for the rows they stored.
mod before_0036 {
    pub const WRITE: &str =
        "WITH new_chains AS (INSERT INTO chains (id, workspace_id) SELECT id, $1 FROM unnest($19::text[]) AS new(id)),
             recorded AS (
                 INSERT INTO applied_messages (correlation_id, workspace_id, results)
                 SELECT id, $1, results::jsonb FROM unnest($20::text[], $21::text[]) AS m(id, results)),
             written AS (
                 INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id,
                                          occurred_at, visitor_id, click_id, contact_id, email_sha256,
                                          phone_sha256, address_sha256, country, value, currency, hdyhau, tags)
                 SELECT u.id, $1, u.event, u.external_id, u.chain_id, u.parent_external_id,
                        'epoch'::timestamptz + u.occurred_at_ms * interval '1 millisecond',
                        u.visitor_id, u.click_id, u.contact_id, u.email_sha256, u.phone_sha256, u.address_sha256,
                        u.country, u.value::numeric, u.currency, u.hdyhau, u.tags::jsonb
                   FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int8[], $8::text[],
                               $9::text[], $10::text[], $11::text[], $12::text[], $13::text[], $14::text[],
                               $15::text[], $16::text[], $17::text[], $18::text[])
                     AS u(id, event, external_id, chain_id, parent_external_id, occurred_at_ms, visitor_id, click_id,
                          contact_id, email_sha256, phone_sha256, address_sha256, country, value, currency, hdyhau,
                          tags)
                 ON CONFLICT ((hashtextextended(workspace_id, 0)), event, external_id) DO UPDATE SET
                chain_id = excluded.chain_id, parent_external_id = excluded.parent_external_id,
                occurred_at = excluded.occurred_at, visitor_id = excluded.visitor_id, click_id = excluded.click_id,
                contact_id = excluded.contact_id, email_sha256 = excluded.email_sha256,
                phone_sha256 = excluded.phone_sha256, address_sha256 = excluded.address_sha256,
                country = excluded.country, value = excluded.value, currency = excluded.currency,
                hdyhau = excluded.hdyhau, tags = excluded.tags, updated_at = now())
             SELECT 1";

    pub const PERSON_BY_EMAIL: &str = concat!(
        "SELECT id, left(visitor_id, 16) AS visitor_id, click_id, contact_id, email_sha256, phone_sha256
       FROM conversions WHERE workspace_id = $1 AND email_sha256 IS NOT NULL AND ",
        "date_trunc('month', created_at AT TIME ZONE 'UTC') = ANY(ARRAY(SELECT generate_series((SELECT ",
        "min(date_trunc('month', created_at AT TIME ZONE 'UTC')) FROM conversions WHERE email_sha256 IS NOT NULL), ",
        "(SELECT max(date_trunc('month', created_at AT TIME ZONE 'UTC')) FROM conversions WHERE email_sha256 ",
        "IS NOT NULL), interval '1 month'))) AND hashtextextended(email_sha256, 0) = hashtextextended($2, 0) ",
        "AND email_sha256 = $2"
    );

    pub const CLEAR_PERSON_CONVERSIONS: &str = "
    UPDATE conversions SET visitor_id = NULL, click_id = NULL, contact_id = NULL, email_sha256 = NULL,
           phone_sha256 = NULL, address_sha256 = NULL, hdyhau = NULL, updated_at = now()
     WHERE id = ANY($1)";
}

/// One conversion of a chunk as the release before 0036 bound it to [`before_0036::WRITE`]: the
/// planned row (a new one in a chain of its own, or a stored one re-sent, with its id and chain).
#[derive(Clone, Default)]
struct PreviousRow {
    id: String,
    external_id: String,
    chain_id: String,
    created: bool,
    visitor_id: Option<String>,
    contact_id: Option<String>,
    email_sha256: Option<String>,
    phone_sha256: Option<String>,
    address_sha256: Option<String>,
}

/// One message of workspace `ws_rollout`, its `rows` all leads, written as the release before
/// 0036 wrote it: one statement, with the binds of its `write_plan` (the new rows' chains
/// inserted beside them, the message recorded with its results).
async fn previous_write(db: &PgPool, correlation_id: &str, rows: &[PreviousRow]) -> Result<(), sqlx::Error> {
    let texts = |field: fn(&PreviousRow) -> Option<&str>| rows.iter().map(field).collect::<Vec<_>>();
    let none = vec![Option::<&str>::None; rows.len()];
    let new_chains: Vec<&str> = rows.iter().filter(|r| r.created).map(|r| r.chain_id.as_str()).collect();
    let results: Vec<Value> = rows
        .iter()
        .map(|r| {
            let result = if r.created { "created" } else { "updated" };
            json!({"id": r.id, "event": "lead", "external_id": r.external_id, "chain_id": r.chain_id, "result": result})
        })
        .collect();
    sqlx::query(before_0036::WRITE)
        .bind("ws_rollout")
        .bind(texts(|r| Some(r.id.as_str())))
        .bind(vec!["lead"; rows.len()])
        .bind(texts(|r| Some(r.external_id.as_str())))
        .bind(texts(|r| Some(r.chain_id.as_str())))
        .bind(&none)
        .bind(vec![intake_tests::now_ms() - 60_000; rows.len()])
        .bind(texts(|r| r.visitor_id.as_deref()))
        .bind(&none)
        .bind(texts(|r| r.contact_id.as_deref()))
        .bind(texts(|r| r.email_sha256.as_deref()))
        .bind(texts(|r| r.phone_sha256.as_deref()))
        .bind(texts(|r| r.address_sha256.as_deref()))
        .bind(&none)
        .bind(&none)
        .bind(&none)
        .bind(&none)
        .bind(&none)
        .bind(new_chains)
        .bind(vec![correlation_id])
        .bind(vec![Value::from(results).to_string()])
        .execute(db)
        .await
        .map(|_| ())
}

/// The ids of the rows that the release before 0036 finds by the email digest `hash` (hex).
async fn previous_by_email(db: &PgPool, hash: &str) -> Vec<String> {
    sqlx::query_scalar(&format!("SELECT id FROM ({}) AS person ORDER BY id", before_0036::PERSON_BY_EMAIL))
        .bind("ws_rollout")
        .bind(hash)
        .fetch_all(db)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Row `g` of the rows stored before, as the previous release's plan has it when a chunk
/// re-sends it: its id and chain, no identifier yet.
fn stored_before(g: i64) -> PreviousRow {
    PreviousRow {
        id: format!("cnv_{g:06}"),
        external_id: format!("old-{g}"),
        chain_id: format!("chn_{g:06}"),
        ..PreviousRow::default()
    }
}

/// The email digest (hex) of row `g` of the rows stored before.
fn old_hash(g: i64) -> String {
    intake_model::normalize::sha256_hex(&format!("e{g}")).as_str().to_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_digests_become_bytes_on_a_populated_table_while_the_previous_version_writes() {
    let own = OwnDatabase::empty("digests").await;
    own.migrate(&["--contract", "--through", "35"]);
    let db = own.pool().await;
    for statement in [
        "INSERT INTO workspaces (id, name, project_id) VALUES ('ws_rollout', 'Rollout', 'prj_rollout')",
        "INSERT INTO chains (id, workspace_id) VALUES ('chn_rollout', 'ws_rollout')",
    ] {
        sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    // The rows stored before, written by the previous release in messages of 1,000.
    let hex = |text: String| Some(intake_model::normalize::sha256_hex(&text).as_str().to_owned());
    for first in (1..=STORED).step_by(1_000) {
        let rows: Vec<PreviousRow> = (first..first + 1_000)
            .map(|g| PreviousRow {
                created: true,
                email_sha256: hex(format!("e{g}")),
                phone_sha256: if g % 2 == 0 { hex(format!("p{g}")) } else { None },
                address_sha256: if g % 3 == 0 { hex(format!("a{g}")) } else { None },
                ..stored_before(g)
            })
            .collect();
        previous_write(&db, &format!("c-old-{first}"), &rows).await.unwrap_or_else(|e| panic!("{first}: {e}"));
    }
    let untouched: String = sqlx::query_scalar("SELECT email_sha256 FROM conversions WHERE external_id = 'old-1'")
        .fetch_one(&db)
        .await
        .unwrap_or_default();

    // The previous version writes throughout the migration: every other write a re-send of a
    // stored conversion with another email, the rest new conversions.
    let writes = Writes::start({
        let db = db.clone();
        move |n| {
            let db = db.clone();
            async move {
                let row = match n % 2 {
                    0 => stored_before(i64::try_from(n % 29_000 + 1_001).unwrap_or_default()),
                    _ => PreviousRow {
                        id: format!("cnv_w{n}"),
                        external_id: format!("new-{n}"),
                        chain_id: format!("chn_w{n}"),
                        created: true,
                        ..PreviousRow::default()
                    },
                };
                let row = PreviousRow { email_sha256: Some(email_hash(n)), ..row };
                previous_write(&db, &format!("c-w{n}"), std::slice::from_ref(&row))
                    .await
                    .unwrap_or_else(|e| panic!("the previous version's write of {}: {e}", row.external_id));
            }
        }
    });
    writes.until(20).await;
    let at_start = writes.count();
    let expanded = own.migrate(&[]);
    let during = writes.count() - at_start;
    // A few more after it, through the trigger that keeps the two in step.
    writes.until(writes.count() + 20).await;
    let (written, slowest) = writes.stop().await;
    assert_eq!(expanded["waiting_for_contract"], json!([40, 41, 42]), "{expanded}");
    assert!(during > 0, "the previous version wrote during the migration");
    assert!(slowest < Duration::from_secs(5), "a write waited {slowest:?} during the migration");

    // No row was rewritten: the rows stored before keep their hex alone; each row the previous
    // version wrote since has its digest as bytes too, equal to the hex.
    let new_rows = i64::try_from(written.div_ceil(2)).unwrap_or_default();
    assert_eq!(scalar(&db, "SELECT count(*) FROM conversions").await, STORED + new_rows);
    let stored: String = sqlx::query_scalar("SELECT email_sha256 FROM conversions WHERE external_id = 'old-1'")
        .fetch_one(&db)
        .await
        .unwrap_or_default();
    assert_eq!(stored, untouched);
    let old_bytes = "SELECT count(*) FROM conversions WHERE id LIKE 'cnv\\_0%' AND email_digest IS NOT NULL";
    let resent = scalar(&db, old_bytes).await;
    assert!(resent > 0 && resent <= i64::try_from(written / 2).unwrap_or_default(), "{resent} rewritten");
    let out_of_step = "SELECT count(*) FROM conversions
        WHERE email_digest IS NOT NULL AND email_digest IS DISTINCT FROM decode(email_sha256, 'hex')";
    assert_eq!(scalar(&db, out_of_step).await, 0, "digests out of step with their hex");
    let last_n = if written % 2 == 1 { written } else { written - 1 };
    let last_new = format!("new-{last_n}");
    let both = format!(
        "SELECT count(*) FROM conversions WHERE external_id = '{last_new}' AND email_digest IS NOT NULL
            AND email_sha256 IS NOT NULL"
    );
    assert_eq!(scalar(&db, &both).await, 1, "the previous version's insert after the expand has its bytes");

    // This version finds both kinds of rows through the digests' index.
    assert_eq!(by_email(&db, &old_hash(1)).await, ["cnv_000001"], "a row stored before, by its hex");
    assert_eq!(by_email(&db, &email_hash(last_n)).await.len(), 1, "a row of the previous version's");

    // During the rollout each version sees the other's writes and erasures.
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_x1", "this-1", &email_hash(1_000_001)).await;
    let hex: Option<String> = sqlx::query_scalar("SELECT email_sha256 FROM conversions WHERE external_id = 'this-1'")
        .fetch_one(&db)
        .await
        .unwrap_or_default();
    assert_eq!(hex, Some(email_hash(1_000_001)), "the previous version reads this one's digest as hex");
    let mut found = previous_by_email(&db, &email_hash(1_000_001)).await;
    assert_eq!(found, ["cnv_x1"], "the previous version's erasure finds this one's row");
    found.extend(previous_by_email(&db, &old_hash(4)).await);
    assert_eq!(found, ["cnv_x1", "cnv_000004"], "and a row stored before");
    sqlx::query(before_0036::CLEAR_PERSON_CONVERSIONS)
        .bind(&found)
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("the previous version's erasure: {e}"));
    sqlx::query(lookups::CLEAR_PERSON_CONVERSIONS)
        .bind(vec!["cnv_000005".to_owned()])
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let erased = "SELECT count(*) FROM conversions
        WHERE external_id IN ('this-1', 'old-4', 'old-5') AND email_sha256 IS NULL AND email_digest IS NULL";
    assert_eq!(scalar(&db, erased).await, 3, "an erasure by either version clears both");
    assert!(by_email(&db, &email_hash(1_000_001)).await.is_empty());
    // This version's re-send of a row stored before, with another email: both forms are the new one.
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_x6", "old-6", &email_hash(1_000_006)).await;
    let hex: Option<String> = sqlx::query_scalar("SELECT email_sha256 FROM conversions WHERE external_id = 'old-6'")
        .fetch_one(&db)
        .await
        .unwrap_or_default();
    assert_eq!(hex, Some(email_hash(1_000_006)));

    // The contract: the previous version's indexes and the trigger go; a new row carries its
    // digest once, as bytes; the rows stored before are still found by their hex.
    let contracted = own.migrate(&["--contract"]);
    assert_eq!(contracted["waiting_for_contract"], json!([]), "{contracted}");
    let indexes = indexes(&db).await;
    for index in ["conversions_by_month_email_hash", "conversions_by_month_phone_hash"] {
        assert!(!indexes.contains(&index.to_owned()), "{index} after the contract: {indexes:?}");
    }
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_x3", "this-3", &email_hash(1_000_003)).await;
    let once = "SELECT count(*) FROM conversions WHERE external_id = 'this-3'
        AND email_sha256 IS NULL AND email_digest IS NOT NULL";
    assert_eq!(scalar(&db, once).await, 1, "a new row's digest is stored once");
    assert_eq!(by_email(&db, &email_hash(1_000_003)).await, ["cnv_x3"]);
    assert_eq!(by_email(&db, &old_hash(1)).await, ["cnv_000001"]);
    // A re-send of a row stored before: its hex stays while it is the digest's, goes when the
    // email changed, so that no erasure can miss a hash the row no longer shows.
    let hex_of = |external_id: &'static str| {
        let db = db.clone();
        async move {
            let hex: Option<String> = sqlx::query_scalar("SELECT email_sha256 FROM conversions WHERE external_id = $1")
                .bind(external_id)
                .fetch_one(&db)
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            hex
        }
    };
    let own_hash: String = sqlx::query_scalar("SELECT email_sha256 FROM conversions WHERE external_id = 'old-8'")
        .fetch_one(&db)
        .await
        .unwrap_or_default();
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_x8", "old-8", &own_hash).await;
    assert_eq!(hex_of("old-8").await, Some(own_hash));
    insert_with_email(&db, INSERT_WITH_EMAIL, "cnv_x7", "old-7", &email_hash(1_000_007)).await;
    assert_eq!(hex_of("old-7").await, None);
    assert_eq!(by_email(&db, &email_hash(1_000_007)).await, ["cnv_000007"]);
    db.close().await;
}

async fn insert_with_email(db: &PgPool, statement: &str, id: &str, external_id: &str, hash: &str) {
    sqlx::query(statement)
        .bind(id)
        .bind(external_id)
        .bind(hash)
        .execute(db)
        .await
        .unwrap_or_else(|e| panic!("{external_id}: {e}"));
}

/// The identifiers of row `id` as stored: the hex and the bytes of each digest, the contact and
/// visitor ids.
async fn identifiers(db: &PgPool, id: &str) -> Vec<Option<String>> {
    sqlx::query_scalar(
        "SELECT ARRAY[email_sha256, encode(email_digest, 'hex'), phone_sha256, encode(phone_digest, 'hex'),
                      address_sha256, encode(address_digest, 'hex'), contact_id, visitor_id]
           FROM conversions WHERE id = $1",
    )
    .bind(id)
    .fetch_one(db)
    .await
    .unwrap_or_else(|e| panic!("{id}: {e}"))
}

/// `intake-writer erase --workspace ws_rollout <kind>` on `own`, the identifier on its standard
/// input, with topics of its own (the erasure is recorded in the requests topic): what it printed.
fn erase(own: &OwnDatabase, kind: &[&str], identifier: &str) -> Value {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut erase = Command::new(std::path::Path::new(&intake_tests::env("INTAKE_BIN_DIR")).join("intake-writer"))
        .args(["erase", "--workspace", "ws_rollout"])
        .args(kind)
        .env("DATABASE_URL", &own.url)
        .envs(intake_tests::own_topics())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("intake-writer erase: {e}"));
    if let Some(mut stdin) = erase.stdin.take() {
        stdin.write_all(format!("{identifier}\n").as_bytes()).unwrap_or_else(|e| panic!("{e}"));
    }
    let output = erase.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    assert!(output.status.success(), "erase {kind:?}: {}", String::from_utf8_lossy(&output.stderr));
    intake_tests::serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("erase printed no JSON: {e}"))
}

/// A person's rows that the release before 0036 wrote keep their digests as hex alone, the bytes
/// never filled in (0036 rewrites no row): once every migration and the contract ran, this
/// version's erasure still finds them by email and by phone and clears both forms of every
/// digest with the other identifiers, and leaves someone else's row as it was.
#[tokio::test]
async fn the_erase_command_clears_the_rows_the_release_before_0036_wrote() {
    let own = OwnDatabase::empty("erase_hex").await;
    own.migrate(&["--contract", "--through", "35"]);
    let db = own.pool().await;
    let statement = "INSERT INTO workspaces (id, name, project_id) VALUES ('ws_rollout', 'Rollout', 'prj_rollout')";
    sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    let hex = |hash: Option<intake_model::conversion::Sha256Hex>| hash.map(|h| h.as_str().to_owned());
    let row = |n: u32, email: &str, phone: &str| PreviousRow {
        id: format!("cnv_{n}"),
        external_id: format!("lead-{n}"),
        chain_id: format!("chn_{n}"),
        created: true,
        visitor_id: Some(format!("visitor-{n}-0123456789")),
        contact_id: Some(format!("crm-{n}")),
        email_sha256: hex(intake_model::normalize::email_hash(email)),
        phone_sha256: hex(intake_model::normalize::phone_hash(phone, None)),
        address_sha256: hex(intake_model::normalize::address_hash("1 Main St", "10115", "DE")),
    };
    let rows = [
        PreviousRow { phone_sha256: None, ..row(1, "ann@example.com", "") },
        PreviousRow { email_sha256: None, ..row(2, "", "+14155552671") },
        row(3, "bob@example.com", "+14155550000"),
    ];
    previous_write(&db, "c-1", &rows).await.unwrap_or_else(|e| panic!("the previous release's write: {e}"));
    own.migrate(&[]);
    own.migrate(&["--contract"]);
    let someone_else = identifiers(&db, "cnv_3").await;
    for (row, id) in rows.iter().zip(["cnv_1", "cnv_2", "cnv_3"]) {
        let stored = identifiers(&db, id).await;
        let as_written = [&row.email_sha256, &None, &row.phone_sha256, &None, &row.address_sha256, &None];
        assert_eq!(stored[..6].iter().collect::<Vec<_>>(), as_written, "{id}: its digests as hex alone");
    }

    let by_email = erase(&own, &["--email"], "Ann@Example.com");
    assert_eq!(by_email, json!({"conversions": 1, "visits": 0}));
    assert_eq!(identifiers(&db, "cnv_1").await, vec![None; 8], "every identifier of the row found by email cleared");
    let by_phone = erase(&own, &["--phone"], "+1 415 555 2671");
    assert_eq!(by_phone, json!({"conversions": 1, "visits": 0}));
    assert_eq!(identifiers(&db, "cnv_2").await, vec![None; 8], "every identifier of the row found by phone cleared");
    assert_eq!(identifiers(&db, "cnv_3").await, someone_else, "someone else's row");
    db.close().await;
}
