//! POST /v1/conversions/validate (docs/api.md, "POST /v1/conversions/validate"): the batch
//! endpoint's envelope, limits and error order, less the conversion limit; every item validated,
//! normalized and hashed, nothing written (no Kafka message, no conversion counted). The answer
//! says per item what a batch send would do with it: its warnings, or its error.

use crate::api_error::ApiError;
use crate::body::BATCH_LIMIT;
use crate::context::RequestContext;
use crate::conversions::{parse, read_body};
use crate::request_body::RequestBody;
use crate::response::{json, Response};
use crate::state::AppState;
use intake_common::config::now_ms;
use intake_model::conversion::Warning;
use intake_model::validate::validate_batch;
use serde::Serialize;

pub async fn batch(state: &AppState, request: http::Request<RequestBody>) -> Result<Response, ApiError> {
    let received_at_ms = now_ms();
    let context = RequestContext::of(&request);
    let body = read_body(state, request, BATCH_LIMIT).await?;
    let validated = validate_batch(&parse(&body)?, received_at_ms).map_err(ApiError::Validation)?;
    drop(body);
    context.items(validated.len());

    let items: Vec<Result<Vec<Warning>, ApiError>> =
        validated.into_iter().map(|item| item.map(|valid| valid.warnings).map_err(ApiError::from)).collect();
    let mut summary = Summary::default();
    let results: Vec<ItemBody> = items
        .iter()
        .enumerate()
        .map(|(index, item)| match item {
            Ok(warnings) => {
                summary.valid += 1;
                ItemBody::Valid { index, ok: true, warnings }
            }
            Err(error) => {
                summary.failed += 1;
                ItemBody::Refused { index, ok: false, error: error.body(None) }
            }
        })
        .collect();
    #[derive(Serialize)]
    struct Validation<'a> {
        results: Vec<ItemBody<'a>>,
        summary: Summary,
    }
    Ok(json(200, &Validation { results, summary }))
}

/// One item of the answer, in input order.
#[derive(Serialize)]
#[serde(untagged)]
enum ItemBody<'a> {
    /// Always with its warnings, an empty list when there are none.
    Valid {
        index: usize,
        ok: bool,
        warnings: &'a [Warning],
    },
    Refused {
        index: usize,
        ok: bool,
        error: crate::api_error::ErrorBody<'a>,
    },
}

#[derive(Default, Serialize)]
struct Summary {
    valid: u64,
    failed: u64,
}
