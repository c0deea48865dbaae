//! Shared by the gateway and the writer.
//!
//! - [`error`]: the documented error codes and their HTTP statuses, in one place.
//! - [`conversion`]: the validated, normalized and hashed conversion (no raw PII in it).
//! - [`validate`]: raw JSON to a validated conversion, or the complete list of problems.
//! - [`normalize`]: email, phone and address normalization and SHA-256 hashing.
//! - [`message`]: the versioned messages between gateway and writer over Kafka.
//! - [`ids`]: prefixed, sortable ids.
//! - [`kafka`]: every Kafka client setting of both programs (feature `service`).
//! - [`service`]: the shutdown signal (feature `service`).
//! - [`config`]: the settings both programs take (database, Kafka, logging).
//! - [`reference`]: the configuration reference rendered from the clap definitions.

pub mod config;
pub mod conversion;
pub mod error;
pub mod ids;
#[cfg(feature = "service")]
pub mod kafka;
pub mod message;
pub mod normalize;
pub mod reference;
#[cfg(feature = "service")]
pub mod service;
pub mod validate;
