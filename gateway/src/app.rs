//! One request through the gateway.
//!
//! The API is a tower service, outside in:
//! 1. [`handle`]: gives the request its id, answers what the layers below could not (a panic,
//!    the cap on requests in flight), sets X-Request-ID, counts the request in the metrics and
//!    writes its one log line.
//! 2. Load shedding over a cap on requests in flight (tower's `LoadShed` over
//!    `GlobalConcurrencyLimit`): beyond the cap, 503 service_unavailable at once.
//! 3. Catch-panic (tower-http): a panic in a request becomes 500 internal_error, never a
//!    dropped connection.
//! 4. The checks of the request's head, one layer each, in the error order ([`crate::layers`]):
//!    route, authentication and scope, query string, request rate limit, write admission.
//! 5. [`endpoint`]: the route's handler, which finds what the layers learnt (the route, the
//!    principal, the admission's ticket) in the request's extensions.

use crate::api_error::ApiError;
use crate::context::RequestContext;
use crate::layers::{Authentication, CheckLayer, QueryString, RequestRateLimit, Routing, WriteAdmission};
use crate::metrics::{Metrics, ShedReason};
use crate::ready::Readiness;
use crate::request_body::RequestBody;
use crate::response::{json, Response, SERVER_TIMING, X_REQUEST_ID};
use crate::routes::Route;
use crate::state::AppState;
use crate::{conversions, openapi, validate_only, workspace};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::error::Overloaded;
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceBuilder, ServiceExt};
use tower_http::catch_panic::CatchPanicLayer;

/// The body of every API response once it has been through the layers.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;
/// The layers below [`handle`]; the catch-panic layer answers with a body type of its own.
type Inner = BoxCloneService<
    http::Request<RequestBody>,
    http::Response<tower_http::body::UnsyncBoxBody<Bytes, BoxError>>,
    BoxError,
>;

/// Retry-After of a refusal by the cap on requests in flight.
const RETRY_AFTER_BUSY_SECS: u64 = 1;

/// Marks the empty response of the catch-panic layer, for [`handle`] to answer it with the
/// request's id (the layer does not know it).
#[derive(Debug, Clone, Copy)]
struct Panicked;

fn panicked(_panic: Box<dyn std::any::Any + Send>) -> http::Response<http_body_util::Full<Bytes>> {
    let mut response = http::Response::new(http_body_util::Full::default());
    response.extensions_mut().insert(Panicked);
    response
}

/// The API as a tower service, one clone per connection.
pub fn api_service(
    state: Arc<AppState>,
    max_requests_in_flight: usize,
) -> impl tower::Service<http::Request<RequestBody>, Response = http::Response<Body>, Error = Infallible, Future: Send>
       + Clone
       + Send
       + 'static {
    let endpoints = state.clone();
    let inner: Inner = BoxCloneService::new(
        ServiceBuilder::new()
            .load_shed()
            .layer(GlobalConcurrencyLimitLayer::new(max_requests_in_flight))
            .layer(CatchPanicLayer::custom(panicked))
            .layer(CheckLayer::new(Routing { panic_test_route: state.panic_test_route }))
            .layer(CheckLayer::new(Authentication(state.clone())))
            .layer(CheckLayer::new(QueryString(state.clone())))
            .layer(CheckLayer::new(RequestRateLimit(state.clone())))
            .layer(CheckLayer::new(WriteAdmission(state.clone())))
            .service_fn(move |request| {
                let state = endpoints.clone();
                async move { Ok::<_, Infallible>(endpoint(&state, request).await) }
            }),
    );
    let metrics = state.metrics.clone();
    tower::service_fn(move |request| {
        let (metrics, inner) = (metrics.clone(), inner.clone());
        async move { Ok::<_, Infallible>(handle(&metrics, request, inner).await) }
    })
}

async fn handle(metrics: &Metrics, mut request: http::Request<RequestBody>, inner: Inner) -> http::Response<Body> {
    let started = Instant::now();
    let context = RequestContext::default();
    request.extensions_mut().insert(context.clone());
    let method = request.method().clone();
    let route_name = Route::recognize(&method, request.uri().path()).map_or(Route::UNKNOWN, Route::name);
    let outcome = match inner.oneshot(request).await {
        Ok(response) if response.extensions().get::<Panicked>().is_none() => Ok(response.map(BodyExt::boxed_unsync)),
        // Logged with the request id as an internal error; the panic's message is not
        // logged, as it may quote the input.
        Ok(_) => Err(ApiError::Internal("request panicked".into())),
        Err(error) if error.is::<Overloaded>() => {
            metrics.shed(ShedReason::requests_in_flight);
            Err(ApiError::Overloaded { retry_after_secs: RETRY_AFTER_BUSY_SECS })
        }
        Err(error) => Err(ApiError::Internal(format!("service: {error}"))),
    };
    let mut response = outcome.unwrap_or_else(|error| {
        error.into_response(&context.id).map(|body| body.map_err(|never| match never {}).boxed_unsync())
    });
    // Every response carries it: parse_errors.rs tells hyper's own error heads by its absence.
    if let Ok(value) = http::HeaderValue::from_str(&context.id) {
        response.headers_mut().insert(X_REQUEST_ID, value);
    }
    let status = response.status().as_u16();
    let elapsed = started.elapsed();
    let stages = context.timed_stages();
    if let Some(value) = stages.and_then(|stages| http::HeaderValue::from_str(&stages.header(elapsed)).ok()) {
        response.headers_mut().insert(SERVER_TIMING, value);
    }
    metrics.observe(route_name, status, elapsed);
    let principal = context.principal();
    // Ids and names as Display: they need no quoting, and a `&str` field is escaped character
    // by character on the busiest line of the log. A request not authenticated has no ids.
    tracing::info!(
        request_id = %context.id,
        %method,
        route = %route_name,
        status,
        workspace_id = principal.map(|(workspace_id, _)| tracing::field::display(workspace_id)),
        key_id = principal.map(|(_, key_id)| tracing::field::display(key_id)),
        items = context.item_count(),
        duration_ms = elapsed.as_secs_f64() * 1000.0,
        stages = stages.map(tracing::field::display),
        "request"
    );
    response
}

/// The route's handler, under the checks of its head.
async fn endpoint(state: &AppState, request: http::Request<RequestBody>) -> Response {
    let context = RequestContext::of(&request);
    let result = match request.extensions().get::<Route>().copied() {
        Some(Route::Workspace) => workspace::get(state, &request).await,
        Some(Route::Conversion) => conversions::single(state, request).await,
        Some(Route::ConversionBatch) => conversions::batch(state, request).await,
        Some(Route::ConversionValidate) => validate_only::batch(state, request).await,
        Some(Route::OpenApi) => Ok(openapi::document()),
        None => Err(ApiError::Internal("no route in the request".into())),
    };
    result.unwrap_or_else(|error| error.into_response(&context.id))
}

#[cfg(test)]
mod tests;

/// The ops port: liveness, readiness and Prometheus metrics. It serves from the start, before
/// Kafka is reached, and until the process exits.
pub async fn handle_ops(readiness: &Readiness, metrics: &Metrics, request: http::Request<RequestBody>) -> Response {
    match request.uri().path() {
        "/healthz" => json(200, &serde_json::json!({ "status": "ok" })),
        "/readyz" => match readiness.status() {
            Ok(()) => json(200, &serde_json::json!({ "status": "ready" })),
            Err(failing) => json(503, &serde_json::json!({ "status": "not_ready", "failing": failing })),
        },
        "/metrics" => metrics.render(),
        _ => json(404, &serde_json::json!({ "error": "not found" })),
    }
}
