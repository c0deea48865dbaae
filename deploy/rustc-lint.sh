#!/bin/sh
# cargo's rustc-workspace-wrapper (.cargo/config.toml): every test target of the workspace is
# compiled by clippy-driver, which lints as it compiles; everything else by rustc itself.
#
# So the suite's build is its lint: `cargo clippy` would check every dependency once more
# (check and build artifacts are separate units to cargo), 100 s of CPU on a fresh machine,
# beside the tests. A test target compiles its crate's whole code, so every crate is linted;
# the programs that run (the services, the load generator) stay rustc's own, since
# clippy-driver turns MIR optimisations off. Findings are errors (CLIPPY_ARGS, set beside the
# wrapper); rustc's warnings on the other targets fail deploy/test.sh at its end.
rustc="$1"
shift
for arg; do
    if [ "$arg" = --test ]; then
        command -v clippy-driver >/dev/null || { echo "clippy is not installed: rustup component add clippy" >&2; exit 1; }
        exec clippy-driver "$rustc" "$@"
    fi
done
exec "$rustc" "$@"
