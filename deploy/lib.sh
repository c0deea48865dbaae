# Shared by up.sh, down.sh, test.sh and the benchmarks: settings, installing what is missing,
# and starting the infrastructure (PostgreSQL, Redis, Apache Kafka) on loopback. Every function
# is safe to run twice: it starts again only what is down.
# shellcheck shell=bash

set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
INTAKE_HOME="${INTAKE_HOME:-$REPO/.intake}"
# Built tools and build output outlive a clone, so a fresh clone on this machine reuses them.
INTAKE_CACHE="${INTAKE_CACHE:-$HOME/.cache/intake}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$INTAKE_CACHE/target}"

PG_PORT="${INTAKE_PG_PORT:-55432}"
REDIS_PORT="${INTAKE_REDIS_PORT:-56379}"
KAFKA_PORT="${INTAKE_KAFKA_PORT:-59092}"
KAFKA_CONTROLLER_PORT="${INTAKE_KAFKA_CONTROLLER_PORT:-59093}"
# The newest 4.x on Maven Central when this was written (4.4.0, 2026): KRaft only, and the
# protocol floor of KIP-896 that librdkafka 2.12 (bundled by rdkafka 0.39) speaks.
KAFKA_VERSION="${INTAKE_KAFKA_VERSION:-4.4.0}"
KAFKA_LIBS="$INTAKE_CACHE/kafka-$KAFKA_VERSION/libs"
MAVEN_CENTRAL="${INTAKE_MAVEN_CENTRAL:-https://repo.maven.apache.org/maven2}"
# A fixed heap of 1 GB: the broker's live data is about 250 MB (docs/operations.md, "Kafka's
# broker").
KAFKA_HEAP_OPTS="${INTAKE_KAFKA_HEAP_OPTS:--Xms1g -Xmx1g}"
# The JIT compiler's thresholds at a twentieth: a request path of the broker is compiled after
# some hundred requests instead of thousands, so that a broker just started reaches its steady
# latency within its warm-up (warm_kafka) rather than after minutes of traffic. Its CPU at start
# stays what it was (about 18 s with the warm-up either way).
KAFKA_JIT_OPTS="${INTAKE_KAFKA_JIT_OPTS:--XX:CompileThresholdScaling=0.05}"
# ZGC, which collects while the broker runs: G1's pauses (up to 100 ms under batch writes) held
# every request that reached the broker meanwhile (docs/operations.md, "Kafka's broker").
KAFKA_GC_OPTS="${INTAKE_KAFKA_GC_OPTS:--XX:+UseZGC}"
# Kafka's command-line tools (the storage format, the warm-up): seconds-long JVMs, for which the
# optimising compiler's work would never pay back.
KAFKA_TOOL_OPTS="-Xmx256m -XX:TieredStopAtLevel=1"

# kafka_for_a_test: the brokers a test starts for itself from now on (the suite's clusters, the
# short fault harness) serve it for a minute or two at a test's load: without the optimising
# compiler and with the serial collector, whose work would otherwise take the CPU that the
# suite's other tests run on: a broker's first 10 s after its start cost 9.6 s of CPU with the
# quick start's settings and 3.0 s with these, and it started in 3.8 s instead of 5.8 (2 cores).
# The quick start's broker and the benchmark's keep theirs.
kafka_for_a_test() {
    KAFKA_HEAP_OPTS="-Xms512m -Xmx512m"
    KAFKA_JIT_OPTS="-XX:TieredStopAtLevel=1"
    KAFKA_GC_OPTS="-XX:+UseSerialGC"
}

export INTAKE_KAFKA_BROKERS="${INTAKE_KAFKA_BROKERS:-127.0.0.1:$KAFKA_PORT}"
export INTAKE_REDIS_URL="${INTAKE_REDIS_URL:-redis://127.0.0.1:$REDIS_PORT}"

LOGS="$INTAKE_HOME/logs"
RUN="$INTAKE_HOME/run"
mkdir -p "$LOGS" "$RUN"

say() { printf '==> %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

# What the build needs (rdkafka-sys compiles librdkafka, C and C++, with zlib). Rust's own
# linker (rust-lld, shipped with the toolchain) links, so no linker comes from Debian.
install_build_packages() {
    local missing=()
    command -v make >/dev/null || missing+=(make)
    command -v cc >/dev/null || missing+=(gcc)
    command -v g++ >/dev/null || missing+=(g++)
    [ -e /usr/include/zlib.h ] || missing+=(zlib1g-dev)
    [ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
}

# What the services and the scripts run. A fresh machine has no package lists: this fetches
# them, so up.sh runs it while the build goes on.
install_packages() {
    install_build_packages
    local missing=()
    command -v pg_ctlcluster >/dev/null || [ -x /usr/lib/postgresql/15/bin/pg_ctl ] || missing+=(postgresql)
    command -v redis-server >/dev/null || missing+=(redis-server)
    command -v python3 >/dev/null || missing+=(python3)
    command -v curl >/dev/null || missing+=(curl)
    command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
    [ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
}

# apt_install [OPTIONS] PACKAGE...: every install of the scripts goes through here. Tests that
# run side by side install what they need on a fresh machine at the same moment, and dpkg takes
# one at a time: ours queue on a lock of their own, and apt waits for any other holder of its
# lock (DPkg::Lock::Timeout) instead of failing. Package lists are fetched only when the
# install cannot do without (a fresh machine has stale or none).
apt_install() {
    say "installing $*"
    # shellcheck disable=SC2016
    as_root flock /var/lock/intake-apt.lock env DEBIAN_FRONTEND=noninteractive sh -c '
        install() { apt-get install -y -qq -o DPkg::Lock::Timeout=600 "$@" >/dev/null; }
        install "$@" 2>/dev/null || { apt-get update -qq -o DPkg::Lock::Timeout=600 && install "$@"; }' sh "$@"
}

install_python_venv() { apt_install python3-venv python3-pip; }

pg_bin() {
    local dir
    dir="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)"
    echo "$dir/$1"
}

# PostgreSQL refuses to run as root; run it as the postgres user when we are root.
as_postgres() { if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi; }

# Apache Kafka's own jars from Maven Central, the broker's and the command-line tools'
# (deploy/kafka-tool.sh), as deploy/kafka/jars-VERSION.txt pins them with their checksums
# (deploy/kafka/pin.sh writes it from deploy/kafka/pom.xml): fetched with curl, eight at a time,
# and checked, once per list (the marker holds the list's checksum). A directory of another list
# may hold a running broker's jars: it is added to, never emptied.
install_kafka() {
    local list="$REPO/deploy/kafka/jars-$KAFKA_VERSION.txt" sum
    [ -f "$list" ] || { say "no pinned jars for Kafka $KAFKA_VERSION: run deploy/kafka/pin.sh $KAFKA_VERSION"; return 1; }
    sum="$(sha256sum "$list" | cut -d ' ' -f 1)"
    [ "$(cat "$KAFKA_LIBS/.complete" 2>/dev/null)" = "$sum" ] && return
    say "fetching Apache Kafka $KAFKA_VERSION and its tools from Maven Central (once; about 55 MB)"
    [ -f "$KAFKA_LIBS/.complete" ] || rm -rf "$KAFKA_LIBS"
    mkdir -p "$KAFKA_LIBS"
    # shellcheck disable=SC2016
    grep -v '^#' "$list" | cut -d ' ' -f 3 | (cd "$KAFKA_LIBS" && xargs -P 8 -n 1 sh -c '
        jar="$(basename "$1")"
        [ -f "$jar" ] || { curl -fsS --retry 3 -o "$jar.part" "$0/$1" && mv "$jar.part" "$jar"; }' "$MAVEN_CENTRAL") \
        >"$LOGS/kafka-install.log" 2>&1 || { tail -n 30 "$LOGS/kafka-install.log"; return 1; }
    if ! grep -v '^#' "$list" | sed 's#  .*/#  #' | (cd "$KAFKA_LIBS" && sha256sum -c --quiet) >>"$LOGS/kafka-install.log" 2>&1; then
        tail -n 30 "$LOGS/kafka-install.log"
        say "jars in $KAFKA_LIBS differ from $list: remove the directory and run again"
        return 1
    fi
    echo "$sum" >"$KAFKA_LIBS/.complete"
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
    # After a SIGKILL of the postmaster its backends take a moment to notice and release the
    # shared memory; until then a new postmaster refuses to start. Try again for a while.
    # Sized for sustained writes rather than PostgreSQL's defaults (128 MB of shared buffers, a
    # checkpoint every 1 GB of WAL): with those, a benchmark's run checkpointed every half
    # minute, most of its WAL was full-page images (each first change of a page after a
    # checkpoint logs the whole page, and every insert touches a page of each of ten indexes),
    # and backends wrote out evicted pages themselves. docs/operations.md, "PostgreSQL".
    local settings="-c shared_buffers=2GB -c max_wal_size=8GB -c min_wal_size=1GB"
    settings+=" -c checkpoint_timeout=15min -c wal_compression=lz4 -c wal_init_zero=off"
    local attempt
    for attempt in $(seq 20); do
        as_postgres "$(pg_bin pg_ctl)" -D "$data" -l "$LOGS/postgres.log" -w \
            -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k /tmp -c max_connections=300 $settings" start >/dev/null && break
        [ "$attempt" = 20 ] && { tail -n 20 "$LOGS/postgres.log" >&2; return 1; }
        sleep 1
    done
    # Beside the others, so that every process of the stack has its pid in $RUN.
    head -n 1 "$data/postmaster.pid" >"$RUN/postgres.pid"
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

# kafka_node NAME NODE_ID PORT CONTROLLER_PORT QUORUM DIR: one KRaft node (broker and
# controller in one process) on 127.0.0.1, its data in DIR/data (kept across restarts), its
# log in $LOGS/NAME.log and its pid in $RUN/NAME.pid. QUORUM is "standalone" for a single node,
# or the static voters "1@127.0.0.1:C1,2@...". Returns once the node says it started.
kafka_node() {
    local name="$1" node_id="$2" port="$3" controller_port="$4" quorum="$5" dir="$6"
    local replication=1 min_isr=1
    [ "$quorum" = standalone ] || { replication=3; min_isr=2; }
    if port_open "$port"; then return; fi
    mkdir -p "$dir/data"
    {
        echo "process.roles=broker,controller"
        echo "node.id=$node_id"
        if [ "$quorum" = standalone ]; then
            echo "controller.quorum.bootstrap.servers=127.0.0.1:$controller_port"
        else
            echo "controller.quorum.voters=$quorum"
        fi
        echo "listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port"
        echo "advertised.listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port"
        echo "inter.broker.listener.name=PLAINTEXT"
        echo "controller.listener.names=CONTROLLER"
        echo "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT"
        echo "log.dirs=$dir/data"
        # Topics are created by intake-writer topics: a misspelt topic is an error, not a new topic.
        echo "auto.create.topics.enable=false"
        echo "offsets.topic.replication.factor=$replication"
        echo "offsets.topic.min.isr=$min_isr"
        # The default 50 partitions make the first group join slow on 2 cores.
        echo "offsets.topic.num.partitions=1"
        echo "transaction.state.log.replication.factor=$replication"
        echo "transaction.state.log.min.isr=$min_isr"
        echo "share.coordinator.state.topic.replication.factor=$replication"
        echo "share.coordinator.state.topic.min.isr=$min_isr"
        # A writer that joins alone need not wait 3 s for others.
        echo "group.initial.rebalance.delay.ms=0"
        # A controller declares a silent broker dead (and moves its leaderships) after this:
        # 4 s instead of 9 s, for the failover tests of the three-node cluster on one machine.
        [ "$quorum" = standalone ] || { echo "broker.session.timeout.ms=4000"; echo "broker.heartbeat.interval.ms=1000"; }
        echo "num.network.threads=2"
        echo "num.io.threads=2"
    } >"$dir/server.properties"
    # The controller's, the metadata publishers' and the log segments' INFO lines are three in
    # four of a broker's log where topics come and go (each test makes its own): WARN for them.
    cat >"$dir/log4j2.properties" <<'LOG4J'
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = out
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.controller.name = org.apache.kafka.controller
logger.controller.level = WARN
logger.image.name = org.apache.kafka.image
logger.image.level = WARN
logger.segments.name = org.apache.kafka.storage.internals.log
logger.segments.level = WARN
LOG4J
    if [ ! -f "$dir/data/meta.properties" ]; then
        local format=(--ignore-formatted -c "$dir/server.properties")
        [ "$quorum" = standalone ] && format+=(--standalone)
        # shellcheck disable=SC2086
        [ -f "$dir/cluster-id" ] || java $KAFKA_TOOL_OPTS -cp "$KAFKA_LIBS/*" kafka.tools.StorageTool random-uuid >"$dir/cluster-id"
        # shellcheck disable=SC2086
        java $KAFKA_TOOL_OPTS -cp "$KAFKA_LIBS/*" kafka.tools.StorageTool format -t "$(cat "$dir/cluster-id")" "${format[@]}" \
            >>"$LOGS/$name.log" 2>&1
    fi
    local log_bytes=0 pid
    [ -f "$LOGS/$name.log" ] && log_bytes="$(stat -c %s "$LOGS/$name.log")"
    say "starting Kafka $KAFKA_VERSION node $name on 127.0.0.1:$port"
    # shellcheck disable=SC2086
    # The GC log (each collection, with the time of day) tells whether a stall of the whole
    # write path was the broker's collector.
    start_process "$name" java $KAFKA_HEAP_OPTS $KAFKA_JIT_OPTS $KAFKA_GC_OPTS \
        "-Xlog:gc:file=$LOGS/$name-gc.log:time,uptime:filecount=2,filesize=10m" \
        -Djava.awt.headless=true -Dlog4j2.configurationFile="$dir/log4j2.properties" \
        -cp "$KAFKA_LIBS/*" kafka.Kafka "$dir/server.properties"
    pid="$(cat "$RUN/$name.pid")"
    for _ in $(seq 900); do
        # Only what this start wrote, from its byte offset: the log of a broker that ran for
        # long (the suite's topics come and go) is hundreds of MB. awk reads to the end rather
        # than `grep -q`, which, leaving early, would fail the pipe with SIGPIPE under pipefail.
        if tail -c "+$((log_bytes + 1))" "$LOGS/$name.log" \
            | awk '/Kafka Server started/ { found = 1 } END { exit !found }'; then return 0; fi
        if ! kill -0 "$pid" 2>/dev/null; then
            say "Kafka node $name exited; the end of $LOGS/$name.log:"
            tail -n 20 "$LOGS/$name.log" >&2
            return 1
        fi
        sleep 0.1
    done
    say "Kafka node $name did not start in 90 s (see $LOGS/$name.log)"
    return 1
}

# The one broker of the quick start and the tests, its data in KAFKA_DIR: up.sh gives each
# PostgreSQL layout a log of its own (.intake/kafka, .intake/ha/kafka).
KAFKA_DIR="$INTAKE_HOME/kafka"
start_kafka() {
    kafka_node kafka 1 "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT" standalone "$KAFKA_DIR"
}

# kafka_runs_on DIR: the quick start's broker runs, with its data in DIR.
kafka_runs_on() {
    local pid
    pid="$(cat "$RUN/kafka.pid" 2>/dev/null)" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$1/server.properties"
}

# warm_kafka: a broker just started runs its request paths interpreted or barely compiled: right
# after command 1, single sends took p50 10.4 ms (p99 24.6) at 8 a second and 4.8 ms (p99 19.5)
# back to back; with this warm-up and the JIT's lower thresholds (KAFKA_JIT_OPTS), 6.9 and 3.2
# ms (p99 10.0), what a broker that has served for a while gives. Kafka's own end-to-end latency
# tool makes the round trips of a send (a one-record produce with acks=all, then the fetch that
# returns it), one after another, on a topic of its own (intake.warmup, 200 bytes a record).
# It takes about 6 s, and 10 s of the broker's CPU; output in $LOGS/kafka-warmup.log. A failed
# warm-up only leaves the broker cold.
KAFKA_WARMUP_RECORDS="${INTAKE_KAFKA_WARMUP_RECORDS:-2000}"
warm_kafka() {
    # shellcheck disable=SC2086
    java $KAFKA_TOOL_OPTS -cp "$KAFKA_LIBS/*" org.apache.kafka.tools.EndToEndLatency \
        --bootstrap-server "$INTAKE_KAFKA_BROKERS" --topic intake.warmup --num-records "$KAFKA_WARMUP_RECORDS" \
        --producer-acks all --record-size 200 >"$LOGS/kafka-warmup.log" 2>&1 ||
        say "warming Kafka up failed ($LOGS/kafka-warmup.log); it warms up with the first requests instead"
}

# start_kafka_cluster DIR BASE_PORT: three KRaft nodes on loopback (ports BASE_PORT+0..2, their
# controllers on BASE_PORT+10..12), data in DIR/kafka-N, pids $RUN/kafka-N.pid with RUN=DIR/run.
# Internal topics at replication 3 with min.insync.replicas 2. Prints the bootstrap list.
start_kafka_cluster() {
    local dir="$1" base="$2" voters="" node pids=()
    local RUN="$dir/run" LOGS="$dir/logs"
    mkdir -p "$RUN" "$LOGS"
    for node in 1 2 3; do voters+="${voters:+,}$node@127.0.0.1:$((base + 9 + node))"; done
    # The three must be formatted with one cluster id.
    # shellcheck disable=SC2086
    [ -f "$dir/cluster-id" ] || java $KAFKA_TOOL_OPTS -cp "$KAFKA_LIBS/*" kafka.tools.StorageTool random-uuid >"$dir/cluster-id"
    for node in 1 2 3; do
        mkdir -p "$dir/kafka-$node"
        cp "$dir/cluster-id" "$dir/kafka-$node/cluster-id"
        # Started in the background: a node of a static quorum waits for the others' votes.
        kafka_node "kafka-$node" "$node" "$((base + node - 1))" "$((base + 9 + node))" "$voters" "$dir/kafka-$node" &
        pids+=($!)
    done
    for node in "${pids[@]}"; do wait "$node"; done
    echo "127.0.0.1:$base,127.0.0.1:$((base + 1)),127.0.0.1:$((base + 2))"
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

# The stack's fixed ports lie in the kernel's ephemeral range (32768-60999): an outgoing
# connection can be given one of them as its local port while its service is down, and the
# service's restart then fails with "Address already in use" until that connection ends.
# Reserved ports are never given out that way. As root only; per network namespace.
reserve_ports() {
    local file=/proc/sys/net/ipv4/ip_local_reserved_ports port current
    [ -w "$file" ] || return 0
    current="$(cat "$file")"
    for port in "$PG_PORT" "$REDIS_PORT" "$KAFKA_PORT" "$KAFKA_CONTROLLER_PORT"; do
        grep -qw "$port" <<<"$current" || current="${current:+$current,}$port"
    done
    echo "$current" >"$file" 2>/dev/null || true
}

start_infrastructure() {
    install_packages
    install_kafka
    reserve_ports
    start_postgres
    start_redis
    start_kafka
}

# The quick start, the test suite and production run one build: the release profile. The suite
# (test.sh) builds its test programs on the same profile, so that it reuses these artifacts and
# tests the very binaries up.sh runs. Only the two services: intake-send and the test programs
# bring an HTTP client stack of their own (`cargo build --release -p intake-send`).
build() {
    say "building intake ($CARGO_TARGET_DIR/release)"
    # The programs only: asked for as a target too, the writer's library (built for them either
    # way) would be copied out of the dependencies, which the suite's build leaves in place
    # (tests/tests/one_build.rs compares the two builds' files).
    (cd "$REPO" && cargo build --release --quiet -p intake-gateway -p intake-writer --bins)
}

BIN="$CARGO_TARGET_DIR/release"

# The HA layout of PostgreSQL (deploy/up.sh --ha).
source "$REPO/deploy/ha.sh"
