-- no-transaction
-- Served by conversions_by_phone_hash. Writers of the version before never read it; its erasure
-- command does, and would scan the workspace: erase with this version's (deploy/RUNBOOK.md).
DROP INDEX CONCURRENTLY IF EXISTS conversions_by_phone;
