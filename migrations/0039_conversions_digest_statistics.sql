-- Statistics on the keys of 0037's and 0038's indexes, for the reason of 0013's: the planner
-- keeps none of a partial index's expression. ANALYZE reads a sample, taking no lock that
-- writes wait for.
CREATE STATISTICS conversions_email_digest
    ON (digest_key(coalesce(email_digest, decode(email_sha256, 'hex')))) FROM conversions;
CREATE STATISTICS conversions_phone_digest
    ON (digest_key(coalesce(phone_digest, decode(phone_sha256, 'hex')))) FROM conversions;
ANALYZE conversions;
