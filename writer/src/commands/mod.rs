//! The writer's commands, one module per group: its flags and what it does with them, returning
//! the JSON object that main prints. The engine they drive is the library (src/lib.rs).

pub mod dlq;
pub mod erase;
pub mod key;
pub mod migrate;
pub mod replay;
pub mod restore;
pub mod run;
pub mod topics;
pub mod workspace;
