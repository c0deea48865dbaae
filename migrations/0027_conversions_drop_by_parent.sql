-- no-transaction
-- contract: applied by `intake-writer migrate --contract` only, once no writer of the version
-- before 0025 runs: their look-up of a chunk's children reads this index.
-- Served by 0025's index on (the workspace id's hash, parent external id).
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_parent;
