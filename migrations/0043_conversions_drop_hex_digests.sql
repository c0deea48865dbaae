-- contract: applied by `intake-writer migrate --contract` only, once no binary of the version
-- before 0036 runs: it reads and writes the digests as hex text.
-- Drops the text digests that 0036's bytes replace, and the trigger that kept both in step. The
-- rows keep the dropped columns' bytes until they are next written (PostgreSQL drops a column
-- from the catalog, not from the pages); `VACUUM FULL` or pg_repack would reclaim them at once,
-- and is not needed. An ACCESS EXCLUSIVE lock for a moment, waited for at most 3 s.
SET LOCAL lock_timeout = '3s';
DROP TRIGGER conversions_digests_in_step ON conversions;
DROP FUNCTION conversions_digests_in_step();
DROP STATISTICS IF EXISTS conversions_email_hash, conversions_phone_hash;
ALTER TABLE conversions
    DROP COLUMN email_sha256,
    DROP COLUMN phone_sha256,
    DROP COLUMN address_sha256;
