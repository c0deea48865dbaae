//! Fixed windows in Redis (docs/api.md, "Rate limits"), against a real Redis. Tests that need a fresh
//! window start their gateway with a window of a few seconds; the minute's own behaviour is
//! checked on the default window.

use intake_tests::serde_json::{json, Value};
use intake_tests::{conversion, database, join_all, stored_count, wait_until, Reply, Stack, StackOptions, TestKey};
use reqwest::Method;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// A window short enough that waiting for a fresh one costs little.
fn short() -> StackOptions {
    StackOptions { rate_limit_window_ms: 5_000, ..StackOptions::default() }
}

/// A stack whose keys may write 10 conversions in a window of 10 s, a key of it, and the end
/// of the current window, which has at least 7 s left.
async fn ten_conversions_a_window() -> (Stack, TestKey, Instant) {
    let options = StackOptions { conversions_per_minute: 10, rate_limit_window_ms: 10_000, ..StackOptions::default() };
    Stack::with_window(options, Duration::from_secs(7)).await
}

/// A batch of `n` valid conversions.
fn batch(n: usize) -> Value {
    json!({"conversions": (0..n).map(|_| conversion("lead")).collect::<Vec<Value>>()})
}

/// 429 rate_limited, with a Retry-After of whole seconds within a window of `window_secs`.
fn assert_rate_limited_within(reply: &Reply, window_secs: u64) {
    assert_eq!((reply.status, reply.error_code()), (429, "rate_limited"), "{reply:?}");
    let retry_after: u64 = reply.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!((1..=window_secs).contains(&retry_after), "Retry-After {retry_after}");
}

fn assert_rate_limited(reply: &Reply) {
    assert_rate_limited_within(reply, 60);
}

/// Seconds until the current minute ends, rounded up, as the default window's headers say.
fn secs_to_the_minute_end() -> u64 {
    let ms = u64::try_from(intake_tests::now_ms()).unwrap_or(0);
    (60_000 - ms % 60_000).div_ceil(1_000)
}

#[tokio::test]
async fn sixty_four_concurrent_clients_get_exactly_600_requests_through() {
    let options = StackOptions { rate_limit_window_ms: 15_000, ..StackOptions::default() };
    let (stack, key, window_end) = Stack::with_window(options, Duration::from_secs(10)).await;
    let client = stack.client();
    let sends = (0..64).map(|_| {
        let (client, key) = (client.clone(), key.clone());
        async move {
            let mut statuses = Vec::new();
            for _ in 0..11 {
                statuses.push(client.send(Method::GET, "/v1/workspace", Some(&key.bearer()), None).await);
            }
            statuses
        }
    });
    let replies: Vec<Reply> = join_all(sends).await.into_iter().flatten().collect();
    let passed = replies.iter().filter(|r| r.status == 200).count();
    assert_eq!(passed, 600, "64 x 11 = 704 requests in one window");
    // Concurrent checks share round trips to Redis; each is still answered as if counted alone,
    // one after the other: every count from 1 to 600 was some request's.
    let mut remaining: Vec<u64> = replies
        .iter()
        .filter(|r| r.status == 200)
        .filter_map(|r| r.header("ratelimit-remaining").and_then(|v| v.parse().ok()))
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..600).collect::<Vec<u64>>(), "RateLimit-Remaining of the 600 passed");
    for reply in replies.iter().filter(|r| r.status != 200) {
        assert_rate_limited_within(reply, 15);
    }
    // Every endpoint counts against the same window, and is refused before the body is read.
    let write = stack.send(Method::POST, "/v1/conversions", Some(&key.bearer()), Some(&json!("not even json"))).await;
    assert_rate_limited_within(&write, 15);
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");
}

#[tokio::test]
async fn a_short_window_ends_when_retry_after_says() {
    let options = StackOptions { requests_per_minute: 2, rate_limit_window_ms: 2_000, ..short() };
    let (stack, key, _) = Stack::with_window(options, Duration::from_millis(1_500)).await;
    for _ in 0..2 {
        assert_eq!(stack.get("/v1/workspace", &key).await.status, 200);
    }
    let refused = stack.get("/v1/workspace", &key).await;
    assert_rate_limited_within(&refused, 2);
    // Waiting out Retry-After, as a client would, is what this test is about.
    let retry_after: u64 = refused.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    tokio::time::sleep(Duration::from_secs(retry_after)).await;
    let next = stack.get("/v1/workspace", &key).await;
    assert_eq!(next.status, 200, "a fresh window after Retry-After: {next:?}");
    assert_eq!(next.header("ratelimit-remaining"), Some("1"));
    let reset: u64 = next.header("ratelimit-reset").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!((1..=2).contains(&reset), "RateLimit-Reset {reset}");
}

#[tokio::test]
async fn ratelimit_headers_describe_the_request_window() {
    let stack = Stack::start().await;
    let key = stack.workspace();
    stack.window_with_at_least(Duration::from_secs(5)).await;
    let expected_reset = secs_to_the_minute_end();
    let first = stack.get("/v1/workspace", &key).await;
    let second = stack.post("/v1/conversions", &key, &json!({"bad": 1})).await;
    assert_eq!(first.header("ratelimit-limit"), Some("600"));
    assert_eq!(first.header("ratelimit-remaining"), Some("599"));
    assert_eq!(second.header("ratelimit-remaining"), Some("598"), "an error after the check counts too");
    let reset: u64 = first.header("ratelimit-reset").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!((1..=60).contains(&reset));
    assert!(
        expected_reset.abs_diff(reset) <= 1,
        "RateLimit-Reset {reset}: seconds to the minute's end, {expected_reset}"
    );
    let unauthenticated = stack.send(Method::GET, "/v1/workspace", None, None).await;
    assert!(unauthenticated.header("ratelimit-limit").is_none());
}

#[tokio::test]
async fn retry_after_is_the_seconds_to_the_end_of_the_minute() {
    let options = StackOptions { requests_per_minute: 1, ..StackOptions::default() };
    let (stack, key, _) = Stack::with_window(options, Duration::from_secs(5)).await;
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200);
    let expected = secs_to_the_minute_end();
    let refused = stack.get("/v1/workspace", &key).await;
    assert_rate_limited(&refused);
    let retry_after: u64 = refused.header("retry-after").and_then(|v| v.parse().ok()).unwrap_or(0);
    assert!(expected.abs_diff(retry_after) <= 1, "Retry-After {retry_after}: seconds to the minute's end, {expected}");
}

#[tokio::test]
async fn a_write_over_the_conversion_limit_is_refused_whole_and_not_counted() {
    let (stack, key, window_end) = ten_conversions_a_window().await;
    let mut with_invalid = batch(7);
    with_invalid["conversions"][3] = json!({"event": "bad!"});
    assert_eq!(
        stack.post("/v1/conversions/batch", &key, &with_invalid).await.status,
        200,
        "7 counted, invalid ones too"
    );
    let refused = stack.post("/v1/conversions/batch", &key, &batch(4)).await;
    assert_rate_limited(&refused);
    assert_eq!(
        stack.post("/v1/conversions/batch", &key, &batch(2)).await.status,
        200,
        "the refused 4 were not counted: 9"
    );
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201, "10");
    assert_rate_limited(&stack.post("/v1/conversions", &key, &conversion("lead")).await);
    let invalid = stack.post("/v1/conversions", &key, &json!({"event": "x"})).await;
    assert_eq!(invalid.error_code(), "validation_failed", "validation comes before the conversion limit");
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "reads are not conversions");
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");
    assert_eq!(
        stored_count(&database().await, &key.workspace_id).await,
        6 + 2 + 1,
        "nothing of the refused writes was written"
    );
}

#[tokio::test]
async fn concurrent_writes_are_counted_as_if_one_after_the_other() {
    let (stack, key, window_end) = ten_conversions_a_window().await;
    // In any order, two batches of 4 and the single fit under 10 and one batch of 4 does not.
    let client = stack.client();
    let sends = [4, 4, 4, 1].map(|n| {
        let (client, bearer, body) = (client.clone(), key.bearer(), batch(n));
        async move { (n, client.send(Method::POST, "/v1/conversions/batch", Some(&bearer), Some(&body)).await) }
    });
    let replies = join_all(sends).await;
    let refused: Vec<usize> = replies.iter().filter(|(_, r)| r.status == 429).map(|(n, _)| *n).collect();
    assert_eq!(refused, vec![4], "{replies:?}");
    for (_, reply) in replies.iter().filter(|(_, r)| r.status != 429) {
        assert_eq!(reply.status, 200, "{reply:?}");
    }
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");
    assert_eq!(stored_count(&database().await, &key.workspace_id).await, 9);
    assert_rate_limited(&stack.post("/v1/conversions/batch", &key, &batch(2)).await);
    assert_eq!(stack.post("/v1/conversions", &key, &conversion("lead")).await.status, 201, "the tenth");
}

#[tokio::test]
async fn keys_have_windows_of_their_own() {
    let stack = Stack::start_with(StackOptions { requests_per_minute: 3, ..short() }).await;
    let (a, b) = (stack.workspace(), stack.workspace());
    let window_end = stack.window_with_at_least(Duration::from_secs(4)).await;
    for _ in 0..3 {
        assert_eq!(stack.get("/v1/workspace", &a).await.status, 200);
    }
    assert_rate_limited_within(&stack.get("/v1/workspace", &a).await, 5);
    assert_eq!(stack.get("/v1/workspace", &b).await.status, 200);
    assert!(Instant::now() < window_end, "the requests took longer than the window: lengthen it");
}

struct Redis(Child);

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_redis(port: u16) -> Redis {
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("redis-server: {e}"));
    let redis = Redis(child);
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "redis-server did not listen on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
    redis
}

#[tokio::test]
async fn redis_down_or_hanging_lets_requests_through_without_stalling() {
    let port = intake_tests::free_port();
    let redis = start_redis(port);
    let options =
        // A Redis that hangs is waited for this long, then the request goes through.
        StackOptions {
            redis_url: Some(format!("redis://127.0.0.1:{port}")),
            requests_per_minute: 5,
            redis_timeout_ms: 200,
            ..short()
        };
    let (stack, key, _) = Stack::with_window(options, Duration::from_secs(4)).await;
    for _ in 0..5 {
        assert_eq!(stack.get("/v1/workspace", &key).await.status, 200);
    }
    assert_rate_limited_within(&stack.get("/v1/workspace", &key).await, 5);

    drop(redis);
    // Timed on reads, which pass the limiter and nothing else: a write's own time through Kafka
    // and PostgreSQL varies with the machine's load, and is not what a stall of Redis would add.
    for _ in 0..20 {
        let started = Instant::now();
        let reply = stack.get("/v1/workspace", &key).await;
        assert_eq!(reply.status, 200, "fail open: {reply:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "no stall");
    }
    // Writes pass both limits (requests and conversions), and are let through too.
    for _ in 0..3 {
        let started = Instant::now();
        let reply = stack.post("/v1/conversions", &key, &conversion("lead")).await;
        assert_eq!(reply.status, 201, "fail open: {reply:?}");
        assert!(started.elapsed() < Duration::from_secs(5), "no stall");
    }
    assert!(
        stack.metrics().await.value("intake_gateway_redis_fail_open_total") > 0.0,
        "the checks let through are counted"
    );
    let warned = || async { stack.logs().matches("rate limiter unavailable").count() };
    wait_until("the warning's log line", Duration::from_secs(5), || async { warned().await > 0 }).await;
    let warnings = warned().await;
    assert!(warnings <= 3, "warned at most once per interval, got {warnings}");

    // A Redis that accepts connections but never answers: the timeout lets requests through.
    let listener = std::net::TcpListener::bind(("127.0.0.1", port)).unwrap_or_else(|e| panic!("{e}"));
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in listener.incoming().flatten() {
            held.push(stream);
        }
    });
    let started = Instant::now();
    assert_eq!(stack.get("/v1/workspace", &key).await.status, 200);
    assert!(started.elapsed() < Duration::from_secs(1));
}

#[tokio::test]
async fn redis_back_after_an_outage_counts_again() {
    let port = intake_tests::free_port();
    let stack = Stack::start_with(StackOptions {
        redis_url: Some(format!("redis://127.0.0.1:{port}")),
        requests_per_minute: 3,
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    // No window to wait for: requests Redis did not see count nothing, and the loop below only
    // needs four requests in some window after Redis is back.
    for _ in 0..6 {
        assert_eq!(stack.get("/v1/workspace", &key).await.status, 200, "Redis not there yet: fail open");
    }
    let _redis = start_redis(port);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = stack.get("/v1/workspace", &key).await;
        if reply.status == 429 {
            assert_rate_limited(&reply);
            break;
        }
        assert!(Instant::now() < deadline, "the limit did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
