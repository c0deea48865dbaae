//! Two writers in one consumer group under concurrent traffic for many workspaces.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, join_all, Stack};

#[tokio::test]
async fn two_writers_share_the_work_and_every_reply_reaches_its_gateway() {
    let mut stack = Stack::start().await;
    stack.start_writer();
    let keys: Vec<_> = (0..12).map(|_| stack.workspace()).collect();
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
        let count: i64 = sqlx::query_scalar("SELECT count(*) FROM conversions WHERE workspace_id = $1")
            .bind(&key.workspace_id)
            .fetch_one(&db)
            .await
            .unwrap_or(-1);
        assert_eq!(count, 5 + 30, "each conversion stored once");
    }
    let created_shared = replies
        .iter()
        .filter(|(n, r)| *n == 0 && r.status == 201 && r.body["conversion"]["external_id"] == shared["external_id"])
        .count();
    assert_eq!(created_shared, 1, "the pair sent concurrently is created exactly once");
    let writers_logged = stack.logs().matches("writer consuming").count();
    assert_eq!(writers_logged, 2);
}
