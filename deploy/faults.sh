#!/usr/bin/env bash
# The fault harness: a private PostgreSQL, Redis and three-node Kafka cluster (replication 3,
# min.insync.replicas 2) under a scratch folder, then tests/src/bin/faults.rs: 2 gateways,
# 2 writers, a supervisor, mixed traffic with a ledger of every acknowledged item, one fault per
# scenario, and a check of PostgreSQL against the ledger. One JSON line per scenario; exits 1 if
# anything acknowledged is missing or wrong, or writes do not come back.
#
#   deploy/faults.sh                       every scenario, 15 s outages
#   deploy/faults.sh --short               the shortened form the test suite runs
#   deploy/faults.sh --seed=7 --outage-s=20 --scenarios=writer_kill,postgres_stop
#   deploy/faults.sh --long-outage --workspaces=1000 [--outage-s=300 --clients=32]
#                                          PostgreSQL stopped for minutes under load from many
#                                          workspaces through 3 gateways (tests/src/bin/outage.rs)
#   deploy/faults.sh --ha [--scenarios=ha_primary_kill,...]
#                                          the database as the HA layout (deploy/ha.sh: etcd x3,
#                                          Patroni x3, HAProxy on the primary's port) and its
#                                          faults: ha_primary_kill, ha_primary_cut, ha_switchover,
#                                          ha_standby_kill, ha_etcd_kill, ha_etcd_quorum_loss,
#                                          ha_patroni_freeze (tests/src/bin/faults/ha.rs), and
#                                          restore_replay from pgBackRest's backups
#   deploy/faults.sh --ha --async [...]    the same with asynchronous replication (deploy/up.sh
#                                          --ha --async): a standby promoted behind the lost
#                                          primary gets what it lacks back from the requests topic
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
SCRATCH="$(mktemp -d /tmp/intake-faults.XXXXXX)"
chmod 755 "$SCRATCH"
# Everything of the harness's own lives in the scratch folder, on ports of its own: below the
# kernel's ephemeral range (32768-60999), so that while PostgreSQL, Redis or a broker is down
# for a scenario no outgoing connection's local port can take its port (tests/src/lib.rs).
export INTAKE_HOME="$SCRATCH" INTAKE_PG_PORT="${FAULTS_PG_PORT:-29432}" INTAKE_REDIS_PORT="${FAULTS_REDIS_PORT:-29379}"
source "$HERE/lib.sh"
KAFKA_BASE="${FAULTS_KAFKA_BASE_PORT:-29092}"
PARTITION_USER=intake-faults

args=("$@")
program=faults
ha=""
if [ "${1:-}" = --ha ]; then
    ha=1
    args=("${@:2}")
    if [ "${args[0]:-}" = --async ]; then
        args=("${args[@]:1}")
        HA_REPLICATION=async
        # For the harness's own calls of deploy/ha.sh, and its rules (tests/src/bin/faults/ha.rs).
        export INTAKE_HA_REPLICATION=async
    fi
    # The layout's own ports from here (deploy/ha.sh ha_port: base+0..55), the primary on
    # PG_PORT; small nodes, with pgBackRest's archive and backups as the stack's (the
    # restore_replay scenario restores the cluster from them).
    HA_BASE="${FAULTS_HA_BASE_PORT:-29500}"
    # For deploy/ha.sh here and for the harness's calls of it.
    HA_SHARED_BUFFERS=128MB
    export INTAKE_HA_SHARED_BUFFERS=128MB
elif [ "${1:-}" = --long-outage ]; then
    program=outage
    args=("${@:2}")
elif [ "${1:-}" = --short ]; then
    args=(--scenarios=writer_kill,broker_leader_kill,postgres_stop --outage-s=4 --self-check)
    kafka_for_a_test
fi

cleanup() {
    local status=$?
    set +e
    iptables -D OUTPUT -o lo -p tcp -m owner --uid-owner "$PARTITION_USER" --dport "$KAFKA_BASE:$((KAFKA_BASE + 12))" -j DROP 2>/dev/null
    # The rules of an HA scenario that cut a node off (tagged with the scratch folder).
    iptables-save 2>/dev/null | grep -F -- "intake-faults:$SCRATCH" | sed 's/^-A /-D /' \
        | while read -r rule; do eval "iptables $rule"; done
    [ -n "$ha" ] && stop_ha_at_once
    for pid in "$SCRATCH"/kafka/run/*.pid; do [ -f "$pid" ] && kill -KILL "$(cat "$pid")" 2>/dev/null; done
    # The harness's gateways and writers, should it have died before stopping them.
    pkill -KILL -f "^$SCRATCH/bin/" 2>/dev/null
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1
    as_postgres "$(pg_bin pg_ctl)" -D "$SCRATCH/pg" -m immediate stop >/dev/null 2>&1
    if [ "$status" != 0 ]; then
        # A failed scenario keeps its evidence, and shows the services' last warnings where the
        # run's output is read (CI). The logs hold hashes and ids, never a raw identifier.
        say "a scenario failed (exit $status): the logs stay in $SCRATCH"
        for log in "$SCRATCH"/*.log; do
            [ -f "$log" ] || continue
            echo "--- $(basename "$log"): last warnings and errors" >&2
            grep -E ' (WARN|ERROR) ' "$log" | grep -v 'librdkafka' | tail -n 12 | cut -c1-300 >&2
        done
    elif [ -z "${FAULTS_KEEP:-}" ]; then
        rm -rf "$SCRATCH"
    fi
}
trap cleanup EXIT

# The HA layout killed at once: Patroni first, so that it restarts nothing; each postmaster
# shut down immediately (it removes its shared memory, which a SIGKILL leaves); then whatever
# is left of each node, HAProxy and etcd.
stop_ha_at_once() {
    local n group postmaster file
    for n in 1 2 3; do
        group="$(cat "$SCRATCH/run/ha-node-$n.pid" 2>/dev/null)" && kill -CONT -- "-$group" 2>/dev/null && kill -KILL -- "-$group" 2>/dev/null
        postmaster="$(head -n 1 "$SCRATCH/ha/node-$n/data/postmaster.pid" 2>/dev/null)"
        [ -n "$postmaster" ] && kill -QUIT "$postmaster" 2>/dev/null
    done
    sleep 2
    for n in 1 2 3; do ha_node_signal "$SCRATCH" "$n" KILL; done
    for file in "$SCRATCH"/run/ha-*.pid; do [ -f "$file" ] && kill -KILL "$(cat "$file")" 2>/dev/null; done
}

install_packages
command -v iptables >/dev/null || apt_install iptables
id -u "$PARTITION_USER" >/dev/null 2>&1 || as_root useradd --system --no-create-home --shell /usr/sbin/nologin "$PARTITION_USER"
install_kafka
started=$SECONDS
# PostgreSQL (or its HA layout) and Redis start while the brokers do.
if [ -n "$ha" ]; then
    start_ha_cluster "$SCRATCH" "$HA_BASE" "$PG_PORT" >/dev/null & postgres=$!
else
    start_postgres & postgres=$!
fi
start_redis & redis=$!
brokers="$(start_kafka_cluster "$SCRATCH/kafka" "$KAFKA_BASE" | tail -n 1)"
wait "$postgres" && wait "$redis"
create_database intake_faults
say "infrastructure up in $((SECONDS - started)) s"

# The test suite (deploy/test.sh) has built the binaries it tests: use those, without waiting
# for the build folder's lock while someone else builds.
if [ -n "${INTAKE_BIN_DIR:-}" ]; then
    BIN="$INTAKE_BIN_DIR"
else
    say "building the harness"
    (cd "$REPO" && cargo build --release --workspace --bins --quiet)
fi
# A copy the partitioned writer's user can run (the build folder is under root's home).
mkdir -p "$SCRATCH/bin"
cp "$BIN/intake-gateway" "$BIN/intake-writer" "$SCRATCH/bin/"
chmod -R a+rx "$SCRATCH/bin"

ha_env=()
# The writers on the layout's nodes, following the primary, as deploy/up.sh --ha runs them.
[ -n "$ha" ] && ha_env=(FAULTS_HA_DIR="$SCRATCH" FAULTS_HA_BASE_PORT="$HA_BASE"
    FAULTS_WRITERS_DATABASE_URL="$(ha_nodes_url "$HA_BASE" intake_faults)")
say "running the scenarios (${args[*]:-all})"
env DATABASE_URL="$(database_url intake_faults)" INTAKE_KAFKA_BROKERS="$brokers" \
    INTAKE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT" INTAKE_BIN_DIR="$SCRATCH/bin" \
    FAULTS_DIR="$SCRATCH" FAULTS_PG_DATA="$SCRATCH/pg" FAULTS_PG_PORT="$PG_PORT" FAULTS_REDIS_PORT="$REDIS_PORT" \
    FAULTS_KAFKA_DIR="$SCRATCH/kafka" FAULTS_KAFKA_BASE_PORT="$KAFKA_BASE" FAULTS_LIB="$HERE/lib.sh" \
    FAULTS_PARTITION_USER="$PARTITION_USER" "${ha_env[@]}" \
    "$BIN/$program" "${args[@]}"
