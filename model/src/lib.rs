//! The pure model of a conversion, shared by the gateway, the writer, the sender, the fuzz target
//! and the client-facing normalization vectors. No runtime here (no tokio, clap, Kafka or
//! database): what runs the services is `intake-common`.
//!
//! - [`error`]: the documented error codes and their HTTP statuses, in one place.
//! - [`conversion`]: the validated, normalized and hashed conversion (no raw PII in it).
//! - [`validate`]: raw JSON to a validated conversion, or the complete list of problems.
//! - [`normalize`]: email, phone and address normalization and SHA-256 hashing.
//! - [`message`]: the versioned messages between gateway and writer over Kafka.
//! - [`ids`]: prefixed, sortable ids.

pub mod conversion;
pub mod error;
pub mod ids;
pub mod message;
pub mod normalize;
pub mod validate;
