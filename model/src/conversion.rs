//! The validated conversion: what the gateway sends to the writer. It is built only by
//! [`crate::validate`]; raw email, phone and address never get into it, only their hashes.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// An external id as its decimal or literal string: `123` and `"123"` are the same id.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ExternalId(pub(crate) String);

impl ExternalId {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A stage name, lower-cased.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Event(pub(crate) String);

impl Event {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Lower-case hex SHA-256 of a normalized identifier.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Sha256Hex(pub(crate) String);

impl Sha256Hex {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// An exact decimal in canonical text (no leading zeros, no trailing fractional zeros), so
/// that `"12.50"` and `12.5` are equal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Decimal(pub(crate) String);

impl Decimal {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One validated conversion. `None` means "not sent": the stored value is kept.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Conversion {
    pub event: Event,
    pub external_id: ExternalId,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_external_id: Option<ExternalId>,
    /// UTC epoch milliseconds.
    pub occurred_at_ms: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub visitor_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub click_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub contact_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub email_sha256: Option<Sha256Hex>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phone_sha256: Option<Sha256Hex>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address_sha256: Option<Sha256Hex>,
    /// ISO 3166-1 alpha-2, upper-case.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub country: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Decimal>,
    /// ISO 4217, upper-case.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub currency: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hdyhau: Option<String>,
    /// When sent, replaces the stored tags.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tags: Option<BTreeMap<String, String>>,
}

/// An identifier that could not be used and was dropped; the conversion is still saved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Warning {
    EmailInvalid,
    PhoneUnparseable,
    AddressUnparseable,
}

/// A conversion that passed validation, with the warnings to report back to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidConversion {
    pub conversion: Conversion,
    pub warnings: Vec<Warning>,
}

/// The condition that picks workspace `$1`'s rows of `conversions` through the keys that lead
/// with the workspace id's 8-byte hash (migrations 0024 and 0025), the id itself checked in the
/// row against the hash's collisions. Every look-up of a workspace's conversions by external id
/// uses it, so that none falls back to a key that a contract migration dropped. A literal
/// argument is the table's alias with its dot (`"c."`).
#[macro_export]
macro_rules! in_workspace {
    () => {
        $crate::in_workspace!("")
    };
    ($alias:literal) => {
        concat!(
            "hashtextextended(",
            $alias,
            "workspace_id, 0) = hashtextextended($1, 0) AND ",
            $alias,
            "workspace_id = $1"
        )
    };
}

/// The end of every insert into `conversions`: what a write of a pair that exists already
/// changes (every column a conversion carries, and `updated_at`). The writer's insert and the
/// benchmark's PostgreSQL baseline (`pg_upsert`) both end with it, so that the baseline measures
/// the statement the writer runs. The key is the unique index on the workspace id's hash
/// (migration 0024), the digests their bytes (0036). `old_shape KEY` gives the statement of the
/// shape before those: the digests as hex text, on the key KEY (`pg_upsert_v1`, and the previous
/// version's insert in the rollout's test). The stored row is named `conversions` (an insert into
/// another table aliases it so). A macro rather than a const: `concat!` takes literals only, and
/// both statements are whole at compile time.
#[macro_export]
macro_rules! conversions_on_conflict {
    () => {
        concat!(
            $crate::conversions_on_conflict!(@ "((hashtextextended(workspace_id, 0)), event, external_id)", "digest"),
            // A row stored before the digests were bytes keeps its hex only while it is the
            // digest's: one a re-send replaced must not outlive it (an erasure would miss it).
            $crate::conversions_on_conflict!(@stale_hex "email"),
            $crate::conversions_on_conflict!(@stale_hex "phone"),
            $crate::conversions_on_conflict!(@stale_hex "address")
        )
    };
    (old_shape $key:expr) => {
        $crate::conversions_on_conflict!(@ $key, "sha256")
    };
    (@stale_hex $kind:literal) => {
        concat!(
            ", ", $kind, "_sha256 = CASE WHEN conversions.", $kind, "_sha256 = encode(excluded.", $kind,
            "_digest, 'hex') THEN conversions.", $kind, "_sha256 END"
        )
    };
    (@ $key:expr, $digest:literal) => {
        concat!(
            "ON CONFLICT ",
            $key,
            " DO UPDATE SET
                chain_id = excluded.chain_id, parent_external_id = excluded.parent_external_id,
                occurred_at = excluded.occurred_at, visitor_id = excluded.visitor_id, click_id = excluded.click_id,
                contact_id = excluded.contact_id, email_", $digest, " = excluded.email_", $digest, ",
                phone_", $digest, " = excluded.phone_", $digest, ", address_", $digest, " = excluded.address_", $digest, ",
                country = excluded.country, value = excluded.value, currency = excluded.currency,
                hdyhau = excluded.hdyhau, tags = excluded.tags, updated_at = now()"
        )
    };
}
