#!/usr/bin/env bash
# Restores the HA layout (deploy/up.sh --ha) to a point in time from pgBackRest's repository:
# deploy/ha-restore.sh "2026-05-04 10:30:00+00" [--accept-loss]. Stop the writers and gateways
# first; replay Kafka after (deploy/RUNBOOK.md, "The HA layout (deploy/up.sh --ha): restore to
# a point in time"). In order:
#   1. the replay's check: the requests topic still holds every message from a minute before
#      the point (else the restore would lose writes quietly; --accept-loss goes on anyway);
#   2. `intake-writer restore export`: what the restore undoes and no replay gives back
#      (workspaces, keys and revocations, erasures), saved in ha/restores/;
#   3. the restore itself (deploy/ha.sh ha_restore_cluster);
#   4. `intake-writer restore apply` of that export.
# Another layout's directory: INTAKE_HOME=DIR.
source "$(dirname "$0")/lib.sh"

usage() { echo 'usage: deploy/ha-restore.sh "YYYY-MM-DD HH:MM:SS+00" [--accept-loss]' >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
target="$1" accept_loss=
case "${2:-}" in "") ;; --accept-loss) accept_loss=--accept-loss ;; *) usage ;; esac
[ -f "$INTAKE_HOME/ha/layout" ] || { say "no HA layout in $INTAKE_HOME/ha"; exit 1; }
export DATABASE_URL="${DATABASE_URL:-$(database_url intake)}"
writer="$BIN/intake-writer"
[ -x "$writer" ] || { say "no $writer: build it first (deploy/up.sh builds it)"; exit 1; }
# With its zone: a time without one would be read as UTC here and in the server's time zone by
# the restore, which would then stop elsewhere than the replay begins.
[[ "$target" =~ (Z|[+-][0-9][0-9](:?[0-9][0-9])?)$ ]] || { say "give the time with its zone, e.g. \"2026-05-04 10:30:00+00\""; exit 2; }
target_s="$(date -u -d "$target" +%s)" || usage
replay_from="$(date -u -d "@$((target_s - 60))" +%Y-%m-%dT%H:%M:%SZ)"

mkdir -p "$INTAKE_HOME/ha/restores"
stamp="$(date -u +%Y%m%dT%H%M%SZ)"
say "checking that the requests topic still holds every write since $replay_from"
# Kept beside the export: with --accept-loss it names the gap (lost_to_retention) for the record.
"$writer" replay --from-time "$replay_from" --dry-run $accept_loss >"$INTAKE_HOME/ha/restores/check-$stamp.json" || {
    say "refused: a restore to $target would lose the writes the topic no longer holds (above);" \
        "restore to a later point, or run again with --accept-loss"
    exit 1
}
export_file="$INTAKE_HOME/ha/restores/export-$stamp.json"
say "saving what the restore undoes (workspaces, keys, erasures) to $export_file"
"$writer" restore export --to "$export_file" >/dev/null || {
    say "the export failed (above): the database must answer; deploy/RUNBOOK.md says what to do without it"
    exit 1
}
ha_restore_cluster "$INTAKE_HOME" "$target"
say "putting back what the restore undid"
"$writer" restore apply --from "$export_file"
say "now replay: $writer replay --from-time $replay_from $accept_loss --dry-run, then without --dry-run; then start the gateways and the writers"
