//! Fast tests of the API's HTTP behaviour: the real service, its layers and endpoints, over a
//! real HTTP/1.1 connection (an in-process pipe), with the world outside the process in memory:
//! keys ([`MemoryKeys`]), rate limits ([`MemoryLimits`]) and writes ([`MemorySink`]). They cover
//! every error path of the handlers; the end-to-end tests (tests/) prove the same paths on
//! PostgreSQL, Redis and Kafka.

use super::api_service;
use crate::auth::{MemoryKeys, Principal};
use crate::limits::MemoryLimits;
use crate::metrics::Metrics;
use crate::overload::{Admission, AdmittedWrite};
use crate::ratelimit::Counter;
use crate::request_body::RequestBody;
use crate::sink::{MemorySink, Outcome, WriteError, MEMORY_STAGES};
use crate::state::AppState;
use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use intake_model::error::ErrorCode;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tower::util::BoxCloneService;
use tower::ServiceExt;

const WRITE_SCOPES: [&str; 2] = ["conversions:write", "workspace:read"];
/// Requests and conversions per key: more than any test sends unless it means to.
const LIMIT: u64 = 1_000;
/// The writes in flight at most; a quarter of them (one) per workspace.
const MAX_WRITES: usize = 4;

type ClientBody = BoxBody<Bytes, Infallible>;
type Service = BoxCloneService<http::Request<RequestBody>, http::Response<super::Body>, Infallible>;

struct Api {
    state: Arc<AppState>,
    sink: Arc<MemorySink>,
    service: Service,
}

struct Settings {
    requests_per_key: u64,
    max_requests_in_flight: usize,
    body_read_timeout: Duration,
    panic_test_route: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            requests_per_key: LIMIT,
            max_requests_in_flight: 64,
            body_read_timeout: Duration::from_secs(10),
            panic_test_route: false,
        }
    }
}

fn principal(key: &str, workspace: &str, scopes: &[&str]) -> Result<Principal, ErrorCode> {
    Ok(Principal {
        key_id: format!("key_{key}").into(),
        workspace_id: workspace.into(),
        scopes: scopes.iter().map(|s| (*s).to_owned()).collect(),
    })
}

fn api() -> Api {
    api_with(Settings::default())
}

fn api_with(settings: Settings) -> Api {
    let keys = MemoryKeys::default()
        .with("svc_live_good", principal("good", "ws_good", &WRITE_SCOPES))
        .with("svc_live_other", principal("other", "ws_other", &WRITE_SCOPES))
        .with("svc_live_busy", principal("busy", "ws_busy", &WRITE_SCOPES))
        .with("svc_live_readonly", principal("readonly", "ws_good", &["workspace:read"]))
        .with("svc_live_deleted", Err(ErrorCode::WorkspaceNotFound))
        .with("svc_live_suspended", Err(ErrorCode::WorkspaceSuspended));
    let sink = Arc::new(MemorySink::default());
    let metrics = Metrics::new();
    let state = Arc::new(AppState {
        // Never connected: GET /v1/workspace's answer is the end-to-end tests' to prove.
        pool: sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(100))
            .connect_lazy("postgres://intake@127.0.0.1:9/none")
            .unwrap_or_else(|error| panic!("a lazy pool: {error}")),
        auth: Arc::new(keys),
        limiter: Arc::new(MemoryLimits::new(settings.requests_per_key, LIMIT)),
        writes: sink.clone(),
        admission: Admission::new(MAX_WRITES, 25, Duration::from_secs(60), metrics.clone()),
        metrics,
        script_base_url: "https://cdn.test".into(),
        body_read_timeout: settings.body_read_timeout,
        panic_test_route: settings.panic_test_route,
    });
    let service = BoxCloneService::new(api_service(state.clone(), settings.max_requests_in_flight));
    Api { state, sink, service }
}

/// A response as a client sees it.
struct Reply {
    status: u16,
    headers: http::HeaderMap,
    body: Value,
}

impl Reply {
    fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    fn has_ratelimit_headers(&self) -> bool {
        ["ratelimit-limit", "ratelimit-remaining", "ratelimit-reset"].iter().all(|h| self.headers.contains_key(*h))
    }
}

impl Api {
    /// Sends one request on a connection of its own.
    async fn send(&self, request: http::Request<ClientBody>) -> Reply {
        let (client, server) = tokio::io::duplex(1 << 20);
        let api = self.service.clone();
        // As the server does: hyper's body wrapped in the one the handlers get (HTTP/1.1 here).
        let service = TowerToHyperService::new(tower::service_fn(move |request| {
            let (request, _fate) = RequestBody::wrap(request, true);
            api.clone().oneshot(request)
        }));
        tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(server), service));
        let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(client))
            .await
            .unwrap_or_else(|error| panic!("handshake: {error}"));
        tokio::spawn(connection);
        let response = sender.send_request(request).await.unwrap_or_else(|error| panic!("request: {error}"));
        let (parts, body) = response.into_parts();
        let bytes = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply { status: parts.status.as_u16(), headers: parts.headers, body }
    }

    async fn post(&self, path: &str, key: Option<&str>, body: impl Into<Bytes>) -> Reply {
        self.send(request("POST", path, key, Full::new(body.into()).boxed())).await
    }

    async fn post_json(&self, path: &str, key: &str, body: &Value) -> Reply {
        self.post(path, Some(key), body.to_string()).await
    }

    async fn get(&self, path: &str, key: Option<&str>) -> Reply {
        self.send(request("GET", path, key, Full::default().boxed())).await
    }

    /// Takes the workspace's whole share of the writes in flight until it is dropped.
    fn fill_admission(&self, workspace_id: &str) -> AdmittedWrite {
        self.state.admission.admit_write(workspace_id).unwrap_or_else(|_| panic!("admitted"))
    }

    /// Uses up the key's whole limit.
    async fn spend(&self, key_id: &str, counter: Counter) {
        assert!(self.state.limiter.check(key_id, counter, LIMIT).await.is_ok());
    }
}

fn request(method: &str, path: &str, key: Option<&str>, body: ClientBody) -> http::Request<ClientBody> {
    let mut builder = http::Request::builder().method(method).uri(path).header("host", "gateway.test");
    if let Some(key) = key {
        builder = builder.header("authorization", format!("Bearer {key}"));
    }
    builder.body(body).unwrap_or_else(|error| panic!("request: {error}"))
}

fn conversion(external_id: &str) -> Value {
    json!({ "event": "lead", "external_id": external_id, "occurred_at": "2026-01-02T03:04:05Z" })
}

const SINGLE: &str = "/v1/conversions";
const BATCH: &str = "/v1/conversions/batch";
const VALIDATE: &str = "/v1/conversions/validate";

#[tokio::test]
async fn the_checks_answer_in_the_documented_order() {
    let api = api();
    let too_large = vec![b' '; 33 * 1024];
    // Each request fails every check from its own on; the first failing check answers.
    let reply = api.post("/v1/conversion?x=1", None, too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (404, "not_found"));
    let reply = api.post("/v1/conversions?x=1", None, too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (401, "missing_api_key"));
    let reply = api.post("/v1/conversions?x=1", Some("svc_live_unknown"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (401, "invalid_api_key"));
    let reply = api.post("/v1/conversions?x=1", Some("svc_live_deleted"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (404, "workspace_not_found"));
    let reply = api.post("/v1/conversions?x=1", Some("svc_live_suspended"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (403, "workspace_suspended"));
    let reply = api.post("/v1/conversions?x=1", Some("svc_live_readonly"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (403, "insufficient_scope"));

    api.spend("key_busy", Counter::Requests).await;
    let _held = api.fill_admission("ws_busy");
    let reply = api.post("/v1/conversions?x=1", Some("svc_live_busy"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (400, "query_not_allowed"));
    let reply = api.post(SINGLE, Some("svc_live_busy"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (429, "rate_limited"));

    let _held = api.fill_admission("ws_other");
    let reply = api.post(SINGLE, Some("svc_live_other"), too_large.clone()).await;
    assert_eq!((reply.status, reply.code()), (503, "service_unavailable"));

    api.spend("key_good", Counter::Conversions).await;
    let reply = api.post(SINGLE, Some("svc_live_good"), too_large).await;
    assert_eq!((reply.status, reply.code()), (413, "payload_too_large"));
    let reply = api.post(SINGLE, Some("svc_live_good"), "{\"event\": ").await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_json"));
    let both = json!({ "event": "lead!", "external_id": "A1", "occurred_at": "1999-12-31T00:00:00Z" });
    let reply = api.post_json(SINGLE, "svc_live_good", &both).await;
    assert_eq!((reply.status, reply.code()), (422, "validation_failed"));
    assert_eq!(reply.body["error"]["details"][0]["path"], "event", "the fields first, then the range");
    let early = json!({ "event": "lead", "external_id": "A1", "occurred_at": "1999-12-31T00:00:00Z" });
    let reply = api.post_json(SINGLE, "svc_live_good", &early).await;
    assert_eq!((reply.status, reply.code()), (422, "occurred_at_out_of_range"));
    let reply = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!((reply.status, reply.code()), (429, "rate_limited"));
    assert!(api.sink.chunks().is_empty(), "nothing refused was written");
}

#[tokio::test]
async fn every_response_carries_its_request_id_and_errors_repeat_it() {
    let api = api();
    for reply in [
        api.get("/nowhere", None).await,
        api.post(SINGLE, None, "{}").await,
        api.post(SINGLE, Some("svc_live_good"), "[").await,
        api.get("/v1/openapi.json", None).await,
        api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await,
    ] {
        let id = reply.header("x-request-id").unwrap_or_default();
        assert!(id.starts_with("req_"), "{id:?}");
        if reply.status >= 400 {
            assert_eq!(reply.body["error"]["request_id"], id);
            assert!(reply.body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
    }
}

#[tokio::test]
async fn refused_keys_get_www_authenticate() {
    let api = api();
    let missing = api.post(SINGLE, None, "{}").await;
    assert_eq!(missing.header("www-authenticate"), Some("Bearer realm=\"conversions\""));
    let invalid = api.post(SINGLE, Some("svc_live_unknown"), "{}").await;
    assert_eq!(invalid.header("www-authenticate"), Some("Bearer realm=\"conversions\", error=\"invalid_token\""));
    let scope = api.post(SINGLE, Some("svc_live_readonly"), "{}").await;
    assert_eq!(
        scope.header("www-authenticate"),
        Some("Bearer realm=\"conversions\", error=\"insufficient_scope\", scope=\"conversions:write\"")
    );
    for reply in [
        api.post(SINGLE, Some("svc_live_deleted"), "{}").await,
        api.post(SINGLE, Some("svc_live_suspended"), "{}").await,
    ] {
        assert_eq!(reply.header("www-authenticate"), None, "{}", reply.code());
    }
}

#[tokio::test]
async fn ratelimit_headers_on_every_response_past_the_request_limit() {
    let api = api_with(Settings { requests_per_key: 10, ..Settings::default() });
    let created = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!(created.status, 201);
    assert_eq!(created.header("ratelimit-limit"), Some("10"));
    assert_eq!(created.header("ratelimit-remaining"), Some("9"));
    assert_eq!(created.header("ratelimit-reset"), Some("42"));
    let _held = api.fill_admission("ws_other");
    for reply in [
        api.post(SINGLE, Some("svc_live_good"), "{").await,
        api.post(SINGLE, Some("svc_live_good"), vec![b' '; 33 * 1024]).await,
        api.post_json(SINGLE, "svc_live_good", &json!({})).await,
        api.post(SINGLE, Some("svc_live_other"), "{}").await,
        api.post_json(VALIDATE, "svc_live_good", &json!({ "conversions": [conversion("A1")] })).await,
    ] {
        assert!(reply.has_ratelimit_headers(), "{} {}", reply.status, reply.code());
    }
    for reply in [
        api.get("/nowhere", Some("svc_live_good")).await,
        api.post(SINGLE, None, "{}").await,
        api.post(SINGLE, Some("svc_live_readonly"), "{}").await,
        api.post("/v1/conversions?x=1", Some("svc_live_good"), "{}").await,
        api.get("/v1/openapi.json", Some("svc_live_good")).await,
    ] {
        assert!(!reply.has_ratelimit_headers(), "{} {}", reply.status, reply.code());
    }
}

#[tokio::test]
async fn requests_refused_for_scope_or_query_count_against_the_request_limit() {
    let api = api_with(Settings { requests_per_key: 2, ..Settings::default() });
    let query = api.post("/v1/conversions?x=1", Some("svc_live_good"), "{}").await;
    assert_eq!((query.status, query.code()), (400, "query_not_allowed"));
    let created = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!(
        (created.status, created.header("ratelimit-remaining")),
        (201, Some("0")),
        "the refused request counted"
    );
    let limited = api.post_json(SINGLE, "svc_live_good", &conversion("A2")).await;
    assert_eq!((limited.status, limited.code()), (429, "rate_limited"));

    for _ in 0..2 {
        let scope = api.post(SINGLE, Some("svc_live_readonly"), "{}").await;
        assert_eq!((scope.status, scope.code()), (403, "insufficient_scope"));
    }
    let scope = api.post(SINGLE, Some("svc_live_readonly"), "{}").await;
    assert_eq!((scope.status, scope.code()), (403, "insufficient_scope"), "the error order answers first");
    let read = api.get("/v1/workspace", Some("svc_live_readonly")).await;
    assert_eq!((read.status, read.code()), (429, "rate_limited"), "two refused requests used the key's limit");
}

#[tokio::test]
async fn refusals_for_load_say_when_to_retry() {
    let api = api_with(Settings { requests_per_key: 1, ..Settings::default() });
    assert_eq!(api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await.status, 201);
    let limited = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!((limited.status, limited.code()), (429, "rate_limited"));
    assert_eq!(limited.header("retry-after"), Some("42"));
    assert!(!limited.has_ratelimit_headers(), "a refused request is not counted");

    let _held = api.fill_admission("ws_other");
    let overloaded = api.post_json(SINGLE, "svc_live_other", &conversion("A1")).await;
    assert_eq!((overloaded.status, overloaded.code()), (503, "service_unavailable"));
    assert_eq!(overloaded.header("retry-after"), Some("1"));
}

#[tokio::test]
async fn the_conversion_limit_counts_every_item_of_a_batch() {
    let api = api();
    assert!(api.state.limiter.check("key_good", Counter::Conversions, LIMIT - 2).await.is_ok());
    let three = json!({ "conversions": [conversion("A1"), conversion("A2"), { "event": "lead" }] });
    let refused = api.post_json(BATCH, "svc_live_good", &three).await;
    assert_eq!((refused.status, refused.code()), (429, "rate_limited"));
    assert_eq!(refused.header("retry-after"), Some("42"));
    assert!(refused.has_ratelimit_headers(), "the request limit's headers");
    let two = json!({ "conversions": [conversion("A1"), { "event": "lead" }] });
    assert_eq!(api.post_json(BATCH, "svc_live_good", &two).await.status, 200);
}

#[tokio::test]
async fn a_body_that_does_not_arrive_in_time_is_408() {
    let api = api_with(Settings { body_read_timeout: Duration::from_millis(100), ..Settings::default() });
    let mut stalled = request("POST", SINGLE, Some("svc_live_good"), Stalled(Some(Bytes::from("{"))).boxed());
    stalled.headers_mut().insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(100));
    let reply = api.send(stalled).await;
    assert_eq!((reply.status, reply.code()), (408, "request_timeout"));
    // HTTP/1.1 here: the connection closes after the 408 (HTTP/2's message: tests/tests/tls_http2.rs).
    let message = reply.body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("the connection is closed"), "{message}");
}

/// A body that sends its first bytes and then nothing, never ending.
struct Stalled(Option<Bytes>);

impl hyper::body::Body for Stalled {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.0.take() {
            Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
            None => Poll::Pending,
        }
    }
}

#[tokio::test]
async fn bodies_over_the_limits_and_unknown_encodings_are_refused() {
    let api = api();
    let single = api.post(SINGLE, Some("svc_live_good"), vec![b' '; 32 * 1024 + 1]).await;
    assert_eq!((single.status, single.code()), (413, "payload_too_large"));
    let batch = api.post(BATCH, Some("svc_live_good"), vec![b' '; 1024 * 1024 + 1]).await;
    assert_eq!((batch.status, batch.code()), (413, "payload_too_large"));
    let mut brotli = request("POST", SINGLE, Some("svc_live_good"), Full::new(Bytes::from("{}")).boxed());
    brotli.headers_mut().insert(http::header::CONTENT_ENCODING, http::HeaderValue::from_static("br"));
    let reply = api.send(brotli).await;
    assert_eq!((reply.status, reply.code()), (415, "unsupported_media_type"));
}

/// serde_json hands a number to a visitor as an object of one name; a client that sends that
/// object where a number may be is refused like any other object there.
#[tokio::test]
async fn an_object_named_like_serde_jsons_numbers_is_not_a_number() {
    let api = api();
    let body = r#"{"event": "lead", "external_id": {"$serde_json::private::Number": "42"}, "occurred_at": 1767323045000,
        "value": {"$serde_json::private::Number": "1"}}"#;
    let reply = api.post(SINGLE, Some("svc_live_good"), body).await;
    assert_eq!((reply.status, reply.code()), (422, "validation_failed"), "{:?}", reply.body);
    let paths: Vec<&str> =
        reply.body["error"]["details"].as_array().into_iter().flatten().filter_map(|d| d["path"].as_str()).collect();
    assert_eq!(paths, ["external_id", "value"]);
    assert!(api.sink.chunks().is_empty());
}

#[tokio::test]
async fn a_send_is_created_then_unchanged_then_updated() {
    let api = api();
    let created = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!(created.status, 201);
    let body = &created.body["conversion"];
    assert_eq!((body["event"].as_str(), body["external_id"].as_str()), (Some("lead"), Some("A1")));
    assert_eq!(body["result"], "created");
    assert!(body["id"].as_str().is_some_and(|id| id.starts_with("cnv_")));
    assert!(body["chain_id"].as_str().is_some_and(|id| id.starts_with("chn_")));
    assert_eq!(body.get("warnings"), None, "no warnings, no field");

    let unchanged = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!((unchanged.status, &unchanged.body["conversion"]["result"]), (200, &json!("unchanged")));
    assert_eq!(unchanged.body["conversion"]["id"], body["id"]);
    let mut changed = conversion("A1");
    changed["value"] = json!("12.50");
    let updated = api.post_json(SINGLE, "svc_live_good", &changed).await;
    assert_eq!((updated.status, &updated.body["conversion"]["result"]), (200, &json!("updated")));

    let other_workspace = api.post_json(SINGLE, "svc_live_other", &conversion("A1")).await;
    assert_eq!(other_workspace.status, 201, "workspaces do not share conversions");
}

#[tokio::test]
async fn warnings_are_answered_and_raw_identifiers_never_reach_the_sink() {
    let api = api();
    let mut input = conversion("A1");
    input["email"] = json!("not an email");
    input["phone"] = json!("+1 202 555 0143");
    let reply = api.post_json(SINGLE, "svc_live_good", &input).await;
    assert_eq!(reply.status, 201);
    assert_eq!(reply.body["conversion"]["warnings"], json!(["email_invalid"]));
    let sent = serde_json::to_string(&api.sink.chunks()).unwrap_or_default();
    assert!(!sent.contains("202") && !sent.contains("not an email"), "{sent}");
    assert!(sent.contains("phone_sha256"), "{sent}");
}

#[tokio::test]
async fn a_batch_answers_each_item_in_order_with_a_summary() {
    let api = api();
    assert_eq!(api.post_json(SINGLE, "svc_live_good", &conversion("OLD")).await.status, 201);
    let mut changed = conversion("CHANGED");
    assert_eq!(api.post_json(SINGLE, "svc_live_good", &changed).await.status, 201);
    changed["value"] = json!(3);
    let batch = json!({ "conversions": [
        conversion("NEW"),
        { "event": "lead", "external_id": "BAD", "occurred_at": "yesterday" },
        conversion("OLD"),
        { "event": "lead", "external_id": "EARLY", "occurred_at": "1999-12-31T00:00:00Z" },
        changed,
    ]});
    let reply = api.post_json(BATCH, "svc_live_good", &batch).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body["summary"], json!({ "created": 1, "updated": 1, "unchanged": 1, "failed": 2 }));
    let results = reply.body["results"].as_array().cloned().unwrap_or_default();
    assert_eq!(results.len(), 5);
    for (index, result) in results.iter().enumerate() {
        assert_eq!(result["index"], index);
    }
    assert_eq!((&results[0]["ok"], &results[0]["conversion"]["result"]), (&json!(true), &json!("created")));
    assert_eq!(results[0]["conversion"]["external_id"], "NEW");
    assert_eq!((&results[1]["ok"], &results[1]["error"]["code"]), (&json!(false), &json!("validation_failed")));
    assert_eq!(results[1]["error"]["details"][0]["path"], "occurred_at");
    assert_eq!(results[1]["error"].get("request_id"), None, "an item's error has no request id");
    assert_eq!(results[2]["conversion"]["result"], "unchanged");
    assert_eq!(results[3]["error"]["code"], "occurred_at_out_of_range");
    assert_eq!(results[4]["conversion"]["result"], "updated");
    assert_eq!(api.sink.chunks().last().map(Vec::len), Some(3), "only the valid items are written");
}

#[tokio::test]
async fn a_batch_is_written_in_chunks_of_at_most_100_in_input_order() {
    let api = api();
    let items: Vec<Value> = (0..250).map(|n| conversion(&format!("E{n}"))).collect();
    let reply = api.post_json(BATCH, "svc_live_good", &json!({ "conversions": items })).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body["summary"]["created"], 250);
    let chunks = api.sink.chunks();
    assert_eq!(chunks.iter().map(Vec::len).collect::<Vec<_>>(), [100, 100, 50]);
    let order: Vec<String> = chunks.iter().flatten().map(|c| c.external_id.as_str().to_owned()).collect();
    assert_eq!(order, (0..250).map(|n| format!("E{n}")).collect::<Vec<_>>());
}

#[tokio::test]
async fn a_batch_envelope_that_is_wrong_is_422_for_the_whole_request() {
    let api = api();
    for envelope in [json!({}), json!({ "conversions": [] }), json!({ "conversions": {} }), json!({ "items": [] })] {
        let reply = api.post_json(BATCH, "svc_live_good", &envelope).await;
        assert_eq!((reply.status, reply.code()), (422, "validation_failed"), "{envelope}");
    }
    let reply = api.post(BATCH, Some("svc_live_good"), "[1,").await;
    assert_eq!((reply.status, reply.code()), (400, "invalid_json"));
}

#[tokio::test]
async fn a_written_request_says_where_its_time_went_and_others_do_not() {
    let api = api();
    let batch = json!({ "conversions": [conversion("B1"), conversion("B2")] });
    for reply in [
        api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await,
        api.post_json(BATCH, "svc_live_good", &batch).await,
    ] {
        let timing = reply.header("server-timing").unwrap_or_default();
        let stages = MEMORY_STAGES.to_string();
        assert!(timing.starts_with(&format!("{stages}, total;dur=")), "{timing}");
    }
    let validated = api.post_json(VALIDATE, "svc_live_good", &batch).await;
    assert_eq!((validated.status, validated.header("server-timing")), (200, None), "nothing was written");
    api.sink.set(Outcome::Fail(WriteError::Timeout));
    let failed = api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await;
    assert_eq!((failed.status, failed.header("server-timing")), (500, None));
}

#[tokio::test]
async fn a_write_that_fails_is_500_for_single_and_batch() {
    let api = api();
    let batch = json!({ "conversions": [conversion("B1"), conversion("B2")] });
    let mut failures: u64 = 0;
    for error in [WriteError::Failed, WriteError::Timeout, WriteError::Expired, WriteError::Produce("down".into())] {
        api.sink.set(Outcome::Fail(error.clone()));
        for reply in [
            api.post_json(SINGLE, "svc_live_good", &conversion("A1")).await,
            api.post_json(BATCH, "svc_live_good", &batch).await,
        ] {
            assert_eq!((reply.status, reply.code()), (500, "internal_error"), "{error}");
            assert_eq!(reply.body["error"]["request_id"], reply.header("x-request-id").unwrap_or_default());
            let text = reply.body.to_string();
            assert!(!text.contains("writer") && !text.contains("Kafka") && !text.contains("down"), "{text}");
            failures += 1;
        }
    }
    assert_eq!(api.state.metrics.write_failures.get(), failures);
    // A batch with no valid item writes nothing, so it cannot fail to.
    let invalid = json!({ "conversions": [{ "event": "lead" }] });
    let reply = api.post_json(BATCH, "svc_live_good", &invalid).await;
    assert_eq!((reply.status, &reply.body["summary"]["failed"]), (200, &json!(1)));
}

#[tokio::test]
async fn validation_writes_nothing_counts_nothing_and_skips_admission() {
    let api = api();
    let _held = api.fill_admission("ws_good");
    let batch = json!({ "conversions": [conversion("A1"), { "event": "lead" }] });
    let reply = api.post_json(VALIDATE, "svc_live_good", &batch).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body["summary"], json!({ "valid": 1, "failed": 1 }));
    assert_eq!(reply.body["results"][0], json!({ "index": 0, "ok": true, "warnings": [] }));
    assert_eq!(reply.body["results"][1]["error"]["code"], "validation_failed");
    assert!(api.sink.chunks().is_empty());
    let quota = api.state.limiter.check("key_good", Counter::Conversions, 0).await.ok().flatten();
    assert_eq!(quota.map(|q| q.remaining), Some(LIMIT), "no conversion counted");
    let reply = api.post("/v1/conversions/validate?x=1", Some("svc_live_good"), "{}").await;
    assert_eq!((reply.status, reply.code()), (400, "query_not_allowed"));
}

#[tokio::test]
async fn the_contract_document_is_public_and_routes_are_exact() {
    let api = api();
    let document = api.get("/v1/openapi.json", None).await;
    assert_eq!(document.status, 200);
    assert!(document.body["openapi"].is_string());
    assert_eq!(api.get("/api/v1/openapi.json", None).await.status, 200);
    for (method, path) in [("GET", SINGLE), ("POST", "/v1/workspace"), ("POST", "/v1/conversions/"), ("GET", "/")] {
        let reply = api.send(request(method, path, Some("svc_live_good"), Full::default().boxed())).await;
        assert_eq!((reply.status, reply.code()), (404, "not_found"), "{method} {path}");
    }
    let alias = api.post_json("/api/v1/conversions", "svc_live_good", &conversion("A1")).await;
    assert_eq!(alias.status, 201);
}

#[tokio::test]
async fn a_panic_is_500_with_the_request_id_and_the_test_route_is_off_by_default() {
    let off = api();
    assert_eq!(off.get("/_test/panic", None).await.status, 404);
    let on = api_with(Settings { panic_test_route: true, ..Settings::default() });
    let reply = on.get("/_test/panic", None).await;
    assert_eq!((reply.status, reply.code()), (500, "internal_error"));
    assert_eq!(reply.body["error"]["request_id"], reply.header("x-request-id").unwrap_or_default());
}

#[tokio::test]
async fn beyond_the_cap_on_requests_in_flight_every_route_is_503_at_once() {
    let api = api_with(Settings { max_requests_in_flight: 1, ..Settings::default() });
    api.sink.set(Outcome::Hang);
    let input = conversion("A1");
    let waiting = api.post_json(SINGLE, "svc_live_good", &input);
    tokio::pin!(waiting);
    // Its connection's task serves it from here on, whether this side waits for it or not.
    tokio::select! {
        _ = &mut waiting => panic!("a hanging write was answered"),
        () = async { while api.sink.chunks().is_empty() { tokio::task::yield_now().await } } => {}
    }
    let reply = api.get("/v1/openapi.json", None).await;
    assert_eq!((reply.status, reply.code()), (503, "service_unavailable"));
    assert_eq!(reply.header("retry-after"), Some("1"));
}
