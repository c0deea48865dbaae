#!/usr/bin/env bash
# pgBackRest against the HA layout's repository (deploy/up.sh --ha), as the repository's owner,
# for the stanza "intake", for example:
#   deploy/pgbackrest.sh info                 backups and the WAL archive's range
#   deploy/pgbackrest.sh backup --type=incr   (full, diff or incr) from the primary
#   deploy/pgbackrest.sh check                the primary's WAL reaches the repository
# A restore runs where the data goes: deploy/RUNBOOK.md, "The HA layout: restore to a point in
# time". Another layout's directory: INTAKE_HOME=DIR.
source "$(dirname "$0")/lib.sh"

[ -f "$INTAKE_HOME/ha/conf/pgbackrest-repo.conf" ] || { say "no HA layout with backups in $INTAKE_HOME/ha"; exit 1; }
HA="$INTAKE_HOME/ha" ha_pgbackrest_repo "$@"
