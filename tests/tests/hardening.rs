//! The gateway under bad clients and overload (docs/architecture.md, "Admission"), and what it
//! tells its operator (docs/operations.md, "Metrics"; readiness, log lines): a panic is a 500
//! with its request id, slow and idle clients are cut off while well-behaved ones are served,
//! overload is refused with 503 before the body is read, a write has one deadline, and an
//! unknown key costs one query.

use intake_tests::raw_http1::Raw;
use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, free_port, join_all, wait_until, Stack, StackOptions};
use reqwest::Method;
use std::time::{Duration, Instant};

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|a| (*a).to_owned()).collect()
}

fn get(path: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: intake\r\n\r\n").into_bytes()
}

/// A write's head with a Content-Length, and no body.
fn write_head(path: &str, authorization: &str, length: usize) -> Vec<u8> {
    format!("POST {path} HTTP/1.1\r\nHost: intake\r\nAuthorization: {authorization}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n")
        .into_bytes()
}

#[tokio::test]
async fn a_panic_in_a_request_is_a_500_with_its_request_id_and_the_connection_lives_on() {
    let stack =
        Stack::start_with(StackOptions { gateway_args: args(&["--panic-test-route"]), ..Default::default() }).await;
    let mut connection = Raw::connect(&stack).await;
    connection.send(&get("/_test/panic")).await;
    let reply = connection.response().await.unwrap_or_else(|| panic!("the connection was dropped"));
    assert_eq!((reply.status, reply.error_code()), (500, "internal_error"), "{reply:?}");
    let request_id = reply.header("x-request-id").unwrap_or_default().to_owned();

    // The same connection serves the next request.
    connection.send(&get("/v1/openapi.json")).await;
    let next = connection.response().await.unwrap_or_else(|| panic!("the connection did not survive the panic"));
    assert_eq!(next.status, 200);

    wait_until("the panic's log line", Duration::from_secs(5), || async { stack.logs().contains("request panicked") })
        .await;
    let logs = stack.logs();
    let line =
        logs.lines().find(|l| l.contains("request panicked")).unwrap_or_else(|| panic!("no panic line in {logs}"));
    assert!(line.contains(&request_id), "the panic is logged with the request id: {line}");
    assert!(!logs.contains("the panic test route was called"), "a panic's message (it may quote input) is not logged");

    // Without the flag there is no such route.
    let plain = Stack::start().await;
    let reply = plain.send(reqwest::Method::GET, "/_test/panic", None, None).await;
    assert_eq!((reply.status, reply.error_code()), (404, "not_found"));
}

#[tokio::test]
async fn a_head_the_http_parser_refuses_gets_the_error_document_and_a_closed_connection() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let many_headers: String = (0..120).map(|i| format!("X-Extra-{i}: 1\r\n")).collect();
    let cases = [
        (
            format!(
                "POST /v1/conversions HTTP/1.1\r\nHost: intake\r\nAuthorization: {}\r\nContent-Length: ten\r\n\r\n",
                key.bearer()
            ),
            400,
            "malformed_request",
        ),
        (
            "POST /v1/conversions HTTP/1.1\r\nHost: intake\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n"
                .to_owned(),
            400,
            "malformed_request",
        ),
        ("NOT HTTP AT ALL\r\n\r\n".to_owned(), 400, "malformed_request"),
        (format!("GET /v1/{} HTTP/1.1\r\nHost: intake\r\n\r\n", "a".repeat(70_000)), 414, "uri_too_long"),
        (format!("GET /v1/workspace HTTP/1.1\r\nHost: intake\r\n{many_headers}\r\n"), 431, "headers_too_large"),
    ];
    for (request, status, code) in cases {
        let mut connection = Raw::connect(&stack).await;
        connection.send(request.as_bytes()).await;
        let reply = connection.response().await.unwrap_or_else(|| panic!("no response to {}", &request[..40]));
        assert_eq!((reply.status, reply.error_code()), (status, code), "{reply:?}");
        assert_eq!(reply.header("content-type"), Some("application/json"));
        assert_eq!(reply.header("connection"), Some("close"));
        assert!(connection.closed_after(Duration::from_secs(5)).await.is_some(), "closed after the {status}");
    }
    // Counted as requests, of no route.
    let metrics = stack.metrics().await;
    for (status, count) in [(400, 3.0), (414, 1.0), (431, 1.0)] {
        let series = format!("intake_gateway_requests_total{{route=\"unknown\",status=\"{status}\"}}");
        assert_eq!(metrics.value(&series), count, "{series} in\n{}", metrics.0);
    }
    // A 400 of the service's own passes as it is, on a connection that stays open.
    let mut own = Raw::connect(&stack).await;
    own.send(&[write_head("/v1/conversions", &key.bearer(), 9), b"{not json".to_vec()].concat()).await;
    let reply = own.response().await.unwrap_or_else(|| panic!("no response to invalid JSON"));
    assert_eq!((reply.status, reply.error_code()), (400, "invalid_json"), "{reply:?}");
    assert_eq!(reply.header("connection"), None);
    own.send(&get("/v1/openapi.json")).await;
    assert_eq!(own.response().await.map(|next| next.status), Some(200), "the connection serves on");
}

#[tokio::test]
async fn slow_heads_missing_bodies_and_idle_connections_are_cut_off() {
    let stack = Stack::start_with(StackOptions {
        gateway_args: args(&[
            "--header-read-timeout-ms",
            "1500",
            "--body-read-timeout-ms",
            "1000",
            "--keep-alive-timeout-ms",
            "500",
        ]),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();

    // Half a head, then nothing: closed after the header read timeout.
    let mut half_head = Raw::connect(&stack).await;
    half_head
        .send(
            format!("POST /v1/conversions HTTP/1.1\r\nHost: intake\r\nAuthorization: {}\r\nContent-", key.bearer())
                .as_bytes(),
        )
        .await;
    // A connection that sends nothing at all: the same.
    let mut silent = Raw::connect(&stack).await;
    let (half_head, silent) =
        tokio::join!(half_head.closed_after(Duration::from_secs(6)), silent.closed_after(Duration::from_secs(6)));
    for (client, closed) in [("half a head", half_head), ("silent", silent)] {
        let closed = closed.unwrap_or_else(|| panic!("{client}: still open after 6 s"));
        assert!(
            closed >= Duration::from_millis(1300) && closed < Duration::from_secs(4),
            "{client}: closed after {closed:?}"
        );
    }

    // A Content-Length and no body: 408 request_timeout after the body read timeout, then closed.
    let mut no_body = Raw::connect(&stack).await;
    let started = Instant::now();
    no_body.send(&write_head("/v1/conversions", &key.bearer(), 200)).await;
    let reply = no_body.response().await.unwrap_or_else(|| panic!("closed without a response"));
    let took = started.elapsed();
    assert_eq!((reply.status, reply.error_code()), (408, "request_timeout"), "{reply:?}");
    assert_eq!(reply.header("connection"), Some("close"));
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "answered after {took:?}");
    assert!(no_body.closed_after(Duration::from_secs(3)).await.is_some(), "closed after the 408");

    // A body trickled a byte at a time: the deadline is for the whole body, not each read.
    let body = conversion("lead").to_string();
    let mut trickle = Raw::connect(&stack).await;
    let started = Instant::now();
    trickle.send(&write_head("/v1/conversions", &key.bearer(), body.len())).await;
    for byte in body.as_bytes().iter().take(8) {
        trickle.send(&[*byte]).await;
        // A client trickling its body is what this test is about.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let reply = trickle.response().await.unwrap_or_else(|| panic!("closed without a response"));
    assert_eq!((reply.status, reply.error_code()), (408, "request_timeout"));
    assert!(started.elapsed() < Duration::from_secs(3));

    // Idle after a response: closed after the keep-alive timeout, well before the header timeout.
    let mut idle = Raw::connect(&stack).await;
    idle.send(&get("/v1/openapi.json")).await;
    assert_eq!(idle.response().await.map(|r| r.status), Some(200));
    let closed =
        idle.closed_after(Duration::from_secs(5)).await.unwrap_or_else(|| panic!("idle connection still open"));
    assert!(
        closed >= Duration::from_millis(400) && closed < Duration::from_millis(1300),
        "idle closed after {closed:?}"
    );
}

#[tokio::test]
async fn well_behaved_clients_are_served_fast_while_100_slow_clients_hang() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    let mut slow = Vec::new();
    for n in 0..100 {
        let mut client = Raw::connect(&stack).await;
        if n % 2 == 0 {
            client
                .send(
                    format!(
                        "GET /v1/workspace HTTP/1.1\r\nHost: intake\r\nAuthorization: {}\r\nX-Slow: ",
                        key.bearer()
                    )
                    .as_bytes(),
                )
                .await;
        } else {
            client.send(&write_head("/v1/conversions", &key.bearer(), 500)).await;
        }
        slow.push(client);
    }
    // The fast requests below are measured against that load: all 100 taken in first.
    stack.wait_connections(100.0).await;

    let mut took = Vec::new();
    for n in 0..30 {
        let started = Instant::now();
        let status = if n % 2 == 0 {
            stack.get("/v1/workspace", &key).await.status
        } else {
            stack.post("/v1/conversions", &key, &conversion("lead")).await.status
        };
        took.push(started.elapsed());
        assert!(status == 200 || status == 201, "{status}");
    }
    took.sort();
    println!("with 100 slow clients hanging: median {:?}, max {:?}", took[took.len() / 2], took[took.len() - 1]);
    assert!(took[took.len() / 2] < Duration::from_millis(250), "median {:?}", took[took.len() / 2]);
    assert!(took[took.len() - 1] < Duration::from_secs(1), "slowest {:?}", took[took.len() - 1]);
    drop(slow);
}

#[tokio::test]
async fn connections_beyond_the_cap_wait_for_a_free_slot() {
    let stack = Stack::start_with(StackOptions {
        gateway_args: args(&[
            "--max-connections",
            "5",
            "--header-read-timeout-ms",
            "1500",
            "--keep-alive-timeout-ms",
            "200",
        ]),
        ..Default::default()
    })
    .await;
    let mut holders = Vec::new();
    for _ in 0..5 {
        holders.push(Raw::connect(&stack).await);
    }
    stack.wait_connections(5.0).await;
    let started = Instant::now();
    let reply = stack.send(reqwest::Method::GET, "/v1/openapi.json", None, None).await;
    let waited = started.elapsed();
    assert_eq!(reply.status, 200, "a connection over the cap is served, not refused");
    assert!(waited >= Duration::from_millis(1000), "it waited for a slot: {waited:?}");
    assert!(waited < Duration::from_secs(4), "until the silent connections timed out: {waited:?}");
}

#[tokio::test]
async fn requests_beyond_the_cap_in_flight_get_503_at_once() {
    let stack = Stack::start_with(StackOptions {
        start_writer: false,
        write_timeout_ms: 3_000,
        gateway_args: args(&["--max-requests-in-flight", "2"]),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let hanging: Vec<_> = (0..2)
        .map(|_| {
            let (client, key) = (stack.client(), key.clone());
            tokio::spawn(async move { client.post("/v1/conversions", &key, &conversion("lead")).await.status })
        })
        .collect();
    stack.wait_writes_in_flight(2.0).await;
    let started = Instant::now();
    let reply = stack.get("/v1/workspace", &key).await;
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!((reply.status, reply.error_code()), (503, "service_unavailable"), "{reply:?}");
    assert_eq!(reply.header("retry-after"), Some("1"));
    for handle in hanging {
        assert_eq!(handle.await.unwrap_or_default(), 500, "no writer: the deadline passes");
    }
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "served again once the cap has room");
    let metrics = stack.metrics().await;
    assert_eq!(metrics.value("intake_gateway_load_shed_total{reason=\"requests_in_flight\"}"), 1.0, "{metrics:?}");
}

#[tokio::test]
async fn writes_beyond_the_cap_get_503_before_their_body_is_read() {
    let mut stack = Stack::start_with(StackOptions {
        start_writer: false,
        // One workspace may take the whole cap here: this is the gateway-wide cap.
        gateway_args: args(&["--max-writes-in-flight", "3", "--workspace-write-share-percent", "100"]),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    // Three workspaces fill the cap (each within its share of it); the fourth write is refused
    // for the cap, not for a workspace's share.
    let hanging: Vec<_> = (0..3)
        .map(|_| {
            let (client, key) = (stack.client(), stack.workspace());
            tokio::spawn(async move { client.post("/v1/conversions", &key, &conversion("lead")).await.status })
        })
        .collect();
    stack.wait_writes_in_flight(3.0).await;

    // The fourth write declares a body and sends none: answered at once, so the body was not awaited.
    let mut fourth = Raw::connect(&stack).await;
    let started = Instant::now();
    fourth.send(&write_head("/v1/conversions/batch", &key.bearer(), 5000)).await;
    let reply = fourth.response().await.unwrap_or_else(|| panic!("closed without a response"));
    assert!(started.elapsed() < Duration::from_millis(500), "answered after {:?}", started.elapsed());
    assert_eq!((reply.status, reply.error_code()), (503, "service_unavailable"), "{reply:?}");
    let retry_after: u64 = reply.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(retry_after >= 1, "Retry-After in whole seconds: {reply:?}");
    // Past the request rate limit: its headers are there, unless Redis was slow to answer on a
    // loaded machine and the check let the request through (fail-open, counted).
    let failed_open = stack.metrics().await.value("intake_gateway_redis_fail_open_total") > 0.0;
    assert!(
        reply.header("ratelimit-remaining").is_some() || failed_open,
        "it got past the request rate limit: {reply:?}"
    );
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "reads are not writes");

    stack.start_writer();
    for handle in hanging {
        assert_eq!(handle.await.unwrap_or_default(), 201, "the writes in flight are answered once a writer runs");
    }
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201);
    let metrics = stack.metrics().await;
    assert_eq!(metrics.value("intake_gateway_load_shed_total{reason=\"writes_in_flight\"}"), 1.0);
    assert_eq!(metrics.value("intake_gateway_writes_in_flight"), 0.0);
}

#[tokio::test]
async fn writes_get_503_while_the_writers_give_no_reply() {
    let mut stack = Stack::start_with(StackOptions {
        start_writer: false,
        gateway_args: args(&["--reply-stall-ms", "1000"]),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let first = {
        let (client, key) = (stack.client(), key.clone());
        tokio::spawn(async move { client.post("/v1/conversions", &key, &conversion("lead")).await.status })
    };
    // The stall time passing with no reply is what this test is about.
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // A write has waited over the stall time with no reply: a new one is refused at once.
    let started = Instant::now();
    let reply = stack.post("/v1/conversions", &key, &conversion("lead")).await;
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!((reply.status, reply.error_code()), (503, "service_unavailable"), "{reply:?}");
    assert_eq!(reply.header("retry-after"), Some("1"));

    // Replies come again: writes are admitted again.
    stack.start_writer();
    assert_eq!(first.await.unwrap_or_default(), 201);
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201);
    let metrics = stack.metrics().await;
    assert_eq!(metrics.value("intake_gateway_load_shed_total{reason=\"writers_behind\"}"), 1.0);
}

#[tokio::test]
async fn a_batch_of_500_without_a_writer_answers_within_the_deadline() {
    let stack =
        Stack::start_with(StackOptions { start_writer: false, write_timeout_ms: 2_000, ..Default::default() }).await;
    let key = stack.workspace();
    let items: Vec<Value> = (0..500).map(|_| conversion("lead")).collect();
    let started = Instant::now();
    let reply = stack.post("/v1/conversions/batch", &key, &json!({ "conversions": items })).await;
    let took = started.elapsed();
    assert_eq!((reply.status, reply.error_code()), (500, "internal_error"));
    assert!(took >= Duration::from_millis(1900) && took < Duration::from_millis(3000), "answered after {took:?}");

    // Five chunks, each carrying the request id to the writer in a Kafka header.
    let request_id = reply.header("x-request-id").unwrap_or_default().to_owned();
    let headers = request_id_headers(&format!("{}.requests", stack.topic_prefix), 5);
    assert_eq!(headers, vec![request_id; 5]);
}

/// The `request_id` header of the first `count` messages of a topic.
fn request_id_headers(topic: &str, count: usize) -> Vec<String> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::{Headers, Message};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", intake_tests::env("INTAKE_KAFKA_BROKERS"))
        .set("group.id", format!("inspect-{}", ulid::Ulid::new()))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap_or_else(|e| panic!("consumer: {e}"));
    consumer.subscribe(&[topic]).unwrap_or_else(|e| panic!("subscribe: {e}"));
    let mut found = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    while found.len() < count && Instant::now() < deadline {
        if let Some(Ok(message)) = consumer.poll(Duration::from_millis(200)) {
            let value = message
                .headers()
                .and_then(|headers| headers.iter().find(|h| h.key == "request_id").and_then(|h| h.value))
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            found.push(value);
        }
    }
    found
}

#[tokio::test]
async fn fifty_concurrent_requests_with_one_unknown_key_cost_one_query() {
    let stack = Stack::start().await;
    let unknown = format!("Bearer svc_live_{}", ulid::Ulid::new());
    let client = stack.client();
    let replies = join_all((0..50).map(|_| {
        let (client, unknown) = (client.clone(), unknown.clone());
        async move { client.send(reqwest::Method::GET, "/v1/workspace", Some(&unknown), None).await.status }
    }))
    .await;
    assert!(replies.iter().all(|status| *status == 401), "{replies:?}");
    let metrics = stack.metrics().await;
    assert_eq!(metrics.value("intake_gateway_key_cache_total{result=\"miss\"}"), 1.0, "one PostgreSQL query");
    assert_eq!(metrics.value("intake_gateway_key_cache_total{result=\"hit\"}"), 49.0);

    // Remembered briefly only: after the unknown-key time (1 s) it is looked up again. That time
    // passing is what is tested.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(stack.send(reqwest::Method::GET, "/v1/workspace", Some(&unknown), None).await.status, 401);
    assert_eq!(stack.metrics().await.value("intake_gateway_key_cache_total{result=\"miss\"}"), 2.0);
}

#[tokio::test]
async fn readiness_follows_kafka_and_postgresql_and_turns_on_sigterm_before_the_listener_closes() {
    let mut stack = Stack::start_with(StackOptions {
        start_writer: false,
        gateway_args: args(&["--shutdown-delay-ms", "1500"]),
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    let ops_url = stack.ops_url.clone();
    let ops = |path: &str| format!("{ops_url}{path}");
    let http = stack.http.clone();
    let status = |url: String| {
        let http = http.clone();
        async move { http.get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0) }
    };
    assert_eq!(status(ops("/readyz")).await, 200);
    assert_eq!(status(ops("/healthz")).await, 200);

    // A gateway whose PostgreSQL is unreachable and whose requests topic does not exist: alive,
    // not ready, and says why.
    let (port, ops_port) = (free_port(), free_port());
    let mut broken = stack.gateway_command(port, ops_port, 1);
    broken
        .env("DATABASE_URL", format!("postgres://postgres@127.0.0.1:{}/nothing", free_port()))
        .env("INTAKE_REQUESTS_TOPIC", format!("{}.missing", stack.topic_prefix))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut broken = broken.spawn().unwrap_or_else(|e| panic!("{e}"));
    let broken_ops = format!("http://127.0.0.1:{ops_port}");
    let mut readyz = (0, Value::Null);
    for _ in 0..100 {
        if let Ok(response) = stack.http.get(format!("{broken_ops}/readyz")).send().await {
            readyz = (response.status().as_u16(), response.json().await.unwrap_or(Value::Null));
            if readyz.1["failing"].as_array().is_some_and(|f| f.len() == 2) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(readyz, (503, json!({ "status": "not_ready", "failing": ["postgres", "kafka"] })));
    assert_eq!(status(format!("{broken_ops}/healthz")).await, 200);
    let _ = broken.kill();
    let _ = broken.wait();

    // SIGTERM: not ready at once, while the API still serves (the shutdown delay) and answers
    // what is in flight; then the listener closes and the gateway exits.
    let in_flight = {
        let (client, key) = (stack.client(), key.clone());
        tokio::spawn(async move { client.post("/v1/conversions", &key, &conversion("lead")).await.status })
    };
    stack.wait_writes_in_flight(1.0).await;
    let exited = stack.terminate_gateway();
    let terminated = Instant::now();
    wait_until("/readyz answering 503", Duration::from_millis(1_000), || async { status(ops("/readyz")).await == 503 })
        .await;
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "still serving during the shutdown delay");
    let closed =
        || async { reqwest::Client::new().get(format!("{}/v1/openapi.json", stack.base_url)).send().await.is_err() };
    wait_until("the listener closing", Duration::from_secs(10), closed).await;
    assert!(terminated.elapsed() >= Duration::from_millis(1_400), "the listener closed only after the 1.5 s delay");
    stack.start_writer();
    assert_eq!(in_flight.await.unwrap_or_default(), 201, "the write in flight was answered");
    let status = tokio::task::spawn_blocking(move || exited.join().ok().flatten()).await.ok().flatten();
    assert!(status.is_some_and(|s| s.success()), "exited cleanly: {status:?}");
}

#[tokio::test]
async fn metrics_count_requests_latency_kafka_round_trips_refusals_and_the_key_cache() {
    let options = StackOptions {
        requests_per_minute: 6,
        conversions_per_minute: 3,
        rate_limit_window_ms: 10_000,
        ..Default::default()
    };
    let (stack, key, window_end) = Stack::with_window(options, Duration::from_secs(7)).await;
    for _ in 0..3 {
        assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201);
    }
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 429, "over the conversion limit");
    for _ in 0..2 {
        assert_eq!(stack.get("/v1/workspace", &key).await.status, 200);
    }
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 429, "over the request limit");
    // Answered by its own refusal, although over the limit: not a refusal of the limit.
    let query = stack.post("/v1/conversions?debug=1", &key, &conversion("lead")).await;
    assert_eq!((query.status, query.error_code()), (400, "query_not_allowed"));
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");

    let metrics = stack.metrics().await;
    let expected = [
        ("intake_gateway_requests_total{route=\"conversions\",status=\"201\"}", 3.0),
        ("intake_gateway_requests_total{route=\"conversions\",status=\"429\"}", 1.0),
        ("intake_gateway_requests_total{route=\"workspace\",status=\"200\"}", 2.0),
        ("intake_gateway_requests_total{route=\"workspace\",status=\"429\"}", 1.0),
        ("intake_gateway_requests_total{route=\"conversions\",status=\"400\"}", 1.0),
        ("intake_gateway_request_seconds_count{route=\"conversions\",status=\"201\"}", 3.0),
        ("intake_gateway_kafka_roundtrip_seconds_count", 3.0),
        ("intake_gateway_writes_in_flight", 0.0),
        ("intake_gateway_ratelimit_refused_total{limit=\"requests\"}", 1.0),
        ("intake_gateway_ratelimit_refused_total{limit=\"conversions\"}", 1.0),
        ("intake_gateway_redis_fail_open_total", 0.0),
    ];
    for (series, value) in expected {
        assert_eq!(metrics.value(series), value, "{series} in\n{}", metrics.0);
    }
    let lookups = metrics.value("intake_gateway_key_cache_total{result=\"hit\"}")
        + metrics.value("intake_gateway_key_cache_total{result=\"miss\"}");
    assert_eq!(lookups, 8.0, "one key lookup per authenticated request");
    assert!(metrics.value("intake_gateway_key_cache_total{result=\"miss\"}") >= 1.0);
    assert!(metrics.value("intake_gateway_kafka_roundtrip_seconds_sum") > 0.0);
    for name in ["intake_gateway_load_shed", "intake_gateway_redis_fail_open", "intake_gateway_writes_in_flight"] {
        assert!(metrics.0.contains(&format!("# TYPE {name} ")), "{name} is exported before it counts anything");
    }
}

#[tokio::test]
async fn one_json_log_line_per_request_says_who_what_and_how_long_without_any_value() {
    let stack = Stack::start_with(StackOptions { gateway_args: args(&["--log-json"]), ..Default::default() }).await;
    let key = stack.workspace();
    let mut item = conversion("lead");
    item["email"] = json!("logline-secret@example.com");
    let mut bad = conversion("lead");
    bad["event"] = json!("not valid!");
    let reply =
        stack.post("/v1/conversions/batch", &key, &json!({ "conversions": [item, bad, conversion("lead")] })).await;
    assert_eq!(reply.status, 200);
    let request_id = reply.header("x-request-id").unwrap_or_default().to_owned();
    let unknown_key = "Bearer svc_live_logline0unknown0key000000000000000";
    let refused = stack.send(Method::POST, "/v1/conversions", Some(unknown_key), Some(&conversion("lead"))).await;
    assert_eq!(refused.status, 401);
    let refused_id = refused.header("x-request-id").unwrap_or_default().to_owned();
    let logged = || async {
        std::fs::read_to_string(stack.log_dir.join("gateway.log"))
            .is_ok_and(|log| log.contains(&request_id) && log.contains(&refused_id))
    };
    wait_until("the request's log line", Duration::from_secs(5), logged).await;

    let gateway_log = std::fs::read_to_string(stack.log_dir.join("gateway.log")).unwrap_or_default();
    let lines: Vec<Value> = gateway_log.lines().filter_map(|l| intake_tests::serde_json::from_str(l).ok()).collect();
    let of_request: Vec<&Value> = lines.iter().filter(|l| l["fields"]["request_id"] == json!(request_id)).collect();
    assert_eq!(of_request.len(), 1, "one line per request: {of_request:?}");
    let fields = &of_request[0]["fields"];
    assert_eq!(fields["message"], "request");
    assert_eq!(fields["route"], "conversions_batch");
    assert_eq!(fields["method"], "POST");
    assert_eq!(fields["status"], 200);
    assert_eq!(fields["workspace_id"], json!(key.workspace_id));
    assert_eq!(fields["key_id"], json!(key.key_id));
    assert_eq!(fields["items"], 3);
    assert!(fields["duration_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{fields}");
    assert!(!gateway_log.contains("logline-secret") && !gateway_log.contains("not valid!"), "no value is logged");

    let refused_line = lines.iter().find(|l| l["fields"]["request_id"] == json!(refused_id));
    let refused_fields = &refused_line.unwrap_or_else(|| panic!("no line for the refused request"))["fields"];
    assert_eq!(refused_fields["status"], 401);
    assert_eq!(refused_fields["route"], "conversions");
    let who = (refused_fields.get("workspace_id"), refused_fields.get("key_id"));
    assert_eq!(who, (None, None), "a request not authenticated has no ids: {refused_fields}");
}

#[tokio::test]
async fn a_log_destination_that_takes_nothing_holds_up_no_request() {
    let stack = Stack::start().await;
    // stderr a pipe that is never read: it is full after 64 KiB, a few hundred lines.
    let (port, ops_port) = (free_port(), free_port());
    let mut gateway = stack.gateway_command(port, ops_port, 1);
    gateway.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped());
    let mut gateway = gateway.spawn().unwrap_or_else(|e| panic!("{e}"));
    let base = format!("http://127.0.0.1:{port}");
    let http = stack.http.clone();
    let get = |path: &'static str| {
        let (http, url) = (http.clone(), format!("{base}{path}"));
        async move { http.get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0) }
    };
    wait_until("the gateway serves", Duration::from_secs(30), || async { get("/v1/openapi.json").await == 200 }).await;
    // Each request logs a line of about 200 bytes: 3,000 of them are ten pipes' worth.
    let started = Instant::now();
    for batch in 0..30 {
        let statuses = join_all((0..100).map(|_| get("/v1/nothing-here"))).await;
        assert!(statuses.iter().all(|s| *s == 404), "batch {batch}: {statuses:?}");
    }
    assert!(started.elapsed() < Duration::from_secs(30), "3,000 requests took {:?}", started.elapsed());
    let _ = gateway.kill();
    let _ = gateway.wait();
}
