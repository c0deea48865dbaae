//! The end-to-end benchmark: starts a gateway and a writer (release build) against the local
//! PostgreSQL, Redis and broker, drives them over real HTTP, and prints throughput and latency
//! percentiles per scenario, with GET /v1/workspace (authentication and rate limiting, no Kafka,
//! no write) as the baseline measured in the same run. Run it with `deploy/bench.sh`.

use intake_tests::serde_json::{json, Value};
use intake_tests::{Client, Stack, StackOptions, TestKey};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone, Copy)]
struct Scenario {
    name: &'static str,
    concurrency: usize,
    items_per_request: usize,
}

const SCENARIOS: [Scenario; 5] = [
    Scenario { name: "GET /v1/workspace (baseline)", concurrency: 16, items_per_request: 0 },
    Scenario { name: "POST /v1/conversions", concurrency: 16, items_per_request: 1 },
    Scenario { name: "POST /v1/conversions", concurrency: 64, items_per_request: 1 },
    Scenario { name: "POST /v1/conversions/batch (100 items)", concurrency: 4, items_per_request: 100 },
    Scenario { name: "POST /v1/conversions/batch (500 items)", concurrency: 2, items_per_request: 500 },
];

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// A realistic item: every identifier present, a parent link to the previous stage.
fn item(run: &str) -> Value {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    json!({
        "event": "purchase", "external_id": format!("{run}-{n}"), "parent_external_id": format!("{run}-{}", n.saturating_sub(1)),
        "occurred_at": intake_tests::now_ms() - 60_000, "visitor_id": "abcdEFGH1234_-xy.12345678", "click_id": "abcDEF123456",
        "contact_id": format!("contact-{n}"), "email": format!("person.{n}@example.com"),
        "phone": format!("+1 415 555 {:04}", n % 10_000), "country": "US",
        "address": {"line1": format!("{n} Main St"), "zip": "94105"}, "value": "129.90", "currency": "USD",
        "tags": {"plan": "pro"}
    })
}

async fn request(client: &Client, key: &TestKey, scenario: &Scenario, run: &str) -> u16 {
    match scenario.items_per_request {
        0 => client.send(reqwest::Method::GET, "/v1/workspace", Some(&key.bearer()), None).await.status,
        1 => client.post("/v1/conversions", key, &item(run)).await.status,
        n => {
            let items: Vec<Value> = (0..n).map(|_| item(run)).collect();
            client.post("/v1/conversions/batch", key, &json!({ "conversions": items })).await.status
        }
    }
}

struct Outcome {
    requests: usize,
    errors: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
}

async fn run(stack: &Stack, key: &TestKey, scenario: &Scenario, duration: Duration) -> Outcome {
    let run = ulid::Ulid::new().to_string();
    let deadline = Instant::now() + duration;
    let started = Instant::now();
    let errors = Arc::new(AtomicU64::new(0));
    let workers: Vec<_> = (0..scenario.concurrency)
        .map(|_| {
            let (client, key, run, errors) = (stack.client(), key.clone(), run.clone(), errors.clone());
            let scenario = *scenario;
            tokio::spawn(async move {
                let mut latencies = Vec::new();
                while Instant::now() < deadline {
                    let sent = Instant::now();
                    let status = request(&client, &key, &scenario, &run).await;
                    latencies.push(sent.elapsed());
                    if !(200..300).contains(&status) {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
                latencies
            })
        })
        .collect();
    let mut latencies = Vec::new();
    for worker in workers {
        latencies.extend(worker.await.unwrap_or_default());
    }
    let elapsed = started.elapsed();
    latencies.sort_unstable();
    Outcome { requests: latencies.len(), errors: errors.load(Ordering::Relaxed) as usize, elapsed, latencies }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index].as_secs_f64() * 1000.0
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::var("INTAKE_BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(10);
    let stack = Stack::start_with(StackOptions {
        requests_per_minute: u64::MAX / 4,
        conversions_per_minute: u64::MAX / 4,
        write_timeout_ms: 30_000,
        ..Default::default()
    })
    .await;
    let key = stack.workspace();
    // Warm up: the consumer group's first join, connections, caches.
    let warm = Scenario { name: "warm-up", concurrency: 4, items_per_request: 1 };
    run(&stack, &key, &warm, Duration::from_secs(2)).await;

    println!("| scenario | concurrency | requests/s | items/s | p50 ms | p90 ms | p99 ms | max ms | errors | items/s vs baseline requests/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut baseline = None;
    for scenario in &SCENARIOS {
        let outcome = run(&stack, &key, scenario, Duration::from_secs(seconds)).await;
        let per_second = outcome.requests as f64 / outcome.elapsed.as_secs_f64();
        let items = per_second * scenario.items_per_request.max(1) as f64;
        let baseline_rate = *baseline.get_or_insert(per_second);
        println!(
            "| {} | {} | {:.0} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {} | {:.2} |",
            scenario.name,
            scenario.concurrency,
            per_second,
            if scenario.items_per_request == 0 { "-".to_owned() } else { format!("{items:.0}") },
            percentile(&outcome.latencies, 0.50),
            percentile(&outcome.latencies, 0.90),
            percentile(&outcome.latencies, 0.99),
            percentile(&outcome.latencies, 1.0),
            outcome.errors,
            items / baseline_rate,
        );
    }
}
