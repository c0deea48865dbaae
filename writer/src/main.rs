//! `intake-writer`: the only program that writes PostgreSQL. `run` applies request messages;
//! the other subcommands are the operator commands. Every command prints one JSON object on
//! stdout, or exits non-zero with a message on stderr. The command line is the library's
//! (`commands/`).

/// See the workspace Cargo.toml: the allocator showed in the profile.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    intake_writer::commands::main();
}
