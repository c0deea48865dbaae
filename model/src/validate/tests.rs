use super::*;
use crate::normalize::sha256_hex;
use serde_json::{json, Value};

const NOW_MS: i64 = 1_780_000_000_000; // 2026-05-28

/// The gateway's path: the input as body text, read by [`Json::parse`].
fn validate_conversion(input: &Value, now_ms: i64) -> Result<ValidConversion, Invalid> {
    let body = input.to_string();
    let json = Json::parse(body.as_bytes()).unwrap_or_else(|e| panic!("{e}: {body}"));
    super::validate_conversion(&json, now_ms)
}

fn validate_batch(input: &Value, now_ms: i64) -> Result<BatchItems, Vec<FieldError>> {
    let body = input.to_string();
    let json = Json::parse(body.as_bytes()).unwrap_or_else(|e| panic!("{e}: {body}"));
    super::validate_batch(&json, now_ms)
}

fn base() -> Value {
    json!({"event": "Lead", "external_id": "crm-1", "occurred_at": "2026-01-02T03:04:05Z"})
}

fn with(field: &str, value: Value) -> Value {
    let mut input = base();
    input[field] = value;
    input
}

fn ok(input: &Value) -> ValidConversion {
    match validate_conversion(input, NOW_MS) {
        Ok(valid) => valid,
        Err(invalid) => panic!("expected valid, got {invalid:?} for {input}"),
    }
}

fn paths(input: &Value) -> Vec<String> {
    match validate_conversion(input, NOW_MS) {
        Err(Invalid::Fields(errors)) => errors.into_iter().map(|e| e.path).collect(),
        other => panic!("expected field errors, got {other:?} for {input}"),
    }
}

fn assert_field_rejects(field: &str, bad: &[Value]) {
    for value in bad {
        assert_eq!(paths(&with(field, value.clone())), vec![field.to_owned()], "{field} = {value}");
    }
}

#[test]
fn serde_jsons_raw_value_name_is_an_unknown_field() {
    let inner = r#"{"event": "Lead", "external_id": "e1", "occurred_at": 1780000000000}"#;
    assert_eq!(
        paths(&json!({ "$serde_json::private::RawValue": inner })),
        ["$serde_json::private::RawValue", "event", "external_id", "occurred_at"]
    );
}

#[test]
fn minimal_conversion_is_valid_and_normalized() {
    let valid = ok(&base());
    assert_eq!(valid.conversion.event.as_str(), "lead");
    assert_eq!(valid.conversion.external_id.as_str(), "crm-1");
    assert_eq!(valid.conversion.occurred_at_ms, 1_767_323_045_000);
    assert!(valid.warnings.is_empty());
}

#[test]
fn event_rules() {
    for good in ["a", "LEAD", "qualified_lead_2", &"x".repeat(40)] {
        ok(&with("event", json!(good)));
    }
    assert_field_rejects(
        "event",
        &[json!("a-b"), json!("a b"), json!("é"), json!("x".repeat(41)), json!(1), json!(true)],
    );
    assert_eq!(paths(&with("event", json!(""))), vec!["event"], "empty is not sent, and event is required");
}

#[test]
fn external_id_string_and_integer_are_one_id() {
    assert_eq!(ok(&with("external_id", json!(123))).conversion.external_id.as_str(), "123");
    assert_eq!(ok(&with("external_id", json!("123"))).conversion.external_id.as_str(), "123");
    assert_eq!(ok(&with("external_id", json!(0))).conversion.external_id.as_str(), "0");
    assert_eq!(
        ok(&with("external_id", json!(9_007_199_254_740_991_u64))).conversion.external_id.as_str(),
        "9007199254740991"
    );
    ok(&with("external_id", json!("é".repeat(128))));
}

#[test]
fn external_id_rules() {
    let bad = [
        json!(-1),
        json!(9_007_199_254_740_992_u64),
        json!(123.0),
        json!(1e3),
        json!(1.5),
        json!("x".repeat(129)),
        json!("a\u{0}b"),
        json!("tab\there"),
        json!("del\u{7f}"),
        json!(true),
        json!([1]),
        json!({"a": 1}),
    ];
    assert_field_rejects("external_id", &bad);
    assert_field_rejects("parent_external_id", &bad);
    assert_eq!(
        ok(&with("parent_external_id", json!(77))).conversion.parent_external_id.map(|p| p.0),
        Some("77".to_owned())
    );
}

#[test]
fn missing_required_fields_are_all_reported() {
    assert_eq!(paths(&json!({})), vec!["event", "external_id", "occurred_at"]);
    assert_eq!(
        paths(&json!({"event": null, "external_id": "", "occurred_at": null})),
        vec!["event", "external_id", "occurred_at"]
    );
}

#[test]
fn not_an_object_is_refused() {
    for input in [json!([]), json!(1), json!("x"), json!(null)] {
        assert_eq!(paths(&input), vec![""]);
    }
}

#[test]
fn unknown_fields_are_named() {
    let mut input = base();
    input["colour"] = json!("red");
    input["address"] = json!({"line1": "1 Main St", "zip": "94105", "line2": "x"});
    assert_eq!(paths(&input), vec!["colour", "address.line2"]);
}

#[test]
fn occurred_at_forms() {
    let cases = [
        (json!("2026-01-02T03:04:05Z"), 1_767_323_045_000),
        (json!("2026-01-02T03:04:05.678Z"), 1_767_323_045_678),
        (json!("2026-01-02T03:04:05.6789Z"), 1_767_323_045_678),
        (json!("2026-01-02T04:04:05+01:00"), 1_767_323_045_000),
        (json!("2026-01-01T22:04:05-05:00"), 1_767_323_045_000),
        (json!("2026-01-03T03:03:05+23:59"), 1_767_323_045_000),
        (json!(1_767_323_045_000_i64), 1_767_323_045_000),
        (json!("1767323045000"), 1_767_323_045_000),
    ];
    for (input, expected) in cases {
        assert_eq!(ok(&with("occurred_at", input.clone())).conversion.occurred_at_ms, expected, "{input}");
    }
}

#[test]
fn occurred_at_malformed() {
    assert_field_rejects(
        "occurred_at",
        &[
            json!("2026-01-02T03:04:05"),  // no zone
            json!("2026-01-02"),           // no time
            json!("2026-02-30T00:00:00Z"), // no such date
            json!("2026-13-01T00:00:00Z"),
            json!("2026-01-02T03:04:05+24:00"), // no zone is a day from UTC
            json!("2026-01-02T03:04:05-25:00"),
            json!("2026-01-02T03:04:05+01"),   // an offset is ±hh:mm
            json!("2026-01-02T03:04:05+0100"), // likewise
            json!("2026-01-02T03:04:05-0500"),
            json!("yesterday"),
            json!("176732304500"),          // 12 digits
            json!("17673230450000"),        // 14 digits
            json!(999_999_999_999_i64),     // below the integer range
            json!(100_000_000_000_001_i64), // above it
            json!(1_767_323_045_000.5),
            json!(-1),
            json!(true),
        ],
    );
}

#[test]
fn occurred_at_out_of_range() {
    let future = NOW_MS + FUTURE_TOLERANCE_MS + 1;
    for input in
        [json!("1999-12-31T23:59:59.999Z"), json!(future), json!("0000000000000"), json!(100_000_000_000_000_i64)]
    {
        assert_eq!(
            validate_conversion(&with("occurred_at", input.clone()), NOW_MS),
            Err(Invalid::OccurredAtOutOfRange),
            "{input}"
        );
    }
    for input in [json!("2000-01-01T00:00:00Z"), json!(NOW_MS + FUTURE_TOLERANCE_MS)] {
        ok(&with("occurred_at", input));
    }
}

#[test]
fn out_of_range_is_reported_only_when_nothing_else_is_wrong() {
    let mut input = with("occurred_at", json!("1990-01-01T00:00:00Z"));
    input["event"] = json!("bad event");
    assert_eq!(paths(&input), vec!["event"]);
}

#[test]
fn visitor_click_contact_ids() {
    ok(&with("visitor_id", json!("abcdEFGH1234_-xy")));
    ok(&with("visitor_id", json!("abcdEFGH1234_-xy.12345678")));
    assert_field_rejects(
        "visitor_id",
        &[
            json!("short"),
            json!("abcdEFGH1234_-xy.1234567"),
            json!("abcdEFGH1234_-x!"),
            json!("abcdEFGH1234_-xyz"),
            json!(1),
        ],
    );
    ok(&with("click_id", json!("abcDEF123456")));
    assert_field_rejects("click_id", &[json!("abcDEF12345"), json!("abcDEF1234567"), json!("abcDEF12345_")]);
    ok(&with("contact_id", json!("c".repeat(128))));
    assert_field_rejects("contact_id", &[json!("c".repeat(129)), json!("a\nb"), json!(5)]);
}

#[test]
fn country_currency_hdyhau() {
    assert_eq!(ok(&with("country", json!("de"))).conversion.country.as_deref(), Some("DE"));
    assert_field_rejects("country", &[json!("DEU"), json!("D"), json!("1A")]);
    assert_eq!(ok(&with("currency", json!("eur"))).conversion.currency.as_deref(), Some("EUR"));
    assert_field_rejects("currency", &[json!("EU"), json!("EURO"), json!("E1R")]);
    ok(&with("hdyhau", json!("h".repeat(200))));
    assert_field_rejects("hdyhau", &[json!("h".repeat(201)), json!("a\u{1f}b")]);
}

#[test]
fn value_is_an_exact_decimal() {
    let cases = [
        (json!(12.5), "12.5"),
        (json!("12.50"), "12.5"),
        (json!("0012"), "12"),
        (json!(0), "0"),
        (json!(1_000_000_000), "1000000000"),
        (json!("9999999999.999999"), "9999999999.999999"),
        (json!(0.1), "0.1"),
        (json!("0.000000"), "0"),
        (json!(999_999_999.123_456), "999999999.123456"),
    ];
    for (input, expected) in cases {
        assert_eq!(
            ok(&with("value", input.clone())).conversion.value.map(|d| d.0).as_deref(),
            Some(expected),
            "{input}"
        );
    }
    assert_field_rejects(
        "value",
        &[
            json!(-1),
            json!(-0.5),
            json!(1_000_000_000.5),
            json!(1_000_000_001),
            json!("1.1234567"),
            json!("12345678901"),
            json!("-1"),
            json!("1e3"),
            json!(".5"),
            json!("5."),
            json!(true),
            json!("٩"),
            json!("１２"),
            json!("1\u{a0}"),
        ],
    );
}

/// A body as the gateway reads it: JSON numbers keep their text.
fn parsed(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn value_as_a_json_number_is_read_from_its_text() {
    let cases = [
        ("0.1", "0.1"),
        ("123456789.123456", "123456789.123456"),
        ("1000000000", "1000000000"),
        ("12.50", "12.5"),
        ("1.25e1", "12.5"),
        ("1e-05", "0.00001"),
        ("0.30000000000000004e0", "0.30000000000000004"),
        ("999999999.999999", "999999999.999999"),
        ("12.5000000", "12.5"),
        ("-0", "0"),
    ];
    for (number, expected) in cases {
        let input =
            parsed(&format!(r#"{{"event":"lead","external_id":"x","occurred_at":1767323045000,"value":{number}}}"#));
        let value = validate_conversion(&input, NOW_MS).ok().and_then(|valid| valid.conversion.value).map(|d| d.0);
        let expected = (!expected.is_empty()).then(|| expected.to_owned());
        assert_eq!(value, expected, "{number}");
    }
    // The same value as a string and as a number is the same decimal.
    let as_number = parsed(r#"{"event":"lead","external_id":"x","occurred_at":1767323045000,"value":12.5}"#);
    assert_eq!(ok(&as_number).conversion.value, ok(&with("value", json!("12.50"))).conversion.value);
}

#[test]
fn numbers_that_f64_cannot_hold_are_refused_or_kept_exactly() {
    for number in ["1000000000.0000001", "1e400", "-1e-400", "-0.0000001"] {
        let input =
            parsed(&format!(r#"{{"event":"lead","external_id":"x","occurred_at":1767323045000,"value":{number}}}"#));
        assert_eq!(paths(&input), vec!["value"], "{number}");
    }
    // A number is bounded by its range only: every decimal it has is kept.
    for (number, exact) in
        [("0.1234567", "0.1234567"), ("0.30000000000000004", "0.30000000000000004"), ("1e-7", "0.0000001")]
    {
        let input =
            parsed(&format!(r#"{{"event":"lead","external_id":"x","occurred_at":1767323045000,"value":{number}}}"#));
        assert_eq!(ok(&input).conversion.value.as_ref().map(|v| v.0.as_str()), Some(exact), "{number}");
    }
}

#[test]
fn external_id_as_a_json_number_must_be_an_integer_in_range() {
    for number in ["123.0", "1e3", "1E3", "1.5", "-1", "-0", "9007199254740992", "1e400", "123.000000000000000001"] {
        let input = parsed(&format!(r#"{{"event":"lead","external_id":{number},"occurred_at":1767323045000}}"#));
        assert_eq!(paths(&input), vec!["external_id"], "{number}");
    }
    let input = parsed(r#"{"event":"lead","external_id":9007199254740991,"occurred_at":1767323045000}"#);
    assert_eq!(ok(&input).conversion.external_id.as_str(), "9007199254740991");
}

#[test]
fn tags_rules() {
    let tags = json!({"plan": "pro", "a_b": "", "c": "x", "d": "y", "e": "z"});
    assert_eq!(ok(&with("tags", tags)).conversion.tags.map(|t| t.len()), Some(5));
    assert_eq!(paths(&with("tags", json!({"a":"1","b":"2","c":"3","d":"4","e":"5","f":"6"}))), vec!["tags"]);
    assert_eq!(paths(&with("tags", json!({"Plan": "x"}))), vec!["tags.Plan"]);
    assert_eq!(paths(&with("tags", json!({"plan": "x".repeat(65)}))), vec!["tags.plan"]);
    assert_eq!(paths(&with("tags", json!({"plan": 1}))), vec!["tags.plan"]);
    assert_eq!(paths(&with("tags", json!({&"k".repeat(25): "x"}))), vec![format!("tags.{}", "k".repeat(25))]);
    assert_eq!(paths(&with("tags", json!(["x"]))), vec!["tags"]);
}

#[test]
fn tag_values_with_control_characters_are_refused() {
    for bad in ["a\u{0}b", "\u{7f}", "tab\there", "line\n", "\u{1b}[31m"] {
        assert_eq!(paths(&with("tags", json!({"plan": bad, "ok": "fine"}))), vec!["tags.plan"], "{bad:?}");
    }
    // Other scripts, spaces and marks are text like any other.
    let fine = json!({"a": "٩٤١٠٥ ९४ ９４", "b": "a\u{a0}b\u{3000}c", "c": "\u{200f}e\u{301}🎉"});
    assert_eq!(ok(&with("tags", fine.clone())).conversion.tags.map(|t| t.len()), Some(3));
}

#[test]
fn every_stored_text_field_refuses_control_characters() {
    for field in [
        "external_id",
        "parent_external_id",
        "contact_id",
        "hdyhau",
        "event",
        "visitor_id",
        "click_id",
        "country",
        "currency",
    ] {
        for bad in ["a\u{0}b", "ab\u{1f}", "\u{7f}ab"] {
            assert_eq!(paths(&with(field, json!(bad))), vec![field], "{field} = {bad:?}");
        }
    }
    assert_eq!(paths(&with("value", json!("1\u{0}"))), vec!["value"]);
}

#[test]
fn unusable_identifiers_with_control_characters_are_warnings() {
    let mut input = base();
    input["email"] = json!("ann@exa\u{0}mple.com");
    input["phone"] = json!("+1 415 555 2671\u{0}");
    input["address"] = json!({"line1": "1 Main\u{0} St", "zip": "94105"});
    let valid = ok(&input);
    assert_eq!(valid.warnings, vec![Warning::EmailInvalid, Warning::PhoneUnparseable, Warning::AddressUnparseable]);
    input["address"] = json!({"line1": "1 Main St", "zip": "94105\u{7f}"});
    assert_eq!(ok(&input).warnings.last(), Some(&Warning::AddressUnparseable));
}

#[test]
fn zip_digits_of_other_scripts_are_unparseable_not_a_panic() {
    for zip in ["٩٤١٠٥", "٩٤١٠٥-١٢٣٤", "९४१०५", "９４１０５"] {
        let valid = ok(&with("address", json!({"line1": "1 Main St", "zip": zip})));
        assert_eq!(valid.warnings, vec![Warning::AddressUnparseable], "{zip}");
        assert_eq!(valid.conversion.address_sha256, None);
    }
}

#[test]
fn phone_with_an_unknown_country_still_parses_with_a_plus() {
    let mut input = with("country", json!("UK"));
    input["phone"] = json!("+44 20 7946 0958");
    let valid = ok(&input);
    assert!(valid.warnings.is_empty(), "{:?}", valid.warnings);
    assert_eq!(valid.conversion.phone_sha256, Some(sha256_hex("+442079460958")));
    assert_eq!(valid.conversion.country.as_deref(), Some("UK"));
}

#[test]
fn null_and_empty_optional_fields_are_not_sent() {
    for field in [
        "parent_external_id",
        "visitor_id",
        "click_id",
        "contact_id",
        "email",
        "phone",
        "country",
        "address",
        "value",
        "currency",
        "hdyhau",
        "tags",
        "email_sha256",
        "phone_sha256",
        "address_sha256",
    ] {
        assert_eq!(ok(&with(field, json!(null))), ok(&base()), "{field}: null");
        assert_eq!(ok(&with(field, json!(""))), ok(&base()), "{field}: empty");
    }
}

#[test]
fn identifiers_are_hashed_and_never_kept_raw() {
    let mut input = base();
    input["email"] = json!(" Ann@Example.com");
    input["phone"] = json!("(415) 555-2671");
    input["country"] = json!("us");
    input["address"] = json!({"line1": "1 Main St.", "zip": "94105-1234"});
    let valid = ok(&input);
    assert_eq!(valid.conversion.email_sha256, Some(sha256_hex("ann@example.com")));
    assert_eq!(valid.conversion.phone_sha256, Some(sha256_hex("+14155552671")));
    assert_eq!(valid.conversion.address_sha256, Some(sha256_hex("1 main st|94105|US")));
    let wire = serde_json::to_string(&valid.conversion).unwrap_or_default();
    for raw in ["Ann@", "ann@", "555", "Main", "main"] {
        assert!(!wire.contains(raw), "{raw} leaked into {wire}");
    }
}

const HASH: &str = "71d4f55f72fa128dfb468a1a3901507c804b74316488744d769d7f4b16696476";

#[test]
fn pre_hashed_identifiers_are_kept_as_the_gateways_own_hashes() {
    let mut input = base();
    input["email_sha256"] = json!(sha256_hex("ann@example.com").as_str());
    input["phone_sha256"] = json!(sha256_hex("+14155552671").as_str());
    input["address_sha256"] = json!(sha256_hex("1 main st|94105|US").as_str());
    let hashed = ok(&input);
    assert!(hashed.warnings.is_empty());

    let mut raw = base();
    raw["email"] = json!(" Ann@Example.com");
    raw["phone"] = json!("+1 415 555 2671");
    raw["address"] = json!({"line1": "1 Main St.", "zip": "94105-1234"});
    assert_eq!(hashed, ok(&raw), "the same conversion, as the writer receives it");
}

#[test]
fn pre_hashed_identifiers_must_be_lower_case_hex_sha256() {
    for field in ["email_sha256", "phone_sha256", "address_sha256"] {
        ok(&with(field, json!(HASH)));
        assert_field_rejects(
            field,
            &[
                json!(HASH.to_uppercase()),
                json!(&HASH[1..]),
                json!(format!("{HASH}0")),
                json!(format!("{}g", &HASH[1..])),
                json!(format!(" {}", &HASH[1..])),
                json!(format!("{HASH}\n")),
                json!("ann@example.com"),
                json!(1),
                json!([HASH]),
                json!({"sha256": HASH}),
            ],
        );
    }
}

#[test]
fn raw_and_hashed_forms_of_one_identifier_are_refused_at_the_hashed_path() {
    let mut input = base();
    input["email"] = json!("ann@example.com");
    input["email_sha256"] = json!(HASH);
    input["phone"] = json!("+14155552671");
    input["phone_sha256"] = json!(HASH);
    input["address"] = json!({"line1": "1 Main St", "zip": "94105"});
    input["address_sha256"] = json!(HASH);
    assert_eq!(paths(&input), ["email_sha256", "phone_sha256", "address_sha256"]);
    // An unusable raw form is still sent; null or "" is not.
    let mut unusable = with("email", json!("not an email"));
    unusable["email_sha256"] = json!(HASH);
    assert_eq!(paths(&unusable), ["email_sha256"]);
    for not_sent in [json!(null), json!("")] {
        let mut input = base();
        input["email"] = not_sent.clone();
        input["email_sha256"] = json!(HASH);
        input["address"] = not_sent;
        input["address_sha256"] = json!(HASH);
        let valid = ok(&input);
        assert_eq!(valid.conversion.email_sha256.as_ref().map(|h| h.as_str()), Some(HASH));
        assert_eq!(valid.conversion.address_sha256.as_ref().map(|h| h.as_str()), Some(HASH));
    }
    // Another identifier's raw form is no conflict.
    let mut mixed = base();
    mixed["email_sha256"] = json!(HASH);
    mixed["phone"] = json!("+14155552671");
    let valid = ok(&mixed);
    assert_eq!(valid.conversion.phone_sha256, Some(sha256_hex("+14155552671")));
}

#[test]
fn pre_hashed_messages_never_contain_the_value() {
    let secret = "SECRET-VALUE-42";
    let mut input = base();
    input["email_sha256"] = json!(secret);
    input["phone"] = json!(secret);
    input["phone_sha256"] = json!(format!("{secret}{}", "0".repeat(49)));
    match validate_conversion(&input, NOW_MS) {
        Err(Invalid::Fields(errors)) => {
            assert_eq!(errors.len(), 3, "{errors:?}");
            assert!(errors.iter().all(|e| !e.message.contains(secret)), "{errors:?}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn address_country_defaults() {
    let mut input = base();
    input["address"] = json!({"line1": "1 Rue X", "zip": "75001"});
    input["country"] = json!("FR");
    assert_eq!(ok(&input).conversion.address_sha256, Some(sha256_hex("1 rue x|75001|FR")));
    input["address"]["country"] = json!("de");
    assert_eq!(ok(&input).conversion.address_sha256, Some(sha256_hex("1 rue x|75001|DE")));
}

#[test]
fn unusable_identifiers_become_warnings() {
    let mut input = base();
    input["email"] = json!("not-an-email");
    input["phone"] = json!("12");
    input["address"] = json!({"line1": "1 Main St", "zip": "ABCDE"});
    let valid = ok(&input);
    assert_eq!(valid.warnings, vec![Warning::EmailInvalid, Warning::PhoneUnparseable, Warning::AddressUnparseable]);
    assert_eq!(
        (valid.conversion.email_sha256, valid.conversion.phone_sha256, valid.conversion.address_sha256),
        (None, None, None)
    );
}

#[test]
fn identifier_length_limits_are_validation_errors() {
    assert_field_rejects("email", &[json!(format!("{}@example.com", "a".repeat(243))), json!(1)]);
    assert_field_rejects("phone", &[json!("1".repeat(33)), json!(4155552671_u64)]);
}

#[test]
fn address_rules() {
    let address = |value: Value| with("address", value);
    assert_eq!(paths(&address(json!({"zip": "94105"}))), vec!["address.line1"]);
    assert_eq!(paths(&address(json!({"line1": "", "zip": ""}))), vec!["address.line1", "address.zip"]);
    assert_eq!(
        paths(&address(json!({"line1": "x".repeat(201), "zip": "1".repeat(17)}))),
        vec!["address.line1", "address.zip"]
    );
    assert_eq!(paths(&address(json!({"line1": "1 Main", "zip": "94105", "country": "USA"}))), vec!["address.country"]);
    assert_eq!(paths(&address(json!("1 Main St"))), vec!["address"]);
    ok(&address(json!({"line1": "x".repeat(200), "zip": "12345", "country": null})));
}

#[test]
fn messages_never_contain_the_value() {
    let secret = "SECRET-VALUE-42";
    let mut input = json!({"event": secret, "external_id": [secret], "occurred_at": secret, "visitor_id": secret,
        "click_id": secret, "contact_id": format!("{secret}\n"), "country": secret, "currency": secret,
        "value": secret, "hdyhau": format!("{secret}\u{1}"), "tags": {"plan": secret.repeat(10)},
        "address": {"line1": secret.repeat(20), "zip": secret}});
    input["email"] = json!(secret.repeat(30));
    match validate_conversion(&input, NOW_MS) {
        Err(Invalid::Fields(errors)) => {
            assert!(errors.len() >= 12, "{errors:?}");
            for error in errors {
                assert!(!error.message.contains(secret), "{error:?}");
            }
        }
        other => panic!("{other:?}"),
    }
}

fn batch_len(input: &Value) -> Result<usize, Vec<FieldError>> {
    validate_batch(input, NOW_MS).map(|items| items.len())
}

#[test]
fn batch_envelope() {
    let item = base();
    assert_eq!(batch_len(&json!({"conversions": [item]})), Ok(1));
    let many: Vec<Value> = (0..500).map(|_| base()).collect();
    assert_eq!(batch_len(&json!({"conversions": many})), Ok(500));
    let too_many: Vec<Value> = (0..501).map(|_| base()).collect();
    let refused = [
        json!({"conversions": []}),
        json!({"conversions": too_many}),
        json!({}),
        json!({"conversions": {}}),
        json!({"conversions": [1], "extra": 1}),
        json!([base()]),
    ];
    for input in refused {
        assert!(batch_len(&input).is_err(), "{input}");
    }
    let paths: Vec<String> = batch_len(&json!({"conversions": [1], "extra": 1}))
        .err()
        .unwrap_or_default()
        .into_iter()
        .map(|e| e.path)
        .collect();
    assert_eq!(paths, vec!["extra"]);
    for body in [json!([base()]), json!(null), json!(5), json!("conversions")] {
        let paths: Vec<String> = batch_len(&body).err().unwrap_or_default().into_iter().map(|e| e.path).collect();
        assert_eq!(paths, vec!["conversions"], "{body}");
    }
}

#[test]
fn batch_items_are_validated_in_order() {
    let mut bad = base();
    bad["event"] = json!("bad event");
    let items = validate_batch(&json!({"conversions": [base(), 7, bad]}), NOW_MS).unwrap_or_default();
    assert!(items[0].is_ok());
    assert_eq!(items[1], Err(Invalid::Fields(vec![FieldError::new("", "must be a JSON object")])));
    assert!(matches!(&items[2], Err(Invalid::Fields(errors)) if errors[0].path == "event"));
}

fn with_unknown_fields(count: usize) -> Value {
    let mut input = base();
    for index in 0..count {
        input[format!("unknown_{index:05}")] = json!(1);
    }
    input
}

fn details_of(invalid: &Invalid) -> &[FieldError] {
    match invalid {
        Invalid::Fields(details) => details,
        Invalid::OccurredAtOutOfRange => &[],
    }
}

#[test]
fn details_are_capped_per_conversion() {
    assert_eq!(paths(&with_unknown_fields(MAX_DETAILS_PER_ITEM)).len(), MAX_DETAILS_PER_ITEM);
    let Err(invalid) = validate_conversion(&with_unknown_fields(1234), NOW_MS) else { panic!("valid") };
    let details = details_of(&invalid);
    assert_eq!(details.len(), MAX_DETAILS_PER_ITEM);
    assert_eq!(details[0].path, "unknown_00000");
    assert_eq!(details[19], FieldError::new("", "1215 more problems not listed"));
}

#[test]
fn batch_envelope_details_are_capped() {
    let mut envelope = json!({"conversions": []});
    for index in 0..100 {
        envelope[format!("extra_{index}")] = json!(1);
    }
    let details = validate_batch(&envelope, NOW_MS).err().unwrap_or_default();
    // The empty `conversions` is always named; the unknown fields are capped.
    assert_eq!(details.len(), MAX_DETAILS_PER_ITEM + 1);
    assert!(details.contains(&FieldError::new("conversions", "must have 1 to 500 items")));
    assert_eq!(details[20], FieldError::new("", "81 more problems not listed"));
}

#[test]
fn batch_details_are_capped_per_response() {
    let items: Vec<Value> = (0..500).map(|_| with_unknown_fields(50)).collect();
    let checked = validate_batch(&json!({"conversions": items}), NOW_MS).unwrap_or_default();
    let lists: Vec<&[FieldError]> = checked.iter().filter_map(|item| item.as_ref().err()).map(details_of).collect();
    assert_eq!(lists.len(), 500);
    assert_eq!(lists.iter().map(|details| details.len()).sum::<usize>(), MAX_DETAILS_PER_RESPONSE);
    assert!(lists.iter().all(|details| (1..=MAX_DETAILS_PER_ITEM).contains(&details.len())));
    assert_eq!(lists[0][19], FieldError::new("", "31 more problems not listed"));
    assert_eq!(lists[499], [FieldError::new("", "50 problems not listed")]);
}

mod properties {
    use super::*;
    use proptest::prelude::*;

    fn arbitrary_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
            ".{0,40}".prop_map(Value::from),
            "[0-9]{13}".prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 32, 8, |inner| {
            let keys = prop_oneof![
                Just("event".to_owned()),
                Just("external_id".to_owned()),
                Just("occurred_at".to_owned()),
                Just("address".to_owned()),
                Just("tags".to_owned()),
                Just("value".to_owned()),
                Just("phone".to_owned()),
                Just("email".to_owned()),
                Just("country".to_owned()),
                Just("line1".to_owned()),
                Just("zip".to_owned()),
                Just("conversions".to_owned()),
                "[a-z_]{1,8}",
            ];
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(keys, inner, 0..8).prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn arbitrary_json_never_panics(input in arbitrary_json()) {
            let _ = validate_conversion(&input, NOW_MS);
            let _ = validate_batch(&input, NOW_MS);
        }

        #[test]
        fn errors_never_echo_string_values(marker in "[A-Z]{12}") {
            let input = json!({"event": marker, "external_id": [marker], "occurred_at": marker, "tags": {"x": marker.repeat(6)}});
            if let Err(Invalid::Fields(errors)) = validate_conversion(&input, NOW_MS) {
                for error in errors {
                    prop_assert!(!error.message.contains(&marker));
                }
            }
        }
    }
}

#[test]
fn every_problem_of_a_schema_field_is_listed_however_many_unknown_fields_come_first() {
    let mut input = with_unknown_fields(100);
    for (field, value) in [
        ("event", json!("bad event!")),
        ("external_id", json!(-1)),
        ("parent_external_id", json!(-1)),
        ("occurred_at", json!("yesterday")),
        ("visitor_id", json!("short")),
        ("click_id", json!("short")),
        ("contact_id", json!("a\u{1}b")),
        ("email", json!("e".repeat(255))),
        ("phone", json!("1".repeat(33))),
        ("country", json!("USA")),
        ("address", json!({"line1": 7, "zip": "z".repeat(17), "country": "USA", "floor": 2})),
        ("value", json!(-1)),
        ("currency", json!("EURO")),
        ("hdyhau", json!("a\u{1}b")),
        ("tags", json!({"Bad Key": "x"})),
        ("email_sha256", json!("not hex")),
        ("phone_sha256", json!("not hex")),
        ("address_sha256", json!("not hex")),
    ] {
        input[field] = value;
    }
    let listed = paths(&input);
    let schema_paths = [
        "event",
        "external_id",
        "parent_external_id",
        "occurred_at",
        "visitor_id",
        "click_id",
        "contact_id",
        "email",
        "phone",
        "country",
        "address.line1",
        "address.zip",
        "address.country",
        "value",
        "currency",
        "hdyhau",
        "email_sha256",
        "phone_sha256",
        "address_sha256",
    ];
    for path in schema_paths {
        assert!(listed.iter().any(|p| p == path), "{path} is not listed: {listed:?}");
    }
    assert!(listed.len() > MAX_DETAILS_PER_ITEM + schema_paths.len() - 1, "{listed:?}");
}
