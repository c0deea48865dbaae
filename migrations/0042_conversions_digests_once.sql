-- contract: applied by `intake-writer migrate --contract` only, once no binary of the version
-- before 0036 runs: it reads and writes the digests as hex.
-- Drops the trigger that wrote each digest twice (0036): from here on a new row carries its
-- digests as bytes alone, and the hex columns hold only what rows written before 0036 had.
-- Also the statistics of 0013 on the hex, which no look-up reads any more. A SHARE ROW
-- EXCLUSIVE lock for a moment, waited for at most 3 s.
SET LOCAL lock_timeout = '3s';
DROP TRIGGER conversions_digests_in_step ON conversions;
DROP FUNCTION conversions_digests_in_step();
DROP STATISTICS IF EXISTS conversions_email_hash, conversions_phone_hash;
