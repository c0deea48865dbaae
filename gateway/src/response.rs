//! Response construction shared by the handlers.

use bytes::Bytes;
use http_body_util::Full;

pub type Response = http::Response<Full<Bytes>>;

// Names the `http` crate has no constants for, made once: a `&str` name is parsed on every insert.
pub const X_REQUEST_ID: http::HeaderName = http::HeaderName::from_static("x-request-id");
/// Where a write's time went (`timing.rs`).
pub const SERVER_TIMING: http::HeaderName = http::HeaderName::from_static("server-timing");
pub const RATELIMIT_LIMIT: http::HeaderName = http::HeaderName::from_static("ratelimit-limit");
pub const RATELIMIT_REMAINING: http::HeaderName = http::HeaderName::from_static("ratelimit-remaining");
pub const RATELIMIT_RESET: http::HeaderName = http::HeaderName::from_static("ratelimit-reset");

pub fn json(status: u16, body: &impl serde::Serialize) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = http::Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    response
}
