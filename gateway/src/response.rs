//! Response construction shared by the handlers.

use bytes::Bytes;
use http_body_util::Full;

pub type Response = http::Response<Full<Bytes>>;

pub fn json(status: u16, body: &impl serde::Serialize) -> Response {
    let bytes = serde_json::to_vec(body).unwrap_or_default();
    let mut response = http::Response::new(Full::new(Bytes::from(bytes)));
    *response.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::INTERNAL_SERVER_ERROR);
    response.headers_mut().insert(http::header::CONTENT_TYPE, http::HeaderValue::from_static("application/json"));
    response
}
