//! What `intake-writer migrate` checks before it changes the schema (deploy/RUNBOOK.md, "Schema
//! migrations"): a concurrent index build that a killed run left invalid is dropped and built
//! again; `--contract` waits until no writer older than its migrations is in the writers'
//! group; and a writer older than an applied migration refuses to start (a rollback after the
//! contract).

use intake_tests::serde_json::{json, Value};
use intake_tests::{OwnDatabase, Stack, StackOptions};
use rdkafka::consumer::{BaseConsumer, Consumer};
use std::process::Output;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn printed(output: &Output) -> Value {
    assert!(output.status.success(), "{}", stderr(output));
    intake_tests::serde_json::from_slice(&output.stdout).unwrap_or_else(|e| panic!("no JSON: {e}"))
}

async fn index_valid(db: &sqlx::PgPool, index: &str) -> Option<(bool, String)> {
    sqlx::query_as(
        "SELECT i.indisvalid, i.indrelid::regclass::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
          WHERE c.relname = $1",
    )
    .bind(index)
    .fetch_optional(db)
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// A run of `migrate` killed while 0038 built its index (a deadline, a lost pod) leaves the index
/// invalid and the migration unrecorded; the file cannot change, so the next run must drop it.
#[tokio::test]
async fn migrate_drops_the_invalid_index_a_killed_concurrent_build_left_and_builds_it_again() {
    let own = OwnDatabase::empty("invalid_index").await;
    own.migrate(&["--contract", "--through", "37"]);
    let db = own.pool().await;
    // An index of 0038's name that PostgreSQL leaves invalid, as a build that did not finish
    // does: a unique build that fails on duplicates.
    for statement in ["CREATE TABLE killed_build (a int)", "INSERT INTO killed_build VALUES (1), (1)"] {
        sqlx::query(statement).execute(&db).await.unwrap_or_else(|e| panic!("{statement}: {e}"));
    }
    let failed = sqlx::query("CREATE UNIQUE INDEX CONCURRENTLY conversions_by_month_phone_digest ON killed_build (a)")
        .execute(&db)
        .await;
    assert!(failed.is_err(), "the build fails on the duplicates");
    assert_eq!(index_valid(&db, "conversions_by_month_phone_digest").await, Some((false, "killed_build".into())));

    let migrated = own.writer_migrate(&["--through", "38"]);
    assert_eq!(printed(&migrated)["migrated"], json!(true));
    assert!(
        stderr(&migrated).contains("dropping the invalid index") && stderr(&migrated).contains("38"),
        "logged: {}",
        stderr(&migrated)
    );
    assert_eq!(index_valid(&db, "conversions_by_month_phone_digest").await, Some((true, "conversions".into())));
    let recorded: bool = sqlx::query_scalar("SELECT success FROM _sqlx_migrations WHERE version = 38")
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(recorded);
    // A valid index is never dropped: migrating again changes nothing.
    let again = own.writer_migrate(&[]);
    assert!(!stderr(&again).contains("dropping the invalid index"), "{}", stderr(&again));
    printed(&again);
    db.close().await;
}

/// A member of the writers' group, as a writer of another build joins it.
fn member(group: &str, topic: &str, client_id: &str) -> BaseConsumer {
    let mut config = rdkafka::ClientConfig::new();
    config
        .set("bootstrap.servers", intake_tests::env("INTAKE_KAFKA_BROKERS"))
        .set("group.id", group)
        .set("client.id", client_id)
        .set("session.timeout.ms", "6000")
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = config.create().unwrap_or_else(|e| panic!("consumer: {e}"));
    consumer.subscribe(&[topic]).unwrap_or_else(|e| panic!("subscribe: {e}"));
    consumer
}

/// The client ids of `group`'s members.
fn members(group: &str) -> Vec<String> {
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", intake_tests::env("INTAKE_KAFKA_BROKERS"))
        .create()
        .unwrap_or_else(|e| panic!("consumer: {e}"));
    let groups = consumer.fetch_group_list(Some(group), Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}"));
    let mut ids: Vec<String> =
        groups.groups().iter().flat_map(|g| g.members()).map(|m| m.client_id().to_owned()).collect();
    ids.sort();
    ids
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_contract_is_refused_while_an_older_writer_is_in_the_group_and_a_rollback_after_it_at_start() {
    let own = OwnDatabase::empty("older_writer").await;
    // The schema of a build that knows migrations up to 39, expanded by this one: 40 to 42 wait.
    own.migrate(&["--contract", "--through", "39"]);
    let expanded = own.migrate(&[]);
    assert_eq!(expanded["waiting_for_contract"], json!([40, 41, 42]), "{expanded}");
    let stack = Stack::start_with(StackOptions { database_url: Some(own.url.clone()), ..Default::default() }).await;
    let group = format!("{}-writers", stack.topic_prefix);
    let topic = format!("{}.requests", stack.topic_prefix);
    let contract = |more: &[&str]| {
        stack.writer_command().args(["migrate", "--contract"]).args(more).output().unwrap_or_else(|e| panic!("{e}"))
    };

    // Two writers of older builds join the group beside this build's: one that knows up to 39,
    // one from before the client.id named its schema.
    let stop = Arc::new(AtomicBool::new(false));
    let polling = {
        let (stop, group, topic) = (stop.clone(), group.clone(), topic.clone());
        std::thread::spawn(move || {
            let older = [member(&group, &topic, "intake-writer/0.1.0/schema-39"), member(&group, &topic, "rdkafka")];
            while !stop.load(Ordering::SeqCst) {
                for consumer in &older {
                    let _ = consumer.poll(Duration::from_millis(50));
                }
            }
        })
    };
    intake_tests::wait_until("the older writers in the group", Duration::from_secs(30), || {
        let group = group.clone();
        async move { tokio::task::block_in_place(|| members(&group)).len() == 3 }
    })
    .await;
    let refused = contract(&[]);
    assert!(!refused.status.success(), "applied with older writers in the group");
    let message = stderr(&refused);
    assert!(
        message.contains("writers older than the contract migrations [40, 41, 42]")
            && message.contains("intake-writer/0.1.0/schema-39 on ")
            && message.contains("rdkafka on "),
        "{message}"
    );
    let db = own.pool().await;
    let newest: i64 = sqlx::query_scalar("SELECT max(version) FROM _sqlx_migrations")
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert!(!message.contains(&format!("/schema-{newest}")), "this build's writer is not older: {message}");
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE version BETWEEN 40 AND 42")
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(applied, 0, "nothing applied");

    // They leave; a Kafka that does not answer is a refusal too, never a skipped check.
    stop.store(true, Ordering::SeqCst);
    polling.join().unwrap_or_else(|_| panic!("the older writers' thread"));
    intake_tests::wait_until("the older writers gone", Duration::from_secs(30), || {
        let group = group.clone();
        async move { tokio::task::block_in_place(|| members(&group)).len() == 1 }
    })
    .await;
    let unreachable = contract(&["--kafka-brokers", "127.0.0.1:1"]);
    assert!(!unreachable.status.success());
    assert!(
        stderr(&unreachable).contains("could not list the members of the writers' group"),
        "{}",
        stderr(&unreachable)
    );

    // Only this build's writer is left: applied.
    let contracted = printed(&contract(&[]));
    assert_eq!(contracted["waiting_for_contract"], json!([]), "{contracted}");
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM _sqlx_migrations WHERE version BETWEEN 40 AND 42")
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(applied, 3);

    // A rollback: this build is the older one beside a newer build's migrations. Their
    // expansion is no obstacle (before the contract a writer may be rolled back)...
    let record = |version: i64, description: &'static str| {
        let db = db.clone();
        async move {
            sqlx::query(
                "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
                 VALUES ($1, $2, true, '\\x00', 0)",
            )
            .bind(version)
            .bind(description)
            .execute(&db)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        }
    };
    record(newest + 1, "a newer build s index").await;
    let mut rolled_back = stack
        .writer_command()
        .args(["run", "--ops-listen", &format!("127.0.0.1:{}", intake_tests::free_port())])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    intake_tests::wait_until("the rolled-back writer in the group", Duration::from_secs(30), || {
        let group = group.clone();
        async move { tokio::task::block_in_place(|| members(&group)).len() == 2 }
    })
    .await;
    assert!(rolled_back.try_wait().ok().flatten().is_none(), "it runs");
    let _ = std::process::Command::new("kill").args(["-TERM", &rolled_back.id().to_string()]).status();
    let _ = rolled_back.wait();
    // ...but after its contract, the writer refuses to start, naming it.
    record(newest + 2, "a newer build s drop (contract)").await;
    // Spawned, not waited on without a bound: a writer that started after all would run on.
    let mut refused = stack
        .writer_command()
        .args(["run", "--ops-listen", &format!("127.0.0.1:{}", intake_tests::free_port())])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    let exited = std::time::Instant::now() + Duration::from_secs(30);
    while refused.try_wait().ok().flatten().is_none() {
        if std::time::Instant::now() > exited {
            let _ = refused.kill();
            panic!("an older build started on a contracted database and runs");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let started = refused.wait_with_output().unwrap_or_else(|e| panic!("{e}"));
    assert!(!started.status.success(), "an older build started on a contracted database");
    assert!(
        stderr(&started).contains(&format!(
            "{} (a newer build s drop (contract)): applied, but this build has no such migration",
            newest + 2
        )),
        "{}",
        stderr(&started)
    );
    db.close().await;
}
