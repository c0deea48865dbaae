-- no-transaction
-- Erasure's look-up by contact id, led by the month the row was created in (UTC): a new row's entry
-- goes among this month's entries, which stay cached however large the table grows, instead of
-- onto a random page of the whole index. Looked up month by month (writer/src/lookups.rs).
CREATE INDEX CONCURRENTLY conversions_by_month_contact_hash
    ON conversions ((date_trunc('month', created_at AT TIME ZONE 'UTC')), hashtextextended(contact_id, hashtextextended(workspace_id, 0)))
    WHERE contact_id IS NOT NULL;
