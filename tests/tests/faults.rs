//! Faults lose nothing that was acknowledged.

use intake_tests::serde_json::Value;
use intake_tests::{conversion, database, Stack, StackOptions};
use std::collections::BTreeSet;
use std::time::Duration;

#[tokio::test]
async fn a_writer_killed_under_traffic_loses_no_acknowledged_conversion() {
    let mut stack = Stack::start_with(StackOptions { write_timeout_ms: 2_000, ..Default::default() }).await;
    let key = stack.workspace();
    let client = stack.client();
    let sender = {
        let key = key.clone();
        tokio::spawn(async move {
            let mut outcomes: Vec<(Value, u16)> = Vec::new();
            for _ in 0..150 {
                let input = conversion("lead");
                let reply = client.post("/v1/conversions", &key, &input).await;
                outcomes.push((input["external_id"].clone(), reply.status));
            }
            outcomes
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    stack.stop_writers(false); // SIGKILL, mid-traffic
    tokio::time::sleep(Duration::from_millis(500)).await;
    stack.start_writer();
    let outcomes = sender.await.unwrap_or_default();

    let acknowledged: BTreeSet<String> = outcomes
        .iter()
        .filter(|(_, status)| *status == 201)
        .map(|(id, _)| id.as_str().unwrap_or_default().to_owned())
        .collect();
    assert!(outcomes.iter().all(|(_, status)| *status == 201 || *status == 500), "{outcomes:?}");
    assert!(acknowledged.len() > 10, "traffic went through before and after the kill");
    // Requests answered 500 during the outage were still in Kafka: give the new writer time.
    let mut stored = BTreeSet::new();
    for _ in 0..100 {
        stored = sqlx::query_scalar::<_, String>("SELECT external_id FROM conversions WHERE workspace_id = $1")
            .bind(&key.workspace_id)
            .fetch_all(&database().await)
            .await
            .unwrap_or_default()
            .into_iter()
            .collect();
        if stored.len() == outcomes.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(acknowledged.is_subset(&stored), "every acknowledged conversion is stored");
    assert_eq!(stored.len(), outcomes.len(), "even the ones answered 500 were applied in the end");
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
    tokio::time::sleep(Duration::from_millis(500)).await;
    let exited = stack.terminate_gateway();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stack.start_writer();
    let reply = in_flight.await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status, 201, "the request in flight at SIGTERM was answered: {reply:?}");
    let status = tokio::task::spawn_blocking(move || exited.join().ok().flatten()).await.ok().flatten();
    assert!(status.is_some_and(|s| s.success()), "the gateway exited cleanly: {status:?}");
}
