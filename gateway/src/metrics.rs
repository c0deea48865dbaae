//! Prometheus metrics of the gateway, served on the ops port.

use crate::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: Family<RequestLabels, Histogram>,
    pub write_failures: Counter,
    redis_failures: Gauge,
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("intake_gateway");
        let requests = Family::<RequestLabels, Counter>::default();
        let latency = Family::<RequestLabels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 14)));
        let write_failures = Counter::default();
        let redis_failures = Gauge::default();
        registry.register("requests", "HTTP requests by route and status", requests.clone());
        registry.register("request_seconds", "HTTP request latency", latency.clone());
        registry.register("write_failures", "Writes answered 500 (Kafka, timeout or writer failure)", write_failures.clone());
        registry.register("ratelimit_unavailable", "Rate-limit checks let through because Redis did not answer", redis_failures.clone());
        Metrics { registry, requests, latency, write_failures, redis_failures }
    }

    pub fn observe(&self, route: &'static str, status: u16, elapsed: Duration) {
        let labels = RequestLabels { route, status };
        self.requests.get_or_create(&labels).inc();
        self.latency.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }

    pub fn render(&self, redis_failures: u64) -> Response {
        self.redis_failures.set(i64::try_from(redis_failures).unwrap_or(i64::MAX));
        let mut text = String::new();
        let _ = encode(&mut text, &self.registry);
        let mut response = http::Response::new(Full::new(Bytes::from(text)));
        response.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
        );
        response
    }
}
