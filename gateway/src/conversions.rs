//! POST /v1/conversions and POST /v1/conversions/batch: read, parse, validate and hash, count
//! against the conversion limit, then write through Kafka and answer with the writer's results.

use crate::api_error::{ApiError, ErrorBody};
use crate::auth::Principal;
use crate::body::{self, BATCH_LIMIT, SINGLE_LIMIT};
use crate::context::{self, RequestContext};
use crate::overload::{AdmittedWrite, WorkspaceTicket, WritePermit};
use crate::ratelimit::Counter;
use crate::request_body::RequestBody;
use crate::response::{json, Response};
use crate::sink::{ChunkedWrite, WriteError};
use crate::state::AppState;
use intake_common::config::now_ms;
use intake_model::conversion::{Conversion, ValidConversion, Warning};
use intake_model::error::ErrorCode;
use intake_model::message::{ItemResult, WriteResult, MAX_CHUNK_ITEMS};
use intake_model::validate::{validate_batch, validate_conversion, Json};
use serde::Serialize;

pub async fn single(state: &AppState, request: http::Request<RequestBody>) -> Result<Response, ApiError> {
    let received_at_ms = now_ms();
    let (context, principal, admitted) = from_layers(&request)?;
    let body = read_body(state, request, SINGLE_LIMIT).await?;
    let permit = write_permit(state, admitted.as_ref())?;
    let ticket = permit.as_ref().map(|permit| permit.ticket.clone());
    let input = parse(&body)?;
    context.items(1);
    let valid = validate_conversion(&input, received_at_ms)?;
    state.limiter.check(&principal.key_id, Counter::Conversions, 1).await?;
    let write = Write { state, principal: &principal, context: &context, received_at_ms, ticket: &ticket };
    let results = write.chunks(vec![vec![valid.conversion]]).await?;
    let result = results.into_iter().flatten().next().ok_or_else(|| ApiError::Internal("empty reply".into()))?;
    let status = if result.result == WriteResult::Created { 201 } else { 200 };
    #[derive(Serialize)]
    struct Single<'a> {
        conversion: ConversionBody<'a>,
    }
    Ok(json(status, &Single { conversion: ConversionBody::new(&result, &valid.warnings) }))
}

pub async fn batch(state: &AppState, request: http::Request<RequestBody>) -> Result<Response, ApiError> {
    let received_at_ms = now_ms();
    let (context, principal, admitted) = from_layers(&request)?;
    let body = read_body(state, request, BATCH_LIMIT).await?;
    let permit = write_permit(state, admitted.as_ref())?;
    let ticket = permit.as_ref().map(|permit| permit.ticket.clone());
    let validated = validate_batch(&parse(&body)?, received_at_ms).map_err(ApiError::Validation)?;
    drop(body);
    context.items(validated.len());
    // Every item counts, valid or not (docs/api.md, "Rate limits").
    state.limiter.check(&principal.key_id, Counter::Conversions, validated.len() as u64).await?;

    // The valid conversions move into the chunks; each item keeps its warnings or its error.
    let mut valid = Vec::with_capacity(validated.len());
    let items: Vec<Result<Vec<Warning>, ApiError>> = validated
        .into_iter()
        .map(|item| {
            item.map(|ValidConversion { conversion, warnings }| {
                valid.push(conversion);
                warnings
            })
            .map_err(ApiError::from)
        })
        .collect();
    let write = Write { state, principal: &principal, context: &context, received_at_ms, ticket: &ticket };
    let written: Vec<ItemResult> = write.chunks(into_chunks(valid)).await?.into_iter().flatten().collect();

    let mut written = written.iter();
    let missing = ApiError::Internal("missing item result".into());
    let mut summary = Summary::default();
    let results: Vec<ItemBody> = items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            let written = match item {
                Ok(warnings) => written.next().map(|result| ConversionBody::new(result, warnings)).ok_or(&missing),
                Err(error) => Err(error),
            };
            match written {
                Ok(conversion) => {
                    summary.count(conversion.result);
                    ItemBody::Written { index, ok: true, conversion }
                }
                Err(error) => {
                    summary.failed += 1;
                    ItemBody::Refused { index, ok: false, error: error.body(None) }
                }
            }
        })
        .collect();
    #[derive(Serialize)]
    struct Batch<'a> {
        results: Vec<ItemBody<'a>>,
        summary: Summary,
    }
    Ok(json(200, &Batch { results, summary }))
}

/// What the layers found out about a write: its context, its principal, its admission.
fn from_layers(
    request: &http::Request<RequestBody>,
) -> Result<(RequestContext, Principal, Option<AdmittedWrite>), ApiError> {
    let admitted = request.extensions().get::<AdmittedWrite>().cloned();
    Ok((RequestContext::of(request), context::required::<Principal, _>(request)?, admitted))
}

/// The write's place among the writes in flight, taken once its body is in (overload.rs) and
/// held until its response is made.
fn write_permit(state: &AppState, admitted: Option<&AdmittedWrite>) -> Result<Option<WritePermit>, ApiError> {
    admitted.map(|admitted| state.admission.write_permit(admitted)).transpose()
}

pub(crate) async fn read_body(
    state: &AppState,
    request: http::Request<RequestBody>,
    limit: usize,
) -> Result<bytes::Bytes, ApiError> {
    let (parts, body) = request.into_parts();
    let bytes = body::read_limited(&parts.headers, body, limit, state.body_read_timeout).await?;
    Ok(bytes)
}

pub(crate) fn parse(body: &[u8]) -> Result<Json<'_>, ApiError> {
    Json::parse(body).map_err(|_| ApiError::Code(ErrorCode::InvalidJson))
}

/// Chunks of at most [`MAX_CHUNK_ITEMS`], in order, the conversions moved rather than copied.
fn into_chunks(conversions: Vec<Conversion>) -> Vec<Vec<Conversion>> {
    let mut chunks = Vec::with_capacity(conversions.len().div_ceil(MAX_CHUNK_ITEMS));
    let mut rest = conversions.into_iter().peekable();
    while rest.peek().is_some() {
        chunks.push(rest.by_ref().take(MAX_CHUNK_ITEMS).collect());
    }
    chunks
}

/// A request's write through the sink.
struct Write<'a> {
    state: &'a AppState,
    principal: &'a Principal,
    context: &'a RequestContext,
    received_at_ms: i64,
    ticket: &'a Option<WorkspaceTicket>,
}

impl Write<'_> {
    async fn chunks(&self, chunks: Vec<Vec<Conversion>>) -> Result<Vec<Vec<ItemResult>>, ApiError> {
        if chunks.is_empty() {
            return Ok(Vec::new());
        }
        let Write { state, principal, context, received_at_ms, ticket } = self;
        let written = state
            .writes
            .write(ChunkedWrite {
                request_id: &context.id,
                workspace_id: &principal.workspace_id,
                chunks,
                received_at_ms: *received_at_ms,
                started: context.started,
                ticket: ticket.as_ref(),
            })
            .await
            .map_err(|error: WriteError| {
                state.metrics.write_failures.inc();
                ApiError::Internal(error.to_string())
            })?;
        if let Some(stages) = written.stages {
            context.stages(stages);
        }
        Ok(written.chunks)
    }
}

/// A written conversion as the response shows it.
#[derive(Serialize)]
struct ConversionBody<'a> {
    id: &'a str,
    event: &'a str,
    external_id: &'a str,
    chain_id: &'a str,
    result: WriteResult,
    #[serde(skip_serializing_if = "<[Warning]>::is_empty")]
    warnings: &'a [Warning],
}

impl<'a> ConversionBody<'a> {
    fn new(result: &'a ItemResult, warnings: &'a [Warning]) -> Self {
        ConversionBody {
            id: &result.id,
            event: &result.event,
            external_id: &result.external_id,
            chain_id: &result.chain_id,
            result: result.result,
            warnings,
        }
    }
}

/// One item of a batch response.
#[derive(Serialize)]
#[serde(untagged)]
enum ItemBody<'a> {
    Written { index: usize, ok: bool, conversion: ConversionBody<'a> },
    Refused { index: usize, ok: bool, error: ErrorBody<'a> },
}

#[derive(Default, Serialize)]
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
}
