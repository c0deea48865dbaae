#!/usr/bin/env bash
# Refused requests a second on one keep-alive client set (wrk, 32 connections): GET /v1/workspace
# and single-send POST /v1/conversions, both past the request rate limit (429), against a release
# gateway of its own. Shows what a refused write costs compared with a refused read: a POST
# refused before its body is read keeps its connection when the body is small (BENCHMARKS.md).
#
#   deploy/bench-refusals.sh                   build the release gateway and run
#   INTAKE_GATEWAY=path deploy/bench-refusals.sh   run against that gateway binary
#
# Needs the quick start's PostgreSQL, Redis and Kafka (deploy/up.sh) and wrk (installed if
# missing). Uses the database intake_bench_refusals (dropped and created again).
source "$(dirname "$0")/lib.sh"


seconds="${INTAKE_BENCH_SECONDS:-10}"
command -v wrk >/dev/null || { say "installing wrk"; as_root apt-get install -y -qq wrk >/dev/null; }
start_infrastructure
if [ -z "${INTAKE_GATEWAY:-}" ]; then
    (cd "$REPO" && cargo build --release -q -p intake-gateway -p intake-writer)
    INTAKE_GATEWAY="$CARGO_TARGET_DIR/release/intake-gateway"
fi
writer="$CARGO_TARGET_DIR/release/intake-writer"
[ -x "$writer" ] || writer="$CARGO_TARGET_DIR/debug/intake-writer"

database=intake_bench_refusals
psql -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -c "DROP DATABASE IF EXISTS $database" -c "CREATE DATABASE $database"
export DATABASE_URL="postgres://postgres@127.0.0.1:$PG_PORT/$database"
export INTAKE_KAFKA_BROKERS="127.0.0.1:$KAFKA_PORT" INTAKE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
prefix="refusals$(date +%s)"
export INTAKE_REQUESTS_TOPIC="$prefix.requests" INTAKE_REPLIES_TOPIC="$prefix.replies" INTAKE_DLQ_TOPIC="$prefix.dlq"
"$writer" migrate >/dev/null
"$writer" topics >/dev/null
workspace="$("$writer" workspace create --name Bench --site bench.example | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
key="$("$writer" key create --workspace "$workspace" --scopes workspace:read,conversions:write | python3 -c 'import json,sys; print(json.load(sys.stdin)["secret"])')"

port=28480
"$INTAKE_GATEWAY" --listen "127.0.0.1:$port" --ops-listen "127.0.0.1:$((port + 1))" --requests-per-minute 1 \
    --log warn >/tmp/intake-bench-refusals-gateway.log 2>&1 &
gateway=$!
trap 'kill $gateway 2>/dev/null; wait $gateway 2>/dev/null' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$((port + 1))/readyz" >/dev/null && break; sleep 0.2; done

script="$(mktemp --suffix .lua)"
cat >"$script" <<LUA
wrk.method = "POST"
wrk.headers["Authorization"] = "Bearer $key"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"event":"lead","external_id":"bench-1","occurred_at":$(date +%s)000,"email":"bench@example.com"}'
LUA
base="http://127.0.0.1:$port"
curl -s -o /dev/null -H "Authorization: Bearer $key" "$base/v1/workspace"
for run in get post; do
    if [ "$run" = get ]; then
        out="$(wrk -t2 -c32 -d"${seconds}s" -H "Authorization: Bearer $key" "$base/v1/workspace")"
    else
        out="$(wrk -t2 -c32 -d"${seconds}s" -s "$script" "$base/v1/conversions")"
    fi
    echo "== $run"
    echo "$out" | grep -E 'Requests/sec|Non-2xx|Socket errors|requests in'
done
rm -f "$script"
