//! Where the endpoints' writes go: the [`WriteSink`] seam between the HTTP handlers and the
//! write path. The gateway runs on the Kafka request-reply client ([`crate::writes::WriteClient`]);
//! the fast tests of the API's HTTP behaviour run on [`MemorySink`], which needs no broker and no
//! database.

use crate::overload::WorkspaceTicket;
use crate::timing::Stages;
use intake_model::conversion::Conversion;
use intake_model::message::ItemResult;
use std::future::Future;
use std::pin::Pin;

/// A boxed future, for the seams' traits: stable Rust has no `async fn` in traits used as
/// `dyn`, and this is what the `async-trait` crate would generate, without the dependency.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

#[derive(Debug, Clone, thiserror::Error)]
pub enum WriteError {
    #[error("the request could not be sent to Kafka: {0}")]
    Produce(String),
    #[error("no reply from a writer before the deadline")]
    Timeout,
    #[error("a writer could not apply a chunk")]
    Failed,
    #[error("a chunk reached Kafka after its deadline and was not applied")]
    Expired,
}

/// All the chunks of one request, for one deadline.
pub struct ChunkedWrite<'a> {
    pub request_id: &'a str,
    pub workspace_id: &'a str,
    pub chunks: Vec<Vec<Conversion>>,
    pub received_at_ms: i64,
    /// When the request arrived: the deadline counts from here.
    pub started: std::time::Instant,
    /// Counts each chunk against its workspace's admission until it is answered.
    pub ticket: Option<&'a WorkspaceTicket>,
}

/// What a write's chunks were answered with.
pub struct Written {
    /// Each item's result, chunk by chunk, in order.
    pub chunks: Vec<Vec<ItemResult>>,
    /// Where the time of the chunk answered last went, when the write path knows.
    pub stages: Option<Stages>,
}

/// Writes a request's chunks and answers with each item's result.
pub trait WriteSink: Send + Sync {
    /// On an error, earlier chunks may be committed (docs/api.md, "POST /v1/conversions/batch").
    fn write<'a>(&'a self, write: ChunkedWrite<'a>) -> BoxFuture<'a, Result<Written, WriteError>>;

    /// For readiness: `Ok` when a write could be made now, else what fails.
    fn probe(&self) -> BoxFuture<'_, Result<(), String>>;
}

#[cfg(test)]
pub use memory::{MemorySink, Outcome, MEMORY_STAGES};

#[cfg(test)]
mod memory {
    use super::{BoxFuture, ChunkedWrite, WriteError, WriteSink, Written};
    use crate::timing::{ReplyLeg, Stages};
    use intake_model::conversion::Conversion;
    use intake_model::ids;
    use intake_model::message::{ItemResult, WriteResult};
    use std::collections::HashMap;
    use std::sync::Mutex;

    /// What [`MemorySink`] does with the next writes.
    #[derive(Debug, Clone)]
    pub enum Outcome {
        /// Answers from its map, as a writer would for a new, changed or repeated conversion.
        Apply,
        /// Fails every write with this error.
        Fail(WriteError),
        /// Never answers (the request waits until its client or the test gives up).
        Hang,
    }

    type Key = (String, String, String);

    /// What every write through it says about its stages.
    pub const MEMORY_STAGES: Stages = Stages {
        gateway: 0.0,
        produce: 0.0,
        fetch: 0.0,
        queue: 0.0,
        apply: 0.0,
        commit: 0.0,
        reply: ReplyLeg::Whole(0.0),
    };

    /// A sink that applies nothing to a database: it remembers each conversion by (workspace,
    /// event, external id) and answers created for a new one, unchanged for one equal to what it
    /// holds, updated for any other (not the writer's merge rules, which the end-to-end tests
    /// cover). It keeps every chunk it was given, for the tests to look at.
    pub struct MemorySink {
        outcome: Mutex<Outcome>,
        /// By (workspace, event, external id): its first answer and what it holds now.
        stored: Mutex<HashMap<Key, (ItemResult, Conversion)>>,
        chunks: Mutex<Vec<Vec<Conversion>>>,
    }

    fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
        mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    impl Default for MemorySink {
        fn default() -> Self {
            MemorySink { outcome: Mutex::new(Outcome::Apply), stored: Mutex::default(), chunks: Mutex::default() }
        }
    }

    impl MemorySink {
        pub fn set(&self, outcome: Outcome) {
            *lock(&self.outcome) = outcome;
        }

        /// Every chunk it was given so far, in order, whether it applied them or not.
        pub fn chunks(&self) -> Vec<Vec<Conversion>> {
            lock(&self.chunks).clone()
        }

        fn apply(&self, workspace_id: &str, conversion: Conversion) -> ItemResult {
            let event = conversion.event.as_str().to_owned();
            let external_id = conversion.external_id.as_str().to_owned();
            let mut stored = lock(&self.stored);
            match stored.get_mut(&(workspace_id.to_owned(), event.clone(), external_id.clone())) {
                Some((first, held)) => {
                    let result = if *held == conversion { WriteResult::Unchanged } else { WriteResult::Updated };
                    *held = conversion;
                    ItemResult { result, ..first.clone() }
                }
                None => {
                    let result = ItemResult {
                        id: ids::conversion_id(),
                        event: event.clone(),
                        external_id: external_id.clone(),
                        chain_id: ids::chain_id(),
                        result: WriteResult::Created,
                    };
                    stored.insert((workspace_id.to_owned(), event, external_id), (result.clone(), conversion));
                    result
                }
            }
        }
    }

    impl WriteSink for MemorySink {
        fn write<'a>(&'a self, write: ChunkedWrite<'a>) -> BoxFuture<'a, Result<Written, WriteError>> {
            let ChunkedWrite { workspace_id, chunks, .. } = write;
            let outcome = lock(&self.outcome).clone();
            lock(&self.chunks).extend(chunks.iter().cloned());
            Box::pin(async move {
                match outcome {
                    Outcome::Fail(error) => return Err(error),
                    Outcome::Hang => std::future::pending::<()>().await,
                    Outcome::Apply => {}
                }
                let chunks = chunks
                    .into_iter()
                    .map(|chunk| chunk.into_iter().map(|conversion| self.apply(workspace_id, conversion)).collect())
                    .collect();
                Ok(Written { chunks, stages: Some(MEMORY_STAGES) })
            })
        }

        fn probe(&self) -> BoxFuture<'_, Result<(), String>> {
            Box::pin(async { Ok(()) })
        }
    }
}
