//! Prometheus metrics of the gateway, served on the ops port. The names are the ones the alert
//! rules are written against; change none without changing them.
//!
//! Each handle is a cheap clone of one shared metric, so a component is given the handles it
//! updates (the rate limiter its refusals and fail-opens, the key cache its hits and misses).

use crate::response::Response;
use bytes::Bytes;
use http_body_util::Full;
use intake_common::metrics::{seconds_histogram, Registrar};
use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
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
        let mut r = Registrar::new("intake_gateway", env!("CARGO_PKG_VERSION"));
        Metrics {
            requests: r.register("requests", "HTTP requests by route and status", Family::default()),
            latency: r.register(
                "request_seconds",
                "HTTP request latency",
                Family::new_with_constructor(|| seconds_histogram(15)),
            ),
            kafka_roundtrip: r.register(
                "kafka_roundtrip_seconds",
                "From producing a chunk to its reply",
                seconds_histogram(15),
            ),
            writes_in_flight: r.register(
                "writes_in_flight",
                "Write requests with their body in and not yet answered",
                Gauge::default(),
            ),
            writes_reading: r.register(
                "writes_reading",
                "Write requests admitted whose body is being read (held against their workspace's share only)",
                Gauge::default(),
            ),
            connections: r.register(
                "connections",
                "API connections open, of either protocol (at most --max-connections; more wait to be accepted)",
                Gauge::default(),
            ),
            load_shed: r.register(
                "load_shed",
                "Requests refused with 503 service_unavailable, by reason",
                Family::default(),
            ),
            ratelimit_refused: r.register(
                "ratelimit_refused",
                "Requests refused with 429 rate_limited, by limit",
                Family::default(),
            ),
            redis_fail_open: r.register(
                "redis_fail_open",
                "Rate-limit checks let through because Redis did not answer",
                Counter::default(),
            ),
            key_cache: r.register(
                "key_cache",
                "API key lookups by cache result (a miss is one PostgreSQL query)",
                Family::default(),
            ),
            write_failures: r.register(
                "write_failures",
                "Writes answered 500 (Kafka, timeout or writer failure)",
                Counter::default(),
            ),
            registry: Arc::new(r.finish()),
        }
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
        let text = intake_common::metrics::encode(&self.registry);
        let mut response = http::Response::new(Full::new(Bytes::from(text)));
        response
            .headers_mut()
            .insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static(intake_common::metrics::CONTENT_TYPE));
        response
    }
}
