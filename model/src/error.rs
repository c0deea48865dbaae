//! The error codes of docs/api.md, "Error codes". A code never changes meaning; this is the only place
//! where a code is tied to its HTTP status.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidJson,
    QueryNotAllowed,
    MissingApiKey,
    InvalidApiKey,
    WorkspaceSuspended,
    InsufficientScope,
    WorkspaceNotFound,
    NotFound,
    PayloadTooLarge,
    UnsupportedMediaType,
    ValidationFailed,
    OccurredAtOutOfRange,
    RateLimited,
    InternalError,
    /// Additive (docs/api.md, "Versioning"): the request body did not arrive within the body read timeout.
    RequestTimeout,
    /// Additive (docs/api.md, "Versioning"): the gateway is overloaded and refuses the request before
    /// reading its body (docs/architecture.md, "Admission"); retry after Retry-After seconds.
    ServiceUnavailable,
    /// Additive (docs/api.md, "Versioning"): the HTTP parser refused the request's head: a
    /// malformed request line or header, or a broken Content-Length or Transfer-Encoding.
    MalformedRequest,
    /// Additive: the request's URI is over 64 KiB.
    UriTooLong,
    /// Additive: the request's head is over its size limit, or has more than 100 headers.
    HeadersTooLarge,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::QueryNotAllowed => "query_not_allowed",
            ErrorCode::MissingApiKey => "missing_api_key",
            ErrorCode::InvalidApiKey => "invalid_api_key",
            ErrorCode::WorkspaceSuspended => "workspace_suspended",
            ErrorCode::InsufficientScope => "insufficient_scope",
            ErrorCode::WorkspaceNotFound => "workspace_not_found",
            ErrorCode::NotFound => "not_found",
            ErrorCode::PayloadTooLarge => "payload_too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::ValidationFailed => "validation_failed",
            ErrorCode::OccurredAtOutOfRange => "occurred_at_out_of_range",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::InternalError => "internal_error",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::ServiceUnavailable => "service_unavailable",
            ErrorCode::MalformedRequest => "malformed_request",
            ErrorCode::UriTooLong => "uri_too_long",
            ErrorCode::HeadersTooLarge => "headers_too_large",
        }
    }

    pub fn status(self) -> u16 {
        match self {
            ErrorCode::InvalidJson | ErrorCode::QueryNotAllowed | ErrorCode::MalformedRequest => 400,
            ErrorCode::MissingApiKey | ErrorCode::InvalidApiKey => 401,
            ErrorCode::WorkspaceSuspended | ErrorCode::InsufficientScope => 403,
            ErrorCode::WorkspaceNotFound | ErrorCode::NotFound => 404,
            ErrorCode::PayloadTooLarge => 413,
            ErrorCode::UnsupportedMediaType => 415,
            ErrorCode::ValidationFailed | ErrorCode::OccurredAtOutOfRange => 422,
            ErrorCode::RateLimited => 429,
            ErrorCode::RequestTimeout => 408,
            ErrorCode::UriTooLong => 414,
            ErrorCode::HeadersTooLarge => 431,
            ErrorCode::InternalError => 500,
            ErrorCode::ServiceUnavailable => 503,
        }
    }

    /// The human message sent with the code. It never contains a value the client sent.
    pub fn default_message(self) -> &'static str {
        match self {
            ErrorCode::InvalidJson => "The request body is not valid JSON.",
            ErrorCode::QueryNotAllowed => "Write endpoints take every field in the JSON body; remove the query string.",
            ErrorCode::MissingApiKey => "Send your API key as 'Authorization: Bearer <API_KEY>'.",
            ErrorCode::InvalidApiKey => "The API key is unknown or has been revoked.",
            ErrorCode::WorkspaceSuspended => "The workspace of this API key is suspended.",
            ErrorCode::InsufficientScope => "The API key lacks the scope this endpoint needs.",
            ErrorCode::WorkspaceNotFound => "The workspace of this API key no longer exists.",
            ErrorCode::NotFound => "There is no such endpoint.",
            ErrorCode::PayloadTooLarge => "The request body is over the size limit of this endpoint.",
            ErrorCode::UnsupportedMediaType => "Content-Encoding must be gzip or identity.",
            ErrorCode::ValidationFailed => "One or more fields are invalid; see details.",
            ErrorCode::OccurredAtOutOfRange => {
                "occurred_at is more than 5 minutes in the future, or before the year 2000."
            }
            ErrorCode::RateLimited => {
                "Too many requests or conversions in this minute; retry after Retry-After seconds."
            }
            ErrorCode::InternalError => "Server fault. Retry; report the request_id to support if it persists.",
            ErrorCode::RequestTimeout => "The request body did not arrive in time. Retry.",
            ErrorCode::ServiceUnavailable => {
                "The service is overloaded and did not process the request; retry after Retry-After seconds."
            }
            ErrorCode::MalformedRequest => {
                "The request is not well-formed HTTP/1.1 (request line, a header, Content-Length or Transfer-Encoding)."
            }
            ErrorCode::UriTooLong => "The request's URI is over 64 KiB.",
            ErrorCode::HeadersTooLarge => "The request's headers are too large or too many (at most 100).",
        }
    }
}

/// One bad field: its path (`event`, `address.zip`, `tags.plan`) and a message that never
/// contains the value that was sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl FieldError {
    pub fn new(path: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError { path: path.into(), message: message.into() }
    }
}
