//! Sending one batch to `POST {base}/conversions/batch` until it has an answer: waits out
//! `Retry-After` on 429 and 503 (every sender pauses, not only the one refused), retries other
//! 5xx and connection errors with exponential backoff and jitter, up to `max_retries` times.
//! Re-sending a batch is safe: matching on event + external_id turns items already written into
//! updates (docs/api.md, "Client guidance").

use crate::row::RowError;
use reqwest::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE, RETRY_AFTER};
use reqwest::StatusCode;
use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

/// What became of a batch.
#[derive(Debug, PartialEq)]
pub enum Outcome {
    /// The batch was answered: one result per item, in order.
    Answered(Vec<ItemResult>),
    /// Every row of the batch failed with this error (an envelope error, or retries ran out).
    Failed(RowError),
    /// No batch can succeed (the key or the address is refused): the run stops.
    Fatal(RowError),
}

#[derive(Debug, PartialEq)]
pub enum ItemResult {
    Created,
    Updated,
    Unchanged,
    Failed(RowError),
}

pub struct Settings {
    pub base_url: String,
    pub key: String,
    pub max_retries: u32,
    pub timeout: Duration,
}

pub struct Client {
    http: reqwest::Client,
    url: String,
    authorization: HeaderValue,
    max_retries: u32,
    /// No request leaves before this instant: set by a `Retry-After`.
    paused_until: Mutex<Option<Instant>>,
    pub retries: AtomicU64,
}

/// What one attempt came to.
enum Attempt {
    Done(Outcome),
    Retry { after: Option<Duration>, error: RowError },
}

const BACKOFF_FIRST: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);

impl Client {
    pub fn new(settings: Settings) -> anyhow::Result<Client> {
        let mut authorization = HeaderValue::from_str(&format!("Bearer {}", settings.key.trim()))
            .map_err(|_| anyhow::anyhow!("the API key has characters a header cannot carry"))?;
        // Kept out of any debug output.
        authorization.set_sensitive(true);
        let http = reqwest::Client::builder()
            .timeout(settings.timeout)
            .user_agent(concat!("intake-send/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Client {
            http,
            url: format!("{}/conversions/batch", settings.base_url.trim_end_matches('/')),
            authorization,
            max_retries: settings.max_retries,
            paused_until: Mutex::new(None),
            retries: AtomicU64::new(0),
        })
    }

    pub async fn send(&self, body: Vec<u8>, items: usize) -> Outcome {
        // Cloned for each attempt without copying.
        let body = bytes::Bytes::from(body);
        let mut retry = 0;
        loop {
            self.wait_for_pause().await;
            let sent = self
                .http
                .post(&self.url)
                .header(AUTHORIZATION, self.authorization.clone())
                .header(CONTENT_TYPE, "application/json")
                .body(body.clone())
                .send()
                .await;
            let attempt = match sent {
                Ok(response) => judge(response, items).await,
                Err(error) => Attempt::Retry { after: None, error: RowError::new("connection_failed", causes(&error)) },
            };
            match attempt {
                Attempt::Done(outcome) => return outcome,
                Attempt::Retry { error, .. } if retry >= self.max_retries => {
                    let message = format!("{} (gave up after {retry} retries)", error.message);
                    return Outcome::Failed(RowError { message, ..error });
                }
                Attempt::Retry { after, .. } => {
                    retry += 1;
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    match after {
                        Some(after) => self.pause_for(after + jitter(Duration::from_millis(500))),
                        None => tokio::time::sleep(backoff(retry)).await,
                    }
                }
            }
        }
    }

    fn pause_for(&self, delay: Duration) {
        let until = Instant::now() + delay;
        let mut paused = self.paused_until.lock().unwrap_or_else(|e| e.into_inner());
        if paused.is_none_or(|p| p < until) {
            *paused = Some(until);
        }
    }

    /// Sleeps while a pause is in force, including one set by another sender meanwhile.
    async fn wait_for_pause(&self) {
        loop {
            let until = *self.paused_until.lock().unwrap_or_else(|e| e.into_inner());
            match until {
                Some(until) if until > Instant::now() => tokio::time::sleep_until(until).await,
                _ => return,
            }
        }
    }
}

async fn judge(response: reqwest::Response, items: usize) -> Attempt {
    let status = response.status();
    let retry_after = response
        .headers()
        .get(RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs);
    let body = response.bytes().await;
    let body = match body {
        Ok(body) => body,
        Err(error) => return Attempt::Retry { after: None, error: RowError::new("connection_failed", causes(&error)) },
    };
    let json: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let error = || {
        RowError::from_api(&json["error"]).unwrap_or_else(|| {
            RowError::new(
                &format!("http_{}", status.as_u16()),
                String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
            )
        })
    };
    match status {
        StatusCode::OK => match results(&json, items) {
            Some(results) => Attempt::Done(Outcome::Answered(results)),
            None => Attempt::Retry {
                after: None,
                error: RowError::new("bad_response", "the batch answer is not one result per item"),
            },
        },
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
            Attempt::Retry { after: retry_after, error: error() }
        }
        StatusCode::REQUEST_TIMEOUT => Attempt::Retry { after: retry_after, error: error() },
        status if status.is_server_error() => Attempt::Retry { after: retry_after, error: error() },
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN | StatusCode::NOT_FOUND => {
            Attempt::Done(Outcome::Fatal(error()))
        }
        _ => Attempt::Done(Outcome::Failed(error())),
    }
}

/// The error and its causes ("error sending request" alone does not say what went wrong).
fn causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// `{"results": [...]}` as one result per item, or `None` when it is not that.
fn results(json: &Value, items: usize) -> Option<Vec<ItemResult>> {
    let results = json["results"].as_array()?;
    if results.len() != items {
        return None;
    }
    results
        .iter()
        .map(|result| match (result["ok"].as_bool()?, result["conversion"]["result"].as_str()) {
            (true, Some("created")) => Some(ItemResult::Created),
            (true, Some("updated")) => Some(ItemResult::Updated),
            (true, Some("unchanged")) => Some(ItemResult::Unchanged),
            (true, _) => None,
            (false, _) => Some(ItemResult::Failed(
                RowError::from_api(&result["error"])
                    .unwrap_or_else(|| RowError::new("unknown", "the item failed without an error")),
            )),
        })
        .collect()
}

/// Exponential backoff before retry `n` (from 1): 0.5 s, 1 s, 2 s, ... up to 30 s, the upper
/// half of it random so that senders retrying together spread out.
fn backoff(n: u32) -> Duration {
    let full = BACKOFF_FIRST.saturating_mul(1 << n.saturating_sub(1).min(16)).min(BACKOFF_MAX);
    full / 2 + jitter(full / 2)
}

fn jitter(up_to: Duration) -> Duration {
    use rand::Rng;
    up_to.mul_f64(rand::thread_rng().gen_range(0.0..=1.0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        for n in 1..=20 {
            let full = BACKOFF_FIRST.saturating_mul(1 << (n - 1).min(16)).min(BACKOFF_MAX);
            let delay = backoff(n);
            assert!(delay >= full / 2 && delay <= full, "retry {n}: {delay:?}");
        }
        assert!(backoff(30) <= BACKOFF_MAX);
    }

    #[test]
    fn results_map_each_item_in_order() {
        let answer = json!({"results": [
            {"index": 0, "ok": true, "conversion": {"result": "created"}},
            {"index": 1, "ok": false, "error": {"code": "validation_failed", "message": "m", "details": [{"path": "event", "message": "bad"}]}},
            {"index": 2, "ok": true, "conversion": {"result": "unchanged"}},
        ]});
        let results = results(&answer, 3).unwrap_or_default();
        assert_eq!(results[0], ItemResult::Created);
        assert!(matches!(&results[1], ItemResult::Failed(e) if e.code == "validation_failed" && e.details.len() == 1));
        assert_eq!(results[2], ItemResult::Unchanged);
        assert!(super::results(&answer, 4).is_none(), "a count that does not match is no answer");
        assert!(super::results(&json!({"results": [{"ok": true}]}), 1).is_none());
    }
}
