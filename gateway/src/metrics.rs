//! Prometheus metrics of the gateway, served on the ops port. The names are the ones the alert
//! rules are written against; change none without changing them.
//!
//! Each handle is a cheap clone of one shared metric, so a component is given the handles it
//! updates (the rate limiter its refusals and fail-opens, the key cache its hits and misses).

use crate::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

/// Which rate limit refused a request.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum Limit {
    requests,
    conversions,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabels {
    pub limit: Limit,
}

/// Why a request was refused with 503.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum ShedReason {
    /// The cap on requests in flight (all routes).
    requests_in_flight,
    /// The cap on writes in flight.
    writes_in_flight,
    /// The workspace's writes wait and no reply has come to one of them for the stall time.
    writers_behind,
    /// The workspace holds its share of the cap on writes in flight.
    workspace_share,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ShedLabels {
    pub reason: ShedReason,
}

#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
#[allow(non_camel_case_types)]
pub enum CacheResult {
    hit,
    miss,
    /// PostgreSQL could not be asked; the last answer it gave was used.
    stale,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabels {
    pub result: CacheResult,
}

#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    requests: Family<RequestLabels, Counter>,
    latency: Family<RequestLabels, Histogram>,
    /// Produce to reply of one chunk.
    pub kafka_roundtrip: Histogram,
    pub writes_in_flight: Gauge,
    pub writes_reading: Gauge,
    /// API connections open (each holds one of `--max-connections`).
    pub connections: Gauge,
    pub load_shed: Family<ShedLabels, Counter>,
    pub ratelimit_refused: Family<LimitLabels, Counter>,
    pub redis_fail_open: Counter,
    pub key_cache: Family<CacheLabels, Counter>,
    pub write_failures: Counter,
}

impl Metrics {
    pub fn new() -> Self {
        // The process metrics keep their standard names; the gateway's own go under its prefix.
        let mut root = Registry::default();
        intake_common::process::register(&mut root);
        let registry = root.sub_registry_with_prefix("intake_gateway");
        let seconds = || Histogram::new(exponential_buckets(0.001, 2.0, 15));
        let metrics = Metrics {
            registry: Arc::new(Registry::default()),
            requests: Family::default(),
            latency: Family::new_with_constructor(seconds),
            kafka_roundtrip: seconds(),
            writes_in_flight: Gauge::default(),
            writes_reading: Gauge::default(),
            connections: Gauge::default(),
            load_shed: Family::default(),
            ratelimit_refused: Family::default(),
            redis_fail_open: Counter::default(),
            key_cache: Family::default(),
            write_failures: Counter::default(),
        };
        // Which version each process runs, for rollouts one instance at a time.
        registry.register(
            "build",
            "The program's version",
            prometheus_client::metrics::info::Info::new(vec![("version", env!("CARGO_PKG_VERSION"))]),
        );
        registry.register("requests", "HTTP requests by route and status", metrics.requests.clone());
        registry.register("request_seconds", "HTTP request latency", metrics.latency.clone());
        registry.register(
            "kafka_roundtrip_seconds",
            "From producing a chunk to its reply",
            metrics.kafka_roundtrip.clone(),
        );
        registry.register(
            "writes_in_flight",
            "Write requests with their body in and not yet answered",
            metrics.writes_in_flight.clone(),
        );
        registry.register(
            "writes_reading",
            "Write requests admitted whose body is being read (held against their workspace's share only)",
            metrics.writes_reading.clone(),
        );
        registry.register(
            "connections",
            "API connections open, of either protocol (at most --max-connections; more wait to be accepted)",
            metrics.connections.clone(),
        );
        registry.register(
            "load_shed",
            "Requests refused with 503 service_unavailable, by reason",
            metrics.load_shed.clone(),
        );
        registry.register(
            "ratelimit_refused",
            "Requests refused with 429 rate_limited, by limit",
            metrics.ratelimit_refused.clone(),
        );
        registry.register(
            "redis_fail_open",
            "Rate-limit checks let through because Redis did not answer",
            metrics.redis_fail_open.clone(),
        );
        registry.register(
            "key_cache",
            "API key lookups by cache result (a miss is one PostgreSQL query)",
            metrics.key_cache.clone(),
        );
        registry.register(
            "write_failures",
            "Writes answered 500 (Kafka, timeout or writer failure)",
            metrics.write_failures.clone(),
        );
        Metrics { registry: Arc::new(root), ..metrics }
    }

    pub fn observe(&self, route: &'static str, status: u16, elapsed: Duration) {
        let labels = RequestLabels { route, status };
        self.requests.get_or_create(&labels).inc();
        self.latency.get_or_create(&labels).observe(elapsed.as_secs_f64());
    }

    pub fn shed(&self, reason: ShedReason) {
        self.load_shed.get_or_create(&ShedLabels { reason }).inc();
    }

    pub fn render(&self) -> Response {
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
