#!/usr/bin/env bash
# Restores the HA layout (deploy/up.sh --ha) to a point in time from pgBackRest's repository:
# deploy/ha-restore.sh "2026-05-04 10:30:00+00". Stop the writers first; replay Kafka after
# (deploy/RUNBOOK.md, "The HA layout: restore to a point in time, then replay"). Another
# layout's directory: INTAKE_HOME=DIR.
source "$(dirname "$0")/lib.sh"

[ $# = 1 ] || { echo 'usage: deploy/ha-restore.sh "YYYY-MM-DD HH:MM:SS+00"' >&2; exit 2; }
[ -f "$INTAKE_HOME/ha/layout" ] || { say "no HA layout in $INTAKE_HOME/ha"; exit 1; }
ha_restore_cluster "$INTAKE_HOME" "$1"
