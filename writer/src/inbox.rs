//! What the writer's stages share (docs/architecture.md, "Isolation in the writer"): a request
//! message as it is held from its reading (`read.rs`) through its workspace's queue
//! (`schedule.rs`) to its answer (`apply.rs`, `outbox.rs`), and the consumer's operations the
//! stages need ([`Partitions`]). The stages depend on this module and on those below them, never
//! on one another or on the composition root (`consume.rs`).

use crate::expiry;
use crate::metrics::{self, Metrics};
use crate::store::Commit;
use intake_common::config::now_us;
use intake_model::conversion::Conversion;
use intake_model::message::{
    ChunkOutcome, ErasureV1, LogPosition, RequestPart, WriteRequest, WriteRequestV1, WriterTiming,
};
use rdkafka::message::{Headers, Message};
use serde::Deserialize;
use std::future::Future;
use std::pin::Pin;

/// A boxed future, for the seams' traits (stable Rust has no `async fn` in a `dyn` trait).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A message of the requests topic, held once: parsed, with the little of its Kafka envelope
/// that is needed later. Its raw bytes are kept only when they cannot be parsed.
#[derive(Debug)]
pub struct Inbound {
    pub partition: i32,
    pub offset: i64,
    /// The gateway's request id (the `request_id` header), for the log line and a dead letter.
    pub request_id: Option<String>,
    pub body: Body,
    /// Read again by a rewind, below what was answered before it (`rewind.rs`): applied if the
    /// database lacks it, but neither replied to nor dead-lettered a second time.
    pub answered_before: bool,
    /// When it was read (epoch µs), for the reply's [`WriterTiming`].
    pub read_us: i64,
}

#[derive(Debug)]
pub enum Body {
    /// To apply.
    Request(WriteRequestV1),
    /// It reached the topic after its deadline: never applied (`expiry.rs`).
    Expired(WriteRequestV1),
    /// It could not be read.
    Unreadable(Unreadable),
    /// An erasure recorded by `intake-writer erase`: applied again unless the database has it.
    Erasure(ErasureV1),
}

#[derive(Debug)]
pub struct Unreadable {
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub error: String,
    /// Enough of it to answer it and fail its request, when that much can be read.
    pub envelope: Option<Envelope>,
}

/// Enough of any message version to answer it when the rest cannot be read.
#[derive(Debug, Deserialize)]
pub struct Envelope {
    pub correlation_id: String,
    pub reply_partition: i32,
    #[serde(default)]
    pub workspace_id: String,
    #[serde(default)]
    pub request: Option<RequestPart>,
}

/// What holding a parsed item costs beyond its text in the message: the struct, and the
/// allocator's rounding of each of its strings.
const ITEM_BYTES: usize = std::mem::size_of::<Conversion>() + 128;
/// What holding any message costs beyond its items: its queue entry, ids and strings.
const MESSAGE_BYTES: usize = 512;

/// Where a message stands in its topic, with its broker's append time (a topic set up by
/// `intake-writer topics` stamps LogAppendTime); none for a message without a time.
pub fn position(message: &impl Message) -> Option<LogPosition> {
    let appended_ms = message.timestamp().to_millis()?;
    Some(LogPosition { partition: message.partition(), offset: message.offset(), appended_ms })
}

impl Inbound {
    /// Reads a message of the requests topic. A message's text is an upper bound of what its
    /// parsed strings take, so its charge against the budget is its length plus the parsed
    /// structs; the raw bytes themselves are not kept.
    pub fn read(message: &impl Message) -> (Inbound, usize) {
        let payload = message.payload().unwrap_or_default();
        let request_id = message
            .headers()
            .and_then(|headers| headers.iter().find(|h| h.key == "request_id").and_then(|h| h.value))
            .and_then(|value| std::str::from_utf8(value).ok())
            .map(str::to_owned);
        let (body, bytes) = match WriteRequest::from_slice(payload) {
            Ok(WriteRequest::V1(mut request)) => {
                request.position = position(message);
                let bytes = payload.len() + request.items.len() * ITEM_BYTES + MESSAGE_BYTES;
                if expiry::expired(message, &request) {
                    (Body::Expired(request), bytes)
                } else {
                    (Body::Request(request), bytes)
                }
            }
            Ok(WriteRequest::Erasure(erasure)) => (Body::Erasure(erasure), payload.len() + MESSAGE_BYTES),
            Err(error) => {
                let key = message.key().map(<[u8]>::to_vec);
                let bytes = payload.len() + key.as_ref().map_or(0, Vec::len) + MESSAGE_BYTES;
                let envelope = serde_json::from_slice::<Envelope>(payload).ok();
                (
                    Body::Unreadable(Unreadable { key, payload: payload.to_vec(), error: error.to_string(), envelope }),
                    bytes,
                )
            }
        };
        let (partition, offset) = (message.partition(), message.offset());
        (Inbound { partition, offset, request_id, body, answered_before: false, read_us: now_us() }, bytes)
    }

    /// The workspace whose queue it goes to: the one it names, else its Kafka key (the gateway
    /// keys each message by its workspace), so that even an unreadable message keeps its place.
    pub fn workspace_id(&self) -> &str {
        match &self.body {
            Body::Request(request) | Body::Expired(request) => &request.workspace_id,
            Body::Erasure(erasure) => &erasure.workspace_id,
            Body::Unreadable(unreadable) => match &unreadable.envelope {
                Some(envelope) if !envelope.workspace_id.is_empty() => &envelope.workspace_id,
                _ => unreadable.key.as_deref().and_then(|key| std::str::from_utf8(key).ok()).unwrap_or_default(),
            },
        }
    }

    /// Where its answer goes: correlation id, reply partition and, for a readable message, the
    /// deadline after which nobody waits for it.
    pub fn reply_to(&self) -> Option<(&str, i32, Option<i64>)> {
        match &self.body {
            Body::Request(request) | Body::Expired(request) => {
                Some((&request.correlation_id, request.reply_partition, Some(request.deadline_ms)))
            }
            Body::Unreadable(unreadable) => {
                unreadable.envelope.as_ref().map(|e| (e.correlation_id.as_str(), e.reply_partition, None))
            }
            Body::Erasure(_) => None,
        }
    }

    /// Its way through this writer, for its reply, once a worker that took it at `taken_us`
    /// has answered it (with the commit made for it, if any); none for a message without the
    /// broker's append time.
    pub fn timing(&self, taken_us: i64, commit: Option<Commit>) -> Option<WriterTiming> {
        let position = match &self.body {
            Body::Request(request) | Body::Expired(request) => request.position?,
            Body::Unreadable(_) | Body::Erasure(_) => return None,
        };
        let now = now_us();
        let Commit { started_us, done_us } = commit.unwrap_or(Commit { started_us: now, done_us: now });
        Some(WriterTiming {
            appended_ms: position.appended_ms,
            read_us: self.read_us,
            taken_us,
            commit_us: started_us,
            committed_us: done_us,
        })
    }

    /// Its place in its HTTP request, when known.
    pub fn request_part(&self) -> Option<&RequestPart> {
        match &self.body {
            Body::Request(request) | Body::Expired(request) => request.request.as_ref(),
            Body::Unreadable(unreadable) => unreadable.envelope.as_ref().and_then(|e| e.request.as_ref()),
            Body::Erasure(_) => None,
        }
    }
}

/// What the stages do to the partitions they read: rdkafka's consumer in the writer
/// (`consume.rs`), a recording double in the tests.
pub trait Partitions: Send + Sync {
    /// Bumped at every rebalance: a message read before one may belong to a partition this
    /// writer no longer holds, or holds again from an older committed offset.
    fn generation(&self) -> u64;

    /// Stores (partition, next offset to read) for commit, unless a rebalance came since
    /// `generation` (an offset stored then could move the group's offset back).
    fn store(&self, generation: u64, offsets: &[(i32, i64)]);

    /// Stops fetching these partitions; the consumer keeps polling (and so stays in the group).
    fn pause(&self, partitions: &[i32]);

    fn resume(&self, partitions: &[i32]);

    /// Messages of these partitions were answered, or their workspaces found busy for a while
    /// shorter than the bound: the writer makes progress on them (`health.rs`).
    fn progressed(&self, partitions: &[i32]);

    /// A workspace of these partitions has waited for its lock past the bound: its wait no
    /// longer counts as progress.
    fn held(&self, partitions: &[i32]);

    /// Whether a message read at `offset` of `partition` is taken, and how (`rewind.rs`).
    fn admit(&self, partition: i32, offset: i64) -> Admission;
}

/// What becomes of a message as it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Its partition waits for a rewind: it is read again from the database's position.
    Drop,
    /// Queued for its workspace; `answered_before` when a rewind read it again below what was
    /// answered.
    Take { answered_before: bool },
}

/// Metrics and the log line of one answered message, with the request id the gateway gave it.
pub fn record(metrics: &Metrics, message: &Inbound, label: &'static str, outcome: &ChunkOutcome) {
    metrics.messages.get_or_create(&metrics::Outcome { outcome: label }).inc();
    if let (ChunkOutcome::Applied { results, .. }, "applied") = (outcome, label) {
        for result in results {
            metrics.items.get_or_create(&metrics::ItemResult { result: result.result.as_str() }).inc();
        }
    }
    let (correlation_id, items) = match &message.body {
        Body::Request(request) | Body::Expired(request) => (request.correlation_id.as_str(), request.items.len()),
        Body::Unreadable(unreadable) => (unreadable.envelope.as_ref().map_or("-", |e| e.correlation_id.as_str()), 0),
        Body::Erasure(_) => ("-", 0),
    };
    tracing::info!(
        request_id = message.request_id.as_deref().unwrap_or("-"),
        correlation_id,
        workspace_id = message.workspace_id(),
        partition = message.partition,
        offset = message.offset,
        items,
        outcome = label,
        "chunk"
    );
}

#[cfg(test)]
pub mod testing {
    //! Messages and a consumer double for the stages' tests.

    use super::{Admission, Partitions};
    use intake_model::message::{RequestPart, WriteRequest, WriteRequestV1};
    use rdkafka::message::{Header, OwnedHeaders, OwnedMessage, Timestamp};
    use std::sync::Mutex;

    /// A chunk of `items` items of a workspace, answered on reply partition 1.
    pub fn request(workspace_id: &str, correlation_id: &str, items: usize) -> WriteRequestV1 {
        let item = serde_json::json!({"event": "lead", "external_id": "x", "occurred_at_ms": 1_700_000_000_000_i64});
        let items = (0..items)
            .map(|i| {
                let mut item = item.clone();
                item["external_id"] = format!("{correlation_id}-{i}").into();
                serde_json::from_value(item).unwrap_or_else(|e| panic!("{e}"))
            })
            .collect();
        WriteRequestV1 {
            correlation_id: correlation_id.to_owned(),
            reply_partition: 1,
            deadline_ms: i64::MAX,
            received_at_ms: 1_700_000_000_000,
            workspace_id: workspace_id.to_owned(),
            items,
            request: Some(RequestPart { id: format!("req-{correlation_id}"), index: 0 }),
            position: None,
        }
    }

    /// The message a gateway produces for `request`, appended by the broker at `appended_ms`.
    pub fn message(request: &WriteRequestV1, partition: i32, offset: i64, appended_ms: i64) -> OwnedMessage {
        let payload = serde_json::to_vec(&WriteRequest::V1(request.clone())).unwrap_or_default();
        raw(request.workspace_id.as_bytes(), payload, partition, offset, appended_ms)
    }

    pub fn raw(key: &[u8], payload: Vec<u8>, partition: i32, offset: i64, appended_ms: i64) -> OwnedMessage {
        let headers = OwnedHeaders::new().insert(Header { key: "request_id", value: Some("rid-1") });
        OwnedMessage::new(
            Some(payload),
            Some(key.to_vec()),
            "requests".into(),
            Timestamp::LogAppendTime(appended_ms),
            partition,
            offset,
            Some(headers),
        )
    }

    /// What the stages did to the partitions.
    #[derive(Default)]
    pub struct RecordedPartitions {
        pub generation: std::sync::atomic::AtomicU64,
        pub stored: Mutex<Vec<(i32, i64)>>,
        pub paused: Mutex<Vec<i32>>,
        pub resumed: Mutex<Vec<i32>>,
        pub progressed: Mutex<Vec<i32>>,
        pub held: Mutex<Vec<i32>>,
        /// Partitions waiting for a rewind, and the offsets answered before one.
        pub rewinding: Mutex<Vec<i32>>,
        pub answered_below: Mutex<std::collections::HashMap<i32, i64>>,
    }

    fn extend(into: &Mutex<Vec<i32>>, partitions: &[i32]) {
        into.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(partitions);
    }

    impl Partitions for RecordedPartitions {
        fn generation(&self) -> u64 {
            self.generation.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn store(&self, generation: u64, offsets: &[(i32, i64)]) {
            if generation == self.generation() {
                self.stored.lock().unwrap_or_else(|e| e.into_inner()).extend_from_slice(offsets);
            }
        }
        fn pause(&self, partitions: &[i32]) {
            extend(&self.paused, partitions);
        }
        fn resume(&self, partitions: &[i32]) {
            extend(&self.resumed, partitions);
        }
        fn progressed(&self, partitions: &[i32]) {
            extend(&self.progressed, partitions);
        }
        fn held(&self, partitions: &[i32]) {
            extend(&self.held, partitions);
        }
        fn admit(&self, partition: i32, offset: i64) -> Admission {
            if self.rewinding.lock().unwrap_or_else(|e| e.into_inner()).contains(&partition) {
                return Admission::Drop;
            }
            let below = self.answered_below.lock().unwrap_or_else(|e| e.into_inner()).get(&partition).copied();
            Admission::Take { answered_before: below.is_some_and(|below| offset < below) }
        }
    }

    impl RecordedPartitions {
        pub fn take(list: &Mutex<Vec<i32>>) -> Vec<i32> {
            std::mem::take(&mut *list.lock().unwrap_or_else(|e| e.into_inner()))
        }

        pub fn stored(&self) -> Vec<(i32, i64)> {
            self.stored.lock().unwrap_or_else(|e| e.into_inner()).clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{message, raw, request};
    use super::*;

    #[test]
    fn a_message_is_held_parsed_with_its_request_id_and_charged_for_its_items() {
        let chunk = request("ws_a", "c1", 100);
        let kafka = message(&chunk, 3, 41, 0);
        let (inbound, bytes) = Inbound::read(&kafka);
        let text = kafka.payload().map_or(0, <[u8]>::len);
        let positioned =
            WriteRequestV1 { position: Some(LogPosition { partition: 3, offset: 41, appended_ms: 0 }), ..chunk };
        assert!(matches!(&inbound.body, Body::Request(read) if *read == positioned), "with where it was read");
        assert_eq!((inbound.partition, inbound.offset, inbound.request_id.as_deref()), (3, 41, Some("rid-1")));
        assert_eq!(inbound.workspace_id(), "ws_a");
        assert!(bytes > text + 100 * std::mem::size_of::<Conversion>(), "{bytes} for {text} bytes of text");
        assert_eq!(inbound.reply_to(), Some(("c1", 1, Some(i64::MAX))));
    }

    #[test]
    fn a_chunk_appended_after_its_deadline_is_held_as_expired() {
        let mut chunk = request("ws_a", "c1", 1);
        chunk.deadline_ms = 1_000;
        assert!(matches!(Inbound::read(&message(&chunk, 0, 0, 1_000)).0.body, Body::Request(_)), "at the deadline");
        assert!(matches!(Inbound::read(&message(&chunk, 0, 0, 1_001)).0.body, Body::Expired(_)));
    }

    #[test]
    fn an_unreadable_message_keeps_its_bytes_and_its_workspace_from_the_key() {
        let garbage = raw(b"ws_key", b"{\"v\":\"9\"}".to_vec(), 0, 5, 0);
        let (inbound, _) = Inbound::read(&garbage);
        let Body::Unreadable(unreadable) = &inbound.body else { panic!("{inbound:?}") };
        assert_eq!((unreadable.payload.as_slice(), inbound.workspace_id()), (&b"{\"v\":\"9\"}"[..], "ws_key"));
        assert_eq!(inbound.reply_to(), None, "nothing says where to answer");
        let envelope = br#"{"v":"9","correlation_id":"c9","reply_partition":2,"workspace_id":"ws_e","request":{"id":"r","index":1}}"#;
        let (inbound, _) = Inbound::read(&raw(b"ws_key", envelope.to_vec(), 0, 6, 0));
        assert_eq!((inbound.workspace_id(), inbound.reply_to()), ("ws_e", Some(("c9", 2, None))));
        assert_eq!(inbound.request_part().map(|p| p.index), Some(1));
    }
}
