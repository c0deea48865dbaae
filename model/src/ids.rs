//! Prefixed, time-sortable ids (ULID text): `cnv_`, `chn_`, `ws_`, `key_`.

use std::sync::Mutex;
use ulid::Generator;

/// A process-wide monotonic generator, so that ids made in one process sort in creation order
/// even within one millisecond (chains merge into the oldest, compared by id).
static GENERATOR: Mutex<Option<Generator>> = Mutex::new(None);

fn next_ulid() -> ulid::Ulid {
    let mut guard = GENERATOR.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let generator = guard.get_or_insert_with(Generator::new);
    // Overflow needs 2^80 ids in one millisecond; fall back to a fresh random id if it happens.
    generator.generate().unwrap_or_else(|_| ulid::Ulid::new())
}

pub fn new_id(prefix: &str) -> String {
    format!("{prefix}{}", next_ulid())
}

pub fn conversion_id() -> String {
    new_id("cnv_")
}

pub fn chain_id() -> String {
    new_id("chn_")
}

pub fn workspace_id() -> String {
    new_id("ws_")
}

pub fn key_id() -> String {
    new_id("key_")
}

/// What the ids of one item of a message read from the requests topic derive from, so that
/// every application of the message gives the same ids: a ULID whose time is the broker's
/// append time (floored at the gateway's receipt, so that a broker clock stepping back after a
/// leader change moves an id no earlier than its request; no state carried from one message to
/// the next, which a replay starting in the middle would not have), then 40 bits of the
/// message's offset, 8 of the item's index in it, and 32 of a SHA-256 of the message id, its
/// partition and the kind of id. Ids still sort by creation, and a chain merge still keeps the
/// one created first.
#[derive(Debug, Clone, Copy)]
pub struct Seed<'a> {
    pub correlation_id: &'a str,
    pub position: crate::message::LogPosition,
    pub received_at_ms: i64,
    pub index: usize,
}

impl Seed<'_> {
    pub fn conversion_id(&self) -> String {
        format!("cnv_{}", self.ulid("cnv"))
    }

    pub fn chain_id(&self) -> String {
        format!("chn_{}", self.ulid("chn"))
    }

    fn ulid(&self, kind: &str) -> ulid::Ulid {
        use sha2::{Digest, Sha256};
        let time = self.position.appended_ms.max(self.received_at_ms).clamp(0, (1 << 48) - 1);
        let digest = Sha256::new()
            .chain_update(self.correlation_id.as_bytes())
            .chain_update(self.position.partition.to_be_bytes())
            .chain_update(kind.as_bytes())
            .finalize();
        let hash = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
        let offset = u128::try_from(self.position.offset).unwrap_or(0) & ((1 << 40) - 1);
        let index = u128::try_from(self.index).unwrap_or(0) & 0xff;
        let random = (offset << 40) | (index << 32) | u128::from(hash);
        ulid::Ulid::from_parts(u64::try_from(time).unwrap_or(0), random)
    }
}

/// A correlation id for one request message; unique, and it sorts by time for debugging.
pub fn correlation_id() -> String {
    next_ulid().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::LogPosition;

    fn seed(correlation_id: &str, partition: i32, offset: i64, appended_ms: i64, index: usize) -> Seed<'_> {
        Seed { correlation_id, position: LogPosition { partition, offset, appended_ms }, received_at_ms: 0, index }
    }

    #[test]
    fn derived_ids_are_the_same_every_time_and_sort_by_time_offset_and_item() {
        let first = seed("m1", 3, 41, 1_000, 7);
        assert_eq!(first.conversion_id(), seed("m1", 3, 41, 1_000, 7).conversion_id(), "applied again: the same id");
        assert_ne!(first.conversion_id().get(4..), first.chain_id().get(4..), "a chain's id is not its conversion's");
        let ordered = [
            seed("m1", 3, 41, 1_000, 7),
            seed("m1", 3, 41, 1_000, 8),
            seed("m2", 3, 42, 1_000, 0),
            seed("m0", 0, 5, 1_001, 0),
        ];
        let ids: Vec<String> = ordered.iter().map(Seed::chain_id).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, sorted, "time, then offset, then item");
        assert_ne!(seed("a", 0, 5, 1_000, 0).conversion_id(), seed("b", 1, 5, 1_000, 0).conversion_id());
        let stepped_back = Seed { received_at_ms: 2_000, ..seed("m3", 3, 43, 1_500, 0) };
        assert!(stepped_back.chain_id() > seed("m2", 3, 42, 1_999, 0).chain_id(), "floored at its receipt");
    }
}
