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

/// The stored identifiers (visitor id, contact id, email digest) of a conversion, once stored.
async fn identifiers(db: &sqlx::PgPool, key: &TestKey, external_id: &str) -> Option<Vec<Option<String>>> {
    stored_fields(db, &key.workspace_id, "lead", external_id, &["visitor_id", "contact_id", "email_sha256"]).await
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
    // Stored before the backup: a person (their email and a contact id), a conversion one step
    // out (that contact id and a visitor id, with a visit of that visitor), and someone else's
    // conversion two steps out (that visitor id and their own email), which an erasure of the
    // person leaves as it is.
    let (email, contact_id, visitor_id) = (format!("{}@example.com", unique(10)), unique(10), unique(16));
    let occurred_at = now_ms() - 60_000;
    let person = json!({"event": "lead", "external_id": unique(12), "occurred_at": occurred_at,
                        "email": email, "contact_id": contact_id});
    let one_step = json!({"event": "lead", "external_id": unique(12), "occurred_at": occurred_at,
                          "contact_id": contact_id, "visitor_id": visitor_id});
    let someone_else = json!({"event": "lead", "external_id": unique(12), "occurred_at": occurred_at,
                              "visitor_id": visitor_id, "email": format!("{}@example.com", unique(10))});
    for conversion in [&person, &one_step, &someone_else] {
        assert_eq!(stack.post("/v1/conversions", &key, conversion).await.status, 201);
    }
    let id_of = |conversion: &Value| conversion["external_id"].as_str().unwrap_or_default().to_owned();
    let untouched = identifiers(&db, &key, &id_of(&someone_else)).await;
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
    assert_eq!(erased, json!({"conversions": 2, "visits": 1}));
    assert_eq!(identifiers(&db, &key, &id_of(&someone_else)).await, untouched, "two steps out: not the person");

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
    assert!(identifiers(&db, &key, external_id).await.is_some_and(|ids| ids[2].is_some()));

    let applied =
        stack.run_writer_command(&["restore", "apply", "--from", &export]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        applied,
        json!({"workspaces": {"created": 1, "updated": 0}, "sites_added": 1,
               "keys": {"created": 1, "revoked": 1}, "erasures": {"applied": 1, "present": 0, "to_run_again": []}})
    );
    wait_until("the revoked key refused again", Duration::from_secs(10), || async {
        status_with(&stack, &leaked).await == 401
    })
    .await;
    assert_eq!(identifiers(&db, &key, external_id).await, Some(vec![None; 3]), "the erasure holds again");
    assert_eq!(
        identifiers(&db, &key, &id_of(&one_step)).await,
        Some(vec![None; 3]),
        "one step out, as the erasure did"
    );
    assert_eq!(identifiers(&db, &key, &id_of(&someone_else)).await, untouched, "two steps out: not the person");
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
    assert_eq!(identifiers(&db, &key, external_id).await, Some(vec![None; 3]), "the replay keeps it erased");
    let erasures: i64 = sqlx::query_scalar("SELECT count(*) FROM erasures WHERE workspace_id = $1")
        .bind(&key.workspace_id)
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(erasures, 1, "the replayed record of the erasure is recognised, not applied a second time");
    assert_eq!(status_with(&stack, &leaked).await, 401);
    assert!(identifiers(&db, &key, later["external_id"].as_str().unwrap_or_default()).await.is_some());

    let twice = stack.run_writer_command(&["restore", "apply", "--from", &export]).unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        twice,
        json!({"workspaces": {"created": 0, "updated": 0}, "sites_added": 0,
               "keys": {"created": 0, "revoked": 0}, "erasures": {"applied": 0, "present": 1, "to_run_again": []}})
    );
    // Another database's export (or one older than a workspace) is refused.
    let stranger = stack.workspace();
    let refused = stack.run_writer_command(&["restore", "apply", "--from", &export]).err().map(|e| e.to_string());
    assert!(
        refused
            .as_deref()
            .is_some_and(|e| e.contains("workspaces the export does not") && e.contains(&stranger.workspace_id)),
        "{refused:?}"
    );
}

/// A directory of this test's own.
fn tempfile_dir() -> String {
    let dir = std::env::temp_dir().join("intake-tests").join(format!("restore-{}", unique(12)));
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    dir.display().to_string()
}
