//! One conversion from HTTP through Kafka to PostgreSQL and back.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, join_all, stored_count, stored_fields, stored_values, Stack, StackOptions};
use std::time::Duration;

/// The stored id, value, hdyhau and currency.
async fn stored(
    workspace_id: &str,
    event: &str,
    external_id: &str,
) -> Option<(String, Option<String>, Option<String>, Option<String>)> {
    let columns = ["id", "value", "hdyhau", "currency"];
    let row = stored_fields(&database().await, workspace_id, event, external_id, &columns).await?;
    Some((row[0].clone().unwrap_or_default(), row[1].clone(), row[2].clone(), row[3].clone()))
}

#[tokio::test]
async fn create_then_unchanged_then_updated() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("Lead");
    input["value"] = json!("12.50");

    let created = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(created.status, 201, "{created:?}");
    let result = &created.body["conversion"];
    assert_eq!(result["result"], "created");
    assert_eq!(result["event"], "lead", "event is stored lower-case");
    assert_eq!(result["external_id"], input["external_id"]);
    assert!(result["id"].as_str().is_some_and(|id| id.starts_with("cnv_")), "{result}");
    assert!(result["chain_id"].as_str().is_some_and(|id| id.starts_with("chn_")), "{result}");
    assert!(created.header("x-request-id").is_some());

    let again = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.body["conversion"]["result"], "unchanged");
    assert_eq!(again.body["conversion"]["id"], result["id"]);
    assert_eq!(again.body["conversion"]["chain_id"], result["chain_id"]);

    input["value"] = json!(13);
    let updated = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(updated.status, 200);
    assert_eq!(updated.body["conversion"]["result"], "updated");
    assert_eq!(updated.body["conversion"]["id"], result["id"]);

    let row = stored(&key.workspace_id, "lead", input["external_id"].as_str().unwrap_or_default()).await;
    assert_eq!(row.map(|r| r.1), Some(Some("13".to_owned())));
}

#[tokio::test]
async fn omitted_null_and_empty_fields_keep_stored_values() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("lead");
    input["hdyhau"] = json!("a podcast");
    input["currency"] = json!("eur");
    input["value"] = json!("12.50");
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.status, 201);

    let mut resend = json!({"event": "LEAD", "external_id": input["external_id"], "occurred_at": input["occurred_at"]});
    resend["hdyhau"] = json!("");
    resend["currency"] = Value::Null;
    resend["value"] = json!(12.5);
    let reply = stack.post("/v1/conversions", &key, &resend).await;
    assert_eq!((reply.status, reply.body["conversion"]["result"].clone()), (200, json!("unchanged")), "{reply:?}");

    let row = stored(&key.workspace_id, "lead", input["external_id"].as_str().unwrap_or_default()).await;
    let (_, value, hdyhau, currency) = row.unwrap_or_else(|| panic!("not stored"));
    assert_eq!(
        (value.as_deref(), hdyhau.as_deref(), currency.as_deref()),
        (Some("12.5"), Some("a podcast"), Some("EUR"))
    );
}

#[tokio::test]
async fn tags_when_sent_replace_the_stored_tags_whole() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("lead");
    input["tags"] = json!({"plan": "pro", "source": "crm"});
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.status, 201);
    let external_id = input["external_id"].as_str().unwrap_or_default().to_owned();
    let tags = || async {
        sqlx::query_scalar::<_, Value>("SELECT tags FROM conversions WHERE workspace_id = $1 AND external_id = $2")
            .bind(&key.workspace_id)
            .bind(&external_id)
            .fetch_one(&database().await)
            .await
            .unwrap_or_else(|e| panic!("{e}"))
    };

    let mut resend = input.clone();
    resend["tags"] = json!({"stage": "won"});
    let reply = stack.post("/v1/conversions", &key, &resend).await;
    assert_eq!((reply.status, reply.body["conversion"]["result"].clone()), (200, json!("updated")), "{reply:?}");
    assert_eq!(tags().await, json!({"stage": "won"}), "no tag of the first send is kept");

    // Omitted, the tags stay; sent empty, they are replaced by none.
    let mut without = input.clone();
    without.as_object_mut().map(|object| object.remove("tags"));
    let reply = stack.post("/v1/conversions", &key, &without).await;
    assert_eq!(reply.body["conversion"]["result"], json!("unchanged"), "{reply:?}");
    assert_eq!(tags().await, json!({"stage": "won"}));
    resend["tags"] = json!({});
    let reply = stack.post("/v1/conversions", &key, &resend).await;
    assert_eq!(reply.body["conversion"]["result"], json!("updated"), "{reply:?}");
    assert_eq!(tags().await, json!({}));
}

#[tokio::test]
async fn integer_and_string_external_id_are_one_conversion() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let number = (intake_tests::now_ms() % 1_000_000_000) as u64;
    let first = stack
        .post(
            "/v1/conversions",
            &key,
            &json!({"event": "lead", "external_id": number, "occurred_at": intake_tests::now_ms()}),
        )
        .await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body["conversion"]["external_id"], json!(number.to_string()));
    let second = stack
        .post(
            "/v1/conversions",
            &key,
            &json!({"event": "lead", "external_id": number.to_string(), "occurred_at": intake_tests::now_ms()}),
        )
        .await;
    assert_eq!(second.status, 200, "{second:?}");
    assert_eq!(second.body["conversion"]["id"], first.body["conversion"]["id"]);
}

#[tokio::test]
async fn workspaces_are_isolated() {
    let stack = Stack::start().await;
    let (a, b) = (stack.workspace(), stack.workspace());
    let mut input = conversion("lead");
    let external_id = input["external_id"].as_str().unwrap_or_default().to_owned();
    input["value"] = json!("1.25");
    let in_a = stack.post("/v1/conversions", &a, &input).await;
    assert_eq!((in_a.status, &in_a.body["conversion"]["result"]), (201, &json!("created")), "{in_a:?}");
    input["value"] = json!("2.25");
    let in_b = stack.post("/v1/conversions", &b, &input).await;
    assert_eq!(
        (in_b.status, &in_b.body["conversion"]["result"]),
        (201, &json!("created")),
        "same pair, other workspace: a new conversion, not an update of the first: {in_b:?}"
    );
    for field in ["id", "chain_id"] {
        assert_ne!(in_a.body["conversion"][field], in_b.body["conversion"][field], "{field}");
    }
    // An update in B leaves A's row as it was.
    input["value"] = json!("3.25");
    let updated = stack.post("/v1/conversions", &b, &input).await;
    assert_eq!((updated.status, &updated.body["conversion"]["result"]), (200, &json!("updated")), "{updated:?}");
    assert_eq!(updated.body["conversion"]["id"], in_b.body["conversion"]["id"]);
    let db = database().await;
    let (stored_a, stored_b) = (stored_values(&db, &a.workspace_id).await, stored_values(&db, &b.workspace_id).await);
    assert_eq!(stored_a.into_iter().collect::<Vec<_>>(), [(external_id.clone(), Some("1.25".to_owned()))]);
    assert_eq!(stored_b.into_iter().collect::<Vec<_>>(), [(external_id.clone(), Some("3.25".to_owned()))]);
    let a_row = stored(&a.workspace_id, "lead", &external_id).await.map(|row| row.0);
    assert_eq!(a_row.as_deref(), in_a.body["conversion"]["id"].as_str(), "A's row is the one A was told of");
}

#[tokio::test]
async fn concurrent_sends_of_one_new_pair_create_it_once() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let input = conversion("purchase");
    let client = stack.client();
    let sends = (0..16).map(|_| {
        let (client, key, input) = (client.clone(), key.clone(), input.clone());
        async move { client.post("/v1/conversions", &key, &input).await }
    });
    let replies = join_all(sends).await;
    let created = replies.iter().filter(|r| r.status == 201).count();
    let unchanged = replies.iter().filter(|r| r.status == 200 && r.body["conversion"]["result"] == "unchanged").count();
    assert_eq!((created, unchanged), (1, 15), "{replies:?}");
    let ids: std::collections::BTreeSet<_> = replies.iter().map(|r| r.body["conversion"]["id"].to_string()).collect();
    assert_eq!(ids.len(), 1);
    assert_eq!(stored_count(&database().await, &key.workspace_id).await, 1);
}

#[tokio::test]
async fn a_writer_restarted_between_two_sends_keeps_the_conversion() {
    let mut stack = Stack::start().await;
    let key = stack.workspace();
    let input = conversion("lead");
    let first = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(first.status, 201);
    stack.stop_writers(true);
    stack.start_writer();
    let second = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!((second.status, second.body["conversion"]["result"].clone()), (200, json!("unchanged")), "{second:?}");
    assert_eq!(second.body["conversion"]["id"], first.body["conversion"]["id"]);
}

#[tokio::test]
async fn no_writer_before_the_deadline_is_500_and_the_write_is_applied_later() {
    let mut stack =
        Stack::start_with(StackOptions { write_timeout_ms: 1_500, start_writer: false, ..Default::default() }).await;
    let key = stack.workspace();
    let input = conversion("lead");
    let timed_out = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(timed_out.status, 500, "{timed_out:?}");
    assert_eq!(timed_out.error_code(), "internal_error");

    stack.start_writer();
    let external_id = input["external_id"].as_str().unwrap_or_default().to_owned();
    let mut applied = None;
    for _ in 0..100 {
        applied = stored(&key.workspace_id, "lead", &external_id).await;
        if applied.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(applied.is_some(), "the request the gateway gave up on was still applied");
    // The gateway may not have read the writer's late reply yet: until then the workspace's
    // write is unanswered, and a write of it is refused 503 with Retry-After.
    let resend = stack.post_honouring_retry_after("/v1/conversions", &key, &input).await;
    assert_eq!(resend.body["conversion"]["result"], "unchanged", "{resend:?}");
}
