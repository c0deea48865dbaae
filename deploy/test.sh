#!/usr/bin/env bash
# Quick start, command 2: runs the whole test suite. Starts the infrastructure it needs
# (the same PostgreSQL, Redis and Tansu as up.sh, with a database of its own); each end-to-end
# test starts its own gateway and writer on topics of its own.
source "$(dirname "$0")/lib.sh"

start_infrastructure
command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked

create_database intake_test
export DATABASE_URL="$(database_url intake_test)"
build
"$BIN/intake-writer" migrate >/dev/null
export INTAKE_BIN_DIR="$BIN"

cd "$REPO"
cargo nextest run --workspace --no-fail-fast "$@"
