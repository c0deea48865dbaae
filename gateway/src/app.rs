//! One request through the gateway.
//!
//! The API is a tower service, outside in:
//! 1. [`App::handle`]: gives the request its id, answers what the layers below refused (they do
//!    not know the id), sets
//!    X-Request-ID, counts the request in the metrics and writes its one log line.
//! 2. Load shedding over a cap on requests in flight (tower's `LoadShed` over
//!    `GlobalConcurrencyLimit`): beyond the cap, 503 service_unavailable at once.
//! 3. Catch-panic (tower-http): a panic in a request becomes 500 internal_error, never a
//!    dropped connection.
//! 4. [`App::route`]: the error order of docs/api.md, "Error order": route, authenticate, scope, query
//!    string, request rate limit, write admission (503, writes only: validation writes
//!    nothing), then the endpoint.

use crate::api_error::ApiError;
use crate::auth::{Authenticator, Principal};
use crate::metrics::{Metrics, ShedReason};
use crate::overload::Admission;
use crate::ratelimit::{Counter, Quota, RateLimiter};
use crate::ready::Readiness;
use crate::request_body::RequestBody;
use crate::response::{json, Response};
use crate::routes::Route;
use crate::writes::WriteClient;
use crate::{conversions, openapi, validate_only, workspace};
use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::BodyExt;
use intake_common::error::ErrorCode;
use intake_common::ids;
use sqlx::PgPool;
use std::convert::Infallible;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::error::Overloaded;
use tower::util::BoxCloneService;
use tower::{BoxError, ServiceBuilder, ServiceExt};
use tower_http::catch_panic::CatchPanicLayer;

/// The body of every API response once it has been through the layers.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;
/// The layers below [`App::handle`]; the catch-panic layer answers with a body type of its own.
type Inner = BoxCloneService<
    http::Request<RequestBody>,
    http::Response<tower_http::body::UnsyncBoxBody<Bytes, BoxError>>,
    BoxError,
>;

/// The path that panics when `--panic-test-route` is on (never by default).
pub const PANIC_TEST_PATH: &str = "/_test/panic";

/// Retry-After of a refusal by the cap on requests in flight.
const RETRY_AFTER_BUSY_SECS: u64 = 1;

pub struct App {
    pub pool: PgPool,
    pub auth: Authenticator,
    pub limiter: RateLimiter,
    pub writes: Arc<WriteClient>,
    pub admission: Admission,
    pub metrics: Metrics,
    pub script_base_url: String,
    pub body_read_timeout: Duration,
    pub panic_test_route: bool,
}

/// A request's id and what its log line says about it, filled in as the request goes through
/// (never a body or an identifier value).
#[derive(Clone)]
pub struct RequestContext {
    pub id: Arc<str>,
    /// When the request arrived: the write deadline counts from here, so that time spent
    /// before the write (a slow key look-up, reading the body) is inside it.
    pub started: std::time::Instant,
    facts: Arc<Facts>,
}

#[derive(Default)]
struct Facts {
    principal: OnceLock<(String, String)>,
    items: OnceLock<usize>,
}

impl Default for RequestContext {
    fn default() -> Self {
        RequestContext { id: ids::new_id("req_").into(), started: std::time::Instant::now(), facts: Arc::default() }
    }
}

impl RequestContext {
    fn authenticated(&self, principal: &Principal) {
        let _ = self.facts.principal.set((principal.workspace_id.clone(), principal.key_id.clone()));
    }

    /// The number of conversions the request carried.
    pub fn items(&self, count: usize) {
        let _ = self.facts.items.set(count);
    }
}

/// Marks the empty response of the catch-panic layer, for [`App::handle`] to answer it with the
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
    app: Arc<App>,
    max_requests_in_flight: usize,
) -> impl tower::Service<http::Request<RequestBody>, Response = http::Response<Body>, Error = Infallible, Future: Send>
       + Clone
       + Send
       + 'static {
    let routed = app.clone();
    let inner: Inner = BoxCloneService::new(
        ServiceBuilder::new()
            .load_shed()
            .layer(GlobalConcurrencyLimitLayer::new(max_requests_in_flight))
            .layer(CatchPanicLayer::custom(panicked))
            .service_fn(move |request| {
                let app = routed.clone();
                async move { Ok::<_, Infallible>(app.route(request).await) }
            }),
    );
    tower::service_fn(move |request| {
        let (app, inner) = (app.clone(), inner.clone());
        async move { Ok::<_, Infallible>(app.handle(request, inner).await) }
    })
}

impl App {
    async fn handle(&self, mut request: http::Request<RequestBody>, inner: Inner) -> http::Response<Body> {
        let started = Instant::now();
        let context = RequestContext::default();
        request.extensions_mut().insert(context.clone());
        let method = request.method().clone();
        let route_name = Route::recognize(&method, request.uri().path()).map_or("unknown", Route::name);
        let outcome = match inner.oneshot(request).await {
            Ok(response) if response.extensions().get::<Panicked>().is_none() => {
                Ok(response.map(BodyExt::boxed_unsync))
            }
            // Logged with the request id as an internal error; the panic's message is not
            // logged, as it may quote the input.
            Ok(_) => Err(ApiError::Internal("request panicked".into())),
            Err(error) if error.is::<Overloaded>() => {
                self.metrics.shed(ShedReason::requests_in_flight);
                Err(ApiError::Overloaded { retry_after_secs: RETRY_AFTER_BUSY_SECS })
            }
            Err(error) => Err(ApiError::Internal(format!("service: {error}"))),
        };
        let mut response = outcome.unwrap_or_else(|error| {
            error.into_response(&context.id).map(|body| body.map_err(|never| match never {}).boxed_unsync())
        });
        if let Ok(value) = http::HeaderValue::from_str(&context.id) {
            response.headers_mut().insert("x-request-id", value);
        }
        let status = response.status().as_u16();
        let elapsed = started.elapsed();
        self.metrics.observe(route_name, status, elapsed);
        let (workspace_id, key_id) = context.facts.principal.get().map_or(("", ""), |(w, k)| (w.as_str(), k.as_str()));
        tracing::info!(
            request_id = &*context.id,
            %method,
            route = route_name,
            status,
            workspace_id,
            key_id,
            items = context.facts.items.get().copied().unwrap_or(0),
            duration_ms = elapsed.as_secs_f64() * 1000.0,
            "request"
        );
        response
    }

    async fn route(&self, request: http::Request<RequestBody>) -> Response {
        let context = request.extensions().get::<RequestContext>().cloned().unwrap_or_default();
        if self.panic_test_route && request.uri().path() == PANIC_TEST_PATH {
            panic!("the panic test route was called");
        }
        let (result, quota) = match Route::recognize(request.method(), request.uri().path()) {
            None => (Err(ApiError::Code(ErrorCode::NotFound)), None),
            Some(Route::OpenApi) => (Ok(openapi::document()), None),
            Some(route) => self.authenticated(route, &context, request).await,
        };
        let mut response = result.unwrap_or_else(|error| error.into_response(&context.id));
        if let Some(quota) = quota {
            let headers = response.headers_mut();
            headers.insert("ratelimit-limit", quota.limit.into());
            headers.insert("ratelimit-remaining", quota.remaining.into());
            headers.insert("ratelimit-reset", quota.reset_secs.into());
        }
        response
    }

    async fn authenticated(
        &self,
        route: Route,
        context: &RequestContext,
        request: http::Request<RequestBody>,
    ) -> (Result<Response, ApiError>, Option<Quota>) {
        let principal = match self.auth.authenticate(request.headers().get(http::header::AUTHORIZATION)).await {
            Ok(principal) => principal,
            Err(error) => return (Err(error), None),
        };
        context.authenticated(&principal);
        if let Some(scope) = route.scope().filter(|scope| !principal.scopes.iter().any(|s| s == scope)) {
            return (Err(ApiError::InsufficientScope { missing: scope }), None);
        }
        if route.refuses_query() && request.uri().query().is_some() {
            return (Err(ApiError::Code(ErrorCode::QueryNotAllowed)), None);
        }
        let quota = match self.limiter.check(&principal.key_id, Counter::Requests, 1).await {
            Ok(quota) => quota,
            Err(error) => return (Err(error), None),
        };
        // Held until the response is made; refused here, before the body is read. The write
        // finds the workspace's ticket in the request's extensions.
        let admitted = match route.is_write().then(|| self.admission.admit_write(&principal.workspace_id)).transpose() {
            Ok(permit) => permit,
            Err(error) => return (Err(error), quota),
        };
        let mut request = request;
        if let Some(permit) = &admitted {
            request.extensions_mut().insert(permit.ticket.clone());
        }
        let result = match route {
            Route::Workspace => workspace::get(&self.pool, &self.script_base_url, &principal).await,
            Route::Conversion => conversions::single(self, &principal, context, request).await,
            Route::ConversionBatch => conversions::batch(self, &principal, context, request).await,
            Route::ConversionValidate => validate_only::batch(self, context, request).await,
            Route::OpenApi => Ok(openapi::document()),
        };
        (result, quota)
    }
}

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
