//! Authentication (docs/api.md, "Authentication") through the real HTTP interface.

use intake_tests::serde_json::json;
use intake_tests::{conversion, Reply, Stack};
use reqwest::Method;
use std::time::{Duration, Instant};

const REALM: &str = "Bearer realm=\"conversions\"";

async fn each_endpoint(stack: &Stack, authorization: Option<&str>) -> Vec<Reply> {
    let body = conversion("lead");
    vec![
        stack.send(Method::GET, "/v1/workspace", authorization, None).await,
        stack.send(Method::POST, "/v1/conversions", authorization, Some(&body)).await,
        stack.send(Method::POST, "/v1/conversions/batch", authorization, Some(&json!({"conversions": [body]}))).await,
    ]
}

#[tokio::test]
async fn missing_key() {
    let stack = Stack::start().await;
    for authorization in
        [None, Some(""), Some("Bearer"), Some("Bearer sk_test_123"), Some("Basic svc_live_abc"), Some("svc_test_x")]
    {
        for reply in each_endpoint(&stack, authorization).await {
            assert_eq!((reply.status, reply.error_code()), (401, "missing_api_key"), "{authorization:?}");
            assert_eq!(reply.header("www-authenticate"), Some(REALM));
        }
    }
}

#[tokio::test]
async fn unknown_and_revoked_keys() {
    let stack = Stack::start().await;
    let unknown = "Bearer svc_live_0000000000000000000000000000000000000000";
    for reply in each_endpoint(&stack, Some(unknown)).await {
        assert_eq!((reply.status, reply.error_code()), (401, "invalid_api_key"));
        assert_eq!(reply.header("www-authenticate"), Some("Bearer realm=\"conversions\", error=\"invalid_token\""));
    }
    let key = stack.workspace();
    stack.run_writer_command(&["key", "revoke", &key.key_id]).unwrap_or_else(|e| panic!("{e:#}"));
    for reply in each_endpoint(&stack, Some(&key.bearer())).await {
        assert_eq!((reply.status, reply.error_code()), (401, "invalid_api_key"));
    }
}

#[tokio::test]
async fn bearer_any_case_and_bare_key_are_accepted() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    for authorization in
        [key.bearer(), format!("bearer {}", key.secret), format!("BEARER  {}", key.secret), key.secret.clone()]
    {
        let reply = stack.send(Method::GET, "/v1/workspace", Some(&authorization), None).await;
        assert_eq!(reply.status, 200, "{authorization:?}: {reply:?}");
        assert!(reply.header("www-authenticate").is_none());
    }
}

#[tokio::test]
async fn scopes() {
    let stack = Stack::start().await;
    let reader = stack.workspace_with_scopes("workspace:read");
    let writer = stack.workspace_with_scopes("conversions:write");
    assert_eq!(stack.get("/v1/workspace", &reader).await.status, 200);
    let refused = stack.post("/v1/conversions", &reader, &conversion("lead")).await;
    assert_eq!((refused.status, refused.error_code()), (403, "insufficient_scope"));
    assert_eq!(
        refused.header("www-authenticate"),
        Some("Bearer realm=\"conversions\", error=\"insufficient_scope\", scope=\"conversions:write\"")
    );
    let batch = stack.post("/v1/conversions/batch", &reader, &json!({"conversions": [conversion("lead")]})).await;
    assert_eq!((batch.status, batch.error_code()), (403, "insufficient_scope"));

    assert_eq!(stack.post("/v1/conversions", &writer, &conversion("lead")).await.status, 201);
    let refused = stack.get("/v1/workspace", &writer).await;
    assert_eq!((refused.status, refused.error_code()), (403, "insufficient_scope"));
    assert_eq!(
        refused.header("www-authenticate"),
        Some("Bearer realm=\"conversions\", error=\"insufficient_scope\", scope=\"workspace:read\"")
    );
    let key = refused.body["error"].clone();
    assert!(key["details"].is_null());
}

/// Polls until the key's requests get `status`, and returns how long that took.
async fn time_until(stack: &Stack, authorization: &str, status: u16) -> Duration {
    let started = Instant::now();
    loop {
        let reply = stack.send(Method::GET, "/v1/workspace", Some(authorization), None).await;
        if reply.status == status {
            return started.elapsed();
        }
        assert!(started.elapsed() < Duration::from_secs(10), "still {} after 10 s", reply.status);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn suspension_resumption_deletion_and_revocation_apply_within_5_seconds_despite_the_cache() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let bearer = key.bearer();
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "the lookup is now cached");

    stack.run_writer_command(&["workspace", "suspend", &key.workspace_id]).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(time_until(&stack, &bearer, 403).await < Duration::from_secs(5));
    let reply = stack.get("/v1/workspace", &key).await;
    assert_eq!(reply.error_code(), "workspace_suspended");
    assert!(reply.header("www-authenticate").is_none());
    let write = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert_eq!((write.status, write.error_code()), (403, "workspace_suspended"));

    stack.run_writer_command(&["workspace", "resume", &key.workspace_id]).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(time_until(&stack, &bearer, 200).await < Duration::from_secs(5));

    stack.run_writer_command(&["workspace", "delete", &key.workspace_id]).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(time_until(&stack, &bearer, 404).await < Duration::from_secs(5));
    let reply = stack.get("/v1/workspace", &key).await;
    assert_eq!(reply.error_code(), "workspace_not_found");
    assert!(reply.header("www-authenticate").is_none());

    let other = stack.workspace();
    assert_eq!(stack.get("/v1/workspace", &other).await.status, 200);
    stack.run_writer_command(&["key", "revoke", &other.key_id]).unwrap_or_else(|e| panic!("{e:#}"));
    assert!(time_until(&stack, &other.bearer(), 401).await < Duration::from_secs(5));
}

#[tokio::test]
async fn a_key_and_its_workspace_refused_at_once_answer_in_the_documented_order() {
    let stack = Stack::start().await;
    let command = |args: &[&str]| stack.run_writer_command(args).unwrap_or_else(|e| panic!("{e:#}"));
    // Each key is asked only after all its changes: the answer is the database's, not a cache's.
    let revoked_in_suspended = stack.workspace();
    command(&["workspace", "suspend", &revoked_in_suspended.workspace_id]);
    command(&["key", "revoke", &revoked_in_suspended.key_id]);
    let revoked_in_deleted = stack.workspace();
    command(&["workspace", "delete", &revoked_in_deleted.workspace_id]);
    command(&["key", "revoke", &revoked_in_deleted.key_id]);
    let suspended_then_deleted = stack.workspace();
    command(&["workspace", "suspend", &suspended_then_deleted.workspace_id]);
    command(&["workspace", "delete", &suspended_then_deleted.workspace_id]);
    let reader_in_suspended = stack.workspace_with_scopes("workspace:read");
    command(&["workspace", "suspend", &reader_in_suspended.workspace_id]);

    for (key, status, code) in [
        (&revoked_in_suspended, 401, "invalid_api_key"),
        (&revoked_in_deleted, 401, "invalid_api_key"),
        (&suspended_then_deleted, 404, "workspace_not_found"),
    ] {
        let reply = stack.get("/v1/workspace", key).await;
        assert_eq!((reply.status, reply.error_code()), (status, code), "{}", reply.body);
    }
    // A write with a read-only key of a suspended workspace: the suspension answers first.
    let reply = stack.post("/v1/conversions", &reader_in_suspended, &conversion("lead")).await;
    assert_eq!((reply.status, reply.error_code()), (403, "workspace_suspended"), "{}", reply.body);
}

#[tokio::test]
async fn error_order_auth_before_everything_else() {
    let stack = Stack::start().await;
    // Invalid body, query string and wrong scope: the missing key answers first.
    let reply = stack.send(Method::POST, "/v1/conversions?x=1", None, Some(&json!({"bad": true}))).await;
    assert_eq!(reply.error_code(), "missing_api_key");
    let reader = stack.workspace_with_scopes("workspace:read");
    let reply =
        stack.send(Method::POST, "/v1/conversions?x=1", Some(&reader.bearer()), Some(&json!({"bad": true}))).await;
    assert_eq!(reply.error_code(), "insufficient_scope", "scope before query string");
    let writer = stack.workspace_with_scopes("conversions:write");
    let reply =
        stack.send(Method::POST, "/v1/conversions?x=1", Some(&writer.bearer()), Some(&json!({"bad": true}))).await;
    assert_eq!((reply.status, reply.error_code()), (400, "query_not_allowed"));
    let reply =
        stack.send(Method::POST, "/v1/conversions/batch?dry_run=true", Some(&writer.bearer()), Some(&json!({}))).await;
    assert_eq!((reply.status, reply.error_code()), (400, "query_not_allowed"));
    let reply = stack.send(Method::GET, "/v1/workspace?x=1", Some(&writer.bearer()), None).await;
    assert_eq!(reply.error_code(), "insufficient_scope");
    let full = stack.workspace();
    assert_eq!(
        stack.send(Method::GET, "/v1/workspace?x=1", Some(&full.bearer()), None).await.status,
        200,
        "reads may carry a query"
    );
}
