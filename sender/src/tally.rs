//! What happened to the rows so far, shared by the senders, the progress display and the
//! summary.

use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

pub struct Tally {
    pub started: Instant,
    pub rows: AtomicU64,
    pub created: AtomicU64,
    pub updated: AtomicU64,
    pub unchanged: AtomicU64,
    pub failed: AtomicU64,
}

/// The counts at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Counts {
    pub rows: u64,
    pub created: u64,
    pub updated: u64,
    pub unchanged: u64,
    pub failed: u64,
    pub retries: u64,
    pub seconds: f64,
}

impl Tally {
    pub fn new() -> Tally {
        Tally {
            started: Instant::now(),
            rows: AtomicU64::new(0),
            created: AtomicU64::new(0),
            updated: AtomicU64::new(0),
            unchanged: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn counts(&self, retries: u64) -> Counts {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Counts {
            rows: get(&self.rows),
            created: get(&self.created),
            updated: get(&self.updated),
            unchanged: get(&self.unchanged),
            failed: get(&self.failed),
            retries,
            seconds: self.started.elapsed().as_secs_f64(),
        }
    }
}

impl Counts {
    /// Rows with an outcome (stored or failed).
    pub fn done(&self) -> u64 {
        self.created + self.updated + self.unchanged + self.failed
    }

    /// The `--summary json` line.
    pub fn json(&self) -> Value {
        json!({
            "rows": self.rows,
            "created": self.created,
            "updated": self.updated,
            "unchanged": self.unchanged,
            "failed": self.failed,
            "retries": self.retries,
            "seconds": (self.seconds * 1000.0).round() / 1000.0,
        })
    }

    /// The `--summary text` line.
    pub fn text(&self) -> String {
        format!(
            "{} rows in {:.1} s: {} created, {} updated, {} unchanged, {} failed; {} retries",
            self.rows, self.seconds, self.created, self.updated, self.unchanged, self.failed, self.retries
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_json_summary_has_every_count() {
        let counts = Counts { rows: 10, created: 5, updated: 2, unchanged: 1, failed: 2, retries: 3, seconds: 1.23456 };
        assert_eq!(
            counts.json(),
            json!({"rows": 10, "created": 5, "updated": 2, "unchanged": 1, "failed": 2, "retries": 3, "seconds": 1.235})
        );
        assert_eq!(counts.done(), 10);
    }
}
