//! The writer's failure handling (docs/architecture.md, "Failure classes"): no single message can stop a writer; what
//! retrying cannot cure is answered, dead-lettered with its reasons, and skipped.

use intake_tests::serde_json::json;
use intake_tests::{conversion, database, produce_request, topic_headers, wait_until, Stack, StackOptions};

use std::time::{Duration, Instant};

#[tokio::test]
async fn a_message_whose_reply_partition_does_not_exist_is_dead_lettered_unapplied_and_the_writer_goes_on() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let topic = format!("{}.requests", stack.topic_prefix);
    let input = conversion("lead");
    produce_request(&topic, &key.workspace_id, 99, &input).await;

    // The same workspace, so the same partition, right behind it.
    let started = Instant::now();
    let next = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!(next.status, 201, "{next:?}");
    assert!(started.elapsed() < Duration::from_secs(5), "served at once: {:?}", started.elapsed());

    // Nobody could be answered for it, so it was not applied: the client's send creates it.
    let letters = topic_headers(&format!("{topic}.dlq"), 1, Duration::from_secs(20));
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].get("reason").map(String::as_str), Some("no_reply_partition"), "{letters:?}");
    assert!(letters[0].get("error").is_some_and(|e| e.contains("partitions")), "{letters:?}");
    let resent = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(resent.body["conversion"]["result"], json!("created"), "{resent:?}");

    // Another one at once: answered from what the brokers said, without holding the reader.
    produce_request(&topic, &key.workspace_id, 99, &conversion("lead")).await;
    let started = Instant::now();
    let next = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!(next.status, 201, "{next:?}");
    assert!(started.elapsed() < Duration::from_secs(2), "served at once: {:?}", started.elapsed());
    let letters = topic_headers(&format!("{topic}.dlq"), 2, Duration::from_secs(20));
    assert_eq!(letters.len(), 2, "{letters:?}");
    // The brokers were asked through the retry policy for the first; the second was answered
    // from what they said.
    let attempts: Vec<Option<&str>> = letters.iter().map(|l| l.get("attempts").map(String::as_str)).collect();
    assert_eq!(attempts, [Some("3"), Some("0")], "{letters:?}");
}

#[tokio::test]
async fn a_message_that_always_fails_is_dead_lettered_with_its_reasons_and_skipped() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let topic = format!("{}.requests", stack.topic_prefix);
    // A workspace that does not exist: the foreign key refuses it however often it is tried.
    produce_request(&topic, &key.workspace_id.replace("ws_", "ws_missing"), 1, &conversion("lead")).await;
    produce_request(&topic, "ws_does_not_exist", 1, &conversion("lead")).await;

    let started = Instant::now();
    let next = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!(next.status, 201, "{next:?}");
    assert!(started.elapsed() < Duration::from_secs(8), "the writer went on: {:?}", started.elapsed());

    let letters = topic_headers(&format!("{topic}.dlq"), 2, Duration::from_secs(20));
    assert_eq!(letters.len(), 2, "{letters:?}");
    for letter in &letters {
        assert_eq!(letter.get("reason").map(String::as_str), Some("apply_failed"), "{letter:?}");
        assert!(letter.get("error").is_some_and(|e| e.contains("foreign key")), "{letter:?}");
        assert_eq!(letter.get("source_topic"), Some(&topic));
        assert!(letter.get("source_partition").is_some_and(|p| p.parse::<i32>().is_ok()), "{letter:?}");
        assert!(letter.get("source_offset").is_some_and(|o| o.parse::<i64>().is_ok()), "{letter:?}");
        assert_eq!(letter.get("attempts").map(String::as_str), Some("3"), "{letter:?}");
    }
    assert_eq!(stack.writer_metrics(0).await.value(r#"intake_writer_dead_lettered_total{reason="apply_failed"}"#), 2.0);
}

#[tokio::test]
async fn the_writer_reports_ready_lag_and_results_on_its_ops_port() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ops = &stack.writer_ops_urls[0];
    // Ready once in the group with its partitions rewound to the database's positions.
    stack.wait_writers_ready().await;
    let ready = stack.http.get(format!("{ops}/readyz")).send().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(ready.status(), 200, "a writer in the group is ready");
    // Its first connections rehearse a write, rolled back, before the first send needs them.
    let rehearsals = || async {
        let metrics = stack.writer_metrics(0).await;
        metrics.value("intake_writer_connections_rehearsed_total")
            + metrics.value("intake_writer_connection_rehearsals_failed_total")
    };
    wait_until("two connections rehearsed", Duration::from_secs(10), || async { rehearsals().await >= 2.0 }).await;
    assert_eq!(stack.writer_metrics(0).await.value("intake_writer_connection_rehearsals_failed_total"), 0.0);
    let db = database().await;
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM workspaces WHERE id LIKE 'ws\\_rehearsal\\_%')
              + (SELECT count(*) FROM applied_messages WHERE correlation_id LIKE 'ws\\_rehearsal\\_%')",
    )
    .fetch_one(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(left, 0, "a rehearsal leaves nothing stored");
    let batch: Vec<_> = (0..30).map(|_| conversion("lead")).collect();
    assert_eq!(stack.post("/v1/conversions/batch", &key, &json!({ "conversions": batch })).await.status, 200);
    let metrics = stack.writer_metrics(0).await;
    for (series, expected) in [
        (r#"intake_writer_items_total{result="created"}"#, 30.0),
        (r#"intake_writer_messages_total{outcome="applied"}"#, 1.0),
        ("intake_writer_assigned_partitions", 4.0),
        ("intake_writer_stalled", 0.0),
        ("intake_writer_apply_seconds_count", 1.0),
    ] {
        assert_eq!(metrics.value(series), expected, "{series}");
    }
    // The process's own, under Prometheus' standard names (intake_common::process).
    for series in
        ["process_resident_memory_bytes", "process_cpu_seconds_total", "process_open_fds", "process_start_time_seconds"]
    {
        assert!(metrics.value(series) > 0.0, "{series}");
    }
    assert_eq!(stack.http.get(format!("{ops}/healthz")).send().await.map(|r| r.status().as_u16()).unwrap_or(0), 200);
}

#[tokio::test]
async fn draining_the_dead_letter_topic_never_lets_an_old_value_overwrite_a_newer_one() {
    // A trigger: on a database of the test's own (DDL on the shared one blocks every test).
    let own = intake_tests::OwnDatabase::create("writer").await;
    let stack = Stack::start_with(StackOptions { database_url: Some(own.url.clone()), ..Default::default() }).await;
    let key = stack.workspace();
    let db = own.pool().await;
    let (x, y) = (format!("x-{}", ulid::Ulid::new()), format!("y-{}", ulid::Ulid::new()));
    let function = format!("refuse_{}", ulid::Ulid::new().to_string().to_lowercase());
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.external_id IN ('{x}', '{y}') THEN RAISE EXCEPTION 'refused by test'; END IF; RETURN NEW; END $$;
         CREATE TRIGGER {function} BEFORE INSERT ON conversions FOR EACH ROW EXECUTE FUNCTION {function}();"
    ))
    .execute(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let send = |id: &str, value: &str| {
        let mut input = conversion("lead");
        input["external_id"] = json!(id);
        input["value"] = json!(value);
        input
    };
    let from = (time::OffsetDateTime::now_utc() - time::Duration::minutes(1))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default();
    assert_eq!(stack.post("/v1/conversions", &key, &send(&x, "1")).await.status, 500, "dead-lettered");
    assert_eq!(stack.post("/v1/conversions", &key, &send(&y, "1")).await.status, 500, "dead-lettered");
    sqlx::raw_sql(&format!("DROP TRIGGER {function} ON conversions; DROP FUNCTION {function}();"))
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stack.post("/v1/conversions", &key, &send(&x, "2")).await.status, 201, "the client's later send");

    let dlq = format!("{}.requests.dlq", stack.topic_prefix);
    let drained = stack
        .run_writer_command(&["replay", "--topic", &dlq, "--from-time", &from])
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(
        drained,
        json!({"messages": 2, "applied": 1, "already_applied": 0, "failed": 0, "kept_newer": 1, "expired": 0, "request_failed": 0})
    );
    let value = |id: String| {
        let db = db.clone();
        async move {
            sqlx::query_scalar::<_, String>("SELECT value::text FROM conversions WHERE external_id = $1")
                .bind(id)
                .fetch_one(&db)
                .await
                .unwrap_or_default()
        }
    };
    assert_eq!(value(x.clone()).await, "2", "the newer value stays");
    assert_eq!(value(y.clone()).await, "1", "what had no newer write is applied");
}

#[tokio::test]
async fn a_request_can_be_followed_from_the_gateway_into_the_writer_by_its_request_id() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let reply = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!(reply.status, 201);
    let request_id = reply.header("x-request-id").unwrap_or_else(|| panic!("no request id: {reply:?}")).to_owned();

    // Where its time went, stage by stage, in the order it went through them; together they
    // are the request's time.
    let timing = reply.header("server-timing").unwrap_or_else(|| panic!("no Server-Timing: {reply:?}")).to_owned();
    let stages: Vec<(&str, f64)> = timing
        .split(", ")
        .map(|stage| {
            let (name, duration) = stage.split_once(";dur=").unwrap_or_else(|| panic!("{timing}"));
            (name, duration.parse().unwrap_or_else(|e| panic!("{timing}: {e}")))
        })
        .collect();
    let names: Vec<&str> = stages.iter().map(|(name, _)| *name).collect();
    assert_eq!(
        names,
        ["gateway", "produce", "fetch", "queue", "apply", "commit", "reply-produce", "reply-read", "total"],
        "{timing}"
    );
    let (parts, total) = stages.split_at(stages.len() - 1);
    let sum: f64 = parts.iter().map(|(_, ms)| ms).sum();
    // The broker stamps whole milliseconds: a span to its stamp shown as 0 gives up to a
    // millisecond to the next one, once on the way in and once on the way back.
    assert!(parts.iter().all(|(_, ms)| *ms >= 0.0) && sum <= total[0].1 + 2.0, "{timing}");
    let timed = |stage: &str| parts.iter().find(|(name, _)| *name == stage).map_or(0.0, |(_, ms)| *ms);
    assert!(timed("apply") > 0.0 && timed("commit") > 0.0, "{timing}");
    let mut logs = String::new();
    for _ in 0..50 {
        logs = stack.logs();
        if logs.lines().filter(|l| l.contains(&request_id)).count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let gateway_line = logs.lines().find(|l| l.contains(&request_id) && l.contains("intake_gateway"));
    let writer_line = logs.lines().find(|l| l.contains(&request_id) && l.contains("intake_writer"));
    assert!(gateway_line.is_some_and(|l| l.contains(&key.workspace_id) && l.contains(&key.key_id)), "{logs}");
    let stages = &timing[..timing.find(", total;").unwrap_or(timing.len())];
    assert!(gateway_line.is_some_and(|l| l.contains(stages)), "the log line names the stages too: {logs}");
    assert!(writer_line.is_some_and(|l| l.contains(&key.workspace_id) && l.contains("applied")), "{logs}");
}

#[tokio::test]
async fn a_writer_started_before_migrate_waits_not_ready_and_applies_once_the_schema_is_there() {
    // The database of the version before the digests as bytes, and this version's writer on it.
    let own = intake_tests::OwnDatabase::empty("behind").await;
    own.migrate(&["--contract", "--through", "35"]);
    let stack = Stack::start_with(StackOptions {
        database_url: Some(own.url.clone()),
        write_timeout_ms: 60_000,
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let ops = stack.writer_ops_urls[0].clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    let reason = loop {
        let reply = stack.http.get(format!("{ops}/readyz")).send().await;
        let body = match reply {
            Ok(reply) => reply.text().await.unwrap_or_default(),
            Err(_) => String::new(), // its ops port not yet listening
        };
        if body.contains("schema_behind") || Instant::now() > deadline {
            break body;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(reason.contains(r#""reason":"schema_behind""#), "{reason}");

    // A send now waits in Kafka, not in the dead-letter topic, and is applied after `migrate`.
    let mut input = conversion("lead");
    input["email"] = json!("behind@example.com");
    let client = stack.client();
    let (sending, body) = (key.clone(), input.clone());
    let sent = tokio::spawn(async move { client.post("/v1/conversions", &sending, &body).await });
    own.migrate(&[]);
    let reply = sent.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status, 201, "{reply:?}");
    let db = own.pool().await;
    let stored: Option<Vec<u8>> = sqlx::query_scalar("SELECT email_digest FROM conversions WHERE external_id = $1")
        .bind(input["external_id"].as_str().unwrap_or_default())
        .fetch_one(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stored.map(|digest| digest.len()), Some(32), "stored in this version's shape");
    let ready = stack.http.get(format!("{ops}/readyz")).send().await.map(|r| r.status().as_u16()).unwrap_or(0);
    assert_eq!(ready, 200);
    let metrics = stack.writer_metrics(0).await;
    assert_eq!(metrics.value(r#"intake_writer_messages_total{outcome="applied"}"#), 1.0);
    assert_eq!(
        metrics.get(r#"intake_writer_dead_lettered_total{reason="apply_failed"}"#),
        None,
        "nothing dead-lettered"
    );
}

#[tokio::test]
async fn a_statement_that_meets_a_schema_behind_is_waited_out_never_dead_lettered() {
    let own = intake_tests::OwnDatabase::create("schema_mid").await;
    let stack = Stack::start_with(StackOptions {
        database_url: Some(own.url.clone()),
        write_timeout_ms: 60_000,
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201);
    // As a database restored from before an expand migration: a column this version writes is
    // not there, and the migration that adds it is pending.
    let db = own.pool().await;
    type Row = (i64, String, bool, Vec<u8>, i64);
    let pending: Row = sqlx::query_as(
        "DELETE FROM _sqlx_migrations WHERE version = 39
         RETURNING version, description, success, checksum, execution_time",
    )
    .fetch_one(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("ALTER TABLE conversions RENAME COLUMN hdyhau TO hdyhau_pending")
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));

    let input = conversion("lead");
    let client = stack.client();
    let (sending, body) = (key.clone(), input.clone());
    let sent = tokio::spawn(async move { client.post("/v1/conversions", &sending, &body).await });
    let ops = stack.writer_ops_urls[0].clone();
    intake_tests::wait_until("the writer not ready, its schema behind", Duration::from_secs(20), || async {
        stack.ops_get(&format!("{ops}/readyz")).await.1.contains(r#""reason":"schema_behind""#)
    })
    .await;
    assert_eq!(stack.writer_metrics(0).await.value("intake_writer_schema_behind"), 1.0);
    assert_eq!(stack.ops_get(&format!("{ops}/healthz")).await.0, 200, "an outage, waited out");
    assert!(!sent.is_finished(), "no answer while the schema is behind");

    // `migrate` brings the column: the send is applied and answered.
    sqlx::query("ALTER TABLE conversions RENAME COLUMN hdyhau_pending TO hdyhau")
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time)
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(pending.0)
    .bind(&pending.1)
    .bind(pending.2)
    .bind(&pending.3)
    .bind(pending.4)
    .execute(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let reply = sent.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status, 201, "{reply:?}");
    let metrics = stack.writer_metrics(0).await;
    let dead_lettered: Vec<&str> = metrics
        .0
        .lines()
        .filter(|l| l.starts_with("intake_writer_dead_lettered_total{") && !l.ends_with(" 0"))
        .collect();
    assert!(dead_lettered.is_empty(), "{dead_lettered:?}");
    assert_eq!(metrics.value("intake_writer_schema_behind"), 0.0);
}

#[tokio::test]
async fn a_writer_started_while_its_database_is_away_checks_the_schema_once_it_answers() {
    let postgres = intake_tests::PrivatePostgres::start_new();
    let migrate = |args: &[&str]| {
        let migrated = std::process::Command::new(
            std::path::PathBuf::from(intake_tests::env("INTAKE_BIN_DIR")).join("intake-writer"),
        )
        .arg("migrate")
        .args(args)
        .env("DATABASE_URL", postgres.url())
        // Its --contract checks a group no writer joins: the stack's writer is of this build.
        .env("INTAKE_WRITER_GROUP", "intake-tests-no-writers")
        .output()
        .unwrap_or_else(|e| panic!("migrate: {e}"));
        assert!(migrated.status.success(), "migrate {args:?}: {}", String::from_utf8_lossy(&migrated.stderr));
    };
    // The schema of a version before this one's, and the database away (a failover) when the
    // writer starts.
    migrate(&["--contract", "--through", "35"]);
    let mut stack = Stack::start_with(StackOptions {
        database_url: Some(postgres.url()),
        start_writer: false,
        write_timeout_ms: 60_000,
        ..Default::default()
    })
    .await;
    postgres.stop();
    stack.start_writer();
    let ops = stack.writer_ops_urls[0].clone();
    let not_ready_for = |what: &'static str, period: Duration| {
        let (stack, ops) = (&stack, ops.clone());
        async move {
            let until = Instant::now() + period;
            while Instant::now() < until {
                let (status, body) = stack.ops_get(&format!("{ops}/readyz")).await;
                assert_ne!(status, 200, "{what}: ready without its schema checked: {body}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    // Longer than a connection attempt's timeout (5 s) and a join of the group: a writer that
    // gave up on the check would be ready by then.
    not_ready_for("the database away", Duration::from_secs(12)).await;
    postgres.start();
    intake_tests::wait_until("the schema found behind", Duration::from_secs(20), || async {
        stack.ops_get(&format!("{ops}/readyz")).await.1.contains(r#""reason":"schema_behind""#)
    })
    .await;
    not_ready_for("the schema behind", Duration::from_secs(2)).await;
    migrate(&["--contract"]);
    intake_tests::wait_until("the writer ready once migrated", Duration::from_secs(30), || async {
        stack.ops_get(&format!("{ops}/readyz")).await.0 == 200
    })
    .await;
}
