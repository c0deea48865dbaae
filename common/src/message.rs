//! The messages between gateway and writer. Both are versioned (`"v"`), so that a writer can
//! refuse a message it does not understand instead of misreading it, and so that gateway and
//! writer can be upgraded one after the other.
//!
//! One request message carries one chunk of at most [`MAX_CHUNK_ITEMS`] validated items of one
//! workspace; its Kafka key is the workspace id, so that one workspace's chunks are applied in
//! order. The writer answers each request with one reply on the gateway's reply partition.

use crate::conversion::Conversion;
use serde::{Deserialize, Serialize};

pub const MAX_CHUNK_ITEMS: usize = 100;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "v")]
pub enum WriteRequest {
    #[serde(rename = "1")]
    V1(WriteRequestV1),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteRequestV1 {
    /// Unique per message; the reply carries it back, and the writer remembers applied ids so
    /// that a redelivered message is answered with its first outcome, not applied again.
    pub correlation_id: String,
    /// The partition of the replies topic that the sending gateway reads.
    pub reply_partition: i32,
    /// Epoch ms after which the gateway no longer waits. The writer applies the message anyway.
    pub deadline_ms: i64,
    /// Epoch ms when the gateway received the request; the 90-day matching rule counts from it.
    pub received_at_ms: i64,
    pub workspace_id: String,
    /// Items in input order.
    pub items: Vec<Conversion>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "v")]
pub enum WriteReply {
    #[serde(rename = "1")]
    V1(WriteReplyV1),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteReplyV1 {
    pub correlation_id: String,
    pub outcome: ChunkOutcome,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ChunkOutcome {
    /// The chunk was committed; one result per item, in order.
    Applied { results: Vec<ItemResult> },
    /// The chunk was not applied and will not be (it went to the dead-letter topic).
    Failed,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemResult {
    pub id: String,
    pub event: String,
    pub external_id: String,
    pub chain_id: String,
    pub result: WriteResult,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WriteResult {
    Created,
    Updated,
    Unchanged,
}

impl WriteResult {
    pub fn as_str(self) -> &'static str {
        match self {
            WriteResult::Created => "created",
            WriteResult::Updated => "updated",
            WriteResult::Unchanged => "unchanged",
        }
    }
}

/// The correlation id of a reply, whatever its version.
impl WriteReply {
    pub fn correlation_id(&self) -> &str {
        match self {
            WriteReply::V1(reply) => &reply.correlation_id,
        }
    }
}
