-- no-transaction
-- The unique key (workspace, external id, event) on the workspace id's 8-byte hash instead of
-- its 30 bytes (0023 keeps the hash unique among workspaces): the largest index that inserts
-- reach at random pages, and the one that shrinks most. Writers of this version name it in their
-- ON CONFLICT; the previous version's name the key on the id, which stays until `intake-writer
-- migrate --contract` (0026) once no writer of that version runs (deploy/RUNBOOK.md, "Schema
-- migrations"). Built concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid index and
-- migrate again.
CREATE UNIQUE INDEX CONCURRENTLY conversions_by_workspace_hash_external_id_event
    ON conversions (hashtextextended(workspace_id, 0), external_id, event);
