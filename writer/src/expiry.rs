//! Stale values never win (docs/architecture.md, "Stale values"): a chunk that reached the
//! requests topic after its deadline was answered 500 by its gateway before it got there, and a
//! value the client sent after that 500 may already be stored. Such a chunk is never applied,
//! live or in a replay; the writer answers it as expired.
//!
//! The time compared is the broker's append time (`message.timestamp.type=LogAppendTime` on the
//! topic), never a clock of a gateway against another's. The gateway sets the deadline a margin
//! before it stops waiting, so that a broker clock behind the gateway's by less than the margin
//! still refuses every chunk appended after the gateway gave up. A broker clock ahead only
//! refuses more chunks, each answered 500: none that was acknowledged.

use intake_model::message::WriteRequestV1;
use rdkafka::message::{Message, Timestamp};

pub fn expired(message: &impl Message, request: &WriteRequestV1) -> bool {
    match message.timestamp() {
        Timestamp::LogAppendTime(appended_ms) => appended_ms > request.deadline_ms,
        // A topic still on CreateTime (not yet reconfigured by `intake-writer topics`): the
        // producer's clock says nothing the writer can trust, so the chunk is applied.
        Timestamp::CreateTime(_) | Timestamp::NotAvailable => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::testing::{message, request};
    use rdkafka::message::OwnedMessage;

    fn stamped(deadline_ms: i64, timestamp: Timestamp) -> (OwnedMessage, WriteRequestV1) {
        let mut chunk = request("ws", "c", 1);
        chunk.deadline_ms = deadline_ms;
        let appended = message(&chunk, 0, 0, 0);
        let stamped = OwnedMessage::new(
            appended.payload().map(<[u8]>::to_vec),
            appended.key().map(<[u8]>::to_vec),
            "requests".into(),
            timestamp,
            0,
            0,
            None,
        );
        (stamped, chunk)
    }

    #[test]
    fn a_chunk_is_expired_only_when_the_broker_appended_it_after_its_deadline() {
        let at = |timestamp| {
            let (message, chunk) = stamped(1_000, timestamp);
            expired(&message, &chunk)
        };
        assert!(!at(Timestamp::LogAppendTime(1_000)), "at the deadline");
        assert!(at(Timestamp::LogAppendTime(1_001)));
        assert!(!at(Timestamp::CreateTime(5_000)), "a producer's clock is not trusted");
        assert!(!at(Timestamp::NotAvailable));
    }
}
