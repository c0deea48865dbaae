//! POST /v1/conversions and POST /v1/conversions/batch: read, parse, validate and hash, count
//! against the conversion limit, then write through Kafka and answer with the writer's results.

use crate::api_error::ApiError;
use crate::app::{App, RequestContext};
use crate::auth::Principal;
use crate::body::{self, BATCH_LIMIT, SINGLE_LIMIT};
use crate::ratelimit::Counter;
use crate::response::{json, Response};
use crate::writes::WriteError;
use hyper::body::Incoming;
use intake_common::config::now_ms;
use intake_common::conversion::{ValidConversion, Warning};
use intake_common::error::ErrorCode;
use intake_common::message::{ItemResult, WriteResult, MAX_CHUNK_ITEMS};
use intake_common::validate::{validate_batch, validate_conversion, Invalid};
use serde_json::{json, Value};

pub async fn single(
    app: &App,
    principal: &Principal,
    context: &RequestContext,
    request: http::Request<Incoming>,
) -> Result<Response, ApiError> {
    let received_at_ms = now_ms();
    let value = read_json(app, context, request, SINGLE_LIMIT).await?;
    context.items(1);
    let valid = validate_conversion(&value, received_at_ms)?;
    app.limiter.check(&principal.key_id, Counter::Conversions, 1).await?;
    let results = write(app, principal, context, vec![vec![valid.conversion]], received_at_ms).await?;
    let result = results.into_iter().flatten().next().ok_or_else(|| ApiError::Internal("empty reply".into()))?;
    let status = if result.result == WriteResult::Created { 201 } else { 200 };
    Ok(json(status, &json!({ "conversion": conversion_result(&result, &valid.warnings) })))
}

pub async fn batch(
    app: &App,
    principal: &Principal,
    context: &RequestContext,
    request: http::Request<Incoming>,
) -> Result<Response, ApiError> {
    let received_at_ms = now_ms();
    let value = read_json(app, context, request, BATCH_LIMIT).await?;
    let validated: Vec<Result<ValidConversion, Invalid>> =
        validate_batch(&value, received_at_ms).map_err(ApiError::Validation)?;
    context.items(validated.len());
    // Every item counts, valid or not (DESIGN section 4).
    app.limiter.check(&principal.key_id, Counter::Conversions, validated.len() as u64).await?;

    let valid: Vec<(usize, &ValidConversion)> =
        validated.iter().enumerate().filter_map(|(index, item)| item.as_ref().ok().map(|v| (index, v))).collect();
    let chunks: Vec<Vec<_>> = valid
        .chunks(MAX_CHUNK_ITEMS)
        .map(|chunk| chunk.iter().map(|(_, item)| item.conversion.clone()).collect())
        .collect();
    let mut written = write(app, principal, context, chunks, received_at_ms).await?.into_iter().flatten();

    let mut summary = Summary::default();
    let results: Vec<Value> = validated
        .iter()
        .enumerate()
        .map(|(index, item)| match item {
            Ok(valid) => match written.next() {
                Some(result) => {
                    summary.count(result.result);
                    json!({ "index": index, "ok": true, "conversion": conversion_result(&result, &valid.warnings) })
                }
                None => {
                    summary.failed += 1;
                    item_error(index, ApiError::Internal("missing item result".into()))
                }
            },
            Err(invalid) => {
                summary.failed += 1;
                item_error(index, ApiError::from(invalid.clone()))
            }
        })
        .collect();
    Ok(json(200, &json!({ "results": results, "summary": summary.to_json() })))
}

async fn read_json(app: &App, context: &RequestContext, request: http::Request<Incoming>, limit: usize) -> Result<Value, ApiError> {
    let (parts, body) = request.into_parts();
    let bytes = body::read_limited(&parts.headers, body, limit, app.body_read_timeout).await?;
    context.body_read();
    serde_json::from_slice(&bytes).map_err(|_| ApiError::Code(ErrorCode::InvalidJson))
}

async fn write(
    app: &App,
    principal: &Principal,
    context: &RequestContext,
    chunks: Vec<Vec<intake_common::conversion::Conversion>>,
    received_at_ms: i64,
) -> Result<Vec<Vec<ItemResult>>, ApiError> {
    if chunks.is_empty() {
        return Ok(Vec::new());
    }
    app.writes.write(&context.id, &principal.workspace_id, chunks, received_at_ms, context.started).await.map_err(|error: WriteError| {
        app.metrics.write_failures.inc();
        ApiError::Internal(error.to_string())
    })
}

fn conversion_result(result: &ItemResult, warnings: &[Warning]) -> Value {
    let mut conversion = json!({
        "id": result.id,
        "event": result.event,
        "external_id": result.external_id,
        "chain_id": result.chain_id,
        "result": result.result.as_str(),
    });
    if !warnings.is_empty() {
        conversion["warnings"] = json!(warnings);
    }
    conversion
}

fn item_error(index: usize, error: ApiError) -> Value {
    let code = error.code();
    let mut body = json!({ "code": code.as_str(), "message": code.default_message() });
    if let ApiError::Validation(details) = error {
        body["details"] = json!(details);
    }
    json!({ "index": index, "ok": false, "error": body })
}

#[derive(Default)]
struct Summary {
    created: u64,
    updated: u64,
    unchanged: u64,
    failed: u64,
}

impl Summary {
    fn count(&mut self, result: WriteResult) {
        match result {
            WriteResult::Created => self.created += 1,
            WriteResult::Updated => self.updated += 1,
            WriteResult::Unchanged => self.unchanged += 1,
        }
    }

    fn to_json(&self) -> Value {
        json!({ "created": self.created, "updated": self.updated, "unchanged": self.unchanged, "failed": self.failed })
    }
}
