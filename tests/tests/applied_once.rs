//! A message is applied once. `applied_messages` is partitioned by the time of the apply, so its
//! primary key (id, applied_at) does not make an id unique across ranges: the statement trigger
//! `applied_messages_once` refuses a second row of an id with unique_violation, the error a
//! writer meets when another writer (a rebalance) applied the message first. Its cost is one
//! index probe per range and id, not a read of the table: it runs at every apply.

use intake_tests::OwnDatabase;
use sqlx::{Connection, PgPool};

async fn insert(db: &PgPool, ids: &[&str]) -> Result<(), sqlx::Error> {
    // The writer's own form of the insert: one statement for the messages of a run.
    sqlx::query(
        "INSERT INTO applied_messages (correlation_id, workspace_id, results)
         SELECT id, 'ws', '[]' FROM unnest($1::text[]) AS m(id)",
    )
    .bind(ids)
    .execute(db)
    .await
    .map(|_| ())
}

fn refused_as_applied(outcome: Result<(), sqlx::Error>) -> bool {
    matches!(outcome, Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("23505"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_message_applied_in_another_range_is_refused_by_an_index_probe() {
    let own = OwnDatabase::create("applied_once").await;
    let db = own.pool().await;
    let setup = [
        "CREATE TABLE applied_messages_old PARTITION OF applied_messages
            FOR VALUES FROM (now() - interval '3 hours') TO (now() - interval '2 hours')",
        // Large and never analyzed, as a range is while it fills: the plan a join would get
        // then read all of it.
        "CREATE TABLE applied_messages_now PARTITION OF applied_messages
            FOR VALUES FROM (now() - interval '1 hour') TO (now() + interval '1 hour')
            WITH (autovacuum_enabled = off)",
        "INSERT INTO applied_messages (correlation_id, workspace_id, results, applied_at)
         VALUES ('applied-hours-ago', 'ws', '[]', now() - interval '150 minutes')",
        "INSERT INTO applied_messages (correlation_id, workspace_id, results)
         SELECT 'filler-' || g, 'ws', '[]' FROM generate_series(1, 50000) AS g",
    ];
    for statement in setup {
        sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }

    // A new id: accepted, with a few blocks read, not the table's thousands. On a connection of
    // its own: the trigger's plan is made at a session's first insert, here with the range full.
    let mut connection = sqlx::PgConnection::connect(&own.url).await.unwrap_or_else(|e| panic!("{e}"));
    let mut tx = connection.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("INSERT INTO applied_messages (correlation_id, workspace_id, results) VALUES ('new', 'ws', '[]')")
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("a new id is refused: {e}"));
    let blocks: i64 = sqlx::query_scalar(
        "SELECT sum(pg_stat_get_xact_blocks_fetched(c.oid))::int8 FROM pg_class c
          WHERE c.relname LIKE 'applied\\_messages%'",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    tx.commit().await.unwrap_or_else(|e| panic!("{e}"));
    let table_blocks: i64 = sqlx::query_scalar("SELECT (pg_relation_size('applied_messages_now') / 8192)::int8")
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(blocks < 100, "one insert read {blocks} blocks of applied_messages ({table_blocks} in its range)");

    // Applied hours ago, in another range; applied a moment ago, in this one; either in a run
    // of several messages.
    assert!(refused_as_applied(insert(&db, &["applied-hours-ago"]).await), "an id of another range");
    assert!(refused_as_applied(insert(&db, &["new"]).await), "an id applied by an earlier transaction");
    assert!(refused_as_applied(insert(&db, &["fresh", "filler-7"]).await), "one id of a run applied before");
    let stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM applied_messages WHERE correlation_id IN ('fresh', 'new')")
            .fetch_one(&db)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stored, 1, "a refused run stores none of its ids");
    db.close().await;
}
