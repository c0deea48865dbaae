-- no-transaction
-- As conversions_by_email_hash, for the phone digest.
CREATE INDEX CONCURRENTLY conversions_by_phone_hash ON conversions (hashtextextended(phone_sha256, 0))
    WHERE phone_sha256 IS NOT NULL;
