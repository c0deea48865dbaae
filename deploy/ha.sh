# The HA layout of PostgreSQL on one machine, from Debian's packages: three etcd members,
# three PostgreSQL 15 nodes under Patroni (synchronous replication, one synchronous standby),
# HAProxy giving the primary one address, and pgBackRest archiving WAL and taking backups.
# Sourced by lib.sh; deploy/up.sh --ha starts it for the stack (primary on $PG_PORT, 55432).
#
# start_ha_cluster DIR BASE_PORT PRIMARY_PORT starts a layout anywhere: data in DIR/ha, pid
# files in DIR/run, logs in DIR/logs (for the stack, DIR is .intake). Ports from BASE_PORT:
#   etcd clients B+0..2, etcd peers B+10..12, PostgreSQL B+20..22, Patroni REST B+30..32,
#   pgBackRest repository B+40 and nodes B+41..43, HAProxy stats and /metrics B+50,
#   and the primary on PRIMARY_PORT.
# Pid files (DIR/run): ha-etcd-N, ha-node-N, ha-haproxy, ha-backup-repo, ha-backup-N.
# ha-node-N.pid holds the process-group id of node N's Patroni (started with setsid):
# `kill -STOP -- -$(cat DIR/run/ha-node-N.pid)` freezes that Patroni alone. PostgreSQL is not
# in that group (Patroni and every backend start sessions of their own): ha_node_signal DIR N
# SIGNAL reaches every process of the node, and SIGKILL through it is a lost machine.
# As root, node N runs as the user intake-dbN, so that a fault harness can cut all of one
# node's traffic by its uid (iptables -m owner --uid-owner, with the layout's port range when
# two layouts run); the repository belongs to postgres.
# shellcheck shell=bash

HA_BASE_PORT="${INTAKE_HA_BASE_PORT:-30400}"
# Three nodes (and three standbys' worth of replay) share the machine's memory.
HA_SHARED_BUFFERS="${INTAKE_HA_SHARED_BUFFERS:-1GB}"
# 0: no WAL archive and no backups (a short-lived layout of a test).
HA_BACKUPS="${INTAKE_HA_BACKUPS:-1}"
# sync: every commit waits for one synchronous standby, and only it is promoted. async: commits
# wait for no standby, and a lagging standby may be promoted; the writers then put back what it
# lacks from the requests topic (docs/architecture.md, "The log is the record").
HA_REPLICATION="${INTAKE_HA_REPLICATION:-sync}"
HA_TEMPLATES="$REPO/deploy/ha"
HA_SCOPE=intake

# ha_port BASE KIND [N]: the port of a member (N 1..3) of the layout at BASE.
ha_port() {
    local base="$1" kind="$2" n="${3:-1}"
    case "$kind" in
        etcd) echo $((base + n - 1)) ;;
        etcd-peer) echo $((base + 9 + n)) ;;
        pg) echo $((base + 19 + n)) ;;
        rest) echo $((base + 29 + n)) ;;
        backup-repo) echo $((base + 40)) ;;
        backup) echo $((base + 40 + n)) ;;
        stats) echo $((base + 50)) ;;
        *) say "ha_port: unknown kind $kind"; return 1 ;;
    esac
}

install_ha_packages() {
    local missing=()
    command -v patroni >/dev/null || missing+=(patroni)
    command -v etcd >/dev/null || missing+=(etcd-server)
    command -v haproxy >/dev/null || missing+=(haproxy)
    command -v pgbackrest >/dev/null || missing+=(pgbackrest)
    command -v openssl >/dev/null || missing+=(openssl)
    command -v setpriv >/dev/null || missing+=(util-linux)
    [ "${#missing[@]}" -eq 0 ] || apt_install "${missing[@]}"
    ha_stop_debian_services
}

# The packages ship services of their own (etcd on 2379/2380, an empty HAProxy, Patroni):
# the layout runs its own processes, so the packaged ones are stopped and disabled.
ha_stop_debian_services() {
    local service port pid
    if [ -d /run/systemd/system ]; then
        for service in etcd haproxy patroni; do
            if systemctl is-enabled --quiet "$service" 2>/dev/null || systemctl is-active --quiet "$service" 2>/dev/null; then
                say "stopping and disabling Debian's $service service (the HA layout runs its own)"
                as_root systemctl disable --now "$service" >/dev/null 2>&1 || true
            fi
        done
    else
        for service in etcd haproxy; do
            [ -x "/etc/init.d/$service" ] || continue
            if as_root "/etc/init.d/$service" status >/dev/null 2>&1; then
                say "stopping Debian's $service service (the HA layout runs its own)"
                as_root "/etc/init.d/$service" stop >/dev/null 2>&1 || true
            fi
            if compgen -G "/etc/rc[2-5].d/S*$service" >/dev/null; then
                as_root update-rc.d "$service" disable >/dev/null 2>&1 || true
            fi
        done
    fi
    # An etcd on its default ports, started some other way.
    for port in 2379 2380; do
        for pid in $(ss -Htlnp "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
            if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = etcd ]; then
                say "stopping the etcd on its default port $port (pid $pid)"
                as_root kill -TERM "$pid" 2>/dev/null || true
            fi
        done
    done
}

# The OS user of node N: its own as root, so that its traffic can be told apart.
ha_node_user() { if [ "$(id -u)" = 0 ]; then echo "intake-db$1"; else id -un; fi; }
ha_repo_user() { if [ "$(id -u)" = 0 ]; then echo postgres; else id -un; fi; }

ha_create_users() {
    [ "$(id -u)" = 0 ] || return 0
    local n user
    for n in 1 2 3; do
        user="$(ha_node_user "$n")"
        id -u "$user" >/dev/null 2>&1 && continue
        useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
            --comment "intake HA layout, PostgreSQL node $n" "$user"
    done
}

# ha_as USER HOME: HA_AS becomes the words that run a command as USER (as root; as ourselves
# otherwise) with HOME set, replacing the caller (no parent left waiting, so a pid stays the
# command's). as_user USER HOME COMMAND... runs it so.
ha_as() {
    if [ "$(id -u)" = 0 ]; then
        HA_AS=(setpriv --reuid="$1" --regid="$(id -g "$1")" --init-groups env HOME="$2")
    else
        HA_AS=(env HOME="$2")
    fi
}
as_user() {
    ha_as "$1" "$2"
    shift 2
    exec "${HA_AS[@]}" "$@"
}

# ha_render TEMPLATE OUT KEY=VALUE...: TEMPLATE with each @KEY@ replaced.
ha_render() {
    local template="$1" out="$2" pair script=""
    shift 2
    for pair in "$@"; do
        local value="${pair#*=}"
        value="${value//\\/\\\\}"
        value="${value//|/\\|}"
        value="${value//&/\\&}"
        script+="s|@${pair%%=*}@|$value|g;"
    done
    sed "$script" "$template" >"$out.part"
    if grep -q '@[A-Z_0-9]*@' "$out.part"; then
        say "$out: placeholders left: $(grep -o '@[A-Z_0-9]*@' "$out.part" | sort -u | tr '\n' ' ')"
        return 1
    fi
    mv "$out.part" "$out"
}

# Writes every configuration file of the layout at DIR (again on each start, so that edits
# of the templates apply). Expects HA, BASE and PRIMARY from start_ha_cluster.
# ha_dcs: the cluster-wide settings (deploy/ha/dcs.yml) for the replication mode chosen.
ha_dcs() {
    case "$HA_REPLICATION" in
        sync) cat "$HA_TEMPLATES/dcs.yml" ;;
        # A standby further behind than maximum_lag_on_failover is never promoted, and the
        # cluster then has no primary at all: with the log as the record, a promotion and a
        # rewind serve sooner, as far back as the requests topic's retention reaches.
        async) sed -e 's/^synchronous_mode: true$/synchronous_mode: false/' \
                   -e 's/^synchronous_mode_strict: true$/synchronous_mode_strict: false/' \
                   -e 's/^maximum_lag_on_failover: .*/maximum_lag_on_failover: 1073741824/' "$HA_TEMPLATES/dcs.yml" ;;
        *) say "INTAKE_HA_REPLICATION=$HA_REPLICATION: sync or async"; return 1 ;;
    esac
}

ha_write_configs() {
    local n user node etcd_hosts="" archive_mode=off archive_command="" restore_command=""
    for n in 1 2 3; do etcd_hosts+="${etcd_hosts:+,}127.0.0.1:$(ha_port "$BASE" etcd "$n")"; done
    mkdir -p "$HA/conf"
    for n in 1 2 3; do
        node="$HA/node-$n"
        user="$(ha_node_user "$n")"
        mkdir -p "$node"
        if [ "$HA_BACKUPS" = 1 ]; then
            archive_mode=on
            archive_command="pgbackrest --config=$node/pgbackrest.conf --stanza=$HA_SCOPE archive-push %p"
            # Segments only: a standby learns a new timeline's history from its primary when it
            # streams. A former primary's crash recovery that found the new timeline's history in
            # the archive would replay its own WAL past the fork onto that timeline, and Patroni,
            # which checks for divergence once PostgreSQL runs, would see it on the leader's timeline
            # and never rewind it: it would wait for ever on "record with incorrect prev-link".
            restore_command="case %f in *.history) exit 1;; esac; pgbackrest --config=$node/pgbackrest.conf --stanza=$HA_SCOPE archive-get %f %p"
            mkdir -p "$node/backrest/spool" "$node/backrest/log" "$node/backrest/lock"
            ha_render "$HA_TEMPLATES/pgbackrest-node.conf" "$node/pgbackrest.conf" HA="$HA" NODE_DIR="$node" \
                REPO_PORT="$(ha_port "$BASE" backup-repo)" NODE_BACKREST_PORT="$(ha_port "$BASE" backup "$n")" \
                PG_PORT="$(ha_port "$BASE" pg "$n")"
        fi
        ha_render "$HA_TEMPLATES/patroni.yml" "$node/patroni.yml" NODE="node-$n" NODE_DIR="$node" \
            REST_PORT="$(ha_port "$BASE" rest "$n")" PG_PORT="$(ha_port "$BASE" pg "$n")" \
            ETCD_HOSTS="$etcd_hosts" PG_BIN="$(dirname "$(pg_bin postgres)")" SHARED_BUFFERS="$HA_SHARED_BUFFERS" \
            ARCHIVE_MODE="$archive_mode" ARCHIVE_COMMAND="$archive_command" RESTORE_COMMAND="$restore_command"
        cp "$HA_TEMPLATES/replay-yields.sh" "$node/replay-yields.sh"
        { echo "bootstrap:"; echo "  dcs:"; ha_dcs | sed -e '/^#/d' -e '/^ *$/d' -e 's/^/    /'; } >>"$node/patroni.yml"
        [ "$(id -u)" = 0 ] && chown -R "$user:" "$node"
        chmod 700 "$node"
    done
    ha_dcs >"$HA/conf/dcs.yml"
    # patronictl needs only etcd and the scope.
    printf 'scope: %s\netcd:\n  hosts: %s\n  protocol: http\n' "$HA_SCOPE" "$etcd_hosts" >"$HA/conf/patronictl.yml"
    ha_render "$HA_TEMPLATES/haproxy.cfg" "$HA/conf/haproxy.cfg" RUN="$RUN" PRIMARY_PORT="$PRIMARY" \
        STATS_PORT="$(ha_port "$BASE" stats)" \
        PG_PORT_1="$(ha_port "$BASE" pg 1)" PG_PORT_2="$(ha_port "$BASE" pg 2)" PG_PORT_3="$(ha_port "$BASE" pg 3)" \
        REST_PORT_1="$(ha_port "$BASE" rest 1)" REST_PORT_2="$(ha_port "$BASE" rest 2)" REST_PORT_3="$(ha_port "$BASE" rest 3)"
    if [ "$HA_BACKUPS" = 1 ]; then
        mkdir -p "$HA/backup" "$HA/backup-state/log" "$HA/backup-state/lock"
        ha_render "$HA_TEMPLATES/pgbackrest-repo.conf" "$HA/conf/pgbackrest-repo.conf" HA="$HA" \
            REPO_PORT="$(ha_port "$BASE" backup-repo)" \
            NODE_BACKREST_PORT_1="$(ha_port "$BASE" backup 1)" NODE_BACKREST_PORT_2="$(ha_port "$BASE" backup 2)" \
            NODE_BACKREST_PORT_3="$(ha_port "$BASE" backup 3)" \
            PG_PORT_1="$(ha_port "$BASE" pg 1)" PG_PORT_2="$(ha_port "$BASE" pg 2)" PG_PORT_3="$(ha_port "$BASE" pg 3)"
        ha_tls
        [ "$(id -u)" = 0 ] && chown -R "$(ha_repo_user):" "$HA/backup" "$HA/backup-state" "$HA/conf/pgbackrest-repo.conf"
    fi
    return 0
}

# One certificate authority and one certificate (CN intake, for localhost) for pgBackRest's
# TLS between the nodes and the repository, made once; each user gets its own copy.
ha_tls() {
    local src="$HA/tls" n
    if [ ! -f "$src/cert.pem" ]; then
        mkdir -p "$src"
        chmod 700 "$src"
        openssl req -x509 -newkey rsa:2048 -nodes -days 3650 -subj /CN=intake-ha-ca \
            -keyout "$src/ca-key.pem" -out "$src/ca.pem" 2>/dev/null
        openssl req -newkey rsa:2048 -nodes -subj /CN=intake -keyout "$src/key.pem" -out "$src/cert.csr" 2>/dev/null
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n' >"$src/ext.cnf"
        openssl x509 -req -in "$src/cert.csr" -CA "$src/ca.pem" -CAkey "$src/ca-key.pem" -CAcreateserial \
            -days 3650 -extfile "$src/ext.cnf" -out "$src/cert.pem.part" 2>/dev/null
        mv "$src/cert.pem.part" "$src/cert.pem"
    fi
    for n in 1 2 3 repo; do
        local to="$HA/node-$n/tls" user
        [ "$n" = repo ] && to="$HA/backup-state/tls"
        mkdir -p "$to"
        cp "$src/ca.pem" "$src/cert.pem" "$src/key.pem" "$to/"
        chmod 600 "$to/key.pem"
        if [ "$(id -u)" = 0 ]; then
            if [ "$n" = repo ]; then user="$(ha_repo_user)"; else user="$(ha_node_user "$n")"; fi
            chown -R "$user:" "$to"
        fi
    done
}

ha_alive() { [ -f "$RUN/$1.pid" ] && ha_pid_alive "$(cat "$RUN/$1.pid")"; }

# A process that exited is a zombie until its parent (init, for a process whose starter is
# gone) reaps it, which can take seconds: that counts as gone.
ha_pid_alive() { kill -0 "$1" 2>/dev/null && [ "$(ps -o stat= -p "$1" 2>/dev/null | cut -c1)" != Z ]; }

# ha_stop_process NAME [SECONDS]: SIGTERM, then SIGKILL after SECONDS (default 10).
ha_stop_process() {
    local name="$1" seconds="${2:-10}" pid
    [ -f "$RUN/$name.pid" ] || return 0
    pid="$(cat "$RUN/$name.pid")"
    if ha_pid_alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq $((seconds * 10))); do ha_pid_alive "$pid" || break; sleep 0.1; done
        if ha_pid_alive "$pid"; then kill -KILL -- "-$pid" "$pid" 2>/dev/null || true; fi
    fi
    rm -f "$RUN/$name.pid"
}

# Is any process of the layout at DIR running?
ha_running() {
    local run="$1/run" file
    for file in "$run"/ha-*.pid; do
        [ -f "$file" ] && kill -0 "$(cat "$file")" 2>/dev/null && return 0
    done
    return 1
}

ha_start_etcd() {
    local n="$1" name="ha-etcd-$1" cluster="" m
    ha_alive "$name" && return
    for m in 1 2 3; do cluster+="${cluster:+,}etcd-$m=http://127.0.0.1:$(ha_port "$BASE" etcd-peer "$m")"; done
    local client="http://127.0.0.1:$(ha_port "$BASE" etcd "$n")" peer="http://127.0.0.1:$(ha_port "$BASE" etcd-peer "$n")"
    say "starting etcd member $n on $client"
    # Heartbeats every 200 ms and an election after 2 s without one (etcd's defaults: 100 ms,
    # 1 s): three members on one loaded 2-core machine miss a 1 s window now and then, and
    # each election pauses writes to etcd. The v2 API is Patroni's (deploy/ha/patroni.yml says
    # why). The initial-cluster flags count only on the first start; later starts read the
    # member from its data directory.
    start_process "$name" etcd --name "etcd-$n" --data-dir "$HA/etcd-$n" \
        --listen-client-urls "$client" --advertise-client-urls "$client" \
        --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
        --initial-cluster "$cluster" --initial-cluster-token "intake-ha-$BASE" --initial-cluster-state new \
        --heartbeat-interval 200 --election-timeout 2000 --enable-v2=true \
        --snapshot-count 10000 --auto-compaction-mode periodic --auto-compaction-retention 1h \
        --logger zap --log-outputs stderr
}

ha_etcd_healthy() {
    curl -fsS --max-time 2 "http://127.0.0.1:$(ha_port "$BASE" etcd "$1")/health" 2>/dev/null | grep -q '"health":"true"'
}

ha_start_backup_servers() {
    local n user
    if ! ha_alive ha-backup-repo; then
        say "starting pgBackRest's repository server on 127.0.0.1:$(ha_port "$BASE" backup-repo)"
        (as_user "$(ha_repo_user)" "$HA/backup-state" pgbackrest --config="$HA/conf/pgbackrest-repo.conf" server) \
            >>"$LOGS/ha-backup-repo.log" 2>&1 </dev/null &
        echo $! >"$RUN/ha-backup-repo.pid"
    fi
    for n in 1 2 3; do
        ha_alive "ha-backup-$n" && continue
        user="$(ha_node_user "$n")"
        (cd "$HA/node-$n" && as_user "$user" "$HA/node-$n" pgbackrest --config="$HA/node-$n/pgbackrest.conf" server) \
            >>"$LOGS/ha-backup-$n.log" 2>&1 </dev/null &
        echo $! >"$RUN/ha-backup-$n.pid"
    done
}

# Node N's Patroni in a process group of its own: the pid file holds its id.
ha_start_node() {
    local n="$1" name="ha-node-$1" node="$HA/node-$1"
    ha_alive "$name" && return
    say "starting PostgreSQL node $n under Patroni (PostgreSQL 127.0.0.1:$(ha_port "$BASE" pg "$n"), REST 127.0.0.1:$(ha_port "$BASE" rest "$n"))"
    rm -f "$RUN/$name.pid"
    # The new session's leader writes its own pid before becoming Patroni (setsid forks when
    # its caller leads a group already, so $! would not be it).
    ha_as "$(ha_node_user "$n")" "$node"
    setsid bash -c 'echo $$ >"$1"; cd "$2"; shift 2; exec "$@"' _ "$RUN/$name.pid" "$node" "${HA_AS[@]}" patroni "$node/patroni.yml" \
        >>"$LOGS/$name.log" 2>&1 </dev/null &
    for _ in $(seq 50); do [ -s "$RUN/$name.pid" ] && return 0; sleep 0.1; done
    say "node $n did not start (see $LOGS/$name.log)"
    return 1
}

# ha_rest N PATH: GET from node N's Patroni REST API.
ha_rest() { curl -fsS --max-time 3 "http://127.0.0.1:$(ha_port "$BASE" rest "$1")$2" 2>/dev/null; }

# ha_cluster_state: "LEADER SYNC_STANDBY" from whichever node answers ("-" when none); with
# asynchronous replication the second is a streaming standby.
ha_cluster_state() {
    local n json
    for n in 1 2 3; do
        json="$(ha_rest "$n" /cluster)" || continue
        python3 -c '
import json, sys
members = json.loads(sys.argv[1]).get("members", [])
standby = ("sync_standby",) if sys.argv[2] == "sync" else ("sync_standby", "replica")
leader = [m["name"] for m in members if m.get("role") == "leader" and m.get("state") == "running"]
sync = [m["name"] for m in members if m.get("role") in standby and m.get("state") in ("streaming", "running")]
print(leader[0] if leader else "-", sync[0] if sync else "-")' "$json" "$HA_REPLICATION"
        return 0
    done
    echo "- -"
}

# The primary takes a write through HAProxy: the commit returns only once the synchronous
# standby confirmed it. The write is WAL of the transaction's own (a logical message): a
# transaction that only takes an id writes no WAL before its commit record, and PostgreSQL
# waits for no standby on such a commit.
ha_primary_writable() {
    [ "$(timeout 10 psql -h 127.0.0.1 -p "$PRIMARY" -U postgres -d postgres -tAc \
        "SELECT pg_is_in_recovery()::text || ' ' || pg_logical_emit_message(true, 'intake-ha', 'probe')::text" \
        2>/dev/null | cut -d' ' -f1)" = false ]
}

ha_pgbackrest_repo() {
    (as_user "$(ha_repo_user)" "$HA/backup-state" pgbackrest --config="$HA/conf/pgbackrest-repo.conf" --stanza="$HA_SCOPE" "$@")
}

# The stanza, a check that the primary's WAL reaches the archive, and a first full backup.
ha_backup_setup() {
    ha_pgbackrest_settled stanza-create || { tail -n 20 "$LOGS/ha-backup.log" >&2; return 1; }
    ha_pgbackrest_settled check \
        || { say "pgbackrest check failed: WAL does not reach the repository"; tail -n 20 "$LOGS/ha-backup.log" >&2; return 1; }
    if ! ha_pgbackrest_repo info --output=json 2>/dev/null | grep -q '"label"'; then
        say "taking the first full backup (pgBackRest, repository $HA/backup)"
        ha_pgbackrest_settled backup --type=full || { tail -n 20 "$LOGS/ha-backup.log" >&2; return 1; }
    fi
}

# ha_pgbackrest_settled COMMAND [ARGS]: the repository's pgBackRest command, asked again for up
# to a minute while it finds more than one primary (its error 056): a former primary back from a
# network cut still runs as one until its Patroni, reaching etcd again, demotes it.
ha_pgbackrest_settled() {
    local _
    for _ in $(seq 60); do
        ha_pgbackrest_repo "$@" --log-level-console=warn >>"$LOGS/ha-backup.log" 2>&1 && return 0
        tail -n 5 "$LOGS/ha-backup.log" | grep -q 'ERROR: \[056\]' || return 1
        sleep 1
    done
    return 1
}

# start_ha_cluster DIR BASE_PORT PRIMARY_PORT: starts what is down of the layout at DIR and
# returns once the primary takes writes through PRIMARY_PORT with a synchronous standby (and,
# with backups, the archive works and a backup exists). Prints the primary's URL without a
# database name.
start_ha_cluster() {
    local dir="$1" BASE="$2" PRIMARY="$3"
    local HA="$dir/ha" RUN="$dir/run" LOGS="$dir/logs" n
    mkdir -p "$HA" "$RUN" "$LOGS"
    if [ -f "$HA/layout" ] && [ "$(cat "$HA/layout")" != "base=$BASE primary=$PRIMARY" ]; then
        say "$HA was made with $(cat "$HA/layout"); start it with those ports, or delete it"
        return 1
    fi
    echo "base=$BASE primary=$PRIMARY" >"$HA/layout"
    install_ha_packages
    ha_create_users
    ha_write_configs
    for n in 1 2 3; do ha_start_etcd "$n"; done
    for _ in $(seq 300); do
        ha_etcd_healthy 1 && ha_etcd_healthy 2 && ha_etcd_healthy 3 && break
        sleep 0.1
    done
    ha_etcd_healthy 1 || ha_etcd_healthy 2 || ha_etcd_healthy 3 \
        || { say "etcd did not come up in 30 s (see $LOGS/ha-etcd-*.log)"; return 1; }
    [ "$HA_BACKUPS" = 1 ] && ha_start_backup_servers
    for n in 1 2 3; do ha_start_node "$n"; done
    if ! ha_alive ha-haproxy; then
        say "starting HAProxy: the primary on 127.0.0.1:$PRIMARY"
        haproxy -c -q -f "$HA/conf/haproxy.cfg"
        start_process ha-haproxy haproxy -db -f "$HA/conf/haproxy.cfg"
    fi
    local state leader sync i
    for i in $(seq 1800); do
        state="$(ha_cluster_state)"
        leader="${state% *}" sync="${state#* }"
        [ "$leader" != - ] && break
        sleep 0.1
    done
    # The mode asked for before waiting for its standby: a cluster last started in the other
    # mode keeps that one in etcd until told.
    [ "$leader" != - ] && ha_patronictl_at "$HA" edit-config --apply "$HA/conf/dcs.yml" --force >/dev/null
    for _ in $(seq "$i" 1800); do
        state="$(ha_cluster_state)"
        leader="${state% *}" sync="${state#* }"
        [ "$leader" != - ] && [ "$sync" != - ] && ha_primary_writable && break
        sleep 0.1
    done
    if [ "$leader" = - ] || [ "$sync" = - ]; then
        say "the HA layout has no primary with a synchronous standby after 180 s (leader $leader, sync standby $sync; see $LOGS/ha-node-*.log)"
        return 1
    fi
    [ "$HA_BACKUPS" = 1 ] && ha_backup_setup
    say "HA layout up ($HA_REPLICATION replication): primary $leader, standby $sync, 127.0.0.1:$PRIMARY"
    echo "postgres://postgres@127.0.0.1:$PRIMARY"
}

ha_patronictl_at() {
    local ha="$1"
    shift
    patronictl -c "$ha/conf/patronictl.yml" "$@"
}

# ha_node_pids DIR N: every process of node N of the layout at DIR: its user's processes
# that work in the node's directory (Patroni and the pgBackRest server are started there,
# PostgreSQL and its archiver's commands work in its data directory below it). Neither
# process groups nor sessions cover a node: Patroni starts PostgreSQL in a session of its
# own, and each PostgreSQL backend makes itself a session of its own.
ha_node_pids() {
    local node pid cwd
    node="$(cd "$1/ha/node-$2" && pwd -P)" || return 0
    for pid in $(pgrep -u "$(ha_node_user "$2")"); do
        cwd="$(readlink "/proc/$pid/cwd" 2>/dev/null)" || continue
        case "$cwd/" in "$node"/*) echo "$pid" ;; esac
    done
}

# ha_node_signal DIR N SIGNAL: SIGNAL to every process of node N. SIGKILL is a lost machine:
# the node is stopped first, so that nothing it forks meanwhile is missed.
ha_node_signal() {
    local dir="$1" n="$2" signal="$3" pids
    pids="$(ha_node_pids "$dir" "$n")"
    [ -n "$pids" ] || return 0
    if [ "$signal" = KILL ] || [ "$signal" = 9 ]; then
        # shellcheck disable=SC2086
        kill -STOP $pids 2>/dev/null || true
        pids="$(ha_node_pids "$dir" "$n")"
    fi
    # shellcheck disable=SC2086
    kill "-$signal" $pids 2>/dev/null || true
}

# ha_stop_node N: Patroni stops its PostgreSQL and releases what it holds in etcd.
ha_stop_node() {
    local n="$1" data="$HA/node-$1/data"
    # Patroni stops PostgreSQL (a shutdown checkpoint) before it exits.
    ha_stop_process "ha-node-$n" 60
    # A PostgreSQL left without its Patroni.
    if [ -f "$data/postmaster.pid" ] && kill -0 "$(head -n 1 "$data/postmaster.pid")" 2>/dev/null; then
        (as_user "$(ha_node_user "$n")" "$HA/node-$n" "$(pg_bin pg_ctl)" -D "$data" -m fast -w stop) >/dev/null 2>&1 || true
    fi
}

# stop_ha_cluster DIR: stops the layout at DIR; data stays. The standbys go first, so that
# no standby takes over while the primary stops.
stop_ha_cluster() {
    local dir="$1"
    local HA="$dir/ha" RUN="$dir/run" LOGS="$dir/logs" BASE n leader
    [ -f "$HA/layout" ] || return 0
    BASE="$(sed -n 's/^base=\([0-9]*\).*/\1/p' "$HA/layout")"
    ha_stop_process ha-haproxy
    leader="$(ha_cluster_state)"
    leader="${leader% *}"
    local pids=()
    for n in 1 2 3; do
        if [ "node-$n" != "$leader" ]; then ha_stop_node "$n" & pids+=($!); fi
    done
    for n in "${pids[@]}"; do wait "$n"; done
    for n in 1 2 3; do
        if [ "node-$n" = "$leader" ]; then ha_stop_node "$n"; fi
    done
    pids=()
    for n in ha-backup-1 ha-backup-2 ha-backup-3 ha-backup-repo ha-etcd-1 ha-etcd-2 ha-etcd-3; do
        ha_stop_process "$n" & pids+=($!)
    done
    for n in "${pids[@]}"; do wait "$n"; done
}

# ha_switchover DIR [CANDIDATE]: a planned switchover of the layout at DIR to CANDIDATE (by
# default the synchronous standby, which needs no catching up); returns once the new primary
# takes writes through HAProxy and etcd lists its synchronous standby. Prints the old and new
# leader and the seconds until each of the two.
ha_switchover() {
    local dir="$1" candidate="${2:-}"
    local HA="$dir/ha" RUN="$dir/run" LOGS="$dir/logs" BASE PRIMARY state leader sync start
    BASE="$(sed -n 's/^base=\([0-9]*\).*/\1/p' "$HA/layout")"
    PRIMARY="$(sed -n 's/.*primary=\([0-9]*\).*/\1/p' "$HA/layout")"
    state="$(ha_cluster_state)"
    leader="${state% *}" sync="${state#* }"
    [ -n "$candidate" ] || candidate="$sync"
    if [ "$leader" = - ] || [ "$candidate" = - ]; then
        say "no switchover: leader $leader, synchronous standby $sync"
        return 1
    fi
    local writable="" listed="" elapsed
    start="$EPOCHREALTIME"
    ha_patronictl_at "$HA" switchover "$HA_SCOPE" --leader "$leader" --candidate "$candidate" --force >&2
    for _ in $(seq 600); do
        state="$(ha_cluster_state)"
        elapsed="$(python3 -c 'import sys; print(round(float(sys.argv[2]) - float(sys.argv[1]), 2))' "$start" "$EPOCHREALTIME")"
        if [ "${state% *}" = "$candidate" ]; then
            [ -z "$writable" ] && ha_primary_writable && writable="$elapsed"
            [ -z "$listed" ] && [ "${state#* }" != - ] && listed="$elapsed"
            [ -n "$writable" ] && [ -n "$listed" ] && break
        fi
        sleep 0.1
    done
    if [ -z "$writable" ] || [ -z "$listed" ]; then
        say "the switchover to $candidate did not finish in 60 s (cluster: $state)"
        return 1
    fi
    printf '{"from": "%s", "to": "%s", "writable_after_seconds": %s, "sync_standby_after_seconds": %s}\n' \
        "$leader" "$candidate" "$writable" "$listed"
}

# ha_restore_cluster DIR TIME: the layout at DIR restored to TIME (a timestamp with its zone,
# "2026-05-04 10:30:00+00") from pgBackRest's repository: every node's data is replaced, node 1
# recovers to TIME and becomes the primary, the others are copied from it, then a full backup
# is taken. The data each node had is kept in node-N/data.before-restore-<UTC time>, never
# deleted here: after a lossy failover it may be the only copy of what was acknowledged
# (deploy/RUNBOOK.md); delete it once the incident is closed. Writers must be stopped first (deploy/RUNBOOK.md, "The HA layout (deploy/up.sh
# --ha): restore to a point in time").
ha_restore_cluster() {
    local dir="$1" target="$2"
    local HA="$dir/ha" RUN="$dir/run" LOGS="$dir/logs" BASE PRIMARY n user node1="$dir/ha/node-1"
    BASE="$(sed -n 's/^base=\([0-9]*\).*/\1/p' "$HA/layout")"
    PRIMARY="$(sed -n 's/.*primary=\([0-9]*\).*/\1/p' "$HA/layout")"
    [ "$HA_BACKUPS" = 1 ] && [ -f "$HA/conf/pgbackrest-repo.conf" ] || { say "the layout at $dir has no backups"; return 1; }
    for n in 1 2 3; do ha_etcd_healthy "$n" && break; done || { say "etcd is not running: start the layout first"; return 1; }
    say "stopping HAProxy and the PostgreSQL nodes"
    ha_stop_process ha-haproxy
    for n in 1 2 3; do ha_stop_node "$n" & done
    wait
    # Patroni would otherwise take the restored node for a stray member of the old cluster.
    printf '%s\nYes I am aware\n' "$HA_SCOPE" | ha_patronictl_at "$HA" remove "$HA_SCOPE" >/dev/null
    # After a restore that did not finish, the data directories are its leftovers and the
    # newest data.before-restore-* still holds what the nodes had.
    local kept
    kept="data.before-restore-$(date -u +%Y%m%dT%H%M%SZ)"
    for n in 1 2 3; do
        if [ -f "$HA/restoring" ]; then
            rm -rf "$HA/node-$n/data"
        elif [ -d "$HA/node-$n/data" ]; then
            mv "$HA/node-$n/data" "$HA/node-$n/$kept"
        fi
    done
    touch "$HA/restoring"
    user="$(ha_node_user 1)"
    install -d -m 700 -o "$user" -g "$(id -g "$user")" "$node1/data"
    touch "$LOGS/ha-restore.log"
    [ "$(id -u)" = 0 ] && chown "$user" "$LOGS/ha-restore.log"
    say "restoring node 1 to $target"
    (cd "$node1" && as_user "$user" "$node1" pgbackrest --config="$node1/pgbackrest.conf" --stanza="$HA_SCOPE" \
        --type=time "--target=$target" --target-action=promote --log-level-console=warn restore) \
        >>"$LOGS/ha-backup.log" 2>&1 || { tail -n 20 "$LOGS/ha-backup.log" >&2; return 1; }
    # Recovery runs outside Patroni, on node 1's port, with the settings of node 1 (the
    # restored postgresql.conf is that of the node the backup was taken from) and no
    # synchronous standby to wait for.
    local pg_port options
    pg_port="$(ha_port "$BASE" pg 1)"
    options="-p $pg_port -c listen_addresses=127.0.0.1 -k /tmp -c synchronous_standby_names="
    options+=" -c hba_file=$node1/data/pg_hba.conf -c ident_file=$node1/data/pg_ident.conf"
    options+=" -c archive_command='pgbackrest --config=$node1/pgbackrest.conf --stanza=$HA_SCOPE archive-push %p'"
    (cd "$node1" && as_user "$user" "$node1" "$(pg_bin pg_ctl)" -D "$node1/data" -l "$LOGS/ha-restore.log" -w -t 3600 \
        -o "$options" start) >/dev/null || { tail -n 20 "$LOGS/ha-restore.log" >&2; return 1; }
    for _ in $(seq 36000); do
        [ "$(psql -h 127.0.0.1 -p "$pg_port" -U postgres -d postgres -tAc 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ] && break
        sleep 0.1
    done
    grep -E 'recovery stopping|selected new timeline' "$LOGS/ha-restore.log" | tail -n 2 >&2 || true
    psql -h 127.0.0.1 -p "$pg_port" -U postgres -d postgres -qc 'ALTER SYSTEM RESET restore_command' \
        -c 'ALTER SYSTEM RESET recovery_target_time' -c 'ALTER SYSTEM RESET recovery_target_action' \
        -c 'ALTER SYSTEM RESET archive_mode'
    (as_user "$user" "$node1" "$(pg_bin pg_ctl)" -D "$node1/data" -m fast -w stop) >/dev/null
    # Node 1 first: a node with an empty directory and no cluster in etcd would make a new one.
    ha_start_node 1
    for _ in $(seq 600); do
        [ "$(ha_cluster_state | cut -d' ' -f1)" = node-1 ] && break
        sleep 0.1
    done
    start_ha_cluster "$dir" "$BASE" "$PRIMARY" >/dev/null
    rm -f "$HA/restoring"
    say "taking a full backup of the restored cluster"
    ha_pgbackrest_repo backup --type=full --log-level-console=warn >>"$LOGS/ha-backup.log" 2>&1 \
        || { tail -n 20 "$LOGS/ha-backup.log" >&2; return 1; }
    say "restored to $target; the data the nodes had is kept in $HA/node-N/data.before-restore-*"
}

# The single PostgreSQL of the quick start (deploy/lib.sh start_postgres) runs.
ha_single_running() {
    [ -f "$INTAKE_HOME/pg/postmaster.pid" ] && kill -0 "$(head -n 1 "$INTAKE_HOME/pg/postmaster.pid")" 2>/dev/null
}

# The stack's layout: data in .intake/ha, the primary on $PG_PORT.
start_ha() { start_ha_cluster "$INTAKE_HOME" "$HA_BASE_PORT" "$PG_PORT" >/dev/null; }

# ha_nodes_url BASE DATABASE: the layout's three PostgreSQL nodes in libpq's multi-host form, the
# writers' DATABASE_URL: a writer follows the primary among them itself (writer/src/primary.rs),
# so that a write's round trips skip HAProxy's relay. The gateways, operators and scripts use
# HAProxy's address.
ha_nodes_url() {
    local hosts="" n
    for n in 1 2 3; do hosts+="${hosts:+,}127.0.0.1:$(ha_port "$1" pg "$n")"; done
    echo "postgres://postgres@$hosts/$2"
}
stop_ha() { stop_ha_cluster "$INTAKE_HOME"; }
