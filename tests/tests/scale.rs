//! Two writers in one consumer group under concurrent traffic for many workspaces.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, join_all, stored_count, wait_until, Metrics, Stack};
use std::time::Duration;

#[tokio::test]
async fn two_writers_share_the_work_and_every_reply_reaches_its_gateway() {
    let mut stack = Stack::start().await;
    stack.start_writer();
    // The group has settled: each writer holds some of the four partitions, all of them held.
    let settled = || async {
        let mut held = Vec::new();
        for ops_url in &stack.writer_ops_urls {
            let metrics = Metrics::try_scrape(&stack.http, ops_url).await;
            held.push(metrics.map_or(0.0, |m| m.value("intake_writer_assigned_partitions")));
        }
        held.iter().all(|h| *h >= 1.0) && held.iter().sum::<f64>() == f64::from(stack.request_partitions())
    };
    wait_until("both writers holding partitions", Duration::from_secs(60), settled).await;
    // Workspaces on every partition, so that each writer has some of the traffic.
    let mut keys = stack.workspaces_on_every_partition();
    while keys.len() < 12 {
        keys.push(stack.workspace());
    }
    let shared = conversion("purchase");
    let client = stack.client();
    let mut requests = Vec::new();
    for (n, key) in keys.iter().enumerate() {
        for i in 0..5 {
            let body = if i == 0 { shared.clone() } else { conversion("lead") };
            requests.push((n, key.clone(), "/v1/conversions", body));
        }
        let items: Vec<Value> = (0..30).map(|_| conversion("signed")).collect();
        requests.push((n, key.clone(), "/v1/conversions/batch", json!({"conversions": items})));
        // The same pair, concurrently, in the first workspace.
        for _ in 0..4 {
            requests.push((0, keys[0].clone(), "/v1/conversions", shared.clone()));
        }
    }
    let sends = requests.into_iter().map(|(n, key, path, body)| {
        let client = client.clone();
        async move { (n, client.post(path, &key, &body).await) }
    });
    let replies = join_all(sends).await;
    for (_, reply) in &replies {
        assert!(reply.status == 200 || reply.status == 201, "{reply:?}");
    }
    let db = database().await;
    for key in &keys {
        assert_eq!(stored_count(&db, &key.workspace_id).await, 5 + 30, "each conversion stored once");
    }
    let created_shared = replies
        .iter()
        .filter(|(n, r)| *n == 0 && r.status == 201 && r.body["conversion"]["external_id"] == shared["external_id"])
        .count();
    assert_eq!(created_shared, 1, "the pair sent concurrently is created exactly once");
    // Each writer applied messages, and between them they created every conversion.
    let (mut applied, mut created) = (Vec::new(), 0.0);
    for index in 0..2 {
        let metrics = stack.writer_metrics(index).await;
        applied.push(metrics.value(r#"intake_writer_messages_total{outcome="applied"}"#));
        created += metrics.value(r#"intake_writer_items_total{result="created"}"#);
    }
    assert!(applied.iter().all(|a| *a >= 1.0), "every writer applied messages: {applied:?}");
    assert_eq!(created, (keys.len() * (5 + 30)) as f64, "the two writers created every conversion once");
}
