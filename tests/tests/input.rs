//! The input contract over HTTP: error shapes, body limits, warnings, and that raw
//! email, phone and address never reach Kafka, PostgreSQL or a log line.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, raw_http, topic_contents, OwnDatabase, Stack, StackOptions};
use reqwest::Method;

#[tokio::test]
async fn every_bad_field_is_reported_at_once_without_its_value() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let body = json!({"event": "bad event!", "external_id": 1.5, "occurred_at": "SECRET-1", "email": "x".repeat(300),
        "address": {"line1": "SECRET-2", "zip": "", "unit": "4"}, "tags": {"Plan": "SECRET-3"}, "colour": "SECRET-4"});
    let reply = stack.post("/v1/conversions", &key, &body).await;
    assert_eq!((reply.status, reply.error_code()), (422, "validation_failed"));
    let mut paths: Vec<&str> =
        reply.body["error"]["details"].as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect();
    paths.sort_unstable();
    assert_eq!(
        paths,
        vec!["address.unit", "address.zip", "colour", "email", "event", "external_id", "occurred_at", "tags.Plan"]
    );
    let text = reply.body.to_string();
    for secret in ["SECRET-1", "SECRET-2", "SECRET-3", "SECRET-4", "bad event!", "xxxxxxxx"] {
        assert!(!text.contains(secret), "{secret} echoed in {text}");
    }
}

#[tokio::test]
async fn occurred_at_out_of_range_only_when_the_rest_is_valid() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("lead");
    input["occurred_at"] = json!("1999-12-31T23:59:59Z");
    let reply = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!((reply.status, reply.error_code()), (422, "occurred_at_out_of_range"));
    assert!(reply.body["error"]["details"].is_null());
    input["occurred_at"] = json!(intake_tests::now_ms() + 6 * 60 * 1000);
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.error_code(), "occurred_at_out_of_range");
    input["event"] = json!("");
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.error_code(), "validation_failed");
    input["event"] = json!("lead");
    input["occurred_at"] = json!(intake_tests::now_ms() + 4 * 60 * 1000);
    assert_eq!(stack.post("/v1/conversions", &key, &input).await.status, 201, "within the 5-minute tolerance");
}

#[tokio::test]
async fn invalid_json() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    for body in ["", "{", "{\"event\": }", "nul", "\u{0}"] {
        for path in ["/v1/conversions", "/v1/conversions/batch"] {
            let reply = stack
                .http
                .post(format!("{}{path}", stack.base_url))
                .header("Authorization", key.bearer())
                .header("Content-Type", "application/json")
                .body(body.to_owned())
                .send()
                .await;
            let reply = reply.unwrap_or_else(|e| panic!("{e}"));
            let status = reply.status().as_u16();
            let json: Value = reply.json().await.unwrap_or(Value::Null);
            assert_eq!((status, json["error"]["code"].as_str()), (400, Some("invalid_json")), "{path} {body:?}");
        }
    }
}

#[tokio::test]
async fn body_limits() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut big = conversion("lead");
    big["hdyhau"] = json!("x".repeat(33 * 1024));
    let reply = stack.post("/v1/conversions", &key, &big).await;
    assert_eq!((reply.status, reply.error_code()), (413, "payload_too_large"));

    // 32 KiB exactly is accepted as far as size goes (it then fails validation: hdyhau too long).
    let mut exact = conversion("lead");
    let filler = 32 * 1024 - exact.to_string().len() - ",\"hdyhau\":\"\"".len();
    exact["hdyhau"] = json!("y".repeat(filler));
    assert_eq!(exact.to_string().len(), 32 * 1024);
    assert_eq!(stack.post("/v1/conversions", &key, &exact).await.error_code(), "validation_failed");

    // A batch of 500 items stays under 1 MiB; one over 1 MiB is refused.
    let items: Vec<Value> = (0..500)
        .map(|_| {
            let mut c = conversion("lead");
            c["hdyhau"] = json!("z".repeat(2100));
            c
        })
        .collect();
    let reply = stack.post("/v1/conversions/batch", &key, &json!({"conversions": items})).await;
    assert_eq!((reply.status, reply.error_code()), (413, "payload_too_large"));
}

#[tokio::test]
async fn size_limit_holds_without_or_with_a_false_content_length() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    // Chunked, no Content-Length: cut off at the limit.
    let chunk = "a".repeat(8 * 1024);
    let mut request = format!("POST /v1/conversions HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n", key.bearer());
    for _ in 0..6 {
        request.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
    }
    request.push_str("0\r\n\r\n");
    let (status, body) = raw_http(&stack.base_url, request.as_bytes()).await;
    assert_eq!(status, 413, "{body}");
    assert!(body.contains("payload_too_large"), "{body}");

    // A declared length over the limit is refused before the body is read (none is sent here).
    let request = format!("POST /v1/conversions HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\nContent-Length: 50000000\r\nConnection: close\r\n\r\n", key.bearer());
    let (status, body) = raw_http(&stack.base_url, request.as_bytes()).await;
    assert_eq!(status, 413, "{body}");
}

#[tokio::test]
async fn unusable_identifiers_are_saved_with_warnings() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut input = conversion("lead");
    input["email"] = json!("not-an-email");
    input["phone"] = json!("12");
    input["address"] = json!({"line1": "1 Main St", "zip": "ABCDE", "country": "US"});
    let reply = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(reply.status, 201, "{reply:?}");
    assert_eq!(
        reply.body["conversion"]["warnings"],
        json!(["email_invalid", "phone_unparseable", "address_unparseable"])
    );

    // A stored hash is not overwritten by a dropped identifier.
    input["email"] = json!("ann@example.com");
    let reply = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(reply.body["conversion"]["result"], "updated");
    input["email"] = json!("broken@");
    let reply = stack.post("/v1/conversions", &key, &input).await;
    assert_eq!(reply.body["conversion"]["result"], "unchanged", "{reply:?}");
    assert_eq!(
        reply.body["conversion"]["warnings"],
        json!(["email_invalid", "phone_unparseable", "address_unparseable"])
    );
    let hash: Option<String> =
        sqlx::query_scalar("SELECT encode(email_digest, 'hex') FROM conversions WHERE workspace_id = $1")
            .bind(&key.workspace_id)
            .fetch_one(&database().await)
            .await
            .unwrap_or_default();
    assert_eq!(hash.as_deref(), Some("71d4f55f72fa128dfb468a1a3901507c804b74316488744d769d7f4b16696476"));
}

#[tokio::test]
async fn gzip_bodies_are_accepted_and_other_encodings_refused() {
    use std::io::Write;
    let stack = Stack::start().await;
    let key = stack.workspace();
    let input = conversion("lead");
    let mut encoder = flate2_encoder();
    let _ = encoder.write_all(input.to_string().as_bytes());
    let compressed = encoder.finish().unwrap_or_default();
    let send = |encoding: &'static str, body: Vec<u8>| {
        stack
            .http
            .post(format!("{}/v1/conversions", stack.base_url))
            .header("Authorization", key.bearer())
            .header("Content-Encoding", encoding)
            .header("Content-Type", "application/json")
            .body(body)
            .send()
    };
    let reply = send("gzip", compressed).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status().as_u16(), 201);
    let reply = send("br", input.to_string().into_bytes()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status().as_u16(), 415);
    let json: Value = reply.json().await.unwrap_or(Value::Null);
    assert_eq!(json["error"]["code"], "unsupported_media_type");
    // A bomb: 40 MiB of zeros in a few KiB.
    let mut bomb = flate2_encoder();
    let _ = bomb.write_all(&vec![b' '; 40 * 1024 * 1024]);
    let reply = send("gzip", bomb.finish().unwrap_or_default()).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(reply.status().as_u16(), 413);
}

fn flate2_encoder() -> flate2::write::GzEncoder<Vec<u8>> {
    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default())
}

#[tokio::test]
async fn raw_email_phone_and_address_reach_no_topic_table_or_log() {
    // A database of its own: the dump below reads every table whole, and the shared database
    // holds the whole suite's rows.
    let own = OwnDatabase::create("pii").await;
    let stack = Stack::start_with(StackOptions { database_url: Some(own.url.clone()), ..Default::default() }).await;
    let key = stack.workspace();
    let marker = format!("pii{}", ulid::Ulid::new().to_string().to_lowercase());
    let digits = &format!("{:07}", intake_tests::now_ms() % 10_000_000)[..7];
    let phone = format!("+1 415 {} {}", &digits[..3], &digits[3..]);
    let mut single = conversion("lead");
    single["email"] = json!(format!("{marker}@example.com"));
    single["phone"] = json!(phone);
    single["address"] = json!({"line1": format!("{marker} Main Street"), "zip": "94105"});
    assert_eq!(stack.post("/v1/conversions", &key, &single).await.status, 201);
    let mut item = conversion("purchase");
    item["email"] = json!(format!("{marker}.b@example.com"));
    item["address"] = json!({"line1": format!("{marker} Second Avenue"), "zip": "SECRETZIP", "country": "GB"});
    let mut invalid = conversion("purchase");
    invalid["email"] = json!(format!("{marker}-{}", "x".repeat(300)));
    let reply = stack.post("/v1/conversions/batch", &key, &json!({"conversions": [item, invalid]})).await;
    assert_eq!(reply.status, 200);
    let raw_phone_digits = format!("415{digits}");

    let dump = std::process::Command::new("pg_dump").arg(&own.url).output().unwrap_or_else(|e| panic!("pg_dump: {e}"));
    assert!(dump.status.success(), "{}", String::from_utf8_lossy(&dump.stderr));
    let dump = String::from_utf8_lossy(&dump.stdout).into_owned();
    assert!(dump.contains(&key.workspace_id), "the dump holds this test's data");
    let requests = topic_contents(&format!("{}.requests", stack.topic_prefix));
    assert!(requests.contains(&key.workspace_id), "the topic holds this test's messages");
    let places = [
        ("database dump", dump),
        ("requests topic", requests),
        ("replies topic", topic_contents(&format!("{}.replies", stack.topic_prefix))),
        ("logs", stack.logs()),
    ];
    for (place, text) in places {
        for raw in [marker.as_str(), raw_phone_digits.as_str(), "SECRETZIP", "Main Street", "main street"] {
            assert!(!text.contains(raw), "{raw} found in the {place}");
        }
    }
}

#[tokio::test]
async fn wrong_method_on_a_known_path_and_query_on_write() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let reply = stack.send(Method::POST, "/v1/conversions?", Some(&key.bearer()), Some(&conversion("lead"))).await;
    assert_eq!(reply.error_code(), "query_not_allowed");
}

/// The cause of the old flakiness of `body_limits`: a body refused with 413 before it was read,
/// while the client is still sending it. The server must close in stages (RFC 9112 9.6) so that
/// every write of the client succeeds and it then reads the 413, instead of its writes failing on
/// a reset connection ("error sending request"). Deterministic: the body goes out in pieces long
/// after the 413 was sent.
#[tokio::test]
async fn a_client_still_sending_a_refused_body_reads_the_413() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stack = Stack::start().await;
    let key = stack.workspace();
    let length = 2 * 1024 * 1024;
    let address = stack.base_url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(address).await.unwrap_or_else(|e| panic!("{e}"));
    let head = format!("POST /v1/conversions/batch HTTP/1.1\r\nHost: x\r\nAuthorization: {}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n", key.bearer());
    stream.write_all(head.as_bytes()).await.unwrap_or_else(|e| panic!("{e}"));
    // A client that sends its head, then its body in pieces over time, is what this test is about.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let piece = vec![b' '; 64 * 1024];
    for n in 0..length / piece.len() {
        stream.write_all(&piece).await.unwrap_or_else(|e| panic!("write {n} failed after the 413: {e}"));
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let mut response = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), stream.read_to_end(&mut response)).await;
    let response = String::from_utf8_lossy(&response);
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
    assert!(response.contains("payload_too_large"), "{response}");
}
