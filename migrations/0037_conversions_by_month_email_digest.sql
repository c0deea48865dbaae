-- no-transaction
-- Erasure's and matching's look-up by email digest, as 0028's but on the digest's bytes (0036),
-- the hex of the rows written before read as bytes: led by the month of creation, then the
-- digest's first 8 bytes. Built concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid
-- index and migrate again.
CREATE INDEX CONCURRENTLY conversions_by_month_email_digest
    ON conversions (
        (date_trunc('month', created_at AT TIME ZONE 'UTC')),
        digest_key(coalesce(email_digest, decode(email_sha256, 'hex')))
    )
    WHERE coalesce(email_digest, decode(email_sha256, 'hex')) IS NOT NULL;
