//! The runtime the gateway and the writer share.
//!
//! - [`kafka`]: every Kafka client setting of both programs (feature `service`).
//! - [`kafka_errors`]: what the programs do with librdkafka's errors (feature `service`).
//! - [`service`]: the shutdown signal (feature `service`).
//! - [`systemd`]: readiness and the watchdog for a unit of `Type=notify` (feature `service`).
//! - [`config`]: the settings both programs take (database, Kafka, logging).
//! - [`metrics`]: the `/metrics` registry of either service, its build info and its text.
//! - [`process`]: the process's memory, CPU, file descriptors and start time on `/metrics`.
//! - [`reference`]: the configuration reference rendered from the clap definitions.
//!
//! The model (conversion, validation, normalization, messages, error codes, ids) is not here: it
//! is the crate `intake-model`, which the programs name as `intake_model`.

pub mod config;
#[cfg(feature = "service")]
pub mod kafka;
#[cfg(feature = "service")]
pub mod kafka_errors;
pub mod log_writer;
pub mod metrics;
pub mod process;
pub mod reference;
#[cfg(feature = "service")]
pub mod service;
#[cfg(feature = "service")]
pub mod systemd;
