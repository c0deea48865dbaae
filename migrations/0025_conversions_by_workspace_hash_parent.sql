-- no-transaction
-- The look-up of a chunk's children (rows whose parent is one of the chunk's items) on the
-- workspace id's 8-byte hash, as the unique key (0024), instead of its 30 bytes. Not on a hash
-- of the parent's external id: a hash scatters new entries over the whole index, where a key
-- that leads with the workspace keeps a workspace's recent parents on a few pages (measured under
-- a memory budget, deploy/RUNBOOK.md, "Schema migrations"). The index on (workspace id, parent
-- external id) stays for the previous version's writers until `intake-writer migrate
-- --contract` (0027). Built concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid
-- index and migrate again.
CREATE INDEX CONCURRENTLY conversions_by_workspace_hash_parent
    ON conversions (hashtextextended(workspace_id, 0), parent_external_id)
    WHERE parent_external_id IS NOT NULL;
