//! The published normalization vectors (`docs/normalization-vectors.json`) through the real
//! HTTP interface: every case sent as a batch item, its warning answered and its hash stored
//! exactly as the vector says; and each client case's hash, sent pre-hashed, is that same
//! conversion unchanged.

use intake_tests::serde_json::{self, json, Value};
use intake_tests::{database, Stack};
use std::collections::HashMap;

fn vectors() -> Vec<Value> {
    let path = intake_tests::repo().join("docs/normalization-vectors.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let vectors: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(vectors["version"], 1);
    vectors["cases"].as_array().cloned().unwrap_or_default()
}

/// The conversion that carries a case's identifier, with the case's country.
fn item(case: &Value, external_id: &str) -> Value {
    let kind = case["kind"].as_str().unwrap_or_default();
    let mut item = json!({"event": "lead", "external_id": external_id, "occurred_at": "2025-01-01T00:00:00Z"});
    item[kind] = case["input"].clone();
    if !case["country"].is_null() {
        item["country"] = case["country"].clone();
    }
    item
}

#[tokio::test]
async fn every_vector_is_what_the_gateway_stores() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let cases = vectors();
    assert!(cases.len() >= 100);
    let items: Vec<Value> = cases.iter().enumerate().map(|(index, case)| item(case, &format!("v{index}"))).collect();
    let reply = stack.post("/v1/conversions/batch", &key, &json!({ "conversions": items })).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.body["summary"]["failed"], 0, "every vector is a valid input: {reply:?}");

    let rows: Vec<(String, Vec<Option<String>>)> = sqlx::query_as(
        "SELECT external_id, ARRAY[encode(email_digest, 'hex'), encode(phone_digest, 'hex'), encode(address_digest, 'hex')]
           FROM conversions WHERE workspace_id = $1",
    )
    .bind(&key.workspace_id)
    .fetch_all(&database().await)
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let stored: HashMap<String, Vec<Option<String>>> = rows.into_iter().collect();

    let mut pre_hashed = Vec::new();
    for (index, case) in cases.iter().enumerate() {
        let name = case["name"].as_str().unwrap_or_default();
        let column = match case["kind"].as_str() {
            Some("email") => 0,
            Some("phone") => 1,
            _ => 2,
        };
        let hashes = stored.get(&format!("v{index}")).unwrap_or_else(|| panic!("{name} not stored"));
        assert_eq!(hashes.get(column).cloned().flatten().as_deref(), case["sha256"].as_str(), "{name}");
        let warnings = &reply.body["results"][index]["conversion"]["warnings"];
        match case["warning"].as_str() {
            Some(warning) => assert_eq!(warnings, &json!([warning]), "{name}"),
            None => assert!(warnings.is_null(), "{name}: {warnings}"),
        }
        if case["client"] == true {
            if let Some(hash) = case["sha256"].as_str() {
                let kind = case["kind"].as_str().unwrap_or_default();
                let mut hashed = item(case, &format!("v{index}"));
                hashed.as_object_mut().map(|object| object.remove(kind));
                hashed[format!("{kind}_sha256")] = json!(hash);
                pre_hashed.push((name, hashed));
            }
        }
    }

    // What a client hashes itself is the same conversion, unchanged.
    assert!(pre_hashed.len() >= 50, "{} client cases with a hash", pre_hashed.len());
    let items: Vec<&Value> = pre_hashed.iter().map(|(_, item)| item).collect();
    let again = stack.post("/v1/conversions/batch", &key, &json!({ "conversions": items })).await;
    for (index, (name, _)) in pre_hashed.iter().enumerate() {
        assert_eq!(again.body["results"][index]["conversion"]["result"], "unchanged", "{name}: {again:?}");
    }
}
