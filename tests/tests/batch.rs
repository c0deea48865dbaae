//! POST /v1/conversions/batch (docs/api.md, "POST /v1/conversions/batch").

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, stored_count, topic_contents, OwnDatabase, Stack, StackOptions};

fn batch(items: Vec<Value>) -> Value {
    json!({ "conversions": items })
}

#[tokio::test]
async fn results_in_input_order_with_item_errors_and_summary() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let first = conversion("lead");
    let mut changed = first.clone();
    changed["value"] = json!(5);
    let mut old = conversion("lead");
    old["occurred_at"] = json!("1999-01-01T00:00:00Z");
    let items =
        vec![first.clone(), json!({"event": "bad!"}), first.clone(), changed, json!(42), old, conversion("deal")];
    let reply = stack.post("/v1/conversions/batch", &key, &batch(items)).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let results = reply.body["results"].as_array().cloned().unwrap_or_default();
    let indexes: Vec<_> = results.iter().map(|r| r["index"].as_u64().unwrap_or(99)).collect();
    assert_eq!(indexes, vec![0, 1, 2, 3, 4, 5, 6]);
    let outcome = |r: &Value| {
        if r["ok"] == json!(true) {
            r["conversion"]["result"].as_str().unwrap_or("?").to_owned()
        } else {
            r["error"]["code"].as_str().unwrap_or("?").to_owned()
        }
    };
    let outcomes: Vec<String> = results.iter().map(outcome).collect();
    assert_eq!(
        outcomes,
        [
            "created",
            "validation_failed",
            "unchanged",
            "updated",
            "validation_failed",
            "occurred_at_out_of_range",
            "created"
        ]
    );
    let details = &results[1]["error"]["details"];
    let paths: Vec<_> = details.as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect();
    assert_eq!(paths, ["event", "external_id", "occurred_at"], "paths relative to the item");
    assert_eq!(results[4]["error"]["details"][0]["path"], "", "an item that is not an object is an item error");
    assert!(results[1]["error"]["message"].as_str().is_some());
    assert_eq!(results[0]["conversion"]["id"], results[2]["conversion"]["id"]);
    assert_eq!(reply.body["summary"], json!({"created": 2, "updated": 1, "unchanged": 1, "failed": 3}));
}

#[tokio::test]
async fn envelope_errors_are_answered_before_anything_is_written() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let many: Vec<Value> = (0..501).map(|_| conversion("lead")).collect();
    let cases = [
        (batch(vec![]), "conversions"),
        (batch(many), "conversions"),
        (json!({}), "conversions"),
        (json!({"conversions": {}}), "conversions"),
        (json!({"conversions": [conversion("lead")], "dry_run": true}), "dry_run"),
        (json!([conversion("lead")]), "conversions"),
        (json!(null), "conversions"),
    ];
    for (body, path) in cases {
        let reply = stack.post("/v1/conversions/batch", &key, &body).await;
        assert_eq!((reply.status, reply.error_code()), (422, "validation_failed"), "{path}");
        assert_eq!(reply.body["error"]["details"][0]["path"], json!(path));
    }
    assert_eq!(stored_count(&database().await, &key.workspace_id).await, 0);
}

#[tokio::test]
async fn five_hundred_items_in_five_chunks() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let items: Vec<Value> = (0..500).map(|_| conversion("lead")).collect();
    let reply = stack.post("/v1/conversions/batch", &key, &batch(items.clone())).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body["summary"], json!({"created": 500, "updated": 0, "unchanged": 0, "failed": 0}));
    let again = stack.post("/v1/conversions/batch", &key, &batch(items)).await;
    assert_eq!(again.body["summary"]["unchanged"], 500);
    let messages = topic_contents(&format!("{}.requests", stack.topic_prefix));
    assert_eq!(messages.lines().count(), 10, "each request: five messages of at most 100 items");
}

#[tokio::test]
async fn a_failed_later_chunk_is_500_earlier_chunks_stay_and_the_resend_is_safe() {
    // A trigger: on a database of the test's own (DDL on the shared one blocks every test).
    let own = OwnDatabase::create("batch").await;
    let stack = Stack::start_with(StackOptions { database_url: Some(own.url.clone()), ..Default::default() }).await;
    let key = stack.workspace();
    let db = own.pool().await;
    let poison = format!("poison-{}", ulid::Ulid::new());
    let function = format!("refuse_{}", poison.to_lowercase().replace('-', "_"));
    // A chunk that the database refuses (a constraint the data breaks): not transient.
    sqlx::raw_sql(&format!(
        "CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN IF NEW.external_id = '{poison}' THEN RAISE EXCEPTION 'refused by test'; END IF; RETURN NEW; END $$;
         CREATE TRIGGER {function} BEFORE INSERT ON conversions FOR EACH ROW EXECUTE FUNCTION {function}();"
    ))
    .execute(&db)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let mut items: Vec<Value> = (0..150).map(|_| conversion("lead")).collect();
    items[120]["external_id"] = json!(poison);
    let reply = stack.post("/v1/conversions/batch", &key, &batch(items.clone())).await;
    sqlx::raw_sql(&format!("DROP TRIGGER {function} ON conversions; DROP FUNCTION {function}();"))
        .execute(&db)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((reply.status, reply.error_code()), (500, "internal_error"));
    assert_eq!(stored_count(&db, &key.workspace_id).await, 100, "the first chunk stays committed");
    let dead = topic_contents(&format!("{}.requests.dlq", stack.topic_prefix));
    assert!(dead.contains(&poison), "the failed chunk went to the dead-letter topic");

    let resend = stack.post("/v1/conversions/batch", &key, &batch(items)).await;
    assert_eq!(resend.body["summary"], json!({"created": 50, "updated": 0, "unchanged": 100, "failed": 0}));
}

#[tokio::test]
async fn no_reply_before_the_deadline_is_500() {
    let stack =
        Stack::start_with(StackOptions { write_timeout_ms: 1_000, start_writer: false, ..Default::default() }).await;
    let key = stack.workspace();
    let reply = stack.post("/v1/conversions/batch", &key, &batch(vec![conversion("lead")])).await;
    assert_eq!((reply.status, reply.error_code()), (500, "internal_error"));
}
