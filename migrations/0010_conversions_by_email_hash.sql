-- no-transaction
-- Erasure's look-up by email hash on 8 bytes, a hash of the 64-character hex digest, instead of
-- (workspace id, digest): a third of the index. Matches are checked against the digest and the
-- workspace in the row. Built concurrently; if this fails, DROP INDEX CONCURRENTLY the invalid
-- index and migrate again.
CREATE INDEX CONCURRENTLY conversions_by_email_hash ON conversions (hashtextextended(email_sha256, 0))
    WHERE email_sha256 IS NOT NULL;
