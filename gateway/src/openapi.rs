//! GET /v1/openapi.json: the machine-readable contract, served without a key.

use crate::response::Response;
use bytes::Bytes;
use http_body_util::Full;

const DOCUMENT: &str = include_str!("../openapi.json");

pub fn document() -> Response {
    let mut response = http::Response::new(Full::new(Bytes::from_static(DOCUMENT.as_bytes())));
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    response
}
