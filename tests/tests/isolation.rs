//! One workspace's trouble stays its own (docs/architecture.md, "Isolation in the writer",
//! "Order within a request", "Failure classes", "Stale values"): a refused middle chunk leaves
//! a prefix, poison chunks of outage-like classes are dead-lettered while the partition goes on,
//! and a chunk that reached Kafka after its deadline is never applied (a workspace held in
//! PostgreSQL holding up only itself is in `latency.rs`). The tests that need a trigger run on a
//! database of their own.

use intake_tests::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

fn batch(items: Vec<Value>) -> Value {
    json!({ "conversions": items })
}

/// A trigger on the test's own database that raises `sqlstate` for the item `external_id`.
async fn refuse(db: &sqlx::PgPool, external_id: &str, sqlstate: &str) {
    let function = format!("refuse_{}", ulid::Ulid::new().to_string().to_lowercase());
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.external_id = '{external_id}' THEN
           RAISE EXCEPTION 'refused by test' USING ERRCODE = '{sqlstate}'; END IF; RETURN NEW; END $$;
         CREATE TRIGGER {function} BEFORE INSERT ON conversions FOR EACH ROW EXECUTE FUNCTION {function}();"
    ))
    .execute(db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
}

/// A stack on a database of its own; the database is dropped after the stack stops.
async fn own_stack(writer_args: &[&str]) -> (OwnDatabase, Stack, sqlx::PgPool) {
    let own = OwnDatabase::create("isolation").await;
    let options = StackOptions {
        database_url: Some(own.url.clone()),
        writer_args: writer_args.iter().map(|a| a.to_string()).collect(),
        ..Default::default()
    };
    let stack = Stack::start_with(options).await;
    let db = own.pool().await;
    (own, stack, db)
}

#[tokio::test]
async fn a_refused_middle_chunk_leaves_the_first_chunk_and_nothing_after_it() {
    let (_own, stack, db) = own_stack(&[]).await;
    let key = stack.workspace();
    let poison = format!("poison-{}", ulid::Ulid::new());
    refuse(&db, &poison, "P0001").await;
    let mut items: Vec<Value> = (0..300).map(|_| conversion("lead")).collect();
    items[150]["external_id"] = json!(poison);
    let reply = stack.post("/v1/conversions/batch", &key, &batch(items.clone())).await;
    assert_eq!((reply.status, reply.error_code()), (500, "internal_error"));
    assert_eq!(stored_count(&db, &key.workspace_id).await, 100, "the first chunk only: a prefix, never a gap");
    let third: Vec<&str> = items[200..].iter().filter_map(|i| i["external_id"].as_str()).collect();
    let third_stored: i64 =
        sqlx::query_scalar("SELECT count(*) FROM conversions WHERE workspace_id = $1 AND external_id = ANY($2)")
            .bind(&key.workspace_id)
            .bind(&third)
            .fetch_one(&db)
            .await
            .unwrap_or(-1);
    assert_eq!(third_stored, 0);
    let letters = topic_headers(&format!("{}.requests.dlq", stack.topic_prefix), 2, Duration::from_secs(5));
    assert_eq!(letters.len(), 1, "only the refused chunk is dead-lettered: {letters:?}");
    assert_eq!(letters[0].get("reason").map(String::as_str), Some("apply_failed"));

    // A later request of the same workspace is applied; the client's re-send fills the rest.
    items[150]["external_id"] = json!(format!("fixed-{}", ulid::Ulid::new()));
    let again = stack.post("/v1/conversions/batch", &key, &batch(items)).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body["summary"], json!({"created": 200, "updated": 0, "unchanged": 100, "failed": 0}));
}

#[tokio::test]
async fn poison_of_outage_like_classes_is_dead_lettered_and_its_partition_goes_on() {
    let (_own, stack, db) = own_stack(&[]).await;
    let key = stack.workspace();
    for sqlstate in ["53200", "57014", "53100"] {
        let poison = format!("poison-{sqlstate}-{}", ulid::Ulid::new());
        refuse(&db, &poison, sqlstate).await;
        let mut item = conversion("lead");
        item["external_id"] = json!(poison);
        let started = Instant::now();
        let reply = stack.post("/v1/conversions", &key, &item).await;
        assert_eq!((reply.status, reply.error_code()), (500, "internal_error"), "{sqlstate}");
        assert!(started.elapsed() < Duration::from_secs(9), "{sqlstate}: given up after its attempts, not timed out");
        let next = stack.post("/v1/conversions", &key, &conversion("lead")).await;
        assert_eq!(next.status, 201, "{sqlstate}: the workspace and its partition go on");
    }
    let letters = topic_headers(&format!("{}.requests.dlq", stack.topic_prefix), 3, Duration::from_secs(10));
    assert_eq!(letters.len(), 3);
}

#[tokio::test]
async fn a_chunk_that_reached_kafka_after_its_deadline_is_never_applied() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let db = database().await;
    let mut item = conversion("purchase");
    item["value"] = json!("10");
    assert_eq!(stack.post("/v1/conversions", &key, &item).await.status, 201);
    let topic = format!("{}.requests", stack.topic_prefix);

    // An older value, delivered after its deadline (held in a producer, or replayed): refused.
    let mut stale = item.clone();
    stale["value"] = json!("5");
    produce_request_with_deadline(&topic, &key.workspace_id, 0, &stale, now_ms() - 1_000).await;
    // A chunk sent in time after it is applied, in order: when it shows, the stale one was read.
    let mut later = conversion("lead");
    later["external_id"] = json!(format!("later-{}", ulid::Ulid::new()));
    produce_request(&topic, &key.workspace_id, 0, &later).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while stored_count(&db, &key.workspace_id).await < 2 {
        assert!(Instant::now() < deadline, "the chunk in time was not applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let value: String =
        sqlx::query_scalar("SELECT value::text FROM conversions WHERE workspace_id = $1 AND external_id = $2")
            .bind(&key.workspace_id)
            .bind(item["external_id"].as_str().unwrap_or_default())
            .fetch_one(&db)
            .await
            .unwrap_or_default();
    assert_eq!(value, "10", "the acknowledged value stays");
    assert_eq!(stack.writer_metrics(0).await.value(r#"intake_writer_messages_total{outcome="expired"}"#), 1.0);
}

/// Small writes of several workspaces share a transaction (docs/architecture.md, "Isolation in
/// the writer"): one whose statement is slow ends that transaction within its tight bound,
/// is set apart and applied alone, and its neighbours wait for it no longer than that bound.
#[tokio::test]
async fn a_slow_write_beside_other_workspaces_holds_them_up_only_briefly() {
    // Two workers for 24 senders: messages wait for a worker, and are taken together.
    let (_own, stack, db) = own_stack(&["--apply-lanes", "2"]).await;
    let function = format!("slow_{}", ulid::Ulid::new().to_string().to_lowercase());
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.external_id LIKE 'slow-%' THEN PERFORM pg_sleep(3); END IF; RETURN NEW; END $$;
         CREATE TRIGGER {function} BEFORE INSERT ON conversions FOR EACH ROW EXECUTE FUNCTION {function}();"
    ))
    .execute(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let slow_key = stack.workspace();
    let others: Vec<TestKey> = (0..24).map(|_| stack.workspace()).collect();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sending: Vec<_> = others
        .iter()
        .map(|key| {
            let (client, key, done) = (stack.client(), key.clone(), done.clone());
            tokio::spawn(async move {
                let mut sends = Vec::new();
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let sent = Instant::now();
                    let status = client.post("/v1/conversions", &key, &conversion("lead")).await.status;
                    sends.push((status, sent.elapsed()));
                }
                sends
            })
        })
        .collect();
    // Twice: each time it most likely waits for a worker beside the neighbours' sends.
    let mut slow_took = Vec::new();
    for _ in 0..2 {
        let mut slow = conversion("lead");
        slow["external_id"] = json!(format!("slow-{}", ulid::Ulid::new()));
        let started = Instant::now();
        let reply = stack.post("/v1/conversions", &slow_key, &slow).await;
        slow_took.push(started.elapsed());
        assert_eq!(reply.status, 201, "applied alone: {}", reply.body);
    }
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut slowest = Duration::ZERO;
    for (key, task) in others.iter().zip(sending) {
        let sends = task.await.unwrap_or_default();
        assert!(sends.iter().all(|(status, _)| *status == 201), "{sends:?}");
        slowest = slowest.max(sends.iter().map(|(_, took)| *took).max().unwrap_or_default());
        assert_eq!(stored_count(&db, &key.workspace_id).await, i64::try_from(sends.len()).unwrap_or(-1));
    }
    // A slow write that was tried beside others first took about a second more.
    eprintln!("the slow writes took {slow_took:?}; the neighbours' slowest send {slowest:?}");
    assert!(slowest < Duration::from_millis(2_500), "a neighbour waited {slowest:?} for the slow write");
    assert_eq!(stored_count(&db, &slow_key.workspace_id).await, 2);
}

#[tokio::test]
async fn a_row_lock_held_elsewhere_is_waited_out_not_dead_lettered() {
    let stack = Stack::start_with(StackOptions {
        writer_args: vec!["--lock-timeout-ms".into(), "200".into()],
        write_timeout_ms: 3_000,
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let item = conversion("lead");
    assert_eq!(stack.post("/v1/conversions", &key, &item).await.status, 201);
    let db = database().await;
    let mut tx = db.begin().await.unwrap_or_else(|e| panic!("{e}"));
    sqlx::query("SELECT 1 FROM conversions WHERE workspace_id = $1 FOR UPDATE")
        .bind(&key.workspace_id)
        .execute(&mut *tx)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let mut update = item.clone();
    update["value"] = json!("7");
    let reply = stack.post("/v1/conversions", &key, &update).await;
    assert_eq!(reply.status, 500, "the row stays locked past the deadline");
    tx.rollback().await.unwrap_or_else(|e| panic!("{e}"));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let values: Vec<_> = stored_values(&db, &key.workspace_id).await.into_values().collect();
        if values == [Some("7".to_owned())] {
            break;
        }
        assert!(Instant::now() < deadline, "the waiting chunk was never applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let letters = topic_headers(&format!("{}.requests.dlq", stack.topic_prefix), 1, Duration::from_secs(2));
    assert!(letters.is_empty(), "a lock wait is not the chunk's failure: {letters:?}");
}
