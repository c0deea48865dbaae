#!/usr/bin/env bash
# Quick start, command 2: runs the whole test suite. Starts the infrastructure it needs
# (the same PostgreSQL, Redis and Kafka as up.sh, with a database of its own); each end-to-end
# test starts its own gateway and writer on topics of its own.
source "$(dirname "$0")/lib.sh"

start_infrastructure
command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked

# Schemathesis and the OpenAPI validator, from PyPI, in a virtualenv kept with the other tools.
export INTAKE_PY_VENV="$INTAKE_CACHE/venv"
if [ ! -x "$INTAKE_PY_VENV/bin/schemathesis" ] || [ ! -x "$INTAKE_PY_VENV/bin/openapi-spec-validator" ]; then
    say "installing schemathesis and openapi-spec-validator"
    python3 -m venv "$INTAKE_PY_VENV" 2>/dev/null || { install_python_venv; python3 -m venv "$INTAKE_PY_VENV"; }
    "$INTAKE_PY_VENV/bin/pip" install -q schemathesis==4.32.5 openapi-spec-validator==0.9.0
fi

create_database intake_test
export DATABASE_URL="$(database_url intake_test)"
build
"$BIN/intake-writer" migrate >/dev/null
export INTAKE_BIN_DIR="$BIN"

cd "$REPO"
cargo nextest run --workspace --no-fail-fast "$@"
