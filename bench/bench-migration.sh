#!/usr/bin/env bash
# The schema migrations of `conversions` on a populated table while writes go on, measured on
# PostgreSQL alone: a database migrated to the schema of the version before the migrations
# under test, `conversions` loaded with N rows as a year's table stands (every index built
# after the load, vacuumed and frozen), then `intake-writer migrate` while single upserts arrive
# at 200 a second. Prints, per migration: its time (as sqlx recorded it), the upserts' p99 and
# longest during it, and the WAL it wrote; the longest wait for a lock that any session was
# seen in (sampled every 100 ms from pg_locks), by whom and for what; and the indexes' bytes per
# conversion before and after. The upserts are the previous version's (digests as hex text)
# during `migrate`, this version's (digests as bytes) during `migrate --contract`, as in a
# rollout. Exits with status 3 when a lock was waited for 5 s or more (the bound the runbook
# holds every migration to).
#
#   bench/bench-migration.sh                     10 M rows, migrations 0036 to 0042: `migrate`,
#                                                then `migrate --contract`
#   INTAKE_MIGRATION_ROWS=1000000 bench/bench-migration.sh
#   INTAKE_MIGRATION_FIRST=6 bench/bench-migration.sh
#                                                every migration from 0006 on, from the schema
#                                                of a version before them (0005)
#   INTAKE_MIGRATION_HA=1 bench/bench-migration.sh
#                                                the same on the HA layout (deploy/ha.sh: three
#                                                nodes, one synchronous standby, through
#                                                HAProxy), started for the run in
#                                                $INTAKE_HOME/bench-migration-ha on ports 31500
#                                                to 31555 and removed after; also the standbys'
#                                                replay lag, sampled every 200 ms
#
# Needs PostgreSQL (started if it is not running). Uses the database intake_bench_migration
# (dropped and created again, dropped at the end). Writes bench/migration.md
# (bench/migration-ha.md on the HA layout).
source "$(dirname "$0")/lib.sh"

rows="${INTAKE_MIGRATION_ROWS:-10000000}"
db=intake_bench_migration
# The first migration under test; the schema before it is the previous version's.
first="${INTAKE_MIGRATION_FIRST:-36}"
ha="${INTAKE_MIGRATION_HA:-0}"
ha_dir="$INTAKE_HOME/bench-migration-ha"
# Each node holds the table, its indexes and the load's WAL: about 1.5 kB a row (a 10 M load
# on the HA layout filled 41 GB before it finished).
nodes=1
[ "$ha" = 1 ] && nodes=3
need_gb=$((rows * 1500 * nodes / 1000000000 + 5))
mkdir -p "$INTAKE_HOME"
free_gb=$(($(df -Pk "$INTAKE_HOME" | awk 'NR == 2 { print $4 }') / 1048576))
if [ "$free_gb" -lt "$need_gb" ]; then
    say "$rows rows on $nodes node(s) need about $need_gb GB free, and $free_gb GB are: fewer rows (INTAKE_MIGRATION_ROWS)"
    exit 1
fi
install_packages
if [ "$ha" = 1 ]; then
    PG_PORT=31555 HA_BACKUPS=0
    trap 'stop_ha_cluster "$ha_dir"; rm -rf "$ha_dir"' EXIT
    start_ha_cluster "$ha_dir" 31500 "$PG_PORT" >/dev/null
else
    start_postgres
fi
bench_database "$db"
writer="$CARGO_TARGET_DIR/release/intake-writer"
pgbench_bin="$(pg_bin pgbench)"
work="$(mktemp -d)"
cleanup() {
    rm -rf "$work"
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null 2>&1
    if [ "$ha" = 1 ]; then stop_ha_cluster "$ha_dir"; rm -rf "$ha_dir"; fi
}
trap cleanup EXIT

# The schema of the version before: every migration before those under test, contracted.
"$writer" migrate --contract --through $((first - 1)) >/dev/null

say "loading $rows conversions"
started="$(date +%s)"
load_year_of_conversions "$db" "$rows"
sql -c "VACUUM (FREEZE, ANALYZE) conversions" -c "VACUUM (ANALYZE) chains" -c "CHECKPOINT"
loaded_s=$(($(date +%s) - started))
index_bytes() { sql -c "SELECT indexrelid::regclass || ' ' || round(pg_relation_size(indexrelid)::numeric / $rows, 1)
                        FROM pg_index WHERE indrelid = 'conversions'::regclass ORDER BY 1"; }
# The heap's bytes a conversion, and a row's own (of a 1 % sample): no migration rewrites a row.
heap_bytes() { sql -c "SELECT round(pg_relation_size('conversions')::numeric / $rows, 1)"; }
row_bytes() { sql -c "SELECT round(avg(pg_column_size(c.*)), 1) FROM conversions c TABLESAMPLE SYSTEM (1)"; }
before="$(index_bytes)"
heap_before="$(heap_bytes)"
row_before="$(row_bytes)"

single_send_script email_sha256 "encode(sha256(('n' || :g)::bytea), 'hex')" >"$work/insert.sql"
single_send_script email_digest "sha256(('n' || :g)::bytea)" >"$work/insert-next.sql"
# Latencies in ms (p99, longest) of the pgbench transactions that ended between FROM and TO.
latencies() {
    cat "$work"/tx* | awk -v from="$1" -v to="$2" '{ t = $5 + $6 / 1e6 } t >= from && t <= to { print $3 }' \
        | sort -n | awk '{ v[NR] = $1 } END { if (NR == 0) { print "- -"; exit }
                          printf "%.2f %.2f\n", v[int(NR * 0.99) + 1] / 1000, v[NR] / 1000 }'
}

say "migrating while single upserts arrive at 200/s"
upserts() { # SCRIPT LOG-PREFIX: upserts at 200/s in the background, until killed
    "$pgbench_bin" -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -c 2 -j 1 -R 200 -T 100000 \
        --log --log-prefix="$work/$2" -f "$work/$1" "$db" >>"$work/pgbench.txt" 2>&1 &
    bench=$! # stopped once its part is done: its log up to then is written
}
stop_upserts() { kill "$bench" 2>/dev/null || true; wait "$bench" 2>/dev/null || true; }
upserts insert.sql tx
sleep 5 # the upserts under way first
lsn0="$(sql -c "SELECT pg_current_wal_lsn()")"
# The standbys' distance behind the primary while the migrations run: bytes of WAL not yet
# replayed, and PostgreSQL's own replay lag (time from a commit to its replay there).
sample_lag() {
    while :; do
        sql -F ' ' -c "SELECT extract(epoch FROM clock_timestamp()), application_name, sync_state,
                              pg_wal_lsn_diff(pg_current_wal_lsn(), replay_lsn),
                              coalesce(extract(epoch FROM replay_lag) * 1000, 0)
                         FROM pg_stat_replication" >>"$work/lag" 2>/dev/null
        sleep 0.2
    done
}
if [ "$ha" = 1 ]; then sample_lag & sampler=$!; fi
# Every lock not granted in this database: how long it has been waited for (ms), its mode, its
# table, and the waiting session's application (pgbench, or the writer's migrate). A failed
# sample is skipped, not the end of the sampling.
sample_locks() {
    while :; do
        sql -F ' ' -c "SELECT round(extract(epoch FROM clock_timestamp() - l.waitstart) * 1000), l.mode,
                              coalesce(l.relation::regclass::text, l.locktype),
                              coalesce(nullif(a.application_name, ''), 'unnamed')
                         FROM pg_locks l JOIN pg_stat_activity a USING (pid)
                        WHERE NOT l.granted AND l.waitstart IS NOT NULL AND a.datname = current_database()" \
            >>"$work/locks" 2>/dev/null || true
        sleep 0.1
    done
}
: >"$work/locks"
sample_locks & lock_sampler=$!
migrate_started="$(date +%s.%N)"
PGAPPNAME=migrate "$writer" migrate >/dev/null
expanded="$(date +%s.%N)"
# The rollout: this version's writers replace the previous version's.
stop_upserts
upserts insert-next.sql txnext
# Its writers are pgbench's upserts, not Kafka's consumers: no group to check.
PGAPPNAME=migrate "$writer" migrate --contract --skip-writer-check >/dev/null
migrate_ended="$(date +%s.%N)"
lsn1="$(sql -c "SELECT pg_current_wal_lsn()")"
if [ "$ha" = 1 ]; then kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null || true; fi
kill "$lock_sampler" 2>/dev/null || true
wait "$lock_sampler" 2>/dev/null || true
# The longest wait seen: "ms mode relation application", or nothing when none was seen.
longest_wait="$(sort -n -k1,1 "$work/locks" | tail -1)"
waited_ms="$(awk '{ print $1 }' <<<"${longest_wait:-0}")"
sleep 2
stop_upserts
after="$(index_bytes)"
heap_after="$(heap_bytes)"
row_after="$(row_bytes)"
read -r p99 longest <<<"$(latencies "$migrate_started" "$migrate_ended")"
read -r before_p99 _ <<<"$(latencies 0 "$migrate_started")"

mkdir -p "$REPO/bench"
report="$REPO/bench/migration.md"
[ "$ha" = 1 ] && report="$REPO/bench/migration-ha.md"
{
    echo "# Migrations of conversions on a populated table under writes"
    echo
    echo "\`bench/bench-migration.sh\`, $(date -u +%FT%TZ), commit \`$(git -C "$REPO" describe --always --dirty)\`; $rows conversions (loaded, indexed and vacuumed in $loaded_s s); single upserts at 200/s throughout. PostgreSQL $(sql -c 'SHOW server_version'), shared_buffers $(sql -c 'SHOW shared_buffers'); $(nproc) cores."
    echo
    echo "| migration | time s |"
    echo "|---|---|"
    sql -F ' | ' -c "SELECT '| ' || version || '_' || description, round(execution_time / 1e9, 2) || ' |'
                     FROM _sqlx_migrations WHERE version >= $first ORDER BY version"
    echo
    echo "\`migrate\` $(awk "BEGIN { printf \"%.1f\", $expanded - $migrate_started }") s, \`migrate --contract\` $(awk "BEGIN { printf \"%.1f\", $migrate_ended - $expanded }") s; all of them $(awk "BEGIN { printf \"%.1f\", $migrate_ended - $migrate_started }") s, WAL $(sql -c "SELECT pg_size_pretty('$lsn1'::pg_lsn - '$lsn0'::pg_lsn)"). Upserts at 200/s: p99 $before_p99 ms before; during the migrations p99 $p99 ms, longest $longest ms."
    echo
    if [ "$ha" = 1 ]; then
        echo "On the HA layout ($(sql -c 'SELECT count(*) FROM pg_stat_replication') standbys, through HAProxy). Each standby during the migrations, sampled every 200 ms:"
        echo
        echo "| standby | sync state | WAL not replayed, largest MB | replay lag, largest ms | replay lag, p99 ms |"
        echo "|---|---|---|---|---|"
        python3 - "$work/lag" "$migrate_started" "$migrate_ended" <<'EOF'
import collections, sys
path, start, end = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
rows = collections.defaultdict(list)
for line in open(path):
    f = line.split()
    if len(f) == 5 and start <= float(f[0]) <= end:
        rows[(f[1], f[2])].append((float(f[3]), float(f[4])))
for (name, state), samples in sorted(rows.items()):
    lags = sorted(lag for _, lag in samples)
    p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
    print(f"| {name} | {state} | {max(b for b, _ in samples) / 1e6:.1f} | {lags[-1]:.0f} | {p99:.0f} |")
EOF
        echo
    fi
    if [ -n "$longest_wait" ]; then
        read -r ms mode relation application <<<"$longest_wait"
        echo "Locks, sampled every 100 ms from \`pg_locks\`: the longest wait seen was $ms ms, for $mode on $relation by $application ($(wc -l <"$work/locks") waiting locks seen in all)."
    else
        echo "Locks, sampled every 100 ms from \`pg_locks\`: no session was seen waiting for one."
    fi
    echo
    echo "A row's own bytes (of a 1 % sample): $row_before before, $row_after after. The heap's bytes a conversion: $heap_before before, $heap_after after."
    echo
    echo "Index bytes per conversion, before:"
    echo
    echo '```'
    echo "$before"
    echo '```'
    echo
    echo "after:"
    echo
    echo '```'
    echo "$after"
    echo '```'
} >"$report"
cat "$report"
if [ "${waited_ms:-0}" -ge 5000 ]; then
    say "a lock was waited for $waited_ms ms: over the 5 s bound"
    exit 3
fi
