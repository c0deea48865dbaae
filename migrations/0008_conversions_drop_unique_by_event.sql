-- The unique constraint on (workspace, event, external_id): the index of 0007 holds the same
-- rule. Dropping it takes the table's exclusive lock for a moment; waiting for it would queue
-- every write behind the wait, so the wait is bounded: past it the migration fails and is run
-- again.
SET LOCAL lock_timeout = '3s';
ALTER TABLE conversions DROP CONSTRAINT conversions_workspace_id_event_external_id_key;
