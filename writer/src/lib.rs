//! The writer as a library: the consumer, scheduler and workers, the SQL of a chunk, the retry
//! policy and what the operator commands do, and the command line of the `intake-writer`
//! binary (`commands/`, which main.rs only calls); the benchmark's `direct_apply` baseline (bench/) links it to
//! time the apply path alone, without shipping a benchmark inside the production binary.

pub mod admin;
mod apply;
pub mod commands;
pub mod consume;
pub mod dlq;
pub mod durability;
pub mod erase;
mod expiry;
pub mod health;
mod inbox;
mod lookups;
// Metrics::new builds the whole registry, process metrics included: no Default, so that none is
// built in passing by a `..Default::default()`.
#[allow(clippy::new_without_default)]
pub mod metrics;
pub mod migrations;
pub mod ops;
mod outbox;
pub mod partitions;
mod plan;
mod positions;
pub mod primary;
mod read;
pub mod replay;
pub mod reread;
pub mod restore;
mod retention;
pub mod retry;
mod rewind;
mod schedule;
pub mod store;
pub mod topics;
