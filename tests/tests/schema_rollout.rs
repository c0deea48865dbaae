//! A schema change rolled out while writes go on (deploy/RUNBOOK.md, "Schema migrations"):
//! `intake-writer migrate` adds the keys on the workspace id's hash and keeps those on the id,
//! so that the previous version's writers and this one's both write, each through its own key,
//! to the same rows; `migrate --contract` then drops the old keys, after which only this
//! version's statements run.

#[allow(dead_code)]
#[path = "../../writer/src/lookups.rs"]
mod lookups;

use intake_tests::serde_json::{json, Value};
use intake_tests::OwnDatabase;
use sqlx::PgPool;

/// The previous version's insert: its ON CONFLICT names the unique key on the workspace id.
const PREVIOUS_INSERT: &str = concat!(
    "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id, occurred_at, value)
     VALUES ($1, 'ws_rollout', 'lead', $2, 'chn_rollout', $3, now(), $4::numeric) ",
    intake_common::conversions_on_conflict!("(workspace_id, event, external_id)")
);

/// This version's, on the key of migration 0024.
const INSERT: &str = concat!(
    "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, parent_external_id, occurred_at, value)
     VALUES ($1, 'ws_rollout', 'lead', $2, 'chn_rollout', $3, now(), $4::numeric) ",
    intake_common::conversions_on_conflict!()
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

/// (external id, parent, value) of the workspace's rows, as this version's look-up of a
/// chunk's related rows finds them: by the external ids `ids` and as children of `parents`.
async fn related(db: &PgPool, ids: &[&str], parents: &[&str]) -> Vec<(String, Option<String>, String)> {
    let rows: Vec<(String, Option<String>, String)> = sqlx::query_as(&format!(
        "SELECT external_id, parent_external_id, value FROM ({}) AS related ORDER BY external_id",
        lookups::RELATED_CONVERSIONS
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
    let expanded = own.migrate(&[]);
    // A new database stops at the first contract; every migration after it waits with it.
    assert_eq!(expanded["waiting_for_contract"], json!([26, 27, 28, 29, 30, 31, 32, 33, 34, 35]), "{expanded}");
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
    let contracted = own.migrate(&["--contract"]);
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
    let again: Value = own.migrate(&[]);
    assert_eq!(again["waiting_for_contract"], json!([]), "{again}");
    assert_eq!(indexes(&db).await, after);
    db.close().await;
}
