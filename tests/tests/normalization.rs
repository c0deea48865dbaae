//! Input hardening over HTTP (docs/api.md, "Identifiers that cannot be used"): text of other scripts and control
//! characters, phones of an unknown country, `value` kept exactly as a JSON number, and
//! `details` capped. Bodies are sent as raw text so that numbers arrive exactly as written.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, now_ms, stored_fields, Reply, Stack, TestKey};

async fn post(stack: &Stack, key: &TestKey, body: &Value) -> Reply {
    stack.post_text("/v1/conversions", key, body.to_string()).await
}

/// A conversion's JSON text with `extra` (`"name": value` pairs, as written) appended. One
/// fixed `occurred_at`, so that a re-send with an equal value is unchanged.
fn conversion_text(external_id: &str, extra: &str) -> String {
    let separator = if extra.is_empty() { "" } else { "," };
    format!(
        r#"{{"event":"lead","external_id":"{external_id}","occurred_at":"2025-01-01T00:00:00Z"{separator}{extra}}}"#
    )
}

fn fresh_id() -> String {
    conversion("lead")["external_id"].as_str().unwrap_or_default().to_owned()
}

fn warnings(answer: &Reply) -> Vec<&str> {
    answer.body["conversion"]["warnings"].as_array().into_iter().flatten().filter_map(Value::as_str).collect()
}

fn detail_paths(error: &Value) -> Vec<&str> {
    error["details"].as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect()
}

/// One stored column of a conversion, as text (`NULL` as `None`).
async fn stored(key: &TestKey, external_id: &str, column: &str) -> Option<String> {
    let row = stored_fields(&database().await, &key.workspace_id, "lead", external_id, &[column]).await;
    row.unwrap_or_else(|| panic!("{external_id} not stored")).remove(0)
}

/// Lower-case hex SHA-256 of `text`, computed by PostgreSQL.
async fn sha256(text: &str) -> String {
    sqlx::query_scalar("SELECT encode(sha256(convert_to($1, 'UTF8')), 'hex')")
        .bind(text)
        .fetch_one(&database().await)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

#[tokio::test]
async fn zip_digits_of_other_scripts_are_address_unparseable() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    // Arabic-Indic, Devanagari and full-width digits; a ZIP+4 of Arabic-Indic digits.
    for zip in ["٩٤١٠٥", "٩٤١٠٥-١٢٣٤", "९४१०५", "９４１０５"] {
        let mut input = conversion("lead");
        input["address"] = json!({"line1": "1 Main St", "zip": zip});
        let answer = post(&stack, &key, &input).await;
        assert_eq!(answer.status, 201, "{zip}: {}", answer.body);
        assert_eq!(warnings(&answer), vec!["address_unparseable"], "{zip}");
        let external_id = input["external_id"].as_str().unwrap_or_default();
        assert_eq!(stored(&key, external_id, "address_sha256").await, None, "{zip}");
    }
    // In a batch too, beside an item with an ASCII zip.
    let mut arabic = conversion("lead");
    arabic["address"] = json!({"line1": "1 Main St", "zip": "٩٤١٠٥-١٢٣٤"});
    let mut ascii = conversion("lead");
    ascii["address"] = json!({"line1": "1 Main St", "zip": "94105-1234"});
    let answer =
        stack.post_text("/v1/conversions/batch", &key, json!({"conversions": [arabic, ascii]}).to_string()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(answer.body["results"][0]["conversion"]["warnings"], json!(["address_unparseable"]));
    assert!(answer.body["results"][1]["conversion"]["warnings"].is_null(), "{}", answer.body);
    let external_id = ascii["external_id"].as_str().unwrap_or_default();
    assert_eq!(stored(&key, external_id, "address_sha256").await, Some(sha256("1 main st|94105|US").await));
}

#[tokio::test]
async fn phone_with_an_unknown_country_parses_from_its_plus() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("lead");
    input["country"] = json!("UK");
    input["phone"] = json!("+44 20 7946 0958");
    let answer = post(&stack, &key, &input).await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert!(warnings(&answer).is_empty(), "{}", answer.body);
    let external_id = input["external_id"].as_str().unwrap_or_default();
    assert_eq!(stored(&key, external_id, "phone_sha256").await, Some(sha256("+442079460958").await));
    assert_eq!(stored(&key, external_id, "country").await.as_deref(), Some("UK"));

    // Without a + there is no region to read it with.
    let mut national = conversion("lead");
    national["country"] = json!("UK");
    national["phone"] = json!("020 7946 0958");
    assert_eq!(warnings(&post(&stack, &key, &national).await), vec!["phone_unparseable"]);
}

#[tokio::test]
async fn control_characters_are_refused_or_make_identifiers_unusable() {
    let stack = Stack::start().await;
    let key = stack.workspace();

    // Stored text: 422 at the field's path, never a 500 from PostgreSQL.
    for (field, value) in [
        ("tags", json!({"c": "a\u{0}b"})),
        ("tags", json!({"c": "\u{7f}"})),
        ("hdyhau", json!("a\u{0}b")),
        ("contact_id", json!("c\u{1b}")),
        ("external_id", json!("x\u{0}")),
        ("parent_external_id", json!("\u{1f}p")),
    ] {
        let mut input = conversion("lead");
        input[field] = value;
        let answer = post(&stack, &key, &input).await;
        assert_eq!(
            (answer.status, answer.body["error"]["code"].as_str()),
            (422, Some("validation_failed")),
            "{field}: {}",
            answer.body
        );
        let path = if field == "tags" { "tags.c" } else { field };
        assert_eq!(detail_paths(&answer.body["error"]), vec![path]);
        assert_eq!(answer.body["error"]["request_id"].as_str(), answer.header("x-request-id"));
    }

    // Identifiers: a warning, the conversion saved without them.
    let mut input = conversion("lead");
    input["email"] = json!("ann@exa\u{0}mple.com");
    input["address"] = json!({"line1": "1 Main\u{0} St", "zip": "94105"});
    let answer = post(&stack, &key, &input).await;
    assert_eq!(answer.status, 201, "{}", answer.body);
    assert_eq!(warnings(&answer), vec!["email_invalid", "address_unparseable"]);
    let external_id = input["external_id"].as_str().unwrap_or_default();
    assert_eq!(stored(&key, external_id, "email_sha256").await, None);
    assert_eq!(stored(&key, external_id, "address_sha256").await, None);

    let mut zip = conversion("lead");
    zip["address"] = json!({"line1": "1 Main St", "zip": "94105\u{7}"});
    assert_eq!(warnings(&post(&stack, &key, &zip).await), vec!["address_unparseable"]);

    // In a batch the item is refused and the others are saved.
    let mut bad = conversion("lead");
    bad["tags"] = json!({"c": "a\u{0}b"});
    let good = conversion("lead");
    let answer = stack.post_text("/v1/conversions/batch", &key, json!({"conversions": [bad, good]}).to_string()).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    assert_eq!(detail_paths(&answer.body["results"][0]["error"]), vec!["tags.c"]);
    assert_eq!(answer.body["results"][1]["conversion"]["result"], "created");
    assert_eq!(answer.body["summary"], json!({"created": 1, "updated": 0, "unchanged": 0, "failed": 1}));
}

#[tokio::test]
async fn value_as_a_json_number_is_kept_exactly() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    for (number, expected) in [
        ("0.1", "0.1"),
        ("123456789.123456", "123456789.123456"),
        ("1000000000", "1000000000"),
        ("999999999.999999", "999999999.999999"),
        ("12.50", "12.5"),
        ("1.25e1", "12.5"),
        ("1e-05", "0.00001"),
        // A number is bounded by its range, not by the string form's six decimals.
        ("0.1234567", "0.1234567"),
        ("0.30000000000000004", "0.30000000000000004"),
    ] {
        let external_id = fresh_id();
        let answer = stack
            .post_text("/v1/conversions", &key, conversion_text(&external_id, &format!(r#""value":{number}"#)))
            .await;
        assert_eq!(answer.status, 201, "{number}: {}", answer.body);
        assert_eq!(stored(&key, &external_id, "value").await.as_deref(), Some(expected), "{number}");
    }

    // "12.50" and 12.5 are the same value: the re-send is unchanged.
    let external_id = fresh_id();
    let as_string = stack.post_text("/v1/conversions", &key, conversion_text(&external_id, r#""value":"12.50""#)).await;
    assert_eq!(as_string.status, 201, "{}", as_string.body);
    let as_number = stack.post_text("/v1/conversions", &key, conversion_text(&external_id, r#""value":12.5"#)).await;
    assert_eq!(as_number.body["conversion"]["result"], "unchanged", "{}", as_number.body);

    // Out of range, however it is written: refused.
    for number in ["1000000000.0000001", "1000000000.5", "1e10", "-0.5", "1e400"] {
        let answer = stack
            .post_text("/v1/conversions", &key, conversion_text(&fresh_id(), &format!(r#""value":{number}"#)))
            .await;
        assert_eq!(
            (answer.status, detail_paths(&answer.body["error"])),
            (422, vec!["value"]),
            "{number}: {}",
            answer.body
        );
    }
    // external_id as a JSON number must be an integer in range.
    for number in ["123.0", "1e3", "9007199254740992"] {
        let body = format!(r#"{{"event":"lead","external_id":{number},"occurred_at":{}}}"#, now_ms());
        let answer = stack.post_text("/v1/conversions", &key, body).await;
        assert_eq!(
            (answer.status, detail_paths(&answer.body["error"])),
            (422, vec!["external_id"]),
            "{number}: {}",
            answer.body
        );
    }
}

/// `count` unknown fields, as JSON members (`"u0":0,"u1":0`).
fn unknown_fields(count: usize) -> String {
    (0..count).map(|index| format!(r#""u{index}":0"#)).collect::<Vec<_>>().join(",")
}

#[tokio::test]
async fn details_are_capped_per_item_and_per_response() {
    let stack = Stack::start().await;
    let key = stack.workspace();

    let answer = stack.post_text("/v1/conversions", &key, conversion_text(&fresh_id(), &unknown_fields(3000))).await;
    assert_eq!(answer.status, 422, "{}", answer.body);
    let details = answer.body["error"]["details"].as_array().cloned().unwrap_or_default();
    assert_eq!(details.len(), 20);
    assert_eq!(details[0]["path"], "u0");
    assert_eq!(details[19], json!({"path": "", "message": "2981 more problems not listed"}));

    let envelope = format!(r#"{{"conversions":[],{}}}"#, unknown_fields(5000));
    let answer = stack.post_text("/v1/conversions/batch", &key, envelope).await;
    assert_eq!(answer.status, 422, "{}", answer.body);
    // The envelope's own field is named besides the 20 entries of unknown fields.
    assert_eq!(answer.body["error"]["details"].as_array().map(Vec::len), Some(21));
    let details = answer.body["error"]["details"].as_array().cloned().unwrap_or_default();
    assert!(details.iter().any(|detail| detail["path"] == "conversions"), "{}", answer.body);

    // A schema field's problem is named however many unknown fields come with it.
    let answer = stack
        .post_text(
            "/v1/conversions",
            &key,
            conversion_text(&fresh_id(), &format!(r#""currency":"EURO",{}"#, unknown_fields(3000))),
        )
        .await;
    let details = answer.body["error"]["details"].as_array().cloned().unwrap_or_default();
    assert_eq!(details.len(), 21, "{}", answer.body);
    assert!(details.iter().any(|detail| detail["path"] == "currency"), "{}", answer.body);

    // A batch of nearly 1 MiB of unknown fields: 500 items of 200 problems each.
    let items: Vec<String> = (0..500).map(|_| conversion_text(&fresh_id(), &unknown_fields(200))).collect();
    let body = format!(r#"{{"conversions":[{}]}}"#, items.join(","));
    assert!(body.len() < 1024 * 1024, "{}", body.len());
    let answer = stack.post_text("/v1/conversions/batch", &key, body).await;
    assert_eq!(answer.status, 200, "{}", answer.body);
    let results = answer.body["results"].as_array().cloned().unwrap_or_default();
    let lists: Vec<usize> =
        results.iter().map(|item| item["error"]["details"].as_array().map_or(0, Vec::len)).collect();
    assert_eq!(lists.len(), 500);
    assert_eq!(lists.iter().sum::<usize>(), 1000);
    assert!(lists.iter().all(|&count| (1..=20).contains(&count)), "{lists:?}");
    assert_eq!(results[0]["error"]["details"][19], json!({"path": "", "message": "181 more problems not listed"}));
    assert_eq!(results[499]["error"]["details"], json!([{"path": "", "message": "200 problems not listed"}]));
    assert!(answer.bytes < 200 * 1024, "response of {} bytes", answer.bytes);
}
