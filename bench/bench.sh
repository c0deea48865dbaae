#!/usr/bin/env bash
# The benchmark, one command. Starts what is missing (PostgreSQL, Redis, Kafka: the
# ones already running are reused, never stopped), recreates the benchmark database, builds the
# release binaries, and runs every scenario in one run with the load generator
# (bench/src/bin/loadgen): gateways and writers of its own on topics of its own, the
# direct_apply and pg_upsert baselines, a CPU profile, batch_ingest with 1, 2 and 4 writers and
# gateways each under a CPU quota, and the runs at 1 M and 10 M stored conversions. Writes
# bench/report.json and bench/report.md (and bench/profile/).
#
#   deploy/bench.sh                 the full run (about 20 minutes, 10 M conversions loaded in 4)
#   deploy/bench.sh --quick         5 s a scenario, no scale runs: to see that it works
#   deploy/bench.sh --gateways 2 --writers 2    the main run on 2 gateways and 2 writers
#   deploy/bench.sh --no-scale --no-profile --micro
#   deploy/bench.sh --sizes 1000000,10000000 --memory-mib 2048 --capped-sizes 10000000
#                                   the runs at size (default 1 M and 10 M stored conversions;
#                                   --sizes 0 for none): a database preloaded by COPY after a
#                                   free-disk check (10 M take about 15 GB), on a PostgreSQL
#                                   cluster of their own in a memory cgroup (shared_buffers a
#                                   quarter of --memory-mib, default 2048), removed afterwards; at
#                                   the --capped-sizes (default the largest) the scenarios run
#                                   again with the cluster capped at --memory-mib, page cache
#                                   included. --memory-mib 0: no cluster, no capped runs, the
#                                   database on the shared server, kept with --keep-sized
#   deploy/bench.sh --baseline REV [--rounds N]
#                                   A/B against commit REV on this host: REV is built in a
#                                   worktree of its own (~/.cache/intake/baseline, its own target
#                                   directory), then the main scenarios of REV (its own load
#                                   generator, migrations and binaries) and of the working tree run
#                                   back to back, N rounds in alternating order (about 13 minutes
#                                   a round); prints each scenario's ratio tree / REV and flags
#                                   one slower by more than 10 % (exit status 3), also into
#                                   bench/baseline-<REV>-<time>/comparison.md. No scale runs,
#                                   runs at size or profile unless their variables ask for them.
#   deploy/bench.sh --ha [--seconds N] [--sizes 1000000,10000000]
#                                   the cost of synchronous replication (about 15 minutes):
#                                   batch_ingest, single_32 and single_200rps on the single node,
#                                   then on the HA layout of deploy/ha.sh (etcd x3, Patroni and
#                                   PostgreSQL x3 in synchronous_mode_strict, HAProxy), started
#                                   for them in $INTAKE_HOME/bench-ha on ports 31400-31455 with
#                                   the single node's shared_buffers, stopped and removed after;
#                                   then the runs at size (default 1 M; 10 M need about 52 GB
#                                   free, three copies) on both, uncapped, the single node's on
#                                   the shared server. Its report, bench/ha/report.md (and .json,
#                                   and the plot), has in "Synchronous replication (HA layout)"
#                                   both and HA / single for throughput, p50 and p99, and the
#                                   same scenarios on empty tables on the layout started again
#                                   with asynchronous replication (deploy/up.sh --ha --async).
#                                   Nothing else runs.
#
# Every option is also an environment variable of the load generator (INTAKE_BENCH_SECONDS,
# INTAKE_BENCH_GATEWAYS, INTAKE_BENCH_SCENARIOS=batch_ingest,single_32 for only those, ... see
# bench/src/bin/loadgen/main.rs); INTAKE_BENCH_DATABASE names the database (default
# intake_bench; it is dropped and created again).
source "$(dirname "$0")/lib.sh"

# --baseline: the binaries of commit $1 in $INTAKE_CACHE/baseline/bin-<commit>, built once in a
# worktree of their own with a target directory of their own, so that neither the shared
# target's binaries nor anyone's working tree is touched. An old commit builds with its own
# Cargo.toml (and so its own release profile), its load generator optimised as the working
# tree's is, wherever its layout keeps it. Prints the directory.
ab_build_rev() {
    local sha="$1" base="$INTAKE_CACHE/baseline" short="${1:0:12}"
    local src="$base/src-$short" bin="$base/bin-$short"
    if [ ! -f "$bin/.complete" ]; then
        mkdir -p "$base"
        if [ ! -d "$src" ]; then
            git -C "$REPO" worktree prune
            git -C "$REPO" worktree add --detach --quiet "$src" "$sha" >&2
        fi
        # Commits of a time when mold linked the build name it in their cargo configuration.
        if grep -qs 'fuse-ld=mold' "$src/.cargo/config.toml" && ! command -v mold >/dev/null; then
            apt_install mold
        fi
        say "building $short in $src (target $base/target; once per commit)"
        # Errors stop here by hand: errexit does not reach into the command substitution that
        # calls this, and the shared target's release directory holds another commit's binaries.
        loadgen_optimised "$src"
        (cd "$src" && CARGO_TARGET_DIR="$base/target" cargo build --release --workspace --bins --quiet \
            "${LOADGEN_OPTIMISED[@]}") >&2 || { say "building $short failed"; return 1; }
        loadgen_optimised "$REPO"
        ab_copy_bins "$base/target/release" "$bin"
        ab_check_bins "$src" "$bin" || { rm -f "$bin/.complete"; return 1; }
    fi
    echo "$bin"
}

# The programs a side's run calls, by its tree's layout: since bench/ has a crate of its own,
# its loadgen and the direct_apply baseline's bench-apply; before, the test crate's loadgen,
# which applies through its own writer's hidden `intake-writer bench-apply`. Either loadgen
# finds the other program in INTAKE_BIN_DIR itself.
ab_check_bins() {
    local tree="$1" bin="$2" program programs=(loadgen intake-writer)
    if [ -f "$tree/bench/Cargo.toml" ]; then
        programs+=(bench-apply)
    elif [ ! -d "$tree/tests/src/bin/loadgen" ]; then
        say "$tree has no load generator (neither bench/ nor tests/src/bin/loadgen)"; return 1
    fi
    for program in "${programs[@]}"; do
        [ -x "$bin/$program" ] || { say "$bin has no $program"; return 1; }
    done
    if [ ! -f "$tree/bench/Cargo.toml" ] && ! "$bin/intake-writer" bench-apply --help >/dev/null 2>&1; then
        say "$bin/intake-writer has no bench-apply"; return 1
    fi
}

# Copies the executables of a release directory: a snapshot, since the shared target's can be
# rebuilt by someone else during the hour a few rounds take.
ab_copy_bins() {
    local from="$1" to="$2" file
    rm -rf "$to" && mkdir -p "$to"
    for file in "$from"/*; do
        if [ -f "$file" ] && [ -x "$file" ]; then cp "$file" "$to/"; fi
    done
    touch "$to/.complete"
}

# One side of a round: a fresh database migrated by the side's own writer, then the side's own
# load generator (its scenarios as that commit defined them) from the side's tree.
ab_side() {
    local tree="$1" bin="$2" out="$3" database="intake_bench_ab"
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS \"$database\" WITH (FORCE)" >/dev/null
    create_database "$database"
    mkdir -p "$out"
    (
        export DATABASE_URL="$(database_url "$database")" INTAKE_BIN_DIR="$bin" INTAKE_BENCH_OUT="$out"
        export INTAKE_KAFKA_VERSION="$KAFKA_VERSION"
        export INTAKE_BENCH_SIZES="${INTAKE_BENCH_SIZES:-0}" INTAKE_BENCH_SCALE="${INTAKE_BENCH_SCALE:-0}"
        export INTAKE_BENCH_PROFILE_SECONDS="${INTAKE_BENCH_PROFILE_SECONDS:-0}"
        # Every migration, by the flag of a commit that has one.
        local contract=()
        "$bin/intake-writer" migrate --help | grep -q -- --contract && contract=(--contract)
        "$bin/intake-writer" migrate "${contract[@]}" >/dev/null
        cd "$tree" && "$bin/loadgen"
    ) >"$out/loadgen.log" 2>&1 || { tail -n 20 "$out/loadgen.log" >&2; return 1; }
}

# deploy/bench.sh --baseline REV --rounds N
ab_run() {
    local rev="$1" rounds="$2" sha short rev_bin tree_bin out round side
    sha="$(git -C "$REPO" rev-parse --verify --quiet "$rev^{commit}")" || { say "no commit $rev"; return 2; }
    short="${sha:0:12}"
    start_infrastructure
    command -v pgbench >/dev/null || { say "installing pgbench"; as_root apt-get install -y -qq postgresql-contrib >/dev/null; }
    command -v wrk >/dev/null || { say "installing wrk"; as_root apt-get install -y -qq wrk >/dev/null || true; }
    rev_bin="$(ab_build_rev "$sha")" || return 1
    say "building the working tree ($CARGO_TARGET_DIR/release)"
    (cd "$REPO" && cargo build --release --workspace --bins --quiet "${LOADGEN_OPTIMISED[@]}")
    tree_bin="$INTAKE_CACHE/baseline/bin-tree"
    ab_copy_bins "$CARGO_TARGET_DIR/release" "$tree_bin"
    ab_check_bins "$REPO" "$tree_bin" || return 1
    out="$REPO/bench/baseline-$short-$(date -u +%Y%m%dT%H%M%S)"
    mkdir -p "$out"
    for round in $(seq "$rounds"); do
        # Alternating order, so that a drift of the machine's load over a round favours neither.
        local order="rev tree"
        [ $((round % 2)) = 0 ] && order="tree rev"
        for side in $order; do
            say "round $round/$rounds: $([ "$side" = rev ] && echo "$short" || echo "working tree") (about 6 minutes)"
            if [ "$side" = rev ]; then
                ab_side "$INTAKE_CACHE/baseline/src-$short" "$rev_bin" "$out/rev-$round"
            else
                ab_side "$REPO" "$tree_bin" "$out/tree-$round"
            fi
        done
    done
    ab_compare "$out" "$short" | tee "$out/comparison.md"
}

# The table of tree / REV per scenario (medians over the rounds); exit status 3 when a scenario
# is slower by more than 10 %: less throughput, or more latency.
ab_compare() {
    python3 - "$1" "$2" <<'EOF'
import json, pathlib, statistics, sys

out, rev = pathlib.Path(sys.argv[1]), sys.argv[2]
def reports(side):
    return [json.loads(p.read_text()) for p in sorted(out.glob(f"{side}-*/report.json"))]
a, b = reports("rev"), reports("tree")
if not a or not b:
    sys.exit("no reports to compare")
# (scenario, metric, higher is better)
rows = [("batch_ingest", "items_per_s", True), ("batch_resend", "items_per_s", True),
        ("single_32", "requests_per_s", True), ("single_32", "p50_ms", False),
        ("single_200rps", "p50_ms", False), ("single_200rps", "p99_ms", False),
        ("direct_apply", "items_per_s", True), ("pg_upsert", "items_per_s", True),
        ("reject_401", "requests_per_s", True), ("reject_422", "requests_per_s", True),
        ("workspace_read", "requests_per_s", True)]
def median(runs, scenario, metric):
    values = [r[scenario][metric] for r in runs if scenario in r and metric in r[scenario]]
    return statistics.median(values) if values else None
def pg_ms(runs, scenario, metric):
    # PostgreSQL's CPU per request or item of the scenario: its cores over the rate.
    values = []
    for r in runs:
        rate = r.get(scenario, {}).get(metric)
        cores = r.get("scenario_details", {}).get(scenario, {}).get("cores", {}).get("postgresql")
        if rate and cores is not None:
            values.append(cores / rate * 1000)
    return statistics.median(values) if values else None
print(f"# A/B: working tree against {rev}, {len(a)} round(s), medians\n")
print(f"| scenario | metric | {rev} | working tree | tree / {rev} | |")
print("|---|---|---|---|---|---|")
flagged = []
for scenario, metric, higher in rows:
    x, y = median(a, scenario, metric), median(b, scenario, metric)
    if x is None or y is None or x == 0:
        continue
    ratio = y / x
    slower = ratio < 1 / 1.1 if higher else ratio > 1.1
    if slower:
        flagged.append(f"{scenario} {metric}")
    print(f"| {scenario} | {metric} | {x:g} | {y:g} | {ratio:.2f} | {'**slower**' if slower else ''} |")
for scenario, metric in [("single_32", "requests_per_s"), ("single_200rps", "requests_per_s"),
                         ("batch_ingest", "items_per_s"), ("direct_apply", "items_per_s")]:
    x, y = pg_ms(a, scenario, metric), pg_ms(b, scenario, metric)
    if x and y:
        unit = "request" if metric == "requests_per_s" else "item"
        slower = y / x > 1.1
        if slower:
            flagged.append(f"{scenario} PostgreSQL CPU")
        print(f"| {scenario} | PostgreSQL CPU ms per {unit} | {x:.3f} | {y:.3f} | {y / x:.2f} | {'**slower**' if slower else ''} |")
machine = lambda runs: statistics.median(r["machine"].get("busy_cores_before_run", 0) for r in runs)
print(f"\nBusy cores before the runs (other load): {rev} {machine(a):g}, working tree {machine(b):g}.")
if flagged:
    print(f"\nSlower by more than 10 %: {', '.join(flagged)}.")
    sys.exit(3)
EOF
}

# The layout of --ha, should the load generator have died without stopping it (it stops the
# layout and removes its directory itself).
stop_bench_ha() {
    local dir="$INTAKE_BENCH_HA_DIR" n file
    [ -d "$dir/run" ] || return 0
    set +e
    say "stopping the HA layout left in $dir"
    stop_ha_cluster "$dir"
    for n in 1 2 3; do ha_node_signal "$dir" "$n" KILL; done
    for file in "$dir"/run/ha-*.pid; do [ -f "$file" ] && kill -KILL "$(cat "$file")" 2>/dev/null; done
    rm -rf "$dir"
}

micro=0
baseline=""
rounds=1
ha=0
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
        --memory-mib) export INTAKE_BENCH_MEMORY_MIB="$2"; shift ;;
        --capped-sizes) export INTAKE_BENCH_CAPPED_SIZES="$2"; shift ;;
        --seconds) export INTAKE_BENCH_SECONDS="$2"; shift ;;
        --gateways) export INTAKE_BENCH_GATEWAYS="$2"; shift ;;
        --writers) export INTAKE_BENCH_WRITERS="$2"; shift ;;
        --no-scale) export INTAKE_BENCH_SCALE=0 ;;
        --no-profile) export INTAKE_BENCH_PROFILE_SECONDS=0 ;;
        --micro) micro=1 ;;
        --baseline) baseline="$2"; shift ;;
        --rounds) rounds="$2"; shift ;;
        --ha) ha=1 ;;
        -h|--help) sed -n '2,/^[^#]/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) say "unknown option $1 (see --help)"; exit 2 ;;
    esac
    shift
done

if [ -n "$baseline" ]; then
    [ "$ha" = 0 ] || { say "--ha and --baseline do not go together"; exit 2; }
    ab_run "$baseline" "$rounds"
    exit $?
fi

if [ "$ha" = 1 ]; then
    # The scenarios compared and nothing else; the load generator starts the layout after the
    # single node's runs, so that its idle processes do not run beside them.
    export INTAKE_BENCH_SCENARIOS="${INTAKE_BENCH_SCENARIOS:-batch_ingest,single_32,single_200rps}" \
        INTAKE_BENCH_SCALE="${INTAKE_BENCH_SCALE:-0}" INTAKE_BENCH_SIZES="${INTAKE_BENCH_SIZES:-1000000}" \
        INTAKE_BENCH_MEMORY_MIB="${INTAKE_BENCH_MEMORY_MIB:-0}" \
        INTAKE_BENCH_PROFILE_SECONDS="${INTAKE_BENCH_PROFILE_SECONDS:-0}" \
        INTAKE_BENCH_HA_DIR="${INTAKE_BENCH_HA_DIR:-$INTAKE_HOME/bench-ha}" \
        INTAKE_BENCH_HA_BASE_PORT="${INTAKE_BENCH_HA_BASE_PORT:-31400}"
    # A report of its own, beside the full run's rather than over it.
    export INTAKE_BENCH_OUT="${INTAKE_BENCH_OUT:-$REPO/bench/ha}"
    export INTAKE_BENCH_HA_PRIMARY_PORT="${INTAKE_BENCH_HA_PRIMARY_PORT:-$((INTAKE_BENCH_HA_BASE_PORT + 55))}"
    install_ha_packages
    trap stop_bench_ha EXIT
fi

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
(cd "$REPO" && cargo build --release --workspace --bins --quiet "${LOADGEN_OPTIMISED[@]}")
# A copy of what was just built: the shared target's binaries can be rebuilt from someone's
# working tree during the run, and a run at size would then measure another writer.
export INTAKE_BIN_DIR="$INTAKE_HOME/bench-bin"
ab_copy_bins "$CARGO_TARGET_DIR/release" "$INTAKE_BIN_DIR"
"$INTAKE_BIN_DIR/intake-writer" migrate --contract >/dev/null
export INTAKE_KAFKA_VERSION="$KAFKA_VERSION" INTAKE_BENCH_OUT="${INTAKE_BENCH_OUT:-$REPO/bench}"
mkdir -p "$INTAKE_BENCH_OUT"
export INTAKE_BENCH_CLUSTER_DIR="${INTAKE_BENCH_CLUSTER_DIR:-$INTAKE_HOME/bench-cluster}"

cd "$REPO"
"$INTAKE_BIN_DIR/loadgen"

if [ "$micro" = 1 ]; then
    say "validate + normalize + hash, one item (criterion): bench/micro.txt"
    cargo bench -p intake-model --bench validate -- --noplot 2>/dev/null | grep -E 'time:|thrpt:|^validate' >bench/micro.txt
fi
sed -n '/^## Targets/,/^## Scenarios/p' "$INTAKE_BENCH_OUT/report.md" | sed '$d'
say "full report: ${INTAKE_BENCH_OUT#"$REPO"/}/report.md, report.json"
