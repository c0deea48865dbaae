//! An erasure covers what was sent before it began but is applied after it (docs/architecture.md, "Privacy"): a batch
//! waiting in Kafka while the writer is away does not bring the erased identifiers back when it
//! is applied. What is sent after the erasure is a later send, stored as sent (docs/api.md, "Erasure").

use intake_tests::serde_json::json;
use intake_tests::{database, now_ms, stored_fields, Stack, StackOptions};
use std::time::{Duration, Instant};

fn unique(length: usize) -> String {
    ulid::Ulid::new().to_string().to_lowercase().chars().rev().take(length).collect()
}

/// The stored identifiers of a workspace's conversion, once it is stored.
async fn stored(workspace_id: &str, event: &str, external_id: &str) -> Option<Vec<Option<String>>> {
    let columns = ["visitor_id", "contact_id", "email_sha256", "phone_sha256", "hdyhau"];
    stored_fields(&database().await, workspace_id, event, external_id, &columns).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_write_sent_before_an_erasure_and_applied_after_it_stays_erased() {
    let mut stack = Stack::start_with(StackOptions { write_timeout_ms: 1_500, ..StackOptions::default() }).await;
    let key = stack.workspace();
    let ws = key.workspace_id.clone();
    let email = format!("{}@example.com", unique(10));
    let occurred = now_ms() - 60_000;
    let first = json!({"event": "lead", "external_id": unique(12), "occurred_at": occurred, "email": email});
    assert_eq!(stack.post("/v1/conversions", &key, &first).await.status, 201);

    // The writer goes away; a batch with the same person and someone else waits in Kafka.
    stack.stop_writers(true);
    let (pending, other) = (unique(12), unique(12));
    let other_email = format!("{}@example.com", unique(10));
    let batch = json!({"conversions": [
        {"event": "purchase", "external_id": pending, "occurred_at": occurred, "email": email,
         "contact_id": "crm-7", "visitor_id": unique(16), "hdyhau": "radio"},
        {"event": "purchase", "external_id": other, "occurred_at": occurred, "email": other_email},
    ]});
    let unanswered = stack.post("/v1/conversions/batch", &key, &batch).await;
    assert_eq!(unanswered.status, 500, "no writer: {unanswered:?}");

    let erased = stack
        .run_writer_command_with_input(&["erase", "--workspace", &ws, "--email"], &format!("{email}\n"))
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 1, "visits": 0}));

    // The writer comes back and applies the batch sent before the erasure.
    stack.start_writer();
    let deadline = Instant::now() + Duration::from_secs(60);
    while stored(&ws, "purchase", &other).await.is_none() {
        assert!(Instant::now() < deadline, "the pending batch was never applied");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stored(&ws, "purchase", &pending).await,
        Some(vec![None; 5]),
        "the person's item sent before the erasure is stored as the erasure left the person's data"
    );
    let kept = stored(&ws, "purchase", &other).await.unwrap_or_default();
    assert!(kept[2].is_some(), "someone else's item in the same batch keeps its identifiers: {kept:?}");
    assert_eq!(stored(&ws, "lead", first["external_id"].as_str().unwrap_or_default()).await, Some(vec![None; 5]));

    // Sent again now, after the erasure, it is a later send: stored as sent.
    let again = stack.post("/v1/conversions/batch", &key, &batch).await;
    assert_eq!(again.status, 200, "{again:?}");
    let resent: Vec<Option<String>> = stored(&ws, "purchase", &pending).await.unwrap_or_default();
    let sent_again = [&resent[0], &resent[1], &resent[2], &resent[4]]; // no phone was sent
    assert!(sent_again.iter().all(|v| v.is_some()), "a later send stores the data again: {resent:?}");
}
