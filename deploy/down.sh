#!/usr/bin/env bash
# Stops what up.sh started, with either PostgreSQL layout (one node, or up.sh --ha). Data stays
# in .intake/ (delete it for a clean slate).
source "$(dirname "$0")/lib.sh"

stop_process gateway
stop_process writer
stop_process kafka
if [ -f "$RUN/redis.pid" ]; then redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true; rm -f "$RUN/redis.pid"; fi
stop_ha
if [ -f "$INTAKE_HOME/pg/PG_VERSION" ]; then as_postgres "$(pg_bin pg_ctl)" -D "$INTAKE_HOME/pg" -m fast stop >/dev/null 2>&1 || true; fi
say "stopped"
