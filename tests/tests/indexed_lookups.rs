//! Erasure and matching stay fast as a workspace grows: on ANALYZEd tables of realistic size
//! (250k conversions and visits, most in one workspace), the planner answers every statement
//! of both paths from indexes, never a sequential scan of `conversions`, `visits` or
//! `conversion_matches`, in the generic plans the writer runs. The statements are the writer's
//! own text (writer/src/lookups.rs).
//! The tables live in a database of the test's own, created and dropped here, so that no test
//! of the shared database sees their rows. An erasure on it is timed too.

#[allow(dead_code)]
#[path = "../../writer/src/lookups.rs"]
mod lookups;

use intake_tests::env;
use intake_tests::OwnDatabase;
use serde_json::Value;
use sqlx::postgres::PgPoolOptions;
use sqlx::PgPool;
use std::process::{Command, Stdio};

/// Rows of each of `conversions` and `visits`; three in four in the workspace `ws_0`.
const ROWS: i64 = 250_000;

/// Workspace `ws_0` holds three in four rows, 99 others the rest, created over a year. Every other conversion has a
/// visitor id (16 characters and a suffix), one in three a click id, one in five a contact id,
/// every other an email hash, one in four a phone hash, one in three the row before as its
/// parent; visits likewise.
async fn fill(db: &PgPool) {
    let statements = [
        "INSERT INTO workspaces (id, name, project_id) SELECT 'ws_' || i, 'w', 'p' FROM generate_series(0, 99) i",
        "CREATE UNLOGGED TABLE spread AS
            SELECT g, CASE WHEN g % 4 = 0 THEN 'ws_' || (g % 100) ELSE 'ws_0' END AS ws
              FROM generate_series(1, {ROWS}) g",
        "INSERT INTO chains (id, workspace_id) SELECT 'ch_' || g, ws FROM spread",
        "INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, occurred_at, visitor_id, click_id,
                                  contact_id, email_digest, phone_digest, parent_external_id, created_at)
         SELECT 'cv_' || g, ws, 'purchase', 'e' || g, 'ch_' || g, now() - (g % 2000) * interval '1 hour',
                CASE WHEN g % 2 = 0 THEN substr(md5('v' || g), 1, 16) || '.1700000000' END,
                CASE WHEN g % 3 = 0 THEN md5('k' || g) END,
                CASE WHEN g % 5 = 0 THEN 'contact-' || g END,
                CASE WHEN g % 2 = 1 THEN decode(md5('e' || g) || md5('E' || g), 'hex') END,
                CASE WHEN g % 4 = 1 THEN decode(md5('p' || g) || md5('P' || g), 'hex') END,
                CASE WHEN g % 3 = 0 THEN 'e' || (g - 1) END,
                now() - (g % 8760) * interval '1 hour'
           FROM spread",
        "INSERT INTO visits (workspace_id, visitor_id, click_id, recipient_id, visited_at, page)
         SELECT ws, substr(md5('v' || (g - g % 2)), 1, 16), CASE WHEN g % 3 = 0 THEN md5('k' || g) END,
                CASE WHEN g % 5 = 0 THEN 'contact-' || g END, now() - (g % 3000) * interval '1 hour', '/p'
           FROM spread",
        "INSERT INTO conversion_matches (conversion_id, visit_id, matched_by)
         SELECT 'cv_' || v.id, v.id, 'visitor_id' FROM visits v WHERE v.id % 2 = 0",
    ];
    for statement in statements {
        let statement = statement.replace("{ROWS}", &ROWS.to_string());
        sqlx::query(&statement).execute(db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    for table in ["conversions", "visits", "conversion_matches", "chains"] {
        sqlx::query(&format!("ANALYZE {table}")).execute(db).await.unwrap_or_else(|e| panic!("{e}"));
    }
}

/// Every (node type, relation) of a JSON plan.
fn nodes(plan: &Value, out: &mut Vec<(String, String)>) {
    let text = |key: &str| plan[key].as_str().unwrap_or_default().to_owned();
    out.push((text("Node Type"), text("Relation Name")));
    for child in plan["Plans"].as_array().into_iter().flatten() {
        nodes(child, out);
    }
}

/// The planner's estimate of the rows of every scan of `index` in a JSON plan.
fn index_rows(plan: &Value, index: &str, out: &mut Vec<f64>) {
    if plan["Index Name"].as_str() == Some(index) {
        out.push(plan["Plan Rows"].as_f64().unwrap_or(f64::MAX));
    }
    for child in plan["Plans"].as_array().into_iter().flatten() {
        index_rows(child, index, out);
    }
}

/// A parameter of a statement.
enum Param {
    Text(&'static str),
    Int(i64),
    Texts(Vec<String>),
    Ints(Vec<i64>),
}

impl Param {
    /// The parameter as an SQL literal (the test's values hold no quote).
    fn literal(&self) -> String {
        let quoted = |value: &str| {
            assert!(!value.contains('\''), "{value}");
            format!("'{value}'")
        };
        match self {
            Param::Text(text) => quoted(text),
            Param::Int(int) => int.to_string(),
            Param::Texts(texts) => {
                format!("ARRAY[{}]::text[]", texts.iter().map(|t| quoted(t)).collect::<Vec<_>>().join(","))
            }
            Param::Ints(ints) => {
                format!("ARRAY[{}]::int8[]", ints.iter().map(i64::to_string).collect::<Vec<_>>().join(","))
            }
        }
    }
}

/// Fails when the generic plan of `statement` scans a big table sequentially: the writer
/// prepares each statement once and plans it without looking at the values
/// (`plan_cache_mode`, writer/src/store.rs), so that is the plan it runs with `params`.
async fn assert_indexed(db: &PgPool, name: &str, statement: &str, params: Vec<Param>) -> Value {
    let mut connection = db.acquire().await.unwrap_or_else(|e| panic!("{e}"));
    let prepare = format!("SET plan_cache_mode = force_generic_plan; PREPARE lookup AS {statement}");
    sqlx::raw_sql(&prepare).execute(&mut *connection).await.unwrap_or_else(|e| panic!("PREPARE {name}: {e}"));
    let args: Vec<String> = params.iter().map(Param::literal).collect();
    let explain = format!("EXPLAIN (FORMAT JSON) EXECUTE lookup({})", args.join(", "));
    let sqlx::types::Json(plan): sqlx::types::Json<Value> = sqlx::query_scalar(&explain)
        .fetch_one(&mut *connection)
        .await
        .unwrap_or_else(|e| panic!("EXPLAIN {name}: {e}"));
    sqlx::raw_sql("DEALLOCATE lookup").execute(&mut *connection).await.unwrap_or_else(|e| panic!("{e}"));
    let mut found = Vec::new();
    nodes(&plan[0]["Plan"], &mut found);
    let scanned: Vec<&(String, String)> = found
        .iter()
        .filter(|(node, relation)| {
            node == "Seq Scan" && ["conversions", "visits", "conversion_matches"].contains(&relation.as_str())
        })
        .collect();
    assert!(scanned.is_empty(), "{name} scans {scanned:?} sequentially: {plan:#}");
    assert!(found.iter().any(|(node, _)| node.contains("Index")), "{name} uses no index: {plan:#}");
    plan
}

fn texts(values: &[&str]) -> Param {
    Param::Texts(values.iter().map(|v| (*v).to_owned()).collect())
}

#[tokio::test(flavor = "multi_thread")]
async fn erasure_and_matching_never_scan_the_big_tables_sequentially() {
    let own = OwnDatabase::create("lookups").await;
    let db = PgPoolOptions::new().max_connections(2).connect(&own.url).await.unwrap_or_else(|e| panic!("{e}"));
    fill(&db).await;
    // A person of ws_0: conversion cv_12 (visitor id of v12, click k12) and cv_15 (contact-15).
    let email: String = sqlx::query_scalar("SELECT md5('e11') || md5('E11')").fetch_one(&db).await.unwrap_or_default();
    let email: &'static str = Box::leak(email.into_boxed_str());
    let visitor: String =
        sqlx::query_scalar("SELECT substr(md5('v12'), 1, 16)").fetch_one(&db).await.unwrap_or_default();
    let visitor: &'static str = Box::leak(visitor.into_boxed_str());
    let ws = || Param::Text("ws_0");
    let checks: Vec<(&str, &str, Vec<Param>)> = vec![
        ("by email", lookups::PERSON_BY_EMAIL, vec![ws(), Param::Text(email)]),
        ("by phone", lookups::PERSON_BY_PHONE, vec![ws(), Param::Text(email)]),
        ("by contact id", lookups::PERSON_BY_CONTACT, vec![ws(), Param::Text("contact-15")]),
        // A workspace of 1 % of the rows: there its range of the unique key looks selective
        // enough to intersect with a hash the planner has no statistics of.
        (
            "by contact id in a small workspace",
            lookups::PERSON_BY_CONTACT,
            vec![Param::Text("ws_20"), Param::Text("contact-20")],
        ),
        ("by visitor id", lookups::PERSON_BY_VISITOR, vec![ws(), Param::Text(visitor)]),
        (
            "one step out",
            lookups::PERSON_ONE_STEP,
            vec![
                ws(),
                texts(&["cv_11", "cv_12"]),
                texts(&[visitor]),
                texts(&["contact-15"]),
                texts(&[email]),
                texts(&[]),
            ],
        ),
        (
            "the visits",
            lookups::DELETE_PERSON_VISITS,
            vec![ws(), texts(&[visitor]), texts(&["k12"]), texts(&["contact-15"]), texts(&["cv_11", "cv_12"])],
        ),
        ("the matches", lookups::DELETE_PERSON_MATCHES, vec![texts(&["cv_11", "cv_12"])]),
        ("the conversions", lookups::CLEAR_PERSON_CONVERSIONS, vec![texts(&["cv_11", "cv_12"])]),
    ];
    for (name, statement, params) in checks {
        let plan = assert_indexed(&db, name, statement, params).await;
        // A look-up by an identifier reads that identifier's index, not a range of the
        // workspace's rows in an index that leads with the workspace id.
        if let Some(index) = match name {
            "by email" => Some("conversions_by_month_email_digest"),
            "by phone" => Some("conversions_by_month_phone_digest"),
            "by contact id" | "by contact id in a small workspace" | "one step out" => {
                Some("conversions_by_month_contact_hash")
            }
            "by visitor id" => Some("conversions_by_month_visitor_hash"),
            _ => None,
        } {
            let plan = plan.to_string();
            assert!(plan.contains(&format!("\"{index}\"")), "{name} reads {index}: {plan}");
            assert!(
                !plan.contains("\"conversions_by_workspace_external_id_event\""),
                "{name} reads the whole workspace's range of the unique key: {plan}"
            );
        }
    }

    // Matching a chunk of 100 conversions, each with all three identifiers.
    let ids: Vec<String> = (0..100).map(|i| format!("cv_new_{i}")).collect();
    let visitors: Vec<String> = (0..100).map(|i| format!("{:016x}.1700000000", i * 7919)).collect();
    let clicks: Vec<String> = (0..100).map(|i| format!("click-{i}")).collect();
    let contacts: Vec<String> = (0..100).map(|i| format!("contact-{}", i * 5)).collect();
    let occurred: Vec<i64> = (0..100).map(|_| intake_tests::now_ms()).collect();
    let params = vec![
        ws(),
        Param::Texts(ids),
        Param::Texts(visitors),
        Param::Texts(clicks),
        Param::Texts(contacts),
        Param::Ints(occurred),
    ];
    assert_indexed(&db, "matching", lookups::MATCH_VISITS, params).await;
    // A chunk's rows by their external ids and their children by the parent's: through the
    // keys on the workspace id's 8-byte hash, not those on the id itself, which `migrate
    // --contract` dropped.
    let external_ids = texts(&["e12", "e13", "new-1"]);
    let plan = assert_indexed(
        &db,
        "a chunk's related rows",
        lookups::RELATED_CONVERSIONS,
        vec![ws(), external_ids, texts(&["e12"]), Param::Int(0)],
    )
    .await;
    let related = plan.to_string();
    for index in ["conversions_by_workspace_hash_external_id_event", "conversions_by_workspace_hash_parent"] {
        assert!(related.contains(&format!("\"{index}\"")), "a chunk's related rows read {index}: {related}");
    }
    // The planner keeps no statistics of a partial index's expression: a look-up by such an
    // expression alone is guessed at 5 % of the table, which here still ends in the index and at
    // 10 M rows in a sequential scan. The children's look-up must stay estimated at a few rows.
    let mut estimates = Vec::new();
    index_rows(&plan[0]["Plan"], "conversions_by_workspace_hash_parent", &mut estimates);
    assert!(
        !estimates.is_empty() && estimates.iter().all(|&rows| rows < 1000.0),
        "the parents' look-up estimated at {estimates:?} rows of {ROWS}: {related}"
    );
    let dropped: Vec<String> = sqlx::query_scalar(
        "SELECT indexname::text FROM pg_indexes WHERE tablename = 'conversions'
            AND indexname IN ('conversions_by_workspace_external_id_event', 'conversions_by_parent',
                              'conversions_by_email_hash', 'conversions_by_phone_hash',
                              'conversions_by_visitor_hash', 'conversions_by_contact_hash',
                              'conversions_by_month_email_hash', 'conversions_by_month_phone_hash')",
    )
    .fetch_all(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(dropped.is_empty(), "the indexes that others replace outlived --contract: {dropped:?}");
    // A merge finds each chain's rows by the chain id alone, not by a range of the workspace's
    // rows in another index that leads with the workspace id.
    let merge =
        assert_indexed(&db, "a chain merge", lookups::MERGE_CHAINS, vec![ws(), texts(&["ch_12"]), texts(&["ch_4"])])
            .await;
    assert!(merge.to_string().contains("\"conversions_by_chain_id\""), "a chain merge: {merge:#}");

    // The erasure itself, in the workspace of 190k conversions and visits: one person's five
    // conversions (one email address), stored in months apart, and their visits.
    let person = intake_model::normalize::email_hash("someone@example.com").unwrap_or_else(|| unreachable!());
    sqlx::query(
        "UPDATE conversions SET email_digest = decode($1, 'hex') WHERE id IN ('cv_2', 'cv_2002', 'cv_4002', 'cv_6002', 'cv_8002')",
    )
    .bind(person.as_str())
    .execute(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let topics = intake_tests::own_topics();
    let started = std::time::Instant::now();
    let mut erase = Command::new(std::path::Path::new(&env("INTAKE_BIN_DIR")).join("intake-writer"))
        .args(["erase", "--workspace", "ws_0", "--email"])
        .env("DATABASE_URL", &own.url)
        .envs(topics)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("intake-writer erase: {e}"));
    if let Some(mut stdin) = erase.stdin.take() {
        use std::io::Write;
        stdin.write_all(b"someone@example.com\n").unwrap_or_else(|e| panic!("{e}"));
    }
    let output = erase.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    let took = started.elapsed();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let erased: Value = serde_json::from_slice(&output.stdout).unwrap_or_default();
    assert_eq!(erased["conversions"], 5, "{erased}");
    assert_eq!(erased["visits"], 10, "two visits for each visitor id: {erased}");
    // Process start and connection included; the lock itself is held for milliseconds.
    assert!(took < std::time::Duration::from_secs(1), "the erasure took {took:?}");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM conversions WHERE email_digest = decode($1, 'hex')")
        .bind(person.as_str())
        .fetch_one(&db)
        .await
        .unwrap_or(-1);
    assert_eq!(left, 0);
    db.close().await;
    drop(own);
}
