# Shared by up.sh, down.sh and test.sh: settings, installing what is missing, and starting the
# infrastructure (PostgreSQL, Redis, Tansu) on loopback. Every function is safe to run twice.
# shellcheck shell=bash

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INTAKE_HOME="${INTAKE_HOME:-$REPO/.intake}"
# Built tools and build output outlive a clone, so a fresh clone on this machine reuses them.
INTAKE_CACHE="${INTAKE_CACHE:-$HOME/.cache/intake}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$INTAKE_CACHE/target}"

PG_PORT="${INTAKE_PG_PORT:-55432}"
REDIS_PORT="${INTAKE_REDIS_PORT:-56379}"
KAFKA_PORT="${INTAKE_KAFKA_PORT:-9092}"
TANSU_VERSION="0.6.0"
TANSU_BIN="$INTAKE_CACHE/tools/bin/tansu"

export INTAKE_KAFKA_BROKERS="${INTAKE_KAFKA_BROKERS:-127.0.0.1:$KAFKA_PORT}"
# Tansu does not wake a waiting fetch when a message arrives, so every hop costs up to
# fetch.wait.max.ms: keep it short here. Apache Kafka needs none of this.
export INTAKE_KAFKA_OPTIONS="${INTAKE_KAFKA_OPTIONS:-fetch.wait.max.ms=2,socket.nagle.disable=true}"
export INTAKE_REDIS_URL="${INTAKE_REDIS_URL:-redis://127.0.0.1:$REDIS_PORT}"

LOGS="$INTAKE_HOME/logs"
RUN="$INTAKE_HOME/run"
mkdir -p "$LOGS" "$RUN"

say() { printf '==> %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

install_packages() {
    local missing=()
    command -v pg_ctlcluster >/dev/null || [ -x /usr/lib/postgresql/15/bin/pg_ctl ] || missing+=(postgresql)
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v make >/dev/null || missing+=(make)
    command -v cc >/dev/null || missing+=(gcc)
    command -v g++ >/dev/null || missing+=(g++)
    command -v python3 >/dev/null || missing+=(python3)
    [ -e /usr/include/zlib.h ] || missing+=(zlib1g-dev)
    command -v curl >/dev/null || missing+=(curl)
    if [ "${#missing[@]}" -gt 0 ]; then
        say "installing ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

install_python_venv() {
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv python3-pip >/dev/null
}

pg_bin() {
    local dir
    dir="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    echo "$dir/$1"
}

# PostgreSQL refuses to run as root; run it as the postgres user when we are root.
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

install_tansu() {
    if [ ! -x "$TANSU_BIN" ]; then
        say "building the Tansu broker $TANSU_VERSION once (about 12 minutes on 2 cores)"
        cargo install tansu --version "$TANSU_VERSION" --features dynostore --locked \
            --root "$INTAKE_CACHE/tools" >"$LOGS/tansu-build.log" 2>&1 \
            || { tail -n 30 "$LOGS/tansu-build.log"; return 1; }
    fi
}

start_postgres() {
    local data="$INTAKE_HOME/pg"
    # Already serving (this checkout's, or another checkout's on this machine): reuse it.
    if port_open "$PG_PORT"; then return; fi
    if [ ! -f "$data/PG_VERSION" ]; then
        mkdir -p "$data"
        [ "$(id -u)" = 0 ] && chown postgres:postgres "$data"
        as_postgres "$(pg_bin initdb)" -D "$data" -U postgres --auth=trust -E UTF8 >"$LOGS/initdb.log"
    fi
    [ "$(id -u)" = 0 ] && chown postgres:postgres "$LOGS" && touch "$LOGS/postgres.log" && chown postgres "$LOGS/postgres.log"
    say "starting PostgreSQL on 127.0.0.1:$PG_PORT"
    as_postgres "$(pg_bin pg_ctl)" -D "$data" -l "$LOGS/postgres.log" -w \
        -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k /tmp -c max_connections=300" start >/dev/null
}

# Creates database $1 if missing.
create_database() {
    local exists
    exists="$(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$1'")"
    [ "$exists" = 1 ] || psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "CREATE DATABASE \"$1\"" >/dev/null
}

database_url() { echo "postgres://postgres@127.0.0.1:$PG_PORT/$1"; }

start_redis() {
    if redis-cli -p "$REDIS_PORT" ping >/dev/null 2>&1; then return; fi
    say "starting Redis on 127.0.0.1:$REDIS_PORT"
    mkdir -p "$INTAKE_HOME/redis"
    redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --daemonize yes --save '' --appendonly no \
        --dir "$INTAKE_HOME/redis" --pidfile "$RUN/redis.pid" --logfile "$LOGS/redis.log"
    wait_for "Redis" 10 redis-cli -p "$REDIS_PORT" ping
}

start_tansu() {
    if port_open "$KAFKA_PORT"; then return; fi
    say "starting Tansu on 127.0.0.1:$KAFKA_PORT"
    start_process tansu "$TANSU_BIN" broker \
        --storage-engine "memory://tansu/" \
        --listener-url "tcp://127.0.0.1:$KAFKA_PORT" \
        --advertised-listener-url "tcp://127.0.0.1:$KAFKA_PORT"
    wait_for "Tansu" 30 port_open "$KAFKA_PORT"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# wait_for NAME SECONDS COMMAND...: retries COMMAND until it succeeds.
wait_for() {
    local name="$1" seconds="$2"
    shift 2
    for _ in $(seq $((seconds * 10))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.1
    done
    say "$name did not come up in ${seconds}s"
    return 1
}

# start_process NAME COMMAND...: runs COMMAND in the background with its log and pid file,
# unless the process of that pid file is still alive.
start_process() {
    local name="$1"
    shift
    if [ -f "$RUN/$name.pid" ] && kill -0 "$(cat "$RUN/$name.pid")" 2>/dev/null; then return; fi
    nohup "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
    echo $! >"$RUN/$name.pid"
}

stop_process() {
    local name="$1" pid
    [ -f "$RUN/$name.pid" ] || return 0
    pid="$(cat "$RUN/$name.pid")"
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -f "$RUN/$name.pid"
}

start_infrastructure() {
    install_packages
    install_tansu
    start_postgres
    start_redis
    start_tansu
}

build() {
    say "building intake ($CARGO_TARGET_DIR)"
    (cd "$REPO" && cargo build --workspace --bins --quiet)
}

BIN="$CARGO_TARGET_DIR/debug"
