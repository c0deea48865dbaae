#!/usr/bin/env bash
# The benchmark, one command. Starts what is missing (PostgreSQL, Redis, Kafka: the
# ones already running are reused, never stopped), recreates the benchmark database, builds the
# release binaries, and runs every scenario in one run with the load generator
# (tests/src/bin/loadgen): gateways and writers of its own on topics of its own, the
# direct_apply and pg_upsert baselines, a CPU profile, batch_ingest with 1, 2 and 4 writers and
# gateways each under a CPU quota, and the runs at 1 M and 10 M stored conversions. Writes
# bench/report.json and bench/report.md (and bench/profile/).
#
#   deploy/bench.sh                 the full run (about 20 minutes, 10 M conversions loaded in 4)
#   deploy/bench.sh --quick         5 s a scenario, no scale runs: to see that it works
#   deploy/bench.sh --gateways 2 --writers 2    the main run on 2 gateways and 2 writers
#   deploy/bench.sh --no-scale --no-profile --micro
#   deploy/bench.sh --sizes 1000000,10000000 --keep-sized
#                                   the runs at size (default 1 M and 10 M stored conversions;
#                                   --sizes 0 for none): a database of their own, preloaded by
#                                   COPY after a free-disk check (10 M take about 15 GB), dropped
#                                   afterwards unless --keep-sized
#
# Every option is also an environment variable of the load generator (INTAKE_BENCH_SECONDS,
# INTAKE_BENCH_GATEWAYS, ... see tests/src/bin/loadgen/main.rs); INTAKE_BENCH_DATABASE names
# the database (default intake_bench; it is dropped and created again).
source "$(dirname "$0")/lib.sh"

micro=0
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) export INTAKE_BENCH_SECONDS="${INTAKE_BENCH_SECONDS:-5}" \
                        INTAKE_BENCH_WARMUP_SECONDS="${INTAKE_BENCH_WARMUP_SECONDS:-2}" \
                        INTAKE_BENCH_BROKER_WARMUP_SECONDS="${INTAKE_BENCH_BROKER_WARMUP_SECONDS:-0}" \
                        INTAKE_BENCH_PROFILE_SECONDS="${INTAKE_BENCH_PROFILE_SECONDS:-5}" \
                        INTAKE_BENCH_SCALE="${INTAKE_BENCH_SCALE:-0}" \
                        INTAKE_BENCH_SIZES="${INTAKE_BENCH_SIZES:-50000}" ;;
        --sizes) export INTAKE_BENCH_SIZES="$2"; shift ;;
        --keep-sized) export INTAKE_BENCH_KEEP_SIZED=1 ;;
        --seconds) export INTAKE_BENCH_SECONDS="$2"; shift ;;
        --gateways) export INTAKE_BENCH_GATEWAYS="$2"; shift ;;
        --writers) export INTAKE_BENCH_WRITERS="$2"; shift ;;
        --no-scale) export INTAKE_BENCH_SCALE=0 ;;
        --no-profile) export INTAKE_BENCH_PROFILE_SECONDS=0 ;;
        --micro) micro=1 ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) say "unknown option $1 (see --help)"; exit 2 ;;
    esac
    shift
done

start_infrastructure
command -v pgbench >/dev/null || { say "installing pgbench"; as_root apt-get install -y -qq postgresql-contrib >/dev/null; }
# The reject paths are measured with wrk, a client lean enough not to be their bottleneck.
command -v wrk >/dev/null || { say "installing wrk"; as_root apt-get install -y -qq wrk >/dev/null || say "wrk did not install: the reject paths use the load generator's client"; }
if [ "${INTAKE_BENCH_PROFILE_SECONDS:-10}" != 0 ]; then
    command -v perf >/dev/null || { say "installing linux-perf (for the profile)"; as_root apt-get install -y -qq linux-perf >/dev/null || true; }
    export PATH="$INTAKE_CACHE/tools/bin:$PATH"
    if ! command -v inferno-flamegraph >/dev/null; then
        say "installing inferno (flamegraphs; once, into $INTAKE_CACHE/tools)"
        cargo install --quiet --locked inferno --root "$INTAKE_CACHE/tools" || say "inferno did not install: no flamegraph"
    fi
fi

database="${INTAKE_BENCH_DATABASE:-intake_bench}"
# A fresh database each run, so that two runs start from the same (empty) tables.
psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS \"$database\" WITH (FORCE)" >/dev/null
create_database "$database"
export DATABASE_URL="$(database_url "$database")"

say "building the release binaries ($CARGO_TARGET_DIR/release)"
(cd "$REPO" && cargo build --release --workspace --bins --quiet)
export INTAKE_BIN_DIR="$CARGO_TARGET_DIR/release"
"$INTAKE_BIN_DIR/intake-writer" migrate >/dev/null
export INTAKE_KAFKA_VERSION="$KAFKA_VERSION" INTAKE_BENCH_OUT="$REPO/bench"

cd "$REPO"
"$INTAKE_BIN_DIR/loadgen"

if [ "$micro" = 1 ]; then
    say "validate + normalize + hash, one item (criterion): bench/micro.txt"
    cargo bench -p intake-model --bench validate -- --noplot 2>/dev/null | grep -E 'time:|thrpt:|^validate' >bench/micro.txt
fi
sed -n '/^## Targets/,/^## Scenarios/p' bench/report.md | sed '$d'
say "full report: bench/report.md, bench/report.json"
