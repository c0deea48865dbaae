//! Pre-hashed identifiers (docs/api.md, "Pre-hashed identifiers"): `email_sha256`, `phone_sha256`
//! and `address_sha256` are stored where the gateway's own hashes go, so a re-send, `unchanged` and
//! erasure treat them alike; the raw and hashed form of one identifier together are refused at the
//! hashed path.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, stored_fields, Stack, TestKey};

const FIELDS: [&str; 3] = ["email_sha256", "phone_sha256", "address_sha256"];

/// Lower-case hex SHA-256 of `text`, computed by PostgreSQL.
async fn sha256(text: &str) -> String {
    sqlx::query_scalar("SELECT encode(sha256(convert_to($1, 'UTF8')), 'hex')")
        .bind(text)
        .fetch_one(&database().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The three hash columns of a conversion.
async fn stored_hashes(key: &TestKey, external_id: &Value) -> Vec<Option<String>> {
    let external_id = external_id.as_str().unwrap_or_default();
    let columns = ["email_sha256", "phone_sha256", "address_sha256"];
    let row = stored_fields(&database().await, &key.workspace_id, "lead", external_id, &columns).await;
    row.unwrap_or_else(|| panic!("{external_id} not stored"))
}

fn detail_paths(error: &Value) -> Vec<&str> {
    error["details"].as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect()
}

#[tokio::test]
async fn the_hashes_of_the_normalized_identifiers_are_the_same_conversion_unchanged() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut raw = conversion("lead");
    raw["email"] = json!("  Ann.Smith+crm@Example.COM ");
    raw["phone"] = json!("(415) 555-2671");
    raw["country"] = json!("US");
    raw["address"] = json!({"line1": "1 Main St., Apt 4", "zip": "94105-1234"});
    let created = stack.post("/v1/conversions", &key, &raw).await;
    assert_eq!(created.status, 201, "{created:?}");
    let expected = vec![
        Some(sha256("ann.smith+crm@example.com").await),
        Some(sha256("+14155552671").await),
        Some(sha256("1 main st apt 4|94105|US").await),
    ];
    assert_eq!(stored_hashes(&key, &raw["external_id"]).await, expected);

    // The same pair with the hashes instead of the raw identifiers: nothing changes.
    let mut hashed = raw.clone();
    for (field, hash) in FIELDS.iter().zip(&expected) {
        let raw_field = field.trim_end_matches("_sha256");
        hashed.as_object_mut().map(|object| object.remove(raw_field));
        hashed[*field] = json!(hash);
    }
    let unchanged = stack.post("/v1/conversions", &key, &hashed).await;
    assert_eq!((unchanged.status, unchanged.body["conversion"]["result"].clone()), (200, json!("unchanged")));
    assert_eq!(unchanged.body["conversion"]["id"], created.body["conversion"]["id"]);
    assert!(unchanged.body["conversion"].get("warnings").is_none(), "a pre-hashed field has no warning");

    // In a batch too, and a different hash is an update stored as sent.
    let other = sha256("someone.else@example.com").await;
    let mut changed = hashed.clone();
    changed["email_sha256"] = json!(other);
    let reply = stack.post("/v1/conversions/batch", &key, &json!({"conversions": [hashed, changed]})).await;
    assert_eq!(reply.body["summary"], json!({"created": 0, "updated": 1, "unchanged": 1, "failed": 0}), "{reply:?}");
    let stored = stored_hashes(&key, &raw["external_id"]).await;
    assert_eq!(stored[0].as_deref(), Some(other.as_str()));

    // Omitted, null or "" keeps the stored hash (docs/api.md, "Omitted, null and empty").
    let mut not_sent = raw.clone();
    for field in ["email", "phone", "address"] {
        not_sent.as_object_mut().map(|object| object.remove(field));
    }
    not_sent["email_sha256"] = json!(null);
    not_sent["phone_sha256"] = json!("");
    let kept = stack.post("/v1/conversions", &key, &not_sent).await;
    assert_eq!(kept.body["conversion"]["result"], "unchanged", "{kept:?}");
    assert_eq!(stored_hashes(&key, &raw["external_id"]).await, stored);
}

#[tokio::test]
async fn erasure_by_email_finds_conversions_stored_from_hashes() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let email_hash = sha256("ann@example.com").await;
    let phone_hash = sha256("+14155552671").await;
    // Sent hashed only...
    let mut hashed = conversion("lead");
    hashed["email_sha256"] = json!(email_hash);
    hashed["phone_sha256"] = json!(phone_hash);
    hashed["address_sha256"] = json!(sha256("1 main st|94105|US").await);
    // ...one step out through the phone hash, sent raw...
    let mut by_phone = conversion("lead");
    by_phone["phone"] = json!("+1 415 555 2671");
    by_phone["hdyhau"] = json!("a podcast");
    // ...and someone else.
    let mut other = conversion("lead");
    other["email_sha256"] = json!(sha256("bob@example.com").await);
    for input in [&hashed, &by_phone, &other] {
        assert_eq!(stack.post("/v1/conversions", &key, input).await.status, 201);
    }
    let erased = stack
        .run_writer_command_with_input(&["erase", "--workspace", &key.workspace_id, "--email"], " Ann@Example.com\n")
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 2, "visits": 0}));
    assert_eq!(stored_hashes(&key, &hashed["external_id"]).await, vec![None, None, None]);
    assert_eq!(stored_hashes(&key, &by_phone["external_id"]).await, vec![None, None, None]);
    assert!(stored_hashes(&key, &other["external_id"]).await[0].is_some(), "another person is kept");

    // Erasure by phone finds a conversion stored from phone_sha256 alone.
    let mut phone_only = conversion("lead");
    phone_only["phone_sha256"] = json!(phone_hash);
    assert_eq!(stack.post("/v1/conversions", &key, &phone_only).await.status, 201);
    let erased = stack
        .run_writer_command_with_input(
            &["erase", "--workspace", &key.workspace_id, "--phone", "--country", "US"],
            "(415) 555-2671\n",
        )
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 1, "visits": 0}));

    // One step out through an email hash sent pre-hashed: erasing a contact id finds the
    // conversion that carries it, and through its email_sha256 the one sent with the raw email.
    let contact = format!("crm-{}", &email_hash[..12]);
    let mut with_contact = conversion("lead");
    with_contact["contact_id"] = json!(contact);
    with_contact["email_sha256"] = json!(email_hash);
    let mut by_email = conversion("lead");
    by_email["email"] = json!("ANN@example.com");
    for input in [&with_contact, &by_email] {
        assert_eq!(stack.post("/v1/conversions", &key, input).await.status, 201);
    }
    let erased = stack
        .run_writer_command_with_input(&["erase", "--workspace", &key.workspace_id, "--contact-id"], &contact)
        .unwrap_or_else(|e| panic!("{e:#}"));
    assert_eq!(erased, json!({"conversions": 2, "visits": 0}));
    assert_eq!(stored_hashes(&key, &by_email["external_id"]).await, vec![None, None, None]);
}

#[tokio::test]
async fn malformed_or_doubled_identifiers_are_refused_at_the_hashed_path() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let hash = sha256("ann@example.com").await;
    let secret = format!("{}Z", &hash[1..]);
    for field in FIELDS {
        for bad in [json!(hash.to_uppercase()), json!(&hash[1..]), json!(format!("{hash}0")), json!(secret), json!(7)] {
            let mut input = conversion("lead");
            input[field] = bad.clone();
            let reply = stack.post("/v1/conversions", &key, &input).await;
            assert_eq!((reply.status, reply.error_code()), (422, "validation_failed"), "{field} = {bad}");
            assert_eq!(detail_paths(&reply.body["error"]), [field], "{field} = {bad}");
            assert!(!reply.body.to_string().contains(&secret[..20]), "the value is never quoted: {reply:?}");
        }
    }
    let mut both = conversion("lead");
    both["email"] = json!("ann@example.com");
    both["email_sha256"] = json!(hash);
    both["phone"] = json!("+14155552671");
    both["phone_sha256"] = json!(hash);
    both["address"] = json!({"line1": "1 Main St", "zip": "94105"});
    both["address_sha256"] = json!(hash);
    let single = stack.post("/v1/conversions", &key, &both).await;
    assert_eq!((single.status, single.error_code()), (422, "validation_failed"));
    assert_eq!(detail_paths(&single.body["error"]), FIELDS);

    // In a batch and a validation, an item error with the same paths.
    let body = json!({"conversions": [both, conversion("lead")]});
    let batch = stack.post("/v1/conversions/batch", &key, &body).await;
    assert_eq!(batch.status, 200);
    assert_eq!(detail_paths(&batch.body["results"][0]["error"]), FIELDS);
    assert_eq!(batch.body["summary"]["created"], 1);
    let validated = stack.post("/v1/conversions/validate", &key, &body).await;
    assert_eq!(detail_paths(&validated.body["results"][0]["error"]), FIELDS);
    assert_eq!(validated.body["summary"], json!({"valid": 1, "failed": 1}));
}
