-- no-transaction
-- The look-up by phone digest, as 0037's by email digest.
CREATE INDEX CONCURRENTLY conversions_by_month_phone_digest
    ON conversions (
        (date_trunc('month', created_at AT TIME ZONE 'UTC')),
        digest_key(coalesce(phone_digest, decode(phone_sha256, 'hex')))
    )
    WHERE coalesce(phone_digest, decode(phone_sha256, 'hex')) IS NOT NULL;
