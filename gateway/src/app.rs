//! One request through the gateway, in the error order of DESIGN section 2.2:
//! route, authenticate, scope, query string, request rate limit, then the endpoint.

use crate::api_error::ApiError;
use crate::auth::Authenticator;
use crate::metrics::Metrics;
use crate::ratelimit::{Counter, Quota, RateLimiter};
use crate::response::{json, Response};
use crate::routes::Route;
use crate::writes::WriteClient;
use crate::{conversions, openapi, workspace};
use hyper::body::Incoming;
use intake_common::error::ErrorCode;
use intake_common::ids;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Instant;

pub struct App {
    pub pool: PgPool,
    pub auth: Authenticator,
    pub limiter: RateLimiter,
    pub writes: Arc<WriteClient>,
    pub metrics: Metrics,
    pub script_base_url: String,
}

impl App {
    pub async fn handle(&self, request: http::Request<Incoming>) -> Response {
        let started = Instant::now();
        let request_id = ids::new_id("req_");
        let method = request.method().clone();
        let route = Route::recognize(&method, request.uri().path());
        let (mut response, quota) = match route {
            None => (ApiError::Code(ErrorCode::NotFound).into_response(&request_id), None),
            Some(Route::OpenApi) => (openapi::document(), None),
            Some(route) => match self.authenticated(route, request).await {
                (Ok(response), quota) => (response, quota),
                (Err(error), quota) => (error.into_response(&request_id), quota),
            },
        };
        let headers = response.headers_mut();
        if let Ok(value) = http::HeaderValue::from_str(&request_id) {
            headers.insert("x-request-id", value);
        }
        if let Some(quota) = quota {
            headers.insert("ratelimit-limit", quota.limit.into());
            headers.insert("ratelimit-remaining", quota.remaining.into());
            headers.insert("ratelimit-reset", quota.reset_secs.into());
        }
        let status = response.status().as_u16();
        let route_name = route.map_or("unknown", Route::name);
        self.metrics.observe(route_name, status, started.elapsed());
        // Never the body: only what identifies the request and its outcome.
        tracing::info!(request_id, %method, route = route_name, status, elapsed_ms = started.elapsed().as_millis() as u64, "request");
        response
    }

    async fn authenticated(&self, route: Route, request: http::Request<Incoming>) -> (Result<Response, ApiError>, Option<Quota>) {
        let principal = match self.auth.authenticate(request.headers().get(http::header::AUTHORIZATION)).await {
            Ok(principal) => principal,
            Err(error) => return (Err(error), None),
        };
        if let Some(scope) = route.scope().filter(|scope| !principal.scopes.iter().any(|s| s == scope)) {
            return (Err(ApiError::InsufficientScope { missing: scope }), None);
        }
        if route.is_write() && request.uri().query().is_some() {
            return (Err(ApiError::Code(ErrorCode::QueryNotAllowed)), None);
        }
        let quota = match self.limiter.check(&principal.key_id, Counter::Requests, 1).await {
            Ok(quota) => quota,
            Err(error) => return (Err(error), None),
        };
        let result = match route {
            Route::Workspace => workspace::get(&self.pool, &self.script_base_url, &principal).await,
            Route::Conversion => conversions::single(self, &principal, request).await,
            Route::ConversionBatch => conversions::batch(self, &principal, request).await,
            Route::OpenApi => Ok(openapi::document()),
        };
        (result, quota)
    }
}

/// The ops port: liveness, readiness and Prometheus metrics.
pub async fn handle_ops(app: &App, request: http::Request<Incoming>) -> Response {
    match request.uri().path() {
        "/healthz" | "/readyz" => json(200, &serde_json::json!({ "status": "ok", "in_flight_writes": app.writes.in_flight() })),
        "/metrics" => app.metrics.render(app.limiter.failures.load(std::sync::atomic::Ordering::Relaxed)),
        _ => json(404, &serde_json::json!({ "error": "not found" })),
    }
}
