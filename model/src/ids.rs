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

/// A correlation id for one request message; unique, and it sorts by time for debugging.
pub fn correlation_id() -> String {
    next_ulid().to_string()
}
