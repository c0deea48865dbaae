#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, starts PostgreSQL, Redis and Apache Kafka on
# loopback, migrates, creates the topics, starts one gateway and one writer, creates a demo
# workspace and key, and prints a curl command. Running it again is harmless, and starts again
# whatever is down (pid files in .intake/run/).
source "$(dirname "$0")/lib.sh"

start_infrastructure
build

create_database intake
export DATABASE_URL="$(database_url intake)"
"$BIN/intake-writer" migrate >/dev/null
"$BIN/intake-writer" topics >/dev/null  # partition counts: INTAKE_REQUEST_PARTITIONS, INTAKE_REPLY_PARTITIONS

start_process writer "$BIN/intake-writer" run --ops-listen 127.0.0.1:8091
start_process gateway "$BIN/intake-gateway" --listen 127.0.0.1:8080 --ops-listen 127.0.0.1:8081 --reply-partition 0
wait_for "gateway" 60 curl -fsS http://127.0.0.1:8081/readyz

if [ ! -f "$INTAKE_HOME/demo-key.json" ]; then
    workspace="$("$BIN/intake-writer" workspace create --name "Demo" --site demo.example | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
    "$BIN/intake-writer" key create --workspace "$workspace" --scopes workspace:read,conversions:write >"$INTAKE_HOME/demo-key.json"
fi
key="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["secret"])' "$INTAKE_HOME/demo-key.json")"

cat <<TXT

intake is running: API http://127.0.0.1:8080/v1
Ops: gateway http://127.0.0.1:8081/{healthz,readyz,metrics}, writer http://127.0.0.1:8091/{healthz,readyz,metrics}
Logs: $LOGS   Stop: deploy/down.sh
Demo key: $key

curl -sS -X POST http://127.0.0.1:8080/v1/conversions \\
  -H 'Authorization: Bearer $key' -H 'Content-Type: application/json' \\
  -d '{"event":"lead","external_id":"demo-$(date +%s)","occurred_at":"$(date -u +%Y-%m-%dT%H:%M:%SZ)","email":"ann@example.com","value":"12.50","currency":"EUR"}'
TXT
