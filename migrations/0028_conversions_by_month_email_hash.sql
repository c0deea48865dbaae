-- no-transaction
-- Erasure's look-up by email digest, led by the month the row was created in (UTC): a new row's entry
-- goes among this month's entries, which stay cached however large the table grows, instead of
-- onto a random page of the whole index. Looked up month by month (writer/src/lookups.rs).
CREATE INDEX CONCURRENTLY conversions_by_month_email_hash
    ON conversions ((date_trunc('month', created_at AT TIME ZONE 'UTC')), hashtextextended(email_sha256, 0))
    WHERE email_sha256 IS NOT NULL;
