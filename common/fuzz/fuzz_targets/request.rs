//! The whole request path of a body, on arbitrary bytes: parsed as the gateway parses it, then
//! validated, normalized and hashed as a single conversion and as a batch, and the valid items
//! put in the Kafka message and read back as the writer reads them. Must never panic, and
//! what it produces must keep the contract's invariants (checked below).
//! Run from `common/`:
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run request fuzz/corpus/request fuzz/seeds/request -- -dict=fuzz/request.dict -max_len=4096 -max_total_time=600 -jobs=1`
//! (and `-max_len=65536` for long strings).
#![no_main]

use intake_common::conversion::{Conversion, ValidConversion};
use intake_common::message::{WriteRequest, WriteRequestV1, MAX_CHUNK_ITEMS};
use intake_common::validate::{
    validate_batch, validate_conversion, Invalid, Json, MAX_DETAILS_PER_ITEM, MAX_DETAILS_PER_RESPONSE,
};
use libfuzzer_sys::fuzz_target;

const NOW_MS: i64 = 1_780_000_000_000;

fuzz_target!(|data: &[u8]| {
    let parsed = Json::parse(data);
    // The gateway's reader takes exactly what serde_json's `Value` takes.
    assert_eq!(parsed.is_ok(), serde_json::from_slice::<serde_json::Value>(data).is_ok(), "parse disagrees");
    let Ok(body) = parsed else {
        return;
    };
    match validate_conversion(&body, NOW_MS) {
        Ok(valid) => {
            check_valid(&valid);
            round_trip(vec![valid.conversion]);
        }
        Err(invalid) => {
            let details = details_count(&invalid);
            assert!(details <= MAX_DETAILS_PER_ITEM, "{details} details for one conversion");
        }
    }
    if let Ok(items) = validate_batch(&body, NOW_MS) {
        let mut details = 0;
        let mut valid = Vec::new();
        for item in items {
            match item {
                Ok(item) => {
                    check_valid(&item);
                    valid.push(item.conversion);
                }
                Err(invalid) => {
                    let count = details_count(&invalid);
                    assert!(count <= MAX_DETAILS_PER_ITEM, "{count} details for one item");
                    details += count;
                }
            }
        }
        assert!(details <= MAX_DETAILS_PER_RESPONSE, "{details} details in one response");
        for chunk in valid.chunks(MAX_CHUNK_ITEMS) {
            round_trip(chunk.to_vec());
        }
    }
});

fn details_count(invalid: &Invalid) -> usize {
    match invalid {
        Invalid::Fields(details) => {
            assert!(!details.is_empty(), "validation_failed without details");
            details.len()
        }
        Invalid::OccurredAtOutOfRange => 0,
    }
}

/// What a valid conversion promises the writer: text PostgreSQL can store, hashes in their
/// form, `value` canonical and in range.
fn check_valid(valid: &ValidConversion) {
    let conversion = &valid.conversion;
    let control = |text: &str| text.chars().any(|c| c <= '\u{1f}' || c == '\u{7f}');
    let mut texts = vec![conversion.event.as_str(), conversion.external_id.as_str()];
    texts.extend(conversion.parent_external_id.as_ref().map(|id| id.as_str()));
    texts.extend(
        [
            &conversion.visitor_id,
            &conversion.click_id,
            &conversion.contact_id,
            &conversion.country,
            &conversion.currency,
            &conversion.hdyhau,
        ]
        .into_iter()
        .flatten()
        .map(String::as_str),
    );
    texts.extend(conversion.tags.iter().flatten().flat_map(|(key, value)| [key.as_str(), value.as_str()]));
    for text in texts {
        assert!(!control(text), "control character in stored text {text:?}");
    }
    for hash in [&conversion.email_sha256, &conversion.phone_sha256, &conversion.address_sha256].into_iter().flatten() {
        let hash = hash.as_str();
        assert!(hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')), "hash {hash:?}");
    }
    if let Some(value) = &conversion.value {
        let (whole, fraction) = value.as_str().split_once('.').unwrap_or((value.as_str(), ""));
        assert!(!whole.is_empty() && whole.len() <= 10 && whole.bytes().all(|b| b.is_ascii_digit()), "value {value:?}");
        assert!(whole == "0" || !whole.starts_with('0'), "value {value:?}");
        assert!(
            fraction.len() <= 6 && fraction.bytes().all(|b| b.is_ascii_digit()) && !fraction.ends_with('0'),
            "value {value:?}"
        );
    }
}

/// The chunk as the gateway sends it must read back unchanged in the writer.
fn round_trip(items: Vec<Conversion>) {
    let request = WriteRequest::V1(WriteRequestV1 {
        correlation_id: "c".to_owned(),
        reply_partition: 0,
        deadline_ms: NOW_MS,
        received_at_ms: NOW_MS,
        workspace_id: "w".to_owned(),
        items,
        request: None,
    });
    let wire = serde_json::to_vec(&request).expect("serializes");
    let back = WriteRequest::from_slice(&wire).expect("reads back");
    assert_eq!(back, request);
}
