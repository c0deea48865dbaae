//! The request parser and validator on arbitrary bytes: the body as the gateway reads it,
//! parsed as JSON, validated as a single conversion and as a batch. Must never panic.
//! Run from `common/`:
//! `RUSTC_BOOTSTRAP=1 cargo fuzz run validate fuzz/corpus/validate fuzz/seeds/validate -- -max_total_time=180`.
#![no_main]

use intake_common::validate::{validate_batch_envelope, validate_conversion};
use libfuzzer_sys::fuzz_target;

const NOW_MS: i64 = 1_780_000_000_000;

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    if let Ok(valid) = validate_conversion(&value, NOW_MS) {
        // What goes to Kafka must serialize and read back unchanged.
        let wire = serde_json::to_vec(&valid.conversion).expect("serializes");
        let back: intake_common::conversion::Conversion = serde_json::from_slice(&wire).expect("reads back");
        assert_eq!(back, valid.conversion);
    }
    if let Ok(items) = validate_batch_envelope(&value) {
        for item in items {
            let _ = validate_conversion(item, NOW_MS);
        }
    }
});
