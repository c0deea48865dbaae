-- no-transaction
-- Erasure's look-up by phone digest, led by the month the row was created in (UTC): a new row's entry
-- goes among this month's entries, which stay cached however large the table grows, instead of
-- onto a random page of the whole index. Looked up month by month (writer/src/lookups.rs).
CREATE INDEX CONCURRENTLY conversions_by_month_phone_hash
    ON conversions ((date_trunc('month', created_at AT TIME ZONE 'UTC')), hashtextextended(phone_sha256, 0))
    WHERE phone_sha256 IS NOT NULL;
