//! The request bodies of the scenarios. Items are a pure function of the run and a number, so a
//! batch can be sent again byte for byte (`batch_resend`) without keeping it in memory, and the
//! `direct_apply` baseline gets the very items `batch_ingest` sends.
//!
//! Every item carries every identifier (email, phone, address, visitor, click and contact id);
//! one item of three is a `purchase` whose parent is the `lead` just before it.

use bytes::Bytes;
use std::fmt::Write;

pub const BATCH_ITEMS: usize = 500;

#[derive(Clone)]
pub struct Generator {
    /// Unique per run and scenario: external ids never collide with an earlier run's.
    run: String,
    /// Fixed for the run, so a re-sent item is identical (`unchanged`).
    occurred_at_ms: i64,
}

impl Generator {
    pub fn new(scenario: &str) -> Generator {
        let run = format!("{scenario}-{}", ulid::Ulid::new().to_string().to_lowercase());
        Generator { run, occurred_at_ms: intake_tests::now_ms() - 60_000 }
    }

    fn external_id(&self, n: u64) -> String {
        format!("{}-{n}", self.run)
    }

    /// The external id of item `n`, for a check that it was stored.
    pub fn external_id_of(&self, n: u64) -> String {
        self.external_id(n)
    }

    /// Item `n`; `parent` is the number of its parent, if it has one. Written as text: building
    /// a `serde_json::Value` per item would cost the generator more than the gateway's parse.
    fn item(&self, out: &mut String, n: u64, parent: Option<u64>) {
        let (event, parent) = match parent {
            Some(p) => ("purchase", format!(r#","parent_external_id":"{}""#, self.external_id(p))),
            None => ("lead", String::new()),
        };
        let _ = write!(
            out,
            r#"{{"event":"{event}","external_id":"{id}"{parent},"occurred_at":{at},"visitor_id":"v{n:015}.{visit:08}","click_id":"c{click:011}","contact_id":"contact-{n}","email":"person.{n}@example.com","phone":"+1 415 {exchange} {line:04}","country":"US","address":{{"line1":"{n} Main St","zip":"94105"}},"value":"129.90","currency":"USD","tags":{{"plan":"pro"}}}}"#,
            id = self.external_id(n),
            at = self.occurred_at_ms,
            visit = n % 100_000_000,
            click = n % 100_000_000_000,
            exchange = 200 + (n / 10_000) % 800,
            line = n % 10_000,
        );
    }

    /// `{"conversions": [...]}` of items `first .. first + len`; item i of the batch links to
    /// item i - 1 when i % 3 == 1.
    pub fn batch(&self, first: u64, len: usize) -> Bytes {
        let mut out = String::with_capacity(len * 420 + 20);
        out.push_str(r#"{"conversions":["#);
        for i in 0..len as u64 {
            if i > 0 {
                out.push(',');
            }
            self.item(&mut out, first + i, (i % 3 == 1).then(|| first + i - 1));
        }
        out.push_str("]}");
        Bytes::from(out)
    }

    /// One item of a client's sequence `first, first + 1, ...`; the same one-in-three parent rule.
    pub fn single(&self, first: u64, k: u64) -> Bytes {
        let mut out = String::with_capacity(420);
        self.item(&mut out, first + k, (k % 3 == 1).then(|| first + k - 1));
        Bytes::from(out)
    }
}

/// A well-formed key that no workspace has.
pub const UNKNOWN_KEY: &str = "Bearer svc_live_bench0unknown0key0000000000000000";

/// An invalid body: the event breaks its pattern (422 validation_failed).
pub fn invalid_single() -> Bytes {
    Bytes::from_static(br#"{"event":"not a valid event!","external_id":"bench-invalid","occurred_at":1700000000000}"#)
}

#[cfg(test)]
mod tests {
    use super::*;
    use intake_tests::serde_json::{self, Value};

    #[test]
    fn batches_are_valid_json_with_every_identifier_and_one_parent_in_three() {
        let generator = Generator::new("test");
        let body: Value = serde_json::from_slice(&generator.batch(1000, BATCH_ITEMS)).unwrap_or_default();
        let items = body["conversions"].as_array().cloned().unwrap_or_default();
        assert_eq!(items.len(), BATCH_ITEMS);
        let now = intake_tests::now_ms();
        for item in &items {
            let valid = intake_model::validate::validate_conversion(&item.into(), now);
            assert!(valid.is_ok(), "{item}: {valid:?}");
            for field in ["visitor_id", "click_id", "contact_id", "email", "phone", "address"] {
                assert!(item.get(field).is_some(), "{field} missing in {item}");
            }
        }
        let parents = items.iter().filter(|i| i.get("parent_external_id").is_some()).count();
        assert_eq!(parents, BATCH_ITEMS / 3 + usize::from(BATCH_ITEMS % 3 == 2));
        assert_eq!(items[1]["parent_external_id"], items[0]["external_id"]);
    }

    #[test]
    fn the_same_numbers_give_the_same_bytes() {
        let generator = Generator::new("test");
        assert_eq!(generator.batch(7, 10), generator.batch(7, 10));
        assert_ne!(generator.batch(7, 10), Generator::new("test").batch(7, 10));
    }

    #[test]
    fn the_invalid_body_is_refused_by_validation() {
        let body = invalid_single();
        let body = intake_model::validate::Json::parse(&body).unwrap_or(intake_model::validate::Json::Null);
        assert!(intake_model::validate::validate_conversion(&body, intake_tests::now_ms()).is_err());
    }
}
