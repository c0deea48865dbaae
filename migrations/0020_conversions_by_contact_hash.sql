-- no-transaction
-- Erasure's look-up by contact id on 8 bytes: a hash of the contact id seeded with the
-- workspace id's, instead of (workspace id, contact id), two text keys of about 30 and 10
-- characters. Seeded by the workspace because contact ids are the CRM's own (often small
-- numbers) and repeat across workspaces; an unseeded hash would gather every workspace's "1042"
-- under one key. Matches are checked against the contact id and the workspace in the row.
-- Built concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid index and migrate again.
CREATE INDEX CONCURRENTLY conversions_by_contact_hash
    ON conversions (hashtextextended(contact_id, hashtextextended(workspace_id, 0)))
    WHERE contact_id IS NOT NULL;
