//! Raw JSON to a [`ValidConversion`], or the complete list of problems (docs/api.md,
//! "Conversion fields"). Every bad field is reported at once; no message contains a sent value.
//!
//! The walk over the body's [`Json`] is written by hand rather than with
//! `#[serde(deny_unknown_fields)]` because serde stops at the first error, and the contract
//! wants every bad field listed together.

use crate::conversion::{Conversion, Decimal, Event, ExternalId, Sha256Hex, ValidConversion, Warning};
use crate::error::FieldError;
use crate::normalize::{self, has_control_chars, pattern};
use details::{Problems, ResponseBudget};
use regex::Regex;
use std::collections::BTreeMap;
use std::fmt::Display;
use std::sync::LazyLock;
use time::format_description::well_known::{Iso8601, Rfc3339};
use time::OffsetDateTime;

pub use details::{MAX_DETAILS_PER_ITEM, MAX_DETAILS_PER_RESPONSE};
pub use json::{Json, Object};

/// Why a conversion was refused. Out-of-range `occurred_at` is its own code, reported only
/// when every other field is valid. `Fields` is capped (see [`details`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Invalid {
    Fields(Vec<FieldError>),
    OccurredAtOutOfRange,
}

/// The items of a batch in input order, each valid or refused.
pub type BatchItems = Vec<Result<ValidConversion, Invalid>>;

/// [`Invalid`] before its details are capped: a batch shares one cap among its items.
enum Refused {
    Fields(Problems),
    OccurredAtOutOfRange,
}

pub const MAX_BATCH_ITEMS: usize = 500;
/// 2^53 - 1: the largest integer every JSON implementation holds exactly.
pub const MAX_INTEGER_ID: u64 = 9_007_199_254_740_991;
/// 2000-01-01T00:00:00Z.
pub const EARLIEST_OCCURRED_AT_MS: i64 = 946_684_800_000;
pub const FUTURE_TOLERANCE_MS: i64 = 5 * 60 * 1000;
const MIN_EPOCH_MS: u64 = 1_000_000_000_000;
const MAX_EPOCH_MS: u64 = 100_000_000_000_000;

const FIELDS: [&str; 18] = [
    "event",
    "external_id",
    "parent_external_id",
    "occurred_at",
    "visitor_id",
    "click_id",
    "contact_id",
    "email",
    "email_sha256",
    "phone",
    "phone_sha256",
    "country",
    "address",
    "address_sha256",
    "value",
    "currency",
    "hdyhau",
    "tags",
];
const ADDRESS_FIELDS: [&str; 3] = ["line1", "zip", "country"];

static EVENT: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[A-Za-z0-9_]{1,40}$"));
static VISITOR_ID: LazyLock<Regex> = LazyLock::new(|| pattern(r"^([A-Za-z0-9_-]{16})(?:\.[0-9]{8})?$"));
static CLICK_ID: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[0-9A-Za-z]{12}$"));
static COUNTRY: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[A-Za-z]{2}$"));
static CURRENCY: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[A-Za-z]{3}$"));
static VALUE_TEXT: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[0-9]{1,10}(\.[0-9]{1,6})?$"));
static TAG_KEY: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[a-z_]{1,24}$"));
static EPOCH_MS_TEXT: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[0-9]{13}$"));
static SHA256_HEX: LazyLock<Regex> = LazyLock::new(|| pattern(r"^[0-9a-f]{64}$"));

/// The identifiers a client may send hashed, each beside its raw field: never both.
const PRE_HASHED: [(&str, &str); 3] =
    [("email", "email_sha256"), ("phone", "phone_sha256"), ("address", "address_sha256")];

/// Validates one conversion input. `now_ms` is the server clock, for the future tolerance.
pub fn validate_conversion(input: &Json, now_ms: i64) -> Result<ValidConversion, Invalid> {
    check_conversion(input, now_ms).map_err(|refused| match refused {
        Refused::Fields(problems) => Invalid::Fields(problems.into_details(MAX_DETAILS_PER_ITEM)),
        Refused::OccurredAtOutOfRange => Invalid::OccurredAtOutOfRange,
    })
}

/// Validates a batch: the envelope `{conversions: [...]}` (its problems are the `Err`), then
/// each item in order. An item that is not an object is an item error. The details that name
/// fields the sender chose (unknown fields, tag keys) stay within [`MAX_DETAILS_PER_RESPONSE`]
/// for all refused items together; those of the API's own fields are all listed.
pub fn validate_batch(input: &Json, now_ms: i64) -> Result<BatchItems, Vec<FieldError>> {
    let items = batch_items(input).map_err(|problems| problems.into_details(MAX_DETAILS_PER_ITEM))?;
    let checked: Vec<Result<ValidConversion, Refused>> =
        items.iter().map(|item| check_conversion(item, now_ms)).collect();
    let refused = checked.iter().filter(|item| matches!(item, Err(Refused::Fields(_)))).count();
    let mut budget = ResponseBudget::new(refused);
    Ok(checked
        .into_iter()
        .map(|item| {
            item.map_err(|refused| match refused {
                Refused::Fields(problems) => Invalid::Fields(budget.details(problems)),
                Refused::OccurredAtOutOfRange => Invalid::OccurredAtOutOfRange,
            })
        })
        .collect())
}

fn check_conversion(input: &Json, now_ms: i64) -> Result<ValidConversion, Refused> {
    let Some(object) = input.as_object() else {
        let mut problems = Problems::default();
        problems.add("", "must be a JSON object");
        return Err(Refused::Fields(problems));
    };
    let mut check = Checker::default();
    check.unknown_fields(object, &FIELDS, "");

    let event = check.required(object, "event", "event").and_then(|v| check.pattern(v, "event", &EVENT));
    let external_id =
        check.required(object, "external_id", "external_id").and_then(|v| check.external_id(v, "external_id"));
    let parent_external_id =
        sent(object, "parent_external_id").and_then(|v| check.external_id(v, "parent_external_id"));
    let occurred_at = check.required(object, "occurred_at", "occurred_at").and_then(|v| check.occurred_at(v));
    let visitor_id = sent(object, "visitor_id").and_then(|v| check.pattern(v, "visitor_id", &VISITOR_ID));
    let click_id = sent(object, "click_id").and_then(|v| check.pattern(v, "click_id", &CLICK_ID));
    let contact_id = sent(object, "contact_id").and_then(|v| check.text(v, "contact_id", 128));
    let email = sent(object, "email").and_then(|v| check.max_chars(v, "email", 254));
    let phone = sent(object, "phone").and_then(|v| check.max_chars(v, "phone", 32));
    let country = sent(object, "country").and_then(|v| check.pattern(v, "country", &COUNTRY));
    let address = sent(object, "address").and_then(|v| check.address(v));
    let value = sent(object, "value").and_then(|v| check.value(v));
    let currency = sent(object, "currency").and_then(|v| check.pattern(v, "currency", &CURRENCY));
    let hdyhau = sent(object, "hdyhau").and_then(|v| check.text(v, "hdyhau", 200));
    let tags = sent(object, "tags").and_then(|v| check.tags(v));
    let [email_hashed, phone_hashed, address_hashed] = PRE_HASHED.map(|(raw, hashed)| {
        let value = sent(object, hashed)?;
        if sent(object, raw).is_some() {
            check.error(hashed, format_args!("must not be sent with {raw}: send one form of the identifier"));
        }
        check.sha256(value, hashed)
    });

    let (Some(event), Some(external_id), Some(occurred_at_ms)) = (event, external_id, occurred_at) else {
        // A missing required field always records a problem.
        return Err(Refused::Fields(check.problems));
    };
    if !check.problems.is_empty() {
        return Err(Refused::Fields(check.problems));
    }
    if occurred_at_ms < EARLIEST_OCCURRED_AT_MS || occurred_at_ms > now_ms + FUTURE_TOLERANCE_MS {
        return Err(Refused::OccurredAtOutOfRange);
    }

    let country = country.map(str::to_ascii_uppercase);
    // A pre-hashed identifier is stored as sent, exactly where the gateway's own hash would be;
    // it has no raw form beside it (checked above) and no warning.
    let mut warnings = Vec::new();
    let email_sha256 = email.and_then(|raw| {
        let hash = normalize::email_hash(raw);
        if hash.is_none() {
            warnings.push(Warning::EmailInvalid);
        }
        hash
    });
    let phone_sha256 = phone.and_then(|raw| {
        let hash = normalize::phone_hash(raw, country.as_deref());
        if hash.is_none() {
            warnings.push(Warning::PhoneUnparseable);
        }
        hash
    });
    let address_sha256 = address.and_then(|address| {
        let address_country = address.country.map(str::to_ascii_uppercase).or_else(|| country.clone());
        let hash = normalize::address_hash(address.line1, address.zip, address_country.as_deref().unwrap_or("US"));
        if hash.is_none() {
            warnings.push(Warning::AddressUnparseable);
        }
        hash
    });

    Ok(ValidConversion {
        conversion: Conversion {
            event: Event(event.to_ascii_lowercase()),
            external_id,
            parent_external_id,
            occurred_at_ms,
            visitor_id: visitor_id.map(str::to_owned),
            click_id: click_id.map(str::to_owned),
            contact_id: contact_id.map(str::to_owned),
            email_sha256: email_hashed.or(email_sha256),
            phone_sha256: phone_hashed.or(phone_sha256),
            address_sha256: address_hashed.or(address_sha256),
            country,
            value,
            currency: currency.map(str::to_ascii_uppercase),
            hdyhau: hdyhau.map(str::to_owned),
            tags,
        },
        warnings,
    })
}

/// The items of a valid batch envelope `{conversions: [...]}`, or its problems.
fn batch_items<'a>(input: &'a Json<'a>) -> Result<&'a Vec<Json<'a>>, Problems> {
    let mut check = Checker::default();
    // Envelope errors name `conversions` or an unknown field (docs/api.md, "Field errors"):
    // a body that is not an object has no `conversions`.
    let Some(object) = input.as_object() else {
        check.error("conversions", "is required, in a JSON object {\"conversions\": [...]}");
        return Err(check.problems);
    };
    check.unknown_fields(object, &["conversions"], "");
    let items = match object.get("conversions") {
        None | Some(Json::Null) => {
            check.error("conversions", "is required");
            None
        }
        Some(Json::Array(items)) if items.is_empty() || items.len() > MAX_BATCH_ITEMS => {
            check.error("conversions", "must have 1 to 500 items");
            None
        }
        Some(Json::Array(items)) => Some(items),
        Some(_) => {
            check.error("conversions", "must be an array");
            None
        }
    };
    match items {
        Some(items) if check.problems.is_empty() => Ok(items),
        _ => Err(check.problems),
    }
}

/// A field's value, or `None` when it was not sent: absent, `null` or `""`.
fn sent<'a>(object: &'a Object<'a>, name: &str) -> Option<&'a Json<'a>> {
    match object.get(name) {
        None | Some(Json::Null) => None,
        Some(Json::String(text)) if text.is_empty() => None,
        Some(value) => Some(value),
    }
}

struct AddressInput<'a> {
    line1: &'a str,
    zip: &'a str,
    country: Option<&'a str>,
}

#[derive(Default)]
struct Checker {
    problems: Problems,
}

impl Checker {
    fn error(&mut self, path: impl Display, message: impl Display) {
        self.problems.add(path, message);
    }

    fn unknown_fields(&mut self, object: &Object, known: &[&str], prefix: &str) {
        let mut unknown: Vec<&str> = object.names().filter(|name| !known.contains(name)).collect();
        unknown.sort_unstable();
        unknown.dedup();
        for name in unknown {
            self.problems.add_sender_named(format_args!("{prefix}{name}"), "is not a known field");
        }
    }

    fn required<'a>(&mut self, object: &'a Object<'a>, name: &str, path: &str) -> Option<&'a Json<'a>> {
        let value = sent(object, name);
        if value.is_none() {
            self.error(path, "is required");
        }
        value
    }

    fn string<'a>(&mut self, value: &'a Json<'a>, path: &str) -> Option<&'a str> {
        let text = value.as_str();
        if text.is_none() {
            self.error(path, "must be a string");
        }
        text
    }

    fn pattern<'a>(&mut self, value: &'a Json<'a>, path: &str, regex: &Regex) -> Option<&'a str> {
        let text = self.string(value, path)?;
        if regex.is_match(text) {
            Some(text)
        } else {
            self.error(path, format_args!("must match {}", regex.as_str()));
            None
        }
    }

    fn sha256(&mut self, value: &Json, path: &str) -> Option<Sha256Hex> {
        let text = self.string(value, path)?;
        if SHA256_HEX.is_match(text) {
            Some(Sha256Hex(text.to_owned()))
        } else {
            self.error(path, "must be a SHA-256 in 64 lower-case hex characters, ^[0-9a-f]{64}$");
            None
        }
    }

    fn max_chars<'a>(&mut self, value: &'a Json<'a>, path: &str, max: usize) -> Option<&'a str> {
        let text = self.string(value, path)?;
        if text.chars().count() <= max {
            Some(text)
        } else {
            self.error(path, format_args!("must be at most {max} characters"));
            None
        }
    }

    /// 1 to `max` characters, no control characters.
    fn text<'a>(&mut self, value: &'a Json<'a>, path: &str, max: usize) -> Option<&'a str> {
        let text = self.string(value, path)?;
        let length = text.chars().count();
        if (1..=max).contains(&length) && !has_control_chars(text) {
            Some(text)
        } else {
            self.error(path, format_args!("must be 1 to {max} characters without control characters"));
            None
        }
    }

    fn external_id(&mut self, value: &Json, path: &str) -> Option<ExternalId> {
        match value {
            Json::String(_) => self.text(value, path, 128).map(|text| ExternalId(text.to_owned())),
            Json::Number(number) => match number.as_u64() {
                Some(integer) if integer <= MAX_INTEGER_ID => Some(ExternalId(integer.to_string())),
                _ => {
                    self.error(path, "must be an integer from 0 to 9007199254740991");
                    None
                }
            },
            _ => {
                self.error(path, "must be a string or an integer");
                None
            }
        }
    }

    /// Epoch milliseconds of a well-formed `occurred_at`; its range is checked by the caller.
    fn occurred_at(&mut self, value: &Json) -> Option<i64> {
        const PATH: &str = "occurred_at";
        let millis = match value {
            Json::Number(number) => number
                .as_u64()
                .filter(|ms| (MIN_EPOCH_MS..=MAX_EPOCH_MS).contains(ms))
                .and_then(|ms| i64::try_from(ms).ok()),
            Json::String(text) if EPOCH_MS_TEXT.is_match(text) => text.parse::<i64>().ok(),
            Json::String(text) => parse_date_time(text),
            _ => None,
        };
        if millis.is_none() {
            self.error(
                PATH,
                "must be an ISO 8601 date-time with a time zone, epoch milliseconds, or a 13-digit string",
            );
        }
        millis
    }

    /// An exact decimal: a JSON number is read from its own text, never through `f64`.
    fn value(&mut self, value: &Json) -> Option<Decimal> {
        const PATH: &str = "value";
        let canonical = match value {
            Json::Number(number) => decimal::json_number_value(number.as_str()),
            Json::String(text) if VALUE_TEXT.is_match(text) => Some(decimal::numeric_string_value(text)),
            _ => None,
        };
        if canonical.is_none() {
            self.error(
                PATH,
                "must be a number from 0 to 1000000000, or a string matching ^[0-9]{1,10}(\\.[0-9]{1,6})?$",
            );
        }
        canonical.map(Decimal)
    }

    fn address<'a>(&mut self, value: &'a Json<'a>) -> Option<AddressInput<'a>> {
        let Some(object) = value.as_object() else {
            self.error("address", "must be an object");
            return None;
        };
        let problems_before = self.problems.count();
        self.unknown_fields(object, &ADDRESS_FIELDS, "address.");
        let line1 =
            self.required(object, "line1", "address.line1").and_then(|v| self.text_any(v, "address.line1", 200));
        let zip = self.required(object, "zip", "address.zip").and_then(|v| self.text_any(v, "address.zip", 16));
        let country = sent(object, "country").and_then(|v| self.pattern(v, "address.country", &COUNTRY));
        if self.problems.count() != problems_before {
            return None;
        }
        Some(AddressInput { line1: line1?, zip: zip?, country })
    }

    /// 1 to `max` characters of any kind (address lines are hashed, never stored).
    fn text_any<'a>(&mut self, value: &'a Json<'a>, path: &str, max: usize) -> Option<&'a str> {
        let text = self.string(value, path)?;
        if (1..=max).contains(&text.chars().count()) {
            Some(text)
        } else {
            self.error(path, format_args!("must be 1 to {max} characters"));
            None
        }
    }

    fn tags(&mut self, value: &Json) -> Option<BTreeMap<String, String>> {
        let Some(object) = value.as_object() else {
            self.error("tags", "must be an object");
            return None;
        };
        let problems_before = self.problems.count();
        let entries = object.entries();
        if entries.len() > 5 {
            self.error("tags", "must have at most 5 entries");
        }
        let mut tags = BTreeMap::new();
        for (key, value) in entries {
            let path = format_args!("tags.{key}");
            // Tag keys are the sender's names: their problems are capped like unknown fields'.
            if !TAG_KEY.is_match(key) {
                self.problems.add_sender_named(path, "key must match ^[a-z_]{1,24}$");
                continue;
            }
            match value.as_str() {
                Some(text) if text.chars().count() <= 64 && !has_control_chars(text) => {
                    tags.insert(key.to_owned(), text.to_owned());
                }
                _ => self
                    .problems
                    .add_sender_named(path, "must be a string of at most 64 characters without control characters"),
            }
        }
        (self.problems.count() == problems_before).then_some(tags)
    }
}

/// ISO 8601 date-time with a zone (`Z` or a `±hh:mm` offset), as UTC epoch milliseconds. The
/// ISO parser also takes the offsets `±hh` and `±hhmm`, which the contract does not, and offsets
/// up to ±25:59; a zone is at most 23:59 from UTC.
fn parse_date_time(text: &str) -> Option<i64> {
    if !ends_with_zone(text) {
        return None;
    }
    let parsed =
        OffsetDateTime::parse(text, &Rfc3339).or_else(|_| OffsetDateTime::parse(text, &Iso8601::DEFAULT)).ok()?;
    if parsed.offset().whole_hours().unsigned_abs() > 23 {
        return None;
    }
    i64::try_from(parsed.unix_timestamp_nanos().div_euclid(1_000_000)).ok()
}

/// Ends in `Z` (either case, as RFC 3339 allows) or in `+hh:mm` / `-hh:mm`.
fn ends_with_zone(text: &str) -> bool {
    let b = text.as_bytes();
    match b {
        [.., b'Z' | b'z'] => true,
        [.., b'+' | b'-', h1, h2, b':', m1, m2] => [h1, h2, m1, m2].iter().all(|d| d.is_ascii_digit()),
        _ => false,
    }
}

mod decimal;
mod details;
mod json;
#[cfg(test)]
mod tests;
