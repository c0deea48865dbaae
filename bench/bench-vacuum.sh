#!/usr/bin/env bash
# The storage settings of `conversions` (fillfactor, autovacuum), measured on PostgreSQL alone:
# for each fillfactor asked for, a copy of the table (every index of it, as the migrations left
# it) loaded with N rows, vacuumed and frozen as a year's table stands; then updates of stored
# rows (a re-sent conversion whose value changed, the columns the writer's upsert sets, none of
# them indexed ones), then a VACUUM of what those updates left, while single-row upserts arrive
# at 200 a second. Prints, per fillfactor: updates/s and their p50/p99, the share of HOT
# updates (no index entry written), WAL and index bytes per update, the vacuum's time and
# index scans, and the p99 of the 200/s upserts without and during that vacuum.
# Then autovacuum as it runs in service, for PostgreSQL's defaults and for the settings of the
# migrations (fillfactor 90, the vacuum at 1 % of dead and 2 % of inserted rows): a copy loaded
# as above, autovacuum on, and for INTAKE_VACUUM_AUTO_SECONDS re-sends at 1,000 updates a second
# and new conversions at 2,000 a second (a batch sender's), while single upserts arrive at 200
# a second; prints how often autovacuum ran on the table, for how long, its index passes, and
# the single upserts' p99 and longest, all of them and those that ended while it ran.
#
#   bench/bench-vacuum.sh                       1 M rows, fillfactor 100 and 90, 30 s of updates;
#                                               autovacuum 240 s a setting
#   INTAKE_VACUUM_ROWS=10000000 INTAKE_VACUUM_FILLFACTORS=100,90,80 INTAKE_VACUUM_SECONDS=60 bench/bench-vacuum.sh
#   INTAKE_VACUUM_AUTO="" bench/bench-vacuum.sh    without the autovacuum runs
#
# Needs PostgreSQL (started if it is not running) and the writer binary for the migrations.
# Uses the database intake_bench_vacuum (dropped and created again). Writes bench/vacuum.md.
source "$(dirname "$0")/lib.sh"

rows="${INTAKE_VACUUM_ROWS:-1000000}"
auto_settings="${INTAKE_VACUUM_AUTO-defaults,migrations}"
auto_seconds="${INTAKE_VACUUM_AUTO_SECONDS:-240}"
seconds="${INTAKE_VACUUM_SECONDS:-30}"
fillfactors="${INTAKE_VACUUM_FILLFACTORS:-100,90}"
db=intake_bench_vacuum
install_packages
start_postgres
bench_database "$db"
"$CARGO_TARGET_DIR/release/intake-writer" migrate --contract >/dev/null
pgbench_bin="$(pg_bin pgbench)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# p50 and p99 in ms of pgbench transaction logs (third field: the latency in µs, counted from
# the scheduled start under --rate; fifth and sixth: when it ended), of the transactions that
# ended between FROM and TO (epoch seconds; 0 and 0 for all).
percentiles() {
    local from="$1" to="$2"
    shift 2
    cat "$@" | awk -v from="$from" -v to="$to" '{ t = $5 + $6 / 1e6 } to == 0 || (t >= from && t <= to) { print $3 }' \
        | quantiles
}
# p50, p99 and the largest in ms of latencies in µs on standard input, the last when $1 is "max".
quantiles() {
    sort -n | awk -v max="${1:-}" '{ v[NR] = $1 } END {
        if (NR == 0) { print (max ? "- - -" : "- -"); exit }
        printf "%.2f %.2f", v[int(NR * 0.5) + 1] / 1000, v[int(NR * 0.99) + 1] / 1000
        if (max) printf " %.2f", v[NR] / 1000
        printf "\n" }'
}
calc() { awk "BEGIN { printf \"%.${2:-0}f\", $1 }"; }

# The rows of a year: 1,000 workspaces, one conversion in three a purchase whose parent is the
# lead before it, every identifier present, ids in creation order.
load() {
    local table="$1" ff="$2"
    sql -c "DROP TABLE IF EXISTS $table" \
        -c "CREATE TABLE $table (LIKE conversions INCLUDING ALL) WITH (fillfactor = $ff, autovacuum_enabled = false)" \
        -c "INSERT INTO $table (id, workspace_id, event, external_id, parent_external_id, chain_id,
                occurred_at, visitor_id, click_id, contact_id, email_digest, phone_digest,
                address_digest, country, value, currency, tags)
            SELECT 'cnv_' || lpad(to_hex(g), 26, '0'), 'ws_' || lpad((g % 1000)::text, 26, '0'),
                CASE WHEN g % 3 = 0 THEN 'purchase' ELSE 'lead' END, 'ext-' || g,
                CASE WHEN g % 3 = 0 THEN 'ext-' || (g - 1) END, 'chn_' || lpad(to_hex(g / 3), 26, '0'),
                now() - make_interval(secs => $rows - g), 'v' || md5(g::text), 'c' || g, 'ct' || g,
                sha256(('e' || g)::bytea), sha256(('p' || g)::bytea), sha256(('a' || g)::bytea),
                'DE', g % 1000, 'EUR', '[\"crm\"]'
            FROM generate_series(1, $rows) g" \
        -c "VACUUM (FREEZE, ANALYZE) $table" -c "CHECKPOINT"
}

# A re-sent conversion with a new value: the columns the writer's upsert sets on a conflict,
# each indexed one to the value it has; the row found by the unique key, as the upsert finds
# it. Rows drawn from the whole table, so that most are updated once (a deal's value set when
# it closes): the first update of a row is the one that needs room on its page; later ones find
# the room its earlier versions leave when pruned.
stored_row="hashtextextended(workspace_id, 0) = hashtextextended('ws_' || lpad((:g % 1000)::text, 26, '0'), 0)
    AND workspace_id = 'ws_' || lpad((:g % 1000)::text, 26, '0') AND external_id = 'ext-' || :g
    AND event = CASE WHEN :g % 3 = 0 THEN 'purchase' ELSE 'lead' END"
cat >"$work/update.sql" <<SQL
\set g random(1, $rows)
UPDATE :table SET value = value + 1, tags = tags, chain_id = chain_id, visitor_id = visitor_id,
    contact_id = contact_id, email_digest = email_digest, phone_digest = phone_digest,
    parent_external_id = parent_external_id, updated_at = now()
WHERE $stored_row;
SQL
# A new single conversion, as single_200rps sends them.
cat >"$work/insert.sql" <<SQL
\set g random(1, 1000000000)
INSERT INTO :table (id, workspace_id, event, external_id, chain_id, occurred_at, visitor_id,
    email_digest, value, currency)
VALUES ('cnv_n' || lpad(to_hex(:g), 25, '0') || :client_id, 'ws_' || lpad((:g % 1000)::text, 26, '0'),
    'lead', 'new-' || :g || '-' || :client_id, 'chn_n' || lpad(to_hex(:g), 25, '0'), now(),
    'v' || md5(:g::text), sha256(('n' || :g)::bytea), 1, 'EUR')
ON CONFLICT DO NOTHING;
SQL

run_pgbench() { # NAME TABLE ARGS...: runs pgbench with a transaction log under $work/NAME
    local name="$1" table="$2"
    shift 2
    mkdir -p "$work/$name"
    (cd "$work/$name" && "$pgbench_bin" -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -D table="$table" \
        --log --log-prefix=tx "$@" "$db" >"$work/$name/out.txt" 2>&1)
}

mkdir -p "$REPO/bench"
report="$REPO/bench/vacuum.md"
{
    echo "# fillfactor and vacuum of conversions"
    echo
    echo "\`bench/bench-vacuum.sh\`, $(date -u +%FT%TZ), commit \`$(git -C "$REPO" describe --always --dirty)\`; $rows rows; $seconds s of updates by 4 clients; single upserts at 200/s, 20 s without the vacuum, then those that ended during it. PostgreSQL $(sql -c 'SHOW server_version'), shared_buffers $(sql -c 'SHOW shared_buffers'); $(nproc) cores."
    echo
    echo "| fillfactor | heap MiB loaded | index MiB loaded | updates/s | update p50 / p99 ms | HOT updates | WAL bytes an update | index bytes an update | vacuum s | index scans | upserts 200/s p99 ms: before / during vacuum |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|"
} >"$report"
for ff in ${fillfactors//,/ }; do
    table="conv_ff$ff"
    say "fillfactor $ff: loading $rows rows"
    load "$table" "$ff"
    heap0="$(sql -c "SELECT pg_relation_size('$table')")"
    index0="$(sql -c "SELECT pg_indexes_size('$table')")"
    lsn0="$(sql -c "SELECT pg_current_wal_lsn()")"
    read -r upd0 hot0 <<<"$(sql -F ' ' -c "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = '$table'")"
    say "fillfactor $ff: $seconds s of updates"
    run_pgbench "update-$ff" "$table" -c 4 -j 2 -T "$seconds" -f "$work/update.sql"
    sql -c "SELECT pg_stat_force_next_flush()" >/dev/null
    read -r upd1 hot1 <<<"$(sql -F ' ' -c "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = '$table'")"
    wal="$(sql -c "SELECT pg_current_wal_lsn() - '$lsn0'::pg_lsn")"
    index1="$(sql -c "SELECT pg_indexes_size('$table')")"
    updates=$((upd1 - upd0))
    read -r up50 up99 <<<"$(percentiles 0 0 "$work/update-$ff"/tx*)"
    say "fillfactor $ff: single upserts at 200/s, then again during a VACUUM"
    run_pgbench "before-$ff" "$table" -c 2 -j 1 -R 200 -T 20 -f "$work/insert.sql"
    run_pgbench "during-$ff" "$table" -c 2 -j 1 -R 200 -T 60 -f "$work/insert.sql" &
    bench=$!
    sleep 1 # the upserts under way first: what is measured is a vacuum among them
    started="$(date +%s.%N)"
    sql -c "VACUUM (VERBOSE) $table" 2>"$work/vacuum-$ff.txt"
    ended="$(date +%s.%N)"
    wait "$bench"
    scans="$(grep -o 'index scans: [0-9]*' "$work/vacuum-$ff.txt" | head -1 | awk '{print $3}')"
    read -r _ before99 <<<"$(percentiles 0 0 "$work/before-$ff"/tx*)"
    read -r _ during99 <<<"$(percentiles "$started" "$ended" "$work/during-$ff"/tx*)"
    echo "| $ff | $(calc "$heap0 / 1048576") | $(calc "$index0 / 1048576") | $(calc "$updates / $seconds") |" \
        "$up50 / $up99 | $(calc "100 * ($hot1 - $hot0) / $updates" 1) % | $(calc "$wal / $updates") |" \
        "$(calc "($index1 - $index0) / $updates") | $(calc "$ended - $started" 1) | ${scans:-?} |" \
        "$before99 / $during99 |" >>"$report"
    sql -c "DROP TABLE $table"
done

# Autovacuum in service: the same load, for each setting, with PostgreSQL's own naptime. A
# sampler records, every half second, whether a vacuum of the table runs (its worker's pid:
# a run) and its index passes.
cat >"$work/resend.sql" <<SQL
\set g random(1, $rows)
UPDATE :table SET value = value + 1, updated_at = now()
WHERE $stored_row;
SQL
sample_vacuum() { # TABLE FILE: "epoch pid index_vacuum_count" while a vacuum of TABLE runs
    while :; do
        sql -F ' ' -c "SELECT extract(epoch FROM clock_timestamp()), pid, index_vacuum_count
                         FROM pg_stat_progress_vacuum WHERE relid = '$1'::regclass" >>"$2" 2>/dev/null || true
        sleep 0.5
    done
}
if [ -n "$auto_settings" ]; then
    {
        echo
        echo "## Autovacuum in service"
        echo
        echo "$rows rows loaded and frozen; for $auto_seconds s, re-sends (an update of a stored row's value) at 1,000 a second and new conversions at 2,000 a second, single upserts at 200 a second measured; autovacuum on, PostgreSQL's naptime ($(sql -c 'SHOW autovacuum_naptime')). \"while it ran\": the single upserts that ended while a vacuum of the table ran (sampled every 0.5 s)."
        echo
        echo "| setting | autovacuum runs | seconds vacuuming | index passes | HOT updates | single upserts p50 / p99 / max ms | while it ran: n, p99 / max ms |"
        echo "|---|---|---|---|---|---|---|"
    } >>"$report"
fi
for setting in ${auto_settings//,/ }; do
    table="conv_auto_$setting"
    case "$setting" in
        defaults) ff=100; options="autovacuum_enabled = true" ;;
        migrations) ff=90; options="autovacuum_enabled = true, autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_insert_scale_factor = 0.02" ;;
        *) say "unknown autovacuum setting $setting (defaults, migrations)"; exit 2 ;;
    esac
    say "autovacuum, $setting: loading $rows rows"
    load "$table" "$ff"
    sql -c "ALTER TABLE $table SET ($options)"
    read -r upd0 hot0 av0 <<<"$(sql -F ' ' -c "SELECT n_tup_upd, n_tup_hot_upd, autovacuum_count FROM pg_stat_user_tables WHERE relname = '$table'")"
    : >"$work/vacuum-$setting.txt"
    sample_vacuum "$table" "$work/vacuum-$setting.txt" &
    sampler=$!
    say "autovacuum, $setting: $auto_seconds s of re-sends, new conversions and single upserts"
    run_pgbench "auto-resend-$setting" "$table" -c 2 -j 1 -R 1000 -T "$auto_seconds" -f "$work/resend.sql" &
    resend=$!
    run_pgbench "auto-new-$setting" "$table" -c 2 -j 1 -R 2000 -T "$auto_seconds" -f "$work/insert.sql" &
    new=$!
    run_pgbench "auto-single-$setting" "$table" -c 2 -j 1 -R 200 -T "$auto_seconds" -f "$work/insert.sql"
    wait "$resend"
    wait "$new"
    kill "$sampler" 2>/dev/null || true
    wait "$sampler" 2>/dev/null || true
    sql -c "SELECT pg_stat_force_next_flush()" >/dev/null
    read -r upd1 hot1 av1 <<<"$(sql -F ' ' -c "SELECT n_tup_upd, n_tup_hot_upd, autovacuum_count FROM pg_stat_user_tables WHERE relname = '$table'")"
    # Per run (a worker's pid): its first and last sample, and its index passes at the last.
    read -r vacuum_s passes <<<"$(awk '!($2 in first) { first[$2] = $1 } { last[$2] = $1; passes[$2] = $3 }
        END { for (p in first) { s += last[p] - first[p] + 0.5; n += passes[p] } printf "%.1f %d\n", s, n }' \
        "$work/vacuum-$setting.txt")"
    read -r p50 p99 max <<<"$(cat "$work/auto-single-$setting"/tx* | awk '{ print $3 }' | quantiles max)"
    # Single upserts that ended within a quarter second of a sample of a running vacuum (the
    # samples half a second apart: the stretch each one stands for).
    during="$(awk 'NR == FNR { at[NR] = $1; n = NR; next }
        { t = $5 + $6 / 1e6; for (i = 1; i <= n; i++) if (t >= at[i] - 0.25 && t <= at[i] + 0.25) { print $3; break } }' \
        "$work/vacuum-$setting.txt" "$work/auto-single-$setting"/tx*)"
    count="$(printf '%s' "$during" | grep -c . || true)"
    read -r _ d99 dmax <<<"$(printf '%s\n' "$during" | grep . | quantiles max)"
    echo "| $setting (fillfactor $ff) | $((av1 - av0)) | $vacuum_s | $passes |" \
        "$(calc "100 * ($hot1 - $hot0) / ($upd1 - $upd0 + 1)" 1) % | $p50 / $p99 / $max | $count, $d99 / $dmax |" >>"$report"
    sql -c "DROP TABLE $table"
done
cat "$report"
