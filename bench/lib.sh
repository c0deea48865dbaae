# The benchmark's own helpers (bench/*.sh), over deploy/lib.sh's settings and its starting of
# PostgreSQL, Redis and Kafka, which the quick start and the tests share.
# shellcheck shell=bash

source "$(dirname "${BASH_SOURCE[0]}")/../deploy/lib.sh"

# The database of a PostgreSQL-alone benchmark: the writer built (for its migrations), database
# $1 dropped and created again, DATABASE_URL pointing at it, and `sql` running psql on it (bare
# output, stopping at the first error).
bench_database() {
    BENCH_DATABASE="$1"
    (cd "$REPO" && cargo build --release -q -p intake-writer)
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS \"$1\" WITH (FORCE)" >/dev/null
    create_database "$1"
    export DATABASE_URL
    DATABASE_URL="$(database_url "$1")"
}
sql() { psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d "$BENCH_DATABASE" -qtAX -v ON_ERROR_STOP=1 "$@"; }

# A pgbench script of the PostgreSQL-alone benchmarks: a new single conversion in its own new
# chain, as single_200rps sends them, its email digest in COLUMN as VALUE (email_sha256 as hex
# text for the versions before 0036, email_digest as bytes since).
single_send_script() { # COLUMN VALUE
    cat <<SQL
\set g random(1, 1000000000)
BEGIN;
INSERT INTO chains (id, workspace_id)
VALUES ('chn_n' || lpad(to_hex(:g), 25, '0') || :client_id, 'ws_' || lpad((:g % 1000)::text, 26, '0'))
ON CONFLICT DO NOTHING;
INSERT INTO conversions (id, workspace_id, event, external_id, chain_id, occurred_at, visitor_id,
    $1, value, currency)
VALUES ('cnv_n' || lpad(to_hex(:g), 25, '0') || :client_id, 'ws_' || lpad((:g % 1000)::text, 26, '0'),
    'lead', 'new-' || :g || '-' || :client_id, 'chn_n' || lpad(to_hex(:g), 25, '0') || :client_id, now(),
    'v' || md5(:g::text), $2, 1, 'EUR')
ON CONFLICT DO NOTHING;
END;
SQL
}

# wrk_post_script FILE AUTHORIZATION BODY: a wrk script that POSTs BODY (JSON, without single
# quotes) with that Authorization header.
wrk_post_script() {
    cat >"$1" <<LUA
wrk.method = "POST"
wrk.headers["Authorization"] = "$2"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '$3'
LUA
}

# bench_key DATABASE WRITER: for a benchmark script's own gateways, database DATABASE (dropped
# and created again, migrated) and topics of its own, exported with the brokers and Redis as the
# programs' settings; one workspace, whose key (every scope) goes into BENCH_KEY.
bench_key() {
    local database="$1" writer="$2" prefix workspace
    psql -q -h 127.0.0.1 -p "$PG_PORT" -U postgres -c "DROP DATABASE IF EXISTS $database" -c "CREATE DATABASE $database"
    export DATABASE_URL="$(database_url "$database")"
    export INTAKE_KAFKA_BROKERS="127.0.0.1:$KAFKA_PORT" INTAKE_REDIS_URL="redis://127.0.0.1:$REDIS_PORT"
    prefix="$database$(date +%s)"
    export INTAKE_REQUESTS_TOPIC="$prefix.requests" INTAKE_REPLIES_TOPIC="$prefix.replies" INTAKE_DLQ_TOPIC="$prefix.dlq"
    "$writer" migrate --contract >/dev/null
    "$writer" topics >/dev/null
    workspace="$("$writer" workspace create --name Bench --site bench.example | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
    BENCH_KEY="$("$writer" key create --workspace "$workspace" --scopes workspace:read,conversions:write | python3 -c 'import json,sys; print(json.load(sys.stdin)["secret"])')"
}

# The load generator shares the cores it measures: the benchmarks build it, and the test library
# it drives the stack with, optimised, unlike the suite (Cargo.toml). loadgen_optimised TREE sets
# LOADGEN_OPTIMISED for the checkout TREE: one from before bench/ had a crate of its own
# (deploy/bench.sh --baseline builds such commits) has its load generator in the test crate.
loadgen_optimised() {
    local package
    LOADGEN_OPTIMISED=()
    for package in intake-tests intake-bench; do
        if [ "$package" = intake-tests ] || [ -f "$1/bench/Cargo.toml" ]; then
            LOADGEN_OPTIMISED+=(--config "profile.release.package.$package.opt-level=2")
        fi
    done
}
loadgen_optimised "$REPO"

# Loads database $1, migrated to a schema with the digests as hex (0035 or before), with $2
# conversions as a year of a busy service holds them: 1,000 workspaces (ids of their real 29
# characters); one conversion in three a purchase in the chain of the lead before it; ids in
# creation order, as ULIDs are; stored over the last year. The indexes are built after the rows
# (maintenance_work_mem 512MB); no vacuum. For the migration benchmark and the storage trials.
load_year_of_conversions() {
    local rows="$2" indexes name
    local sql=(psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d "$1" -qtAX -v ON_ERROR_STOP=1)
    indexes="$("${sql[@]}" -c "SELECT string_agg(indexdef, '; ') FROM pg_indexes WHERE tablename = 'conversions'
                       AND indexname NOT IN (SELECT conname FROM pg_constraint)")"
    for name in $("${sql[@]}" -c "SELECT indexname FROM pg_indexes WHERE tablename = 'conversions'
                          AND indexname NOT IN (SELECT conname FROM pg_constraint)"); do
        "${sql[@]}" -c "DROP INDEX $name"
    done
    "${sql[@]}" -c "INSERT INTO workspaces (id, name, project_id)
                SELECT 'ws_' || lpad(w::text, 26, '0'), 'w', 'p' FROM generate_series(0, 999) w" \
        -c "SET session_replication_role = replica" \
        -c "INSERT INTO chains (id, workspace_id)
                SELECT 'chn_' || lpad(to_hex(g), 26, '0'), 'ws_' || lpad((g % 1000)::text, 26, '0')
                FROM generate_series(1, $rows) g WHERE g % 3 <> 0" \
        -c "INSERT INTO conversions (id, workspace_id, event, external_id, parent_external_id, chain_id,
                occurred_at, visitor_id, click_id, contact_id, email_sha256, phone_sha256,
                address_sha256, country, value, currency, tags, created_at)
            SELECT 'cnv_' || lpad(to_hex(g), 26, '0'), 'ws_' || lpad((g % 1000)::text, 26, '0'),
                CASE WHEN g % 3 = 0 THEN 'purchase' ELSE 'lead' END, 'ext-' || g,
                CASE WHEN g % 3 = 0 THEN 'ext-' || (g - 1) END,
                'chn_' || lpad(to_hex(CASE WHEN g % 3 = 0 THEN g - 1 ELSE g END), 26, '0'),
                now() - make_interval(secs => ($rows - g) * 31536000.0 / $rows), 'v' || md5(g::text), 'c' || g,
                'ct' || g, encode(sha256(('e' || g)::bytea), 'hex'), encode(sha256(('p' || g)::bytea), 'hex'),
                encode(sha256(('a' || g)::bytea), 'hex'), 'DE', g % 1000, 'EUR', '[\"crm\"]',
                now() - make_interval(secs => ($rows - g) * 31536000.0 / $rows)
            FROM generate_series(1, $rows) g"
    "${sql[@]}" -c "SET maintenance_work_mem = '512MB'" -c "$indexes"
}
