//! Writes whose body comes slowly (docs/architecture.md, "Admission"): while a body is read it
//! holds a place in its workspace's share of the writes in flight, never the gateway's cap, so
//! that a few workspaces trickling their uploads cannot keep the other workspaces' writes out.

use intake_tests::raw_http1::{Raw, RawResponse};
use intake_tests::serde_json::json;
use intake_tests::{conversion, wait_until, Stack, StackOptions, TestKey};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The gateway's cap on writes in flight, and a quarter of it for each workspace.
const CAP: usize = 8;
const SHARE: usize = 2;
/// Spaces before the JSON of a slow body: more than the trickle sends during the test.
const PADDING: usize = 4_000;

/// An upload that sends its head and a few bytes, then a byte every 250 ms until told to
/// stop; then it sends the rest of its body (`finish`) or goes away.
struct SlowUpload {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Option<RawResponse>>,
}

impl SlowUpload {
    async fn start(stack: &Stack, key: &TestKey, finish: bool) -> SlowUpload {
        let json = json!({ "conversions": [conversion("lead")] }).to_string();
        let body = format!("{}{json}", " ".repeat(PADDING)).into_bytes();
        let head = format!(
            "POST /v1/conversions/batch HTTP/1.1\r\nHost: intake\r\nAuthorization: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            key.bearer(),
            body.len()
        );
        let mut client = Raw::connect(stack).await;
        client.send(head.as_bytes()).await;
        client.send(&body[..3]).await;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut sent = 3;
            while !stopped.load(Ordering::Relaxed) && sent < PADDING {
                tokio::time::sleep(Duration::from_millis(250)).await;
                client.send(&body[sent..=sent]).await;
                sent += 1;
            }
            if !finish {
                return None;
            }
            client.send(&body[sent..]).await;
            client.response().await
        });
        SlowUpload { stop, task }
    }

    async fn finish(self) -> Option<RawResponse> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_else(|e| panic!("{e}"))
    }
}

#[tokio::test]
async fn slow_uploads_of_a_few_workspaces_leave_the_gateways_cap_to_the_others() {
    let stack = Stack::start_with(StackOptions {
        gateway_args: [
            "--max-writes-in-flight",
            &CAP.to_string(),
            "--workspace-write-share-percent",
            "25",
            // Longer than the test: the slow bodies are still being read when the others write.
            "--body-read-timeout-ms",
            "60000",
        ]
        .iter()
        .map(|a| (*a).to_owned())
        .collect(),
        ..Default::default()
    })
    .await;

    // Four workspaces trickle as many bodies as the share lets each: together the whole cap.
    let slow_keys: Vec<TestKey> = (0..CAP / SHARE).map(|_| stack.workspace()).collect();
    let mut uploads = Vec::new();
    for (n, key) in slow_keys.iter().cycle().take(CAP).enumerate() {
        uploads.push(SlowUpload::start(&stack, key, n == 0).await);
    }
    let reading = || async { stack.metrics().await.get("intake_gateway_writes_reading") == Some(CAP as f64) };
    wait_until("every slow body being read", Duration::from_secs(10), reading).await;

    // Other workspaces write, as many at once as the whole cap, and every write is admitted.
    let others: Vec<TestKey> = (0..CAP / SHARE).map(|_| stack.workspace()).collect();
    let writes = others.iter().cycle().take(CAP).map(|key| {
        let (client, key) = (stack.client(), key.clone());
        async move { client.post("/v1/conversions", &key, &conversion("lead")).await }
    });
    for reply in intake_tests::join_all(writes).await {
        assert_eq!(reply.status, 201, "{reply:?}");
    }
    let batch = json!({ "conversions": [conversion("lead"), conversion("lead")] });
    assert_eq!(stack.post("/v1/conversions/batch", &others[0], &batch).await.status, 200);

    // A slow workspace's own reads hold its share: its next write is refused, before its body.
    let reply = stack.post("/v1/conversions", &slow_keys[1], &conversion("lead")).await;
    assert_eq!((reply.status, reply.error_code()), (503, "service_unavailable"), "{reply:?}");
    assert_eq!(reply.header("retry-after"), Some("1"));

    // A slow body that ends is written like any other.
    let mut uploads = uploads.into_iter();
    let finished = uploads.next().unwrap_or_else(|| panic!("no uploads"));
    let response = finished.finish().await.unwrap_or_else(|| panic!("no response to the finished upload"));
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.body["summary"]["created"], 1, "{response:?}");

    // Slow clients that go away free their places.
    for upload in uploads {
        assert!(upload.finish().await.is_none());
    }
    let released = || async {
        let metrics = stack.metrics().await;
        metrics.get("intake_gateway_writes_reading") == Some(0.0)
            && metrics.get("intake_gateway_writes_in_flight") == Some(0.0)
    };
    wait_until("the slow bodies' places freed", Duration::from_secs(10), released).await;
    assert_eq!(stack.post("/v1/conversions", &slow_keys[1], &conversion("lead")).await.status, 201);

    let metrics = stack.metrics().await;
    assert_eq!(metrics.value("intake_gateway_load_shed_total{reason=\"workspace_share\"}"), 1.0);
    assert_eq!(
        metrics.get("intake_gateway_load_shed_total{reason=\"writes_in_flight\"}"),
        None,
        "no write was refused for the gateway's cap"
    );
}
