-- no-transaction
-- The look-up by phone digest, as 0038's by email digest.
CREATE INDEX CONCURRENTLY conversions_by_month_phone_digest
    ON conversions ((date_trunc('month', created_at AT TIME ZONE 'UTC')), digest_key(phone_digest))
    WHERE phone_digest IS NOT NULL;
