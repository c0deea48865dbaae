//! The checks a request passes before its endpoint, each a tower layer, stacked in the error
//! order of docs/api.md, "Error order":
//!
//! 1. [`Routing`]: 404 not_found; the [`Route`] into the request's extensions.
//! 2. [`Authentication`]: 401, 404 workspace_not_found, 403 workspace_suspended, then 403
//!    insufficient_scope; the [`Principal`] into the extensions.
//! 3. [`QueryString`]: 400 query_not_allowed on the routes that take every field in their body.
//! 4. [`RequestRateLimit`]: 429 rate_limited; the RateLimit-* headers on every response past it.
//! 5. [`WriteAdmission`]: 503 service_unavailable on writes, before their body is read; the
//!    [`AdmittedWrite`](crate::overload::AdmittedWrite) into the extensions: a place in the
//!    workspace's share, which the endpoint turns into a place among the writes in flight once
//!    the body is in.
//!
//! What needs the body (its size, read deadline, JSON, fields, the conversion limit) is the
//! endpoint's. A refusal is answered by the layer that refuses, with the request's id, so that
//! the layers above it see a response like any other.

use crate::api_error::ApiError;
use crate::auth::Principal;
use crate::context::RequestContext;
use crate::ratelimit::{Counter, Quota};
use crate::response::{Response, RATELIMIT_LIMIT, RATELIMIT_REMAINING, RATELIMIT_RESET};
use crate::routes::Route;
use crate::sink::BoxFuture;
use crate::state::AppState;
use intake_model::error::ErrorCode;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll};

/// One check of a request's head.
pub trait Check: Send + Sync + 'static {
    /// What a passed check holds until the response is made.
    type Passed: Send + 'static;

    fn check(&self, request: &mut http::request::Parts) -> impl Future<Output = Result<Self::Passed, ApiError>> + Send;

    /// Adds what the check knows to the response of a request it passed.
    fn finish(&self, _passed: Self::Passed, _response: &mut Response) {}
}

/// A [`Check`] as a tower layer.
pub struct CheckLayer<C>(Arc<C>);

impl<C> CheckLayer<C> {
    pub fn new(check: C) -> Self {
        CheckLayer(Arc::new(check))
    }
}

impl<C, S> tower::Layer<S> for CheckLayer<C> {
    type Service = Checked<C, S>;

    fn layer(&self, inner: S) -> Self::Service {
        Checked { check: self.0.clone(), inner }
    }
}

pub struct Checked<C, S> {
    check: Arc<C>,
    inner: S,
}

impl<C, S: Clone> Clone for Checked<C, S> {
    fn clone(&self) -> Self {
        Checked { check: self.check.clone(), inner: self.inner.clone() }
    }
}

impl<C, S, B> tower::Service<http::Request<B>> for Checked<C, S>
where
    C: Check,
    S: tower::Service<http::Request<B>, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
    B: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = BoxFuture<'static, Result<Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let check = self.check.clone();
        // The clone that was polled ready serves this request (tower's usual swap).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (mut parts, body) = request.into_parts();
            let passed = match check.check(&mut parts).await {
                Ok(passed) => passed,
                Err(error) => {
                    let context = parts.extensions.get::<RequestContext>().cloned().unwrap_or_default();
                    return Ok(error.into_response(&context.id));
                }
            };
            let mut response = inner.call(http::Request::from_parts(parts, body)).await?;
            check.finish(passed, &mut response);
            Ok(response)
        })
    }
}

/// The path that panics when `--panic-test-route` is on (never by default).
pub const PANIC_TEST_PATH: &str = "/_test/panic";

pub struct Routing {
    /// `--panic-test-route`: [`PANIC_TEST_PATH`] panics.
    pub panic_test_route: bool,
}

impl Check for Routing {
    type Passed = ();

    async fn check(&self, request: &mut http::request::Parts) -> Result<(), ApiError> {
        if self.panic_test_route && request.uri.path() == PANIC_TEST_PATH {
            panic!("the panic test route was called");
        }
        let route = Route::recognize(&request.method, request.uri.path()).ok_or(ApiError::Code(ErrorCode::NotFound))?;
        request.extensions.insert(route);
        Ok(())
    }
}

/// The key and its scope; public routes (the contract document) pass without a key.
pub struct Authentication(pub Arc<AppState>);

impl Check for Authentication {
    type Passed = ();

    async fn check(&self, request: &mut http::request::Parts) -> Result<(), ApiError> {
        let Some(scope) = request.extensions.get::<Route>().and_then(|route| route.scope()) else {
            return Ok(());
        };
        let principal = self.0.auth.authenticate(request.headers.get(http::header::AUTHORIZATION)).await?;
        if let Some(context) = request.extensions.get::<RequestContext>() {
            context.authenticated(&principal);
        }
        if !principal.scopes.iter().any(|s| s == scope) {
            count_refused_request(&self.0, &principal).await;
            return Err(ApiError::InsufficientScope { missing: scope });
        }
        request.extensions.insert(principal);
        Ok(())
    }
}

pub struct QueryString(pub Arc<AppState>);

impl Check for QueryString {
    type Passed = ();

    async fn check(&self, request: &mut http::request::Parts) -> Result<(), ApiError> {
        let refuses = request.extensions.get::<Route>().is_some_and(|route| route.refuses_query());
        if refuses && request.uri.query().is_some() {
            if let Some(principal) = request.extensions.get::<Principal>() {
                count_refused_request(&self.0, principal).await;
            }
            return Err(ApiError::Code(ErrorCode::QueryNotAllowed));
        }
        Ok(())
    }
}

/// Every authenticated request counts against its key's request limit, also one refused for a
/// reason that the error order answers before the limit (403 insufficient_scope, 400
/// query_not_allowed): else a key could send such requests without end. Its own refusal
/// answers it whatever the count says, and the limit's refusal metric does not count it.
async fn count_refused_request(state: &AppState, principal: &Principal) {
    let _ = state.limiter.count(&principal.key_id, Counter::Requests, 1).await;
}

/// One request against its key's request limit; what is not authenticated is not counted, and
/// what a check above refused was counted there.
pub struct RequestRateLimit(pub Arc<AppState>);

impl Check for RequestRateLimit {
    type Passed = Option<Quota>;

    async fn check(&self, request: &mut http::request::Parts) -> Result<Option<Quota>, ApiError> {
        match request.extensions.get::<Principal>() {
            Some(principal) => self.0.limiter.check(&principal.key_id, Counter::Requests, 1).await,
            None => Ok(None),
        }
    }

    fn finish(&self, quota: Option<Quota>, response: &mut Response) {
        if let Some(quota) = quota {
            let headers = response.headers_mut();
            headers.insert(RATELIMIT_LIMIT, quota.limit.into());
            headers.insert(RATELIMIT_REMAINING, quota.remaining.into());
            headers.insert(RATELIMIT_RESET, quota.reset_secs.into());
        }
    }
}

/// Writes only: validation writes nothing.
pub struct WriteAdmission(pub Arc<AppState>);

impl Check for WriteAdmission {
    type Passed = ();

    async fn check(&self, request: &mut http::request::Parts) -> Result<(), ApiError> {
        if !request.extensions.get::<Route>().is_some_and(|route| route.is_write()) {
            return Ok(());
        }
        let Some(principal) = request.extensions.get::<Principal>() else {
            return Err(ApiError::Internal("a write without a principal".into()));
        };
        let admitted = self.0.admission.admit_write(&principal.workspace_id)?;
        request.extensions.insert(admitted);
        Ok(())
    }
}
