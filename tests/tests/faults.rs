//! Faults lose nothing that was acknowledged.

use intake_tests::serde_json::json;
use intake_tests::{
    check_ledger, conversion, database, purchase, stored_count, stored_values, wait_until, FaultReport,
    PrivatePostgres, Stack, StackOptions, Traffic,
};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

fn no_reply_stall() -> Vec<String> {
    vec!["--reply-stall-ms".into(), "600000".into()]
}

#[tokio::test]
async fn a_writer_killed_under_traffic_loses_no_acknowledged_conversion() {
    // Writes that time out are what this test follows, not the gateway refusing new ones while
    // none is answered (tested in hardening.rs): the reply-stall time is far off.
    let mut stack = Stack::start_with(StackOptions {
        write_timeout_ms: 2_000,
        gateway_args: no_reply_stall(),
        ..StackOptions::unlimited()
    })
    .await;
    let keys = vec![stack.workspace()];
    // New conversions and updates of earlier ones, as the fault harness's clients send them.
    let traffic = Traffic::start(stack.client(), &keys);
    let db = database().await;
    let stored_some = || async { stored_count(&db, &keys[0].workspace_id).await >= 5 };
    wait_until("traffic being stored", Duration::from_secs(10), stored_some).await;
    let killed_at = Instant::now();
    // SIGKILL, mid-traffic, and an outage of half a second with requests arriving during it.
    stack.stop_writers(false);
    tokio::time::sleep(Duration::from_millis(500)).await;
    stack.start_writer();
    traffic.wait_recovered(killed_at, Duration::from_secs(30)).await;
    // Some more writes and updates on the new writer.
    let back = traffic.acknowledged();
    wait_until("writes after the restart", Duration::from_secs(20), || async { traffic.acknowledged() >= back + 6 })
        .await;
    let sent = traffic.stop().await;

    let report = FaultReport::of(&sent, keys.len(), killed_at);
    // 503: refused before the body was read (the workspace got no answer for the stall time),
    // so never written; 500: accepted, in Kafka, applied by the next writer.
    assert!(report.unexpected.is_empty(), "{report:?}");
    assert!(report.recovered_after.is_some(), "writes came back: {report:?}");
    let check = check_ledger(&keys, &sent, Duration::from_secs(10)).await;
    assert!(check.is_clean(), "acknowledged but not stored, or stored with an older value: {check:?}");
    assert!(check.updated > 0, "the traffic updated rows: {check:?}");
    // Requests answered 500 during the outage were still in Kafka: the new writer applied them.
    let accepted: BTreeSet<&str> =
        sent.iter().filter(|s| s.status != 503).flat_map(|s| s.external_ids.iter().map(String::as_str)).collect();
    let mut stored = BTreeSet::new();
    for _ in 0..100 {
        stored = stored_values(&db, &keys[0].workspace_id).await.into_keys().collect();
        if stored.len() == accepted.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(stored.iter().map(String::as_str).collect::<BTreeSet<_>>(), accepted, "even the ones answered 500");
}

#[tokio::test]
async fn a_gateway_stopped_with_sigterm_answers_what_is_in_flight() {
    let mut stack = Stack::start_with(StackOptions { start_writer: false, ..Default::default() }).await;
    let key = stack.workspace();
    let client = stack.client();
    let in_flight = {
        let key = key.clone();
        tokio::spawn(async move { client.post("/v1/conversions", &key, &conversion("lead")).await })
    };
    stack.wait_writes_in_flight(1.0).await;
    let exited = stack.terminate_gateway();
    stack.wait_not_ready().await;
    stack.start_writer();
    let reply = in_flight.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status, 201, "the request in flight at SIGTERM was answered: {reply:?}");
    let status = tokio::task::spawn_blocking(move || exited.join().ok().flatten()).await.ok().flatten();
    assert!(status.is_some_and(|s| s.success()), "the gateway exited cleanly: {status:?}");
}

/// The gateway's metrics count answers given from a key's last known answer.
async fn assert_answered_from_last_known_keys(stack: &Stack) {
    let stale = stack.metrics().await.value(r#"intake_gateway_key_cache_total{result="stale"}"#);
    assert!(stale >= 1.0, "the gateway answered from the last known key while the database did not");
}

#[tokio::test]
async fn a_database_outage_delays_writes_and_loses_none() {
    let postgres = PrivatePostgres::start_new();
    // A stall timeout longer than the retries' longest pause (5 s), short enough to pass here.
    let stall = Duration::from_secs(6);
    let options = StackOptions {
        database_url: Some(postgres.url()),
        write_timeout_ms: 2_000,
        gateway_args: no_reply_stall(),
        writer_args: vec!["--stall-timeout-ms".into(), stall.as_millis().to_string()],
        ..Default::default()
    };
    postgres.migrate();
    let stack = Stack::start_with(options).await;
    let key = stack.workspace();
    // A row the outage's first write updates.
    let updated = ulid::Ulid::new().to_string();
    assert_eq!(stack.post("/v1/conversions", &key, &purchase(&updated, "1.25")).await.status, 201);

    postgres.stop();
    let outage = std::time::Instant::now();
    let mut during = Vec::new();
    for attempt in 0..3 {
        let input = if attempt == 0 { purchase(&updated, "2.25") } else { conversion("lead") };
        let reply = stack.post("/v1/conversions", &key, &input).await;
        // The first waits out the deadline; once the workspace has had no answer for the stall
        // time (the write timeout), its writes are refused before the body is read instead.
        match (attempt, reply.status) {
            (0, _) | (_, 500) => {
                assert_eq!((reply.status, reply.error_code()), (500, "internal_error"), "no writer can commit now");
                during.push(input);
            }
            _ => assert_eq!((reply.status, reply.error_code()), (503, "service_unavailable")),
        }
    }
    // The writer has work it cannot do: not ready once the stall timeout is over, but alive, so
    // that no orchestrator restarts it for an outage a restart cannot end.
    let ops = |path: &'static str| {
        let url = format!("{}{path}", stack.writer_ops_urls[0]);
        let stack = &stack;
        async move { stack.ops_get(&url).await }
    };
    let stalled = || async { ops("/readyz").await == (503, r#"{"status":"not_ready","reason":"stalled"}"#.into()) };
    wait_until("the writer stalled", stall + Duration::from_secs(10), stalled).await;
    assert!(outage.elapsed() > stall, "stalled only past the stall timeout");
    assert_eq!(ops("/healthz").await.0, 200, "a writer waiting out a database outage is alive");
    postgres.start();

    let db = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&postgres.url())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let value_of = |external_id: String| {
        let db = &db;
        let workspace_id = &key.workspace_id;
        async move { stored_values(db, workspace_id).await.remove(&external_id).flatten() }
    };
    // The first chunk, the update, reached Kafka in time (its key was in the gateway's cache):
    // the writer applies it once the database is back. A chunk that reached Kafka after its
    // deadline (the request waited on the key's look-up meanwhile) is never applied: its 500
    // stands, and the client re-sends.
    let applied = || async { value_of(updated.clone()).await.as_deref() == Some("2.25") };
    wait_until("the update sent during the outage applied", Duration::from_secs(15), applied).await;
    for input in &during {
        let mut reply = stack.post("/v1/conversions", &key, input).await;
        for _ in 0..20 {
            if reply.status != 503 {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            reply = stack.post("/v1/conversions", &key, input).await;
        }
        assert!([200, 201].contains(&reply.status), "the client's re-send: {} {}", reply.status, reply.body);
    }
    let stored = stored_values(&db, &key.workspace_id).await;
    for input in &during {
        let external_id = input["external_id"].as_str().unwrap_or_default();
        assert!(stored.contains_key(external_id), "{external_id}, sent during the outage, is stored after the re-send");
    }
    assert_eq!(stored.len(), during.len(), "one row each (the first of them updated the row written before)");
    let after = stack.post("/v1/conversions", &key, &purchase(&updated, "3.25")).await;
    assert_eq!((after.status, &after.body["conversion"]["result"]), (200, &json!("updated")), "{after:?}");
    assert_eq!(value_of(updated.clone()).await.as_deref(), Some("3.25"));
    assert!(stack.logs().contains("unavailable; retrying"), "the writer said it waits for the database");
    assert_answered_from_last_known_keys(&stack).await;
}

#[tokio::test]
async fn a_key_keeps_its_last_answer_through_a_database_outage_for_the_stale_time_and_no_longer() {
    let postgres = PrivatePostgres::start_new();
    postgres.migrate();
    // A look-up fails after the acquire time (0.2 s), so stale answers are given, and cached
    // for the cache time (1 s), about every 1.2 s: the last one just before the stale time ends
    // must not outlive it.
    let (cache, stale) = (Duration::from_secs(1), Duration::from_secs(5));
    let options = StackOptions {
        database_url: Some(postgres.url()),
        auth_cache_ttl_ms: 1_000,
        gateway_args: vec![
            "--auth-stale-ttl-ms".into(),
            stale.as_millis().to_string(),
            "--database-acquire-timeout-ms".into(),
            "200".into(),
        ],
        ..Default::default()
    };
    let stack = Stack::start_with(options).await;
    let key = stack.workspace();
    // The validation endpoint needs the key and nothing else of the database.
    let body = intake_tests::serde_json::json!({"conversions": [conversion("lead")]});
    let validate = || stack.post("/v1/conversions/validate", &key, &body);
    assert_eq!(validate().await.status, 200);
    // The database's last answer for the key came before this instant.
    let last_answer = std::time::Instant::now();
    postgres.stop();

    let mut served_from_memory = Vec::new();
    let refused = loop {
        let reply = validate().await;
        let at = last_answer.elapsed();
        match reply.status {
            200 => served_from_memory.push(at),
            _ => break (reply, at),
        }
        assert!(
            at < stale + Duration::from_secs(3),
            "the key was still answered {at:?} after the database's last answer"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (reply, at) = refused;
    assert_eq!((reply.status, reply.error_code()), (500, "internal_error"), "{}", reply.body);
    // Past the cache time only the last known answer can have served the key.
    assert!(
        served_from_memory.iter().any(|served| *served > cache + Duration::from_millis(100)),
        "the key was served from its last answer during the outage: {served_from_memory:?}"
    );
    assert_answered_from_last_known_keys(&stack).await;
    let last_served = served_from_memory.iter().max().copied().unwrap_or_default();
    assert!(
        last_served <= stale + Duration::from_millis(300),
        "served {last_served:?} after the database's last answer, beyond the stale time"
    );
    assert!(
        at >= stale.saturating_sub(Duration::from_millis(1_500)),
        "refused {at:?} after the last answer: the stale time was cut short"
    );
}

/// A database that takes the key look-up and does not answer it (here a lock held on the keys;
/// a stalled disk or a host gone without a reset look the same) holds no request past the
/// look-up timeout: the key's last answer serves it.
#[tokio::test]
async fn a_key_look_up_the_database_does_not_answer_is_served_from_the_last_answer() {
    let postgres = PrivatePostgres::start_new();
    postgres.migrate();
    let options = StackOptions {
        database_url: Some(postgres.url()),
        auth_cache_ttl_ms: 500,
        gateway_args: vec!["--database-acquire-timeout-ms".into(), "300".into()],
        ..Default::default()
    };
    let stack = Stack::start_with(options).await;
    let key = stack.workspace();
    let body = intake_tests::serde_json::json!({"conversions": [conversion("lead")]});
    let validate = || stack.post("/v1/conversions/validate", &key, &body);
    assert_eq!(validate().await.status, 200);

    let db = sqlx::PgPool::connect(&postgres.url()).await.unwrap_or_else(|e| panic!("{e}"));
    let mut lock = db.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *lock)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    // Past the cache time every request needs a look-up, and each one waits on the lock.
    let locked = std::time::Instant::now();
    while locked.elapsed() < Duration::from_secs(3) {
        let sent = std::time::Instant::now();
        let reply = validate().await;
        let took = sent.elapsed();
        assert_eq!(reply.status, 200, "{}", reply.body);
        assert!(took < Duration::from_secs(2), "a request waited {took:?} on a look-up the database did not answer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    lock.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    assert_answered_from_last_known_keys(&stack).await;
}
