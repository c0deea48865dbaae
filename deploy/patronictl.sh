#!/usr/bin/env bash
# Patroni's patronictl against the HA layout (deploy/up.sh --ha), for example:
#   deploy/patronictl.sh list                 members, roles (Leader, Sync Standby), lag, timeline
#   deploy/patronictl.sh switchover --leader node-1 --candidate node-2 --force
#   deploy/patronictl.sh reinit intake node-3 --force     copy a member again from the leader
#   deploy/patronictl.sh history              timelines: every promotion
# The cluster (scope) is "intake". Another layout's directory: INTAKE_HOME=DIR.
source "$(dirname "$0")/lib.sh"

config="$INTAKE_HOME/ha/conf/patronictl.yml"
[ -f "$config" ] || { say "no HA layout in $INTAKE_HOME/ha (start one with deploy/up.sh --ha)"; exit 1; }
exec patronictl -c "$config" "$@"
