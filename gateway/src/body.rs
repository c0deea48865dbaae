//! Reads a request body without ever holding more than the endpoint's limit: a declared
//! Content-Length over the limit is refused before reading, a body that turns out longer (no
//! Content-Length, or a false one) is cut off at the limit, and a gzip body is inflated only up
//! to the limit, so a decompression bomb costs at most the limit in memory. The whole body must
//! arrive within the body read timeout (a deadline for all of it, not per read, so that a
//! client trickling a byte at a time is bounded too), else 408 request_timeout.

use crate::api_error::ApiError;
use crate::request_body::RequestBody;
use bytes::Bytes;
use flate2::read::GzDecoder;
use http_body_util::{BodyExt, Limited};
use intake_model::error::ErrorCode;
use std::io::Read;
use std::time::Duration;

pub const SINGLE_LIMIT: usize = 32 * 1024;
pub const BATCH_LIMIT: usize = 1024 * 1024;

pub async fn read_limited(
    headers: &http::HeaderMap,
    body: RequestBody,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, ApiError> {
    let encoding = content_encoding(headers)?;
    let declared =
        headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if encoding == Encoding::Identity && declared.is_some_and(|length| length > limit as u64) {
        return Err(too_large());
    }
    let http1 = body.is_http1();
    let bytes = match tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(error)) if error.downcast_ref::<http_body_util::LengthLimitError>().is_some() => return Err(too_large()),
        // The client went away or sent a broken chunked body.
        Ok(Err(_)) => return Err(ApiError::Code(ErrorCode::InvalidJson)),
        // On HTTP/1 the connection closes after the response (request_body.rs).
        Err(_) => return Err(ApiError::RequestTimeout { connection_closed: http1 }),
    };
    match encoding {
        Encoding::Identity => Ok(bytes),
        Encoding::Gzip => inflate(&bytes, limit),
    }
}

#[derive(Debug, PartialEq, Eq)]
enum Encoding {
    Identity,
    Gzip,
}

fn content_encoding(headers: &http::HeaderMap) -> Result<Encoding, ApiError> {
    match headers.get(http::header::CONTENT_ENCODING).map(|v| v.to_str().map(|s| s.trim().to_ascii_lowercase())) {
        None => Ok(Encoding::Identity),
        Some(Ok(value)) if value.is_empty() || value == "identity" => Ok(Encoding::Identity),
        Some(Ok(value)) if value == "gzip" || value == "x-gzip" => Ok(Encoding::Gzip),
        Some(_) => Err(ApiError::Code(ErrorCode::UnsupportedMediaType)),
    }
}

fn inflate(compressed: &[u8], limit: usize) -> Result<Bytes, ApiError> {
    let mut inflated = Vec::with_capacity(compressed.len().saturating_mul(4).min(limit + 1));
    // One byte past the limit tells "exactly at the limit" from "over it".
    let read = GzDecoder::new(compressed).take(limit as u64 + 1).read_to_end(&mut inflated);
    match read {
        Ok(_) if inflated.len() > limit => Err(too_large()),
        Ok(_) => Ok(Bytes::from(inflated)),
        Err(_) => Err(ApiError::Code(ErrorCode::InvalidJson)),
    }
}

fn too_large() -> ApiError {
    ApiError::Code(ErrorCode::PayloadTooLarge)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::write::GzEncoder;
    use std::io::Write;

    fn gzip(data: &[u8]) -> Vec<u8> {
        let mut encoder = GzEncoder::new(Vec::new(), flate2::Compression::default());
        let _ = encoder.write_all(data);
        encoder.finish().unwrap_or_default()
    }

    #[test]
    fn inflates_up_to_the_limit() {
        let data = vec![b'a'; 1000];
        assert_eq!(inflate(&gzip(&data), 1000).map(|b| b.len()).ok(), Some(1000));
        assert!(matches!(inflate(&gzip(&data), 999), Err(ApiError::Code(ErrorCode::PayloadTooLarge))));
    }

    #[test]
    fn bomb_is_refused_without_inflating_it() {
        let bomb = gzip(&vec![0u8; 50 * 1024 * 1024]);
        assert!(bomb.len() < 100 * 1024);
        assert!(matches!(inflate(&bomb, BATCH_LIMIT), Err(ApiError::Code(ErrorCode::PayloadTooLarge))));
    }

    #[test]
    fn corrupt_gzip_is_invalid_json() {
        assert!(matches!(inflate(b"not gzip", 100), Err(ApiError::Code(ErrorCode::InvalidJson))));
    }
}
