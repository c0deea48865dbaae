-- Statistics on the keys of 0038's and 0039's indexes, for the reason of 0013's: the planner
-- keeps none of a partial index's expression. ANALYZE reads a sample, taking no lock that
-- writes wait for.
CREATE STATISTICS conversions_email_digest ON (digest_key(email_digest)) FROM conversions;
CREATE STATISTICS conversions_phone_digest ON (digest_key(phone_digest)) FROM conversions;
ANALYZE conversions;
