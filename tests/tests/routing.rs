//! Routing, the error object, the alias base and GET /v1/workspace.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, stored_values, Stack};
use reqwest::Method;

#[tokio::test]
async fn unknown_paths_are_not_found_with_the_error_object() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let cases = [
        (Method::GET, "/"),
        (Method::GET, "/v1"),
        (Method::GET, "/v1/"),
        (Method::GET, "/api/v1"),
        (Method::GET, "/v1/conversions"),
        (Method::POST, "/v1/workspace"),
        (Method::DELETE, "/v1/conversions"),
        (Method::GET, "/v1/conversions/cnv_1"),
        (Method::POST, "/v2/conversions"),
        (Method::GET, "/favicon.ico"),
        (Method::PUT, "/api/v1/conversions/batch"),
    ];
    for (method, path) in cases {
        for authorization in [None, Some(key.bearer())] {
            let reply = stack.send(method.clone(), path, authorization.as_deref(), None).await;
            assert_eq!((reply.status, reply.error_code()), (404, "not_found"), "{method} {path}");
            assert!(reply.header("www-authenticate").is_none());
        }
    }
}

#[tokio::test]
async fn the_alias_base_serves_v1() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let (alias, v1) = (stack.get("/api/v1/workspace", &key).await, stack.get("/v1/workspace", &key).await);
    assert_eq!((alias.status, &alias.body), (200, &v1.body), "the same workspace answer on both bases");
    assert_eq!(alias.body["workspace"]["id"], json!(key.workspace_id));

    let input = conversion("lead");
    let created = stack.post("/api/v1/conversions", &key, &input).await;
    assert_eq!(created.status, 201, "{created:?}");
    let conversion = &created.body["conversion"];
    assert_eq!((&conversion["result"], &conversion["external_id"]), (&json!("created"), &input["external_id"]));
    let again = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!((again.status, &again.body["conversion"]["result"]), (200, &json!("unchanged")), "{again:?}");
    assert_eq!(again.body["conversion"]["id"], conversion["id"], "the conversion the alias stored");
    let batch = stack.post("/api/v1/conversions/batch", &key, &json!({"conversions": [input]})).await;
    assert_eq!(batch.status, 200, "{batch:?}");
    let item = &batch.body["results"][0];
    assert_eq!((&item["ok"], &item["conversion"]["result"]), (&json!(true), &json!("unchanged")), "{batch:?}");
    assert_eq!(item["conversion"]["id"], conversion["id"]);
    let stored = stored_values(&database().await, &key.workspace_id).await;
    let external_id = input["external_id"].as_str().unwrap_or_default();
    assert_eq!(stored.keys().collect::<Vec<_>>(), [external_id], "one row, stored through the alias");

    let missing = stack.send(Method::POST, "/api/v1/conversions", None, Some(&input)).await;
    assert_eq!((missing.status, missing.error_code()), (401, "missing_api_key"));
}

#[tokio::test]
async fn every_response_carries_a_request_id() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let ok = stack.get("/v1/workspace", &key).await;
    let created = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    let error = stack.send(Method::GET, "/nope", None, None).await;
    let ids: Vec<_> = [&ok, &created, &error].iter().map(|r| r.header("x-request-id").map(str::to_owned)).collect();
    assert!(ids.iter().all(Option::is_some), "{ids:?}");
    assert_eq!(error.body["error"]["request_id"], json!(ids[2]));
    assert_ne!(ids[0], ids[1]);
}

#[tokio::test]
async fn workspace_response() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let reply = stack.get("/v1/workspace", &key).await;
    assert_eq!(reply.status, 200);
    let body = &reply.body;
    assert_eq!(body["workspace"]["id"], json!(key.workspace_id));
    assert_eq!(body["workspace"]["name"], "Test");
    assert_eq!(body["workspace"]["status"], "active");
    assert_eq!(body["workspace"]["siteRestriction"], "any");
    assert!(body["workspace"]["projectId"].as_str().is_some_and(|p| !p.is_empty()));
    let src = body["script"]["src"].as_str().unwrap_or_default();
    assert!(src.starts_with("https://") && src.contains(&key.workspace_id), "{src}");
    assert!(body["script"]["snippet"].as_str().is_some_and(|s| s.contains(src)));
    assert_eq!(body["sites"], json!([{"host": "shop.example", "lastSeenAt": Value::Null}]));
    assert_eq!(body["key"]["id"], json!(key.key_id));
    assert_eq!(body["key"]["scopes"], json!(["workspace:read", "conversions:write"]));

    // A site seen by the tracking script: when, as an RFC 3339 UTC instant.
    sqlx::query("UPDATE sites SET last_seen_at = '2026-03-04 05:06:07.5+00' WHERE workspace_id = $1")
        .bind(&key.workspace_id)
        .execute(&intake_tests::database().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let reply = stack.get("/v1/workspace", &key).await;
    assert_eq!(reply.body["sites"], json!([{"host": "shop.example", "lastSeenAt": "2026-03-04T05:06:07.5Z"}]));
}

#[tokio::test]
async fn openapi_needs_no_key() {
    let stack = Stack::start().await;
    let mut documents = Vec::new();
    for path in ["/v1/openapi.json", "/api/v1/openapi.json"] {
        let reply = stack.send(Method::GET, path, None, None).await;
        assert_eq!(reply.status, 200);
        assert!(reply.body["openapi"].as_str().is_some_and(|v| v.starts_with("3.1")), "{:?}", reply.body);
        assert!(reply.body["paths"]["/conversions"]["post"].is_object(), "{:?}", reply.body["paths"]);
        documents.push(reply.body);
    }
    assert_eq!(documents[0], documents[1], "one document on both bases");
}
