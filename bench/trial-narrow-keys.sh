#!/usr/bin/env bash
# A trial of a design not built: what giving the rows already stored narrow internal keys would
# cost, by copying `chains` and `conversions` into tables of the narrow shape (a 4-byte workspace
# key, the ULIDs' 128 bits as `uuid`, digests as bytes, fixed-width columns first) in committed
# batches, then building their indexes concurrently: the copy-and-swap way of pg_repack, whose
# swap (a rename under a brief lock) and whose trigger for the writes during the copy are not
# part of the trial. Single upserts at 200/s go to the current tables throughout.
#
#   bench/trial-narrow-keys.sh                  10 M rows (about 8 minutes)
#   ROWS=1000000 BATCH=50000 bench/trial-narrow-keys.sh
#
# Prints the copy's and the index builds' time and WAL, the upserts' p99 during each, and bytes
# per conversion of both shapes; also into bench/narrow-keys.md. Uses the database
# intake_trial_narrow_keys, dropped at the end.
source "$(dirname "$0")/lib.sh"
set -eo pipefail
rows="${ROWS:-10000000}"
batch="${BATCH:-100000}"
db=intake_trial_narrow_keys
start_postgres
writer="$CARGO_TARGET_DIR/release/intake-writer"
bench_database "$db"
work="$(mktemp -d)"
"$writer" migrate --contract --through 35 >/dev/null
say "loading $rows"
load_year_of_conversions "$db" "$rows"
# PostgreSQL alone: no writer, no Kafka to ask for one.
"$writer" migrate --contract --skip-writer-check >/dev/null
sql -c "VACUUM (FREEZE, ANALYZE) conversions" -c "VACUUM (FREEZE, ANALYZE) chains" -c "CHECKPOINT"

single_send_script email_digest "sha256(('n' || :g)::bytea)" >"$work/insert.sql"
"$(pg_bin pgbench)" -h 127.0.0.1 -p "$PG_PORT" -U postgres -n -c 2 -j 1 -R 200 -T 100000 \
    --log --log-prefix="$work/tx" -f "$work/insert.sql" "$db" >"$work/pgbench.txt" 2>&1 &
bench=$!
sleep 5
t() { date +%s.%N; }
lsn() { sql -c "SELECT pg_current_wal_lsn()"; }
lsn0="$(lsn)"; t0="$(t)"
# Narrow keys: a 4-byte workspace key, the ids' 128 bits as uuid (md5 of the text stands in for
# decoding the ULID: same width), digests as bytes; fixed-width columns first.
sql -c "ALTER TABLE workspaces ADD COLUMN key int4" \
    -c "UPDATE workspaces w SET key = n.k FROM (SELECT id, row_number() OVER (ORDER BY id) AS k FROM workspaces) n WHERE n.id = w.id" \
    -c "CREATE UNIQUE INDEX ON workspaces (key)" \
    -c "CREATE TABLE conversions_n (key uuid NOT NULL, chain_key uuid NOT NULL, occurred_at timestamptz NOT NULL,
            created_at timestamptz NOT NULL, updated_at timestamptz NOT NULL, workspace_key int4 NOT NULL,
            event text NOT NULL, external_id text NOT NULL, parent_external_id text, visitor_id text,
            click_id text, contact_id text, email_digest bytea, phone_digest bytea, address_digest bytea,
            country text, value numeric, currency text, hdyhau text, tags jsonb) WITH (fillfactor = 90)" \
    -c "CREATE TABLE chains_n (key uuid NOT NULL, created_at timestamptz NOT NULL, merged_at timestamptz,
            merged_into uuid, workspace_key int4 NOT NULL)"
copy() { # TABLE SELECT-LIST FROM
    local last='' n=0 started; started="$(t)"
    while :; do
        last="$(sql -c "WITH b AS (SELECT * FROM $1 WHERE id > '$last' ORDER BY id LIMIT $batch),
                             i AS (INSERT INTO ${1}_n SELECT $2 FROM b JOIN workspaces w ON w.id = b.workspace_id)
                        SELECT max(id) FROM b")"
        [ -n "$last" ] || break
        n=$((n + 1))
    done
    echo "$1: $n batches in $(awk "BEGIN { printf \"%.1f\", $(t) - $started }") s" | tee -a "$work/result"
}
copy chains "md5(b.id)::uuid, b.created_at, b.merged_at, md5(b.merged_into)::uuid, w.key"
copy conversions "md5(b.id)::uuid, md5(b.chain_id)::uuid, b.occurred_at, b.created_at, b.updated_at, w.key,
    b.event, b.external_id, b.parent_external_id, b.visitor_id, b.click_id, b.contact_id,
    coalesce(b.email_digest, decode(b.email_sha256, 'hex')), coalesce(b.phone_digest, decode(b.phone_sha256, 'hex')),
    coalesce(b.address_digest, decode(b.address_sha256, 'hex')), b.country, b.value, b.currency, b.hdyhau, b.tags"
lsn1="$(lsn)"; t1="$(t)"
idx() {
    local s; s="$(t)"
    sql -c "$1"
    echo "$(awk "BEGIN { printf \"%.1f\", $(t) - $s }") s: $1" | tee -a "$work/result"
}
idx "CREATE UNIQUE INDEX CONCURRENTLY chains_n_pkey ON chains_n (key)"
idx "CREATE UNIQUE INDEX CONCURRENTLY conversions_n_pkey ON conversions_n (key)"
idx "CREATE INDEX CONCURRENTLY conversions_n_by_chain ON conversions_n (chain_key)"
idx "CREATE UNIQUE INDEX CONCURRENTLY conversions_n_unique ON conversions_n (workspace_key, external_id, event)"
idx "CREATE INDEX CONCURRENTLY conversions_n_parent ON conversions_n (workspace_key, parent_external_id) WHERE parent_external_id IS NOT NULL"
idx "CREATE INDEX CONCURRENTLY conversions_n_email ON conversions_n (date_trunc('month', created_at AT TIME ZONE 'UTC'), digest_key(email_digest)) WHERE email_digest IS NOT NULL"
idx "CREATE INDEX CONCURRENTLY conversions_n_phone ON conversions_n (date_trunc('month', created_at AT TIME ZONE 'UTC'), digest_key(phone_digest)) WHERE phone_digest IS NOT NULL"
idx "CREATE INDEX CONCURRENTLY conversions_n_visitor ON conversions_n (date_trunc('month', created_at AT TIME ZONE 'UTC'), hashtextextended(left(visitor_id, 16), 0)) WHERE visitor_id IS NOT NULL"
idx "CREATE INDEX CONCURRENTLY conversions_n_contact ON conversions_n (date_trunc('month', created_at AT TIME ZONE 'UTC'), hashtextextended(contact_id, workspace_key)) WHERE contact_id IS NOT NULL"
lsn2="$(lsn)"; t2="$(t)"
kill "$bench"; wait "$bench" 2>/dev/null || true
p99() { cat "$work"/tx* | awk -v from="$1" -v to="$2" '{ t = $5 + $6 / 1e6 } t >= from && t <= to { print $3 }' \
        | sort -n | awk '{ v[NR] = $1 } END { printf "p99 %.2f ms, max %.2f ms, n %d", v[int(NR * 0.99) + 1] / 1000, v[NR] / 1000, NR }'; }
{
    echo "rows $rows, batch $batch"
    echo "copy: $(awk "BEGIN { printf \"%.1f\", $t1 - $t0 }") s, WAL $(sql -c "SELECT pg_size_pretty('$lsn1'::pg_lsn - '$lsn0'::pg_lsn)"); upserts $(p99 "$t0" "$t1")"
    echo "indexes: $(awk "BEGIN { printf \"%.1f\", $t2 - $t1 }") s, WAL $(sql -c "SELECT pg_size_pretty('$lsn2'::pg_lsn - '$lsn1'::pg_lsn)"); upserts $(p99 "$t1" "$t2")"
    echo "upserts before: $(p99 0 "$t0")"
    sql -c "SELECT c.relname, round(pg_relation_size(c.oid)::numeric / (SELECT count(*) FROM conversions), 1),
                   round(coalesce((SELECT sum(pg_relation_size(indexrelid)) FROM pg_index WHERE indrelid = c.oid), 0)::numeric
                         / (SELECT count(*) FROM conversions), 1)
              FROM pg_class c WHERE relname IN ('conversions', 'conversions_n', 'chains', 'chains_n') ORDER BY 1"
    sql -c "SELECT indexrelid::regclass, round(pg_relation_size(indexrelid)::numeric / (SELECT count(*) FROM conversions), 1)
              FROM pg_index WHERE indrelid IN ('conversions'::regclass, 'conversions_n'::regclass) ORDER BY 1"
    sql -c "SELECT 'row bytes', (SELECT round(avg(pg_column_size(c.*)), 1) FROM conversions c TABLESAMPLE SYSTEM (1)),
                   (SELECT round(avg(pg_column_size(c.*)), 1) FROM conversions_n c TABLESAMPLE SYSTEM (1))"
} | tee -a "$work/result"
mkdir -p "$REPO/bench"
{ echo "# Narrow keys for the stored rows: a copy into the narrow shape"; echo
  echo "\`bench/trial-narrow-keys.sh\`, $(date -u +%FT%TZ), commit \`$(git -C "$REPO" rev-parse --short HEAD)\`; $(nproc) cores."
  echo; echo '```'; cat "$work/result"; echo '```'; } >"$REPO/bench/narrow-keys.md"
psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -qc "DROP DATABASE IF EXISTS $db WITH (FORCE)" >/dev/null
rm -rf "$work"
