#!/usr/bin/env bash
# A planned switchover of the HA layout (deploy/up.sh --ha) to CANDIDATE, by default the
# synchronous standby: deploy/ha-switchover.sh [node-N]. Returns once the new primary takes
# writes on the primary's address and has its synchronous standby; prints {"from", "to",
# "writable_after_seconds", "sync_standby_after_seconds"}. Another layout's directory:
# INTAKE_HOME=DIR.
source "$(dirname "$0")/lib.sh"

[ -f "$INTAKE_HOME/ha/layout" ] || { say "no HA layout in $INTAKE_HOME/ha (start one with deploy/up.sh --ha)"; exit 1; }
ha_switchover "$INTAKE_HOME" "${1:-}"
