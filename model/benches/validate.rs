//! validate + normalize + hash of one realistic item, every identifier present.
//! Run: `cargo bench -p intake-model --bench validate`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use intake_model::normalize;
use intake_model::validate::{validate_conversion, Json};
use serde_json::json;
use std::hint::black_box;

fn items(count: usize) -> Vec<serde_json::Value> {
    (0..count)
        .map(|i| {
            json!({
                "event": "Purchase", "external_id": format!("order-{i}"), "parent_external_id": i,
                "occurred_at": "2026-01-02T03:04:05.123+01:00", "visitor_id": "abcdEFGH1234_-xy.12345678",
                "click_id": "abcDEF123456", "contact_id": format!("contact-{i}"),
                "email": format!(" Person.{i}@Example.com "), "phone": format!("(415) 555-{:04}", 2000 + i % 7000),
                "country": "us", "address": {"line1": format!("{i} Main St., Apt 4"), "zip": "94105-1234"},
                "value": "129.90", "currency": "usd", "hdyhau": "a podcast",
                "tags": {"plan": "pro", "source": "crm"}
            })
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let now_ms = 1_780_000_000_000;
    let bodies: Vec<Vec<u8>> = items(1000).iter().map(|item| item.to_string().into_bytes()).collect();
    let mut group = c.benchmark_group("validate_conversion");
    group.throughput(Throughput::Elements(bodies.len() as u64));
    // From the body's bytes, as the gateway reads it.
    group.bench_function("full_item_x1000", |b| {
        b.iter(|| {
            for body in &bodies {
                let Ok(input) = Json::parse(black_box(body)) else { continue };
                let _ = black_box(validate_conversion(&input, now_ms));
            }
        })
    });
    let minimal: Vec<_> =
        (0..1000).map(|i| json!({"event": "lead", "external_id": i, "occurred_at": 1_767_323_045_000_i64})).collect();
    group.bench_function("minimal_item_x1000", |b| {
        b.iter(|| {
            for input in &minimal {
                let _ = black_box(validate_conversion(&black_box(input).into(), now_ms));
            }
        })
    });
    group.finish();

    // The identifier steps alone, to see where an item's time goes.
    let mut steps = c.benchmark_group("normalize");
    steps.bench_function("phone_hash", |b| b.iter(|| normalize::phone_hash(black_box("(415) 555-2671"), Some("US"))));
    steps.bench_function("email_hash", |b| b.iter(|| normalize::email_hash(black_box(" Person.1@Example.com "))));
    steps.bench_function("address_hash", |b| {
        b.iter(|| normalize::address_hash(black_box("1 Main St., Apt 4"), "94105-1234", "US"))
    });
    steps.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
