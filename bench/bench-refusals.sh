#!/usr/bin/env bash
# Refused requests a second on one keep-alive client set (wrk, 32 connections): GET /v1/workspace
# and single-send POST /v1/conversions, both past the request rate limit (429), against a release
# gateway of its own. Shows what a refused write costs compared with a refused read: a POST
# refused before its body is read keeps its connection when the body is small (BENCHMARKS.md).
#
#   bench/bench-refusals.sh                    build the release gateway and run
#   INTAKE_GATEWAY=path bench/bench-refusals.sh    run against that gateway binary
#   INTAKE_BENCH_TLS=1 bench/bench-refusals.sh     the same over HTTPS (a self-signed P-256
#                                                  certificate made with openssl)
#   INTAKE_BENCH_RUNS="get post get-close"         get-close: GET with Connection: close, a new
#                                                  connection (and handshake) per request
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

bench_key intake_bench_refusals "$writer"
key="$BENCH_KEY"

port=28480
base="http://127.0.0.1:$port"
tls=()
if [ "${INTAKE_BENCH_TLS:-0}" = 1 ]; then
    certs="$(mktemp -d)"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj /CN=localhost \
        -addext subjectAltName=DNS:localhost -days 1 -keyout "$certs/key.pem" -out "$certs/cert.pem" 2>/dev/null
    tls=(--tls-cert "$certs/cert.pem" --tls-key "$certs/key.pem")
    base="https://localhost:$port"
fi
# A Redis answer later than the gateway's 50 ms default would let the request through (the rate
# limiter fails open) into the write path: on a busy machine that measured something else.
"$INTAKE_GATEWAY" --listen "127.0.0.1:$port" --ops-listen "127.0.0.1:$((port + 1))" --requests-per-minute 1 \
    --redis-timeout-ms 1000 "${tls[@]}" --log warn >/tmp/intake-bench-refusals-gateway.log 2>&1 &
gateway=$!
trap 'kill $gateway 2>/dev/null; wait $gateway 2>/dev/null' EXIT
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$((port + 1))/readyz" >/dev/null && break; sleep 0.2; done

script="$(mktemp --suffix .lua)"
wrk_post_script "$script" "Bearer $key" "{\"event\":\"lead\",\"external_id\":\"bench-1\",\"occurred_at\":$(date +%s)000,\"email\":\"bench@example.com\"}"
curl -sk -o /dev/null -H "Authorization: Bearer $key" "$base/v1/workspace"
# The gateway's CPU time (user + system, in clock ticks) tells its cost per request even on a
# machine whose other load moves the requests a second.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$gateway/stat"; }
tick_us=$((1000000 / $(getconf CLK_TCK)))
for run in ${INTAKE_BENCH_RUNS:-get post}; do
    before="$(cpu_ticks)"
    if [ "$run" = get ]; then
        out="$(wrk -t2 -c32 -d"${seconds}s" -H "Authorization: Bearer $key" "$base/v1/workspace")"
    elif [ "$run" = get-close ]; then
        # What a refusal costs when it ends its connection: a new connection (handshake) each.
        out="$(wrk -t2 -c32 -d"${seconds}s" -H "Authorization: Bearer $key" -H "Connection: close" "$base/v1/workspace")"
    else
        out="$(wrk -t2 -c32 -d"${seconds}s" -s "$script" "$base/v1/conversions")"
    fi
    ticks=$(($(cpu_ticks) - before))
    requests="$(echo "$out" | awk '/requests in/ {print $1}')"
    refused="$(echo "$out" | awk '/Non-2xx/ {print $NF}')"
    rate="$(echo "$out" | awk '/Requests\/sec/ {print $2}')"
    errors="$(echo "$out" | grep 'Socket errors' || true)"
    echo "$run: $rate requests/s ($refused of $requests refused), gateway CPU $((ticks * tick_us / requests)) µs a request ${errors}"
done
if grep -q "letting requests through" /tmp/intake-bench-refusals-gateway.log; then
    echo "warning: Redis was too slow and some requests were let through: the numbers are not of refusals alone"
fi
rm -f "$script"
