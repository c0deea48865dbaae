#!/bin/sh
# Patroni's callback on the local HA layout (deploy/ha/patroni.yml): DATA_DIR NICE, then
# Patroni's ACTION ROLE SCOPE. Sets a standby's replay (PostgreSQL's startup process) to NICE.
#
# The three nodes share one machine's cores. A commit waits for the synchronous standby's flush,
# which its WAL receiver does; the replay is not on that path, yet it wakes at every commit,
# side by side with the processes that are. At a lower priority it runs after them, in the cores'
# idle time. Only the replay: the startup process exists during recovery alone and ends at a
# promotion, so a promoted node runs at its full share, and the WAL receiver of any standby
# (the synchronous one may change) keeps its own. Production nodes have machines of their own
# and no such callback (deploy/systemd/patroni.yml.example).
set -u
data_dir=$1 nice=$2
postmaster=$(head -n 1 "$data_dir/postmaster.pid" 2>/dev/null) || exit 0
for pid in $(pgrep -P "$postmaster"); do
    case "$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" in
    *": startup "*) renice -n "$nice" -p "$pid" >/dev/null ;;
    esac
done
exit 0
