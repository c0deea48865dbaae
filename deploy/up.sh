#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, starts PostgreSQL, Redis and Apache Kafka on
# loopback, migrates, creates the topics, starts one gateway and one writer, creates a demo
# workspace and key, and prints a curl command. Running it again is harmless, and starts again
# whatever is down (pid files in .intake/run/); it stops at `migrate --contract` while a writer of
# an older build still runs (deploy/RUNBOOK.md, "Upgrades, one instance at a time").
#
# deploy/up.sh --ha: the same, with PostgreSQL as the HA layout (deploy/ha.sh: three nodes under
# Patroni and etcd, synchronous replication, the primary behind HAProxy on the same port,
# pgBackRest) instead of one node. Data in .intake/ha/; deploy/patronictl.sh operates it.
# deploy/up.sh --ha --async: the HA layout with asynchronous replication: no commit waits for a
# standby, a lagging standby may be promoted, and the writers put back what it lacks from the
# requests topic (docs/architecture.md, "The log is the record"). Run without --async again to
# return to synchronous replication.
source "$(dirname "$0")/lib.sh"

ha=0
async=0
for arg in "$@"; do
    case "$arg" in
        --ha) ha=1 ;;
        --async) async=1 ;;
        *) echo "usage: deploy/up.sh [--ha [--async]]" >&2; exit 2 ;;
    esac
done
if [ "$async" = 1 ] && [ "$ha" = 0 ]; then
    echo "usage: --async is a mode of the HA layout: deploy/up.sh --ha --async" >&2
    exit 2
fi
[ "$async" = 1 ] && HA_REPLICATION=async

# One PostgreSQL layout at a time: both serve 127.0.0.1:$PG_PORT.
if [ "$ha" = 1 ] && ha_single_running; then
    say "the single PostgreSQL runs ($INTAKE_HOME/pg): stop the stack with deploy/down.sh, then deploy/up.sh --ha"
    exit 1
fi
if [ "$ha" = 0 ] && ha_running "$INTAKE_HOME"; then
    say "the HA layout runs ($INTAKE_HOME/ha): deploy/up.sh --ha, or deploy/down.sh first for the single node"
    exit 1
fi

if [ "$ha" = 1 ] && ! ha_alive ha-haproxy && port_open "$PG_PORT"; then
    say "something else serves 127.0.0.1:$PG_PORT (another checkout's PostgreSQL?): stop it first"
    exit 1
fi

# The build is most of a first run: it starts first, and goes on while packages are installed
# and the services fetched and started.
install_build_packages
build &
building=$!
trap 'kill "$building" ${warming:-} 2>/dev/null || true' EXIT
install_packages

# Each layout's database has a log of its own: a database is a function of its requests topic
# (docs/architecture.md, "The log is the record"), and one layout's database never had what the
# other's writers answered, which a rewind would otherwise apply to it. A broker left running
# on the other layout's data (by deploy/test.sh after deploy/down.sh, say) is started again on
# this one's, and the services with it.
[ "$ha" = 0 ] || KAFKA_DIR="$INTAKE_HOME/ha/kafka"
if [ -f "$RUN/kafka.pid" ] && port_open "$KAFKA_PORT" && ! kafka_runs_on "$KAFKA_DIR"; then
    say "Kafka runs on the other layout's log: starting it again on this one's ($KAFKA_DIR)"
    stop_process gateway
    stop_process writer
    stop_process kafka
fi
kafka_was_running=0
port_open "$KAFKA_PORT" && kafka_was_running=1
if [ "$ha" = 1 ]; then
    install_kafka
    reserve_ports
    start_ha
    start_redis
    start_kafka
else
    start_infrastructure
fi
wait "$building" || { say "the build failed (above)"; exit 1; }
# A broker started now is warmed up (lib.sh, warm_kafka) while the services start: beside the
# build, it took CPU from it, and the build is most of a first run.
if [ "$kafka_was_running" = 0 ]; then
    warm_kafka &
    warming=$!
fi

create_database intake
export DATABASE_URL="$(database_url intake)"
# What a write's answer waits for (docs/architecture.md, "Acknowledged means replicated"): a
# synchronous standby's flush on the HA layout, the disk of the primary with asynchronous
# replication (the requests topic keeps the rest) and on the single node.
if [ "$ha" = 1 ] && [ "$async" = 0 ]; then
    export INTAKE_WRITER_ACK_WHEN=replicated
else
    export INTAKE_WRITER_ACK_WHEN=flushed
fi
"$BIN/intake-writer" migrate --contract >/dev/null
"$BIN/intake-writer" topics >/dev/null  # partition counts: INTAKE_REQUEST_PARTITIONS, INTAKE_REPLY_PARTITIONS

writer_url="$DATABASE_URL"
[ "$ha" = 0 ] || writer_url="$(ha_nodes_url "$HA_BASE_PORT" intake)"
DATABASE_URL="$writer_url" start_process writer "$BIN/intake-writer" run --ops-listen 127.0.0.1:8091
start_process gateway "$BIN/intake-gateway" --listen 127.0.0.1:8080 --ops-listen 127.0.0.1:8081 --reply-partition 0
wait_for "gateway" 60 curl -fsS http://127.0.0.1:8081/readyz
# The writer is ready once the group gave it its partitions: before that, the printed curl would
# wait for the join (seconds, after a restart of Kafka) before its answer.
wait_for "writer" 60 curl -fsS http://127.0.0.1:8091/readyz

[ -z "${warming:-}" ] || wait "$warming"

# A key printed by an earlier run on the other layout (the single node after --ha, or the
# reverse) is not in this database: made again.
if [ -f "$INTAKE_HOME/demo-key.json" ]; then
    demo_key_id="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$INTAKE_HOME/demo-key.json" 2>/dev/null || true)"
    known="$(psql "$DATABASE_URL" -tAc "SELECT count(*) FROM api_keys WHERE id = '${demo_key_id//\'/}' AND revoked_at IS NULL" 2>/dev/null || true)"
    [ "$known" = 1 ] || rm -f "$INTAKE_HOME/demo-key.json"
fi
if [ ! -f "$INTAKE_HOME/demo-key.json" ]; then
    workspace="$("$BIN/intake-writer" workspace create --name "Demo" --site demo.example | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
    "$BIN/intake-writer" key create --workspace "$workspace" --scopes workspace:read,conversions:write >"$INTAKE_HOME/demo-key.json"
fi
key="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["secret"])' "$INTAKE_HOME/demo-key.json")"

cat <<TXT

intake is running: API http://127.0.0.1:8080/v1
Ops: gateway http://127.0.0.1:8081/{healthz,readyz,metrics}, writer http://127.0.0.1:8091/{healthz,readyz,metrics}
Logs: $LOGS   Stop: deploy/down.sh
$([ "$ha" = 1 ] && echo "PostgreSQL: HA layout, primary on 127.0.0.1:$PG_PORT (deploy/patronictl.sh list; deploy/RUNBOOK.md, \"The HA layout\")")
Demo key: $key

curl -sS -X POST http://127.0.0.1:8080/v1/conversions \\
  -H 'Authorization: Bearer $key' -H 'Content-Type: application/json' \\
  -d '{"event":"lead","external_id":"demo-$(date +%s)","occurred_at":"$(date -u +%Y-%m-%dT%H:%M:%SZ)","email":"ann@example.com","value":"12.50","currency":"EUR"}'
TXT
