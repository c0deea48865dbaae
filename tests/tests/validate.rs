//! POST /v1/conversions/validate (docs/api.md, "POST /v1/conversions/validate"): the batch
//! endpoint's envelope, limits and error order less the conversion limit; every item validated and
//! normalized, nothing written.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, raw_http, stored_count, topic_contents, Stack, StackOptions};
use reqwest::Method;
use std::time::{Duration, Instant};

const PATH: &str = "/v1/conversions/validate";
const HASH: &str = "71d4f55f72fa128dfb468a1a3901507c804b74316488744d769d7f4b16696476";

fn batch(items: Vec<Value>) -> Value {
    json!({ "conversions": items })
}

fn paths(error: &Value) -> Vec<&str> {
    error["details"].as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect()
}

#[tokio::test]
async fn every_item_is_answered_in_order_and_nothing_is_written() {
    // A conversion limit of 3: a validation of 7 items would be refused if it were counted.
    let options = StackOptions { conversions_per_minute: 3, rate_limit_window_ms: 10_000, ..Default::default() };
    let (stack, key, window_end) = Stack::with_window(options, Duration::from_secs(7)).await;

    let mut with_identifiers = conversion("Lead");
    with_identifiers["email"] = json!(" Ann@Example.com ");
    with_identifiers["phone"] = json!("(415) 555-2671");
    with_identifiers["country"] = json!("us");
    with_identifiers["address"] = json!({"line1": "1 Main St", "zip": "94105-1234"});
    let mut unusable = conversion("lead");
    unusable["email"] = json!("not-an-email");
    unusable["phone"] = json!("12");
    unusable["address"] = json!({"line1": "1 Main St", "zip": "ABCDE"});
    let mut old = conversion("lead");
    old["occurred_at"] = json!("1999-01-01T00:00:00Z");
    let mut both_forms = conversion("lead");
    both_forms["email"] = json!("ann@example.com");
    both_forms["email_sha256"] = json!(HASH);
    let mut pre_hashed = conversion("lead");
    pre_hashed["email_sha256"] = json!(HASH);
    let items = vec![
        with_identifiers,
        unusable,
        json!({"event": "bad!", "external_id": 1}),
        json!(42),
        old,
        both_forms,
        pre_hashed,
    ];
    let reply = stack.post(PATH, &key, &batch(items.clone())).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    let results = reply.body["results"].as_array().cloned().unwrap_or_default();
    assert_eq!(results.len(), 7, "{reply:?}");
    for (index, result) in results.iter().enumerate() {
        assert_eq!(result["index"], json!(index));
    }
    assert_eq!(results[0], json!({"index": 0, "ok": true, "warnings": []}));
    assert_eq!(
        results[1],
        json!({"index": 1, "ok": true, "warnings": ["email_invalid", "phone_unparseable", "address_unparseable"]})
    );
    assert_eq!(
        (results[2]["ok"].clone(), results[2]["error"]["code"].clone()),
        (json!(false), json!("validation_failed"))
    );
    assert_eq!(paths(&results[2]["error"]), ["event", "occurred_at"], "paths relative to the item");
    assert!(results[2]["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    assert!(results[2]["error"].get("request_id").is_none(), "an item error carries no request id");
    assert_eq!(paths(&results[3]["error"]), [""], "an item that is not an object is an item error");
    assert_eq!(
        results[4]["error"],
        json!({"code": "occurred_at_out_of_range", "message": results[4]["error"]["message"]})
    );
    assert_eq!(paths(&results[5]["error"]), ["email_sha256"]);
    assert_eq!(results[6], json!({"index": 6, "ok": true, "warnings": []}));
    assert_eq!(reply.body["summary"], json!({"valid": 3, "failed": 4}));

    // The alias answers the same.
    let alias = stack.post("/api/v1/conversions/validate", &key, &batch(items)).await;
    assert_eq!(alias.body, reply.body);

    // Nothing stored, nothing sent to the writers, and the conversion limit untouched: a real
    // send of 3 still fits.
    assert_eq!(stored_count(&database().await, &key.workspace_id).await, 0);
    assert_eq!(topic_contents(&format!("{}.requests", stack.topic_prefix)), "", "no Kafka message");
    let three: Vec<Value> = (0..3).map(|_| conversion("lead")).collect();
    let sent = stack.post("/v1/conversions/batch", &key, &batch(three.clone())).await;
    assert_eq!(sent.body["summary"], json!({"created": 3, "updated": 0, "unchanged": 0, "failed": 0}), "{sent:?}");
    let refused = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!((refused.status, refused.error_code()), (429, "rate_limited"), "the limit of 3 holds");
    // Validating after the limit is reached still works: it is not a write.
    let after = stack.post(PATH, &key, &batch(three)).await;
    assert_eq!(after.body["summary"], json!({"valid": 3, "failed": 0}), "{after:?}");
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");
}

#[tokio::test]
async fn a_stored_conversion_is_neither_changed_nor_read() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("lead");
    input["value"] = json!("10");
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.status, 201);
    let mut changed = input.clone();
    changed["value"] = json!("20");
    let reply = stack.post(PATH, &key, &batch(vec![changed.clone()])).await;
    assert_eq!(reply.body["results"][0], json!({"index": 0, "ok": true, "warnings": []}));
    let value: Option<String> =
        sqlx::query_scalar("SELECT value::text FROM conversions WHERE workspace_id = $1 AND external_id = $2")
            .bind(&key.workspace_id)
            .bind(input["external_id"].as_str().unwrap_or_default())
            .fetch_one(&database().await)
            .await
            .unwrap_or_default();
    assert_eq!(value.as_deref(), Some("10"));
    let resent = stack.post("/v1/conversions", &key, &changed).await;
    assert_eq!(resent.body["conversion"]["result"], "updated", "the validation wrote nothing");
}

#[tokio::test]
async fn it_counts_against_the_request_limit_before_its_body_is_read() {
    let options = StackOptions { requests_per_minute: 3, rate_limit_window_ms: 5_000, ..Default::default() };
    let (stack, key, window_end) = Stack::with_window(options, Duration::from_secs(4)).await;
    let body = batch(vec![conversion("lead")]);
    for remaining in ["2", "1", "0"] {
        let reply = stack.post(PATH, &key, &body).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.header("ratelimit-remaining"), Some(remaining));
    }
    // Over the limit: 429 before the body is read, so even a body over 1 MiB gets it, not 413.
    let huge = "x".repeat(2 * 1024 * 1024);
    let refused = stack.post_text(PATH, &key, huge).await;
    assert_eq!((refused.status, refused.error_code()), (429, "rate_limited"), "{refused:?}");
    let retry_after: u64 = refused.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!((1..=5).contains(&retry_after), "Retry-After {retry_after} within the 5 s window");
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");
}

#[tokio::test]
async fn errors_come_in_the_batch_endpoints_order() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let read_only = stack.workspace_with_scopes("workspace:read");
    let valid = batch(vec![conversion("lead")]);

    // 404: another method on the path.
    let get = stack.send(Method::GET, PATH, Some(&key.bearer()), None).await;
    assert_eq!((get.status, get.error_code()), (404, "not_found"));
    // 401 before anything else.
    let anonymous = stack.send(Method::POST, &format!("{PATH}?x=1"), None, Some(&valid)).await;
    assert_eq!((anonymous.status, anonymous.error_code()), (401, "missing_api_key"));
    // 403 insufficient_scope before the query string.
    let scope = stack.send(Method::POST, &format!("{PATH}?x=1"), Some(&read_only.bearer()), Some(&valid)).await;
    assert_eq!((scope.status, scope.error_code()), (403, "insufficient_scope"));
    assert_eq!(
        scope.header("www-authenticate"),
        Some(r#"Bearer realm="conversions", error="insufficient_scope", scope="conversions:write""#)
    );
    // 400 query_not_allowed before the body's size.
    let huge = format!("{{\"conversions\": [\"{}\"]}}", "x".repeat(1024 * 1024));
    let query = stack.post_text(&format!("{PATH}?dry_run=1"), &key, huge.clone()).await;
    assert_eq!((query.status, query.error_code()), (400, "query_not_allowed"));
    // 413 before the JSON, at the batch endpoint's limit of 1 MiB.
    let too_large = stack.post_text(PATH, &key, format!("{huge}not json")).await;
    assert_eq!((too_large.status, too_large.error_code()), (413, "payload_too_large"));
    let over_by_one = format!("{{\"conversions\":[\"{}\"]}}", "x".repeat(1024 * 1024 - 19));
    assert_eq!(over_by_one.len(), 1024 * 1024 + 1);
    assert_eq!(stack.post_text(PATH, &key, over_by_one).await.status, 413);
    let at_the_limit = format!("{{\"conversions\":[\"{}\"]}}", "x".repeat(1024 * 1024 - 20));
    assert_eq!(at_the_limit.len(), 1024 * 1024);
    let at_the_limit = stack.post_text(PATH, &key, at_the_limit).await;
    assert_eq!(at_the_limit.status, 200, "exactly 1 MiB is read: {:?}", at_the_limit.status);
    assert_eq!(at_the_limit.body["summary"], json!({"valid": 0, "failed": 1}));
    // A body over 1 MiB without a Content-Length is cut off at the limit.
    let address = stack.base_url.clone();
    let chunk = "x".repeat(1024 * 1024 + 10);
    let chunked = format!(
        "POST {PATH} HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n",
        key.bearer(),
        chunk.len()
    );
    assert_eq!(raw_http(&address, chunked.as_bytes()).await.0, 413);
    // 400 invalid_json before the envelope.
    let invalid = stack.post_text(PATH, &key, "{\"conversions\": [".to_owned()).await;
    assert_eq!((invalid.status, invalid.error_code()), (400, "invalid_json"));
    // 422 validation_failed on the envelope, with its path.
    let many: Vec<Value> = (0..501).map(|_| conversion("lead")).collect();
    for (body, path) in [
        (batch(vec![]), "conversions"),
        (batch(many), "conversions"),
        (json!({}), "conversions"),
        (json!({"conversions": null}), "conversions"),
        (json!({"conversions": {}}), "conversions"),
        (json!({"conversions": [conversion("lead")], "dry_run": true}), "dry_run"),
        (json!([conversion("lead")]), "conversions"),
    ] {
        let reply = stack.post(PATH, &key, &body).await;
        assert_eq!((reply.status, reply.error_code()), (422, "validation_failed"), "{path}: {reply:?}");
        assert_eq!(reply.body["error"]["details"][0]["path"], json!(path));
    }
    // 500 items are within the limit.
    let five_hundred: Vec<Value> = (0..500).map(|_| conversion("lead")).collect();
    let reply = stack.post(PATH, &key, &batch(five_hundred)).await;
    assert_eq!(reply.body["summary"], json!({"valid": 500, "failed": 0}));
    assert_eq!(stored_count(&database().await, &key.workspace_id).await, 0);
}

#[tokio::test]
async fn it_answers_while_writes_are_refused_for_overload() {
    // No writer and a cap of one write in flight: the first write waits, the next is refused.
    let stack = Stack::start_with(StackOptions {
        start_writer: false,
        write_timeout_ms: 5_000,
        gateway_args: vec!["--max-writes-in-flight".into(), "1".into()],
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let (client, waiting_key) = (stack.client(), key.clone());
    let waiting = tokio::spawn(async move { client.post("/v1/conversions", &waiting_key, &conversion("lead")).await });
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stack.metrics().await.value("intake_gateway_writes_in_flight") < 1.0 {
        assert!(std::time::Instant::now() < deadline, "the first write never got in flight");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let refused = stack.post("/v1/conversions/batch", &key, &batch(vec![conversion("lead")])).await;
    assert_eq!((refused.status, refused.error_code()), (503, "service_unavailable"), "{refused:?}");

    let validated = stack.post(PATH, &key, &batch(vec![conversion("lead")])).await;
    assert_eq!(validated.status, 200, "validation needs no writer: {validated:?}");
    assert_eq!(validated.body["summary"], json!({"valid": 1, "failed": 0}));
    let waited = waiting.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(waited.status, 500, "no writer: the write's deadline passes");
}
