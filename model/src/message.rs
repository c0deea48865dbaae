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

/// Read with [`WriteRequest::from_slice`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "v")]
pub enum WriteRequest {
    #[serde(rename = "1")]
    V1(WriteRequestV1),
    /// Not a write: an erasure that `intake-writer erase` applied, recorded in its workspace's
    /// order so that a rewind or a replay that applies the person's data again erases it again.
    #[serde(rename = "erasure-1")]
    Erasure(ErasureV1),
}

/// An erasure as it was applied (docs/api.md, "Erasure"): which identifier, by the value its
/// look-up compares (for an email or a phone, the hash of the normalized value: never the raw
/// identifier), and the erasure's instant, which makes applying it again a no-op once applied.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErasureV1 {
    pub workspace_id: String,
    /// email, phone, contact_id or visitor_id.
    pub kind: String,
    pub value: String,
    /// The erasure's instant, in microseconds since the Unix epoch.
    pub erased_at_us: i64,
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
    /// Which request the chunk belongs to and where in it. Absent in messages of gateways that
    /// predate it (a writer then applies the chunk on its own, as they expect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request: Option<RequestPart>,
    /// Where the writer read it in the requests topic: set by its reader, never sent. The ids
    /// of what it creates derive from it (`ids::Seed`), so that applying it again, after a
    /// restore or on another node, gives the ids its client was told.
    #[serde(skip)]
    pub position: Option<LogPosition>,
}

/// A message's place in the requests topic and the broker's append time (epoch ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogPosition {
    pub partition: i32,
    pub offset: i64,
    pub appended_ms: i64,
}

/// A chunk's place in its HTTP request: when one chunk fails for good, the writer answers the
/// later chunks of the same request as failed without applying them, so that a failed batch
/// leaves a prefix committed, never a gap (docs/architecture.md, "Order within a request").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestPart {
    /// The gateway's request id (X-Request-ID), unique per request.
    pub id: String,
    /// 0-based index of this chunk among the request's chunks.
    pub index: u32,
}

/// Read with [`WriteReply::from_slice`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "v")]
pub enum WriteReply {
    #[serde(rename = "1")]
    V1(WriteReplyV1),
}

impl WriteRequest {
    pub fn from_slice(bytes: &[u8]) -> serde_json::Result<Self> {
        match version(bytes)?.as_ref() {
            "1" => serde_json::from_slice(bytes).map(WriteRequest::V1),
            "erasure-1" => serde_json::from_slice(bytes).map(WriteRequest::Erasure),
            other => Err(unknown_version(other)),
        }
    }
}

impl WriteReply {
    pub fn from_slice(bytes: &[u8]) -> serde_json::Result<Self> {
        match version(bytes)?.as_ref() {
            "1" => serde_json::from_slice(bytes).map(WriteReply::V1),
            other => Err(unknown_version(other)),
        }
    }
}

/// A message's `"v"`, read alone. Not serde's derive for a tagged enum: it copies the whole
/// message into a tree of its own before reading it, a fifth of the writer's time in the
/// batch_ingest profile; reading the version first and then the message straight into its
/// version's struct scans the bytes twice and allocates once.
fn version(bytes: &[u8]) -> serde_json::Result<std::borrow::Cow<'_, str>> {
    #[derive(Deserialize)]
    struct Versioned<'a> {
        #[serde(borrow)]
        v: std::borrow::Cow<'a, str>,
    }
    serde_json::from_slice::<Versioned>(bytes).map(|versioned| versioned.v)
}

fn unknown_version(version: &str) -> serde_json::Error {
    serde::de::Error::unknown_variant(version, &["1"])
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteReplyV1 {
    pub correlation_id: String,
    pub outcome: ChunkOutcome,
    /// When the writer handled the message, for the gateway's `Server-Timing`. Absent from
    /// writers that predate it, and a gateway that predates it ignores it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<WriterTiming>,
}

/// A request message's way through the writer (docs/operations.md, "Where a write's time
/// goes"): the broker's append time in epoch ms (its clock), then the writer's instants in
/// epoch µs (its clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriterTiming {
    pub appended_ms: i64,
    /// Read from the requests topic.
    pub read_us: i64,
    /// Taken by a worker.
    pub taken_us: i64,
    /// Its transaction's commit asked for (for a message answered without one: as committed).
    pub commit_us: i64,
    /// Committed (on the HA layout: and on a synchronous standby), its reply about to be sent.
    pub committed_us: i64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum ChunkOutcome {
    /// The chunk was committed; one result per item, in order.
    Applied {
        results: Vec<ItemResult>,
        /// The chains that this chunk, or a chunk applied with it before it, merged into older
        /// ones, each with the chain it is part of now: the gateway names the chain after the
        /// whole request in the answers of the request's earlier chunks. Absent from writers
        /// that predate it, and from the answer to a message applied before (a redelivery).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        merged: Vec<ChainMerge>,
    },
    /// The chunk was not applied and will not be: it went to the dead-letter topic, or an
    /// earlier chunk of its request did.
    Failed,
    /// The chunk reached the requests topic after its deadline (the broker's append time): the
    /// gateway had answered 500 already, so it is never applied.
    Expired,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ItemResult {
    pub id: String,
    pub event: String,
    pub external_id: String,
    pub chain_id: String,
    pub result: WriteResult,
}

/// A chain merged into an older one: `from`'s conversions are now in `into`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainMerge {
    pub from: String,
    pub into: String,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::validate_conversion;

    #[test]
    fn a_message_of_an_unknown_version_or_none_is_refused() {
        let body = r#"{"correlation_id":"c","reply_partition":0,"deadline_ms":0,"received_at_ms":0,"workspace_id":"ws","items":[]}"#;
        let versioned = |v: &str| body.replacen('{', &format!(r#"{{"v":"{v}","#), 1);
        assert!(WriteRequest::from_slice(versioned("1").as_bytes()).is_ok());
        let error =
            WriteRequest::from_slice(versioned("2").as_bytes()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(error.contains("unknown variant `2`"), "{error}");
        assert!(WriteRequest::from_slice(body.as_bytes()).is_err(), "no version");
        assert!(WriteReply::from_slice(br#"{"v":"9","correlation_id":"c","outcome":{"status":"failed"}}"#).is_err());
    }

    /// A rollout runs gateways and writers of both kinds side by side: a message without the
    /// request part is read, and a writer that predates it ignores the new member.
    #[test]
    fn the_request_part_is_optional_both_ways() {
        let old = r#"{"v":"1","correlation_id":"c","reply_partition":0,"deadline_ms":0,"received_at_ms":0,"workspace_id":"ws","items":[]}"#;
        let Ok(WriteRequest::V1(read)) = WriteRequest::from_slice(old.as_bytes()) else {
            panic!("old message refused")
        };
        assert_eq!(read.request, None);
        let new = old.replacen('{', r#"{"request":{"id":"r","index":1},"#, 1);
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct OldWriter {
            correlation_id: String,
            items: Vec<serde_json::Value>,
        }
        assert!(serde_json::from_str::<OldWriter>(&new).is_ok());
        let Ok(WriteRequest::V1(read)) = WriteRequest::from_slice(new.as_bytes()) else {
            panic!("new message refused")
        };
        assert_eq!(read.request, Some(RequestPart { id: "r".into(), index: 1 }));
    }

    /// Writers that predate `merged` send none, and gateways that predate it ignore it.
    #[test]
    fn the_merged_chains_are_optional_both_ways() {
        let old = r#"{"v":"1","correlation_id":"c","outcome":{"status":"applied","results":[]}}"#;
        let read = WriteReply::from_slice(old.as_bytes()).ok();
        let expected = ChunkOutcome::Applied { results: Vec::new(), merged: Vec::new() };
        assert_eq!(
            read,
            Some(WriteReply::V1(WriteReplyV1 { correlation_id: "c".into(), outcome: expected, timing: None }))
        );
        let new = old.replace(r#""results":[]"#, r#""results":[],"merged":[{"from":"chn_b","into":"chn_a"}]"#);
        #[derive(Deserialize)]
        #[serde(tag = "status", rename_all = "snake_case")]
        #[allow(dead_code)]
        enum OldOutcome {
            Applied { results: Vec<ItemResult> },
        }
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct OldGateway {
            outcome: OldOutcome,
        }
        assert!(serde_json::from_str::<OldGateway>(&new).is_ok());
    }

    /// serde_json's `arbitrary_precision` (see model/Cargo.toml) cannot read a number that is
    /// not an integer inside an internally tagged enum: every field here must round-trip.
    #[test]
    fn messages_round_trip_with_every_field_set() {
        let input = serde_json::json!({"event": "lead", "external_id": 9_007_199_254_740_991_u64, "parent_external_id": "p",
            "occurred_at": 1_767_323_045_000_i64, "visitor_id": "abcdEFGH1234_-xy.12345678", "click_id": "abcDEF123456",
            "contact_id": "c", "email": "a@b.co", "phone": "+14155552671", "country": "US",
            "address": {"line1": "1 Main St", "zip": "94105"}, "value": 12.5, "currency": "USD", "hdyhau": "h",
            "tags": {"plan": "pro"}});
        let conversion = validate_conversion(&(&input).into(), 1_780_000_000_000).map(|v| v.conversion);
        let Ok(conversion) = conversion else { panic!("{conversion:?}") };
        let request = WriteRequest::V1(WriteRequestV1 {
            correlation_id: "c".into(),
            reply_partition: i32::MAX,
            deadline_ms: i64::MAX,
            received_at_ms: i64::MIN,
            workspace_id: "w".into(),
            items: vec![conversion],
            request: Some(RequestPart { id: "req".into(), index: 2 }),
            position: None,
        });
        let bytes = serde_json::to_vec(&request).unwrap_or_default();
        assert_eq!(WriteRequest::from_slice(&bytes).ok(), Some(request));
        let erasure = WriteRequest::Erasure(ErasureV1 {
            workspace_id: "w".into(),
            kind: "email".into(),
            value: "ab".repeat(32),
            erased_at_us: i64::MAX,
        });
        let bytes = serde_json::to_vec(&erasure).unwrap_or_default();
        assert_eq!(WriteRequest::from_slice(&bytes).ok(), Some(erasure));
        let result = ItemResult {
            id: "i".into(),
            event: "e".into(),
            external_id: "x".into(),
            chain_id: "c".into(),
            result: WriteResult::Created,
        };
        let merged = vec![ChainMerge { from: "chn_b".into(), into: "chn_a".into() }];
        for outcome in [
            ChunkOutcome::Applied { results: vec![result.clone()], merged: Vec::new() },
            ChunkOutcome::Applied { results: vec![result], merged },
            ChunkOutcome::Failed,
            ChunkOutcome::Expired,
        ] {
            let reply = WriteReply::V1(WriteReplyV1 { correlation_id: "c".into(), outcome, timing: None });
            let bytes = serde_json::to_vec(&reply).unwrap_or_default();
            assert_eq!(WriteReply::from_slice(&bytes).ok(), Some(reply));
        }
    }

    /// Writers that predate the timing send none; a gateway that predates it reads the rest.
    #[test]
    fn the_timing_is_optional_both_ways() {
        let timing =
            WriterTiming { appended_ms: 1, read_us: 2_000, taken_us: 2_100, commit_us: 4_000, committed_us: 5_000 };
        let reply = WriteReply::V1(WriteReplyV1 {
            correlation_id: "c".into(),
            outcome: ChunkOutcome::Failed,
            timing: Some(timing),
        });
        let bytes = serde_json::to_vec(&reply).unwrap_or_default();
        assert_eq!(WriteReply::from_slice(&bytes).ok(), Some(reply));
        #[derive(Deserialize)]
        #[allow(dead_code)]
        struct Older {
            correlation_id: String,
            outcome: ChunkOutcome,
        }
        assert!(serde_json::from_slice::<Older>(&bytes).is_ok());
    }
}
