#!/usr/bin/env bash
# The benchmarks, one command: the validation micro-benchmark (criterion) and the end-to-end
# load benchmark (release build, real HTTP, real PostgreSQL, Redis and broker). Prints markdown
# to paste into BENCHMARKS.md together with the machine it ran on.
source "$(dirname "$0")/lib.sh"

start_infrastructure
create_database intake_bench
export DATABASE_URL="$(database_url intake_bench)"
say "building the release binaries"
(cd "$REPO" && cargo build --release --workspace --bins --quiet)
"$CARGO_TARGET_DIR/release/intake-writer" migrate >/dev/null
export INTAKE_BIN_DIR="$CARGO_TARGET_DIR/release"

echo "## $(date -u +%Y-%m-%d) on $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB"
echo
echo "Broker: Tansu $TANSU_VERSION (memory storage), INTAKE_KAFKA_OPTIONS=$INTAKE_KAFKA_OPTIONS"
echo
echo "### End to end (\`deploy/bench.sh\`, ${INTAKE_BENCH_SECONDS:-10} s a scenario)"
echo
"$INTAKE_BIN_DIR/loadgen"
echo
echo "### validate + normalize + hash, one item (\`cargo bench -p intake-common --bench validate\`)"
echo
(cd "$REPO" && cargo bench -p intake-common --bench validate -- --noplot 2>/dev/null | grep -E 'time:|thrpt:|^validate' | sed 's/^/    /')
