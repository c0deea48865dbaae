//! Rows grouped into batch requests within the endpoint's limits (docs/api.md, "Limits"): at most
//! `max_items` items and a body of at most 1 MiB.

use crate::row::{Original, RowError};
use intake_model::error::ErrorCode;

/// The largest body the batch endpoint takes.
pub const MAX_BODY_BYTES: usize = 1024 * 1024;
const ENVELOPE_OPEN: &[u8] = b"{\"conversions\":[";
const ENVELOPE_CLOSE: &[u8] = b"]}";

/// A row that goes into a batch: its serialized item and what the rejects file needs.
pub struct Item {
    pub original: Original,
    pub json: Vec<u8>,
}

pub struct Batch {
    pub items: Vec<Item>,
}

impl Batch {
    /// `{"conversions":[item,item,...]}`, built from the serialized items.
    pub fn body(&self) -> Vec<u8> {
        let size =
            ENVELOPE_OPEN.len() + ENVELOPE_CLOSE.len() + self.items.iter().map(|i| i.json.len() + 1).sum::<usize>();
        let mut body = Vec::with_capacity(size);
        body.extend_from_slice(ENVELOPE_OPEN);
        for (index, item) in self.items.iter().enumerate() {
            if index > 0 {
                body.push(b',');
            }
            body.extend_from_slice(&item.json);
        }
        body.extend_from_slice(ENVELOPE_CLOSE);
        body
    }
}

/// Collects items into batches, in input order.
pub struct Batcher {
    max_items: usize,
    items: Vec<Item>,
    body_bytes: usize,
}

impl Batcher {
    pub fn new(max_items: usize) -> Batcher {
        Batcher { max_items, items: Vec::new(), body_bytes: ENVELOPE_OPEN.len() + ENVELOPE_CLOSE.len() }
    }

    /// Why an item cannot go into any batch, if it cannot.
    pub fn refuse(json: &[u8]) -> Option<RowError> {
        (ENVELOPE_OPEN.len() + ENVELOPE_CLOSE.len() + json.len() > MAX_BODY_BYTES).then(|| {
            RowError::new(
                ErrorCode::PayloadTooLarge.as_str(),
                format!("the row alone is over the batch body limit of {MAX_BODY_BYTES} bytes"),
            )
        })
    }

    /// Adds an item (one [`Batcher::refuse`] let through); returns the batch it completed, if any.
    pub fn push(&mut self, item: Item) -> Option<Batch> {
        let size = item.json.len() + 1;
        let full = if self.body_bytes + size > MAX_BODY_BYTES { self.take() } else { None };
        self.body_bytes += size;
        self.items.push(item);
        if self.items.len() >= self.max_items {
            return full.or_else(|| self.take());
        }
        full
    }

    /// The last, partly filled batch.
    pub fn take(&mut self) -> Option<Batch> {
        if self.items.is_empty() {
            return None;
        }
        self.body_bytes = ENVELOPE_OPEN.len() + ENVELOPE_CLOSE.len();
        Some(Batch { items: std::mem::take(&mut self.items) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(bytes: usize) -> Item {
        Item { original: Original::JsonObject, json: vec![b'1'; bytes] }
    }

    #[test]
    fn batches_hold_at_most_max_items() {
        let mut batcher = Batcher::new(3);
        let mut batches: Vec<Batch> = (0..7).filter_map(|_| batcher.push(item(10))).collect();
        batches.extend(batcher.take());
        let sizes: Vec<usize> = batches.iter().map(|b| b.items.len()).collect();
        assert_eq!(sizes, vec![3, 3, 1]);
    }

    #[test]
    fn a_body_never_exceeds_the_limit() {
        let mut batcher = Batcher::new(500);
        let mut batches: Vec<Batch> = (0..10).filter_map(|_| batcher.push(item(300_000))).collect();
        batches.extend(batcher.take());
        assert_eq!(batches.iter().map(|b| b.items.len()).collect::<Vec<_>>(), vec![3, 3, 3, 1]);
        assert!(batches.iter().all(|b| b.body().len() <= MAX_BODY_BYTES));
    }

    #[test]
    fn a_row_over_the_limit_alone_is_refused() {
        let refused = Batcher::refuse(&item(MAX_BODY_BYTES).json).map(|e| e.code);
        assert_eq!(refused.as_deref(), Some("payload_too_large"));
        assert!(Batcher::refuse(&item(MAX_BODY_BYTES - 20).json).is_none());
    }

    #[test]
    fn the_body_is_the_batch_envelope() {
        let mut batcher = Batcher::new(500);
        for json in [&b"{\"a\":1}"[..], b"2"] {
            let _ = batcher.push(Item { original: Original::JsonObject, json: json.to_vec() });
        }
        let body = batcher.take().map(|b| b.body()).unwrap_or_default();
        assert_eq!(String::from_utf8_lossy(&body), "{\"conversions\":[{\"a\":1},2]}");
    }
}
