-- no-transaction
-- The look-up of a chunk's children (rows whose parent is one of the chunk's items) on 8 bytes:
-- a hash of the parent's external id seeded with the workspace id's, as the contacts' (0020),
-- instead of (workspace id, parent external id), about 30 and 10 to 40 bytes. Rows found are
-- checked against the parent external id and the workspace in the row. The index on (workspace
-- id, parent external id) stays for the previous version's writers until `intake-writer migrate
-- --contract` (0028). Built concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid
-- index and migrate again.
CREATE INDEX CONCURRENTLY conversions_by_parent_hash
    ON conversions (hashtextextended(parent_external_id, hashtextextended(workspace_id, 0)))
    WHERE parent_external_id IS NOT NULL;
