#!/usr/bin/env bash
# docs/configuration.md from the programs' own clap definitions: every flag of intake-gateway,
# intake-writer (each subcommand) and intake-send, with its environment variable, default and
# help text. Each program prints its part when run with --config-reference
# (common/src/reference.rs).
#
#   deploy/config-reference.sh           regenerates docs/configuration.md
#   deploy/config-reference.sh --check   exits 1, showing the difference, when the file is stale
#
# Uses the programs in $INTAKE_BIN_DIR when set (as the test suite does), else builds them.
source "$(dirname "$0")/lib.sh"

if [ -n "${INTAKE_BIN_DIR:-}" ]; then BIN="$INTAKE_BIN_DIR"; else build; (cd "$REPO" && cargo build --release --quiet -p intake-send); fi
TARGET="$REPO/docs/configuration.md"

render() {
    cat <<'HEADER'
# Configuration reference

Every setting of the three programs, generated from their command-line definitions by
`deploy/config-reference.sh` (do not edit by hand). A setting is a flag or its environment
variable; the flag wins when both are given. Settings without a variable are command
arguments. `intake-writer`'s own flags (`--log`, `--log-json`) go before its subcommand.

## Servers

HEADER
    "$BIN/intake-gateway" --config-reference
    "$BIN/intake-writer" --config-reference
    printf '## Sender\n\n'
    "$BIN/intake-send" --config-reference
}

if [ "${1:-}" = --check ]; then
    fresh="$(mktemp)"
    render >"$fresh"
    if ! diff -u "$TARGET" "$fresh" >&2; then
        rm -f "$fresh"
        echo "docs/configuration.md is out of date with the programs' flags: run deploy/config-reference.sh" >&2
        exit 1
    fi
    rm -f "$fresh"
    echo "ok: docs/configuration.md matches the programs' flags"
else
    mkdir -p "$(dirname "$TARGET")"
    render >"$TARGET"
    say "wrote $TARGET"
fi
