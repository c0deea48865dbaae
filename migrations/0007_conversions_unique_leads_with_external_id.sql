-- no-transaction
-- The unique key of a conversion, (workspace, external_id, event), built beside the one it
-- replaces: led by external_id, it also answers the look-ups by (workspace, external_id) that
-- conversions_by_external_id served, which then goes. ON CONFLICT (workspace_id, event,
-- external_id) infers either index (the same columns), so writers of either version upsert
-- through it. Built concurrently: writes go on meanwhile. If this fails, it leaves an invalid
-- index of this name: DROP INDEX CONCURRENTLY it and migrate again (deploy/RUNBOOK.md).
CREATE UNIQUE INDEX CONCURRENTLY conversions_by_workspace_external_id_event
    ON conversions (workspace_id, external_id, event);
