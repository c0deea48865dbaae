//! The runbook's restore (deploy/RUNBOOK.md, "PostgreSQL restored from a backup: replay"), with what a
//! replay of the requests topic cannot give back: the changes made after the backup to keys,
//! workspaces and erasures, saved by `restore export` before the restore and put back by
//! `restore apply` after it.

use intake_tests::serde_json::{json, Value};
use intake_tests::{now_ms, stored_fields, wait_until, OwnDatabase, Stack, StackOptions, TestKey};
use std::process::Command;
use std::time::Duration;

fn unique(length: usize) -> String {
    ulid::Ulid::new().to_string().to_lowercase().chars().rev().take(length).collect()
}

fn rfc3339(at: time::OffsetDateTime) -> String {
    at.format(&time::format_description::well_known::Rfc3339).unwrap_or_default()
}

fn run(program: &str, args: &[&str]) {
    let output = Command::new(program).args(args).output().unwrap_or_else(|e| panic!("{program}: {e}"));
    assert!(output.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&output.stderr));
}

/// What the key's holder gets from the API now.
async fn status_with(stack: &Stack, key: &TestKey) -> u16 {
    stack.send(reqwest::Method::GET, "/v1/workspace", Some(&key.bearer()), None).await.status
}

/// The stored identifiers (visitor id, email digest) of a conversion, once stored.
async fn identifiers(db: &sqlx::PgPool, key: &TestKey, external_id: &str) -> Option<Vec<Option<String>>> {
    stored_fields(db, &key.workspace_id, "lead", external_id, &["visitor_id", "email_sha256"]).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_restore_keeps_the_revocations_workspaces_and_erasures_made_after_its_backup() {
    let own = OwnDatabase::create("restore").await;
    let mut stack = Stack::start_with(StackOptions {
        database_url: Some(own.url.clone()),
        auth_cache_ttl_ms: 100,
        ..StackOptions::default()
    })
    .await;
    let db = own.pool().await;
    let dir = tempfile_dir();
    let key = stack.workspace();
    let second_key = stack
        .run_writer_command(&["key", "create", "--workspace", &key.workspace_id])
        .unwrap_or_else(|e| panic!("{e:#}"));
    let leaked = TestKey {
        workspace_id: key.workspace_id.clone(),
        key_id: second_key["id"].as_str().unwrap_or_default().to_owned(),
        secret: second_key["secret"].as_str().unwrap_or_default().to_owned(),
    };
    // A person stored before the backup, with a visit of theirs.
    let (email, visitor_id) = (format!("{}@example.com", unique(10)), unique(16));
    let person = json!({"event": "lead", "external_id": unique(12), "occurred_at": now_ms() - 60_000,
                        "email": email, "visitor_id": visitor_id});
    assert_eq!(stack.post("/v1/conversions", &key, &person).await.status, 201);
    sqlx::query(
        "INSERT INTO visits (workspace_id, visitor_id, visited_at) VALUES ($1, $2, now() - interval '2 minutes')",
    )
    .bind(&key.workspace_id)
    .bind(&visitor_id)
    .execute(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    let backup_started = time::OffsetDateTime::now_utc();
    let backup = format!("{dir}/backup.dump");
    run("pg_dump", &["-Fc", "-d", &own.url, "-f", &backup]);

    // After the backup: a leaked key revoked, a workspace created and written to, another
    // write, and the person erased.
    stack.run_writer_command(&["key", "revoke", &leaked.key_id]).unwrap_or_else(|e| panic!("{e:#}"));
    let newcomer = stack.workspace();
    let newcomers_write = json!({"event": "lead", "external_id": unique(12), "occurred_at": now_ms()});
    let told = stack.post("/v1/conversions", &newcomer, &newcomers_write).await;
    assert_eq!(told.status, 201, "{told:?}");
    let later = json!({"event": "lead", "external_id": unique(12), "occurred_at": now_ms()});
    assert_eq!(stack.post("/v1/conversions", &key, &later).await.status, 201);
    let erased = stack
        .run_writer_command_with_input(&["erase", "--workspace", &key.workspace_id, "--email"], &format!("{email}\n"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 1, "visits": 1}));

    // The runbook: writers stopped, the export, the restore.
    stack.stop_writers(true);
    let export = format!("{dir}/export.json");
    let exported =
        stack.run_writer_command(&["restore", "export", "--to", &export]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!((&exported["workspaces"], &exported["keys"], &exported["erasures"]), (&json!(2), &json!(3), &json!(1)));
    let again = stack.run_writer_command(&["restore", "export", "--to", &export]);
    assert!(again.is_err(), "an export is never overwritten");
    let (server, name) = own.url.rsplit_once('/').unwrap_or_else(|| panic!("no database in {}", own.url));
    let admin = format!("{server}/postgres");
    run("psql", &[&admin, "-qc", &format!("DROP DATABASE {name} WITH (FORCE)")]);
    run("psql", &[&admin, "-qc", &format!("CREATE DATABASE {name}")]);
    run("pg_restore", &["-d", &own.url, &backup]);
    let db = own.pool().await;
    // What the restore undid: the leaked key works again, the person is back.
    wait_until("the revoked key working again on the restored database", Duration::from_secs(10), || async {
        status_with(&stack, &leaked).await == 200
    })
    .await;
    let external_id = person["external_id"].as_str().unwrap_or_default();
    assert!(identifiers(&db, &key, external_id).await.is_some_and(|ids| ids.iter().all(Option::is_some)));

    let applied =
        stack.run_writer_command(&["restore", "apply", "--from", &export]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        applied,
        json!({"workspaces": {"created": 1, "updated": 0}, "sites_added": 1,
               "keys": {"created": 1, "revoked": 1}, "erasures": {"applied": 1, "present": 0}})
    );
    wait_until("the revoked key refused again", Duration::from_secs(10), || async {
        status_with(&stack, &leaked).await == 401
    })
    .await;
    assert_eq!(identifiers(&db, &key, external_id).await, Some(vec![None, None]), "the erasure holds again");
    let visits: i64 = sqlx::query_scalar("SELECT count(*) FROM visits WHERE workspace_id = $1")
        .bind(&key.workspace_id)
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(visits, 0, "the person's visit is erased again");

    let from = rfc3339(backup_started - time::Duration::minutes(1));
    let replayed: Value =
        stack.run_writer_command(&["replay", "--from-time", &from]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!((&replayed["failed"], &replayed["applied"]), (&json!(0), &json!(2)), "{replayed}");
    stack.start_writer();
    stack.wait_writers_ready().await;

    let newcomers_id: Option<String> =
        sqlx::query_scalar("SELECT id FROM conversions WHERE workspace_id = $1 AND external_id = $2")
            .bind(&newcomer.workspace_id)
            .bind(newcomers_write["external_id"].as_str())
            .fetch_optional(&db)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(newcomers_id.map(Value::from), Some(told.body["conversion"]["id"].clone()), "under the id told");
    let more = json!({"event": "lead", "external_id": unique(12), "occurred_at": now_ms()});
    assert_eq!(stack.post("/v1/conversions", &newcomer, &more).await.status, 201, "the new workspace's key works");
    assert_eq!(identifiers(&db, &key, external_id).await, Some(vec![None, None]), "the replay keeps it erased");
    assert_eq!(status_with(&stack, &leaked).await, 401);
    assert!(identifiers(&db, &key, later["external_id"].as_str().unwrap_or_default()).await.is_some());

    let twice = stack.run_writer_command(&["restore", "apply", "--from", &export]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        twice,
        json!({"workspaces": {"created": 0, "updated": 0}, "sites_added": 0,
               "keys": {"created": 0, "revoked": 0}, "erasures": {"applied": 0, "present": 1}})
    );
}

/// A directory of this test's own.
fn tempfile_dir() -> String {
    let dir = std::env::temp_dir().join("intake-tests").join(format!("restore-{}", unique(12)));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir.display().to_string()
}
