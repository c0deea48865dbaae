//! One input row: the item sent for it, what the rejects file writes back for it, and why it
//! failed.

use serde::Serialize;
use serde_json::Value;

/// A row as read: the conversion to send (serialized), or why it cannot be sent at all.
pub struct Row {
    pub original: Original,
    pub item: Result<Vec<u8>, RowError>,
}

/// What the rejects file needs to write the row back in the input's format.
pub enum Original {
    /// The row's cells, in the order of the rejects file's header.
    Csv(Vec<String>),
    /// A JSON object: written back from the item itself.
    JsonObject,
    /// A line that is not a JSON object, as it was read.
    Line(String),
}

/// Why a row failed: the API's error object of the item or of its batch, or a local problem
/// (`invalid_json`, `invalid_csv_row`, `payload_too_large`, `connection_failed`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RowError {
    pub code: String,
    pub message: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub details: Vec<Value>,
}

impl RowError {
    pub fn new(code: &str, message: impl Into<String>) -> RowError {
        RowError { code: code.to_owned(), message: message.into(), details: Vec::new() }
    }

    /// The API's `{"code", "message", "details"}`, or `None` when `value` is not one.
    pub fn from_api(value: &Value) -> Option<RowError> {
        Some(RowError {
            code: value["code"].as_str()?.to_owned(),
            message: value["message"].as_str().unwrap_or_default().to_owned(),
            details: value["details"].as_array().cloned().unwrap_or_default(),
        })
    }

    /// One line for a CSV cell: `code: path: message; path: message`, or `code: message`.
    pub fn text(&self) -> String {
        let details: Vec<String> = self
            .details
            .iter()
            .map(|d| {
                format!("{}: {}", d["path"].as_str().unwrap_or_default(), d["message"].as_str().unwrap_or_default())
            })
            .collect();
        if details.is_empty() {
            format!("{}: {}", self.code, self.message)
        } else {
            format!("{}: {}", self.code, details.join("; "))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_names_the_code_and_each_bad_field() {
        let error = RowError::from_api(&json!({
            "code": "validation_failed",
            "message": "One or more fields are invalid.",
            "details": [{"path": "event", "message": "must match ^[A-Za-z0-9_]{1,40}$"}, {"path": "tags.x", "message": "too long"}]
        }));
        assert_eq!(
            error.map(|e| e.text()).as_deref(),
            Some("validation_failed: event: must match ^[A-Za-z0-9_]{1,40}$; tags.x: too long")
        );
        assert_eq!(RowError::new("internal_error", "Retry.").text(), "internal_error: Retry.");
        assert_eq!(RowError::from_api(&json!({"message": "no code"})), None);
    }
}
