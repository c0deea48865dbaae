//! The request body as the validator reads it: a JSON document whose strings borrow from the
//! body where they hold no escape, and whose objects are their fields in sent order.
//!
//! Written here rather than reading into `serde_json::Value`: `Value` copies every string and
//! builds a `BTreeMap` node per field, and for 500-item batches parsing and dropping that tree
//! takes a fifth of the gateway's CPU in a profile of `batch_ingest`. Typed structs are no option:
//! serde stops at the first error, and the contract lists every bad field at once. What is read
//! is what `Value` would hold: of a name sent twice the last value counts, and an object's
//! names are visited in sorted order, so details come in the same order as before.
//!
//! One difference, on purpose: where serde_json is built with `raw_value` (sqlx turns it on in
//! the gateway), `Value` reads an object whose first name is `$serde_json::private::RawValue` as
//! the JSON text in its value, a second document inside the first with a depth limit of its
//! own. Here it is an object like any other, so such a conversion has an unknown field.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Number, Value};
use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, PartialEq)]
pub enum Json<'a> {
    Null,
    Bool(bool),
    /// Its text as sent (serde_json's `arbitrary_precision`).
    Number(Number),
    String(Cow<'a, str>),
    Array(Vec<Json<'a>>),
    Object(Object<'a>),
}

/// An object's fields in sent order, a name possibly more than once.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Object<'a> {
    fields: Vec<(Cow<'a, str>, Json<'a>)>,
}

impl<'a> Json<'a> {
    /// Reads a body. Fails where `serde_json::from_slice::<Value>` fails (syntax, trailing
    /// characters, nesting deeper than 128), but for the raw-value object above.
    pub fn parse(bytes: &'a [u8]) -> serde_json::Result<Self> {
        serde_json::from_slice(bytes)
    }

    pub fn as_object(&self) -> Option<&Object<'a>> {
        match self {
            Json::Object(object) => Some(object),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::String(text) => Some(text),
            _ => None,
        }
    }
}

impl<'a> Object<'a> {
    /// The value of `name`; of a name sent twice, the last.
    pub fn get(&self, name: &str) -> Option<&Json<'a>> {
        self.fields.iter().rev().find(|(field, _)| field == name).map(|(_, value)| value)
    }

    /// The names in sent order, a repeated one each time.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.fields.iter().map(|(name, _)| name.as_ref())
    }

    /// Each name once with its last value, sorted by name. Sorting keeps a body of many
    /// fields at O(n log n); `get` is for the few known names.
    pub fn entries(&self) -> Vec<(&str, &Json<'a>)> {
        let mut entries: Vec<(&str, &Json<'a>)> =
            self.fields.iter().map(|(name, value)| (name.as_ref(), value)).collect();
        // Stable: among equal names the sent order stays, and the last one sent is kept.
        entries.sort_by(|a, b| a.0.cmp(b.0));
        let mut unique: Vec<(&str, &Json<'a>)> = Vec::with_capacity(entries.len());
        for entry in entries {
            match unique.last_mut() {
                Some(last) if last.0 == entry.0 => *last = entry,
                _ => unique.push(entry),
            }
        }
        unique
    }
}

impl<'a> From<&'a Value> for Json<'a> {
    fn from(value: &'a Value) -> Self {
        match value {
            Value::Null => Json::Null,
            Value::Bool(flag) => Json::Bool(*flag),
            Value::Number(number) => Json::Number(number.clone()),
            Value::String(text) => Json::String(Cow::Borrowed(text)),
            Value::Array(items) => Json::Array(items.iter().map(Json::from).collect()),
            Value::Object(map) => Json::Object(Object {
                fields: map.iter().map(|(name, value)| (Cow::Borrowed(name.as_str()), Json::from(value))).collect(),
            }),
        }
    }
}

/// The key under which serde_json with `arbitrary_precision` hands a number to
/// `deserialize_any`: a map of one entry, the number's text its value. serde_json's own `Value`
/// reads numbers the same way; `numbers_keep_their_text` fails if this ever changes.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

impl<'de> Deserialize<'de> for Json<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json<'de>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_unit<E>(self) -> Result<Json<'de>, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E>(self, flag: bool) -> Result<Json<'de>, E> {
        Ok(Json::Bool(flag))
    }

    fn visit_u64<E>(self, integer: u64) -> Result<Json<'de>, E> {
        Ok(Json::Number(integer.into()))
    }

    fn visit_i64<E>(self, integer: i64) -> Result<Json<'de>, E> {
        Ok(Json::Number(integer.into()))
    }

    fn visit_f64<E: de::Error>(self, float: f64) -> Result<Json<'de>, E> {
        Number::from_f64(float).map(Json::Number).ok_or_else(|| E::custom("not a JSON number"))
    }

    fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Borrowed(text)))
    }

    fn visit_str<E>(self, text: &str) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(text.to_owned())))
    }

    fn visit_string<E>(self, text: String) -> Result<Json<'de>, E> {
        Ok(Json::String(Cow::Owned(text)))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json<'de>, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(512));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json<'de>, A::Error> {
        let mut fields = Vec::new();
        while let Some(name) = map.next_key::<Name<'de>>()? {
            let value = if fields.is_empty() && name.0 == NUMBER_TOKEN {
                match map.next_value::<TokenValue<'de>>()? {
                    TokenValue::NumberText(text) => {
                        return Number::from_str(&text).map(Json::Number).map_err(de::Error::custom)
                    }
                    TokenValue::Sent(value) => value,
                }
            } else {
                map.next_value()?
            };
            fields.push((name.0, value));
        }
        Ok(Json::Object(Object { fields }))
    }
}

/// The value under [`NUMBER_TOKEN`]: the number's text when serde_json hands a number over (an
/// owned `String`, `visit_string`), or a value the client sent under that name. A string of
/// the body arrives borrowed or as `visit_str`, never as `visit_string`, so an object that a
/// client builds with that name stays an object (and an unknown field where a number belongs).
enum TokenValue<'a> {
    NumberText(String),
    Sent(Json<'a>),
}

impl<'de> Deserialize<'de> for TokenValue<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(TokenValueVisitor)
    }
}

struct TokenValueVisitor;

impl<'de> Visitor<'de> for TokenValueVisitor {
    type Value = TokenValue<'de>;

    fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
        JsonVisitor.expecting(formatter)
    }

    fn visit_string<E: de::Error>(self, text: String) -> Result<TokenValue<'de>, E> {
        Ok(TokenValue::NumberText(text))
    }

    fn visit_unit<E: de::Error>(self) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_unit().map(TokenValue::Sent)
    }

    fn visit_bool<E: de::Error>(self, flag: bool) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_bool(flag).map(TokenValue::Sent)
    }

    fn visit_u64<E: de::Error>(self, integer: u64) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_u64(integer).map(TokenValue::Sent)
    }

    fn visit_i64<E: de::Error>(self, integer: i64) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_i64(integer).map(TokenValue::Sent)
    }

    fn visit_f64<E: de::Error>(self, float: f64) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_f64(float).map(TokenValue::Sent)
    }

    fn visit_borrowed_str<E: de::Error>(self, text: &'de str) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_borrowed_str(text).map(TokenValue::Sent)
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<TokenValue<'de>, E> {
        JsonVisitor.visit_str(text).map(TokenValue::Sent)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<TokenValue<'de>, A::Error> {
        JsonVisitor.visit_seq(seq).map(TokenValue::Sent)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<TokenValue<'de>, A::Error> {
        JsonVisitor.visit_map(map).map(TokenValue::Sent)
    }
}

/// An object's name, borrowed when it holds no escape (serde's own `Cow<str>` always copies).
struct Name<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Name<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl<'de> Visitor<'de> for NameVisitor {
            type Value = Name<'de>;

            fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
                formatter.write_str("a field name")
            }

            fn visit_borrowed_str<E>(self, text: &'de str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Borrowed(text)))
            }

            fn visit_str<E>(self, text: &str) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(text.to_owned())))
            }

            fn visit_string<E>(self, text: String) -> Result<Name<'de>, E> {
                Ok(Name(Cow::Owned(text)))
            }
        }
        deserializer.deserialize_str(NameVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Json<'_> {
        Json::parse(text.as_bytes()).unwrap_or_else(|e| panic!("{text}: {e}"))
    }

    /// The name serde_json gives a number inside, sent by a client, is an ordinary object.
    #[test]
    fn an_object_named_like_a_number_stays_an_object() {
        for body in [
            r#"{"$serde_json::private::Number": "42"}"#,
            r#"{"$serde_json::private::Number": "4\u0032"}"#,
            r#"{"$serde_json::private::Number": 42, "other": 1}"#,
        ] {
            let Json::Object(object) = parse(body) else { panic!("{body}: an object") };
            assert!(object.get(NUMBER_TOKEN).is_some(), "{body}");
        }
    }

    #[test]
    fn numbers_keep_their_text() {
        for text in ["12.50", "0", "-0.0", "123456789012345678901234567890", "1.000000000000000000001"] {
            let Json::Number(number) = parse(text) else { panic!("{text}: a number") };
            assert_eq!(number.as_str(), text);
        }
        // As `Value` holds it (serde_json writes the exponent's sign).
        let Ok(Value::Number(value)) = serde_json::from_str::<Value>("1e3") else { panic!("a number") };
        assert_eq!(parse("1e3"), Json::Number(value));
        let Json::Object(object) = parse(r#"{"value": 12.50}"#) else { panic!("an object") };
        assert_eq!(object.get("value").map(|v| matches!(v, Json::Number(n) if n.as_str() == "12.50")), Some(true));
    }

    #[test]
    fn strings_borrow_unless_escaped() {
        assert!(matches!(parse(r#""plain""#), Json::String(Cow::Borrowed("plain"))));
        assert!(matches!(parse(r#""a\nb""#), Json::String(Cow::Owned(ref s)) if s == "a\nb"));
        assert_eq!(parse(r#""\u0000""#).as_str(), Some("\u{0}"));
        let Json::Object(object) = parse(r#"{"t\u0061gs": 1, "plain": 2}"#) else { panic!("an object") };
        assert!(object.get("tags").is_some());
        assert!(matches!(object.fields[1].0, Cow::Borrowed("plain")));
    }

    #[test]
    fn the_last_of_a_repeated_name_counts_and_names_come_sorted() {
        let Json::Object(object) = parse(r#"{"b": 1, "a": 2, "b": 3, "c": {"x": []}, "a": null}"#) else {
            panic!("an object")
        };
        assert_eq!(object.get("b"), Some(&Json::Number(3.into())));
        let names: Vec<&str> = object.entries().iter().map(|(name, _)| *name).collect();
        assert_eq!(names, ["a", "b", "c"]);
        assert_eq!(object.entries()[0].1, &Json::Null);
        assert_eq!(object.entries()[1].1, &Json::Number(3.into()));
    }

    /// What `Value` reads, this reads: the same document from either path.
    #[test]
    fn reads_what_value_reads() {
        let bodies = [
            r#"{"conversions": [{"event": "Lead", "tags": {"z": "1", "a": "\u00e9"}, "value": 1.50, "x": [true, false, null]}]}"#,
            r#"[1, -2, 3.25, "s", {"k": {"k": {"k": []}}}]"#,
            r#"{"b": 1, "a": 2, "b": 3}"#,
            r#"  "text"  "#,
        ];
        for body in bodies {
            let value: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(normalized(&parse(body)), normalized(&Json::from(&value)), "{body}");
        }
    }

    /// Objects as their sorted entries, so that sent order and repeats compare as `Value` holds them.
    fn normalized(json: &Json<'_>) -> String {
        match json {
            Json::Null => "null".into(),
            Json::Bool(flag) => flag.to_string(),
            Json::Number(number) => format!("n{number}"),
            Json::String(text) => format!("{text:?}"),
            Json::Array(items) => format!("[{}]", items.iter().map(normalized).collect::<Vec<_>>().join(",")),
            Json::Object(object) => format!(
                "{{{}}}",
                object
                    .entries()
                    .iter()
                    .map(|(name, value)| format!("{name:?}:{}", normalized(value)))
                    .collect::<Vec<_>>()
                    .join(",")
            ),
        }
    }

    #[test]
    fn fails_where_value_fails() {
        let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
        for body in ["", "{", "[1,]", "{\"a\" 1}", "1 2", "nul", "\"\\ud800\"x", &"[".repeat(200), &deep] {
            assert!(serde_json::from_str::<Value>(body).is_err(), "{body}");
            assert!(Json::parse(body.as_bytes()).is_err(), "{body}");
        }
    }
}
