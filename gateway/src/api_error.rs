//! Every error the API answers, mapped to its status, code, body and headers in this one place.

use crate::response::{json, Response};
use intake_model::error::{ErrorCode, FieldError};
use intake_model::validate::Invalid;
use serde::Serialize;

/// The realm of the API keys' Bearer scheme (RFC 6750).
const REALM: &str = "conversions";

#[derive(Debug)]
pub enum ApiError {
    /// An error fully described by its code.
    Code(ErrorCode),
    Validation(Vec<FieldError>),
    InsufficientScope {
        missing: &'static str,
    },
    RateLimited {
        retry_after_secs: u64,
    },
    /// Refused before the body was read: the gateway cannot expect to answer in time.
    Overloaded {
        retry_after_secs: u64,
    },
    /// The body did not arrive in time; on HTTP/1 the connection closes after the answer, on
    /// HTTP/2 only the request's stream ends.
    RequestTimeout {
        connection_closed: bool,
    },
    /// A server fault; the reason is logged, never sent.
    Internal(String),
}

impl ApiError {
    pub fn code(&self) -> ErrorCode {
        match self {
            ApiError::Code(code) => *code,
            ApiError::Validation(_) => ErrorCode::ValidationFailed,
            ApiError::InsufficientScope { .. } => ErrorCode::InsufficientScope,
            ApiError::RateLimited { .. } => ErrorCode::RateLimited,
            ApiError::Overloaded { .. } => ErrorCode::ServiceUnavailable,
            ApiError::RequestTimeout { .. } => ErrorCode::RequestTimeout,
            ApiError::Internal(_) => ErrorCode::InternalError,
        }
    }

    pub fn into_response(self, request_id: &str) -> Response {
        let code = self.code();
        if let ApiError::Internal(reason) = &self {
            tracing::error!(request_id, %reason, "internal error");
        }
        let mut response = json(code.status(), &Document { error: self.body(Some(request_id)) });
        let headers = response.headers_mut();
        let www_authenticate = match &self {
            ApiError::Code(ErrorCode::MissingApiKey) => Some(format!("Bearer realm=\"{REALM}\"")),
            ApiError::Code(ErrorCode::InvalidApiKey) => {
                Some(format!("Bearer realm=\"{REALM}\", error=\"invalid_token\""))
            }
            ApiError::InsufficientScope { missing } => {
                Some(format!("Bearer realm=\"{REALM}\", error=\"insufficient_scope\", scope=\"{missing}\""))
            }
            _ => None,
        };
        if let Some(value) = www_authenticate.and_then(|v| http::HeaderValue::from_str(&v).ok()) {
            headers.insert(http::header::WWW_AUTHENTICATE, value);
        }
        if let ApiError::RateLimited { retry_after_secs } | ApiError::Overloaded { retry_after_secs } = self {
            headers.insert(http::header::RETRY_AFTER, http::HeaderValue::from(retry_after_secs));
        }
        response
    }
}

/// The body of an error response.
#[derive(Serialize)]
struct Document<'a> {
    error: ErrorBody<'a>,
}

/// An error as the body says it: at the top of a response with the request's id, or in one item
/// of a batch without.
#[derive(Serialize)]
pub struct ErrorBody<'a> {
    code: &'static str,
    message: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    details: Option<&'a [FieldError]>,
}

impl ApiError {
    /// The body of the error's response, for a response written without `into_response`.
    pub fn document(&self, request_id: &str) -> Vec<u8> {
        serde_json::to_vec(&Document { error: self.body(Some(request_id)) }).unwrap_or_default()
    }

    pub fn body<'a>(&'a self, request_id: Option<&'a str>) -> ErrorBody<'a> {
        let code = self.code();
        let details = match self {
            ApiError::Validation(details) => Some(details.as_slice()),
            _ => None,
        };
        let message = match self {
            ApiError::RequestTimeout { connection_closed: true } => {
                "The request body did not arrive in time; the connection is closed. Retry on a new connection."
            }
            ApiError::RequestTimeout { connection_closed: false } => {
                "The request body did not arrive in time; this request's stream is ended, the connection stays open. Retry."
            }
            _ => code.default_message(),
        };
        ErrorBody { code: code.as_str(), message, request_id, details }
    }
}

impl From<Invalid> for ApiError {
    fn from(invalid: Invalid) -> Self {
        match invalid {
            Invalid::Fields(details) => ApiError::Validation(details),
            Invalid::OccurredAtOutOfRange => ApiError::Code(ErrorCode::OccurredAtOutOfRange),
        }
    }
}
