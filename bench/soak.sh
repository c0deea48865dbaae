#!/usr/bin/env bash
# The soak: mixed traffic (singles, batches, re-sends, chains, erasures) at half the
# measured capacity for a set time, on a gateway and a writer of its own (release build) with the
# topics' retention shortened to a few minutes, so that pruning (applied_messages ranges, erasure
# tombstones, Kafka segments) happens inside the run. Samples every minute: RSS and open
# descriptors of the gateway and the writer, p50 and p99, applied_messages rows, table and index
# sizes with dead tuples, the Kafka log of the run's topics. Fails if anything acknowledged is
# missing at the end, or if after minute 5 RSS or descriptors (the gateway's besides its clients'
# connections, whose number follows latency) grow more than 10 %, p99 more than 2×, or a pruned
# table or the Kafka log does not level off. An item counts as acknowledged once its request was
# answered rightly; 503s (shedding) are counted apart, not as wrong answers. Writes
# bench/soak.json and bench/soak.md (the table).
#
#   deploy/soak.sh                    30 minutes
#   deploy/soak.sh --minutes 10 --retention-ms 120000 --rate 2000
#
# Options are also environment variables of `loadgen soak` (INTAKE_SOAK_MINUTES,
# INTAKE_SOAK_SAMPLE_SECONDS, INTAKE_SOAK_RETENTION_MS, INTAKE_SOAK_RATE in items/s,
# INTAKE_SOAK_WARMUP_SECONDS before the capacity is measured; see
# bench/src/bin/loadgen/soak.rs). The database is intake_soak, dropped and created again.
source "$(dirname "$0")/lib.sh"

while [ $# -gt 0 ]; do
    case "$1" in
        --minutes) export INTAKE_SOAK_MINUTES="$2"; shift ;;
        --sample-seconds) export INTAKE_SOAK_SAMPLE_SECONDS="$2"; shift ;;
        --retention-ms) export INTAKE_SOAK_RETENTION_MS="$2"; shift ;;
        --rate) export INTAKE_SOAK_RATE="$2"; shift ;;
        -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) say "unknown option $1 (see --help)"; exit 2 ;;
    esac
    shift
done

start_infrastructure
database="${INTAKE_SOAK_DATABASE:-intake_soak}"
psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS \"$database\" WITH (FORCE)" >/dev/null
create_database "$database"
export DATABASE_URL="$(database_url "$database")"

say "building the release binaries ($CARGO_TARGET_DIR/release)"
(cd "$REPO" && cargo build --release --workspace --bins --quiet "${LOADGEN_OPTIMISED[@]}")
export INTAKE_BIN_DIR="$CARGO_TARGET_DIR/release" INTAKE_BENCH_OUT="$REPO/bench"
"$INTAKE_BIN_DIR/intake-writer" migrate --contract >/dev/null

cd "$REPO"
"$INTAKE_BIN_DIR/loadgen" soak
