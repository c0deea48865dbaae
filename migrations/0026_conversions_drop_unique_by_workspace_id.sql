-- no-transaction
-- contract: applied by `intake-writer migrate --contract` only, once no writer of the version
-- before 0024 runs: their ON CONFLICT names this key, and their inserts fail without it.
-- Served by 0024's key on the workspace id's hash.
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_workspace_external_id_event;
