-- no-transaction
-- Served by the unique index of 0007, which leads with (workspace_id, external_id).
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_external_id;
