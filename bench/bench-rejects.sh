#!/usr/bin/env bash
# The reject paths of deploy/bench.sh, gateway against gateway: reject_401 (an unknown key) and
# reject_422 (a valid key, an invalid body: the request is counted in Redis before the body is
# read) by wrk, one thread and 64 connections on one key, as deploy/bench.sh measures them. With
# a baseline, the two gateways take turns, a fresh process each time, so that the comparison is
# of one run on one machine state: on a shared machine, runs minutes apart differ by a third.
#
#   bench/bench-rejects.sh                      the release gateway of this checkout
#   INTAKE_GATEWAY_BASELINE=path bench/bench-rejects.sh
#                                               and that gateway binary, in turns
#   INTAKE_GATEWAY=path                         another gateway binary than this checkout's
#   INTAKE_BENCH_ROUNDS (3), INTAKE_BENCH_SECONDS (10), INTAKE_BENCH_CONNECTIONS (64)
#
# Prints every run (requests/s, the gateway's CPU a request, requests a Redis round trip) and
# the median requests/s of each. The gateways log at info, as deployed (a line a request).
# Needs the quick start's PostgreSQL, Redis and Kafka (deploy/up.sh) and wrk (installed if
# missing). Uses the database intake_bench_rejects (dropped and created again).
source "$(dirname "$0")/lib.sh"

rounds="${INTAKE_BENCH_ROUNDS:-3}"
seconds="${INTAKE_BENCH_SECONDS:-10}"
connections="${INTAKE_BENCH_CONNECTIONS:-64}"
command -v wrk >/dev/null || { say "installing wrk"; as_root apt-get install -y -qq wrk >/dev/null; }
start_infrastructure
(cd "$REPO" && cargo build --release -q -p intake-gateway -p intake-writer)
candidate="${INTAKE_GATEWAY:-$CARGO_TARGET_DIR/release/intake-gateway}"
bench_key intake_bench_rejects "$CARGO_TARGET_DIR/release/intake-writer"

port=28490
log=/tmp/intake-bench-rejects-gateway.log
scripts="$(mktemp -d)"
gateway=""
trap '[ -n "$gateway" ] && kill "$gateway" 2>/dev/null; rm -rf "$scripts"' EXIT
body='{"event":"not a valid event!","external_id":"bench-invalid","occurred_at":1700000000000}'
for path in reject_401 reject_422; do
    authorization="Bearer $BENCH_KEY"
    [ "$path" = reject_401 ] && authorization="Bearer svc_live_bench0unknown0key0000000000000000"
    wrk_post_script "$scripts/$path.lua" "$authorization" "$body"
done

redis_calls() { redis-cli -p "$REDIS_PORT" info commandstats | awk -F'[:=,]' '/^cmdstat_evalsha:/ {n = $3} END {print n + 0}'; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$gateway/stat"; }
tick_us=$((1000000 / $(getconf CLK_TCK)))

# measure NAME BINARY PATH: one run on a fresh gateway; prints "NAME PATH requests/s".
measure() {
    local name="$1" binary="$2" path="$3" before calls out requests rate
    # A Redis answer later than the 50 ms default would let requests through (fail open): on a
    # busy machine that would measure something else.
    "$binary" --listen "127.0.0.1:$port" --ops-listen "127.0.0.1:$((port + 1))" \
        --requests-per-minute 1000000000 --redis-timeout-ms 1000 >"$log" 2>&1 &
    gateway=$!
    wait_for "the gateway" 20 curl -sf "http://127.0.0.1:$((port + 1))/readyz"
    wrk -t1 -c"$connections" -d2s -s "$scripts/$path.lua" "http://127.0.0.1:$port/v1/conversions" >/dev/null
    before="$(cpu_ticks)" calls="$(redis_calls)"
    out="$(wrk -t1 -c"$connections" -d"${seconds}s" -s "$scripts/$path.lua" "http://127.0.0.1:$port/v1/conversions")"
    local ticks=$(($(cpu_ticks) - before)) trips=$(($(redis_calls) - calls))
    kill "$gateway" && wait "$gateway" 2>/dev/null || true
    gateway=""
    requests="$(echo "$out" | awk '/requests in/ {print $1}')"
    rate="$(echo "$out" | awk '/Requests\/sec/ {print $2}')"
    local per_trip="-"
    [ "$trips" -gt 0 ] && per_trip="$(awk -v r="$requests" -v t="$trips" 'BEGIN {printf "%.1f", r / t}')"
    say "$name $path: $rate requests/s, gateway CPU $((ticks * tick_us / requests)) µs a request, $per_trip requests a Redis round trip"
    echo "$name $path $rate"
}

results="$scripts/results"
for round in $(seq "$rounds"); do
    for path in reject_401 reject_422; do
        measure candidate "$candidate" "$path" >>"$results"
        if [ -n "${INTAKE_GATEWAY_BASELINE:-}" ]; then measure baseline "$INTAKE_GATEWAY_BASELINE" "$path" >>"$results"; fi
    done
    say "round $round of $rounds done"
done
echo "median requests/s of $rounds runs ($connections connections, ${seconds} s each):"
for name in candidate baseline; do
    for path in reject_401 reject_422; do
        rates="$(awk -v n="$name" -v p="$path" '$1 == n && $2 == p {print $3}' "$results" | sort -n)"
        [ -n "$rates" ] || continue
        echo "  $name $path: $(echo "$rates" | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')"
    done
done
